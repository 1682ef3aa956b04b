"""A prior-corrected decision rule for rare classes: post-processing of a trained model's class probabilities, free of
privacy cost, from a class prior the user declares as a public fact.

Why: under DP noise a rare class seldom wins the argmax (recall 0 although the AUROC is high), and a threshold tuned
on the test set, or a base rate counted from the clients' labels, would be a leak (the second one an uncharged release
of the clients' data). The base rate is often public instead (a published prevalence, a public reference sample, a
design share): declared before the run, it moves the decision boundary at no cost, whatever the clients hold.

The rule (:class:`PriorCorrection`). Let ``pi`` be the declared class prior of the clients' training data and ``w``
the class weights the run trained with (a weighted loss, or DP-SGD's class-weighted sampling rates ``q * w_y /
max(w)``: both weigh class y's records by ``w_y`` in expectation; ``w = 1`` without weights). The model was fitted to
the distribution with the same class-conditionals ``p(x|y)`` and the effective prior

    pi'_y = pi_y * w_y / sum_k pi_k * w_k,

so its probabilities estimate ``q(y|x) = p(x|y) pi'_y / q(x)``. The balanced decision (the Bayes rule under a uniform
prior, which maximises balanced accuracy) is ``argmax_y p(x|y) = argmax_y q(y|x) / pi'_y``, that is

    predict argmax_y q(y|x) * r_y,   r_y = (1 / (pi_y * w_y)) / sum_k (1 / (pi_k * w_k)).

Without weights ``r_y`` is proportional to ``1 / pi_y``; with weights already the inverse of the prior (``w_y``
proportional to ``1 / pi_y``) ``r`` is uniform and the rule is the plain argmax. For two classes it is the threshold
``q(1|x) > pi'_1``: the positive wins when its probability exceeds its effective training share. ``r`` depends on
``pi`` and ``w`` only (public facts), never on the clients' labels or the test set; the decisions of two neighbouring
federations differ only through their trained models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from privfl.errors import ConfigurationError
from privfl.metrics.classification import balanced_accuracy_of

#: how far the declared prior's sum may be from 1 (published rates are rounded: 0.333, 0.333, 0.334)
PRIOR_SUM_TOLERANCE = 1e-3


def _vector(values, what: str) -> np.ndarray:
    try:
        out = np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{what} must be a list of numbers, one per class, got {values!r}") from None
    return out


@dataclass(frozen=True)
class PriorCorrection:
    """The balanced decision rule of a model trained on data with the public class prior ``class_prior`` and the
    class weights ``class_weights`` (None: unweighted); see the module's docstring for the formula. Build it with
    :meth:`of`, which checks both."""

    class_prior: tuple[float, ...]
    class_weights: tuple[float, ...] | None = None

    @classmethod
    def of(cls, class_prior: Sequence[float], num_classes: int, class_weights: Sequence[float] | None = None,
           what: str = "class_prior") -> "PriorCorrection":
        """Check the declared prior against the public label set (``num_classes``): one finite number > 0 per class,
        summing to 1 (within :data:`PRIOR_SUM_TOLERANCE`; then renormalised), and the weights (one finite number
        > 0 per class). ``what`` names the setting in the errors (``class_prior``, ``--class-prior``)."""
        prior = _vector(class_prior, what)
        if prior.size != num_classes:
            raise ConfigurationError(f"{what} has {prior.size} values for {num_classes} classes: give one base rate "
                                     "per class, in the order of the model's outputs (e.g. [0.96, 0.04])")
        if not np.isfinite(prior).all() or (prior <= 0).any():
            raise ConfigurationError(f"{what} must be finite numbers > 0 (a class with base rate 0 is never "
                                     f"predicted), got {prior.tolist()}")
        total = float(prior.sum())
        if abs(total - 1.0) > PRIOR_SUM_TOLERANCE:
            hint = " (percentages? divide by 100)" if math.isclose(total, 100.0, rel_tol=1e-3) else ""
            raise ConfigurationError(f"{what} must sum to 1 (the public base rates of the classes), got "
                                     f"{prior.tolist()} summing to {total:g}{hint}")
        weights = None
        if class_weights is not None:
            w = _vector(class_weights, "class weights")
            if w.size != num_classes or not np.isfinite(w).all() or (w <= 0).any():
                raise ConfigurationError(f"{what}: the run's class weights {w.tolist()} are not one finite number "
                                         f"> 0 per class ({num_classes} classes)")
            weights = tuple(float(v) for v in w)
        return cls(tuple(float(p) for p in prior / total), weights)

    @property
    def training_prior(self) -> np.ndarray:
        """``pi'``: the class prior the model was effectively trained on (the prior tilted by the weights)."""
        tilted = np.asarray(self.class_prior) * (1.0 if self.class_weights is None else np.asarray(self.class_weights))
        return tilted / tilted.sum()

    @property
    def factors(self) -> np.ndarray:
        """``r``: the factor each class's probability is multiplied by before the argmax (sums to 1)."""
        inverse = 1.0 / self.training_prior
        return inverse / inverse.sum()

    @property
    def threshold(self) -> float | None:
        """For two classes, the probability of class 1 above which it is predicted (``pi'_1``); None otherwise."""
        return float(self.training_prior[1]) if len(self.class_prior) == 2 else None

    def decide(self, proba: np.ndarray) -> np.ndarray:
        """The predicted class of each row of ``proba`` (n, C): ``argmax_y proba[:, y] * r_y``."""
        proba = np.asarray(proba, dtype=np.float64)
        if proba.ndim != 2 or proba.shape[1] != len(self.class_prior):
            raise ConfigurationError(f"class probabilities of shape {proba.shape} for a prior over "
                                     f"{len(self.class_prior)} classes")
        return (proba * self.factors).argmax(axis=1)

    def metrics(self, proba: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """The decision metrics of the rule on labelled data: accuracy, balanced accuracy (mean recall over the
        classes present), the share of the most predicted class, and for two classes the recall and the
        predicted-positive rate. (The rule moves decisions only: AUROC, average precision, NLL and ECE are the
        model's, as reported without it.)"""
        return decision_metrics(self.decide(proba), y, len(self.class_prior))

    def describe(self) -> dict:
        """The rule, for a run's JSON: the declared prior, the weights, ``training_prior``, ``factors`` and, for two
        classes, ``threshold``."""
        out = {"class_prior": list(self.class_prior),
               "class_weights": None if self.class_weights is None else list(self.class_weights),
               "training_prior": self.training_prior.tolist(), "factors": self.factors.tolist()}
        if self.threshold is not None:
            out["threshold"] = self.threshold
        return out


def decision_metrics(pred: np.ndarray, y: np.ndarray, num_classes: int) -> dict[str, float]:
    """Accuracy, balanced accuracy (as :func:`privfl.metrics.classification.balanced_accuracy`), the share of the most
    predicted class and, for two classes, recall and predicted-positive rate, of the class predictions ``pred``."""
    pred, y = np.asarray(pred), np.asarray(y)
    if not len(y):
        return {"accuracy": math.nan, "balanced_accuracy": math.nan, "majority_prediction_share": math.nan}
    out = {"accuracy": float((pred == y).mean()), "balanced_accuracy": balanced_accuracy_of(pred, y),
           "majority_prediction_share": float(np.bincount(pred, minlength=num_classes).max() / len(pred))}
    if num_classes == 2:
        positive = y == 1
        out["recall"] = float((pred[positive] == 1).mean()) if positive.any() else math.nan
        out["positive_rate"] = float((pred == 1).mean())
    return out


__all__ = ["PRIOR_SUM_TOLERANCE", "PriorCorrection", "decision_metrics"]
