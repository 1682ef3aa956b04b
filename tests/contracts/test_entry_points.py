"""The neighbouring-dataset contract at the entry points users call (issue 25).

``tests/privfl/test_neighbouring_contract.py`` runs an algorithm's client step with the public facts handed in.
Here D and a neighbour D' go through the real entry points, ``privfl.federate``, ``privfl run --data``, a compare
TOML with ``data =`` and the Flower ``RunSpec``, each building its own public facts as a user's run would, and
everything the server would see before any value is compared:

- the public facts (design size, record cap, declared sizes, shapes);
- the run plan: placement, noise multipliers, the charged channels (shape, clip, sensitivity, quantiser bound),
  distributed-noise plans (quantiser, share std, survivor floors), the events each client's ledger will charge per
  round (DP-SGD's q, steps and z among them) and the trust assumption;
- the error a refused configuration replies with (its text must not depend on the data either).

Record-level neighbours add one record to a client (add/remove) or replace one (replace-one); client-level
neighbours change a client's whole data set, its size tripled. The grid is every registered algorithm x unit x
relation x placement (x secure aggregation) that the entry point accepts; a refused cell must be refused alike.

The black-box audits run ``privfl.federate`` end to end: the record-count distinguisher of the issue (a threshold on
the released update's norm, (63, 63) against (64, 63) records) must stay below the claim.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import sqlite3
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import privfl
from privfl.algorithms import ALGORITHMS
from privfl.apps.api import own_model_algorithms
from privfl.apps.cli import main
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays
from privfl.apps.empirical_audit import epsilon_lower_bound
from privfl.errors import ConfigurationError
from privfl.runtime.engine import Simulation

CLIENTS, RECORDS, FEATURES, CLASSES = 3, 40, 6, 3
REGRESSION = {"fedbnr"}


class _Stop(BaseException):
    """Raised right after a run is prepared (facts and plan built, nothing charged): what the server would see
    before the first value is recorded, and the entry point goes no further."""


def _summary(sim) -> dict:
    """Everything a run fixes before its first release that reaches the server, as plain values."""
    pub, plan = sim.public, sim.plan
    facts = {k: getattr(pub, k) for k in ("n_clients", "task", "num_classes", "input_shape", "client_size",
                                          "client_sizes", "record_cap")}
    distributed = {name: (p.quantiser.low, p.quantiser.high, p.quantiser.step, p.quantiser.bits, p.local_sigma,
                          p.n_min, p.n_max, p.honest, p.event.to_dict())
                   for name, p in (plan.distributed or {}).items()}
    events = {}
    for k in range(pub.n_clients):
        per = plan.round_events(k)
        events[k] = None if per is None else {ch: e.to_dict() for ch, e in per.items()}
    return {"facts": facts, "placement": plan.placement, "multipliers": plan.noise_multipliers,
            "sampling_rate": plan.sampling_rate, "unit": plan.unit, "channels": [repr(c) for c in plan.channels],
            "distributed": distributed, "events": events, "trust": plan.trust, "amplified": plan.amplified}


@pytest.fixture
def capture(monkeypatch):
    """Simulation.prepare records the run's summary and stops the entry point there."""
    return install_capture(monkeypatch)


def install_capture(monkeypatch) -> list[dict]:
    """What :func:`capture` does, for a test elsewhere that runs this module's entry-point checks."""
    seen: list[dict] = []
    original = Simulation.prepare

    def prepare(self):
        original(self)
        seen.append(_summary(self))
        raise _Stop

    monkeypatch.setattr(Simulation, "prepare", prepare)
    return seen


# ------------------------------------------------------------------------------------------------------ data

def _arrays(task: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(FEATURES, CLASSES))
    parts = []
    for _ in range(CLIENTS):
        x = rng.uniform(-1, 1, size=(RECORDS, FEATURES)).astype(np.float32)
        y = (np.argmax(x @ w, 1).astype(np.int64) if task == "classification"
             else (x @ w[:, 0]).astype(np.float32))
        parts.append((x, y))
    x = rng.uniform(-1, 1, size=(30, FEATURES)).astype(np.float32)
    test = (x, np.argmax(x @ w, 1).astype(np.int64) if task == "classification" else (x @ w[:, 0]).astype(np.float32))
    return parts, test


