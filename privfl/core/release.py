"""The release pipeline: the only way a value leaves a client.

For each round, in this order (ARCHITECTURE.md, "the path of one value"):

1. **validate** every channel value: finite, of the declared shape, else :class:`InvalidRelease` and nothing released;
   except that a private round whose local result is not finite releases its data-independent fallback instead
   (:func:`fallback_value`: no change), charged and noised as usual, and says so only in a
   :class:`LocalResultNotFinite` warning on the client's side: whether training failed on a client's records must
   not reach the server as an error it is not charged for (a private local step that raised, rather than returned a
   non-finite value, is handled alike by the runtime: :meth:`ReleasePipeline.failed_step_values`,
   :class:`LocalStepFailed`);
2. **clip**: the channel's clip makes its declared sensitivity true;
3. **charge** the ledger for all the round's channels in one committed transaction; if the client's budget would be
   exceeded, :class:`PrivacyBudgetExceeded` is raised, nothing is charged or released, the client sits the round out;
4. **noise**: Gaussian noise of std ``noise_multiplier * sensitivity`` (``local`` placement), or the std the server must
   add to the sum (``central`` placement: a trusted aggregator), or nothing yet (``distributed``: each client adds a
   discrete Gaussian share after quantisation, in ``privfl.privacy.secure``; the ledger is charged the distributed event);
5. (optional, ``privfl.privacy.secure``) quantise and mask for secure aggregation;
6. hand the server :class:`Release` objects; the ledger row is marked released.

Under secure aggregation across processes (``privfl.flower.app``) the value leaves the client only as its masked
input, a protocol stage after the charge: the pipeline then releases with ``mark=False`` and the client marks the
round's rows released (:meth:`ReleasePipeline.mark_round_released`) just before it sends that input. A client that
drops before then holds charges that are not marked released, never a release without its charge. The server sees,
per release, only its :class:`ReleaseHeader` in the clear.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from privfl.accounting.events import GaussianEvent, NonPrivateEvent, NoOpEvent, PoissonSampledEvent, PrivacyEvent
from privfl.accounting.ledger import ChargeRequest, PrivacyLedger
from privfl.mechanisms import GaussianMechanism, InvalidRelease, ReleaseMisuse, as_noise_source
from privfl.mechanisms.noise import NoiseSource
from privfl.core.channels import (Channel, ClippedValue, NormClip, PreClipped, PrivatizedValue, RangeBound,
                                  TrainedPrivately, amplifies)
from privfl.errors import DIVERGENCE_CAUSES

PLACEMENTS = ("local", "central", "distributed")


class LocalResultNotFinite(RuntimeWarning):
    """A client's local result was not finite (its training diverged on its records, or a server's broadcast made
    it), and its release pipeline released the data-independent fallback (:func:`fallback_value`) in its place,
    charged as usual. The warning stays on the client's side: the server sees an ordinary release."""


class LocalStepFailed(RuntimeWarning):
    """A private client's local step raised an exception (its training failed on its records: an overflow, a
    factorisation of a matrix that stopped being positive definite), and its release pipeline released the
    data-independent fallback (:func:`planned_fallback`) for every channel in its place, charged and noised as usual,
    with the weight the algorithm would have sent (``FederatedAlgorithm.private_release_weight``). The warning names
    the exception's type and stays on the client's side: the server sees an ordinary release."""


def _raw(value):
    return value.value if isinstance(value, (ClippedValue, PrivatizedValue)) else value


def _not_finite(value) -> bool:
    """Whether ``value`` (an algorithm's channel value) holds a NaN or infinite entry."""
    try:
        arr = np.asarray(_raw(value), dtype=np.float64)
    except (TypeError, ValueError):
        return False
    return not bool(np.all(np.isfinite(arr)))


