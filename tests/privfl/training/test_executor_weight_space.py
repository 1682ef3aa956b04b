"""The vectorised executor for the weight-space Bayesian algorithms (FOLA, HBFL): a round's clients trained together
give, with the same seeds, the global posterior the per-client loop gives, in every privacy mode that takes the
vectorised path; what cannot be batched falls back to the per-client loop by itself.

Tolerances. Both paths run the same float32 arithmetic except for the order of a few reductions (a batch gradient as
the sum of per-example gradients, the per-example Fisher summed by a batched matmul, Adam's and SGD's updates on
stacked tensors): about one float32 ulp (6e-8 relative) per step, a few steps per round, two rounds. Means and
natural parameters are O(1), so they are compared with ``atol=1e-6``. A precision is 1 / std^2 (HBFL's tempered by
T) or a Fisher sum over records: its relative error is what is bounded, so precisions are compared with
``rtol=1e-6`` (plus an ``atol`` of 1e-6 of the largest entry, for entries that are rounding noise around zero).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from privfl.algorithms import ALGORITHMS
from privfl.algorithms.fola import FOLA
from privfl.algorithms.hbfl import HBFL, VectorisedHBFL
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays
from privfl.errors import ConfigurationError
from privfl.privacy.record_level import VectorisedDPSGD, clip_factor
from privfl.training.stacked import PerExampleGradients, VectorisedOnlineFisher, adam_step, sgd_step
from privfl.training.fisher import per_example_fisher
from privfl.runtime.engine import Simulation
from privfl.training.local import flat_parameters, load_flat_parameters


def _federation(sizes=(12, 12, 7, 12, 7), shape=(10,), classes=3, seed=0):
    """Two record counts, so the online and non-private steps train in two groups of equal batch schedules."""
    rng = np.random.default_rng(seed)
    parts = []
    for n in sizes:
        parts.append((rng.normal(size=(n, *shape)).astype(np.float32),
                      rng.integers(0, classes, size=n).astype(np.int64)))
    test = (rng.normal(size=(20, *shape)).astype(np.float32), rng.integers(0, classes, size=20).astype(np.int64))
    return federated_from_arrays(parts, test, task="classification", num_classes=classes, name="toy",
                                 design_size=round(sum(len(y) for _, y in parts) / len(parts)))


FED = FederationConfig(rounds=2, local_epochs=2, batch_size=5, lr=0.1, momentum=0.9, hidden=(6,), seed=3)
NON_PRIVATE = PrivacyConfig(epsilon=math.inf, delta=1e-5)
CLIENT = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="client", clip=0.5, secure_noise=False)
EXAMPLE = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=0.7, secure_noise=False)
# declared (public) record counts: each client its own DP-SGD schedule, so a round is several vectorised groups
EXAMPLE_DECLARED = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=0.7, adjacency="replace_one",
                                 secure_noise=False)

CASES = [("fola", NON_PRIVATE, {}), ("fola", CLIENT, {}), ("fola", EXAMPLE, {}), ("fola", EXAMPLE_DECLARED, {}),
         ("hbfl", NON_PRIVATE, {"meme_lr": 0.01}), ("hbfl", CLIENT, {"meme_lr": 0.01}),
         ("hbfl", EXAMPLE, {"meme_lr": 0.01}), ("hbfl", EXAMPLE_DECLARED, {"meme_lr": 0.01}),
         ("hbfl", NON_PRIVATE, {"meme_lr": 0.3, "meme_optimizer": "sgd"}),
         ("hbfl", EXAMPLE, {"meme_lr": 0.3, "meme_optimizer": "sgd"})]
IDS = ["fola-none", "fola-client", "fola-example", "fola-example-declared", "hbfl-none", "hbfl-client",
       "hbfl-example", "hbfl-example-declared", "hbfl-sgd-none", "hbfl-sgd-example"]


def _sim(name, privacy, kwargs, executor, data=None, fed=FED):
    alg = ALGORITHMS[name](fed, privacy, **kwargs)
    return Simulation(alg, data if data is not None else _federation(), fed, privacy, executor=executor)


def _posterior(alg):
    if isinstance(alg, FOLA):
        return alg.mean, alg.precision
    return alg.global_mean, alg.global_precision


def _assert_same_run(a, b):
    ra, rb = a.run(), b.run()
    mean_a, prec_a = _posterior(a.algorithm)
    mean_b, prec_b = _posterior(b.algorithm)
    np.testing.assert_allclose(mean_b, mean_a, rtol=0, atol=1e-6)
    np.testing.assert_allclose(prec_b, prec_a, rtol=1e-6, atol=1e-6 * np.abs(prec_a).max())
    assert [h.participants for h in ra.history] == [h.participants for h in rb.history]
    assert ra.audit["clients"] == rb.audit["clients"]  # every client charged the same events in its own ledger
    return ra, rb


@pytest.mark.parametrize("name, privacy, kwargs", CASES, ids=IDS)
def test_vectorised_run_equals_the_per_client_loop(name, privacy, kwargs):
    a, b = _sim(name, privacy, kwargs, "per_client"), _sim(name, privacy, kwargs, "vectorised")
    a.prepare()
    b.prepare()
    assert not a.vectorised and b.vectorised
    _assert_same_run(a, b)
    if name == "hbfl":  # the client-held local models (never released) are written back to their clients
        _assert_same_local_models(a, b)


def _local_models(sim) -> dict:
    """HBFL's local models, kept on the clients' side (``Simulation.client_states``) with the halves apart."""
    assert sim.split and not sim.algorithm.client_models
    return {k: state["client_models"] for k, state in enumerate(sim.client_states)
            if state and "client_models" in state}


def _assert_same_local_models(a, b):
    models_a, models_b = _local_models(a), _local_models(b)
    assert sorted(models_a) == sorted(models_b) == list(range(len(a.client_states)))
    for k, model in models_a.items():
        assert type(model) is type(models_b[k])
        np.testing.assert_allclose(flat_parameters(models_b[k]), flat_parameters(model), rtol=0, atol=1e-6)


def test_hbfl_local_models_of_several_architectures_train_together():
    """Local models cycle over an MLP and a conv net (one vectorised group per architecture), on image data, with
    DP-SGD on the meme: each client's local model and the global posterior equal the per-client loop's."""
    data = _federation(sizes=(9, 9, 9, 9), shape=(1, 8, 8))
    fed = FederationConfig(rounds=2, local_epochs=1, batch_size=4, lr=0.1, momentum=0.5, hidden=(5,), seed=1)
    kwargs = {"local_models": ("mlp", "lenet5"), "meme_lr": 0.01}
    a = _sim("hbfl", EXAMPLE, kwargs, "per_client", data, fed)
    b = _sim("hbfl", EXAMPLE, kwargs, "vectorised", data, fed)
    _assert_same_run(a, b)
    _assert_same_local_models(a, b)


@pytest.mark.parametrize("name, privacy, kwargs, executor, attribute", [
    ("fola", NON_PRIVATE, {}, VectorisedOnlineFisher, "chunk"),
    ("fola", EXAMPLE, {}, VectorisedDPSGD, "chunk"),
    ("hbfl", EXAMPLE, {"meme_lr": 0.01}, VectorisedHBFL, "_chunk")], ids=["fola-none", "fola-example", "hbfl-example"])
def test_chunks_of_one_client_give_what_one_chunk_gives(monkeypatch, name, privacy, kwargs, executor, attribute):
    """The chunk size (memory budget) changes nothing: one client per chunk equals one chunk of all (and so the
    per-client loop, above); FOLA's Fisher sums follow their chunk."""
    runs = []
    for one in (False, True):
        if one:
            monkeypatch.setattr(executor, attribute, lambda self, *args: 1)
        sim = _sim(name, privacy, kwargs, "vectorised")
        sim.run()
        runs.append(_posterior(sim.algorithm))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(runs[1][1], runs[0][1], rtol=1e-6, atol=1e-6 * np.abs(runs[0][1]).max())


