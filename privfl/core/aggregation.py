"""Server-side aggregation over releases: weighted sums only, so secure aggregation can hide every upload.

Central noise (a trusted aggregator) is added here, once per channel per round, to the weighted sum. With weights
w_k the sum moves by at most max_k w_k times a client's sensitivity, so the central noise std is scaled by max_k w_k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from privfl.mechanisms import GaussianMechanism, InvalidRelease, as_noise_source
from privfl.mechanisms.gaussian import gaussian_noise
from privfl.mechanisms.noise import NoiseSource
from privfl.core.channels import Channel
from privfl.core.release import Release


@dataclass(frozen=True)
class Aggregate:
    """The weighted sum of one channel's releases in one round, and what is publicly known about it."""

    channel: str
    total: np.ndarray
    total_weight: float
    participants: float  # how many clients the sum holds; in a run amplified by client sampling the expected count
    noise_std: float  # std of the Gaussian noise the sum carries, per coordinate (local + central)


def weighted_sums(releases: Sequence[Release], channels: Mapping[str, Channel],
                  noise: NoiseSource | np.random.Generator | int | str = 0) -> dict[str, Aggregate]:
    """Sum each channel's ``weight * value`` over clients and add central noise where the releases ask for it."""
    source = as_noise_source(noise)
    by_channel: dict[str, list[Release]] = {}
    for r in releases:
        by_channel.setdefault(r.channel, []).append(r)
    out = {}
    for name, rs in by_channel.items():
        centrals = {r.central_noise_std for r in rs}
        if len(centrals) != 1:
            raise InvalidRelease(f"channel {name}: releases disagree on the central noise std {sorted(centrals)}")
        weights = np.array([r.weight for r in rs])
        # Uploads that stayed float32 (unclipped, un-noised: the model's own precision) are summed in float32, as
        # the model trains; anything clipped or noised is float64 and summed in float64.
        dtype = np.float32 if all(np.asarray(r.value).dtype == np.float32 for r in rs) else np.float64
        total = np.zeros(np.shape(rs[0].value), dtype=dtype)
        scaled = None  # one scratch vector for weight * value, not a new array per client
        for w, r in zip(weights, rs):
            if w == 1.0:
                total += r.value
            else:
                if scaled is None:
                    scaled = np.empty_like(total)
                np.multiply(r.value, dtype(w), out=scaled, casting="same_kind")
                total += scaled
        total = total.astype(np.float64, copy=False)
        central = centrals.pop() * float(weights.max())
        if central > 0:
            total += gaussian_noise(total.shape, central, source, channels[name].symmetric)  # total is ours
        local_var = float(np.sum(weights ** 2 * np.array([r.local_noise_std ** 2 for r in rs])))
        out[name] = Aggregate(name, total, float(weights.sum()), len(rs), float(np.sqrt(local_var + central ** 2)))
    return out


def noise_only_sums(channels: Sequence[Channel], noise_multipliers: Mapping[str, float] | None,
                    noise: NoiseSource | np.random.Generator | int | str = 0) -> dict[str, Aggregate]:
    """The sums of a round amplified by client sampling (client level, central noise) in which no client was sampled
    or released: zero plus the central noise every other round's sum carries (each noised channel's multiplier times
    its sensitivity; every client-level release weighs 1), so the server steps as in any round. Without it such a
    round published no step at all, which told an observer of the model that nobody took part: conditioned on a
    published round, a client's chance of having been sampled exceeds the rate the ledger amplifies by."""
    source = as_noise_source(noise)
    out = {}
    for ch in channels:
        std = GaussianMechanism(ch.sensitivity, noise_multipliers[ch.name]).noise_std if (
            noise_multipliers and ch.private and ch.name in noise_multipliers) else 0.0
        total = np.zeros(ch.shape, dtype=np.float64)
        if std > 0:
            total += gaussian_noise(total.shape, std, source, ch.symmetric)
        out[ch.name] = Aggregate(ch.name, total, 0.0, 0, std)
    return out
