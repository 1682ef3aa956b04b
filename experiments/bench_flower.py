"""Flower's Deployment Engine on loopback against the in-process runtime: the same FedAvg run, 10 clients, 20 rounds,
a ~1.1e5-parameter MLP on scikit-learn's digits (64 -> 1500 -> 10).

Workload (the same on both sides): 150 digits records per client (``--per-client``), ``--local-epochs`` 1 (so 5
SGD steps of batch 32 per client and round), no privacy. This is a light workload: in process a round takes 0.15 to
0.25 s here, so the ratio below mostly measures Flower's per-round latency, not training.

The deployment (one flower-superlink, ten SuperNode OS processes) is started first and not timed, as a real
federation's is long-lived. The SuperNodes run with ``--isolation process`` and one warm privfl worker each
(``privfl.flower.warm``: one long-lived process per SuperNode serves every ClientApp message; it has imported
privfl and torch before the run starts, as a real organisation's worker would have). The timed part is ``flwr run``
from its start until it returns (shipping the app, starting the ServerApp process, the start-of-run identify query,
every round's messages, the ServerApp writing its result, then its process ending and the log stream closing:
``flower_after_result_seconds``). ``flower_over_inprocess`` is that time over the in-process runtime's (default
executor); ``flower_rounds_over_inprocess`` is the rounds' time alone (as the ServerApp timed them) over it;
``worker_*`` say how much of the time the workers spent on tasks (pull, load, ClientApp, push).

What ``flower_over_inprocess`` runs is Flower 1.41's own code with its fixed idle waits shortened and the SuperLink's
state in memory (Flower's default), nothing else:

- each SuperNode is ``experiments/fast_supernode.py --poll-interval P`` (``--supernode-poll``, default 0.25 s; a
  benchmark and test tool, not part of privfl): Flower's ``flower-supernode`` entry point, same command line and code, after two
  patches of ``flwr.supernode.start_client_internal`` in that process. (1) Its ``time`` global becomes a shim whose
  ``sleep(s)`` sleeps ``min(s, P)``; the module sleeps in three places, all on every message's path: 3 s after a
  pull from the SuperLink that brought no message (flwr 1.41.0 line 263: a round's message waited up to 3 s at the
  SuperLink), 0.5 s between two looks for the ClientApp's reply (line 470) and 0.5 s between two looks for a reply
  object's content (line 506). (2) Its ``pull_objects`` retries an object the SuperLink does not hold yet after
  ``--object-backoff`` seconds (default 0.05) instead of flwr's 1 s, still doubling to flwr's 10 s cap: the SuperLink
  hands a message out before the ServerApp has pushed its objects, so a SuperNode that looks often finds them
  missing and, unpatched, waited a whole second. The launcher refuses to start (``--require-patch``) if the
  installed flwr is not 1.41.x or the module does not hold exactly these waits;
- the SuperLink runs with Flower's default ``--database :flwr-in-memory:`` (state and message objects in Python;
  LocalDeployment otherwise gives it an SQLite file, whose object store cost the SuperLink ~0.8 of a core here);
- Flower's own setting ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` (``--superexec-poll``, default 0.1 s; Flower's 1 s):
  how often the SuperLink's SuperExec looks for the run's ServerApp to start (once per run);
- privfl's own polls: the ServerApp pulls replies every ``--reply-poll`` s (``PRIVFL_REPLY_POLL``, default 0.1;
  ``privfl.flower.app.REPLY_POLL`` is 0.2; flwr's ``Grid.send_and_receive`` waits 3 s) and each warm worker claims
  its SuperNode's next task every ``--worker-poll`` s (default 0.25; the worker's default is 0.2).

Polling more often costs CPU, and on 2 cores that is what decides: the SuperLink serves every SuperNode's pulls and
every object, and it is the busiest process of the run (0.7 to 0.9 of a core). With every poll at 0.05 s the run
took 216 s (9.4 s a round: the SuperLink, swamped by 200 empty pulls a second, took ~2.3 s to hand each message's
objects out); with 0.25 s SuperNode and worker polls and a 0.1 s reply poll, 138 s (6.1 s a round), hence the
defaults; the same with the SuperLink's state in memory instead of SQLite, 60 s (2.6 s a round). What is not
shortened: the ServerApp's pulls of reply objects (flwr's 1 s backoff, in the ServerApp process; but see
``--server-object-backoff``), the ServerApp process's start (imports) and its 1 s log flush at exit
(flwr/supercore/logger.py ``flush_logs``), the SuperLink's log stream to ``flwr run`` (every 0.5 s), and Flower's
HTTP requests and serialisation work.

``--stock`` also measures the same deployment with Flower's waits as they are (plain ``flower-supernode``, Flower's
SuperExec poll, privfl's default 0.2 s reply and worker polls): ``flower_over_inprocess_stock`` (~240 s for the
default run on 2 shared cores). ``--subprocess`` also measures Flower's default isolation (a fresh
``flwr-clientapp`` process per message, stock waits): ``flower_over_inprocess_subprocess`` (slow: ~950 s).
``--server-object-backoff S`` (a measurement of what is left, off by default) also patches the ServerApp process:
the bench's app module rebinds ``flwr.superlink.grid.http_grid.pull_objects`` so that a reply whose objects the
SuperLink does not hold yet is asked for again after S seconds instead of flwr's 1 s (the SuperLink hands a reply
out as soon as its SuperNode has sent its metadata, before the objects). ``--logs DIR`` keeps each deployment's logs
(SuperNodes' with timestamps) under ``DIR/<variant>`` (the comparison's, below, under ``DIR/compare``).
``--superlink-sqlite`` starts the SuperLinks with an SQLite state file (``--database FILE``, as LocalDeployment does
by default) instead of Flower's default in-memory state.

Then the Simulation Engine (a SuperLink with ``--simulation``, virtual SuperNodes on Ray) runs one FedAvg round of
``--engine-clients`` (default 1,000) organisations, each with 4 MNIST-5k images and its own ledger file, with a
logistic regression on 2x2-pooled images: ``engine_seconds`` (``flwr run`` until the result is written, Ray's
start-up included) and ``engine_round_seconds`` (the round as the ServerApp timed it). ``--engine-clients 0`` skips it.

``sim_1000_clients_round_seconds`` is that round's seconds (``engine_round_seconds``) under the name the issue gives
it; when ``--engine-clients`` is not 1,000 (``--smoke``: 20 clients, a stand-in) its value says how many clients ran.

privfl against a plain Flower app (issue 31; on by default, ``--compare-repeats 0`` skips it). The numbers above
compare Flower's transport with privfl's in-process runtime; this part measures privfl's own overhead on Flower: the
same job done by privfl's ServerApp and ClientApp and by a plain Flower 1.41 app written against Flower's public API
alone (``experiments/plain_flower_app``: Flower's ``FedAvg`` and, for DP-FedAvg, its
``DifferentialPrivacyServerSideFixedClipping`` wrapper with Flower's RDP accountant; no privfl import). Same MLP
(64 -> ``--hidden`` -> 10), same data files and partitions (each SuperNode's node config ``data-path`` and
``partition-id``), same local training (``--local-epochs``, batch 32, lr 0.05, plain SGD, one torch thread), same
rounds, every client every round, no evaluation on either side. DP-FedAvg is client-level with central noise:
privfl's ``dp_fedavg`` at ``--dp-epsilon`` (default 3) and delta 1e-5 with clip ``--dp-clip`` (default 1), and the
plain app gets the clip and the noise multiplier of privfl's run plan (``RunPlan.build``), so that the noise std on
the sum (z x C) is the same (``dp_noise_multiplier``, ``dp_clip``; the bench checks the privfl run used that z).
Differences that are part of what is measured: privfl's start-of-run identify query, its ledger (one SQLite
transaction per client and round), its CSPRNG noise (Flower draws NumPy's), its float64 model vector (Flower ships the
float32 state dict), and the ServerApps' reply polls (privfl's 0.2 s; Flower's ``Grid.send_and_receive`` 3 s).

The four variants run on ONE deployment with stock binaries: ``flower-superlink`` (Flower's default in-memory state)
and one plain ``flower-supernode`` per client with Flower's own waits (no ``fast_supernode.py`` launcher, no
``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``, no ``PRIVFL_REPLY_POLL``). With ``--compare-isolation process`` (default) each
SuperNode runs ``--isolation process`` and one warm worker (``privfl.flower.warm``, poll 0.2 s) serves the ClientApp
tasks of both apps alike (it loads each FAB's ClientApp once, Flower's loader); ``--compare-isolation subprocess`` is
Flower's default instead (a fresh ``flwr-clientapp`` process per message, for both apps: slow). After one untimed
1-round warm-up run of each variant (``--compare-warmup 0`` skips it), ``--compare-repeats`` (default 3) repetitions
run alternated: privfl FedAvg, plain FedAvg, privfl DP-FedAvg, plain DP-FedAvg, the order within each pair swapped
every other repetition. Each ``flwr run`` is timed end to end (shipping the app, the ServerApp's start, every round,
the process's end and the log stream's close). Keys: ``privfl_fedavg_seconds``, ``plain_flower_fedavg_seconds``,
``privfl_dp_seconds``, ``plain_flower_dp_seconds`` (medians; ``*_runs_seconds`` every run);
``privfl_over_plain_flower_fedavg`` and ``privfl_over_plain_flower_dp`` (ratio of the medians);
``privfl_over_plain_flower``: the WORSE (larger) of those two (goal <= 1.2); per-round latency as each ServerApp
timed its rounds (privfl: its round records; plain: the gaps between the calls Flower makes to the strategy's
``evaluate_fn`` hook before the first round and after each): ``privfl_round_seconds`` and
``plain_flower_round_seconds`` (median over the runs of both algorithms, pooled), and per algorithm
``privfl_fedavg_round_seconds`` and the like.

Needs flwr (``pip install 'privfl[flower]'``) for the deployment and the Simulation Engine; without it the in-process
runs are measured and ``flower_seconds``, ``flower_over_inprocess``, ``privfl_over_plain_flower``, ``engine_seconds``
and ``sim_1000_clients_round_seconds`` say ``unavailable``. Prints ``key=value`` lines.

Usage: python experiments/bench_flower.py [--clients 10] [--rounds 20] [--hidden 1500] [--per-client 150]
        [--local-epochs 1] [--supernode-poll 0.25] [--object-backoff 0.05] [--worker-poll 0.25] [--reply-poll 0.1]
        [--superexec-poll 0.1] [--stock] [--subprocess] [--logs DIR] [--engine-clients 1000]
        [--compare-repeats 3] [--compare-warmup 1] [--compare-isolation process] [--dp-epsilon 3] [--dp-clip 1]
        [--smoke]

``--smoke`` sets the sizes to their smallest (``--clients 2 --rounds 1 --hidden 8 --per-client 32
--engine-clients 20 --compare-repeats 1 --compare-warmup 0``, and 1 s instead of 5 s for the SuperNodes to register;
flags given with it win): the in-process runs, a loopback deployment, the comparison with the plain Flower app and
the Simulation Engine (20 virtual SuperNodes standing in for 1,000) all run and every key is printed, a smoke test
whose values are not a measurement (Flower's and Ray's start-up dominate it: a minute or two; its comparison
deployment shortens Flower's idle waits with fast_supernode.py, which a measurement never does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import tempfile
import sys
import time

import numpy as np
import torch

from privfl.algorithms import make_algorithm
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays, load_digits
from privfl.flower.app import APP_MODULE, RunSpec, read_result, write_app
from privfl.flower.local import LocalDeployment
from privfl.flower.warm import PRELOAD, preload
from privfl.runtime.engine import Simulation


SMOKE = {"clients": 2, "rounds": 1, "hidden": 8, "per_client": 32, "engine_clients": 20, "settle": 1.0,
         "compare_repeats": 1, "compare_warmup": 0}

#: the plain Flower app (Flower's own strategies, no privfl) that privfl's runs are compared with
PLAIN_APP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plain_flower_app")
#: the comparison's variants in the order of one repetition (pairs: privfl, then the plain app doing the same job)
COMPARED = (("privfl_fedavg", "plain_flower_fedavg"), ("privfl_dp", "plain_flower_dp"))


def flower_version() -> str | None:
    """The installed flwr's version if its server side imports, else None (the deployment is then skipped)."""
    try:
        from importlib.metadata import version
        import flwr.server  # noqa: F401  (importable, not just installed)
        return version("flwr")
    except Exception:  # flwr absent or broken
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=1500)
    ap.add_argument("--per-client", type=int, default=150, help="records per client")
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds for the flwr run")
    ap.add_argument("--supernode-poll", type=float, default=0.25,
                    help="fast_supernode.py --poll-interval: cap on the SuperNodes' fixed waits (s)")
    ap.add_argument("--object-backoff", type=float, default=None,
                    help="fast_supernode.py --object-backoff: first retry of a missing object (s; 0.05)")
    ap.add_argument("--worker-poll", type=float, default=0.25, help="seconds between a warm worker's claims")
    ap.add_argument("--reply-poll", type=float, default=0.1, help="seconds between the ServerApp's reply pulls")
    ap.add_argument("--superexec-poll", type=float, default=0.1, help="FLWR_SUPEREXEC_TASK_POLL_INTERVAL (s)")
    ap.add_argument("--stock", action="store_true",
                    help="also measure the warm deployment with Flower's waits unpatched (slow: ~240 s)")
    ap.add_argument("--subprocess", action="store_true",
                    help="also measure Flower's default isolation (a ClientApp process per message; slow)")
    ap.add_argument("--server-object-backoff", type=float, default=None,
                    help="also patch the ServerApp's first retry of a reply object (s; default: flwr's 1 s)")
    ap.add_argument("--superlink-sqlite", action="store_true",
                    help="the SuperLink keeps its state and objects in an SQLite file, not in Python (Flower's "
                         "default)")
    ap.add_argument("--logs", default=None, help="keep each deployment's logs under this folder")
    ap.add_argument("--engine-clients", type=int, default=1000, help="virtual SuperNodes of the Simulation Engine run")
    ap.add_argument("--compare-repeats", type=int, default=3,
                    help="alternated repetitions of privfl vs the plain Flower app (0 skips the comparison)")
    ap.add_argument("--compare-warmup", type=int, default=1, choices=(0, 1),
                    help="one untimed 1-round run of each compared variant first")
    ap.add_argument("--compare-isolation", choices=("process", "subprocess"), default="process",
                    help="the compared SuperNodes' ClientApp isolation: a warm worker each (process) or Flower's "
                         "fresh process per message (subprocess)")
    ap.add_argument("--dp-epsilon", type=float, default=3.0, help="privfl DP-FedAvg's epsilon (delta 1e-5)")
    ap.add_argument("--dp-clip", type=float, default=1.0, help="DP-FedAvg's clip C (both apps)")
    ap.add_argument("--settle", type=float, default=5.0,
                    help="seconds the SuperNodes get to register before the clock starts (not timed)")
    ap.add_argument("--smoke", action="store_true", help="smallest sizes (a smoke test)")
    args = ap.parse_args()
    if args.smoke:  # the smallest sizes as defaults, so that a flag given with --smoke still wins
        ap.set_defaults(**SMOKE)
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
    if flower_version() is None:
        print("flower_seconds=unavailable (flwr not installed)")
        print("flower_over_inprocess=unavailable")
        if args.compare_repeats > 0:
            print("privfl_over_plain_flower=unavailable (flwr not installed)")
        if args.engine_clients > 0:
            print("engine_seconds=unavailable (flwr not installed)")
            print("sim_1000_clients_round_seconds=unavailable (flwr not installed)")
        return

    spec = RunSpec.of("fedavg", data, fed, privacy, run_id="bench", node_wait=120, round_timeout=600)
    backoff = 0.05 if args.object_backoff is None else args.object_backoff
    fast = dict(warm=True, worker_poll_interval=args.worker_poll,
                supernode_command=fast_supernode(args.supernode_poll, "--object-backoff", f"{backoff:g}",
                                                 "--log-timestamps"),
                superexec_poll=args.superexec_poll, reply_poll=args.reply_poll,
                server_object_backoff=args.server_object_backoff,
                superlink_database=None if args.superlink_sqlite else ":flwr-in-memory:")
    print(f"supernode_poll={args.supernode_poll:g}")
    print(f"object_backoff={backoff:g}")
    print(f"worker_poll={args.worker_poll:g}")
    print(f"reply_poll={args.reply_poll:g}")
    print(f"superexec_poll={args.superexec_poll:g}")
    if args.server_object_backoff is not None:
        print(f"server_object_backoff={args.server_object_backoff:g}")
    print(f"superlink_database={'sqlite' if args.superlink_sqlite else ':flwr-in-memory:'}")
    variants = [("", fast)]
    if args.stock:  # the same SuperLink, Flower's waits
        variants.append(("_stock", dict(warm=True, superlink_database=fast["superlink_database"])))
    if args.subprocess:
        variants.append(("_subprocess", dict(warm=False)))
    for suffix, options in variants:
        logs = os.path.join(args.logs, suffix.lstrip("_") or "fast") if args.logs else None
        seconds, rounds, result, workers, phases = deployed_run(data, spec, args.timeout, logs=logs,
                                                                settle=args.settle, **options)
        print(f"flower{suffix}_seconds={seconds:.2f}")
        print(f"flower{suffix}_round_seconds={rounds:.2f}")
        for name, value in phases.items():
            print(f"flower{suffix}_{name}={value:.2f}")
        if not suffix:
            same = np.array_equal(result["state"]["global_params"], expected)
            print(f"flower_equals_inprocess_per_client={same}")
            print(f"flower_over_inprocess_per_client={seconds / timings['per_client']:.2f}")
        print(f"flower_rounds_over_inprocess{suffix}={rounds / timings['auto']:.2f}")
        if workers:
            print(f"worker{suffix}_task_seconds_max={max(w['task'] for w in workers):.2f}")
            print(f"worker{suffix}_clientapp_seconds_mean={np.mean([w['clientapp'] for w in workers]):.2f}")
            print(f"worker{suffix}_tasks={sum(w['tasks'] for w in workers)}")
        print(f"flower_over_inprocess{suffix}={seconds / timings['auto']:.2f}")
    if args.compare_repeats > 0:
        compare_with_plain_flower(data, fed, args)
    if args.engine_clients > 0:
        simulation_engine(args.engine_clients, args.timeout)


