"""Channels: the named outputs a client sends, each declared once with its shape, privacy unit and clip.

The clip is what makes the declared sensitivity true, so a channel's sensitivity is *derived* from its clip and the
adjacency, never typed in by hand. Clip kinds:

- :class:`NormClip`: the release pipeline clips the whole upload to an L2 norm (client-level DP, e.g. DP-FedAvg).
- :class:`PreClipped`: the algorithm builds the value from per-record terms it clipped with ``mechanisms`` (e.g. a
  Fisher diagonal from per-example gradients clipped to C); it hands the pipeline a :class:`ClippedValue` whose bound
  must match the channel's.
- :class:`RangeBound`: the value lives in a bounded set (probability vectors), which bounds the sensitivity.
- :class:`TrainedPrivately`: the value is a function of a model trained with DP-SGD (opacus); it is post-processing
  of that training, which the algorithm hands over as a :class:`PrivatizedValue` carrying the training's event. The
  pipeline charges that event and adds no noise.
- :class:`Unclipped`: only for non-private runs (``epsilon = inf``); such a channel is charged a NonPrivateEvent.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from privfl.mechanisms import InvalidRelease, squared_sum_sensitivity, sum_sensitivity
from privfl.mechanisms.clipping import check_adjacency, check_bound, clip_per_client
from privfl.errors import DIVERGENCE_CAUSES, ConfigurationError

UNITS = ("example", "client")


@dataclass(frozen=True)
class NormClip:
    """Clip the whole value to L2 norm ``bound``; a sum over units moves by ``bound`` (add/remove)."""

    bound: float

    def __post_init__(self):
        object.__setattr__(self, "bound", check_bound("clip bound", self.bound))

    def sensitivity(self, adjacency: str) -> float:
        return sum_sensitivity(self.bound, adjacency)

    def apply(self, value, *, owned: bool = False) -> np.ndarray:
        """``value`` clipped to norm ``bound``; ``owned``: ``value`` is the caller's own float64 copy, scaled in
        place (``mechanisms.clipping.clip_per_client``). A :class:`ClippedValue` (a statistic the algorithm built
        from clipped per-record terms, released at client level) is clipped as a whole like any other value."""
        if isinstance(value, ClippedValue):
            value, owned = value.value, False
        return clip_per_client(value, self.bound, owned=owned).value


@dataclass(frozen=True)
class PreClipped:
    """The value is a sum of per-record terms clipped by the algorithm to ``bound``.

    ``statistic``: ``"sum"`` (terms g_i), or ``"squared_sum"`` (terms g_i (.) g_i or phi_i phi_i^T).
    """

    bound: float
    statistic: str = "sum"

    def __post_init__(self):
        object.__setattr__(self, "bound", check_bound("clip bound", self.bound))
        if self.statistic not in ("sum", "squared_sum"):
            raise InvalidRelease(f"statistic must be 'sum' or 'squared_sum', got {self.statistic!r}")

    def sensitivity(self, adjacency: str) -> float:
        if self.statistic == "sum":
            return sum_sensitivity(self.bound, adjacency)
        return squared_sum_sensitivity(self.bound, adjacency)

    @property
    def unit_norm(self) -> float:
        """The largest norm of one record's term: ``bound`` for a sum, ``bound^2`` for a squared sum."""
        return self.bound if self.statistic == "sum" else self.bound ** 2

    def apply(self, value) -> np.ndarray:
        if not isinstance(value, ClippedValue):
            raise InvalidRelease("a PreClipped channel takes a ClippedValue built from per-record clipped terms; "
                                 "wrap the statistic with ClippedValue(value, bound, statistic)")
        if value.bound > self.bound * (1 + 1e-12) or value.statistic != self.statistic:
            raise InvalidRelease(f"value was clipped to {value.bound} ({value.statistic}) but the channel declares "
                                 f"{self.bound} ({self.statistic}); clip to the declared bound")
        return value.value


