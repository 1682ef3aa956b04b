"""Poisson-sampled zCDP events under the rdp accountant: Zhu and Wang's general bound (2019, Theorem 6).

A sound upper bound can never be below the exact value, so on Gaussians (exactly rho-zCDP with rho = 1/(2 z^2)) it
must stay at or above dp-accounting's exact sampled-Gaussian RDP at every integer order, and within a modest factor.
"""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
from scipy import special

from privfl.accounting.accountants import make_accountant
from privfl.accounting.accountants.rdp import DEFAULT_ORDERS
from privfl.accounting.accountants.sampled_zcdp import poisson_sampled_zcdp_rdp
from privfl.accounting.errors import UnsupportedEventError
from privfl.accounting.events import (ComposedEvent, GaussianEvent, NonPrivateEvent, PoissonSampledEvent,
                                      SelfComposedEvent, UnsupportedEvent, ZCDPEvent, event_from_dict)
from privfl.accounting.ledger import PrivacyLedger

pytestmark = pytest.mark.timeout(60)

ORDERS = np.array(DEFAULT_ORDERS)
INTEGER = np.array([a >= 2 and float(a).is_integer() for a in ORDERS])


def gaussian_rdp(q: float, z: float, orders) -> np.ndarray:
    """dp-accounting's exact RDP of the Poisson-sampled Gaussian (Mironov, Talwar and Zhang 2019)."""
    inner = dp_accounting.rdp.RdpAccountant(orders=list(orders))
    inner.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
    return np.asarray(inner._rdp, dtype=np.float64)


def sampled_zcdp_epsilon(q: float, rho: float, steps: int, delta: float = 1e-5) -> float:
    return make_accountant("rdp").compose(PoissonSampledEvent(q, ZCDPEvent(rho)), steps).get_epsilon(delta)


# -- (a) never below the exact sampled Gaussian, and not far above it ----------------------------------------------

@pytest.mark.parametrize("q", [1e-4, 1e-3, 0.01, 0.06, 0.3, 0.9, 0.999])
@pytest.mark.parametrize("z", [0.3, 0.7, 1.0, 2.0, 5.0, 30.0])
def test_bound_is_at_least_the_exact_sampled_gaussian_at_every_integer_order(q, z):
    orders = ORDERS[INTEGER]
    ours = poisson_sampled_zcdp_rdp(q, 1.0 / (2 * z * z), orders)
    exact = gaussian_rdp(q, z, orders)
    assert np.all(np.isfinite(ours)) and np.all(ours > 0)
    # 1e-9: the two are computed by different float summations; mathematically ours >= exact term by term
    assert np.all(ours >= exact * (1 - 1e-9)), (orders[ours < exact * (1 - 1e-9)], ours, exact)
    assert np.all(ours <= orders / (2 * z * z) * (1 + 1e-12))  # capped by the unamplified rho alpha


@pytest.mark.parametrize("q, z, steps, factor", [(0.06, 1.0, 500, 1.25), (0.01, 1.0, 1000, 1.2),
                                                   (0.02, 0.8, 2000, 1.2), (0.06, 1.5, 500, 1.3)])
def test_composed_epsilon_is_within_a_modest_factor_of_the_sampled_gaussian(q, z, steps, factor):
    """Measured (delta = 1e-5): q=0.06, z=1, 500 steps: 12.25 against the Gaussian's 10.14 under RDP (1.21x; PLD
    9.23); q=0.01, z=1, 1000 steps: 2.45 against 2.10 (1.17x). The factor 3 on the orders >= 3 terms is the gap."""
    ours = sampled_zcdp_epsilon(q, 1.0 / (2 * z * z), steps)
    gaussian = make_accountant("rdp").compose(PoissonSampledEvent(q, GaussianEvent(1.0, z)), steps).get_epsilon(1e-5)
    assert gaussian <= ours <= factor * gaussian


def _renyi(log_p: np.ndarray, log_q: np.ndarray, alpha: float) -> float:
    """D_alpha(P || Q) from log-probabilities on a common finite support."""
    return float(special.logsumexp(alpha * log_p + (1 - alpha) * log_q)) / (alpha - 1)


