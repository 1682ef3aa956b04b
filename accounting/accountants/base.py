"""The one interface every accountant backend implements.

An accountant composes events and answers epsilon(delta) and delta(epsilon). It checks that it can compose an event
before changing any state, so a refused event leaves no trace (dp-accounting's habit).

Approximated events (``ApproximatedEvent``: a mechanism within a total variation of a post-processing of another) are
taken by the backends that set ``handles_total_variation``: :meth:`Accountant.compose` hands them the idealised event
and keeps the summed total variation s, and their answers add (1 + e^epsilon) s to delta (``_slack_epsilon``,
``_slack_delta``). The other backends refuse such events, so no backend can drop the term.
"""

from __future__ import annotations

import abc
import copy
import math

from ..errors import UnsupportedEventError
from ..events import PrivacyEvent, split_total_variation


class Accountant(abc.ABC):
    """Composes privacy events and converts the composition to (epsilon, delta)."""

    name: str = "abstract"
    #: whether this backend composes ``ApproximatedEvent``s (and adds their total variation to delta)
    handles_total_variation: bool = False

    def __init__(self) -> None:
        self._events: list[tuple[PrivacyEvent, int]] = []
        self._total_variation = 0.0

    @property
    def total_variation(self) -> float:
        """The summed total variation of the approximated events composed so far (0 if none)."""
        return getattr(self, "_total_variation", 0.0)

    @property
    def events(self) -> tuple[tuple[PrivacyEvent, int], ...]:
        """What has been composed so far, as (event, count) pairs."""
        return tuple(self._events)

    @abc.abstractmethod
    def supports(self, event: PrivacyEvent) -> bool:
        """Whether ``event`` can be composed by this accountant."""

    def _refusal(self, event: PrivacyEvent) -> str | None:
        """Why ``event`` cannot be composed now (a message that says what to change), or None if it can."""
        if self.supports(event):
            return None
        return (f"the {self.name!r} accountant cannot compose a {event.mechanism!r} event; "
                f"choose an accountant that supports it (exact: unsampled Gaussians; pld: sampled Gaussians under "
                f"add/remove or replace-one; rdp: add/remove-sampled Gaussians, zCDP events and add/remove Poisson-"
                f"sampled zCDP events; zcdp: unsampled Gaussian and zCDP events)")

    @abc.abstractmethod
    def _compose(self, event: PrivacyEvent, count: int) -> None:
        """Update the state; called only with supported events."""

    def compose(self, event: PrivacyEvent, count: int = 1) -> "Accountant":
        """Compose ``event`` ``count`` times; raises :class:`UnsupportedEventError` with the state unchanged."""
        from ..validation import check_count

        count = check_count("count", count)
        if not isinstance(event, PrivacyEvent):
            raise UnsupportedEventError(f"expected a PrivacyEvent, got {type(event).__name__}")
        inner, tv = split_total_variation(event)  # the event itself when it holds no ApproximatedEvent
        if inner is not event and not self.handles_total_variation:
            raise UnsupportedEventError(
                f"the {self.name!r} accountant cannot compose {event.mechanism!r} (a mechanism within a total "
                "variation of another, e.g. distributed discrete-Gaussian noise accounted as a Gaussian); use "
                "accountant='pld' (tightest) or accountant='rdp'")
        reason = self._refusal(inner)
        if reason is not None:
            raise UnsupportedEventError(reason)
        self._compose(inner, count)
        if tv:
            self._total_variation = self.total_variation + count * tv
        self._events.append((event, count))
        return self

    def _slack_delta(self, delta_ideal: float, epsilon: float) -> float:
        """delta(epsilon) of the real composition from the idealised one's: + (1 + e^epsilon) s, capped at 1."""
        tv = self.total_variation
        if tv == 0.0:
            return delta_ideal
        return min(1.0, delta_ideal + (1.0 + math.exp(min(epsilon, 700.0))) * tv)

    def _slack_epsilon(self, epsilon_ideal, delta: float) -> float:
        """epsilon(delta) of the real composition, given ``epsilon_ideal(d)``, the idealised composition's epsilon at
        delta d. With s the summed total variation and e_c = epsilon_ideal(delta / 2): if (1 + e^e_c) s <= delta / 2,
        the answer e = epsilon_ideal(delta - (1 + e^e_c) s) is at most e_c (a larger delta needs no larger epsilon),
        so delta_ideal(e) + (1 + e^e) s <= delta - (1 + e^e_c) s + (1 + e^e_c) s = delta; otherwise inf."""
        tv = self.total_variation
        if tv == 0.0:
            return epsilon_ideal(delta)
        cap = epsilon_ideal(delta / 2.0)
        if not math.isfinite(cap):
            return math.inf
        slack = (1.0 + math.exp(min(cap, 700.0))) * tv
        if slack > delta / 2.0:
            return math.inf
        return min(cap, epsilon_ideal(delta - slack))

    def copy(self) -> "Accountant":
        """An independent accountant in the same state (composing into it leaves this one as it is)."""
        return copy.deepcopy(self)

    def _shallow_copy(self) -> "Accountant":
        """:meth:`copy` for accountants whose state is numbers plus the list of composed events (events are frozen
        records): a new list, shared events. The ledger copies a state once per new history, every round."""
        other = copy.copy(self)
        other._events = list(self._events)
        return other

    @abc.abstractmethod
    def get_epsilon(self, delta: float) -> float:
        """The smallest epsilon this accountant can certify at ``delta`` (inf if unbounded, never negative)."""

    @abc.abstractmethod
    def get_delta(self, epsilon: float) -> float:
        """The smallest delta this accountant can certify at ``epsilon``."""
