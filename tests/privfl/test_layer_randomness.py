"""One client's records never move another client's layer randomness (dropout masks). A review (session 26) found
the FedAvg family's per-client loop trained every client on torch's one global generator: one client's record count
shifted every later client's dropout masks, so at client level removing one client's data moved the others' clipped
updates (the sum by 1.87 C against a charged C). Each client's local training now draws from a child of its own
stream, in a forked torch state. Neighbouring pair through ``privfl.federate``: D and D' = org0's data removed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import privfl
from privfl.algorithms.fedavg import FedAvg


def _clients(removed: bool, k: int = 6, keep: int = 0):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(k * 30, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    clients = {f"org{i}": (x[i::k], y[i::k]) for i in range(k)}
    if removed:
        clients["org0"] = (clients["org0"][0][:keep], clients["org0"][1][:keep])
    return clients, (x[:40], y[:40])


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))


@pytest.mark.parametrize("algorithm", ["dp_fedavg", "fedprox"])
def test_one_clients_data_does_not_move_another_clients_dropout(monkeypatch, algorithm):
    seen = []
    original = FedAvg._train_one

    def spy(self, dataset, rng):
        out = original(self, dataset, rng)
        seen.append((len(dataset), out.astype(np.float64)))
        return out

    monkeypatch.setattr(FedAvg, "_train_one", spy)
    runs = {}
    for removed in (False, True):
        seen.clear()
        # dp_fedavg: org0's data removed (the client-level neighbour); fedprox (not private): org0 holds fewer records
        clients, test = _clients(removed, keep=0 if algorithm == "dp_fedavg" else 10)
        kw = dict(mu=0.1) if algorithm == "fedprox" else {}
        privfl.federate(_model(), clients, algorithm=algorithm, epsilon=3.0 if algorithm == "dp_fedavg" else None,
                        unit="client" if algorithm == "dp_fedavg" else None, clip=0.5 if algorithm == "dp_fedavg"
                        else None, rounds=1, test=test, client_size=30, lr=0.1, local_epochs=2, batch_size=8,
                        secure_noise=False, seed=1, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **kw)
        runs[removed] = [v for n, v in seen if n]  # org0 without records trains nothing at client level
    full, other = runs[False], runs[True]
    if algorithm == "dp_fedavg":
        other = [None] + other
    assert len(full) == len(other)
    for a, b in zip(full[1:], other[1:]):  # orgs 1.. hold the same data in D and D'
        np.testing.assert_array_equal(a, b)


def test_layer_seeds_follow_the_streams_state_so_a_restored_stream_draws_what_a_kept_one_does():
    """Flower's ClientApp rebuilds a client's stream each message and restores its state; a spawn counter is not part
    of that state, so a spawned child repeated itself every round there (a review, session 26). The seed is a hash
    of the state as training starts: the same in both runtimes, and new every round the stream has moved."""
    from privfl.algorithms.fedavg import own_layer_randomness

    def seed(rng):
        with own_layer_randomness(rng):
            return torch.initial_seed()

    kept = np.random.default_rng(np.random.SeedSequence(7))
    saved, kept_seeds, restored_seeds = None, [], []
    for _ in range(3):
        kept_seeds.append(seed(kept))
        kept.integers(0, 10, size=50)  # the round's shuffles
        fresh = np.random.default_rng(np.random.SeedSequence(7))
        if saved is not None:
            fresh.bit_generator.state = saved
        restored_seeds.append(seed(fresh))
        fresh.integers(0, 10, size=50)
        saved = fresh.bit_generator.state
    assert kept_seeds == restored_seeds and len(set(kept_seeds)) == 3
