"""Sampled events under the replace-one relation (clients' record counts public): closed forms, agreement with
dp-accounting, the looseness of the add/remove-with-2C shortcut, the ledger and calibration."""

from __future__ import annotations

import json
import math
import sqlite3

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant as DpPLDAccountant
from dp_accounting.pld import privacy_loss_distribution as dp_pld

from privfl.accounting import (ComposedEvent, GaussianEvent, InvalidPrivacyParameter, PoissonSampledEvent,
                        SelfComposedEvent, UnsupportedEventError, calibrate, epsilon_for, event_from_dict,
                        make_accountant)
from privfl.accounting.accountants import pld as pld_module
from privfl.accounting.ledger import ChargeRequest, PrivacyLedger, round_events

pytestmark = pytest.mark.timeout(60)
DELTA = 1e-5
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
INTERVAL = 1e-3  # the pld backend's default grid


def epsilon_of(name: str, event, count: int = 1, delta: float = DELTA) -> float:
    return make_accountant(name).compose(event, count).get_epsilon(delta)


def sampled(q: float, displacement: float, noise_std: float, relation: str = "replace_one") -> PoissonSampledEvent:
    return PoissonSampledEvent(q, GaussianEvent(displacement, noise_std), relation)


# -- the event -------------------------------------------------------------------------------------------------------

def test_relation_is_validated_and_named_in_the_error():
    assert PoissonSampledEvent(0.1, GaussianEvent(1.0, 1.0)).relation == "add_remove"
    for bad in ("swap", "", None, 1, "REPLACE_ONE"):
        with pytest.raises(InvalidPrivacyParameter, match="add_remove.*replace_one"):
            PoissonSampledEvent(0.1, GaussianEvent(1.0, 1.0), bad)


def test_relation_is_serialised_and_old_rows_read_back_as_add_remove():
    event = sampled(0.2, 2.0, 3.0)
    assert event.to_dict()["relation"] == "replace_one"
    assert event_from_dict(event.to_dict()) == event
    assert event.mechanism == "poisson_replace_one(gaussian)"
    legacy = {"kind": "poisson_sampled", "sampling_rate": 0.2, "event": GaussianEvent(1.0, 3.0).to_dict()}
    assert event_from_dict(legacy) == PoissonSampledEvent(0.2, GaussianEvent(1.0, 3.0), "add_remove")
    assert event != PoissonSampledEvent(0.2, GaussianEvent(2.0, 3.0))  # the relation is part of the event


# -- closed forms ------------------------------------------------------------------------------------------------

def test_replace_one_radius_is_half_the_displacement():
    """dp-accounting's REPLACE_ONE at radius r and q = 1 is the Gaussian of sensitivity 2r (eps 4.377 at sd = 2)."""
    theirs = dp_pld.from_gaussian_mechanism(2.0, sampling_prob=1.0, neighboring_relation=REPLACE_ONE,
                                            value_discretization_interval=1e-4).get_epsilon_for_delta(DELTA)
    exact = epsilon_of("exact", GaussianEvent(2.0, 2.0))
    assert exact == pytest.approx(4.3771781, rel=1e-6)
    assert theirs == pytest.approx(exact, rel=1e-3)


@pytest.mark.parametrize("displacement,noise_std", [(2.0, 2.0), (1.0, 3.0), (0.5, 0.4)])
def test_sampling_everyone_under_replace_one_is_the_unsampled_gaussian(displacement, noise_std):
    unsampled = epsilon_of("exact", GaussianEvent(displacement, noise_std), 3)
    for name in ("pld", "rdp", "exact", "zcdp"):
        everyone = epsilon_of(name, sampled(1.0, displacement, noise_std), 3)
        assert everyone == pytest.approx(epsilon_of(name, GaussianEvent(displacement, noise_std), 3), rel=1e-12)
    assert epsilon_of("pld", sampled(1.0, displacement, noise_std), 3) == pytest.approx(unsampled, rel=1e-12)
    # The sampled path itself (q a hair below 1) lands on the same curve: radius = displacement / 2 is right.
    almost = epsilon_of("pld", sampled(1.0 - 1e-9, displacement, noise_std), 3)
    assert almost == pytest.approx(unsampled, rel=2e-3, abs=2e-3)
    assert almost >= unsampled * (1 - 1e-9)  # pessimistic grid: never below the exact value


