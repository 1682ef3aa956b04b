"""Closed-form values, checked to tight tolerance: the analytic Gaussian, Gaussian RDP, zCDP rho and its conversions."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant as DpPLDAccountant
from scipy import stats

from privfl.accounting.accountants import ExactAccountant, RDPAccountant, ZCDPAccountant, make_accountant
from privfl.accounting.accountants.analytic_gaussian import gaussian_delta, gaussian_epsilon, gaussian_log_delta, gaussian_mu
from privfl.accounting.accountants.dp_events import to_dp_event
from privfl.accounting.accountants.zcdp import optimal_epsilon, standard_epsilon
from privfl.accounting.events import (ComposedEvent, GaussianEvent, NonPrivateEvent, PoissonSampledEvent, UnsupportedEvent,
                               ZCDPEvent)

pytestmark = pytest.mark.timeout(30)


def balle_wang_delta(mu: float, epsilon: float) -> float:
    """delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), written out directly (fine for moderate values)."""
    return stats.norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * stats.norm.cdf(-epsilon / mu - mu / 2)


# -- the analytic Gaussian (exact accountant) ------------------------------------------------------------------------

@pytest.mark.parametrize("mu", [0.05, 0.3, 1.0, 2.5, 6.0])
@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.5, 1.0, 3.0, 8.0])
def test_delta_matches_the_balle_wang_formula(mu, epsilon):
    expected = balle_wang_delta(mu, epsilon)
    assert gaussian_delta(mu, epsilon) == pytest.approx(expected, rel=1e-9, abs=1e-15)


def test_delta_matches_high_precision_arithmetic_far_in_the_tails():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 60
    for mu, epsilon in [(1e-4, 1e-6), (0.1, 2.0), (1.0, 12.0), (5.0, 40.0), (40.0, 900.0), (200.0, 2e4)]:
        m, e = mpmath.mpf(mu), mpmath.mpf(epsilon)
        exact = mpmath.ncdf(-e / m + m / 2) - mpmath.exp(e) * mpmath.ncdf(-e / m - m / 2)
        assert gaussian_log_delta(mu, epsilon) == pytest.approx(float(mpmath.log(exact)), rel=1e-9)


@pytest.mark.parametrize("noise_std", [0.4, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("delta", [1e-12, 1e-5, 1e-2])
def test_exact_single_gaussian_equals_dp_accounting_analytic_gaussian(noise_std, delta):
    accountant = ExactAccountant().compose(GaussianEvent(2.0, 2.0 * noise_std))
    expected = dp_accounting.get_epsilon_gaussian(noise_std, delta)
    assert accountant.get_epsilon(delta) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert accountant.get_delta(expected) == pytest.approx(delta, rel=1e-7)


@pytest.mark.parametrize("noise_std", [0.8, 2.0, 5.0])
def test_exact_agrees_with_a_fine_pld(noise_std):
    """An independent numerical route: dp-accounting's PLD at a fine discretisation lands within 1%."""
    delta = 1e-5
    pld = DpPLDAccountant(value_discretization_interval=1e-4)
    pld.compose(dp_accounting.GaussianDpEvent(noise_std), 5)
    exact = ExactAccountant().compose(GaussianEvent(1.0, noise_std), 5).get_epsilon(delta)
    assert exact == pytest.approx(pld.get_epsilon(delta), rel=1e-2)
    assert exact <= pld.get_epsilon(delta) * (1 + 1e-9)  # PLD is pessimistic, exact is tight


