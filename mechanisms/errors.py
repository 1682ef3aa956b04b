"""Exceptions of the mechanisms package."""

from __future__ import annotations


class InvalidRelease(ValueError):
    """A value cannot be released as given (non-finite entries, wrong shape, bad parameters); nothing was released."""


class ReleaseMisuse(RuntimeError):
    """A mechanism was used in a way that would break its guarantee (a seed with a secure source, releasing twice)."""
