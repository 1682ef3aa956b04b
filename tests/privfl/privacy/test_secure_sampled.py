"""Record-level distributed noise under secure aggregation: a sum over a Poisson sample of records, charged
``PoissonSampledEvent(q, ApproximatedEvent(GaussianEvent, tv))`` (the Gaussian the honest shares' sum nearly is) and
composed by the pld (or rdp) accountant, or, with ``gaussian=False``, ``PoissonSampledEvent(q, ZCDPEvent(rho))``
under rdp (``privfl.privacy.secure``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privfl.accounting.accountants import make_accountant
from privfl.accounting.calibration import calibrate
from privfl.accounting.errors import UnsupportedEventError
from privfl.accounting.events import ApproximatedEvent, GaussianEvent, PoissonSampledEvent, ZCDPEvent
from privfl.accounting.ledger import PrivacyLedger
from privfl.errors import ConfigurationError
from privfl.mechanisms.discrete_gaussian import distributed_noise_rho, sample_discrete_gaussian
from privfl.privacy.secure import (SecureAggregation, calibrate_distributed_sampled, plan_distributed_noise,
                           plan_distributed_noise_sampled)

pytestmark = pytest.mark.timeout(120)

DELTA = 1e-5


def rdp_epsilon(event, rounds: int) -> float:
    return make_accountant("rdp").compose(event, rounds).get_epsilon(DELTA)


# (epsilon, rounds, q, dimension, clip, bound, clients, measured noise-multiplier ratio of the zCDP bound's plan to
# the sampled Gaussian's under rdp)
SETTINGS = [(3.0, 100, 0.06, 1000, 1.0, 5.0, 10, 1.207),
            (8.0, 500, 0.06, 10000, 1.0, 20.0, 50, 1.112),
            (1.0, 50, 0.01, 100, 0.5, 2.0, 5, 1.025)]


@pytest.mark.parametrize("epsilon, rounds, q, d, clip, bound, n, ratio", SETTINGS)
@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_calibrated_plan_meets_the_target_at_the_central_noise(epsilon, rounds, q, d, clip, bound, n, ratio,
                                                                accountant):
    """With 48 bits the honest shares' sum is charged as the sampled Gaussian (its total variation ~1e-20 a round),
    so the distributed plan needs the central plan's noise multiplier, to the calibrations' tolerance."""
    plan = calibrate_distributed_sampled(epsilon, DELTA, rounds, q, bound, d, clip, n, SecureAggregation(bits=48),
                                         accountant=accountant)
    inner = plan.event.event
    assert isinstance(inner, ApproximatedEvent) and isinstance(inner.event, GaussianEvent)
    assert inner.total_variation < 1e-15
    assert plan.event.sampling_rate == q and plan.event.relation == "add_remove"
    spent = make_accountant(accountant).compose(plan.event, rounds).get_epsilon(DELTA)
    assert spent <= epsilon
    assert spent == pytest.approx(epsilon, rel=2e-4)  # LEDGER_MARGIN (1e-4) below, to the search's tolerance
    central = calibrate(epsilon, DELTA, rounds, sampling_rate=q, accountant=accountant).noise_multiplier
    assert plan.noise_multiplier == pytest.approx(central, rel=2e-3)  # the central search's tolerance is 1e-3
    # the charged Gaussian: the honest shares' std over the rounded sensitivity, a hair below the nominal multiplier
    assert inner.event.noise_multiplier <= plan.noise_multiplier
    assert inner.event.noise_multiplier == pytest.approx(plan.noise_multiplier, rel=1e-6)


@pytest.mark.parametrize("epsilon, rounds, q, d, clip, bound, n, ratio", SETTINGS)
def test_the_zcdp_bound_plan_costs_a_measured_factor_over_the_gaussian(epsilon, rounds, q, d, clip, bound, n, ratio):
    """The Kairouz-Liu-Steinke event under Zhu and Wang's sampled bound (``gaussian=False``, what a coarse quantiser
    falls back to under rdp) at the same quantiser: the factor over the sampled Gaussian that the tight charge
    removes."""
    from privfl.accounting.calibration import calibrate_noise
    from privfl.accounting.events import SelfComposedEvent

    secure = SecureAggregation(bits=48)

    def run(m):
        plan = plan_distributed_noise_sampled(bound, d, m, n, n, secure.bits, clip=clip, sampling_rate=q,
                                              gaussian=False)
        return plan.event

    m, spent = calibrate_noise(lambda m: SelfComposedEvent(run(m), rounds), epsilon, DELTA, "rdp", guess=1.0,
                               step=1.1, tol=1e-6)
    assert isinstance(run(m).event, ZCDPEvent) and spent <= epsilon
    gaussian = calibrate(epsilon, DELTA, rounds, sampling_rate=q, accountant="rdp").noise_multiplier
    assert m / gaussian == pytest.approx(ratio, abs=0.01)
    continuous_rho = 1.0 / (2.0 * m ** 2)  # at 48 bits the KLS rho is the continuous one: the gap is the bound's
    assert run(m).event.rho == pytest.approx(continuous_rho, rel=1e-6)


def test_plan_event_is_the_kls_bound_of_the_replace_one_rounded_record_sensitivity():
    plan = plan_distributed_noise_sampled(4.0, 200, 1.3, 8, 6, 16, clip=0.5, sampling_rate=0.02, gaussian=False)
    q = plan.quantiser
    rounded = 0.5 / q.step + 2.0 * math.sqrt(200)  # clip/step + 2 sqrt(d): both sums are rounded
    assert rounded == q.rounded_l2_sensitivity(0.5, 200, replace_one=True)
    expected = max(distributed_noise_rho(l2_sensitivity=rounded, sigma=plan.local_sigma, n=n, dimension=200)
                   for n in range(6, 9))
    assert plan.event == PoissonSampledEvent(0.02, ZCDPEvent(expected, label="distributed_discrete_gaussian"))
    # noise of n_min shares: std noise_multiplier * clip in real units
    assert plan.noise_std(6) == pytest.approx(1.3 * 0.5, rel=1e-9)
    # 16 bits: few levels, so the rounding's 2 sqrt(d) inflates rho well above the continuous value
    assert expected > 1.0 / (2 * 1.3 ** 2) * 1.1
    # the Gaussian charge at the same quantiser: the rounded sensitivity over the honest shares' std, and a total
    # variation too large at 16 bits for a useful bound (the calibration then moves up or falls back)
    gaussian = plan_distributed_noise_sampled(4.0, 200, 1.3, 8, 6, 16, clip=0.5, sampling_rate=0.02)
    assert gaussian.quantiser == q and gaussian.event.event.event == GaussianEvent(rounded,
                                                                                    math.sqrt(6) * plan.local_sigma)
    assert gaussian.event.event.total_variation > 1e-6


def test_sampled_plan_uses_the_same_quantiser_as_the_unsampled_plan_for_the_same_noise():
    sampled = plan_distributed_noise_sampled(3.0, 50, 1.1, 10, 8, 40, clip=1.5, sampling_rate=0.1)
    unsampled = plan_distributed_noise(3.0, 50, 1.1, 10, 8, 40, sensitivity=1.5, relation="replace_one")
    assert sampled.quantiser == unsampled.quantiser and sampled.local_sigma == unsampled.local_sigma
    assert sampled.event == PoissonSampledEvent(0.1, unsampled.event)


def test_record_sensitivity_holds_on_random_neighbouring_samples():
    """Adding or removing one clipped record, then clipping the sum to [-B, B] and rounding both sums, moves the
    integer vector by less than clip/step + 2 sqrt(d)."""
    rng = np.random.default_rng(0)
    d, clip, bound = 30, 1.0, 2.0
    plan = plan_distributed_noise_sampled(bound, d, 1.0, 4, 4, 20, clip=clip, sampling_rate=0.1)
    q = plan.quantiser
    limit = q.rounded_l2_sensitivity(clip, d, replace_one=True)
    worst = 0.0
    for _ in range(300):
        records = rng.normal(size=(rng.integers(0, 8), d)) * rng.uniform(0.1, 3.0)
        records *= np.minimum(1.0, clip / np.maximum(np.linalg.norm(records, axis=1, keepdims=True), 1e-12))
        extra = rng.normal(size=d)
        extra *= min(1.0, clip / np.linalg.norm(extra))
        without = np.clip(records.sum(axis=0), -bound, bound)
        with_record = np.clip(records.sum(axis=0) + extra, -bound, bound)
        a = q.to_integers(without, rng)
        b = q.to_integers(with_record, rng)
        worst = max(worst, float(np.linalg.norm(a - b)))
    assert worst < limit


def test_the_quantiser_range_does_not_wrap_for_n_max_clients():
    n_max, n_min, bits, d, bound = 12, 9, 32, 64, 1.0
    plan = plan_distributed_noise_sampled(bound, d, 2.0, n_max, n_min, bits, clip=0.8, sampling_rate=0.05)
    q = plan.quantiser
    assert q.n_clients == n_max
    assert n_max * q.max_level + q.noise_headroom <= 2 ** (bits - 1) - 1
    rng = np.random.default_rng(1)
    for extreme in (bound, -bound):  # every client at the edge of the range, plus its noise share
        ints = [q.to_integers(np.full(d, extreme), rng) + sample_discrete_gaussian(plan.local_sigma, d, rng=rng)
                for _ in range(n_max)]
        words = [q.encode(v) for v in ints]
        total = np.zeros(d, dtype=np.uint64)
        for w in words:
            total = (total + w) & np.uint64(q.modulus - 1)
        decoded = q.decode_sum(total, n_max)
        expected = np.sum(ints, axis=0) * q.step
        np.testing.assert_allclose(decoded, expected, rtol=1e-12)
        assert np.all(np.sign(decoded) == np.sign(extreme))


def test_bad_survivor_configurations_raise_naming_the_flag():
    with pytest.raises(ConfigurationError, match="--min-survivors"):
        calibrate_distributed_sampled(3.0, DELTA, 10, 0.05, 1.0, 20, 1.0, 6, SecureAggregation(dropout=0.2))
    with pytest.raises(ConfigurationError, match="--min-survivors 6 exceeds"):
        calibrate_distributed_sampled(3.0, DELTA, 10, 0.05, 1.0, 20, 1.0, 6,
                                      SecureAggregation(dropout=0.2, min_survivors=6))
    plan = calibrate_distributed_sampled(3.0, DELTA, 10, 0.05, 1.0, 20, 1.0, 6,
                                         SecureAggregation(dropout=0.2, min_survivors=5))
    assert (plan.n_min, plan.n_max) == (5, 6)


@pytest.mark.parametrize("kwargs, words", [
    (dict(clip=0.0, sampling_rate=0.1), "clip"),
    (dict(clip=1.0, sampling_rate=0.0), "sampling rate"),
    (dict(clip=1.0, sampling_rate=1.5), "sampling rate"),
])
def test_bad_plan_arguments_are_refused(kwargs, words):
    with pytest.raises(ConfigurationError, match=words):
        plan_distributed_noise_sampled(1.0, 10, 1.0, 5, 5, 32, **kwargs)


def test_the_plan_is_charged_by_pld_and_rdp_ledgers_and_refused_by_zcdp_and_exact(tmp_path):
    for name in ("pld", "rdp"):
        plan = calibrate_distributed_sampled(4.0, DELTA, 20, 0.05, 1.0, 20, 1.0, 5, SecureAggregation(bits=48),
                                             accountant=name)
        led = PrivacyLedger(tmp_path / f"{name}.sqlite", "run", delta=DELTA, epsilon_budget=4.0, accountant=name)
        for rnd in range(20):
            led.charge("0", rnd, "update", plan.event)
        expected = make_accountant(name).compose(plan.event, 20).get_epsilon(DELTA)
        assert led.epsilon("0") == pytest.approx(expected, rel=1e-9)
        assert led.epsilon("0") <= 4.0
        (row,) = [c for c in led.charges() if c.round == 0]
        assert row.event == plan.event  # stored and read back whole, total variation included
    for name in ("zcdp", "exact"):
        other = PrivacyLedger(tmp_path / f"{name}.sqlite", "run", delta=DELTA, accountant=name)
        with pytest.raises(UnsupportedEventError, match="pld"):
            other.charge("0", 0, "update", plan.event)


def test_a_coarse_quantiser_falls_back_to_the_zcdp_bound_under_rdp_and_stays_sound_under_pld():
    """At 20 bits and d = 2000 the total variation of a plan near the target is too large for a Gaussian charge
    within 1% of delta: rdp charges the zCDP bound, pld the Gaussian with its term (a larger multiplier)."""
    secure = SecureAggregation(bits=20)
    rdp = calibrate_distributed_sampled(3.0, DELTA, 50, 0.05, 2.0, 2000, 1.0, 5, secure, accountant="rdp")
    pld = calibrate_distributed_sampled(3.0, DELTA, 50, 0.05, 2.0, 2000, 1.0, 5, secure, accountant="pld")
    assert isinstance(rdp.event.event, ZCDPEvent)
    assert isinstance(pld.event.event, ApproximatedEvent)
    for plan, name in ((rdp, "rdp"), (pld, "pld")):
        assert make_accountant(name).compose(plan.event, 50).get_epsilon(DELTA) <= 3.0
    with pytest.raises(ConfigurationError, match="pld"):
        calibrate_distributed_sampled(3.0, DELTA, 50, 0.05, 2.0, 20, 1.0, 5, secure, accountant="zcdp")


@pytest.mark.timeout(240)
def test_unsampled_distributed_runs_charge_the_zcdp_event_under_zcdp_and_the_gaussian_under_rdp(tmp_path):
    """A client-level distributed run with accountant zcdp charges the plain KLS zCDP event; with rdp (or pld, the
    default) the Gaussian its honest shares' sum nearly is; either way the ledger is the accountant's composition."""
    from privfl.algorithms import make_algorithm
    from privfl.core.config import FederationConfig, PrivacyConfig
    from privfl.data import make_federated
    from privfl.runtime.engine import Simulation

    data = make_federated("digits", 5, partition="iid", seed=0)
    fed = FederationConfig(rounds=2, hidden=(), local_epochs=1, lr=0.05)
    for accountant, mechanism in (("zcdp", "distributed_discrete_gaussian"),
                                  ("rdp", "distributed_discrete_gaussian~gaussian")):
        privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, clip=1.0, placement="distributed", accountant=accountant)
        alg = make_algorithm("dp_fedavg", fed, privacy)
        path = tmp_path / f"{accountant}.sqlite"
        res = Simulation(alg, data, fed, privacy, ledger_path=str(path),
                         secure=SecureAggregation(bits=48, min_survivors=4)).run()
        assert res.accountant == accountant and 0 < res.audit["max_epsilon"] <= 4.0
        led = PrivacyLedger.open_existing(path)
        assert {c.event.mechanism for c in led.charges()} == {mechanism}
        client = led.clients()[0]
        expected = make_accountant(accountant)
        for c in led.charges(client):
            expected.compose(c.event)
        assert led.epsilon(client) == pytest.approx(expected.get_epsilon(DELTA), rel=1e-9)


@pytest.mark.parametrize("args", [(0.0, DELTA, 10, 0.05), (float("inf"), DELTA, 10, 0.05), (3.0, 0.0, 10, 0.05),
                                  (3.0, DELTA, 0, 0.05), (3.0, DELTA, 10, 0.0), (3.0, DELTA, 10, 1.5)])
def test_bad_calibration_targets_are_refused(args):
    from privfl.accounting.errors import InvalidPrivacyParameter

    with pytest.raises(InvalidPrivacyParameter):
        calibrate_distributed_sampled(*args, 1.0, 20, 1.0, 5, SecureAggregation())
