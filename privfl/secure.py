"""Secure aggregation of a round's releases: the server learns each channel's weighted sum, not the uploads.

Each client scales its release by its public weight, quantises it to Z_{2^bits} by stochastic rounding
(``secure_agg.Quantiser``, sized so the sum of all clients cannot wrap) and masks it in the pairwise-masked protocol
(``secure_agg.run_round``); the server unmasks only the sum and decodes it. Algorithms are unchanged: they receive the
same :class:`privfl.aggregation.Aggregate` as without secure aggregation, up to quantisation error (one rounding step
per client and coordinate, unbiased).

Quantisation range of a channel: its public coordinate bound (``Channel.coordinate_bound``; a NormClip's C) times the
largest weight, widened by 8 standard deviations of local noise when the client adds noise itself (a noisy value
beyond that is clipped into the range: post-processing of a private release). A channel without a public bound
(non-private runs) uses the round's largest |value|, rounded up to a power of two; that maximum is then not hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from mechanisms.gaussian import gaussian_noise
from mechanisms.noise import NoiseSource, as_noise_source
from privfl.aggregation import Aggregate
from privfl.channels import Channel
from privfl.errors import ConfigurationError
from privfl.release import Release
from secure_agg import Quantiser, run_round


@dataclass(frozen=True)
class SecureAggregation:
    """Secure-aggregation settings: ``bits`` of the modular ring, simulated ``dropout`` (fraction of the round's
    clients that drop after sharing keys, before sending their masked input), and ``min_survivors`` below which the
    round aborts (default: the protocol's threshold)."""

    bits: int = 48
    dropout: float = 0.0
    min_survivors: int | None = None

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 8 <= self.bits <= 64:
            raise ConfigurationError(f"secure aggregation bits must be an integer in [8, 64], got {self.bits!r}")
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ConfigurationError(f"dropout must lie in [0, 1), got {self.dropout!r}")


def _range(channel: Channel, releases: Sequence[Release]) -> float:
    max_w = max(r.weight for r in releases)
    bound = channel.coordinate_bound
    if bound is None:
        peak = max(float(np.abs(r.weight * r.value).max(initial=0.0)) for r in releases)
        return 2.0 ** math.ceil(math.log2(max(peak, 1e-12))) if peak > 0 else 1.0
    local = max(r.local_noise_std for r in releases)
    return max_w * (bound + 8.0 * local)


def secure_weighted_sums(releases: Sequence[Release], channels: Mapping[str, Channel], config: SecureAggregation,
                         rng: np.random.Generator, noise: NoiseSource | np.random.Generator | int | str = 0
                         ) -> dict[str, Aggregate]:
    """Like :func:`privfl.aggregation.weighted_sums`, through the secure-aggregation protocol."""
    source = as_noise_source(noise)
    by_channel: dict[str, list[Release]] = {}
    for r in releases:
        by_channel.setdefault(r.channel, []).append(r)
    clients = sorted({r.client_id for r in releases})
    n_drop = int(math.floor(config.dropout * len(clients)))
    dropped = set(rng.choice(clients, size=n_drop, replace=False).tolist()) if n_drop else set()
    out = {}
    for name, rs in by_channel.items():
        half = _range(channels[name], rs)
        quantiser = Quantiser(low=-half, high=half, bits=config.bits, n_clients=len(rs))
        words = {}
        for r in rs:
            contribution = np.clip(r.weight * r.value, -half, half) if r.local_noise_std > 0 else r.weight * r.value
            words[r.client_id] = quantiser.quantise(contribution.ravel(), rng)
        drop_at = {"masked_input": dropped & set(words)} if dropped else None
        result = run_round(words, bits=config.bits, min_inputs=config.min_survivors, drop_at=drop_at)
        included = [r for r in rs if r.client_id in set(result.included)]
        total = quantiser.decode_sum(result.sum, len(included)).reshape(rs[0].value.shape)
        weights = np.array([r.weight for r in included])
        centrals = {r.central_noise_std for r in included}
        central = centrals.pop() * float(weights.max()) if centrals else 0.0
        if central > 0:
            total = total + gaussian_noise(total.shape, central, source, channels[name].symmetric)
        local_var = float(np.sum(weights ** 2 * np.array([r.local_noise_std ** 2 for r in included])))
        out[name] = Aggregate(name, total, float(weights.sum()), len(included), float(np.sqrt(local_var + central ** 2)))
    return out
