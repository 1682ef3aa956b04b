"""A user's own ``nn.Module`` trained by FOLA (the network whose posterior is learnt), HBFL (each client's local
model, one or a list of architectures) and FedBNN (each client's Bayesian net, made from the user's layers): through
``privfl.federate`` on a small real data set, to a measured utility floor and at most the target epsilon, with the
user's module left untouched; unsupported layers refused before training with a message naming them; and the client
and server halves apart computing what one object computes."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from sklearn.datasets import load_breast_cancer
from torch import nn

import privfl
from privfl.algorithms import make_algorithm
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays
from privfl.errors import ConfigurationError
from privfl.runtime.engine import Simulation


def _breast_cancer(clients: int = 4, seed: int = 0):
    """Breast cancer (569 x 30, 2 classes): a public slice of 60 records fixes the standardisation (its mean and
    std, public statistics), the rest is split over ``clients`` clients and a test set of 120."""
    x, y = load_breast_cancer(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order].astype(np.float32), y[order].astype(np.int64)
    public = x[:60]
    x = ((x - public.mean(0)) / public.std(0)).astype(np.float32)
    test = (x[60:180], y[60:180])
    rest_x, rest_y = x[180:], y[180:]
    parts = {f"hospital_{k}": (rest_x[k::clients], rest_y[k::clients]) for k in range(clients)}
    return parts, test


def _mlp(hidden: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(30, hidden), nn.Tanh(), nn.Linear(hidden, 2))


def _deep(hidden: int = 6) -> nn.Module:
    return nn.Sequential(nn.Linear(30, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 2))


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_unchanged(module: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = module.state_dict()
    assert set(after) == set(before)
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, msg=key)
    assert all(p.grad is None for p in module.parameters()), "the user's module was trained in place"


def _assert_audited(result, target: float) -> None:
    if math.isinf(target):
        return
    assert 0 < result.epsilon <= target * (1 + 1e-9)
    assert result.audit and all(row["epsilon"] <= target * (1 + 1e-9) for row in result.audit.values())


# -- FOLA: the user's network is the one whose posterior is learnt --------------------------------------------------

#: (unit, epsilon, model, options, balanced-accuracy floor). Measured at seed 0 (seeds 0-2): 0.94 (0.89-0.94)
#: non-private, 0.81 (0.76-0.86) at client level (four clients: the noise on a client-level sum is large, so a
#: logistic regression, epsilon 10, a small precision clip), 0.87 (0.84-0.91) at record level, epsilon 3.
FOLA_CASES = [
    ("nonprivate", math.inf, _mlp, {}, 0.85),
    ("client", 10.0, lambda: nn.Linear(30, 2), {"clip": 0.1, "precision_clip": 0.01}, 0.7),
    ("example", 3.0, _mlp, {}, 0.75),
]


@pytest.mark.parametrize("unit, epsilon, build, options, floor", FOLA_CASES, ids=[c[0] for c in FOLA_CASES])
def test_fola_trains_the_users_model(unit, epsilon, build, options, floor):
    torch.manual_seed(0)
    net = build()
    before = _snapshot(net)
    clients, test = _breast_cancer()
    result = privfl.federate(net, clients, algorithm="fola", epsilon=epsilon,
                             unit=None if unit == "nonprivate" else unit, test=test, rounds=2, secure_noise=False,
                             seed=0, **options, client_size=_declared(clients))
    _assert_unchanged(net, before)
    assert result.history[-1]["metrics"]["balanced_accuracy"] >= floor
    _assert_audited(result, epsilon)
    # the trained model is the user's architecture, a copy
    assert type(result.model) is type(net) and result.model is not net
    assert [n for n, _ in result.model.named_parameters()] == [n for n, _ in net.named_parameters()]


class _Shared(nn.Module):
    """A layer used twice per forward pass (weight sharing)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(30, 30)
        self.out = nn.Linear(30, 2)

    def forward(self, x):
        return self.out(self.inner(torch.tanh(self.inner(x))))