class _OwnOnlineStep(FOLA):
    """A FOLA whose online local step is its own: the executor cannot know it, so it runs per client."""

    def _train_online(self, model, x, y, rng):
        return super()._train_online(model, x, y, rng)


def test_what_cannot_be_batched_falls_back_to_the_per_client_loop():
    data = _federation()
    # FOLA with a local step of a subclass's own
    alg = _OwnOnlineStep(FED, NON_PRIVATE)
    sim = Simulation(alg, data, FED, NON_PRIVATE)
    sim.prepare()
    assert not alg.vectorisable and not sim.vectorised
    with pytest.raises(ConfigurationError):
        Simulation(_OwnOnlineStep(FED, NON_PRIVATE), data, FED, NON_PRIVATE, executor="vectorised").vectorised
    # HBFL whose meme is a Bayesian conv net (the functional meme covers BayesLinear stacks only)
    images = _federation(sizes=(9, 9, 9), shape=(1, 8, 8))
    conv_fed = FederationConfig(rounds=1, local_epochs=1, batch_size=4, lr=0.1, model="lenet5", seed=2)
    hbfl = HBFL(conv_fed, EXAMPLE, meme_lr=0.01)
    sim = Simulation(hbfl, images, conv_fed, EXAMPLE)
    sim.prepare()
    assert not hbfl.vectorisable and not sim.vectorised
    # ... and client_updates, asked directly, is then the per-client loop itself, draw for draw
    ref = HBFL(conv_fed, EXAMPLE, meme_lr=0.01)
    ref.setup(images, np.random.default_rng(0))
    hbfl.setup(images, np.random.default_rng(0))
    parts = images.train_parts
    expected = {k: ref.client_update(k, parts[k], 0, np.random.default_rng(k)) for k in range(3)}
    got = dict(hbfl.client_updates([0, 1, 2], list(parts), 0, [np.random.default_rng(k) for k in range(3)]))
    for k in range(3):
        for ch in ("natural_mean", "precision"):
            np.testing.assert_array_equal(got[k].values[ch].value, expected[k].values[ch].value)