@dataclass(frozen=True)
class RangeBound:
    """Values whose range bounds the sensitivity: ``rows`` rows, each a probability vector.

    - ``per_row_sensitivity``: how far one row can move, the diameter of its set (any two probability vectors are at
      most sqrt(2) apart in L2);
    - ``row_norm``: the largest norm of one row (a probability vector has |p|_2 <= |p|_1 = 1);
    - ``unit``: the privacy unit of the channel that carries the bound (give the channel's own).

    A neighbour that changes the upload moves it by at most ``per_row_sensitivity * sqrt(rows)``: one record of a
    client that still uploads (unit ``"example"``, either adjacency; the default, valid for any channel) or a client
    replaced by another (unit ``"client"``, replace-one). A neighbour that removes the whole upload (unit
    ``"client"``, add/remove) moves the sum by the upload itself: at most ``row_norm * sqrt(rows)``.
    """

    per_row_sensitivity: float
    rows: int
    unit: str = "example"
    row_norm: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "per_row_sensitivity", check_bound("per-row sensitivity", self.per_row_sensitivity))
        object.__setattr__(self, "row_norm", check_bound("row norm", self.row_norm))
        if isinstance(self.rows, bool) or not isinstance(self.rows, (int, np.integer)) or self.rows < 1:
            raise InvalidRelease(f"rows must be an integer >= 1, got {self.rows!r}")
        object.__setattr__(self, "rows", int(self.rows))
        if self.unit not in UNITS:
            raise InvalidRelease(f"RangeBound unit must be one of {UNITS} (the channel's), got {self.unit!r}")

    @property
    def takes_removed(self) -> bool:
        """Whether the all-zero value is accepted: at client level the contribution of a client whose data is removed
        (``privfl.core.release.removed_value``), which every row's norm bound covers: zero is at most ``row_norm``
        from any row, within the sensitivity under add/remove, and under replace-one when ``row_norm`` is at most
        ``per_row_sensitivity`` (probability rows: 1 and sqrt(2))."""
        return self.unit == "client" and self.row_norm <= self.per_row_sensitivity

    def sensitivity(self, adjacency: str) -> float:
        if check_adjacency(adjacency) == "add_remove" and self.unit == "client":
            return self.row_norm * math.sqrt(self.rows)
        return self.per_row_sensitivity * math.sqrt(self.rows)

    def apply(self, value: np.ndarray) -> np.ndarray:
        if self.takes_removed and value.ndim == 2 and not np.any(value):
            return value  # a client-level client without records: no upload (see takes_removed)
        if value.ndim != 2 or np.any(value < -1e-9) or np.any(np.abs(value.sum(axis=1) - 1) > 1e-6):
            raise InvalidRelease("a probability channel takes rows of non-negative numbers that sum to 1")
        return value


@dataclass(frozen=True)
class TrainedPrivately:
    """Post-processing of DP-SGD local training: the pipeline charges the training's event, adds no noise."""

    def sensitivity(self, adjacency: str) -> float:
        check_adjacency(adjacency)
        return math.nan  # not a noised statistic: its cost is the training's event

    def apply(self, value) -> np.ndarray:
        if not isinstance(value, PrivatizedValue):
            raise InvalidRelease("a TrainedPrivately channel takes a PrivatizedValue(value, event) whose event is the "
                                 "DP-SGD training's privacy event")
        return value.value


@dataclass(frozen=True)
class Unclipped:
    """No clip: the value is released as it is, and the release is charged as non-private (epsilon = inf)."""

    def sensitivity(self, adjacency: str) -> float:
        return math.inf

    def apply(self, value: np.ndarray) -> np.ndarray:
        return value


@dataclass(frozen=True)
class ClippedValue:
    """A statistic built by the algorithm from terms it clipped to ``bound`` with ``mechanisms`` clipping."""

    value: np.ndarray
    bound: float
    statistic: str = "sum"


