"""The server's Gaussian product from weighted sums: equals FedAvg with equal precisions, matches the direct
formula, is invariant to a common precision scale, floors noisy precisions and folds known noise variance; the
empirical-Bayes shrinkage of noisy coordinates by their known noise."""

import math

import numpy as np
import pytest

from privfl.core.aggregation import Aggregate, weighted_sums
from privfl.algorithms.gaussian_product import (GaussianProduct, combine, gaussian_product, natural_parameters,
                                                product_of_gaussians, shrink_by_known_noise)
from privfl.core.channels import Channel, Unclipped
from privfl.errors import ConfigurationError
from privfl.core.release import Release

DIM = 6
CHANNELS = {name: Channel(name, (DIM,), unit="client", clip=Unclipped()) for name in ("natural_mean", "precision")}


def releases(means, precisions, weights):
    out = []
    for k, (m, p, w) in enumerate(zip(means, precisions, weights)):
        eta, lam = natural_parameters(m, p)
        out += [Release(str(k), 0, "natural_mean", eta, w, 0.0, 0.0, f"r/{k}/nm"),
                Release(str(k), 0, "precision", lam, w, 0.0, 0.0, f"r/{k}/p")]
    return out


def server(means, precisions, weights, **kw):
    agg = weighted_sums(releases(means, precisions, weights), CHANNELS)
    return gaussian_product(agg["natural_mean"], agg["precision"], precision_floor=kw.pop("floor", 1e-9), **kw)