def _sampled_pair(log_p: np.ndarray, log_q: np.ndarray, q: float) -> tuple[np.ndarray, np.ndarray]:
    """(log of the mixture (1 - q) P + q Q: the output with the record, log P: without it)."""
    return np.logaddexp(math.log1p(-q) + log_p, math.log(q) + log_q), log_p


@pytest.mark.parametrize("epsilon0", [0.1, 0.5, 1.0, 2.0, 4.0])
def test_bound_holds_in_both_directions_for_randomised_response(epsilon0):
    """Randomised response is epsilon0-DP, hence (epsilon0^2 / 2)-zCDP (Bun and Steinke 2016, Prop. 1.4), and is not
    a Gaussian: its subsampled divergence, computed exactly in both directions, must stay under the bound (the
    direction D(P || mixture) is the one Theorem 6's factor 3 pays for; it comes within 0.5% of the bound here)."""
    log_p = np.log(np.array([math.exp(epsilon0), 1.0]) / (1.0 + math.exp(epsilon0)))
    log_q = log_p[::-1].copy()
    orders = np.arange(2.0, 200.0)
    for q in [1e-3, 0.01, 0.1, 0.5, 0.9]:
        with_record, without = _sampled_pair(log_p, log_q, q)
        bound = poisson_sampled_zcdp_rdp(q, epsilon0 ** 2 / 2, orders)
        for alpha, b in zip(orders, bound):
            exact = max(_renyi(with_record, without, alpha), _renyi(without, with_record, alpha))
            assert exact <= b * (1 + 1e-9), (q, alpha, exact, b)


@pytest.mark.parametrize("sigma", [0.6, 1.0, 3.0])
def test_bound_holds_in_both_directions_for_the_discrete_gaussian(sigma):
    """The discrete Gaussian with integer shift 1 is (1 / (2 sigma^2))-zCDP (Canonne, Kamath and Steinke 2020);
    the bound is tight at order 2 (equal up to rounding) and above the exact divergence everywhere."""
    x = np.arange(-int(60 * sigma) - 60, int(60 * sigma) + 61, dtype=np.float64)
    log_p = -x ** 2 / (2 * sigma ** 2)
    log_q = -(x - 1) ** 2 / (2 * sigma ** 2)
    log_p, log_q = log_p - special.logsumexp(log_p), log_q - special.logsumexp(log_q)
    orders = np.arange(2.0, 41.0)
    for q in [0.01, 0.1, 0.5, 0.9]:
        with_record, without = _sampled_pair(log_p, log_q, q)
        bound = poisson_sampled_zcdp_rdp(q, 1 / (2 * sigma ** 2), orders)
        for alpha, b in zip(orders, bound):
            exact = max(_renyi(with_record, without, alpha), _renyi(without, with_record, alpha))
            assert exact <= b * (1 + 1e-9), (q, alpha, exact, b)


def test_large_orders_and_tiny_rho_neither_overflow_nor_lose_precision():
    orders = [2.0, 3.0, 64.0, 1000.0, 2500.0]
    big = poisson_sampled_zcdp_rdp(0.5, 50.0, orders)  # exponents (l-1) l rho up to 3e8: log space only
    assert np.all(np.isfinite(big))
    np.testing.assert_allclose(big, 50.0 * np.array(orders), rtol=0.05)  # barely amplified, never above the cap
    assert np.all(big <= 50.0 * np.array(orders))
    tiny = poisson_sampled_zcdp_rdp(1e-3, 1e-12, [2.0])[0]
    # at order 2 the bound is log(1 + q^2 (e^{2 rho} - 1)) exactly: ~ 2 q^2 rho, kept to full relative precision
    assert tiny == pytest.approx(math.log1p(1e-6 * math.expm1(2e-12)), rel=1e-9)


def test_fractional_orders_get_only_the_unamplified_bound():
    orders = [1.5, 2.5, 3.0, 10.5]
    values = poisson_sampled_zcdp_rdp(0.01, 0.3, orders)
    assert values[0] == 0.3 * 1.5 and values[1] == 0.3 * 2.5 and values[3] == 0.3 * 10.5
    assert values[2] < 0.3 * 3.0


# -- (b) q = 1 is the plain zCDP event; (c) monotone in q and rho --------------------------------------------------

