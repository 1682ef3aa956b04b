"""Calibration metrics beyond ECE: maximum calibration error (FedBNN, Appendix B) and the Brier score.

Both take class probabilities ``proba`` (n, C) and integer labels ``y`` (n,). Confidence bins are the equal-width bins
(lo, hi] of :func:`privfl.metrics.classification_metrics`' ECE, so ECE and MCE of one prediction set are computed on
the same bins.
"""

from __future__ import annotations

import numpy as np


def _check(proba: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    proba = np.asarray(proba, dtype=np.float64)
    y = np.asarray(y)
    if proba.ndim != 2 or y.ndim != 1 or len(proba) != len(y):
        raise ValueError(f"expected proba of shape (n, C) and labels of shape (n,), got {proba.shape} and {y.shape}")
    if len(y) and (y.min() < 0 or y.max() >= proba.shape[1]):
        raise ValueError(f"labels must lie in [0, {proba.shape[1]}), got range [{y.min()}, {y.max()}]")
    return proba, y.astype(np.int64, copy=False)


def maximum_calibration_error(proba: np.ndarray, y: np.ndarray, bins: int = 15) -> float:
    """MCE = max over non-empty confidence bins B of |accuracy(B) - confidence(B)| (Naeini et al. 2015; FedBNN
    Appendix B). 0 for an empty prediction set."""
    proba, y = _check(proba, y)
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    conf = proba.max(axis=1)
    correct = proba.argmax(axis=1) == y
    edges = np.linspace(0.0, 1.0, bins + 1)
    worst = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        in_bin = (conf > lo) & (conf <= hi)
        if in_bin.any():
            worst = max(worst, abs(float(correct[in_bin].mean()) - float(conf[in_bin].mean())))
    return worst


def brier_score(proba: np.ndarray, y: np.ndarray) -> float:
    """Multi-class Brier score: mean over examples of sum_c (p_c - 1[y = c])^2 (Brier 1950), in [0, 2]; lower is
    better. A proper scoring rule, so unlike ECE it cannot be gamed by a constant prediction."""
    proba, y = _check(proba, y)
    if not len(y):
        return 0.0
    onehot = np.zeros_like(proba)
    onehot[np.arange(len(y)), y] = 1.0
    return float(np.mean(np.sum((proba - onehot) ** 2, axis=1)))


__all__ = ["brier_score", "maximum_calibration_error"]