@pytest.mark.parametrize("build, match", [
    (lambda: nn.Sequential(nn.Linear(30, 8), nn.LayerNorm(8), nn.Linear(8, 2)),
     r"nn\.Linear and nn\.Conv2d .* only; the model has parameters in layers 1 \(LayerNorm\)"),
    (lambda: nn.Sequential(nn.Linear(30, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)), r"BatchNorm1d"),
    (lambda: nn.Sequential(nn.Linear(30, 8), nn.BatchNorm1d(8, affine=False), nn.Linear(8, 2)),
     r"batch normalisation .*mixes the examples"),
    (_Shared, r"inner \(Linear\) run more than once"),
    (lambda: nn.Sequential(nn.Unflatten(1, (5, 6)), nn.Linear(6, 2), nn.Flatten(), nn.Linear(10, 2)),
     r"more than one input vector per example"),
], ids=["layernorm", "batchnorm", "batchnorm-no-affine", "shared-weights", "sequence-input"])
def test_fola_refuses_layers_its_fisher_cannot_handle_before_training(build, match):
    clients, test = _breast_cancer()
    with pytest.raises(ConfigurationError, match=match):
        privfl.federate(build(), clients, algorithm="fola", epsilon=math.inf, test=test, rounds=1)


def test_fola_refuses_frozen_parameters_other_losses_and_lists():
    net = _mlp()
    net[0].weight.requires_grad_(False)
    clients, test = _breast_cancer()
    with pytest.raises(ConfigurationError, match=r"frozen .*posterior covers every parameter"):
        privfl.federate(net, clients, algorithm="fola", epsilon=math.inf, test=test, rounds=1)
    fed, private = FederationConfig(rounds=1), PrivacyConfig(epsilon=math.inf)
    for loss in (nn.NLLLoss(), nn.CrossEntropyLoss(label_smoothing=0.1), nn.CrossEntropyLoss(weight=torch.ones(2))):
        with pytest.raises(ConfigurationError, match=r"Fisher information of the task loss"):
            make_algorithm("fola", fed, private, model=_mlp(), loss=loss)
    make_algorithm("fola", fed, private, model=_mlp(), loss=nn.CrossEntropyLoss())  # FOLA's own loss: accepted
    with pytest.raises(ConfigurationError, match=r"one torch.nn.Module or factory"):
        make_algorithm("fola", fed, private, model=[_mlp(), _mlp()])


# -- HBFL: the user's module is each client's local (personalised) model --------------------------------------------

#: (models, unit, epsilon, floor on the local models' mean balanced accuracy). Measured at seed 0 (seeds 0-2): 0.94
#: (0.93-0.94) with one module, non-private; 0.86 (0.86-0.90) with two architectures at client level, epsilon 3
#: (the local models never leave the clients; the meme, privfl's, is what the noise hits).
HBFL_CASES = [("one-module", "nonprivate", math.inf, 0.85), ("two-architectures", "client", 3.0, 0.7)]


@pytest.mark.parametrize("models, unit, epsilon, floor", HBFL_CASES, ids=[c[0] for c in HBFL_CASES])
def test_hbfl_trains_the_users_local_models(models, unit, epsilon, floor):
    torch.manual_seed(0)
    nets = _mlp() if models == "one-module" else [_mlp(), _deep()]
    before = [_snapshot(n) for n in (nets if isinstance(nets, list) else [nets])]
    clients, test = _breast_cancer()
    result = privfl.federate(nets, clients, algorithm="hbfl", epsilon=epsilon,
                             unit=None if unit == "nonprivate" else unit, test=test, rounds=2, secure_noise=False,
                             seed=0, client_size=_declared(clients))
    for net, snap in zip(nets if isinstance(nets, list) else [nets], before):
        _assert_unchanged(net, snap)
    metrics = result.history[-1]["metrics"]
    assert metrics["balanced_accuracy_local"] >= floor
    _assert_audited(result, epsilon)


