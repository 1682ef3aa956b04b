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
from privfl.channels import ClippedValue, PrivatizedValue
from privfl.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays
from privfl.errors import CorruptMessage
from privfl.runtime import Simulation


def _federation(sizes=(12, 12, 9, 12), dim=8, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    parts = [(rng.normal(size=(n, dim)).astype(np.float32), rng.integers(0, classes, size=n).astype(np.int64))
             for n in sizes]
    test = (rng.normal(size=(20, dim)).astype(np.float32), rng.integers(0, classes, size=20).astype(np.int64))
    return federated_from_arrays(parts, test, task="classification", num_classes=classes, name="toy")


FED = FederationConfig(rounds=2, local_epochs=1, batch_size=4, lr=0.1, hidden=(5,), seed=7)
NON_PRIVATE = PrivacyConfig(epsilon=math.inf, delta=1e-5)
CLIENT = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="client", clip=0.5, placement="local", secure_noise=False)
EXAMPLE = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=0.7, secure_noise=False)
#: every algorithm whose halves are apart, in each of its privacy modes
SPLIT = [("fedavg", NON_PRIVATE), ("fedprox", NON_PRIVATE), ("dp_fedavg", NON_PRIVATE), ("dp_fedavg", CLIENT),
         ("dpsgd_fedavg", NON_PRIVATE), ("dpsgd_fedavg", EXAMPLE), ("fola", NON_PRIVATE), ("fola", CLIENT),
         ("fola", EXAMPLE)]
IDS = [f"{name}-{p.unit if p.private else 'nonprivate'}" for name, p in SPLIT]


def _simulation(name, privacy, *, split=True, executor="per_client"):
    alg = ALGORITHMS[name](FED, privacy)
    if not split:
        alg.splittable = False  # one object plays both halves (the legacy path)
    return Simulation(alg, _federation(), FED, privacy, executor=executor)


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
    sim = _simulation(name, privacy)
    sim.prepare()
    broadcast = sim.broadcast(0)
    reference = {k: _values(sim._client_update(k, 0)) for k in range(2)}

    sim2 = _simulation(name, privacy)
    sim2.prepare()
    sim2.broadcast(0)
    for attr, value in list(vars(sim2.algorithm).items()):
        if isinstance(value, np.ndarray):
            setattr(sim2.algorithm, attr, np.full_like(value, np.nan))
    for k in range(2):
        for ch, value in _values(sim2._client_update(k, 0)).items():
            np.testing.assert_array_equal(value, reference[k][ch], err_msg=f"client {k} channel {ch}")

    sim3 = _simulation(name, privacy)
    sim3.prepare()
    spoiled = Broadcast(0, {key: (value + 0.5 if isinstance(value, np.ndarray) else value)
                            for key, value in broadcast.values.items()})
    sim3._broadcast = spoiled
    changed = _values(sim3._client_update(0, 0))
    assert any(not np.array_equal(changed[ch], reference[0][ch]) for ch in changed)


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
name, fed, privacy, public, setup_state, dataset, rng, client = spec["args"]
server_side = ALGORITHMS[name](fed, privacy)  # built here from public configuration only, never set up
setup_rng = np.random.default_rng()
setup_rng.bit_generator.state = setup_state
half = server_side.client_half(public, setup_rng)
broadcast = Broadcast.from_bytes(spec["broadcast"])
out, state = half.client_update(client, broadcast, dataset, None, rng)
pickle.dump({"values": out.values, "weight": out.weight}, open(sys.argv[2], "wb"))
"""


@pytest.mark.parametrize("name, privacy", [("dp_fedavg", CLIENT), ("fola", EXAMPLE)], ids=["dp_fedavg", "fola"])
def test_client_half_in_another_process(tmp_path, name, privacy):
    """The client half runs in a process of its own, given the public run description, the broadcast's bytes, its
    own data and its own generator: its output is bit for bit the in-process client step's."""
    sim = _simulation(name, privacy)
    sim.prepare()
    client = 1
    setup_state = np.random.default_rng(np.random.SeedSequence(FED.seed).spawn(5)[0]).bit_generator.state
    rng_before = pickle.loads(pickle.dumps(sim.train_rngs[client]))
    spec = {"args": (name, FED, privacy, sim.public, setup_state, sim.data.train_parts[client], rng_before, client),
            "broadcast": sim.broadcast(0).to_bytes()}
    (tmp_path / "spec.pkl").write_bytes(pickle.dumps(spec))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "spec.pkl"), str(tmp_path / "out.pkl")],
                          capture_output=True, text=True, timeout=240, env={**_env(), "MKL_CBWR": "COMPATIBLE"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = pickle.loads((tmp_path / "out.pkl").read_bytes())
    local = sim._client_update(client, 0)
    assert child["weight"] == local.weight
    got, want = _values(type(local)(child["values"])), _values(local)
    for ch in want:
        np.testing.assert_allclose(got[ch], want[ch], rtol=0, atol=1e-6, err_msg=ch)


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


def test_vectorised_executor_runs_on_the_client_half():
    apart = _simulation("fedavg", NON_PRIVATE, executor="vectorised")
    together = _simulation("fedavg", NON_PRIVATE, split=False, executor="vectorised")
    apart.run(), together.run()
    assert apart.split and apart.vectorised
    np.testing.assert_array_equal(apart.algorithm.global_params, together.algorithm.global_params)
