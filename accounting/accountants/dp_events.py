"""Translation of privfl events into dp-accounting's ``DpEvent`` tree, for the ``rdp`` backend.

dp-accounting speaks in noise multipliers z = noise_std / sensitivity, so a ``GaussianEvent(sensitivity, noise_std)``
becomes ``GaussianDpEvent(noise_std / sensitivity)``: the privacy loss of a Gaussian depends on nothing else.

Inside a Poisson-sampled event, the releases share one sampling coin (a sampled client sends every channel of its
round). A composition of Gaussians on the same sample is exactly one Gaussian with mu^2 = sum mu_i^2 (Dong, Roth and
Su 2019, Cor. 3.3), so the sampled group becomes ``PoissonSampledDpEvent(q, GaussianDpEvent(1 / mu))`` -- exact, and
the form dp-accounting's RDP accountant composes.

Only add/remove sampling translates: dp-accounting's ``RdpAccountant`` has no Poisson-sampled Gaussian under
``REPLACE_ONE``, so a replace-one sampled event (q < 1) has no translation (the ``pld`` backend composes it).
Extreme ratios are kept inside double precision: a release with mu = 0 costs nothing, one with mu >= 1e50 (RDP
above 1e99 at every order) is charged as non-private (epsilon = inf), and noise multipliers above 1e6 are lowered to
1e6 (less noise can only cost more; dp-accounting squares them).
"""

from __future__ import annotations

import math

import dp_accounting

from ..events import (ComposedEvent, GaussianEvent, NoOpEvent, NonPrivateEvent, PoissonSampledEvent,
                               PrivacyEvent, SelfComposedEvent, ZCDPEvent, flatten)

_MU_NON_PRIVATE = 1e50
_MAX_NOISE_MULTIPLIER = 1e6


def to_dp_event(event: PrivacyEvent, *, allow_zcdp: bool) -> dp_accounting.DpEvent | None:
    """The ``DpEvent`` equivalent of ``event``, or None when it has none (the caller then refuses the event).

    ``allow_zcdp``: whether ``ZCDPEvent(rho)`` may become ``ZCDpEvent(rho)`` (RDP(alpha) = rho alpha holds for every
    alpha > 1, so RDP composes it soundly; PLD has no representation of a bare zCDP guarantee).
    """
    if isinstance(event, GaussianEvent):
        mu = event.mu
        if mu == 0.0:
            return dp_accounting.NoOpDpEvent()
        if mu >= _MU_NON_PRIVATE:
            return dp_accounting.NonPrivateDpEvent()
        return dp_accounting.GaussianDpEvent(min(event.noise_multiplier, _MAX_NOISE_MULTIPLIER))
    if isinstance(event, ZCDPEvent):
        return dp_accounting.ZCDpEvent(event.rho) if allow_zcdp else None
    if isinstance(event, NoOpEvent):
        return dp_accounting.NoOpDpEvent()
    if isinstance(event, NonPrivateEvent):
        return dp_accounting.NonPrivateDpEvent()
    if isinstance(event, SelfComposedEvent):
        inner = to_dp_event(event.event, allow_zcdp=allow_zcdp)
        return None if inner is None else dp_accounting.SelfComposedDpEvent(inner, event.count)
    if isinstance(event, ComposedEvent):
        inner = [to_dp_event(e, allow_zcdp=allow_zcdp) for e in event.events]
        return None if any(e is None for e in inner) else dp_accounting.ComposedDpEvent(inner)
    if isinstance(event, PoissonSampledEvent):
        if event.sampling_rate == 1.0:  # everyone is sampled: the event itself
            return to_dp_event(event.event, allow_zcdp=allow_zcdp)
        if event.relation != "add_remove":
            return None
        return _sampled_gaussian(event)
    return None  # UnsupportedEvent, or a kind this module does not know: never guess


def _sampled_gaussian(event: PoissonSampledEvent) -> dp_accounting.DpEvent | None:
    leaves = flatten(event.event)
    if not all(isinstance(leaf, (GaussianEvent, NonPrivateEvent)) for leaf, _ in leaves):
        return None  # zCDP inside a sample (the rdp accountant bounds it itself), nested sampling or unsupported
    if any(isinstance(leaf, NonPrivateEvent) for leaf, _ in leaves):
        return dp_accounting.NonPrivateDpEvent()  # sound: a sampled non-private release is charged as non-private
    mu_squared = sum(count * leaf.mu * leaf.mu for leaf, count in leaves)  # products overflow to inf, ** raises
    if mu_squared == 0.0:
        return dp_accounting.NoOpDpEvent()
    if mu_squared >= _MU_NON_PRIVATE ** 2:
        return dp_accounting.NonPrivateDpEvent()
    z = min(1.0 / math.sqrt(mu_squared), _MAX_NOISE_MULTIPLIER)
    return dp_accounting.PoissonSampledDpEvent(event.sampling_rate, dp_accounting.GaussianDpEvent(z))


def has_replace_one_sampling(event: PrivacyEvent) -> bool:
    """Whether ``event`` holds a Poisson-sampled event (q < 1) under the replace-one relation."""
    return any(isinstance(leaf, PoissonSampledEvent)
               and ((leaf.sampling_rate < 1.0 and leaf.relation == "replace_one")
                    or has_replace_one_sampling(leaf.event))
               for leaf, _ in flatten(event))


__all__ = ["to_dp_event", "has_replace_one_sampling"]
