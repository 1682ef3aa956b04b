"""FedBNR against FedAvg and centralised references on diabetes and synthetic1d, non-private and at epsilon = 3.

Writes ``experiments/results/fedbnr.json`` (every run and the per-setting means) and ``experiments/results/fedbnr.md``
(the table). Usage: ``python experiments/run_fedbnr.py [--seeds 3] [--out experiments/results]``.

``--sets diabetes,star98,fair`` runs the smaller comparison of issue 16 instead: per set and seed (10% of the data
held out for validation), FedBNR's candidates (RFF; +phase 1 hyperparameters; +phase 1 deep kernel, ``--no-deep``
leaves it out; and ``RFF_GRID``, FedBNR (RFF) over feature pairs, ridge, target clip and budget split, one release
each) and FedAvg MLP at the learning rates ``FEDAVG_LRS``, each without DP and at epsilon = 3. Per set and privacy
level the FedBNR candidate and the learning rate with the lowest mean validation RMSE are reported with their test
RMSE (the same trained models; the test split plays no part in the choice), and FedBNR (RFF) is checked against
Central BLR (phase 2's exactness). ``--seed-list``, ``--parts`` and ``--rows`` split the work over processes;
``--merge`` writes their rows into fedbnr.json (key ``sets_comparison``) and on top of fedbnr.md.

``--defaults autompg,grunfeld,macrodata,randhie`` (issue 28) runs FedBNR at its default settings against FedAvg MLP
on sets the defaults were not chosen on (fedbnr_defaults.json/.md). ``--feature-rule diabetes,star98,fair`` checks a
default feature count derived from the public record count (``default_feature_pairs``) on the validation splits of
the issue-16 sets and of thinned copies of them (fedbnr_feature_rule.json/.md; validation RMSE only).
``--budget diabetes,star98,fair`` chooses the target clip and the budget split at the other defaults on those sets'
validation splits (fedbnr_budget.json/.md).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import platform
import time

import numpy as np
import torch
from torch import nn

from privfl import FederationConfig, PrivacyConfig, Simulation, make_federated
from privfl.core.aggregation import Aggregate
from privfl.algorithms.base import ClientOutput, FederatedAlgorithm
from privfl.privacy.record_level import DPSGDSchedule, calibrate_dpsgd, dpsgd_schedule
from privfl.algorithms.fedbnr import DEFAULT_LINEAR_SCALE, DEFAULT_LINEAR_SHARE, FedBNR
from privfl.core.channels import Channel, PrivatizedValue, TrainedPrivately, Unclipped
from privfl.data import FederatedData
from privfl.models.features import RandomFourierFeatures
from privfl.metrics import regression_metrics
from privfl.core.public import PublicFacts, private_torch_generator, release_weight
from privfl.training.local import batches, flat_parameters, load_flat_parameters

EPSILON, DELTA = 3.0, 1e-5
#: the target clip of the runs written before FedBNR's default became 2 (fedbnr_budget.md): issue 16's comparison,
#: the feature-count rule and the linear-block choice ran at B_y = 3, and rerun at it
ISSUE16_TARGET_CLIP = 3.0
N_CLIENTS = 10
DATASETS = {"diabetes": {"alignment_size": 35}, "synthetic1d": {"n": 1000, "alignment_size": 80}}
METRICS = ("rmse", "nll", "ece", "mce", "brier")


# -- FedAvg baseline: a probabilistic MLP regressor ----------------------------------------------------------------

class GaussianMLP(nn.Module):
    """x -> (mean, variance) with a softplus variance head."""

    def __init__(self, input_dim: int, hidden=(50, 50)):
        super().__init__()
        layers, width = [], input_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.body = nn.Sequential(*layers, nn.Linear(width, 2))

    def forward(self, x):
        out = self.body(x.reshape(len(x), -1))
        return out[:, 0], nn.functional.softplus(out[:, 1]) + 1e-4


def gaussian_nll_loss(model, x, y):
    mean, var = model(x)
    return (0.5 * torch.log(var) + 0.5 * (y - mean) ** 2 / var).mean()


class FedAvgRegression(FederatedAlgorithm):
    """FedAvg of a :class:`GaussianMLP`; private runs train each client with DP-SGD (per-example clip C, Poisson
    sampling, noise z C per step), so the upload is post-processing of record-level DP training. As in privfl's
    algorithms, the schedule, the expected batch and the weight come from public facts (never len(dataset)), and
    the noise and Poisson coins from the OS CSPRNG unless the run asks for seeded noise."""

    name = "fedavg_regression"

    def __init__(self, fed, privacy):
        super().__init__(fed, privacy)
        self._multipliers: dict[DPSGDSchedule, float] = {}

    def setup(self, data, rng):
        public = self.bind_public(data)
        torch.manual_seed(int(rng.integers(0, 2 ** 31 - 1)))
        self.model = GaussianMLP(int(np.prod(public.input_shape)))
        self.global_params = flat_parameters(self.model)

    def channels(self):
        clip = TrainedPrivately() if self.privacy.private else Unclipped()
        return [Channel("update", (self.global_params.size,), unit="example", clip=clip,
                        description="local model change")]

    def _noise_multiplier(self, schedule: DPSGDSchedule) -> float:
        if schedule not in self._multipliers:
            self._multipliers[schedule] = calibrate_dpsgd(self.privacy.epsilon, self.privacy.delta, self.fed.rounds,
                                                          schedule, self.privacy.resolved_accountant)
        return self._multipliers[schedule]

    def planned_events(self, client: int) -> dict:
        """The round's event of the DP-SGD-trained upload, for the run plan (which refuses a private run without
        it)."""
        if not self.privacy.private:
            return {}
        schedule = dpsgd_schedule(self, client)
        return {"update": schedule.round_event(self._noise_multiplier(schedule))}

    def _train_plain(self, model, x, y, rng):
        opt = torch.optim.SGD(model.parameters(), lr=self.fed.lr, momentum=self.fed.momentum)
        for _ in range(self.fed.local_epochs):
            for idx in batches(len(x), self.fed.batch_size, rng):
                idx = torch.as_tensor(idx)
                opt.zero_grad()
                gaussian_nll_loss(model, x[idx], y[idx]).backward()
                opt.step()

    def _train_dpsgd(self, model, x, y, schedule, z, rng):
        from torch.func import functional_call, grad, vmap

        clip = self.privacy.clip
        names = [n for n, _ in model.named_parameters()]
        gen = private_torch_generator(rng, self.privacy.secure_noise)
        opt = torch.optim.SGD(model.parameters(), lr=self.fed.lr, momentum=self.fed.momentum)

        def one(params, xi, yi):
            return gaussian_nll_loss(lambda t: functional_call(model, params, (t,)), xi[None], yi[None])

        per_example = vmap(grad(one), in_dims=(None, 0, 0))
        for _ in range(schedule.steps):
            take = torch.rand(len(x), generator=gen) < schedule.sample_rate  # Poisson sampling
            params = {n: p.detach() for n, p in model.named_parameters()}
            summed = {n: torch.zeros_like(p) for n, p in params.items()}
            if take.any():
                grads = per_example(params, x[take], y[take])
                norms = torch.sqrt(sum((grads[n].reshape(len(grads[n]), -1) ** 2).sum(1) for n in names))
                scale = torch.clamp(clip / (norms + 1e-12), max=1.0)
                summed = {n: (grads[n] * scale.reshape(-1, *[1] * (grads[n].dim() - 1))).sum(0) for n in names}
            expected = schedule.expected_batch
            for n, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=gen) * z * clip
                p.grad = (summed[n] + noise) / expected
            opt.step()

    def client_update(self, client, dataset, round, rng):
        local = copy.deepcopy(self.model)
        load_flat_parameters(local, self.global_params)
        x, y = dataset.tensors()
        if not self.privacy.private:
            self._train_plain(local, x, y, rng)
            update = flat_parameters(local) - self.global_params
            return ClientOutput({"update": update}, weight=float(len(dataset)))
        schedule = dpsgd_schedule(self, client)
        z = self._noise_multiplier(schedule)
        self._train_dpsgd(local, x, y, schedule, z, rng)
        update = flat_parameters(local) - self.global_params
        return ClientOutput({"update": PrivatizedValue(update, schedule.round_event(z))},
                            weight=release_weight(self.privacy, self.public, client, dataset))

    def server_update(self, aggregates: dict[str, Aggregate], round):
        agg = aggregates["update"]
        self.global_params = self.global_params + agg.total / agg.total_weight

    def evaluate(self, dataset):
        load_flat_parameters(self.model, self.global_params)
        with torch.no_grad():
            mean, var = self.model(dataset.tensors()[0])
        scale = dataset.target_scale
        return regression_metrics(dataset.to_original_units(mean.double().numpy()), var.double().numpy() * scale ** 2,
                                  dataset.to_original_units(dataset.y))


# -- centralised references ----------------------------------------------------------------------------------------

def pooled(data: FederatedData) -> FederatedData:
    """The same training data held by one party (for centralised references through the same code path)."""
    train = data.pooled_train()
    return FederatedData([train], data.test, data.name, data.num_classes, data.input_shape,
                         val=data.val, partition="pooled", seed=data.seed, design_size=len(train))


def exact_gp(data: FederatedData, lengthscale: float, noise_std: float, prior_std: float) -> dict[str, float]:
    train, test = data.pooled_train(), data.test
    rff = RandomFourierFeatures(int(np.prod(data.input_shape)), 1, lengthscale)
    k = prior_std ** 2 * rff.kernel(train.x, train.x)
    k_star = prior_std ** 2 * rff.kernel(test.x, train.x)
    chol = np.linalg.cholesky(k + noise_std ** 2 * np.eye(len(k)))
    alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, train.y.astype(np.float64)))
    v = np.linalg.solve(chol, k_star.T)
    mean = k_star @ alpha
    var = prior_std ** 2 + noise_std ** 2 - np.sum(v * v, axis=0)
    s = test.target_scale
    return regression_metrics(test.to_original_units(mean), var * s ** 2, test.to_original_units(test.y))


# -- the grid ------------------------------------------------------------------------------------------------------

def privacy_for(private: bool, **kw) -> PrivacyConfig:
    if not private:
        return PrivacyConfig()
    return PrivacyConfig(epsilon=EPSILON, delta=DELTA, unit="example", **kw)


def _result(sim: Simulation, r, data: FederatedData) -> dict:
    """The run's test metrics and epsilon, plus ``val_rmse`` (the same trained model on the validation split, for
    choosing settings without looking at the test set) when ``data`` has one."""
    out = {**r.final, "epsilon": r.audit["max_epsilon"]}
    if data.val is not None:
        out["val_rmse"] = sim.diagnostic_algorithm().evaluate(data.val)["rmse"]
    return out


def run_one(method: str, private: bool, data: FederatedData, seed: int, *, lr: float = 0.02,
            rff: dict | None = None) -> dict:
    """One run of ``method``; ``lr`` is FedAvg MLP's SGD step (the earlier run's fixed 0.02 by default), ``rff``
    FedBNR (RFF)'s options (``num_samples``, ``ridge_scale``; default the earlier run's 50 and 0.25)."""
    fed = FederationConfig(rounds=1, seed=seed)
    exact = dict(accountant="exact")  # unsampled Gaussians only: the exact accountant is exact
    if method in ("FedBNR (RFF)", "FedBNR (RFF, local noise)", "FedBNR (defaults)"):
        placement = "local" if "local" in method else "central"
        privacy = privacy_for(private, placement=placement, **exact)
        options = dict(rff or {})
        if method != "FedBNR (defaults)":  # the paper's pure random Fourier features (issue 16's runs)
            options.setdefault("linear_share", 0.0)
            options.setdefault("target_clip", ISSUE16_TARGET_CLIP)
        factor = options.pop("lengthscale_factor", None)
        if factor is not None:  # a multiple of the default sqrt(input dimension)
            options["lengthscale"] = factor * math.sqrt(np.prod(data.input_shape))
        sim = Simulation(FedBNR(fed, privacy, **options), data, fed, privacy)
        return _result(sim, sim.run(), data)
    if "+phase 1" in method:
        hidden = (32,) if "deep" in method else ()
        kfed = FederationConfig(rounds=20, local_epochs=10, lr=0.01, seed=seed)
        aggregation = "distillation" if method.startswith("FedBNR-KD") else "fedavg"
        privacy = privacy_for(private, **exact)
        # both phases within one budget: a two-phase FedBNR, run by the runtime (privfl.runtime.phases)
        alg = FedBNR(fed, privacy, kernel_rounds=20, kernel_fed=kfed, **{"target_clip": ISSUE16_TARGET_CLIP, **(rff or {})},
                     kernel_options=dict(hidden=hidden, latent_dim=4, update_clip=0.05, aggregation=aggregation))
        sim = Simulation(alg, data, fed, privacy)
        r = sim.run()
        k = r.phases[0]["final"]
        return {**_result(sim, r, data), "learned_noise_std": k["noise_std"], "learned_prior_std": k["prior_std"],
                "learned_lengthscale": k["lengthscale"]}
    if method == "FedAvg MLP":
        ffed = FederationConfig(rounds=30, local_epochs=2, batch_size=16, lr=lr, momentum=0.5, seed=seed)
        privacy = privacy_for(private, clip=1.0, accountant="pld")
        sim = Simulation(FedAvgRegression(ffed, privacy), data, ffed, privacy)
        return _result(sim, sim.run(), data)
    if method in ("Central BLR (same features)", "Central BLR (default features)"):
        privacy = privacy_for(private, **exact)
        options = {} if "default" in method else {"linear_share": 0.0}
        sim = Simulation(FedBNR(fed, privacy, **options), pooled(data), fed, privacy)
        return _result(sim, sim.run(), data)
    if method == "Central GP (exact kernel)":
        return {**exact_gp(data, math.sqrt(np.prod(data.input_shape)), 0.5, 1.0), "epsilon": math.inf}
    raise ValueError(method)


GRID = [
    ("FedBNR (RFF)", (False, True)),
    ("FedBNR (RFF, local noise)", (True,)),
    ("FedBNR (+phase 1: hyperparameters)", (False, True)),
    ("FedBNR (+phase 1: deep kernel)", (False, True)),
    ("FedBNR-KD (+phase 1: hyperparameters)", (False, True)),
    ("FedBNR-KD (+phase 1: deep kernel)", (False, True)),
    ("FedAvg MLP", (False, True)),
    ("Central BLR (same features)", (False, True)),
    ("Central GP (exact kernel)", (False,)),
]


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    keys = sorted({(r["dataset"], r["method"], r["private"]) for r in rows},
                  key=lambda k: (k[0], [g[0] for g in GRID].index(k[1]), k[2]))
    for ds, method, private in keys:
        group = [r for r in rows if (r["dataset"], r["method"], r["private"]) == (ds, method, private)]
        s = {"dataset": ds, "method": method, "private": private, "seeds": len(group),
             "epsilon_spent_max": max(r["epsilon"] for r in group)}
        for m in METRICS:
            vals = np.array([r[m] for r in group])
            s[m], s[f"{m}_std"] = float(vals.mean()), float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
        out.append(s)
    return out


def _columns(rows: list[dict]) -> dict:
    """Rows of one shape as ``{"columns": [...], "rows": [[...], ...]}`` (10,000 runs stay a few hundred KB)."""
    columns = list(rows[0]) if rows else []
    return {"columns": columns, "rows": [[row[c] for c in columns] for row in rows]}


def _finite(obj):
    """JSON without Infinity: a non-finite number is written as the string "inf" (or "nan")."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, (float, np.floating)) and not math.isfinite(obj):
        return str(float(obj))
    return obj.item() if isinstance(obj, np.generic) else obj


