"""Quantisation of real vectors to integers mod 2^k, with stochastic rounding, such that sums cannot wrap.

A value x in the declared range [low, high] becomes the integer round((x - centre) / step) in [-M, M] (stochastic
rounding, so unbiased), stored mod 2^k in two's complement. ``step`` and M are chosen so that the sum of up to
``n_clients`` such integers plus ``noise_headroom`` (a bound on the summed integer noise, e.g. distributed discrete
Gaussian shares) stays within (-2^(k-1), 2^(k-1)): the modular sum then decodes exactly by centring. A value outside
the range raises ``QuantisationRangeError``; nothing ever wraps silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import QuantisationRangeError

__all__ = ["Quantiser", "noise_headroom"]

_MAX_EXACT_LEVEL = 2 ** 52  # float64 represents every integer up to 2^53: keep levels exact through the scaling


def noise_headroom(central_sigma: float, tail_sigmas: float = 10.0) -> int:
    """Integer headroom for summed noise of standard deviation ``central_sigma`` (integer units).

    The sum of discrete Gaussian shares is sub-Gaussian with variance proxy at most the summed sigma^2, so it exceeds
    ``tail_sigmas`` standard deviations with probability at most 2 exp(-tail_sigmas^2 / 2) per coordinate
    (about 4e-22 for the default 10).
    """
    if not math.isfinite(central_sigma) or central_sigma < 0:
        raise ValueError("central_sigma must be finite and >= 0")
    if not math.isfinite(tail_sigmas) or tail_sigmas <= 0:
        raise ValueError("tail_sigmas must be finite and > 0")
    return int(math.ceil(tail_sigmas * central_sigma))


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Quantiser:
    """Maps values in [low, high] to Z_{2^bits} so that the sum of ``n_clients`` of them never wraps.

    ``step`` (the grid spacing) defaults to the finest that fits the budget 2^(bits-1) - 1 >= n_clients * M +
    noise_headroom, with M = ceil((high - low) / (2 step)) the largest integer one client can send (and M <= 2^52,
    so the float64 scaling stays exact). Passing a ``step``
    checks that budget instead and raises ``ValueError`` telling you what to change if it does not fit.
    """

    low: float
    high: float
    bits: int
    n_clients: int
    noise_headroom: int = 0
    step: float | None = None

    def __post_init__(self):
        low, high = float(self.low), float(self.high)
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"need finite low < high, got [{self.low}, {self.high}]")
        if not math.isfinite(high - low):
            raise QuantisationRangeError(f"the range [{low:g}, {high:g}] is wider than float64 can represent; clip the "
                                         f"values to a narrower public range")
        bits = _check_int("bits", self.bits, 2)
        if bits > 64:
            raise ValueError(f"bits must be <= 64, got {bits}")
        n = _check_int("n_clients", self.n_clients, 1)
        headroom = _check_int("noise_headroom", self.noise_headroom, 0)
        budget = 2 ** (bits - 1) - 1
        half_width = (high - low) / 2.0
        if self.step is None:
            max_level = min((budget - headroom) // n, _MAX_EXACT_LEVEL)
            if max_level < 1:
                raise ValueError(f"{bits} bits cannot hold a sum of {n} clients plus a noise headroom of {headroom}; "
                                 f"use more bits")
            step = half_width / max_level
        else:
            step = float(self.step)
            if not (math.isfinite(step) and step > 0):
                raise ValueError(f"step must be finite and > 0, got {self.step!r}")
            max_level = math.ceil(half_width / step - 1e-9)
            if max_level > _MAX_EXACT_LEVEL:
                raise ValueError(f"step {step} gives {max_level} levels, beyond the 2^52 that float64 scaling keeps "
                                 f"exact; use a larger step")
            if n * max_level + headroom > budget:
                raise ValueError(
                    f"a sum of {n} clients with up to {max_level} levels each plus noise headroom {headroom} needs "
                    f"{math.ceil(math.log2(n * max_level + headroom + 1)) + 1} bits, have {bits}: use more bits, a "
                    f"larger step, a narrower range or fewer clients")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "n_clients", n)
        object.__setattr__(self, "noise_headroom", headroom)
        object.__setattr__(self, "step", step)
        object.__setattr__(self, "_max_level", int(max_level))

    @property
    def centre(self) -> float:
        return (self.low + self.high) / 2.0

    @property
    def max_level(self) -> int:
        """Largest |integer| one client's (noise-free) value can quantise to."""
        return self._max_level

    @property
    def modulus(self) -> int:
        return 1 << self.bits

    def check_range(self, values: np.ndarray) -> np.ndarray:
        x = np.asarray(values, dtype=np.float64)
        bad = ~np.isfinite(x) | (x < self.low) | (x > self.high)
        if bad.any():
            where = np.flatnonzero(bad.ravel())
            first = x.ravel()[where[0]]
            raise QuantisationRangeError(
                f"{where.size} value(s) outside the declared range [{self.low}, {self.high}] (first at flat index "
                f"{where[0]}: {first!r}); clip before quantising or declare a wider range")
        return x

    def to_integers(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Centred integers in [-max_level, max_level] by unbiased stochastic rounding (int64)."""
        if not isinstance(rng, np.random.Generator):
            raise TypeError("pass a numpy Generator (np.random.default_rng(seed)) for the stochastic rounding")
        x = self.check_range(values)
        scaled = np.clip((x - self.centre) / self.step, -self._max_level, self._max_level)
        floor = np.floor(scaled)
        up = rng.random(size=scaled.shape) < (scaled - floor)
        ints = (floor + up).astype(np.int64)
        return np.clip(ints, -self._max_level, self._max_level, out=ints)

    def encode(self, integers: np.ndarray) -> np.ndarray:
        """Signed integers (values, or values plus integer noise) to uint64 words mod 2^bits."""
        z = np.asarray(integers)
        if not np.issubdtype(z.dtype, np.integer):
            raise TypeError(f"encode takes integers, got dtype {z.dtype}")
        z = z.astype(np.int64, copy=False)
        limit = self._max_level + self.noise_headroom
        if z.size and int(np.abs(z).max()) > limit:
            raise QuantisationRangeError(
                f"an integer of magnitude {int(np.abs(z).max())} exceeds what one client may contribute "
                f"({self._max_level} levels + noise headroom {self.noise_headroom}); the sum could wrap")
        words = z.astype(np.uint64)  # two's complement: exact mod 2^64
        if self.bits < 64:
            np.bitwise_and(words, np.uint64(self.modulus - 1), out=words)
        return words

    def quantise(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return self.encode(self.to_integers(values, rng))

    def centred(self, words: np.ndarray) -> np.ndarray:
        """Words mod 2^bits back to signed int64 in [-2^(bits-1), 2^(bits-1))."""
        w = np.asarray(words)
        if w.dtype.kind != "u":
            raise TypeError(f"expected unsigned words, got dtype {w.dtype}")
        w = w.astype(np.uint64, copy=False)
        if self.bits < 64 and w.size and int(w.max()) >= self.modulus:
            raise ValueError(f"words must be reduced mod 2^{self.bits}")
        # sign-extend from bit (bits - 1): shift the sign bit to bit 63, reinterpret, shift back arithmetically; exact
        # for every 1 <= bits <= 64 (no constant 2^bits ever enters int64, so 63 bits works like the others)
        shift = np.uint64(64 - self.bits)
        return np.left_shift(w, shift).view(np.int64) >> np.int64(64 - self.bits)

    def decode_sum(self, total: np.ndarray, n_summed: int) -> np.ndarray:
        """The real-valued sum of ``n_summed`` quantised values from their modular sum (exact up to rounding)."""
        n = _check_int("n_summed", n_summed, 0)
        if n > self.n_clients:
            raise ValueError(f"n_summed={n} exceeds n_clients={self.n_clients} the quantiser was sized for; the sum "
                             f"may have wrapped")
        return self.centred(total).astype(np.float64) * self.step + n * self.centre

    def rounded_l2_sensitivity(self, l2_sensitivity: float, dimension: int, *, replace_one: bool = False) -> float:
        """L2 sensitivity in integer units after scaling and stochastic rounding of one client's vector.

        ``l2_sensitivity`` is the L2 displacement between neighbouring inputs in real units (the channel's sensitivity
        under its relation). Stochastic rounding moves every coordinate by less than 1 (Kairouz, Liu, Steinke 2021,
        Sec. 4, the deterministic bound). Add/remove: the vector x itself (||x|| <= l2_sensitivity, centred) is
        added or removed, and ||R(x/step)|| < ||x||/step + sqrt(d). Replace one (``replace_one``): x becomes x',
        both rounded independently, so ||R(x/step) - R(x'/step)|| < ||x - x'||/step + 2 sqrt(d).
        """
        if not math.isfinite(l2_sensitivity) or l2_sensitivity < 0:
            raise ValueError("l2_sensitivity must be finite and >= 0")
        d = _check_int("dimension", dimension, 1)
        return l2_sensitivity / self.step + (2.0 if replace_one else 1.0) * math.sqrt(d)
