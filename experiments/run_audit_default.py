"""Issue 29: ``privfl audit-run`` on the default comparison's setting, honest and with each injected fault.

DP-FedSGD as ``make demo`` runs it (``experiments/configs/default.toml``: MNIST-5k, 10 clients, Dirichlet 0.1, record
level, delta 1e-5, logistic regression on 2x2-pooled images, 410 rounds of lot 256, central noise) at epsilon 1, 3
and 8, with ``CANARIES`` record canaries (each included by a fair coin, in its client's Poisson lot at the lot's rate
like any record, its gradient a secret direction clipped to C; the most the 1,970 coordinates of the model take: half
of them), seeds 0-2. For each run: the one-run lower bound on epsilon (Steinke, Nasr and Jagielski 2023; 95 %
confidence) beside the ledger's epsilon, and the test accuracy (the canaries are in the training).

Faults (never reachable from ``privfl run``): ``half_noise`` halves every Gaussian draw, ``no_clip`` lets the
canaries' 10 C gradients out unclipped. The ledger charges what was calibrated either way. Runs go two at a time
(the machine's two cores, one torch thread each). Writes ``experiments/results/run_audit_default.{json,md}``.

Usage: python experiments/run_audit_default.py [--smoke]   (``--smoke``: epsilon 3, one seed, 3 rounds, 64 canaries;
not a measurement)
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from multiprocessing import Pool

import numpy as np
import torch

from privfl.algorithms import make_algorithm
from privfl.apps.compare import CompareConfig, RunSpec, _configs, _options, federation
from privfl.apps.run_audit import audit_run

OUT = "experiments/results"
CONFIG = "experiments/configs/default.toml"
EPSILONS = (1.0, 3.0, 8.0)
SEEDS = (0, 1, 2)
FAULTS = ("none", "half_noise", "no_clip")
CANARIES = 985


def run(job) -> dict:
    epsilon, seed, fault, canaries, rounds = job
    torch.set_num_threads(1)
    config = CompareConfig.from_toml(CONFIG)
    fed, privacy = _configs(config, RunSpec("dp_fedsgd", epsilon, seed))
    if rounds is not None:
        fed = dataclasses.replace(fed, rounds=rounds)
    privacy = dataclasses.replace(privacy, secure_noise=False)
    data = federation(config, seed)
    alg = make_algorithm("dp_fedsgd", fed, privacy, **_options(config, "dp_fedsgd"))
    start = time.perf_counter()
    audit = audit_run(alg, data, fed, privacy, canaries=canaries, fault=fault)
    accuracy = float(alg.evaluate(data.test)["accuracy"])
    return {"epsilon": epsilon, "seed": seed, **audit.to_dict(), "accuracy": accuracy,
            "seconds": time.perf_counter() - start}


def markdown(rows, smoke: bool) -> str:
    lines = ["# The run audit on the default comparison's setting (issue 29)", "",
             "`privfl audit-run` on DP-FedSGD as `make demo` runs it (MNIST-5k, 10 clients, Dirichlet 0.1, record "
             "level, delta 1e-5, 410 rounds of lot 256, central noise), with "
             f"{rows[0]['canaries']} record canaries (each included by a fair coin; in its client's Poisson lot like "
             "any record; its gradient a secret direction clipped to C). Lower bound: Steinke, Nasr and Jagielski's "
             "one-run bound at 95 % confidence. Seeds "
             f"{sorted({r['seed'] for r in rows})}; `python experiments/run_audit_default.py`"
             + (" --smoke (NOT a measurement)" if smoke else "") + ".", "",
             "| epsilon (target) | fault | lower bound per seed | ledger epsilon | caught (bound > ledger) | "
             "correct / guesses (seed 0) | accuracy |", "|---|---|---|---|---|---|---|"]
    for eps in sorted({r["epsilon"] for r in rows}):
        for fault in FAULTS:
            rs = sorted((r for r in rows if r["epsilon"] == eps and r["fault"] == fault), key=lambda r: r["seed"])
            if not rs:
                continue
            lines.append(f"| {eps:g} | {fault} | " + ", ".join(f"{r['epsilon_lower_bound']:.2f}" for r in rs)
                         + f" | {max(r['epsilon_ledger'] for r in rs):.3f} | "
                         f"{sum(r['violated'] for r in rs)} of {len(rs)} | {rs[0]['correct']} / {rs[0]['guesses']} | "
                         f"{np.mean([r['accuracy'] for r in rs]):.4f} |")
    lines += ["", "An honest run's bound must stay below its ledger's epsilon (it is a 95 % lower bound on the true "
              "one). `no_clip` multiplies a canary's signal by ten and is caught; `half_noise` doubles the "
              "Gaussian's privacy parameter, which this one-run bound cannot see at delta 1e-5 (README, \"The run "
              "audit\").", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    smoke = "--smoke" in argv
    jobs = ([(3.0, 0, f, 64, 3) for f in FAULTS] if smoke else
            [(eps, seed, f, CANARIES, None) for eps in EPSILONS for f in FAULTS for seed in SEEDS])
    start = time.perf_counter()
    if smoke:
        rows = [run(job) for job in jobs]
    else:
        with Pool(2) as pool:
            rows = pool.map(run, jobs)
    for r in rows:
        print(f"eps={r['epsilon']:g} seed={r['seed']} {r['fault']}: bound {r['epsilon_lower_bound']:.3f} ledger "
              f"{r['epsilon_ledger']:.3f} ({r['seconds']:.1f} s)", file=sys.stderr, flush=True)
    text = markdown(rows, smoke)
    if not smoke:
        with open(os.path.join(OUT, "run_audit_default.json"), "w") as f:
            json.dump({"rows": rows, "wall_s": time.perf_counter() - start, "machine": platform.machine(),
                       "python": platform.python_version()}, f, indent=1)
        with open(os.path.join(OUT, "run_audit_default.md"), "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