@pytest.mark.parametrize("q,z", [(0.01, 0.8), (0.1, 1.0), (0.3, 2.0)])
def test_sampled_replace_one_matches_dp_accountings_replace_one_accountant(q, z):
    """dp-accounting's radius-1 sampled Gaussian at noise z is our displacement-2 event at noise_std z."""
    theirs = DpPLDAccountant(REPLACE_ONE, value_discretization_interval=INTERVAL).compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), 100)
    ours = make_accountant("pld").compose(sampled(q, 2.0, z), 100)
    assert ours.get_epsilon(DELTA) == pytest.approx(theirs.get_epsilon(DELTA), rel=1e-12)
    assert ours.get_delta(1.0) == pytest.approx(theirs.get_delta(1.0), rel=1e-9)
    # A round of two channels on one coin is one Gaussian with mu^2 = sum mu_c^2.
    two = make_accountant("pld").compose(PoissonSampledEvent(q, ComposedEvent(
        (GaussianEvent(2.0, z * math.sqrt(2)), GaussianEvent(2.0, z * math.sqrt(2)))), "replace_one"), 100)
    assert two.get_epsilon(DELTA) == pytest.approx(theirs.get_epsilon(DELTA), rel=1e-9)


@pytest.mark.parametrize("events", [
    [(PoissonSampledEvent(0.1, GaussianEvent(1.0, 1.0)), 100)],
    [(PoissonSampledEvent(0.01, GaussianEvent(1.0, 0.8)), 1000)],
    [(GaussianEvent(1.0, 4.0), 3), (PoissonSampledEvent(0.2, GaussianEvent(1.0, 1.5)), 40),
     (SelfComposedEvent(PoissonSampledEvent(0.05, GaussianEvent(2.0, 3.0)), 7), 2)],
])
def test_add_remove_results_equal_dp_accountings_pld_accountant(events):
    ours = make_accountant("pld")
    theirs = DpPLDAccountant(value_discretization_interval=INTERVAL)
    for event, count in events:
        ours.compose(event, count)
        inner = event.event if isinstance(event, SelfComposedEvent) else event
        n = event.count if isinstance(event, SelfComposedEvent) else 1
        if isinstance(inner, PoissonSampledEvent):
            dp_event = dp_accounting.PoissonSampledDpEvent(inner.sampling_rate, dp_accounting.GaussianDpEvent(
                inner.event.noise_multiplier))
        else:
            dp_event = dp_accounting.GaussianDpEvent(inner.noise_multiplier)
        theirs.compose(dp_accounting.SelfComposedDpEvent(dp_event, n), count)
    assert ours.get_epsilon(DELTA) == pytest.approx(theirs.get_epsilon(DELTA), rel=1e-12)
    assert ours.get_delta(2.0) == pytest.approx(theirs.get_delta(2.0), rel=1e-9)


# -- the looseness of charging replace-one as add/remove with sensitivity 2C ---------------------------------------------

@pytest.mark.parametrize("q,sigma_over_clip,rounds", [(0.01, 1.0, 1000), (0.1, 2.0, 100), (0.05, 3.0, 500),
                                                       (0.2, 4.0, 50)])
def test_replace_one_is_tighter_than_add_remove_with_twice_the_clip(q, sigma_over_clip, rounds):
    clip = 1.0
    sigma = sigma_over_clip * clip
    replace = epsilon_of("pld", sampled(q, 2 * clip, sigma), rounds)
    add_remove_2c = epsilon_of("pld", sampled(q, 2 * clip, sigma, "add_remove"), rounds)
    ratio = add_remove_2c / replace
    print(f"q={q} sigma/C={sigma_over_clip} rounds={rounds}: replace-one eps {replace:.4g}, "
          f"add/remove with 2C {add_remove_2c:.4g}, ratio {ratio:.2f}")
    assert 0 < replace < add_remove_2c
    assert ratio > 1.15  # larger with less noise: 4.7x at sigma / C = 1, 1.6x at 2, 1.2x at 3-4