# --------------------------------------------------------------------------------------------- executor pieces


def _linear_model():
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _conv_model():  # not a linear stack: per-example gradients by vmap
    return torch.nn.Sequential(torch.nn.Unflatten(1, (1, 2, 2)), torch.nn.Conv2d(1, 2, 2), torch.nn.Tanh(),
                               torch.nn.Flatten(), torch.nn.Linear(2, 3))


@pytest.mark.parametrize("make_model", [_linear_model, _conv_model], ids=["ghost", "vmap"])
def test_per_example_squares_are_the_clipped_fisher_of_privfl_fisher(make_model):
    """Per client, the weighted sum of clipped squared per-example gradients (padding rows weighted 0) is
    ``privfl.training.fisher.per_example_fisher`` on that client's real rows."""
    torch.manual_seed(0)
    model = make_model()
    sizes = (5, 2, 0)
    xs = [torch.randn(n, 4) for n in sizes]
    ys = [torch.randint(0, 3, (n,)) for n in sizes]
    c, width = len(sizes), max(sizes)
    xb, yb, weight = torch.zeros(c, width, 4), torch.zeros(c, width, dtype=torch.long), torch.zeros(c, width)
    for r, (x, y) in enumerate(zip(xs, ys)):
        xb[r, :len(x)], yb[r, :len(y)], weight[r, :len(x)] = x, y, 1.0
    params = {n: p.detach().unsqueeze(0).repeat(c, *([1] * p.dim())) for n, p in model.named_parameters()}
    terms = PerExampleGradients(model)(params, xb, yb, weight)
    got = terms.flat(terms.square_sums(clip_factor(terms.norms2(), 0.3).pow(2) * weight))
    for r, (x, y) in enumerate(zip(xs, ys)):
        expected = (per_example_fisher(model, x, y, clip=0.3).squared if len(x)
                    else torch.zeros(got.shape[1]))
        torch.testing.assert_close(got[r], expected, rtol=1e-5, atol=1e-7)


def test_adam_step_is_torch_adam():
    torch.manual_seed(1)
    p = torch.randn(3, 4)
    grads = [torch.randn(3, 4) for _ in range(5)]
    torch_p = [torch.nn.Parameter(p[r].clone()) for r in range(3)]
    opts = [torch.optim.Adam([q], lr=0.01) for q in torch_p]
    stacked, state = {"w": p.clone()}, None
    for g in grads:
        for r, (q, opt) in enumerate(zip(torch_p, opts)):
            q.grad = g[r].clone()
            opt.step()
        state = adam_step(stacked, {"w": g}, state, lr=0.01)
    for r in range(3):
        torch.testing.assert_close(stacked["w"][r], torch_p[r].detach(), rtol=0, atol=1e-7)


