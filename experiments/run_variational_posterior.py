"""Issue 27, part 2 for HBFL: HBFL's Bayesian meme with its noise paid once, against DP-FedSGD's point estimate.

``dp_fedsgd`` with ``posterior="variational"``: the model is the mean-field Gaussian twin of DP-FedSGD's network
(``BayesLinear``, HBFL's meme), and each round's Poisson lot releases the clipped sum of the ELBO data term's
per-record gradients with respect to the variational parameters (each record at weight noise of its own), noised once
(central here): DP-FedSGD's one channel and event. The server adds the KL term's gradient (temperature 1: the ELBO,
prior N(0, 1)) and steps; it predicts by averaging 30 weight draws from q.

Setting: the record-level table's (``experiments/run_record_level.py``: MNIST-5k, 10 clients, Dirichlet 0.1, record
level, delta 1e-5, logistic regression on 2x2-pooled images, 30 expected epochs of Poisson lots). Every setting of
the variational rows is chosen on the table's validation split (15 % of every client's records held out; the test
split is used once, for the rows below), as the table chose DP-FedSGD's:

1. lot size L, server lr and clip C by validation accuracy, one run (seed 0) per point: the table's full grid
   (``FEDSGD_GRID``) at epsilon 3, its lr grid (``FEDSGD_LR``) at the epsilon-3 choice of L and C at epsilon 1 and 8,
   q starting at ``BayesLinear``'s deviation (softplus(-5) = 0.0067);
2. then q's initial standard deviation (``init_std``) per epsilon among ``INIT_STDS`` by the mean validation NLL over
   seeds 0-2, at the chosen L, lr and C.

The baseline row is DP-FedSGD as the table runs it (its own chosen settings), same seeds. Runs go two at a time (the
machine's two cores, one torch thread each; nothing else running).

Reported on the test split, mean +- std over seeds 0-2: accuracy, NLL, ECE and selective accuracy (on the 80 % of test
points the model is most confident about). Writes ``experiments/results/variational_posterior.{json,md}``.

``--default-init-std``: the default comparison's ``hbfl_noise_once`` row (``experiments/configs/default.toml``) chooses
its initial deviation the same way, on that comparison's own validation split (``val_fraction``, held by no client;
the test set unread) at epsilon = 3, seed 0, among ``INIT_STDS``; writes
``experiments/results/variational_default_init_std.json``.

``--fresh-seeds``: the committed choices of ``variational_posterior.json`` (L, lr, C and q's initial deviation at
epsilon 3) and DP-FedSGD's table settings, unchanged, run on seeds 3-42 (``FRESH_SEEDS``: federations, splits and
noise none of the choices saw) and compared seed by seed, because the three seeds' mean differences above are
smaller than their seed-to-seed spread (selective accuracy: -0.0025 against a std of 0.004-0.007). The rule, fixed
before the run: for each metric, the 95 % t-interval of the paired difference (variational minus DP-FedSGD) decides
*better* (the interval on the better side of 0: higher accuracy and selective accuracy, lower NLL and ECE),
*worse* (on the other side) or *not distinguished*. Writes ``experiments/results/variational_posterior_fresh.{json,md}``.

``--selective-score``: whether the posterior's spread earns a better abstention rule than its mean confidence (the
one metric the rows above do not win). The score ``p_max - k * s``, ``p_max`` the predictive's largest class
probability and ``s`` the standard deviation of that class's probability over q's 30 draws, with ``k`` chosen among
``LCB_KS`` (0 is the usual rule) by mean validation selective accuracy over seeds 0-2 (the validation federations),
then run with the committed epsilon-3 settings on ``FRESH_SEEDS`` against DP-FedSGD's largest class probability,
paired by seed, with the verdict rule of ``--fresh-seeds`` (fixed before the run). Post-processing of q: free of
privacy cost. Writes ``experiments/results/variational_selective_score.{json,md}``.

Usage: python experiments/run_variational_posterior.py [--smoke | --default-init-std | --fresh-seeds | --selective-score]   (``--smoke``: one seed,
epsilon 3, 20 rounds, two grid points and two initial deviations; not a measurement)
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from multiprocessing import Pool

import numpy as np
import torch
from scipy import stats

from privfl.algorithms import make_algorithm
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.runtime.engine import Simulation

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_record_level import (DELTA, EPOCHS, EPSILONS, FEDSGD_GRID, FEDSGD_LR, SEEDS, federation, grid,  # noqa: E402
                              validation_federation)
from run_trajectory_posterior import (METRICS, OUT, chosen_settings, publish, publish_choice, train,  # noqa: E402
                                      versus_dp_fedsgd)

#: seeds none of the committed choices saw (``--fresh-seeds``)
FRESH_SEEDS = tuple(range(3, 43))
#: the direction in which each metric is better (``--fresh-seeds``' verdicts)
BETTER = {"accuracy": 1, "nll": -1, "ece": -1, "selective_accuracy": 1}

#: the multiples of the draws' spread ``--selective-score`` chooses among (0: the predictive's largest probability)
LCB_KS = (0.0, 0.5, 1.0, 2.0, 4.0)

#: q's initial standard deviations the validation split chooses among (0.0067: BayesLinear's default, softplus(-5))
INIT_STDS = (0.0067, 0.02, 0.05, 0.1, 0.2)


def train_variational(data, epsilon: float, seed: int, hp: dict, init_std: float | None,
                      rounds: int | None = None):
    """One seeded run of the table's setting at ``hp`` with the variational posterior: (algorithm, result, rounds,
    seconds)."""
    lot = int(hp["lot_size"])
    rounds = rounds or int(round(EPOCHS * sum(len(p) for p in data.train_parts) / lot))
    fed = FederationConfig(rounds=rounds, batch_size=lot, lr=hp["lr"], momentum=0.9, hidden=(), pool=2, seed=seed)
    privacy = PrivacyConfig(epsilon=epsilon, delta=DELTA, unit="example", clip=hp["clip"], accountant="pld",
                            secure_noise=False)
    alg = make_algorithm("dp_fedsgd", fed, privacy, lot_size=lot, posterior="variational", init_std=init_std)
    start = time.perf_counter()
    result = Simulation(alg, data, fed, privacy).run()
    return alg, result, rounds, time.perf_counter() - start


def evaluate(alg, split) -> dict:
    out = alg.evaluate(split)
    return {k: float(out[k]) for k in METRICS}


def point_metrics(alg, split) -> dict:
    """The same run's mean model (q's means, no draws)."""
    samples = alg.posterior_samples
    scale = alg.posterior_scale
    alg.posterior_scale = 1e-12
    alg.posterior_samples = 2
    try:
        return evaluate(alg, split)
    finally:
        alg.posterior_scale, alg.posterior_samples = scale, samples


def default_init_std() -> dict:
    """The default comparison's initial deviation, on its validation split (module docstring)."""
    from privfl.apps.compare import CompareConfig, RunSpec, _configs, _options, federation as compare_federation

    config = CompareConfig.from_toml("experiments/configs/default.toml")
    spec = RunSpec("hbfl_noise_once", 3.0, 0)
    fed, privacy = _configs(config, spec)
    data = compare_federation(config, spec.seed)
    nll = {}
    for s in INIT_STDS:
        options = {**_options(config, spec.algorithm), "init_std": s}
        alg = make_algorithm(config.base(spec.algorithm), fed, privacy, **options)
        Simulation(alg, data, fed, privacy).run()
        nll[str(s)] = evaluate(alg, data.val)["nll"]
    return {"epsilon": 3.0, "seed": 0, "validation_nll": nll, "chosen": min(INIT_STDS, key=lambda s: nll[str(s)])}


