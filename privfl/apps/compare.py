"""``privfl compare``: utility under DP against baselines, a grid of algorithms x epsilon targets x seeds.

Each run has its own ledger; a finished run leaves ``runs/<key>.json`` and is not redone when the comparison is
started again (an interrupted run, with a ledger but no result, is redone from a fresh ledger). A run resumes only
when its settings are identical: each row carries ``settings`` and their hash ``config_hash``, and a finished run of
other settings in the same ``out_dir`` (other rounds, clients, partition, model...) is refused, never silently
reused. Outputs, in ``out_dir``: ``results.json`` (``{"results": [...]}``), ``results.csv``, the figures
``accuracy_vs_epsilon.png``, ``epsilon_per_client.png`` and ``reliability.png``, ``config.toml`` (a copy of the TOML
the comparison was started from), ``config.json`` (the resolved grid) and ``models/<key>.pt`` (each run's trained
model, a torch state_dict). JSON files are strict: infinite numbers are the string ``"inf"``, NaN is ``null``.
Without a test set no client holds (own data without ``test_data``), the test set is the clients' own held-out
records, never charged: every row then carries ``test_from_clients`` and ``test_metrics_privacy`` (its metrics are
not covered by the ledger's epsilon), its reliability diagram has no per-bin counts, and a private grid warns once
(:mod:`privfl.apps.held_out`).

Each row reports ``accuracy``, ``balanced_accuracy``, ``auroc``, ``nll``, ``ece`` and ``selective_accuracy`` (accuracy
on the 80 % of test points the model is most confident about; classification only) of the final model, each round's
privacy signal-to-noise ratio (``snr_per_round``, per noised channel) and its median over the rounds (``snr_median``;
None where the server's sums carry no noise it knows of), the noise
the run's ledger shows applied per channel (``noise_applied``), and ``privfl_version``. With ``val_fraction`` > 0 a
validation split is carved from the training data before partitioning (held by no client, disjoint from the test
set) and each row also reports ``val_accuracy``, ``val_balanced_accuracy``, ``val_auroc``, ``val_nll``, ``val_ece``
and ``val_final`` of the same final model: the numbers to choose settings on, never the test set's. With
``class_prior`` (the classes' public base rates) each row with a global model also reports the balanced,
prior-corrected decisions of its final model (``prior_corrected``, ``prior_balanced_accuracy``;
:mod:`privfl.metrics.decision`).

Non-private baselines (fedavg, fedprox) run once per seed at epsilon = inf; private algorithms run at every target
(at inf without noise). Client-level DP (dp_fedavg) implies record-level DP at the same epsilon, so it is a valid
baseline under the record-level unit.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import shutil
import sys
import time
import tomllib
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from privfl.algorithms import ALGORITHMS, algorithm_defaults, algorithm_options, make_algorithm
from privfl.core.config import FederationConfig, PrivacyConfig, privacy_settings
from privfl.data import make_federated
from privfl.errors import ConfigurationError
from privfl.metrics.classification import reliability_bins
from privfl.metrics.report import applied_noise, strict_json
from privfl.core.options import option_value
from privfl.runtime.engine import Simulation
from privfl.apps.settings import resolve_settings, resolve_unit, split_settings
from privfl.apps.trained_model import save_model, trained_model_description


class CompareNote(UserWarning):
    """Something a comparison accepts but does not use, said once (e.g. ``[overrides.<algorithm>]`` for an
    algorithm outside the grid)."""


_FED_FIELDS = {f.name for f in fields(FederationConfig)}
_PRIV_FIELDS = {f.name for f in fields(PrivacyConfig)}


@dataclass(frozen=True)
class CompareConfig:
    """A comparison grid. ``overrides`` maps an algorithm name to FederationConfig/PrivacyConfig fields and the
    algorithm's own options; ``rounds`` among them is that algorithm's own count (its rows record it in ``rounds`` and
    ``settings``), so a DP-SGD step per round and a FedAvg round need not share one number.

    The defaults: MNIST-5k, 10 clients, Dirichlet(0.1), record level, delta 1e-5, epsilon in {1, 3, 8, inf}, every
    classification algorithm, one seed, 15 rounds of small (32-unit) models (FedBNN with 20 warm-up epochs instead of
    the paper's 50). The README's main job (``make demo``) is ``experiments/configs/default.toml``, whose settings were
    chosen on a validation split (``experiments/tune_default.py``). FedBNR is a regression method and runs in
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
    rounds: int = 15
    algorithms: tuple[str, ...] = ("fedavg", "fedprox", "dp_fedavg", "dpsgd_fedavg", "fola", "hbfl", "fedbnn")
    accountant: str | None = None
    overrides: dict[str, dict[str, Any]] = field(default_factory=lambda: _default_overrides())
    out_dir: str = "runs/compare"
    # your own data instead of ``dataset`` (``privfl.data.own``; partition and alpha do not apply): ``data``, files
    # (a glob, one per client, or one file with ``client_column``) with the ``target`` column, or ``entry``, a
    # ``module:function`` returning (model, clients[, test]); ``test_data`` (else ``test_fraction`` of each client's
    # records, 0.2), ``classes`` (the public label set; else the test file's labels), ``task``, and ``public_data``
    # (standardise features with its statistics). Relative paths in a TOML are relative to the TOML's folder.
    data: str | None = None
    target: str | None = None
    client_column: str | None = None
    client_names: tuple | None = None  # with client_column: the declared roster (a private grid must declare it)
    entry: str | None = None
    test_data: str | None = None
    test_fraction: float | None = None
    classes: tuple | None = None
    task: str = "classification"
    public_data: str | None = None
    # the public design size of a client's data set (DP-SGD's sampling rate and steps when record counts are private)
    # and the public record cap; a private run on your own data must declare client_size (the clients' record counts
    # are private and never set it); a built-in data set has its published size. [overrides.<algorithm>] may set
    # either for one algorithm.
    client_size: int | None = None
    record_cap: int | None = None
    # reference rows, non-private, with FedAvg's settings: "centralised" (one model trained on the clients' pooled
    # data: the ceiling) and "local_only" (each client trains alone on its own data; the mean of their test metrics:
    # the floor every federation must beat; nothing leaves a client, so epsilon spent is 0)
    references: tuple[str, ...] = ()
    # share of a built-in data set carved, before partitioning, as a validation split no client holds (0: none); rows
    # then report val_* metrics, to tune settings on without looking at the test set
    val_fraction: float = 0.0
    # the classes' base rates in the clients' data, a public fact the user declares (never counted from the data):
    # each row with a global model also reports the balanced, prior-corrected decisions of its final model
    # (``prior_corrected``, ``prior_balanced_accuracy``; ``val_`` ones with a validation split), class weights
    # included (privfl.metrics.decision; post-processing, nothing charged)
    class_prior: tuple[float, ...] | None = None
    # named variants of a registered algorithm, each its own row: ``[variants.<label>]`` with ``algorithm =
    # "<registered name>"`` and settings or options that override ``[overrides.<that algorithm>]`` (e.g. DP-FedSGD
    # predicting with FOLA's Laplace posterior beside DP-FedSGD itself); ``algorithms`` lists the label
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the grid's clip for every row (an algorithm's table may still set its own): a number, or "adaptive" (with
    # clip_quantile) for the algorithms that clip adaptively, the others keeping their own clip (a note says which)
    clip: float | str | None = None
    clip_quantile: float | None = None

    def base(self, name: str) -> str:
        """The registered algorithm a row name runs: a variant's ``algorithm``, else the name itself."""
        variant = self.variants.get(name)
        return name if variant is None else variant["algorithm"]

    def settings_for(self, name: str) -> dict[str, Any]:
        """A row's overrides: its algorithm's ``[overrides.<algorithm>]``, then a variant's own keys."""
        variant = self.variants.get(name)
        if variant is None:
            return self.overrides.get(name, {})
        own = {k: v for k, v in variant.items() if k != "algorithm"}
        return {**self.overrides.get(variant["algorithm"], {}), **own}

    def _check_variants(self) -> None:
        if not isinstance(self.variants, dict) or not all(isinstance(v, dict) for v in self.variants.values()):
            raise ConfigurationError("variants must be TOML tables: [variants.<label>] with algorithm = \"<name>\" "
                                     "and key = value lines")
        for label, variant in self.variants.items():
            if not (label.isidentifier() and label == label.lower()):
                raise ConfigurationError(f"[variants.{label}]: a variant's label is a lower-case identifier")
            if label in ALGORITHMS or label in REFERENCES:
                raise ConfigurationError(f"[variants.{label}]: {label!r} is an algorithm's or a reference's name; "
                                         "choose another label")
            base = variant.get("algorithm")
            if base not in ALGORITHMS:
                raise ConfigurationError(f"[variants.{label}] needs algorithm = one of {sorted(ALGORITHMS)}, got "
                                         f"{base!r}")
            _check_settings(f"[variants.{label}]", base, {k: v for k, v in variant.items() if k != "algorithm"})

    def _check_types(self) -> None:
        """Each scalar setting has its type and range (a TOML ``rounds = "x"`` is refused here, naming the key)."""
        for key in ("rounds", "clients"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{key} must be an integer >= 1, got {value!r}")
        for key, low, high in (("delta", 0.0, 1.0), ("alpha", 0.0, math.inf)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high:
                raise ConfigurationError(f"{key} must be a number in ({low:g}, {high:g}), got {value!r}")
        for key in ("client_size", "record_cap"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigurationError(f"{key} must be an integer >= 1, got {value!r}")
        value = self.val_fraction
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ConfigurationError(f"val_fraction must be a number in [0, 1), got {value!r}")
        if self.unit not in ("client", "example"):
            raise ConfigurationError(f"unit must be 'client' or 'example', got {self.unit!r}")
        clip = self.clip
        if clip is not None and clip != "adaptive" and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                                        or not math.isfinite(clip) or clip <= 0):
            raise ConfigurationError(f"clip must be a number > 0 or \"adaptive\", got {clip!r}")
        if self.clip_quantile is not None and clip != "adaptive":
            raise ConfigurationError("clip_quantile is adaptive clipping's target quantile: give it with clip = "
                                     "\"adaptive\" (or in an algorithm's table beside its clip = \"adaptive\")")
        for key in ("dataset", "partition", "out_dir", "task"):
            if not isinstance(getattr(self, key), str):
                raise ConfigurationError(f"{key} must be a string, got {getattr(self, key)!r}")
        for key in ("epsilons", "seeds", "algorithms", "references"):
            if isinstance(getattr(self, key), (str, bytes)) or not hasattr(getattr(self, key), "__iter__"):
                raise ConfigurationError(f"{key} must be a list, got {getattr(self, key)!r}")
        if not isinstance(self.overrides, dict) or not all(isinstance(v, dict) for v in self.overrides.values()):
            raise ConfigurationError("overrides must be TOML tables: [overrides.<algorithm>] with key = value lines")

    @property
    def own_data(self) -> bool:
        return self.data is not None or self.entry is not None

    def __post_init__(self):
        self._check_types()
        object.__setattr__(self, "epsilons", tuple(float(e) for e in self.epsilons))
        bad_seeds = [s for s in self.seeds if isinstance(s, bool) or not isinstance(s, int) or s < 0]
        if bad_seeds:
            raise ConfigurationError(f"seeds must be integers >= 0, e.g. seeds = [0, 1, 2]; got {bad_seeds[0]!r}")
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        object.__setattr__(self, "algorithms", tuple(self.algorithms))
        self._check_variants()
        unknown = [a for a in self.algorithms if a not in ALGORITHMS and a not in self.variants]
        if unknown:
            raise ConfigurationError(f"unknown algorithms {unknown}; choose from {sorted(ALGORITHMS)}"
                                     + (f" or the variants {sorted(self.variants)}" if self.variants else ""))
        if not self.epsilons or any(not (e > 0) for e in self.epsilons):
            raise ConfigurationError(f"epsilons must be > 0 (inf allowed), got {self.epsilons}")
        if not self.seeds:
            raise ConfigurationError("seeds must not be empty")
        if self.classes is not None:
            object.__setattr__(self, "classes", tuple(self.classes))
        if self.class_prior is not None:
            prior = self.class_prior
            if (isinstance(prior, (str, bytes)) or not hasattr(prior, "__iter__")
                    or not all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in prior)):
                raise ConfigurationError(f"class_prior must be a list of numbers, one base rate per class (e.g. "
                                         f"[0.96, 0.04]), got {prior!r}")
            object.__setattr__(self, "class_prior", tuple(float(p) for p in prior))
        object.__setattr__(self, "references", tuple(self.references))
        bad_refs = sorted(set(self.references) - set(REFERENCES))
        if bad_refs:
            raise ConfigurationError(f"references {bad_refs} unknown; choose from {list(REFERENCES)}")
        if self.data is not None and self.entry is not None:
            raise ConfigurationError("data and entry both give the clients' data; choose one")
        if self.data is not None and self.target is None:
            raise ConfigurationError("data needs target, the name of the label (or target) column")
        if self.client_names is not None:
            if self.client_column is None:
                raise ConfigurationError("client_names declares the clients of client_column; add client_column or "
                                         "drop client_names")
            object.__setattr__(self, "client_names", tuple(str(n) for n in self.client_names))
        if (self.data is not None and self.client_column is not None and self.client_names is None
                and any(math.isfinite(e) for e in self.epsilons)):
            raise ConfigurationError("a private grid on one file split by client_column declares its clients: add "
                                     "client_names = [\"a\", \"b\", ...] (the roster may not be read off the rows)")
        if not self.own_data:
            given = [k for k in ("target", "client_column", "test_data", "test_fraction", "classes", "public_data")
                     if getattr(self, k) is not None]
            if given:
                raise ConfigurationError(f"{given} describe your own data: add data (files) or entry "
                                         "(module:function), or drop them")
        if self.own_data and self.val_fraction:
            raise ConfigurationError("val_fraction carves a validation split from a built-in dataset; with your own "
                                     "data leave it out (or 0)")
        uses_alignment = [a for a in self.algorithms if getattr(ALGORITHMS[self.base(a)], "uses_alignment", False)]
        if self.own_data and uses_alignment:
            raise ConfigurationError(f"{uses_alignment} need a public alignment set carved from a built-in data set; "
                                     "with your own data leave them out of algorithms")
        if self.clients < 2:
            raise ConfigurationError(f"clients = {self.clients}: a federation needs at least 2 clients")
        if self.overrides == _default_overrides():  # the built-in sizes: only those of the grid's algorithms apply
            bases = {self.base(a) for a in self.algorithms}
            object.__setattr__(self, "overrides", {k: v for k, v in self.overrides.items() if k in bases})
        unknown = sorted(set(self.overrides) - set(ALGORITHMS))
        if unknown:
            raise ConfigurationError(f"[overrides.{unknown[0]}] names no algorithm; choose from {sorted(ALGORITHMS)}")
        for name, over in self.overrides.items():
            _check_settings(f"[overrides.{name}]", name, over)
        if self.clip == "adaptive":
            fixed = sorted({self.base(a) for a in self.algorithms
                            if ALGORITHMS[self.base(a)].supports_privacy
                            and not getattr(ALGORITHMS[self.base(a)], "adaptive_clipping", False)})
            if fixed:
                able = sorted(n for n, c in ALGORITHMS.items() if getattr(c, "adaptive_clipping", False))
                warnings.warn(CompareNote(f"clip = \"adaptive\" applies to the grid's algorithms that clip "
                                          f"adaptively ({able}); {fixed} keep their own clip"), stacklevel=3)
        stray = sorted(set(self.overrides) - {self.base(a) for a in self.algorithms})
        if stray:  # a TOML kept for a larger grid: its other sections wait for their algorithms
            warnings.warn(CompareNote(
                f"{', '.join(f'[overrides.{a}]' for a in stray)} {'is' if len(stray) == 1 else 'are'} for "
                f"{'an algorithm' if len(stray) == 1 else 'algorithms'} not in the grid (algorithms = "
                f"{list(self.algorithms)}): not used by this comparison (checked all the same)"), stacklevel=3)

    @classmethod
    def from_toml(cls, path: str) -> "CompareConfig":
        if not os.path.isfile(path):
            what = "is a directory" if os.path.isdir(path) else "does not exist"
            raise ConfigurationError(f"compare config {path} {what}; pass a TOML file (see experiments/configs/)")
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigurationError(f"compare config {path} is not valid TOML: {exc}") from None
        except UnicodeDecodeError:
            raise ConfigurationError(f"compare config {path} is not a text (TOML) file") from None
        known = {f.name for f in fields(cls)}
        folder = os.path.dirname(os.path.abspath(path))
        for key in ("data", "test_data", "public_data"):  # relative to the TOML's folder
            if isinstance(raw.get(key), str) and not os.path.isabs(raw[key]):
                raw[key] = os.path.join(folder, raw[key])
        if ("data" in raw or "entry" in raw) and "clients" not in raw:
            raw["clients"] = _count_clients(raw)
        bad = set(raw) - known
        if bad:
            raise ConfigurationError(f"{path}: unknown keys {sorted(bad)}; valid keys: {sorted(known)}")
        try:
            return cls(**raw)
        except (ConfigurationError, TypeError, ValueError) as exc:
            raise ConfigurationError(f"compare config {path}: {exc}") from None


#: the reference rows ``references`` may ask for
REFERENCES = ("centralised", "local_only")


#: settings an algorithm's table may not set: the grid's own (its axes, and its delta), with the top-level key for each
_GRID_KEYS = {"epsilon": "epsilons", "seed": "seeds", "delta": "delta"}


def _check_settings(table: str, algorithm: str, settings: dict) -> None:
    """A TOML table of one algorithm's settings ([overrides.<algorithm>] or [variants.<label>]): its rounds, and no
    key that is neither a federation or privacy setting nor one of the algorithm's options."""
    rounds = settings.get("rounds", 1)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ConfigurationError(f"{table} rounds must be an integer >= 1, got {rounds!r}")
    grid = [key for key in _GRID_KEYS if key in settings]
    if grid:  # each row's epsilon and seed are its place in the grid, and delta is every row's
        key = grid[0]
        raise ConfigurationError(f"{table} sets {key}, which the grid sets for every algorithm: give it as "
                                 f"{_GRID_KEYS[key]} = ... at the top level of the TOML (or compare that algorithm in "
                                 "a grid of its own)")
    bad = set(settings) - _FED_FIELDS - _PRIV_FIELDS - set(algorithm_options(algorithm))
    if bad:
        raise ConfigurationError(f"{table} has unknown keys {sorted(bad)}; it takes federation and privacy settings "
                                 f"and {algorithm}'s options {list(algorithm_options(algorithm))}")


def _count_clients(raw: dict) -> int:
    """How many clients the own data of a TOML holds (``clients`` then need not be written)."""
    from privfl.data.own import client_tables, load_entry

    try:
        if raw.get("data") is not None:
            names = raw.get("client_names")
            if names is not None:
                return len(names)
            return len(client_tables(raw["data"], raw.get("client_column"), flag="data ="))
        return len(load_entry(str(raw["entry"]), flag="entry =").clients)
    except ConfigurationError:
        return 10  # the grid's own checks report the problem with the data


def _default_overrides() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {name: {"hidden": [32], "local_epochs": 1}
                                      for name in ("fedavg", "fedprox", "dpsgd_fedavg", "fola", "hbfl", "fedbnn")}
    out["fedbnn"]["warmup_epochs"] = 20  # the paper's 50 warm-up epochs would be most of the grid's time
    return out


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
        epsilons = config.epsilons if ALGORITHMS[config.base(alg)].supports_privacy else (math.inf,)
        for eps in epsilons:
            for seed in config.seeds:
                specs.append(RunSpec(alg, eps, seed))
    specs += [RunSpec(kind, math.inf, seed) for kind in config.references for seed in config.seeds]
    return specs


def _configs(config: CompareConfig, spec: RunSpec) -> tuple[FederationConfig, PrivacyConfig]:
    if spec.algorithm in REFERENCES:  # FedAvg's model and local training, without DP
        spec = RunSpec("fedavg", math.inf, spec.seed)
    base = config.base(spec.algorithm)
    defaults = resolve_settings(base, {}, image=_image_input(config))
    entry_model = _entry(config.entry).model if config.entry is not None else {}
    over = config.settings_for(spec.algorithm)
    # the grid's clip, under the algorithm's own table; "adaptive" only where the algorithm clips adaptively
    grid_clip = {}
    if config.clip is not None and (config.clip != "adaptive"
                                    or getattr(ALGORITHMS.get(base), "adaptive_clipping", False)):
        grid_clip = {"clip": config.clip, "clip_quantile": config.clip_quantile}
    if over == _default_overrides().get(base):  # the built-in sizes give way to the entry point's model
        settings = {**defaults, **grid_clip, **over, **entry_model}
    else:
        settings = {**defaults, **entry_model, **grid_clip, **over}
    # clip = "adaptive" (with clip_quantile) in the TOML's tables: resolved as every front end resolves it
    clips = resolve_settings(base, {"clip": settings.get("clip"), "clip_quantile": settings.get("clip_quantile")},
                             image=_image_input(config))
    settings["clip"], settings["clip_quantile"] = clips["clip"], clips.get("clip_quantile")
    # an algorithm built for fewer units (DP-FedAvg: client level) uses its own
    unit = resolve_unit(base, config.unit, adapt=True)
    fed_kw, priv_kw = split_settings(settings)
    priv_kw.setdefault("unit", unit)
    if config.accountant is not None:
        priv_kw.setdefault("accountant", config.accountant)
    privacy = PrivacyConfig(epsilon=spec.epsilon, delta=config.delta, **priv_kw)
    fed_kw.setdefault("rounds", config.rounds)  # [overrides.<algorithm>] rounds: that algorithm's own count
    for key in ("client_size", "record_cap"):
        if getattr(config, key) is not None:
            fed_kw.setdefault(key, getattr(config, key))
    fed = FederationConfig(seed=spec.seed, **fed_kw)
    return fed, privacy


def _image_input(config: CompareConfig) -> bool:
    """Whether the grid's inputs are images (C, H, W): a built-in image data set; own data comes as tables (rows of
    features), never images."""
    from privfl.data.federated import is_image_dataset

    return not config.own_data and is_image_dataset(config.dataset)


def run_rounds(config: CompareConfig, spec: RunSpec) -> int:
    """The rounds ``spec`` runs: the grid's ``rounds``, or its algorithm's ``rounds`` override."""
    return _configs(config, spec)[0].rounds


def _options(config: CompareConfig, algorithm: str) -> dict[str, Any]:
    """The algorithm's own options among its overrides (normalised as ``privfl run --option`` values are:
    :func:`privfl.core.options.option_value`, lists from TOML become tuples), and the user's own model when the ``entry``
    point returned one (:func:`_entry_model`)."""
    base = config.base(algorithm)
    names = set(algorithm_options(base)) if base in ALGORITHMS else set()
    return {**{k: option_value(v) for k, v in config.settings_for(algorithm).items()
               if k in names and k not in _FED_FIELDS and k not in _PRIV_FIELDS}, **_entry_model(config, base)}


def _entry_model(config: CompareConfig, algorithm: str) -> dict[str, Any]:
    """The user's own training objects the ``entry`` point returned (its model, an ``nn.Module`` or a factory, and
    its loss, optimizer and metrics), as keyword arguments of ``algorithm``; a clear refusal for an algorithm that
    does not take them (it builds its own models, or trains with its own loss)."""
    from privfl.algorithms import user_training_options

    given = _entry(config.entry).training if config.entry is not None else {}
    if not given:
        return {}
    return user_training_options(given, algorithm, f"entry = {config.entry!r}",
                                 "list only algorithms that train them ({})")


def run_settings(config: CompareConfig, spec: RunSpec) -> dict:
    """Everything that defines one run of the grid (algorithm and its options, federation, privacy, data): what its
    row carries as ``settings``, and what its resume hash covers."""
    fed, privacy = _configs(config, spec)
    name = "fedavg" if spec.algorithm in REFERENCES else spec.algorithm
    defaults = algorithm_defaults(config.base(name), image=_image_input(config))
    return strict_json({"algorithm": spec.algorithm, "algorithm_options": {**defaults, **config.settings_for(name)},
                        "federation": asdict(fed), "privacy": privacy_settings(privacy),
                        "data": _data_settings(config)})


def _data_settings(config: CompareConfig) -> dict:
    if not config.own_data:
        out = {"dataset": config.dataset, "clients": config.clients, "partition": config.partition,
               "alpha": config.alpha if config.partition == "dirichlet" else None}
        if config.val_fraction:  # only when set, so runs finished before the key existed still resume
            out["val_fraction"] = float(config.val_fraction)
        if config.class_prior is not None:  # likewise
            out["class_prior"] = list(config.class_prior)
        return out
    keys = ("data", "target", "client_column", "entry", "test_data", "test_fraction", "classes", "task", "public_data")
    out = {"clients": config.clients, "partition": "given", **{k: getattr(config, k) for k in keys}}
    if config.client_names is not None:  # only when set, so runs finished before the key existed still resume
        out["client_names"] = list(config.client_names)
    if config.class_prior is not None:
        out["class_prior"] = list(config.class_prior)
    return out


_ENTRIES: dict[str, Any] = {}


def _entry(spec: str):
    """The entry point's result, called once per process and entry."""
    from privfl.data.own import load_entry

    if spec not in _ENTRIES:
        _ENTRIES[spec] = load_entry(spec, flag="entry =")
    return _ENTRIES[spec]


def _test_from_clients(config: CompareConfig) -> bool:
    """Whether the grid's test set is held out of the clients' own records (own data without a test file, and an
    entry point that returns no test set)."""
    if not config.own_data or config.test_data is not None:
        return False
    return config.entry is None or _entry(config.entry).test is None


def _check_declared_sizes(config: CompareConfig, specs) -> None:
    """Refuse, before any run of the grid charges anything, a run (the grid's settings or an algorithm's
    ``[overrides]``) that declares record counts public while the test set is held out of the clients' own records
    (:func:`privfl.core.public.check_declared_sizes`)."""
    from privfl.core.public import DECLARED_SIZES_HELD_OUT, sizes_are_public

    if not _test_from_clients(config):
        return
    for spec in specs:
        if spec.algorithm in REFERENCES:
            continue
        if sizes_are_public(_configs(config, spec)[1]):
            raise ConfigurationError(f"run {spec.key}: {DECLARED_SIZES_HELD_OUT}")


def federation(config: CompareConfig, seed: int):
    """The federation one seed of the grid runs on: a built-in data set partitioned by ``seed``, or the own data
    (``seed`` draws the held-out split when there is no test file)."""
    if not config.own_data:
        return make_federated(config.dataset, config.clients, partition=config.partition, alpha=config.alpha,
                              seed=seed, val_fraction=float(config.val_fraction))
    from privfl.data.own import client_tables, federated_from_tables, read_table

    if config.data is not None:
        clients, test, name = client_tables(config.data, config.client_column, flag="data =",
                                            names=config.client_names, names_flag="client_names ="), None, "own"
    else:
        got = _entry(config.entry)
        clients, test, name = got.clients, got.test, config.entry
    if config.test_data is not None:
        test = read_table(config.test_data, "test_data =")
    public = None if config.public_data is None else read_table(config.public_data, "public_data =")
    data = federated_from_tables(clients, config.target, task=config.task, classes=config.classes, test=test,
                                 test_fraction=0.2 if config.test_fraction is None else config.test_fraction,
                                 seed=seed, standardize="public" if public is not None else None, public=public,
                                 name=name)
    if len(data.train_parts) != config.clients:
        raise ConfigurationError(f"clients = {config.clients} but the data has {len(data.train_parts)} clients; set "
                                 f"clients = {len(data.train_parts)} (or leave it out of the TOML)")
    return data


def settings_hash(settings: dict) -> str:
    """A short SHA-256 of the settings' canonical JSON."""
    text = json.dumps(settings, sort_keys=True, default=str, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_one(config: CompareConfig, spec: RunSpec, data, progress=None) -> dict:
    """One run of the grid: its row (metrics, privacy spent, settings, noise applied), its ledger, and its trained model
    in ``models/<key>.pt``. ``progress`` is called with each round's record."""
    from privfl import __version__

    if spec.algorithm in REFERENCES:
        return run_reference(config, spec, data, progress)
    fed, privacy = _configs(config, spec)
    ledger_dir = os.path.join(config.out_dir, "ledgers")
    os.makedirs(ledger_dir, exist_ok=True)
    ledger = os.path.join(ledger_dir, f"{spec.key}.sqlite")
    for suffix in ("", "-wal", "-shm"):  # an interrupted run starts again from a fresh ledger
        if os.path.exists(ledger + suffix):
            os.remove(ledger + suffix)
    algorithm = make_algorithm(config.base(spec.algorithm), fed, privacy, **_options(config, spec.algorithm))
    rule = _prior_rule(config, algorithm, data)  # refused here, before the run charges anything
    start = time.perf_counter()
    sim = Simulation(algorithm, data, fed, privacy, ledger_path=ledger, run_id=spec.key, progress=progress)
    result = sim.run()
    seconds = time.perf_counter() - start
    eps = [v["epsilon"] for v in result.audit["clients"].values()]
    final = result.final
    diagnostic = sim.diagnostic_algorithm()  # the server half with every client's own state (a simulation view)
    calibration = diagnostic.calibration_predictions(data.test) if len(data.test) else None
    validation = _validation_metrics(diagnostic, data)
    settings = run_settings(config, spec)
    row = {
        "algorithm": spec.algorithm, "epsilon_target": spec.epsilon, "seed": spec.seed,
        "accuracy": final.get("accuracy"), "nll": final.get("nll"), "ece": final.get("ece"),
        "epsilon_spent_max": max(eps) if eps else 0.0, "epsilon_spent_mean": float(np.mean(eps)) if eps else 0.0,
        "delta": config.delta, "unit": privacy.unit, "accountant": result.accountant, "rounds": fed.rounds,
        "clients": config.clients, "dataset": data.name if config.own_data else config.dataset, "seconds": seconds,
        "ledger": ledger,
        "accuracy_per_round": [r.metrics.get("accuracy") for r in result.history],
        "snr_per_round": [dict(r.snr) for r in result.history], "snr_median": snr_median(result.history),
        "epsilon_per_client_per_round": {cid: [e for _, e in series] for cid, series in (
            sim.epsilon_by_round(config.delta) if result.phases else _epsilon_series(ledger, config.delta)).items()},
        "balanced_accuracy": final.get("balanced_accuracy"), "auroc": final.get("auroc"),
        "selective_accuracy": final.get("selective_accuracy"), "final": final,
        "noise_multipliers": result.noise_multipliers,
        "noise_applied": ({p.name: applied_noise(p.ledger.charges()) for p in sim.phase_runs} if result.phases
                          else applied_noise(sim.ledger.charges())),
        "settings": settings, "config_hash": settings_hash(settings), "privfl_version": __version__,
        "model_path": save_model(diagnostic, os.path.join(config.out_dir, "models", f"{spec.key}.pt")),
        "model": trained_model_description(diagnostic, fed, _entry_model(config, config.base(spec.algorithm)).get("model")),
    }
    if calibration is not None:  # the predictions the run's ECE is computed on (FedBNN: personalised, own classes)
        row["reliability"] = reliability_bins(*calibration)
    if validation is not None:
        row.update(_val_columns(validation))
    if rule is not None:
        row.update(_prior_columns(rule, diagnostic, data))
    return row


def _prior_rule(config: CompareConfig, algorithm, data):
    """The run's prior-corrected decision rule (``class_prior``, checked against the data's public label set, with
    the class weights ``algorithm`` trains with), or None: no ``class_prior``, or an algorithm without a global
    model's probabilities (FedBNN), whose rows report without it."""
    from privfl.algorithms.base import FederatedAlgorithm
    from privfl.apps.settings import resolve_prior_correction

    if config.class_prior is None or type(algorithm).predict_proba is FederatedAlgorithm.predict_proba:
        return None
    return resolve_prior_correction(config.class_prior, algorithm, task=data.test.task,
                                    num_classes=data.num_classes, what="class_prior")


def _prior_columns(rule, diagnostic, data) -> dict[str, Any]:
    """``prior_corrected`` (the rule and its decision metrics on the test split), ``prior_balanced_accuracy``, and
    their ``val_`` twins on the validation split when there is one."""
    from privfl.metrics.report import prior_corrected

    out = {}
    for prefix, split in (("", data.test), ("val_", getattr(data, "val", None))):
        corrected = (None if split is None or not len(split)
                     else prior_corrected(rule, diagnostic.predict_proba(split), split.y))
        if corrected is not None:
            out[f"{prefix}prior_corrected"] = corrected
            out[f"{prefix}prior_balanced_accuracy"] = corrected["metrics"]["balanced_accuracy"]
    return out


#: the validation columns a row carries when the grid has a validation split (``val_fraction`` > 0)
VAL_KEYS = ("val_accuracy", "val_balanced_accuracy", "val_auroc", "val_nll", "val_ece")


def _validation_metrics(algorithm, data) -> dict[str, float] | None:
    """The final model's metrics on the validation split, computed as the run's test metrics are (the global model's
    ``evaluate`` and the clients' own models' ``local_metrics``); None without a validation split."""
    if getattr(data, "val", None) is None:
        return None
    return {**algorithm.evaluate(data.val), **algorithm.local_metrics(data.val)}


def _val_columns(validation: dict[str, float]) -> dict[str, Any]:
    return {**{key: validation.get(key[len("val_"):]) for key in VAL_KEYS}, "val_final": validation}


def run_reference(config: CompareConfig, spec: RunSpec, data, progress=None) -> dict:
    """A reference row (see ``CompareConfig.references``): FedAvg without DP on the clients' pooled data
    (``centralised``), or on each client's data alone (``local_only``, metrics averaged over clients)."""
    from dataclasses import replace

    from privfl import __version__
    from privfl.data import ArrayDataset

    fed, privacy = _configs(config, spec)
    parts = data.train_parts
    if spec.algorithm == "centralised":
        first = parts[0]
        pooled = ArrayDataset(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]), first.task,
                              first.num_classes, f"{data.name}-pooled", first.target_offset, first.target_scale)
        federations = [replace(data, train_parts=[pooled])]
    else:
        federations = [replace(data, train_parts=[p]) for p in parts]
    start = time.perf_counter()
    finals, per_round, vals = [], [], []
    for k, fed_data in enumerate(federations):
        report = progress if k == len(federations) - 1 else None  # the bar counts the grid's rounds once
        sim = Simulation(make_algorithm("fedavg", fed, privacy, **_entry_model(config, "fedavg")), fed_data, fed,
                         privacy, run_id=spec.key, progress=report)
        result = sim.run()
        finals.append(result.final)
        per_round.append([r.metrics.get("accuracy") for r in result.history])
        vals.append(_validation_metrics(sim.diagnostic_algorithm(), fed_data))
    keys = sorted(set.intersection(*(set(f) for f in finals)))
    final = {key: float(np.mean([f[key] for f in finals])) for key in keys}
    spent = math.inf if spec.algorithm == "centralised" else 0.0  # pooling raw data vs. nothing leaving a client
    settings = run_settings(config, spec)
    return {
        "algorithm": spec.algorithm, "epsilon_target": math.inf, "seed": spec.seed,
        "accuracy": final.get("accuracy"), "nll": final.get("nll"), "ece": final.get("ece"),
        "epsilon_spent_max": spent, "epsilon_spent_mean": spent, "delta": config.delta, "unit": None,
        "accountant": None, "rounds": fed.rounds, "clients": config.clients,
        "dataset": data.name if config.own_data else config.dataset, "seconds": time.perf_counter() - start,
        "ledger": None, "accuracy_per_round": [None if any(v is None for v in r) else float(np.mean(r))
                               for r in zip(*per_round)],
        "epsilon_per_client_per_round": {}, "balanced_accuracy": final.get("balanced_accuracy"),
        "auroc": final.get("auroc"), "selective_accuracy": final.get("selective_accuracy"), "final": final,
        "noise_multipliers": None, "noise_applied": {},
        "settings": settings, "config_hash": settings_hash(settings), "privfl_version": __version__,
        "reference": spec.algorithm,
        **({} if vals[0] is None else _val_columns({key: float(np.mean([v[key] for v in vals]))
                                                    for key in sorted(set.intersection(*(set(v) for v in vals)))})),
    }


def _revive(obj, key: str | None = None):
    """A row read back from strict JSON: "inf" strings are floats again, null metrics NaN."""
    if isinstance(obj, dict):
        return {k: _revive(v, k) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_revive(v, key) for v in obj]
    if isinstance(obj, str) and obj in ("inf", "-inf"):
        return float(obj)
    if obj is None and key in _NUMERIC_KEYS:
        return math.nan
    return obj


_NUMERIC_KEYS = {"accuracy", "balanced_accuracy", "auroc", "nll", "ece", "selective_accuracy", "confidence",
                 "epsilon_spent_max",
                 "epsilon_spent_mean", "epsilon_target", "prior_balanced_accuracy", "val_prior_balanced_accuracy",
                 *VAL_KEYS}


def _epsilon_series(ledger_path: str, delta: float) -> dict[str, list[tuple[int, float]]]:
    from privfl.accounting.ledger import PrivacyLedger

    led = PrivacyLedger.open_existing(ledger_path)
    try:
        return led.epsilon_by_round(delta)
    finally:
        led.close()


def _stale(path: str, row: dict, settings: dict) -> str | None:
    """Why a finished run's row cannot be reused for ``settings``, or None when it can."""
    if row.get("config_hash") == settings_hash(settings):
        return None
    old = strict_json(row.get("settings"))
    if not isinstance(old, dict):
        return f"{path} was written without its settings (an older privfl) and cannot be checked"
    diffs = []
    for group in sorted(set(old) | set(settings)):
        a, b = old.get(group), settings.get(group)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [f"{group}.{k}: {a.get(k)!r} then, {b.get(k)!r} now" for k in sorted(set(a) | set(b))
                      if a.get(k) != b.get(k)]
        elif a != b:
            diffs.append(f"{group}: {a!r} then, {b!r} now")
    return f"{path} holds a run of other settings ({'; '.join(diffs[:4]) or 'settings differ'})"


def _mark_held_out(row: dict, held_out: bool) -> dict:
    """A result row as published (``runs/<key>.json``, ``results.json``/``.csv``, the figures): where the test set
    is the clients' own held-out records (``held_out``), never charged, its metrics keep their keys but carry
    :data:`privfl.apps.held_out.MARK` (not covered by the ledger's epsilon), and the reliability diagram loses its
    per-bin counts, which sum to the held-out set's size (:mod:`privfl.apps.held_out`)."""
    if not held_out:
        return row
    from privfl.apps.held_out import MARK, without_counts

    out = {**row, **MARK}
    if isinstance(row.get("reliability"), dict):
        out["reliability"] = without_counts(row["reliability"])
    return out


def compare(config: CompareConfig, progress: bool = True, toml_path: str | None = None) -> list[dict]:
    """Run (or resume) the grid and write results and figures; returns the result rows. A finished run is reused
    only if its settings are identical; otherwise nothing is run and a :class:`ConfigurationError` says which
    output folder to change. ``toml_path``, the TOML the config came from, is copied to ``out_dir/config.toml``."""
    specs = grid(config)
    for alg in config.algorithms:  # an entry's own model is refused for an algorithm that cannot train it, up front
        _entry_model(config, config.base(alg))
    _check_declared_sizes(config, specs)
    held_out = _test_from_clients(config)
    if held_out and any(math.isfinite(s.epsilon) for s in specs if s.algorithm not in REFERENCES):
        from privfl.apps.held_out import WARNING

        print(f"compare: warning: {WARNING}", file=sys.stderr, flush=True)
    done: dict[str, dict] = {}
    for spec in specs:  # check every finished run before running anything
        path = os.path.join(config.out_dir, "runs", f"{spec.key}.json")
        if os.path.exists(path):
            try:
                with open(path) as f:
                    row = _revive(json.load(f))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ConfigurationError(f"{path} is not a result file (corrupt JSON); delete it to rerun that run, or "
                                         "pass another --out-dir") from None
            why = _stale(path, row, run_settings(config, spec))
            if why is not None:
                raise ConfigurationError(f"{why}; resuming would mix results of different runs: pass another --out-dir "
                                         f"(or out_dir in the TOML), or delete {config.out_dir} to start again")
            done[spec.key] = row
    os.makedirs(os.path.join(config.out_dir, "runs"), exist_ok=True)
    _write_config(config, toml_path)
    pending = [s for s in specs if s.key not in done]
    data_by_seed = {}
    rows = []
    bar = None
    if progress and pending:
        total = sum(run_rounds(config, s) for s in pending)
        if sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            bar = Progress(TextColumn("{task.description}"), BarColumn(),
                           TextColumn("{task.completed}/{task.total} rounds"), TimeElapsedColumn(), TextColumn("ETA"),
                           TimeRemainingColumn())
        else:  # a log file, CI: a live bar would print nothing until the end
            bar = LineProgress()
        bar.start()
        task = bar.add_task("compare", total=total)
    try:
        for i, spec in enumerate(specs):
            if spec.key in done:
                rows.append(_mark_held_out(done[spec.key], held_out))
                continue
            path = os.path.join(config.out_dir, "runs", f"{spec.key}.json")
            position = pending.index(spec) + 1
            if bar is not None:
                bar.update(task, description=f"run {position}/{len(pending)} {spec.key}")
            if spec.seed not in data_by_seed:
                data_by_seed[spec.seed] = federation(config, spec.seed)
            kwargs = {}
            if bar is not None:
                kwargs["progress"] = lambda rec, _bar=bar, _task=task: _bar.advance(_task)
            row = _mark_held_out(run_one(config, spec, data_by_seed[spec.seed], **kwargs), held_out)
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(strict_json(row), f, allow_nan=False)
            os.replace(tmp, path)  # a run counts as done only once its result is whole on disk
            rows.append(row)
    finally:
        if bar is not None:
            bar.stop()
    write_outputs(config, rows)
    return rows


#: seconds between two of :class:`LineProgress`'s round lines within one run (a run's start is always reported)
PROGRESS_INTERVAL = 30.0


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class LineProgress:
    """The comparison's progress as plain lines on stdout, for output that is not a terminal (a log file, CI), where
    a live bar shows nothing until the end: a line when each run starts, then one at most every
    :data:`PROGRESS_INTERVAL` seconds while it runs, and one at the end; each with the rounds done of the total, the
    time elapsed and an ETA. It offers the calls :func:`compare` makes of rich's ``Progress``."""

    def __init__(self, stream=None, interval: float | None = None):
        self.stream = stream
        self.interval = PROGRESS_INTERVAL if interval is None else float(interval)
        self.total, self.done, self.description = 0, 0, "compare"
        self._start = self._last = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()
        self._last = -math.inf

    def add_task(self, description: str, total: int) -> int:
        self.description, self.total = description, int(total)
        return 0

    def update(self, task: int, description: str) -> None:
        self.description = description
        self._line(force=True)

    def advance(self, task: int) -> None:
        self.done += 1
        self._line()

    def stop(self) -> None:
        elapsed = time.perf_counter() - self._start
        self._print(f"compare: {self.done}/{self.total} rounds done in {_duration(elapsed)}")

    def _line(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        elapsed = now - self._start
        eta = elapsed / self.done * (self.total - self.done) if self.done else math.nan
        self._print(f"compare: {self.description}: {self.done}/{self.total} rounds, elapsed {_duration(elapsed)}, "
                    f"ETA {_duration(eta)}")

    def _print(self, text: str) -> None:
        print(text, file=self.stream if self.stream is not None else sys.stdout, flush=True)


def _write_config(config: CompareConfig, toml_path: str | None) -> None:
    """``config.json`` (the resolved grid) and, when the grid came from a TOML file, its copy ``config.toml``."""
    resolved = strict_json({**asdict(config), "privfl_version": _version()})
    with open(os.path.join(config.out_dir, "config.json"), "w") as f:
        json.dump(resolved, f, indent=1, allow_nan=False)
    if toml_path is not None:
        target = os.path.join(config.out_dir, "config.toml")
        if not (os.path.exists(target) and os.path.samefile(toml_path, target)):
            shutil.copyfile(toml_path, target)


def _version() -> str:
    from privfl import __version__

    return __version__


SUMMARY_KEYS = ("algorithm", "epsilon_target", "seed", "accuracy", "nll", "ece", "epsilon_spent_max",
                "epsilon_spent_mean", "delta", "unit", "accountant", "rounds", "clients", "dataset", "seconds",
                "balanced_accuracy", "auroc", "selective_accuracy", "snr_median", "config_hash", "privfl_version")


def write_outputs(config: CompareConfig, rows: list[dict]) -> None:
    from privfl.apps.plots import plot_accuracy_vs_epsilon, plot_epsilon_curves, plot_reliability

    with open(os.path.join(config.out_dir, "results.json"), "w") as f:
        json.dump(strict_json({"results": rows}), f, indent=1, allow_nan=False)
    with open(os.path.join(config.out_dir, "results.csv"), "w", newline="") as f:
        keys = SUMMARY_KEYS + (VAL_KEYS if config.val_fraction else ())  # validation columns last, when there are any
        if config.class_prior is not None:
            keys += ("prior_balanced_accuracy",) + (("val_prior_balanced_accuracy",) if config.val_fraction else ())
        if any(r.get("test_from_clients") for r in rows):  # the metrics above are the clients' uncharged records'
            keys += ("test_from_clients", "test_metrics_privacy")
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    plot_accuracy_vs_epsilon(rows, os.path.join(config.out_dir, "accuracy_vs_epsilon.png"), delta=config.delta)
    plot_epsilon_curves(rows, os.path.join(config.out_dir, "epsilon_per_client.png"), delta=config.delta)
    plot_reliability(rows, os.path.join(config.out_dir, "reliability.png"))


def snr_median(history) -> float | None:
    """The median over a run's rounds of each round's privacy SNR (``privfl.runtime.rounds.privacy_snr``; the mean
    over the round's noised channels); None when no round's sums carried noise the server knows of (a non-private
    run, DP-SGD-trained uploads)."""
    per_round = [float(np.mean(list(r.snr.values()))) for r in history if r.snr]
    return float(np.median(per_round)) if per_round else None


def summary_table(rows: list[dict]) -> list[dict]:
    """Mean (and std over seeds) per (algorithm, epsilon target)."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["algorithm"], r["epsilon_target"]), []).append(r)
    out = []
    for (alg, eps), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        acc = np.array([r["accuracy"] for r in rs], dtype=float)
        rounds = sorted({int(r["rounds"]) for r in rs if isinstance(r.get("rounds"), (int, float))})
        out.append({"algorithm": alg, "epsilon_target": eps, "seeds": len(rs), "accuracy": float(acc.mean()),
                    "rounds": rounds[0] if len(rounds) == 1 else rounds,
                    "accuracy_std": float(acc.std()), "nll": float(np.mean([r["nll"] for r in rs])),
                    "balanced_accuracy": _mean(rs, "balanced_accuracy"), "auroc": _mean(rs, "auroc"),
                    "ece": float(np.mean([r["ece"] for r in rs])),
                    "selective_accuracy": _mean(rs, "selective_accuracy"),
                    "epsilon_spent_max": float(max(r["epsilon_spent_max"] for r in rs)),
                    "epsilon_spent_mean": float(np.mean([r["epsilon_spent_mean"] for r in rs])),
                    "snr_median": _mean(rs, "snr_median"),
                    **({"val_accuracy": _mean(rs, "val_accuracy")} if any("val_accuracy" in r for r in rs) else {})})
    return out


def _mean(rows: list[dict], key: str) -> float:
    """Mean of ``key`` over rows (NaN where a row lacks it: rows of an older privfl)."""
    values = [r.get(key) for r in rows]
    return float(np.mean([math.nan if v is None else v for v in values]))