def fallback_value(channel: Channel, value):
    """What a private channel releases in place of a non-finite local result: a value of the channel's shape that
    depends on nothing of the client's (zeros: no change, no statistic; a probability channel's uniform rows),
    wrapped as the algorithm wrapped its own (a :class:`ClippedValue`'s bound and statistic, a
    :class:`PrivatizedValue`'s event), so the round is charged exactly as it would have been.

    Where the privacy unit is the whole value (client level: a client's value against its neighbour's, both in the
    clip's ball) the fallback is one more value in that ball, so the charge holds. A record-level statistic is a sum of
    per-record clipped terms: one record whose term is not finite (a gradient that overflowed) makes the whole sum
    fall back, a move larger than one record's bound. That case needs the term dropped where records are clipped:
    the vectorised per-example executors and HBFL's materialised steps do (``privfl.training.stacked.PerExampleTerms``,
    ``privfl.privacy.record_level.clipped_gradient_sum``: an example whose gradient or norm is not finite adds the
    zero term), so their sums stay finite, as does opacus's per-client loop (``dpsgd_train`` recomputes a step whose
    clipped sum is not finite example by example, dropping that example's term), and so do FOLA's record-level
    Fisher accumulators (``privfl.training.fisher``)."""
    filler = _filler(channel)
    if isinstance(value, ClippedValue):
        return ClippedValue(filler, value.bound, value.statistic)
    if isinstance(value, PrivatizedValue):
        return PrivatizedValue(filler, value.event)
    return filler


def _filler(channel: Channel) -> np.ndarray:
    """The data-independent value of a fallback: zeros (no change, no statistic), a probability channel's uniform
    rows."""
    if isinstance(channel.clip, RangeBound):
        return np.full(channel.shape, 1.0 / channel.shape[-1])
    return np.zeros(channel.shape)


def _wrapped(channel: Channel, filler: np.ndarray, event=None):
    """``filler`` as the value the channel's clip takes: a :class:`PreClipped` channel's :class:`ClippedValue` at its
    declared bound, a :class:`TrainedPrivately` channel's :class:`PrivatizedValue` with ``event`` (the run plan's
    planned event of the channel for this client, what its release would have charged), else the array itself."""
    if isinstance(channel.clip, PreClipped):
        return ClippedValue(filler, channel.clip.bound, channel.clip.statistic)
    if isinstance(channel.clip, TrainedPrivately):
        if event is None:
            raise ReleaseMisuse(f"channel {channel.name} is charged with its training's planned event; none was given")
        return PrivatizedValue(filler, event)
    return filler


def planned_fallback(channel: Channel, event=None):
    """What a private channel releases when the client's local step produced no value at all (it raised): the
    data-independent :func:`fallback_value` filler (zeros, a probability channel's uniform rows), wrapped as the
    channel's clip takes it, a DP-SGD-trained channel's with ``event``, the run plan's planned event of the channel
    (``RunPlan.trained_events``), so the round is charged exactly as the algorithm's own value would have been."""
    return _wrapped(channel, _filler(channel), event)


def removed_value(channel: Channel, event=None):
    """The release of a client-level channel by a client with no records: exact zeros, wrapped as the channel's
    clip takes them. At client level a neighbour is a client's whole data removed, and a removed client's
    contribution to every sum is zero: what the charged sensitivity assumes (a probability channel at client level
    takes an all-zero value for it, :class:`RangeBound`)."""
    return _wrapped(channel, np.zeros(channel.shape), event)


@dataclass(frozen=True)
class Release:
    """What the server receives for one channel of one client in one round.

    ``value`` already carries ``local_noise_std`` of noise; ``central_noise_std`` is the noise the aggregator must add
    to the sum of this channel (central placement), the same for every client of the round.
    """

    client_id: str
    round: int
    channel: str
    value: np.ndarray
    weight: float
    local_noise_std: float
    central_noise_std: float
    release_id: str

    @property
    def header(self) -> "ReleaseHeader":
        """Everything about this release but its value."""
        return ReleaseHeader(self.client_id, self.round, self.channel, self.weight, self.local_noise_std,
                             self.central_noise_std, self.release_id)


