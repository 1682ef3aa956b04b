"""Issue 27, part 2: FOLA's Laplace posterior with its statistics paid for once, against DP-FedSGD's point estimate.

``dp_fedsgd`` with ``posterior="laplace"``: on each round's Poisson lot every client releases, beside DP-FedSGD's
clipped gradient sum, the per-tensor sums of its records' squared clipped gradient norms (the Fisher's trace per
parameter tensor); both sums get their noise once (central here), one sampled event per round, the budget split 95 / 5
(``fisher_share``). The server steps as DP-FedSGD does and keeps the mean of the noisy traces over the last tenth of the
rounds; it predicts with the Laplace posterior N(w, s / (1 + N F_t / d_t)) per tensor t by averaging 30 draws.

Setting: the record-level table's (``experiments/run_record_level.py``: MNIST-5k, 10 clients, Dirichlet 0.1, record
level, delta 1e-5, logistic regression on 2x2-pooled images, 30 expected epochs of Poisson lots), with the table's
chosen DP-FedSGD hyper-parameters at each epsilon. The posterior scale s is chosen per epsilon on the table's
validation split (15 % of every client's records held out; mean validation NLL over seeds 0-2) among
``SCALES``; the test split is used once, for the rows below. The baseline row is DP-FedSGD as the table runs it (all
the budget on the gradient), same seeds.

Reported on the test split, mean +- std over seeds 0-2: accuracy, NLL, ECE and selective accuracy (on the 80 % of test
points the model is most confident about). Writes ``experiments/results/laplace_posterior.{json,md}``.

``--default-scale``: the default comparison's ``fola_noise_once`` row (``experiments/configs/default.toml``) chooses
its scale the same way, on that comparison's own validation split (``val_fraction``, held by no client; the test set
unread) at epsilon = 3, seed 0, among ``SCALES``; writes ``experiments/results/laplace_default_scale.json``.

Usage: python experiments/run_laplace_posterior.py [--smoke | --default-scale]   (``--smoke``: one seed, epsilon 3,
20 rounds)
"""

from __future__ import annotations

import os
import platform
import sys

import numpy as np
import torch

from privfl.algorithms import make_algorithm
from privfl.runtime.engine import Simulation

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_record_level import EPSILONS, SEEDS, federation, validation_federation  # noqa: E402
from run_trajectory_posterior import (METRICS, chosen_settings, publish, publish_choice, train,  # noqa: E402
                                      versus_dp_fedsgd)

#: the posterior scales the validation split chooses among (1: the Laplace posterior itself)
SCALES = (0.01, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


def evaluate(alg, split, scale: float | None = None) -> dict:
    if scale is not None:
        alg.posterior_scale = scale
    out = alg.evaluate(split)
    return {k: float(out[k]) for k in METRICS}


def default_scale() -> dict:
    """The default comparison's Laplace scale, on its validation split (module docstring)."""
    from privfl.apps.compare import CompareConfig, RunSpec, _configs, _options, federation as compare_federation

    config = CompareConfig.from_toml("experiments/configs/default.toml")
    spec = RunSpec("fola_noise_once", 3.0, 0)
    fed, privacy = _configs(config, spec)
    data = compare_federation(config, spec.seed)
    alg = make_algorithm(config.base(spec.algorithm), fed, privacy, **_options(config, spec.algorithm))
    Simulation(alg, data, fed, privacy).run()
    nll = {str(s): evaluate(alg, data.val, s)["nll"] for s in SCALES}
    alg.posterior = "none"
    point = evaluate(alg, data.val)["nll"]
    chosen = min(SCALES, key=lambda s: nll[str(s)])
    return {"epsilon": 3.0, "seed": 0, "validation_nll": nll, "validation_nll_global_model": point,
            "chosen": chosen}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    smoke = "--smoke" in argv
    torch.set_num_threads(1)
    if "--default-scale" in argv:
        return publish_choice("laplace_default_scale", default_scale())
    settings = chosen_settings()
    epsilons, seeds = ((3.0,), (0,)) if smoke else (EPSILONS, SEEDS)
    rounds = 20 if smoke else None
    validation, rows = [], []
    for eps in epsilons:
        hp = settings[eps]
        for seed in seeds:  # the scale, on the validation split only
            val_data = validation_federation(federation(seed))
            alg, _, _, _ = train(val_data, eps, seed, hp, "laplace", rounds)
            validation.append({"epsilon": eps, "seed": seed,
                               "nll": {str(s): evaluate(alg, val_data.test, s)["nll"] for s in SCALES}})
        scale = min(SCALES, key=lambda s: np.mean([v["nll"][str(s)] for v in validation if v["epsilon"] == eps]))
        for seed in seeds:
            data = federation(seed)
            laplace, res_l, n_rounds, sec_l = train(data, eps, seed, hp, "laplace", rounds)
            point, res_p, _, sec_p = train(data, eps, seed, hp, "none", rounds)
            row = {"epsilon": eps, "seed": seed, "rounds": n_rounds, "hyper_parameters": hp, "posterior_scale": scale,
                   "fisher_share": laplace.fisher_share, "posterior_rounds": laplace.posterior_rounds,
                   "dp_fedsgd": evaluate(point, data.test), "laplace": evaluate(laplace, data.test, scale),
                   "laplace_point": evaluate(laplace, data.test, 1e-12),
                   "epsilon_spent": {"dp_fedsgd": res_p.audit["max_epsilon"], "laplace": res_l.audit["max_epsilon"]},
                   "noise_multipliers": {"dp_fedsgd": res_p.final.get("noise_multiplier"),
                                         "laplace": res_l.final.get("noise_multiplier")},
                   "seconds": {"dp_fedsgd": sec_p, "laplace": sec_l}}
            rows.append(row)
            print(f"eps={eps:g} seed={seed} scale={scale:g}: dp_fedsgd {row['dp_fedsgd']} laplace {row['laplace']}",
                  file=sys.stderr, flush=True)
    out = {"rows": rows, "validation": validation, "scales": list(SCALES), "machine": platform.machine(),
           "python": platform.python_version(), "smoke": smoke}
    return publish("laplace_posterior", out, markdown(rows, smoke), smoke)


def markdown(rows: list[dict], smoke: bool) -> str:
    head = ["# FOLA's Laplace posterior, its Fisher paid for once (issue 27, part 2)", "",
            "MNIST-5k, 10 clients, Dirichlet 0.1, record level, delta 1e-5, central noise, the record-level table's "
            "chosen DP-FedSGD settings. `laplace`: DP-FedSGD's lots also release per-tensor Fisher traces (5 % of "
            "the budget), the server predicts with the Laplace posterior at its global model (scale s chosen on the "
            "validation split); `laplace, point`: the same runs' global model. Mean +- std over seeds "
            f"{sorted({r['seed'] for r in rows})} on the test split. `python experiments/run_laplace_posterior.py`"
            + (" --smoke (NOT a measurement)" if smoke else "") + "."]
    return versus_dp_fedsgd(rows, head=head, key="laplace", labels=("laplace, point", "laplace"),
                            param="posterior_scale", param_header="s", param_on=("laplace",), name="Laplace")


if __name__ == "__main__":
    sys.exit(main())
