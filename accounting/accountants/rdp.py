"""The RDP accountant: dp-accounting's ``RdpAccountant`` over a rich set of orders.

Renyi DP of every order adds under composition (Mironov 2017, Prop. 1); the sampled Gaussian's RDP is computed as in
Mironov, Talwar and Zhang 2019, and converted to (epsilon, delta) with the improved bound of Canonne, Kamath and Steinke
2020 (Prop. 12), minimised over the orders. ``ZCDPEvent(rho)`` is composed as RDP(alpha) = rho alpha, which holds for
every alpha > 1 by definition of zCDP (Bun and Steinke 2016, Def. 1.1).

Conversions use RDP(alpha) capped by rho alpha, with rho the composition's zCDP parameter ignoring sampling (sampling
never costs privacy, so that is an upper bound at every order). An order whose computed RDP is negative or NaN (the
sampled Gaussian's series cancels for extreme noise) keeps only that cap: dp-accounting would report epsilon = 0
for it, which is not a bound at small delta.

Poisson-sampled zCDP. dp-accounting has no event for a Poisson-sampled mechanism known only to be rho-zCDP (a sum of
distributed discrete Gaussians under secure aggregation, sampled per record). ``PoissonSampledEvent(q, E)`` under
add/remove, where ``E``'s leaves are zCDP events (and Gaussians: a composition on one sample is rho-zCDP with the
summed rho), is charged here with Zhu and Wang's general bound (``sampled_zcdp``) at integer orders and rho alpha at
fractional ones, into a side array of RDP values that adds, per order, to dp-accounting's own. Nested sampling,
unsupported mechanisms or replace-one inside such a sample are refused by name.

Cost. RDP adds, per order, over the leaves of a composition (dp-accounting's accountant does exactly that: its state
is the sum of count x RDP(leaf) in traversal order). A sampled Gaussian's RDP at the default orders costs ~0.15 s
(fractional orders sum a series), so each leaf's RDP vector is computed once per (leaf, orders) and cached, and
composing is then a vector addition: the ledger's composition tree (a new round composed into its parent's state),
calibration's repeated evaluations and a reopened ledger's rebuild pay for each distinct leaf once, as the pld
backend's leaf cache does. dp-accounting's accountant is kept only to answer ``supports``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Sequence

import numpy as np
from dp_accounting import rdp as dp_rdp
from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp_conversions

from .dp_events import to_dp_event
from .dp_wrapper import DpAccountingAccountant, clamp_answer
from .sampled_zcdp import poisson_sampled_zcdp_rdp
from .tree import unamplified_rho
from .zcdp import optimal_delta, optimal_epsilon
from ..errors import InvalidPrivacyParameter
from ..events import (ComposedEvent, GaussianEvent, NonPrivateEvent, PoissonSampledEvent, PrivacyEvent,
                      SelfComposedEvent, UnsupportedEvent, ZCDPEvent, flatten, split_total_variation)
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
    """Renyi-DP accountant (dp-accounting ``RdpAccountant``): unsampled and add/remove-sampled Gaussians, zCDP events,
    and add/remove Poisson-sampled zCDP events (Zhu and Wang 2019, Theorem 6; ``sampled_zcdp``).

    Replace-one sampled events are refused (dp-accounting has no replace-one sampled Gaussian RDP); use ``pld``.
    """

    name = "rdp"
    allow_zcdp = True
    handles_total_variation = True

    def __init__(self, orders: Sequence[float] | None = None) -> None:
        orders = DEFAULT_ORDERS if orders is None else _check_orders(orders)
        super().__init__(dp_rdp.RdpAccountant(orders=list(orders)))  # answers ``supports`` only; holds no state
        self._orders_key = tuple(float(a) for a in orders)
        self._rho_bound = 0.0  # zCDP of the composition ignoring sampling: RDP(alpha) <= rho alpha
        # RDP per order of everything dp-accounting can represent: the sum of count x RDP(leaf), leaf vectors cached
        self._rdp = np.zeros(len(self._orders_key), dtype=np.float64)
        # RDP per order of the Poisson-sampled zCDP events, which dp-accounting cannot represent (adds to its rdp)
        self._sampled_zcdp_rdp = np.zeros(len(self._inner.orders), dtype=np.float64)

    def copy(self) -> "RDPAccountant":
        """An independent accountant in the same state: two arrays and the list of composed events copied (the
        dp-accounting accountant, which holds no state here, is shared)."""
        other = self._shallow_copy()
        other._rdp = self._rdp.copy()
        other._sampled_zcdp_rdp = self._sampled_zcdp_rdp.copy()
        return other

    def supports(self, event: PrivacyEvent) -> bool:
        if isinstance(event, PrivacyEvent):
            event = split_total_variation(event)[0]  # compose() hands _refusal the idealised event
        if not (isinstance(event, PrivacyEvent) and _has_sampled_zcdp(event)):
            return super().supports(event)
        split = _split(event)
        return not isinstance(split, str) and (split[0] is None or super().supports(split[0]))

    def _refusal(self, event: PrivacyEvent) -> str | None:
        if not (isinstance(event, PrivacyEvent) and _has_sampled_zcdp(event)):
            return super()._refusal(event)
        split = _split(event)
        if isinstance(split, str):
            return split
        rest = split[0]
        return None if rest is None else super()._refusal(rest)  # the rest holds no sampled zCDP event

    def _compose(self, event: PrivacyEvent, count: int) -> None:
        if _has_sampled_zcdp(event):
            rest, sampled = _split(event)
            if rest is not None:
                self._add_leaves(rest, count)
            for (q, rho), times in sampled:
                self._sampled_zcdp_rdp += (count * times) * poisson_sampled_zcdp_rdp(q, rho, self._orders_key)
        else:
            self._add_leaves(event, count)
        rho = unamplified_rho(event)
        self._rho_bound += math.inf if rho is None else count * rho

    def _add_leaves(self, event: PrivacyEvent, count: int) -> None:
        """Add count x RDP of every leaf of ``event`` (supported: checked by ``compose``) from the leaf cache."""
        for leaf, times in flatten(event):
            self._rdp += (count * times) * _leaf_rdp(leaf, self._orders_key)

    def _safe_rdp(self) -> np.ndarray:
        """RDP per order (dp-accounting's plus the sampled-zCDP side array), capped by rho alpha; negative or NaN
        values (numerical failures) keep only the cap, and positive values below 1e-15 are raised to it
        (dp-accounting's conversion takes log(1 - e^-r), which fails once e^-r rounds to 1)."""
        cap = self._rho_bound * self.orders
        rdp = self._rdp
        rdp = np.where(np.isnan(rdp) | (rdp < 0.0), np.inf, rdp) + self._sampled_zcdp_rdp
        rdp = np.minimum(rdp, cap)
        return np.where((rdp > 0.0) & (rdp < _RDP_FLOOR), _RDP_FLOOR, rdp)

    def get_epsilon(self, delta: float) -> float:
        return self._slack_epsilon(self._ideal_epsilon, check_delta(delta))

    def _ideal_epsilon(self, delta: float) -> float:
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
        return self._slack_delta(clamp_answer("delta", delta, upper=1.0), epsilon)

    @property
    def orders(self) -> np.ndarray:
        """The Renyi orders alpha tracked."""
        return self._inner.orders

    @property
    def rdp(self) -> np.ndarray:
        """The composed RDP epsilon(alpha) at each of ``orders`` (dp-accounting's plus the Poisson-sampled zCDP
        events'), before the cap by rho alpha that conversions apply."""
        return self._rdp + self._sampled_zcdp_rdp


@functools.lru_cache(maxsize=4096)
def _leaf_rdp(leaf: PrivacyEvent, orders: tuple[float, ...]) -> np.ndarray:
    """RDP at ``orders`` of one leaf event (no composition inside), as dp-accounting's ``RdpAccountant`` computes it
    (read-only; cached: a sampled Gaussian costs ~0.15 s at the default orders)."""
    inner = dp_rdp.RdpAccountant(orders=list(orders))
    with _quiet_non_convergence():
        inner.compose(to_dp_event(leaf, allow_zcdp=True), 1)
    out = np.array(inner.rdp, dtype=np.float64)
    out.setflags(write=False)
    return out


def _has_zcdp(event: PrivacyEvent) -> bool:
    return any(isinstance(sub, ZCDPEvent) or (isinstance(sub, PoissonSampledEvent) and _has_zcdp(sub.event))
               for sub, _ in flatten(event))


def _has_sampled_zcdp(event: PrivacyEvent) -> bool:
    """Whether ``event`` holds a Poisson-sampled zCDP event (q < 1), possibly under samplings at q = 1."""
    for leaf, _ in flatten(event):
        if isinstance(leaf, PoissonSampledEvent):
            if leaf.sampling_rate < 1.0 and _has_zcdp(leaf.event):
                return True
            if leaf.sampling_rate == 1.0 and _has_sampled_zcdp(leaf.event):
                return True
    return False


def _split(event: PrivacyEvent) -> tuple[PrivacyEvent | None, list[tuple[tuple[float, float], int]]] | str:
    """(the rest of ``event``, for dp-accounting, or None; the Poisson-sampled zCDP leaves as ((q, rho), count)),
    or why the event cannot be composed. Sampling at q = 1 samples everyone and is unwrapped."""
    rest: list[PrivacyEvent] = []
    sampled: dict[tuple[float, float], int] = {}

    def walk(e: PrivacyEvent, times: int) -> str | None:
        for leaf, count in flatten(e):
            n = times * count
            if isinstance(leaf, PoissonSampledEvent) and leaf.sampling_rate == 1.0:
                reason = walk(leaf.event, n)
                if reason is not None:
                    return reason
            elif isinstance(leaf, PoissonSampledEvent) and _has_zcdp(leaf.event):
                reason = _sampled_zcdp_refusal(leaf)
                if reason is not None:
                    return reason
                inner = flatten(leaf.event)
                if any(isinstance(sub, NonPrivateEvent) for sub, _ in inner):
                    rest.append(SelfComposedEvent(NonPrivateEvent(), n))  # sound: charged as non-private
                    continue
                rho = sum(c * sub.rho for sub, c in inner)  # zCDP composes on one sample: rho adds
                if math.isinf(rho):
                    rest.append(SelfComposedEvent(NonPrivateEvent(), n))
                elif rho > 0.0:
                    key = (leaf.sampling_rate, rho)
                    sampled[key] = sampled.get(key, 0) + n
            else:
                rest.append(leaf if n == 1 else SelfComposedEvent(leaf, n))
        return None

    reason = walk(event, 1)
    if reason is not None:
        return reason
    remainder = None if not rest else rest[0] if len(rest) == 1 else ComposedEvent(tuple(rest))
    return remainder, list(sampled.items())


def _sampled_zcdp_refusal(event: PoissonSampledEvent) -> str | None:
    """Why the rdp accountant cannot bound this Poisson-sampled zCDP event, or None."""
    if event.relation != "add_remove":
        return (f"the 'rdp' accountant cannot compose {event.mechanism!r}: its bound for Poisson-sampled zCDP "
                "events (Zhu and Wang 2019, Theorem 6) holds under add/remove adjacency only, and no accountant of "
                "privfl bounds a replace-one sampled zCDP mechanism; run with add_remove adjacency (record counts "
                "private) or without record sampling")
    for sub, _ in flatten(event.event):
        if isinstance(sub, PoissonSampledEvent):
            return (f"the 'rdp' accountant cannot compose {event.mechanism!r}: a Poisson sample nested inside a "
                    "Poisson-sampled zCDP event has no bound here; charge the inner mechanism's unsampled zCDP "
                    "guarantee inside the sample instead")
        if not isinstance(sub, (ZCDPEvent, GaussianEvent, NonPrivateEvent)):
            kind = "an unsupported mechanism" if isinstance(sub, UnsupportedEvent) else f"a {sub.mechanism!r} event"
            return (f"the 'rdp' accountant cannot compose {event.mechanism!r}: the sample holds {kind}, which has "
                    "no zCDP guarantee")
    return None


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
