"""Cost of privfl's privacy layer in a federated round, printed as ``key=value`` lines measured in one run.

One DP-FedAvg round on MNIST-5k (10 clients, MLP 784-100-10, 1 local epoch): the clients' local training is run
once per round, then its outputs go (a) straight to the weighted sum (no privacy layer) and (b) through each client's
release pipeline (validate, clip, SQLite ledger charge, Gaussian noise, mark released; the round's charges and marks
committed to disk in one transaction before the sum, as ``privfl.runtime.engine`` does) and the aggregator with central
noise. ``privacy_overhead`` = (time(b) - time(a)) / (training + time(a)), the fraction a round
slows down with the privacy layer; goal <= 0.05. Each time is the median over ``--rounds`` rounds (default 8).

Usage: python experiments/bench_overhead.py [--rounds 8] [--smoke]

``--smoke``: one round (the same phases and keys, in seconds; a smoke test, its values are not a measurement).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import numpy as np

from privfl.accounting.ledger import PrivacyLedger
from privfl import FederationConfig, PrivacyConfig, make_algorithm, make_federated
from privfl.core.aggregation import weighted_sums
from privfl.core.release import Release, ReleasePipeline
from privfl.runtime.engine import noise_multipliers_for


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds timed (medians over them)")
    parser.add_argument("--smoke", action="store_true", help="one round (a smoke test; seconds)")
    args = parser.parse_args(argv)
    rounds = 1 if args.smoke else args.rounds
    print(f"machine={platform.machine()} cpus={os.cpu_count()} python={platform.python_version()}")
    data = make_federated("mnist5k", 10, partition="iid", seed=0)
    fed = FederationConfig(rounds=rounds, hidden=(100,), local_epochs=1, lr=0.05)
    privacy = PrivacyConfig(epsilon=3.0, delta=1e-5, clip=1.0)
    alg = make_algorithm("dp_fedavg", fed, privacy)
    alg.setup(data, np.random.default_rng(0))
    channels = alg.channels()
    by_name = {c.name: c for c in channels}
    multipliers = noise_multipliers_for(alg, privacy, rounds)
    with tempfile.TemporaryDirectory() as tmp:
        ledger = PrivacyLedger(os.path.join(tmp, "ledger.sqlite"), "bench", delta=1e-5, epsilon_budget=3.0)
        pipes = [ReleasePipeline(str(k), channels, ledger, multipliers, placement="central", noise=k)
                 for k in range(10)]
        rngs = [np.random.default_rng(k) for k in range(10)]
        t_train, t_plain, t_private = [], [], []
        for rnd in range(rounds):
            start = time.perf_counter()
            outs = [alg.client_update(k, data.train_parts[k], rnd, rngs[k]) for k in range(10)]
            t_train.append(time.perf_counter() - start)

            start = time.perf_counter()
            plain = [Release(str(k), rnd, "update", np.asarray(o.values["update"]), o.weight, 0.0, 0.0, "")
                     for k, o in enumerate(outs)]
            weighted_sums(plain, by_name, 0)
            t_plain.append(time.perf_counter() - start)

            start = time.perf_counter()
            private = []
            with ledger.transaction():  # as the runtime does: the round's charges and marks, one durable commit
                for k, o in enumerate(outs):
                    private.extend(pipes[k].release(rnd, o.values, o.weight).values())
            aggregates = weighted_sums(private, by_name, 0)
            t_private.append(time.perf_counter() - start)
            alg.server_update(aggregates, rnd)
        ledger.close()
    train, plain, priv = (statistics.median(t) for t in (t_train, t_plain, t_private))
    print(f"params={alg.dim}")
    print(f"round_without_privacy_ms={1000 * (train + plain):.1f}")
    print(f"round_with_privacy_ms={1000 * (train + priv):.1f}")
    print(f"privacy_layer_ms={1000 * (priv - plain):.2f}")
    print(f"privacy_overhead={(priv - plain) / (train + plain):.4f}")


if __name__ == "__main__":
    main()
