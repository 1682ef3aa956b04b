"""Sources of Gaussian noise.

The random generator is always passed in. ``SeededNoise`` wraps a ``numpy.random.Generator`` (reproducible from a
seed, for experiments). ``SecureNoise`` draws from the operating system's CSPRNG (``os.urandom``) and refuses a seed:
a deployment should not be able to replay its noise. Both produce standard normal float64 arrays.

Caveat (Mironov, CCS 2012): floating-point samplers leak through the low bits of their output; the discrete Gaussian
(``mechanisms.discrete_gaussian``) used with secure aggregation does not have that problem.
"""

from __future__ import annotations

import os

import numpy as np

from mechanisms.errors import ReleaseMisuse


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
    """Noise from ``os.urandom`` through the Box-Muller transform on 53-bit uniforms.

    ``SecureNoise(seed=...)`` raises: a cryptographically secure source is not reproducible by design.
    """

    secure = True

    def __init__(self, seed=None):
        if seed is not None:
            raise ReleaseMisuse("SecureNoise draws from the OS CSPRNG and cannot be seeded; "
                                "use SeededNoise(seed) for reproducible experiments")

    @staticmethod
    def _uniform_open(n: int) -> np.ndarray:
        """n uniforms in (0, 1]: 53 random bits each, from os.urandom."""
        bits = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(11)
        return (bits.astype(np.float64) + 1.0) * (1.0 / 9007199254740992.0)

    def standard_normal(self, shape) -> np.ndarray:
        size = int(np.prod(shape, dtype=np.int64)) if np.ndim(shape) else int(shape)
        pairs = (size + 1) // 2
        u1 = self._uniform_open(pairs)
        u2 = self._uniform_open(pairs)
        radius = np.sqrt(-2.0 * np.log(u1))
        angle = 2.0 * np.pi * u2
        out = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:size]
        return out.reshape(shape)


def as_noise_source(source) -> NoiseSource:
    """Accept a NoiseSource, a numpy Generator, an int seed, or the string 'secure'."""
    if isinstance(source, NoiseSource):
        return source
    if isinstance(source, str):
        if source == "secure":
            return SecureNoise()
        raise ValueError(f"unknown noise source {source!r}; pass 'secure', a numpy Generator or an int seed")
    return SeededNoise(source)
