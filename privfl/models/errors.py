"""Exceptions of privfl.models."""

from __future__ import annotations

from privfl.errors import ConfigurationError


class ModelConfigError(ConfigurationError):
    """A model cannot be built or used as asked (unknown name, input too small, bad prior); the message says what to
    change."""


__all__ = ["ModelConfigError"]
