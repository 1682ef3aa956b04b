"""The one place that resolves a run's settings, for every front end (``privfl run``, ``privfl compare``,
``privfl.federate``; the Flower spec is built from what they resolve).

A setting is what the user gave, else the algorithm's default for the input (``privfl.algorithms.algorithm_defaults``:
a 2x2 pooling applies to images only), else :class:`privfl.core.config.FederationConfig`'s and
:class:`privfl.core.config.PrivacyConfig`'s own defaults. The unit is the user's, else the algorithm's
``default_unit``; a grid that sets one unit for algorithms built for fewer (``compare``) gives each of them the first
unit it supports.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping

from privfl.core.config import FederationConfig, PrivacyConfig

#: the settings of the two configurations, by field name
FED_FIELDS = frozenset(f.name for f in fields(FederationConfig))
PRIVACY_FIELDS = frozenset(f.name for f in fields(PrivacyConfig))
#: what a run uses for a setting neither the user nor the algorithm gives: the configurations' own defaults
FALLBACKS: Mapping[str, Any] = {f.name: f.default for f in fields(FederationConfig) + fields(PrivacyConfig)
                                if f.name in ("clip", "local_epochs", "lr", "pool", "model")}


#: adaptive clipping's target quantile when ``clip="adaptive"`` names none (Andrew et al.'s median)
DEFAULT_CLIP_QUANTILE = 0.5


def resolve_settings(algorithm: str, given: Mapping[str, Any], *, image: bool) -> dict[str, Any]:
    """The settings a run of ``algorithm`` uses: ``given`` (a value of None: not given), over the algorithm's defaults
    for an ``image`` input or not, over :data:`FALLBACKS`. Keys other than these pass through as given.

    ``clip="adaptive"``: adaptive clipping (``PrivacyConfig.clip_quantile``), starting from the clip the run would
    have had (the algorithm's default), towards ``clip_quantile`` (default :data:`DEFAULT_CLIP_QUANTILE`). A
    ``clip_quantile`` without ``clip="adaptive"`` is refused."""
    from privfl.algorithms import ALGORITHMS, algorithm_defaults
    from privfl.errors import ConfigurationError

    given = dict(given)
    clip = given.get("clip")
    adaptive = isinstance(clip, str)
    if adaptive and clip != "adaptive":
        raise ConfigurationError(f"clip must be a number > 0 or 'adaptive', got {clip!r}")
    if not adaptive and given.get("clip_quantile") is not None:
        raise ConfigurationError("clip_quantile is adaptive clipping's target quantile: give it with clip='adaptive' "
                                 "(privfl run --clip adaptive --clip-quantile Q), or drop it for a fixed clip")
    if adaptive:
        given["clip"] = None
    resolved = dict(FALLBACKS)
    if algorithm in ALGORITHMS:
        resolved.update(algorithm_defaults(algorithm, image=image))
    resolved.update({k: v for k, v in given.items() if v is not None})
    if adaptive:
        resolved["clip_quantile"] = (DEFAULT_CLIP_QUANTILE if given.get("clip_quantile") is None
                                     else given["clip_quantile"])
    return resolved


def resolve_unit(algorithm: str, unit: str | None, *, adapt: bool = False) -> str:
    """The privacy unit of a run of ``algorithm``: ``unit``, else the algorithm's ``default_unit``; with ``adapt`` (a
    grid's one unit for many algorithms) the algorithm's first supported unit when it does not support ``unit``."""
    from privfl.algorithms import ALGORITHMS, default_unit

    if unit is None:
        return default_unit(algorithm)
    units = getattr(ALGORITHMS.get(algorithm), "units", None)
    if adapt and units and unit not in units:
        return units[0]
    return unit


def split_settings(settings: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``settings`` as keyword arguments of FederationConfig and of PrivacyConfig (other keys are left out)."""
    fed = {k: (tuple(v) if k == "hidden" and v is not None else v) for k, v in settings.items() if k in FED_FIELDS}
    privacy = {k: v for k, v in settings.items() if k in PRIVACY_FIELDS}
    return fed, privacy


def resolve_prior_correction(class_prior, algorithm, *, task: str, num_classes: int, loss=None,
                             what: str = "class_prior"):
    """The prior-corrected decision rule of a run (:class:`privfl.metrics.decision.PriorCorrection`), or None without
    ``class_prior``: the user's declared base rates (a public fact), checked against the public label set
    (``num_classes``), and the class weights the built ``algorithm`` trains with (its ``class_weights``, DP-FedSGD's
    sampling weights, else the weight of its loss, or of ``loss``), so the correction undoes the tilt they give the
    training prior. Nothing here reads the clients' data. Refused (before anything is charged) for a regression task
    and for an algorithm with no global model's probabilities to correct (FedBNN's models are the clients' own)."""
    if class_prior is None:
        return None
    from privfl.algorithms.base import FederatedAlgorithm
    from privfl.errors import ConfigurationError
    from privfl.metrics.decision import PriorCorrection

    if task != "classification":
        raise ConfigurationError(f"{what} is a decision rule over classes; a {task} run has none: drop it")
    if type(algorithm).predict_proba is FederatedAlgorithm.predict_proba:
        raise ConfigurationError(f"{what}: {algorithm.name} has no global model whose class probabilities the "
                                 "prior could correct; drop it or choose another algorithm")
    if loss is None:
        loss = getattr(getattr(algorithm, "user", None), "loss", None)
    weights = run_class_weights(getattr(algorithm, "class_weights", None), loss)
    return PriorCorrection.of(class_prior, num_classes, weights, what=what)


def run_class_weights(class_weights=None, loss=None):
    """The class weights a run trains with, as its options give them (public facts, the user's): the algorithm's
    ``class_weights`` option, else the weight of a weighted classification loss
    (``privfl.privacy.record_level.loss_class_weight``, the one reading of it); None when the run is unweighted."""
    if class_weights is not None:
        return [float(w) for w in class_weights]
    if loss is None:
        return None
    from privfl.privacy.record_level import loss_class_weight

    weight = loss_class_weight(loss)
    return None if weight is None else [float(w) for w in weight.detach().cpu().reshape(-1)]


__all__ = ["FALLBACKS", "FED_FIELDS", "PRIVACY_FIELDS", "resolve_prior_correction", "run_class_weights", "resolve_settings",
           "resolve_unit", "split_settings"]
