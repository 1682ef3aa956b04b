"""Utility and calibration metrics."""

from privfl.metrics.calibration import brier_score, maximum_calibration_error
from privfl.metrics.classification import classification_metrics
from privfl.metrics.regression import gaussian_nll, interval_calibration, regression_metrics, rmse

__all__ = ["brier_score", "classification_metrics", "gaussian_nll", "interval_calibration",
           "maximum_calibration_error", "regression_metrics", "rmse"]
