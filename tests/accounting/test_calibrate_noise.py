"""The one generic calibrator: a factory noise -> event in, the smallest noise meeting the target out, never over."""

import math

import pytest

from accounting.calibration import calibrate, calibrate_noise, round_event
from accounting.accountants import make_accountant
from accounting.errors import InvalidPrivacyParameter
from accounting.events import GaussianEvent, PoissonSampledEvent, SelfComposedEvent


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
