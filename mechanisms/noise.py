"""Sources of Gaussian noise.

The random generator is always passed in. ``SeededNoise`` wraps a ``numpy.random.Generator`` (reproducible from a
seed, for experiments). ``SecureNoise`` draws from the operating system's CSPRNG (``os.urandom``) and refuses a seed:
a deployment should not be able to replay its noise. Both produce standard normal float64 arrays.

``SecureNoise`` is Box-Muller, X = R (cos 2 pi u2, sin 2 pi u2) with R = sqrt(-2 ln U1), on two uniforms built from
random bits. Its tails are what a Gaussian mechanism's privacy rests on: a sampler whose |X| cannot pass some bound
is not (epsilon, delta)-DP once one neighbour's output can lie beyond that bound and the other's cannot. 53-bit
uniforms stopped R at sqrt(2 * 53 ln 2) = 8.57 (delta broke for noise multipliers below about 0.23); uniforms rounded
to float64 stop it at sqrt(2 * 1074 ln 2) = 38.6. So U1 is never formed as one float:

- the first random bit picks the side of 1/2 that U1 lies on; the run of k bits after it that repeat it (a geometric
  count, P(k) = 2^-(k+1), continued across 64-bit words for as long as it lasts: no cap) picks the binade
  [2^-(k+2), 2^-(k+1)) of V = min(U1, 1 - U1), and the next 52 unused bits its mantissa f in [1, 2). That is exactly V
  rounded down to 53 significant bits, V = f 2^-(k+2), for an exact uniform U1 on (0, 1), which the bits not drawn
  would complete: full resolution near 0 and near 1, whatever the exponent.
- E = -ln U1 is -ln V below 1/2 and -log1p(-V) above it, so E has relative error below 2^-51 everywhere. While V is a
  normal float64 (k <= 1020: every draw in practice, the rest has probability 2^-1021) these are numpy's log and
  log1p of V; below 1/2 with k > 1020, E = (k + 2) ln 2 - ln f, with no float V at all (no underflow, the same
  relative error); above 1/2 with k > 1020, E = V rounded to a subnormal float64 or 0 (log1p(-V) = -V there), an
  absolute error below 2^-1074.
- u2 is a 53-bit uniform in (0, 1].

So R has no bound: every r > 0 is passed with probability exactly P[-2 ln U1 > r^2] = exp(-r^2 / 2) up to the
rounding of V to 53 significant bits (a relative 2^-52), e.g. 1.9e-22 at 10 sigma, 1.4e-87 at 20, 2.2e-308 at 37.64
(the old cap), 3.4e-2172 at 100.

What it guarantees. The bits define exact independent uniforms U1, U2 on (0, 1) and so an exact standard normal pair
Z = sqrt(-2 ln U1) (cos 2 pi U2, sin 2 pi U2), coupled with the output pair X so that on every draw

    |X_i - Z_i| <= c |Z| + a,  c = 2^-51 + 2 pi 2^-53 = 1.14e-15,  a = 2^-537        (i = 1, 2)

(exact arithmetic on the drawn bits, plus the few ulps of numpy's log, log1p, sqrt, cos and sin, not proven here; a
is the subnormal case). For any B > 0, |Z| <= B except with probability exp(-B^2 / 2) per pair (|Z|^2 / 2 is an exact
exponential), and then |X_i - Z_i| <= r_B = c B + a. Hence if a release f(D) + sigma N(0, I_d) is (epsilon, delta)-DP,
the release made with this sampler satisfies, for every event S, neighbours D, D' and every B (S^r: S enlarged by r
in every coordinate; the steps are the coupling, DP, the coupling again),

    P[M(D) in S] <= e^epsilon P[M(D') in S^(2 sigma r_B)] + delta + (1 + e^epsilon) ceil(d/2) exp(-B^2 / 2).

Taking B^2 = 2 (epsilon + ln ceil(d/2) + 800) makes the extra term at most 2 e^-800 = 1e-347, negligible against any
delta privfl accepts (>= 1e-100), for every epsilon, every noise multiplier and every d; the enlargement 2 sigma r_B
is then a few hundred ulps of sigma (1.4e-13 sigma at epsilon = 1000, the largest target calibration accepts, and
d = 1e12; it grows only as sqrt(epsilon)), the scale at which floating point decides anyway (the caveat below). The
old cap (R <= 37.64, V >= 2^-1022) gave the extra term (1 + e^epsilon) ceil(d/2) 2^-1020, not negligible above
epsilon ~ 420: a unit-sensitivity release with noise multiplier z puts mass P[N(0, 1) > 37.64 - 1/z] beyond the
other neighbour's support, more than delta = 1e-5 once z < 0.030, and more than any delta >= 1e-100 at the smallest
noise calibration returns (z = 0.021 to 0.035, one round at epsilon = 1000). This is a coupling, not a
total-variation bound against N(0, 1) rounded to float64: no float64 Box-Muller is close to that in total variation,
since it reaches only some of the floats.

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

_NORMAL_RUN = 1020              # V >= 2^-(1020 + 2) = 2^-1022 is a normal float64; longer runs are handled apart
_FAST_MIN_EXPONENT = 42         # frexp exponent of c >> 11 when the run is <= 10 and its word still holds 52 bits
_TWO_PI = 2.0 * math.pi
_LN2 = math.log(2.0)


def _words(random_bytes: RandomBytes, n: int) -> np.ndarray:
    """n little-endian 64-bit words from ``random_bytes``."""
    data = random_bytes(8 * n)
    if len(data) != 8 * n:
        raise ValueError(f"random_bytes({8 * n}) returned {len(data)} bytes")
    return np.frombuffer(data, dtype="<u8").astype(np.uint64, copy=False)


def _long_run(c: int, first_bit: int, random_bytes: RandomBytes) -> int:
    """The run of bits repeating ``first_bit`` after it, once it reaches the first word's last 11 bits (P = 2^-52),
    counted to its end however long it is (it ends with probability 1; each further word is needed with
    probability 2^-64).

    ``c`` is the first word with its bits flipped when ``first_bit`` is 1, so the run reads as zeros."""
    run = 63 - c.bit_length()
    flip = (1 << 64) - 1 if first_bit else 0
    while c == 0:
        c = int(_words(random_bytes, 1)[0]) ^ flip
        run += 64 - c.bit_length()
    return run


def _half_uniform_parts(n: int, random_bytes: RandomBytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n uniforms U in (0, 1) at full resolution near 0 and near 1, as (run, f, upper): V = min(U, 1 - U) rounded down
    to 53 significant bits is f 2^-(run + 2), f in [1, 2) a float64, run >= 0 with no bound, and upper = (U > 1/2).
    See the module docstring for the bit layout."""
    w = _words(random_bytes, n)
    flip = (w.view(np.int64) >> 63).view(np.uint64)        # all ones where the first bit is 1
    c = w ^ flip                                            # the run after the first bit now reads as zeros
    upper = flip != 0
    # c < 2^63, so c >> 11 < 2^52 converts exactly; its frexp exponent k is its bit length, and c's run is 52 - k.
    _, k = np.frexp((c >> np.uint64(11)).astype(np.float64))
    run = (52 - k).astype(np.int64)
    # Common case (run <= 10): the 52 bits after the run's end are still in this word.
    mantissa = (w << (run + 2).astype(np.uint64)) >> np.uint64(12)
    slow = np.flatnonzero(k < _FAST_MIN_EXPONENT)
    if slow.size:
        for i in slow[k[slow] == 0]:                        # run >= 52: count on, across words if need be
            run[i] = _long_run(int(c[i]), int(upper[i]), random_bytes)
        mantissa[slow] = _words(random_bytes, slow.size) >> np.uint64(12)
    return run, 1.0 + mantissa.astype(np.float64) * 2.0 ** -52, upper