@dataclass(frozen=True)
class ReleaseHeader:
    """What a client declares in the clear about one release whose value goes into a secure sum: its public weight,
    the plan's noise levels and its ledger row; never the value."""

    client_id: str
    round: int
    channel: str
    weight: float
    local_noise_std: float
    central_noise_std: float
    release_id: str

    def to_dict(self) -> dict:
        return {"client_id": self.client_id, "round": self.round, "channel": self.channel, "weight": self.weight,
                "local_noise_std": self.local_noise_std, "central_noise_std": self.central_noise_std,
                "release_id": self.release_id}

    @classmethod
    def from_dict(cls, d) -> "ReleaseHeader":
        try:
            header = cls(str(d["client_id"]), int(d["round"]), str(d["channel"]), float(d["weight"]),
                         float(d["local_noise_std"]), float(d["central_noise_std"]), str(d["release_id"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRelease(f"a release header is malformed: {exc}") from None
        if not (math.isfinite(header.weight) and header.weight > 0 and math.isfinite(header.local_noise_std)
                and header.local_noise_std >= 0 and math.isfinite(header.central_noise_std)
                and header.central_noise_std >= 0):
            raise InvalidRelease(f"release header {header.release_id}: weight must be finite > 0 and noise levels "
                                 f"finite >= 0")
        return header


class ReleasePipeline:
    """One client's way out. Holds the client's channels, its noise multipliers, the ledger and the noise source.

    Args:
        client_id: the client this pipeline belongs to.
        channels: the channels the client's algorithm declares.
        ledger: where every release is charged before it is made.
        noise_multipliers: channel name -> noise std / sensitivity; ``None`` for a non-private run (every channel must
            then be :class:`privfl.core.channels.Unclipped`, and every release is charged as non-private).
        placement: ``local`` (the client adds the noise) or ``central`` (the aggregator adds it to the sum).
        sampling_rate: Poisson client-sampling rate q. Amplification by sampling needs an observer who cannot tell
            whether the client took part: client-level privacy (``privacy_unit="client"``) with ``central``
            placement, where the trusted aggregator publishes only the noised model. Each round's event is then a
            Poisson-sampled Gaussian under the channel's relation, charged every round, sampled or not. Otherwise
            sampling buys no amplification: at record level the output of a round that skips the client is not a
            neighbour's (its other records are missing too); with local or distributed noise the server sees who
            sent. A sampled round is then charged the plain Gaussian and a skipped round nothing.
        noise: a :class:`NoiseSource`, numpy Generator, int seed, or ``"secure"``.
        privacy_unit: the run's privacy unit (``PrivacyConfig.unit``).
    """

    def __init__(self, client_id: str, channels: Sequence[Channel], ledger: PrivacyLedger,
                 noise_multipliers: Mapping[str, float] | None, *, placement: str = "local",
                 sampling_rate: float = 1.0, noise: NoiseSource | np.random.Generator | int | str = 0,
                 distributed_events: Mapping[str, PrivacyEvent] | None = None, privacy_unit: str = "client"):
        self.client_id = str(client_id)
        self.channels = {c.name: c for c in channels}
        if len(self.channels) != len(channels):
            raise InvalidRelease(f"duplicate channel names in {[c.name for c in channels]}")
        if placement not in PLACEMENTS:
            raise InvalidRelease(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if placement == "distributed":
            if distributed_events is None or noise_multipliers is None:
                raise InvalidRelease("distributed placement needs the events of the planned distributed noise "
                                     "(privfl.privacy.secure.plan_distributed_noise) and a private run")
            if sampling_rate < 1.0:
                raise InvalidRelease("distributed noise with client sampling is not supported; use sampling_rate=1")
        if privacy_unit not in ("example", "client"):
            raise InvalidRelease(f"privacy_unit must be 'example' or 'client', got {privacy_unit!r}")
        self.privacy_unit = privacy_unit
        self.placement = placement
        self.distributed_events = dict(distributed_events or {})
        self.sampling_rate = float(sampling_rate)
        self.ledger = ledger
        self.noise = as_noise_source(noise)
        self.mechanisms: dict[str, GaussianMechanism | None] = {}
        for name, ch in self.channels.items():
            if noise_multipliers is None:
                if ch.private:
                    raise InvalidRelease(f"channel {name} is clipped for privacy but no noise multiplier was given")
                self.mechanisms[name] = None
                continue
            if not ch.private:
                raise InvalidRelease(f"channel {name} is unclipped; a private run needs a clip on every channel")
            if isinstance(ch.clip, TrainedPrivately):
                self.mechanisms[name] = None  # charged with the training's own event, no noise here
                continue
            if name not in noise_multipliers:
                raise InvalidRelease(f"no noise multiplier for channel {name}; calibrate one per channel")
            self.mechanisms[name] = GaussianMechanism(ch.sensitivity, noise_multipliers[name])
        # Whether a release draws noise on the client after its charge. If not, nothing between the charge and the
        # hand-over can fail, and a marked release writes its rows released (one statement per row, no mark after).
        self._noise_after_charge = placement == "local" and any(m is not None for m in self.mechanisms.values())
        self._buffers: dict[str, np.ndarray] = {}  # per channel: the float64 array the last release was made in
        self._fixed_requests: dict[tuple[bool, ...], list[ChargeRequest]] = {}  # see _requests
        self._opened: dict[str, int] = {}  # banded channel -> the last block this client's ledger holds a charge in

    def event_for(self, name: str, value: object = None, opens: bool = True) -> PrivacyEvent:
        """The event one release of channel ``name`` costs (the ledger charges exactly this). A banded channel
        (``Channel.record_bands``) is charged its block's event by the client's first release in a block of b
        rounds (``opens``, :meth:`opens_block`) and a no-op by its other releases in the block."""
        mech = self.mechanisms[name]
        if isinstance(self.channels[name].clip, TrainedPrivately):
            if not isinstance(value, PrivatizedValue):
                raise ReleaseMisuse(f"channel {name} is charged with its training's event; none was given")
            return value.event
        if mech is None:
            return NonPrivateEvent()
        if not opens and self.channels[name].record_bands > 1:
            return NoOpEvent()  # covered by this client's block charge (Channel.record_bands)
        if self.placement == "distributed":
            if name not in self.distributed_events:
                raise InvalidRelease(f"no distributed-noise event planned for channel {name}")
            return self.distributed_events[name]
        channel = self.channels[name]
        event: PrivacyEvent = GaussianEvent(mech.sensitivity, mech.noise_std)
        if channel.record_sampled:  # a sum over a Poisson sample of records (Channel.record_sampling_rate)
            if self.amplified:
                raise InvalidRelease(f"channel {name}: record sampling and amplifying client sampling cannot be "
                                     "composed into one event; use sampling_rate=1")
            return PoissonSampledEvent(channel.record_sampling_rate, event, relation=channel.adjacency)
        if self.amplified:
            event = PoissonSampledEvent(self.sampling_rate, event, relation=channel.adjacency)
        return event

    @property
    def amplified(self) -> bool:
        """Whether rounds are charged as Poisson-sampled events (see the class docstring)."""
        return amplifies(self.sampling_rate, self.privacy_unit, self.placement)

    def opens_block(self, name: str, round: int) -> bool:
        """Whether this client's release of banded channel ``name`` in ``round`` is its first in the round's block of
        b rounds (rounds k b to k b + b - 1): the ledger holds no charge of the channel for this client in the block
        before ``round``. A record takes part at most once per block (its group's round), only in a round its client
        released, so one block event per block a client released in covers every record's participations, whatever
        rounds the client missed (dropped out, sat out past its budget: a refused block charge leaves the block
        unopened). Always True for other channels. Read from the ledger, so a pipeline rebuilt every round (a
        deployment's client) decides as one kept for the run."""
        b = self.channels[name].record_bands
        if b == 1:
            return True
        block = int(round) // b
        if self._opened.get(name) == block:
            return False
        start = block * b
        if any(c.channel == name and start <= c.round < int(round) for c in self.ledger.charges(self.client_id)):
            self._opened[name] = block
            return False
        return True

    def _requests(self, round: int, values: Mapping[str, object] | None = None) -> list[ChargeRequest]:
        """Round ``round``'s charge requests, in channel order. Without a DP-SGD-trained channel they depend on the
        pipeline's fixed configuration and on which banded channels the round opens a block of only, so each list is
        built once and reused (the requests are frozen)."""
        phase = tuple(self.opens_block(name, round) for name in self.channels)
        if phase in self._fixed_requests:
            return self._fixed_requests[phase]
        values = values or {}
        requests = [ChargeRequest(name, self.event_for(name, values.get(name), opens), ch.unit)
                    for (name, ch), opens in zip(self.channels.items(), phase)]
        if not any(isinstance(ch.clip, TrainedPrivately) for ch in self.channels.values()):
            self._fixed_requests[phase] = requests
        return requests

    def charge_only(self, round: int) -> None:
        """Charge a round in which Poisson sampling left this client out.

        Amplification by sampling accounts for every round of every member of the population, sampled or not; the
        ledger must hold those rounds too or it would under-count.
        """
        if self.sampling_rate >= 1.0:
            raise ReleaseMisuse("charge_only is for Poisson-sampled runs (sampling_rate < 1)")
        if not self.amplified:
            return  # record level: a round that releases nothing costs nothing (see the class docstring)
        if any(isinstance(ch.clip, TrainedPrivately) for ch in self.channels.values()):
            raise ReleaseMisuse("client sampling with DP-SGD-trained channels is not supported: the training's "
                                "event is only known once the client has trained")
        self.ledger.charge_all(self.client_id, round, self._requests(round), left_out=True)

    def _buffer(self, channel: Channel) -> np.ndarray | None:
        """A float64 array of ``channel``'s shape to convert this round's float32 upload into: the one the last
        release was made in when nothing outside holds it any more (no Release, view, tensor or sum of it is left:
        its only references are this pipeline's dict, this frame and ``getrefcount``'s argument), else a new one,
        kept for the next round. Reusing it saves the page faults of a new upload-sized array every round; the value
        it held was released rounds ago and is overwritten whole."""
        if not (isinstance(channel.clip, NormClip) and channel.shape):
            return None
        buf = self._buffers.get(channel.name)
        if buf is None or sys.getrefcount(buf) != 3:
            buf = self._buffers[channel.name] = np.empty(channel.shape)
        return buf

    @staticmethod
    def _clip(channel: Channel, validated, raw):
        """The channel's clip of its validated value; a norm clip scales in place the float64 copy validation made
        (never the algorithm's own array: when validation made no copy, the clip makes one). A float32 upload's copy
        is checked finite by that clip's norm (``Channel.validate(defer_finite=True)``), before anything is
        charged."""
        if isinstance(channel.clip, NormClip) and isinstance(validated, np.ndarray) and validated is not raw and not (
                isinstance(raw, np.ndarray) and np.shares_memory(validated, raw)):
            try:
                return channel.clip.apply(validated, owned=True)
            except InvalidRelease as exc:
                text = str(exc)
                if "non-finite" in text:  # the clip's finiteness check of an upload: local training diverged
                    text += f"; the local training diverged: {DIVERGENCE_CAUSES}"
                raise InvalidRelease(f"channel {channel.name}: {text}") from None
        return channel.clip.apply(validated)

    def release(self, round: int, values: Mapping[str, object], weight: float = 1.0, *,
                mark: bool = True) -> dict[str, Release]:
        """Validate, clip, charge, noise and release every channel of one round (all or nothing). ``mark=False``:
        the values leave later (as a masked input, see the module docstring); the caller marks the rows with
        :meth:`mark_round_released` when they do."""
        missing = set(self.channels) - set(values)
        extra = set(values) - set(self.channels)
        if missing or extra:
            raise InvalidRelease(f"round values must cover exactly the declared channels {sorted(self.channels)}; "
                                 f"missing {sorted(missing)}, undeclared {sorted(extra)}")
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            raise InvalidRelease(f"release weight must be a finite number > 0, got {weight!r}")
        # 1. validate, 2. clip — before anything is charged.
        try:
            validated, clipped = self._validated(values)
        except InvalidRelease:
            fallback = self._fallback(round, values)
            if fallback is None:
                raise
            values = fallback
            validated, clipped = self._validated(values)
        # 3. charge, atomically for the round (and, when no noise is left to draw here, marked released with it).
        marked = mark and not self._noise_after_charge
        requests = self._requests(round, validated)
        charges = {c.channel: c for c in self.ledger.charge_all(self.client_id, round, requests, release=marked)}
        for name, ch in self.channels.items():
            if ch.record_bands > 1:
                self._opened[name] = int(round) // ch.record_bands
        releases = {}
        for name, ch in self.channels.items():
            mech = self.mechanisms[name]
            value = clipped[name] if mech is None and not ch.private else np.asarray(clipped[name], dtype=np.float64)
            local_std = central_std = 0.0
            if mech is not None:
                if self.placement == "local":
                    value = value + mech.noise(value.shape, self.noise, symmetric=ch.symmetric)
                    local_std = mech.noise_std
                elif self.placement == "central":
                    central_std = mech.noise_std
                # distributed: integer noise shares are added after quantisation (privfl.privacy.secure)
            # 6. the row is marked released just before the value is handed over (never twice).
            if mark and not marked:
                self.ledger.mark_released(charges[name])
            releases[name] = Release(self.client_id, round, name, value, float(weight), local_std, central_std,
                                     charges[name].release_id)
        return releases

    def _validated(self, values: Mapping[str, object]) -> tuple[dict, dict]:
        """Steps 1 and 2 of :meth:`release`: every channel's value validated, then clipped."""
        validated = {name: ch.validate(values[name], defer_finite=isinstance(ch.clip, NormClip),
                                       into=self._buffer(ch) if _is_float32(values[name]) else None)
                     for name, ch in self.channels.items()}
        clipped = {name: self._clip(ch, validated[name], values[name]) for name, ch in self.channels.items()}
        return validated, clipped

    def _fallback(self, round: int, values: Mapping[str, object]) -> dict | None:
        """The round's values to release in place of a local result that is not finite (:func:`fallback_value` for
        every channel), or None to refuse as before: no entry is non-finite (another fault), a non-finite value has
        another shape than its channel's (a bug, not a failure on the records), or a non-finite channel is not
        private (a non-private release hides nothing: a clear error is better). Whether a private client's training
        failed depends on its records; an error in its place would tell the server so, uncharged, so the fallback
        leaves as an ordinary release, and only a :class:`LocalResultNotFinite` warning, on the client's side, says
        it."""
        bad = [name for name in self.channels if _not_finite(values[name])]
        if not bad or any(not self.channels[name].private for name in bad):
            return None
        if any(np.shape(_raw(values[name])) != self.channels[name].shape for name in bad):
            return None
        warnings.warn(f"client {self.client_id}, round {round}: the local result is not finite (channels {bad}); "
                      f"it released the data-independent fallback instead (no change), charged as usual, and the "
                      f"server cannot tell. The local training diverged: {DIVERGENCE_CAUSES}", LocalResultNotFinite,
                      stacklevel=3)
        return {name: fallback_value(ch, values[name]) for name, ch in self.channels.items()}

    def failed_step_values(self, round: int, exc: BaseException,
                           events: Mapping[str, PrivacyEvent] | None = None) -> dict | None:
        """The round's values to release in place of a local step that raised ``exc``: :func:`planned_fallback` for
        every channel (``events``: the run plan's planned events of this client's DP-SGD-trained channels), released
        by :meth:`release` as any other round's, charged and noised as usual; or None in a non-private run (a
        non-private release hides nothing: a clear error is better there). Whether a private client's local step
        fails depends on its records; an error in its place would tell the server so, uncharged. Only a
        :class:`LocalStepFailed` warning, on the client's side, names the exception's type. Sound at client level;
        at record level one record deciding between a release and the fallback is not covered by the ledger, so the
        record-level engines contain a record's own failure per example and this is the last resort."""
        if not all(ch.private for ch in self.channels.values()):
            return None
        events = dict(events or {})
        values = {name: planned_fallback(ch, events.get(name)) for name, ch in self.channels.items()}
        covered = ("and the server cannot tell" if self.privacy_unit == "client" else
                   "but at record level the ledger's epsilon does not cover this round: one record may have decided "
                   "the failure (the DP-SGD engines contain a record's own failure per example; this step raised "
                   "outside them)")
        warnings.warn(f"client {self.client_id}, round {round}: the local step raised {type(exc).__name__}; it "
                      f"released the data-independent fallback instead (no change), charged as usual, {covered}. "
                      f"If training diverged: {DIVERGENCE_CAUSES}. If every client's step fails, the "
                      f"program is more likely at fault (your model, loss or optimizer): the same run without privacy "
                      f"(epsilon=inf, --epsilon inf) raises the error with its text", LocalStepFailed, stacklevel=2)
        return values

    def removed_values(self, events: Mapping[str, PrivacyEvent] | None = None) -> dict:
        """The values a client-level client with no records releases: :func:`removed_value` (exact zeros) for every
        channel, released by :meth:`release` as any other round's, charged and noised as usual."""
        if self.privacy_unit != "client":
            raise ReleaseMisuse("only a client-level run releases a client without records as zeros; at record level "
                                "its local step runs (DP-SGD's noise-only steps are what its charge covers)")
        events = dict(events or {})
        return {name: removed_value(ch, events.get(name)) for name, ch in self.channels.items()}

    def mark_round_released(self, round: int) -> int:
        """Mark this client's charged rows of ``round`` released (:func:`mark_round_released`)."""
        return mark_round_released(self.ledger, self.client_id, round)


def _is_float32(value) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == np.float32


def mark_round_released(ledger: PrivacyLedger, client_id: str, round: int) -> int:
    """Mark ``client_id``'s charged, not yet released rows of ``round`` released (the values are about to leave, as
    a masked input); returns how many. Refuses a round with no such charge: nothing may leave without one."""
    pending = [c for c in ledger.charges(str(client_id)) if c.round == int(round) and not c.released
               and not c.left_out]
    if not pending:
        raise ReleaseMisuse(f"client {client_id} has no charged, unreleased value in round {round}; nothing may be "
                            f"sent without its charge")
    for charge in pending:
        ledger.mark_released(charge)
    return len(pending)