def _neighbour(parts, unit: str, adjacency: str):
    """D': one record more in client 0 (add/remove) or one replaced (replace-one) at record level; at client level
    client 0's whole data set replaced by one three times its size."""
    (x0, y0), rest = parts[0], parts[1:]
    if unit == "client":
        return [(np.concatenate([x0] * 3)[::-1].copy(), np.concatenate([y0] * 3)[::-1].copy()), *rest]
    extreme = (np.ones((1, FEATURES), np.float32), y0[:1].copy())
    if adjacency == "add_remove":
        return [(np.concatenate([x0, extreme[0]]), np.concatenate([y0, extreme[1]])), *rest]
    return [(np.concatenate([extreme[0], x0[1:]]), np.concatenate([extreme[1], y0[1:]])), *rest]


def _write_csvs(folder, parts, test, task):
    import pandas as pd

    folder.mkdir(parents=True, exist_ok=True)
    for k, (x, y) in enumerate(parts):
        frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(FEATURES)])
        frame["y"] = y
        frame.to_csv(folder / f"c{k}.csv", index=False)
    frame = pd.DataFrame(test[0], columns=[f"f{i}" for i in range(FEATURES)])
    frame["y"] = test[1]
    frame.to_csv(folder.parent / f"{folder.name}-test.csv", index=False)
    return str(folder / "*.csv"), str(folder.parent / f"{folder.name}-test.csv")


def _outcome(call, seen: list) -> object:
    """What a user's call left for the server to see: the prepared run's summary, or the refusal's text."""
    before = len(seen)
    try:
        code = call()
    except _Stop:
        return seen[before]
    except ConfigurationError as exc:
        return ("refused", str(exc))
    return ("exit", code, len(seen) - before)


# ------------------------------------------------------------------------------------------------------ grids

PRIVATE = sorted(n for n, cls in ALGORITHMS.items() if cls.supports_privacy)
# the non-private baselines (fedavg, fedprox) claim nothing: their facts may follow the data
CLI_GRID = [(n, unit, adjacency, placement, secure, sampling)
            for n, unit, adjacency, placement, secure, sampling in itertools.product(
                PRIVATE, ("example", "client"), ("add_remove", "replace_one"), ("local", "central", "distributed"),
                (False, True), (False, True))
            if secure or placement != "distributed"]


def _cli_argv(name, unit, adjacency, placement, data, test, size, secure=False, sampling=False, extra=()):
    task_flags = ["--task", "regression"] if name in REGRESSION else []
    argv = ["run", "--algorithm", name, "--epsilon", "3", "--unit", unit, "--adjacency", adjacency, "--placement",
            placement, "--data", data, "--target", "y", "--test-data", test, "--rounds", "2", "--hidden", "8",
            "--pool", "1", "--standardize", "none", "--seeded-noise", "--quiet", *task_flags, *extra]
    if secure:
        argv += ["--secure-agg"]
    if placement == "distributed":
        argv += ["--accountant", "rdp"] if name.startswith("dp_fedsgd") else ["--accountant", "zcdp"]
    if sampling:
        argv += ["--sampling-rate", "0.5"]
    if size is not None:
        argv += ["--client-size", str(size)]
    return argv


