"""privfl's own exception types, re-exported with those of the privacy packages."""

from __future__ import annotations

from privfl.accounting.errors import InvalidPrivacyParameter, LedgerError, PrivacyBudgetExceeded, PrivacyError
from privfl.mechanisms.errors import InvalidRelease, ReleaseMisuse


class ConfigurationError(ValueError):
    """A configuration value is invalid; the message names the field and what to change."""


class MessageError(ValueError):
    """A privfl message could not be encoded or decoded; the message says what to change."""


class CorruptMessage(MessageError):
    """The bytes or records are not an intact privfl message (truncated, altered, of another kind or version)."""


class UnsupportedValue(MessageError):
    """A value cannot be carried exactly (object arrays, non-string keys, ...); nothing was encoded."""


__all__ = ["ConfigurationError", "CorruptMessage", "MessageError", "UnsupportedValue", "InvalidPrivacyParameter", "InvalidRelease", "LedgerError", "PrivacyBudgetExceeded",
           "PrivacyError", "ReleaseMisuse"]
