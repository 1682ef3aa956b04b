"""A Flower deployment on this machine's loopback: one ``flower-superlink`` and one ``flower-supernode`` per
organisation, each a separate OS process (insecure mode: for tests and benchmarks, never across machines).

The commands are exactly those of a real federation (flwr 1.41)::

    flower-superlink --insecure --port P --database STATE.db --disable-runtime-dependency-installation
    flower-supernode --insecure --superlink 127.0.0.1:P --port Q_k \\
        --node-config "partition-id=k data-path='...' ledger-path='...'"
    flwr run APP_DIR CONNECTION --stream     # CONNECTION in $FLWR_HOME/config.toml: address 127.0.0.1:P, insecure

and, for Flower's Simulation Engine (virtual SuperNodes on Ray, ``simulation=True``), no SuperNode processes::

    flower-superlink --insecure --simulation --port P --database STATE.db --disable-runtime-dependency-installation
    flwr run APP_DIR CONNECTION --stream --federation-config "num-supernodes=N client-resources-num-cpus=1"

With ``warm=True`` each SuperNode is started with ``--isolation process`` (it spawns no SuperExec and no ClientApp
process) and gets one warm worker (:mod:`privfl.flower.warm`), a long-lived process that serves every ClientApp task
of its SuperNode on the SuperNode's runtime API::

    flower-supernode --insecure --superlink 127.0.0.1:P --port Q_k --isolation process --node-config "..."
    python -m privfl.flower.warm --runtime-api-address 127.0.0.1:Q_k --insecure --parent-pid SUPERNODE_PID

With ``supernode_poll=SECONDS`` each SuperNode runs under privfl's launcher (:mod:`privfl.flower.supernode`), which
is Flower's ``flower-supernode`` with its fixed idle waits (3 s between empty pulls from the SuperLink, 0.5 s between
looks for a reply) capped at ``SECONDS`` and its first retry of a message object not yet at the SuperLink after
0.05 s instead of 1 s (the launcher's ``--object-backoff``); its command line is the same, with the launcher's
options in front::

    privfl-flower-supernode --poll-interval 0.05 --require-patch --insecure --superlink 127.0.0.1:P --port Q_k ...

and ``superexec_poll=SECONDS`` sets Flower's own ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` (default 1 s: how often the
SuperLink's SuperExec looks for a ServerApp to start, once per run) for every process of the deployment.

Every process is started in its own session and :meth:`LocalDeployment.close` ends each process group it started
(SIGTERM, then SIGKILL), so no SuperExec, ClientApp or worker process outlives the deployment.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

CONNECTION = "privfl-local"


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free a moment ago (all held open together while they are chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_port(port: int, timeout: float, proc: subprocess.Popen, log: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}; see {log}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:g} s; see {log}")


class LocalDeployment:
    """A SuperLink and ``len(node_configs)`` SuperNodes under ``workdir`` (logs, state database, FLWR_HOME);
    ``env``: variables added to this process's environment for every process of the deployment; ``warm``: the
    SuperNodes run with ``--isolation process`` and one warm ClientApp worker each (``workers[k]``, its log
    ``worker{k}.log``), instead of Flower's default of one fresh ClientApp process per message;
    ``worker_poll_interval``: seconds between a warm worker's claims while its SuperNode has no task;
    ``supernode_poll``: None (default) runs Flower's ``flower-supernode`` as it is, a number of seconds runs each
    SuperNode under ``privfl-flower-supernode --poll-interval SECONDS --require-patch`` (Flower's SuperNode with its
    fixed waits shortened, :mod:`privfl.flower.supernode`; a flwr it cannot patch fails the SuperNode's start),
    with ``supernode_options`` (more of the launcher's options, e.g. ``("--log-timestamps",)``) after it;
    ``superexec_poll``: Flower's ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` for the deployment (None: Flower's 1 s);
    ``superlink_database``: the SuperLink's ``--database`` (None: ``superlink-state.db`` in ``workdir``; Flower's
    ``":flwr-in-memory:"`` keeps its state and message objects in Python, not in SQLite)."""

    def __init__(self, workdir: str, node_configs: list[dict], *, bin_dir: str | None = None,
                 start_timeout: float = 60.0, simulation: bool = False, env: dict[str, str] | None = None,
                 warm: bool = False, worker_poll_interval: float = 0.2, supernode_poll: float | None = None,
                 supernode_options: tuple[str, ...] = (), superexec_poll: float | None = None,
                 superlink_database: str | None = None):
        self.workdir = os.path.abspath(workdir)
        self.bin_dir = bin_dir or os.path.dirname(sys.executable)
        self.home = os.path.join(self.workdir, "flwr-home")
        os.makedirs(self.home, exist_ok=True)
        self.env = dict(os.environ, **(env or {}), FLWR_HOME=self.home,
                        PATH=self.bin_dir + os.pathsep + os.environ.get("PATH", ""))
        if superexec_poll is not None:
            self.env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = f"{superexec_poll:g}"
        self.node_configs = node_configs
        self.start_timeout = start_timeout
        self.simulation = simulation  # the SuperLink runs the Simulation Engine (Ray); node_configs must be empty
        if simulation and node_configs:
            raise ValueError("a simulation SuperLink runs virtual SuperNodes: pass node_configs=[]")
        self.warm = warm
        if warm and simulation:
            raise ValueError("warm workers serve SuperNodes; a simulation SuperLink has none")
        self.worker_poll_interval = worker_poll_interval
        if supernode_poll is None and supernode_options:
            raise ValueError("supernode_options are privfl-flower-supernode's: give supernode_poll too")
        self.supernode_poll = supernode_poll
        self.supernode_options = tuple(supernode_options)
        self.superlink_database = superlink_database or os.path.join(self.workdir, "superlink-state.db")
        self.procs: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen | None] = []  # warm mode: the worker of SuperNode k
        self.port = 0
        self._node_args: list[list[str]] = []  # each SuperNode's command line, to restart it as it was
        self._node_ports: list[int] = []

    def _start(self, name: str, args: list[str], mode: str = "wb", keep: bool = True) -> subprocess.Popen:
        log = open(os.path.join(self.workdir, f"{name}.log"), mode)
        try:
            proc = subprocess.Popen([os.path.join(self.bin_dir, args[0]), *args[1:]], stdout=log,
                                    stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir, start_new_session=True,
                                    preexec_fn=_die_with_parent)
        finally:
            log.close()
        if keep:
            self.procs.append(proc)
        return proc

    def _start_worker(self, k: int, node: subprocess.Popen, mode: str = "wb") -> subprocess.Popen:
        """SuperNode ``k``'s warm worker (it ends by itself if the SuperNode ends: ``--parent-pid``)."""
        python = "python" if os.path.exists(os.path.join(self.bin_dir, "python")) else sys.executable
        proc = self._start(f"worker{k}", [python, "-m", "privfl.flower.warm", "--runtime-api-address",
                                          f"127.0.0.1:{self._node_ports[k]}", "--insecure", "--parent-pid",
                                          str(node.pid), "--poll-interval", str(self.worker_poll_interval)],
                           mode=mode, keep=False)
        if k < len(self.workers):
            self.workers[k] = proc
        else:
            self.workers.append(proc)
        return proc

    def _supernode_command(self) -> list[str]:
        """Flower's ``flower-supernode``, or privfl's launcher of it with the launcher's options (then Flower's)."""
        if self.supernode_poll is None:
            return ["flower-supernode"]
        options = ["--poll-interval", f"{self.supernode_poll:g}", "--require-patch", *self.supernode_options]
        if os.path.exists(os.path.join(self.bin_dir, "privfl-flower-supernode")):
            return ["privfl-flower-supernode", *options]
        # privfl not (re)installed in this environment: the launcher's module runs the same
        python = "python" if os.path.exists(os.path.join(self.bin_dir, "python")) else sys.executable
        return [python, "-m", "privfl.flower.supernode", *options]

    def start(self) -> "LocalDeployment":
        self.port, *node_ports = free_ports(1 + len(self.node_configs))
        with open(os.path.join(self.home, "config.toml"), "w") as f:
            f.write(f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
                    f'address = "127.0.0.1:{self.port}"\ninsecure = true\n')
        link = self._start("superlink", ["flower-superlink", "--insecure", "--port", str(self.port), "--database",
                                         self.superlink_database,
                                         "--disable-runtime-dependency-installation",
                                         *(["--simulation"] if self.simulation else [])])
        _wait_port(self.port, self.start_timeout, link, os.path.join(self.workdir, "superlink.log"))
        for k, config in enumerate(self.node_configs):
            items = " ".join(f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"
                             for key, value in config.items())
            args = [*self._supernode_command(), "--insecure", "--superlink", f"127.0.0.1:{self.port}",
                    "--port", str(node_ports[k]), *(["--isolation", "process"] if self.warm else []),
                    "--node-config", items]
            self._node_args.append(args)
            self._node_ports.append(node_ports[k])
            node = self._start(f"supernode{k}", args)
            if self.warm:
                self._start_worker(k, node)
        return self

    def wait_workers(self, timeout: float = 120.0) -> None:
        """Warm mode: return once every worker has started serving (its imports done), else raise RuntimeError."""
        deadline = time.monotonic() + timeout
        for k, proc in enumerate(self.workers):
            log = os.path.join(self.workdir, f"worker{k}.log")
            while True:
                with open(log, errors="replace") as f:
                    if f"pid={proc.pid}] INFO serving" in f.read():
                        break
                if proc.poll() is not None:
                    raise RuntimeError(f"the warm worker of SuperNode {k} exited with {proc.returncode}; see {log}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the warm worker of SuperNode {k} is not serving after {timeout:g} s; "
                                       f"see {log}")
                time.sleep(0.2)

    def run(self, app_dir: str, *, timeout: float, federation_config: str | None = None,
            run_config: str | None = None) -> subprocess.CompletedProcess:
        """``flwr run APP_DIR CONNECTION --stream``, bounded by ``timeout`` seconds (the stream ends with the run);
        ``federation_config``: the Simulation Engine's settings, e.g. ``"num-supernodes=3"``; ``run_config``: Flower's
        ``--run-config`` overrides, e.g. ``"rounds=1 run-id='short'"`` (``privfl.flower.app.OVERRIDE_KEYS``)."""
        extra = ["--federation-config", federation_config] if federation_config else []
        extra += ["--run-config", run_config] if run_config else []
        with open(os.path.join(self.workdir, "flwr-run.log"), "ab") as log:
            proc = subprocess.Popen([os.path.join(self.bin_dir, "flwr"), "run", app_dir, CONNECTION, "--stream",
                                     *extra],
                                    stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir,
                                    start_new_session=True)
            self.procs.append(proc)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _stop(proc)
                raise
        return subprocess.CompletedProcess(proc.args, proc.returncode)

    def kill_node(self, k: int) -> None:
        """Stop SuperNode ``k`` (and, in warm mode, its worker, with any ClientApp task it was running)."""
        if self.warm and self.workers[k] is not None:
            _stop(self.workers[k])
        _stop(self.procs[1 + k])

    def restart_node(self, k: int) -> subprocess.Popen:
        """Start SuperNode ``k`` again (after :meth:`kill_node`, or stopping it first) with its command line and node
        config as they were: the same data and ledger paths, so its ledger carries on from the rows it holds. Its log
        goes on in ``supernode{k}.log``. The SuperLink registers it as a new node. In warm mode its worker is
        restarted with it (log ``worker{k}.log``, appended)."""
        self.kill_node(k)
        proc = self._start(f"supernode{k}", self._node_args[k], mode="ab")
        self.procs.pop()  # keep procs[1 + k] the SuperNode of organisation k
        self.procs[1 + k] = proc
        if self.warm:
            self._start_worker(k, proc, mode="ab")
        return proc

    def close(self) -> None:
        for proc in self.workers:
            if proc is not None:
                _stop(proc)
        for proc in reversed(self.procs):
            _stop(proc)

    def __enter__(self) -> "LocalDeployment":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _die_with_parent() -> None:
    """In the child, before it runs: ask Linux to send it SIGTERM when the process that started it ends, however it
    ends (SIGTERM, SIGINT, SIGKILL, a crash), so a deployment never outlives the test or benchmark that started it.
    Elsewhere a no-op (``close()`` and the context manager still stop everything on a normal exit)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def _stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """End the process group ``proc`` leads (it was started in a new session): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
            if sig == signal.SIGTERM:
                # the leader is gone; make sure no child of its group (SuperExec, ClientApp) is left behind
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
        except subprocess.TimeoutExpired:
            continue


__all__ = ["CONNECTION", "LocalDeployment", "free_ports"]
