"""FOLA on regression: a Gaussian likelihood, task loss 0.5 (y - f(x))^2, whose per-example gradients give the
precision's empirical Fisher (checked against the closed form of a linear model), in every privacy mode on a real
data set (diabetes, standardised with a public slice's statistics), the record-level Fisher channels within their
sensitivity next to an extreme target, the halves apart computing what one object computes, and
``privfl.federate`` with float targets."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.datasets import load_diabetes
from torch import nn

import privfl
from privfl.algorithms.fola import FOLA
from privfl.core.channels import ClippedValue, NormClip, PreClipped, TrainedPrivately
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays
from privfl.errors import ConfigurationError
from privfl.training.fisher import HalfSquaredError, half_squared_error, per_example_fisher, per_example_task_loss
from privfl.runtime.engine import Simulation
from privfl.training.local import load_flat_parameters

FED = FederationConfig(rounds=3, local_epochs=2, batch_size=16, lr=0.05, hidden=(16,), seed=0)
FROZEN = FederationConfig(rounds=1, local_epochs=2, batch_size=16, lr=1e-12, hidden=(16,), seed=0)  # params fixed
NON_PRIVATE = PrivacyConfig()
CLIENT = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="client", clip=1.0, secure_noise=False)
EXAMPLE = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=1.0, secure_noise=False)


def _diabetes_arrays(clients: int = 3, seed: int = 0):
    """Diabetes (442 x 10, targets 25-346): a public slice of 42 records, a test set of 100, the rest (300) dealt
    over ``clients`` clients."""
    x, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order].astype(np.float32), y[order].astype(np.float32)
    public, test, rest = (x[:42], y[:42]), (x[42:142], y[42:142]), (x[142:], y[142:])
    parts = [(rest[0][k::clients], rest[1][k::clients]) for k in range(clients)]
    return parts, test, public


@pytest.fixture(scope="module")
def diabetes():
    """Features and targets standardised by the public slice's mean and std (``standardize="public"``)."""
    parts, test, public = _diabetes_arrays()
    return federated_from_arrays(parts, test, task="regression", standardize="public", public=public,
                                 name="diabetes", design_size=round(sum(len(y) for _, y in parts) / len(parts)))


def _mean_predictor_rmse(data) -> float:
    """RMSE on the test set (targets' units) of predicting the clients' mean target: the bar to clear."""
    train = np.concatenate([p.to_original_units(p.y) for p in data.train_parts])
    return float(np.sqrt(np.mean((data.test.to_original_units(data.test.y) - train.mean()) ** 2)))


