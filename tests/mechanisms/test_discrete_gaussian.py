import math
import random
import time
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from privfl.accounting.events import ZCDPEvent
from privfl.mechanisms.discrete_gaussian import (_accept, _discrete_laplace, discrete_gaussian_pmf,
                                          discrete_gaussian_variance, distributed_discrete_gaussian_event,
                                          distributed_noise_rho, kls_tau, local_sigma, sample_discrete_gaussian,
                                          sample_discrete_gaussian_exact)

pytestmark = pytest.mark.timeout(120)


def _kl_and_g_test(samples: np.ndarray, sigma: float) -> tuple[float, float]:
    """KL(empirical || true pmf) and the p-value of a G-test with tails pooled to expected counts >= 5."""
    n = samples.size
    half = int(math.ceil(12 * sigma)) + 12
    support = np.arange(-half, half + 1)
    p = discrete_gaussian_pmf(support, sigma)
    counts = np.bincount(np.clip(samples, -half, half) + half, minlength=support.size).astype(float)
    observed = counts / n
    nz = observed > 0
    kl = float((observed[nz] * np.log(observed[nz] / p[nz])).sum())
    big = n * p >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(n * p[big], n * p[~big].sum())
    if exp[-1] < 5:  # fold a tiny pooled tail into the largest bin
        obs, exp = obs[:-1], exp[:-1]
        obs[np.argmax(exp)] += counts[~big].sum()
    mask = obs > 0
    g = 2.0 * float((obs[mask] * np.log(obs[mask] / exp[mask])).sum())
    return kl, float(stats.chi2.sf(g, obs.size - 1))


@pytest.mark.parametrize("sigma", [0.6, 3.0, 17.5])
def test_fast_sampler_matches_the_true_pmf(sigma):
    samples = sample_discrete_gaussian(sigma, 200_000, rng=np.random.default_rng(11))
    kl, pvalue = _kl_and_g_test(samples, sigma)
    support = int(np.unique(samples).size)
    assert kl < 3 * support / (2 * samples.size) + 1e-4
    assert pvalue > 1e-4


@pytest.mark.parametrize("sigma", [0.6, 3.0, 17.5])
def test_secure_sampler_matches_the_true_pmf(sigma):
    samples = sample_discrete_gaussian(sigma, 200_000, secure=True)  # unseeded: thresholds for a 1e-6 false alarm
    kl, pvalue = _kl_and_g_test(samples, sigma)
    support = int(np.unique(samples).size)
    assert kl < 3 * support / (2 * samples.size) + 1e-4
    assert pvalue > 1e-6


class _Exponentials:
    """A source that hands out given standard-exponential draws, in order."""

    def __init__(self, values):
        self.values = list(values)

    def exponential(self, n):
        out, self.values = np.array(self.values[:n], dtype=np.float64), self.values[n:]
        return out


@pytest.mark.parametrize("sigma", [0.6, 4.0, 50.0])
@pytest.mark.parametrize("multiple", [10, 37, 40, 100, 1000])
def test_secure_sampler_reaches_every_multiple_of_sigma_at_its_probability(sigma, multiple):
    # The secure path draws floor(t E) and accepts on E' > gamma, E and E' full-resolution exponentials without a
    # bound: a share of `multiple` sigmas is drawn (P[floor(t E) >= k] = exp(-k/t) > 0) and accepted exactly when
    # E' > gamma (P = exp(-gamma) > 0). 53-bit uniforms cut the geometric at 36.7 t and accepted nothing past
    # |y| - sigma^2/t = 38.6 sigma (exp(-gamma) underflows at gamma ~ 745).
    t = math.floor(sigma) + 1
    y_wanted = math.ceil(multiple * sigma)
    e = (y_wanted + 0.5) / t  # floor(t e) = y_wanted
    y = _discrete_laplace(_Exponentials([e, 0.0]), t, 1)
    assert y.tolist() == [y_wanted]
    assert _discrete_laplace(_Exponentials([0.0, e]), t, 1).tolist() == [-y_wanted]
    centre, two_var = sigma * sigma / t, 2 * sigma * sigma
    gamma = (y_wanted - centre) ** 2 / two_var
    assert gamma > 0
    assert _accept(_Exponentials([gamma * (1 + 1e-12)]), y, centre, two_var).tolist() == [True]
    assert _accept(_Exponentials([gamma * (1 - 1e-12)]), y, centre, two_var).tolist() == [False]


