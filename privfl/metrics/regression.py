"""Regression metrics for Gaussian predictive distributions: RMSE, Gaussian NLL, and interval calibration.

Interval calibration follows FedBNR (Yu et al., Sec. 5.2 and App. C): for each confidence level p, the central p
interval of each predictive Gaussian, mean +- Phi^-1((1 + p) / 2) * sd, should contain a fraction p of the targets.
With coverage c(p) measured on the test set:

- ECE = mean over levels of |c(p) - p|;
- MCE = max over levels of |c(p) - p|;
- interval Brier score = mean over levels and points of (p - 1[y in interval_p])^2 (p (1 - p) on average when
  calibrated: about 1/6 over levels spread on (0, 1), cf. their Central GP's 0.16-0.24).

The paper does not list its levels; privfl uses p = 0.05, 0.10, ..., 0.95 (``DEFAULT_LEVELS``).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import ndtri

#: confidence levels of the central intervals: 0.05, 0.10, ..., 0.95
DEFAULT_LEVELS = np.arange(1, 20) / 20.0


def _arrays(mean, var, y) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mean = np.asarray(mean, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if mean.shape != y.shape:
        raise ValueError(f"predictions and targets differ in length ({mean.size} and {y.size})")
    if not mean.size:
        raise ValueError("regression metrics need at least one target")
    if var is None:
        return mean, None, y
    var = np.broadcast_to(np.asarray(var, dtype=np.float64), mean.shape).reshape(-1)
    if not np.all(np.isfinite(var)) or np.any(var <= 0):
        raise ValueError("predictive variances must be finite and > 0")
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(y))):
        raise ValueError("predictive means and targets must be finite")
    return mean, var, y


def rmse(mean, y) -> float:
    """Root mean squared error of the predictive means."""
    mean, _, y = _arrays(mean, None, y)
    return float(np.sqrt(np.mean((mean - y) ** 2)))


def gaussian_nll(mean, var, y) -> float:
    """Mean negative log density of the targets under N(mean, var): 0.5 log(2 pi var) + (y - mean)^2 / (2 var)."""
    mean, var, y = _arrays(mean, var, y)
    return float(np.mean(0.5 * np.log(2.0 * math.pi * var) + 0.5 * (y - mean) ** 2 / var))


def interval_calibration(mean, var, y, levels=DEFAULT_LEVELS) -> dict[str, object]:
    """Coverage of the central intervals at each level, and the ECE, MCE and interval Brier score they give."""
    mean, var, y = _arrays(mean, var, y)
    levels = np.asarray(levels, dtype=np.float64).reshape(-1)
    if not levels.size or np.any(levels <= 0) or np.any(levels >= 1):
        raise ValueError(f"confidence levels must lie in (0, 1), got {levels}")
    z = ndtri((1.0 + levels) / 2.0)                                  # half-widths in standard deviations
    inside = np.abs(y - mean)[None, :] <= z[:, None] * np.sqrt(var)[None, :]   # (levels, points)
    coverage = inside.mean(axis=1)
    gap = np.abs(coverage - levels)
    return {"levels": levels.tolist(), "coverage": coverage.tolist(), "ece": float(gap.mean()),
            "mce": float(gap.max()), "brier": float(np.mean((levels[:, None] - inside) ** 2))}


def regression_metrics(mean, var, y, levels=DEFAULT_LEVELS) -> dict[str, float]:
    """``rmse``, ``nll`` (Gaussian), ``ece``, ``mce`` and ``brier`` (interval calibration) of Gaussian predictions.

    Report them in the data's own units: pass means, variances and targets already mapped back with
    ``ArrayDataset.to_original_units`` (variances times ``target_scale ** 2``).
    """
    cal = interval_calibration(mean, var, y, levels)
    return {"rmse": rmse(mean, y), "nll": gaussian_nll(mean, var, y), "ece": cal["ece"], "mce": cal["mce"],
            "brier": cal["brier"]}


def point_regression_metrics(pred, y) -> dict[str, float]:
    """``rmse``, ``mae`` and ``r2`` (coefficient of determination, 1 - SSE / SST; 0 is predicting the test mean) of
    point predictions, e.g. a network trained with squared error. Pass both in the data's own units."""
    pred, _, y = _arrays(pred, None, y)
    sst = float(np.sum((y - y.mean()) ** 2))
    sse = float(np.sum((pred - y) ** 2))
    return {"rmse": rmse(pred, y), "mae": float(np.mean(np.abs(pred - y))),
            "r2": 1.0 - sse / sst if sst > 0 else float("nan")}


__all__ = ["DEFAULT_LEVELS", "gaussian_nll", "interval_calibration", "point_regression_metrics", "regression_metrics",
           "rmse"]
