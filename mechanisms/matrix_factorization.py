"""Banded Toeplitz matrix factorisation: correlated noise across the steps of a private training run (DP-FTRL).

The mechanism (Denisov et al., NeurIPS 2022; Choquette-Choo et al., NeurIPS 2023, "amplified banded MF"): a run
of n steps releases, at step t, ``y_t = sum_{k < b} c_k x_{t-k} + z_t`` (the strategy matrix C, lower-triangular
Toeplitz with b bands, applied to the stream of clipped gradient sums x; fresh Gaussian noise z_t every step); the
server decodes ``x_hat = C^{-1} y = x + C^{-1} z``. The noise the model sees is correlated across steps: an SGD-type
model is a linear function A x of the gradients (the workload: prefix sums, with momentum beta the coefficients
(1 - beta^{m+1}) / (1 - beta)), and its error is ``A C^{-1} z``, whose size the strategy minimises.

Sensitivity: with ``||c|| = 1`` every column of C has L2 norm at most 1, so one participation of a record moves the
whole released stream by at most its clipped norm. With b-min-separated participation (the records split at random
into b groups, group ``t mod b`` sampled at step t), one record's participations touch disjoint blocks of b rows,
and the run is the composition of ceil(n / b) Poisson-sampled Gaussians at the group's sampling rate (the
accounting is the caller's: ``privfl.core.channels.Channel.record_bands``).

Only numpy and scipy: the strategy is an IIR filter (C^{-1} of a lower-triangular Toeplitz matrix is the power series
of 1 / c(x)), so the objective and its gradient cost O(n b) per evaluation; the coefficients are cached per
(n, b, beta).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy.optimize import minimize
from scipy.signal import lfilter

from .errors import InvalidRelease


def _check(n: int, bands: int, momentum: float) -> tuple[int, int, float]:
    for name, value in (("steps", n), ("bands", bands)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InvalidRelease(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise InvalidRelease(f"momentum must be a number in [0, 1), got {momentum!r}")
    return int(n), int(bands), float(momentum)


def workload(n: int, momentum: float = 0.0) -> np.ndarray:
    """The first column of the lower-triangular Toeplitz workload A (how step t's model depends on step j's
    gradient): ``(1 - beta^{m+1}) / (1 - beta)`` for m = t - j (prefix sums when beta = 0)."""
    n, _, beta = _check(n, 1, momentum)
    m = np.arange(n, dtype=np.float64)
    return np.ones(n) if beta == 0 else (1.0 - beta ** (m + 1)) / (1.0 - beta)


def squared_error(coefficients, n: int, momentum: float = 0.0) -> float:
    """``||A C^{-1}||_F^2`` for the b-banded Toeplitz C of ``coefficients`` normalised to unit norm (every column's
    norm at most 1): the total variance, over all n steps' models, of the noise ``A C^{-1} z`` per unit of noise
    variance. The identity (b = 1) gives independent noise's error."""
    c = np.asarray(coefficients, dtype=np.float64)
    e = lfilter([1.0], c / np.linalg.norm(c), workload(n, momentum))
    return float(np.dot(np.arange(n, 0, -1, dtype=np.float64), e * e))


def _objective(c: np.ndarray, a: np.ndarray, w: np.ndarray) -> tuple[float, np.ndarray]:
    """f(c) = ||c||^2 sum_m w_m e_m^2 with e = a / c (power series), and its gradient: de_m / dc_k = -h_{m-k},
    h = e / c."""
    norm2 = float(np.dot(c, c))
    e = lfilter([1.0], c, a)
    h = lfilter([1.0], c, e)
    s = float(np.dot(w, e * e))
    we = w * e
    n = len(a)
    cross = np.array([np.dot(we[k:], h[:n - k]) for k in range(len(c))])
    return norm2 * s, 2.0 * c * s - 2.0 * norm2 * cross


def square_root_coefficients(n: int, bands: int, momentum: float = 0.0) -> np.ndarray:
    """The banded square root of the workload (Kalinin and Lampert 2024): the first b coefficients of the power
    series r with r * r = a, normalised to unit norm. The optimiser's starting point."""
    n, bands, beta = _check(n, bands, momentum)
    a = workload(min(n, bands), beta)
    r = np.zeros(len(a))
    r[0] = math.sqrt(a[0])
    for m in range(1, len(a)):
        r[m] = (a[m] - np.dot(r[1:m], r[m - 1:0:-1])) / (2.0 * r[0])
    return r / np.linalg.norm(r)


