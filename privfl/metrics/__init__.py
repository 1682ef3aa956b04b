"""Utility and calibration metrics."""

from privfl.metrics.classification import classification_metrics

__all__ = ["classification_metrics"]