def test_the_secure_path_is_fast():
    start = time.perf_counter()
    sample_discrete_gaussian(50.0, 100_000, secure=True)
    assert time.perf_counter() - start < 1.0


def test_exact_sampler_matches_the_true_pmf():
    samples = sample_discrete_gaussian_exact(Fraction(9, 4), 4000, rand=random.Random(5))
    kl, pvalue = _kl_and_g_test(samples, 1.5)
    assert kl < 0.01 and pvalue > 1e-4
    assert sample_discrete_gaussian_exact("0.25", 3).dtype == np.int64  # default secrets-based source


def test_secure_source_and_reproducibility():
    secure = sample_discrete_gaussian(4.0, 100_000, secure=True)
    var = discrete_gaussian_variance(4.0)
    assert abs(secure.var() - var) < 5 * var * math.sqrt(2 / secure.size)
    a = sample_discrete_gaussian(4.0, (3, 5), rng=np.random.default_rng(1))
    b = sample_discrete_gaussian(4.0, (3, 5), rng=np.random.default_rng(1))
    assert a.shape == (3, 5) and a.dtype == np.int64 and np.array_equal(a, b)
    with pytest.raises(ValueError):
        sample_discrete_gaussian(4.0, 3, rng=np.random.default_rng(1), secure=True)
    with pytest.raises(TypeError):
        sample_discrete_gaussian(4.0, 3)
    with pytest.raises(ValueError):
        sample_discrete_gaussian(-1.0, 3, secure=True)


def test_noising_a_1e5_vector_is_fast():
    start = time.perf_counter()
    sample_discrete_gaussian(50.0, 100_000, rng=np.random.default_rng(0))
    assert time.perf_counter() - start < 1.0


def test_sum_of_n_shares_carries_the_central_noise():
    n, central = 10, 6.0
    sigma = local_sigma(central, n)
    m = 40_000
    shares = sample_discrete_gaussian(sigma, (m, n), rng=np.random.default_rng(7))
    sums = shares.sum(axis=1)
    expected_var = n * discrete_gaussian_variance(sigma)
    assert expected_var == pytest.approx(central ** 2, rel=1e-6)
    se_var = expected_var * math.sqrt(2 / (m - 1))
    assert abs(sums.var(ddof=1) - expected_var) < 4 * se_var
    assert abs(sums.mean()) < 4 * math.sqrt(expected_var / m)
    # and its distribution is close to the central discrete Gaussian
    kl, _ = _kl_and_g_test(sums, central)
    assert kl < 0.01


def test_variance_of_the_discrete_gaussian():
    assert discrete_gaussian_variance(5.0) == pytest.approx(25.0, rel=1e-12)
    assert discrete_gaussian_variance(0.3) < 0.3 ** 2


def test_tau_matches_its_definition():
    assert kls_tau(1.0, 2) == pytest.approx(10 * math.exp(-math.pi ** 2))
    assert kls_tau(1.0, 1) == 0.0
    assert kls_tau(0.5, 50) > kls_tau(0.5, 10)


