"""Flower's Deployment Engine on loopback against the in-process runtime: the same FedAvg run, 10 clients, 20 rounds,
a ~1.1e5-parameter MLP on scikit-learn's digits (64 -> 1500 -> 10).

The deployment (one flower-superlink, ten flower-supernode OS processes) is started first and not timed, as a real
federation's is long-lived; the timed part is ``flwr run`` until the ServerApp has written its result (shipping the
app, starting the ServerApp, every round's messages and ClientApp processes). Needs flwr (``pip install
'privfl[flower]'``). Prints ``key=value`` lines.

Then the Simulation Engine (a SuperLink with ``--simulation``, virtual SuperNodes on Ray) runs one FedAvg round of
``--engine-clients`` (default 1,000) organisations, each with 4 MNIST-5k images and its own ledger file, with a
logistic regression on 2x2-pooled images: ``engine_seconds`` (``flwr run`` until the result is written, Ray's
start-up included) and ``engine_round_seconds`` (the round as the ServerApp timed it). ``--engine-clients 0`` skips it.

    python experiments/bench_flower.py [--clients 10] [--rounds 20] [--hidden 1500] [--engine-clients 1000]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch

from privfl.algorithms import make_algorithm
from privfl.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays, load_digits
from privfl.flower.app import RunSpec, read_result, write_app
from privfl.flower.local import LocalDeployment
from privfl.runtime import Simulation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=1500)
    ap.add_argument("--per-client", type=int, default=150, help="records per client")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds for the flwr run")
    ap.add_argument("--engine-clients", type=int, default=1000, help="virtual SuperNodes of the Simulation Engine run")
    args = ap.parse_args()

    digits = load_digits(flatten=True)
    idx = np.random.default_rng(0).permutation(len(digits))
    n = args.per_client
    parts = [digits.subset(idx[k * n:(k + 1) * n]) for k in range(args.clients)]
    data = federated_from_arrays(parts, digits.subset(idx[args.clients * n:]), name="digits-bench")
    fed = FederationConfig(rounds=args.rounds, local_epochs=1, batch_size=32, lr=0.05, hidden=(args.hidden,), seed=0)
    privacy = PrivacyConfig()
    torch.set_num_threads(1)  # as the ClientApps train (RunSpec.torch_threads)

    timings = {}
    for executor in ("auto", "per_client"):
        sim = Simulation(make_algorithm("fedavg", fed, privacy), data, fed, privacy, executor=executor)
        start = time.perf_counter()
        sim.run()
        timings[executor] = time.perf_counter() - start
        if executor == "per_client":
            expected = sim.algorithm.global_params
    print(f"parameters={expected.size}")
    print(f"inprocess_seconds={timings['auto']:.2f}")
    print(f"inprocess_per_client_seconds={timings['per_client']:.2f}")

    with tempfile.TemporaryDirectory(prefix="privfl-bench-flower-") as work:
        configs = []
        for k, part in enumerate(data.train_parts):
            path = os.path.join(work, f"org{k}.npz")
            np.savez(path, x=part.x, y=part.y)
            configs.append({"partition-id": k, "data-path": path, "ledger-path": os.path.join(work, f"org{k}.sqlite")})
        spec = RunSpec.of("fedavg", data, fed, privacy, run_id="bench", node_wait=120, round_timeout=600)
        result_path = os.path.join(work, "result.bin")
        app = write_app(os.path.join(work, "app"), spec, result_path=result_path)
        with LocalDeployment(work, configs) as dep:
            time.sleep(5)  # let the SuperNodes register (not timed: a federation is up before a run)
            start = time.perf_counter()
            dep.run(app, timeout=args.timeout)
            flower = time.perf_counter() - start
            if not os.path.exists(result_path):
                log = open(os.path.join(work, "flwr-run.log"), errors="replace").read()[-3000:]
                raise SystemExit(f"the ServerApp wrote no result:\n{log}")
            result = read_result(result_path)
    rounds = sum(h["seconds"] for h in result["history"])
    same = np.array_equal(result["state"]["global_params"], expected)
    print(f"flower_seconds={flower:.2f}")
    print(f"flower_round_seconds={rounds:.2f}")
    print(f"flower_equals_inprocess_per_client={same}")
    print(f"flower_over_inprocess_per_client={flower / timings['per_client']:.2f}")
    print(f"flower_over_inprocess={flower / timings['auto']:.2f}")
    if args.engine_clients > 0:
        simulation_engine(args.engine_clients, args.timeout)


def simulation_engine(n_clients: int, timeout: float) -> None:
    """One FedAvg round of ``n_clients`` virtual SuperNodes on Flower's Simulation Engine (see the module docstring)."""
    from privfl.data import make_federated

    base = make_federated("mnist5k", 10, partition="iid", seed=0)
    x = np.concatenate([p.x for p in base.train_parts])
    y = np.concatenate([p.y for p in base.train_parts])
    per = max(1, len(x) // n_clients)
    parts = [(x[k * per:(k + 1) * per], y[k * per:(k + 1) * per]) for k in range(n_clients)]
    data = federated_from_arrays(parts, (base.test.x, base.test.y), task="classification",
                                 num_classes=base.num_classes, name="mnist5k-engine")
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=4, lr=0.1, hidden=(), pool=2, seed=0)
    privacy = PrivacyConfig()
    with tempfile.TemporaryDirectory(prefix="privfl-bench-engine-") as work:
        for k, (px, py) in enumerate(parts):
            np.savez(os.path.join(work, f"org{k}.npz"), x=px, y=py)
        spec = RunSpec.of("fedavg", data, fed, privacy, run_id="engine", node_wait=600, round_timeout=timeout)
        result_path = os.path.join(work, "result.bin")
        app = write_app(os.path.join(work, "app"), spec, result_path=result_path,
                        data_path_template=os.path.join(work, "org{partition-id}.npz"),
                        ledger_path_template=os.path.join(work, "org{partition-id}.sqlite"))
        engine = os.path.join(work, "engine")
        os.makedirs(engine)
        with LocalDeployment(engine, [], simulation=True) as dep:
            start = time.perf_counter()
            dep.run(app, timeout=timeout,
                    federation_config=f"num-supernodes={n_clients} client-resources-num-cpus=1")
            seconds = time.perf_counter() - start
        if not os.path.exists(result_path):
            log = open(os.path.join(engine, "flwr-run.log"), errors="replace").read()[-3000:]
            raise SystemExit(f"the Simulation Engine's ServerApp wrote no result:\n{log}")
        result = read_result(result_path)
    print(f"engine_clients={n_clients}")
    print(f"engine_seconds={seconds:.1f}")
    print(f"engine_round_seconds={result['history'][0]['seconds']:.1f}")


if __name__ == "__main__":
    main()
