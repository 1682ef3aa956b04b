"""Secure aggregation of a round's releases: the server learns each channel's weighted sum, not the uploads.

Two steps, one per side, joined only by ``secure_agg``'s serialisable messages:

- the **client's** (:func:`encode_for_secure_sum`, in the client's pipeline after validate -> clip -> charge ->
  noise): scale each release by its public weight, clip it into the channel's public range, quantise it to
  Z_{2^bits} by stochastic rounding and, with distributed noise, add the client's discrete-Gaussian share, all with
  the client's own generator; the words go into the client's ``secure_agg.ClientSession``;
- the **server's** (``secure_agg.ServerSession``, then :func:`decode_secure_sum`): unmask only the sum of the
  survivors' inputs, decode it, add central noise where the placement says so.

:func:`secure_weighted_sums` runs both in one process (the in-process runtime); ``privfl.flower.app`` runs the
same steps across machines, the protocol's stages as Flower message rounds. A round that cannot be aggregated safely
(one client, fewer than ``min_survivors``, too few clients for the declared threat model) aborts with
``ProtocolAbort``: nothing of it is revealed, and the run goes on. Algorithms are unchanged: they receive the same
:class:`privfl.core.aggregation.Aggregate` as without secure aggregation, up to quantisation error (one rounding step
per client and coordinate, unbiased).

Quantisation range of a channel (:func:`channel_encodings`): fixed by public facts only, before any value is seen,
and the same for every client: the distributed-noise plan's quantiser where there is one, else the channel's public
coordinate bound (``Channel.coordinate_bound``: a NormClip's C, or a declared ``value_bound``) times the largest
public release weight (:func:`public_weight_bound`), widened by 8 standard deviations of the plan's local noise when
the client adds noise itself; sized for the run's client count so the sum cannot wrap. Every contribution is
clipped into the range before rounding: for a noisy value that is post-processing of a private release; for an
un-noised one (central or distributed placement) a per-coordinate clip to a public box is a contraction, so the
channel's declared sensitivity still holds. A private channel without a public coordinate bound (DP-SGD-trained
models included) is refused before the run (:func:`check_secure_channels`): its range could only be read off the
values. The one exception is a non-private run (``epsilon = inf``, nothing claimed): there each client announces
the range its own value needs (:func:`announced_half_width`) and the largest is used; a deployment refuses it.

Distributed noise is planned for the channel's sensitivity under its own relation (add/remove: C; replace one: 2C,
and two independent roundings), so the charged event is the one of the relation the run declares. A channel that
is a sum over a Poisson sample of records (record-level DP-FedSGD) is planned by
:func:`plan_distributed_noise_sampled` / :func:`calibrate_distributed_sampled`: the round is charged
``PoissonSampledEvent(q, ApproximatedEvent(GaussianEvent, tv))``, the Poisson-sampled continuous Gaussian that the
sum of the honest shares nearly is (``mechanisms.discrete_gaussian.distributed_gaussian_event``: within total
variation tv of a post-processing of it), which the pld accountant composes as tightly as central noise; where tv
is not small against the run's delta (coarse quantisation), ``PoissonSampledEvent(q, ZCDPEvent(rho))`` instead,
which the rdp accountant bounds (Zhu and Wang 2019, Theorem 6).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from privfl.accounting.accountants.analytic_gaussian import gaussian_mu
from privfl.accounting.calibration import calibrate, calibrate_noise, clt_noise_multiplier
from privfl.accounting.validation import check_count, check_delta, check_probability, check_target_epsilon
from privfl.accounting.events import (ComposedEvent, GaussianEvent, PoissonSampledEvent, PrivacyEvent,
                                     SelfComposedEvent)
from privfl.mechanisms.discrete_gaussian import (GAUSSIAN_PROXY_DELTA_SHARE, distributed_discrete_gaussian_event,
                                                distributed_gaussian_event, local_sigma, sample_discrete_gaussian)
from privfl.mechanisms.gaussian import gaussian_noise
from privfl.mechanisms.noise import NoiseSource, as_noise_source
from privfl.core.aggregation import Aggregate
from privfl.core.channels import Channel, TrainedPrivately
from privfl.errors import ConfigurationError
from privfl.core.public import private_rng
from privfl.core.release import Release
from privfl.secure_agg import ProtocolAbort, Quantiser, noise_headroom, run_round
from privfl.secure_agg.params import ParameterError


# Aim a hair below the target: the ledger composes round by round, which can differ from the count-composition
# searched here in the last digits.


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
        survivors = self.survivors(n_clients)
        if self.min_survivors is not None and self.min_survivors > survivors:
            # every round would abort after its charges (a review, session 26: 3 of 3 rounds aborted, the whole
            # budget spent, exit 0)
            raise ConfigurationError(f"--min-survivors {self.min_survivors} exceeds the {survivors} of {n_clients} "
                                     f"clients a round can have (dropout {self.dropout:g}), so every round would "
                                     f"abort; set --min-survivors to at most {survivors}")

    def survivors(self, n_clients: int) -> int:
        """How many of ``n_clients`` remain after the simulated dropout (the count ``secure_weighted_sums`` keeps)."""
        from privfl.secure_agg.params import fraction_count

        return n_clients - fraction_count(self.dropout, n_clients)


@dataclass(frozen=True)
class DistributedNoise:
    """The plan of one channel's distributed noise: the quantiser every client uses, the std of the discrete Gaussian
    share each client adds (integer units), and the event charged for it per round (Kairouz, Liu, Steinke 2021 bound,
    for any number of summed shares between ``n_min`` and ``n_max``; rounds with fewer survivors abort): a
    ``ZCDPEvent`` (:func:`plan_distributed_noise`), or ``PoissonSampledEvent(q, ZCDPEvent)`` for a sum over a
    Poisson sample of records (:func:`plan_distributed_noise_sampled`)."""

    quantiser: Quantiser
    local_sigma: float
    noise_multiplier: float
    n_min: int
    n_max: int
    event: PrivacyEvent
    #: the honest shares the noise is calibrated for: ``n_min`` less the ``floor(corruption * clients)`` shares that
    #: colluding clients may subtract again (None: ``n_min``, no corruption declared)
    n_honest: int | None = None
    #: the declared fraction of clients that may collude with the server
    corruption: float = 0.0

    @property
    def honest(self) -> int:
        return self.n_min if self.n_honest is None else self.n_honest

    @property
    def trust(self) -> str:
        """The trust assumption the plan's event holds under, as the ledger records it."""
        return (f"secure aggregation: noise for >= {self.honest} honest shares (>= {self.n_min} survivors of at most "
                f"{self.n_max}, <= {self.n_min - self.honest} colluding with the server, corruption "
                f"{self.corruption:g})")

    def noise_std(self, n_summed: int) -> float:
        """Std of the summed noise per coordinate, in real units, for ``n_summed`` shares."""
        return self.local_sigma * math.sqrt(n_summed) * self.quantiser.step


