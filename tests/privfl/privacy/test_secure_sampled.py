"""Record-level distributed noise under secure aggregation: a sum over a Poisson sample of records, charged
``PoissonSampledEvent(q, ZCDPEvent(rho))`` and composed by the rdp accountant (``privfl.privacy.secure``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privfl.accounting.accountants import make_accountant
from privfl.accounting.calibration import calibrate
from privfl.accounting.errors import UnsupportedEventError
from privfl.accounting.events import PoissonSampledEvent, ZCDPEvent
from privfl.accounting.ledger import PrivacyLedger
from privfl.errors import ConfigurationError
from privfl.mechanisms.discrete_gaussian import distributed_noise_rho, sample_discrete_gaussian
from privfl.privacy.secure import (SecureAggregation, calibrate_distributed_sampled, plan_distributed_noise,
                           plan_distributed_noise_sampled)

pytestmark = pytest.mark.timeout(120)

DELTA = 1e-5


def rdp_epsilon(event, rounds: int) -> float:
    return make_accountant("rdp").compose(event, rounds).get_epsilon(DELTA)


# (epsilon, rounds, q, dimension, clip, bound, clients, measured noise-multiplier ratio to the sampled Gaussian's)
SETTINGS = [(3.0, 100, 0.06, 1000, 1.0, 5.0, 10, 1.207),
            (8.0, 500, 0.06, 10000, 1.0, 20.0, 50, 1.112),
            (1.0, 50, 0.01, 100, 0.5, 2.0, 5, 1.025)]


@pytest.mark.parametrize("epsilon, rounds, q, d, clip, bound, n, ratio", SETTINGS)
def test_calibrated_plan_meets_the_target_closely_and_costs_a_measured_factor_over_the_gaussian(
        epsilon, rounds, q, d, clip, bound, n, ratio):
    plan = calibrate_distributed_sampled(epsilon, DELTA, rounds, q, bound, d, clip, n, SecureAggregation(bits=48))
    assert isinstance(plan.event, PoissonSampledEvent) and isinstance(plan.event.event, ZCDPEvent)
    assert plan.event.sampling_rate == q and plan.event.relation == "add_remove"
    spent = rdp_epsilon(plan.event, rounds)
    assert spent <= epsilon
    assert spent == pytest.approx(epsilon, rel=2e-4)  # LEDGER_MARGIN (1e-4) below, to the search's tolerance
    # the continuous Poisson-sampled Gaussian under the same (rdp) accountant is a lower bound on the noise
    gaussian = calibrate(epsilon, DELTA, rounds, sampling_rate=q, accountant="rdp").noise_multiplier
    assert gaussian <= plan.noise_multiplier
    assert plan.noise_multiplier / gaussian == pytest.approx(ratio, abs=0.01)
    # ... and the gap is the general bound's, not the rounding's: at 48 bits the KLS rho is the continuous one
    continuous_rho = 1.0 / (2.0 * plan.noise_multiplier ** 2)
    assert plan.event.event.rho == pytest.approx(continuous_rho, rel=1e-6)
    assert plan.event.event.rho >= continuous_rho


def test_plan_event_is_the_kls_bound_of_the_replace_one_rounded_record_sensitivity():
    plan = plan_distributed_noise_sampled(4.0, 200, 1.3, 8, 6, 16, clip=0.5, sampling_rate=0.02)
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


def test_the_plan_is_charged_by_an_rdp_ledger_and_refused_by_zcdp_and_pld(tmp_path):
    plan = calibrate_distributed_sampled(4.0, DELTA, 20, 0.05, 1.0, 20, 1.0, 5, SecureAggregation(bits=48))
    led = PrivacyLedger(tmp_path / "l.sqlite", "run", delta=DELTA, epsilon_budget=4.0, accountant="rdp")
    for rnd in range(20):
        led.charge("0", rnd, "update", plan.event)
    assert led.epsilon("0") == pytest.approx(rdp_epsilon(plan.event, 20), rel=1e-9)
    assert led.epsilon("0") <= 4.0
    for name in ("zcdp", "pld"):
        other = PrivacyLedger(tmp_path / f"{name}.sqlite", "run", delta=DELTA, accountant=name)
        with pytest.raises(UnsupportedEventError, match="rdp"):
            other.charge("0", 0, "update", plan.event)


@pytest.mark.timeout(240)
def test_unsampled_distributed_runs_still_charge_their_zcdp_event_under_the_rdp_accountant(tmp_path):
    """What ``PrivacyConfig`` allows for distributed placement (zcdp or rdp) still holds: the plain KLS zCDP event
    is composed by rdp as rho alpha."""
    from privfl.algorithms import make_algorithm
    from privfl.core.config import FederationConfig, PrivacyConfig
    from privfl.data import make_federated
    from privfl.runtime.engine import Simulation

    data = make_federated("digits", 5, partition="iid", seed=0)
    fed = FederationConfig(rounds=2, hidden=(), local_epochs=1, lr=0.05)
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, clip=1.0, placement="distributed", accountant="rdp")
    alg = make_algorithm("dp_fedavg", fed, privacy)
    res = Simulation(alg, data, fed, privacy, ledger_path=str(tmp_path / "l.sqlite"),
                     secure=SecureAggregation(bits=48, min_survivors=4)).run()
    assert res.accountant == "rdp" and 0 < res.audit["max_epsilon"] <= 4.0
    led = PrivacyLedger.open_existing(tmp_path / "l.sqlite")
    events = [c.event for c in led.charges()]
    assert {e.mechanism for e in events} == {"distributed_discrete_gaussian"}
    client = led.clients()[0]
    rounds = [c.event for c in led.charges(client)]
    expected = make_accountant("rdp")
    for e in rounds:
        expected.compose(e)
    assert led.epsilon(client) == pytest.approx(expected.get_epsilon(DELTA), rel=1e-9)


@pytest.mark.parametrize("args", [(0.0, DELTA, 10, 0.05), (float("inf"), DELTA, 10, 0.05), (3.0, 0.0, 10, 0.05),
                                  (3.0, DELTA, 0, 0.05), (3.0, DELTA, 10, 0.0), (3.0, DELTA, 10, 1.5)])
def test_bad_calibration_targets_are_refused(args):
    from privfl.accounting.errors import InvalidPrivacyParameter

    with pytest.raises(InvalidPrivacyParameter):
        calibrate_distributed_sampled(*args, 1.0, 20, 1.0, 5, SecureAggregation())
