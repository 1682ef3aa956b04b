"""Classification metrics: balanced accuracy and AUROC against hand counts and scikit-learn, on imbalanced data."""

import math

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from privfl.metrics import auroc, balanced_accuracy, classification_metrics


def test_majority_predictor_on_imbalanced_data_is_exposed():
    """97% negatives, a model that always predicts the majority: accuracy 0.97 but balanced accuracy 0.5."""
    y = np.array([0] * 97 + [1] * 3)
    proba = np.tile([0.9, 0.1], (100, 1))
    m = classification_metrics(proba, y)
    assert m["accuracy"] == pytest.approx(0.97)
    assert m["balanced_accuracy"] == pytest.approx(0.5)
    assert m["auroc"] == pytest.approx(0.5)  # constant scores: ties everywhere
    assert {"accuracy", "balanced_accuracy", "auroc", "nll", "ece", "selective_accuracy", "majority_prediction_share",
            "positive_rate", "recall", "average_precision"} == set(m)
    # the 0.5 rule never fires: one class predicted, no positive found, although nothing else is wrong
    assert (m["majority_prediction_share"], m["positive_rate"], m["recall"]) == (1.0, 0.0, 0.0)


def test_binary_auroc_by_hand():
    # positives scored 0.8 and 0.4, negatives 0.6 and 0.2: 3 of 4 (pos, neg) pairs ordered right
    y = np.array([1, 1, 0, 0])
    p1 = np.array([0.8, 0.4, 0.6, 0.2])
    assert auroc(np.stack([1 - p1, p1], axis=1), y) == pytest.approx(0.75)


def test_balanced_accuracy_by_hand():
    y = np.array([0, 0, 0, 0, 1, 1, 2])
    pred = np.array([0, 0, 0, 1, 1, 0, 2])
    proba = np.eye(3)[pred]
    assert balanced_accuracy(proba, y) == pytest.approx((3 / 4 + 1 / 2 + 1) / 3)


def test_multiclass_auroc_is_macro_one_vs_rest_and_skips_absent_classes():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 200)
    logits = rng.normal(size=(200, 4)) + 2 * np.eye(4)[y]
    proba = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    expected = np.mean([roc_auc_score(y == c, proba[:, c]) for c in range(3)])  # class 3 never occurs
    assert auroc(proba, y) == pytest.approx(expected)
    full = proba[:, :3] / proba[:, :3].sum(axis=1, keepdims=True)
    assert auroc(full, y) == pytest.approx(roc_auc_score(y, full, multi_class="ovr", average="macro"))


def test_auroc_is_nan_with_one_class():
    assert math.isnan(auroc(np.array([[0.3, 0.7], [0.6, 0.4]]), np.array([1, 1])))


@pytest.mark.parametrize("classes", [2, 3, 10])
def test_numpy_metrics_equal_scikit_learns_with_ties(classes):
    """balanced_accuracy and auroc are computed in numpy/scipy (they run every round); they must be sklearn's."""
    import warnings

    from sklearn.metrics import balanced_accuracy_score

    from privfl.metrics.classification import auroc, balanced_accuracy

    rng = np.random.default_rng(classes)
    checked = 0
    for _ in range(30):
        n = int(rng.integers(5, 300))
        y = rng.integers(0, classes, n)
        p = np.round(rng.random((n, classes)), 1) + 0.01  # rounded: many tied scores
        p /= p.sum(axis=1, keepdims=True)
        if len(np.unique(y)) < 2:
            continue
        present = np.unique(y)
        ref = (roc_auc_score(y == 1, p[:, 1]) if classes == 2
               else np.mean([roc_auc_score(y == c, p[:, c]) for c in present]))
        assert auroc(p, y) == pytest.approx(ref, abs=1e-12)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sklearn warns when a predicted class is absent from y
            assert balanced_accuracy(p, y) == pytest.approx(balanced_accuracy_score(y, p.argmax(1)), abs=1e-12)
        checked += 1
    assert checked >= 20



def test_binary_metrics_equal_scikit_learn_with_ties():
    from sklearn.metrics import average_precision_score, recall_score

    from privfl.metrics.classification import binary_metrics

    rng = np.random.default_rng(0)
    for trial in range(100):
        y = rng.integers(0, 2, 40)
        scores = np.round(rng.random(40), 1) if trial % 2 else rng.random(40)  # ties on odd trials
        m = binary_metrics(np.stack([1 - scores, scores], axis=1), y)
        assert m["average_precision"] == pytest.approx(average_precision_score(y, scores), abs=1e-12)
        assert m["recall"] == pytest.approx(recall_score(y, (scores > 0.5).astype(int)), abs=1e-12)
        assert m["positive_rate"] == pytest.approx(np.mean(scores > 0.5))


def test_selective_accuracy_keeps_the_most_confident_points():
    from privfl.metrics.classification import selective_accuracy

    y = np.array([0, 0, 1, 1, 1])
    proba = np.array([[0.99, 0.01], [0.9, 0.1], [0.2, 0.8], [0.45, 0.55], [0.51, 0.49]])  # the last one is wrong
    assert selective_accuracy(proba, y, coverage=0.8) == 1.0  # its least confident point is left out
    assert selective_accuracy(proba, y, coverage=1.0) == pytest.approx(0.8)


def test_a_one_class_model_is_warned_about():
    from privfl.metrics.report import one_class_warning

    y = np.array([0] * 97 + [1] * 3)
    assert "predicts one class" in one_class_warning(classification_metrics(np.tile([0.9, 0.1], (100, 1)), y))
    proba = np.tile([0.9, 0.1], (100, 1))
    proba[-1] = [0.2, 0.8]
    assert one_class_warning(classification_metrics(proba, y)) is None
