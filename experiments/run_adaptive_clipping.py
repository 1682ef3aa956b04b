"""Issue 29: adaptive clipping against the best fixed clip chosen in hindsight, on the default comparison's setting.

DP-FedSGD and DP-SGD FedAvg as ``make demo`` runs them (``experiments/configs/default.toml``: MNIST-5k, 10 clients,
Dirichlet 0.1, record level, delta 1e-5, logistic regression on 2x2-pooled images; DP-FedSGD: central noise, 410
rounds of lot 256, server lr 0.125 with momentum 0.9; DP-SGD FedAvg: local noise, 10 rounds of 3 local epochs,
batch 32, lr 0.25), seeds 0-2:

- **fixed clips** C in ``CLIPS``, each run at every seed; the best one is picked *in hindsight*, by its mean test
  accuracy over the seeds (the baseline Andrew et al. compare with: what a grid search on the test set would find);
- **adaptive at privfl's defaults** (``clip="adaptive"``: quantile 0.5, Andrew et al.'s untuned choice, step 0.2,
  1 % of the budget for the count): the clip starts at the algorithm's default (1.0) and follows the quantile of the
  records' gradient norms (DP-FedSGD: one clip, its count released on the lot and charged in every ledger, Andrew et
  al.'s step each round; DP-SGD FedAvg: every client trains a round at the broadcast clip and sends noisy counts at
  nine thresholds drawn inside its DP-SGD steps' events, the server moves the clip ``clip_lr`` of the way to the
  quantile they estimate, in log space);
- **adaptive, chosen on validation**: quantile, step and share over ``ADAPTIVE[algorithm]``, the point with the best
  accuracy
  on the comparison's validation split (``val_fraction``: images held by no client, the test set unread) at
  epsilon 3, seed 0.

Reported per epsilon (1, 3, 8; the acceptance is at 3): mean +- std over the seeds of test accuracy, NLL and ECE, the
adaptive runs' clip over the rounds (DP-FedSGD: first, median, last; DP-SGD FedAvg: the clients' clips after the last
round, mean), and the largest epsilon any client's ledger spent. Runs go two at a time (the machine's two cores, one
torch thread each). Writes ``experiments/results/adaptive_clipping.{json,md}``.

``--fresh-seeds``: the committed comparison's two choices (the adaptive setting chosen on validation, the fixed clip
picked in hindsight on seeds 0-2's test accuracy) run again on seeds the choices never saw (``FRESH_SEEDS``; a seed
whose federation leaves a client too small for the schedule is refused by privfl and skipped, and said), paired by
seed: the hindsight pick's own selection bias (the best of six clips on the same seeds it is scored on) is gone.
Writes ``experiments/results/adaptive_clipping_fresh.{json,md}``.

``--fresh-hindsight`` (after ``--fresh-seeds``): at epsilon 3, every fixed clip on those fresh seeds, the best picked
in hindsight on them, against the same seeds' adaptive runs (``adaptive_clipping_fresh_hindsight.{json,md}``).

``--client-level``: the same comparison for DP-FedAvg's client-level adaptive clipping (Andrew et al.'s own
algorithm), its own fixed clips around its default 0.1 (``adaptive_clipping_client.{json,md}``).

Usage: python experiments/run_adaptive_clipping.py [--smoke | --fresh-seeds | --fresh-hindsight | --client-level]   (``--smoke``: epsilon 3, one seed, two
fixed clips, 2 rounds; not a measurement)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import platform
import sys
import time

import numpy as np
import torch
from scipy import stats

from privfl.algorithms import make_algorithm
from privfl.apps.compare import CompareConfig, RunSpec, _configs, _options, federation
from privfl.runtime.engine import Simulation

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_trajectory_posterior import pool_map  # noqa: E402

OUT = "experiments/results"
CONFIG = "experiments/configs/default.toml"
ALGORITHMS = ("dp_fedsgd", "dpsgd_fedavg")
EPSILONS = (1.0, 3.0, 8.0)
SEEDS = (0, 1, 2)
#: the fixed clips the hindsight choice is made among (the algorithms' default, 1.0, in the middle)
CLIPS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
#: adaptive clipping's settings the validation split chooses among, per algorithm: quantile Q, the clip's step size
#: eta (``clip_lr``: DP-FedSGD's per-round step of Andrew et al.'s rule over 410 rounds; DP-SGD FedAvg's fraction of
#: the way to the estimated quantile over its 10 rounds, at most 1) and the count's share of the budget
#: (``clip_share``); the defaults (0.5, 0.2, 0.01) also reported
ADAPTIVE = {"dp_fedsgd": {"quantile": (0.1, 0.3, 0.5, 0.7, 0.9), "clip_lr": (0.2, 0.05), "clip_share": (0.01, 0.1)},
            "dpsgd_fedavg": {"quantile": (0.1, 0.2, 0.3, 0.5, 0.7, 0.9), "clip_lr": (0.2, 0.5, 1.0),
                             "clip_share": (0.01, 0.1)}}
DEFAULT = (0.5, 0.2, 0.01)
METRICS = ("accuracy", "nll", "ece")
#: seeds the choices never saw (``--fresh-seeds``): 40, so that the paired difference's interval is narrower than the
#: margin below (10 seeds gave a standard error of 0.0065 for DP-SGD FedAvg at epsilon 3)
FRESH_SEEDS = tuple(range(3, 43))
#: the verdict's margin, fixed before the 40-seed run: adaptive *matches* the hindsight clip when the 95 % t-interval
#: of the paired accuracy difference (adaptive - fixed) lies above -MATCH_MARGIN (one accuracy point, the margin of
#: issue 27's "within 1 point"), and *beats* it when the interval lies above 0
MATCH_MARGIN = 0.01


def run(job) -> dict:
    """One seeded run of ``algorithm`` on the default comparison's setting: at a fixed clip, or adaptive with
    ``adaptive`` = (quantile, clip_lr, clip_share); evaluated on the test split, or on the validation split
    (``split="val"``)."""
    algorithm, epsilon, seed, clip, adaptive, rounds, split = job
    quantile = None if adaptive is None else adaptive[0]
    torch.set_num_threads(1)
    config = CompareConfig.from_toml(CONFIG)
    spec = RunSpec(algorithm, epsilon, seed)
    fed, privacy = _configs(config, spec)
    if rounds is not None:
        fed = dataclasses.replace(fed, rounds=rounds)
    privacy = dataclasses.replace(privacy, secure_noise=False, **(
        {"clip": clip} if adaptive is None else dict(zip(("clip_quantile", "clip_lr", "clip_share"), adaptive))))
    data = federation(config, seed)
    alg = make_algorithm(algorithm, fed, privacy, **_options(config, algorithm))
    start = time.perf_counter()
    sim = Simulation(alg, data, fed, privacy)
    result = sim.run()
    out = alg.evaluate(data.val if split == "val" else data.test)
    path = [r.clip for r in result.history if r.clip is not None]
    return {"algorithm": algorithm, "epsilon": epsilon, "seed": seed, "split": split,
            "clip": "adaptive" if quantile is not None else clip, "adaptive": adaptive,
            **{m: float(out[m]) for m in METRICS}, "epsilon_spent": float(result.audit["max_epsilon"]),
            "charged_channels": sorted({c.channel for k in range(sim.public.n_clients)
                                        for c in sim.ledger.charges(str(k))}),
            "clip_path": path, "rounds": fed.rounds, "seconds": time.perf_counter() - start}


def _label_of(adaptive) -> str:
    return "adaptive Q {:g}, eta {:g}, share {:g}".format(*adaptive)


def _label(r: dict) -> str:
    return f"{r['clip']:g}" if r["adaptive"] is None else _label_of(r["adaptive"])


def summary(rows: list[dict], chosen: dict, algorithms=ALGORITHMS) -> list[dict]:
    out = []
    for name in algorithms:
        for eps in sorted({r["epsilon"] for r in rows if r["algorithm"] == name}):
            at = [r for r in rows if r["algorithm"] == name and r["epsilon"] == eps and r["split"] == "test"]
            cells = {}
            for label in sorted({_label(r) for r in at}, key=lambda x: (x.startswith("adaptive"), x)):
                rs = [r for r in at if _label(r) == label]
                cell = {m: (float(np.mean([r[m] for r in rs])), float(np.std([r[m] for r in rs]))) for m in METRICS}
                cell["epsilon_spent"] = max(r["epsilon_spent"] for r in rs)
                cell["channels"] = rs[0]["charged_channels"]
                if label.startswith("adaptive"):
                    paths = [r["clip_path"] for r in rs]
                    cell["clip"] = [float(np.mean([p[0] for p in paths])),
                                    float(np.mean([np.median(p) for p in paths])),
                                    float(np.mean([p[-1] for p in paths]))]
                cells[label] = cell
            fixed = [k for k in cells if not k.startswith("adaptive")]
            best = max(fixed, key=lambda k: cells[k]["accuracy"][0])
            tuned = _label_of(chosen[name])
            out.append({"algorithm": name, "epsilon": eps, "cells": cells, "best_fixed": best, "chosen": tuned,
                        "adaptive_minus_best": cells[tuned]["accuracy"][0] - cells[best]["accuracy"][0],
                        "default_minus_best": cells[_label_of(DEFAULT)]["accuracy"][0] - cells[best]["accuracy"][0]})
    return out


def markdown(table: list[dict], validation: list[dict], chosen: dict, smoke: bool) -> str:
    lines = ["# Adaptive clipping against the best fixed clip in hindsight (issue 29)", "",
             "The default comparison's setting (`experiments/configs/default.toml`: MNIST-5k, 10 clients, Dirichlet "
             "0.1, record level, delta 1e-5; DP-FedSGD with central noise, 410 rounds of lot 256; DP-SGD FedAvg with "
             "local noise, 10 rounds of 3 local epochs). Fixed clips: each of "
             f"{list(CLIPS)} at every seed, the best picked in hindsight by mean test accuracy. Adaptive: the clip "
             "starts at 1.0 and follows the Q-quantile of the records' gradient norms (Andrew et al.; DP-FedSGD one "
             "clip from a count released on the lot with 1 % of the budget and charged in every ledger; DP-SGD FedAvg "
             "one clip per round, broadcast, moved eta of the way (in log space) to the quantile that the clients' "
             "noisy counts at nine thresholds estimate, the counts drawn inside their DP-SGD steps' events): at "
             "privfl's defaults (Q 0.5, eta 0.2, share 0.01; untuned), and with Q, eta and share chosen over "
             + "; ".join(f"{name}: " + ", ".join(f"{k} {list(v)}" for k, v in grid.items())
                         for name, grid in ADAPTIVE.items())
             + " on the comparison's validation split at epsilon 3, seed 0 (validation accuracy in the JSON; chosen: "
             + ", ".join(f"{k}: {_label_of(v)}" for k, v in chosen.items()) + "). Mean +- std over seeds "
             f"{list(SEEDS[:1] if smoke else SEEDS)} on the test split. "
             "`python experiments/run_adaptive_clipping.py`" + (" --smoke (NOT a measurement)" if smoke else "") + ".",
             ""] + _table_lines(table)
    return "\n".join(lines)


def _table_lines(table: list[dict]) -> list[str]:
    """The rows of :func:`summary` as a markdown table, then the adaptive-minus-best line."""
    lines = ["| algorithm | epsilon | clip | accuracy | NLL | ECE | adaptive clip | channels charged | "
             "max epsilon spent |", "|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        for label, c in t["cells"].items():
            mark = " (best fixed)" if label == t["best_fixed"] else " (chosen)" if label == t["chosen"] else ""
            clip = "" if "clip" not in c else " / ".join(f"{v:.3g}" for v in c["clip"])
            lines.append(f"| {t['algorithm']} | {t['epsilon']:g} | {label}{mark} | "
                         + " | ".join(f"{c[m][0]:.4f} ± {c[m][1]:.4f}" for m in METRICS)
                         + f" | {clip} | {', '.join(c['channels'])} | {c['epsilon_spent']:.3f} |")
    lines += ["", "Adaptive clip column: the clip at the first, median and last round (mean over seeds).", "",
              "Adaptive (Q chosen on validation) minus the best fixed clip, mean test accuracy: "
              + "; ".join(f"{t['algorithm']} epsilon {t['epsilon']:g}: {t['adaptive_minus_best']:+.4f} (defaults "
                          f"{t['default_minus_best']:+.4f}; best fixed C = {t['best_fixed']})" for t in table)
              + ".", ""]
    return lines


#: client level (``--client-level``): DP-FedAvg's fixed clips around its default 0.1, and the adaptive settings the
#: validation split chooses among (as ``ADAPTIVE``)
CLIENT_CLIPS = (0.025, 0.05, 0.1, 0.2, 0.4, 1.0)
CLIENT_ADAPTIVE = {"quantile": (0.1, 0.3, 0.5, 0.7, 0.9), "clip_lr": (0.2, 0.5), "clip_share": (0.01, 0.1)}


def client_level(smoke: bool = False) -> int:
    """DP-FedAvg (client level, Andrew et al.'s own algorithm) on the default comparison's setting as ``make demo``
    runs it (15 rounds, logistic regression on 2x2-pooled images, clip 0.1): fixed clips ``CLIENT_CLIPS`` against
    adaptive clipping at the defaults and as chosen on validation (epsilon 3, seed 0) over ``CLIENT_ADAPTIVE``,
    seeds 0-2 at epsilon 1, 3, 8. Writes ``adaptive_clipping_client.{json,md}``."""
    name = "dp_fedavg"
    epsilons, seeds, clips = ((3.0,), SEEDS[:1], CLIENT_CLIPS[2:4]) if smoke else (EPSILONS, SEEDS, CLIENT_CLIPS)
    points = [tuple(p) for p in itertools.product(*CLIENT_ADAPTIVE.values())][:2 if smoke else None]
    rounds = 2 if smoke else None
    start = time.perf_counter()
    validation = pool_map(run, [(name, 3.0, 0, None, p, rounds, "val") for p in points], smoke)
    chosen = {name: tuple(max(validation, key=lambda v: v["accuracy"])["adaptive"])}
    jobs = [(name, eps, seed, clip, None, rounds, "test") for eps in epsilons for seed in seeds for clip in clips]
    jobs += [(name, eps, seed, None, p, rounds, "test") for eps in epsilons for seed in seeds
             for p in sorted({DEFAULT, chosen[name]})]
    rows = pool_map(run, jobs, smoke)
    table = summary(rows, chosen, (name,))
    lines = ["# Adaptive clipping at client level against the best fixed clip in hindsight (issue 29)", "",
             "DP-FedAvg as the default comparison runs it (`experiments/configs/default.toml`: MNIST-5k, 10 clients, "
             "Dirichlet 0.1, client level, delta 1e-5, local noise, 15 rounds, logistic regression on 2x2-pooled "
             f"images). Fixed clips: each of {list(CLIENT_CLIPS)} at every seed, the best picked in hindsight by mean "
             "test accuracy. Adaptive (Andrew et al.'s client-level algorithm): the clip starts at the default 0.1; "
             "each client sends its change over the round's clip and its bit [norm <= C_t] - 1/2 on a channel of its "
             "own, charged in every ledger; the server steps the clip on the noisy count over the expected "
             "participants. At privfl's defaults (Q 0.5, eta 0.2, share 0.01) and with Q, eta and share chosen over "
             + ", ".join(f"{k} {list(v)}" for k, v in CLIENT_ADAPTIVE.items())
             + f" on the comparison's validation split at epsilon 3, seed 0 (chosen: {_label_of(chosen[name])}). "
             f"Mean +- std over seeds {list(seeds)} on the test split. "
             "`python experiments/run_adaptive_clipping.py --client-level`"
             + (" --smoke (NOT a measurement)" if smoke else "") + ".", ""] + _table_lines(table)
    text = "\n".join(lines)
    if not smoke:
        _write("adaptive_clipping_client", {"rows": rows, "validation": validation, "chosen": chosen,
                                            "summary": table, "clips": list(CLIENT_CLIPS),
                                            "adaptive_grid": CLIENT_ADAPTIVE}, text, start)
    print(text)
    return 0


def _fresh_run(job) -> dict:
    """:func:`run`, or the refusal's text when privfl refuses the seed's federation (a client too small for the
    schedule: nothing is charged)."""
    from privfl.errors import ConfigurationError

    try:
        return run(job)
    except ConfigurationError as exc:
        return {"algorithm": job[0], "epsilon": job[1], "seed": job[2], "refused": str(exc).split(":")[0]}


def fresh_seeds(smoke: bool = False) -> int:
    """Both choices of the committed comparison (``adaptive_clipping.json``) on :data:`FRESH_SEEDS`, paired by
    seed (module docstring)."""
    with open(os.path.join(OUT, "adaptive_clipping.json")) as f:
        committed = json.load(f)
    seeds = FRESH_SEEDS[:1] if smoke else FRESH_SEEDS
    epsilons = (3.0,) if smoke else EPSILONS
    rounds = 2 if smoke else None
    best = {(t["algorithm"], t["epsilon"]): float(t["best_fixed"]) for t in committed["summary"]}
    chosen = {name: tuple(v) for name, v in committed["chosen"].items()}
    start = time.perf_counter()
    jobs = [(name, eps, seed, clip, adaptive, rounds, "test") for name in ALGORITHMS for eps in epsilons
            for seed in seeds for clip, adaptive in ((best[name, eps], None), (None, chosen[name]))]
    rows = pool_map(_fresh_run, jobs, smoke)
    table = []
    for name in ALGORITHMS:
        for eps in epsilons:
            at = [r for r in rows if r["algorithm"] == name and r["epsilon"] == eps and "refused" not in r]
            fixed = {r["seed"]: r["accuracy"] for r in at if r["adaptive"] is None}
            adapt = {r["seed"]: r["accuracy"] for r in at if r["adaptive"] is not None}
            paired = _paired(adapt, fixed)
            table.append({"algorithm": name, "epsilon": eps, "fixed_clip": best[name, eps],
                          "adaptive": list(chosen[name]),
                          "fixed_accuracy": float(np.mean([fixed[k] for k in paired["seeds"]])),
                          "adaptive_accuracy": float(np.mean([adapt[k] for k in paired["seeds"]])), **paired})
    text = fresh_markdown(table, rows, seeds, smoke)
    if not smoke:
        _write("adaptive_clipping_fresh", {"rows": rows, "summary": table, "seeds": list(seeds)}, text, start)
    print(text)
    return 0


def _write(stem: str, payload: dict, text: str, start: float) -> None:
    """``OUT/<stem>.json`` (``payload`` with the wall time and machine; every run's clip path at four significant
    digits, 410 rounds' worth per DP-FedSGD run; compact) and ``OUT/<stem>.md`` (``text``)."""
    for r in payload.get("rows", []) + payload.get("validation", []):
        if "clip_path" in r:
            r["clip_path"] = [float(f"{c:.4g}") for c in r["clip_path"]]
    payload = {**payload, "wall_s": time.perf_counter() - start, "machine": platform.machine(),
               "python": platform.python_version()}
    with open(os.path.join(OUT, f"{stem}.json"), "w") as f:
        json.dump(payload, f, separators=(",", ":"))
    with open(os.path.join(OUT, f"{stem}.md"), "w") as f:
        f.write(text)


def fresh_markdown(table: list[dict], rows: list[dict], seeds, smoke: bool) -> str:
    refused = sorted({(r["algorithm"], r["seed"], r["refused"]) for r in rows if "refused" in r})
    lines = ["# Adaptive clipping against the hindsight clip on seeds neither choice saw (issue 29)", "",
             "`adaptive_clipping.md`'s two choices, unchanged: the adaptive setting chosen on validation and the "
             "fixed clip picked in hindsight by mean test accuracy over seeds 0-2 (the best of "
             f"{list(CLIPS)}), each run on seeds {list(seeds)}, which neither choice saw, and compared seed by seed "
             "(the same federation and split). Paired difference of test accuracy, adaptive minus fixed, mean +- "
             "standard error over the seeds, and its 95 % t-interval. Verdict (rule fixed before the run): adaptive "
             f"*matches* the hindsight clip when the interval lies above -{MATCH_MARGIN:g} (one accuracy point), "
             "*beats* it when the interval lies above 0, else the match is *not shown*. "
             "`python experiments/run_adaptive_clipping.py --fresh-seeds`"
             + (" --smoke (NOT a measurement)" if smoke else "") + ".", "",
             "| algorithm | epsilon | fixed clip (hindsight) | adaptive (chosen) | seeds | fixed | adaptive | "
             "adaptive - fixed | 95 % interval | adaptive ahead | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['algorithm']} | {t['epsilon']:g} | {t['fixed_clip']:g} | {_label_of(t['adaptive'])} | "
                     f"{len(t['seeds'])} | {t['fixed_accuracy']:.4f} | {t['adaptive_accuracy']:.4f} | "
                     f"{t['difference']:+.4f} ± {t['standard_error']:.4f} | [{t['interval_95'][0]:+.4f}, "
                     f"{t['interval_95'][1]:+.4f}] | {t['adaptive_ahead']} of {len(t['seeds'])} | {t['verdict']} |")
    if refused:
        lines += ["", "Seeds privfl refused (a client too small for the schedule; nothing charged): "
                  + "; ".join(f"{a} seed {s}: {why}" for a, s, why in refused) + "."]
    return "\n".join(lines) + "\n"


def _paired(adapt: dict, fixed: dict) -> dict:
    """Adaptive minus fixed accuracy over the seeds both have: mean, standard error, 95 % t-interval, verdict
    (``MATCH_MARGIN``), seeds ahead."""
    paired = sorted(set(fixed) & set(adapt))
    d = np.array([adapt[k] - fixed[k] for k in paired])
    se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
    half = float(stats.t.ppf(0.975, len(d) - 1) * se) if len(d) > 1 else float("nan")
    low, high = float(d.mean()) - half, float(d.mean()) + half
    return {"seeds": paired, "difference": float(d.mean()), "standard_error": se, "interval_95": [low, high],
            "verdict": "beats" if low > 0 else "matches" if low > -MATCH_MARGIN else "not shown",
            "adaptive_ahead": int((d > 0).sum())}


def fresh_hindsight(smoke: bool = False) -> int:
    """The stricter comparison at epsilon 3: every fixed clip of ``CLIPS`` on the fresh seeds, the best one picked in
    hindsight *on those seeds* (its selection bias now in the fixed clip's favour), against the adaptive runs of
    ``adaptive_clipping_fresh.json`` (the same seeds' runs, not rerun). Writes
    ``adaptive_clipping_fresh_hindsight.{json,md}``."""
    with open(os.path.join(OUT, "adaptive_clipping_fresh.json")) as f:
        fresh = json.load(f)
    seeds = fresh["seeds"][:1] if smoke else fresh["seeds"]
    rounds = 2 if smoke else None
    done = [r for r in fresh["rows"] if r["epsilon"] == 3.0 and "refused" not in r and r["seed"] in seeds]
    start = time.perf_counter()
    jobs = [(name, 3.0, seed, clip, None, rounds, "test") for name in ALGORITHMS for seed in seeds for clip in CLIPS
            if not any(r["algorithm"] == name and r["seed"] == seed and r["adaptive"] is None and r["clip"] == clip
                       for r in done)]
    rows = [r for r in pool_map(_fresh_run, jobs, smoke) if "refused" not in r] + done
    table = []
    for name in ALGORITHMS:
        mine = [r for r in rows if r["algorithm"] == name]
        adapt = {r["seed"]: r["accuracy"] for r in mine if r["adaptive"] is not None}
        by_clip = {c: {r["seed"]: r["accuracy"] for r in mine if r["adaptive"] is None and r["clip"] == c}
                   for c in CLIPS}
        means = {c: float(np.mean([v[k] for k in adapt if k in v])) for c, v in by_clip.items() if v}
        best = max(means, key=means.get)
        table.append({"algorithm": name, "epsilon": 3.0, "fixed_means": {f"{c:g}": m for c, m in means.items()},
                      "best_fixed": best, "adaptive": fresh_choice(fresh, name),
                      "adaptive_accuracy": float(np.mean(list(adapt.values()))),
                      **_paired(adapt, by_clip[best])})
    lines = ["# Adaptive clipping against the best fixed clip picked in hindsight on the fresh seeds themselves "
             "(issue 29)", "",
             f"Epsilon 3. Every fixed clip of {list(CLIPS)} run on the fresh seeds of `adaptive_clipping_fresh.md`; "
             "the best by mean test accuracy *on those seeds* is the hindsight clip (the best of six on the seeds it "
             "is scored on: the selection bias now favours the fixed clip), against the adaptive runs already in "
             "`adaptive_clipping_fresh.json` (same seeds, not rerun). Paired difference, adaptive minus that clip; "
             f"verdict as there (matches: 95 % t-interval above -{MATCH_MARGIN:g}; beats: above 0). "
             "`python experiments/run_adaptive_clipping.py --fresh-hindsight`"
             + (" --smoke (NOT a measurement)" if smoke else "") + ".", "",
             "| algorithm | mean accuracy per fixed clip | best in hindsight | adaptive | adaptive - best | "
             "95 % interval | adaptive ahead | verdict |", "|---|---|---|---|---|---|---|---|"]
    for t in table:
        per = ", ".join(f"{c}: {m:.4f}" for c, m in t["fixed_means"].items())
        lines.append(f"| {t['algorithm']} ({len(t['seeds'])} seeds) | {per} | {t['best_fixed']:g} | "
                     f"{t['adaptive_accuracy']:.4f} | {t['difference']:+.4f} ± {t['standard_error']:.4f} | "
                     f"[{t['interval_95'][0]:+.4f}, {t['interval_95'][1]:+.4f}] | {t['adaptive_ahead']} of "
                     f"{len(t['seeds'])} | {t['verdict']} |")
    text = "\n".join(lines) + "\n"
    if not smoke:
        _write("adaptive_clipping_fresh_hindsight", {"rows": [r for r in rows if r not in done], "summary": table,
                                                     "seeds": list(seeds)}, text, start)
    print(text)
    return 0


def fresh_choice(fresh: dict, name: str) -> list:
    """The adaptive setting the fresh-seed table ran for ``name``."""
    return next(t["adaptive"] for t in fresh["summary"] if t["algorithm"] == name)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    smoke = "--smoke" in argv
    if "--fresh-seeds" in argv:
        return fresh_seeds(smoke)
    if "--fresh-hindsight" in argv:
        return fresh_hindsight(smoke)
    if "--client-level" in argv:
        return client_level(smoke)
    epsilons, seeds, clips = ((3.0,), SEEDS[:1], CLIPS[2:4]) if smoke else (EPSILONS, SEEDS, CLIPS)
    points = {name: [tuple(p) for p in itertools.product(*ADAPTIVE[name].values())][:2 if smoke else None]
              for name in ALGORITHMS}
    rounds = 2 if smoke else None
    start = time.perf_counter()
    validation = pool_map(run, [(name, 3.0, 0, None, p, rounds, "val") for name in ALGORITHMS for p in points[name]],
                          smoke)
    chosen = {name: tuple(max((v for v in validation if v["algorithm"] == name),
                              key=lambda v: v["accuracy"])["adaptive"]) for name in ALGORITHMS}
    jobs = [(name, eps, seed, clip, None, rounds, "test") for name in ALGORITHMS for eps in epsilons
            for seed in seeds for clip in clips]
    jobs += [(name, eps, seed, None, p, rounds, "test") for name in ALGORITHMS for eps in epsilons for seed in seeds
             for p in sorted({DEFAULT, chosen[name]})]
    rows = pool_map(run, jobs, smoke)
    for r in rows:
        print(f"{r['algorithm']} eps={r['epsilon']:g} seed={r['seed']} {_label(r)}: acc {r['accuracy']:.4f} "
              f"spent {r['epsilon_spent']:.3f} ({r['seconds']:.1f} s)", file=sys.stderr, flush=True)
    table = summary(rows, chosen)
    text = markdown(table, validation, chosen, smoke)
    if not smoke:
        _write("adaptive_clipping", {"rows": rows, "validation": validation, "chosen": chosen, "summary": table,
                                     "clips": list(CLIPS), "adaptive_grid": ADAPTIVE}, text, start)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
