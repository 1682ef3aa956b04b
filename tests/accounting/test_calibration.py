"""Calibration acceptance: never overshoot the target, and stay within tolerance of the smallest noise."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant as DpPLDAccountant
from hypothesis import given, settings
from hypothesis import strategies as st

from privfl.accounting.accountants import ExactAccountant, make_accountant
from privfl.accounting.calibration import Calibration, calibrate, epsilon_for, round_event
from privfl.accounting.errors import InvalidPrivacyParameter
from privfl.accounting.events import ComposedEvent, GaussianEvent, PoissonSampledEvent

pytestmark = pytest.mark.timeout(60)
DELTA = 1e-5


def minimum_exact_noise(epsilon: float, delta: float, rounds: int) -> float:
    """rounds Gaussians at z are one Gaussian at z / sqrt(rounds); dp-accounting's analytic Gaussian gives its sigma."""
    return math.sqrt(rounds) * dp_accounting.get_sigma_gaussian(epsilon, delta)


class BisectedExact(ExactAccountant):
    """The exact accountant under another name, so calibration takes the bisection path instead of the closed form."""

    name = "exact_by_bisection"


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 3.0, 8.0])
@pytest.mark.parametrize("rounds", [1, 10, 100])
def test_exact_calibration_hits_the_minimum_noise(epsilon, rounds):
    cal = calibrate(epsilon, DELTA, rounds)
    assert cal.accountant == "exact"
    minimum = minimum_exact_noise(epsilon, DELTA, rounds)
    assert minimum * (1 - 1e-9) <= cal.noise_multiplier <= minimum * 1.01
    assert cal.epsilon <= epsilon
    assert epsilon_for(cal.noise_multipliers, rounds, 1.0, DELTA, "exact") == cal.epsilon


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 3.0, 8.0])
@pytest.mark.parametrize("rounds", [1, 10, 100])
def test_bisection_is_within_one_percent_and_never_below(epsilon, rounds):
    cal = calibrate(epsilon, DELTA, rounds, accountant=BisectedExact)
    assert cal.accountant == "exact_by_bisection"
    minimum = minimum_exact_noise(epsilon, DELTA, rounds)
    assert minimum * (1 - 1e-9) <= cal.noise_multiplier <= minimum * 1.01
    assert cal.epsilon <= epsilon


@settings(max_examples=25, deadline=None)
@given(epsilon=st.floats(0.05, 20.0), delta=st.floats(1e-12, 1e-2), rounds=st.integers(1, 5000),
       name=st.sampled_from(["exact", "zcdp", "rdp"]))
def test_calibration_never_overshoots(epsilon, delta, rounds, name):
    cal = calibrate(epsilon, delta, rounds, accountant=name, tol=1e-3)
    assert cal.epsilon <= epsilon
    assert make_accountant(name).compose(round_event(cal.noise_multipliers), rounds).get_epsilon(delta) <= epsilon
    if name != "exact":  # a hair less noise misses the target (exact: the closed form is the minimum itself)
        assert epsilon_for(cal.noise_multiplier / 1.001, rounds, 1.0, delta, name) > epsilon


def test_sampled_calibration_meets_the_target_and_matches_dp_accounting():
    q, rounds, epsilon = 0.1, 100, 1.0
    cal = calibrate(epsilon, DELTA, rounds, sampling_rate=q)
    assert cal.accountant == "pld"
    assert cal.epsilon <= epsilon
    # Re-check with a fresh dp-accounting accountant at its default (finer) discretisation.
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(cal.noise_multiplier)), rounds)
    assert DpPLDAccountant().compose(event).get_epsilon(DELTA) <= epsilon
    # dp-accounting's own calibration of the same mechanism (its default PLD accountant) agrees within 2%.
    theirs = dp_accounting.calibrate_dp_mechanism(
        DpPLDAccountant,
        lambda z: dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds),
        epsilon, DELTA, bracket_interval=dp_accounting.ExplicitBracketInterval(1.0, 10.0), tol=1e-3)
    assert cal.noise_multiplier == pytest.approx(theirs, rel=0.02)


@pytest.mark.parametrize("epsilon,q,rounds", [(3.0, 0.1, 100), (1.0, 0.01, 1000), (8.0, 0.05, 20)])
def test_sampled_calibration_matches_dp_accounting_at_the_same_discretisation(epsilon, q, rounds):
    cal = calibrate(epsilon, DELTA, rounds, sampling_rate=q)
    assert cal.epsilon <= epsilon
    theirs = dp_accounting.calibrate_dp_mechanism(
        lambda: DpPLDAccountant(value_discretization_interval=1e-3),
        lambda z: dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds),
        epsilon, DELTA, tol=1e-4)
    assert cal.noise_multiplier == pytest.approx(theirs, rel=0.02)


def test_sampled_calibration_under_rdp_needs_more_noise_than_pld():
    pld = calibrate(2.0, DELTA, 50, sampling_rate=0.1, accountant="pld")
    rdp = calibrate(2.0, DELTA, 50, sampling_rate=0.1, accountant="rdp")
    assert rdp.epsilon <= 2.0 and pld.epsilon <= 2.0
    assert rdp.noise_multiplier > pld.noise_multiplier