def plan_distributed_noise(bound: float, dimension: int, noise_multiplier: float, n_max: int, n_min: int,
                           bits: int, *, sensitivity: float | None = None, relation: str = "add_remove",
                           record_level: bool = False, n_honest: int | None = None,
                           corruption: float = 0.0, gaussian: bool = True) -> DistributedNoise:
    """Quantiser and per-client noise share so that ``n_honest`` shares carry noise of std ``noise_multiplier *
    sensitivity``; the event, for the rounded sensitivity D under ``relation``, is the Gaussian the honest shares'
    sum nearly is (``gaussian``, default: ``distributed_gaussian_event``, ``ApproximatedEvent(GaussianEvent(D,
    sqrt(n_honest) sigma), tv)``, composed by the pld or rdp accountant) or the Kairouz-Liu-Steinke zCDP bound
    (``gaussian=False``, composed by the zcdp or rdp accountant).

    ``record_level``: the neighbours differ in one record of a client that uploads either way, so both uploads are
    stochastically rounded and the integer vectors differ by less than sensitivity/step + 2 sqrt(d) (the replace-one
    form of ``Quantiser.rounded_l2_sensitivity``) under either relation; + sqrt(d) holds only when a whole upload is
    added or removed (client level, add/remove).

    ``bound``: the public coordinate bound that sets the quantiser's range [-bound, bound]. ``sensitivity``: the
    channel's L2 sensitivity under its relation (default ``bound``: a norm clip under add/remove). The grid has L
    levels per client with n_max * L plus 10 standard deviations of the largest possible noise sum inside
    2^(bits-1), so no sum of at most ``n_max`` clients wraps (up to a 1e-22 tail per coordinate).

    ``n_honest`` (default ``n_min``): the shares the noise is sized for, ``n_min`` less the clients that may collude
    with the server (:func:`honest_shares`): a colluding client knows its own share and the server subtracts it, so
    only honest shares guard the sum; the event is charged for any number of honest shares in [n_honest, n_max].
    """
    if not 1 <= n_min <= n_max:
        raise ConfigurationError(f"need 1 <= min survivors <= clients, got {n_min} and {n_max}")
    if relation not in ("add_remove", "replace_one"):
        raise ConfigurationError(f"relation must be add_remove or replace_one, got {relation!r}")
    honest = _check_honest(n_honest, n_min)
    sensitivity = bound if sensitivity is None else float(sensitivity)
    quantiser, share = _size_distributed_noise(bound, sensitivity, noise_multiplier, n_max, honest, bits)
    rounded = quantiser.rounded_l2_sensitivity(sensitivity, dimension,
                                               replace_one=record_level or relation == "replace_one")
    make_event = distributed_gaussian_event if gaussian else distributed_discrete_gaussian_event
    event = make_event(l2_sensitivity=rounded, sigma=share, n_min=honest, n_max=n_max, dimension=dimension)
    return DistributedNoise(quantiser, share, noise_multiplier, n_min, n_max, event, honest, float(corruption))


def _check_honest(n_honest: int | None, n_min: int) -> int:
    if n_honest is None:
        return n_min
    if isinstance(n_honest, bool) or not isinstance(n_honest, int) or not 1 <= n_honest <= n_min:
        raise ConfigurationError(f"need 1 <= honest shares <= min survivors ({n_min}), got {n_honest!r}")
    return n_honest


def honest_shares(config: "SecureAggregation", n_clients: int, n_min: int) -> int:
    """The noise shares that still guard a round's sum when ``floor(corruption * n_clients)`` clients collude with
    the server (each knows its own discrete-Gaussian share, so the server can subtract it): ``n_min`` survivors less
    the colluders, counted by the protocol's own rule (``secure_agg.params.fraction_count``: 0.29 of 100 is 29, where
    a bare floor of the float product said 28 and sized the noise for one honest share more than the protocol
    guarantees). Refused, naming what to change, when no honest share would remain."""
    from privfl.secure_agg.params import fraction_count

    colluding = fraction_count(config.corruption, n_clients)
    honest = n_min - colluding
    if honest < 1:
        raise ConfigurationError(
            f"distributed noise with corruption {config.corruption:g}: up to {colluding} of {n_clients} clients may "
            f"collude with the server and subtract their noise shares, leaving no honest share of the {n_min} "
            f"survivors a round needs; lower the corruption or raise --min-survivors")
    return honest


