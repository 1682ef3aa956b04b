"""The one interface every accountant backend implements.

An accountant composes events and answers epsilon(delta) and delta(epsilon). It checks that it can compose an event
before changing any state, so a refused event leaves no trace (dp-accounting's habit).
"""

from __future__ import annotations

import abc
import copy

from ..errors import UnsupportedEventError
from ..events import PrivacyEvent


class Accountant(abc.ABC):
    """Composes privacy events and converts the composition to (epsilon, delta)."""

    name: str = "abstract"

    def __init__(self) -> None:
        self._events: list[tuple[PrivacyEvent, int]] = []

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
        reason = self._refusal(event)
        if reason is not None:
            raise UnsupportedEventError(reason)
        self._compose(event, count)
        self._events.append((event, count))
        return self

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
