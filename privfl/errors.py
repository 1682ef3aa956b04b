"""privfl's own exception types, re-exported with those of the privacy packages."""

from __future__ import annotations

from privfl.accounting.errors import InvalidPrivacyParameter, LedgerError, PrivacyBudgetExceeded, PrivacyError
from privfl.mechanisms.errors import InvalidRelease, ReleaseMisuse


class ConfigurationError(ValueError):
    """A configuration value is invalid; the message names the field and what to change."""


__all__ = ["ConfigurationError", "InvalidPrivacyParameter", "InvalidRelease", "LedgerError", "PrivacyBudgetExceeded",
           "PrivacyError", "ReleaseMisuse"]
