"""Privacy events: small frozen records that describe a mechanism and hold no maths beyond their own parameters.

An event is validated when it is constructed, so a NaN sigma or a negative rho never reaches an accountant or the
ledger. Accountants (``accounting.accountants``) turn events into (epsilon, delta).

Every event serialises to a plain dict (``to_dict``) and back (``event_from_dict``) so the ledger can store it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidPrivacyParameter
from .validation import (RELATIONS, check_count, check_positive_finite, check_probability,
                                   check_relation)


class PrivacyEvent:
    """Base class. Subclasses are frozen dataclasses with a class-level ``kind`` used for serialisation."""

    kind: str = "abstract"

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def mechanism(self) -> str:
        """A short name of the mechanism, for ledgers and tables."""
        return self.kind


@dataclass(frozen=True)
class GaussianEvent(PrivacyEvent):
    """One release of the Gaussian mechanism: noise N(0, noise_std^2 I) on a value of L2 sensitivity ``sensitivity``.

    ``sensitivity`` is always the largest L2 distance between the value on two neighbouring data sets under the run's
    neighbouring relation (a unit clipped to norm C moves a sum by C under add/remove, by 2C under replace-one).
    It is exactly rho-zCDP with rho = sensitivity^2 / (2 noise_std^2), and exactly a mu-Gaussian-DP mechanism with
    mu = sensitivity / noise_std (Dong, Roth and Su 2019). ``mu`` may overflow to inf (or underflow to 0) for extreme
    ratios; accountants then report epsilon = inf (or charge nothing).
    """

    sensitivity: float
    noise_std: float
    kind = "gaussian"

    def __post_init__(self):
        object.__setattr__(self, "sensitivity", check_positive_finite("sensitivity", self.sensitivity))
        object.__setattr__(self, "noise_std", check_positive_finite("noise_std", self.noise_std))

    @property
    def noise_multiplier(self) -> float:
        return self.noise_std / self.sensitivity

    @property
    def mu(self) -> float:
        return self.sensitivity / self.noise_std

    @property
    def rho(self) -> float:
        mu = self.mu
        return mu * mu / 2.0  # products overflow to inf where ** would raise

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "sensitivity": self.sensitivity, "noise_std": self.noise_std}


@dataclass(frozen=True)
class ZCDPEvent(PrivacyEvent):
    """A mechanism known only to satisfy rho-zCDP (e.g. a sum of discrete Gaussians, Kairouz et al. 2021)."""

    rho: float
    label: str = "zcdp"
    kind = "zcdp"

    def __post_init__(self):
        object.__setattr__(self, "rho", check_positive_finite("rho", self.rho))
        if not isinstance(self.label, str) or not self.label:
            raise InvalidPrivacyParameter("label must be a non-empty string naming the mechanism")

    @property
    def mechanism(self) -> str:
        return self.label

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "rho": self.rho, "label": self.label}


@dataclass(frozen=True)
class PoissonSampledEvent(PrivacyEvent):
    """``event`` applied to a Poisson sample of the population, each member included with probability q.

    ``relation`` is the run's neighbouring relation, ``"add_remove"`` (default) or ``"replace_one"`` (clients' record
    counts are public, so neighbours replace one unit). Every sensitivity inside ``event`` is, as everywhere, the L2
    displacement between the two neighbouring outputs under that relation: a unit clipped to norm C gives C under
    add/remove and 2C under replace-one.

    Under replace-one the accountant charges the Poisson-sampled Gaussian whose sampled component sits at +r or -r
    around the output without the unit, with r = sensitivity / 2 (dp-accounting's ``REPLACE_ONE`` relation with
    radius r; at q = 1 it is exactly the unsampled Gaussian with sensitivity 2r). That is sound when every unit's
    contribution has norm at most sensitivity / 2, which holds for a sum of units clipped to C (2C = twice the clip).
    A channel whose replace-one displacement is below twice its per-unit norm bound (e.g. sums of squares of
    non-negative terms: sqrt(2) C^2 apart, each of norm C^2) must pass twice the per-unit bound (2 C^2) inside a
    sampled replace-one event, not its displacement.
    """

    sampling_rate: float
    event: PrivacyEvent
    relation: str = "add_remove"
    kind = "poisson_sampled"

    def __post_init__(self):
        object.__setattr__(self, "sampling_rate", check_probability("sampling_rate", self.sampling_rate))
        if not isinstance(self.event, PrivacyEvent):
            raise InvalidPrivacyParameter(f"event must be a PrivacyEvent, got {type(self.event).__name__}")
        check_relation(self.relation)

    @property
    def mechanism(self) -> str:
        if self.relation == "add_remove":
            return f"poisson({self.event.mechanism})"
        return f"poisson_{self.relation}({self.event.mechanism})"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "sampling_rate": self.sampling_rate, "relation": self.relation,
                "event": self.event.to_dict()}


@dataclass(frozen=True)
class ApproximatedEvent(PrivacyEvent):
    """A mechanism within total variation ``total_variation`` of a post-processing of ``event``'s mechanism.

    For every input, the law of the mechanism's output and the law of some fixed post-processing of ``event``'s
    mechanism on that input are at most ``total_variation`` apart. Composing such mechanisms (adaptively, in any
    order) gives a transcript within the sum of their total variations, s, of the composition of the idealised
    mechanisms (a hybrid argument), so for every epsilon

        delta(epsilon) <= delta_ideal(epsilon) + (1 + e^epsilon) s,

    with delta_ideal the idealised composition's (post-processing costs nothing). The accountants that take these
    events (``pld``, ``rdp``) compose ``event`` and add that term; the others refuse them. Example: a sum of discrete
    Gaussian shares is within a tiny total variation of a rounded continuous Gaussian, which is a post-processing of
    the continuous Gaussian mechanism (``privfl.mechanisms.discrete_gaussian.distributed_gaussian_event``).
    """

    event: PrivacyEvent
    total_variation: float
    label: str = "approximated"
    kind = "approximated"

    def __post_init__(self):
        if not isinstance(self.event, PrivacyEvent):
            raise InvalidPrivacyParameter(f"event must be a PrivacyEvent, got {type(self.event).__name__}")
        tv = self.total_variation
        if isinstance(tv, bool) or not isinstance(tv, (int, float)) or not (math.isfinite(tv) and 0.0 <= tv < 1.0):
            raise InvalidPrivacyParameter(f"total_variation must be a number in [0, 1), got {tv!r}")
        object.__setattr__(self, "total_variation", float(tv))
        if not isinstance(self.label, str) or not self.label:
            raise InvalidPrivacyParameter(f"label must be a non-empty string, got {self.label!r}")

    @property
    def mechanism(self) -> str:
        return f"{self.label}~{self.event.mechanism}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "total_variation": self.total_variation, "label": self.label,
                "event": self.event.to_dict()}


@dataclass(frozen=True)
class SelfComposedEvent(PrivacyEvent):
    """``event`` applied ``count`` times (adaptively)."""

    event: PrivacyEvent
    count: int
    kind = "self_composed"

    def __post_init__(self):
        if not isinstance(self.event, PrivacyEvent):
            raise InvalidPrivacyParameter(f"event must be a PrivacyEvent, got {type(self.event).__name__}")
        object.__setattr__(self, "count", check_count("count", self.count))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "count": self.count, "event": self.event.to_dict()}


@dataclass(frozen=True)
class ComposedEvent(PrivacyEvent):
    """The adaptive composition of ``events``, in order."""

    events: tuple[PrivacyEvent, ...] = field(default_factory=tuple)
    kind = "composed"

    def __post_init__(self):
        if isinstance(self.events, (str, bytes, dict)) or not hasattr(self.events, "__iter__"):
            raise InvalidPrivacyParameter(f"events must be a sequence of PrivacyEvent, got {self.events!r}")
        events = tuple(self.events)
        for e in events:
            if not isinstance(e, PrivacyEvent):
                raise InvalidPrivacyParameter(f"every composed event must be a PrivacyEvent, got {type(e).__name__}")
        object.__setattr__(self, "events", events)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "events": [e.to_dict() for e in self.events]}


@dataclass(frozen=True)
class NoOpEvent(PrivacyEvent):
    """A step that touches no private data (costs nothing)."""

    kind = "noop"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}


@dataclass(frozen=True)
class NonPrivateEvent(PrivacyEvent):
    """A release without noise (``--epsilon inf``): every accountant reports epsilon = inf for it."""

    kind = "non_private"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}


@dataclass(frozen=True)
class UnsupportedEvent(PrivacyEvent):
    """A mechanism whose privacy cost cannot be computed; every accountant refuses it, none guesses."""

    reason: str = "unknown mechanism"
    kind = "unsupported"

    def __post_init__(self):
        if not isinstance(self.reason, str):
            raise InvalidPrivacyParameter(f"reason must be a string saying why, got {self.reason!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "reason": self.reason}


def event_from_dict(d: dict[str, Any]) -> PrivacyEvent:
    """Inverse of ``PrivacyEvent.to_dict``; validates as the constructors do."""
    try:
        return _event_from_dict(d)
    except (KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise InvalidPrivacyParameter(f"not a serialised privacy event ({type(exc).__name__}: {exc}): "
                                      f"{str(d)[:200]}") from None


def _event_from_dict(d: dict[str, Any]) -> PrivacyEvent:
    if not isinstance(d, dict) or "kind" not in d:
        raise InvalidPrivacyParameter(f"not a serialised privacy event: {str(d)[:200]}")
    kind = d["kind"]
    if kind == GaussianEvent.kind:
        return GaussianEvent(d["sensitivity"], d["noise_std"])
    if kind == ZCDPEvent.kind:
        return ZCDPEvent(d["rho"], d.get("label", "zcdp"))
    if kind == PoissonSampledEvent.kind:
        # Rows written before relations existed carry none: they were add/remove.
        return PoissonSampledEvent(d["sampling_rate"], _event_from_dict(d["event"]), d.get("relation", "add_remove"))
    if kind == SelfComposedEvent.kind:
        return SelfComposedEvent(_event_from_dict(d["event"]), d["count"])
    if kind == ApproximatedEvent.kind:
        return ApproximatedEvent(_event_from_dict(d["event"]), d["total_variation"], d.get("label", "approximated"))
    if kind == ComposedEvent.kind:
        return ComposedEvent(tuple(_event_from_dict(e) for e in d["events"]))
    if kind == NoOpEvent.kind:
        return NoOpEvent()
    if kind == NonPrivateEvent.kind:
        return NonPrivateEvent()
    if kind == UnsupportedEvent.kind:
        return UnsupportedEvent(d.get("reason", "unknown mechanism"))
    raise InvalidPrivacyParameter(f"unknown privacy event kind {kind!r}")


def flatten(event: PrivacyEvent) -> list[tuple[PrivacyEvent, int]]:
    """Expand compositions into a list of (leaf event, count), merging equal leaves; order is kept."""
    counts: dict[PrivacyEvent, int] = {}

    def walk(e: PrivacyEvent, times: int) -> None:
        if isinstance(e, ComposedEvent):
            for sub in e.events:
                walk(sub, times)
        elif isinstance(e, SelfComposedEvent):
            walk(e.event, times * e.count)
        elif isinstance(e, NoOpEvent):
            return
        else:
            counts[e] = counts.get(e, 0) + times

    walk(event, 1)
    return list(counts.items())


def split_total_variation(event: PrivacyEvent) -> tuple[PrivacyEvent, float]:
    """(``event`` with every ``ApproximatedEvent`` replaced by its idealised event, the total variation they add up
    to over the whole composition: each one's times the number of times it is composed). ``event`` itself, not a
    copy, when it holds no ``ApproximatedEvent``."""

    def walk(e: PrivacyEvent) -> tuple[PrivacyEvent, float]:
        if isinstance(e, ApproximatedEvent):
            inner, tv = walk(e.event)
            return inner, tv + e.total_variation
        if isinstance(e, SelfComposedEvent):
            inner, tv = walk(e.event)
            return (e if inner is e.event else SelfComposedEvent(inner, e.count)), tv * e.count
        if isinstance(e, ComposedEvent):
            parts = [walk(sub) for sub in e.events]
            same = all(p[0] is sub for p, sub in zip(parts, e.events))
            return (e if same else ComposedEvent(tuple(p[0] for p in parts))), sum(p[1] for p in parts)
        if isinstance(e, PoissonSampledEvent):  # the noise is drawn whether or not a unit is sampled: tv is not scaled
            inner, tv = walk(e.event)
            return (e if inner is e.event else PoissonSampledEvent(e.sampling_rate, inner, e.relation)), tv
        return e, 0.0

    return walk(event)


def rho_of(event: PrivacyEvent) -> float:
    """The zCDP parameter of an event, if it has one (sampled and non-private events have none)."""
    total = 0.0
    for leaf, count in flatten(event):
        if isinstance(leaf, (GaussianEvent, ZCDPEvent)):
            total += count * leaf.rho
        elif isinstance(leaf, NonPrivateEvent):
            return math.inf
        else:
            raise InvalidPrivacyParameter(f"{leaf.mechanism} has no zCDP parameter")
    return total


__all__ = [
    "RELATIONS", "PrivacyEvent", "GaussianEvent", "ZCDPEvent", "PoissonSampledEvent", "SelfComposedEvent", "ComposedEvent",
    "NoOpEvent", "NonPrivateEvent", "UnsupportedEvent", "ApproximatedEvent", "event_from_dict", "flatten", "rho_of",
    "split_total_variation",
]
