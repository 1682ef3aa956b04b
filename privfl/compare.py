"""``privfl compare``: utility under DP against baselines, a grid of algorithms x epsilon targets x seeds.

Each run has its own ledger; a finished run leaves ``runs/<key>.json`` and is not redone when the comparison is
started again (an interrupted run, with a ledger but no result, is redone from a fresh ledger). Outputs, in
``out_dir``: ``results.json`` (``{"results": [...]}``), ``results.csv``, and the figures ``accuracy_vs_epsilon.png``,
``epsilon_per_client.png`` and ``reliability.png``.

Non-private baselines (fedavg, fedprox) run once per seed at epsilon = inf; private algorithms run at every target
(at inf without noise). Client-level DP (dp_fedavg) implies record-level DP at the same epsilon, so it is a valid
baseline under the record-level unit.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from privfl.algorithms import ALGORITHMS, make_algorithm
from privfl.config import FederationConfig, PrivacyConfig
from privfl.data import make_federated
from privfl.errors import ConfigurationError
from privfl.metrics.classification import reliability_bins
from privfl.runtime import Simulation

_FED_FIELDS = {f.name for f in fields(FederationConfig)}
_PRIV_FIELDS = {f.name for f in fields(PrivacyConfig)}


@dataclass(frozen=True)
class CompareConfig:
    """A comparison grid. ``overrides`` maps an algorithm name to FederationConfig/PrivacyConfig fields.

    The defaults are the README's main job: MNIST-5k, 10 clients, Dirichlet(0.1), record level, delta 1e-5,
    epsilon in {1, 3, 8, inf}, every classification algorithm, one seed, 5 rounds of small (32-unit) models, sized to
    finish in under 10 minutes on 2 cores (about 4 measured). FedBNR is a regression method and runs in
    ``experiments/run_fedbnr.py`` instead.
    """

    dataset: str = "mnist5k"
    clients: int = 10
    partition: str = "dirichlet"
    alpha: float = 0.1
    unit: str = "example"
    delta: float = 1e-5
    epsilons: tuple[float, ...] = (1.0, 3.0, 8.0, math.inf)
    seeds: tuple[int, ...] = (0,)
    rounds: int = 5
    algorithms: tuple[str, ...] = ("fedavg", "fedprox", "dp_fedavg", "dpsgd_fedavg", "fola", "hbfl", "fedbnn")
    accountant: str | None = None
    overrides: dict[str, dict[str, Any]] = field(default_factory=lambda: {
        name: {"hidden": [32], "local_epochs": 1} for name in ("fedavg", "fedprox", "dpsgd_fedavg", "fola", "hbfl",
                                                                "fedbnn")})
    out_dir: str = "runs/compare"

    def __post_init__(self):
        object.__setattr__(self, "epsilons", tuple(float(e) for e in self.epsilons))
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        object.__setattr__(self, "algorithms", tuple(self.algorithms))
        unknown = [a for a in self.algorithms if a not in ALGORITHMS]
        if unknown:
            raise ConfigurationError(f"unknown algorithms {unknown}; choose from {sorted(ALGORITHMS)}")
        if not self.epsilons or any(not (e > 0) for e in self.epsilons):
            raise ConfigurationError(f"epsilons must be > 0 (inf allowed), got {self.epsilons}")
        if not self.seeds:
            raise ConfigurationError("seeds must not be empty")
        for name, over in self.overrides.items():
            bad = set(over) - _FED_FIELDS - _PRIV_FIELDS
            if bad:
                raise ConfigurationError(f"[overrides.{name}] has unknown keys {sorted(bad)}")

    @classmethod
    def from_toml(cls, path: str) -> "CompareConfig":
        with open(path, "rb") as f:
            raw = tomllib.load(f)
        known = {f.name for f in fields(cls)}
        bad = set(raw) - known
        if bad:
            raise ConfigurationError(f"{path}: unknown keys {sorted(bad)}; valid keys: {sorted(known)}")
        return cls(**raw)


@dataclass(frozen=True)
class RunSpec:
    algorithm: str
    epsilon: float
    seed: int

    @property
    def key(self) -> str:
        eps = "inf" if math.isinf(self.epsilon) else f"{self.epsilon:g}"
        return f"{self.algorithm}-eps{eps}-seed{self.seed}"


def grid(config: CompareConfig) -> list[RunSpec]:
    specs = []
    for alg in config.algorithms:
        epsilons = config.epsilons if ALGORITHMS[alg].supports_privacy else (math.inf,)
        for eps in epsilons:
            for seed in config.seeds:
                specs.append(RunSpec(alg, eps, seed))
    return specs


def _configs(config: CompareConfig, spec: RunSpec) -> tuple[FederationConfig, PrivacyConfig]:
    cls = ALGORITHMS[spec.algorithm]
    settings = {**cls.defaults, **config.overrides.get(spec.algorithm, {})}
    unit = "client" if spec.algorithm == "dp_fedavg" else config.unit
    priv_kw = {k: v for k, v in settings.items() if k in _PRIV_FIELDS}
    priv_kw.setdefault("unit", unit)
    if config.accountant is not None:
        priv_kw.setdefault("accountant", config.accountant)
    privacy = PrivacyConfig(epsilon=spec.epsilon, delta=config.delta, **priv_kw)
    fed_kw = {k: (tuple(v) if k == "hidden" and v is not None else v) for k, v in settings.items()
              if k in _FED_FIELDS}
    fed = FederationConfig(rounds=config.rounds, seed=spec.seed, **fed_kw)
    return fed, privacy


def run_one(config: CompareConfig, spec: RunSpec, data) -> dict:
    fed, privacy = _configs(config, spec)
    ledger_dir = os.path.join(config.out_dir, "ledgers")
    os.makedirs(ledger_dir, exist_ok=True)
    ledger = os.path.join(ledger_dir, f"{spec.key}.sqlite")
    for suffix in ("", "-wal", "-shm"):  # an interrupted run starts again from a fresh ledger
        if os.path.exists(ledger + suffix):
            os.remove(ledger + suffix)
    algorithm = make_algorithm(spec.algorithm, fed, privacy)
    start = time.perf_counter()
    result = Simulation(algorithm, data, fed, privacy, ledger_path=ledger, run_id=spec.key).run()
    seconds = time.perf_counter() - start
    eps = [v["epsilon"] for v in result.audit["clients"].values()]
    final = result.final
    calibration = algorithm.calibration_predictions(data.test)
    row = {
        "algorithm": spec.algorithm, "epsilon_target": spec.epsilon, "seed": spec.seed,
        "accuracy": final.get("accuracy"), "nll": final.get("nll"), "ece": final.get("ece"),
        "epsilon_spent_max": max(eps) if eps else 0.0, "epsilon_spent_mean": float(np.mean(eps)) if eps else 0.0,
        "delta": config.delta, "unit": privacy.unit, "accountant": result.accountant, "rounds": config.rounds,
        "clients": config.clients, "dataset": config.dataset, "seconds": seconds, "ledger": ledger,
        "accuracy_per_round": [r.metrics.get("accuracy") for r in result.history],
        "epsilon_per_client_per_round": {cid: [e for _, e in series] for cid, series in
                                         _epsilon_series(ledger, config.delta).items()},
    }
    if calibration is not None:  # the predictions the run's ECE is computed on (FedBNN: personalised, own classes)
        row["reliability"] = reliability_bins(*calibration)
    return row


def _epsilon_series(ledger_path: str, delta: float) -> dict[str, list[tuple[int, float]]]:
    from accounting.ledger import PrivacyLedger

    led = PrivacyLedger.open_existing(ledger_path)
    try:
        return led.epsilon_by_round(delta)
    finally:
        led.close()


def compare(config: CompareConfig, progress: bool = True) -> list[dict]:
    """Run (or resume) the grid and write results and figures; returns the result rows."""
    os.makedirs(os.path.join(config.out_dir, "runs"), exist_ok=True)
    specs = grid(config)
    data_by_seed = {}
    rows = []
    bar = None
    if progress:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                       TimeElapsedColumn())
        bar.start()
        task = bar.add_task("compare", total=len(specs))
    try:
        for spec in specs:
            path = os.path.join(config.out_dir, "runs", f"{spec.key}.json")
            if os.path.exists(path):
                with open(path) as f:
                    rows.append(json.load(f))
            else:
                if bar is not None:
                    bar.update(task, description=f"{spec.key}")
                if spec.seed not in data_by_seed:
                    data_by_seed[spec.seed] = make_federated(config.dataset, config.clients,
                                                             partition=config.partition, alpha=config.alpha,
                                                             seed=spec.seed)
                row = run_one(config, spec, data_by_seed[spec.seed])
                tmp = path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(row, f)
                os.replace(tmp, path)  # a run counts as done only once its result is whole on disk
                rows.append(row)
            if bar is not None:
                bar.advance(task)
    finally:
        if bar is not None:
            bar.stop()
    write_outputs(config, rows)
    return rows


SUMMARY_KEYS = ("algorithm", "epsilon_target", "seed", "accuracy", "nll", "ece", "epsilon_spent_max",
                "epsilon_spent_mean", "delta", "unit", "accountant", "rounds", "clients", "dataset", "seconds")


def write_outputs(config: CompareConfig, rows: list[dict]) -> None:
    from privfl.plots import plot_accuracy_vs_epsilon, plot_epsilon_curves, plot_reliability

    with open(os.path.join(config.out_dir, "results.json"), "w") as f:
        json.dump({"results": rows}, f, indent=1)
    with open(os.path.join(config.out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_KEYS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    plot_accuracy_vs_epsilon(rows, os.path.join(config.out_dir, "accuracy_vs_epsilon.png"), delta=config.delta)
    plot_epsilon_curves(rows, os.path.join(config.out_dir, "epsilon_per_client.png"), delta=config.delta)
    plot_reliability(rows, os.path.join(config.out_dir, "reliability.png"))


def summary_table(rows: list[dict]) -> list[dict]:
    """Mean (and std over seeds) per (algorithm, epsilon target)."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["algorithm"], r["epsilon_target"]), []).append(r)
    out = []
    for (alg, eps), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        acc = np.array([r["accuracy"] for r in rs], dtype=float)
        out.append({"algorithm": alg, "epsilon_target": eps, "seeds": len(rs), "accuracy": float(acc.mean()),
                    "accuracy_std": float(acc.std()), "nll": float(np.mean([r["nll"] for r in rs])),
                    "ece": float(np.mean([r["ece"] for r in rs])),
                    "epsilon_spent_max": float(max(r["epsilon_spent_max"] for r in rs)),
                    "epsilon_spent_mean": float(np.mean([r["epsilon_spent_mean"] for r in rs]))})
    return out
