"""privfl's own exception types, re-exported with those of the privacy packages."""

from __future__ import annotations

from privfl.accounting.errors import InvalidPrivacyParameter, LedgerError, PrivacyBudgetExceeded, PrivacyError
from privfl.mechanisms.errors import InvalidRelease, ReleaseMisuse


class ConfigurationError(ValueError):
    """A configuration value is invalid; the message names the field and what to change."""


class UsageError(ConfigurationError):
    """A refusal decided by the program alone (an algorithm's client step, the user's model or loss, the order of the
    rounds asked for), never by the values of the records: the same on every neighbouring dataset. Raised inside a
    private client's local step it propagates as an error; any other exception there is released as the
    data-independent fallback, charged (``privfl.runtime.local_step``)."""


#: the usual causes of a run whose training diverges, and what to change (the end of every divergence error)
DIVERGENCE_CAUSES = ("the usual causes are features (or regression targets) in large or very different units, e.g. "
                     "not standardised (standardise them with public statistics: privfl run --public-data FILE, "
                     "--standardize public; in Python scale them with a public reference sample before "
                     "privfl.federate), or too large a learning rate (lower --lr / lr=)")


class TrainingDiverged(ConfigurationError):
    """A run's training diverged (a non-finite or exploding loss, predictions or global state); the message names the
    round, what diverged and the likely causes (:data:`DIVERGENCE_CAUSES`). Rounds before it stay charged."""


class MessageError(ValueError):
    """A privfl message could not be encoded or decoded; the message says what to change."""


class CorruptMessage(MessageError):
    """The bytes or records are not an intact privfl message (truncated, altered, of another kind or version)."""


class UnsupportedValue(MessageError):
    """A value cannot be carried exactly (object arrays, non-string keys, ...); nothing was encoded."""


__all__ = ["ConfigurationError", "CorruptMessage", "DIVERGENCE_CAUSES", "InvalidPrivacyParameter", "InvalidRelease",
           "LedgerError", "MessageError", "PrivacyBudgetExceeded", "PrivacyError", "ReleaseMisuse", "TrainingDiverged",
           "UnsupportedValue", "UsageError"]
