"""Secure aggregation of a round's releases: the server learns each channel's weighted sum, not the uploads.

Each client scales its release by its public weight, quantises it to Z_{2^bits} by stochastic rounding
(``secure_agg.Quantiser``, sized so the sum of all clients cannot wrap) and masks it in the pairwise-masked protocol
(``secure_agg.run_round``, by default its variant that holds against an active server, with the degree and threshold
derived from the declared dropout and corruption); the server unmasks only the sum and decodes it. A round that cannot
be aggregated safely (one client, fewer than ``min_survivors``, a value too large to quantise, too few clients for the
declared threat model) aborts with ``ProtocolAbort``: nothing of it is revealed, and the run goes on.
Algorithms are unchanged: they receive the same :class:`privfl.aggregation.Aggregate` as without secure aggregation,
up to quantisation error (one rounding step per client and coordinate, unbiased).

Quantisation range of a channel: a function of public facts only (:func:`quantisation_half_width`): its public
coordinate bound (``Channel.coordinate_bound``; a NormClip's C, or a declared ``value_bound``) times the largest
(public) weight, widened by 8 standard deviations of local noise when the client adds noise itself. Every
contribution is clipped into the range before rounding: for a noisy value that is post-processing of a private
release; for an un-noised one (central or distributed placement) a per-coordinate clip to a public box is a
contraction, so the channel's declared sensitivity still holds. A private channel without a public coordinate bound
is refused (:func:`check_secure_channels`): a range read off the un-noised uploads would reveal their largest value.
Only non-private channels (``epsilon = inf``) and values that are already private (DP-SGD-trained models, whose
range is post-processing of the training's release) may use the round's largest |value|, rounded up to a power of
two.

Distributed noise is planned for the channel's sensitivity under its own relation (add/remove: C; replace one: 2C,
and two independent roundings), so the charged zCDP event is the one of the relation the run declares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from privfl.accounting.calibration import calibrate, calibrate_noise
from privfl.accounting.events import ComposedEvent, GaussianEvent, PrivacyEvent, SelfComposedEvent
from privfl.mechanisms.discrete_gaussian import distributed_discrete_gaussian_event, local_sigma, sample_discrete_gaussian
from privfl.mechanisms.gaussian import gaussian_noise
from privfl.mechanisms.noise import NoiseSource, as_noise_source
from privfl.aggregation import Aggregate
from privfl.channels import Channel, TrainedPrivately
from privfl.errors import ConfigurationError
from privfl.public import private_rng
from privfl.release import Release
from privfl.secure_agg import ProtocolAbort, Quantiser, noise_headroom, run_round
from privfl.secure_agg.params import ParameterError


@dataclass(frozen=True)
class SecureAggregation:
    """Secure-aggregation settings: ``bits`` of the modular ring, simulated ``dropout`` (fraction of the round's
    clients that drop after sharing keys, before sending their masked input), and ``min_survivors`` below which the
    round aborts (default: the protocol's threshold). ``malicious``: run the variant that holds against an active
    server (signed keys and inputs, consistency round; in this in-process simulation every client draws its identity
    key and the registry is built in process). ``corruption``: the declared fraction of clients that may collude with
    the server; with ``dropout`` it sets the neighbour-graph degree and threshold (``secure_agg.params``)."""

    bits: int = 48
    dropout: float = 0.0
    min_survivors: int | None = None
    malicious: bool = True
    corruption: float = 0.0

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 8 <= self.bits <= 64:
            raise ConfigurationError(f"secure aggregation bits must be an integer in [8, 64] (--secagg-bits), got "
                                     f"{self.bits!r}")
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ConfigurationError(f"dropout must lie in [0, 1), got {self.dropout!r}")
        if self.min_survivors is not None and (isinstance(self.min_survivors, bool)
                                               or not isinstance(self.min_survivors, int) or self.min_survivors < 1):
            raise ConfigurationError(f"min survivors must be a positive integer (--min-survivors), got "
                                     f"{self.min_survivors!r}")
        if not isinstance(self.malicious, bool):
            raise ConfigurationError(f"malicious must be True or False, got {self.malicious!r}")
        if not (isinstance(self.corruption, (int, float)) and not isinstance(self.corruption, bool)
                and 0 <= self.corruption < 1):
            raise ConfigurationError(f"corruption must lie in [0, 1), got {self.corruption!r}")

    def check(self, n_clients: int) -> None:
        """Refuse, before the run, a ring too small for ``n_clients`` and a threat model (dropout, corruption, active
        server) that no degree and threshold can meet with all of them (every round would fail)."""
        from privfl.secure_agg.params import derive_parameters

        try:
            Quantiser(low=-1.0, high=1.0, bits=self.bits, n_clients=n_clients)
        except ValueError as exc:
            raise ConfigurationError(f"secure aggregation: {exc} (--secagg-bits)") from exc
        try:
            derive_parameters(n_clients, dropout=self.dropout, corruption=self.corruption, malicious=self.malicious,
                              min_inputs=self.min_survivors)
        except ParameterError as exc:
            raise ConfigurationError(f"secure aggregation: {exc}") from exc

    def survivors(self, n_clients: int) -> int:
        """How many of ``n_clients`` remain after the simulated dropout (the count ``secure_weighted_sums`` keeps)."""
        return n_clients - int(math.floor(self.dropout * n_clients))


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
                           bits: int, *, sensitivity: float | None = None, relation: str = "add_remove"
                           ) -> DistributedNoise:
    """Quantiser and per-client noise share so that ``n_min`` shares carry noise of std ``noise_multiplier *
    sensitivity``; the event is the Kairouz-Liu-Steinke bound for the rounded sensitivity under ``relation``.

    ``bound``: the public coordinate bound that sets the quantiser's range [-bound, bound]. ``sensitivity``: the
    channel's L2 sensitivity under its relation (default ``bound``: a norm clip under add/remove). The grid has L
    levels per client with n_max * L plus 10 standard deviations of the largest possible noise sum inside
    2^(bits-1), so no sum of at most ``n_max`` clients wraps (up to a 1e-22 tail per coordinate).
    """
    if not 1 <= n_min <= n_max:
        raise ConfigurationError(f"need 1 <= min survivors <= clients, got {n_min} and {n_max}")
    if relation not in ("add_remove", "replace_one"):
        raise ConfigurationError(f"relation must be add_remove or replace_one, got {relation!r}")
    sensitivity = bound if sensitivity is None else float(sensitivity)
    ratio = sensitivity / bound  # noise std in units of the range's half-width
    spread = 10.0 * noise_multiplier * ratio * math.sqrt(n_max / n_min)
    levels = int((2 ** (bits - 1) - 2) // (n_max + spread + 1))
    levels = min(levels, 2 ** 40)
    if levels < 16:
        raise ConfigurationError(f"{bits} bits leave only {levels} quantisation levels for {n_max} clients with noise "
                                 f"multiplier {noise_multiplier:g}; use more bits (--secagg-bits)")
    step = bound / levels
    sigma_total = noise_multiplier * ratio * levels
    quantiser = Quantiser(low=-bound, high=bound, bits=bits, n_clients=n_max, step=step,
                          noise_headroom=noise_headroom(sigma_total * math.sqrt(n_max / n_min)))
    share = local_sigma(sigma_total, n_min)
    rounded = quantiser.rounded_l2_sensitivity(sensitivity, dimension, replace_one=relation == "replace_one")
    event = distributed_discrete_gaussian_event(l2_sensitivity=rounded, sigma=share, n_min=n_min, n_max=n_max,
                                                dimension=dimension)
    return DistributedNoise(quantiser, share, noise_multiplier, n_min, n_max, event)


def calibrate_distributed(channels: Sequence[Channel], epsilon: float, delta: float, rounds: int, n_clients: int,
                          config: "SecureAggregation") -> dict[str, DistributedNoise]:
    """Plan each private channel's distributed noise so the run meets (epsilon, delta) under the zCDP accountant.

    The continuous Gaussian calibration gives each channel's per-round rho; the distributed plan's noise multiplier is
    then raised (the one search, ``accounting.calibration.calibrate_noise``, over the factory noise -> the run's
    events) until its Kairouz-Liu-Steinke rho, for the channel's sensitivity under its relation, is no larger, so the
    charged events never overshoot.
    """
    private = [c for c in channels if c.private]
    for c in private:
        if c.coordinate_bound is None or len(c.shape) != 1:
            raise ConfigurationError(f"channel {c.name}: distributed noise needs a vector channel with a norm clip")
    survivors = config.survivors(n_clients)
    if config.min_survivors is None and survivors < n_clients:
        raise ConfigurationError(
            f"distributed noise with dropout {config.dropout:g}: {survivors} of {n_clients} clients survive a round, "
            f"fewer than the {n_clients} noise shares the noise would be calibrated for, so every round would abort; "
            f"set --min-survivors to at most {survivors} (the noise is then calibrated for that many shares)")
    if config.min_survivors is not None and config.min_survivors > survivors:
        raise ConfigurationError(
            f"--min-survivors {config.min_survivors} exceeds the {survivors} of {n_clients} clients that survive a "
            f"dropout of {config.dropout:g}, so every round would abort; set --min-survivors to at most {survivors}")
    cal = calibrate(epsilon, delta, rounds, channels={c.name: c.budget_share for c in private}, accountant="zcdp")
    n_min = config.min_survivors or n_clients
    plans = {}
    for c in private:
        def plan(m: float, c=c) -> DistributedNoise:
            return plan_distributed_noise(c.coordinate_bound, c.shape[0], m, n_clients, n_min, config.bits,
                                          sensitivity=c.sensitivity, relation=c.adjacency)

        others = tuple(GaussianEvent(1.0, cal.noise_multipliers[o.name]) for o in private if o is not c)

        def run_events(m: float, plan=plan, others=others) -> PrivacyEvent:
            """The run with this channel on its distributed plan and the others at their continuous noise: under
            zCDP it meets the calibrated epsilon exactly when the plan's rho is at most the channel's share."""
            return SelfComposedEvent(ComposedEvent((plan(m).event,) + others), rounds)

        z = cal.noise_multipliers[c.name]
        m, _ = calibrate_noise(run_events, cal.epsilon, delta, "zcdp", guess=z, step=1.1, tol=1e-9, lower=z,
                               upper=1e6 * z)
        plans[c.name] = plan(m)
    return plans


def _range_needs_public_bound(channel: Channel) -> bool:
    """A private channel's range must be public unless its values are already private (DP-SGD-trained: reading
    their range is post-processing of the training's release)."""
    return channel.private and not isinstance(channel.clip, TrainedPrivately)


def check_secure_channels(channels: Sequence[Channel]) -> None:
    """Refuse, before a round, a private channel whose quantisation range would have to be read off un-noised
    uploads."""
    for c in channels:
        if _range_needs_public_bound(c) and c.coordinate_bound is None:
            raise ConfigurationError(
                f"channel {c.name!r} has no public coordinate bound, so secure aggregation could only size its "
                "quantisation range from the un-noised uploads, which would reveal them; declare a public "
                "value_bound for the channel (e.g. from a public record cap)")


def quantisation_half_width(channel: Channel, weights: Sequence[float], local_noise_stds: Sequence[float]) -> float:
    """The half-width of a channel's quantisation range from public facts: its coordinate bound, the largest public
    weight and the largest local noise std (8 standard deviations of headroom)."""
    bound = channel.coordinate_bound
    if bound is None:
        raise ConfigurationError(f"channel {channel.name!r} has no public coordinate bound")
    return max(weights) * (bound + 8.0 * max(local_noise_stds))


_MAX_HALF_WIDTH = 2.0 ** 1022  # the range [-h, h] must have a finite float64 width 2h


def _range(channel: Channel, releases: Sequence[Release]) -> float:
    if channel.coordinate_bound is None:
        check_secure_channels([channel])
        # non-private, or already private (DP-SGD-trained) values: the round's largest value may size the range
        with np.errstate(over="ignore", invalid="ignore"):
            peak = max(float(np.abs(np.multiply(r.weight, r.value, dtype=np.float64)).max(initial=0.0))
                       for r in releases)
        if not peak <= _MAX_HALF_WIDTH:  # also catches inf and nan
            raise ProtocolAbort(f"channel {channel.name!r}: a weighted contribution of magnitude {peak:.4g} cannot be "
                                f"quantised (the limit is 2^1022); nothing of this round is revealed. Clip the channel "
                                f"(declare a clip or a value_bound) or lower its weights", party="server")
        return 2.0 ** math.ceil(math.log2(max(peak, 1e-12))) if peak > 0 else 1.0
    half = quantisation_half_width(channel, [r.weight for r in releases], [r.local_noise_std for r in releases])
    if not (math.isfinite(half) and half <= _MAX_HALF_WIDTH):
        raise ProtocolAbort(f"channel {channel.name!r}: the quantisation half-width {half:.4g} is too large for "
                            f"float64 (at most 2^1022); declare a smaller coordinate bound or weights", party="server")
    return half


def secure_weighted_sums(releases: Sequence[Release], channels: Mapping[str, Channel], config: SecureAggregation,
                         rng: np.random.Generator, noise: NoiseSource | np.random.Generator | int | str = 0,
                         distributed: Mapping[str, DistributedNoise] | None = None, *,
                         secure_noise: bool = False) -> dict[str, Aggregate]:
    """Like :func:`privfl.aggregation.weighted_sums`, through the secure-aggregation protocol.

    With ``distributed`` plans, each client adds its discrete Gaussian share to its quantised value before masking,
    and a round with fewer than the plan's ``n_min`` survivors aborts (:class:`secure_agg.ProtocolAbort`).
    ``rng`` decides the simulated dropouts. ``secure_noise``: the clients' stochastic rounding and discrete Gaussian
    shares come from the OS CSPRNG (the default of private runs, ``privfl.public``); otherwise from ``rng``.
    """
    source = as_noise_source(noise)
    by_channel: dict[str, list[Release]] = {}
    for r in releases:
        by_channel.setdefault(r.channel, []).append(r)
    clients = sorted({r.client_id for r in releases})
    n_drop = int(math.floor(config.dropout * len(clients)))
    dropped = set(rng.choice(clients, size=n_drop, replace=False).tolist()) if n_drop else set()
    coins = private_rng(rng, secure_noise)  # the clients' rounding coins
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
            contribution = np.clip(r.weight * r.value, quantiser.low, quantiser.high)  # a contraction (docstring)
            ints = quantiser.to_integers(contribution.ravel(), coins)
            if plan is not None:
                share = (sample_discrete_gaussian(plan.local_sigma, ints.shape, secure=True) if secure_noise
                         else sample_discrete_gaussian(plan.local_sigma, ints.shape, rng=coins))
                ints = ints + share
            words[r.client_id] = quantiser.encode(ints)
        need = max(2, min_inputs or 0)
        if len(words) < need:  # e.g. a sampled round with one client: abort the round, reveal nothing
            flag = " (--min-survivors)" if min_inputs and min_inputs > 1 else ""
            raise ProtocolAbort(f"channel {name!r}: only {len(words)} client(s) in this round, secure aggregation "
                                f"needs at least {need}{flag}; the round is aborted", party="server")
        drop_at = {"masked_input": dropped & set(words)} if dropped else None
        try:
            result = run_round(words, bits=config.bits, min_inputs=min_inputs, drop_at=drop_at,
                               malicious=config.malicious, dropout=config.dropout, corruption=config.corruption)
        except ParameterError as exc:  # e.g. a sampled round too small for the declared dropout: abort the round
            raise ProtocolAbort(f"channel {name!r}: {len(words)} clients cannot be aggregated safely under the "
                                f"declared threat model ({exc})", party="server") from exc
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