@dataclass(frozen=True)
class PrivatizedValue:
    """A value already made private by its computation (DP-SGD training) and the event that computation cost."""

    value: np.ndarray
    event: object  # accounting.events.PrivacyEvent

    def __post_init__(self):
        from privfl.accounting.events import NonPrivateEvent, PrivacyEvent

        if not isinstance(self.event, PrivacyEvent) or isinstance(self.event, NonPrivateEvent):
            raise InvalidRelease("PrivatizedValue.event must be the privacy event of the training that produced it")


@dataclass(frozen=True)
class Channel:
    """A named output of a client: its shape, privacy unit, clip and share of the round's privacy budget.

    ``value_bound``: a public bound on every coordinate's magnitude (before noise), used to size the quantisation
    range under secure aggregation; a :class:`NormClip` implies it (C).

    ``record_sampling_rate``: a record-level channel whose value is a sum over a Poisson sample of the client's
    records, each included with this public probability q, declares q (DP-FedSGD's clipped gradient sums). The
    release is then the sampled Gaussian ``PoissonSampled(q, Gaussian(sensitivity, noise))`` under the channel's
    relation: charged so by the pipeline and calibrated so by the run plan. 1: no record sampling.

    ``record_bands``: b > 1 declares the banded matrix-factorisation mechanism (DP-FTRL with b-min-separated
    participation, ``privfl.mechanisms.matrix_factorization``): the client's records are split at random into b
    groups, group ``t mod b`` is the one sampled (at ``record_sampling_rate``) in round t, and the value is the
    client's banded mixture ``sum_{k < b} c_k x_{t-k}`` of its rounds' sums (``||c|| = 1``). One record's
    participations then touch disjoint runs of b rounds (the client mixes by absolute round: a round it missed
    counts as a zero sum), each a Poisson-sampled Gaussian of the channel's sensitivity (Choquette-Choo et al.,
    NeurIPS 2023), and a record takes part at most once in each block of rounds k b to k b + b - 1 (its group's
    round), only in a round its client released. The pipeline charges that event at the client's first release in a
    block and a no-op at its other releases there (``ReleasePipeline.opens_block``), so a client is charged one event
    per block it released in: ceil(rounds / b) in a full run, which the run plan calibrates.
    """

    name: str
    shape: tuple[int, ...]
    unit: str
    clip: NormClip | PreClipped | RangeBound | TrainedPrivately | Unclipped
    adjacency: str = "add_remove"
    budget_share: float = 1.0
    symmetric: bool = False
    value_bound: float | None = None
    record_sampling_rate: float = 1.0
    record_bands: int = 1
    description: str = field(default="", compare=False)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise InvalidRelease(f"channel name must be an identifier such as 'update' or 'fisher_diag', "
                                 f"got {self.name!r}")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.unit not in UNITS:
            raise InvalidRelease(f"channel {self.name}: unit must be one of {UNITS}, got {self.unit!r}")
        check_adjacency(self.adjacency)
        if not (isinstance(self.budget_share, (int, float)) and math.isfinite(self.budget_share)
                and self.budget_share > 0):
            raise InvalidRelease(f"channel {self.name}: budget_share must be > 0, got {self.budget_share!r}")
        if self.value_bound is not None and not (isinstance(self.value_bound, (int, float))
                                                 and math.isfinite(self.value_bound) and self.value_bound > 0):
            raise InvalidRelease(f"channel {self.name}: value_bound must be a finite number > 0 or None")
        if self.symmetric and (len(self.shape) != 2 or self.shape[0] != self.shape[1]):
            raise InvalidRelease(f"channel {self.name}: symmetric needs a square shape, got {self.shape}")
        q = self.record_sampling_rate
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q <= 1:
            raise InvalidRelease(f"channel {self.name}: record_sampling_rate must lie in (0, 1], got {q!r}")
        object.__setattr__(self, "record_sampling_rate", float(q))
        if q < 1 and self.unit != "example":
            raise InvalidRelease(f"channel {self.name}: record sampling bounds a record's influence; it needs "
                                 f"unit='example', got {self.unit!r}")
        b = self.record_bands
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise InvalidRelease(f"channel {self.name}: record_bands must be an integer >= 1, got {b!r}")
        if b > 1 and self.unit != "example":
            raise InvalidRelease(f"channel {self.name}: banded participation separates a record's rounds; it needs "
                                 f"unit='example', got {self.unit!r}")

    @property
    def record_sampled(self) -> bool:
        """Whether the value is a sum over a Poisson sample of records (``record_sampling_rate`` < 1)."""
        return self.record_sampling_rate < 1.0

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of this channel, derived from its clip and adjacency. A sum over Poisson-sampled records
        under replace-one is accounted with dp-accounting's radius = sensitivity / 2 (``PoissonSampledEvent``), sound
        only when every record's term has norm at most that radius: the displacement is raised to twice a record's
        norm bound where it is smaller (a squared sum: sqrt(2) C^2 apart, but one term of norm up to C^2)."""
        s = self.clip.sensitivity(self.adjacency)
        if self.record_sampled and self.adjacency == "replace_one":
            unit = getattr(self.clip, "unit_norm", None)
            if unit is None:
                raise InvalidRelease(f"channel {self.name}: a sum over Poisson-sampled records under replace-one needs "
                                     "a bound on one record's term (a PreClipped clip)")
            s = max(s, 2.0 * float(unit))
        return s

    @property
    def coordinate_bound(self) -> float | None:
        """A public bound on |coordinate| of the clipped value, if the channel has one."""
        if self.value_bound is not None:
            return float(self.value_bound)
        if isinstance(self.clip, NormClip):
            return self.clip.bound
        return None

    @property
    def private(self) -> bool:
        return not isinstance(self.clip, Unclipped)

    def validate(self, value, *, defer_finite: bool = False,
                 into: np.ndarray | None = None) -> np.ndarray | ClippedValue:
        """Finite and of the declared shape, or :class:`InvalidRelease` naming the channel.

        ``defer_finite``: a float32 array converted here to a float64 copy is not checked for finiteness; the caller
        (the release pipeline, for a norm-clipped channel) hands that copy to the norm clip, which checks it through
        the norm it computes anyway (``mechanisms.clipping.clip_per_client(owned=True)``). Any other value is
        checked here as always.

        ``into``: a float64 array of the channel's shape that the caller owns and no one else holds (the release
        pipeline's reused buffer); a float32 upload of a clipped channel is converted into it instead of into a new
        array (a new array of an upload's size costs a page fault per 4 KiB on first touch)."""
        raw = value.value if isinstance(value, (ClippedValue, PrivatizedValue)) else value
        # An unclipped (non-private) float32 value stays float32 (no copy): nothing about it needs float64. Anything
        # clipped or noised is float64 from here on, so that its clip and its noise hold as computed.
        keep32 = not self.private and isinstance(raw, np.ndarray) and raw.dtype == np.float32
        is32 = isinstance(raw, np.ndarray) and raw.dtype == np.float32
        if (is32 and not keep32 and into is not None and raw.shape == self.shape and into.shape == self.shape
                and into.dtype == np.float64):
            np.copyto(into, raw)
            arr = into
        else:
            arr = raw if keep32 else np.asarray(raw, dtype=np.float64)
        if arr.shape != self.shape:
            raise InvalidRelease(f"channel {self.name}: expected shape {self.shape}, got {arr.shape}; nothing was "
                                 f"released")
        # float32 values are checked before conversion (half the bytes; the conversion keeps finiteness exactly)
        if not (defer_finite and is32 and arr is not raw) and not _all_finite(raw if is32 else arr):
            raise InvalidRelease(f"channel {self.name}: value has NaN or Inf entries; nothing was released: the "
                                 f"local training diverged; {DIVERGENCE_CAUSES}")
        if self.symmetric and arr.ndim == 2 and arr.shape[0] == arr.shape[1]:
            # noise is drawn for the upper triangle and mirrored: what leaves is the upper triangle, mirrored, so the
            # antisymmetric part of a value that is not exactly symmetric (V - V^T) never leaves without noise
            arr = np.triu(arr) + np.triu(arr, 1).T
        if isinstance(value, ClippedValue):
            return ClippedValue(arr, value.bound, value.statistic)
        if isinstance(value, PrivatizedValue):
            return PrivatizedValue(arr, value.event)
        return arr


def _all_finite(arr: np.ndarray) -> bool:
    """Whether every entry is finite. Fast path: a finite sum has no NaN or inf entry behind it (one vectorised
    pass, no BLAS call: a BLAS pool left threaded by the caller would make it slow); only when the sum is not finite
    (a NaN or inf, or huge finite values that overflowed) are the entries checked one by one."""
    flat = arr.reshape(-1)
    if flat.size and flat.dtype in (np.float32, np.float64):
        with np.errstate(over="ignore", invalid="ignore"):
            if np.isfinite(np.add.reduce(flat)):
                return True
    return bool(np.all(np.isfinite(arr)))


def amplifies(sampling_rate: float, unit: str, placement: str) -> bool:
    """Whether client sampling amplifies a run's guarantee: client-level privacy, central noise (the only observer,
    of the published model, cannot tell who took part), and a sampling rate below 1."""
    return sampling_rate < 1.0 and unit == "client" and placement == "central"


def charged_channels(channels, privacy, secure_aggregation: bool) -> list:
    """The channels as the run charges them; every runtime applies these rules before it plans noise.

    - At client level under add/remove, a client's upload is protected as a whole only inside the sum; with local
      noise and no secure aggregation the server sees every upload on its own, from a client it knows took part, so
      any two uploads of that client are neighbours: such channels are charged (and noised) as replace-one.
    - A Poisson-sampled replace-one event is accounted with dp-accounting's radius = displacement / 2, which holds
      only if each client's whole upload has norm at most half the declared displacement. A norm clip C (2C apart)
      satisfies it; probability rows (FedBNN: sqrt(2 |AD|) apart, but an upload of norm up to sqrt(|AD|)) do not, so
      their displacement is raised to twice the upload's norm bound. Other clips cannot be sampled under replace-one.
    """
    out = list(channels)
    if privacy.private and privacy.unit == "client" and privacy.placement == "local" and not secure_aggregation:
        out = [dataclasses.replace(c, adjacency="replace_one") if c.private and c.adjacency == "add_remove" else c
               for c in out]
    if privacy.private and amplifies(privacy.sampling_rate, privacy.unit, privacy.placement):
        sampled = []
        for c in out:
            if c.private and c.adjacency == "replace_one" and not isinstance(c.clip, NormClip):
                if not isinstance(c.clip, RangeBound):
                    raise ConfigurationError(
                        f"channel {c.name!r}: client sampling under replace-one needs a public bound on a client's "
                        "whole upload (a norm clip); use add_remove adjacency or sampling_rate=1")
                c = dataclasses.replace(c, clip=dataclasses.replace(c.clip, per_row_sensitivity=2 * c.clip.row_norm))
            sampled.append(c)
        out = sampled
    return out


def check_record_level_clips(channels, privacy) -> None:
    """Refuse a record-level run whose channel bounds a record's influence only by clipping the client's whole upload
    under add/remove adjacency: removing a record does not remove the upload, it moves it between two clipped values,
    up to twice the clip apart, so such a channel must declare ``adjacency="replace_one"``. ``privacy``: the run's
    PrivacyConfig (its ``private`` and ``unit``). Every runtime calls this on an algorithm's channels before a round."""
    if not privacy.private or privacy.unit != "example":
        return
    for c in channels:
        if c.private and c.unit == "client" and isinstance(c.clip, NormClip) and c.adjacency != "replace_one":
            raise ConfigurationError(
                f"channel {c.name!r} clips the client's whole upload to bound one record (unit='example'); a record "
                "moves that upload by up to twice the clip, so the channel must declare adjacency='replace_one' "
                "(or run with unit='client')")