def test_gaussian_composition_is_a_gaussian():
    """n releases at sigma compose to one release at sigma / sqrt(n) (Dong, Roth and Su 2019, Cor. 3.3)."""
    composed = ExactAccountant().compose(GaussianEvent(1.0, 6.0), 9)
    single = ExactAccountant().compose(GaussianEvent(1.0, 2.0))
    assert composed.mu == pytest.approx(single.mu, rel=1e-12)
    assert composed.get_epsilon(1e-6) == pytest.approx(single.get_epsilon(1e-6), rel=1e-10)
    mixed = ExactAccountant().compose(ComposedEvent((GaussianEvent(3.0, 4.0), GaussianEvent(1.0, 1.0))))
    assert mixed.mu == pytest.approx(math.sqrt((3 / 4) ** 2 + 1.0), rel=1e-12)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mu", [1e-12, 1e-8, 1e-3, 1.0, 50.0, 1e3, 1e6])
@pytest.mark.parametrize("delta", [1e-300, 1e-12, 1e-5, 0.5, 0.999])
def test_analytic_gaussian_is_stable_at_the_extremes(mu, delta):
    epsilon = gaussian_epsilon(mu, delta)
    assert math.isfinite(epsilon) and epsilon >= 0.0
    assert gaussian_delta(mu, epsilon) <= delta * (1 + 1e-9)
    if epsilon > 0:
        assert gaussian_delta(mu, epsilon * (1 - 1e-6)) > delta  # and it is the smallest such epsilon
    else:
        assert gaussian_delta(mu, 0.0) <= delta  # (0, delta)-DP already holds
    assert epsilon <= mu * mu / 2 + mu * math.sqrt(2 * math.log(1 / delta)) + 1e-12  # never above zCDP's bound


@pytest.mark.parametrize("epsilon", [1e-3, 0.5, 1.0, 3.0, 8.0, 50.0])
@pytest.mark.parametrize("delta", [1e-10, 1e-5, 1e-2])
def test_gaussian_mu_inverts_the_profile(epsilon, delta):
    mu = gaussian_mu(epsilon, delta)
    assert gaussian_delta(mu, epsilon) <= delta
    assert gaussian_delta(mu * (1 + 1e-9), epsilon) == pytest.approx(delta, rel=1e-6)
    assert 1.0 / mu == pytest.approx(dp_accounting.get_sigma_gaussian(epsilon, delta), rel=1e-9)


def test_exact_reports_zero_when_delta_is_already_met():
    accountant = ExactAccountant().compose(GaussianEvent(1.0, 1e4))
    assert gaussian_delta(accountant.mu, 0.0) < 1e-3
    assert accountant.get_epsilon(1e-3) == 0.0


# -- RDP --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sensitivity,noise_std,count", [(1.0, 1.0, 1), (2.0, 3.0, 7), (0.5, 10.0, 100)])
def test_gaussian_rdp_is_alpha_over_two_sigma_squared(sensitivity, noise_std, count):
    accountant = RDPAccountant().compose(GaussianEvent(sensitivity, noise_std), count)
    orders = accountant.orders
    expected = count * orders * sensitivity ** 2 / (2 * noise_std ** 2)
    np.testing.assert_allclose(accountant.rdp, expected, rtol=1e-12)


def test_zcdp_event_is_linear_rdp():
    """rho-zCDP means RDP(alpha) <= rho alpha for every alpha (Bun and Steinke 2016, Def. 1.1)."""
    accountant = RDPAccountant().compose(ZCDPEvent(0.07), 3)
    np.testing.assert_allclose(accountant.rdp, 3 * 0.07 * accountant.orders, rtol=1e-12)


def test_rdp_orders_are_rich():
    orders = RDPAccountant().orders
    assert len(orders) >= 200
    assert orders.min() < 1.1 and orders.max() > 1000
    assert np.all(np.diff(orders) > 0)


# -- zCDP -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["zcdp", "rdp"])
@pytest.mark.parametrize("sigma", [0.5, 1.0, 4.0])
def test_zcdp_event_equals_the_gaussian_with_the_same_rho(name, sigma):
    gaussian = make_accountant(name).compose(GaussianEvent(1.0, sigma), 5)
    zcdp = make_accountant(name).compose(ZCDPEvent(1.0 / (2 * sigma ** 2)), 5)
    assert zcdp.get_epsilon(1e-6) == pytest.approx(gaussian.get_epsilon(1e-6), rel=1e-12)


