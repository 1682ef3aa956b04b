"""Walking composed events down to the leaves the closed-form accountants (exact, zCDP) understand."""

from __future__ import annotations

import math

from ..events import GaussianEvent, NonPrivateEvent, PoissonSampledEvent, PrivacyEvent, ZCDPEvent, flatten


def unsampled_leaves(event: PrivacyEvent) -> list[tuple[PrivacyEvent, int]]:
    """``flatten(event)``, with sampling at rate q = 1 (which samples everyone, so changes nothing) unwrapped.

    Sampled events with q < 1 stay leaves; the caller refuses them. ``NoOpEvent`` leaves are dropped, as in ``flatten``.
    """
    out: list[tuple[PrivacyEvent, int]] = []
    for leaf, count in flatten(event):
        if isinstance(leaf, PoissonSampledEvent) and leaf.sampling_rate == 1.0:
            out.extend((sub, count * times) for sub, times in unsampled_leaves(leaf.event))
        else:
            out.append((leaf, count))
    return out


def unamplified_rho(event: PrivacyEvent) -> float | None:
    """The zCDP parameter of ``event`` with every sampling ignored: an upper bound, since Poisson sampling (under
    either relation) never costs privacy. inf if a release is non-private, None if a leaf has no rho."""
    total = 0.0
    for leaf, count in flatten(event):
        if isinstance(leaf, PoissonSampledEvent):
            inner = unamplified_rho(leaf.event)
            if inner is None:
                return None
            total += count * inner
        elif isinstance(leaf, (GaussianEvent, ZCDPEvent)):
            total += count * leaf.rho
        elif isinstance(leaf, NonPrivateEvent):
            return math.inf
        else:
            return None
    return total


__all__ = ["unsampled_leaves", "unamplified_rho"]
