"""What a private client sends when its local step raises, or has no records to run on (``privfl.runtime.local_step``).

A review found two ledger-false paths (D1, D2):

- D1: an exception raised inside a private client's local step, decided by one record (a target of 1e20 overflowing
  FedBNR's kernel network, a feature of 1e38 making FedBNN's posterior NaN), reached the server as an error in place
  of a release, uncharged: the error itself told the server something about the records. Now the client releases
  the data-independent fallback of every channel through its pipeline, charged and noised as usual, with the weight
  the algorithm would have sent (``FederatedAlgorithm.private_release_weight``), and only a ``LocalStepFailed``
  warning on its own side names the exception's type. In the vectorised executor one client's exception does not
  fail the others. A non-private run keeps raising.
- D2: at client level (add/remove) the README's neighbour of a client is its data removed, the client still taking
  part and contributing zero; FedBNN's and HBFL's empty clients uploaded non-zero values (the initial net's
  probabilities, a norm-C change), so a client's true displacement was up to twice the charged sensitivity. Now a
  client-level client without records releases exact zeros for every channel, without running its local step.

Every test starts at ``privfl.federate`` or the Simulation API; pre-noise values are read with seeded central
placement, as the review's probes did (the pipeline's releases are recorded, the run is not changed).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import privfl
from privfl.algorithms import ALGORITHMS, make_algorithm
from privfl.core import release as rel
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.core.release import LocalStepFailed
from privfl.data import federated_from_arrays
from privfl.errors import ConfigurationError
from privfl.runtime.engine import Simulation

PRIVATE = sorted(n for n, cls in ALGORITHMS.items() if cls.supports_privacy)
REGRESSION = {"fedbnr"}
FEATURES, CLASSES = 4, 3


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def released(monkeypatch):
    """Every release the pipelines make: (client id, round, channel, value, weight, event charged, local and central
    noise std, which release call), in order."""
    seen = []
    original = rel.ReleasePipeline.release
    calls = iter(range(10 ** 9))

    def spy(self, round, values, weight=1.0, *, mark=True):
        out = original(self, round, values, weight, mark=mark)
        events = {c.channel: c.event for c in self.ledger.charges(self.client_id) if c.round == round}
        call = next(calls)
        for name, r in out.items():
            seen.append((r.client_id, r.round, name, np.array(r.value, dtype=np.float64), r.weight, events[name],
                         r.local_noise_std, r.central_noise_std, call))
        return out

    monkeypatch.setattr(rel.ReleasePipeline, "release", spy)
    return seen


def _parts(task, sizes, seed=0):
    rng = np.random.default_rng(seed)
    parts = []
    for n in sizes:
        x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        if task == "regression":
            y = (np.sin(x[:, 0]) + 0.3 * x[:, 1]).astype(np.float32)
        else:
            y = (np.digitize(x[:, 0], [-0.4, 0.4])).astype(np.int64)
        parts.append((x, y))
    return parts


def _federation(task, parts, seed=1):
    test, public = _parts(task, (40, 30), seed)
    if task == "regression":
        return federated_from_arrays(parts, test, task=task, alignment=public, name="toy-regression")
    return federated_from_arrays(parts, test, task=task, num_classes=CLASSES, alignment=public, name="toy")


def _algorithm(name, fed, privacy):
    options = {"fedbnn": dict(alignment_size=20, warmup_epochs=1, prior_steps=2, mc_samples=2),
               "fedbnr": dict(num_samples=10, client_rows=60, kernel_rounds=1, kernel_options={"hidden": ()}),
               "fola": dict(update_bound=0.1)}.get(name, {})
    return make_algorithm(name, fed, privacy, **options)


def _built(name, fed, privacy):
    """The algorithm, or a skip where it refuses the unit (DP-SGD FedAvg gives record-level DP only)."""
    try:
        return _algorithm(name, fed, privacy)
    except ConfigurationError as exc:
        pytest.skip(f"{name} refuses this configuration: {exc}")


def _phase_algorithms(sim):
    """Each algorithm that released (a phased run's phases), by its channels' names."""
    algs = [p.algorithm for p in sim.phase_runs] if hasattr(sim, "phase_runs") else [sim.algorithm]
    return {frozenset(c.name for c in alg.channels()): alg for alg in algs}


# -- the weight a private release carries is known without the data -------------------------------------------------

WEIGHT_GRID = [(n, unit, adjacency) for n in PRIVATE for unit, adjacency in
               (("example", "replace_one"), ("example", "add_remove"), ("client", "add_remove"))
               if ALGORITHMS[n].units is None or unit in ALGORITHMS[n].units]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, unit, adjacency", WEIGHT_GRID, ids=["-".join(g) for g in WEIGHT_GRID])
def test_private_release_weight_is_what_client_update_sends(name, unit, adjacency, released):
    """The fallback's weight must be the one the algorithm sends, known without the client's data: every registered
    private algorithm's ``client_update`` sends ``private_release_weight(client)`` (record level with declared sizes,
    replace-one, included: a weight there may be the declared count)."""
    task = "regression" if name in REGRESSION else "classification"
    parts = _parts(task, (30, 40, 50))
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=10, lr=0.05, hidden=(8,), seed=0,
                           client_size=None if adjacency == "replace_one" else 40)
    privacy = PrivacyConfig(epsilon=3.0, delta=1e-5, unit=unit, adjacency=adjacency, clip=1.0, placement="central",
                            secure_noise=False)
    sim = Simulation(_built(name, fed, privacy), _federation(task, parts), fed, privacy)
    sim.run()
    by_channels = _phase_algorithms(sim)
    assert released
    groups = {}
    for cid, rnd, channel, _, weight, *_, call in released:
        groups.setdefault((cid, call), []).append((channel, weight))
    for (cid, _), items in groups.items():
        names = frozenset(c for c, _ in items)
        alg = next(a for chans, a in by_channels.items() if names <= chans)
        for channel, weight in items:
            assert weight == alg.private_release_weight(int(cid)), (name, cid, channel, weight)


# -- D2: a client-level client without records contributes exactly zero ---------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n for n in PRIVATE if ALGORITHMS[n].units is None or "client" in ALGORITHMS[n].units])
def test_a_client_level_client_without_records_releases_exact_zeros(name, released):
    """Client-level add/remove: client 0's data removed, the roster public, so client 0 still takes part. Its
    releases are exactly zero before noise (seeded central placement: the release is the pre-noise value), charged as
    the others' and at the same weight; the others' are not zero (the check is not vacuous). FedBNN released its
    initial net's probabilities (norm ~4.5 at |AD| = 20, sensitivity sqrt(20)); HBFL a norm-C change; FedBNR's kernel
    phase raised ``cannot reshape tensor of 0 elements``."""
    task = "regression" if name in REGRESSION else "classification"
    parts = _parts(task, (0, 40, 40))
    fed = FederationConfig(rounds=2, local_epochs=1, batch_size=10, lr=0.05, hidden=(8,), seed=0, client_size=40)
    privacy = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="client", adjacency="add_remove", clip=1.0,
                            placement="central", secure_noise=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LocalStepFailed)  # zeros by design, not a failure's fallback
        Simulation(_built(name, fed, privacy), _federation(task, parts), fed, privacy).run()
    mine = [r for r in released if r[0] == "0"]
    others = [r for r in released if r[0] != "0"]
    assert mine and len(mine) * 2 == len(others)
    for cid, rnd, channel, value, weight, event, local_std, central_std, _ in mine:
        assert not value.any(), f"{name}: client 0's {channel} in round {rnd} is not zero (norm " \
                                f"{np.linalg.norm(value):.4g})"
        peer = next(r for r in others if r[1:3] == (rnd, channel))
        assert (weight, event, local_std, central_std) == (peer[4], peer[5], peer[6], peer[7])
    assert any(r[3].any() for r in others)


# -- D1: a local step that raises on one record ----------------------------------------------------------------------

class Tripwire(nn.Module):
    """A user's classifier whose forward raises on an input beyond float32's comfortable range: a stand-in for a
    local step that one record makes fail (an overflow, a factorisation that is no longer positive definite)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        if bool((x.abs() > 1e30).any()):
            raise FloatingPointError("a record overflowed the local step")
        return self.linear(x)


