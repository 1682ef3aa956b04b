"""A federation on Flower's Simulation Engine, launched from this machine: what ``privfl run --runtime flower-sim``
runs instead of the in-process :class:`privfl.runtime.engine.Simulation`.

The same run (algorithm, data, :class:`FederationConfig`, :class:`PrivacyConfig`, algorithm options, secure
aggregation) is written out as a Flower app (:func:`privfl.flower.app.write_app` of a
:class:`privfl.flower.app.RunSpec`) and run by a local SuperLink in simulation mode
(:class:`privfl.flower.local.LocalDeployment` with ``simulation=True``): the server half in the engine's ServerApp,
each client half in a ClientApp on a virtual SuperNode (a Ray worker process, never this process). The virtual
SuperNodes know only their partition id, so each client's data and ledger live at paths made from it, under
``out_dir``:

- ``data/client<k>.npz``: client k's training data (arrays ``x``, ``y``); ``data/test.npz``: the test set the
  ServerApp evaluates each round; ``data/alignment.npz``: a public alignment set (FedBNN), inputs only;
- ``<ledger_dir>/client<k>.sqlite``: client k's OWN privacy ledger (default ``ledger_dir``: ``out_dir/ledgers``). Each
  client charges only its own ledger and refuses to release past its budget there, as an organisation would;
  ``privfl audit <ledger_dir>`` composes the folder's ledgers into one report (:func:`merged_audit`);
- ``app/``: the Flower app; ``engine/``: the SuperLink's state and logs (``flwr-run.log``, ``superlink.log``);
  ``result.bin``: what the ServerApp published (the final server state, each round's participants and metrics).

:func:`run_simulation_engine` waits for the run and returns a :class:`SimulationEngineRun` whose ``result`` is the
in-process runtime's :class:`privfl.runtime.engine.RunResult` (per-round metrics from the ServerApp's evaluation, per-round
epsilon from the clients' ledgers), so a front end writes the same outputs for both runtimes.

Reproducibility: seeds are the run plan's streams on both runtimes, so with seeded noise and ``executor="per_client"``
in process the final model is the same bit for bit (tests/flower/test_runtime_contract.py; give every process
``MKL_CBWR=COMPATIBLE`` through ``env`` for bit-exact float32 sums across processes).

flwr and Ray are needed (``pip install 'privfl[flower]'``); this module imports them only when a run starts.
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from privfl.errors import ConfigurationError

#: the install hint every "Flower is missing" message gives
INSTALL_HINT = "pip install 'privfl[flower]'"
#: client k's ledger file in a ledger folder
LEDGER_FILE = "client{k}.sqlite"
_LEDGER_PATTERN = re.compile(r"^client(\d+)\.sqlite$")


def require_flower() -> None:
    """Refuse, before anything runs, a machine without Flower's Simulation Engine (flwr, Ray and the
    ``flower-superlink`` and ``flwr`` commands next to this Python)."""
    missing = [name for name in ("flwr", "ray") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigurationError(f"--runtime flower-sim needs Flower's Simulation Engine ({' and '.join(missing)} "
                                 f"{'is' if len(missing) == 1 else 'are'} not installed): {INSTALL_HINT}, or run "
                                 f"with --runtime inprocess")
    bin_dir = os.path.dirname(sys.executable)
    absent = [cmd for cmd in ("flwr", "flower-superlink", "flower-superexec")
              if not os.path.exists(os.path.join(bin_dir, cmd))]
    if absent:
        raise ConfigurationError(f"--runtime flower-sim runs Flower's commands from {bin_dir}, which lacks "
                                 f"{', '.join(absent)}: {INSTALL_HINT} into this Python's environment")


def require_runs_on_flower(algorithm: str) -> None:
    """Refuse an algorithm whose halves cannot be apart on Flower (:func:`privfl.flower.app.runs_on_flower`)."""
    from privfl.algorithms import ALGORITHMS
    from privfl.flower.app import runs_on_flower

    if not runs_on_flower(algorithm):
        able = sorted(a for a in ALGORITHMS if runs_on_flower(a))
        raise ConfigurationError(f"{algorithm} does not run on Flower yet (its client step cannot be apart from its "
                                 f"server step); --runtime flower-sim runs {', '.join(able) or 'none'}: use "
                                 f"--runtime inprocess for {algorithm}")


def require_one_phase(algorithm) -> None:
    """Refuse a multi-phase run (FedBNR with kernel rounds): its phases are charged as ledger runs of their own
    (``<run id>-<phase>``), which this launcher does not read back yet."""
    from privfl.algorithms.base import is_phased

    if is_phased(algorithm):
        raise ConfigurationError(f"{algorithm.name} with phases ({', '.join(n for n, _ in algorithm.phase_plan)}) "
                                 "does not run through --runtime flower-sim yet: use --runtime inprocess, or run it "
                                 "in one phase (fedbnr: --kernel-rounds 0)")


def ledger_paths(ledger_dir: str, n_clients: int) -> list[str]:
    """Client k's ledger file in ``ledger_dir``, for k = 0..n_clients-1."""
    return [os.path.join(ledger_dir, LEDGER_FILE.format(k=k)) for k in range(n_clients)]