def dp_noise(data, fed, privacy) -> tuple[float, float]:
    """privfl's DP-FedAvg noise for this run, from its run plan: (privfl's noise multiplier, the multiplier that gives
    Flower's server-side fixed clipping at clip ``privacy.clip`` the same std on the sum). The two are equal when the
    sensitivity of the clipped sum is the clip (add/remove-one clients)."""
    from privfl.core.plan import RunPlan

    spec = RunSpec.of("dp_fedavg", data, fed, privacy)
    alg = make_algorithm("dp_fedavg", fed, privacy)
    alg.setup(spec.public_facts(), np.random.default_rng(0))
    plan = RunPlan.build(alg, privacy, fed, alg.public)
    (channel,) = plan.channels
    z = float(plan.noise_multipliers[channel.name])
    return z, z * channel.sensitivity / privacy.clip


def write_organisations(data, work: str) -> list[dict]:
    """Each client's records as ``work/org<k>.npz`` and its SuperNode's node config (partition id, data path, its own
    ledger ``work/org<k>.sqlite``)."""
    configs = []
    for k, part in enumerate(data.train_parts):
        path = os.path.join(work, f"org{k}.npz")
        np.savez(path, x=part.x, y=part.y)
        configs.append({"partition-id": k, "data-path": path, "ledger-path": os.path.join(work, f"org{k}.sqlite")})
    return configs