def test_hbfl_local_models_are_the_users_architectures_cycled_over_clients():
    clients, test = _breast_cancer()
    data = federated_from_arrays(list(clients.values()), test, task="classification", num_classes=2,
                                 design_size=_declared(clients))
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=32, lr=0.05, hidden=(8,), seed=1)
    privacy = PrivacyConfig(epsilon=math.inf)
    alg = make_algorithm("hbfl", fed, privacy, model=[_mlp(), _deep()], meme_lr=0.01)
    sim = Simulation(alg, data, fed, privacy, executor="per_client")
    sim.run()
    assert sim.split
    shapes = [[tuple(p.shape) for p in sim.client_states[k]["client_models"].parameters()] for k in range(4)]
    assert shapes[0] == shapes[2] == [tuple(p.shape) for p in _mlp().parameters()]
    assert shapes[1] == shapes[3] == [tuple(p.shape) for p in _deep().parameters()]
    with pytest.raises(ConfigurationError, match=r"either model .* or local_models"):
        make_algorithm("hbfl", fed, privacy, model=_mlp(), local_models=["mlp"])
    bad = make_algorithm("hbfl", fed, privacy, model=nn.Linear(30, 3))
    with pytest.raises(ConfigurationError, match=r"outputs 3 values per example .* 2 classes"):
        Simulation(bad, data, fed, privacy).run()


# -- FedBNN: the user's layers become each client's Bayesian net ----------------------------------------------------

FEDBNN_OPTIONS = {"warmup_epochs": 5, "prior_steps": 10, "mc_samples": 4, "alignment_size": 40, "bbb_lr": 1e-2}
#: Measured at seed 0 (seeds 0-2): 0.91 (0.91-0.96) non-private and at record level, epsilon 3 (personalised models;
#: the noisy alignment release gets reliability near 0 at |AD| = 40, so the clients lean on their own data).
FEDBNN_CASES = [("nonprivate", math.inf, 0.8), ("example", 3.0, 0.8)]


@pytest.mark.parametrize("unit, epsilon, floor", FEDBNN_CASES, ids=[c[0] for c in FEDBNN_CASES])
def test_fedbnn_trains_the_users_per_client_nets(unit, epsilon, floor):
    torch.manual_seed(0)
    nets = [_mlp(), _deep()]
    before = [_snapshot(n) for n in nets]
    clients, test = _breast_cancer()
    result = privfl.federate(nets, clients, algorithm="fedbnn", epsilon=epsilon,
                             unit=None if unit == "nonprivate" else unit, test=test, rounds=2, secure_noise=False,
                             seed=0, **FEDBNN_OPTIONS, client_size=_declared(clients))
    for net, snap in zip(nets, before):
        _assert_unchanged(net, snap)
    assert result.history[-1]["metrics"]["balanced_accuracy"] >= floor
    _assert_audited(result, epsilon)


def test_fedbnn_makes_the_users_layers_bayesian_and_refuses_others():
    from privfl.algorithms.fedbnn import bayesian_twin
    from privfl.models import BayesLinear, bayes_modules

    net = _deep()
    twin = bayesian_twin(copy.deepcopy(net), init_rho=-3.0)
    layers = [m for _, m in bayes_modules(twin)]
    assert len(layers) == 3 and all(isinstance(m, BayesLinear) for m in layers)
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    for bayes, linear in zip(layers, linears):  # the means start at the user's weights
        torch.testing.assert_close(bayes.weight_mu.detach(), linear.weight.detach())
        torch.testing.assert_close(bayes.bias_mu.detach(), linear.bias.detach())
    assert not any(isinstance(m, nn.Linear) for m in twin.modules())
    fed, privacy = FederationConfig(rounds=1), PrivacyConfig(epsilon=math.inf)
    with pytest.raises(ConfigurationError, match=r"1 \(LayerNorm\)"):
        bayesian_twin(nn.Sequential(nn.Linear(30, 8), nn.LayerNorm(8), nn.Linear(8, 2)), -3.0)
    with pytest.raises(ConfigurationError, match=r"either model .* or architectures"):
        make_algorithm("fedbnn", fed, privacy, model=_mlp(), architectures=["mlp"])
    clients, test = _breast_cancer()
    with pytest.raises(ConfigurationError, match=r"fedbnn: .*LayerNorm"):
        privfl.federate([_mlp(), nn.Sequential(nn.Linear(30, 8), nn.LayerNorm(8), nn.Linear(8, 2))], clients,
                        algorithm="fedbnn", epsilon=math.inf, test=test, rounds=1, **FEDBNN_OPTIONS)


