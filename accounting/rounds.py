"""The one rule for what a round's charged events compose to: the sampled channels of a round share one coin.

Used by calibration (``accounting.calibration.round_event``), by the ledger (a client's history) and by every
translation of a round into events, so what is calibrated is exactly what is charged.
"""

from __future__ import annotations

from typing import Iterable

from .events import ComposedEvent, PoissonSampledEvent, PrivacyEvent


def round_events(charged: Iterable[tuple[int, PrivacyEvent]]) -> list[PrivacyEvent]:
    """The mechanisms a client's charges describe, one list entry per round's mechanism.

    A round's channels released on one Poisson sample share one sampling coin: ``PoissonSampled(q, A)`` and
    ``PoissonSampled(q, B)`` charged in the same round are the mechanism ``PoissonSampled(q, Composed(A, B))``, which
    is what calibration composes (charging them as two independent samples would be a different mechanism). Events
    are grouped by (sampling rate, relation); a run has one relation, and the accountant refuses a mix.
    """
    by_round: dict[int, list[PrivacyEvent]] = {}
    for rnd, event in charged:
        by_round.setdefault(rnd, []).append(event)
    out: list[PrivacyEvent] = []
    for rnd in sorted(by_round):
        sampled: dict[tuple[float, str], list[PrivacyEvent]] = {}
        for event in by_round[rnd]:
            if isinstance(event, PoissonSampledEvent):
                sampled.setdefault((event.sampling_rate, event.relation), []).append(event.event)
            else:
                out.append(event)
        for (q, relation), inner in sampled.items():
            out.append(PoissonSampledEvent(q, inner[0] if len(inner) == 1 else ComposedEvent(tuple(inner)), relation))
    return out


__all__ = ["round_events"]