def _size_distributed_noise(bound: float, sensitivity: float, noise_multiplier: float, n_max: int, n_min: int,
                            bits: int) -> tuple[Quantiser, float]:
    """(quantiser on [-bound, bound], per-client share sigma in integer units) such that ``n_min`` shares sum to noise
    of std ``noise_multiplier * sensitivity`` and a sum of ``n_max`` inputs plus 10 standard deviations of the
    largest noise sum cannot wrap."""
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
    return quantiser, local_sigma(sigma_total, n_min)


def plan_distributed_noise_sampled(bound: float, dimension: int, noise_multiplier: float, n_max: int, n_min: int,
                                   bits: int, *, clip: float, sampling_rate: float, n_honest: int | None = None,
                                   corruption: float = 0.0, gaussian: bool = True, bands: int = 1) -> DistributedNoise:
    """Distributed noise for a sum over a Poisson sample of records (record-level DP, add/remove, e.g. DP-FedSGD):
    each client releases sum_{i in S} clip_C(g_i), S a Poisson sample of its records at rate ``sampling_rate``,
    coordinate-clipped to the public range [-bound, bound], stochastically rounded, plus its discrete-Gaussian
    share; ``n_honest`` shares (``n_min`` survivors less the colluders) sum to noise of std
    ``noise_multiplier * clip``. ``.event``, charged per round, is ``PoissonSampledEvent(sampling_rate, inner)``.

    Sensitivity. Adding or removing one record moves the client's real sum by its clipped gradient, L2 norm <= clip;
    the coordinate clip of the sum to [-bound, bound] is 1-Lipschitz in each coordinate, so it cannot increase that
    L2 distance. The client still sends a sum, with or without the record, and both are stochastically rounded, each
    coordinate moving by less than one step: the integer vectors differ by less than D = clip/step + 2 sqrt(d), the
    replace-one form of ``Quantiser.rounded_l2_sensitivity`` (not the + sqrt(d) of a whole upload added or removed),
    whatever the rounding draws (so any coupling of them, and by joint convexity the mixture over them, is bounded
    by the worst shift of norm <= D).

    ``bands`` b > 1 (banded matrix factorisation, ``privfl.core.channels.Channel.record_bands``): the event is one
    block's, b rounds in which the record's clipped gradient enters as c_k g (``||c|| = 1``), each round's value rounded
    on its own: the block is one vector of b d coordinates, D = clip/step + 2 sqrt(b d) (Minkowski over the rows) and
    b d coordinates' total variation.

    The event. ``gaussian`` (default): ``inner = distributed_gaussian_event`` = ``ApproximatedEvent(
    GaussianEvent(D, sqrt(n_honest) sigma), tv)``: for h >= n_honest honest shares, the released sum is within total
    variation tv of round(x + Z), Z ~ N(0, h sigma^2 I), a post-processing of the Gaussian mechanism (noise std
    sqrt(h) sigma >= sqrt(n_honest) sigma); Poisson sampling of the record amplifies it as it does the central
    Gaussian (the record's membership is independent of the noise), so the pld accountant composes the sampled
    Gaussian and adds (1 + e^eps) tv per round to delta. ``gaussian=False``: ``inner = ZCDPEvent(rho)``, the
    Kairouz-Liu-Steinke bound of the sum of n shares at D, the largest over n in [n_honest, n_max], composed by the
    rdp accountant with Zhu and Wang's bound. Either way rounds with fewer survivors abort. ``bound`` sizes the
    quantiser as in :func:`plan_distributed_noise`.
    """
    if not 1 <= n_min <= n_max:
        raise ConfigurationError(f"need 1 <= min survivors <= clients, got {n_min} and {n_max}")
    for name, value in (("bound", bound), ("clip", clip), ("noise_multiplier", noise_multiplier)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ConfigurationError(f"{name} must be a finite number > 0, got {value!r}")
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, float)) or not 0 < sampling_rate <= 1:
        raise ConfigurationError(f"the record sampling rate must lie in (0, 1], got {sampling_rate!r}")
    honest = _check_honest(n_honest, n_min)
    quantiser, share = _size_distributed_noise(float(bound), float(clip), float(noise_multiplier), n_max, honest,
                                               bits)
    if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
        raise ConfigurationError(f"bands must be an integer >= 1, got {bands!r}")
    block = int(dimension) * bands  # a block of b rounds: one vector of b d coordinates
    rounded = quantiser.rounded_l2_sensitivity(float(clip), block, replace_one=True)
    if gaussian:
        inner = distributed_gaussian_event(l2_sensitivity=rounded, sigma=share, n_min=honest, n_max=n_max,
                                           dimension=block)
    else:
        inner = distributed_discrete_gaussian_event(l2_sensitivity=rounded, sigma=share, n_min=honest, n_max=n_max,
                                                    dimension=block)
    return DistributedNoise(quantiser, share, float(noise_multiplier), n_min, n_max,
                            PoissonSampledEvent(float(sampling_rate), inner), honest, float(corruption))


def _survivor_floor(config: "SecureAggregation", n_clients: int) -> int:
    """The number of noise shares a plan is calibrated for (``min_survivors``, else every client); refuses, before
    the run, a dropout that leaves fewer survivors than that (every round would abort)."""
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
    return config.min_survivors or n_clients