def test_sampling_everyone_is_the_plain_zcdp_event():
    sampled = make_accountant("rdp").compose(PoissonSampledEvent(1.0, ZCDPEvent(0.4)), 7)
    plain = make_accountant("rdp").compose(ZCDPEvent(0.4), 7)
    np.testing.assert_allclose(sampled.rdp, plain.rdp, rtol=1e-15)
    assert sampled.get_epsilon(1e-6) == plain.get_epsilon(1e-6)
    np.testing.assert_array_equal(poisson_sampled_zcdp_rdp(1.0, 0.4, ORDERS), 0.4 * ORDERS)


def test_monotone_in_sampling_rate_and_in_rho():
    qs = [1e-3, 0.01, 0.05, 0.2, 0.5, 0.9, 1.0]
    rhos = [1e-3, 0.05, 0.5, 2.0, 10.0]
    for rho in rhos:
        curves = [poisson_sampled_zcdp_rdp(q, rho, ORDERS) for q in qs]
        for lower, higher in zip(curves, curves[1:]):
            assert np.all(lower <= higher * (1 + 1e-12))
    for q in qs:
        curves = [poisson_sampled_zcdp_rdp(q, rho, ORDERS) for rho in rhos]
        for lower, higher in zip(curves, curves[1:]):
            assert np.all(lower <= higher * (1 + 1e-12))
    epsilons = [sampled_zcdp_epsilon(q, 0.3, 100) for q in qs]
    assert epsilons == sorted(epsilons)


# -- (d) composition adds per order ---------------------------------------------------------------------------------

def test_t_steps_are_t_times_one_step_at_every_order():
    event = PoissonSampledEvent(0.05, ZCDPEvent(0.2))
    one = make_accountant("rdp").compose(event)
    counted = make_accountant("rdp").compose(event, 250)
    looped = make_accountant("rdp")
    for _ in range(250):
        looped.compose(event)
    np.testing.assert_allclose(counted.rdp, 250 * one.rdp, rtol=1e-12)
    np.testing.assert_allclose(looped.rdp, 250 * one.rdp, rtol=1e-9)
    nested = make_accountant("rdp").compose(SelfComposedEvent(SelfComposedEvent(event, 25), 10))
    np.testing.assert_allclose(nested.rdp, 250 * one.rdp, rtol=1e-12)
    assert looped.get_epsilon(1e-5) == pytest.approx(counted.get_epsilon(1e-5), rel=1e-9)


def test_mixed_compositions_add_dp_accountings_rdp_and_the_side_array_per_order():
    sampled_zcdp = PoissonSampledEvent(0.05, ZCDPEvent(0.2))
    others = ComposedEvent((GaussianEvent(1.0, 3.0), PoissonSampledEvent(0.1, GaussianEvent(1.0, 2.0)),
                            ZCDPEvent(0.01)))
    mixed = make_accountant("rdp").compose(ComposedEvent((sampled_zcdp, others)), 3)
    parts = make_accountant("rdp").compose(sampled_zcdp, 3)
    rest = make_accountant("rdp").compose(others, 3)
    np.testing.assert_allclose(mixed.rdp, parts.rdp + rest.rdp, rtol=1e-12)
    # channels of one round on one sample: a composition of zCDP (and Gaussian) releases is zCDP with rho summed
    one_coin = make_accountant("rdp").compose(
        PoissonSampledEvent(0.05, ComposedEvent((ZCDPEvent(0.1), GaussianEvent(1.0, math.sqrt(5.0))))))
    np.testing.assert_allclose(one_coin.rdp, poisson_sampled_zcdp_rdp(0.05, 0.2, ORDERS), rtol=1e-12)


def test_conversion_uses_the_side_array_and_the_rho_cap():
    acct = make_accountant("rdp").compose(PoissonSampledEvent(0.01, ZCDPEvent(0.5)), 100)
    safe = acct._safe_rdp()
    np.testing.assert_allclose(safe, np.minimum(acct.rdp, 50.0 * acct.orders), rtol=1e-15)
    unamplified = make_accountant("zcdp").compose(ZCDPEvent(0.5), 100).get_epsilon(1e-5)
    assert acct.get_epsilon(1e-5) < 0.5 * unamplified  # amplification is used
    assert 0 < acct.get_delta(acct.get_epsilon(1e-5)) <= 1e-5 * (1 + 1e-6)


