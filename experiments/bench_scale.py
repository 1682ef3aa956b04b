"""How one federated round's time grows with the number of simulated clients, as ``key=value`` lines.

One DP-FedAvg round (logistic regression on 2x2-pooled MNIST-5k, client-level clip, central noise, SQLite ledger on
disk) at 10, 100 and 1000 clients, the same 4,000 training images split IID among them. Printed: seconds per round,
the share of it spent in the privacy layer (pipelines + ledger), and the growth exponent between sizes
(time ~ clients^k).

Usage: python experiments/bench_scale.py (no options: the client counts are its keys, and its default run takes
seconds, so it is also its own smallest configuration, the smoke test that ``make test`` runs)
"""

from __future__ import annotations

import math
import os
import platform
import tempfile
import time

from privfl import FederationConfig, PrivacyConfig, Simulation, make_algorithm, make_federated


def one_round(n_clients: int, tmp: str) -> float:
    data = make_federated("mnist5k", n_clients, partition="iid", seed=0, min_size=1)
    fed = FederationConfig(rounds=1, hidden=(), pool=2, local_epochs=1, lr=0.1)
    privacy = PrivacyConfig(epsilon=3.0, delta=1e-5, clip=0.1)
    sim = Simulation(make_algorithm("dp_fedavg", fed, privacy), data, fed, privacy,
                     ledger_path=os.path.join(tmp, f"scale{n_clients}.sqlite"))
    start = time.perf_counter()
    sim.run()
    return time.perf_counter() - start


def main() -> None:
    print(f"machine={platform.machine()} cpus={os.cpu_count()} python={platform.python_version()}")
    sizes = (10, 100, 1000)
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            times[n] = one_round(n, tmp)
            print(f"round_s_{n}={times[n]:.3f}")
    for a, b in zip(sizes, sizes[1:]):
        print(f"growth_exponent_{a}_to_{b}={math.log(times[b] / times[a]) / math.log(b / a):.3f}")


if __name__ == "__main__":
    main()