def calibrate_distributed_sampled(epsilon: float, delta: float, rounds: int, sampling_rate: float, bound: float,
                                  dimension: int, clip: float, n_clients: int, config: "SecureAggregation",
                                  accountant: str = "pld", bands: int = 1) -> DistributedNoise:
    """The record-sampled distributed plan (:func:`plan_distributed_noise_sampled`) with the smallest noise
    multiplier whose ``rounds``-fold composition meets (epsilon, delta) under ``accountant`` (``pld``, the default
    and tightest, or ``rdp``): the one search (``accounting.calibration.calibrate_noise``), started from the
    central-limit estimate of the continuous Poisson-sampled Gaussian's (``clt_noise_multiplier``).

    Each candidate plan charges the sampled Gaussian with its total-variation term (``gaussian=True``); under rdp,
    where ``rounds`` times that term, times (1 + e^epsilon), exceeds ``GAUSSIAN_PROXY_DELTA_SHARE`` of delta (a
    coarse quantiser), the sampled zCDP bound instead. A larger multiplier only shrinks the term (a coarser
    quantiser step but a larger share in its units), so the search stays monotone; under pld a term too large for
    the target makes the candidate's epsilon infinite and the search moves up. The charged Gaussian's multiplier
    (the honest shares' noise over the rounded sensitivity D >= clip / step) is never below the smallest the
    continuous sampled Gaussian needs; the central plan's search stops up to 0.1% above that smallest, this one
    within 1e-6, so the two nominal multipliers may differ either way by that much. ``bands``: the plan's block of
    banded rounds (``rounds`` is then the number of blocks). ``n_clients``: the clients
    summed at most; the survivor floor is ``config.min_survivors`` (else every client), checked against the dropout
    as in :func:`calibrate_distributed`. Never overshoots the target.
    """
    epsilon, delta = check_target_epsilon(epsilon), check_delta(delta)
    rounds, sampling_rate = check_count("rounds", rounds), check_probability("sampling_rate", sampling_rate)
    if accountant not in ("pld", "rdp"):
        raise ConfigurationError(f"distributed noise on sampled records is composed by the pld (tightest) or rdp "
                                 f"accountant, not {accountant!r}; set accountant='pld' (CLI: --accountant pld)")
    n_min = _survivor_floor(config, n_clients)
    honest = honest_shares(config, n_clients, n_min)
    guess = clt_noise_multiplier(gaussian_mu(epsilon, delta), sampling_rate, rounds)
    budget = GAUSSIAN_PROXY_DELTA_SHARE * delta / (1.0 + math.exp(min(epsilon, 700.0)))

    def plan(m: float) -> DistributedNoise:
        def build(gaussian: bool) -> DistributedNoise:
            return plan_distributed_noise_sampled(bound, dimension, m, n_clients, n_min, config.bits, clip=clip,
                                                  sampling_rate=sampling_rate, n_honest=honest,
                                                  corruption=config.corruption, gaussian=gaussian, bands=bands)
        proxy = build(True)
        if accountant == "pld" or rounds * proxy.event.event.total_variation <= budget:
            return proxy
        return build(False)

    def run_events(m: float) -> PrivacyEvent:
        return SelfComposedEvent(plan(m).event, rounds)

    m, _ = calibrate_noise(run_events, epsilon, delta, accountant, guess=guess, step=1.1, tol=1e-6)
    return plan(m)


def calibrate_distributed(channels: Sequence[Channel], epsilon: float, delta: float, rounds: int, n_clients: int,
                          config: "SecureAggregation", accountant: str = "pld") -> dict[str, DistributedNoise]:
    """Plan each private channel's distributed noise so the run meets (epsilon, delta) under ``accountant``.

    ``zcdp``: each channel charged the Kairouz-Liu-Steinke bound. The continuous Gaussian calibration gives each
    channel's per-round rho; the distributed plan's noise multiplier is then raised (the one search,
    ``accounting.calibration.calibrate_noise``, over the factory noise -> the run's events) until its rho, for the
    channel's sensitivity under its relation, is no larger, so the charged events never overshoot.

    ``pld`` (tightest) or ``rdp``: each channel charged as the Gaussian its honest shares' sum nearly is
    (``distributed_gaussian_event``, with its total-variation term). The continuous calibration gives the channels'
    multipliers z_c (their budget shares); one factor s >= 1 scales them all, the smallest whose run (every channel on
    its distributed plan at s z_c) meets the target under the same accountant.
    """
    private = [c for c in channels if c.private]
    for c in private:
        if c.coordinate_bound is None or len(c.shape) != 1:
            raise ConfigurationError(f"channel {c.name}: distributed noise needs a vector channel with a norm clip")
    if accountant not in ("zcdp", "pld", "rdp"):
        raise ConfigurationError(f"distributed noise is composed by the pld (tightest), rdp or zcdp accountant, not "
                                 f"{accountant!r}; set accountant='pld' (CLI: --accountant pld)")
    n_min = _survivor_floor(config, n_clients)
    honest = honest_shares(config, n_clients, n_min)
    gaussian = accountant != "zcdp"
    cal = calibrate(epsilon, delta, rounds, channels={c.name: c.budget_share for c in private}, accountant=accountant)

    def plan_for(c: Channel, m: float) -> DistributedNoise:
        return plan_distributed_noise(c.coordinate_bound, c.shape[0], m, n_clients, n_min, config.bits,
                                      sensitivity=c.sensitivity, relation=c.adjacency,
                                      record_level=c.unit == "example", n_honest=honest,
                                      corruption=config.corruption, gaussian=gaussian)

    if gaussian:
        def all_events(scale: float) -> PrivacyEvent:
            return SelfComposedEvent(ComposedEvent(tuple(plan_for(c, scale * cal.noise_multipliers[c.name]).event
                                                         for c in private)), rounds)

        scale, _ = calibrate_noise(all_events, epsilon, delta, accountant, guess=1.0, step=1.01, tol=1e-6,
                                   lower=1.0, upper=1e6)
        return {c.name: plan_for(c, scale * cal.noise_multipliers[c.name]) for c in private}
    plans = {}
    for c in private:
        others = tuple(GaussianEvent(1.0, cal.noise_multipliers[o.name]) for o in private if o is not c)

        def run_events(m: float, c=c, others=others) -> PrivacyEvent:
            """The run with this channel on its distributed plan and the others at their continuous noise: under
            zCDP it meets the calibrated epsilon exactly when the plan's rho is at most the channel's share."""
            return SelfComposedEvent(ComposedEvent((plan_for(c, m).event,) + others), rounds)

        z = cal.noise_multipliers[c.name]
        m, _ = calibrate_noise(run_events, cal.epsilon, delta, "zcdp", guess=z, step=1.1, tol=1e-9, lower=z,
                               upper=1e6 * z)
        plans[c.name] = plan_for(c, m)
    return plans