def _validation_run(job) -> dict:
    """One run on seed ``seed``'s validation federation (a worker's job): its validation metrics."""
    epsilon, seed, hp, init_std, rounds = job
    torch.set_num_threads(1)
    val_data = validation_federation(federation(seed))
    alg, _, _, seconds = train_variational(val_data, epsilon, seed, hp, init_std, rounds)
    return {"epsilon": epsilon, "seed": seed, "hyper_parameters": hp, "init_std": init_std,
            "validation": evaluate(alg, val_data.test), "seconds": seconds}


def _final_run(job) -> dict:
    """One seed's test rows (a worker's job): the variational run at its chosen settings and DP-FedSGD at its own."""
    epsilon, seed, hp, init_std, point_hp, rounds = job
    torch.set_num_threads(1)
    data = federation(seed)
    var, res_v, n_rounds, sec_v = train_variational(data, epsilon, seed, hp, init_std, rounds)
    point, res_p, _, sec_p = train(data, epsilon, seed, point_hp, "none", rounds)
    setting = f"L {hp['lot_size']}, lr {hp['lr']:g}, C {hp['clip']:g}, init std {init_std:g}"
    return {"epsilon": epsilon, "seed": seed, "rounds": n_rounds, "hyper_parameters": hp, "init_std": init_std,
            "setting": setting, "dp_fedsgd_hyper_parameters": point_hp,
            "dp_fedsgd": evaluate(point, data.test), "variational": evaluate(var, data.test),
            "variational_point": point_metrics(var, data.test),
            "epsilon_spent": {"dp_fedsgd": res_p.audit["max_epsilon"], "variational": res_v.audit["max_epsilon"]},
            "seconds": {"dp_fedsgd": sec_p, "variational": sec_v}}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    smoke = "--smoke" in argv
    torch.set_num_threads(1)
    if "--default-init-std" in argv:
        return publish_choice("variational_default_init_std", default_init_std())
    if "--fresh-seeds" in argv:
        return fresh_seeds()
    if "--selective-score" in argv:
        return selective_score()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    baseline = chosen_settings()
    epsilons, seeds = ((3.0,), (0,)) if smoke else (EPSILONS, SEEDS)
    stds = INIT_STDS[:2] if smoke else INIT_STDS
    rounds = 20 if smoke else None
    start = time.perf_counter()
    pool = None if smoke else Pool(2)  # the smoke run stays in this process (importable from tests)
    pmap = pool.map if pool is not None else (lambda f, jobs: [f(j) for j in jobs])
    try:
        # 1. L, lr and C by validation accuracy (seed 0), as the record-level table chose DP-FedSGD's
        points = list(grid(FEDSGD_GRID))[:2 if smoke else None]
        tuning = pmap(_validation_run, [(3.0, 0, hp, None, rounds) for hp in points])
        best = lambda rows: max(rows, key=lambda r: r["validation"]["accuracy"])["hyper_parameters"]  # noqa: E731
        chosen = {3.0: best(tuning)}
        for eps in (e for e in epsilons if e != 3.0):
            rows = pmap(_validation_run, [(eps, 0, {**chosen[3.0], "lr": lr}, None, rounds) for lr in FEDSGD_LR])
            tuning += rows
            chosen[eps] = best(rows)
        for r in tuning:
            log(f"tune eps={r['epsilon']:g} {r['hyper_parameters']}: validation {r['validation']}")
        # 2. q's initial deviation by the mean validation NLL over seeds
        jobs = [(eps, seed, chosen[eps], s, rounds) for eps in epsilons for seed in seeds for s in stds]
        validation = pmap(_validation_run, jobs)
        init_std = {eps: min(stds, key=lambda s: np.mean([v["validation"]["nll"] for v in validation
                                                         if v["epsilon"] == eps and v["init_std"] == s]))
                    for eps in epsilons}
        log(f"chosen: {chosen}, init_std {init_std}")
        # 3. the test split, once
        rows = pmap(_final_run, [(eps, seed, chosen[eps], init_std[eps], baseline[eps], rounds)
                                 for eps in epsilons for seed in seeds])
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    for row in rows:
        log(f"eps={row['epsilon']:g} seed={row['seed']} {row['setting']}: dp_fedsgd {row['dp_fedsgd']} "
            f"variational {row['variational']}")
    out = {"rows": rows, "tuning": tuning, "chosen": {str(k): v for k, v in chosen.items()},
           "validation": validation, "init_std": {str(k): v for k, v in init_std.items()}, "init_stds": list(stds),
           "fedsgd_grid": FEDSGD_GRID, "fedsgd_lr": FEDSGD_LR, "wall_s": time.perf_counter() - start,
           "machine": platform.machine(), "python": platform.python_version(), "smoke": smoke}
    return publish("variational_posterior", out, markdown(rows, smoke), smoke)


