"""Benchmark of calibration, printed as ``key=value`` lines measured in one run.

- ``exact_calibrated_over_minimum_max``: over epsilon in {0.5, 1, 3, 8} x rounds in {1, 10, 100}, the largest ratio of
  privfl's calibrated noise multiplier (exact accountant) to the minimum noise for the exact Gaussian composition
  (sqrt(rounds) x dp-accounting's ``get_sigma_gaussian``); goal: >= 1 and <= 1.01. ``..._min`` must be >= 1.
- ``pld_over_dp_accounting_max``: with client sampling, privfl's PLD calibration over dp-accounting's own
  ``calibrate_dp_mechanism`` with a PLD accountant (same events), largest over a grid; goal <= 1.02.
- ``exact_calibration_ms`` and ``pld_calibration_ms``: time per calibration (median).

Usage: python experiments/bench_accountant.py [--smoke]

``--smoke``: one point of each grid (epsilon 3, 1 round; epsilon 3, 20 rounds, q = 0.5), the same keys, in seconds
(a smoke test that every entry point still runs; its values say nothing about the grid).
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant

from privfl.accounting.calibration import calibrate


def dp_accounting_pld_sigma(epsilon: float, delta: float, rounds: int, q: float) -> float:
    def event(sigma):
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), rounds)

    return dp_accounting.calibrate_dp_mechanism(
        lambda: pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3), event, epsilon, delta,
        dp_accounting.LowerEndpointAndGuess(0.1, 2.0))


EXACT_GRID = tuple((eps, rounds) for eps in (0.5, 1.0, 3.0, 8.0) for rounds in (1, 10, 100))
PLD_GRID = ((1.0, 50, 0.1), (3.0, 100, 0.1), (8.0, 100, 0.05), (3.0, 20, 0.5))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one point of each grid (a smoke test; seconds)")
    args = parser.parse_args(argv)
    exact_grid = ((3.0, 1),) if args.smoke else EXACT_GRID
    pld_grid = ((3.0, 20, 0.5),) if args.smoke else PLD_GRID
    print(f"machine={platform.machine()} cpus={__import__('os').cpu_count()} python={platform.python_version()}")
    ratios, times_exact = [], []
    for eps, rounds in exact_grid:
        start = time.perf_counter()
        z = calibrate(eps, 1e-5, rounds).noise_multiplier
        times_exact.append(time.perf_counter() - start)
        minimum = math.sqrt(rounds) * dp_accounting.get_sigma_gaussian(eps, 1e-5)
        ratios.append(z / minimum)
    print(f"exact_calibrated_over_minimum_max={max(ratios):.6f}")
    print(f"exact_calibrated_over_minimum_min={min(ratios):.6f}")
    print(f"exact_calibration_ms={1000 * statistics.median(times_exact):.3f}")
    pld_ratios, times_pld = [], []
    for eps, rounds, q in pld_grid:
        start = time.perf_counter()
        ours = calibrate(eps, 1e-5, rounds, sampling_rate=q, accountant="pld").noise_multiplier
        times_pld.append(time.perf_counter() - start)
        pld_ratios.append(ours / dp_accounting_pld_sigma(eps, 1e-5, rounds, q))
    print(f"pld_over_dp_accounting_max={max(pld_ratios):.6f}")
    print(f"pld_over_dp_accounting_min={min(pld_ratios):.6f}")
    print(f"pld_calibration_ms={1000 * statistics.median(times_pld):.1f}")


if __name__ == "__main__":
    main()
