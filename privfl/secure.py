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

from accounting.calibration import calibrate
from accounting.events import PrivacyEvent
from mechanisms.discrete_gaussian import distributed_discrete_gaussian_event, local_sigma, sample_discrete_gaussian
from mechanisms.gaussian import gaussian_noise
from mechanisms.noise import NoiseSource, as_noise_source
from privfl.aggregation import Aggregate
from privfl.channels import Channel
from privfl.errors import ConfigurationError
from privfl.release import Release
from secure_agg import Quantiser, noise_headroom, run_round


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


@dataclass(frozen=True)
class DistributedNoise:
    """The plan of one channel's distributed noise: the quantiser every client uses, the std of the discrete Gaussian
    share each client adds (integer units), and the zCDP event charged for it (Kairouz, Liu, Steinke 2021 bound, for
    any number of summed shares between ``n_min`` and ``n_max``; rounds with fewer survivors abort)."""

    quantiser: Quantiser
    local_sigma: float
    noise_multiplier: float
    n_min: int
    n_max: int
    event: PrivacyEvent

    def noise_std(self, n_summed: int) -> float:
        """Std of the summed noise per coordinate, in real units, for ``n_summed`` shares."""
        return self.local_sigma * math.sqrt(n_summed) * self.quantiser.step


def plan_distributed_noise(bound: float, dimension: int, noise_multiplier: float, n_max: int, n_min: int,
                           bits: int) -> DistributedNoise:
    """Quantiser and per-client noise share so that ``n_min`` shares carry noise of std ``noise_multiplier * bound``.

    The grid has L levels per client with n_max * L plus 10 standard deviations of the largest possible noise sum
    inside 2^(bits-1), so no sum of at most ``n_max`` clients wraps (up to a 1e-22 tail per coordinate).
    """
    if not 1 <= n_min <= n_max:
        raise ConfigurationError(f"need 1 <= min survivors <= clients, got {n_min} and {n_max}")
    spread = 10.0 * noise_multiplier * math.sqrt(n_max / n_min)
    levels = int((2 ** (bits - 1) - 2) // (n_max + spread + 1))
    levels = min(levels, 2 ** 40)
    if levels < 16:
        raise ConfigurationError(f"{bits} bits leave only {levels} quantisation levels for {n_max} clients with noise "
                                 f"multiplier {noise_multiplier:g}; use more bits (--secagg-bits)")
    step = bound / levels
    sigma_total = noise_multiplier * levels
    quantiser = Quantiser(low=-bound, high=bound, bits=bits, n_clients=n_max, step=step,
                          noise_headroom=noise_headroom(sigma_total * math.sqrt(n_max / n_min)))
    share = local_sigma(sigma_total, n_min)
    event = distributed_discrete_gaussian_event(l2_sensitivity=quantiser.rounded_l2_sensitivity(bound, dimension),
                                                sigma=share, n_min=n_min, n_max=n_max, dimension=dimension)
    return DistributedNoise(quantiser, share, noise_multiplier, n_min, n_max, event)


def calibrate_distributed(channels: Sequence[Channel], epsilon: float, delta: float, rounds: int, n_clients: int,
                          config: "SecureAggregation") -> dict[str, DistributedNoise]:
    """Plan each private channel's distributed noise so the run meets (epsilon, delta) under the zCDP accountant.

    The continuous Gaussian calibration gives each channel's per-round rho; the distributed plan's noise multiplier is
    then raised (bisection) until its Kairouz-Liu-Steinke rho is no larger, so the charged events never overshoot.
    """
    private = [c for c in channels if c.private]
    for c in private:
        if c.coordinate_bound is None or len(c.shape) != 1:
            raise ConfigurationError(f"channel {c.name}: distributed noise needs a vector channel with a norm clip")
    cal = calibrate(epsilon, delta, rounds, channels={c.name: c.budget_share for c in private}, accountant="zcdp")
    n_min = config.min_survivors or n_clients
    plans = {}
    for c in private:
        z = cal.noise_multipliers[c.name]
        target_rho = 1.0 / (2.0 * z * z)

        def plan(m: float) -> DistributedNoise:
            return plan_distributed_noise(c.coordinate_bound, c.shape[0], m, n_clients, n_min, config.bits)

        lo, hi = z, 2.0 * z
        while plan(hi).event.rho > target_rho:
            lo, hi = hi, 2.0 * hi
        for _ in range(40):
            mid = (lo + hi) / 2.0
            if plan(mid).event.rho > target_rho:
                lo = mid
            else:
                hi = mid
        plans[c.name] = plan(hi)
    return plans


def _range(channel: Channel, releases: Sequence[Release]) -> float:
    max_w = max(r.weight for r in releases)
    bound = channel.coordinate_bound
    if bound is None:
        peak = max(float(np.abs(r.weight * r.value).max(initial=0.0)) for r in releases)
        return 2.0 ** math.ceil(math.log2(max(peak, 1e-12))) if peak > 0 else 1.0
    local = max(r.local_noise_std for r in releases)
    return max_w * (bound + 8.0 * local)


def secure_weighted_sums(releases: Sequence[Release], channels: Mapping[str, Channel], config: SecureAggregation,
                         rng: np.random.Generator, noise: NoiseSource | np.random.Generator | int | str = 0,
                         distributed: Mapping[str, DistributedNoise] | None = None) -> dict[str, Aggregate]:
    """Like :func:`privfl.aggregation.weighted_sums`, through the secure-aggregation protocol.

    With ``distributed`` plans, each client adds its discrete Gaussian share to its quantised value before masking,
    and a round with fewer than the plan's ``n_min`` survivors aborts (:class:`secure_agg.ProtocolAbort`).
    """
    source = as_noise_source(noise)
    by_channel: dict[str, list[Release]] = {}
    for r in releases:
        by_channel.setdefault(r.channel, []).append(r)
    clients = sorted({r.client_id for r in releases})
    n_drop = int(math.floor(config.dropout * len(clients)))
    dropped = set(rng.choice(clients, size=n_drop, replace=False).tolist()) if n_drop else set()
    out = {}
    for name, rs in by_channel.items():
        plan = (distributed or {}).get(name)
        if plan is not None:
            if any(r.weight != 1.0 for r in rs):
                raise ConfigurationError("distributed noise needs unit release weights (the sensitivity assumes them)")
            quantiser, min_inputs = plan.quantiser, max(plan.n_min, config.min_survivors or 0)
        else:
            half = _range(channels[name], rs)
            quantiser = Quantiser(low=-half, high=half, bits=config.bits, n_clients=len(rs))
            min_inputs = config.min_survivors
        words = {}
        for r in rs:
            contribution = r.weight * r.value
            if r.local_noise_std > 0:
                contribution = np.clip(contribution, quantiser.low, quantiser.high)
            ints = quantiser.to_integers(contribution.ravel(), rng)
            if plan is not None:
                ints = ints + sample_discrete_gaussian(plan.local_sigma, ints.shape, rng=rng)
            words[r.client_id] = quantiser.encode(ints)
        drop_at = {"masked_input": dropped & set(words)} if dropped else None
        result = run_round(words, bits=config.bits, min_inputs=min_inputs, drop_at=drop_at)
        included = [r for r in rs if r.client_id in set(result.included)]
        total = quantiser.decode_sum(result.sum, len(included)).reshape(rs[0].value.shape)
        weights = np.array([r.weight for r in included])
        centrals = {r.central_noise_std for r in included}
        central = centrals.pop() * float(weights.max()) if centrals else 0.0
        if central > 0:
            total = total + gaussian_noise(total.shape, central, source, channels[name].symmetric)
        local_var = float(np.sum(weights ** 2 * np.array([r.local_noise_std ** 2 for r in included])))
        if plan is not None:
            local_var += plan.noise_std(len(included)) ** 2
        out[name] = Aggregate(name, total, float(weights.sum()), len(included), float(np.sqrt(local_var + central ** 2)))
    return out
