"""Seeded train/test splits (stratified for classification) and ``Standardizer``, a per-record affine map whose
statistics are public inputs (fitted on public data, public bounds, or supplied)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from privfl.data.dataset import ArrayDataset
from privfl.data.errors import DatasetError


def _check_rng(rng: object) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise DatasetError("pass a numpy Generator as rng, e.g. np.random.default_rng(seed); privfl never uses the "
                           "global numpy random state")
    return rng


def train_test_split_indices(n_or_labels: int | np.ndarray, test_fraction: float, rng: np.random.Generator, *,
                             stratify: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint (train, test) index arrays covering ``range(n)``, each sorted.

    ``n_or_labels`` is a count or the label array. With labels and ``stratify`` (the default for labels), every class
    puts ``round(test_fraction * n_c)`` examples in the test set, adjusted so the total is ``round(test_fraction * n)``.
    """
    rng = _check_rng(rng)
    if not (isinstance(test_fraction, (int, float)) and 0.0 < float(test_fraction) < 1.0):
        raise DatasetError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    if isinstance(n_or_labels, (int, np.integer)):
        n, labels = int(n_or_labels), None
    else:
        labels = np.asarray(n_or_labels)
        if labels.ndim != 1:
            raise DatasetError(f"labels must be 1-D, got shape {labels.shape}")
        n = len(labels)
    if stratify is None:
        stratify = labels is not None
    if stratify and labels is None:
        raise DatasetError("stratify=True needs the label array, not a count")
    n_test = int(round(float(test_fraction) * n))
    if n_test < 1 or n_test > n - 1:
        raise DatasetError(f"test_fraction={test_fraction} of {n} examples leaves an empty train or test set")
    if not stratify:
        perm = rng.permutation(n)
        return np.sort(perm[n_test:]), np.sort(perm[:n_test])
    classes, inverse = np.unique(labels, return_inverse=True)
    per_class = [rng.permutation(np.flatnonzero(inverse == c)) for c in range(len(classes))]
    sizes = np.array([len(ix) for ix in per_class])
    want = sizes * float(test_fraction)
    take = np.floor(want).astype(np.int64)
    # largest remainders first, ties broken at random, until the total matches
    short = n_test - int(take.sum())
    if short > 0:
        order = np.lexsort((rng.random(len(sizes)), -(want - take)))
        for c in order:
            if short == 0:
                break
            if take[c] < sizes[c]:
                take[c] += 1
                short -= 1
    test = np.concatenate([ix[:k] for ix, k in zip(per_class, take)])
    train = np.concatenate([ix[k:] for ix, k in zip(per_class, take)])
    return np.sort(train), np.sort(test)