def test_gaussian_loss_and_its_per_example_fisher_by_hooks_and_by_torch_func():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))
    x, y = torch.randn(12, 5), torch.randn(12) * 3.0  # scalar targets meet outputs of shape (12, 1)
    per = half_squared_error(net(x), y)
    torch.testing.assert_close(per, 0.5 * (net(x).reshape(-1) - y) ** 2)
    criterion = HalfSquaredError()
    torch.testing.assert_close(criterion(net(x), y), per.mean())
    criterion.reduction = "none"  # what opacus's DP-SGD loss wrapper sets
    torch.testing.assert_close(criterion(net(x), y), per)
    assert per_example_task_loss("regression") is half_squared_error
    for clip in (None, 0.5):
        hooks = per_example_fisher(net, x, y, clip=clip, loss_fn=half_squared_error, method="hooks")
        func = per_example_fisher(net, x, y, clip=clip, loss_fn=half_squared_error, method="func")
        torch.testing.assert_close(hooks.squared, func.squared, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(hooks.norms, func.norms, rtol=1e-5, atol=1e-7)
    assert torch.all(hooks.norms * hooks.weights.sqrt() <= 0.5 * (1 + 1e-6))  # clipped whatever the loss
    with pytest.raises(ConfigurationError, match="task"):
        per_example_task_loss("ranking")


def test_local_precision_is_the_fisher_of_the_gaussian_likelihood(diabetes):
    """For f(x) = w.x + b the per-example gradient of 0.5 (y - f)^2 is (f - y) [x, 1]: the precision of eq. 24 in
    round 1 is mean_i (f_i - y_i)^2 [x_i^2, 1], computed here in closed form."""
    alg = FOLA(FROZEN, NON_PRIVATE, model=lambda: nn.Linear(10, 1))
    alg.setup(diabetes, np.random.default_rng(0))
    assert not alg.vectorisable  # regression runs on the per-client loop
    part = diabetes.train_parts[1]
    x, y = part.x.astype(np.float64), part.y.astype(np.float64)
    w, b = alg.mean[:10], alg.mean[10]
    residual2 = (x @ w + b - y) ** 2
    closed = np.concatenate([(residual2[:, None] * x ** 2).mean(0), [residual2.mean()]])
    out = alg.client_update(1, part, 0, np.random.default_rng(1))
    np.testing.assert_allclose(out.values["precision"], closed, rtol=1e-4)
    np.testing.assert_allclose(out.values["natural_mean"], closed * alg.mean, rtol=1e-4, atol=1e-12)
    assert out.weight == len(part)
    assert out.metrics["train_loss"] == pytest.approx(0.5 * residual2.mean(), rel=1e-4)


def _frozen_example_client(data, part):
    alg = FOLA(FROZEN, EXAMPLE, update_bound=0.5)
    alg.setup(data, np.random.default_rng(0))
    alg._dpsgd_noise_multiplier = lambda schedule: 1.0  # no calibration needed: lr ~ 0 keeps the parameters
    return alg, alg.client_update(0, part, 0, np.random.default_rng(7))


def test_record_level_fisher_channels_stay_within_their_sensitivity_next_to_an_extreme_target(diabetes):
    """A record with a target 1e4 standard deviations out: its squared-error gradient is huge, and clipped to C."""
    part = diabetes.train_parts[0]
    x_extreme = np.concatenate([part.x, part.x[:1]])
    y_extreme = np.concatenate([part.y, np.array([1e4], np.float32)])
    neighbour = type(part)(x_extreme, y_extreme, part.task, part.num_classes, "with an extreme record",
                           part.target_offset, part.target_scale)
    alg, without = _frozen_example_client(diabetes, part)
    _, full = _frozen_example_client(diabetes, neighbour)
    c, bound = EXAMPLE.clip, 0.5
    fisher, fisher_nat = full.values["fisher_diag"], full.values["fisher_natural_mean"]
    assert isinstance(fisher, ClippedValue) and (fisher.bound, fisher.statistic) == (c, "squared_sum")
    assert (fisher_nat.bound, fisher_nat.statistic) == (bound * c ** 2, "sum")
    moved = fisher.value - without.values["fisher_diag"].value
    assert np.linalg.norm(moved) <= c ** 2 * (1 + 1e-5)
    # the extreme record is clipped, not dropped: its squared terms sum to ||clipped gradient||^2 = C^2
    assert moved.sum() == pytest.approx(c ** 2, rel=1e-3)
    assert np.linalg.norm(fisher_nat.value - without.values["fisher_natural_mean"].value) <= bound * c ** 2 * (1 + 1e-5)
    # the difference is that record's clipped squared gradient of 0.5 (y - f)^2, once per epoch, divided by epochs
    load_flat_parameters(alg.model, alg.mean)
    own = per_example_fisher(alg.model, torch.from_numpy(x_extreme[-1:]), torch.from_numpy(y_extreme[-1:]), clip=c,
                             loss_fn=half_squared_error).squared.double().numpy()
    np.testing.assert_allclose(moved, own, rtol=1e-3, atol=2e-6)  # float32 sums of about 100 terms


def test_a_record_whose_fisher_term_overflows_adds_zero_and_keeps_the_other_records_terms(diabetes):
    """A finite target of 1e30: its squared gradient overflows float32. That record's Fisher term is dropped on its
    own (it adds zero, within its C^2), so the client's Fisher channels stay finite and equal to its sums without
    the record; until now the overflow made the whole client's Fisher non-finite, released as the data-independent
    fallback (every other record's terms lost)."""
    part = diabetes.train_parts[0]
    extreme = type(part)(np.concatenate([part.x, part.x[:1]]), np.concatenate([part.y, np.array([1e30], np.float32)]),
                         part.task, part.num_classes, "with an overflowing record", part.target_offset,
                         part.target_scale)
    _, without = _frozen_example_client(diabetes, part)
    _, full = _frozen_example_client(diabetes, extreme)
    for name in ("fisher_diag", "fisher_natural_mean"):
        value = full.values[name].value
        assert np.all(np.isfinite(value)), name
        np.testing.assert_allclose(value, without.values[name].value, rtol=1e-4, atol=1e-5)
    # the same rule in both per-example Fisher methods: the overflowing example adds zero, the others are kept
    model = nn.Sequential(nn.Linear(10, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.from_numpy(extreme.x[-5:])
    y = torch.from_numpy(extreme.y[-5:])
    for method in ("hooks", "func"):
        full_batch = per_example_fisher(model, x, y, clip=1.0, loss_fn=half_squared_error, method=method)
        rest = per_example_fisher(model, x[:-1], y[:-1], clip=1.0, loss_fn=half_squared_error, method=method)
        assert torch.isfinite(full_batch.squared).all() and float(full_batch.weights[-1]) == 0.0, method
        torch.testing.assert_close(full_batch.squared, rest.squared, rtol=1e-5, atol=1e-7)


#: (mode, privacy, options, RMSE bound as a fraction of predicting the mean). Measured at seeds 0-2 (3 rounds,
#: diabetes, 3 clients of 100, mean predictor 71.4): non-private 0.76-0.77 (R^2 0.38-0.40); record level, epsilon 3,
#: 0.81-0.91. Client level, epsilon 3, with three clients is dominated by noise (1.17-1.88 for a linear model, clip
#: 1; 0.79-1.03 even at epsilon 1000, clip 5: the two clipped, noised sums make a noisy ratio): the bound sits well
#: above that, so there it checks that the run stays finite (an MLP at clip 0.1 diverged to NaN) and is audited.
MODES = [("nonprivate", NON_PRIVATE, {}, 0.85),
         ("client", CLIENT, {"model": lambda: nn.Linear(10, 1), "precision_clip": 1.0}, 3.0),
         ("example", EXAMPLE, {}, 0.97)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, privacy, options, bound", MODES, ids=[m[0] for m in MODES])
def test_fola_trains_a_regression_model_in_every_mode(diabetes, mode, privacy, options, bound):
    torch.manual_seed(0)
    alg = FOLA(FED, privacy, **options)
    result = Simulation(alg, diabetes, FED, privacy).run()
    metrics = result.history[-1].metrics
    assert set(metrics) >= {"rmse", "mae", "r2"} and all(math.isfinite(metrics[k]) for k in ("rmse", "mae", "r2"))
    assert metrics["rmse"] <= bound * _mean_predictor_rmse(diabetes)
    assert metrics["mae"] <= metrics["rmse"]
    assert np.all(alg.precision > 0) and np.all(np.isfinite(alg.mean))
    clips = {c.name: c.clip for c in alg.channels()}
    if mode == "nonprivate":
        assert metrics["r2"] >= 0.3
        return
    assert 0.95 * privacy.epsilon <= result.audit["max_epsilon"] <= privacy.epsilon
    if mode == "client":
        assert clips == {"natural_mean_delta": NormClip(1.0), "precision_delta": NormClip(1.0)}
    else:
        assert clips == {"mean": TrainedPrivately(), "fisher_diag": PreClipped(1.0, "squared_sum"),
                         "fisher_natural_mean": PreClipped(0.1, "sum")}


def _simulation(data, privacy, split: bool, executor: str = "per_client"):
    alg = FOLA(FED, privacy, model=lambda: nn.Sequential(nn.Linear(10, 4), nn.Tanh(), nn.Linear(4, 1)))
    if not split:
        alg.splittable = False  # one object plays both halves
    return Simulation(alg, data, FED, privacy, executor=executor)


@pytest.mark.parametrize("privacy", [NON_PRIVATE, CLIENT, EXAMPLE], ids=["nonprivate", "client", "example"])
def test_halves_apart_equal_one_object_on_regression(diabetes, privacy):
    apart, together = _simulation(diabetes, privacy, True), _simulation(diabetes, privacy, False)
    result_apart, result_together = apart.run(), together.run()
    assert apart.split and not together.split
    for key in ("mean", "precision"):
        np.testing.assert_array_equal(getattr(apart.algorithm, key), getattr(together.algorithm, key), err_msg=key)
    assert [r.metrics for r in result_apart.history] == [r.metrics for r in result_together.history]
    assert result_apart.audit["clients"] == result_together.audit["clients"]
    # the automatic executor falls back to the per-client loop for regression: the same run
    auto = _simulation(diabetes, privacy, True, executor="auto")
    auto.run()
    np.testing.assert_array_equal(auto.algorithm.mean, together.algorithm.mean)


def test_federate_runs_fola_on_float_targets():
    parts, test, public = _diabetes_arrays(clients=4)
    mu_x, sd_x, mu_y, sd_y = public[0].mean(0), public[0].std(0), public[1].mean(), public[1].std()

    def standardise(pair):
        return (pair[0] - mu_x) / sd_x, (pair[1] - mu_y) / sd_y

    clients = {f"clinic_{k}": standardise(p) for k, p in enumerate(parts)}
    test_std = standardise(test)
    net = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 1))
    result = privfl.federate(net, clients, algorithm="fola", epsilon=math.inf, test=test_std, rounds=3,
                             local_epochs=2, batch_size=16, lr=0.05, seed=0)
    metrics = result.history[-1]["metrics"]
    assert set(metrics) >= {"rmse", "mae", "r2"}
    # standardised units: predicting the public mean (0) scores 0.90 here; measured 0.65-0.67 (R^2 0.38-0.43) at
    # seeds 0-2
    assert metrics["rmse"] <= 0.85 * float(np.sqrt(np.mean((test_std[1] - 0.0) ** 2)))
    assert metrics["r2"] >= 0.3
    assert type(result.model) is nn.Sequential and result.model is not net
    with pytest.raises(ConfigurationError, match=r"Gaussian likelihood.*leave loss out"):
        privfl.federate(net, clients, algorithm="fola", epsilon=math.inf, test=test_std, rounds=1,
                        loss=nn.CrossEntropyLoss())