def compare_with_plain_flower(data, fed, args) -> None:
    """privfl's FedAvg and DP-FedAvg against the plain Flower app doing the same job, alternated on one stock
    deployment (see the module docstring); prints the comparison's keys."""
    n, rounds = len(data.train_parts), fed.rounds
    dp_privacy = PrivacyConfig(epsilon=args.dp_epsilon, delta=1e-5, unit="client", clip=args.dp_clip,
                               placement="central")
    # a private run declares the clients' design size (public, fixed before the data; here every client has it)
    dp_fed = dataclasses.replace(fed, client_size=args.per_client)
    z_privfl, z_flower = dp_noise(data, dp_fed, dp_privacy)
    warm = args.compare_isolation == "process"
    with tempfile.TemporaryDirectory(prefix="privfl-bench-plain-") as work:
        configs = write_organisations(data, work)
        runs = {}  # variant -> (kind, app folder, result path, extra options)
        for variant, algorithm, run_fed, privacy in (("privfl_fedavg", "fedavg", fed, PrivacyConfig()),
                                                     ("privfl_dp", "dp_fedavg", dp_fed, dp_privacy)):
            spec = RunSpec.of(algorithm, data, run_fed, privacy, run_id=variant, node_wait=120, round_timeout=600)
            result = os.path.join(work, f"{variant}.bin")
            runs[variant] = ("privfl", write_app(os.path.join(work, variant), spec, result_path=result), result)
        plain = {"num-clients": n, "local-epochs": fed.local_epochs, "batch-size": fed.batch_size, "lr": fed.lr,
                 "momentum": fed.momentum, "hidden": ",".join(str(h) for h in fed.hidden),
                 "in-features": int(np.prod(data.train_parts[0].x.shape[1:])),
                 "num-classes": int(data.train_parts[0].num_classes), "seed": fed.seed, "torch-threads": 1,
                 "noise-multiplier": z_flower, "clipping-norm": args.dp_clip, "target-delta": dp_privacy.delta}
        for variant, dp in (("plain_flower_fedavg", False), ("plain_flower_dp", True)):
            runs[variant] = ("plain", PLAIN_APP, os.path.join(work, f"{variant}.json"), dict(plain, dp=dp))
        deploy = os.path.join(work, "deployment")
        os.makedirs(deploy)
        times = {v: [] for pair in COMPARED for v in pair}
        per_round = {v: [] for v in times}
        # --smoke checks that every key is printed, not a measurement: its SuperNodes shorten Flower's idle waits
        # (fast_supernode.py), which saves make test most of a minute; a measurement runs stock binaries
        quick = {"supernode_command": fast_supernode(0.05), "worker_poll_interval": 0.05} if args.smoke else {}
        with LocalDeployment(deploy, configs, warm=warm, superlink_database=":flwr-in-memory:", **quick) as dep:
            if warm:
                dep.wait_workers(timeout=300)  # not timed: a worker is up before a run
            time.sleep(args.settle)  # not timed: the SuperNodes register
            for k, proc in enumerate(dep.procs[1:]):
                if proc.poll() is not None:
                    log = open(os.path.join(deploy, f"supernode{k}.log"), errors="replace").read()[-3000:]
                    raise SystemExit(f"SuperNode {k} exited with {proc.returncode}:\n{log}")
            if args.compare_warmup:
                for pair in COMPARED:
                    for variant in pair:
                        compared_run(dep, runs[variant], 1, f"{variant}-warmup", args.timeout)
            for rep in range(args.compare_repeats):
                for pair in COMPARED:
                    for variant in (pair if rep % 2 == 0 else pair[::-1]):
                        seconds, rounds_seconds, result = compared_run(dep, runs[variant], rounds, f"{variant}-{rep}",
                                                                       args.timeout)
                        if variant == "privfl_dp" and result["noise_multipliers"] != {"update": z_privfl}:
                            raise SystemExit(f"privfl's DP-FedAvg run planned {result['noise_multipliers']}, the "
                                             f"plain app was given z = {z_privfl}")
                        times[variant].append(seconds)
                        per_round[variant].append(rounds_seconds)
        if args.logs:  # the comparison's deployment logs (SuperLink, SuperNodes, workers, every flwr run)
            keep = os.path.join(args.logs, "compare")
            os.makedirs(keep, exist_ok=True)
            for name in os.listdir(deploy):
                if name.endswith(".log"):
                    shutil.copy(os.path.join(deploy, name), keep)
    median = {v: float(np.median(t)) for v, t in times.items()}
    print(f"compare_isolation={args.compare_isolation}")
    print(f"compare_repeats={args.compare_repeats}")
    print(f"compare_rounds={rounds}")
    print(f"dp_noise_multiplier={z_privfl:.4f}")
    print(f"dp_clip={args.dp_clip:g}")
    for variant in times:
        print(f"{variant}_seconds={median[variant]:.2f}")
        print(f"{variant}_runs_seconds={','.join(f'{t:.2f}' for t in times[variant])}")
        print(f"{variant}_round_seconds={np.median(per_round[variant]):.3f}")
    ratios = {}
    for (ours, theirs), name in zip(COMPARED, ("fedavg", "dp")):
        ratios[name] = median[ours] / median[theirs]
        print(f"privfl_over_plain_flower_{name}={ratios[name]:.3f}")
    print(f"privfl_over_plain_flower={max(ratios.values()):.3f}")
    print(f"privfl_round_seconds={np.median(per_round['privfl_fedavg'] + per_round['privfl_dp']):.3f}")
    print(f"plain_flower_round_seconds="
          f"{np.median(per_round['plain_flower_fedavg'] + per_round['plain_flower_dp']):.3f}")


