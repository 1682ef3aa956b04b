"""Sources of Gaussian noise.

The random generator is always passed in. ``SeededNoise`` wraps a ``numpy.random.Generator`` (reproducible from a
seed, for experiments). ``SecureNoise`` draws from the operating system's CSPRNG (``os.urandom``) and refuses a seed:
a deployment should not be able to replay its noise. Both produce standard normal float64 arrays.

``SecureNoise`` is Box-Muller, X = R (cos 2 pi u2, sin 2 pi u2) with R = sqrt(-2 ln U1), on two uniforms built from
random bits. Its tails are what a Gaussian mechanism's privacy rests on: a sampler whose |X| cannot pass some bound
is not (epsilon, delta)-DP once one neighbour's output can lie beyond that bound and the other's cannot (53-bit
uniforms stopped R at sqrt(2 * 53 ln 2) = 8.57). So U1 is taken at full float64 resolution at both ends:

- the first random bit picks the side of 1/2 that U1 lies on; the run of k bits after it that repeat it (a geometric
  count, P(k) = 2^-(k+1), continued across 64-bit words) picks the binade [2^-(k+2), 2^-(k+1)) of V = min(U1, 1 - U1),
  and the next 52 unused bits its mantissa. That is exactly V rounded down to float64 for an exact uniform U1 on
  (0, 1), which the bits not drawn would complete: full resolution near 0 and near 1, not a 2^-53 grid.
- E = -ln U1 is -ln V below 1/2 and -log1p(-V) above it, so E has relative error below 2^-51 everywhere.
- the run is capped at 1020 bits (V >= 2^-1022, the smallest normal float64), so R <= sqrt(2 * 1022 ln 2) = 37.64.
  That cap is the only truncation left. u2 is a 53-bit uniform in (0, 1].

What it guarantees. The bits define exact independent uniforms U1, U2 on (0, 1) and so an exact standard normal pair
Z = sqrt(-2 ln U1) (cos 2 pi U2, sin 2 pi U2), coupled with the output pair X so that, on every draw except one of
probability eta = 2^-1020 = 8.9e-308 per pair (a run that reaches the cap),

    |X_i - Z_i| <= (2^-51 + 2 pi 2^-53) |Z| <= b = 4.3e-14        (i = 1, 2; exact arithmetic on the drawn bits)

plus the few ulps of float64 log, log1p, sqrt, cos and sin (numpy's, not proven here). Hence if a release
f(D) + sigma N(0, I_d) is (epsilon, delta)-DP, the release made with this sampler satisfies, for every event S and
neighbours D, D' (S^r: S enlarged by r in every coordinate; the steps are the coupling, DP, the coupling again),

    P[M(D) in S] <= e^epsilon P[M(D') in S^(2 sigma b)] + delta + (1 + e^epsilon) ceil(d/2) eta.

The extra term is below 1e-10 delta whenever delta/d >= 1e10 (1 + e^epsilon) eta, i.e. delta/d >= 3.3e-297 at
epsilon = 1, 4.6e-276 at epsilon = 50, 2.4e-254 at epsilon = 100: for every delta >= 1e-100 (the floor privfl's
accounting sets), d <= 1e12 and epsilon <= 420 it is negligible. (The same argument gave the old 53-bit sampler
eta = 2^-53 = 1.1e-16: an extra term of 1e-5 already at d = 1e5, epsilon = 14.4.) The enlargement 2 sigma b =
8.6e-14 sigma, a few hundred ulps of sigma, is the scale at which floating point decides anyway (the caveat below).
This is a coupling, not a total-variation bound against N(0, 1) rounded to float64: no float64 Box-Muller is close
to that in total variation, since it reaches only some of the floats; eta plays the part of the total-variation
distance in the bound above.

Caveat (Mironov, CCS 2012): floating-point samplers leak through the low bits of their output; the discrete Gaussian
(``mechanisms.discrete_gaussian``) used with secure aggregation does not have that problem.
"""

from __future__ import annotations

import math
import os
from typing import Callable

import numpy as np

from .errors import ReleaseMisuse

RandomBytes = Callable[[int], bytes]

_RUN_CAP = 1020                 # V >= 2^-(1020 + 2) = 2^-1022, the smallest normal float64
_FAST_MIN_EXPONENT = 42         # frexp exponent of c >> 11 when the run is <= 10 and its word still holds 52 bits
_TWO_PI = 2.0 * math.pi


def _words(random_bytes: RandomBytes, n: int) -> np.ndarray:
    """n little-endian 64-bit words from ``random_bytes``."""
    data = random_bytes(8 * n)
    if len(data) != 8 * n:
        raise ValueError(f"random_bytes({8 * n}) returned {len(data)} bytes")
    return np.frombuffer(data, dtype="<u8").astype(np.uint64, copy=False)