@pytest.mark.parametrize("sampling_rate,accountant", [(1.0, "exact"), (1.0, "zcdp"), (0.1, "pld"), (0.1, "rdp")])
def test_two_channels_meet_the_target_and_split_the_budget(sampling_rate, accountant):
    shares = {"natural_mean": 0.7, "precision": 0.3}
    cal = calibrate(1.0, DELTA, 20, sampling_rate=sampling_rate, channels=shares, accountant=accountant)
    assert set(cal.noise_multipliers) == set(shares)
    assert cal.epsilon <= 1.0
    assert epsilon_for(cal.noise_multipliers, 20, sampling_rate, DELTA, accountant) <= 1.0
    z = cal.noise_multipliers
    # Channel c carries share_c of the round's 1/z^2 (its rho, or its mu^2).
    assert (1 / z["natural_mean"] ** 2) / (1 / z["precision"] ** 2) == pytest.approx(0.7 / 0.3, rel=1e-12)
    # The round as a whole is one Gaussian with noise multiplier s: the single-channel answer.
    single = calibrate(1.0, DELTA, 20, sampling_rate=sampling_rate, accountant=accountant)
    combined = 1 / math.sqrt(sum(1 / v ** 2 for v in z.values()))
    assert combined == pytest.approx(single.noise_multiplier, rel=2e-3)
    with pytest.raises(InvalidPrivacyParameter):
        cal.noise_multiplier


def test_shares_are_normalised():
    a = calibrate(2.0, DELTA, 10, channels={"a": 7, "b": 3})
    b = calibrate(2.0, DELTA, 10, channels={"a": 0.7, "b": 0.3})
    assert a.noise_multipliers == pytest.approx(b.noise_multipliers, rel=1e-12)


def test_round_event_and_epsilon_for_build_the_calibrated_events():
    assert round_event({"update": 2.0}) == GaussianEvent(1.0, 2.0)
    assert round_event({"a": 2.0, "b": 3.0}, 0.5) == PoissonSampledEvent(
        0.5, ComposedEvent((GaussianEvent(1.0, 2.0), GaussianEvent(1.0, 3.0))))
    cal = calibrate(1.0, DELTA, 30, sampling_rate=0.2, channels={"a": 1, "b": 2})
    assert epsilon_for(cal.noise_multipliers, 30, 0.2, DELTA) == pytest.approx(cal.epsilon, rel=1e-12)
    assert epsilon_for(4.0, 10, delta=DELTA) == ExactAccountant().compose(GaussianEvent(1, 4.0), 10).get_epsilon(DELTA)


def test_accountant_factories_are_accepted():
    cal = calibrate(1.0, DELTA, 50, sampling_rate=0.1,
                    accountant=lambda: make_accountant("pld", value_discretization_interval=5e-4))
    assert cal.accountant == "pld" and cal.epsilon <= 1.0


def test_calibration_is_a_frozen_record():
    cal = calibrate(1.0, DELTA, 10)
    assert isinstance(cal, Calibration)
    with pytest.raises(AttributeError):
        cal.epsilon = 2.0  # type: ignore[misc]
    assert cal.delta == DELTA and cal.rounds == 10 and cal.sampling_rate == 1.0 and cal.target_epsilon == 1.0


@pytest.mark.parametrize("kwargs", [
    dict(target_epsilon=0.0), dict(target_epsilon=-1.0), dict(target_epsilon=math.nan), dict(target_epsilon=math.inf),
    dict(target_delta=0.0), dict(target_delta=1.0), dict(target_delta=math.nan), dict(target_delta=-1e-5),
    dict(rounds=0), dict(rounds=1.5), dict(rounds=True), dict(rounds=-3),
    dict(sampling_rate=0.0), dict(sampling_rate=1.5), dict(sampling_rate=math.nan), dict(sampling_rate=1e-6),
    dict(channels={}), dict(channels={"a": 0.0}), dict(channels={"a": -1.0}), dict(channels={"a": math.nan}),
    dict(channels={"a": math.inf}), dict(channels={"": 1.0}), dict(channels=[("a", 1.0)]),
    dict(accountant="moments"), dict(accountant=42), dict(tol=0.0), dict(tol=0.5), dict(tol=math.nan),
])
def test_invalid_calibration_requests_raise(kwargs):
    args = dict(target_epsilon=1.0, target_delta=DELTA, rounds=10) | kwargs
    with pytest.raises(InvalidPrivacyParameter):
        calibrate(**args)


def test_exact_with_sampling_points_to_pld_or_rdp():
    with pytest.raises(InvalidPrivacyParameter, match="pld"):
        calibrate(1.0, DELTA, 10, sampling_rate=0.5, accountant="exact")
    with pytest.raises(InvalidPrivacyParameter, match="pld"):
        epsilon_for({"update": 3.0}, 10, 0.5, DELTA, "exact")


def test_zcdp_with_sampling_is_refused_clearly():
    with pytest.raises(InvalidPrivacyParameter, match="zcdp"):
        calibrate(1.0, DELTA, 10, sampling_rate=0.5, accountant="zcdp")
