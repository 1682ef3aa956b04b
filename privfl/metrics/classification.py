"""Classification metrics: accuracy, NLL and calibration (expected calibration error)."""

from __future__ import annotations

import numpy as np


def classification_metrics(proba: np.ndarray, y: np.ndarray, bins: int = 15) -> dict[str, float]:
    """Accuracy, NLL and expected calibration error (equal-width confidence bins, Guo et al. 2017)."""
    y = np.asarray(y)
    pred = proba.argmax(axis=1)
    correct = pred == y
    p_true = np.clip(proba[np.arange(len(y)), y], 1e-12, 1.0)
    conf = proba.max(axis=1)
    edges = np.linspace(0.0, 1.0, bins + 1)
    ece = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        in_bin = (conf > lo) & (conf <= hi)
        if in_bin.any():
            ece += in_bin.mean() * abs(correct[in_bin].mean() - conf[in_bin].mean())
    return {"accuracy": float(correct.mean()), "nll": float(-np.log(p_true).mean()), "ece": float(ece)}


def reliability_bins(proba: np.ndarray, y: np.ndarray, bins: int = 10) -> dict[str, list[float]]:
    """Per confidence bin: mean confidence, accuracy and count (for a reliability diagram)."""
    y = np.asarray(y)
    conf = proba.max(axis=1)
    correct = proba.argmax(axis=1) == y
    edges = np.linspace(0.0, 1.0, bins + 1)
    out = {"confidence": [], "accuracy": [], "count": [], "edges": edges.tolist()}
    for lo, hi in zip(edges[:-1], edges[1:]):
        in_bin = (conf > lo) & (conf <= hi)
        n = int(in_bin.sum())
        out["count"].append(n)
        out["confidence"].append(float(conf[in_bin].mean()) if n else float("nan"))
        out["accuracy"].append(float(correct[in_bin].mean()) if n else float("nan"))
    return out
