"""The runtime contract (issue 13): one test body, run over both runtimes, the in-process :class:`Simulation` and
Flower's Simulation Engine (:func:`privfl.flower.sim.run_simulation_engine`, what ``privfl run --runtime flower-sim``
launches). On the same seeds each runtime must

- end with the final model of the in-process run, bit for bit (FedAvg, and DP-FedAvg with local seeded noise);
- charge one ledger row per client, round and channel, and no more;
- keep every client's epsilon within the target;
- release nothing more from a client once its budget is exhausted (client 2's ledger holds an earlier charge that
  leaves room for exactly one of the run's two rounds: it releases round 0 and sits round 1 out);

and on the Simulation Engine the client half runs in other processes than the server half: every process of the
engine reports, through an audit hook (``sys.addaudithook``, installed by a ``sitecustomize`` on its PYTHONPATH), which
of the run's files it opens; the ServerApp's process writes the result, the ClientApps' processes open the clients'
data and ledgers.

Small on purpose (3 clients, 2 rounds, digits, tiny models): the engine starts once per algorithm (two launches,
each serving every assertion about its run), the in-process runs share one subprocess, and all of them run at once
(their start-ups, mostly waiting, overlap). Like every bit-exact
comparison in tests/flower (conftest.py), each process gets ``MKL_CBWR=COMPATIBLE``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from privfl.accounting.events import GaussianEvent
from privfl.accounting.ledger import PrivacyLedger
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays, load_digits
from privfl.flower.app import RunSpec
from privfl.flower.records import from_bytes

N_CLIENTS, ROUNDS = 3, 2
#: the client whose ledger holds an earlier charge: room for one of the run's rounds, not two
EXHAUSTED = "2"
HAS_ENGINE = importlib.util.find_spec("flwr") is not None and importlib.util.find_spec("ray") is not None
# flower-sim: make test-all (CI time: Ray's start-up, about two minutes a case)
RUNTIMES = ["inprocess", pytest.param("flower-sim", marks=[pytest.mark.slow, pytest.mark.skipif(
    not HAS_ENGINE, reason="Flower's Simulation Engine is not installed (pip install 'privfl[flower]')")])]

#: name -> (algorithm, federation, privacy); the private case's noise is seeded so both runtimes draw the same
CASES = {
    "fedavg": ("fedavg", FederationConfig(rounds=ROUNDS, local_epochs=1, batch_size=32, lr=0.1, hidden=(8,), seed=5),
               PrivacyConfig()),
    "dp_fedavg_local": ("dp_fedavg",
                        FederationConfig(rounds=ROUNDS, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=3),
                        PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="local",
                                      secure_noise=False)),
}

_IN_PROCESS = """
import os, sys
import numpy as np
import torch
from privfl.algorithms import make_algorithm
from privfl.data import ArrayDataset, federated_from_arrays
from privfl.flower.app import RunSpec
from privfl.flower.records import to_bytes
from privfl.runtime.engine import Simulation

data_dir = sys.argv[1]
for work in sys.argv[2:]:  # one case per folder: spec.json, ledger.sqlite -> out.bin
    spec = RunSpec.from_json(open(os.path.join(work, "spec.json")).read())
    def part(name):
        with np.load(os.path.join(data_dir, name)) as f:
            return ArrayDataset(f["x"], f["y"], spec.task, spec.num_classes, name)
    data = federated_from_arrays([part(f"client{k}.npz") for k in range(spec.n_clients)], part("test.npz"),
                                 name=spec.name)
    torch.set_num_threads(spec.torch_threads or 1)  # as the ClientApps train
    sim = Simulation(make_algorithm(spec.algorithm, spec.fed, spec.privacy, **spec.algorithm_options()), data,
                     spec.fed, spec.privacy, executor="per_client", public=spec.public_facts(),
                     ledger_path=os.path.join(work, "ledger.sqlite"), run_id=spec.run_id)
    result = sim.run()
    history = [{"round": r.round, "participants": r.participants, "sat_out": r.sat_out} for r in result.history]
    with open(os.path.join(work, "out.bin"), "wb") as f:
        f.write(to_bytes({"state": dict(sim.algorithm.broadcast(spec.fed.rounds).values), "history": history,
                          "pid": os.getpid()}, "contract"))
"""

#: installed in every process of the engine: which process opens which of the run's files
_SITECUSTOMIZE = """
import os, sys

_LOG, _WATCH = os.environ.get("PRIVFL_CONTRACT_LOG"), os.environ.get("PRIVFL_CONTRACT_WATCH")

def _report(event, args):
    if event not in ("open", "sqlite3.connect") or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.path.abspath(os.fsdecode(args[0]))
    if path.startswith(_WATCH) and path != _LOG:
        with open(_LOG, "a") as log:
            log.write(f"{os.getpid()}\\t{event}\\t{path}\\n")