def test_masked_sgd_step_skips_a_client_as_a_skipped_optimizer_step_does():
    """Client 0 steps every time; client 1 skips the first two steps (an empty batch), so its momentum starts at
    its third: each equals torch's SGD stepped only when active."""
    torch.manual_seed(2)
    grads = [torch.randn(2, 3) for _ in range(4)]
    active = [torch.tensor([True, False]), torch.tensor([True, False]), torch.tensor([True, True]),
              torch.tensor([True, True])]
    start = torch.randn(2, 3)
    ref = [torch.nn.Parameter(start[r].clone()) for r in range(2)]
    opts = [torch.optim.SGD([q], lr=0.1, momentum=0.9) for q in ref]
    stacked, buf = {"w": start.clone()}, None
    for g, on in zip(grads, active):
        for r in range(2):
            if on[r]:
                ref[r].grad = g[r].clone()
                opts[r].step()
        buf = sgd_step(stacked, {"w": g}, buf, lr=0.1, momentum=0.9, active=on)
    for r in range(2):
        torch.testing.assert_close(stacked["w"][r], ref[r].detach(), rtol=0, atol=1e-7)


def test_online_fisher_step_equals_fola_online_training_on_a_conv_net():
    """The vmap (non-ghost) path of VectorisedOnlineFisher against FOLA's own per-client online step."""
    torch.manual_seed(3)
    model = _conv_model()
    start = flat_parameters(model)
    precision = np.random.default_rng(0).uniform(0.1, 2.0, size=start.size)
    data = [(torch.randn(7, 4), torch.randint(0, 3, (7,))) for _ in range(3)]
    fed = FederationConfig(rounds=1, local_epochs=2, batch_size=3, lr=0.2, momentum=0.5, seed=0)
    fola = FOLA(fed, NON_PRIVATE, prior_weight=0.7)
    fola.mean, fola.precision = start, precision
    expected = []
    for k, (x, y) in enumerate(data):
        load_flat_parameters(model, start)
        loss, fisher = fola._train_online(model, x, y, np.random.default_rng(k))
        expected.append((flat_parameters(model), fisher * fed.local_epochs, loss))
    ex = VectorisedOnlineFisher(model, epochs=2, batch_size=3, lr=0.2, momentum=0.5, prior_weight=0.7)
    got = {i: (m, f, loss) for i, m, f, loss in ex.train(start, precision, data,
                                                         [np.random.default_rng(k) for k in range(3)])}
    for k in range(3):
        np.testing.assert_allclose(got[k][0], expected[k][0], rtol=0, atol=1e-6)
        np.testing.assert_allclose(got[k][1], expected[k][1].numpy(), rtol=1e-5, atol=1e-7)
        assert got[k][2] == pytest.approx(expected[k][2], rel=1e-6)


@pytest.mark.parametrize("name", ["fola", "hbfl"])
def test_secure_noise_runs_vectorised_and_charges_what_the_loop_charges(name):
    """With OS-entropy noise and coins (the default of a private run) the runs cannot be compared value by value,
    but each client's ledger holds the same events, and the posterior is finite."""
    secure = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=0.7)
    assert secure.secure_noise
    kwargs = {"meme_lr": 0.01} if name == "hbfl" else {}
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=5, lr=0.1, momentum=0.9, hidden=(6,), seed=3)
    a, b = (_sim(name, secure, kwargs, executor, fed=fed) for executor in ("per_client", "vectorised"))
    ra, rb = a.run(), b.run()
    assert b.vectorised
    assert ra.audit["clients"] == rb.audit["clients"]
    mean, precision = _posterior(b.algorithm)
    assert np.all(np.isfinite(mean)) and np.all(precision > 0)
    assert not np.allclose(mean, _posterior(a.algorithm)[0], rtol=0, atol=1e-9)  # the noise is not the seeded one
