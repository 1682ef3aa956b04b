"""Exceptions of the secure aggregation package.

Every error says what went wrong and what to change. ``QuantisationRangeError`` subclasses ``ValueError`` so that
``except ValueError`` still catches it.
"""

from __future__ import annotations


class ProtocolAbort(Exception):
    """A party stopped the protocol: continuing could reveal an individual input or return a wrong sum.

    ``reason`` is a short human-readable cause; ``party`` is the client id (or ``"server"``) that aborted and
    ``stage`` the protocol stage it was in, when known.
    """

    def __init__(self, reason: str, *, party: object = None, stage: str | None = None):
        self.reason = reason
        self.party = party
        self.stage = stage
        where = []
        if party is not None:
            where.append(f"party={party}")
        if stage is not None:
            where.append(f"stage={stage}")
        super().__init__(f"{reason} ({', '.join(where)})" if where else reason)


class QuantisationRangeError(ValueError):
    """A value lies outside the declared quantisation range (or is not finite); nothing was quantised.

    Widen the range, clip the values first, or fix the upstream computation; values are never wrapped silently.
    """


class MessageFormatError(ValueError):
    """Bytes or a dict that are not a well-formed protocol message (bad JSON, too deeply nested, a missing, extra or
    mistyped field). Subclasses ``ValueError``, so ``except ValueError`` still catches it."""
