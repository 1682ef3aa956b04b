"""How the backends must order: tight ones never above loose ones on the same releases."""

from __future__ import annotations

import pytest

from privfl.accounting.accountants import make_accountant
from privfl.accounting.events import GaussianEvent, PoissonSampledEvent

pytestmark = pytest.mark.timeout(30)


def epsilon_of(name: str, event, count: int, delta: float) -> float:
    return make_accountant(name).compose(event, count).get_epsilon(delta)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 5.0, 20.0])
@pytest.mark.parametrize("rounds", [1, 10, 100])
@pytest.mark.parametrize("delta", [1e-8, 1e-5])
def test_exact_below_rdp_below_standard_zcdp(sigma, rounds, delta):
    event = GaussianEvent(1.0, sigma)
    exact = epsilon_of("exact", event, rounds, delta)
    rdp = epsilon_of("rdp", event, rounds, delta)
    zcdp = make_accountant("zcdp").compose(event, rounds)
    conversions = zcdp.epsilon_conversions(delta)
    assert exact <= rdp <= conversions["standard"]
    assert exact <= conversions["optimal"] <= conversions["standard"]
    assert exact < rdp  # RDP is not tight for Gaussians


@pytest.mark.parametrize("sigma,rounds", [(1.0, 1), (2.0, 10), (5.0, 50), (20.0, 100)])
def test_pld_is_close_to_exact_without_sampling(sigma, rounds):
    exact = epsilon_of("exact", GaussianEvent(1.0, sigma), rounds, 1e-5)
    pld = epsilon_of("pld", GaussianEvent(1.0, sigma), rounds, 1e-5)
    assert exact * (1 - 1e-9) <= pld <= exact * 1.01 + 2e-3


@pytest.mark.parametrize("q,sigma,rounds", [(0.01, 0.8, 100), (0.01, 2.0, 10), (0.1, 1.0, 100), (0.1, 5.0, 10),
                                            (0.5, 2.0, 100)])
def test_rdp_above_pld_with_sampling(q, sigma, rounds):
    event = PoissonSampledEvent(q, GaussianEvent(1.0, sigma))
    rdp = epsilon_of("rdp", event, rounds, 1e-5)
    pld = epsilon_of("pld", event, rounds, 1e-5)
    assert 0 < pld <= rdp


def test_sampling_amplifies():
    full = epsilon_of("exact", GaussianEvent(1.0, 2.0), 50, 1e-5)
    for name in ("pld", "rdp"):
        assert epsilon_of(name, PoissonSampledEvent(0.1, GaussianEvent(1.0, 2.0)), 50, 1e-5) < full


def test_pld_composes_a_hundred_sampled_rounds_quickly():
    """The default discretisation keeps a 100-round sampled composition well under a second (generous bound here)."""
    import time

    start = time.perf_counter()
    epsilon = epsilon_of("pld", PoissonSampledEvent(0.1, GaussianEvent(1.0, 1.0)), 100, 1e-5)
    assert time.perf_counter() - start < 3.0
    assert 6.5 < epsilon < 7.5  # dp-accounting at its default 1e-4 grid: 7.047
