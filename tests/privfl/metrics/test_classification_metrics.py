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
    assert {"accuracy", "balanced_accuracy", "auroc", "nll", "ece"} == set(m)


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
