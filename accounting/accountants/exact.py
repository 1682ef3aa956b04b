"""The exact accountant: compositions of Gaussian releases without sampling, converted with no slack at all.

n adaptive releases of Gaussian mechanisms with mu_i = sensitivity_i / noise_std_i compose to exactly a Gaussian
mechanism with mu^2 = sum_i mu_i^2 (Dong, Roth and Su 2019, Corollary 3.3). Its (epsilon, delta) curve is the analytic
Gaussian of Balle and Wang 2018 (Theorem 8), so the epsilon reported here is the tight one: no other accountant can
certify less for the same releases. Sampled events (q < 1) are refused; use the ``pld`` or ``rdp`` accountant for them.
"""

from __future__ import annotations

import math

from .analytic_gaussian import gaussian_delta, gaussian_epsilon
from .base import Accountant
from .tree import unsampled_leaves
from ..events import GaussianEvent, NonPrivateEvent, PrivacyEvent
from ..validation import check_delta, check_non_negative_finite


class ExactAccountant(Accountant):
    """Tracks mu^2 = sum (sensitivity / noise_std)^2 of unsampled Gaussian releases (Gaussian DP, Dong-Roth-Su)."""

    name = "exact"

    def __init__(self) -> None:
        super().__init__()
        self._mu_squared = 0.0
        self._non_private = False

    @property
    def mu(self) -> float:
        """The composition's Gaussian-DP parameter (inf after a non-private release)."""
        return math.inf if self._non_private else math.sqrt(self._mu_squared)

    def supports(self, event: PrivacyEvent) -> bool:
        if not isinstance(event, PrivacyEvent):
            return False
        return all(isinstance(leaf, (GaussianEvent, NonPrivateEvent)) for leaf, _ in unsampled_leaves(event))

    def _compose(self, event: PrivacyEvent, count: int) -> None:
        mu_squared = 0.0
        for leaf, times in unsampled_leaves(event):
            if isinstance(leaf, NonPrivateEvent):
                self._non_private = True
            else:
                mu_squared += times * leaf.mu * leaf.mu  # products overflow to inf, ** would raise
        self._mu_squared += count * mu_squared

    def copy(self):
        return self._shallow_copy()  # the state is numbers and frozen events

    def get_epsilon(self, delta: float) -> float:
        delta = check_delta(delta)
        return gaussian_epsilon(self.mu, delta)

    def get_delta(self, epsilon: float) -> float:
        epsilon = check_non_negative_finite("epsilon", epsilon)
        return gaussian_delta(self.mu, epsilon)


__all__ = ["ExactAccountant"]
