"""The one generic calibrator: a factory noise -> event in, the smallest noise meeting the target out, never over."""

import math

import pytest

from privfl.accounting.calibration import calibrate, calibrate_noise, round_event
from privfl.accounting.accountants import make_accountant
from privfl.accounting.errors import InvalidPrivacyParameter
from privfl.accounting.events import GaussianEvent, PoissonSampledEvent, SelfComposedEvent


def _epsilon(name, event, delta=1e-5):
    return make_accountant(name).compose(event).get_epsilon(delta)


@pytest.mark.parametrize("accountant,q,rounds,eps", [("pld", 0.1, 50, 1.0), ("rdp", 0.2, 20, 3.0),
                                                    ("exact", 1.0, 10, 2.0), ("zcdp", 1.0, 5, 0.5)])
def test_never_overshoots_and_is_within_tol_of_the_smallest(accountant, q, rounds, eps):
    def make_event(z):
        inner = GaussianEvent(1.0, z)
        return SelfComposedEvent(inner if q == 1.0 else PoissonSampledEvent(q, inner), rounds)

    z, got = calibrate_noise(make_event, eps, 1e-5, accountant, tol=1e-3)
    assert got == _epsilon(accountant, make_event(z)) and got <= eps
    assert _epsilon(accountant, make_event(z / (1 + 1e-3))) > eps or z <= 1e-6


def test_calibrate_and_the_round_rule_agree_with_the_generic_search():
    cal = calibrate(3.0, 1e-5, 30, sampling_rate=0.1, channels={"a": 0.5, "b": 0.5}, accountant="pld")
    z, _ = calibrate_noise(lambda s: SelfComposedEvent(round_event({"a": s * math.sqrt(2), "b": s * math.sqrt(2)},
                                                                   0.1), 30), 3.0, 1e-5, "pld")
    assert math.isclose(z * math.sqrt(2), cal.noise_multipliers["a"], rel_tol=2e-3)


def test_an_unreachable_target_is_refused():
    with pytest.raises(InvalidPrivacyParameter, match="no noise multiplier up to"):
        calibrate_noise(lambda z: GaussianEvent(1.0, z), 1e-3, 1e-5, "exact", upper=10.0)


@pytest.mark.parametrize("rounds", [5, 60])
def test_a_ledger_composing_round_by_round_accepts_every_calibrated_round(tmp_path, rounds):
    """Calibration composes R rounds at once; the ledger composes them one round at a time (incremental). The
    calibrated noise must leave every one of the R rounds inside the budget, under the ledger's own composition."""
    from privfl.accounting.calibration import calibrate, round_event
    from privfl.accounting.ledger import ChargeRequest, PrivacyLedger

    cal = calibrate(2.0, 1e-5, rounds, sampling_rate=0.2, channels={"mean": 0.6, "precision": 0.4},
                    accountant="pld")
    event = round_event(cal.noise_multipliers, 0.2)
    led = PrivacyLedger(tmp_path / "l.sqlite", "run", delta=1e-5, epsilon_budget=2.0, accountant="pld")
    with led.transaction():
        for rnd in range(rounds):
            for client in range(3):
                led.charge_all(client, rnd, [ChargeRequest(name, PoissonSampledEvent(0.2, GaussianEvent(1.0, z)))
                                             for name, z in cal.noise_multipliers.items()])
    assert cal.epsilon <= 2.0 and led.audit()["max_epsilon"] <= 2.0
    assert led.audit()["max_epsilon"] == pytest.approx(cal.epsilon, rel=1e-6)
    assert event is not None


def test_dpsgd_calibration_holds_under_the_ledgers_round_by_round_composition(tmp_path):
    """DP-SGD steps and a Gaussian release per round (FOLA's shape): calibrated at once, charged round by round."""
    from privfl.accounting.ledger import ChargeRequest, PrivacyLedger
    from privfl.privacy.record_level import DPSGDSchedule, calibrate_dpsgd

    schedule = DPSGDSchedule.for_client(400, 32, 1)
    fisher = GaussianEvent(1.0, 25.0)
    rounds = 30
    z = calibrate_dpsgd(3.0, 1e-5, rounds, schedule, "pld", other_round_events=[fisher])
    led = PrivacyLedger(tmp_path / "l.sqlite", "run", delta=1e-5, epsilon_budget=3.0, accountant="pld")
    for rnd in range(rounds):
        led.charge_all(0, rnd, [ChargeRequest("fisher", fisher), ChargeRequest("mean", schedule.round_event(z))])
    assert 3.0 * (1 - 1e-3) <= led.epsilon(0) <= 3.0
