import math

import numpy as np
import pytest
from scipy import stats

from privfl.accounting.events import GaussianEvent
from privfl.mechanisms import (GaussianMechanism, InvalidRelease, ReleaseMisuse, SecureNoise, SeededNoise,
                        gaussian_noise)


def test_release_returns_value_and_its_event():
    mech = GaussianMechanism(sensitivity=2.0, noise_multiplier=1.5)
    noisy, event = mech.release(np.zeros(10), np.random.default_rng(0))
    assert noisy.shape == (10,)
    assert event == GaussianEvent(2.0, 3.0)
    assert event.rho == pytest.approx(2.0 ** 2 / (2 * 3.0 ** 2))


def test_no_noise_limit_returns_value():
    # The mechanism never alters the value beyond its noise: with a tiny multiplier the value passes through.
    mech = GaussianMechanism(1.0, 1e-12)
    x = np.arange(5.0)
    noisy, _ = mech.release(x, 0)
    np.testing.assert_allclose(noisy, x, atol=1e-9)


@pytest.mark.parametrize("source", ["seeded", "secure"])
def test_measured_noise_std_matches_formula(source):
    mech = GaussianMechanism(sensitivity=0.7, noise_multiplier=2.5)
    src = SeededNoise(np.random.default_rng(1)) if source == "seeded" else SecureNoise()
    n = 200_000
    noise = mech.noise((n,), src)
    expected = 0.7 * 2.5
    # The sample std has standard error sigma / sqrt(2n); allow 5 of them.
    assert abs(noise.std() - expected) < 5 * expected / math.sqrt(2 * n)
    assert abs(noise.mean()) < 5 * expected / math.sqrt(n)
    # And it is Gaussian: a KS test against N(0, expected^2) does not reject at 1e-3.
    assert stats.kstest(noise[:20_000] / expected, "norm").pvalue > 1e-3


def test_secure_source_refuses_a_seed():
    with pytest.raises(ReleaseMisuse, match="cannot be seeded"):
        SecureNoise(seed=1)


def test_seeded_noise_is_reproducible_and_secure_is_not():
    a = gaussian_noise((4,), 1.0, 7)
    b = gaussian_noise((4,), 1.0, 7)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(gaussian_noise((4,), 1.0, "secure"), gaussian_noise((4,), 1.0, "secure"))


def test_symmetric_noise_is_symmetric_with_the_right_std():
    m = gaussian_noise((300, 300), 2.0, 3, symmetric=True)
    np.testing.assert_array_equal(m, m.T)
    assert m[np.triu_indices(300)].std() == pytest.approx(2.0, rel=0.02)
    with pytest.raises(InvalidRelease):
        gaussian_noise((3, 4), 1.0, 0, symmetric=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0, "x"])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(InvalidRelease):
        GaussianMechanism(bad, 1.0)
    with pytest.raises(InvalidRelease):
        GaussianMechanism(1.0, bad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_not_released(bad):
    mech = GaussianMechanism(1.0, 1.0)
    x = np.ones(3)
    x[1] = bad
    with pytest.raises(InvalidRelease, match="non-finite"):
        mech.release(x, 0)
