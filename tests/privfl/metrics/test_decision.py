"""The prior-corrected decision rule (issue 28, rare classes under DP): on hand-made probabilities, equal to the argmax
where there is nothing to correct, the class weights' tilt undone, and the refusals of a prior that is not one base rate
per class."""

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import balanced_accuracy_score, recall_score
from torch import nn

from privfl.errors import ConfigurationError
from privfl.apps.settings import run_class_weights
from privfl.metrics.decision import PriorCorrection, decision_metrics


def test_the_rule_on_hand_made_probabilities():
    rule = PriorCorrection.of([0.9, 0.1], 2)
    # r is proportional to 1 / pi: (10, 1/0.1 = 10/9 ... ) normalised to (0.1, 0.9); the positive wins above 0.1
    np.testing.assert_allclose(rule.factors, [0.1, 0.9])
    assert rule.threshold == pytest.approx(0.1)
    proba = np.array([[0.85, 0.15],   # 0.085 vs 0.135: positive, although the argmax says negative
                      [0.95, 0.05],   # 0.095 vs 0.045: negative
                      [0.30, 0.70]])  # positive either way
    np.testing.assert_array_equal(rule.decide(proba), [1, 0, 1])
    # three classes: pi = (0.5, 0.3, 0.2), r proportional to (2, 10/3, 5)
    three = PriorCorrection.of([0.5, 0.3, 0.2], 3)
    np.testing.assert_allclose(three.factors, np.array([2, 10 / 3, 5]) / (2 + 10 / 3 + 5))
    assert three.threshold is None
    proba = np.array([[0.45, 0.30, 0.25],   # 0.90, 1.00, 1.25 (x 1/sum): class 2
                      [0.60, 0.25, 0.15],   # 1.20, 0.83, 0.75: class 0
                      [0.40, 0.35, 0.25]])  # 0.80, 1.17, 1.25: class 2
    np.testing.assert_array_equal(three.decide(proba), [2, 0, 2])


def test_without_anything_to_correct_it_is_the_argmax():
    proba = np.random.default_rng(0).dirichlet(np.ones(3), size=200)
    uniform = PriorCorrection.of([1 / 3, 1 / 3, 1 / 3], 3)
    np.testing.assert_array_equal(uniform.decide(proba), proba.argmax(axis=1))
    # weights that are already the inverse base rates leave a uniform training prior: nothing left to correct
    prior = np.array([0.7, 0.2, 0.1])
    inverse = PriorCorrection.of(prior, 3, class_weights=1.0 / prior)
    np.testing.assert_allclose(inverse.factors, [1 / 3] * 3)
    np.testing.assert_array_equal(inverse.decide(proba), proba.argmax(axis=1))


def test_the_class_weights_tilt_the_training_prior_and_the_rule_undoes_it():
    # a model trained with w = (1/9, 1) on a 4 % base rate saw the prior pi * w / sum: (0.96/9, 0.04) normalised
    rule = PriorCorrection.of([0.96, 0.04], 2, class_weights=[1 / 9, 1.0])
    expected = np.array([0.96 / 9, 0.04]) / (0.96 / 9 + 0.04)
    np.testing.assert_allclose(rule.training_prior, expected)
    assert rule.threshold == pytest.approx(expected[1])
    np.testing.assert_allclose(rule.factors, (1 / expected) / (1 / expected).sum())
    # for two classes the rule is the threshold q(1|x) > pi'_1 (away from exact ties)
    p1 = np.random.default_rng(1).uniform(size=500)
    p1 = p1[np.abs(p1 - rule.threshold) > 1e-9]
    np.testing.assert_array_equal(rule.decide(np.c_[1 - p1, p1]), (p1 > rule.threshold).astype(int))
    assert rule.describe()["class_weights"] == pytest.approx([1 / 9, 1.0])


def test_a_prior_that_is_not_one_base_rate_per_class_is_refused_by_name():
    with pytest.raises(ConfigurationError, match=r"class_prior has 3 values for 2 classes"):
        PriorCorrection.of([0.5, 0.3, 0.2], 2)
    for bad in ([0.0, 1.0], [-0.1, 1.1], [math.nan, 1.0], [math.inf, 0.5]):
        with pytest.raises(ConfigurationError, match=r"class_prior must be finite numbers > 0"):
            PriorCorrection.of(bad, 2)
    with pytest.raises(ConfigurationError, match=r"must sum to 1 .* summing to 0\.8$"):
        PriorCorrection.of([0.5, 0.3], 2)
    with pytest.raises(ConfigurationError, match=r"percentages\? divide by 100"):
        PriorCorrection.of([96, 4], 2)
    with pytest.raises(ConfigurationError, match=r"--class-prior must be a list of numbers"):
        PriorCorrection.of(["a", "b"], 2, what="--class-prior")
    with pytest.raises(ConfigurationError, match=r"class weights .* one finite number > 0 per class"):
        PriorCorrection.of([0.9, 0.1], 2, class_weights=[1.0, 1.0, 1.0])
    with pytest.raises(ConfigurationError, match=r"class probabilities of shape \(4, 3\)"):
        PriorCorrection.of([0.9, 0.1], 2).decide(np.full((4, 3), 1 / 3))
    # rounded published rates are accepted, and renormalised
    rule = PriorCorrection.of([0.333, 0.333, 0.3335], 3)
    assert sum(rule.class_prior) == pytest.approx(1.0)


def test_decision_metrics_are_scikit_learns():
    rng = np.random.default_rng(2)
    y = (rng.uniform(size=300) < 0.1).astype(int)
    proba = np.clip(0.2 * y[:, None] * [-1, 1] + rng.dirichlet([8, 1], size=300), 1e-6, None)
    proba /= proba.sum(axis=1, keepdims=True)
    rule = PriorCorrection.of([0.9, 0.1], 2)
    pred = rule.decide(proba)
    out = rule.metrics(proba, y)
    assert out["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(y, pred))
    assert out["recall"] == pytest.approx(recall_score(y, pred))
    assert out["positive_rate"] == pytest.approx(pred.mean())
    assert out["accuracy"] == pytest.approx((pred == y).mean())
    three = decision_metrics(np.array([0, 0, 2, 2]), np.array([0, 1, 2, 2]), 3)
    assert three["majority_prediction_share"] == 0.5 and "recall" not in three


def test_the_weights_a_run_trains_with_are_read_from_its_options():
    assert run_class_weights((0.2, 1.0)) == [0.2, 1.0]
    assert run_class_weights(None, nn.CrossEntropyLoss(weight=torch.tensor([0.25, 1.0]))) == [0.25, 1.0]
    assert run_class_weights(None, nn.NLLLoss(weight=torch.tensor([0.5, 1.0]))) == [0.5, 1.0]
    assert run_class_weights(None, nn.CrossEntropyLoss()) is None
    assert run_class_weights(None, nn.MSELoss()) is None
    assert run_class_weights() is None
