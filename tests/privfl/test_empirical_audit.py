"""Mechanism-level empirical audit: the lower bound never exceeds the claim; injected faults are caught."""

import pytest

from privfl.empirical_audit import audit_gaussian_release


@pytest.mark.timeout(120)
@pytest.mark.parametrize("z", [1.0, 2.0])
def test_lower_bound_stays_below_the_claimed_epsilon(z):
    result = audit_gaussian_release(z, trials=100_000, seed=1)
    assert 0 < result.epsilon_lower_bound <= result.claimed_epsilon
    assert result.passed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mutation", ["half_noise", "no_clip"])
def test_mutations_are_caught(mutation):
    result = audit_gaussian_release(2.0, trials=100_000, mutation=mutation, seed=2)
    assert result.epsilon_lower_bound > result.claimed_epsilon, result


def test_bad_arguments():
    with pytest.raises(ValueError, match="mutation"):
        audit_gaussian_release(1.0, mutation="other")
    with pytest.raises(ValueError, match="trials"):
        audit_gaussian_release(1.0, trials=10)
