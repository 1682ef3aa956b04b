"""Partitions of a training set over clients. Each returns one sorted int64 index array per client; the arrays are
disjoint and cover every index, except where ``examples_per_class`` asks for a subset. Randomness only from the
numpy ``Generator`` passed in."""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np

from privfl.data.errors import PartitionError

#: FedBNN's data regimes (Makhija et al., Sec. 5): examples of each held class per client.
EXAMPLES_PER_CLASS_PRESETS = {"small": 50, "medium": 100, "full": 2500}


class PartitionWarning(UserWarning):
    """A partition could not give what was asked where the data is too small (e.g. 2500 examples per class)."""


def _check_rng(rng: object) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise PartitionError("pass a numpy Generator as rng, e.g. np.random.default_rng(seed)")
    return rng


def _check_n_clients(n_clients: object, n: int) -> int:
    if not isinstance(n_clients, (int, np.integer)) or isinstance(n_clients, bool) or n_clients < 1:
        raise PartitionError(f"n_clients must be a positive int, got {n_clients!r}")
    if n_clients > n:
        raise PartitionError(f"n_clients={n_clients} is larger than the {n} training examples; use fewer clients")
    return int(n_clients)


def _labels(labels: Sequence[int] | np.ndarray) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise PartitionError(f"labels must be a 1-D array of class labels, got shape {y.shape}")
    if len(y) and not np.issubdtype(y.dtype, np.integer):
        raise PartitionError("labels must be integer class labels; regression targets need sorted_chunk_partition "
                             "or iid_partition")
    return y.astype(np.int64, copy=False)


def _finish(parts: list) -> list[np.ndarray]:
    """Each client's pieces joined into one sorted int64 index array."""
    out = []
    for p in parts:
        pieces = p if isinstance(p, list) else [p]
        arr = (np.concatenate([np.asarray(q, dtype=np.int64) for q in pieces]) if pieces
               else np.empty(0, dtype=np.int64))
        out.append(np.sort(arr))
    return out


def iid_partition(labels_or_n: Sequence[int] | np.ndarray | int, n_clients: int,
                  rng: np.random.Generator) -> list[np.ndarray]:
    """Uniformly random split into ``n_clients`` parts whose sizes differ by at most one."""
    rng = _check_rng(rng)
    n = int(labels_or_n) if isinstance(labels_or_n, (int, np.integer)) else len(np.asarray(labels_or_n))
    n_clients = _check_n_clients(n_clients, n)
    return _finish(list(np.array_split(rng.permutation(n), n_clients)))


def dirichlet_partition(labels: Sequence[int] | np.ndarray, n_clients: int, alpha: float, rng: np.random.Generator,
                        *, min_size: int = 10, max_attempts: int = 1000,
                        balance: bool = True) -> list[np.ndarray]:
    """Label-skewed split (FOLA Sec. V; the recipe of Hsu et al. 2019 and NIID-Bench).

    For each class, proportions over clients are drawn from Dir(alpha * 1) and the class's shuffled indices are cut
    accordingly. With ``balance`` (as in the public code of these papers), a client already holding more than n /
    n_clients examples gets no more of later classes, which keeps sizes from exploding at small alpha. The whole draw
    is repeated until every client has at least ``min_size`` examples, at most ``max_attempts`` times.
    """
    rng = _check_rng(rng)
    y = _labels(labels)
    n = len(y)
    n_clients = _check_n_clients(n_clients, n)
    if not (isinstance(alpha, (int, float, np.floating)) and np.isfinite(alpha) and alpha > 0):
        raise PartitionError(f"alpha must be a positive finite number (smaller = more skewed), got {alpha!r}")
    if not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise PartitionError(f"min_size must be a non-negative int, got {min_size!r}")
    if min_size * n_clients > n:
        raise PartitionError(f"min_size={min_size} for {n_clients} clients needs {min_size * n_clients} examples, "
                             f"only {n} exist; lower min_size or n_clients")
    if max_attempts < 1:
        raise PartitionError("max_attempts must be at least 1")
    classes = np.unique(y)
    cap = n / n_clients
    smallest = -1
    for _ in range(int(max_attempts)):
        parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
        sizes = np.zeros(n_clients, dtype=np.int64)
        for c in classes:
            idx = rng.permutation(np.flatnonzero(y == c))
            p = rng.dirichlet(np.full(n_clients, float(alpha)))
            if balance:
                p = np.where(sizes < cap, p, 0.0)
            total = p.sum()
            if not np.isfinite(total) or total <= 0:  # every open client drew ~0: share evenly among open ones
                p = (sizes < cap).astype(np.float64) if balance else np.ones(n_clients)
                total = p.sum()
            cuts = (np.cumsum(p / total) * len(idx)).astype(np.int64)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
                sizes[k] += len(chunk)
        smallest = int(sizes.min())
        if smallest >= min_size:
            return _finish(parts)
    raise PartitionError(f"no Dirichlet(alpha={alpha}) partition over {n_clients} clients gave every client "
                         f"{min_size} examples in {max_attempts} attempts (last smallest: {smallest}); raise alpha, "
                         "lower min_size or use fewer clients")


