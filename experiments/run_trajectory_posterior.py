"""Issue 27's free lever: DP-FedSGD (noise paid once, central) predicting with a posterior read off its own trajectory
(``dp_fedsgd`` option ``posterior="trajectory"``: the mean and per-coordinate variance of the last rounds' global
iterates, a diagonal SWAG; Bayesian model averaging over draws from it) against the same runs' point estimate.

Setting: the record-level table's (``experiments/run_record_level.py``: MNIST-5k, 10 clients, Dirichlet 0.1, record
level, delta 1e-5, logistic regression on 2x2-pooled images, 30 expected epochs of Poisson lots), with the table's
chosen DP-FedSGD hyper-parameters at each epsilon (``experiments/results/record_level.json``, chosen on its validation
split). The posterior's window (a tenth of the rounds) was chosen on that validation split at epsilon = 3 among a
quarter, a tenth and a twentieth; ``posterior_samples`` 30 and ``posterior_scale`` 1 are the option's defaults. Both
rows of a (epsilon, seed) come from one run with seeded noise: the posterior is post-processing, the releases and
charges are identical (``tests/privfl/algorithms/test_dp_fedsgd.py``), so the difference is the prediction alone.

Reported on the test split, mean +- std over seeds 0-2: accuracy, NLL, ECE and selective accuracy (on the 80 % of test
points the model is most confident about). Writes ``experiments/results/trajectory_posterior.{json,md}``.

Usage: python experiments/run_trajectory_posterior.py [--smoke]   (``--smoke``: one seed, epsilon 3, 20 rounds)
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

import numpy as np
import torch

from privfl.algorithms import make_algorithm
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.runtime.engine import Simulation

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_record_level import DELTA, EPOCHS, EPSILONS, SEEDS, federation  # noqa: E402

OUT = "experiments/results"
METRICS = ("accuracy", "nll", "ece", "selective_accuracy")


def chosen_settings() -> dict[float, dict]:
    with open(os.path.join(OUT, "record_level.json")) as f:
        chosen = json.load(f)["chosen"]
    return {float(c["epsilon"]): c["hyper_parameters"] for c in chosen if c["algorithm"] == "dp_fedsgd"}


def train(data, epsilon: float, seed: int, hp: dict, posterior: str, rounds: int | None = None):
    """One seeded DP-FedSGD run of the record-level table's setting at ``hp``, predicting with ``posterior``:
    ``(algorithm, result, rounds, seconds)``."""
    lot = int(hp["lot_size"])
    n_train = sum(len(p) for p in data.train_parts)
    rounds = rounds or int(round(EPOCHS * n_train / lot))
    fed = FederationConfig(rounds=rounds, batch_size=lot, lr=hp["lr"], momentum=0.9, hidden=(), pool=2, seed=seed)
    privacy = PrivacyConfig(epsilon=epsilon, delta=DELTA, unit="example", clip=hp["clip"], accountant="pld",
                            secure_noise=False)
    alg = make_algorithm("dp_fedsgd", fed, privacy, lot_size=lot, posterior=posterior)
    start = time.perf_counter()
    result = Simulation(alg, data, fed, privacy).run()
    return alg, result, rounds, time.perf_counter() - start


def run(epsilon: float, seed: int, hp: dict, rounds: int | None = None) -> dict:
    """One seeded DP-FedSGD run; its final metrics under the point estimate and under the trajectory posterior."""
    data = federation(seed)
    alg, result, rounds, seconds = train(data, epsilon, seed, hp, "trajectory", rounds)
    posterior = alg.evaluate(data.test)  # with the posterior (the run's own final metrics)
    alg.posterior = "none"  # the same run's point estimate: its last global parameters
    point = alg.evaluate(data.test)
    return {"epsilon": epsilon, "seed": seed, "rounds": rounds, "hyper_parameters": hp,
            "posterior_rounds": alg.posterior_rounds, "epsilon_spent": result.audit["max_epsilon"],
            "point": {k: point[k] for k in METRICS}, "trajectory": {k: posterior[k] for k in METRICS},
            "seconds": seconds}


def metric_cells(rs: list[dict], key: str) -> list[str]:
    """Mean +- std over ``rs`` of each metric of ``r[key]``, as table cells."""
    cells = []
    for m in METRICS:
        v = np.array([r[key][m] for r in rs])
        cells.append(f"{v.mean():.4f} ± {v.std():.4f}")
    return cells


def differences(rows: list[dict], new: str, old: str) -> str:
    """Per epsilon, the mean over seeds of ``r[new] - r[old]`` for each metric, as one sentence's clauses."""
    out = []
    for eps in sorted({r["epsilon"] for r in rows}):
        rs = [r for r in rows if r["epsilon"] == eps]
        d = {m: np.mean([r[new][m] - r[old][m] for r in rs]) for m in METRICS}
        out.append(f"epsilon {eps:g}: accuracy {d['accuracy']:+.4f}, NLL {d['nll']:+.4f}, ECE {d['ece']:+.4f}, "
                   f"selective accuracy {d['selective_accuracy']:+.4f}")
    return "; ".join(out)