def compared_run(dep, run, rounds: int, tag: str, timeout: float):
    """One timed ``flwr run`` of a compared variant (``run``: its kind, app folder, result path and, for the plain
    app, its run config) for ``rounds`` rounds; returns (seconds, mean seconds of a round as its ServerApp timed
    them, the result it wrote)."""
    kind, app, result_path, *extra = run
    if os.path.exists(result_path):
        os.remove(result_path)
    if kind == "privfl":  # a fresh run id each time: a ledger refuses a round of a run id twice
        run_config = f"run-id='{tag}'" + (f" rounds={rounds}" if rounds else "")
    else:
        overrides = dict(extra[0], **{"num-server-rounds": rounds, "result-path": result_path})
        run_config = os.path.join(dep.workdir, f"{tag}.toml")
        with open(run_config, "w") as f:  # TOML basic strings share JSON's escapes
            f.write("".join(f"{key} = {str(v).lower() if isinstance(v, bool) else json.dumps(v)}\n"
                            for key, v in overrides.items()))
    start = time.perf_counter()
    dep.run(app, timeout=timeout, run_config=run_config)
    seconds = time.perf_counter() - start
    if not os.path.exists(result_path):
        log = open(os.path.join(dep.workdir, "flwr-run.log"), errors="replace").read()[-3000:]
        raise SystemExit(f"{tag}: the ServerApp wrote no result:\n{log}")
    if kind == "privfl":
        result = read_result(result_path)
        laps = [h["seconds"] for h in result["history"]]
    else:
        with open(result_path) as f:
            result = json.load(f)
        laps = result["round_seconds"]
        if not result["finite"]:
            raise SystemExit(f"{tag}: the plain app's final model is not finite")
    if len(laps) != rounds:
        raise SystemExit(f"{tag}: {len(laps)} rounds ran, not {rounds}")
    return seconds, float(np.mean(laps)), result