@pytest.mark.parametrize("seed", range(3))
def test_equal_precisions_give_fedavg(seed):
    rng = np.random.default_rng(seed)
    means = [rng.normal(size=DIM) for _ in range(4)]
    shared = rng.uniform(0.1, 5.0, size=DIM)
    weights = rng.integers(10, 500, size=4).astype(float)
    post = server(means, [shared] * 4, weights)
    fedavg = sum(w * m for w, m in zip(weights, means)) / weights.sum()
    np.testing.assert_allclose(post.mean, fedavg, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(post.precision, shared, rtol=1e-12)
    assert post.floored == 0


def test_matches_the_direct_formula_and_weights_by_precision():
    rng = np.random.default_rng(7)
    means = [rng.normal(size=DIM) for _ in range(3)]
    precs = [rng.uniform(0.01, 10.0, size=DIM) for _ in range(3)]
    weights = np.array([100.0, 300.0, 50.0])
    q = weights / weights.sum()
    lam = sum(qk * p for qk, p in zip(q, precs))
    mu = sum(qk * p * m for qk, p, m in zip(q, precs, means)) / lam
    for post in (server(means, precs, weights), product_of_gaussians(means, precs, weights)):
        np.testing.assert_allclose(post.mean, mu, rtol=1e-12)
        np.testing.assert_allclose(post.precision, lam, rtol=1e-12)
        np.testing.assert_allclose(post.natural_mean, mu * lam, rtol=1e-12)
    # a client far more certain about a coordinate pulls the mean to itself
    precs[0][0] = 1e6
    assert server(means, precs, weights).mean[0] == pytest.approx(means[0][0], rel=1e-3)


def test_a_common_precision_scale_cancels_in_the_mean():
    """HBFL's temperature T scales every precision alike; the aggregated mean must not move."""
    rng = np.random.default_rng(3)
    means = [rng.normal(size=DIM) for _ in range(3)]
    precs = [rng.uniform(0.1, 2.0, size=DIM) for _ in range(3)]
    base = server(means, precs, [1.0, 2.0, 3.0])
    scaled = server(means, [1e4 * p for p in precs], [1.0, 2.0, 3.0])
    np.testing.assert_allclose(scaled.mean, base.mean, rtol=1e-10)
    np.testing.assert_allclose(scaled.precision, 1e4 * base.precision, rtol=1e-10)


def test_noisy_precisions_are_floored_and_the_mean_stays_finite():
    eta = np.array([0.5, -0.2, 0.3, 1.0])
    lam = np.array([2.0, -0.5, 1e-9, 0.0])
    post = combine(eta, lam, precision_floor=0.1)
    np.testing.assert_allclose(post.precision, [2.0, 0.1, 0.1, 0.1])
    np.testing.assert_allclose(post.mean, [0.25, -2.0, 3.0, 10.0])
    assert post.floored == 3 and np.all(np.isfinite(post.mean))
    per_coordinate = combine(eta, lam, precision_floor=np.array([0.1, 0.2, 0.3, 0.4]))
    np.testing.assert_allclose(per_coordinate.precision, [2.0, 0.2, 0.3, 0.4])


def test_known_noise_variance_is_folded_into_the_precision():
    eta, lam = np.array([1.0, 2.0]), np.array([4.0, 1.0])
    quiet = combine(eta, lam, precision_floor=1e-3, natural_noise_std=0.5, precision_noise_std=0.2)
    np.testing.assert_allclose(quiet.precision, lam)  # without fold_noise nothing changes
    folded = combine(eta, lam, precision_floor=1e-3, natural_noise_std=0.5, precision_noise_std=0.2, fold_noise=True)
    mu = eta / lam
    var = (0.5 ** 2 + mu ** 2 * 0.2 ** 2) / lam ** 2
    np.testing.assert_allclose(folded.mean, mu)
    np.testing.assert_allclose(folded.precision, 1.0 / (1.0 / lam + var))
    assert np.all(folded.precision < lam)
    # an Aggregate's noise std is for the sum: gaussian_product divides it by the total weight
    agg_nm = Aggregate("natural_mean", eta * 10, 10.0, 3, 5.0)
    agg_p = Aggregate("precision", lam * 10, 10.0, 3, 2.0)
    np.testing.assert_allclose(gaussian_product(agg_nm, agg_p, precision_floor=1e-3, fold_noise=True).precision,
                               folded.precision)


def test_a_reference_mean_regularises_the_division_by_a_noisy_precision():
    eta, lam, ref = np.array([1e-3, 2.0]), np.array([1e-4, 1.0]), np.array([0.5, 0.5])
    plain = combine(eta, lam, precision_floor=1e-6, precision_noise_std=0.05)
    np.testing.assert_allclose(plain.mean, eta / lam)  # without a reference: the raw (wild) ratio
    reg = combine(eta, lam, precision_floor=1e-6, precision_noise_std=0.05, reference_mean=ref)
    np.testing.assert_allclose(reg.mean, ref + lam * (eta - lam * ref) / (lam ** 2 + 0.05 ** 2))
    assert abs(reg.mean[0] - 0.5) < 0.01 < abs(plain.mean[0] - 0.5)  # mostly-noise precision: stays near ref
    assert reg.mean[1] == pytest.approx(2.0, rel=3e-3)  # well-measured precision: the product mean
    exact = combine(eta, lam, precision_floor=1e-6, reference_mean=ref)  # no noise: the reference is not used
    np.testing.assert_allclose(exact.mean, eta / lam)
    per_coordinate = combine(eta, lam, precision_floor=1e-6, precision_noise_std=np.array([0.05, 0.0]),
                             reference_mean=ref)
    assert per_coordinate.mean[1] == pytest.approx(2.0)


def test_misuse_is_refused():
    a = Aggregate("natural_mean", np.ones(2), 2.0, 2, 0.0)
    b = Aggregate("precision", np.ones(2), 3.0, 2, 0.0)
    with pytest.raises(ConfigurationError, match="total weights"):
        gaussian_product(a, b, precision_floor=0.1)
    with pytest.raises(ConfigurationError, match="Aggregate"):
        gaussian_product(np.ones(2), b, precision_floor=0.1)
    with pytest.raises(ConfigurationError, match="precision_floor"):
        combine(np.ones(2), np.ones(2), precision_floor=0.0)
    with pytest.raises(ConfigurationError, match="non-finite"):
        combine(np.array([np.nan, 1.0]), np.ones(2), precision_floor=0.1)
    with pytest.raises(ConfigurationError):
        natural_parameters(np.ones(2), np.array([1.0, -1.0]))
    assert isinstance(product_of_gaussians([np.ones(2)], [np.ones(2)]), GaussianProduct)


def test_shrinkage_by_known_noise_is_exact_without_noise_and_pools_pure_noise():
    x = np.array([1.0, 2.0, 4.0, -3.0, 0.5])
    groups = [(0, 3), (3, 5)]
    for centre in ("group_mean", "zero"):
        est, var = shrink_by_known_noise(x, 0.0, groups, centre=centre)
        np.testing.assert_array_equal(est, x)
        np.testing.assert_array_equal(var, 0.0)
    # a noise std far above the spread: every coordinate becomes its group's centre, with no spread left
    est, var = shrink_by_known_noise(x, 1e3, groups, centre="group_mean")
    np.testing.assert_allclose(est, [7 / 3] * 3 + [-1.25] * 2)
    np.testing.assert_array_equal(var, 0.0)
    est, _ = shrink_by_known_noise(x, 1e3, groups, centre="zero")
    np.testing.assert_array_equal(est, 0.0)
    # a constant group without noise is its own value (no 0/0)
    est, var = shrink_by_known_noise(np.full(4, 3.0), 0.0, [(0, 4)])
    np.testing.assert_array_equal(est, 3.0)


@pytest.mark.parametrize("centre,offset", [("group_mean", 5.0), ("zero", 0.0)])
def test_shrinkage_by_known_noise_beats_the_raw_observations_and_matches_the_moments(centre, offset):
    rng = np.random.default_rng(3)
    n, tau, sigma = 20_000, 0.5, 1.0
    truth = offset + tau * rng.normal(size=n)
    noise_std = sigma * rng.uniform(0.5, 1.5, size=n)  # per-coordinate known stds
    observed = truth + noise_std * rng.normal(size=n)
    est, var = shrink_by_known_noise(observed, noise_std, [(0, n)], centre=centre)
    raw_mse, eb_mse = np.mean((observed - truth) ** 2), np.mean((est - truth) ** 2)
    assert eb_mse < 0.5 * raw_mse  # tau^2 / (tau^2 + s^2) ~ 0.2 of the noise variance kept
    # the posterior variance it reports is the error it makes, on average (moments within sampling error)
    assert np.mean(var) == pytest.approx(eb_mse, rel=0.05)
    # a margin of two standard errors lowers the spread estimate: a little more shrinkage, still better
    est2, _ = shrink_by_known_noise(observed, noise_std, [(0, n)], centre=centre, margin=2.0)
    assert np.mean((est2 - truth) ** 2) < 0.5 * raw_mse
    assert np.mean(np.abs(est2 - est)) < 0.1 * np.mean(np.abs(est - offset))  # ~2 SE / tau^2 ~ 9% less gain


def test_shrinkage_margin_leaves_pure_noise_at_the_centre():
    """On pure noise the plain moment estimate keeps a fluctuation about half the time; two standard errors of
    margin keep a group at its centre in all but a few per cent of draws (one-sided normal tail: ~2.3%)."""
    rng = np.random.default_rng(11)
    kept = plain_kept = 0
    for _ in range(400):
        x = rng.normal(size=300)
        est, var = shrink_by_known_noise(x, 1.0, [(0, 300)], centre="zero", margin=2.0)
        kept += bool(np.any(est != 0.0))
        assert np.all((est == 0.0) == (var == 0.0))
        plain, _ = shrink_by_known_noise(x, 1.0, [(0, 300)], centre="zero")
        plain_kept += bool(np.any(plain != 0.0))
    assert kept <= 20 and 140 < plain_kept < 260


def test_shrinkage_by_known_noise_refuses_bad_groups_and_values():
    x = np.zeros(4)
    for groups in ([(0, 2)], [(0, 3), (2, 4)], [(0, 0), (0, 4)], [(0, 5)]):
        with pytest.raises(ConfigurationError, match="groups"):
            shrink_by_known_noise(x, 1.0, groups)
    with pytest.raises(ConfigurationError, match="centre"):
        shrink_by_known_noise(x, 1.0, [(0, 4)], centre="median")
    for margin in (-1.0, math.inf, True, "2"):
        with pytest.raises(ConfigurationError, match="margin"):
            shrink_by_known_noise(x, 1.0, [(0, 4)], margin=margin)
    with pytest.raises(ConfigurationError, match="finite"):
        shrink_by_known_noise(np.array([0.0, np.nan]), 1.0, [(0, 2)])
