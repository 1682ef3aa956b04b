"""Regression metrics: RMSE and Gaussian NLL by hand, interval calibration against closed forms."""

import math

import numpy as np
import pytest
from scipy.stats import norm

from privfl.metrics import gaussian_nll, interval_calibration, regression_metrics, rmse
from privfl.metrics.regression import DEFAULT_LEVELS


def test_rmse_and_nll_by_hand():
    mean, var, y = np.array([0.0, 1.0]), np.array([1.0, 4.0]), np.array([1.0, -1.0])
    assert rmse(mean, y) == pytest.approx(math.sqrt((1 + 4) / 2))
    by_hand = np.mean([0.5 * math.log(2 * math.pi) + 0.5, 0.5 * math.log(2 * math.pi * 4) + 0.5 * 4 / 4])
    assert gaussian_nll(mean, var, y) == pytest.approx(by_hand)
    assert gaussian_nll(mean, var, y) == pytest.approx(-np.mean(norm.logpdf(y, mean, np.sqrt(var))))


def test_coverage_counts_central_intervals():
    # the 0.5 interval of N(0, 1) is +-0.6745: points at 0.5 are inside, at 1.0 outside
    cal = interval_calibration(np.zeros(4), np.ones(4), np.array([0.5, -0.5, 1.0, -1.0]), levels=[0.5])
    assert cal["coverage"] == [0.5] and cal["ece"] == 0.0 and cal["mce"] == 0.0
    assert cal["brier"] == pytest.approx(0.25)


def test_calibrated_predictions_score_near_zero():
    rng = np.random.default_rng(0)
    mean = rng.normal(size=40_000)
    sd = rng.uniform(0.5, 2.0, size=mean.size)
    y = mean + sd * rng.standard_normal(mean.size)
    m = regression_metrics(mean, sd ** 2, y)
    assert m["ece"] < 0.01 and m["mce"] < 0.02
    assert m["brier"] == pytest.approx(np.mean(DEFAULT_LEVELS * (1 - DEFAULT_LEVELS)), abs=0.005)


def test_overconfidence_matches_closed_form():
    # targets twice as spread as predicted: coverage(p) = 2 Phi(z_p / 2) - 1
    rng = np.random.default_rng(1)
    y = 2.0 * rng.standard_normal(100_000)
    cal = interval_calibration(np.zeros_like(y), np.ones_like(y), y)
    levels = np.asarray(cal["levels"])
    expected = 2 * norm.cdf(norm.ppf((1 + levels) / 2) / 2) - 1
    np.testing.assert_allclose(cal["coverage"], expected, atol=0.006)
    assert cal["ece"] == pytest.approx(np.mean(np.abs(expected - levels)), abs=0.005)
    assert cal["mce"] == pytest.approx(np.max(np.abs(expected - levels)), abs=0.006)


@pytest.mark.parametrize("args", [
    (np.zeros(3), np.array([1.0, 0.0, 1.0]), np.zeros(3)),       # zero variance
    (np.zeros(3), np.ones(3), np.zeros(2)),                       # length mismatch
    (np.zeros(3), np.array([1.0, np.nan, 1.0]), np.zeros(3)),     # NaN variance
])
def test_bad_inputs_are_refused(args):
    with pytest.raises(ValueError):
        regression_metrics(*args)


def test_levels_must_lie_strictly_inside_zero_one():
    with pytest.raises(ValueError, match="levels"):
        interval_calibration(np.zeros(2), np.ones(2), np.zeros(2), levels=[0.5, 1.0])