def markdown(summary: list[dict], seeds: int, seconds: float) -> str:
    lines = ["# FedBNR vs FedAvg and centralised references", "",
             f"10 clients, sorted-chunk split, {seeds} seeds (mean ± std); private: (ε, δ) = ({EPSILON:g}, {DELTA:g}) "
             "per client, record level (add/remove). RMSE and NLL in the data's own units; ECE/MCE over central "
             "intervals at levels 0.05..0.95. Written by `experiments/run_fedbnr.py` "
             f"({seconds:.0f} s on {platform.machine()}).", ""]
    for ds in dict.fromkeys(s["dataset"] for s in summary):
        lines += [f"## {ds}", "", "| method | ε | RMSE | NLL | ECE | MCE | ε spent (max) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for s in summary:
            if s["dataset"] != ds:
                continue
            eps = f"{EPSILON:g}" if s["private"] else "∞"
            spent = "∞" if not math.isfinite(s["epsilon_spent_max"]) else f"{s['epsilon_spent_max']:.3f}"
            lines.append(f"| {s['method']} | {eps} | {s['rmse']:.3f} ± {s['rmse_std']:.3f} | {s['nll']:.3f} ± "
                         f"{s['nll_std']:.3f} | {s['ece']:.3f} ± {s['ece_std']:.3f} | {s['mce']:.3f} | {spent} |")
        lines.append("")
    lines += ["Notes:",
              "- FedBNR (RFF) equals Central BLR: non-private because phase 2 is exact; at ε = 3 with central noise "
              "because it is the same mechanism (noise once on the summed statistics) and, with the same seed, the "
              "same noise draw. With local noise every client perturbs its own statistics (sqrt(10) times the "
              "noise on the sum), the trust model of the DP-SGD FedAvg baseline.",
              "- Phase-1 variants split the budget half/half (Gaussian DP) between the kernel uploads (client-level "
              "clip, a valid record-level bound: a record changes its client's clipped upload, so the sensitivity is "
              "twice the clip, replace-one) and phase 2.",
              "- FedBNR-KD rows (phase 1 by kernel distillation, eq. 19) also use the server's labelled set (8% of "
              "the data: 35 / 80 points) that no other method gets; every method's clients hold the same data "
              "(the set is carved out before partitioning for all rows). Its defaults (alpha 1000, 10 server Adam "
              "steps at 0.01, Gram clip 0.02 RMS per entry) were chosen on a validation split of seed 10, not on "
              "these test sets.",
              "- FedBNR's ridge_scale (0.25) was picked from {0, 0.25, 0.5, 1, 2} on these two data sets (seeds 0-3), "
              "so private FedBNR numbers are mildly optimistic in that one constant; all other hyperparameters are "
              "fixed public defaults, not tuned.", ""]
    return "\n".join(lines)


# -- FedBNR against FedAvg-MLP on several offline real sets, settings chosen on a validation split ----------------

#: FedBNR's candidate variants and FedAvg MLP's candidate learning rates for the ``--sets`` comparison.
FEDBNR_VARIANTS = ("FedBNR (RFF)", "FedBNR (+phase 1: hyperparameters)", "FedBNR (+phase 1: deep kernel)")
FEDAVG_LRS = (0.02, 0.05, 0.1)
#: FedBNR (RFF)'s small grid (one release each, so it costs seconds): feature pairs m, ridge_scale, the target clip
#: B_y and the scatter channel's budget share. Fewer features mean fewer noisy entries in the released d x d scatter
#: (d = 2m); the ridge damps the noise that remains; a smaller B_y and a larger share for Phi^T y put less noise on
#: the statistic the predictive mean is linear in.
RFF_GRID = tuple({"num_samples": m, "ridge_scale": r, "target_clip": b, "scatter_share": a}
                 for m in (10, 25, 50) for r in (0.25, 1.0, 4.0) for b in (1.5, 3.0) for a in (0.3, 0.5)
                 if (m, r, b, a) != (50, 0.25, 3.0, 0.5))
#: added after the first selection missed on star98 at epsilon = 3 (see fedbnr.md): twice the default lengthscale
#: (smoother features), and phase 1 (hyperparameters) with the smaller target clip.
RFF_GRID_SMOOTH = tuple({"num_samples": m, "ridge_scale": r, "target_clip": 1.5, "scatter_share": a,
                         "lengthscale_factor": 2.0} for m in (25, 50) for r in (0.25, 1.0) for a in (0.3, 0.5))
VAL_FRACTION = 0.1


def _config_name(method: str, kw: dict) -> str:
    if "lr" in kw:
        return f"{method} lr={kw['lr']:g}"
    if "rff" in kw and method != "FedBNR (RFF)":
        return method[:-1] + ", " + ", ".join(f"{k}={v:g}" for k, v in kw["rff"].items()) + ")"
    if "rff" in kw:
        o = kw["rff"]
        extra = (f", B_y={o['target_clip']:g}" if o["target_clip"] != 3.0 else "") + (
            f", scatter share={o['scatter_share']:g}" if o["scatter_share"] != 0.5 else "") + (
            f", lengthscale x{o['lengthscale_factor']:g}" if "lengthscale_factor" in o else "")
        return f"FedBNR (RFF, m={o['num_samples']}, ridge={o['ridge_scale']:g}{extra})"
    return method


def sets_rows(name: str, seeds, variants, lrs, rff_grid=RFF_GRID, phase1_clipped=False, repeats: int = 1) -> list[dict]:
    """Every candidate on every seed: test metrics and the same model's validation RMSE (``val_rmse``); each private
    job ``repeats`` times (fresh noise and Poisson coins from the OS CSPRNG, the same data split), so that a mean
    over a few seeds is not decided by one noise draw."""
    rows = []
    for seed in seeds:
        data = make_federated(name, N_CLIENTS, seed=seed, val_fraction=VAL_FRACTION)
        jobs = [(m, p, {}) for m in variants for p in (False, True)]
        jobs += [("FedBNR (RFF)", p, {"rff": o}) for o in rff_grid for p in (False, True)
                 if p or (o["target_clip"], o["scatter_share"], o["ridge_scale"]) == (3.0, 0.5, 0.25)]
        jobs += [("FedAvg MLP", p, {"lr": lr}) for lr in lrs for p in (False, True)]
        if phase1_clipped:
            jobs += [("FedBNR (+phase 1: hyperparameters)", True, {"rff": {"target_clip": 1.5}})]
        if "FedBNR (RFF)" in variants:  # phase 2's exactness, checked on every seed
            jobs += [("Central BLR (same features)", False, {})]
        if "FedBNR (defaults)" in variants:
            jobs += [("Central BLR (default features)", False, {})]
        jobs = [(m, p, kw, k) for m, p, kw in jobs for k in range(repeats if p else 1)]
        for method, private, kw, repeat in jobs:
            t = time.perf_counter()
            try:
                res = run_one(method, private, data, seed, **kw)
            except ValueError as exc:  # e.g. FedAvg MLP diverging at a large step: the pipeline refuses NaN updates
                if method != "FedAvg MLP":
                    raise
                print(f"{name} seed {seed} {method} {kw} diverged: {exc}", flush=True)
                res = {m: math.inf for m in (*METRICS, "val_rmse")}
                res.update(epsilon=math.nan, diverged=True)
            config = _config_name(method, kw)
            row = {"dataset": name, "seed": seed, "repeat": repeat, "method": method, "config": config,
                   "private": private, "epsilon_target": EPSILON if private else math.inf, "delta": DELTA,
                   "seconds": time.perf_counter() - t, **res}
            rows.append(row)
            print(f"{name:9s} seed {seed} {config:40s} {'ε=3' if private else 'ε=∞'}  val {res['val_rmse']:.4g}  "
                  f"test {res['rmse']:.4g}  ε {res['epsilon']:.3f}  ({row['seconds']:.1f} s)", flush=True)
    return rows


def select_on_validation(rows: list[dict]) -> list[dict]:
    """Per (set, privacy, family: FedBNR / FedAvg MLP), the configuration with the lowest mean validation RMSE over
    the seeds (and noise draws), and its test metrics (mean over everything; std over the seeds of each seed's mean).
    The test set plays no part in the choice."""
    out = []
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        for private in (False, True):
            for family in ("FedBNR", "FedAvg MLP"):
                group = [r for r in rows if r["dataset"] == ds and r["private"] == private
                         and r["method"].startswith(family) and not r["method"].startswith("Central")]
                configs = list(dict.fromkeys(r["config"] for r in group))
                if not configs:
                    continue
                val = {c: float(np.mean([r["val_rmse"] for r in group if r["config"] == c])) for c in configs}
                best = min(configs, key=val.get)
                chosen = [r for r in group if r["config"] == best]
                seeds = sorted({r["seed"] for r in chosen})
                rmse = np.array([np.mean([r["rmse"] for r in chosen if r["seed"] == k]) for k in seeds])
                nll = np.array([r["nll"] for r in chosen])
                out.append({"dataset": ds, "private": private, "family": family, "chosen": best,
                            "val_rmse": val, "seeds": len(seeds), "runs": len(chosen), "rmse": float(rmse.mean()),
                            "rmse_std": float(rmse.std(ddof=1)) if len(rmse) > 1 else 0.0,
                            "nll": float(nll.mean()), "epsilon_spent_max": max(r["epsilon"] for r in chosen)})
    return out


def verdicts(selected: list[dict], rows: list[dict]) -> list[dict]:
    """The acceptance conditions per set: FedBNR (no DP) RMSE <= 1.1 x FedAvg MLP (no DP); FedBNR (ε = 3) RMSE <
    DP-SGD FedAvg MLP (ε = 3); FedBNR (RFF) without DP equals Central BLR on every seed (phase 2 is exact)."""
    out = []
    for ds in dict.fromkeys(s["dataset"] for s in selected):
        pick = {(s["family"], s["private"]): s for s in selected if s["dataset"] == ds}
        if len(pick) < 4:
            continue
        rff = {r["seed"]: r["rmse"] for r in rows if r["dataset"] == ds
               and r["config"] in ("FedBNR (RFF)", "FedBNR (defaults)") and not r["private"]}
        blr = {r["seed"]: r["rmse"] for r in rows if r["dataset"] == ds and r["method"].startswith("Central BLR")}
        gap = max(abs(rff[k] - blr[k]) for k in blr) if blr else math.nan
        ratio = pick[("FedBNR", False)]["rmse"] / pick[("FedAvg MLP", False)]["rmse"]
        out.append({"dataset": ds, "ratio_no_dp": ratio, "within_1_1x": bool(ratio <= 1.1),
                    "fedbnr_eps3": pick[("FedBNR", True)]["rmse"], "fedavg_eps3": pick[("FedAvg MLP", True)]["rmse"],
                    "beats_dpsgd": bool(pick[("FedBNR", True)]["rmse"] < pick[("FedAvg MLP", True)]["rmse"]),
                    "phase2_max_abs_rmse_gap_vs_central_blr": gap,
                    "phase2_exact": bool(gap <= 1e-6 * max(blr.values()))})
    return out


def acceptance_lines(checks: list[dict], title: str) -> list[str]:
    """The acceptance table of :func:`verdicts` as markdown lines, under ``title``."""
    lines = ["", title, "",
             "| set | FedBNR / FedAvg MLP test RMSE, no DP (≤ 1.1?) | FedBNR vs DP-SGD FedAvg MLP test RMSE at ε = 3 "
             "(lower?) | phase 2 = central BLR (max RMSE gap over seeds) |", "|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c['dataset']} | {c['ratio_no_dp']:.3f} ({'yes' if c['within_1_1x'] else 'NO'}) | "
                     f"{c['fedbnr_eps3']:.4g} vs {c['fedavg_eps3']:.4g} ({'yes' if c['beats_dpsgd'] else 'NO'}) | "
                     f"{'yes' if c['phase2_exact'] else 'NO'} ({c['phase2_max_abs_rmse_gap_vs_central_blr']:.1e}) |")
    return lines


def _extension(row: dict) -> bool:
    """Whether a row is one of the candidates added after the first selection (RFF_GRID_SMOOTH, phase 1 with B_y)."""
    return "lengthscale" in row["config"] or row["config"].startswith("FedBNR (+phase 1: hyperparameters, ")


def sets_markdown(selected: list[dict], checks: list[dict], rows: list[dict], seconds: float) -> str:
    seeds = sorted({r["seed"] for r in rows})
    first = {(s["dataset"], s["family"], s["private"]): s
             for s in select_on_validation([r for r in rows if not _extension(r)])}
    lines = ["# FedBNR vs FedAvg MLP on three offline real regression sets (settings chosen on validation)", "",
             f"{N_CLIENTS} clients, sorted-chunk split, seeds {seeds} (test RMSE in the target's own units, mean ± "
             f"std over seeds); private: (ε, δ) = ({EPSILON:g}, {DELTA:g}) per client, record level. Each seed holds "
             f"out 20% for testing and {VAL_FRACTION:.0%} for validation, and standardises with a public reference "
             "split (5%, at least 20 rows) that no client holds. Written by `experiments/run_fedbnr.py --sets` "
             f"({seconds:.0f} s of runs, summed over several processes on a shared, loaded 2-core "
             f"{platform.machine()} machine).", "",
             "For each set and privacy level, FedBNR's candidate and FedAvg MLP's learning rate with the lowest mean "
             "validation RMSE over the seeds were chosen; the same trained models were then scored on the test split, "
             "which played no part in the choice.", "",
             "| set | method | ε | chosen on validation | val RMSE | test RMSE | NLL | candidates |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for s in selected:
        eps = f"{EPSILON:g}" if s["private"] else "∞"
        name = "FedBNR" if s["family"] == "FedBNR" else ("DP-SGD FedAvg MLP" if s["private"] else "FedAvg MLP")
        lines.append(f"| {s['dataset']} | {name} | {eps} | {s['chosen']} | {s['val_rmse'][s['chosen']]:.4g} | "
                     f"{s['rmse']:.4g} ± {s['rmse_std']:.2g} | {s['nll']:.3f} | {len(s['val_rmse'])} |")
    lines += acceptance_lines(checks, "Acceptance (issue 16):")
    all_sets = list(dict.fromkeys(r["dataset"] for r in rows))

    def where(test) -> str:
        have = [ds for ds in all_sets if any(r["dataset"] == ds and test(r["config"]) for r in rows)]
        return "every set" if have == all_sets else " and ".join(have) + " only"

    deep = where(lambda c: c == "FedBNR (+phase 1: deep kernel)")
    clipped = where(lambda c: c.startswith("FedBNR (+phase 1: hyperparameters, "))
    lines += ["", "Candidates (everything else is the earlier run's fixed default):",
              "- FedBNR: RFF (m = 50 feature pairs, ridge_scale 0.25, B_y = 3, scatter share 0.5); +phase 1 "
              f"hyperparameters; +phase 1 deep kernel ({deep}); RFF over "
              "m ∈ {10, 25, 50} × ridge_scale ∈ {0.25, 1, 4} × target clip B_y ∈ {1.5, 3} × scatter share ∈ "
              "{0.3, 0.5} (`RFF_GRID`; without DP only m matters). Then, because the first selection missed on star98 "
              "at ε = 3 (its test RMSE lost to DP-SGD, see below), two extensions, chosen again on validation: RFF "
              "at twice the default lengthscale with B_y = 1.5 "
              "(m ∈ {25, 50} × ridge_scale ∈ {0.25, 1} × scatter share ∈ {0.3, 0.5}, `RFF_GRID_SMOOTH`) and "
              f"+phase 1 hyperparameters with B_y = 1.5 at ε = 3 ({clipped}).",
              "- FedAvg MLP (and DP-SGD FedAvg MLP): SGD learning rate ∈ {" + ", ".join(f"{v:g}" for v in FEDAVG_LRS)
              + "} (30 rounds, 2 local epochs, batch 16, momentum 0.5, DP-SGD clip 1; a diverged run counts as "
              "infinite validation RMSE). Its clip, epochs and width were not tuned."]
    changed = [(k, v) for k, v in first.items() if k[2] and k[1] == "FedBNR"
               and any(s["dataset"] == k[0] and s["family"] == "FedBNR" and s["private"] and s["chosen"] != v["chosen"]
                       for s in selected)]
    for (ds, _, _), v in changed:
        lines.append(f"- Before the extensions, {ds} at ε = 3 chose {v['chosen']} (validation "
                     f"{v['val_rmse'][v['chosen']]:.4g}): test RMSE {v['rmse']:.4g} ± {v['rmse_std']:.2g}, worse than "
                     "DP-SGD FedAvg MLP. The extensions were added after seeing that; the test split still played no "
                     "part in choosing among them.")
    lines += ["- FedBNR's DP noise comes from the OS CSPRNG (not seeded), so a rerun gives other ε = 3 numbers; the "
              "seed-to-seed std above is the scale of that variation. Validation sets are small (diabetes 44, star98 "
              "30, fair 637 rows), so the choice among many FedBNR candidates is itself noisy.",
              "- Data: diabetes (scikit-learn; 442 rows, 10 features, disease progression after one year), star98 "
              "(statsmodels; 303 California school districts, 20 features, share of students above the national "
              "maths median), fair (statsmodels; 6,366 women, 8 features, `affairs`: heavy-tailed, 68% zeros, max "
              "57.6; every method is close to predicting the mean there).", ""]
    return "\n".join(lines)


def write_sets(rows: list[dict], out: str, seconds: float) -> None:
    """Put the comparison in fedbnr.json (key ``sets_comparison``, the earlier run kept) and on top of fedbnr.md
    (the earlier run's sections kept below, marked as such)."""
    selected = select_on_validation(rows)
    checks = verdicts(selected, rows)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "fedbnr.json")
    doc = json.load(open(path)) if os.path.exists(path) else {}
    doc["sets_comparison"] = _finite({"setting": {"clients": N_CLIENTS, "epsilon": EPSILON, "delta": DELTA,
                                                  "unit": "example", "val_fraction": VAL_FRACTION,
                                                  "fedbnr_variants": FEDBNR_VARIANTS, "fedavg_lrs": FEDAVG_LRS},
                                      "selected": selected, "acceptance": checks, "runs": rows, "seconds": seconds})
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    md_path = os.path.join(out, "fedbnr.md")
    earlier = open(md_path).read() if os.path.exists(md_path) else ""
    marker = "<!-- earlier run -->"
    if marker in earlier:
        earlier = earlier[earlier.index(marker):]
    elif earlier:
        earlier = (marker + "\n\n# Earlier run: diabetes and synthetic1d, every variant, fixed settings (not tuned "
                   "on validation)\n\n" + earlier.replace("# FedBNR vs FedAvg and centralised references\n\n", "", 1))
    with open(md_path, "w") as f:
        f.write(sets_markdown(selected, checks, rows, seconds) + "\n" + earlier)


def _default(name: str):
    """FedBNR's default for option ``name`` (what ``--defaults`` runs)."""
    import inspect

    return inspect.signature(FedBNR.__init__).parameters[name].default


def defaults_markdown(selected: list[dict], checks: list[dict], rows: list[dict], seconds: float,
                      repeats: int = 1) -> str:
    """The table of ``--defaults``: FedBNR at its default settings (nothing chosen) against FedAvg MLP (learning rate
    chosen on validation), on sets the defaults were not chosen on."""
    seeds = sorted({r["seed"] for r in rows})
    lines = ["# FedBNR with its default settings on regression sets its defaults were not chosen on (issue 28)", "",
             f"{N_CLIENTS} clients, sorted-chunk split, seeds {seeds}, {repeats} noise draw(s) per seed for every "
             "private run (both methods: noise and Poisson coins from the OS CSPRNG); test RMSE in the target's own "
             "units, mean over seeds and draws ± std over the seeds' means; private: "
             f"(ε, δ) = ({EPSILON:g}, {DELTA:g}) per client, record level. FedBNR runs its "
             f"defaults (a linear block of prior share {DEFAULT_LINEAR_SHARE:g} at input scale "
             f"{DEFAULT_LINEAR_SCALE:g} beside m = 50 random Fourier feature pairs, ridge_scale 0.25, B_y = "
             f"{_default('target_clip'):g}, scatter share {_default('scatter_share'):g}; chosen on the validation "
             "splits of diabetes, star98 and fair: fedbnr_linear.md, then fedbnr_budget.md for B_y and the split), "
             "nothing tuned here; FedAvg MLP's learning rate is chosen on "
             f"the validation split ({VAL_FRACTION:.0%}) among {{" + ", ".join(f"{v:g}" for v in FEDAVG_LRS) + "} "
             f"(30 rounds, 2 local epochs, batch 16, momentum 0.5, DP-SGD clip 1). `experiments/run_fedbnr.py "
             f"--defaults` ({seconds:.0f} s of runs on this 2-core {platform.machine()} machine, one process).", "",
             "| set | method | ε | setting | val RMSE | test RMSE | NLL |", "|---|---|---:|---|---:|---:|---:|"]
    for s in selected:
        eps = f"{EPSILON:g}" if s["private"] else "∞"
        name = "FedBNR" if s["family"] == "FedBNR" else ("DP-SGD FedAvg MLP" if s["private"] else "FedAvg MLP")
        lines.append(f"| {s['dataset']} | {name} | {eps} | {s['chosen']} | {s['val_rmse'][s['chosen']]:.4g} | "
                     f"{s['rmse']:.4g} ± {s['rmse_std']:.2g} | {s['nll']:.3f} |")
    lines += acceptance_lines(checks, "Acceptance (issue 28: within 1.1x of FedAvg MLP without DP, below DP-SGD "
                                      "FedAvg MLP at ε = 3, phase 2 exact):")
    lines += ["", "Data (all shipped inside their packages): autompg (mlxtend; 392 cars, 7 features, miles per gallon), "
              "grunfeld (statsmodels; 220 firm-years, 3 features, gross investment), macrodata (statsmodels; 203 US "
              "quarters, 11 features, real private investment), randhie (statsmodels; a fixed 3,000-row subsample of "
              "the RAND Health Insurance Experiment, 9 features, doctor visits: a heavy-tailed count). FedBNR's noise "
              "comes from the OS CSPRNG, so a rerun gives other ε = 3 numbers.", ""]
    return "\n".join(lines)


# -- issue 28: a default feature count from the public record count, checked on the issue-16 sets' validation ------

def public_record_count(public: PublicFacts) -> int:
    """N, the federation's public record count: the sum of the clients' public sizes (declared sizes, else the design
    size), never a client's true record count."""
    return int(public.total_size(range(public.n_clients)))


def default_feature_pairs(records: int, private: bool, per_record: float) -> int:
    """The candidate rule of issue 28 (not adopted: validation rejected it, see fedbnr_feature_rule.md): m = 50
    without DP; under DP m = clip(round(per_record * N), 5, 50). Its reasoning: the released d x d scatter's noise
    is ~ 2 sqrt(d) s in spectral norm (s fixed by the budget) while the pooled signal's scale per direction is
    ~ N / d, so the signal-to-noise ratio goes like N / d^1.5 and a small federation might afford fewer features.
    The floor 5 is the smallest m of ``M_SWEEP``. Only public facts enter (N and whether the run is private)."""
    if not private:
        return 50
    return max(5, min(50, int(math.floor(per_record * int(records) + 0.5))))


#: candidates for the private rule's constant (feature pairs per public record of the federation,
#: :func:`default_feature_pairs`), a fixed sweep of m around them, and the ridge scales tried with each m at ε = 3
RULE_CONSTANTS = (0.02, 0.03, 0.05, 0.075, 0.1, 0.15)
M_SWEEP = (5, 10, 15, 20, 25, 35, 50)
RULE_RIDGES = (0.25, 1.0)
#: each client keeps this fraction of its records (a seeded subsample; the public design size is scaled alike) so
#: that the rule is validated on smaller federations of the same sets too, down to the held-out sets' sizes and
#: below; fractions that leave fewer than ``MIN_RULE_DESIGN`` records per client are skipped
RULE_FRACTIONS = (1.0, 0.5, 0.25, 0.05)
MIN_RULE_DESIGN = 3


def thinned(data: FederatedData, fraction: float, seed: int) -> FederatedData:
    """``data`` with each client keeping a seeded random ``fraction`` of its records and the design size scaled
    alike (the experimenter's declaration for the smaller federation); validation and test splits unchanged."""
    if fraction == 1.0:
        return data
    rng = np.random.default_rng([seed, int(round(fraction * 1000))])
    parts = [p.subset(np.sort(rng.choice(len(p), max(1, int(round(fraction * len(p)))), replace=False)))
             for p in data.train_parts]
    return dataclasses.replace(data, train_parts=parts,
                               design_size=max(1, int(round(fraction * data.design_size))))


def feature_rule_rows(name: str, seeds, repeats: int) -> list[dict]:
    """FedBNR (RFF) at every m of ``M_SWEEP`` and every m a candidate constant of ``RULE_CONSTANTS`` gives this set's
    public record count, without DP (ridge is then void) and at ε = 3 with each ridge scale of ``RULE_RIDGES``
    (``repeats`` noise draws per seed: the noise comes from the OS CSPRNG). Only the validation RMSE is kept: the
    test split plays no part in choosing the rule."""
    rows = []
    for seed in seeds:
        full = make_federated(name, N_CLIENTS, seed=seed, val_fraction=VAL_FRACTION)
        for fraction in RULE_FRACTIONS:
            if fraction * full.design_size < MIN_RULE_DESIGN:
                continue
            data = thinned(full, fraction, seed)
            label = name if fraction == 1.0 else f"{name} ×{fraction:g}"
            records = public_record_count(PublicFacts.of(data))
            ms = sorted(set(M_SWEEP) | {default_feature_pairs(records, True, c) for c in RULE_CONSTANTS})
            for m in ms:
                jobs = [(False, 0.25, 0)] + [(True, r, k) for r in RULE_RIDGES for k in range(repeats)]
                for private, ridge, k in jobs:
                    res = run_one("FedBNR (RFF)", private, data, seed, rff={"num_samples": m, "ridge_scale": ridge})
                    rows.append({"dataset": label, "seed": seed, "fraction": fraction, "records": records, "m": m,
                                 "ridge_scale": ridge, "private": private, "repeat": k, "val_rmse": res["val_rmse"]})
            print(f"{label:14s} seed {seed} N={records}: {len(ms)} feature counts done", flush=True)
    return rows


def feature_rule_summary(rows: list[dict]) -> dict:
    """Mean validation RMSE per (set, privacy, ridge, m), each relative to today's default (m = 50, ridge 0.25) at
    the same privacy level, and per candidate constant the m it gives each set and the mean of those ratios over the
    sets (the choice: the lowest mean ratio at ε = 3; without DP the rule is used only if it lowers that mean too)."""
    sets = list(dict.fromkeys(r["dataset"] for r in rows))
    records = {ds: next(r["records"] for r in rows if r["dataset"] == ds) for ds in sets}

    def mean_val(ds, private, ridge, m):
        vals = [r["val_rmse"] for r in rows if (r["dataset"], r["private"], r["m"]) == (ds, private, m)
                and (not private or r["ridge_scale"] == ridge)]
        return float(np.mean(vals)) if vals else math.nan

    levels = [(False, 0.25)] + [(True, r) for r in RULE_RIDGES]
    curves = {}
    for ds in sets:
        for private, ridge in levels:
            base = mean_val(ds, private, 0.25, 50)
            ms = sorted({r["m"] for r in rows if r["dataset"] == ds})
            curves[f"{ds}|{'eps3' if private else 'nodp'}|{ridge:g}"] = {
                m: {"val_rmse": mean_val(ds, private, ridge, m), "ratio": mean_val(ds, private, ridge, m) / base}
                for m in ms}
    candidates = []
    for c in (*RULE_CONSTANTS, None):  # None: today's m = 50 everywhere
        ms = {ds: 50 if c is None else default_feature_pairs(records[ds], True, c) for ds in sets}
        entry = {"constant": c, "m": ms}
        for private, ridge in levels:
            key = f"{'eps3' if private else 'nodp'}|{ridge:g}"
            ratios = {ds: curves[f"{ds}|{key}"][ms[ds]]["ratio"] for ds in sets}
            entry[key] = {"ratios": ratios, "mean_ratio": float(np.mean(list(ratios.values())))}
        candidates.append(entry)
    return {"records": records, "curves": curves, "candidates": candidates}


def feature_rule_markdown(summary: dict, rows: list[dict], seconds: float, repeats: int) -> str:
    seeds = sorted({r["seed"] for r in rows})
    sets = list(summary["records"])
    lines = ["# FedBNR's default feature count: a rule of the public record count, checked on validation (issue 28)", "",
             f"FedBNR (RFF) on the issue-16 sets (diabetes, star98, fair; {N_CLIENTS} clients) and on thinned copies "
             f"of them (× f: each client keeps a seeded fraction f ∈ {{{', '.join(f'{v:g}' for v in RULE_FRACTIONS)}}}"
             f" of its records and the design size is scaled alike, kept where ≥ {MIN_RULE_DESIGN} records per "
             f"client remain), so that the rule is checked at small N too; seeds {seeds}, validation RMSE only "
             f"(the sets' own {VAL_FRACTION:.0%} "
             f"split; the test split was not scored into this file). At ε = 3 (δ = {DELTA:g}, record level) each "
             f"seed has {repeats} noise draws. Everything else at today's defaults (B_y = 3, scatter share 0.5). "
             f"`experiments/run_fedbnr.py --feature-rule` ({seconds:.0f} s on a 2-core {platform.machine()} machine "
             "shared with other jobs, one process).", "",
             "Candidate rule: m = clip(round(c · N), 5, 50) under DP (N = the federation's public record count), 50 without "
             "DP. Each cell: mean validation RMSE relative to today's default (m = 50, ridge_scale 0.25) at the same "
             "privacy level (below 1 is better); the last row is the mean over the sets and sizes. N: the federation's public "
             "record count (10 × the design size).", "",
             ]
    consts = summary["candidates"]
    today = next(c for c in consts if c["constant"] is None)
    rules = [c for c in consts if c["constant"] is not None]
    best = min(rules, key=lambda c: c["eps3|0.25"]["mean_ratio"])
    best_r1 = min(consts, key=lambda c: c["eps3|1"]["mean_ratio"])
    worse_r1 = [ds for ds in sets if today["eps3|1"]["ratios"][ds] > 1]
    lines += ["Result: at ε = 3 with ridge_scale 0.25 the best rule (c = "
              f"{best['constant']:g}) has a mean ratio of {best['eps3|0.25']['mean_ratio']:.3f}, worse than today's "
              f"m = 50 ({today['eps3|0.25']['mean_ratio']:.3f} by definition); no rule candidate is below 1 on "
              "average. Without DP the rule would be worse still (best "
              f"{min(c['nodp|0.25']['mean_ratio'] for c in rules):.3f}). With ridge_scale 1 the lowest mean is "
              f"{'m = 50' if best_r1['constant'] is None else 'c = ' + format(best_r1['constant'], 'g')} "
              f"({best_r1['eps3|1']['mean_ratio']:.3f}; m = 50 at ridge 1: {today['eps3|1']['mean_ratio']:.3f}, worse "
              f"than ridge 0.25 on {', '.join(worse_r1) or 'no set'}). Decision (issue 28): FedBNR's defaults stay "
              "m = 50 and ridge_scale 0.25; the feature-count rule is not adopted, and ridge_scale 1 is not taken either "
              "(a mean change of about 1%, worse on the sets named above, and it would move every private FedBNR "
              "result, large federations included).", ""]
    head = " | ".join("today (50)" if c["constant"] is None else f"c = {c['constant']:g}" for c in consts)
    for key, title in (("eps3|0.25", "ε = 3, ridge_scale 0.25"), ("eps3|1", "ε = 3, ridge_scale 1"),
                       ("nodp|0.25", "no DP (if the rule applied without DP too)")):
        lines += [f"**{title}** (each cell: the rule's m, then the ratio)", "", f"| set (N) | {head} |",
                  "|---|" + "---:|" * len(consts)]
        for ds in sets:
            lines.append(f"| {ds} ({summary['records'][ds]}) | " + " | ".join(
                f"{c['m'][ds]}: {c[key]['ratios'][ds]:.3f}" for c in consts) + " |")
        lines += ["| **mean ratio** | " + " | ".join(f"**{c[key]['mean_ratio']:.3f}**" for c in consts) + " |", ""]
    lines += ["", "Validation RMSE by feature pairs m (mean over seeds and draws; the ratio to m = 50 in brackets):", "",
              "| set | privacy | " + " | ".join(f"m={m}" for m in M_SWEEP) + " |",
              "|---|---|" + "---:|" * len(M_SWEEP)]
    for key, curve in summary["curves"].items():
        ds, level, ridge = key.split("|")
        label = "no DP" if level == "nodp" else f"ε = 3, ridge {ridge}"
        lines.append(f"| {ds} | {label} | " + " | ".join(
            f"{curve[m]['val_rmse']:.4g} ({curve[m]['ratio']:.3f})" for m in M_SWEEP) + " |")
    return "\n".join(lines) + "\n"


# -- issue 28: a linear block beside the random features, chosen on the issue-16 sets' validation splits ---------

#: (linear_share a, linear_scale c, num_samples m, ridge_scale) candidates; a = 0 is the paper's pure random Fourier
#: features (c unused) at today's m = 50 and ridge 0.25, the reference. The first sweep (a with c, at m = 50 and ridge
#: 0.25) found its best at a = 0.75-0.9 with c = 1; the second adds the feature count and the ridge around it
LINEAR_CANDIDATES = (((0.0, 1.0, 50, 0.25),) + tuple((a, c, 50, 0.25) for a in (0.25, 0.5, 0.75, 0.9, 0.95)
                                                    for c in (1.0, 2.0))
                     + tuple((a, 1.0, m, r) for a in (0.75, 0.9) for m in (10, 20, 50) for r in (0.25, 1.0)
                             if (m, r) != (50, 0.25)))


def linear_rows(name: str, seeds, repeats: int) -> list[dict]:
    """FedBNR with each (a, c) of ``LINEAR_CANDIDATES`` (everything else at its defaults: m = 50, ridge_scale 0.25,
    B_y = 3, scatter share 0.5), without DP and at ε = 3 (``repeats`` noise draws per seed: the noise comes from the
    OS CSPRNG). Only the validation RMSE is kept: the test split plays no part in the choice."""
    rows = []
    for seed in seeds:
        data = make_federated(name, N_CLIENTS, seed=seed, val_fraction=VAL_FRACTION)
        for a, c, m, ridge in LINEAR_CANDIDATES:
            options = {"linear_share": a, "linear_scale": c, "num_samples": m, "ridge_scale": ridge,
                       "target_clip": ISSUE16_TARGET_CLIP}
            for private, k in [(False, 0)] + [(True, k) for k in range(repeats)]:
                res = run_one("FedBNR (defaults)", private, data, seed, rff=options)
                rows.append({"dataset": name, "seed": seed, **options, "private": private, "repeat": k,
                             "val_rmse": res["val_rmse"], "epsilon": res["epsilon"]})
        print(f"{name:9s} seed {seed}: {len(LINEAR_CANDIDATES)} candidates done", flush=True)
    return rows


def linear_summary(rows: list[dict]) -> dict:
    """Per candidate, its mean validation RMSE per (set, privacy) relative to a = 0 (the pure random features) at
    the same privacy level, and the mean of those ratios over the sets and both privacy levels: the choice is the
    candidate with the lowest mean (the rule was fixed before the runs)."""
    sets = list(dict.fromkeys(r["dataset"] for r in rows))
    cells = [(ds, p) for ds in sets for p in (False, True)]

    def mean_val(ds, private, candidate):
        return float(np.mean([r["val_rmse"] for r in rows if (r["dataset"], r["private"]) == (ds, private) and
                              (r["linear_share"], r["linear_scale"], r["num_samples"], r["ridge_scale"])
                              == candidate]))

    table = []
    for a, c, m, ridge in LINEAR_CANDIDATES:
        ratios = {f"{ds}|{'dp' if p else 'nodp'}": mean_val(ds, p, (a, c, m, ridge))
                  / mean_val(ds, p, LINEAR_CANDIDATES[0]) for ds, p in cells}
        table.append({"linear_share": a, "linear_scale": c, "num_samples": m, "ridge_scale": ridge,
                      "ratios": ratios,
                      "mean_ratio": float(np.mean(list(ratios.values()))),
                      "mean_ratio_dp": float(np.mean([v for k, v in ratios.items() if k.endswith("|dp")])),
                      "mean_ratio_nodp": float(np.mean([v for k, v in ratios.items() if k.endswith("|nodp")]))})
    best = min(table, key=lambda t: t["mean_ratio"])
    return {"sets": sets, "table": table, "chosen": {k: best[k] for k in ("linear_share", "linear_scale",
                                                                          "num_samples", "ridge_scale")}}


def linear_markdown(summary: dict, rows: list[dict], seconds: float, repeats: int) -> str:
    seeds = sorted({r["seed"] for r in rows})
    sets = summary["sets"]
    head = "| a (linear share) | c (input scale) | m | ridge | " + " | ".join(f"{ds}, no DP | {ds}, ε = 3" for ds in sets) + \
        " | mean, no DP | mean, ε = 3 | **mean** |"
    lines = ["# FedBNR's default features: a linear block beside the random Fourier features (issue 28)", "",
             f"FedBNR on the issue-16 sets ({', '.join(sets)}; {N_CLIENTS} clients, sorted-chunk split), seeds "
             f"{seeds}, validation RMSE only (the sets' own {VAL_FRACTION:.0%} split; the test split was not scored "
             f"into this file). At ε = {EPSILON:g} (δ = {DELTA:g}, record level, central noise) each seed has "
             f"{repeats} noise draws. Candidates: the features [sqrt(a) l(x), sqrt(1 - a) r(x)] "
             "(`privfl.models.features.LinearRandomFourierFeatures`: l(x) the inputs scaled by 1 / (c sqrt(d)) into "
             "the unit ball with a bias, r(x) the m = 50 random Fourier features); a = 0 is the paper's pure random "
             "features, the default until now. Everything else at its default (ridge_scale 0.25, B_y = 3, scatter "
             "share 0.5). The scatter's sensitivity is the linear block's per-radius bound on a record's term "
             "(`ScatterBound`, `LinearRandomFourierFeatures.term_square_bound`), so a linear block costs a little "
             "more noise than pure random features (at B = 1: 0.752 at a = 0.5, 0.838 at a = 0.9, against 0.714). Each cell: mean validation RMSE relative to a = 0 at the same privacy "
             "level (below 1 is better). Rule (fixed before the runs): the lowest mean over the six cells. "
             f"`experiments/run_fedbnr.py --linear` ({seconds:.0f} s on this 2-core {platform.machine()} machine, "
             "one process).", "", head, "|---|---|---|---|" + "---:|" * (2 * len(sets) + 3)]
    for t in summary["table"]:
        cells = " | ".join(f"{t['ratios'][ds + '|nodp']:.3f} | {t['ratios'][ds + '|dp']:.3f}" for ds in sets)
        c = "–" if t["linear_share"] == 0 else f"{t['linear_scale']:g}"
        lines.append(f"| {t['linear_share']:g} | {c} | {t['num_samples']} | {t['ridge_scale']:g} | {cells} | {t['mean_ratio_nodp']:.3f} | "
                     f"{t['mean_ratio_dp']:.3f} | **{t['mean_ratio']:.3f}** |")
    ch = summary["chosen"]
    lines += ["", f"Chosen: a = {ch['linear_share']:g}, c = {ch['linear_scale']:g}, m = {ch['num_samples']}, ridge_scale "
              f"{ch['ridge_scale']:g} (FedBNR's defaults). Its check on sets it was not chosen on: `fedbnr_defaults.md`.",
              ""]
    return "\n".join(lines)


# -- issue 28: the budget's split and the target clip at the linear-block defaults, on the issue-16 validation splits

#: (target_clip B_y, scatter_share) candidates at FedBNR's other defaults; the first is today's default, the
#: reference. Only the private runs differ (without DP nothing is clipped or split), so only epsilon = 3 is run
BUDGET_CANDIDATES = ((3.0, 0.5),) + tuple((b, s) for b in (1.5, 2.0, 3.0) for s in (0.2, 0.3, 0.4, 0.5)
                                          if (b, s) != (3.0, 0.5))


def budget_rows(name: str, seeds, repeats: int) -> list[dict]:
    """FedBNR at epsilon 3 with each (B_y, scatter share) of ``BUDGET_CANDIDATES`` (everything else at its defaults),
    ``repeats`` noise draws per seed; only the validation RMSE is kept (the test split plays no part)."""
    rows = []
    for seed in seeds:
        data = make_federated(name, N_CLIENTS, seed=seed, val_fraction=VAL_FRACTION)
        for b, share in BUDGET_CANDIDATES:
            for k in range(repeats):
                res = run_one("FedBNR (defaults)", True, data, seed, rff={"target_clip": b, "scatter_share": share})
                rows.append({"dataset": name, "seed": seed, "target_clip": b, "scatter_share": share, "repeat": k,
                             "val_rmse": res["val_rmse"], "epsilon": res["epsilon"]})
        print(f"{name:9s} seed {seed}: {len(BUDGET_CANDIDATES)} candidates done", flush=True)
    return rows


def budget_summary(rows: list[dict]) -> dict:
    """Per candidate, its mean validation RMSE per set relative to today's default (B_y 3, share 0.5), and the mean
    of those ratios over the sets: the choice is the candidate with the lowest mean (rule fixed before the runs)."""
    sets = list(dict.fromkeys(r["dataset"] for r in rows))

    def mean_val(ds, candidate):
        return float(np.mean([r["val_rmse"] for r in rows if r["dataset"] == ds
                              and (r["target_clip"], r["scatter_share"]) == candidate]))

    table = []
    for cand in BUDGET_CANDIDATES:
        ratios = {ds: mean_val(ds, cand) / mean_val(ds, BUDGET_CANDIDATES[0]) for ds in sets}
        table.append({"target_clip": cand[0], "scatter_share": cand[1], "ratios": ratios,
                      "mean_ratio": float(np.mean(list(ratios.values())))})
    best = min(table, key=lambda t: t["mean_ratio"])
    return {"sets": sets, "table": table,
            "chosen": {"target_clip": best["target_clip"], "scatter_share": best["scatter_share"]}}


def budget_markdown(summary: dict, rows: list[dict], seconds: float, repeats: int) -> str:
    seeds = sorted({r["seed"] for r in rows})
    sets = summary["sets"]
    lines = ["# FedBNR's target clip and budget split at its linear-block defaults (issue 28)", "",
             f"FedBNR at ε = {EPSILON:g} (δ = {DELTA:g}, record level, central noise) on the issue-16 sets "
             f"({', '.join(sets)}; {N_CLIENTS} clients, sorted-chunk split), seeds {seeds}, {repeats} noise draws "
             f"per seed, validation RMSE only (the sets' own {VAL_FRACTION:.0%} split; the test split was not scored "
             "into this file). Candidates: the target clip B_y (standardised targets are clipped to [-B_y, B_y]; "
             "the cross channel's sensitivity is B B_y) and the scatter channel's share of the budget (the cross "
             "channel gets the rest); everything else at FedBNR's defaults (linear block a = 0.9 at c = 1 beside "
             "m = 50 random Fourier feature pairs, ridge_scale 0.25). Without DP neither matters. Each cell: mean "
             "validation RMSE relative to today's default (B_y 3, share 0.5; below 1 is better). Rule (fixed before "
             "the runs): the lowest mean over the sets. The issue-16 grid (`fedbnr.md`, pure random features) had "
             "already chosen B_y 1.5 or share 0.3 on two of these sets' validation splits. "
             f"`experiments/run_fedbnr.py --budget` ({seconds:.0f} s on this 2-core {platform.machine()} machine, "
             "one process).", "",
             "| B_y | scatter share | " + " | ".join(sets) + " | **mean** |",
             "|---|---|" + "---:|" * (len(sets) + 1)]
    for t in summary["table"]:
        lines.append(f"| {t['target_clip']:g} | {t['scatter_share']:g} | "
                     + " | ".join(f"{t['ratios'][ds]:.3f}" for ds in sets) + f" | **{t['mean_ratio']:.3f}** |")
    ch = summary["chosen"]
    lines += ["", f"Chosen: B_y = {ch['target_clip']:g}, scatter share {ch['scatter_share']:g}.", ""]
    return "\n".join(lines)


def _publish(out: str, stem: str, payload: dict, text: str, seconds: float, **json_format) -> None:
    """Write ``out/<stem>.json`` (``payload``, non-finite numbers as strings) and ``out/<stem>.md`` (``text``)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(_finite(payload), f, **json_format)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(text)
    print(f"wrote {out}/{stem}.json and {stem}.md ({seconds:.0f} s)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--methods", nargs="*", default=None, help="subset of method names (default: all)")
    parser.add_argument("--sets", default=None,
                        help="comma-separated offline regression sets (e.g. diabetes,star98,fair): FedBNR vs FedAvg "
                             "MLP with settings chosen on a validation split, written on top of fedbnr.md")
    parser.add_argument("--seed-list", default=None, help="with --sets: comma-separated seeds (default 0..seeds-1)")
    parser.add_argument("--no-deep", action="store_true", help="with --sets: leave out the deep-kernel variant")
    parser.add_argument("--lrs", default=None, help="with --sets: FedAvg MLP's learning rates (default FEDAVG_LRS)")
    parser.add_argument("--parts", default="variants,grid,smooth,phase1-clip,fedavg",
                        help="with --sets: which candidates to run (variants: FedBNR's variants; deep: the deep-kernel "
                             "one only; grid: RFF_GRID; smooth: RFF_GRID_SMOOTH; phase1-clip: phase 1 with B_y = 1.5; "
                             "fedavg: FedAvg MLP at --lrs), to split the work over processes")
    parser.add_argument("--rows", default=None, help="with --sets: write the rows to this JSON file, no summary")
    parser.add_argument("--defaults", default=None, metavar="SETS",
                        help="comma-separated offline regression sets (e.g. autompg,grunfeld,macrodata,randhie): FedBNR "
                             "at its default settings against FedAvg MLP (learning rate on validation), written to "
                             "fedbnr_defaults.json/.md")
    parser.add_argument("--feature-rule", default=None, metavar="SETS",
                        help="comma-separated sets (issue 16's: diabetes,star98,fair): FedBNR (RFF)'s validation RMSE "
                             "over feature counts and the default rule's candidate constants, written to "
                             "fedbnr_feature_rule.json/.md")
    parser.add_argument("--repeats", type=int, default=3,
                        help="with --feature-rule or --linear: noise draws per seed at ε = 3")
    parser.add_argument("--linear", default=None, metavar="SETS",
                        help="comma-separated sets (issue 16's: diabetes,star98,fair): FedBNR's validation RMSE with a "
                             "linear block beside its random features (LINEAR_CANDIDATES), no DP and ε = 3; writes "
                             "fedbnr_linear.json/.md")
    parser.add_argument("--budget", default=None, metavar="SETS",
                        help="comma-separated sets (issue 16's: diabetes,star98,fair): FedBNR's validation RMSE at ε = 3 "
                             "over its target clip and budget split (BUDGET_CANDIDATES); writes fedbnr_budget.json/.md")
    parser.add_argument("--merge", nargs="*", default=None,
                        help="summarise rows files written by --sets --rows into fedbnr.json/.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.merge:
        def number(v):  # _finite wrote non-finite numbers as strings
            return float(v) if v in ("inf", "-inf", "nan") else v

        rows = [{k: number(v) for k, v in r.items()} for path in args.merge for r in json.load(open(path))]
        write_sets(rows, args.out, sum(r["seconds"] for r in rows))
        print(f"wrote {args.out}/fedbnr.json and fedbnr.md")
        return
    studies = {"linear": (linear_rows, linear_summary, linear_markdown, LINEAR_CANDIDATES),
               "budget": (budget_rows, budget_summary, budget_markdown, BUDGET_CANDIDATES)}
    for key, (rows_of, summarise_rows, markdown_of, candidates) in studies.items():
        sets = getattr(args, key)
        if not sets:
            continue
        # a choice among candidates on the issue-16 sets' validation splits (10 seeds unless --seed-list)
        seeds = [int(k) for k in args.seed_list.split(",")] if args.seed_list else list(range(10))
        start = time.perf_counter()
        rows = [r for name in sets.split(",") for r in rows_of(name, seeds, args.repeats)]
        seconds = time.perf_counter() - start
        summary = summarise_rows(rows)
        _publish(args.out, f"fedbnr_{key}",
                 {"setting": {"clients": N_CLIENTS, "epsilon": EPSILON, "delta": DELTA, "unit": "example",
                              "val_fraction": VAL_FRACTION, "seeds": seeds, "repeats": args.repeats,
                              "candidates": candidates},
                  "summary": summary, "runs": _columns(rows), "seconds": seconds},
                 markdown_of(summary, rows, seconds, args.repeats), seconds, indent=1)
        return
    if args.feature_rule:
        seeds = [int(k) for k in args.seed_list.split(",")] if args.seed_list else list(range(args.seeds))
        start = time.perf_counter()
        rows = [r for name in args.feature_rule.split(",") for r in feature_rule_rows(name, seeds, args.repeats)]
        seconds = time.perf_counter() - start
        summary = feature_rule_summary(rows)
        _publish(args.out, "fedbnr_feature_rule",
                 {"setting": {"clients": N_CLIENTS, "epsilon": EPSILON, "delta": DELTA, "val_fraction": VAL_FRACTION,
                              "seeds": seeds, "repeats": args.repeats, "constants": RULE_CONSTANTS,
                              "m_sweep": M_SWEEP, "ridges": RULE_RIDGES},
                  "summary": summary, "runs": _columns(rows), "seconds": seconds},
                 feature_rule_markdown(summary, rows, seconds, args.repeats), seconds, separators=(",", ":"))
        return
    if args.defaults:
        seeds = [int(k) for k in args.seed_list.split(",")] if args.seed_list else list(range(args.seeds))
        start = time.perf_counter()
        rows = [r for name in args.defaults.split(",")
                for r in sets_rows(name, seeds, ("FedBNR (defaults)",), FEDAVG_LRS, (), repeats=args.repeats)]
        seconds = time.perf_counter() - start
        selected = select_on_validation(rows)
        checks = verdicts(selected, rows)
        _publish(args.out, "fedbnr_defaults",
                 {"setting": {"clients": N_CLIENTS, "epsilon": EPSILON, "delta": DELTA, "unit": "example",
                              "val_fraction": VAL_FRACTION, "fedavg_lrs": FEDAVG_LRS, "seeds": seeds,
                              "repeats": args.repeats, "linear_share": DEFAULT_LINEAR_SHARE,
                              "linear_scale": DEFAULT_LINEAR_SCALE},
                  "selected": selected, "acceptance": checks, "runs": rows, "seconds": seconds},
                 defaults_markdown(selected, checks, rows, seconds, args.repeats), seconds, indent=2)
        return
    if args.sets:
        seeds = [int(k) for k in args.seed_list.split(",")] if args.seed_list else list(range(args.seeds))
        variants = tuple(v for v in FEDBNR_VARIANTS if not (args.no_deep and "deep" in v))
        lrs = FEDAVG_LRS if args.lrs is None else tuple(float(v) for v in args.lrs.split(",") if v)
        parts = set(args.parts.split(","))
        if "variants" not in parts:
            variants = tuple(v for v in FEDBNR_VARIANTS if "deep" in v and "deep" in parts)
        rff_grid = (RFF_GRID if "grid" in parts else ()) + (RFF_GRID_SMOOTH if "smooth" in parts else ())
        lrs = lrs if "fedavg" in parts else ()
        rows = [r for name in args.sets.split(",")
                for r in sets_rows(name, seeds, variants, lrs, rff_grid, "phase1-clip" in parts)]
        if args.rows:
            with open(args.rows, "w") as f:
                json.dump(_finite(rows), f)
        else:
            write_sets(rows, args.out, sum(r["seconds"] for r in rows))
        return
    start = time.perf_counter()
    rows = []
    for ds, kw in DATASETS.items():
        for seed in range(args.seeds):
            data = make_federated(ds, N_CLIENTS, seed=seed, **kw)
            for method, settings in GRID:
                if args.methods and method not in args.methods:
                    continue
                for private in settings:
                    t = time.perf_counter()
                    res = run_one(method, private, data, seed)
                    row = {"dataset": ds, "seed": seed, "method": method, "private": private,
                           "epsilon_target": EPSILON if private else math.inf, "delta": DELTA,
                           "seconds": time.perf_counter() - t, **res}
                    rows.append(row)
                    print(f"{ds:12s} seed {seed} {method:38s} {'ε=3' if private else 'ε=∞'}  rmse {res['rmse']:.4g}  "
                          f"nll {res['nll']:.3f}  ece {res['ece']:.3f}  ε {res['epsilon']:.3f}  "
                          f"({row['seconds']:.1f} s)", flush=True)
    summary = summarise(rows)
    seconds = time.perf_counter() - start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fedbnr.json"), "w") as f:
        json.dump(_finite({"setting": {"clients": N_CLIENTS, "epsilon": EPSILON, "delta": DELTA, "unit": "example",
                                       "adjacency": "add_remove", "seeds": args.seeds, "datasets": DATASETS},
                           "summary": summary, "runs": rows, "seconds": seconds}), f, indent=2)
    with open(os.path.join(args.out, "fedbnr.md"), "w") as f:
        f.write(markdown(summary, args.seeds, seconds))
    print(f"wrote {args.out}/fedbnr.json and fedbnr.md ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
