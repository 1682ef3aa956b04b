"""Classification metrics: accuracy, balanced accuracy, AUROC, NLL, calibration (expected calibration error),
selective accuracy, the share of the most predicted class, and for two classes the predicted-positive rate, recall
and average precision.

Accuracy misleads on imbalanced data (a majority-class predictor scores the majority's share), so every
classification run also reports balanced accuracy (the mean recall over the classes present in the labels) and the
area under the ROC curve (binary; macro one-vs-rest over the classes present for more than two classes). Both are
scikit-learn's definitions, computed in numpy and scipy (they run after every round; the tests compare them with
``sklearn.metrics``).
"""

from __future__ import annotations

import numpy as np


def balanced_accuracy(proba: np.ndarray, y: np.ndarray) -> float:
    """Mean over the classes present in ``y`` of the recall of the argmax prediction (Brodersen et al. 2010);
    chance level is 1 / (number of classes present) whatever the class balance. (scikit-learn's
    ``balanced_accuracy_score``, computed here in numpy: it runs after every round.)"""
    if not len(np.asarray(y)):
        return float("nan")
    return balanced_accuracy_of(np.asarray(proba).argmax(axis=1), y)


def balanced_accuracy_of(pred: np.ndarray, y: np.ndarray) -> float:
    """Mean over the classes present in ``y`` of the recall of the class predictions ``pred``."""
    pred, y = np.asarray(pred), np.asarray(y)
    if not len(y):
        return float("nan")
    classes, index = np.unique(y, return_inverse=True)
    hits = np.bincount(index, weights=(pred == y), minlength=len(classes))
    return float(np.mean(hits / np.bincount(index, minlength=len(classes))))


def _rank_auc(scores: np.ndarray, positive: np.ndarray, ranks: np.ndarray) -> float:
    """AUROC as the Mann-Whitney statistic with average ranks for ties (what ``roc_auc_score`` computes)."""
    n_pos = int(positive.sum())
    n_neg = len(scores) - n_pos
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def auroc(proba: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve of the class scores ``proba`` (n, C).

    Two columns: the binary AUROC of the positive class (column 1). More: the macro average of the one-vs-rest AUROCs
    of the classes present in ``y`` (a class absent from the labels has no ROC curve and is left out). NaN when fewer
    than two classes are present (no curve can be drawn). Computed from ranks (scipy), equal to scikit-learn's
    ``roc_auc_score`` (tested)."""
    from scipy.stats import rankdata

    proba = np.asarray(proba, dtype=np.float64)
    y = np.asarray(y)
    present = np.unique(y)
    if len(present) < 2:
        return float("nan")
    if proba.shape[1] == 2:
        return _rank_auc(proba[:, 1], y == 1, rankdata(proba[:, 1]))
    ranks = rankdata(proba[:, present], axis=0)
    return float(np.mean([_rank_auc(proba[:, c], y == c, ranks[:, i]) for i, c in enumerate(present)]))


def classification_metrics(proba: np.ndarray, y: np.ndarray, bins: int = 15) -> dict[str, float]:
    """Accuracy, balanced accuracy, AUROC (see :func:`auroc`), NLL and expected calibration error (equal-width
    confidence bins, Guo et al. 2017)."""
    y = np.asarray(y)
    proba = np.asarray(proba)
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
    out = {"accuracy": float(correct.mean()), "balanced_accuracy": balanced_accuracy(proba, y),
           "auroc": auroc(proba, y), "nll": float(-np.log(p_true).mean()), "ece": float(ece),
           "selective_accuracy": selective_accuracy(proba, y),
           "majority_prediction_share": float(np.bincount(pred).max() / len(pred)) if len(pred) else float("nan")}
    if proba.shape[1] == 2:
        out.update(binary_metrics(proba, y))
    return out


def selective_accuracy(proba: np.ndarray, y: np.ndarray, coverage: float = 0.8) -> float:
    """Accuracy on the ``coverage`` share of the points the model is most confident about (its largest class
    probability): what a model whose uncertainty is worth something gains by abstaining on the rest."""
    proba, y = np.asarray(proba), np.asarray(y)
    if not len(y):
        return float("nan")
    keep = max(1, int(round(coverage * len(y))))
    order = np.argsort(-proba.max(axis=1), kind="stable")[:keep]
    return float((proba[order].argmax(axis=1) == y[order]).mean())


def binary_metrics(proba: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """For two classes (class 1 the positive): the predicted-positive rate and the recall of the 0.5 rule, and the
    average precision of the positive scores (scikit-learn's definition: the precision at each positive, averaged).
    A rare-class model that ranks well (high AUROC) but never predicts the positive shows recall 0 here."""
    y = np.asarray(y)
    score = np.asarray(proba, dtype=np.float64)[:, 1]
    pred = score > 0.5
    positive = y == 1
    n_pos = int(positive.sum())
    recall = float(pred[positive].mean()) if n_pos else float("nan")
    if n_pos:
        order = np.argsort(-score, kind="stable")
        hits = positive[order]
        # ties share a threshold: the precision at a score counts every point scored at least as high
        ranked = score[order]
        last_of_tie = np.r_[ranked[1:] != ranked[:-1], True]
        tp = np.cumsum(hits)
        # one threshold per distinct score (the last point of each tie): sum over thresholds of (R_k - R_{k-1}) P_k
        idx = np.flatnonzero(last_of_tie)
        precision, recall_at = tp[idx] / (idx + 1), tp[idx] / n_pos
        average_precision = float(np.sum(np.diff(np.r_[0.0, recall_at]) * precision))
    else:
        average_precision = float("nan")
    return {"positive_rate": float(pred.mean()) if len(pred) else float("nan"), "recall": recall,
            "average_precision": average_precision}


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