def client_ledgers(folder: str) -> list[str]:
    """The per-client ledger files (``client<k>.sqlite``) a Flower run wrote in ``folder``, in client order."""
    found = [(int(m.group(1)), path) for path in glob.glob(os.path.join(folder, "client*.sqlite"))
             if (m := _LEDGER_PATTERN.match(os.path.basename(path)))]
    return [path for _, path in sorted(found)]


def _open_all(paths, run_id: str):
    from privfl.accounting.ledger import PrivacyLedger

    ledgers = []
    try:
        for path in paths:
            if os.path.isfile(path) and run_id in PrivacyLedger.run_ids(path):
                ledgers.append(PrivacyLedger.open_existing(path, run_id))
    except BaseException:
        for ledger in ledgers:
            ledger.close()
        raise
    return ledgers


def merged_audit(paths, run_id: str, delta: float | None = None) -> dict:
    """One audit (``PrivacyLedger.audit``'s form) of a run whose clients each kept their own ledger: every client of
    every ledger among ``paths`` that holds ``run_id``; ``max_epsilon`` over all of them."""
    ledgers = _open_all(paths, run_id)
    if not ledgers:
        raise ConfigurationError(f"none of {len(list(paths))} ledger files holds run {run_id!r}")
    try:
        reports = [ledger.audit(delta) for ledger in ledgers]
    finally:
        for ledger in ledgers:
            ledger.close()
    clients: dict[str, dict] = {}
    for report in reports:
        for cid, values in report["clients"].items():
            if cid in clients:
                raise ConfigurationError(f"client {cid} has rows of run {run_id!r} in two ledgers; audit each file "
                                         "on its own")
            clients[cid] = values
    clients = dict(sorted(clients.items(), key=lambda kv: (len(kv[0]), kv[0])))
    first = reports[0]
    return {"delta": first["delta"], "max_epsilon": max((v["epsilon"] for v in clients.values()), default=0.0),
            "run_id": run_id, "accountant": first["accountant"], "epsilon_budget": first["epsilon_budget"],
            "clients": clients}


def merged_epsilon_by_round(paths, run_id: str, delta: float | None = None) -> dict[str, list[tuple[int, float]]]:
    """Each client's cumulative epsilon after each round it was charged in, over the per-client ledgers."""
    out: dict[str, list[tuple[int, float]]] = {}
    ledgers = _open_all(paths, run_id)
    try:
        for ledger in ledgers:
            out.update(ledger.epsilon_by_round(delta))
    finally:
        for ledger in ledgers:
            ledger.close()
    return out


def merged_charges(paths, run_id: str) -> list:
    """Every committed charge of ``run_id`` in the per-client ledgers, in client then round order."""
    ledgers = _open_all(paths, run_id)
    try:
        return [charge for ledger in ledgers for charge in ledger.charges()]
    finally:
        for ledger in ledgers:
            ledger.close()


def ledger_meta(paths, run_id: str) -> dict:
    """The run's metadata as the first ledger holding it stored it (noise source, warnings)."""
    ledgers = _open_all(paths, run_id)
    try:
        return ledgers[0].meta if ledgers else {}
    finally:
        for ledger in ledgers:
            ledger.close()


