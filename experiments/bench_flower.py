"""Flower's Deployment Engine on loopback against the in-process runtime: the same FedAvg run, 10 clients, 20 rounds,
a ~1.1e5-parameter MLP on scikit-learn's digits (64 -> 1500 -> 10).

Workload (the same on both sides): 150 digits records per client (``--per-client``), ``--local-epochs`` 1 (so 5
SGD steps of batch 32 per client and round), no privacy. This is a light workload: in process a round takes 0.15 to
0.25 s here, so the ratio below mostly measures Flower's per-round latency, not training.

The deployment (one flower-superlink, ten flower-supernode OS processes) is started first and not timed, as a real
federation's is long-lived. The SuperNodes run with ``--isolation process`` and one warm privfl worker each
(``privfl.flower.warm``: one long-lived process per SuperNode serves every ClientApp message; it has imported
privfl and torch before the run starts, as a real organisation's worker would have). The timed part is ``flwr run``
until the ServerApp has written its result (shipping the app, starting the ServerApp process, the start-of-run
identify query, every round's messages). ``flower_over_inprocess`` is that time over the in-process runtime's
(default executor); ``worker_*`` say how much of it the workers spent on tasks (pull, load, ClientApp, push).

``--subprocess`` also measures Flower's default isolation (a fresh ``flwr-clientapp`` process per message):
``flower_over_inprocess_subprocess`` (slow: ~950 s for the default run on 2 cores). What is left per round is
Flower's: a SuperNode waits 3 s between two pulls from the SuperLink when it has no message, and pulls a message's
objects with a backoff of 1 s doubling (both fixed in flwr 1.41); the ServerApp polls for replies every 0.2 s
(``privfl.flower.app.REPLY_POLL``; flwr's own ``Grid.send_and_receive`` waits 3 s).

Then the Simulation Engine (a SuperLink with ``--simulation``, virtual SuperNodes on Ray) runs one FedAvg round of
``--engine-clients`` (default 1,000) organisations, each with 4 MNIST-5k images and its own ledger file, with a
logistic regression on 2x2-pooled images: ``engine_seconds`` (``flwr run`` until the result is written, Ray's
start-up included) and ``engine_round_seconds`` (the round as the ServerApp timed it). ``--engine-clients 0`` skips it.

Needs flwr (``pip install 'privfl[flower]'``). Prints ``key=value`` lines.

    python experiments/bench_flower.py [--clients 10] [--rounds 20] [--hidden 1500] [--per-client 150]
        [--local-epochs 1] [--subprocess] [--engine-clients 1000]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
import time

import numpy as np
import torch

from privfl.algorithms import make_algorithm
from privfl.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays, load_digits
from privfl.flower.app import RunSpec, read_result, write_app
from privfl.flower.local import LocalDeployment
from privfl.flower.warm import PRELOAD, preload
from privfl.runtime import Simulation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=1500)
    ap.add_argument("--per-client", type=int, default=150, help="records per client")
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds for the flwr run")
    ap.add_argument("--subprocess", action="store_true",
                    help="also measure Flower's default isolation (a ClientApp process per message; slow)")
    ap.add_argument("--engine-clients", type=int, default=1000, help="virtual SuperNodes of the Simulation Engine run")
    args = ap.parse_args()

    digits = load_digits(flatten=True)
    idx = np.random.default_rng(0).permutation(len(digits))
    n = args.per_client
    parts = [digits.subset(idx[k * n:(k + 1) * n]) for k in range(args.clients)]
    data = federated_from_arrays(parts, digits.subset(idx[args.clients * n:]), name="digits-bench")
    fed = FederationConfig(rounds=args.rounds, local_epochs=args.local_epochs, batch_size=32, lr=0.05,
                           hidden=(args.hidden,), seed=0)
    privacy = PrivacyConfig()
    torch.set_num_threads(1)  # as the ClientApps train (RunSpec.torch_threads)
    preload(PRELOAD)  # what a warm worker imports before its first task (torch._dynamo: ~4 s at the first optimizer)

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

    spec = RunSpec.of("fedavg", data, fed, privacy, run_id="bench", node_wait=120, round_timeout=600)
    variants = [("", dict(warm=True))]
    if args.subprocess:
        variants.append(("_subprocess", dict(warm=False)))
    for suffix, options in variants:
        seconds, rounds, result, workers, phases = deployed_run(data, spec, args.timeout, **options)
        print(f"flower{suffix}_seconds={seconds:.2f}")
        print(f"flower{suffix}_round_seconds={rounds:.2f}")
        for name, value in phases.items():
            print(f"flower{suffix}_{name}={value:.2f}")
        if not suffix:
            same = np.array_equal(result["state"]["global_params"], expected)
            print(f"flower_equals_inprocess_per_client={same}")
            print(f"flower_over_inprocess_per_client={seconds / timings['per_client']:.2f}")
        if workers:
            print(f"worker{suffix}_task_seconds_max={max(w['task'] for w in workers):.2f}")
            print(f"worker{suffix}_clientapp_seconds_mean={np.mean([w['clientapp'] for w in workers]):.2f}")
            print(f"worker{suffix}_tasks={sum(w['tasks'] for w in workers)}")
        print(f"flower_over_inprocess{suffix}={seconds / timings['auto']:.2f}")
    if args.engine_clients > 0:
        simulation_engine(args.engine_clients, args.timeout)


def deployed_run(data, spec, timeout: float, *, warm: bool):
    """``flwr run`` of ``spec`` on a fresh loopback deployment (started and waited for before the clock starts);
    returns (seconds, the rounds' seconds as the ServerApp timed them, its result, each worker's task totals)."""
    with tempfile.TemporaryDirectory(prefix="privfl-bench-flower-") as work:
        configs = []
        for k, part in enumerate(data.train_parts):
            path = os.path.join(work, f"org{k}.npz")
            np.savez(path, x=part.x, y=part.y)
            configs.append({"partition-id": k, "data-path": path, "ledger-path": os.path.join(work, f"org{k}.sqlite")})
        result_path = os.path.join(work, "result.bin")
        app = write_app(os.path.join(work, "app"), spec, result_path=result_path)
        with LocalDeployment(work, configs, warm=warm) as dep:
            if warm:
                dep.wait_workers(timeout=300)  # imports done (not timed: a worker is up before a run)
            time.sleep(5)  # let the SuperNodes register (not timed: a federation is up before a run)
            wall, start = time.time(), time.perf_counter()
            dep.run(app, timeout=timeout)
            seconds = time.perf_counter() - start
            if not os.path.exists(result_path):
                log = open(os.path.join(work, "flwr-run.log"), errors="replace").read()[-3000:]
                raise SystemExit(f"the ServerApp wrote no result:\n{log}")
            result = read_result(result_path)
            # after the result is written: the ServerApp process ends, the SuperLink marks the run finished and
            # `flwr run --stream` returns
            phases = {"after_result_seconds": wall + seconds - os.path.getmtime(result_path)}
            workers = [worker_totals(os.path.join(work, f"worker{k}.log")) for k in range(len(configs))] if warm else []
            if workers:
                # from `flwr run` to the first ClientApp task: building and shipping the app, the SuperLink's
                # SuperExec starting the ServerApp process (imports), the ServerApp's setup, node wait, the query
                phases["until_first_task_seconds"] = min(w["first_start"] for w in workers) - wall
    return seconds, sum(h["seconds"] for h in result["history"]), result, workers, phases


def worker_totals(log: str) -> dict:
    """A warm worker's tasks, and the seconds it spent on them in all and inside the ClientApp, from its log."""
    pattern = (r"^(\S+ \S+),(\d+) \[[^]]*\] INFO task \d+ \(\S+\) (?:done|FAILED) in ([0-9.]+) s "
               r"\(pull [0-9.]+, load [0-9.]+, ClientApp ([0-9.]+), push [0-9.]+\)")
    tasks = re.findall(pattern, open(log, errors="replace").read(), flags=re.M)
    ends = [time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000 for stamp, ms, _, _ in tasks]
    return {"tasks": len(tasks), "task": sum(float(t[2]) for t in tasks),
            "clientapp": sum(float(t[3]) for t in tasks),
            "first_start": min((e - float(t[2]) for e, t in zip(ends, tasks)), default=math.inf)}


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