# -- quantisation ranges: public facts only ----------------------------------------------------------------------

def check_secure_channels(channels: Sequence[Channel]) -> None:
    """Refuse, before any round, a private channel without a public coordinate bound under secure aggregation.

    Every client must quantise into one range fixed before the round; without a public bound the only way to pick
    it would be to read it off the clients' values, so the range would leak them. DP-SGD-trained values are refused
    too: they have no public range either, and a range agreed from their values would make the quantiser depend on
    the data. Non-private channels (``epsilon = inf``, charged as such) are the one exception (see
    :func:`announced_half_width`)."""
    for c in channels:
        if c.private and c.coordinate_bound is None:
            raise ConfigurationError(
                f"channel {c.name!r} has no public coordinate bound, so secure aggregation could only size its "
                "quantisation range from the clients' values, which would reveal them; declare a public "
                f"value_bound for channel {c.name!r} (e.g. from a public record cap or a norm clip; for a DP-SGD-"
                "trained upload, the algorithm option update_bound: dpsgd_fedavg's clips its change to [-B, B]), or "
                "run without secure aggregation")


def quantisation_half_width(channel: Channel, weights: Sequence[float], local_noise_stds: Sequence[float]) -> float:
    """The half-width of a channel's quantisation range from public facts: its coordinate bound, the largest public
    weight and the largest local noise std (8 standard deviations of headroom)."""
    bound = channel.coordinate_bound
    if bound is None:
        check_secure_channels([channel])
        raise ConfigurationError(f"channel {channel.name!r} has no public coordinate bound; declare a value_bound")
    return max(weights) * (bound + 8.0 * max(local_noise_stds))


_MAX_HALF_WIDTH = 2.0 ** 1022  # the range [-h, h] must have a finite float64 width 2h


def _range(channel: Channel, releases: Sequence[Release]) -> float:
    """The half-width a round's ``releases`` of ``channel`` are quantised into (what :func:`channel_encodings`
    fixes): from public facts for a private channel (its bound, the releases' public weights and the plan's local
    noise std), refused without a public bound; the clients' announcements for a non-private one."""
    if channel.private:
        return quantisation_half_width(channel, [r.weight for r in releases], [r.local_noise_std for r in releases])
    return max(announced_half_width(channel, r) for r in releases)


def public_weight_bound(privacy, public) -> float | None:
    """The largest release weight of any client of a private run, from public facts only
    (``privfl.core.public.release_weight``): the largest declared record count when sizes are public at record level,
    else 1. ``None`` for a non-private run, whose weights are true record counts."""
    if not privacy.private:
        return None
    if public.sizes_public and privacy.unit == "example":
        return float(max(public.client_sizes))
    return 1.0


def announced_half_width(channel: Channel, release: Release) -> float:
    """A non-private client's announcement of the range its value needs: its weight times the channel's bound, or
    the smallest power of two above its largest |weight * value|.

    Only for non-private channels, whose values the run releases without any guarantee (charged ``epsilon = inf``):
    the announcement is a function of such a value. A private channel's range is public (:func:`channel_encodings`).
    Raises :class:`ProtocolAbort` for a value too large to quantise (nothing of the round is revealed)."""
    if channel.private:
        raise ConfigurationError(f"channel {channel.name!r} is private: its quantisation range must come from public "
                                 f"facts, never from its values")
    if channel.coordinate_bound is not None:
        return float(release.weight) * channel.coordinate_bound
    with np.errstate(over="ignore", invalid="ignore"):
        peak = float(np.abs(np.multiply(release.weight, release.value, dtype=np.float64)).max(initial=0.0))
    if not peak <= _MAX_HALF_WIDTH:  # also catches inf and nan
        raise ProtocolAbort(f"channel {channel.name!r}: a weighted contribution of magnitude {peak:.4g} cannot be "
                            f"quantised (the limit is 2^1022); nothing of this round is revealed. Clip the channel "
                            f"(declare a clip or a value_bound) or lower its weights", party=release.client_id)
    return 2.0 ** math.ceil(math.log2(max(peak, 1e-12))) if peak > 0 else 1.0


@dataclass(frozen=True)
class ChannelEncoding:
    """How every client of a round encodes one channel for the masked sum: the same for all of them, fixed before
    any value is seen. ``noise_sigma``: std (integer units) of the discrete-Gaussian share each client adds
    (distributed noise), 0 without; ``min_inputs``: the survivor floor the channel's noise was charged for."""

    channel: str
    shape: tuple[int, ...]
    quantiser: Quantiser
    noise_sigma: float = 0.0
    min_inputs: int | None = None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def noise_std(self, n_summed: int) -> float:
        """Std of the summed discrete-Gaussian shares of ``n_summed`` clients, per coordinate, in real units."""
        return self.noise_sigma * math.sqrt(n_summed) * self.quantiser.step