@dataclass
class SimulationEngineRun:
    """What a run on the Simulation Engine left: ``result`` in the in-process runtime's form, the per-client ledger
    files, the final server state (the algorithm's broadcast after the last round) and the run's spec."""

    result: object  # privfl.runtime.engine.RunResult
    ledger_paths: list[str]
    state: dict
    spec: object  # privfl.flower.app.RunSpec
    out_dir: str
    #: what the ServerApp published (privfl.flower.app.read_result)
    published: dict = field(default_factory=dict)

    def charges(self) -> list:
        """Every charge of the run, over the clients' own ledgers."""
        return merged_charges(self.ledger_paths, self.spec.run_id)

    def diagnostic_algorithm(self):
        """A client half holding the final server state, to read a saved model from; the clients' own states
        (HBFL's local models, FedBNN's personalised models) stayed on their SuperNodes and are not in it."""
        from privfl.algorithms import make_algorithm
        from privfl.algorithms.base import Broadcast
        from privfl.core.plan import seed_stream

        spec = self.spec
        alg = make_algorithm(spec.algorithm, spec.fed, spec.privacy, **spec.algorithm_options())
        public = spec.public_facts()
        setup = seed_stream(spec.fed.seed, "setup")
        alg.setup(public, np.random.default_rng(setup))
        half = alg.client_half(public, np.random.default_rng(setup))
        return half.view([None] * spec.n_clients, Broadcast(spec.fed.rounds, self.state))


def _write_arrays(path: str, dataset, *, inputs_only: bool = False) -> str:
    arrays = {"x": dataset.x} if inputs_only else {"x": dataset.x, "y": dataset.y}
    tmp = f"{path}.tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return path


def _round_epsilons(paths, run_id: str, delta: float, rounds) -> dict[int, list[float]]:
    """Each round's per-client cumulative epsilon (a client's last charged value carries over rounds it sat out)."""
    series = merged_epsilon_by_round(paths, run_id, delta)
    out = {}
    for rnd in rounds:
        out[rnd] = [max((e for r, e in s if r <= rnd), default=0.0) for s in series.values()] or [0.0]
    return out


