"""The contract every accountant backend must honour, run against all of them (dp-accounting's habit)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privfl.accounting.accountants import ACCOUNTANTS, make_accountant
from privfl.accounting.errors import InvalidPrivacyParameter, UnsupportedEventError
from privfl.accounting.events import (ComposedEvent, GaussianEvent, NoOpEvent, NonPrivateEvent, PoissonSampledEvent,
                               SelfComposedEvent, UnsupportedEvent, ZCDPEvent)

NAMES = sorted(ACCOUNTANTS)
DELTA = 1e-5

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=NAMES)
def name(request) -> str:
    return request.param


def epsilon_of(name: str, event, count: int = 1, delta: float = DELTA) -> float:
    return make_accountant(name).compose(event, count).get_epsilon(delta)


def test_factory_builds_every_backend_empty(name):
    accountant = make_accountant(name)
    assert accountant.name == name
    assert accountant.events == ()
    assert accountant.get_epsilon(DELTA) == 0.0
    assert accountant.get_delta(0.0) == 0.0


def test_factory_refuses_unknown_names_and_lists_the_valid_ones():
    with pytest.raises(InvalidPrivacyParameter) as err:
        make_accountant("moments")
    for valid in NAMES:
        assert valid in str(err.value)
    with pytest.raises(InvalidPrivacyParameter):
        make_accountant(None)  # type: ignore[arg-type]


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(NAMES), noise_std=st.floats(2.0, 60.0), sensitivity=st.floats(0.1, 4.0),
       count=st.integers(1, 16), delta=st.floats(1e-12, 0.5))
def test_epsilon_is_never_negative_nor_nan(name, noise_std, sensitivity, count, delta):
    epsilon = epsilon_of(name, GaussianEvent(sensitivity, noise_std), count, delta)
    assert epsilon >= 0.0 and not math.isnan(epsilon)
    delta_back = make_accountant(name).compose(GaussianEvent(sensitivity, noise_std), count).get_delta(epsilon)
    assert 0.0 <= delta_back <= 1.0


def test_epsilon_decreases_as_noise_grows(name):
    epsilons = [epsilon_of(name, GaussianEvent(1.0, sigma), 10) for sigma in (1.0, 2.0, 4.0, 8.0, 16.0)]
    assert all(e > 0 for e in epsilons)
    assert all(a > b for a, b in zip(epsilons, epsilons[1:])), epsilons


def test_epsilon_decreases_as_noise_grows_under_sampling(name):
    sampled = [PoissonSampledEvent(0.1, GaussianEvent(1.0, sigma)) for sigma in (1.0, 2.0, 4.0)]
    if not make_accountant(name).supports(sampled[0]):
        pytest.skip(f"{name} does not compose sampled events")
    epsilons = [epsilon_of(name, event, 20) for event in sampled]
    assert all(a > b > 0 for a, b in zip(epsilons, epsilons[1:])), epsilons


@pytest.mark.parametrize("sigma,count", [(2.0, 1), (5.0, 10), (3.0, 16), (20.0, 4)])
@pytest.mark.parametrize("delta", [1e-10, 1e-5, 1e-2])
def test_epsilon_delta_epsilon_round_trip(name, sigma, count, delta):
    accountant = make_accountant(name).compose(GaussianEvent(1.0, sigma), count)
    epsilon = accountant.get_epsilon(delta)
    delta_back = accountant.get_delta(epsilon)
    assert delta_back <= delta * (1 + 1e-9)
    assert delta_back == pytest.approx(delta, rel=1e-6)
    assert accountant.get_epsilon(delta_back) == pytest.approx(epsilon, rel=1e-6)


def test_delta_epsilon_round_trip(name):
    accountant = make_accountant(name).compose(GaussianEvent(1.0, 3.0), 8)
    for epsilon in (0.25, 1.0, 4.0):
        delta = accountant.get_delta(epsilon)
        assert 0 < delta < 1
        assert accountant.get_epsilon(delta) == pytest.approx(epsilon, rel=1e-6)


def test_delta_decreases_in_epsilon(name):
    accountant = make_accountant(name).compose(GaussianEvent(1.0, 2.0), 5)
    deltas = [accountant.get_delta(e) for e in (0.0, 0.5, 1.0, 2.0, 4.0)]
    assert all(a > b for a, b in zip(deltas, deltas[1:])), deltas


@pytest.mark.parametrize("refused", [
    UnsupportedEvent("a mechanism nobody can account for"),
    ComposedEvent((GaussianEvent(1.0, 1.0), UnsupportedEvent("hidden inside a composition"))),
    SelfComposedEvent(UnsupportedEvent(), 3),
    PoissonSampledEvent(0.5, PoissonSampledEvent(0.5, ZCDPEvent(0.1))),  # nested sampling of a zCDP event
    PoissonSampledEvent(0.5, ZCDPEvent(0.1), "replace_one"),
])
def test_a_refused_event_leaves_no_trace(name, refused):
    accountant = make_accountant(name).compose(GaussianEvent(1.0, 4.0), 3)
    events_before = accountant.events
    epsilon_before = accountant.get_epsilon(DELTA)
    delta_before = accountant.get_delta(1.0)
    assert not accountant.supports(refused)
    with pytest.raises(UnsupportedEventError):
        accountant.compose(refused)
    assert accountant.events == events_before
    assert accountant.get_epsilon(DELTA) == epsilon_before
    assert accountant.get_delta(1.0) == delta_before


def test_refusals_specific_to_each_backend(name):
    """exact and zcdp refuse sampling (q < 1); pld refuses bare and sampled zCDP events; rdp composes all three."""
    sampled = PoissonSampledEvent(0.3, GaussianEvent(1.0, 2.0))
    zcdp = ZCDPEvent(0.2)
    accountant = make_accountant(name)
    assert accountant.supports(sampled) == (name in ("pld", "rdp"))
    assert accountant.supports(zcdp) == (name in ("rdp", "zcdp"))
    assert accountant.supports(PoissonSampledEvent(0.3, zcdp)) == (name == "rdp")
    # Sampling everyone (q = 1) changes nothing, and every backend composes it like the bare release.
    everyone = PoissonSampledEvent(1.0, GaussianEvent(1.0, 2.0))
    assert epsilon_of(name, everyone, 3) == pytest.approx(epsilon_of(name, GaussianEvent(1.0, 2.0), 3), rel=1e-9)


@pytest.mark.parametrize("bad_count", [0, -1, 1.5, True, "2"])
def test_bad_counts_raise_and_leave_no_trace(name, bad_count):
    accountant = make_accountant(name).compose(GaussianEvent(1.0, 2.0))
    with pytest.raises(InvalidPrivacyParameter):
        accountant.compose(GaussianEvent(1.0, 2.0), bad_count)
    assert len(accountant.events) == 1


def test_non_private_release_means_infinite_epsilon(name):
    accountant = make_accountant(name).compose(GaussianEvent(1.0, 2.0)).compose(NonPrivateEvent())
    assert accountant.get_epsilon(DELTA) == math.inf
    assert accountant.get_delta(10.0) == 1.0
    nested = ComposedEvent((GaussianEvent(1.0, 2.0), SelfComposedEvent(NonPrivateEvent(), 2)))
    assert epsilon_of(name, nested) == math.inf


def test_noop_costs_nothing(name):
    base = epsilon_of(name, GaussianEvent(1.0, 3.0), 4)
    with_noop = make_accountant(name).compose(GaussianEvent(1.0, 3.0), 4).compose(NoOpEvent(), 7)
    assert with_noop.get_epsilon(DELTA) == pytest.approx(base, rel=1e-12)
    assert epsilon_of(name, NoOpEvent(), 5) == 0.0


def test_count_is_self_composition(name):
    """compose(e, n) == compose(SelfComposedEvent(e, n)) == n separate composes."""
    event = GaussianEvent(1.5, 6.0)
    by_count = epsilon_of(name, event, 6)
    by_event = epsilon_of(name, SelfComposedEvent(event, 6))
    looped = make_accountant(name)
    for _ in range(6):
        looped.compose(event)
    assert by_event == pytest.approx(by_count, rel=1e-9)
    assert looped.get_epsilon(DELTA) == pytest.approx(by_count, rel=1e-3)


def test_composition_costs_more_than_its_parts(name):
    one = epsilon_of(name, GaussianEvent(1.0, 3.0))
    both = epsilon_of(name, ComposedEvent((GaussianEvent(1.0, 3.0), GaussianEvent(1.0, 5.0))))
    assert both > one


@pytest.mark.parametrize("bad_delta", [math.nan, math.inf, -math.inf, -1e-5, 0.0, 1.0, 1.5, None, "1e-5"])
def test_bad_delta_raises(name, bad_delta):
    accountant = make_accountant(name).compose(GaussianEvent(1.0, 2.0))
    with pytest.raises(InvalidPrivacyParameter):
        accountant.get_epsilon(bad_delta)


@pytest.mark.parametrize("bad_epsilon", [math.nan, math.inf, -math.inf, -0.5, None, "1"])
def test_bad_epsilon_raises(name, bad_epsilon):
    accountant = make_accountant(name).compose(GaussianEvent(1.0, 2.0))
    with pytest.raises(InvalidPrivacyParameter):
        accountant.get_delta(bad_epsilon)


@pytest.mark.parametrize("build", [
    lambda: GaussianEvent(1.0, math.nan),
    lambda: GaussianEvent(1.0, -1.0),
    lambda: GaussianEvent(1.0, 0.0),
    lambda: GaussianEvent(1.0, math.inf),
    lambda: GaussianEvent(math.nan, 1.0),
    lambda: ZCDPEvent(-0.1),
    lambda: ZCDPEvent(math.nan),
    lambda: ZCDPEvent(math.inf),
    lambda: PoissonSampledEvent(0.0, GaussianEvent(1.0, 1.0)),
    lambda: PoissonSampledEvent(1.5, GaussianEvent(1.0, 1.0)),
    lambda: PoissonSampledEvent(-0.1, GaussianEvent(1.0, 1.0)),
    lambda: PoissonSampledEvent(math.nan, GaussianEvent(1.0, 1.0)),
    lambda: SelfComposedEvent(GaussianEvent(1.0, 1.0), 0),
])
def test_invalid_events_cannot_be_built(build):
    with pytest.raises(InvalidPrivacyParameter):
        build()
