"""Walking composed events down to the leaves the closed-form accountants (exact, zCDP) understand."""

from __future__ import annotations

from accounting.events import PoissonSampledEvent, PrivacyEvent, flatten


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


__all__ = ["unsampled_leaves"]