def _long_run(c: int, first_bit: int, random_bytes: RandomBytes) -> int:
    """The run of bits repeating ``first_bit`` after it, once it reaches the first word's last 11 bits (P = 2^-52).

    ``c`` is the first word with its bits flipped when ``first_bit`` is 1, so the run reads as zeros."""
    run = 63 - c.bit_length()
    flip = (1 << 64) - 1 if first_bit else 0
    while c == 0 and run < _RUN_CAP:
        c = int.from_bytes(random_bytes(8), "little") ^ flip
        run += 64 - c.bit_length()
    return min(run, _RUN_CAP)


def _half_uniform(n: int, random_bytes: RandomBytes) -> tuple[np.ndarray, np.ndarray]:
    """n uniforms U in (0, 1) at full float64 resolution near 0 and near 1, as (V, upper): V = min(U, 1 - U) rounded
    down to a float64 in [2^-1022, 1/2), and upper = (U > 1/2). See the module docstring for the bit layout."""
    w = _words(random_bytes, n)
    flip = (w.view(np.int64) >> 63).view(np.uint64)        # all ones where the first bit is 1
    c = w ^ flip                                            # the run after the first bit now reads as zeros
    upper = flip != 0
    # c < 2^63, so c >> 11 < 2^52 converts exactly; its frexp exponent k is its bit length, and c's run is 52 - k.
    _, k = np.frexp((c >> np.uint64(11)).astype(np.float64))
    run = 52 - k
    # Common case (run <= 10): the 52 bits after the run's end are still in this word.
    mantissa = (w << (run + 2).astype(np.uint64)) >> np.uint64(12)
    slow = np.flatnonzero(k < _FAST_MIN_EXPONENT)
    if slow.size:
        for i in slow[k[slow] == 0]:                        # run >= 52: count on, across words if need be
            run[i] = _long_run(int(c[i]), int(upper[i]), random_bytes)
        mantissa[slow] = _words(random_bytes, slow.size) >> np.uint64(12)
    v = np.ldexp(1.0 + mantissa.astype(np.float64) * 2.0 ** -52, -(run + 2))
    return v, upper


def _radius(n: int, random_bytes: RandomBytes) -> np.ndarray:
    """n Box-Muller radii sqrt(-2 ln U1), U1 from :func:`_half_uniform` (at most 37.64)."""
    v, upper = _half_uniform(n, random_bytes)
    squared = np.where(upper, np.log1p(-v), np.log(v))     # ln U1, with U1 = 1 - V above 1/2
    squared *= -2.0
    return np.sqrt(squared, out=squared)


def _uniform_open(n: int, random_bytes: RandomBytes) -> np.ndarray:
    """n uniforms in (0, 1]: 53 random bits each."""
    bits = _words(random_bytes, n) >> np.uint64(11)
    return (bits.astype(np.float64) + 1.0) * 2.0 ** -53


class NoiseSource:
    """Produces i.i.d. N(0, 1) float64 arrays of a given shape."""

    secure: bool = False

    def standard_normal(self, shape) -> np.ndarray:
        raise NotImplementedError


class SeededNoise(NoiseSource):
    """Noise from a caller-owned ``numpy.random.Generator`` (or a seed, to make one)."""

    def __init__(self, rng: np.random.Generator | int):
        if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
            rng = np.random.default_rng(int(rng))
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"rng must be a numpy.random.Generator or an int seed, got {type(rng).__name__}")
        self.rng = rng

    def standard_normal(self, shape) -> np.ndarray:
        return self.rng.standard_normal(shape)


class SecureNoise(NoiseSource):
    """Noise from ``os.urandom`` through Box-Muller with full-resolution uniforms (tails to 37.6 sigma; see the
    module docstring for the exact guarantee).

    ``SecureNoise(seed=...)`` raises: a cryptographically secure source is not reproducible by design.
    """

    secure = True

    def __init__(self, seed=None):
        if seed is not None:
            raise ReleaseMisuse("SecureNoise draws from the OS CSPRNG and cannot be seeded; "
                                "use SeededNoise(seed) for reproducible experiments")

    def standard_normal(self, shape) -> np.ndarray:
        size = int(np.prod(shape, dtype=np.int64)) if np.ndim(shape) else int(shape)
        pairs = (size + 1) // 2
        radius = _radius(pairs, os.urandom)
        angle = _TWO_PI * _uniform_open(pairs, os.urandom)
        out = np.empty(2 * pairs)
        np.multiply(radius, np.cos(angle), out=out[:pairs])
        np.multiply(radius, np.sin(angle), out=out[pairs:])
        return out[:size].reshape(shape)


def as_noise_source(source) -> NoiseSource:
    """Accept a NoiseSource, a numpy Generator, an int seed, or the string 'secure'."""
    if isinstance(source, NoiseSource):
        return source
    if isinstance(source, str):
        if source == "secure":
            return SecureNoise()
        raise ValueError(f"unknown noise source {source!r}; pass 'secure', a numpy Generator or an int seed")
    return SeededNoise(source)