def paired(rows: list[dict], metric: str) -> dict:
    """Variational minus DP-FedSGD on ``metric`` over the rows' seeds: mean, standard error, 95 % t-interval and the
    verdict of the module docstring's rule."""
    d = np.array([r["variational"][metric] - r["dp_fedsgd"][metric] for r in rows])
    se = float(d.std(ddof=1) / np.sqrt(len(d)))
    half = float(stats.t.ppf(0.975, len(d) - 1) * se)
    low, high = float(d.mean()) - half, float(d.mean()) + half
    sign = BETTER[metric]
    verdict = ("better" if min(sign * low, sign * high) > 0 else "worse" if max(sign * low, sign * high) < 0
               else "not distinguished")
    return {"metric": metric, "difference": float(d.mean()), "standard_error": se, "interval_95": [low, high],
            "verdict": verdict, "variational_better_on": int((sign * d > 0).sum()), "seeds": len(d)}


def _fresh_run(job) -> dict:
    """:func:`_final_run`, or the refusal's first words when privfl refuses the seed's federation (nothing charged)."""
    from privfl.errors import ConfigurationError

    try:
        return _final_run(job)
    except ConfigurationError as exc:
        return {"seed": job[1], "refused": str(exc).split(":")[0]}


def fresh_seeds() -> int:
    """The committed epsilon-3 choices on :data:`FRESH_SEEDS`, paired by seed (module docstring)."""
    with open(os.path.join(OUT, "variational_posterior.json")) as f:
        committed = json.load(f)
    hp, init_std = committed["chosen"]["3.0"], float(committed["init_std"]["3.0"])
    start = time.perf_counter()
    with Pool(2) as pool:
        runs = pool.map(_fresh_run, [(3.0, seed, hp, init_std, chosen_settings()[3.0], None)
                                     for seed in FRESH_SEEDS])
    rows, refused = [r for r in runs if "refused" not in r], [r for r in runs if "refused" in r]
    table = [paired(rows, m) for m in METRICS]
    text = fresh_markdown(table, rows, hp, init_std, refused)
    out = {"rows": rows, "refused": refused, "summary": table, "seeds": list(FRESH_SEEDS), "hyper_parameters": hp, "init_std": init_std,
           "wall_s": time.perf_counter() - start, "machine": platform.machine(),
           "python": platform.python_version()}
    return publish("variational_posterior_fresh", out, text, False)