def _assign_classes(classes: np.ndarray, n_clients: int, classes_per_client: int,
                    rng: np.random.Generator) -> list[np.ndarray]:
    """Give each client ``classes_per_client`` distinct classes, each class held by as equal a number of clients as
    possible (counts differ by at most one), at random."""
    k = len(classes)
    slots = n_clients * classes_per_client
    counts = np.full(k, slots // k, dtype=np.int64)
    counts[rng.permutation(k)[: slots % k]] += 1
    held = []
    for _ in range(n_clients):
        # the classes with most remaining slots first (ties at random): this greedy order never gets stuck
        order = np.lexsort((rng.random(k), -counts))[:classes_per_client]
        counts[order] -= 1
        held.append(np.sort(classes[order]))
    return held


def disjoint_class_partition(labels: Sequence[int] | np.ndarray, n_clients: int, classes_per_client: int,
                             rng: np.random.Generator, examples_per_class: int | str | None = None,
                             ) -> list[np.ndarray]:
    """Each client holds only ``classes_per_client`` of the classes (FedBNN Sec. 5: 5 of 10 classes on MNIST/CIFAR-10,
    20 of 100 on CIFAR-100).

    Classes are spread so each is held by about ``n_clients * classes_per_client / n_classes`` clients. A class's
    examples are split evenly among its holders; with ``examples_per_class`` (an int or ``"small"``/``"medium"``/
    ``"full"`` = 50/100/2500) each holder gets that many of each of its classes, or an even share of the class where
    the data is too small for that (with a ``PartitionWarning``), and the remaining examples are left out.
    """
    rng = _check_rng(rng)
    y = _labels(labels)
    n = len(y)
    n_clients = _check_n_clients(n_clients, n)
    classes = np.unique(y)
    if not isinstance(classes_per_client, (int, np.integer)) or not 1 <= classes_per_client <= len(classes):
        raise PartitionError(f"classes_per_client must be an int in [1, {len(classes)}] (the classes present), got "
                             f"{classes_per_client!r}")
    if isinstance(examples_per_class, str):
        if examples_per_class not in EXAMPLES_PER_CLASS_PRESETS:
            raise PartitionError(f"examples_per_class must be an int or one of "
                                 f"{sorted(EXAMPLES_PER_CLASS_PRESETS)}, got {examples_per_class!r}")
        examples_per_class = EXAMPLES_PER_CLASS_PRESETS[examples_per_class]
    if examples_per_class is not None and (not isinstance(examples_per_class, (int, np.integer))
                                           or examples_per_class < 1):
        raise PartitionError(f"examples_per_class must be a positive int, got {examples_per_class!r}")
    held = _assign_classes(classes, n_clients, int(classes_per_client), rng)
    parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    capped = []
    for c in classes:
        holders = [k for k in range(n_clients) if c in held[k]]
        if not holders:
            continue
        idx = rng.permutation(np.flatnonzero(y == c))
        if examples_per_class is None:
            chunks = np.array_split(idx, len(holders))
        else:
            per = min(int(examples_per_class), len(idx) // len(holders))
            if per < examples_per_class:
                capped.append((int(c), per))
            chunks = [idx[i * per:(i + 1) * per] for i in range(len(holders))]
        for k, chunk in zip(holders, chunks):
            parts[k].append(chunk)
    if capped:
        warnings.warn(f"examples_per_class={examples_per_class} exceeds the data for {len(capped)} classes; their "
                      f"holders got {min(p for _, p in capped)}-{max(p for _, p in capped)} each",
                      PartitionWarning, stacklevel=2)
    out = _finish(parts)
    empty = [k for k, p in enumerate(out) if len(p) == 0]
    if empty:
        raise PartitionError(f"clients {empty} received no examples (classes too small for their holders); use fewer "
                             "clients or more classes_per_client")
    return out


def most_correlated_feature(x: np.ndarray, y: np.ndarray) -> int:
    """Index of the feature with the largest absolute Pearson correlation with ``y`` (constant features count 0)."""
    x = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    y = np.asarray(y, dtype=np.float64).reshape(len(y), -1)
    if y.shape[1] != 1:
        raise PartitionError("most_correlated_feature needs a scalar target")
    xc = x - x.mean(axis=0)
    yc = y[:, 0] - y[:, 0].mean()
    denom = np.sqrt((xc ** 2).sum(axis=0) * (yc ** 2).sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        corr = np.where(denom > 0, (xc * yc[:, None]).sum(axis=0) / np.where(denom > 0, denom, 1.0), 0.0)
    return int(np.argmax(np.abs(corr)))


def sorted_chunk_partition(x: np.ndarray, y: np.ndarray, n_clients: int, chunks_per_client: int = 2,
                           rng: np.random.Generator | None = None, *, feature: int | None = None,
                           ) -> list[np.ndarray]:
    """FedBNR's regression split (Yu et al., Sec. 5.2): sort the examples by the feature with the largest absolute
    correlation with the target (or by ``feature``), cut them into ``n_clients * chunks_per_client`` contiguous
    chunks of near-equal size, and give each client ``chunks_per_client`` chunks at random."""
    rng = _check_rng(rng)
    x = np.asarray(x)
    n = len(x)
    if len(np.asarray(y)) != n:
        raise PartitionError(f"x and y have different lengths ({n} and {len(np.asarray(y))})")
    n_clients = _check_n_clients(n_clients, n)
    if not isinstance(chunks_per_client, (int, np.integer)) or chunks_per_client < 1:
        raise PartitionError(f"chunks_per_client must be a positive int, got {chunks_per_client!r}")
    n_chunks = n_clients * int(chunks_per_client)
    if n_chunks > n:
        raise PartitionError(f"{n_clients} clients x {chunks_per_client} chunks need at least {n_chunks} examples, "
                             f"only {n} exist")
    flat = x.reshape(n, -1)
    if feature is None:
        feature = most_correlated_feature(flat, y)
    elif not 0 <= feature < flat.shape[1]:
        raise PartitionError(f"feature must be in [0, {flat.shape[1]}), got {feature}")
    order = np.argsort(flat[:, feature], kind="stable")
    chunks = np.array_split(order, n_chunks)
    deal = rng.permutation(n_chunks).reshape(n_clients, int(chunks_per_client))
    return _finish([[chunks[j] for j in row] for row in deal])


PARTITIONS = ("iid", "dirichlet", "disjoint_class", "sorted_chunk")

__all__ = ["EXAMPLES_PER_CLASS_PRESETS", "PARTITIONS", "PartitionWarning", "dirichlet_partition",
           "disjoint_class_partition", "iid_partition", "most_correlated_feature", "sorted_chunk_partition"]
