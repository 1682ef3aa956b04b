"""Seeded train/test splits (stratified for classification) and standardisation fitted on the training part only."""

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
    """Affine map fitted on training data: features ``(x - x_mean) / x_std``, targets ``(y - y_mean) / y_std``.

    Constant features get std 1. In a real federation these statistics are themselves a release; here they are a
    simulation convention (as in the papers) and are computed on the training split only, never on test data.
    """

    x_mean: np.ndarray
    x_std: np.ndarray
    y_mean: float = 0.0
    y_std: float = 1.0

    @classmethod
    def fit(cls, data: ArrayDataset, *, targets: bool = True) -> "Standardizer":
        x = data.x.astype(np.float64)
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

    def transform(self, data: ArrayDataset) -> ArrayDataset:
        if data.input_shape != self.x_mean.shape:
            raise DatasetError(f"standardizer was fitted on inputs of shape {self.x_mean.shape}, got "
                               f"{data.input_shape}")
        x = (data.x.astype(np.float64) - self.x_mean) / self.x_std
        if data.task == "regression":
            # compose with any scaling the data already carries, so original units stay recoverable
            y = (data.y.astype(np.float64) - self.y_mean) / self.y_std
            offset = data.target_offset + data.target_scale * self.y_mean
            scale = data.target_scale * self.y_std
        else:
            y, offset, scale = data.y, data.target_offset, data.target_scale
        return ArrayDataset(x.astype(np.float32), y, data.task, data.num_classes, data.name, offset, scale)


def standardize(data: ArrayDataset, *, targets: bool = True) -> ArrayDataset:
    """Standardise ``data`` with its own statistics (features, and targets for regression)."""
    return Standardizer.fit(data, targets=targets).transform(data)


__all__ = ["Standardizer", "standardize", "train_test_split_indices"]