@pytest.mark.timeout(900)
def test_privfl_run_data_shows_the_server_the_same_run_on_neighbours(tmp_path, capture, capsys):
    """``privfl run --data`` over every private algorithm x unit x relation x placement: the summary (or the refusal)
    is identical on D and D'; the grid cannot pass vacuously."""
    accepted = {}
    for task in ("classification", "regression"):
        parts, test = _arrays(task)
        base = _write_csvs(tmp_path / f"{task}-D", parts, test, task)
        neighbours = {(unit, adjacency): _write_csvs(tmp_path / f"{task}-{unit}-{adjacency}",
                                                     _neighbour(parts, unit, adjacency), test, task)
                      for unit, adjacency in itertools.product(("example", "client"), ("add_remove", "replace_one"))}
        for name, unit, adjacency, placement, secure, sampling in CLI_GRID:
            if (name in REGRESSION) != (task == "regression"):
                continue
            options = dict(secure=secure, sampling=sampling)
            a = _outcome(lambda: main(_cli_argv(name, unit, adjacency, placement, *base, RECORDS, **options)),
                         capture)
            err_a = capsys.readouterr().err
            b = _outcome(lambda: main(_cli_argv(name, unit, adjacency, placement, *neighbours[(unit, adjacency)],
                                                RECORDS, **options)), capture)
            err_b = capsys.readouterr().err
            cell = (name, unit, adjacency, placement, secure, sampling)
            assert a == b, cell
            assert err_a == err_b, cell  # a refusal's text (exit 2) is the same on both
            if isinstance(a, dict):
                accepted.setdefault(name, set()).add(unit)
    for name in set(PRIVATE) - {"fedbnn"}:  # FedBNN needs a public alignment set carved from a built-in data set
        assert name in accepted, f"{name}: no accepted configuration through privfl run --data"
    assert "example" in accepted["dpsgd_fedavg"] and "client" in accepted["dp_fedavg"]
    assert sum(len(units) for units in accepted.values()) >= 9