# -- one relation per history -------------------------------------------------------------------------------------

def test_mixing_relations_is_refused_and_leaves_no_trace():
    accountant = make_accountant("pld").compose(sampled(0.1, 2.0, 2.0), 10).compose(GaussianEvent(1.0, 5.0))
    before = (accountant.events, accountant.get_epsilon(DELTA))
    with pytest.raises(UnsupportedEventError, match="one neighbouring relation"):
        accountant.compose(sampled(0.1, 1.0, 2.0, "add_remove"))
    assert (accountant.events, accountant.get_epsilon(DELTA)) == before
    assert accountant.relation == "replace_one"
    mixed = ComposedEvent((sampled(0.1, 2.0, 2.0), sampled(0.2, 1.0, 2.0, "add_remove")))
    assert not make_accountant("pld").supports(mixed)
    # Unsampled Gaussians and q = 1 events compose with either relation.
    accountant.compose(PoissonSampledEvent(1.0, GaussianEvent(1.0, 3.0), "add_remove"))


def test_rdp_refuses_replace_one_sampling_and_points_to_pld():
    with pytest.raises(UnsupportedEventError, match="pld"):
        make_accountant("rdp").compose(sampled(0.1, 2.0, 2.0))
    for name in ("exact", "zcdp"):
        with pytest.raises(UnsupportedEventError, match="cannot compose"):
            make_accountant(name).compose(sampled(0.1, 2.0, 2.0))
    assert make_accountant("rdp").supports(sampled(1.0, 2.0, 2.0))  # q = 1 is the unsampled Gaussian


def test_leaf_distributions_are_built_once_and_reused():
    event = sampled(0.07, 2.0, 1.3)
    make_accountant("pld").compose(event, 37).get_epsilon(DELTA)
    blocks, leaves = pld_module._block_pld.cache_info(), pld_module._leaf_pld.cache_info()
    again = make_accountant("pld").compose(event, 37)
    again.get_epsilon(DELTA)
    again.get_delta(1.0)
    assert pld_module._block_pld.cache_info().hits == blocks.hits + 1  # built once for both answers, from cache
    assert pld_module._leaf_pld.cache_info().misses == leaves.misses
    singles = pld_module._single_pld.cache_info()
    make_accountant("pld").compose(event, 38).get_epsilon(DELTA)  # a new count reuses the one-step distribution
    assert pld_module._single_pld.cache_info().misses == singles.misses


# -- the ledger ------------------------------------------------------------------------------------------------------

def test_round_events_group_by_coin_and_relation():
    a, b = GaussianEvent(2.0, 1.0), GaussianEvent(2.0, 3.0)
    grouped = round_events([(0, PoissonSampledEvent(0.1, a, "replace_one")),
                            (0, PoissonSampledEvent(0.1, b, "replace_one")),
                            (1, PoissonSampledEvent(0.1, a, "replace_one"))])
    assert grouped == [PoissonSampledEvent(0.1, ComposedEvent((a, b)), "replace_one"),
                       PoissonSampledEvent(0.1, a, "replace_one")]
    split = round_events([(0, PoissonSampledEvent(0.1, a, "replace_one")), (0, PoissonSampledEvent(0.1, b))])
    assert {e.relation for e in split} == {"replace_one", "add_remove"}