def _draw_probabilities(alg, split) -> np.ndarray:
    """q's ``posterior_samples`` draws' class probabilities on ``split`` (draws, points, classes), from the stream the
    algorithm's own prediction uses (their mean is ``alg.predict_proba``)."""
    from privfl.algorithms.dp_fedsgd import POSTERIOR_STREAM
    from privfl.training.local import load_flat_parameters, predict_proba

    mean, var = alg.posterior_moments()
    rng = np.random.default_rng(np.random.SeedSequence(alg.fed.seed, spawn_key=(POSTERIOR_STREAM,)))
    x = split.tensors()[0]
    out = []
    for _ in range(alg.posterior_samples):
        load_flat_parameters(alg._plain, (mean + np.sqrt(var) * rng.standard_normal(mean.shape)).astype(np.float32))
        out.append(predict_proba(alg._plain, x))
    return np.stack(out)


def _selective(score: np.ndarray, correct: np.ndarray, coverage: float = 0.8) -> float:
    keep = max(1, int(round(coverage * len(score))))
    return float(correct[np.argsort(-score, kind="stable")[:keep]].mean())


def _lcb_scores(alg, split) -> dict:
    """Selective accuracy of the variational predictive under ``p_max - k s`` for every k of :data:`LCB_KS`."""
    draws = _draw_probabilities(alg, split)
    mean = draws.mean(0)
    pred = mean.argmax(1)
    spread = draws[:, np.arange(len(pred)), pred].std(0)
    correct = pred == np.asarray(split.y)
    return {str(k): _selective(mean.max(1) - k * spread, correct) for k in LCB_KS}


