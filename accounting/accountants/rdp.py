"""The RDP accountant: dp-accounting's ``RdpAccountant`` over a rich set of orders.

Renyi DP of every order adds under composition (Mironov 2017, Prop. 1); the sampled Gaussian's RDP is computed as in
Mironov, Talwar and Zhang 2019, and converted to (epsilon, delta) with the improved bound of Canonne, Kamath and Steinke
2020 (Prop. 12), minimised over the orders. ``ZCDPEvent(rho)`` is composed as RDP(alpha) = rho alpha, which holds for
every alpha > 1 by definition of zCDP (Bun and Steinke 2016, Def. 1.1).

Conversions use RDP(alpha) capped by rho alpha, with rho the composition's zCDP parameter ignoring sampling (sampling
never costs privacy, so that is an upper bound at every order). An order whose computed RDP is negative or NaN (the
sampled Gaussian's series cancels for extreme noise) keeps only that cap: dp-accounting would report epsilon = 0
for it, which is not a bound at small delta.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence

import numpy as np
from dp_accounting import rdp as dp_rdp
from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp_conversions

from .dp_wrapper import DpAccountingAccountant, clamp_answer
from .tree import unamplified_rho
from .zcdp import optimal_delta, optimal_epsilon
from ..errors import InvalidPrivacyParameter
from ..events import PrivacyEvent
from ..validation import (MAX_RDP_ORDER, MAX_RDP_ORDER_SUM, MAX_RDP_ORDERS, check_delta,
                                   check_non_negative_finite, check_positive_finite)

# Fine steps near 1 (large epsilon), every integer to 128, then a geometric tail to ~2500 (small rho or small q).
# Integer orders cost O(alpha) each for sampled Gaussians, which is what bounds the tail.
DEFAULT_ORDERS: tuple[float, ...] = tuple(
    [1.0 + k / 20.0 for k in range(1, 40)]
    + [3.0 + k / 10.0 for k in range(0, 80)]
    + [float(a) for a in range(11, 129)]
    + sorted({float(round(128 * 1.25 ** k)) for k in range(1, 14)})
)


_RDP_FLOOR = 1e-15


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
    """Renyi-DP accountant (dp-accounting ``RdpAccountant``): unsampled and add/remove-sampled Gaussians, zCDP events.

    Replace-one sampled events are refused (dp-accounting has no replace-one sampled Gaussian RDP); use ``pld``.
    """

    name = "rdp"
    allow_zcdp = True

    def __init__(self, orders: Sequence[float] | None = None) -> None:
        orders = DEFAULT_ORDERS if orders is None else _check_orders(orders)
        super().__init__(dp_rdp.RdpAccountant(orders=list(orders)))
        self._rho_bound = 0.0  # zCDP of the composition ignoring sampling: RDP(alpha) <= rho alpha

    def _compose(self, event: PrivacyEvent, count: int) -> None:
        with _quiet_non_convergence():
            super()._compose(event, count)
        rho = unamplified_rho(event)
        self._rho_bound += math.inf if rho is None else count * rho

    def _safe_rdp(self) -> np.ndarray:
        """RDP per order, capped by rho alpha; negative or NaN values (numerical failures) keep only the cap, and
        positive values below 1e-15 are raised to it (dp-accounting's conversion takes log(1 - e^-r), which fails
        once e^-r rounds to 1)."""
        cap = self._rho_bound * self.orders
        rdp = np.asarray(self._inner.rdp, dtype=np.float64)
        rdp = np.where(np.isnan(rdp) | (rdp < 0.0), np.inf, rdp)
        rdp = np.minimum(rdp, cap)
        return np.where((rdp > 0.0) & (rdp < _RDP_FLOOR), _RDP_FLOOR, rdp)

    def get_epsilon(self, delta: float) -> float:
        delta = check_delta(delta)
        try:
            with np.errstate(all="ignore"):
                epsilon, _ = dp_rdp_conversions.compute_epsilon(self.orders, self._safe_rdp(), delta)
        except (ValueError, ArithmeticError):  # fall back to the zCDP bound the RDP curve is capped by
            epsilon = optimal_epsilon(self._rho_bound, delta)
        return clamp_answer("epsilon", epsilon, upper=math.inf)

    def get_delta(self, epsilon: float) -> float:
        epsilon = check_non_negative_finite("epsilon", epsilon)
        try:
            with np.errstate(all="ignore"):
                delta, _ = dp_rdp_conversions.compute_delta(self.orders, self._safe_rdp(), epsilon)
        except (ValueError, ArithmeticError):
            delta = optimal_delta(self._rho_bound, epsilon)
        return clamp_answer("delta", delta, upper=1.0)

    @property
    def orders(self) -> np.ndarray:
        """The Renyi orders alpha tracked."""
        return self._inner.orders

    @property
    def rdp(self) -> np.ndarray:
        """The composed RDP epsilon(alpha) at each of ``orders``."""
        return self._inner.rdp


def _check_orders(orders) -> tuple[float, ...]:
    """1 to MAX_RDP_ORDERS finite orders in (1, MAX_RDP_ORDER] summing to at most MAX_RDP_ORDER_SUM: a sampled
    Gaussian's RDP at an integer order alpha costs O(alpha)."""
    message = (f"RDP orders must be a non-empty sequence of at most {MAX_RDP_ORDERS} finite numbers in "
               f"(1, {MAX_RDP_ORDER:g}] summing to at most {MAX_RDP_ORDER_SUM:g}, e.g. [1.5, 2, 4, 8, 16, 32, 64]")
    if isinstance(orders, (str, bytes)) or not isinstance(orders, Sequence | np.ndarray):
        raise InvalidPrivacyParameter(f"{message}; got {orders!r}")
    if not 0 < len(orders) <= MAX_RDP_ORDERS:
        raise InvalidPrivacyParameter(f"{message}; got {len(orders)} orders")
    checked = tuple(check_positive_finite("RDP order", a) for a in orders)
    if not all(1.0 < a <= MAX_RDP_ORDER for a in checked) or math.fsum(checked) > MAX_RDP_ORDER_SUM:
        raise InvalidPrivacyParameter(f"{message}; got {list(orders)[:10]}{' ...' if len(orders) > 10 else ''}")
    return checked


__all__ = ["RDPAccountant", "DEFAULT_ORDERS"]