@functools.lru_cache(maxsize=64)
def _optimised(n: int, bands: int, momentum: float) -> tuple[float, ...]:
    start = square_root_coefficients(n, bands, momentum)
    if len(start) == 1:
        return (1.0,)
    a = workload(n, momentum)
    w = np.arange(n, 0, -1, dtype=np.float64)
    scale = _objective(start, a, w)[0]

    def fun(c):
        f, g = _objective(c, a, w)
        return f / scale, g / scale

    bounds = [(1e-3, None)] + [(None, None)] * (len(start) - 1)  # c_0 > 0: C stays invertible
    res = minimize(fun, start, jac=True, method="L-BFGS-B", bounds=bounds,
                   options={"maxiter": 2000, "ftol": 1e-12, "gtol": 1e-9})
    best = res.x if res.fun <= 1.0 else start  # never worse than the square root it started from
    best = best / np.linalg.norm(best)
    return tuple(float(v) for v in best)


def banded_toeplitz(n: int, bands: int, momentum: float = 0.0) -> np.ndarray:
    """The unit-norm coefficients c_0..c_{b-1} of the b-banded lower-triangular Toeplitz strategy C that minimises
    :func:`squared_error` for n steps (L-BFGS from the banded square root; cached). ``bands = 1``: ``[1.0]``,
    independent noise. Deterministic given (n, b, beta); the caller may hold the result as a public fact."""
    n, bands, beta = _check(n, bands, momentum)
    return np.array(_optimised(n, min(bands, n), beta))


class BandedEncoder:
    """A client's side of the strategy: ``encode(x_t)`` returns ``sum_k c_k x_{t-k}`` from the last b - 1 values it
    keeps (zero before the first step, and for a step it missed: :meth:`skip`). Its ``history`` (rows newest first)
    is the client's own state."""

    def __init__(self, coefficients, history=None):
        self.c = np.asarray(coefficients, dtype=np.float64)
        self.history = None if history is None else np.asarray(history, dtype=np.float64)

    def skip(self, steps: int) -> None:
        """``steps`` steps passed without a value (a round the client missed): each counts as x = 0, so the next
        value is mixed with the right coefficients (c_k for the value k steps back, absolute steps)."""
        b = len(self.c)
        if steps <= 0 or self.history is None or b == 1:
            return
        zeros = np.zeros((min(int(steps), b - 1), *self.history.shape[1:]))
        self.history = np.concatenate([zeros, self.history])[:b - 1]

    def encode(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        b = len(self.c)
        out = self.c[0] * x
        if self.history is not None:
            for k in range(1, min(b, len(self.history) + 1)):
                out = out + self.c[k] * self.history[k - 1]
        if b > 1:
            rows = [x] if self.history is None else [x, *self.history[:b - 2]]
            self.history = np.stack(rows)
        return out


class BandedDecoder:
    """The server's side: ``decode(y_t)`` returns ``x_hat_t = (y_t - sum_{k >= 1} c_k x_hat_{t-k}) / c_0``, the
    rows of C^{-1} y in order (post-processing of the released stream)."""

    def __init__(self, coefficients, history=None):
        self.encoder = BandedEncoder(coefficients, history)

    @property
    def history(self):
        return self.encoder.history

    def skip(self, steps: int) -> None:
        """``steps`` steps passed without a released value (an aborted round): decoded as zeros."""
        self.encoder.skip(steps)

    def decode(self, y: np.ndarray) -> np.ndarray:
        c, enc = self.encoder.c, self.encoder
        rest = np.zeros_like(np.asarray(y, dtype=np.float64))
        if enc.history is not None:
            for k in range(1, min(len(c), len(enc.history) + 1)):
                rest = rest + c[k] * enc.history[k - 1]
        x = (np.asarray(y, dtype=np.float64) - rest) / c[0]
        enc.encode(x)  # keeps x_hat_t in the history (the encoded value itself is not needed)
        return x


__all__ = ["BandedDecoder", "BandedEncoder", "banded_toeplitz", "square_root_coefficients", "squared_error",
           "workload"]