def test_ledger_stores_and_reopens_replace_one_events(tmp_path):
    path = tmp_path / "ledger.sqlite"
    led = PrivacyLedger(path, "run", delta=DELTA, epsilon_budget=20.0, accountant="pld")
    for rnd in range(5):
        led.charge_all("a", rnd, [ChargeRequest("mean", sampled(0.2, 2.0, 3.0)),
                                  ChargeRequest("precision", sampled(0.2, 2.0, 6.0))])
    spent = led.epsilon("a")
    expected = epsilon_for({"mean": 1.5, "precision": 3.0}, 5, 0.2, DELTA, "pld", relation="replace_one")
    assert spent == pytest.approx(expected, rel=1e-9)
    assert spent < epsilon_for({"mean": 1.5, "precision": 3.0}, 5, 0.2, DELTA, "pld")
    mechanisms = {r[0] for r in sqlite3.connect(path).execute("SELECT mechanism FROM charges")}
    assert mechanisms == {"poisson_replace_one(gaussian)"}
    led.close()
    again = PrivacyLedger.open_existing(path)
    assert all(c.event.relation == "replace_one" for c in again.charges())
    assert again.epsilon("a") == pytest.approx(spent, rel=1e-12)
    report = again.audit()
    assert report["clients"]["a"]["rho"] == pytest.approx(5 * (2 / 9 + 2 / 36), rel=1e-12)  # no amplification
    # A client's run has one relation: an add/remove sampled charge is refused and writes nothing.
    rows = len(again.charges())
    with pytest.raises(UnsupportedEventError):
        again.charge("a", 5, "mean", sampled(0.2, 1.0, 3.0, "add_remove"))
    assert len(again.charges()) == rows


def test_rows_written_before_relations_read_back_as_add_remove(tmp_path):
    path = tmp_path / "ledger.sqlite"
    led = PrivacyLedger(path, "run", accountant="pld")
    led.charge("a", 0, "u", PoissonSampledEvent(0.1, GaussianEvent(1.0, 1.0)))
    eps = led.epsilon("a")
    conn = sqlite3.connect(path)
    legacy = {"kind": "poisson_sampled", "sampling_rate": 0.1, "event": {"kind": "gaussian", "sensitivity": 1.0,
                                                                          "noise_std": 1.0}}
    conn.execute("UPDATE charges SET event=?", (json.dumps(legacy),))
    conn.commit()
    conn.close()
    assert led.charges()[0].event.relation == "add_remove"
    assert led.epsilon("a") == eps


# -- calibration ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("epsilon,q,rounds", [(1.0, 0.01, 1000), (3.0, 0.1, 100)])
def test_replace_one_calibration_meets_its_target_and_beats_the_2c_shortcut(epsilon, q, rounds):
    replace = calibrate(epsilon, DELTA, rounds, sampling_rate=q, relation="replace_one")
    shortcut = calibrate(epsilon, DELTA, rounds, sampling_rate=q)  # add/remove, charged with sensitivity 2C
    assert replace.relation == "replace_one" and replace.accountant == "pld"
    assert replace.epsilon <= epsilon
    assert epsilon_for(replace.noise_multipliers, rounds, q, DELTA, "pld", relation="replace_one") <= epsilon
    # Both multipliers are relative to the displacement 2C, so the noise std is z * 2C in both runs.
    assert replace.noise_multiplier < shortcut.noise_multiplier
    print(f"eps={epsilon} q={q} rounds={rounds}: replace-one z={replace.noise_multiplier:.4f}, "
          f"add/remove 2C z={shortcut.noise_multiplier:.4f} ({shortcut.noise_multiplier / replace.noise_multiplier:.2f}x)")
    # A fresh dp-accounting REPLACE_ONE accountant (radius C: noise multiplier 2 z) agrees that the target is met.
    check = DpPLDAccountant(REPLACE_ONE, value_discretization_interval=1e-4).compose(
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(2 * replace.noise_multiplier)), rounds))
    assert check.get_epsilon(DELTA) <= epsilon
    # And it is tight: a hair less noise misses the target.
    assert epsilon_for(replace.noise_multiplier / 1.002, rounds, q, DELTA, "pld", relation="replace_one") > epsilon


def test_replace_one_calibration_needs_pld():
    with pytest.raises(InvalidPrivacyParameter, match="pld"):
        calibrate(1.0, DELTA, 10, sampling_rate=0.1, accountant="rdp", relation="replace_one")
    # Without sampling the relation changes nothing: the Gaussian's displacement already carries it.
    assert calibrate(1.0, DELTA, 10, relation="replace_one").noise_multiplier == calibrate(1.0, DELTA,
                                                                                            10).noise_multiplier
