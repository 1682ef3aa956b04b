"""The common shell of a backend that delegates to a dp-accounting ``PrivacyAccountant`` (``rdp``).

Events are translated (``dp_events.to_dp_event``) and checked by both this shell and dp-accounting before any state
changes, so a refused event leaves no trace. ``count`` is passed down as a self-composition, never a Python loop.
"""

from __future__ import annotations

import math

import dp_accounting

from .base import Accountant
from .dp_events import has_replace_one_sampling, to_dp_event
from ..errors import InvalidPrivacyParameter
from ..events import PrivacyEvent
from ..validation import check_delta, check_non_negative_finite


class DpAccountingAccountant(Accountant):
    """An :class:`Accountant` whose maths is a dp-accounting ``PrivacyAccountant`` (``self._inner``)."""

    allow_zcdp: bool = False

    def __init__(self, inner: dp_accounting.PrivacyAccountant) -> None:
        super().__init__()
        self._inner = inner

    def _translate(self, event: PrivacyEvent) -> dp_accounting.DpEvent | None:
        if not isinstance(event, PrivacyEvent):
            return None
        return to_dp_event(event, allow_zcdp=self.allow_zcdp)

    def supports(self, event: PrivacyEvent) -> bool:
        dp_event = self._translate(event)
        return dp_event is not None and self._inner.supports(dp_event)

    def _refusal(self, event: PrivacyEvent) -> str | None:
        if isinstance(event, PrivacyEvent) and has_replace_one_sampling(event):
            return (f"the {self.name!r} accountant cannot compose Poisson-sampled events under the replace_one "
                    "relation (dp-accounting's RDP accountant has no replace-one sampled Gaussian); use the pld "
                    "accountant (accountant='pld'), which composes them exactly")
        return super()._refusal(event)

    def _compose(self, event: PrivacyEvent, count: int) -> None:
        self._inner.compose(self._translate(event), count)

    def get_epsilon(self, delta: float) -> float:
        delta = check_delta(delta)
        return clamp_answer("epsilon", self._inner.get_epsilon(delta), upper=math.inf)

    def get_delta(self, epsilon: float) -> float:
        epsilon = check_non_negative_finite("epsilon", epsilon)
        return clamp_answer("delta", self._inner.get_delta(epsilon), upper=1.0)


def clamp_answer(name: str, value, *, upper: float) -> float:
    """Clamp a backend's answer into [0, upper]; a NaN is an error, never a silent zero."""
    value = float(value)
    if math.isnan(value):
        raise InvalidPrivacyParameter(f"the accountant produced a NaN {name}; the composed events are out of its range")
    return min(upper, max(0.0, value))


__all__ = ["DpAccountingAccountant", "clamp_answer"]
