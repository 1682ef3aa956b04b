"""The run plan (``privfl.core.plan``) is built once from public inputs, and its events are exactly what the ledger
charges: every row of every client's ledger is the event the plan fixed for that client's channel."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privfl.algorithms import ALGORITHMS
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays
from privfl.errors import ConfigurationError
from privfl.core.plan import STREAMS, RunPlan, seed_stream
from privfl.runtime.engine import Simulation
from privfl.privacy.secure import SecureAggregation


def _federation(sizes=(10, 10, 8, 10, 9), dim=6, classes=3, seed=1):
    rng = np.random.default_rng(seed)
    parts = [(rng.normal(size=(n, dim)).astype(np.float32), rng.integers(0, classes, size=n).astype(np.int64))
             for n in sizes]
    test = (rng.normal(size=(15, dim)).astype(np.float32), rng.integers(0, classes, size=15).astype(np.int64))
    return federated_from_arrays(parts, test, task="classification", num_classes=classes, name="toy",
                                 design_size=round(sum(len(y) for _, y in parts) / len(parts)))


FED = FederationConfig(rounds=3, local_epochs=1, batch_size=4, lr=0.1, hidden=(4,), seed=5)
CASES = [
    ("fedavg", PrivacyConfig(epsilon=math.inf, delta=1e-5), None),
    ("dp_fedavg", PrivacyConfig(epsilon=2.0, delta=1e-5, unit="client", clip=0.5, placement="local",
                                secure_noise=False), None),
    ("dp_fedavg", PrivacyConfig(epsilon=2.0, delta=1e-5, unit="client", clip=0.5, placement="central",
                                sampling_rate=0.6, secure_noise=False), None),
    ("dp_fedavg", PrivacyConfig(epsilon=2.0, delta=1e-5, unit="client", clip=0.5, placement="distributed",
                                secure_noise=False), "secure"),
    ("fola", PrivacyConfig(epsilon=2.0, delta=1e-5, unit="client", clip=0.5, placement="local",
                           secure_noise=False), None),
    # DP-SGD-trained channels: the event is the algorithm's own calibration, planned before any client trains
    ("dpsgd_fedavg", PrivacyConfig(epsilon=2.0, delta=1e-5, unit="example", clip=0.5, secure_noise=False), None),
    ("dpsgd_fedavg", PrivacyConfig(epsilon=2.0, delta=1e-5, unit="example", clip=0.5, adjacency="replace_one",
                                   secure_noise=False), None),
    ("fola", PrivacyConfig(epsilon=2.0, delta=1e-5, unit="example", clip=0.5, secure_noise=False), None),
    ("hbfl", PrivacyConfig(epsilon=2.0, delta=1e-5, unit="example", clip=0.5, secure_noise=False), None),
]
IDS = ["fedavg", "dp_fedavg-local", "dp_fedavg-sampled", "dp_fedavg-distributed", "fola-client", "dpsgd_fedavg",
       "dpsgd_fedavg-declared-sizes", "fola-example", "hbfl-example"]


@pytest.mark.parametrize("name, privacy, secure", CASES, ids=IDS)
def test_ledger_rows_are_the_plans_events(name, privacy, secure):
    agg = SecureAggregation(bits=20) if secure else None
    sim = Simulation(ALGORITHMS[name](FED, privacy), _federation(), FED, privacy, secure=agg)
    sim.run()
    plan = sim.plan
    assert isinstance(plan, RunPlan)
    charged = 0
    for k in range(plan.n_clients):
        planned = plan.round_events(k)
        assert planned is not None
        rows = sim.ledger.charges(str(k))
        for row in rows:
            assert row.event == planned[row.channel], (k, row.round, row.channel)
        charged += len(rows)
        rounds = {row.round for row in rows}
        for rnd in rounds:  # every channel of a charged round, no other
            assert {row.channel for row in rows if row.round == rnd} == set(planned)
    assert charged > 0


def test_plan_is_public_the_same_from_the_public_facts_alone():
    """Two plans built from the same public inputs agree, whatever the clients' data: a deployment's clients rebuild
    the server's plan from the run's public specification."""
    privacy = PrivacyConfig(epsilon=2.0, delta=1e-5, unit="client", clip=0.5, placement="local")
    plans = []
    for seed in (1, 2):  # different data, same public facts
        data = _federation(seed=seed)
        sim = Simulation(ALGORITHMS["fola"](FED, privacy), data, FED, privacy)
        sim.prepare()
        plans.append(sim.plan)
    a, b = plans
    assert a.noise_multipliers == b.noise_multipliers and a.channels == b.channels and a.placement == b.placement
    assert [a.round_events(k) for k in range(5)] == [b.round_events(k) for k in range(5)]


def test_seed_streams_match_the_spawn_order():
    root = np.random.SeedSequence(11).spawn(len(STREAMS))
    for i, name in enumerate(STREAMS):
        assert seed_stream(11, name).generate_state(4).tolist() == root[i].generate_state(4).tolist()
    clients = root[STREAMS.index("clients")].spawn(3)
    assert seed_stream(11, "clients", 2).generate_state(4).tolist() == clients[2].generate_state(4).tolist()
    with pytest.raises(ValueError, match="seed stream"):
        seed_stream(11, "nope")


def test_distributed_noise_without_secure_aggregation_is_refused():
    privacy = PrivacyConfig(epsilon=2.0, delta=1e-5, unit="client", clip=0.5, placement="distributed")
    sim = Simulation(ALGORITHMS["dp_fedavg"](FED, privacy), _federation(), FED, privacy)
    with pytest.raises(ConfigurationError, match="secure aggregation"):
        sim.prepare()


def test_a_trained_channel_without_a_planned_event_is_refused():
    """Every DP-SGD-trained channel's event is fixed by the plan before any client trains: an algorithm that plans
    none for it is refused before anything is charged."""
    from privfl.algorithms.dpsgd_fedavg import DPSGDFedAvg
    from privfl.errors import ConfigurationError

    class Unplanned(DPSGDFedAvg):
        def planned_events(self, client):
            return {}

    privacy = PrivacyConfig(epsilon=2.0, delta=1e-5, unit="example", clip=0.5, secure_noise=False)
    sim = Simulation(Unplanned(FED, privacy), _federation(), FED, privacy)
    with pytest.raises(ConfigurationError, match="no planned event"):
        sim.prepare()
    assert sim.ledger.charges("0") == []
