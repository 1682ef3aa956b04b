"""The PLD accountant: dp-accounting's ``PLDAccountant`` (privacy loss distributions; Koskela et al. 2020,
Doroshenko et al. 2022), the tightest of the backends for sampled Gaussians.

The privacy loss is discretised on a grid of width ``value_discretization_interval`` with dp-accounting's pessimistic
estimate (losses rounded up), so the reported epsilon is an upper bound. The default, 1e-3, keeps a 100-round
composition of a Poisson-sampled Gaussian (q <= 0.5, z >= 0.6) to ~0.2 s, against ~1-2 s at dp-accounting's default
of 1e-4, and moves epsilon by at most a few 1e-3 from that finer value (below 0.1% once epsilon >= 1). Pass a finer
interval when epsilon is tiny (below ~0.1). The cost grows as the noise shrinks (the loss spreads over more grid
points): for unsampled Gaussians use ``exact``, which is tight and instantaneous.
"""

from __future__ import annotations

from dp_accounting import pld as dp_pld

from accounting.accountants.dp_wrapper import DpAccountingAccountant
from accounting.validation import check_positive_finite

DEFAULT_VALUE_DISCRETIZATION_INTERVAL = 1e-3


class PLDAccountant(DpAccountingAccountant):
    """Privacy-loss-distribution accountant (dp-accounting ``PLDAccountant``, add/remove-one adjacency)."""

    name = "pld"
    allow_zcdp = False  # a bare rho-zCDP guarantee has no privacy loss distribution

    def __init__(self, value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL) -> None:
        self.value_discretization_interval = check_positive_finite("value_discretization_interval",
                                                                   value_discretization_interval)
        super().__init__(dp_pld.PLDAccountant(value_discretization_interval=self.value_discretization_interval))


__all__ = ["PLDAccountant", "DEFAULT_VALUE_DISCRETIZATION_INTERVAL"]