@dataclass(frozen=True)
class Standardizer:
    """Per-record affine map: features ``(x - x_mean) / x_std``, regression targets ``(y - y_mean) / y_std``.

    Once built, it transforms each record on its own, so a record's image depends on no other record. Its
    statistics must be public facts in a federation (see ``make_federated``): fitted on public data
    (``Standardizer.fit(public_split)``), taken from public bounds (``Standardizer.from_bounds``), or supplied by the
    user; a fit on clients' training data would be an unaccounted release of it.
    """

    x_mean: np.ndarray
    x_std: np.ndarray
    y_mean: float = 0.0
    y_std: float = 1.0

    def __post_init__(self) -> None:
        x_mean = np.asarray(self.x_mean, dtype=np.float64)
        x_std = np.broadcast_to(np.asarray(self.x_std, dtype=np.float64), x_mean.shape).copy()
        if not (np.all(np.isfinite(x_mean)) and np.all(np.isfinite(x_std)) and np.all(x_std > 0)):
            raise DatasetError("a Standardizer needs finite x_mean and finite, positive x_std; give constant "
                               "features std 1")
        if not (np.isfinite(self.y_mean) and np.isfinite(self.y_std) and self.y_std > 0):
            raise DatasetError(f"a Standardizer needs a finite y_mean and a finite, positive y_std, got "
                               f"{self.y_mean!r} and {self.y_std!r}")
        x_mean.setflags(write=False)
        x_std.setflags(write=False)
        object.__setattr__(self, "x_mean", x_mean)
        object.__setattr__(self, "x_std", x_std)
        object.__setattr__(self, "y_mean", float(self.y_mean))
        object.__setattr__(self, "y_std", float(self.y_std))

    @classmethod
    def fit(cls, data: ArrayDataset, *, targets: bool = True) -> "Standardizer":
        """Mean and std of ``data`` (features, and regression targets with ``targets``); constant features get std
        1. Fit only on data that is public: in ``make_federated`` that is the public reference split."""
        x = data.x.astype(np.float64)
        if len(x) < 2:
            raise DatasetError(f"fitting a standardizer needs at least 2 examples, {data.name!r} has {len(x)}")
        x_mean = x.mean(axis=0)
        x_std = x.std(axis=0)
        x_std = np.where(x_std > 1e-12 * np.maximum(1.0, np.abs(x_mean)), x_std, 1.0)
        if targets and data.task == "regression":
            y = data.y.astype(np.float64)
            y_mean, y_std = float(y.mean()), float(y.std())
            if not y_std > 0:
                y_std = 1.0
        else:
            y_mean, y_std = 0.0, 1.0
        return cls(x_mean, x_std, y_mean, y_std)

    @classmethod
    def from_bounds(cls, x_low: np.ndarray | float, x_high: np.ndarray | float, input_shape: tuple[int, ...], *,
                    y_low: float | None = None, y_high: float | None = None) -> "Standardizer":
        """Map public bounds ``[x_low, x_high]`` (per feature, or one pair for all) to [-1, 1], and targets in
        ``[y_low, y_high]`` likewise when given. Records outside the bounds are mapped affinely too, not clipped:
        the release pipeline's clip is what bounds a record's influence."""
        shape = tuple(int(s) for s in input_shape)
        lo = np.broadcast_to(np.asarray(x_low, dtype=np.float64), shape)
        hi = np.broadcast_to(np.asarray(x_high, dtype=np.float64), shape)
        if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)) and np.all(hi > lo)):
            raise DatasetError("feature bounds must be finite with x_low < x_high for every feature")
        if (y_low is None) != (y_high is None):
            raise DatasetError("give both y_low and y_high, or neither")
        y_mean, y_std = 0.0, 1.0
        if y_low is not None:
            if not (np.isfinite(y_low) and np.isfinite(y_high) and y_high > y_low):
                raise DatasetError(f"target bounds must be finite with y_low < y_high, got [{y_low}, {y_high}]")
            y_mean, y_std = (float(y_low) + float(y_high)) / 2, (float(y_high) - float(y_low)) / 2
        return cls((lo + hi) / 2, (hi - lo) / 2, y_mean, y_std)

    def transform(self, data: ArrayDataset) -> ArrayDataset:
        """``data`` mapped record by record; regression ``target_offset``/``target_scale`` compose with the map so
        original units stay recoverable."""
        if data.input_shape != self.x_mean.shape:
            raise DatasetError(f"standardizer was fitted on inputs of shape {self.x_mean.shape}, got "
                               f"{data.input_shape}")
        x = (data.x.astype(np.float64) - self.x_mean) / self.x_std
        if data.task == "regression":
            y = (data.y.astype(np.float64) - self.y_mean) / self.y_std
            offset = data.target_offset + data.target_scale * self.y_mean
            scale = data.target_scale * self.y_std
        else:
            y, offset, scale = data.y, data.target_offset, data.target_scale
        return ArrayDataset(x.astype(np.float32), y, data.task, data.num_classes, data.name, offset, scale)


def standardize(data: ArrayDataset, *, targets: bool = True) -> ArrayDataset:
    """Standardise ``data`` with its own statistics (features, and targets for regression). For a centralised
    analysis of one data set; a federation's clients are standardised with public statistics instead
    (``make_federated``, ``federated_from_arrays``)."""
    return Standardizer.fit(data, targets=targets).transform(data)


__all__ = ["Standardizer", "standardize", "train_test_split_indices"]
