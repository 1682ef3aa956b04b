"""The client and server halves of an algorithm meet only through messages (``privfl.algorithms.base``): the client
half is a separate instance that learns the server's state from a :class:`Broadcast` alone, so a run with the halves
apart equals one where a single object plays both, and a client half in another process, given only the broadcast's
bytes, its data and its generator, computes exactly what the in-process client step computes."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys

import numpy as np
import pytest

from privfl.algorithms import ALGORITHMS
from privfl.algorithms.base import Broadcast
from privfl.core.channels import ClippedValue, PrivatizedValue
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays
from privfl.errors import CorruptMessage
from privfl.runtime.engine import Simulation


def _federation(sizes=(12, 12, 9, 12), dim=8, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    parts = [(rng.normal(size=(n, dim)).astype(np.float32), rng.integers(0, classes, size=n).astype(np.int64))
             for n in sizes]
    test = (rng.normal(size=(20, dim)).astype(np.float32), rng.integers(0, classes, size=20).astype(np.int64))
    return federated_from_arrays(parts, test, task="classification", num_classes=classes, name="toy",
                                 design_size=round(sum(len(y) for _, y in parts) / len(parts)))


FED = FederationConfig(rounds=2, local_epochs=1, batch_size=4, lr=0.1, hidden=(5,), seed=7)
NON_PRIVATE = PrivacyConfig(epsilon=math.inf, delta=1e-5)
CLIENT = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="client", clip=0.5, placement="local", secure_noise=False)
EXAMPLE = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=0.7, secure_noise=False)
#: every algorithm whose halves are apart, in each of its privacy modes
SPLIT = [("fedavg", NON_PRIVATE), ("fedprox", NON_PRIVATE), ("dp_fedavg", NON_PRIVATE), ("dp_fedavg", CLIENT),
         ("dpsgd_fedavg", NON_PRIVATE), ("dpsgd_fedavg", EXAMPLE), ("dp_fedsgd", NON_PRIVATE),
         ("dp_fedsgd", EXAMPLE), ("fola", NON_PRIVATE), ("fola", CLIENT),
         ("fola", EXAMPLE), ("hbfl", NON_PRIVATE), ("hbfl", CLIENT), ("hbfl", EXAMPLE), ("fedbnn", NON_PRIVATE),
         ("fedbnn", CLIENT), ("fedbnn", EXAMPLE)]
IDS = [f"{name}-{p.unit if p.private else 'nonprivate'}" for name, p in SPLIT]
#: small settings for the algorithms whose defaults are the papers' (minutes of training)
OPTIONS = {"hbfl": {"meme_lr": 0.01},
           "fedbnn": {"warmup_epochs": 2, "prior_steps": 3, "mc_samples": 2, "alignment_size": 8,
                      "small_fraction": 0.0, "bbb_lr": 1e-2}}
#: algorithms whose first client step reads nothing of the broadcast (FedBNN's warm-up): checked after a run
WARM = {"fedbnn"}
#: algorithms with per-client state (``client_state``)
STATEFUL = [("hbfl", NON_PRIVATE), ("hbfl", EXAMPLE), ("fedbnn", NON_PRIVATE), ("fedbnn", CLIENT)]
STATEFUL_IDS = [f"{name}-{p.unit if p.private else 'nonprivate'}" for name, p in STATEFUL]


def _simulation(name, privacy, *, split=True, executor="per_client", progress=None):
    alg = ALGORITHMS[name](FED, privacy, **OPTIONS.get(name, {}))
    if not split:
        alg.splittable = False  # one object plays both halves (the legacy path)
    return Simulation(alg, _federation(), FED, privacy, executor=executor, progress=progress)


def _ready(name, privacy, **kw) -> tuple[Simulation, int]:
    """A prepared simulation and the round to step: 0, or for ``WARM`` algorithms the round after a full run."""
    sim = _simulation(name, privacy, **kw)
    if name in WARM:
        sim.run()
        return sim, FED.rounds
    sim.prepare()
    return sim, 0


def _state(sim):
    return {name: np.asarray(getattr(sim.algorithm, name)) for name in type(sim.algorithm).broadcast_state}


@pytest.mark.parametrize("name, privacy", SPLIT, ids=IDS)
def test_halves_apart_equal_one_object(name, privacy):
    apart, together = _simulation(name, privacy), _simulation(name, privacy, split=False)
    result_apart, result_together = apart.run(), together.run()
    assert apart.split and not together.split
    assert type(apart.algorithm).broadcast_state, f"{name} declares no broadcast"
    for key, value in _state(together).items():
        np.testing.assert_array_equal(_state(apart)[key], value, err_msg=key)
    assert [r.metrics for r in result_apart.history] == [r.metrics for r in result_together.history]
    assert result_apart.audit["clients"] == result_together.audit["clients"]


@pytest.mark.parametrize("name, privacy", SPLIT, ids=IDS)
def test_client_half_reads_only_the_broadcast(name, privacy):
    """Spoil every attribute of the server half that the broadcast does not carry, after the broadcast: the client
    steps do not change. Then spoil the broadcast state itself: they do (the test can fail)."""
    sim, rnd = _ready(name, privacy)
    broadcast = sim.broadcast(rnd)
    reference = {k: _values(sim._client_update(k, rnd)) for k in range(2)}

    sim2, _ = _ready(name, privacy)
    sim2.broadcast(rnd)
    for attr, value in list(vars(sim2.algorithm).items()):
        if isinstance(value, np.ndarray):
            setattr(sim2.algorithm, attr, np.full_like(value, np.nan))
        elif isinstance(value, (dict, set)):  # per-client state, if the server half held any
            value.clear()
    for k in range(2):
        for ch, value in _values(sim2._client_update(k, rnd)).items():
            np.testing.assert_array_equal(value, reference[k][ch], err_msg=f"client {k} channel {ch}")

    sim3, _ = _ready(name, privacy)
    spoiled = Broadcast(rnd, {key: _spoiled(value) for key, value in broadcast.values.items()})
    sim3._broadcast = spoiled
    changed = _values(sim3._client_update(0, rnd))
    assert any(not np.array_equal(changed[ch], reference[0][ch]) for ch in changed)


def _spoiled(value):
    """A broadcast value moved, staying one an honest server could send (the client half refuses others before
    training): rows of probabilities (FedBNN's consensus) rolled by one class; other arrays by 0.5; a float in [0, 1]
    (FedBNN's reliability, which can make the global probabilities irrelevant when it is 0) halfway towards 0.5 and
    shifted off it."""
    if isinstance(value, np.ndarray):
        if (value.ndim == 2 and np.all(value >= 0) and np.all(value <= 1)
                and np.allclose(value.sum(axis=1), 1.0)):
            return np.roll(value, 1, axis=1)
        return value + 0.5
    if isinstance(value, float):
        return 0.5 * value + 0.3
    return value


def _values(out) -> dict[str, np.ndarray]:
    values = {}
    for ch, v in out.values.items():
        if isinstance(v, PrivatizedValue):
            v = v.value
        if isinstance(v, ClippedValue):
            v = v.value
        values[ch] = np.asarray(v, dtype=np.float64)
    return values


_CHILD = """
import pickle, sys
import numpy as np
import torch
torch.set_num_threads(1)
from privfl.algorithms import ALGORITHMS
from privfl.algorithms.base import Broadcast
spec = pickle.load(open(sys.argv[1], "rb"))
name, options, fed, privacy, public, setup_state, dataset, rng, client = spec["args"]
server_side = ALGORITHMS[name](fed, privacy, **options)  # built here from public configuration only, never set up
setup_rng = np.random.default_rng()
setup_rng.bit_generator.state = setup_state
half = server_side.client_half(public, setup_rng)
broadcast = Broadcast.from_bytes(spec["broadcast"])
state = half.decode_state(client, spec["state"])  # the client's own state, as it kept it between rounds
out, state = half.client_update(client, broadcast, dataset, state, rng)
pickle.dump({"values": out.values, "weight": out.weight, "state": half.encode_state(client, state)},
            open(sys.argv[2], "wb"))
"""


@pytest.mark.parametrize("name, privacy", [("dp_fedavg", CLIENT), ("fola", EXAMPLE), ("hbfl", EXAMPLE),
                                           ("fedbnn", NON_PRIVATE)], ids=["dp_fedavg", "fola", "hbfl", "fedbnn"])
def test_client_half_in_another_process(tmp_path, name, privacy):
    """The client half runs in a process of its own, given the public run description, the broadcast's bytes, its
    own state's bytes, its own data and its own generator: its output and its new state are the in-process client
    step's (FedBNN after a run, so the client tunes its prior from a broadcast and continues its own posterior)."""
    sim, rnd = _ready(name, privacy)
    client = 1
    setup_state = np.random.default_rng(np.random.SeedSequence(FED.seed).spawn(5)[0]).bit_generator.state
    rng_before = pickle.loads(pickle.dumps(sim.train_rngs[client]))
    spec = {"args": (name, OPTIONS.get(name, {}), FED, privacy, sim.public, setup_state, sim.data.train_parts[client],
                     rng_before, client),
            "broadcast": sim.broadcast(rnd).to_bytes(),
            "state": sim.client_half.encode_state(client, sim.client_states[client])}
    (tmp_path / "spec.pkl").write_bytes(pickle.dumps(spec))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "spec.pkl"), str(tmp_path / "out.pkl")],
                          capture_output=True, text=True, timeout=240, env={**_env(), "MKL_CBWR": "COMPATIBLE"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = pickle.loads((tmp_path / "out.pkl").read_bytes())
    local = sim._client_update(client, rnd)
    assert child["weight"] == local.weight
    got, want = _values(type(local)(child["values"])), _values(local)
    for ch in want:
        np.testing.assert_allclose(got[ch], want[ch], rtol=0, atol=1e-6, err_msg=ch)
    got_state = _flat_state(sim, client, sim.client_half.decode_state(client, child["state"]))
    want_state = _flat_state(sim, client, sim.client_states[client])
    assert sorted(got_state) == sorted(want_state)
    for key in want_state:
        np.testing.assert_allclose(got_state[key], want_state[key], rtol=0, atol=1e-6, err_msg=key)


def _flat_state(sim, client, state) -> dict[str, np.ndarray]:
    """A client's state as flat arrays (its message values, nested mappings flattened)."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        else:
            out[prefix] = np.asarray(value)

    walk("", sim.algorithm.encode_client_state(client, state or {}))
    return out


def _env():
    import os

    return dict(os.environ)


def test_broadcast_round_trips_exactly_and_refuses_tampering():
    sim = _simulation("fola", EXAMPLE)
    sim.prepare()
    broadcast = sim.broadcast(0)
    data = broadcast.to_bytes()
    back = Broadcast.from_bytes(data)
    assert back.round == 0 and set(back.values) == set(broadcast.values)
    for key, value in broadcast.values.items():
        np.testing.assert_array_equal(back.values[key], value)
        assert back.values[key].dtype == value.dtype
    for bad in (data[:-1], data[:40] + bytes([data[40] ^ 1]) + data[41:], data + b"\0"):
        with pytest.raises(CorruptMessage):
            Broadcast.from_bytes(bad)
    with pytest.raises(CorruptMessage, match="broadcast carries"):
        sim.client_half.load(Broadcast(0, {"mean": broadcast.values["mean"]}))


def test_broadcast_shares_no_buffer_with_the_server():
    sim = _simulation("fedavg", NON_PRIVATE)
    sim.prepare()
    broadcast = sim.broadcast(0)
    before = broadcast.values["global_params"].copy()
    sim.algorithm.global_params += 1.0
    np.testing.assert_array_equal(broadcast.values["global_params"], before)


@pytest.mark.parametrize("name, privacy", [("fedavg", NON_PRIVATE), ("hbfl", NON_PRIVATE), ("hbfl", EXAMPLE)],
                         ids=["fedavg", "hbfl-nonprivate", "hbfl-example"])
def test_vectorised_executor_runs_on_the_client_half(name, privacy):
    """A round's clients trained together on the client half, each with its own state loaded and taken back,
    give exactly what one object gives on the same executor."""
    apart = _simulation(name, privacy, executor="vectorised")
    together = _simulation(name, privacy, split=False, executor="vectorised")
    result_apart, result_together = apart.run(), together.run()
    assert apart.split and apart.vectorised and together.vectorised
    for key, value in _state(together).items():
        np.testing.assert_array_equal(_state(apart)[key], value, err_msg=key)
    assert [r.metrics for r in result_apart.history] == [r.metrics for r in result_together.history]
    _assert_same_client_states(apart, together)


def _assert_same_client_states(apart, together):
    """Every client's state kept on its side (apart) equals what the one object holds for it (together)."""
    alg = together.algorithm
    for k, state in enumerate(apart.client_states):
        state = state or {}
        for name in alg.client_state:
            holder = getattr(alg, name)
            assert not getattr(apart.algorithm, name), f"the server half holds {name}"
            if isinstance(holder, set):
                assert bool(state.get(name)) == (k in holder), (k, name)
                continue
            assert (name in state) == (k in holder), (k, name)
            if name in state:
                want = alg.encode_client_state(k, {name: holder[k]})[name]
                got = alg.encode_client_state(k, {name: state[name]})[name]
                for key in (want if isinstance(want, dict) else {None: want}):
                    np.testing.assert_array_equal(got[key] if key is not None else got,
                                                  want[key] if key is not None else want, err_msg=f"{k} {name}")


@pytest.mark.parametrize("name, privacy", STATEFUL, ids=STATEFUL_IDS)
def test_local_metrics_are_computed_where_the_client_states_live(name, privacy):
    """The clients' own models are reported from the client side (the server half holds none), and the round's
    metrics, the local ones included, equal one object's."""
    apart, together = _simulation(name, privacy), _simulation(name, privacy, split=False)
    result_apart, result_together = apart.run(), together.run()
    _assert_same_client_states(apart, together)
    local = together.algorithm.local_metrics(together.data.test)
    assert local, f"{name} reports no local metrics"
    # the server half holds no client model: nothing (HBFL) or the no-model placeholder (FedBNN: uniform predictions)
    assert apart.algorithm.local_metrics(apart.data.test) != local
    assert apart.local_metrics(apart.data.test) == local
    for record in result_apart.history:
        assert set(local) <= set(record.metrics)
    assert [r.metrics for r in result_apart.history] == [r.metrics for r in result_together.history]
    # post-run diagnostics read the client side through the runtime
    view = apart.diagnostic_algorithm()
    assert view is not apart.algorithm and view.local_metrics(apart.data.test) == local
    assert view.evaluate(apart.data.test) == together.algorithm.evaluate(together.data.test)
    cal_apart = view.calibration_predictions(apart.data.test)
    cal_together = together.algorithm.calibration_predictions(together.data.test)
    for got, want in zip(cal_apart, cal_together):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name, privacy", STATEFUL, ids=STATEFUL_IDS)
def test_client_state_round_trips_through_bytes_and_the_client_continues_identically(name, privacy):
    """Every client's state is encoded (``encode_client_state``), written as a message, read back and decoded
    after every round, as a deployment keeps it between rounds: the run is exactly the one that kept live objects."""
    def round_trip(record):
        for k, state in enumerate(through_bytes.client_states):
            data = through_bytes.client_half.encode_state(k, state)
            assert isinstance(data, bytes)
            through_bytes.client_states[k] = through_bytes.client_half.decode_state(k, data)

    through_bytes = _simulation(name, privacy, progress=round_trip)
    kept = _simulation(name, privacy)
    result_bytes, result_kept = through_bytes.run(), kept.run()
    for key, value in _state(kept).items():
        np.testing.assert_array_equal(_state(through_bytes)[key], value, err_msg=key)
    assert [r.metrics for r in result_bytes.history] == [r.metrics for r in result_kept.history]
    # the decoded states are new objects holding the same values, not the kept ones
    state_bytes, state_kept = through_bytes.client_states[0], kept.client_states[0]
    assert set(state_bytes) == set(state_kept)
    models = [n for n in state_kept if hasattr(state_kept[n], "state_dict")]
    assert models and all(state_bytes[n] is not state_kept[n] for n in models)
    want, got = _flat_state(kept, 0, state_kept), _flat_state(through_bytes, 0, state_bytes)
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        assert got[key].dtype == want[key].dtype


def test_client_state_messages_refuse_tampering_and_another_clients_state():
    sim, _ = _ready("hbfl", NON_PRIVATE)
    sim.run()
    half = sim.client_half
    data = half.encode_state(2, sim.client_states[2])
    for bad in (data[:-1], data[:60] + bytes([data[60] ^ 1]) + data[61:]):
        with pytest.raises(CorruptMessage):
            half.decode_state(2, bad)
    with pytest.raises(CorruptMessage, match="client 1"):
        half.decode_state(1, data)
    assert half.decode_state(3, half.encode_state(3, None)) is None  # a client that has not stepped yet


@pytest.mark.parametrize("name, privacy", SPLIT, ids=IDS)
def test_a_server_half_restored_from_its_checkpoint_continues_exactly(name, privacy):
    """What a Flower run resumes from (``FederatedAlgorithm.checkpoint``, issue 31) is all the server half carries
    between rounds: a fresh instance set up from the public facts, given round 0's checkpoint (through its bytes, as
    the ServerApp writes it) and round 1's sums, ends where the uninterrupted server does (DP-FedSGD's server
    momentum included)."""
    from privfl.core.messages import from_bytes, to_bytes

    sim = _simulation(name, privacy)
    alg = sim.algorithm
    seen = []
    update = alg.server_update

    def recording(aggregates, rnd):
        seen.append((rnd, alg.checkpoint(), aggregates))
        update(aggregates, rnd)

    alg.server_update = recording
    sim.run()
    (_, before_0, _), (_, after_0, sums_1) = seen
    fresh = ALGORITHMS[name](FED, privacy, **OPTIONS.get(name, {}))
    fresh.setup(sim.public, np.random.default_rng(0))
    fresh.restore(from_bytes(to_bytes(after_0, "checkpoint"), "checkpoint"))
    fresh.server_update(sums_1, 1)
    final, got = alg.checkpoint(), fresh.checkpoint()
    assert set(got) == set(final)
    for key in final:
        assert _same(got[key], final[key]), key
    assert not all(_same(before_0[k], final[k]) for k in final)  # the rounds did change the server's state


def _same(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["fedbnr"])
def test_an_algorithm_whose_server_keeps_more_is_not_checkpointed(name):
    alg = ALGORITHMS[name](FED, NON_PRIVATE)
    assert not alg.checkpointable
    with pytest.raises(NotImplementedError, match="not checkpointed"):
        alg.checkpoint()