def _score_run(job) -> dict:
    """One seed (a worker's job): the variational run's selective accuracy per k and DP-FedSGD's, on the validation
    federation (``validation``) or the test split."""
    seed, hp, init_std, point_hp, validation = job
    torch.set_num_threads(1)
    data = federation(seed)
    if validation:
        data = validation_federation(data)
    var, res_v, _, _ = train_variational(data, 3.0, seed, hp, init_std)
    point, res_p, _, _ = train(data, 3.0, seed, point_hp, "none")
    return {"seed": seed, "validation": validation, "variational": _lcb_scores(var, data.test),
            "dp_fedsgd": evaluate(point, data.test)["selective_accuracy"],
            "epsilon_spent": {"dp_fedsgd": res_p.audit["max_epsilon"], "variational": res_v.audit["max_epsilon"]}}


def selective_score() -> int:
    """``--selective-score`` (module docstring)."""
    with open(os.path.join(OUT, "variational_posterior.json")) as f:
        committed = json.load(f)
    hp, init_std = committed["chosen"]["3.0"], float(committed["init_std"]["3.0"])
    point_hp = chosen_settings()[3.0]
    start = time.perf_counter()
    with Pool(2) as pool:
        val = pool.map(_score_run, [(seed, hp, init_std, point_hp, True) for seed in SEEDS])
        k = max(LCB_KS, key=lambda k: (np.mean([r["variational"][str(k)] for r in val]), -k))
        rows = pool.map(_score_run, [(seed, hp, init_std, point_hp, False) for seed in FRESH_SEEDS])
    table = []
    for kk in sorted({0.0, k}):
        d = np.array([r["variational"][str(kk)] - r["dp_fedsgd"] for r in rows])
        se = float(d.std(ddof=1) / np.sqrt(len(d)))
        half = float(stats.t.ppf(0.975, len(d) - 1) * se)
        low, high = float(d.mean()) - half, float(d.mean()) + half
        table.append({"k": kk, "variational": float(np.mean([r["variational"][str(kk)] for r in rows])),
                      "dp_fedsgd": float(np.mean([r["dp_fedsgd"] for r in rows])), "difference": float(d.mean()),
                      "standard_error": se, "interval_95": [low, high], "better_on": int((d > 0).sum()),
                      "verdict": "better" if low > 0 else "worse" if high < 0 else "not distinguished"})
    validation_means = ", ".join(f"{kk:g}: {np.mean([r['variational'][str(kk)] for r in val]):.4f}" for kk in LCB_KS)
    lines = ["# Does q's spread earn a better abstention rule? (issue 27, HBFL's selective accuracy)", "",
             f"Score p_max - k s (s: the standard deviation over q's 30 draws of the predicted class's probability); "
             f"k among {list(LCB_KS)} chosen by mean validation selective accuracy over seeds {list(SEEDS)} "
             f"(validation federations): **k = {k:g}** "
             f"({validation_means}; "
             f"DP-FedSGD {np.mean([r['dp_fedsgd'] for r in val]):.4f}). Then the committed epsilon-3 settings on "
             f"seeds {FRESH_SEEDS[0]}-{FRESH_SEEDS[-1]}, test split, paired against DP-FedSGD's largest class "
             "probability; verdict rule of `variational_posterior_fresh.md`, fixed before the run. "
             "`python experiments/run_variational_posterior.py --selective-score`.", "",
             "| score | DP-FedSGD | variational | variational - DP-FedSGD | 95 % interval | variational better on | "
             "verdict |", "|---|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| p_max - {t['k']:g} s | {t['dp_fedsgd']:.4f} | {t['variational']:.4f} | "
                     f"{t['difference']:+.4f} ± {t['standard_error']:.4f} | [{t['interval_95'][0]:+.4f}, "
                     f"{t['interval_95'][1]:+.4f}] | {t['better_on']} of {len(rows)} | {t['verdict']} |")
    spent = max(max(r["epsilon_spent"].values()) for r in rows + val)
    lines += ["", f"Largest epsilon spent by any client in any run: {spent:.3f} (target 3)."]
    out = {"chosen_k": k, "validation": val, "rows": rows, "summary": table, "ks": list(LCB_KS),
           "wall_s": time.perf_counter() - start, "machine": platform.machine(), "python": platform.python_version()}
    return publish("variational_selective_score", out, "\n".join(lines) + "\n", False)


