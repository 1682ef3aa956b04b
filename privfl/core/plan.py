"""The run plan: every seed stream and noise level of a run, computed once from public inputs.

A :class:`RunPlan` is built from the algorithm's channels, the privacy configuration, the federation's public facts
and the secure-aggregation configuration, and from nothing else: no client's data. It holds the channels as they
are charged (``privfl.core.channels.charged_channels``), the placement, each channel's noise multiplier or distributed
noise plan, and the seed streams. Every runtime builds its release pipelines from it (the in-process
:class:`privfl.runtime.engine.Simulation`, and each client of a Flower deployment, which rebuilds the same plan from the
same public specification and checks it against the server's), so the noise a client adds and the events its ledger
charges are what the plan says.

Seeds: one ``SeedSequence(seed)`` spawns five streams, in this order: setup (the algorithm's initial state), sample
(client sampling, only in a run seeded on purpose: a private run with secure noise samples from the CSPRNG,
``privfl.core.public.client_sampler``), server (the aggregator's noise), clients (stream ``k`` is client ``k``'s: its training generator
is that stream's first child, its noise source is drawn from the stream itself) and secure (secure aggregation: the
stream itself simulates dropouts in process; its child ``k`` is client ``k``'s encoding generator).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from privfl.accounting.events import PrivacyEvent
from privfl.core.channels import Channel, TrainedPrivately, amplifies, charged_channels, check_record_level_clips
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.errors import ConfigurationError
from privfl.core.public import PublicFacts
from privfl.core.release import ReleasePipeline

#: the seed streams spawned from ``SeedSequence(seed)``, in spawn order
STREAMS = ("setup", "sample", "server", "clients", "secure")


def seed_stream(seed: int, name: str, *key: int) -> np.random.SeedSequence:
    """The seed stream ``name`` (one of :data:`STREAMS`) of a run seeded ``seed``; ``key`` descends into it (client
    ``k`` of the ``clients`` stream: ``seed_stream(seed, "clients", k)``)."""
    if name not in STREAMS:
        raise ValueError(f"seed stream must be one of {STREAMS}, got {name!r}")
    return np.random.SeedSequence(int(seed), spawn_key=(STREAMS.index(name), *map(int, key)))


#: why client sampling does not amplify a run under secure aggregation (refused up front, every entry point)
SECURE_AMPLIFIED = (
    "client sampling amplifies client-level privacy only when whether a round is published does not depend on who "
    "was sampled; under secure aggregation a round aborts when fewer clients than its survivor floor take part, so "
    "one client's participation can decide whether the others' sum is published. Use sampling_rate=1 "
    "(--sampling-rate 1) with secure aggregation, or central noise without secure aggregation")


def noise_multipliers_for(channels, privacy: PrivacyConfig, rounds: int) -> dict[str, float] | None:
    """Calibrate one noise multiplier per noised private channel so each client's composition over ``rounds`` meets
    (epsilon, delta) under the run's accountant, splitting the budget by the channels' shares. Client sampling
    amplifies client-level guarantees under central noise only (``ReleasePipeline``); channels that are sums over
    Poisson-sampled records (:func:`record_sampling_rate`) are calibrated as sampled Gaussians at the record rate;
    any other run is calibrated as if its client released every round. ``{}`` when every private channel is trained privately (DP-SGD calibrates
    its own noise); ``None`` for a non-private run."""
    from privfl.accounting.calibration import calibrate

    if not privacy.private:
        return None
    private = [c for c in channels if c.private]
    shares = {c.name: c.budget_share for c in private}
    if not shares or all(isinstance(c.clip, TrainedPrivately) for c in private):
        return {}
    q = privacy.sampling_rate if amplifies(privacy.sampling_rate, privacy.unit, privacy.placement) else 1.0
    rate = record_sampling_rate(channels, privacy)
    if rate < 1:  # sums over Poisson-sampled records: every round is a sampled Gaussian at the record rate
        q = rate
    kwargs = {}
    if q < 1:
        relations = {c.adjacency for c in private}
        if len(relations) != 1:
            raise ConfigurationError(f"client sampling composes one neighbouring relation; the channels declare "
                                     f"{sorted(relations)}")
        kwargs["relation"] = relations.pop()
    cal = calibrate(privacy.epsilon, privacy.delta, charged_rounds(channels, rounds), sampling_rate=q,
                    channels=shares, accountant=privacy.resolved_accountant, **kwargs)
    return dict(cal.noise_multipliers)


def record_bands(channels) -> int:
    """The one band count b of a run's noised channels (``Channel.record_bands``; 1: independent noise every round).
    Channels released on one lot share its groups, so they must declare one b."""
    bands = {c.record_bands for c in channels if c.private and not isinstance(c.clip, TrainedPrivately)}
    if len(bands) > 1:
        raise ConfigurationError(f"the noised channels declare different bands {sorted(bands)}; a round's channels "
                                 "share one lot, so they must declare one")
    return bands.pop() if bands else 1


def charged_rounds(channels, rounds: int) -> int:
    """How many events a run of ``rounds`` rounds charges each client: one per round, or one per block of b rounds
    with banded channels (``Channel.record_bands``): ceil(rounds / b)."""
    return -(-int(rounds) // record_bands(channels))


def record_sampling_rate(channels, privacy: PrivacyConfig) -> float:
    """The one Poisson record-sampling rate q of a run whose noised channels are sums over sampled records
    (``Channel.record_sampling_rate``, e.g. DP-FedSGD's clipped gradient sums), 1.0 when none is. Every noised
    private channel must declare the same q (they are released on one sample of records, so a round is one
    sampled event, the event calibration composes), and client sampling must not amplify the same rounds."""
    noised = [c for c in channels if c.private and not isinstance(c.clip, TrainedPrivately)]
    rates = {c.record_sampling_rate for c in noised}
    if not any(rate < 1 for rate in rates):
        return 1.0
    if len(rates) != 1:
        raise ConfigurationError(f"the noised channels sample records at different rates {sorted(rates)}; a round "
                                 "is one Poisson sample of records, so they must declare one rate")
    if amplifies(privacy.sampling_rate, privacy.unit, privacy.placement):
        raise ConfigurationError("record sampling and amplifying client sampling cannot be composed into one event; "
                                 "set sampling_rate=1")
    return rates.pop()


def _calibrate_distributed_sampled(channels, privacy: PrivacyConfig, rounds: int, n_clients: int, secure):
    """Distributed noise for channels that are sums over Poisson-sampled records: each client's discrete-Gaussian
    share under secure aggregation, the round charged as the Poisson-sampled Gaussian the honest shares' sum nearly
    is, with its total-variation term, and composed by the run's pld (or rdp) accountant
    (``privfl.privacy.secure.calibrate_distributed_sampled``)."""
    from privfl.privacy.secure import calibrate_distributed_sampled

    accountant = privacy.resolved_accountant
    if accountant not in ("pld", "rdp"):
        raise ConfigurationError(f"distributed noise on sampled records is a Poisson-sampled Gaussian (up to a tiny "
                                 f"total variation), which the {accountant!r} accountant cannot compose; set "
                                 "accountant='pld' (CLI: --accountant pld) or 'rdp'")
    q = record_sampling_rate(channels, privacy)
    private = [c for c in channels if c.private]
    if len(private) != 1:
        raise ConfigurationError("distributed noise on sampled records is planned for one private channel; got "
                                 f"{[c.name for c in private]}")
    c = private[0]
    if c.coordinate_bound is None or len(c.shape) != 1:
        raise ConfigurationError(f"channel {c.name}: distributed noise needs a vector channel with a public "
                                 "coordinate bound")
    if c.adjacency != "add_remove":
        raise ConfigurationError("distributed noise on sampled records is planned under add/remove adjacency; use "
                                 "adjacency='add_remove' or placement 'central'")
    plan = calibrate_distributed_sampled(privacy.epsilon, privacy.delta, charged_rounds(channels, rounds), q,
                                         c.coordinate_bound, c.shape[0], c.clip.bound, n_clients, secure,
                                         accountant=accountant, bands=c.record_bands)
    return {c.name: plan}


@dataclass(frozen=True)
class RunPlan:
    """See the module docstring. Build with :meth:`build`."""

    seed: int
    n_clients: int
    rounds: int
    channels: tuple[Channel, ...]
    #: ``local`` (each client noises its release), ``central`` (the aggregator noises the sum) or ``distributed``
    #: (each client adds a discrete-Gaussian share under secure aggregation)
    placement: str
    #: channel -> noise std / sensitivity (None: a non-private run; {}: only DP-SGD-trained channels)
    noise_multipliers: Mapping[str, float] | None
    sampling_rate: float
    unit: str
    #: channel -> the distributed-noise plan (``privfl.privacy.secure.DistributedNoise``) when ``placement == "distributed"``
    distributed: Mapping[str, object] | None = None
    #: client -> channel -> the event a DP-SGD-trained channel charges per round (the algorithm's own calibration)
    trained_events: Mapping[int, Mapping[str, PrivacyEvent]] = field(default_factory=dict)

    @classmethod
    def build(cls, algorithm, privacy: PrivacyConfig, fed: FederationConfig, public: PublicFacts,
              secure=None) -> "RunPlan":
        """The plan of ``algorithm`` (already set up from ``public``) under ``privacy``, ``fed.rounds`` rounds and
        the optional secure aggregation ``secure`` (a :class:`privfl.privacy.secure.SecureAggregation`)."""
        from privfl.privacy.secure import calibrate_distributed, check_secure_channels

        n_clients = public.n_clients
        channels = charged_channels(algorithm.channels(), privacy, secure is not None)
        check_record_level_clips(channels, privacy)
        if secure is not None:
            check_secure_channels(channels)
            secure.check(n_clients)
            if privacy.private and amplifies(privacy.sampling_rate, privacy.unit, privacy.placement):
                raise ConfigurationError(SECURE_AMPLIFIED)
        distributed = None
        if privacy.placement == "distributed" and privacy.private:
            if secure is None:
                raise ConfigurationError("distributed noise is added by the clients under secure aggregation; turn "
                                         "secure aggregation on (--secure-agg) or choose local/central placement")
            trained = sorted(c.name for c in channels if c.private and isinstance(c.clip, TrainedPrivately))
            if trained:  # their noise is each client's own DP-SGD noise, drawn inside training: none to share out
                raise ConfigurationError(f"{algorithm.name}: the channels {trained} are trained with DP-SGD, whose "
                                         "noise each client draws inside its own training; there is no sum to noise "
                                         "once, so placement 'distributed' does not apply: choose placement 'local' "
                                         "(with secure aggregation if you like) or 'central' (--placement)")
            if record_sampling_rate(channels, privacy) < 1:
                distributed = _calibrate_distributed_sampled(channels, privacy, fed.rounds, n_clients, secure)
            else:
                if record_bands(channels) > 1:
                    raise ConfigurationError("banded noise under secure aggregation is planned for sums over "
                                             "Poisson-sampled records; lower the bands until bands x the sampling "
                                             "rate is below 1, or choose placement 'central'")
                distributed = calibrate_distributed(channels, privacy.epsilon, privacy.delta, fed.rounds, n_clients,
                                                    secure, accountant=privacy.resolved_accountant)
            multipliers = {name: p.noise_multiplier for name, p in distributed.items()}
            placement = "distributed"
        else:
            multipliers = noise_multipliers_for(channels, privacy, fed.rounds)
            placement = "local" if privacy.placement == "local" else "central"
        trained = {}
        trained_channels = [c.name for c in channels if isinstance(c.clip, TrainedPrivately)]
        if privacy.private and trained_channels:
            trained = {k: dict(algorithm.planned_events(k)) for k in range(n_clients)}
            missing = sorted({c for k in trained for c in trained_channels if c not in trained[k]})
            if missing:
                raise ConfigurationError(f"{algorithm.name}: the DP-SGD-trained channel(s) {missing} have no planned "
                                         "event (FederatedAlgorithm.planned_events): the run plan must fix what "
                                         "every release charges before any client trains")
        return cls(int(fed.seed), n_clients, int(fed.rounds), tuple(channels), placement, multipliers,
                   float(privacy.sampling_rate), privacy.unit, distributed, trained)

    # -- seeds ------------------------------------------------------------------------------------------------------

    def stream(self, name: str) -> np.random.SeedSequence:
        """The seed stream ``name`` (one of :data:`STREAMS`)."""
        return seed_stream(self.seed, name)

    def client_stream(self, client: int) -> np.random.SeedSequence:
        """Client ``client``'s stream (it does not depend on the number of clients)."""
        return seed_stream(self.seed, "clients", client)

    def train_rng(self, client: int) -> np.random.Generator:
        """Client ``client``'s training generator at the start of the run."""
        return np.random.default_rng(self.client_stream(client).spawn(1)[0])

    def secure_rng(self, client: int) -> np.random.Generator:
        """Client ``client``'s generator for its secure-aggregation encoding (rounding coins, discrete-Gaussian
        shares): its own child of the ``secure`` stream, held by the client."""
        return np.random.default_rng(seed_stream(self.seed, "secure", client))

    # -- pipelines and events ---------------------------------------------------------------------------------------

    @property
    def amplified(self) -> bool:
        """Whether client sampling amplifies this run (``privfl.core.channels.amplifies``): every member's round is then
        charged, sampled or not."""
        return amplifies(self.sampling_rate, self.unit, self.placement)

    @property
    def trust(self) -> str:
        """The trust assumption every charge of this run holds under, as the ledger records it (``meta["trust"]``)
        and ``privfl audit`` shows it."""
        if self.noise_multipliers is None:
            return "none: a non-private run (every release is charged as non-private)"
        private = [c for c in self.channels if c.private]
        if self.placement == "distributed":
            text = "; ".join(sorted({p.trust for p in (self.distributed or {}).values()}))
        elif self.placement == "local" or all(isinstance(c.clip, TrainedPrivately) for c in private):
            text = ("local: each client adds its noise (or trains by DP-SGD) before anything leaves it; holds against "
                    "the server and every other client")
        elif any(isinstance(c.clip, TrainedPrivately) for c in private):
            text = ("central and local: DP-SGD-trained channels are noised in the client; the other channels' noise "
                    "is added by the aggregator to the sum, which holds only if the aggregator is trusted")
        else:
            text = ("central: the aggregator adds the noise to the sum; holds only if the aggregator is trusted (it "
                    "sees the clients' clipped releases)")
        if self.amplified:
            text += ("; amplified by client sampling, which holds only while the sample stays secret from the "
                     "adversary (drawn from the CSPRNG)")
        return text

    @property
    def distributed_events(self) -> dict[str, PrivacyEvent] | None:
        if self.distributed is None:
            return None
        return {name: p.event for name, p in self.distributed.items()}

    def pipeline(self, client: int, ledger, noise) -> ReleasePipeline:
        """Client ``client``'s release pipeline, charging ``ledger`` and drawing noise from ``noise``."""
        return ReleasePipeline(str(client), self.channels, ledger, self.noise_multipliers, placement=self.placement,
                               sampling_rate=self.sampling_rate, noise=noise,
                               distributed_events=self.distributed_events, privacy_unit=self.unit)

    def round_events(self, client: int) -> dict[str, PrivacyEvent] | None:
        """The events a release of client ``client`` charges in one round, channel by channel, as the plan fixes
        them (a non-private run: every channel charged as non-private); None if a DP-SGD-trained channel's event
        is not planned by the algorithm."""
        from privfl.accounting.ledger import PrivacyLedger

        pipe = self.pipeline(client, PrivacyLedger(":memory:", "plan"), 0)
        trained = self.trained_events.get(int(client), {})
        events = {}
        for c in self.channels:
            if isinstance(c.clip, TrainedPrivately) and self.noise_multipliers is not None:
                if c.name not in trained:
                    return None
                events[c.name] = trained[c.name]
            else:
                events[c.name] = pipe.event_for(c.name)  # a banded channel: its block's event
        return events


__all__ = ["RunPlan", "STREAMS", "charged_rounds", "noise_multipliers_for", "record_bands", "record_sampling_rate",
           "seed_stream"]