if _LOG and _WATCH:
    sys.addaudithook(_report)
"""


@dataclass
class Outcome:
    """What a runtime left: the final server state, each round's participants and sat-out clients, every ledger
    row of the run, each client's audit, and which processes ran the server half and the client half."""

    state: dict
    history: list[dict]
    charges: list
    audits: dict
    server_pids: set
    client_pids: set


@pytest.fixture(scope="module")
def digits_parts():
    digits = load_digits(flatten=True)
    idx = np.random.default_rng(1).permutation(len(digits))
    parts = [digits.subset(idx[k * 100:(k + 1) * 100]) for k in range(N_CLIENTS)]
    return federated_from_arrays(parts, digits.subset(idx[1500:1600]), name="digits-contract",
                                 design_size=round(sum(map(len, parts)) / len(parts)))


def _spec(case: str, data) -> RunSpec:
    algorithm, fed, privacy = CASES[case]
    return RunSpec.of(algorithm, data, fed, privacy, run_id=f"contract-{case}")


def _exhaust_after_one_round(path: str, spec: RunSpec) -> None:
    """Charge client EXHAUSTED half of one round's zCDP in ``path``: with the rounds calibrated to the target
    together, one more round fits under the budget and two do not."""
    from privfl.algorithms import make_algorithm
    from privfl.core.plan import RunPlan, seed_stream

    alg = make_algorithm(spec.algorithm, spec.fed, spec.privacy)
    alg.setup(spec.public_facts(), np.random.default_rng(seed_stream(spec.fed.seed, "setup")))
    multipliers = RunPlan.build(alg, spec.privacy, spec.fed, spec.public_facts()).noise_multipliers
    rho_round = sum(1 / (2 * z * z) for z in multipliers.values())
    privacy = spec.privacy
    ledger = PrivacyLedger(path, spec.run_id, delta=privacy.delta, epsilon_budget=privacy.epsilon,
                           accountant=privacy.resolved_accountant)
    try:
        ledger.charge(EXHAUSTED, 10_000, "earlier", GaussianEvent(1.0, 1 / math.sqrt(rho_round)), "client")
    finally:
        ledger.close()


def _ledger_outcome(paths, run_id):
    charges, audits = [], {}
    for path in paths:
        ledger = PrivacyLedger.open_existing(path, run_id)
        try:
            charges += ledger.charges()
            audits.update(ledger.audit()["clients"])
        finally:
            ledger.close()
    return charges, audits


def _run_in_process(data, work, repro_env) -> dict[str, Outcome]:
    """Every case on the in-process runtime (``executor="per_client"``), in one fresh process with ``repro_env``."""
    data_dir = work / "data"
    data_dir.mkdir(parents=True)
    for k, part in enumerate(data.train_parts):
        np.savez(data_dir / f"client{k}.npz", x=part.x, y=part.y)
    np.savez(data_dir / "test.npz", x=data.test.x, y=data.test.y)
    specs = {case: _spec(case, data) for case in CASES}
    for case, spec in specs.items():
        (work / case).mkdir()
        (work / case / "spec.json").write_text(spec.to_json())
        if spec.privacy.private:
            _exhaust_after_one_round(str(work / case / "ledger.sqlite"), spec)
    subprocess.run([sys.executable, "-c", _IN_PROCESS, str(data_dir), *(str(work / case) for case in CASES)],
                   check=True, timeout=400, env=dict(os.environ, **repro_env))
    out = {}
    for case, spec in specs.items():
        got = from_bytes((work / case / "out.bin").read_bytes(), "contract")
        charges, audits = _ledger_outcome([str(work / case / "ledger.sqlite")], spec.run_id)
        out[case] = Outcome(got["state"], got["history"], charges, audits, {got["pid"]}, {got["pid"]})
    return out


def _run_on_engine(case, data, work, repro_env) -> Outcome:
    from privfl.flower.sim import ledger_paths, run_simulation_engine

    spec = _spec(case, data)
    algorithm, fed, privacy = CASES[case]
    ledgers = str(work / "run" / "ledgers")
    os.makedirs(ledgers)
    if privacy.private:
        _exhaust_after_one_round(ledger_paths(ledgers, N_CLIENTS)[int(EXHAUSTED)], spec)
    hook = work / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    log = str(work / "opened.log")
    env = dict(repro_env, PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               PRIVFL_CONTRACT_LOG=log, PRIVFL_CONTRACT_WATCH=str(work / "run"))
    run = run_simulation_engine(algorithm, data, fed, privacy, {}, str(work / "run"), run_id=spec.run_id,
                                ledger_dir=ledgers, env=env, timeout=400)
    history = [{"round": r.round, "participants": r.participants, "sat_out": r.sat_out} for r in run.result.history]
    charges, audits = _ledger_outcome(run.ledger_paths, spec.run_id)
    server, clients = set(), set()
    with open(log) as f:
        for line in f:
            pid, _, path = line.rstrip("\n").split("\t")
            if os.path.basename(path).startswith("result.bin"):
                server.add(int(pid))  # the ServerApp publishes the result
            elif os.path.basename(path).startswith("client") and (".npz" in path or ".sqlite" in path):
                clients.add(int(pid))  # a ClientApp reads its data and charges its ledger
    return Outcome(run.state, history, charges, audits, server, clients)


