"""Reporting helpers for run results: the noise a ledger shows applied, and strict JSON.

Strict JSON: Python's ``json`` writes ``Infinity`` and ``NaN``, which other JSON parsers refuse. Results written by
privfl carry the string ``"inf"`` (or ``"-inf"``) for an infinite number (a non-private run's epsilon) and ``null`` for
a number that is not defined (``NaN``, e.g. the AUROC of a test set with one class). :func:`from_strict_number` reads
them back.
"""

from __future__ import annotations

import math
from typing import Any


def strict_json(obj: Any) -> Any:
    """``obj`` with every infinite float replaced by ``"inf"``/``"-inf"`` and every NaN by ``None``, numpy scalars and
    arrays by Python numbers and lists, tuples by lists; dictionary keys are kept."""
    import numpy as np

    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return strict_json(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
    return obj


def from_strict_number(value: Any) -> Any:
    """The inverse of :func:`strict_json` for one number: ``"inf"``/``"-inf"`` to floats, ``None`` to NaN."""
    if value is None:
        return math.nan
    if isinstance(value, str) and value in ("inf", "-inf"):
        return float(value)
    return value


def _gaussians(event, steps: int = 1, sampling_rate: float = 1.0):
    """(GaussianEvent, steps, sampling rate) inside ``event`` (composed, self-composed and sampled events opened)."""
    kind = getattr(event, "kind", "")
    if kind == "gaussian":
        yield event, steps, sampling_rate
    elif kind == "self_composed":
        yield from _gaussians(event.event, steps * int(event.count), sampling_rate)
    elif kind == "poisson_sampled":
        yield from _gaussians(event.event, steps, sampling_rate * float(event.sampling_rate))
    elif kind == "composed":
        for e in event.events:
            yield from _gaussians(e, steps, sampling_rate)


def applied_noise(charges) -> dict[str, list[dict[str, float]]]:
    """The noise a ledger's charges show applied, per channel: the distinct Gaussian releases (``noise_multiplier`` =
    noise std / sensitivity, ``noise_std``, ``sensitivity``, ``steps`` per charge and ``sampling_rate``) over clients
    and rounds. For DP-SGD-trained channels these are the per-step noise each client used; for noised channels the
    release noise. A channel charged with no Gaussian (non-private, or an unsupported event) maps to an empty list."""
    out: dict[str, set] = {}
    for charge in charges:
        seen = out.setdefault(charge.channel, set())
        for g, steps, q in _gaussians(charge.event):
            seen.add((round(g.noise_std / g.sensitivity, 12), g.noise_std, g.sensitivity, steps, q))
    return {ch: [{"noise_multiplier": z, "noise_std": s, "sensitivity": c, "steps": n, "sampling_rate": q}
                 for z, s, c, n, q in sorted(v)] for ch, v in sorted(out.items())}


def prior_corrected(rule, proba, y) -> dict | None:
    """What a run reports of its prior-corrected decision rule (:class:`privfl.metrics.decision.PriorCorrection`):
    the rule (declared prior, weights, training prior, factors, binary threshold) and its decision metrics on the
    labelled data (``proba``: the final model's class probabilities on it). None without a rule or probabilities."""
    if rule is None or proba is None:
        return None
    return {**rule.describe(), "metrics": rule.metrics(proba, y)}


__all__ = ["applied_noise", "from_strict_number", "one_class_warning", "prior_corrected", "strict_json"]


def one_class_warning(metrics) -> str | None:
    """The warning a classification run gets when its final model predicts one class for every test point (the
    ``majority_prediction_share`` metric is 1): on rare classes under DP the 0.5 rule may never fire although the
    model ranks well (see AUROC and average precision). None otherwise."""
    share = (metrics or {}).get("majority_prediction_share")
    if share is None or not share >= 1.0:
        return None
    return ("the final model predicts one class for every test point (balanced accuracy "
            f"{metrics.get('balanced_accuracy', float('nan')):.3f}, AUROC {metrics.get('auroc', float('nan')):.3f}): "
            "a rare class may never win the argmax under DP noise; look at recall and average precision, and "
            "consider a decision rule from a public base rate (class_prior=, --class-prior: "
            "privfl.metrics.decision)")

