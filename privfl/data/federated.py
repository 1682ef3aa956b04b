"""``make_federated``: one call from a data set name to client parts and a global test set, reproducible from a seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from privfl.data.dataset import ArrayDataset, FederatedData
from privfl.data.errors import DatasetError, PartitionError
from privfl.data.offline import load_diabetes, load_digits, load_mnist5k, synthetic1d
from privfl.data.partition import (PARTITIONS, dirichlet_partition, disjoint_class_partition, iid_partition,
                                   most_correlated_feature, sorted_chunk_partition)
from privfl.data.split import Standardizer, train_test_split_indices
from privfl.data.torchvision_sets import TORCHVISION_DATASETS, load_torchvision
from privfl.data.uci import UCI_DATASETS, load_uci


@dataclass(frozen=True)
class _Source:
    task: str
    options: tuple[str, ...]  # loader keywords accepted through make_federated's **loader_kw
    load: Callable[..., ArrayDataset | tuple[ArrayDataset, ArrayDataset]]
    standardize: bool  # default for regression sets


def _offline_synthetic(rng: np.random.Generator, n: int = 200, noise_std: float = 0.5, low: float = -5.0,
                       high: float = 5.0) -> ArrayDataset:
    return synthetic1d(n, rng, noise_std=noise_std, low=low, high=high)


_SOURCES: dict[str, _Source] = {
    "digits": _Source("classification", ("flatten",), lambda rng, **kw: load_digits(**kw), False),
    "mnist5k": _Source("classification", ("flatten",), lambda rng, **kw: load_mnist5k(**kw), False),
    "diabetes": _Source("regression", (), lambda rng: load_diabetes(standardized=False), True),
    "synthetic1d": _Source("regression", ("n", "noise_std", "low", "high"), _offline_synthetic, False),
}
for _name in TORCHVISION_DATASETS:
    _SOURCES[_name] = _Source(
        "classification", ("root", "download", "flatten"),
        (lambda key: lambda rng, root=None, download=False, flatten=False:
            load_torchvision(key, root, download, flatten=flatten))(_name), False)
for _name in UCI_DATASETS:
    _SOURCES[_name] = _Source(
        "regression", ("root", "download", "target"),
        (lambda key: lambda rng, root=None, download=False, target=None:
            load_uci(key, root, download, target=target, standardized=False))(_name), True)

#: Every name ``make_federated`` accepts.
DATASETS = tuple(_SOURCES)


def _check_fraction(name: str, value: float, *, allow_zero: bool) -> float:
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool) and np.isfinite(value)
    if not ok or not ((0.0 <= value if allow_zero else 0.0 < value) and value < 1.0):
        raise DatasetError(f"{name} must be in {'[0' if allow_zero else '(0'}, 1), got {value!r}")
    return float(value)


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


def make_federated(dataset: str, n_clients: int, partition: str = "auto", alpha: float = 0.1, seed: int = 0,
                   test_fraction: float | None = None, *, val_fraction: float = 0.0, alignment_size: int = 0,
                   min_size: int = 10, classes_per_client: int | None = None,
                   examples_per_class: int | str | None = None, chunks_per_client: int | None = None,
                   standardize: bool | None = None, **loader_kw) -> FederatedData:
    """Load ``dataset``, hold out a global test set, and partition the rest over ``n_clients``.

    - ``dataset``: one of ``DATASETS`` (digits, mnist5k, diabetes, synthetic1d offline; mnist, cifar10, cifar100,
      ccpp, bike, parkinsons, sml2010, skillcraft from files under ``root``, fetched only with ``download=True``).
    - ``partition``: ``"iid"``, ``"dirichlet"`` (``alpha``, ``min_size``), ``"disjoint_class"``
      (``classes_per_client``, default half the classes; ``examples_per_class``), ``"sorted_chunk"`` (FedBNR;
      ``chunks_per_client``, default 2), or ``"auto"``: dirichlet for classification, sorted_chunk for regression.
    - ``test_fraction``: share of the data held out for testing (default 0.2); mnist/cifar use their official test
      split and refuse a value. ``val_fraction`` (of the whole data, or of the official training set) and
      ``alignment_size`` (a count; FedBNN's public alignment set) are carved from the training data before
      partitioning; ``info["n_total"]`` counts every example loaded.
    - ``standardize``: fit feature (and target) standardisation on the clients' pooled training data and apply it to
      every split; default on for diabetes and the UCI sets. ``target_scale`` turns RMSE back into original units.
    - ``loader_kw``: ``flatten`` (image sets), ``n``/``noise_std``/``low``/``high`` (synthetic1d), ``root``/
      ``download`` (file-backed sets; ``download`` defaults to False), ``target`` (UCI).

    Every random choice derives from ``seed`` through independent numpy streams (data, split, partition).
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
    if not isinstance(alignment_size, (int, np.integer)) or alignment_size < 0:
        raise DatasetError(f"alignment_size must be a non-negative int, got {alignment_size!r}")

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
        test = full.subset(test_idx, name=f"{key}-test")
        n_total = n_base = len(full)
    labels = full.y if classification else None
    pool, val_idx = _take(pool, labels, int(round(val_fraction * n_base)), split_rng, "val_fraction")
    pool, align_idx = _take(pool, None, int(alignment_size), split_rng, "alignment_size")
    train = full.subset(pool, name=f"{key}-train")
    if n_clients > len(train):
        raise DatasetError(f"n_clients={n_clients} is larger than the {len(train)} training examples of {key}; use "
                           "fewer clients")

    if standardize is None:
        standardize = source.standardize
    scaler = Standardizer.fit(train) if standardize else None

    def finish(part: ArrayDataset, name: str) -> ArrayDataset:
        out = scaler.transform(part) if scaler is not None else part
        return ArrayDataset(out.x, out.y, out.task, out.num_classes, name, out.target_offset, out.target_scale)

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
        feature = most_correlated_feature(train.x, train.y)
        parts = sorted_chunk_partition(train.x, train.y, n_clients, cpc, part_rng, feature=feature)
        info["sort_feature"] = feature
    if len(parts) != n_clients:  # pragma: no cover - every partition returns one part per client
        raise PartitionError("partition returned the wrong number of parts")
    if scaler is not None:
        info["standardizer"] = scaler
    return FederatedData(
        train_parts=[finish(train.subset(ix), f"{key}-client{k}") for k, ix in enumerate(parts)],
        test=finish(test, f"{key}-test"),
        name=key,
        num_classes=full.num_classes,
        input_shape=full.input_shape,
        val=finish(full.subset(val_idx), f"{key}-val") if len(val_idx) else None,
        alignment=finish(full.subset(align_idx), f"{key}-alignment") if len(align_idx) else None,
        partition=partition,
        seed=int(seed),
        info=info,
    )


__all__ = ["DATASETS", "make_federated"]
