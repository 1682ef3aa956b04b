"""Utility and calibration metrics."""

from privfl.metrics.calibration import brier_score, maximum_calibration_error
from privfl.metrics.classification import auroc, balanced_accuracy, classification_metrics
from privfl.metrics.decision import PriorCorrection
from privfl.metrics.regression import (gaussian_nll, interval_calibration, point_regression_metrics,
                                      regression_metrics, rmse)
from privfl.metrics.report import applied_noise, from_strict_number, strict_json

__all__ = ["PriorCorrection", "applied_noise", "auroc", "balanced_accuracy", "brier_score", "classification_metrics",
           "from_strict_number", "gaussian_nll", "interval_calibration", "maximum_calibration_error",
           "point_regression_metrics", "regression_metrics", "rmse", "strict_json"]
