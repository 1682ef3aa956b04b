"""The RDP accountant: dp-accounting's ``RdpAccountant`` over a rich set of orders.

Renyi DP of every order adds under composition (Mironov 2017, Prop. 1); the sampled Gaussian's RDP is computed as in
Mironov, Talwar and Zhang 2019, and converted to (epsilon, delta) with the improved bound of Canonne, Kamath and Steinke
2020 (Prop. 12), minimised over the orders. ``ZCDPEvent(rho)`` is composed as RDP(alpha) = rho alpha, which holds for
every alpha > 1 by definition of zCDP (Bun and Steinke 2016, Def. 1.1).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import numpy as np
from dp_accounting import rdp as dp_rdp

from accounting.accountants.dp_wrapper import DpAccountingAccountant
from accounting.errors import InvalidPrivacyParameter
from accounting.events import PrivacyEvent

# Fine steps near 1 (large epsilon), every integer to 128, then a geometric tail to ~2500 (small rho or small q).
# Integer orders cost O(alpha) each for sampled Gaussians, which is what bounds the tail.
DEFAULT_ORDERS: tuple[float, ...] = tuple(
    [1.0 + k / 20.0 for k in range(1, 40)]
    + [3.0 + k / 10.0 for k in range(0, 80)]
    + [float(a) for a in range(11, 129)]
    + sorted({float(round(128 * 1.25 ** k)) for k in range(1, 14)})
)


class _DropNonConvergence(logging.Filter):
    """dp-accounting logs a warning when a fractional order's series fails to converge and then sets that order's RDP
    to inf, which only removes the order from the minimum (sound). Those warnings are dropped while we compose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


@contextlib.contextmanager
def _quiet_non_convergence():
    logger = logging.getLogger("absl")
    log_filter = _DropNonConvergence()
    logger.addFilter(log_filter)
    try:
        yield
    finally:
        logger.removeFilter(log_filter)


class RDPAccountant(DpAccountingAccountant):
    """Renyi-DP accountant (dp-accounting ``RdpAccountant``, add/remove-one adjacency)."""

    name = "rdp"
    allow_zcdp = True

    def __init__(self, orders: Sequence[float] | None = None) -> None:
        orders = DEFAULT_ORDERS if orders is None else tuple(float(a) for a in orders)
        if not orders or not all(np.isfinite(a) and a > 1.0 for a in orders):
            raise InvalidPrivacyParameter("RDP orders must be a non-empty sequence of finite numbers > 1")
        super().__init__(dp_rdp.RdpAccountant(orders=list(orders)))

    def _compose(self, event: PrivacyEvent, count: int) -> None:
        with _quiet_non_convergence():
            super()._compose(event, count)

    @property
    def orders(self) -> np.ndarray:
        """The Renyi orders alpha tracked."""
        return self._inner.orders

    @property
    def rdp(self) -> np.ndarray:
        """The composed RDP epsilon(alpha) at each of ``orders``."""
        return self._inner.rdp


__all__ = ["RDPAccountant", "DEFAULT_ORDERS"]