@pytest.fixture(scope="module")
def outcome_of(request, digits_parts, tmp_path_factory, repro_env):
    """``outcome_of(runtime, case)``: each runtime runs each case once, and every test reads the same outcome. The
    runs start together, in threads, as soon as one is asked for: the in-process one (every case in one process)
    and, when the session selected a flower-sim test, one engine launch per case, so their start-ups overlap."""
    wanted = {item.callspec.params.get("runtime") for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}
    pool = ThreadPoolExecutor(max_workers=1 + len(CASES))
    futures: dict = {}

    def start():
        if futures:
            return
        futures["inprocess"] = pool.submit(_run_in_process, digits_parts, tmp_path_factory.mktemp("inprocess"),
                                           repro_env)
        if "flower-sim" in wanted and HAS_ENGINE:
            for case in CASES:
                futures["flower-sim", case] = pool.submit(_run_on_engine, case, digits_parts,
                                                          tmp_path_factory.mktemp(f"engine-{case}"), repro_env)

    def get(runtime, case):
        start()
        return futures["inprocess"].result()[case] if runtime == "inprocess" else futures[runtime, case].result()

    yield get
    pool.shutdown(wait=True)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_runtime_contract(runtime, case, outcome_of):
    algorithm, fed, privacy = CASES[case]
    got, reference = outcome_of(runtime, case), outcome_of("inprocess", case)

    # the final model is the in-process run's on the same seeds, bit for bit
    assert sorted(got.state) == sorted(reference.state)
    for name, value in reference.state.items():
        assert np.array_equal(got.state[name], value), \
            f"{name}: max abs difference {np.max(np.abs(np.asarray(got.state[name]) - np.asarray(value)))}"

    private = privacy.private
    exhausted = {EXHAUSTED} if private else set()
    # a client whose budget is exhausted sits the rest of the run out; the others take part in every round
    assert [h["sat_out"] for h in got.history] == [[]] + [sorted(exhausted)] * (ROUNDS - 1)
    assert [h["participants"] for h in got.history] == [N_CLIENTS] + [N_CLIENTS - len(exhausted)] * (ROUNDS - 1)

    # one ledger row per client, round and channel, each released; nothing more from the exhausted client
    run_rows = [c for c in got.charges if c.round < ROUNDS]
    channels = {c.channel for c in run_rows}
    assert len(channels) >= 1
    per_client_round = Counter((c.client_id, c.round) for c in run_rows)
    for k in map(str, range(N_CLIENTS)):
        rounds = [0] if k in exhausted else list(range(ROUNDS))
        assert {r for (cid, r) in per_client_round if cid == k} == set(rounds), f"client {k}'s rounds"
        assert all(per_client_round[k, r] == len(channels) for r in rounds), f"client {k}: one row per channel"
        assert all(c.released for c in run_rows if c.client_id == k)
        assert got.audits[k]["releases"] == len(rounds) * len(channels)
    assert len({(c.client_id, c.round, c.channel) for c in run_rows}) == len(run_rows)

    # every client's epsilon within the target (a non-private run's is inf, and so is its target)
    for k, audit in got.audits.items():
        assert audit["epsilon"] <= privacy.epsilon * (1 + 1e-9), f"client {k} spent {audit['epsilon']}"
    if private:  # the exhausted client indeed has no room for another round
        assert got.audits[EXHAUSTED]["epsilon"] > privacy.epsilon / 2


@pytest.mark.timeout(900)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_where_the_client_half_runs(runtime, outcome_of):
    """On the Simulation Engine the client half runs in other processes than the server half (and than this test);
    the in-process runtime runs both in one process (by design: it is the embedded runtime)."""
    got = outcome_of(runtime, "dp_fedavg_local")  # served by the contract test's run, no launch of its own
    assert got.server_pids and got.client_pids
    if runtime == "flower-sim":
        assert got.server_pids.isdisjoint(got.client_pids), (got.server_pids, got.client_pids)
        assert os.getpid() not in got.server_pids | got.client_pids
    else:
        assert got.server_pids == got.client_pids