def deployed_run(data, spec, timeout: float, *, warm: bool, reply_poll: float | None = None, logs: str | None = None,
                 server_object_backoff: float | None = None, settle: float = 5.0, **deployment):
    """``flwr run`` of ``spec`` on a fresh loopback deployment (started and waited for before the clock starts, then
    ``settle`` seconds for the SuperNodes to register; ``deployment``: more of LocalDeployment's options,
    ``reply_poll``: the ServerApp's ``PRIVFL_REPLY_POLL``);
    returns (seconds, the rounds' seconds as the ServerApp timed them, its result, each worker's task totals)."""
    with tempfile.TemporaryDirectory(prefix="privfl-bench-flower-") as work:
        configs = write_organisations(data, work)
        result_path = os.path.join(work, "result.bin")
        app = write_app(os.path.join(work, "app"), spec, result_path=result_path)
        if server_object_backoff is not None:
            patch_server_object_backoff(app, server_object_backoff)
        env = {"PRIVFL_REPLY_POLL": f"{reply_poll:g}"} if reply_poll is not None else {}
        with LocalDeployment(work, configs, warm=warm, env=env, **deployment) as dep:
            if warm:
                dep.wait_workers(timeout=300)  # imports done (not timed: a worker is up before a run)
            time.sleep(settle)  # let the SuperNodes register (not timed: a federation is up before a run)
            for k, proc in enumerate(dep.procs[1:]):  # e.g. fast_supernode.py refusing an unknown flwr
                if proc.poll() is not None:
                    log = open(os.path.join(work, f"supernode{k}.log"), errors="replace").read()[-3000:]
                    raise SystemExit(f"SuperNode {k} exited with {proc.returncode}:\n{log}")
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
        if logs:
            os.makedirs(logs, exist_ok=True)
            for name in os.listdir(work):
                if name.endswith(".log"):
                    shutil.copy(os.path.join(work, name), logs)
            if workers:
                # from `flwr run` to the first ClientApp task: building and shipping the app, the SuperLink's
                # SuperExec starting the ServerApp process (imports), the ServerApp's setup, node wait, the query
                phases["until_first_task_seconds"] = min(w["first_start"] for w in workers) - wall
    return seconds, sum(h["seconds"] for h in result["history"]), result, workers, phases


