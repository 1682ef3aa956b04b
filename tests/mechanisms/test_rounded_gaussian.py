"""The sum of discrete-Gaussian shares charged as the continuous Gaussian it nearly is
(``mechanisms.discrete_gaussian.rounded_gaussian_total_variation`` / ``distributed_gaussian_event``), checked
against exact computations: the total variation by convolving the shares' probability mass functions, and the
charged delta(epsilon) against the exact hockey-stick divergences of the real (sampled, composed, multi-dimensional)
mechanism on the integers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from privfl.accounting.accountants import make_accountant
from privfl.accounting.errors import InvalidPrivacyParameter, UnsupportedEventError
from privfl.accounting.events import (ApproximatedEvent, ComposedEvent, GaussianEvent, PoissonSampledEvent,
                                      SelfComposedEvent, event_from_dict, split_total_variation)
from privfl.mechanisms.discrete_gaussian import distributed_gaussian_event, rounded_gaussian_total_variation

pytestmark = pytest.mark.timeout(300)


def _share_pmf(sigma: float) -> np.ndarray:
    """N_Z(0, sigma^2) on [-H, H], H = 14 sigma + 2 (the mass beyond is below 1e-40)."""
    half = int(math.ceil(14 * sigma)) + 2
    k = np.arange(-half, half + 1, dtype=np.float64)
    w = np.exp(-k * k / (2.0 * sigma * sigma))
    return w / w.sum()


def _sum_pmf(sigma: float, shares: int) -> np.ndarray:
    """The exact law of a sum of ``shares`` independent N_Z(0, sigma^2), centred on the middle index."""
    one = _share_pmf(sigma)
    out = one
    for _ in range(shares - 1):
        out = np.convolve(out, one)
    return out


def _rounded_gaussian(variance: float, half: int) -> np.ndarray:
    m = np.arange(-half, half + 1, dtype=np.float64)
    s = math.sqrt(variance)
    return stats.norm.sf((m - 0.5) / s) - stats.norm.sf((m + 0.5) / s)


@pytest.mark.parametrize("sigma, shares", [(1.0, 1), (1.0, 2), (1.5, 3), (2.0, 5), (3.0, 2), (4.0, 10), (8.0, 3)])
def test_the_total_variation_bound_holds_against_the_exact_convolution_and_is_within_4x(sigma, shares):
    exact = _sum_pmf(sigma, shares)
    rounded = _rounded_gaussian(shares * sigma * sigma, (len(exact) - 1) // 2)
    tv = 0.5 * np.abs(exact - rounded).sum() + 0.5 * (1.0 - rounded.sum())
    bound = rounded_gaussian_total_variation(sigma, shares, shares)
    assert tv <= bound <= 4.0 * tv


def test_the_bound_covers_every_share_count_in_the_range_and_shrinks_as_sigma_grows():
    sigma = 2.0
    bound = rounded_gaussian_total_variation(sigma, 2, 6)
    for h in range(2, 7):
        exact = _sum_pmf(sigma, h)
        rounded = _rounded_gaussian(h * sigma * sigma, (len(exact) - 1) // 2)
        assert 0.5 * np.abs(exact - rounded).sum() + 0.5 * (1.0 - rounded.sum()) <= bound
    values = [rounded_gaussian_total_variation(s, 3, 10) for s in (1.0, 10.0, 1e3, 1e6, 1e11)]
    assert all(a > b for a, b in zip(values, values[1:]))
    assert values[-1] < 1e-22  # a 48-bit quantiser's share std is ~1e11 integer units
    assert rounded_gaussian_total_variation(0.7, 3) == 1.0  # below sigma = 1 the bound is not used


def _delta_exact(p: np.ndarray, q: np.ndarray, epsilon: float) -> float:
    """The hockey-stick divergence sum max(p - e^eps q, 0) of two mass functions on one support."""
    return float(np.maximum(p - math.exp(epsilon) * q, 0.0).sum())


def _pairs(sigma: float, shares: int, shift: tuple[int, ...], q: float):
    """(with the unit, without it) mass functions of the real mechanism: each coordinate the sum of ``shares``
    shares, plus ``shift`` when the unit is sampled (probability q); d = len(shift) coordinates, flattened."""
    base = _sum_pmf(sigma, shares)
    half = (len(base) - 1) // 2
    out = base
    moved = np.roll(base, shift[0])
    for k in shift[1:]:
        out = np.multiply.outer(out, base).ravel()
        moved = np.multiply.outer(moved, np.roll(base, k)).ravel()
    assert all(abs(k) < half // 4 for k in shift)  # np.roll wraps only mass below 1e-40
    return (1.0 - q) * out + q * moved, out


def _charged_delta(event, count: int, epsilon: float) -> float:
    return make_accountant("pld", value_discretization_interval=1e-4).compose(event, count).get_delta(epsilon)


@pytest.mark.parametrize("sigma, shares, shift, q", [
    (20.0, 3, (20,), 0.3),       # one coordinate, z = sqrt(3)
    (12.0, 2, (9, 12), 0.5),     # two coordinates, ||shift|| = 15, z = 1.13
    (30.0, 4, (40,), 1.0),       # unsampled
])
def test_the_charged_delta_bounds_the_exact_hockey_stick_of_the_real_mechanism_both_ways(sigma, shares, shift, q):
    with_unit, without = _pairs(sigma, shares, shift, q)
    l2 = math.sqrt(sum(k * k for k in shift))
    inner = distributed_gaussian_event(l2_sensitivity=l2, sigma=sigma, n_min=shares, dimension=len(shift))
    assert inner.event == GaussianEvent(l2, math.sqrt(shares) * sigma)
    event = PoissonSampledEvent(q, inner)
    ideal = PoissonSampledEvent(q, inner.event)
    for epsilon in (0.0, 0.25, 0.5, 1.0, 2.0):
        real = max(_delta_exact(with_unit, without, epsilon), _delta_exact(without, with_unit, epsilon))
        charged = _charged_delta(event, 1, epsilon)
        assert real <= charged
        # tight: the charge exceeds the ideal Gaussian's by the total-variation term only, and the real mechanism
        # is within that term of the Gaussian's (a vacuous bound would not be)
        gaussian = _charged_delta(ideal, 1, epsilon)
        slack = (1.0 + math.exp(epsilon)) * inner.total_variation
        assert charged <= gaussian + slack + 1e-12
        assert abs(real - gaussian) <= slack + 2e-3 * gaussian + 1e-9


@pytest.mark.parametrize("survivors", [3, 4, 6])
def test_a_charge_for_the_fewest_honest_shares_holds_for_every_survivor_count(survivors):
    """The plan charges n_min = 3 honest shares and covers up to n_max = 6: the real mechanism with 3, 4 or 6 shares
    summed (more noise than charged) stays within the charge, exactly computed."""
    sigma, shift, q = 12.0, (18,), 0.5
    with_unit, without = _pairs(sigma, survivors, shift, q)
    inner = distributed_gaussian_event(l2_sensitivity=18.0, sigma=sigma, n_min=3, n_max=6, dimension=1)
    assert inner.event.noise_std == pytest.approx(math.sqrt(3) * sigma)
    for epsilon in (0.0, 0.5, 1.0, 2.0):
        real = max(_delta_exact(with_unit, without, epsilon), _delta_exact(without, with_unit, epsilon))
        assert real <= _charged_delta(PoissonSampledEvent(q, inner), 1, epsilon)


def test_the_charged_delta_bounds_the_exact_two_fold_composition():
    """Two rounds of one coordinate (sum of 3 shares, shift 15, q = 0.4): the exact privacy loss distribution of the
    real mechanism composed twice, against the accountant's composition of the charged event."""
    sigma, shares, shift, q = 10.0, 3, 15, 0.4
    with_unit, without = _pairs(sigma, shares, (shift,), q)
    inner = distributed_gaussian_event(l2_sensitivity=float(shift), sigma=sigma, n_min=shares, dimension=1)
    event = PoissonSampledEvent(q, inner)
    for upper, lower in ((with_unit, without), (without, with_unit)):
        keep = upper > 1e-300
        loss, mass = np.log(upper[keep]) - np.log(lower[keep]), upper[keep]
        total_loss = np.add.outer(loss, loss).ravel()
        total_mass = np.multiply.outer(mass, mass).ravel()
        for epsilon in (0.2, 0.5, 1.0):
            real = float(np.sum(total_mass * np.maximum(0.0, 1.0 - np.exp(epsilon - total_loss))))
            assert real <= _charged_delta(event, 2, epsilon)