def test_event_rho_approaches_the_continuous_gaussian_as_sigma_grows():
    l2, n, d = 20.0, 10, 10_000
    ratios = []
    for sigma in (0.5, 0.8, 1.0, 1.5, 3.0):
        event = distributed_discrete_gaussian_event(l2_sensitivity=l2, sigma=sigma, n_min=n, dimension=d)
        assert isinstance(event, ZCDPEvent) and event.label == "distributed_discrete_gaussian"
        ratios.append(event.rho / (l2 ** 2 / (2 * n * sigma ** 2)))
    assert all(r >= 1.0 for r in ratios)
    assert all(a >= b for a, b in zip(ratios, ratios[1:]))
    assert ratios[0] > 2 and ratios[-1] == pytest.approx(1.0, abs=1e-9)


def test_event_charges_the_worst_number_of_survivors():
    args = dict(l2_sensitivity=5.0, sigma=0.6, dimension=1000)
    at_min = distributed_discrete_gaussian_event(n_min=5, **args).rho
    over_range = distributed_discrete_gaussian_event(n_min=5, n_max=50, **args).rho
    assert over_range >= at_min
    assert over_range == pytest.approx(max(distributed_noise_rho(n=n, **args) for n in range(5, 51)))
    # fewer survivors means less noise: the guarantee at n_min is weaker than at larger n when tau is negligible
    big = dict(l2_sensitivity=5.0, sigma=4.0, dimension=1000)
    assert distributed_noise_rho(n=5, **big) > distributed_noise_rho(n=10, **big)


@pytest.mark.parametrize("sigma,n,d,l2,l1", [(0.5, 10, 1000, 20.0, None), (0.8, 3, 50, 4.0, 12.0),
                                             (1.2, 100, 100_000, 60.0, None), (3.0, 7, 10, 2.0, 2.0)])
def test_rho_dominates_every_renyi_term_of_kls_proposition_14(sigma, n, d, l2, l1):
    """KLS21 Prop. 14: D_a <= min(a/2 A2^2 + tau d, a/2 (A2^2 + 2 A1 tau + tau^2 d), a/2 (A2 + tau sqrt(d))^2) for
    a >= 1, A2 = L2 / (sqrt(n) sigma), A1 = L1 / (sqrt(n) sigma). rho-zCDP means D_a <= a rho for every a: the charged
    rho must dominate the bound at every order, and be attained (the bound divided by a, at some order) not looser."""
    rho = distributed_noise_rho(l2_sensitivity=l2, sigma=sigma, n=n, dimension=d, l1_sensitivity=l1)
    l1_used = min(math.sqrt(d) * l2, l2 * l2) if l1 is None else l1
    a2, a1 = l2 / (math.sqrt(n) * sigma), l1_used / (math.sqrt(n) * sigma)
    tau = 10 * sum(math.exp(-2 * math.pi ** 2 * sigma ** 2 * k / (k + 1)) for k in range(1, n))
    orders = [1.0 + 0.01 * i for i in range(1, 100)] + [2.0 ** j for j in range(1, 12)]

    def prop14(a):
        return min(a / 2 * a2 ** 2 + tau * d, a / 2 * (a2 ** 2 + 2 * a1 * tau + tau ** 2 * d),
                   a / 2 * (a2 + tau * math.sqrt(d)) ** 2)

    assert all(prop14(a) <= a * rho * (1 + 1e-12) for a in orders)
    assert rho <= max(prop14(a) / a for a in [1.0] + orders) * (1 + 1e-12)


def test_explicit_l1_sensitivity_is_used():
    args = dict(l2_sensitivity=3.0, sigma=0.7, n=20, dimension=10_000)
    assert distributed_noise_rho(l1_sensitivity=3.0, **args) <= distributed_noise_rho(**args)


@pytest.mark.parametrize("kwargs", [dict(sigma=0.4), dict(n_min=0), dict(l2_sensitivity=0.0), dict(dimension=0),
                                    dict(n_max=3), dict(l1_sensitivity=-1.0)])
def test_event_validates(kwargs):
    args = dict(l2_sensitivity=1.0, sigma=1.0, n_min=5, dimension=10)
    args.update(kwargs)
    with pytest.raises(ValueError):
        distributed_discrete_gaussian_event(**args)