def test_federate_gives_fedbnr_the_model_and_says_why_it_refuses_a_classification_task():
    # fedbnr takes the user's model (its feature extractor: tests/privfl/test_fedbnr_user_extractor.py), and a
    # classification data set is refused with the reason, as are training objects it has no use for
    clients, test = _breast_cancer()
    from privfl.apps.api import own_model_algorithms

    assert "fedbnr" in own_model_algorithms()
    with pytest.raises(ConfigurationError, match=r"fedbnr is a regression algorithm"):
        privfl.federate(_mlp(), clients, algorithm="fedbnr", epsilon=math.inf, test=test)
    with pytest.raises(ConfigurationError, match=r"fedbnr does not take \['loss'\]"):
        privfl.federate(_mlp(), clients, algorithm="fedbnr", epsilon=math.inf, test=test, loss=nn.MSELoss())


# -- the halves apart -----------------------------------------------------------------------------------------------

def _declared(clients) -> int:
    """The design size these tests declare: the clients' mean size (a test's choice, fixed with the data)."""
    return round(sum(len(y) for _, y in clients.values()) / len(clients))


def _toy(sizes=(12, 12, 9, 12), dim=8, classes=3, seed=0):
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


def _small():
    return nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))


def _other():
    return nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))


def _normed():  # a local model the vectorised executor cannot batch (LayerNorm is not among its pure layers)
    return nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 3))


SPLIT = [("fola", NON_PRIVATE, {"model": _small()}), ("fola", CLIENT, {"model": _small}),
         ("fola", EXAMPLE, {"model": _small()}),
         ("hbfl", NON_PRIVATE, {"model": [_small(), _other()], "meme_lr": 0.01}),
         ("hbfl", EXAMPLE, {"model": _small, "meme_lr": 0.01}),
         ("fedbnn", NON_PRIVATE, {"model": [_small(), _other], "warmup_epochs": 2, "prior_steps": 3, "mc_samples": 2,
                                  "alignment_size": 8, "bbb_lr": 1e-2})]
SPLIT_IDS = ["fola-nonprivate", "fola-client", "fola-example", "hbfl-list", "hbfl-example", "fedbnn-list"]


def _simulation(name, privacy, options, *, split=True, executor="per_client", progress=None):
    alg = make_algorithm(name, FED, privacy, **options)
    if not split:
        alg.splittable = False
    return Simulation(alg, _toy(), FED, privacy, executor=executor, progress=progress)


def _state(sim):
    return {name: np.asarray(getattr(sim.algorithm, name)) for name in type(sim.algorithm).broadcast_state}


def _same_runs(a, b, result_a, result_b):
    for key, value in _state(b).items():
        np.testing.assert_array_equal(_state(a)[key], value, err_msg=key)
    assert [r.metrics for r in result_a.history] == [r.metrics for r in result_b.history]
    assert result_a.audit["clients"] == result_b.audit["clients"]