def fresh_markdown(table: list[dict], rows: list[dict], hp: dict, init_std: float, refused: list[dict]) -> str:
    mean = lambda key, m: float(np.mean([r[key][m] for r in rows]))  # noqa: E731
    lines = ["# HBFL's noise-once meme against DP-FedSGD on seeds the choices never saw (issue 27)", "",
             f"`variational_posterior.md`'s epsilon-3 choice, unchanged (L {hp['lot_size']}, lr {hp['lr']:g}, "
             f"C {hp['clip']:g}, init std {init_std:g}) and DP-FedSGD at the record-level table's settings, each run "
             f"on seeds {FRESH_SEEDS[0]}-{FRESH_SEEDS[-1]} ({len(rows)} federations, splits and noise draws neither "
             "choice saw), compared seed by seed on the test split. Paired difference, variational minus DP-FedSGD, "
             "mean +- standard error and its 95 % t-interval; verdict (rule fixed before the run): *better* when "
             "the interval lies on the better side of 0 (higher accuracy and selective accuracy, lower NLL and "
             "ECE), *worse* on the other side, else *not distinguished*. "
             "`python experiments/run_variational_posterior.py --fresh-seeds`.", "",
             "| metric | DP-FedSGD | variational | variational - DP-FedSGD | 95 % interval | variational better on |"
             " verdict |", "|---|---|---|---|---|---|---|"]
    for t in table:
        m = t["metric"]
        lines.append(f"| {m.replace('_', ' ')} | {mean('dp_fedsgd', m):.4f} | {mean('variational', m):.4f} | "
                     f"{t['difference']:+.4f} ± {t['standard_error']:.4f} | [{t['interval_95'][0]:+.4f}, "
                     f"{t['interval_95'][1]:+.4f}] | {t['variational_better_on']} of {t['seeds']} | {t['verdict']} |")
    spent = max(max(r["epsilon_spent"].values()) for r in rows)
    lines += ["", f"Largest epsilon spent by any client in any run: {spent:.3f} (target 3)."]
    if refused:
        lines += ["", "Seeds privfl refused (nothing charged): "
                  + "; ".join(f"seed {r['seed']}: {r['refused']}" for r in refused) + "."]
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict], smoke: bool) -> str:
    head = ["# HBFL's Bayesian meme, its noise paid once (issue 27, part 2)", "",
            "MNIST-5k, 10 clients, Dirichlet 0.1, record level, delta 1e-5, central noise. `variational`: DP-FedSGD "
            "on the mean-field Gaussian twin of its network (the ELBO's data term as clipped per-record gradient "
            "sums, the KL term added by the server), predicting with 30 draws from q; its lot size L, lr and clip C "
            "chosen on the record-level table's validation split as the table chose DP-FedSGD's (validation "
            "accuracy, full grid at epsilon 3, lr at 1 and 8), then q's initial deviation by validation NLL; "
            "`variational, mean`: the same runs' mean model. DP-FedSGD: the table's chosen settings. Mean +- std "
            f"over seeds {sorted({r['seed'] for r in rows})} on the test split. "
            "`python experiments/run_variational_posterior.py`" + (" --smoke (NOT a measurement)" if smoke else "")
            + "."]
    return versus_dp_fedsgd(rows, head=head, key="variational", labels=("variational, mean", "variational"),
                            param="setting", param_header="setting", param_on=("variational_point", "variational"),
                            name="Variational")


if __name__ == "__main__":
    sys.exit(main())