def _clients(extreme: bool):
    parts = _parts("classification", (40, 40, 40), seed=3)
    x, y = parts[0]
    if extreme:
        x = np.concatenate([x, np.full((1, FEATURES), 1e35, np.float32)])
        y = np.concatenate([y, y[:1]])
    test = _parts("classification", (60,), seed=4)[0]
    return {"a": (x, y), "b": parts[1], "c": parts[2]}, test


def _federate(extreme, **kw):
    clients, test = _clients(extreme)
    args = dict(epsilon=3.0, classes=list(range(CLASSES)), test=test, rounds=2, local_epochs=1, client_size=40,
                batch_size=10, lr=0.05, seed=0, secure_noise=False, placement="central")
    args.update(kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = privfl.federate(Tripwire(), clients, **args)
    return result, [w for w in caught if issubclass(w.category, LocalStepFailed)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm, unit, executor", [
    ("dp_fedavg", "client", "vectorised"), ("dp_fedavg", "client", "per_client"), ("hbfl", "client", "auto")])
def test_a_private_local_step_that_raises_releases_the_fallback(algorithm, unit, executor, released):
    """D = D' + one record that makes client a's local step raise. On D the run completes as on D'; client a
    releases every round, zeros before noise (the fallback: no change; a DP-SGD-trained channel's charged with the run
    plan's planned event), with the headers, weights and charges it has on D'; only a ``LocalStepFailed`` warning on
    its own side names the exception's type. In the vectorised executor the exception (which fails the stacked step
    for every client) does not fail the others: they train one by one, and their releases are not zero."""
    kw = dict(algorithm=algorithm, unit=unit)
    if executor == "per_client":  # a user's optimizer runs the clients one after another
        kw["optimizer"] = lambda p: torch.optim.SGD(p, lr=0.05)
    runs = {}
    for world, extreme in (("D'", False), ("D", True)):
        released.clear()
        result, failures = _federate(extreme, **kw)
        runs[world] = (list(released), failures, result)
    (prime, prime_failures, prime_result), (full, failures, result) = runs["D'"], runs["D"]
    assert not prime_failures
    assert failures and all("FloatingPointError" in str(w.message) for w in failures)
    assert "overflowed" not in " ".join(str(w.message) for w in failures)  # the type, never the text
    assert len(result.history) == len(prime_result.history) == 2
    a = [r for r in full if r[0] == "0"]
    a_prime = [r for r in prime if r[0] == "0"]
    assert [r[1:3] for r in a] == [r[1:3] for r in a_prime] and {r[1] for r in a} == {0, 1}
    for got, want in zip(a, a_prime):
        assert not got[3].any(), f"client a's fallback {got[2]} in round {got[1]} is not zero"
        assert (got[4], got[5], got[6], got[7]) == (want[4], want[5], want[6], want[7])
    assert all(r[3].any() for r in full if r[0] != "0")
    assert result.audit["a"]["epsilon"] == prime_result.audit["a"]["epsilon"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm, executor", [("dpsgd_fedavg", "per_client"), ("dpsgd_fedavg", "auto"),
                                                  ("dp_fedsgd", "auto"), ("hbfl", "auto"), ("fola", "auto")])
