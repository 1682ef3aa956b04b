"""A rare class under DP (issue 28): scikit-learn's digits as "3 or not", the 3s subsampled to 4 % of the records (the
bank data set of the issue had 3.9 % positives; ``RARE_DIGIT=8`` and ``RARE_SHARE`` pick another digit and share),
federated over 6 organisations, record level, epsilon = 3, delta = 1e-5.

Per seed the positives are subsampled (about 67 of 1,686 images) and the images split once: 20 % test, 20 % of the rest validation, the remaining training records dealt to 6
organisations in unequal shares (Dirichlet 1.0 over the organisations, every organisation's share at least 60
records). Every method trains an MLP (64 -> 32 -> 2) through ``privfl.federate`` for ``ROUNDS`` rounds:

- ``fedavg`` and ``fedavg_weighted``: FedAvg without DP, plain and with a class-weighted loss (the reference the issue
  names: the non-private class-weighted federated model);
- ``dpsgd_fedavg`` and ``dpsgd_fedavg_weighted``: DP-SGD FedAvg at epsilon = 3 (local noise), plain and with the
  class-weighted loss, which privfl turns into class-weighted sampling (``record_level.class_sampling_rates``);
- ``dp_fedsgd`` and ``dp_fedsgd_weighted``: DP-FedSGD at epsilon = 3 (central noise, paid once), one step per round
  (``FEDSGD_ROUNDS`` rounds, a federation-wide lot in ``LOTS``), plain and with ``class_weights``.

Every method is also reported as ``<method>+prior``: the same trained models deciding by the prior-corrected rule
(``privfl.federate(..., class_prior=...)``, ``privfl.metrics.decision.PriorCorrection``: predict argmax_y p(y|x) *
r_y, with r_y proportional to 1 / (pi_y w_y) for the run's class weights w), pure post-processing at no privacy
cost. The prior pi = (1 - ``SHARE``, ``SHARE``) is the base rate the experiment builds in by design (the share it
subsamples the positives to), a public fact, never counted from the organisations' labels or the test split.

Settings are chosen per method and per decision rule on the validation split (mean balanced accuracy over the seeds,
of the 0.5 rule for ``<method>``, of the corrected rule for ``<method>+prior``; the test split plays no part): the learning rate in ``LRS`` (DP-FedSGD: ``FEDSGD_LRS``), the batch in ``BATCHES`` (DP-FedSGD: the lot in
``LOTS``; a weighted run samples the majority less, so it may want a larger one) and, for the weighted methods, the
positive class's weight ratio in ``RATIOS``
(the negative class weighs ``1 / ratio``; a public choice, made before the run, never from the organisations'
label counts). The chosen settings are then reported on the test split: balanced accuracy, recall and
predicted-positive rate of the 0.5 rule, AUROC, average precision and the largest epsilon spent.

Writes ``experiments/results/rare_class.json`` (every run) and ``experiments/results/rare_class.md`` (the table;
``--out`` elsewhere). The best private method is the one (``+prior`` variants included) with the best validation
balanced accuracy; the goal compares it with the non-private class-weighted FedAvg under the 0.5 rule, the reference
the issue names (the gap to that reference's own ``+prior`` row is reported too).
Usage: ``python experiments/run_rare_class.py [--seeds 3] [--rounds 15] [--out experiments/results]``; ``--smoke``
runs one seed, one setting each and two rounds (seconds; not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import privfl
from privfl.metrics.classification import binary_metrics, classification_metrics

EPSILON, DELTA = 3.0, 1e-5
ORGS = 6
ROUNDS = 15
FEDSGD_ROUNDS = 300
LOTS = (128, 512, 1024)  # DP-FedSGD's expected lot over the federation
LRS = (0.1, 0.3, 1.0)
FEDSGD_LRS = (1.0, 2.0, 4.0)  # the server's step size
RATIOS = (3.0, 9.0, 24.0)  # 24: about the inverse base rate
BATCHES = (16, 64)  # DP-SGD FedAvg's local batch (FedAvg: the first)
CLIENT_SIZE = 250  # the public design size: an upper bound the organisations agree on, not their record counts


POSITIVE = int(os.environ.get("RARE_DIGIT", "3"))
SHARE = float(os.environ.get("RARE_SHARE", "0.04"))


def split(seed: int):
    """(organisations' (X, y) pairs, validation (X, y), test (X, y)) for one seed."""
    x, digit = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)  # pixel intensities 0..16: a public scale, nothing read from the data
    y = (digit == POSITIVE).astype(np.int64)
    rng = np.random.default_rng(seed)
    positives, negatives = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
    keep = int(round(SHARE / (1 - SHARE) * len(negatives)))  # the positives subsampled to SHARE of the records
    chosen = np.concatenate([negatives, rng.choice(positives, size=keep, replace=False)])
    x, y = x[chosen], y[chosen]
    order = rng.permutation(len(y))
    n_test = len(y) // 5
    test, rest = order[:n_test], order[n_test:]
    n_val = len(rest) // 5
    val, train = rest[:n_val], rest[n_val:]
    while True:
        shares = rng.dirichlet(np.ones(ORGS))
        counts = np.floor(shares * len(train)).astype(int)
        counts[-1] = len(train) - counts[:-1].sum()
        if counts.min() >= 60 and counts.max() <= CLIENT_SIZE:
            break
    cuts = np.cumsum(counts)[:-1]
    orgs = [(x[idx], y[idx]) for idx in np.split(train, cuts)]
    return orgs, (x[val], y[val]), (x[test], y[test])


