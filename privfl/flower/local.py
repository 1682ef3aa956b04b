"""A Flower deployment on this machine's loopback: one ``flower-superlink`` and one ``flower-supernode`` per
organisation, each a separate OS process (insecure mode by default: for tests and benchmarks, never across
machines; ``tls=True`` and ``auth=True`` run it as a real federation runs, below).

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

By default each SuperNode is Flower's ``flower-supernode`` as it is; ``supernode_command=(PROGRAM, OPTIONS...)``
starts it as ``PROGRAM OPTIONS...`` followed by ``flower-supernode``'s options instead (privfl's own tests use
``experiments/fast_supernode.py``, a test tool, not installed, that shortens Flower's fixed idle waits),
and ``superexec_poll=SECONDS`` sets Flower's own ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` (default 1 s: how often the
SuperLink's SuperExec looks for a ServerApp to start, once per run) for every process of the deployment.

With ``tls=True`` the SuperLink serves its Fleet, Control and Runtime APIs (one port in flwr 1.41) over TLS with a
certificate for 127.0.0.1, ::1 and localhost signed by a CA generated for the deployment (:func:`make_credentials`,
in ``workdir/credentials`` unless ``credentials=`` gives one); every client verifies it with that CA::

    flower-superlink --ssl-ca-certfile CA.crt --ssl-certfile SERVER.pem --ssl-keyfile SERVER.key --port P ...
    flower-supernode --root-certificates CA.crt --superlink 127.0.0.1:P --port Q_k --node-config "..."
    flwr run APP_DIR CONNECTION --stream     # config.toml: address, root-certificates = "CA.crt", insecure = false

and with ``auth=True`` too, Flower's SuperNode authentication: the SuperLink accepts only SuperNodes whose public key
the coordinator registered through its Control API before they start (a SuperNode can no longer register itself),
and each SuperNode signs every request with its private key (EC, NIST P-384, OpenSSH format)::

    flower-superlink --ssl-ca-certfile CA.crt --ssl-certfile SERVER.pem --ssl-keyfile SERVER.key \
        --enable-supernode-auth --port P --database STATE.db --disable-runtime-dependency-installation
    flwr supernode register supernode{k}.key.pub CONNECTION --format json --name partition-{k}   # -> node id
    flower-supernode --root-certificates CA.crt --auth-supernode-private-key supernode{k}.key \
        --superlink 127.0.0.1:P --port Q_k --node-config "..."

(``node_ids[k]``: the node id the SuperLink gave organisation k's key; :meth:`LocalDeployment.restart_node` starts it
again with the same key, so under the same node id). The link between a SuperNode and its own ClientApp process or
warm worker stays plain HTTP on loopback (the SuperNode's runtime API, ``--insecure`` for the warm worker).

Every process is started in its own session and :meth:`LocalDeployment.close` ends each process group it started
(SIGTERM, then SIGKILL), so no SuperExec, ClientApp or worker process outlives the deployment.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time

CONNECTION = "privfl-local"

#: file names in a credentials folder (:func:`make_credentials`)
CA_CERT, SERVER_CERT, SERVER_KEY = "ca.crt", "server.pem", "server.key"
#: the addresses a loopback SuperLink's certificate is valid for (its subject alternative names)
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


@dataclasses.dataclass(frozen=True)
class Credentials:
    """The files of a TLS and SuperNode-authentication setup (:func:`make_credentials`), absolute paths:
    ``ca_cert`` the CA certificate every client verifies the SuperLink with (``--root-certificates``,
    ``root-certificates`` in config.toml), ``server_cert`` and ``server_key`` the SuperLink's certificate and key
    (``--ssl-certfile``, ``--ssl-keyfile``), ``node_keys[k]`` organisation ``k``'s SuperNode private key (OpenSSH
    format, NIST P-384; ``--auth-supernode-private-key``) and ``node_public_keys[k]`` its public half (OpenSSH
    format; ``flwr supernode register``)."""

    folder: str
    ca_cert: str
    server_cert: str
    server_key: str
    node_keys: tuple[str, ...] = ()
    node_public_keys: tuple[str, ...] = ()


def _write_private(path: str, data: bytes) -> None:
    """Write a private key readable by its owner only (mode 0600), never over an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_supernode_key(path: str) -> str:
    """Draw a SuperNode authentication key (EC, NIST P-384, as Flower's ``flwr supernode register`` requires a NIST
    curve), write its private half to ``path`` (OpenSSH format, mode 0600, never overwritten) and its public half to
    ``path + ".pub"`` (OpenSSH format); return the public key's path."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    _write_private(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
    public = path + ".pub"
    with open(public, "wb") as f:
        f.write(key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
                + b"\n")
    return public


def write_ca(folder: str, common_name: str = "privfl local CA", days: int = 2):
    """A fresh self-signed CA in ``folder``: its certificate ``ca.crt`` (returned with the CA's private key, which
    is kept in memory, never written)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    path = os.path.join(folder, CA_CERT)
    with open(path, "xb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return path, cert, key


def make_credentials(folder: str, n_nodes: int, *, hosts: tuple[str, ...] = LOOPBACK_HOSTS,
                     days: int = 2) -> Credentials:
    """Generate, in ``folder`` (created; files already there are never overwritten), a fresh CA, a SuperLink
    certificate signed by it for ``hosts`` (IP addresses and DNS names, its subject alternative names; by default
    this machine's loopback) valid for ``days``, and ``n_nodes`` SuperNode authentication keys
    (:func:`write_supernode_key`: ``supernode{k}.key`` and ``supernode{k}.key.pub``). Nothing is downloaded; the
    CA's private key is never written (no further certificate can be issued from it)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = os.path.abspath(folder)
    os.makedirs(folder, exist_ok=True)
    ca_path, ca, ca_key = write_ca(folder, days=days)
    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    server_cert, server_key = os.path.join(folder, SERVER_CERT), os.path.join(folder, SERVER_KEY)
    with open(server_cert, "xb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(server_key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
    node_keys = [os.path.join(folder, f"supernode{k}.key") for k in range(n_nodes)]
    publics = [write_supernode_key(path) for path in node_keys]
    return Credentials(folder, ca_path, server_cert, server_key, tuple(node_keys), tuple(publics))


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
    ``supernode_command``: the program (and its options) that starts each SuperNode with ``flower-supernode``'s
    command line after it (default: Flower's ``flower-supernode``; the module docstring);
    ``superexec_poll``: Flower's ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` for the deployment (None: Flower's 1 s);
    ``superlink_database``: the SuperLink's ``--database`` (None: ``superlink-state.db`` in ``workdir``; Flower's
    ``":flwr-in-memory:"`` keeps its state and message objects in Python, not in SQLite); ``tls``: the SuperLink
    serves TLS and every client verifies it with the deployment's CA; ``auth`` (needs ``tls``): Flower's SuperNode
    authentication, each organisation's key registered before its SuperNode starts (``node_ids``);
    ``credentials``: the CA, certificate and keys to use (:func:`make_credentials`; None: fresh ones in
    ``workdir/credentials``)."""

    def __init__(self, workdir: str, node_configs: list[dict], *, bin_dir: str | None = None,
                 start_timeout: float = 60.0, simulation: bool = False, env: dict[str, str] | None = None,
                 warm: bool = False, worker_poll_interval: float = 0.2,
                 supernode_command: tuple[str, ...] = ("flower-supernode",), superexec_poll: float | None = None,
                 superlink_database: str | None = None, tls: bool = False, auth: bool = False,
                 credentials: Credentials | None = None):
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
        if not supernode_command or not all(isinstance(a, str) and a for a in supernode_command):
            raise ValueError("supernode_command is a program and its options, as strings")
        self.supernode_command = tuple(supernode_command)
        self.superlink_database = superlink_database or os.path.join(self.workdir, "superlink-state.db")
        if auth and not tls:
            raise ValueError("Flower's SuperNode authentication needs TLS: give tls=True too")
        if auth and simulation:
            raise ValueError("a simulation SuperLink has no SuperNodes to authenticate")
        if credentials is not None and not tls:
            raise ValueError("credentials are for a TLS deployment: give tls=True")
        if auth and credentials is not None and len(credentials.node_keys) < len(node_configs):
            raise ValueError(f"credentials hold {len(credentials.node_keys)} SuperNode keys for "
                             f"{len(node_configs)} SuperNodes")
        self.tls, self.auth = tls, auth
        self.credentials = credentials
        self.node_ids: list[int] = []  # auth: organisation k's node id, as `flwr supernode register` returned it
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

    @property
    def address(self) -> str:
        """The SuperLink's address (Fleet, Control and Runtime APIs: one port in flwr 1.41)."""
        return f"127.0.0.1:{self.port}"

    def superlink_tls_args(self) -> list[str]:
        """The SuperLink's transport flags: ``--insecure``, or its certificate, key and CA, and
        ``--enable-supernode-auth`` with ``auth``."""
        if not self.tls:
            return ["--insecure"]
        c = self.credentials
        return ["--ssl-ca-certfile", c.ca_cert, "--ssl-certfile", c.server_cert, "--ssl-keyfile", c.server_key,
                *(["--enable-supernode-auth"] if self.auth else [])]

    def supernode_tls_args(self, k: int) -> list[str]:
        """SuperNode ``k``'s flags for its link to the SuperLink: ``--insecure``, or the CA it verifies the SuperLink
        with and, with ``auth``, its private key."""
        if not self.tls:
            return ["--insecure"]
        return ["--root-certificates", self.credentials.ca_cert,
                *(["--auth-supernode-private-key", self.credentials.node_keys[k]] if self.auth else [])]

    def flwr(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Flower's CLI (``flwr ARGS``) as the coordinator runs it: this deployment's FLWR_HOME (its config.toml
        names the connection ``privfl-local``), output captured as text, bounded by ``timeout`` seconds."""
        return subprocess.run([os.path.join(self.bin_dir, "flwr"), *args], capture_output=True, text=True,
                              env=self.env, cwd=self.workdir, timeout=timeout)

    def register_supernode(self, public_key: str, name: str | None = None) -> int:
        """``flwr supernode register PUBLIC_KEY privfl-local --format json`` (with ``--name NAME``): authorise a
        SuperNode's public key (OpenSSH format) at the SuperLink; returns the node id the SuperLink assigned to it.
        Raises RuntimeError with Flower's output if the SuperLink refuses."""
        proc = self.flwr("supernode", "register", public_key, CONNECTION, "--format", "json",
                         *(["--name", name] if name else []))
        try:
            return int(json.loads(proc.stdout[proc.stdout.index("{"):])["node-id"])
        except (ValueError, KeyError):
            raise RuntimeError(f"flwr supernode register {public_key} failed ({proc.returncode}):\n"
                               f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}") from None

    def list_supernodes(self) -> list[dict]:
        """``flwr supernode list privfl-local --format json``: the SuperNodes the SuperLink knows (node id, owner,
        status ``registered`` / ``online`` / ``offline``, ...)."""
        proc = self.flwr("supernode", "list", CONNECTION, "--format", "json")
        try:
            return json.loads(proc.stdout[proc.stdout.index("{"):])["nodes"]
        except (ValueError, KeyError):
            raise RuntimeError(f"flwr supernode list failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                               f"{proc.stderr[-2000:]}") from None

    def start_process(self, name: str, args: list[str]) -> subprocess.Popen:
        """Start one more process of this deployment (e.g. a SuperNode a test plays the adversary with), in its own
        session with its log ``NAME.log`` in ``workdir``; :meth:`close` stops it with the others."""
        return self._start(name, args)

    def stop_process(self, proc: subprocess.Popen) -> None:
        """End the process group ``proc`` leads (SIGTERM, then SIGKILL), e.g. one :meth:`start_process` started."""
        _stop(proc)

    def start(self) -> "LocalDeployment":
        self.port, *node_ports = free_ports(1 + len(self.node_configs))
        if self.tls and self.credentials is None:
            self.credentials = make_credentials(os.path.join(self.workdir, "credentials"),
                                                len(self.node_configs) if self.auth else 0)
        # TOML basic strings share JSON's escapes, so json.dumps of a path is a valid TOML string
        transport = (f"root-certificates = {json.dumps(self.credentials.ca_cert)}\ninsecure = false\n" if self.tls
                     else "insecure = true\n")
        with open(os.path.join(self.home, "config.toml"), "w") as f:
            f.write(f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
                    f'address = "{self.address}"\n{transport}')
        link = self._start("superlink", ["flower-superlink", *self.superlink_tls_args(), "--port", str(self.port),
                                         "--database", self.superlink_database,
                                         "--disable-runtime-dependency-installation",
                                         *(["--simulation"] if self.simulation else [])])
        _wait_port(self.port, self.start_timeout, link, os.path.join(self.workdir, "superlink.log"))
        if self.auth:  # only the registered keys' SuperNodes may connect (Flower's Control API, from this machine)
            self.node_ids = [self.register_supernode(self.credentials.node_public_keys[k],
                                                     name=f"partition-{config.get('partition-id', k)}")
                             for k, config in enumerate(self.node_configs)]
        for k, config in enumerate(self.node_configs):
            items = " ".join(f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"
                             for key, value in config.items())
            args = [*self.supernode_command, *self.supernode_tls_args(k), "--superlink", self.address,
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
        goes on in ``supernode{k}.log``. The SuperLink registers it as a new node (with ``auth``, it comes back under
        its key's node id, ``node_ids[k]``). In warm mode its worker is restarted with it (log ``worker{k}.log``,
        appended)."""
        self.kill_node(k)
        proc = self._start(f"supernode{k}", self._node_args[k], mode="ab")
        self.procs.pop()  # keep procs[1 + k] the SuperNode of organisation k
        self.procs[1 + k] = proc
        if self.warm:
            self._start_worker(k, proc, mode="ab")
        return proc

    def close(self) -> None:
        # every process but the SuperLink at once (each SuperNode says goodbye to the SuperLink as it ends, so they
        # end together in about the time one takes), then the SuperLink
        _stop_all([proc for proc in self.workers if proc is not None] + list(reversed(self.procs[1:])))
        _stop_all(self.procs[:1])

    def __enter__(self) -> "LocalDeployment":
        try:
            return self.start()
        except BaseException:  # __exit__ is not called when __enter__ raises: stop what was started
            self.close()
            raise

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
    _stop_all([proc], grace)


def _stop_all(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    """End the process groups ``procs`` lead, together: SIGTERM to each, up to ``grace`` seconds for all of them to
    end, SIGKILL to any left; then SIGKILL to each group, so that no child of a group whose leader has ended
    (SuperExec, ClientApp) is left behind."""

    def signal_group(proc, sig):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    for proc in procs:
        signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        signal_group(proc, signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


__all__ = ["CONNECTION", "Credentials", "LocalDeployment", "free_ports", "make_credentials", "write_ca",
           "write_supernode_key"]