def test_copy_is_independent():
    acct = make_accountant("rdp").compose(PoissonSampledEvent(0.05, ZCDPEvent(0.2)))
    other = acct.copy()
    other.compose(PoissonSampledEvent(0.05, ZCDPEvent(0.2)))
    np.testing.assert_allclose(other.rdp, 2 * acct.rdp, rtol=1e-12)


# -- refusals, by name ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("event, words", [
    (PoissonSampledEvent(0.05, ZCDPEvent(0.2), "replace_one"), "add/remove adjacency only"),
    (PoissonSampledEvent(0.05, PoissonSampledEvent(0.5, ZCDPEvent(0.2))), "nested"),
    (PoissonSampledEvent(0.05, ComposedEvent((ZCDPEvent(0.2), UnsupportedEvent("x")))), "unsupported mechanism"),
    (ComposedEvent((PoissonSampledEvent(0.05, ZCDPEvent(0.2)), UnsupportedEvent("x"))), "cannot compose"),
])
def test_unsupported_cases_are_refused_by_name_and_leave_no_trace(event, words):
    acct = make_accountant("rdp").compose(PoissonSampledEvent(0.05, ZCDPEvent(0.2)))
    before = acct.rdp.copy()
    assert not acct.supports(event)
    with pytest.raises(UnsupportedEventError, match=words):
        acct.compose(event)
    np.testing.assert_array_equal(acct.rdp, before)
    assert len(acct.events) == 1


def test_a_non_private_release_inside_the_sample_is_charged_as_non_private():
    acct = make_accountant("rdp").compose(PoissonSampledEvent(0.05, ComposedEvent((ZCDPEvent(0.2), NonPrivateEvent()))))
    assert math.isinf(acct.get_epsilon(1e-5))


@pytest.mark.parametrize("name", ["pld", "exact", "zcdp"])
def test_other_accountants_refuse_and_name_the_rdp_accountant(name):
    with pytest.raises(UnsupportedEventError, match="rdp"):
        make_accountant(name).compose(PoissonSampledEvent(0.05, ZCDPEvent(0.2)))


def test_pld_refusal_says_why_and_what_to_use():
    with pytest.raises(UnsupportedEventError, match=r"no privacy loss distribution; use the rdp accountant"):
        make_accountant("pld").compose(PoissonSampledEvent(0.05, ZCDPEvent(0.2)))


# -- (e) the ledger charges and audits; (f) the event survives serialisation -----------------------------------------

def test_a_ledger_with_the_rdp_accountant_charges_and_audits_sampled_zcdp(tmp_path):
    event = PoissonSampledEvent(0.06, ZCDPEvent(0.5, label="distributed_discrete_gaussian"))
    expected = sampled_zcdp_epsilon(0.06, 0.5, 20)
    path = tmp_path / "ledger.sqlite"
    led = PrivacyLedger(path, "run", delta=1e-5, epsilon_budget=expected * 1.001, accountant="rdp")
    for rnd in range(20):
        led.mark_released(led.charge("a", rnd, "update", event))
    report = led.audit()
    assert report["clients"]["a"]["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert report["clients"]["a"]["rho"] == pytest.approx(20 * 0.5)  # unamplified upper bound
    assert report["clients"]["a"]["releases"] == 20
    with pytest.raises(Exception, match="budget"):
        led.charge("a", 20, "update", event)
    led.close()
    reopened = PrivacyLedger.open_existing(path)
    assert reopened.epsilon("a") == pytest.approx(expected, rel=1e-9)
    assert reopened.charges("a")[0].event == event
    reopened.close()


def test_a_ledger_with_the_pld_accountant_refuses_the_charge_and_writes_nothing(tmp_path):
    led = PrivacyLedger(tmp_path / "ledger.sqlite", "run", delta=1e-5, accountant="pld")
    with pytest.raises(UnsupportedEventError, match="rdp accountant"):
        led.charge("a", 0, "update", PoissonSampledEvent(0.06, ZCDPEvent(0.5)))
    assert led.charges() == []


def test_serialisation_round_trip():
    event = PoissonSampledEvent(0.06, ZCDPEvent(0.25, label="distributed_discrete_gaussian"))
    assert event_from_dict(json.loads(json.dumps(event.to_dict()))) == event

