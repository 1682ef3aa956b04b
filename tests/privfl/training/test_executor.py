"""The vectorised client executor gives, client by client, what the per-client loop gives (same seeds, 1e-6), for
every algorithm on the vectorised path, with and without DP; what it cannot batch runs per client."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from privfl.mechanisms.noise import NoiseSource
from privfl.algorithms import ALGORITHMS
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays
from privfl.errors import ConfigurationError
from privfl.training.stacked import VectorisedSGD, chunk_size, vectorisable
from privfl.runtime.engine import Simulation
from privfl.training.local import flat_parameters, load_flat_parameters, train_epochs


class ZeroNoise(NoiseSource):
    """No Gaussian noise, so that pre-noise values can be compared."""

    def standard_normal(self, shape):
        return np.zeros(shape)


def _federation(sizes=(12, 12, 12, 7, 7, 12), dim=10, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    parts = []
    for n in sizes:
        x = rng.normal(size=(n, dim)).astype(np.float32)
        parts.append((x, rng.integers(0, classes, size=n).astype(np.int64)))
    test = (rng.normal(size=(20, dim)).astype(np.float32), rng.integers(0, classes, size=20).astype(np.int64))
    return federated_from_arrays(parts, test, task="classification", num_classes=classes, name="toy",
                                 design_size=round(sum(len(y) for _, y in parts) / len(parts)))


FED = FederationConfig(rounds=2, local_epochs=2, batch_size=5, lr=0.1, momentum=0.9, hidden=(6,), seed=3)
NON_PRIVATE = PrivacyConfig(epsilon=math.inf, delta=1e-5)

CASES = [("fedavg", NON_PRIVATE, "local"), ("fedprox", NON_PRIVATE, "local"), ("dp_fedavg", NON_PRIVATE, "local"),
         ("dp_fedavg", PrivacyConfig(epsilon=3.0, delta=1e-5, unit="client", clip=0.5, placement="local",
                                     secure_noise=False), "local"),
         ("dp_fedavg", PrivacyConfig(epsilon=3.0, delta=1e-5, unit="client", clip=0.5, placement="central",
                                     sampling_rate=0.6, secure_noise=False), "central"),
         ("dpsgd_fedavg", NON_PRIVATE, "local"),
         # record-level DP-SGD: Poisson batches and noise drawn from each client's own seeded generators
         ("dpsgd_fedavg", PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=0.7, secure_noise=False),
          "local"),
         # declared sizes: each client its own schedule (q = B / n_k), so the round is several groups
         ("dpsgd_fedavg", PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=0.7, adjacency="replace_one",
                                        secure_noise=False), "local")]


def _run(name, privacy, executor, zero_noise=False):
    data = _federation()
    alg = ALGORITHMS[name](FED, privacy) if name != "fedprox" else ALGORITHMS[name](FED, privacy, mu=0.3)
    sim = Simulation(alg, data, FED, privacy, executor=executor)
    sim.prepare()
    if zero_noise:
        for p in sim.pipelines:
            p.noise = ZeroNoise()
    return sim


@pytest.mark.parametrize("name, privacy, placement", CASES, ids=[f"{c[0]}-{c[2]}-{c[1].private}" for c in CASES])
def test_vectorised_run_equals_the_per_client_loop(name, privacy, placement):
    a, b = _run(name, privacy, "per_client"), _run(name, privacy, "vectorised")
    assert not a.vectorised and b.vectorised
    ra, rb = a.run(), b.run()
    np.testing.assert_allclose(b.algorithm.global_params, a.algorithm.global_params, rtol=0, atol=1e-6)
    assert [h.participants for h in ra.history] == [h.participants for h in rb.history]
    assert ra.audit["clients"] == rb.audit["clients"]


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "dp_fedavg"])
def test_client_steps_send_what_client_step_sends(name):
    """Each client's release, charged in its own ledger, equals the per-client ``client_step`` release."""
    privacy = (PrivacyConfig(epsilon=3.0, delta=1e-5, unit="client", clip=0.5, secure_noise=False)
               if name == "dp_fedavg" else NON_PRIVATE)
    a, b = _run(name, privacy, "per_client", zero_noise=True), _run(name, privacy, "vectorised", zero_noise=True)
    one = {k: a.client_step(k, 0) for k in range(a.public.n_clients)}
    together = dict(b.client_steps(range(b.public.n_clients), 0))
    assert set(one) == set(together)
    for k, releases in one.items():
        for ch, r in releases.items():
            v = together[k][ch]
            np.testing.assert_allclose(v.value, r.value, rtol=0, atol=1e-6)
            assert (v.weight, v.local_noise_std, v.central_noise_std) == (r.weight, r.local_noise_std,
                                                                         r.central_noise_std)
        assert [c.event for c in a.ledger.charges(str(k))] == [c.event for c in b.ledger.charges(str(k))]