def test_a_record_level_step_contains_the_raising_record(algorithm, executor, released):
    """At record level the fallback would be one record deciding between a release and zeros (a review, session 26:
    not covered by the ledger), so the engines contain the failure per example: the raising record adds the zero
    term, the client trains and releases as usual (never the fallback, no ``LocalStepFailed``), in both executors
    (HBFL: the local model, never released, skips its step on that lot). The exact equality of D's and D''s releases
    is ``tests/privfl/privacy/test_raising_record.py``."""
    kw = dict(algorithm=algorithm, unit="example")
    if executor == "per_client":
        kw["optimizer"] = lambda p: torch.optim.SGD(p, lr=0.05)
    released.clear()
    result, failures = _federate(True, **kw)
    assert not failures
    assert len(result.history) == 2
    a = [r for r in released if r[0] == "0"]
    assert {r[1] for r in a} == {0, 1} and all(r[3].any() for r in a)


@pytest.mark.timeout(300)
def test_a_non_private_local_step_that_raises_still_raises():
    """Nothing is private in a non-private run: the local step's exception propagates (a clear error)."""
    with pytest.raises(FloatingPointError, match="overflowed"):
        _federate(True, algorithm="fedavg", epsilon=math.inf, optimizer=lambda p: torch.optim.SGD(p, lr=0.05))