def _half_uniform(n: int, random_bytes: RandomBytes) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_half_uniform_parts` as (V, upper), V = f 2^-(run + 2) a float64 (subnormal or 0 once run > 1020)."""
    run, f, upper = _half_uniform_parts(n, random_bytes)
    return np.ldexp(f, -(run + 2)), upper


def _exponential(n: int, random_bytes: RandomBytes) -> np.ndarray:
    """n draws of E = -ln U, U uniform on (0, 1) from :func:`_half_uniform_parts`: standard exponentials with
    relative error below 2^-51 and no upper bound (the module docstring)."""
    run, f, upper = _half_uniform_parts(n, random_bytes)
    v = np.ldexp(f, -(run + 2))
    with np.errstate(divide="ignore"):                           # log(0) where V underflowed: replaced below
        e = np.where(upper, np.log1p(-v), np.log(v))             # ln U1, with U1 = 1 - V above 1/2
    np.negative(e, out=e)
    if n and run.max() > _NORMAL_RUN:                            # V below the normal floats: never in practice
        deep = np.flatnonzero((run > _NORMAL_RUN) & ~upper)
        e[deep] = (run[deep] + 2) * _LN2 - np.log(f[deep])
    return e


def _radius(n: int, random_bytes: RandomBytes) -> np.ndarray:
    """n Box-Muller radii sqrt(-2 ln U1) = sqrt(2 E), E from :func:`_exponential` (no upper bound)."""
    squared = _exponential(n, random_bytes)
    squared *= 2.0
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
    """Noise from ``os.urandom`` through Box-Muller with full-resolution uniforms (tails without bound, each at its
    Gaussian probability; see the module docstring for the exact guarantee).

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
