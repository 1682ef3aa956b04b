"""Issue 16: record-level DP at the utility of centralised DP-SGD. DP-FedSGD (the noise paid once for the
federation: central, and distributed under secure aggregation) against DP-SGD FedAvg (every client adds its own
DP-SGD noise) on MNIST-5k.

Setting: MNIST-5k (4,000 training images, 1,000 test), 10 clients, Dirichlet(0.1), record level (add/remove),
delta 1e-5, epsilon in {1, 3, 8}, seeds 0-2 (each seed: its own split, partition, initialisation and noise), multinomial
logistic regression on 2x2-average-pooled images (14x14 -> 10: 1,970 weights; the pooling is the model's
``FederationConfig.pool``).

Hyper-parameters are chosen on a validation split carved from the training clients' own data (15% of each client's
records of the seed-0 federation, pooled; the clients train on the other 85%), never on the test set; the final runs
then train on the clients' full data and report test accuracy (mean +- std over seeds) and ECE. The grids (kept small
to fit ~15 minutes of CPU on a shared 2-core machine) and the choices are written to the md.

Usage: python experiments/run_record_level.py [--quick]   (writes experiments/results/record_level.{json,md});
``--markdown-only`` rewrites the md from the JSON; ``--rerun-distributed`` re-runs only the distributed placement's
final runs (3 epsilons x 3 seeds, the committed central choices of hyper-parameters, as the full run does) and
replaces them in the JSON, keeping the rows they replace under ``"superseded_distributed"`` (used when the
distributed charge changed and nothing else did).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import numpy as np
import torch

from privfl.algorithms import make_algorithm
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays, make_federated
from privfl.runtime.engine import Simulation
from privfl.privacy.secure import SecureAggregation

CLIENTS, ALPHA, DELTA = 10, 0.1, 1e-5
EPSILONS = (1.0, 3.0, 8.0)
SEEDS = (0, 1, 2)
VAL_FRACTION = 0.15
EPOCHS = 30  # DP-FedSGD: passes over the (expected) data, as the centralised DP-SGD reference (batch 256, 30 epochs)
OUT = "experiments/results"

#: DP-FedSGD's grid at epsilon = 3 (lot size L, server lr, clip C; SGD momentum 0.9); at epsilon 1 and 8 only lr is
#: re-tuned, at the epsilon-3 choice of L and C (CPU budget)
FEDSGD_GRID = {"lot_size": (256, 512), "lr": (0.1, 0.25, 0.5, 1.0), "clip": (0.5, 1.0)}
FEDSGD_LR = (0.1, 0.25, 0.5, 1.0)
#: DP-SGD FedAvg's grid at every epsilon: (rounds, local epochs), local batch, client lr (clip 1, no momentum)
DPSGD_GRID = {"schedule": ((10, 3), (20, 2), (40, 1)), "batch_size": (32, 64), "lr": (0.5, 1.0, 2.0)}


def federation(seed: int):
    return make_federated("mnist5k", CLIENTS, partition="dirichlet", alpha=ALPHA, seed=seed)


def validation_federation(data):
    """The clients keep 85% of their records; the other 15% of every client, pooled, is the validation set (the
    test set is not touched)."""
    parts, val_x, val_y = [], [], []
    for k, part in enumerate(data.train_parts):
        order = np.random.default_rng([2026, k]).permutation(len(part))
        cut = int(round(VAL_FRACTION * len(part)))
        held, kept = part.subset(order[:cut]), part.subset(order[cut:])
        parts.append((kept.x, kept.y))
        val_x.append(held.x)
        val_y.append(held.y)
    # the design size is a constant of this experiment's design (the kept share of the benchmark's training split
    # over its clients), as the public facts took it before sizes had to be declared
    return federated_from_arrays(parts, (np.concatenate(val_x), np.concatenate(val_y)), task="classification",
                                 num_classes=data.num_classes, name="mnist5k-val",
                                 design_size=round(sum(len(y) for _, y in parts) / len(parts)))


def run(algorithm: str, data, epsilon: float, seed: int, *, placement: str = "central", **hp) -> dict:
    """One run; returns its final metrics, the epsilon spent and the wall/CPU seconds."""
    options = {}
    if algorithm == "dp_fedsgd":
        lot = hp["lot_size"]
        n_train = sum(len(p) for p in data.train_parts)
        rounds = int(round(EPOCHS * n_train / lot))
        fed = FederationConfig(rounds=rounds, batch_size=lot, lr=hp["lr"], momentum=0.9, hidden=(), pool=2, seed=seed)
        options = {"lot_size": lot}
        clip = hp["clip"]
    else:
        rounds, epochs = hp["schedule"]
        fed = FederationConfig(rounds=rounds, local_epochs=epochs, batch_size=hp["batch_size"], lr=hp["lr"],
                               hidden=(), pool=2, seed=seed)
        clip = 1.0
    # pld for every placement (distributed: the honest shares' sum charged as the sampled Gaussian it nearly is)
    privacy = PrivacyConfig(epsilon=epsilon, delta=DELTA, unit="example", clip=clip, placement=placement,
                            accountant="pld", secure_noise=False)
    secure = SecureAggregation(bits=48, malicious=False) if placement == "distributed" else None
    wall, cpu = time.perf_counter(), time.process_time()
    sim = Simulation(make_algorithm(algorithm, fed, privacy, **options), data, fed, privacy, secure=secure)
    result = sim.run()
    final = result.final
    spent = max(v["epsilon"] for v in result.audit["clients"].values())
    return {"algorithm": algorithm, "placement": placement, "epsilon": epsilon, "seed": seed,
            "hyper_parameters": {k: (list(v) if isinstance(v, tuple) else v) for k, v in hp.items()},
            "rounds": fed.rounds, "accuracy": final["accuracy"], "ece": final["ece"], "nll": final["nll"],
            "epsilon_spent": spent, "noise_multipliers": sim.plan.noise_multipliers,
            "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


def grid(spec: dict):
    keys = list(spec)
    for values in itertools.product(*(spec[k] for k in keys)):
        yield dict(zip(keys, values))


def tune(algorithm: str, val_data, epsilon: float, points, log) -> tuple[dict, list[dict]]:
    rows = []
    for hp in points:
        row = run(algorithm, val_data, epsilon, 0, **hp)
        rows.append(row)
        log(f"  tune {algorithm} eps={epsilon:g} {hp}: val acc {row['accuracy']:.4f} ({row['wall_s']:.1f} s)")
    best = max(rows, key=lambda r: r["accuracy"])
    return best["hyper_parameters"], rows


def main(argv=()) -> None:
    torch.set_num_threads(1)
    quick = "--quick" in argv
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    feds = {seed: federation(seed) for seed in SEEDS}
    val_data = validation_federation(feds[0])
    tuning, chosen = [], {}
    # DP-FedSGD: full grid at epsilon 3, lr only at 1 and 8
    hp3, rows = tune("dp_fedsgd", val_data, 3.0, list(grid(FEDSGD_GRID))[:2 if quick else None], log)
    tuning += rows
    chosen[("dp_fedsgd", 3.0)] = hp3
    for eps in (1.0, 8.0):
        points = [{**hp3, "lr": lr} for lr in FEDSGD_LR][:1 if quick else None]
        chosen[("dp_fedsgd", eps)], rows = tune("dp_fedsgd", val_data, eps, points, log)
        tuning += rows
    # DP-SGD FedAvg: its grid at every epsilon
    for eps in EPSILONS:
        points = list(grid(DPSGD_GRID))[:2 if quick else None]
        chosen[("dpsgd_fedavg", eps)], rows = tune("dpsgd_fedavg", val_data, eps, points, log)
        tuning += rows
    tuning_cpu = time.process_time() - start_cpu
    final = []
    for (algorithm, eps), hp in sorted(chosen.items()):
        placements = ("central", "distributed") if algorithm == "dp_fedsgd" else ("local",)
        for placement, seed in itertools.product(placements, SEEDS[:1 if quick else None]):
            row = run(algorithm, feds[seed], eps, seed, placement=placement if algorithm == "dp_fedsgd" else "central",
                      **hp)
            row["placement"] = placement
            final.append(row)
            log(f"final {algorithm} {placement} eps={eps:g} seed={seed}: test acc {row['accuracy']:.4f} "
                f"ece {row['ece']:.3f} spent {row['epsilon_spent']:.3f} ({row['wall_s']:.1f} s)")
    summary = summarise(final)
    report = {"setting": {"dataset": "mnist5k", "clients": CLIENTS, "partition": f"dirichlet({ALPHA})",
                          "unit": "example", "adjacency": "add_remove", "delta": DELTA, "epsilons": EPSILONS,
                          "seeds": SEEDS, "model": "logistic regression on 2x2-pooled images (1,970 weights)",
                          "validation": f"{VAL_FRACTION:.0%} of each client's records (seed-0 federation)",
                          "dp_fedsgd_epochs": EPOCHS, "fedsgd_grid": FEDSGD_GRID, "fedsgd_lr_grid": FEDSGD_LR,
                          "dpsgd_grid": DPSGD_GRID, "quick": quick},
              "chosen": [{"algorithm": a, "epsilon": e, "hyper_parameters": hp} for (a, e), hp in sorted(chosen.items())],
              "tuning": tuning, "final": final, "summary": summary,
              "cpu_s": {"tuning": tuning_cpu, "total": time.process_time() - start_cpu},
              "wall_s": time.perf_counter() - start_wall}
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "record_level.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    md = markdown(report)
    with open(os.path.join(OUT, "record_level.md"), "w") as f:
        f.write(md)
    print(md)


def summarise(final):
    out = []
    keys = sorted({(r["algorithm"], r["placement"], r["epsilon"]) for r in final})
    for algorithm, placement, eps in keys:
        rows = [r for r in final if (r["algorithm"], r["placement"], r["epsilon"]) == (algorithm, placement, eps)]
        acc = np.array([r["accuracy"] for r in rows])
        ece = np.array([r["ece"] for r in rows])
        out.append({"algorithm": algorithm, "placement": placement, "epsilon": eps, "runs": len(rows),
                    "accuracy": float(acc.mean()), "accuracy_std": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
                    "ece": float(ece.mean()), "ece_std": float(ece.std(ddof=1)) if len(ece) > 1 else 0.0,
                    "epsilon_spent_max": max(r["epsilon_spent"] for r in rows),
                    "noise_multiplier": next(iter((rows[0]["noise_multipliers"] or {}).values()), None),
                    "wall_s_per_run": float(np.mean([r["wall_s"] for r in rows]))})
    return out


def _old_rows(report, eps):
    return [r for r in report["superseded_distributed"] if r["epsilon"] == eps]


def _old_z(report) -> str:
    return " / ".join(f"{next(iter(_old_rows(report, e)[0]['noise_multipliers'].values())):.3g}"
                      for e in EPSILONS)


def _old_acc(report) -> str:
    return " / ".join(f"{np.mean([r['accuracy'] for r in _old_rows(report, e)]):.3f}" for e in EPSILONS)


def markdown(report) -> str:
    s = report["setting"]
    lines = ["# Record-level DP on MNIST-5k: DP-FedSGD vs DP-SGD FedAvg (issue 16)", "",
             f"{s['clients']} clients, {s['partition']}, record level (add/remove), delta {s['delta']:g}, seeds "
             f"{list(s['seeds'])}; {s['model']}. Test accuracy and ECE (15 bins) of the final global model, mean ± "
             "std over seeds (each seed: its own split, partition, initialisation and noise). ε spent: the largest "
             "client's ε from its ledger.", "",
             "| algorithm | noise placement | ε target | test accuracy | ECE | ε spent (max) | noise multiplier | "
             "s / run |", "|---|---|---|---|---|---|---|---|"]
    for r in report["summary"]:
        z = r["noise_multiplier"]
        lines.append(f"| {r['algorithm']} | {r['placement']} | {r['epsilon']:g} | {r['accuracy']:.4f} ± "
                     f"{r['accuracy_std']:.4f} | {r['ece']:.3f} ± {r['ece_std']:.3f} | {r['epsilon_spent_max']:.3f} | "
                     f"{'per client (DP-SGD)' if z is None else f'{z:.3f}'} | {r['wall_s_per_run']:.1f} |")
    lines += ["", "## Hyper-parameters (chosen on validation, never on test)", "",
              f"Validation: {s['validation']}, the clients training on the rest; one run (seed 0) per grid point, "
              "the best final validation accuracy chosen.", "",
              f"- dp_fedsgd (SGD momentum 0.9 on the server, {s['dp_fedsgd_epochs']} expected epochs: rounds = "
              f"{s['dp_fedsgd_epochs']} x N / L): full grid at ε = 3 over lot size L {list(s['fedsgd_grid']['lot_size'])}"
              f", server lr {list(s['fedsgd_grid']['lr'])}, clip C {list(s['fedsgd_grid']['clip'])}; at ε = 1 and 8 "
              f"only the lr {list(s['fedsgd_lr_grid'])} at the ε = 3 choice of L and C (CPU budget). The distributed "
              "placement reuses the central choice (no separate tuning).",
              f"- dpsgd_fedavg (clip 1, no momentum): (rounds, local epochs) "
              f"{[list(x) for x in s['dpsgd_grid']['schedule']]} x local batch {list(s['dpsgd_grid']['batch_size'])} x "
              f"client lr {list(s['dpsgd_grid']['lr'])}, at every ε.", "",
              "| algorithm | ε | chosen | validation accuracy |", "|---|---|---|---|"]
    for c in report["chosen"]:
        val = max(r["accuracy"] for r in report["tuning"] if r["algorithm"] == c["algorithm"]
                  and r["epsilon"] == c["epsilon"] and r["hyper_parameters"] == c["hyper_parameters"])
        lines.append(f"| {c['algorithm']} | {c['epsilon']:g} | {c['hyper_parameters']} | {val:.4f} |")
    lines += ["", "### Every grid point", "", "| algorithm | ε | hyper-parameters | validation accuracy | s |",
              "|---|---|---|---|---|"]
    for r in report["tuning"]:
        lines.append(f"| {r['algorithm']} | {r['epsilon']:g} | {r['hyper_parameters']} | {r['accuracy']:.4f} | "
                     f"{r['wall_s']:.1f} |")
    lines += ["", "## Reading", "",
              "- dp_fedsgd adds the noise once for the federation: its central placement is centralised DP-SGD's "
              "noise (z C on the sum of all clients' lots), while every dpsgd_fedavg client adds its own DP-SGD noise "
              "to a model trained on its own ~400 records.",
              "- The distributed placement charges the sum of the honest clients' discrete-Gaussian shares as the "
              "Poisson-sampled Gaussian it nearly is (privfl.mechanisms.discrete_gaussian.distributed_gaussian_event: "
              "within a total variation of ~1e-20 a round of a rounded Gaussian, a post-processing of the Gaussian "
              "mechanism), composed by the pld accountant with that term added to delta, so its noise multiplier is "
              "the central one (see the table's column)."
              + (f" Before that change it charged PoissonSampled(q, ZCDP(rho)) under the rdp accountant (Zhu and "
                 f"Wang's general bound), which needed z {_old_z(report)} at ε = 1 / 3 / 8 and reached test accuracy "
                 f"{_old_acc(report)}." if report.get("superseded_distributed") else ""),
              "- Single validation runs pick the hyper-parameters, so a choice may sit on a grid's edge "
              "(dpsgd_fedavg's most rounds, dp_fedsgd's smallest L): larger grids were not affordable on this "
              "machine."]
    cpu = report["cpu_s"]
    lines += ["", f"CPU time of this script: {cpu['total']:.0f} s ({cpu['tuning']:.0f} s of it tuning), wall "
              f"{report['wall_s']:.0f} s, torch on one thread, on a 2-core machine shared with other jobs."
              + (" QUICK MODE: truncated grids and one seed; not the reported results." if s["quick"] else "")]
    if report.get("distributed_rerun"):
        rerun = report["distributed_rerun"]
        lines += ["", "The distributed rows were re-run alone after the change of their charge "
                      "(`--rerun-distributed`: the same data, seeds and hyper-parameters): "
                      f"{rerun['cpu_s']:.0f} s CPU, wall {rerun['wall_s']:.0f} s."]
    lines += [""]
    return "\n".join(lines)


def rerun_distributed() -> None:
    """Re-run the distributed final rows with the committed choices; the rows replaced are kept in the JSON."""
    torch.set_num_threads(1)
    path = os.path.join(OUT, "record_level.json")
    with open(path) as f:
        report = json.load(f)
    feds = {seed: federation(seed) for seed in SEEDS}
    chosen = {(c["algorithm"], c["epsilon"]): c["hyper_parameters"] for c in report["chosen"]}
    old = [r for r in report["final"] if r["placement"] == "distributed"]
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    new = []
    for eps in EPSILONS:
        hp = {k: (tuple(v) if isinstance(v, list) else v) for k, v in chosen[("dp_fedsgd", float(eps))].items()}
        for seed in SEEDS:
            row = run("dp_fedsgd", feds[seed], float(eps), seed, placement="distributed", **hp)
            row["placement"] = "distributed"
            new.append(row)
            print(f"final dp_fedsgd distributed eps={eps:g} seed={seed}: test acc {row['accuracy']:.4f} "
                  f"spent {row['epsilon_spent']:.3f} z {row['noise_multipliers']} ({row['wall_s']:.1f} s)",
                  file=sys.stderr, flush=True)
    report["superseded_distributed"] = report.get("superseded_distributed", []) + old
    report["final"] = [r for r in report["final"] if r["placement"] != "distributed"] + new
    report["summary"] = summarise(report["final"])
    report["distributed_rerun"] = {"cpu_s": time.process_time() - start_cpu,
                                   "wall_s": time.perf_counter() - start_wall}
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    text = markdown(report)
    with open(os.path.join(OUT, "record_level.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    if "--rerun-distributed" in sys.argv:
        rerun_distributed()
    elif "--markdown-only" in sys.argv:  # rewrite the md from the committed JSON (no runs)
        with open(os.path.join(OUT, "record_level.json")) as f:
            text = markdown(json.load(f))
        with open(os.path.join(OUT, "record_level.md"), "w") as f:
            f.write(text)
    else:
        main(sys.argv[1:])