def test_executor_matches_train_epochs_across_chunks():
    """Chunks of one client (a tiny memory budget) and one chunk of all give train_epochs' models."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    start = flat_parameters(model)
    data = [(torch.randn(9, 4), torch.randint(0, 3, (9,))) for _ in range(4)]
    expected = []
    for k, (x, y) in enumerate(data):
        load_flat_parameters(model, start)
        train_epochs(model, x, y, epochs=2, batch_size=4, lr=0.2, momentum=0.5, rng=np.random.default_rng(k))
        expected.append(flat_parameters(model) - start)
    for budget in (1, 1 << 26):
        sgd = VectorisedSGD(model, epochs=2, batch_size=4, lr=0.2, momentum=0.5, memory_budget=budget)
        got = dict(sgd.train(start, data, [np.random.default_rng(k) for k in range(4)]))
        for k in range(4):
            np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=1e-6)
    assert chunk_size(model, 9, 4, memory_budget=1) == 1


def test_what_cannot_be_batched_runs_per_client():
    assert not vectorisable(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)))
    assert not vectorisable(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.1)))
    data = _federation()
    # (FOLA and HBFL: tests/privfl/training/test_executor_weight_space.py)
    with pytest.raises(ConfigurationError):
        Simulation(ALGORITHMS["fedavg"](FED, NON_PRIVATE), data, FED, NON_PRIVATE, executor="fast")


def _linear_model():
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _conv_model():  # not a linear stack: per-example gradients by vmap
    return torch.nn.Sequential(torch.nn.Unflatten(1, (1, 2, 2)), torch.nn.Conv2d(1, 2, 2), torch.nn.Tanh(),
                               torch.nn.Flatten(), torch.nn.Linear(2, 3))


@pytest.mark.parametrize("make_model, ghost", [(_linear_model, True), (_conv_model, False)])
def test_vectorised_dpsgd_matches_the_opacus_loop_client_by_client(make_model, ghost):
    """Chunks of one client and one chunk of all: each client's update equals what dpsgd_train (opacus, ghost
    clipping) gives from the same generators, with empty Poisson batches included (q small, few records), on the
    ghost path (a linear stack) and on the per-example vmap path."""
    from privfl.privacy.record_level import DPSGDSchedule, dpsgd_train
    from privfl.privacy.record_level import VectorisedDPSGD
    from privfl.training.stacked import linear_stack
    from privfl.core.public import private_torch_generator

    torch.manual_seed(0)
    model = make_model()
    assert (linear_stack(model) is not None) == ghost
    start = flat_parameters(model)
    data = [(torch.randn(n, 4), torch.randint(0, 3, (n,))) for n in (9, 3, 14, 1)]
    schedule = DPSGDSchedule.for_client(8, 2, 2)  # q = 0.25: some batches are empty
    expected = []
    for k, (x, y) in enumerate(data):
        load_flat_parameters(model, start)
        dpsgd_train(model, x, y, schedule, noise_multiplier=1.3, clip=0.4, lr=0.3, momentum=0.5,
                    rng=np.random.default_rng(k))
        expected.append(flat_parameters(model) - start)
    for budget in (1, 1 << 26):
        rngs = [np.random.default_rng(k) for k in range(4)]
        gens = [(private_torch_generator(r, False), private_torch_generator(r, False)) for r in rngs]
        ex = VectorisedDPSGD(model, schedule=schedule, noise_multiplier=1.3, clip=0.4, lr=0.3, momentum=0.5,
                             secure_noise=False, memory_budget=budget)
        got = {i: u for i, u, _ in ex.train(start, data, gens)}
        for k in range(4):
            np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=1e-6)


def test_vectorised_dpsgd_noise_has_the_calibrated_scale():
    """With nothing to learn from (zero inputs, one step), the update is the noise alone: its std per coordinate is
    lr * z * clip / expected batch, under seeded and under secure (opacus secure_mode) noise alike."""
    from privfl.privacy.record_level import DPSGDSchedule
    from privfl.privacy.record_level import VectorisedDPSGD

    model = torch.nn.Sequential(torch.nn.Linear(200, 50))
    start = np.zeros(sum(p.numel() for p in model.parameters()))
    schedule = DPSGDSchedule(sample_rate=0.5, steps_per_epoch=1, epochs=1, size=40)
    for secure in (False, True):
        ex = VectorisedDPSGD(model, schedule=schedule, noise_multiplier=2.0, clip=0.5, lr=1.0, momentum=0.0,
                             secure_noise=secure)
        gens = [(torch.Generator().manual_seed(7), torch.Generator().manual_seed(8))]
        data = [(torch.zeros(40, 200), torch.zeros(40, dtype=torch.long))]
        (_, update, stats), = list(ex.train(start, data, gens))
        # zero inputs: the weight gradients vanish; only the 50 bias gradients carry signal, so look at the weights
        weights = update[:200 * 50]
        assert np.std(weights) == pytest.approx(2.0 * 0.5 / 20.0, rel=0.03)
        assert stats["dpsgd_steps"] == 1.0