def test_rho_adds():
    accountant = ZCDPAccountant()
    accountant.compose(GaussianEvent(1.0, 2.0), 3).compose(GaussianEvent(2.0, 5.0)).compose(ZCDPEvent(0.01, "dgauss"))
    assert accountant.rho == pytest.approx(3 / 8 + 4 / 50 + 0.01, rel=1e-12)
    assert GaussianEvent(3.0, 2.0).rho == pytest.approx(9 / 8)
    assert ZCDPAccountant().compose(NonPrivateEvent()).rho == math.inf


@pytest.mark.parametrize("rho", [1e-4, 0.01, 0.5, 2.0, 50.0])
@pytest.mark.parametrize("delta", [1e-10, 1e-5, 1e-2])
def test_zcdp_conversions(rho, delta):
    accountant = ZCDPAccountant().compose(ZCDPEvent(rho))
    conversions = accountant.epsilon_conversions(delta)
    assert conversions["standard"] == pytest.approx(rho + 2 * math.sqrt(rho * math.log(1 / delta)), rel=1e-12)
    assert conversions["standard"] == accountant.epsilon_standard(delta) == standard_epsilon(rho, delta)
    assert conversions["optimal"] == accountant.get_epsilon(delta)
    assert 0.0 <= conversions["optimal"] <= conversions["standard"]
    # The optimum over alpha of Canonne, Kamath and Steinke 2020, Prop. 12, by brute force on a dense grid.
    alphas = 1 + np.logspace(-7, 8, 200_001)
    bound = rho * alphas + np.log(1 / (alphas * delta)) / (alphas - 1) + np.log1p(-1 / alphas)
    brute = max(0.0, float(bound.min()))
    if delta ** 2 + math.expm1(-rho) >= 0:  # delta above the total-variation bound: (0, delta)-DP
        brute = 0.0
    assert conversions["optimal"] == pytest.approx(brute, rel=1e-6, abs=1e-12)
    assert conversions["optimal"] <= brute + 1e-12


def test_optimal_zcdp_is_strictly_better_in_the_usual_regime():
    for rho in (0.05, 0.5, 5.0):
        assert optimal_epsilon(rho, 1e-5) < standard_epsilon(rho, 1e-5)


# -- translation to dp-accounting -------------------------------------------------------------------------------------

def test_translation_uses_noise_multipliers():
    assert to_dp_event(GaussianEvent(2.0, 3.0), allow_zcdp=False) == dp_accounting.GaussianDpEvent(1.5)
    assert to_dp_event(ZCDPEvent(0.2), allow_zcdp=True) == dp_accounting.ZCDpEvent(0.2)
    assert to_dp_event(ZCDPEvent(0.2), allow_zcdp=False) is None
    assert to_dp_event(UnsupportedEvent(), allow_zcdp=True) is None


def test_a_sampled_round_of_channels_is_one_sampled_gaussian():
    """Channels released on one sample compose to one Gaussian with 1/z^2 = sum 1/z_c^2 (exact, Dong-Roth-Su)."""
    event = PoissonSampledEvent(0.2, ComposedEvent((GaussianEvent(1.0, 3.0), GaussianEvent(2.0, 4.0))))
    translated = to_dp_event(event, allow_zcdp=False)
    assert isinstance(translated, dp_accounting.PoissonSampledDpEvent)
    assert translated.sampling_probability == 0.2
    assert translated.event.noise_multiplier == pytest.approx(1 / math.sqrt(1 / 9 + 1 / 4), rel=1e-12)
    assert to_dp_event(PoissonSampledEvent(1.0, GaussianEvent(1.0, 2.0)), allow_zcdp=False) == \
        dp_accounting.GaussianDpEvent(2.0)
    assert to_dp_event(PoissonSampledEvent(0.2, ZCDPEvent(0.1)), allow_zcdp=True) is None