def test_accountants_take_the_approximated_event_and_add_its_term_and_the_others_refuse_it():
    inner = ApproximatedEvent(GaussianEvent(1.0, 2.0), 1e-9, label="x")
    assert inner.mechanism == "x~gaussian"
    assert event_from_dict(inner.to_dict()) == inner
    nested = SelfComposedEvent(ComposedEvent((PoissonSampledEvent(0.1, inner), inner)), 5)
    ideal, tv = split_total_variation(nested)
    assert tv == pytest.approx(10e-9)
    assert ideal == SelfComposedEvent(ComposedEvent((PoissonSampledEvent(0.1, GaussianEvent(1.0, 2.0)),
                                                     GaussianEvent(1.0, 2.0))), 5)
    for name in ("pld", "rdp"):
        acct = make_accountant(name).compose(nested)
        plain = make_accountant(name).compose(ideal)
        assert acct.total_variation == pytest.approx(1e-8)
        for epsilon in (0.5, 2.0):
            assert acct.get_delta(epsilon) == pytest.approx(plain.get_delta(epsilon) + (1 + math.exp(epsilon)) * 1e-8,
                                                            rel=1e-9)
        eps = acct.get_epsilon(1e-5)
        assert plain.get_epsilon(1e-5) <= eps <= plain.get_epsilon(1e-5) * 1.05  # (1 + e^5) 1e-8 = 15% of delta
        assert acct.get_delta(eps) <= 1e-5 * (1 + 1e-6)
        assert acct.copy().get_epsilon(1e-5) == eps
        assert acct.supports(nested)
    for name in ("exact", "zcdp"):
        with pytest.raises(UnsupportedEventError, match="pld"):
            make_accountant(name).compose(inner)
    # a total variation too large for delta: no finite epsilon
    assert make_accountant("pld").compose(ApproximatedEvent(GaussianEvent(1.0, 2.0), 1e-3)).get_epsilon(1e-5) \
        == math.inf
    for bad in (-1e-9, 1.0, float("nan"), True):
        with pytest.raises(InvalidPrivacyParameter):
            ApproximatedEvent(GaussianEvent(1.0, 2.0), bad)