def test_privfl_run_data_without_a_declared_size_is_exit_2_and_charges_nothing(tmp_path, capsys):
    parts, test = _arrays("classification")
    data, test_csv = _write_csvs(tmp_path / "D", parts, test, "classification")
    ledger = tmp_path / "ledger.sqlite"
    code = main(["run", "--algorithm", "dpsgd_fedavg", "--epsilon", "1", "--data", data, "--target", "y",
                 "--test-data", test_csv, "--rounds", "1", "--ledger", str(ledger), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "--client-size" in err and "Traceback" not in err
    if ledger.exists():  # nothing charged: no row at all
        with sqlite3.connect(ledger) as conn:
            assert conn.execute("SELECT COUNT(*) FROM charges").fetchone()[0] == 0
    code = main(["run", "--algorithm", "dpsgd_fedavg", "--epsilon", "1", "--data", data, "--target", "y",
                 "--test-data", test_csv, "--rounds", "1", "--ledger", str(ledger), "--quiet", "--client-size", "40"])
    assert code == 0, capsys.readouterr().err


FEDERATE_GRID = [(n, unit) for n in own_model_algorithms() if ALGORITHMS[n].supports_privacy
                 for unit in ("example", "client")]


def _federate(parts, test, name, unit, size, **kw):
    clients = {f"org{k}": p for k, p in enumerate(parts)}
    kw.setdefault("rounds", 1)
    return privfl.federate(nn.Linear(FEATURES, CLASSES), clients, algorithm=name, epsilon=1.0, unit=unit, test=test,
                           client_size=size, secure_noise=False, **kw)


@pytest.mark.parametrize("name, unit", FEDERATE_GRID, ids=["-".join(g) for g in FEDERATE_GRID])
def test_federate_shows_the_server_the_same_run_on_neighbours(name, unit, capture):
    parts, test = _arrays("classification")
    for adjacency in ("add_remove", "replace_one"):
        a = _outcome(lambda: _federate(parts, test, name, unit, RECORDS), capture)
        b = _outcome(lambda: _federate(_neighbour(parts, unit, adjacency), test, name, unit, RECORDS), capture)
        assert a == b
        accepted = isinstance(a, dict)
        # without a declared size: refused on both, with the same text, before anything is built
        a = _outcome(lambda: _federate(parts, test, name, unit, None), capture)
        b = _outcome(lambda: _federate(_neighbour(parts, unit, adjacency), test, name, unit, None), capture)
        assert a == b and a[0] == "refused"
        assert "client_size=" in a[1] or not accepted


def test_federate_without_a_declared_size_charges_nothing(tmp_path):
    parts, test = _arrays("classification")
    ledger = tmp_path / "l.sqlite"
    with pytest.raises(ConfigurationError, match="client_size="):
        _federate(parts, test, "dpsgd_fedavg", "example", None, ledger=str(ledger))
    assert not ledger.exists()


COMPARE_ALGORITHMS = sorted(set(PRIVATE) - REGRESSION - {"fedbnn"})  # FedBNN needs a built-in alignment set


@pytest.mark.parametrize("task, unit, adjacency", list(itertools.product(
    ["classification", "regression"], ["example", "client"], ["add_remove", "replace_one"])))
def test_compare_toml_with_own_data_shows_the_server_the_same_run_on_neighbours(tmp_path, capture, capsys, task,
                                                                                unit, adjacency):
    """A compare TOML with ``data =``: every algorithm the task takes (FedBNR on regression data) x placement
    (compare has no secure aggregation, so local and central) under the unit and relation of the case, set the way
    a user sets them ([overrides.<algorithm>])."""
    parts, test = _arrays(task)
    for label, world in (("D", parts), ("D2", _neighbour(parts, unit, adjacency))):
        _write_csvs(tmp_path / label, world, test, task)
    outcomes = {}
    names = sorted(REGRESSION) if task == "regression" else COMPARE_ALGORITHMS
    # compare runs an algorithm built for fewer units at its own unit: the neighbours here are the unit's own
    cells = [(name, placement) for name, placement in itertools.product(names, ("local", "central"))
             if unit in (getattr(ALGORITHMS[name], "units", None) or (unit,))]
    for name, placement in cells:
        for label in ("D", "D2"):
            for size_line in ("client_size = 40\n", ""):
                cfg = tmp_path / f"{label}-{name}-{placement}-{bool(size_line)}.toml"
                cfg.write_text(f'data = "{label}/*.csv"\ntarget = "y"\ntest_data = "{label}-test.csv"\n'
                               f'algorithms = ["{name}"]\nepsilons = [3.0]\nseeds = [0]\nrounds = 2\n'
                               f'unit = "{unit}"\ntask = "{task}"\n{size_line}'
                               f'out_dir = "{tmp_path / "out" / label}"\n'
                               f'[overrides.{name}]\nplacement = "{placement}"\nadjacency = "{adjacency}"\n'
                               f'pool = 1\n')
                got = _outcome(lambda: main(["compare", str(cfg), "--quiet"]), capture)
                outcomes[(name, placement, label, bool(size_line))] = (got, capsys.readouterr().err)
    for name, placement in cells:
        for declared in (True, False):
            assert outcomes[(name, placement, "D", declared)] == outcomes[(name, placement, "D2", declared)], (
                name, placement, declared)
        undeclared, err = outcomes[(name, placement, "D", False)]
        if isinstance(undeclared, dict):  # record counts declared public (replace-one at record level): no size needed
            assert undeclared["facts"]["client_sizes"] is not None, name
            continue
        refused, code, _ = undeclared
        assert refused == "exit" and code == 2 and "Traceback" not in err, name
        assert "client_size" in err or not isinstance(outcomes[(name, placement, "D", True)][0], dict), name
    assert sum(isinstance(outcomes[(n, p, "D", True)][0], dict) for n, p in cells) >= (1 if task == "regression"
                                                                                         else 2)


@pytest.mark.parametrize("unit, adjacency", list(itertools.product(["example", "client"],
                                                                    ["add_remove", "replace_one"])))
def test_flower_runspec_is_the_same_on_neighbours(unit, adjacency):
    """The Flower spec (what the ServerApp and every ClientApp plan the run from) over every private algorithm x
    placement (distributed under secure aggregation) x sampling, under the unit and relation of the case: the same
    JSON on D and D', or the same refusal; without a declared size a private spec is refused when sizes are private."""
    pytest.importorskip("flwr")
    from privfl.flower.app import RunSpec
    from privfl.privacy.secure import SecureAggregation

    accepted = 0
    for name, placement, sampling in itertools.product(PRIVATE, ("local", "central", "distributed"), (1.0, 0.5)):
        task = "regression" if name in REGRESSION else "classification"
        parts, test = _arrays(task)
        accountant = ("rdp" if name.startswith("dp_fedsgd") else "zcdp") if placement == "distributed" else None
        try:
            privacy = PrivacyConfig(epsilon=3.0, unit=unit, adjacency=adjacency, clip=1.0, placement=placement,
                                    sampling_rate=sampling, accountant=accountant)
        except ConfigurationError:
            continue  # a configuration refused before any data is read
        secure = SecureAggregation(bits=48, malicious=False) if placement == "distributed" else None
        specs = []
        for world in (parts, _neighbour(parts, unit, adjacency)):
            data = federated_from_arrays(world, test, task=task, num_classes=CLASSES if task == "classification"
                                         else None)
            outcome = []
            for size in (RECORDS, None):
                fed = FederationConfig(rounds=2, hidden=(8,), client_size=size)
                try:
                    outcome.append(RunSpec.of(name, data, fed, privacy, run_id="r", secure=secure).to_json())
                except ConfigurationError as exc:
                    outcome.append(("refused", str(exc)))
            specs.append(outcome)
        cell = (name, placement, sampling)
        assert specs[0] == specs[1], cell
        if isinstance(specs[0][0], str):
            accepted += 1
            assert json.loads(specs[0][0])["client_size"] == RECORDS, cell
            sizes_public = unit == "example" and adjacency == "replace_one"
            assert sizes_public or (specs[0][1][0] == "refused" and "client_size=" in specs[0][1][1]), cell
    assert accepted >= 8


# ------------------------------------------------------------------------------------------------------ audits

def _norm_of_update(parts, size, seed):
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    clients = {f"org{k}": p for k, p in enumerate(parts)}
    test = (np.zeros((4, 4), np.float32), np.array([0, 1, 0, 1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = privfl.federate(model, clients, algorithm="dpsgd_fedavg", epsilon=1.0, rounds=1, client_size=size,
                                 test=test, batch_size=32, lr=0.5)
    end = torch.cat([p.detach().flatten() for p in result.model.parameters()])
    return float(torch.linalg.norm(end - start))


@pytest.mark.timeout(600)
def test_record_count_distinguisher_through_federate_stays_below_the_claim():
    """The issue's black box: 2 clients, (63, 63) against (64, 63) records, epsilon 1, one round of DP-SGD FedAvg
    through ``privfl.federate``, a threshold on the update's norm. On the old main the design size was the clients'
    mean size (63 vs 64: 1 vs 2 DP-SGD steps), and this distinguisher gave a lower bound of 3.69. With the size
    declared (64) the schedule is the same in both worlds and the bound stays below the claim."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    other = (rng.normal(size=(63, 4)).astype(np.float32), rng.integers(0, 2, 63))
    d, d2 = [(x[:63], y[:63]), other], [(x, y), other]
    trials = int(os.environ.get("PRIVFL_AUDIT_TRIALS", "300"))  # the 300 per world
    for size in (None, 64):  # as a user's first run would leave it (no size), then with the size declared
        try:
            out = np.array([_norm_of_update(d, size, s) for s in range(trials)])
        except ConfigurationError:
            assert size is None  # refused before anything is released: nothing to distinguish
            continue
        inn = np.array([_norm_of_update(d2, size, s) for s in range(trials)])
        bound = max(epsilon_lower_bound(inn, out, delta=1e-5)[0], epsilon_lower_bound(-inn, -out, delta=1e-5)[0])
        assert bound <= 1.0, (size, bound)


def _cli_and_compare_outcomes(tmp_path, capture, capsys, worlds, name, adjacency, run_extra, toml_tables,
                              unit="example"):
    """Per world (D and D'), what ``privfl run`` of ``name`` with ``run_extra`` left the server to see in each
    placement (local, central, distributed), with and without secure aggregation, and what a compare TOML of the
    same data with ``toml_tables`` (its last lines: the algorithms and their tables) did: ``{key + (world,):
    (outcome, stderr)}``."""
    _, test = _arrays("classification")
    paths = {world: _write_csvs(tmp_path / world, data, test, "classification") for world, data in worlds.items()}
    cells = [(p, s) for p in ("local", "central", "distributed") for s in (False, True) if s or p != "distributed"]
    outcomes = {}
    for world in worlds:
        for placement, secure in cells:
            argv = _cli_argv(name, unit, adjacency, placement, *paths[world], RECORDS, secure=secure,
                             extra=run_extra)
            outcomes[("run", placement, secure, world)] = (_outcome(lambda: main(argv), capture),
                                                           capsys.readouterr().err)
        cfg = tmp_path / f"{world}.toml"
        cfg.write_text(f'data = "{world}/*.csv"\ntarget = "y"\ntest_data = "{world}-test.csv"\n'
                       f'epsilons = [3.0]\nseeds = [0]\nrounds = 2\n'
                       f'unit = "{unit}"\nclient_size = {RECORDS}\nout_dir = "{tmp_path / "out" / world}"\n'
                       + toml_tables)
        outcomes[("compare", world)] = (_outcome(lambda: main(["compare", str(cfg), "--quiet"]), capture),
                                        capsys.readouterr().err)
    return outcomes, paths


def _same_on_neighbours(outcomes) -> list:
    """Every entry point's outcome equal on D and D', no traceback; the prepared runs (accepted ones) of D."""
    keys = {k[:-1] for k in outcomes}
    for key in keys:
        assert outcomes[(*key, "D")] == outcomes[(*key, "D2")], key
    assert all("Traceback" not in outcomes[(*key, "D")][1] for key in keys)
    return [outcomes[(*key, "D")][0] for key in keys if isinstance(outcomes[(*key, "D")][0], dict)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("posterior, label", [("laplace", "fola_noise_once"), ("variational", "hbfl_noise_once")])
@pytest.mark.parametrize("adjacency", ["add_remove", "replace_one"])
def test_dp_fedsgd_posteriors_show_the_server_the_same_run_on_neighbours(tmp_path, capture, capsys, adjacency,
                                                                         posterior, label):
    """DP-FedSGD with FOLA's Laplace posterior (its Fisher-trace channel on the gradient's lot) and with HBFL's
    variational meme (issue 27) as users reach them: ``privfl run --option posterior=...`` (local, central and
    distributed noise, with and without secure aggregation) and a compare TOML ``[variants.<label>]``: the same
    summary, or the same refusal, on D and D'."""
    parts, _ = _arrays("classification")
    worlds = {"D": parts, "D2": _neighbour(parts, "example", adjacency)}
    outcomes, _ = _cli_and_compare_outcomes(
        tmp_path, capture, capsys, worlds, "dp_fedsgd", adjacency, ("--option", f"posterior={posterior}"),
        f'algorithms = ["{label}"]\n[overrides.dp_fedsgd]\nadjacency = "{adjacency}"\npool = 1\n'
        f'placement = "central"\n[variants.{label}]\nalgorithm = "dp_fedsgd"\nposterior = "{posterior}"\n')
    accepted = _same_on_neighbours(outcomes)
    assert len(accepted) >= 5  # local and central, with and without secure aggregation, and the variant
    if posterior == "laplace":  # two channels on one lot; distributed noise plans one sampled channel: refused
        assert all(any("fisher_trace" in c for c in s["channels"]) for s in accepted)
        refused = outcomes[("run", "distributed", True, "D")]
        assert refused[0][:2] == ("exit", 2)
        assert ("one private channel" if adjacency == "add_remove" else "accountant='pld'") in refused[1]


@pytest.mark.parametrize("posterior", ["laplace", "variational"])
@pytest.mark.parametrize("adjacency", ["add_remove", "replace_one"])
def test_dp_fedsgd_posteriors_through_federate_and_the_flower_spec_are_the_same_on_neighbours(capture, adjacency,
                                                                                               posterior):
    """The same two posteriors (issue 27) from the two other entry points: ``privfl.federate(model, clients,
    algorithm="dp_fedsgd", posterior=...)`` with the user's own module (local and central noise, with and without
    secure aggregation, distributed under it), and the Flower ``RunSpec`` every ServerApp and ClientApp plans the run
    from: the same prepared run (or refusal) and the same spec JSON on D and D'."""
    from privfl.privacy.secure import SecureAggregation

    parts, test = _arrays("classification")
    worlds = (parts, _neighbour(parts, "example", adjacency))
    cells = [("local", False), ("central", False), ("central", True), ("distributed", True)]
    accepted = 0
    for placement, secure in cells:
        a, b = (_outcome(lambda w=w: _federate(w, test, "dp_fedsgd", "example", RECORDS, posterior=posterior,
                                                placement=placement, secure_agg=secure), capture) for w in worlds)
        assert a == b, (placement, secure)
        accepted += isinstance(a, dict)
        if isinstance(a, dict) and posterior == "laplace":
            assert any("fisher_trace" in c for c in a["channels"])
    assert accepted >= 3  # local and central, with and without secure aggregation
    pytest.importorskip("flwr")
    from privfl.flower.app import RunSpec

    specs = []
    for w in worlds:
        data = federated_from_arrays(w, test, task="classification", num_classes=CLASSES)
        fed = FederationConfig(rounds=2, hidden=(), client_size=RECORDS)
        out = []
        for placement, secure in cells:
            try:
                privacy = PrivacyConfig(epsilon=3.0, unit="example", adjacency=adjacency, clip=1.0,
                                        placement=placement, accountant="rdp" if placement == "distributed" else None)
                sa = SecureAggregation(bits=48, malicious=False) if secure else None
                out.append(RunSpec.of("dp_fedsgd", data, fed, privacy, run_id="r", secure=sa,
                                      options={"posterior": posterior}).to_json())
            except ConfigurationError as exc:
                out.append(("refused", str(exc)))
        specs.append(out)
    assert specs[0] == specs[1]
    assert sum(isinstance(s, str) for s in specs[0]) >= 3
    assert all(f'"{posterior}"' in s for s in specs[0] if isinstance(s, str))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, unit, channels", [("dp_fedsgd", "example", {"gradient_sum", "clip_count"}),
                                                  ("dpsgd_fedavg", "example", {"update", "clip_count"}),
                                                  ("dp_fedavg", "client", {"update", "clip_count"})])
@pytest.mark.parametrize("adjacency", ["add_remove", "replace_one"])
def test_adaptive_clipping_shows_the_server_the_same_run_on_neighbours(tmp_path, capture, capsys, adjacency, name,
                                                                        unit, channels):
    """Adaptive clipping (issue 29) as users ask for it: ``privfl run --clip adaptive --clip-quantile Q`` (local,
    central and distributed noise, with and without secure aggregation), a compare TOML's ``clip = "adaptive"``
    and ``privfl.federate(..., clip="adaptive")``: the same prepared run (DP-FedSGD's clip-count channel among the
    charged ones; DP-SGD FedAvg's counts a channel drawn inside each client's steps) or the same refusal on D and
    D', and the same
    Flower spec; a quantile without ``--clip adaptive`` exits 2 before anything runs. DP-FedAvg at client level
    (its change over the broadcast clip and its clip bit, two channels), on a client's whole data set replaced."""
    parts, test = _arrays("classification")
    worlds = {"D": parts, "D2": _neighbour(parts, unit, adjacency)}
    bound = ("--option", "update_bound=0.5") if name == "dpsgd_fedavg" else ()  # a secure sum's public range
    outcomes, paths = _cli_and_compare_outcomes(
        tmp_path, capture, capsys, worlds, name, adjacency, ("--clip", "adaptive", "--clip-quantile", "0.7", *bound),
        f'algorithms = ["{name}"]\n[overrides.{name}]\nadjacency = "{adjacency}"\npool = 1\nclip = "adaptive"\n'
        f'hidden = [8]\n', unit=unit)
    for world in worlds:
        outcomes[("federate", world)] = (_outcome(lambda: _federate(worlds[world], test, name, unit, RECORDS,
                                                                    clip="adaptive"), capture), "")
    accepted = _same_on_neighbours(outcomes)
    assert len(accepted) >= 6  # local and central, with and without secure aggregation; compare; federate
    assert all({c.split("'")[1] for c in s["channels"]} == channels for s in accepted)
    if importlib.util.find_spec("flwr") is not None:  # the Flower spec every ServerApp and ClientApp plans from
        from privfl.flower.app import RunSpec

        privacy = PrivacyConfig(epsilon=3.0, unit=unit, adjacency=adjacency, clip=1.0, clip_quantile=0.7)
        fed = FederationConfig(rounds=2, hidden=(8,), client_size=RECORDS)
        specs = [RunSpec.of(name, federated_from_arrays(w, test, task="classification", num_classes=CLASSES), fed,
                            privacy, run_id="r").to_json() for w in worlds.values()]
        assert specs[0] == specs[1] and '"clip_quantile": 0.7' in specs[0]
    # a quantile without adaptive clipping, and adaptive clipping for an algorithm without it: exit 2, no run
    for extra, says in ((("--clip-quantile", "0.7"), "clip_quantile is adaptive clipping's target quantile"),
                        (("--clip", "adaptive", "--clip-quantile", "1.5"), "clip_quantile (adaptive clipping's")):
        argv = _cli_argv(name, unit, adjacency, "central", *paths["D"], RECORDS, extra=extra)
        assert _outcome(lambda: main(argv), capture) == ("exit", 2, 0)
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err
    argv = _cli_argv("fola", "example", adjacency, "central", *paths["D"], RECORDS, extra=("--clip", "adaptive"))
    assert _outcome(lambda: main(argv), capture) == ("exit", 2, 0)
    assert "clip='adaptive' is available for ['dp_fedavg', 'dp_fedsgd', 'dpsgd_fedavg']" in capsys.readouterr().err


@pytest.mark.timeout(600)
@pytest.mark.parametrize("adjacency", ["add_remove", "replace_one"])
def test_banded_noise_shows_the_server_the_same_run_on_neighbours(tmp_path, capture, capsys, adjacency):
    """Correlated noise (issue 29, DP-FedSGD's ``bands``) as users ask for it: ``privfl run --option bands=2``
    (local, central and distributed noise, with and without secure aggregation), a compare TOML's ``bands = 2`` and
    ``privfl.federate(..., bands=2)``: the same prepared run (the gradient channel banded, its group sampled at
    2 q) or the same refusal on D and D', and the same Flower spec; bands that sample a group at a rate above 1
    exit 2 before anything runs."""
    parts, test = _arrays("classification")
    worlds = {"D": parts, "D2": _neighbour(parts, "example", adjacency)}
    outcomes, paths = _cli_and_compare_outcomes(
        tmp_path, capture, capsys, worlds, "dp_fedsgd", adjacency, ("--option", "bands=2", "--option", "lot_size=8"),
        f'algorithms = ["dp_fedsgd"]\n[overrides.dp_fedsgd]\nadjacency = "{adjacency}"\npool = 1\nbands = 2\n'
        f'lot_size = 8\n')
    for world in worlds:
        outcomes[("federate", world)] = (_outcome(lambda: _federate(worlds[world], test, "dp_fedsgd", "example",
                                                                    RECORDS, bands=2, lot_size=8, rounds=2),
                                                           capture), "")
    accepted = _same_on_neighbours(outcomes)
    assert len(accepted) >= 6  # local and central, with and without secure aggregation; compare; federate
    assert all(all("record_bands=2" in c for c in s["channels"]) for s in accepted)
    if importlib.util.find_spec("flwr") is not None:  # the Flower spec every ServerApp and ClientApp plans from
        from privfl.flower.app import RunSpec

        privacy = PrivacyConfig(epsilon=3.0, unit="example", adjacency=adjacency, clip=1.0)
        fed = FederationConfig(rounds=2, hidden=(), client_size=RECORDS)
        specs = [RunSpec.of("dp_fedsgd", federated_from_arrays(w, test, task="classification", num_classes=CLASSES),
                            fed, privacy, run_id="r", options={"bands": 2, "lot_size": 8}).to_json()
                 for w in worlds.values()]
        assert specs[0] == specs[1] and '["bands", 2]' in specs[0]
    total = RECORDS * len(parts)
    argv = _cli_argv("dp_fedsgd", "example", adjacency, "central", *paths["D"], RECORDS,
                     extra=("--option", "bands=2", "--option", f"lot_size={total}"))
    assert _outcome(lambda: main(argv), capture) == ("exit", 2, 0)
    err = capsys.readouterr().err
    assert "set bands to at most 1" in err and "Traceback" not in err