def versus_dp_fedsgd(rows: list[dict], *, head: list[str], key: str, labels: tuple[str, str], param: str,
                     param_header: str, param_on: tuple[str, ...], name: str) -> str:
    """A posterior's table against DP-FedSGD's global model, per epsilon: the DP-FedSGD row, the same runs' point model
    (``r[key + "_point"]``, labelled ``labels[0]``) and the posterior (``r[key]``, ``labels[1]``); ``r[param]`` in the
    ``param_header`` column on the rows of ``param_on``; then the posterior's differences from DP-FedSGD. ``head``: the
    title and description lines."""
    lines = [*head, "",
             f"| epsilon | method | {param_header} | accuracy | NLL | ECE | selective accuracy | max epsilon spent |",
             "|---|---|---|---|---|---|---|---|"]
    for eps in sorted({r["epsilon"] for r in rows}):
        rs = [r for r in rows if r["epsilon"] == eps]
        for k, label, spent_key in (("dp_fedsgd", "DP-FedSGD (global model)", "dp_fedsgd"),
                                    (f"{key}_point", labels[0], key), (key, labels[1], key)):
            v = rs[0][param]
            value = (v if isinstance(v, str) else f"{v:g}") if k in param_on else ""
            spent = max(r["epsilon_spent"][spent_key] for r in rs)
            lines.append(f"| {eps:g} | {label} | {value} | " + " | ".join(metric_cells(rs, k)) + f" | {spent:.3f} |")
    lines.append("")
    lines += [f"{name} minus DP-FedSGD (mean over seeds): " + differences(rows, key, "dp_fedsgd") + ".", ""]
    return "\n".join(lines)


def markdown(rows: list[dict], smoke: bool) -> str:
    lines = ["# DP-FedSGD with a posterior read off its trajectory (issue 27's free lever)", "",
             "MNIST-5k, 10 clients, Dirichlet 0.1, record level, delta 1e-5, the record-level table's chosen "
             "DP-FedSGD settings; the posterior: mean and variance of the last tenth of the rounds' global iterates "
             "(window chosen on the table's validation split at epsilon 3), 30 draws averaged. Mean +- std over seeds "
             f"{sorted({r['seed'] for r in rows})} on the test split; both rows of an epsilon are the same runs "
             "(post-processing). `python experiments/run_trajectory_posterior.py`"
             + (" --smoke (NOT a measurement)" if smoke else "") + ".", "",
             "| epsilon | prediction | accuracy | NLL | ECE | selective accuracy | max epsilon spent |",
             "|---|---|---|---|---|---|---|"]
    for eps in sorted({r["epsilon"] for r in rows}):
        rs = [r for r in rows if r["epsilon"] == eps]
        spent = max(r["epsilon_spent"] for r in rs)
        for key, label in (("point", "global model (last iterate)"), ("trajectory", "trajectory posterior")):
            lines.append(f"| {eps:g} | {label} | " + " | ".join(metric_cells(rs, key)) + f" | {spent:.3f} |")
    lines.append("")
    lines += ["Trajectory posterior minus point estimate (mean over seeds): "
              + differences(rows, "trajectory", "point") + ".", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    smoke = "--smoke" in argv
    torch.set_num_threads(1)
    settings = chosen_settings()
    rows = []
    for eps in ((3.0,) if smoke else EPSILONS):
        for seed in ((0,) if smoke else SEEDS):
            row = run(eps, seed, settings[eps], rounds=20 if smoke else None)
            rows.append(row)
            print(f"eps={eps:g} seed={seed}: point {row['point']} trajectory {row['trajectory']} "
                  f"({row['seconds']:.1f} s)", file=sys.stderr, flush=True)
    out = {"rows": rows, "machine": platform.machine(), "python": platform.python_version(), "smoke": smoke}
    return publish("trajectory_posterior", out, markdown(rows, smoke), smoke)


def publish_choice(stem: str, out: dict) -> int:
    """A default's validation choice (``--default-...``): ``out`` written to ``OUT/<stem>.json`` and printed."""
    with open(os.path.join(OUT, f"{stem}.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    return 0


def pool_map(run, jobs: list, smoke: bool) -> list:
    """``run`` over ``jobs``: two at a time (the machine's two cores), or in this process for a smoke run (importable
    from tests)."""
    if smoke:
        return [run(job) for job in jobs]
    from multiprocessing import Pool

    with Pool(2) as pool:
        return pool.map(run, jobs)


def publish(stem: str, out: dict, text: str, smoke: bool) -> int:
    """Print a comparison's table; unless it is a smoke run, also write ``OUT/<stem>.json`` (``out``) and
    ``OUT/<stem>.md`` (``text``). The posterior comparisons' one ending (returns their exit code, 0)."""
    if not smoke:
        with open(os.path.join(OUT, f"{stem}.json"), "w") as f:
            json.dump(out, f, indent=1)
        with open(os.path.join(OUT, f"{stem}.md"), "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
