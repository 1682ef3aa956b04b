"""The zCDP accountant: rho adds under composition (Bun and Steinke 2016, Lemma 2.3).

A Gaussian release is exactly rho-zCDP with rho = sensitivity^2 / (2 noise_std^2); ``ZCDPEvent`` carries its own rho.
Two conversions to (epsilon, delta)-DP are offered:

- standard: epsilon = rho + 2 sqrt(rho log(1/delta))   (Bun and Steinke 2016, Proposition 1.3);
- optimal:  epsilon = inf_{alpha > 1} rho alpha + log(1/(alpha delta)) / (alpha - 1) + log(1 - 1/alpha)
            (Canonne, Kamath and Steinke 2020, Proposition 12; Asoodeh et al. 2021), together with epsilon = 0 when
            delta >= sqrt(1 - e^{-rho}), since total variation <= sqrt(1 - e^{-KL}) and KL <= rho.

``get_epsilon`` reports the optimal conversion, which is never above the standard one (every alpha gives a valid bound
and each is below the standard bound at that alpha). Sampled events (q < 1) are refused: zCDP is not amplified by
sampling in closed form; use ``pld`` or ``rdp``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize

from .base import Accountant
from .tree import unsampled_leaves
from ..events import GaussianEvent, NonPrivateEvent, PrivacyEvent, ZCDPEvent
from ..validation import check_delta, check_non_negative_finite

# alpha = 1 + t; a log-spaced grid of t locates the optimum, a bounded 1-D search refines it. Any alpha is sound.
_T_GRID = np.logspace(-12.0, 14.0, 521)


def _epsilon_at(t, rho: float, log_inv_delta: float):
    """rho alpha + (log(1/delta) - log alpha)/(alpha - 1) + log(1 - 1/alpha) at alpha = 1 + t (CKS 2020, Prop. 12)."""
    return rho * (1.0 + t) + (log_inv_delta - np.log1p(t)) / t + np.log(t) - np.log1p(t)


def _log_delta_at(t, rho: float, epsilon: float):
    """log[e^{(alpha-1)(rho alpha - epsilon)} (1 - 1/alpha)^{alpha-1} / alpha] at alpha = 1 + t: the same bound,
    solved for delta."""
    return t * (rho * (1.0 + t) - epsilon) + t * (np.log(t) - np.log1p(t)) - np.log1p(t)


def _minimise_over_t(fn) -> float:
    """min over t > 0 of ``fn``: the best grid point, refined between its neighbours."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        values = fn(_T_GRID)
    values = np.where(np.isnan(values), np.inf, values)
    i = int(np.argmin(values))
    best = float(values[i])
    if not math.isfinite(best):
        return best
    lo = math.log(_T_GRID[max(i - 1, 0)])
    hi = math.log(_T_GRID[min(i + 1, len(_T_GRID) - 1)])
    result = optimize.minimize_scalar(lambda log_t: float(fn(math.exp(log_t))), bounds=(lo, hi), method="bounded",
                                      options={"xatol": 1e-12})
    if result.success and math.isfinite(result.fun):
        best = min(best, float(result.fun))
    return best


def standard_epsilon(rho: float, delta: float) -> float:
    """rho + 2 sqrt(rho log(1/delta)) (Bun and Steinke 2016, Proposition 1.3)."""
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def optimal_epsilon(rho: float, delta: float) -> float:
    """The tight conversion of Canonne, Kamath and Steinke 2020 (Proposition 12), never above ``standard_epsilon``."""
    if rho == 0.0:
        return 0.0
    if math.isinf(rho):
        return math.inf
    if delta * delta + math.expm1(-rho) >= 0.0:  # delta >= sqrt(1 - e^{-rho}) >= total variation
        return 0.0
    log_inv_delta = -math.log(delta)
    best = _minimise_over_t(lambda t: _epsilon_at(t, rho, log_inv_delta))
    return max(0.0, min(best, standard_epsilon(rho, delta)))


def optimal_delta(rho: float, epsilon: float) -> float:
    """The smallest delta the same family of bounds gives at ``epsilon`` (the inverse of ``optimal_epsilon``)."""
    if rho == 0.0:
        return 0.0
    if math.isinf(rho):
        return 1.0
    log_best = _minimise_over_t(lambda t: _log_delta_at(t, rho, epsilon))
    total_variation = math.sqrt(-math.expm1(-rho))
    return float(min(1.0, total_variation, math.exp(min(log_best, 0.0))))


class ZCDPAccountant(Accountant):
    """Adds rho of Gaussian and zCDP events; converts with the optimal zCDP-to-DP bound."""

    name = "zcdp"

    def __init__(self) -> None:
        super().__init__()
        self._rho = 0.0
        self._non_private = False

    @property
    def rho(self) -> float:
        """The total zCDP parameter so far (inf after a non-private release)."""
        return math.inf if self._non_private else self._rho

    def supports(self, event: PrivacyEvent) -> bool:
        if not isinstance(event, PrivacyEvent):
            return False
        return all(isinstance(leaf, (GaussianEvent, ZCDPEvent, NonPrivateEvent))
                   for leaf, _ in unsampled_leaves(event))

    def _compose(self, event: PrivacyEvent, count: int) -> None:
        rho = 0.0
        for leaf, times in unsampled_leaves(event):
            if isinstance(leaf, NonPrivateEvent):
                self._non_private = True
            else:
                rho += times * leaf.rho
        self._rho += count * rho

    def copy(self):
        return self._shallow_copy()  # the state is numbers and frozen events

    def get_epsilon(self, delta: float) -> float:
        """The optimal conversion (Canonne, Kamath and Steinke 2020, Prop. 12)."""
        delta = check_delta(delta)
        return optimal_epsilon(self.rho, delta)

    def get_delta(self, epsilon: float) -> float:
        epsilon = check_non_negative_finite("epsilon", epsilon)
        return optimal_delta(self.rho, epsilon)

    def epsilon_standard(self, delta: float) -> float:
        """rho + 2 sqrt(rho log(1/delta)) (Bun and Steinke 2016, Proposition 1.3)."""
        delta = check_delta(delta)
        rho = self.rho
        return math.inf if math.isinf(rho) else standard_epsilon(rho, delta)

    def epsilon_conversions(self, delta: float) -> dict[str, float]:
        """Both conversions at ``delta``: ``{"standard": ..., "optimal": ...}``."""
        return {"standard": self.epsilon_standard(delta), "optimal": self.get_epsilon(delta)}


__all__ = ["ZCDPAccountant", "standard_epsilon", "optimal_epsilon", "optimal_delta"]