def run_simulation_engine(algorithm: str, data, fed, privacy, options: Mapping | None, out_dir: str, *,
                          run_id: str, ledger_dir: str | None = None, secure=None, env: Mapping | None = None,
                          timeout: float | None = None, node_wait: float = 300.0,
                          round_timeout: float = 600.0, modules=()) -> SimulationEngineRun:
    """Run ``algorithm`` on ``data`` under ``fed`` and ``privacy`` on Flower's Simulation Engine, one virtual
    SuperNode per client (see the module docstring for the files under ``out_dir``), and wait for it.

    ``options``: the algorithm's options (JSON values, as ``make_algorithm`` takes them); ``secure``: a
    :class:`privfl.privacy.secure.SecureAggregation` (semi-honest); ``env``: variables for every process of the engine;
    ``timeout``: seconds for the whole run (default: node_wait plus round_timeout per round); ``modules``: the Python
    files that register the run's own algorithm (``privfl.register_algorithm``), which the app imports. Raises
    :class:`privfl.flower.app.DeploymentError` (with the log to read) when the engine publishes no result."""
    require_flower()
    require_runs_on_flower(algorithm)
    from privfl.algorithms import make_algorithm

    require_one_phase(make_algorithm(algorithm, fed, privacy, **dict(options or {})))
    from privfl.flower.app import DeploymentError, RunSpec, algorithm_modules, read_result, write_app

    modules = algorithm_modules(algorithm, modules)
    from privfl.flower.local import LocalDeployment
    from privfl.core.public import SEEDED_NOISE_WARNING
    from privfl.runtime.engine import RunResult
    from privfl.runtime.rounds import RoundRecord

    n_clients = len(data.train_parts)
    out_dir = os.path.abspath(out_dir)
    data_dir = os.path.join(out_dir, "data")
    ledger_dir = os.path.abspath(ledger_dir or os.path.join(out_dir, "ledgers"))
    os.makedirs(data_dir, exist_ok=True)
    os.makedirs(ledger_dir, exist_ok=True)
    for k, part in enumerate(data.train_parts):
        _write_arrays(os.path.join(data_dir, f"client{k}.npz"), part)
    test_path = _write_arrays(os.path.join(data_dir, "test.npz"), data.test) if data.test is not None else ""
    alignment = getattr(data, "alignment", None)
    alignment_path = (_write_arrays(os.path.join(data_dir, "alignment.npz"), alignment, inputs_only=True)
                      if alignment is not None else None)
    spec = RunSpec.of(algorithm, data, fed, privacy, run_id=run_id, options=dict(options or {}), secure=secure,
                      alignment_path=alignment_path, node_wait=node_wait, round_timeout=round_timeout)
    result_path = os.path.join(out_dir, "result.bin")
    if os.path.exists(result_path):
        os.remove(result_path)  # a result on disk is this run's or none
    app = write_app(os.path.join(out_dir, "app"), spec, result_path=result_path, test_path=test_path,
                    test_from_clients=bool(getattr(data, "test_from_clients", False)),
                    data_path_template=os.path.join(data_dir, "client{partition-id}.npz"),
                    ledger_path_template=os.path.join(ledger_dir, LEDGER_FILE.replace("{k}", "{partition-id}")),
                    modules=modules)
    engine = os.path.join(out_dir, "engine")
    shutil.rmtree(engine, ignore_errors=True)  # the SuperLink's state of an earlier launch is not this run's
    os.makedirs(engine)
    budget = timeout if timeout is not None else node_wait + round_timeout * max(1, fed.rounds) + 120.0
    with LocalDeployment(engine, [], simulation=True, env=dict(env or {})) as deployment:
        try:
            deployment.run(app, timeout=budget,
                           federation_config=f"num-supernodes={n_clients} client-resources-num-cpus=1")
        except subprocess.TimeoutExpired:
            raise DeploymentError(f"run {run_id!r} did not finish on Flower's Simulation Engine within {budget:g} s "
                                  f"(stopped); see {os.path.join(engine, 'flwr-run.log')}") from None
    if not os.path.exists(result_path):
        log = os.path.join(engine, "flwr-run.log")
        tail = ""
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                tail = f.read()[-3000:]
        raise DeploymentError(f"Flower's Simulation Engine published no result for run {run_id!r}; see {log} and "
                              f"{os.path.join(engine, 'superlink.log')}" + (f"\n{tail}" if tail else ""))
    published = read_result(result_path)
    paths = ledger_paths(ledger_dir, n_clients)
    result = RunResult(algorithm, getattr(data, "name", "?"), n_clients, fed.rounds, privacy.epsilon, privacy.delta,
                       privacy.resolved_accountant, published["noise_multipliers"], ledger=ledger_dir,
                       run_id=run_id, noise="secure" if privacy.secure_noise else "seeded")
    history = published["history"]
    epsilons = _round_epsilons(paths, run_id, privacy.delta, [int(h["round"]) for h in history])
    released_any = False
    for h in history:
        rnd = int(h["round"])
        if privacy.private:
            eps = epsilons[rnd]
        else:  # a non-private run's releases are charged NonPrivateEvent: epsilon = inf once one is made
            released_any = released_any or int(h["participants"]) > 0
            eps = [math.inf] if released_any else [0.0]
        result.history.append(RoundRecord(rnd, bool(h["aborted"]), int(h["participants"]),
                                          [str(c) for c in h["sat_out"]], dict(h["metrics"]), float(max(eps)),
                                          float(np.mean(eps)), float(h["seconds"]),
                                          snr={str(k): float(v) for k, v in dict(h.get("snr") or {}).items()},
                                          clip=None if h.get("clip") is None else float(h["clip"])))
    run = SimulationEngineRun(result, paths, dict(published["state"]), spec, out_dir, published)
    test = data.test
    if (history and test is not None and test.task == "regression"
            and (test.target_offset != 0.0 or test.target_scale != 1.0)):
        # the ServerApp's test file holds standardised targets; the final metrics in the data set's own units
        result.history[-1].metrics = run.diagnostic_algorithm().evaluate(test)
    result.audit = merged_audit(paths, run_id, privacy.delta)
    if privacy.private and not privacy.secure_noise:
        result.audit["warning"] = SEEDED_NOISE_WARNING
    return run


__all__ = ["INSTALL_HINT", "SimulationEngineRun", "client_ledgers", "ledger_meta", "ledger_paths", "merged_audit",
           "merged_charges", "merged_epsilon_by_round", "require_flower", "require_one_phase", "require_runs_on_flower",
           "run_simulation_engine"]