def model_factory(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2))


#: the class prior every run declares: the base rate the split builds in by design (a public fact)
def class_prior() -> list[float]:
    return [1.0 - SHARE, SHARE]


#: the metrics of the prior-corrected rule, reported as ``prior_<name>`` (AUROC, AP, NLL, ECE are the model's)
PRIOR_KEYS = ("balanced_accuracy", "accuracy", "recall", "positive_rate")


def evaluate(model: nn.Module, data, decision) -> dict:
    """The 0.5 rule's metrics of ``model`` on ``data``, and ``prior_<name>`` those of the run's prior-corrected rule
    (``decision``, from ``privfl.federate``)."""
    with torch.no_grad():
        proba = torch.softmax(model(torch.as_tensor(data[0])), dim=1).numpy()
    out = classification_metrics(proba, data[1])
    out.update(binary_metrics(proba, data[1]))
    out = {k: out[k] for k in ("balanced_accuracy", "auroc", "accuracy", "recall", "positive_rate",
                               "average_precision", "nll", "ece")}
    corrected = decision.metrics(proba, data[1])
    out.update({f"prior_{k}": corrected[k] for k in PRIOR_KEYS})
    return out


def run(method: str, lr: float, ratio: float | None, batch: int, seed: int, rounds: int) -> dict:
    orgs, val, test = split(seed)
    algorithm = METHODS[method][0]
    private = algorithm != "fedavg"
    weights = None if ratio is None else (1.0 / ratio, 1.0)
    if algorithm == "dp_fedsgd":
        options = {"class_weights": weights} if weights else {}
        options.update(batch_size=batch)
        rounds = rounds * FEDSGD_ROUNDS // ROUNDS
    else:
        loss = nn.CrossEntropyLoss(weight=torch.tensor(weights)) if weights else nn.CrossEntropyLoss()
        options = {"loss": loss, "batch_size": batch, "local_epochs": 1}
    clients = {f"org{k}": part for k, part in enumerate(orgs)}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = privfl.federate(model_factory(seed), clients, algorithm=algorithm,
                                 epsilon=EPSILON if private else None, delta=DELTA, rounds=rounds, test=val,
                                 lr=lr, seed=seed, client_size=CLIENT_SIZE if private else None,
                                 class_prior=class_prior(), **options)
    spent = max((a["epsilon"] for a in result.audit.values()), default=0.0)
    return {"method": method, "lr": lr, "ratio": ratio, "batch": batch, "seed": seed, "rounds": rounds,
            "seconds": time.perf_counter() - start, "epsilon_spent": spent,
            "decision": result.decision.describe(),
            "validation": evaluate(result.model, val, result.decision),
            "test": evaluate(result.model, test, result.decision)}


def rule_view(metrics: dict, prior: bool) -> dict:
    """``metrics`` as one decision rule reports them: the 0.5 rule's, or (``prior``) the prior-corrected rule's in
    place of the decision metrics (AUROC, average precision, NLL and ECE are the model's under both)."""
    out = {k: v for k, v in metrics.items() if not k.startswith("prior_")}
    if prior:
        out.update({k: metrics[f"prior_{k}"] for k in PRIOR_KEYS})
    return out


