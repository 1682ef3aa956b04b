"""Exceptions of the accounting package.

Every error tells the caller what to change. They subclass the matching built-in (``ValueError``) where a caller
would naturally catch that, so ``except ValueError`` still works.
"""

from __future__ import annotations


class PrivacyError(Exception):
    """Base class of privfl's privacy errors."""


class InvalidPrivacyParameter(PrivacyError, ValueError):
    """A privacy parameter (sensitivity, sigma, rho, q, epsilon, delta, count) is out of its domain."""


class UnsupportedEventError(PrivacyError, TypeError):
    """An accountant was asked to compose an event it cannot account for; its state is unchanged."""


class PrivacyBudgetExceeded(PrivacyError):
    """Charging a release would take a client past its budget; nothing was charged and nothing may be released."""

    def __init__(self, message: str, *, client_id: str | None = None, epsilon_after: float | None = None,
                 epsilon_budget: float | None = None):
        super().__init__(message)
        self.client_id = client_id
        self.epsilon_after = epsilon_after
        self.epsilon_budget = epsilon_budget


class LedgerError(PrivacyError):
    """The ledger refused an operation (conflicting replay, run mismatch, corrupt row)."""


class InvalidLedgerArgument(LedgerError, ValueError):
    """A ledger key or label is malformed (client id, round, channel, unit, run id); nothing was written."""