def local_noise_stds(channels: Sequence[Channel], placement: str,
                     noise_multipliers: Mapping[str, float] | None) -> dict[str, float]:
    """The std of the noise each client adds to each channel before quantising: the plan's, a public fact."""
    out = {}
    for c in channels:
        noised = (placement == "local" and noise_multipliers is not None and c.name in noise_multipliers
                  and not isinstance(c.clip, TrainedPrivately))
        out[c.name] = float(noise_multipliers[c.name]) * c.sensitivity if noised else 0.0
    return out


def channel_encodings(channels: Sequence[Channel], config: SecureAggregation, *, n_clients: int,
                      local_stds: Mapping[str, float], weight_bound: float | None,
                      distributed: Mapping[str, DistributedNoise] | None = None,
                      announced: Mapping[str, float] | None = None) -> dict[str, ChannelEncoding]:
    """Each channel's encoding, in the order of ``channels``: the distributed-noise plan's quantiser where there is
    one, else the range ``weight_bound * (bound + 8 local std)`` of public facts, sized so ``n_clients`` inputs
    cannot wrap. ``announced``: the largest :func:`announced_half_width` of a round's clients, for non-private
    channels only (``weight_bound`` is then None). A channel without a public range is refused
    (:class:`ConfigurationError` naming it)."""
    out = {}
    for c in channels:
        plan = (distributed or {}).get(c.name)
        if plan is not None:
            if weight_bound is not None and weight_bound != 1.0:
                raise ConfigurationError("distributed noise needs unit release weights (the sensitivity assumes them)")
            out[c.name] = ChannelEncoding(c.name, c.shape, plan.quantiser, plan.local_sigma,
                                          max(plan.n_min, config.min_survivors or 0))
            continue
        if c.private or c.coordinate_bound is not None and weight_bound is not None:
            check_secure_channels([c])
            if weight_bound is None:
                raise ConfigurationError(f"channel {c.name!r}: a private channel needs public release weights")
            half = quantisation_half_width(c, [weight_bound], [local_stds.get(c.name, 0.0)])
        elif announced is not None and c.name in announced:
            half = float(announced[c.name])
        else:
            raise ConfigurationError(f"channel {c.name!r} has no public quantisation range; declare a value_bound "
                                     f"for it or run without secure aggregation")
        if not (math.isfinite(half) and 0 < half <= _MAX_HALF_WIDTH):
            raise ConfigurationError(f"channel {c.name!r}: the quantisation half-width {half:.4g} is not in (0, "
                                     f"2^1022]; declare a smaller coordinate bound or weights")
        try:
            quantiser = Quantiser(low=-half, high=half, bits=config.bits, n_clients=n_clients)
        except ValueError as exc:
            raise ConfigurationError(f"secure aggregation, channel {c.name!r}: {exc} (--secagg-bits)") from exc
        out[c.name] = ChannelEncoding(c.name, c.shape, quantiser, 0.0, config.min_survivors)
    return out


def round_min_inputs(encodings: Mapping[str, ChannelEncoding]) -> int | None:
    """The survivor floor of a round: the largest of its channels'."""
    floors = [e.min_inputs for e in encodings.values() if e.min_inputs]
    return max(floors) if floors else None


# -- what a client binds its session to ------------------------------------------------------------------------

#: the label of :func:`secure_context` (its version: a change of what is bound changes it)
SECURE_CONTEXT_LABEL = b"privfl/secure-context/v1"


