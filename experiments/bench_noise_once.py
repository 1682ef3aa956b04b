"""Noise paid once for the federation: what the distributed plan charges against central noise (issue 27).

For the record-level table's schedule (``experiments/run_record_level.py``: DP-FedSGD on MNIST-5k, 10 clients,
Dirichlet 0.1, record level add/remove, delta 1e-5, lot size 256, clip 0.5, 30 expected epochs, i.e. 469 rounds of
Poisson-sampled lots at q = 256 / 4000), the run plan is built twice at each epsilon in {1, 3, 8}, as a run builds it
before its first release (``Simulation.prepare``; nothing is trained):

- ``central_z_eps<e>``: the central Gaussian noise multiplier (the aggregator adds N(0, (z C)^2) to the sum; PLD
  accountant, the table's);
- ``distributed_z_eps<e>``: the noise multiplier the distributed plan charges when the clients share the noise as
  discrete-Gaussian shares under secure aggregation (48-bit ring, no dropout, the honest survivors' shares; the run's
  default pld accountant: the sum charged as the Poisson-sampled Gaussian it nearly is, with its total-variation
  term, ``privfl.privacy.secure.calibrate_distributed_sampled``), i.e. the equivalent Gaussian noise multiplier of
  the sum it charges;
- ``distributed_over_central_z_eps<e>``: their ratio (issue 27's goal: <= 1.15 at each epsilon);
- ``zcdp_bound_z_eps<e>`` and ``zcdp_bound_over_central_z_eps<e>``: what the same plan needed when it charged the
  Kairouz-Liu-Steinke zCDP bound under Zhu and Wang's sampled-RDP bound (rdp accountant; privfl's charge until
  this change, kept for coarse quantisers), at the same quantiser;
- ``plan_seconds``: the wall time of the six run plans (not of the zCDP-bound searches).

Usage: python experiments/bench_noise_once.py [--rounds R] [--smoke]   (``--smoke``: 5 rounds instead of the table's
469, every key printed, values meaningless; ``make test`` runs it)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from privfl.algorithms import make_algorithm
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import make_federated
from privfl.privacy.secure import SecureAggregation
from privfl.runtime.engine import Simulation

EPSILONS = (1, 3, 8)
CLIENTS, ALPHA, DELTA, LOT, CLIP, EPOCHS = 10, 0.1, 1e-5, 256, 0.5, 30


def emit(key: str, value) -> None:
    if isinstance(value, float):
        value = f"{value:.6g}"
    print(f"{key}={value}", flush=True)


def plan_multiplier(data, epsilon: float, rounds: int, placement: str):
    """(the noise multiplier of DP-FedSGD's gradient sum in the run plan of one placement, its channel)."""
    fed = FederationConfig(rounds=rounds, batch_size=LOT, lr=0.5, momentum=0.9, hidden=(), pool=2, seed=0)
    privacy = PrivacyConfig(epsilon=epsilon, delta=DELTA, unit="example", clip=CLIP, placement=placement,
                            secure_noise=False)  # the default accountant of both placements: pld
    secure = SecureAggregation(bits=48, malicious=False) if placement == "distributed" else None
    sim = Simulation(make_algorithm("dp_fedsgd", fed, privacy, lot_size=LOT), data, fed, privacy, secure=secure)
    sim.prepare()
    multipliers = sim.plan.noise_multipliers
    if len(multipliers) != 1:
        raise RuntimeError(f"expected one noised channel, got {sorted(multipliers)}")
    (channel,) = [c for c in sim.channels if c.private]
    return float(next(iter(multipliers.values()))), channel


def zcdp_bound_multiplier(epsilon: float, rounds: int, q: float, bound: float, dimension: int) -> float:
    """The smallest noise multiplier of the same distributed plan charged PoissonSampled(q, ZCDP(rho)) (the KLS bound
    of the shares' sum) under the rdp accountant."""
    from privfl.accounting.calibration import calibrate_noise
    from privfl.accounting.events import SelfComposedEvent
    from privfl.privacy.secure import plan_distributed_noise_sampled

    def run(m: float):
        plan = plan_distributed_noise_sampled(bound, dimension, m, CLIENTS, CLIENTS, 48, clip=CLIP, sampling_rate=q,
                                              gaussian=False)
        return SelfComposedEvent(plan.event, rounds)

    m, _ = calibrate_noise(run, epsilon, DELTA, "rdp", guess=1.0, step=1.2, tol=1e-4)
    return m


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: the table's 30 epochs of lots)")
    parser.add_argument("--smoke", action="store_true", help="5 rounds: every key, in seconds")
    args = parser.parse_args(argv)
    emit("machine", platform.machine())
    emit("cpus", os.cpu_count())
    emit("python", platform.python_version())
    data = make_federated("mnist5k", CLIENTS, partition="dirichlet", alpha=ALPHA, seed=0)
    n_train = sum(len(p) for p in data.train_parts)
    rounds = args.rounds or (5 if args.smoke else int(round(EPOCHS * n_train / LOT)))
    emit("rounds", rounds)
    emit("sampling_rate", LOT / n_train)  # each record joins a round's lot with probability q = L / N
    planned = {}
    start = time.perf_counter()
    for eps in EPSILONS:
        planned[eps] = (plan_multiplier(data, float(eps), rounds, "central"),
                        plan_multiplier(data, float(eps), rounds, "distributed"))
    seconds = time.perf_counter() - start
    for eps in EPSILONS:
        (central, _), (distributed, channel) = planned[eps]
        emit(f"central_z_eps{eps}", central)
        emit(f"distributed_z_eps{eps}", distributed)
        emit(f"distributed_over_central_z_eps{eps}", distributed / central)
        old = zcdp_bound_multiplier(float(eps), rounds, channel.record_sampling_rate, channel.coordinate_bound,
                                    channel.shape[0])
        emit(f"zcdp_bound_z_eps{eps}", old)
        emit(f"zcdp_bound_over_central_z_eps{eps}", old / central)
    emit("plan_seconds", seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