@pytest.mark.parametrize("name, privacy, options", SPLIT, ids=SPLIT_IDS)
def test_halves_apart_equal_one_object_with_user_models(name, privacy, options):
    """The client half, built from the same constructor arguments (the user's modules deep-copied, factories
    called on the client's seeded generator), computes what one object computes, and audits the same."""
    apart, together = _simulation(name, privacy, options), _simulation(name, privacy, options, split=False)
    result_apart, result_together = apart.run(), together.run()
    assert apart.split and not together.split
    _same_runs(apart, together, result_apart, result_together)


@pytest.mark.parametrize("name, privacy, options", [SPLIT[3], SPLIT[5]], ids=["hbfl-list", "fedbnn-list"])
def test_user_model_client_states_round_trip_through_bytes(name, privacy, options):
    """A client's own model (HBFL's local model, FedBNN's posterior), encoded as state_dict arrays after every round
    and rebuilt from the constructor arguments: the run is exactly the one that kept live objects."""
    def round_trip(record):
        for k, state in enumerate(through_bytes.client_states):
            through_bytes.client_states[k] = through_bytes.client_half.decode_state(
                k, through_bytes.client_half.encode_state(k, state))

    through_bytes = _simulation(name, privacy, options, progress=round_trip)
    kept = _simulation(name, privacy, options)
    _same_runs(through_bytes, kept, through_bytes.run(), kept.run())


@pytest.mark.parametrize("models, batched", [([_small(), _other()], True), ([_small(), _normed()], False)],
                         ids=["batchable", "layernorm-falls-back"])
def test_hbfl_vectorised_executor_with_user_models(models, batched):
    """User local models of two architectures are trained together, grouped by architecture, with the per-client
    step's results; a local model the executor cannot batch makes the round run per client, with the same result."""
    options = {"model": models, "meme_lr": 0.01}
    vectorised = _simulation("hbfl", NON_PRIVATE, options, executor="auto")
    per_client = _simulation("hbfl", NON_PRIVATE, options)
    result_v, result_p = vectorised.run(), per_client.run()
    assert vectorised.algorithm.vectorisable is batched
    for key, value in _state(per_client).items():
        np.testing.assert_allclose(_state(vectorised)[key], value, rtol=1e-4, atol=1e-6, err_msg=key)
    for rv, rp in zip(result_v.history, result_p.history):
        for metric, value in rp.metrics.items():
            assert rv.metrics[metric] == pytest.approx(value, rel=1e-4, abs=1e-6), metric


def _images(sizes=(12, 12, 9, 12), seed=0):
    rng = np.random.default_rng(seed)
    parts = [(rng.normal(size=(n, 1, 6, 6)).astype(np.float32), rng.integers(0, 3, size=n).astype(np.int64))
             for n in sizes]
    test = (rng.normal(size=(20, 1, 6, 6)).astype(np.float32), rng.integers(0, 3, size=20).astype(np.int64))
    return federated_from_arrays(parts, test, task="classification", num_classes=3, name="toy-images",
                                 design_size=round(sum(len(y) for _, y in parts) / len(parts)))


def _conv():
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(18, 3))


@pytest.mark.parametrize("privacy", [NON_PRIVATE, EXAMPLE], ids=["nonprivate", "example"])
def test_fola_user_conv_model_batched_equals_per_client(privacy):
    """A user's Conv2d + Linear network: its per-example Fisher through the hooks (per client) and through the
    vectorised executor's per-example terms agree, and so do the posteriors."""
    runs, net = [], _conv()
    for executor in ("auto", "per_client"):
        alg = make_algorithm("fola", FED, privacy, model=net)
        sim = Simulation(alg, _images(), FED, privacy, executor=executor)
        runs.append((sim, sim.run()))
    (vectorised, _), (per_client, _) = runs
    assert vectorised.algorithm.vectorisable and vectorised.vectorised
    for key, value in _state(per_client).items():
        np.testing.assert_allclose(_state(vectorised)[key], value, rtol=1e-4, atol=1e-6, err_msg=key)