def _canonical(value):
    """A JSON-able form of ``value`` in which every float is exact (``float.hex``) and numpy scalars are plain."""
    if isinstance(value, (bool, type(None), str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value).hex()
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    raise TypeError(f"cannot bind a {type(value).__name__} into a secure-aggregation context")


def secure_context(run_id: str, round: int, encodings: Mapping[str, ChannelEncoding], *, phase: str | None = None,
                   distributed: Mapping[str, DistributedNoise] | None = None) -> bytes:
    """The context a client binds its secure-aggregation session to (``secure_agg.ClientSession(context=...)``):
    SHA-256 over the ledger run it charged (``run_id``: a phase's ledger run in a multi-phase run), the ``phase``, the
    ``round``, and its encodings of the round, channel by channel in order: name, shape, quantiser (low, high, step,
    bits, clients, headroom), discrete-Gaussian share std, survivor floor, and the distributed-noise plan it was
    charged under (noise multiplier, n_min, n_max, honest shares, corruption, the charged event).

    Each client computes it from what it holds itself (its own plan and the ledger rows it charged), never from a
    server message; the honest clients of one run, phase and round compute the same bytes, and the protocol makes a
    client count a peer's keys only when the peer bound the same (``secure_agg.protocol.session_binding``). So a
    server that puts clients of two runs (say one whose noise shares are sized for 30 rounds and one sized for 10),
    two phases or two rounds into one session gets every client to abort at the first tag check, before any share
    or masked input leaves: the sum a victim's ledger charged for (``honest`` shares of *its* sigma) is the only sum
    it takes part in."""
    channels = []
    for name, enc in encodings.items():
        q = enc.quantiser
        plan = (distributed or {}).get(name)
        channels.append({
            "channel": name, "shape": list(enc.shape),
            "quantiser": {"low": q.low, "high": q.high, "step": q.step, "bits": q.bits, "n_clients": q.n_clients,
                          "noise_headroom": q.noise_headroom},
            "noise_sigma": float(enc.noise_sigma), "min_inputs": enc.min_inputs,
            "plan": None if plan is None else {
                "noise_multiplier": plan.noise_multiplier, "local_sigma": plan.local_sigma, "n_min": plan.n_min,
                "n_max": plan.n_max, "honest": plan.honest, "corruption": plan.corruption,
                "event": plan.event.to_dict()}})
    body = {"run": str(run_id), "phase": None if phase is None else str(phase), "round": int(round),
            "channels": channels}
    text = json.dumps(_canonical(body), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(SECURE_CONTEXT_LABEL + b"\0" + text.encode("utf-8")).digest()


def release_run(release: Release) -> str | None:
    """The ledger run a release was charged in, read off its ledger row id (``<run>/<client>/<round>/<channel>``);
    None for a release not made by a ledger (a hand-built one)."""
    suffix = f"/{release.client_id}/{release.round}/{release.channel}"
    rid = str(release.release_id)
    return rid[:-len(suffix)] if rid.endswith(suffix) and len(rid) > len(suffix) else None


def client_secure_context(releases: Mapping[str, Release], encodings: Mapping[str, ChannelEncoding], *,
                          phase: str | None = None,
                          distributed: Mapping[str, DistributedNoise] | None = None) -> bytes:
    """:func:`secure_context` from one client's own releases of the round: the run and round its ledger charged
    (the same for every channel, or the round is refused)."""
    runs = {release_run(r) for r in releases.values()}
    rounds = {int(r.round) for r in releases.values()}
    if len(runs) != 1 or len(rounds) != 1:
        raise ProtocolAbort(f"one client's releases of one secure sum name runs {sorted(map(str, runs))} and rounds "
                            f"{sorted(rounds)}; the round is aborted", party=next(iter(releases.values())).client_id
                            if releases else None)
    run = runs.pop()
    return secure_context("" if run is None else run, rounds.pop(), encodings, phase=phase, distributed=distributed)


# -- the client's step and the server's step ---------------------------------------------------------------------

def encode_for_secure_sum(releases: Mapping[str, Release], encodings: Mapping[str, ChannelEncoding],
                          rng: np.random.Generator, *, secure_noise: bool) -> np.ndarray:
    """The client's encoding of its round's releases: one vector of words mod 2^bits, the channels in the order of
    ``encodings``. Each value is scaled by its public weight, clipped into the public range (a per-coordinate
    contraction: the declared sensitivity still holds), stochastically rounded and, with distributed noise, given
    the client's discrete-Gaussian share. The coins and shares come from the client's own generator ``rng`` (or the
    OS CSPRNG when ``secure_noise``): the result depends on this client's releases, its generator and public facts
    only. The words then go into the client's ``secure_agg.ClientSession``."""
    coins = private_rng(rng, secure_noise)
    parts = []
    for name, enc in encodings.items():
        if name not in releases:
            raise ConfigurationError(f"no release of channel {name!r} to encode")
        r, q = releases[name], enc.quantiser
        contribution = np.clip(np.multiply(r.weight, r.value, dtype=np.float64).ravel(), q.low, q.high)
        ints = q.to_integers(contribution, coins)
        if enc.noise_sigma > 0:
            ints = ints + (sample_discrete_gaussian(enc.noise_sigma, ints.shape, secure=True) if secure_noise
                           else sample_discrete_gaussian(enc.noise_sigma, ints.shape, rng=coins))
        parts.append(q.encode(ints))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


def decode_secure_sum(total: np.ndarray, encodings: Mapping[str, ChannelEncoding], channels: Mapping[str, Channel],
                      included: Sequence[Mapping[str, Release]],
                      noise: NoiseSource | np.random.Generator | int | str = 0) -> dict[str, Aggregate]:
    """The server's step: the unmasked modular sum of the ``included`` clients' words back to one
    :class:`Aggregate` per channel. ``included``: what each summed client declared in the clear, per channel (its
    public weight and the plan's noise levels; values are not read). Central noise is added here (placement
    ``central``: a trusted aggregator)."""
    source = as_noise_source(noise)
    total = np.asarray(total)
    if total.shape != (sum(e.size for e in encodings.values()),):
        raise ProtocolAbort(f"the unmasked sum has shape {total.shape}, not the round's encodings'", party="server")
    n = len(included)
    out, offset = {}, 0
    for name, enc in encodings.items():
        words = total[offset:offset + enc.size]
        offset += enc.size
        value = enc.quantiser.decode_sum(words, n).reshape(enc.shape)
        headers = [rs[name] for rs in included]
        weights = np.array([h.weight for h in headers], dtype=np.float64)
        centrals = {h.central_noise_std for h in headers}
        if len(centrals) > 1:
            raise ProtocolAbort(f"channel {name!r}: the clients declare different central noise levels",
                                party="server")
        central = centrals.pop() * float(weights.max()) if centrals else 0.0
        channel = channels[name]
        if channel.symmetric and value.ndim == 2:
            # each client rounded both triangles on coins of their own: release the upper one mirrored (as the
            # pipeline does), or upper minus lower (two roundings of one value) would carry its fraction unnoised
            value = np.triu(value) + np.triu(value, 1).T
        if central > 0:
            # Each client's clipped value was rounded stochastically before the sum, unnoised: coupled on the same
            # coins, two neighbouring values round at most one step apart per coordinate, so the rounded sum's
            # sensitivity (or radius) is the channel's (times the public weight) plus step sqrt(size). The noise is
            # raised by that ratio, so its multiplier, which is all the charged Gaussian (sampled or not) depends on,
            # holds.
            # a sum over Poisson-sampled records under replace-one is accounted at radius = displacement / 2 (the
            # sampled record's term around the rest), so the rounding is measured against that radius (a review)
            radius = float(channel.sensitivity) / (2.0 if channel.record_sampled and channel.adjacency == "replace_one"
                                                   else 1.0)
            base = radius * float(weights.max())
            if base > 0:
                central *= 1.0 + enc.quantiser.step * math.sqrt(enc.size) / base
            value = value + gaussian_noise(value.shape, central, source, channel.symmetric)
        local_var = float(np.sum(weights ** 2 * np.array([h.local_noise_std ** 2 for h in headers])))
        local_var += enc.noise_std(n) ** 2
        out[name] = Aggregate(name, value, float(weights.sum()), n, float(np.sqrt(local_var + central ** 2)))
    return out


def _client_order(client_id: str):
    return (0, int(client_id), "") if client_id.isdigit() else (1, 0, client_id)


def secure_weighted_sums(releases: Sequence[Release], channels: Mapping[str, Channel], config: SecureAggregation,
                         rng: np.random.Generator, noise: NoiseSource | np.random.Generator | int | str = 0,
                         distributed: Mapping[str, DistributedNoise] | None = None, *,
                         secure_noise: bool = False, client_rngs: Mapping[str, np.random.Generator] | None = None,
                         weight_bound: float | None = None, n_clients: int | None = None,
                         local_stds: Mapping[str, float] | None = None,
                         on_masked_input: Callable[[list[str]], None] | None = None,
                         phase: str | None = None) -> dict[str, Aggregate]:
    """Like :func:`privfl.core.aggregation.weighted_sums`, through the secure-aggregation protocol, in process: each client
    encodes its releases (:func:`encode_for_secure_sum`, with its own generator ``client_rngs[client_id]``) and
    takes part in ``secure_agg.run_round`` (one masked vector per client, all channels); the server unmasks the sum
    and decodes it (:func:`decode_secure_sum`). The same steps as a deployment's (``privfl.flower.app``).

    Public facts: ``weight_bound`` (:func:`public_weight_bound`; default: the largest declared weight of the round,
    which in a private run is a public constant), ``n_clients`` the inputs the ranges are sized for (default: the
    round's clients), ``local_stds`` each channel's local noise std (default: the releases' declared ones). A private
    channel without a public coordinate bound is refused; non-private channels without one use the clients'
    announcements (:func:`announced_half_width`). ``rng`` decides the simulated dropouts only (``config.dropout``).
    Without ``client_rngs`` (direct calls, tests) each client's generator is a child of ``rng`` in client order.
    ``on_masked_input(client_ids)`` is called just before the masked inputs of ``client_ids`` (the clients that do
    not drop) are handed to the protocol: where a deployment's client marks its ledger rows released.
    Each client binds its session to the context it computes from its own releases (the ledger run and round they
    were charged in), the round's encodings and the distributed-noise plans (:func:`client_secure_context`;
    ``phase``: the phase's name in a multi-phase run), as a deployment's clients do; the server expects the same
    (releases of different runs or rounds in one sum abort the round).
    A round that cannot be aggregated safely raises :class:`secure_agg.ProtocolAbort`.
    """
    by_client: dict[str, dict[str, Release]] = {}
    for r in releases:
        by_client.setdefault(r.client_id, {})[r.channel] = r
    clients = sorted(by_client, key=_client_order)
    order = [channels[name] for name in channels if any(name in rs for rs in by_client.values())]
    if not clients:
        return {}
    if weight_bound is None and any(c.private for c in order):
        weight_bound = max(r.weight for r in releases)
    if local_stds is None:
        local_stds = {c.name: max(rs[c.name].local_noise_std for rs in by_client.values()) for c in order}
    announced = {c.name: max(announced_half_width(c, rs[c.name]) for rs in by_client.values())
                 for c in order if not c.private and (weight_bound is None or c.coordinate_bound is None)}
    encodings = channel_encodings(order, config, n_clients=n_clients or len(clients), local_stds=local_stds,
                                  weight_bound=weight_bound, distributed=distributed, announced=announced)
    min_inputs = round_min_inputs(encodings)
    need = max(2, min_inputs or 0)
    if len(clients) < need:  # e.g. a sampled round with one client: abort the round, reveal nothing
        flag = " (--min-survivors)" if min_inputs and min_inputs > 1 else ""
        raise ProtocolAbort(f"only {len(clients)} client(s) in this round, secure aggregation needs at least {need}"
                            f"{flag}; the round is aborted", party="server")
    if client_rngs is None:
        client_rngs = {cid: np.random.default_rng(rng.integers(0, 2 ** 63 - 1)) for cid in clients}
    contexts = {cid: client_secure_context(by_client[cid], encodings, phase=phase, distributed=distributed)
                for cid in clients}
    if len(set(contexts.values())) != 1:  # in process every client runs one plan: a mix is a caller's error
        raise ProtocolAbort("the round's releases belong to different runs, phases or rounds; one secure sum holds "
                            "one round of one run: the round is aborted", party="server")
    words = {cid: encode_for_secure_sum(by_client[cid], encodings, client_rngs[cid], secure_noise=secure_noise)
             for cid in clients}
    from privfl.secure_agg.params import fraction_count

    n_drop = fraction_count(config.dropout, len(clients))
    dropped = set(rng.choice(clients, size=n_drop, replace=False).tolist()) if n_drop else set()
    if on_masked_input is not None:
        on_masked_input([cid for cid in clients if cid not in dropped])
    try:
        result = run_round(words, bits=config.bits, min_inputs=min_inputs,
                           drop_at={"masked_input": dropped} if dropped else None,
                           malicious=config.malicious, dropout=config.dropout, corruption=config.corruption,
                           context=next(iter(contexts.values())), contexts=contexts)
    except ParameterError as exc:  # e.g. a sampled round too small for the declared dropout: abort the round
        raise ProtocolAbort(f"{len(clients)} clients cannot be aggregated safely under the declared threat model "
                            f"({exc})", party="server") from exc
    included = [by_client[cid] for cid in clients if cid in set(result.included)]
    return decode_secure_sum(result.sum, encodings, channels, included, noise)