#: this folder's SuperNode launcher (a benchmark and test tool, not part of privfl: experiments/fast_supernode.py)
FAST_SUPERNODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast_supernode.py")


def fast_supernode(poll: float, *options: str) -> tuple[str, ...]:
    """``LocalDeployment(supernode_command=...)``: Flower's SuperNode with its fixed waits capped at ``poll`` s."""
    return (sys.executable, FAST_SUPERNODE, "--poll-interval", f"{poll:g}", "--require-patch", *options)


def patch_server_object_backoff(app: str, first: float) -> None:
    """Make the app module rebind ``flwr.superlink.grid.http_grid.pull_objects`` (the ServerApp's pulls of reply
    objects) to retry after ``first`` seconds (see the module docstring); flwr still finds the components."""
    path = os.path.join(app, f"{APP_MODULE}.py")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write("import flwr.superlink.grid.http_grid as _http_grid\n"
                f"import sys as _sys\n_sys.path.insert(0, {os.path.dirname(FAST_SUPERNODE)!r})\n"
                "from fast_supernode import backing_off_from as _backing_off_from\n\n"
                f"_http_grid.pull_objects = _backing_off_from({first!r}, _http_grid.pull_objects)\n" + text)


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
    round_seconds = result['history'][0]['seconds']
    print(f"engine_clients={n_clients}")
    print(f"engine_seconds={seconds:.1f}")
    print(f"engine_round_seconds={round_seconds:.1f}")
    stand_in = "" if n_clients == 1000 else f" (measured with {n_clients} clients, a stand-in for 1,000)"
    print(f"sim_1000_clients_round_seconds={round_seconds:.1f}{stand_in}")


if __name__ == "__main__":
    main()
