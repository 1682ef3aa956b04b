"""Checks shared by events, accountants and calibration. Each raises :class:`InvalidPrivacyParameter`."""

from __future__ import annotations

import math
import numbers

from accounting.errors import InvalidPrivacyParameter


def _as_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidPrivacyParameter(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if math.isnan(value):
        raise InvalidPrivacyParameter(f"{name} is NaN; pass a finite number")
    return value


def check_positive_finite(name: str, value) -> float:
    value = _as_float(name, value)
    if not math.isfinite(value) or value <= 0:
        raise InvalidPrivacyParameter(f"{name} must be a finite number > 0, got {value!r}")
    return value


def check_non_negative_finite(name: str, value) -> float:
    value = _as_float(name, value)
    if not math.isfinite(value) or value < 0:
        raise InvalidPrivacyParameter(f"{name} must be a finite number >= 0, got {value!r}")
    return value


def check_epsilon(value, *, allow_inf: bool = False) -> float:
    """A target epsilon: > 0, finite unless ``allow_inf`` (epsilon = inf means 'no privacy')."""
    value = _as_float("epsilon", value)
    if value <= 0:
        raise InvalidPrivacyParameter(f"epsilon must be > 0, got {value!r}; use a positive target such as 1 or 3")
    if math.isinf(value) and not allow_inf:
        raise InvalidPrivacyParameter("epsilon must be finite here; epsilon = inf means no privacy guarantee")
    return value


def check_delta(value) -> float:
    value = _as_float("delta", value)
    if not 0 < value < 1:
        raise InvalidPrivacyParameter(
            f"delta must lie strictly between 0 and 1, got {value!r}; a common choice is 1e-5 or 1/(10 n)")
    return value


def check_probability(name: str, value) -> float:
    """A sampling rate q in (0, 1]."""
    value = _as_float(name, value)
    if not 0 < value <= 1:
        raise InvalidPrivacyParameter(f"{name} must lie in (0, 1], got {value!r}")
    return value


def check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidPrivacyParameter(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise InvalidPrivacyParameter(f"{name} must be >= 1, got {value}")
    return int(value)