#: method -> (algorithm, weighted)
METHODS = {"fedavg": ("fedavg", False), "fedavg_weighted": ("fedavg", True),
           "dpsgd_fedavg": ("dpsgd_fedavg", False), "dpsgd_fedavg_weighted": ("dpsgd_fedavg", True),
           "dp_fedsgd": ("dp_fedsgd", False), "dp_fedsgd_weighted": ("dp_fedsgd", True)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--smoke", action="store_true", help="one seed, one setting, two rounds (not a measurement)")
    args = parser.parse_args(argv)
    seeds = [0] if args.smoke else list(range(args.seeds))
    rounds = 2 if args.smoke else args.rounds
    ratios = RATIOS[:1] if args.smoke else RATIOS
    rows = []
    for method, (algorithm, weighted) in METHODS.items():
        grid = FEDSGD_LRS if algorithm == "dp_fedsgd" else LRS
        sizes = LOTS if algorithm == "dp_fedsgd" else BATCHES if algorithm == "dpsgd_fedavg" else BATCHES[:1]
        for lr in (grid[:1] if args.smoke else grid):
            for ratio in (ratios if weighted else (None,)):
                for batch in (sizes[:1] if args.smoke else sizes):
                    for seed in seeds:
                        row = run(method, lr, ratio, batch, seed, rounds)
                        rows.append(row)
                        print(f"{method} lr={lr} ratio={ratio} batch={batch} seed={seed}: validation balanced accuracy "
                              f"{row['validation']['balanced_accuracy']:.3f} (+prior "
                              f"{row['validation']['prior_balanced_accuracy']:.3f}), eps {row['epsilon_spent']:.3f}, "
                              f"{row['seconds']:.1f}s", flush=True)
    chosen = {}
    for method in METHODS:
        for variant, prior in ((method, False), (f"{method}+prior", True)):
            settings = {(r["lr"], r["ratio"], r["batch"]) for r in rows if r["method"] == method}
            best = max(sorted(settings, key=str), key=lambda s: np.mean([
                rule_view(r["validation"], prior)["balanced_accuracy"] for r in rows
                if r["method"] == method and (r["lr"], r["ratio"], r["batch"]) == s]))
            picked = [r for r in rows if r["method"] == method and (r["lr"], r["ratio"], r["batch"]) == best]
            tests = [rule_view(r["test"], prior) for r in picked]
            chosen[variant] = {"lr": best[0], "ratio": best[1], "batch": best[2], "prior": prior,
                               "validation_balanced_accuracy": float(np.mean([
                                   rule_view(r["validation"], prior)["balanced_accuracy"] for r in picked])),
                               "test_mean": {k: float(np.mean([t[k] for t in tests])) for k in tests[0]},
                               "test_std": {k: float(np.std([t[k] for t in tests])) for k in tests[0]},
                               "epsilon_spent_max": max(r["epsilon_spent"] for r in picked)}
    reference = chosen["fedavg_weighted"]["test_mean"]["balanced_accuracy"]
    # the best private method by validation, +prior variants included (the test split plays no part in the choice)
    private = [m for m in chosen if METHODS[m.split("+")[0]][0] != "fedavg"]
    best_private = max(private, key=lambda m: chosen[m]["validation_balanced_accuracy"])
    best_plain = max((m for m in private if not chosen[m]["prior"]),
                     key=lambda m: chosen[m]["validation_balanced_accuracy"])
    gap = reference - chosen[best_private]["test_mean"]["balanced_accuracy"]
    summary = {"best_private": best_private, "gap_to_weighted_fedavg": gap, "goal": "gap <= 0.05",
               "met": bool(gap <= 0.05),
               "gap_to_weighted_fedavg_prior": (chosen["fedavg_weighted+prior"]["test_mean"]["balanced_accuracy"]
                                                - chosen[best_private]["test_mean"]["balanced_accuracy"]),
               "best_private_without_prior": best_plain,
               "gap_without_prior": reference - chosen[best_plain]["test_mean"]["balanced_accuracy"]}
    print(json.dumps(summary), flush=True)
    if args.smoke:
        return
    os.makedirs(args.out, exist_ok=True)
    meta = {"python": platform.python_version(), "torch": torch.__version__, "seeds": seeds, "rounds": rounds,
            "fedsgd_rounds": rounds * FEDSGD_ROUNDS // ROUNDS, "lots": list(LOTS), "epsilon": EPSILON,
            "delta": DELTA, "orgs": ORGS, "batches": list(BATCHES), "client_size": CLIENT_SIZE, "positive": POSITIVE,
            "share": SHARE, "class_prior": class_prior(), "lrs": list(LRS), "fedsgd_lrs": list(FEDSGD_LRS),
            "ratios": list(RATIOS), "date": time.strftime("%Y-%m-%d")}
    with open(os.path.join(args.out, "rare_class.json"), "w") as f:
        json.dump({"meta": meta, "chosen": chosen, "summary": summary, "runs": rows}, f, indent=1)
    lines = [f"# A rare class under DP: digits, {POSITIVE} or not, the {POSITIVE}s subsampled to {SHARE:.0%} of the "
             f"records, {ORGS} organisations, record level, epsilon = {EPSILON:g}", "",
             f"Mean ± std over {len(seeds)} seeds on the test split; the learning rate (and the positive class's "
             "weight ratio for the weighted rows) chosen per method and decision rule on the validation split. "
             "Balanced accuracy, recall and predicted-positive rate are those of the 0.5 rule, and on the `+prior` "
             "rows those of the same runs' prior-corrected rule (argmax of p(y|x) r_y, r_y proportional to "
             f"1 / (pi_y w_y), with the design base rate pi = {class_prior()} declared as a public fact and the "
             "run's class weights w; post-processing, no privacy cost; AUROC and average precision are the model's "
             "under both rules). `python experiments/run_rare_class.py`, "
             f"{rounds} rounds, batch in {list(BATCHES)} (DP-FedSGD: {meta['fedsgd_rounds']} rounds of one step, "
             f"lot in {list(LOTS)}), "
             f"public design size {CLIENT_SIZE}, {meta['date']}. Best private method chosen on validation.", "",
             "| method | lr | weight ratio | batch / lot | validation balanced accuracy | balanced accuracy | recall | "
             "positive rate | AUROC | average precision | max ε spent |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, c in chosen.items():
        m, s = c["test_mean"], c["test_std"]
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:g}"
        eps = "∞ (no DP)" if METHODS[method.split("+")[0]][0] == "fedavg" else f"{c['epsilon_spent_max']:.3f}"
        lines.append(f"| {method} | {c['lr']:g} | {ratio} | {c['batch']} | {c['validation_balanced_accuracy']:.3f} | "
                     f"{m['balanced_accuracy']:.3f} ± {s['balanced_accuracy']:.3f}"
                     f" | {m['recall']:.3f} | {m['positive_rate']:.3f} | {m['auroc']:.3f} | "
                     f"{m['average_precision']:.3f} | {eps} |")
    lines += ["", f"Best private method: {best_private}, {gap * 100:.1f} points of balanced accuracy below the "
              f"non-private class-weighted FedAvg (goal: within 5 points): {'met' if summary['met'] else 'missed'}. "
              f"Below that reference's own +prior row: {summary['gap_to_weighted_fedavg_prior'] * 100:.1f} points. "
              f"Without the prior-corrected variants the best private method would be "
              f"{summary['best_private_without_prior']}, {summary['gap_without_prior'] * 100:.1f} points below."]
    lines += ["", "Notes:",
              "- The grids were widened twice after seeing a first table (weight ratios {3, 9} -> {3, 9, 24}; "
              "DP-FedSGD's learning rates {0.5, 1, 2} -> {1, 2, 4}, 150 -> 300 rounds, a lot of 128 -> {128, 512, "
              "1024}; DP-SGD FedAvg's batch 16 -> {16, 64}), because the chosen settings sat on the grids' edges; "
              "the choice within each grid is still made on validation only.",
              "- The first data set tried, digits \"0 or not\" at its natural 9.9 %, was too easy to say anything "
              "(every method, private or not, weighted or not, within 2 points of 0.99); 3 and 8 at 4 % are the "
              "harder cases reported (`RARE_DIGIT=8`: `experiments/results/rare_class_digit8/`).",
              "- A class weight under DP-SGD is a sampling rate (`privfl.privacy.record_level.class_sampling_rates`): "
              "the majority is sampled less, so a weighted run sees fewer records per step at the same noise, which "
              "is why it prefers larger lots.",
              "- Validation sets are small (about 270 records, 11 positives), so the choices are noisy, and with "
              "fresh noise in every run two runs of the same grid can choose differently.",
              "- The `+prior` rows train nothing new: they are the same runs deciding by the prior-corrected rule "
              "(`privfl.federate(..., class_prior=...)`), with their settings chosen on that rule's validation "
              "balanced accuracy. The prior is the design share the split subsamples to, a public fact; the "
              "organisations' label counts and the test split play no part in it."]
    with open(os.path.join(args.out, "rare_class.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
