"""The discrete Gaussian and its distributed use with secure aggregation.

- Sampling N_Z(0, sigma^2), P[X = x] proportional to exp(-x^2 / (2 sigma^2)) on the integers, by the rejection
  sampler of Canonne, Kamath and Steinke (NeurIPS 2020, Alg. 3): draw Y from the discrete Laplace with scale
  t = floor(sigma) + 1 and accept it with probability exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2)).

  ``sample_discrete_gaussian`` is the fast, vectorised version: randomness comes from a passed-in numpy Generator or,
  with ``secure=True``, from the operating system's CSPRNG (``os.urandom``); the discrete Laplace is a difference of
  two geometric variables. With ``secure=True`` (every private run) each geometric is floor(t E) and the acceptance
  test is E' > (|Y| - sigma^2/t)^2 / (2 sigma^2), with E, E' standard exponentials -ln U drawn at full resolution
  (``mechanisms.noise``: no upper bound, relative error below 2^-51): P[floor(t E) >= k] = exp(-k/t) and
  P[E' > gamma] = exp(-gamma), so no tail is cut and every integer keeps its probability up to a relative error of
  about (|x|/t + x^2/sigma^2) 2^-50 (a multiplicative error, below 1e-12 out to 1000 sigma; beyond that the mass is
  below e^-500000). A uniform double (53 bits) would cut the geometric at 36.7 t and make the acceptance of
  |Y| - sigma^2/t beyond 8.6 sigma a coin of probability 2^-53 or 0: a share's support would end near 37 t, which
  breaks delta for a sum of few shares at small noise multipliers, as it did for the continuous sampler. With a
  seeded Generator (reproducible experiments) the inverse transform and the float acceptance on 53-bit uniforms are
  kept, so seeded streams are unchanged: their law is within about 1e-15 in total variation of N_Z(0, sigma^2), with
  the tails cut near 37 t. Outputs are integers, so the low-bit attack on floating-point noise (Mironov 2012) does
  not apply. ``sample_discrete_gaussian_exact`` implements
  CKS20 Algorithms 1-3 in exact rational arithmetic (``fractions``) with ``secrets``-grade randomness, for when an
  exact guarantee matters; it is pure Python and slow (about 10^4 samples per second).

- Accounting for distributed noise: each of n clients adds N_Z(0, sigma^2) shares before secure aggregation, so the
  sum carries the sum of n discrete Gaussians, which is *not* a discrete Gaussian. Kairouz, Liu and Steinke (ICML
  2021, "The distributed discrete Gaussian mechanism for federated learning with secure aggregation",
  arXiv:2102.06387, Proposition 14 / Theorem 1) bound its Renyi divergence for Delta in Z^d and every order a > 1 by
  the minimum of
      a/2 * L2^2 + tau d,
      a/2 * (L2^2 + 2 L1 tau + tau^2 d),
      a/2 * (L2 + tau sqrt(d))^2,
  with L2 = ||Delta||_2 / (sqrt(n) sigma), L1 = ||Delta||_1 / (sqrt(n) sigma),
  tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1)), and sigma >= 1/2.
  ``distributed_discrete_gaussian_event`` converts each term to rho-zCDP (D_a <= a rho for all a > 1) - the first
  conservatively, tau d <= a tau d - and takes the smallest: rho = min(L2^2/2 + tau d, (L2^2 + 2 L1 tau + tau^2 d)/2,
  (L2 + tau sqrt(d))^2 / 2). As sigma grows, tau -> 0 and rho -> ||Delta||_2^2 / (2 n sigma^2), the continuous value.
  The terms were checked against the authors' published accounting code and, term by term, against an independent
  transcription of Proposition 14 (sigma >= 1/2, the same tau, the same three minima; a test pins the three terms
  to their formulas and the continuous limit); the guarantee is charged for the worst
  number of summed shares in [n_min, n_max] (tau grows with n, the L2 term shrinks), and a secure-aggregation round
  with fewer than n_min inputs must abort (``secure_agg`` ``min_inputs``).
"""

from __future__ import annotations

import math
import os
import random
import secrets
from fractions import Fraction

import numpy as np

from ..accounting.events import ZCDPEvent
from .noise import _exponential

__all__ = [
    "sample_discrete_gaussian", "sample_discrete_gaussian_exact", "discrete_gaussian_pmf",
    "discrete_gaussian_variance", "distributed_discrete_gaussian_event", "distributed_noise_rho",
    "local_sigma", "kls_tau", "rounded_gaussian_total_variation", "distributed_gaussian_event",
    "GAUSSIAN_PROXY_DELTA_SHARE",
]


def _check_sigma(sigma) -> float:
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float, np.integer, np.floating)):
        raise ValueError(f"sigma must be a real number, got {sigma!r}")
    sigma = float(sigma)
    if not math.isfinite(sigma) or sigma <= 0:
        raise ValueError(f"sigma must be finite and > 0, got {sigma!r}")
    return sigma


def _check_size(size) -> tuple[int, ...]:
    shape = (size,) if isinstance(size, (int, np.integer)) else tuple(size)
    if not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ValueError(f"size must be a non-negative int or a tuple of them, got {size!r}")
    return tuple(int(s) for s in shape)


# ---------------------------------------------------------------------------------------------------- fast sampler
class _OsUniform:
    """Randomness from os.urandom (a CSPRNG): uniform doubles in [0, 1) with 53 random bits each, and standard
    exponentials -ln U at full resolution, without an upper bound (``mechanisms.noise._exponential``)."""

    def random(self, n: int) -> np.ndarray:
        words = np.frombuffer(os.urandom(8 * n), dtype="<u8")
        return (words >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)

    def exponential(self, n: int) -> np.ndarray:
        return _exponential(n, os.urandom)


class _GeneratorUniform:
    def __init__(self, rng: np.random.Generator):
        self._rng = rng

    def random(self, n: int) -> np.ndarray:
        return self._rng.random(n)


def _uniform_source(rng, secure: bool):
    if secure:
        if rng is not None:
            raise ValueError("pass either rng or secure=True, not both")
        return _OsUniform()
    if not isinstance(rng, np.random.Generator):
        raise TypeError("pass a numpy Generator as rng (np.random.default_rng(seed)), or secure=True for os.urandom")
    return _GeneratorUniform(rng)


def _discrete_laplace(source, t: int, n: int) -> np.ndarray:
    """n draws with P[Y = y] proportional to exp(-|y| / t): a difference of two geometric variables on {0, 1, ...}."""
    if hasattr(source, "exponential"):  # full-resolution exponentials: the geometric's tail is not cut
        g = np.floor(source.exponential(2 * n) * t).astype(np.int64)  # P[g >= k] = P[E >= k/t] = exp(-k/t)
        return g[:n] - g[n:]
    log_q = -1.0 / t
    u = source.random(2 * n)
    g = np.floor(np.log1p(-u) / log_q).astype(np.int64)  # P[g >= k] = exp(-k/t)
    return g[:n] - g[n:]


def _accept(source, y: np.ndarray, centre: float, two_var: float) -> np.ndarray:
    """Which draws of ``y`` pass CKS20's test, each with probability exp(-(|y| - centre)^2 / two_var)."""
    gamma = np.square(np.abs(y) - centre) / two_var
    if hasattr(source, "exponential"):
        return source.exponential(y.size) > gamma  # P[E > gamma] = exp(-gamma), however small
    return source.random(y.size) < np.exp(-gamma)


def sample_discrete_gaussian(sigma: float, size, *, rng: np.random.Generator | None = None,
                             secure: bool = False) -> np.ndarray:
    """``size`` i.i.d. draws of N_Z(0, sigma^2) as int64 (vectorised CKS20 rejection sampler).

    Randomness from ``rng`` (reproducible) or, with ``secure=True``, from os.urandom (then no tail is cut). See the
    module docstring for the floating-point caveats and ``sample_discrete_gaussian_exact`` for exact sampling.
    """
    sigma = _check_sigma(sigma)
    shape = _check_size(size)
    source = _uniform_source(rng, secure)
    total = math.prod(shape)
    out = np.empty(total, dtype=np.int64)
    t = math.floor(sigma) + 1
    centre = sigma * sigma / t
    two_var = 2.0 * sigma * sigma
    filled = 0
    while filled < total:
        batch = max(64, int(1.6 * (total - filled)) + 16)
        y = _discrete_laplace(source, t, batch)
        keep = y[_accept(source, y, centre, two_var)]
        take = min(keep.size, total - filled)
        out[filled:filled + take] = keep[:take]
        filled += take
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------------------- exact sampler
def _bernoulli(p: Fraction, rand: random.Random) -> bool:
    return rand.randrange(p.denominator) < p.numerator


def _bernoulli_exp_small(gamma: Fraction, rand: random.Random) -> bool:
    """Bernoulli(exp(-gamma)) for 0 <= gamma <= 1 (CKS20 Alg. 1, von Neumann's trick)."""
    k = 1
    while _bernoulli(gamma / k, rand):
        k += 1
    return k % 2 == 1


def _bernoulli_exp(gamma: Fraction, rand: random.Random) -> bool:
    """Bernoulli(exp(-gamma)) for gamma >= 0."""
    whole = math.floor(gamma)
    for _ in range(whole):
        if not _bernoulli_exp_small(Fraction(1), rand):
            return False
    return _bernoulli_exp_small(gamma - whole, rand)


def _discrete_laplace_exact(t: int, rand: random.Random) -> int:
    """P[Y = y] proportional to exp(-|y| / t), t a positive integer (CKS20 Alg. 2)."""
    while True:
        u = rand.randrange(t)
        if not _bernoulli_exp(Fraction(u, t), rand):
            continue
        v = 0
        while _bernoulli_exp(Fraction(1), rand):
            v += 1
        x = u + t * v
        negative = rand.randrange(2) == 1
        if negative and x == 0:
            continue
        return -x if negative else x


def sample_discrete_gaussian_exact(sigma_squared, size: int, *, rand: random.Random | None = None) -> np.ndarray:
    """``size`` exact draws of N_Z(0, sigma_squared) (CKS20 Alg. 3), sigma_squared a positive rational.

    ``sigma_squared`` may be an int, a ``Fraction`` or a decimal string ("2.25"); floats are converted exactly. The
    randomness is ``secrets.SystemRandom()`` unless a ``random.Random`` is passed (for reproducible tests).
    """
    s2 = Fraction(sigma_squared)
    if s2 <= 0:
        raise ValueError("sigma_squared must be > 0")
    n = _check_size(size)
    if len(n) != 1:
        raise ValueError("size must be an int")
    rand = rand if rand is not None else secrets.SystemRandom()
    t = math.isqrt(math.floor(s2)) + 1  # floor(sigma) + 1, since floor(sqrt(x)) = isqrt(floor(x))
    out = np.empty(n[0], dtype=np.int64)
    for i in range(n[0]):
        while True:
            y = _discrete_laplace_exact(t, rand)
            gamma = (abs(y) - s2 / t) ** 2 / (2 * s2)
            if _bernoulli_exp(gamma, rand):
                out[i] = y
                break
    return out


# ---------------------------------------------------------------------------------------------------- the law
def discrete_gaussian_pmf(values, sigma: float) -> np.ndarray:
    """P[X = x] for X ~ N_Z(0, sigma^2), normalised numerically over |x| <= 40 sigma + 40."""
    sigma = _check_sigma(sigma)
    half = int(math.ceil(40 * sigma)) + 40
    support = np.arange(-half, half + 1, dtype=np.float64)
    norm = np.exp(-support ** 2 / (2 * sigma * sigma)).sum()
    x = np.asarray(values, dtype=np.float64)
    return np.exp(-x ** 2 / (2 * sigma * sigma)) / norm


def discrete_gaussian_variance(sigma: float) -> float:
    """Var[N_Z(0, sigma^2)] (at most sigma^2, and within 1e-10 relative of it for sigma >= 1)."""
    sigma = _check_sigma(sigma)
    half = int(math.ceil(40 * sigma)) + 40
    support = np.arange(-half, half + 1, dtype=np.float64)
    p = discrete_gaussian_pmf(support, sigma)
    return float((p * support ** 2).sum())


# ---------------------------------------------------------------------------------------------------- accounting
def local_sigma(central_sigma: float, n_min: int) -> float:
    """Per-client sigma so that the sum of ``n_min`` shares has variance about ``central_sigma``^2."""
    central_sigma = _check_sigma(central_sigma)
    if isinstance(n_min, bool) or not isinstance(n_min, (int, np.integer)) or n_min < 1:
        raise ValueError(f"n_min must be a positive integer, got {n_min!r}")
    return central_sigma / math.sqrt(int(n_min))


def kls_tau(sigma: float, n: int) -> float:
    """tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1)) of Kairouz, Liu and Steinke (2021)."""
    k = np.arange(1, int(n), dtype=np.float64)
    return float(10.0 * np.exp(-2.0 * math.pi ** 2 * sigma ** 2 * k / (k + 1.0)).sum())


def distributed_noise_rho(*, l2_sensitivity: float, sigma: float, n: int, dimension: int,
                          l1_sensitivity: float | None = None) -> float:
    """rho-zCDP of the sum of exactly ``n`` N_Z(0, sigma^2)^d shares (see the module docstring for the bound).

    Sensitivities are in integer units (after scaling and rounding). Without ``l1_sensitivity`` the bound
    ||Delta||_1 <= min(sqrt(d) ||Delta||_2, ||Delta||_2^2), valid for integer vectors, is used.
    """
    sigma = _check_sigma(sigma)
    if sigma < 0.5:
        raise ValueError("the Kairouz-Liu-Steinke bound needs sigma >= 1/2 (integer units)")
    l2 = float(l2_sensitivity)
    if not math.isfinite(l2) or l2 <= 0:
        raise ValueError(f"l2_sensitivity must be finite and > 0, got {l2_sensitivity!r}")
    if isinstance(dimension, bool) or not isinstance(dimension, (int, np.integer)) or dimension < 1:
        raise ValueError(f"dimension must be a positive integer, got {dimension!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    d = int(dimension)
    l1 = min(math.sqrt(d) * l2, l2 * l2) if l1_sensitivity is None else float(l1_sensitivity)
    if not math.isfinite(l1) or l1 <= 0:
        raise ValueError(f"l1_sensitivity must be finite and > 0, got {l1_sensitivity!r}")
    scale = math.sqrt(n) * sigma
    a2, a1 = l2 / scale, l1 / scale
    tau = kls_tau(sigma, n)
    return min(a2 * a2 / 2 + tau * d,
               (a2 * a2 + 2 * a1 * tau + tau * tau * d) / 2,
               (a2 + tau * math.sqrt(d)) ** 2 / 2)


def distributed_discrete_gaussian_event(*, l2_sensitivity: float, sigma: float, n_min: int, dimension: int,
                                        l1_sensitivity: float | None = None, n_max: int | None = None) -> ZCDPEvent:
    """The zCDP event of distributed discrete Gaussian noise: each client adds N_Z(0, sigma^2)^d (integer units).

    Charged honestly for any number of summed shares n in [n_min, n_max] (``n_max`` defaults to ``n_min``): the
    largest rho over that range. The caller must abort rounds with fewer than ``n_min`` inputs in the sum.
    """
    if isinstance(n_min, bool) or not isinstance(n_min, (int, np.integer)) or n_min < 1:
        raise ValueError(f"n_min must be a positive integer, got {n_min!r}")
    n_max = n_min if n_max is None else n_max
    if isinstance(n_max, bool) or not isinstance(n_max, (int, np.integer)) or n_max < n_min:
        raise ValueError(f"n_max must be an integer >= n_min, got {n_max!r}")
    rho = max(distributed_noise_rho(l2_sensitivity=l2_sensitivity, sigma=sigma, n=n, dimension=dimension,
                                    l1_sensitivity=l1_sensitivity)
              for n in range(int(n_min), int(n_max) + 1))
    return ZCDPEvent(rho=rho, label="distributed_discrete_gaussian")


# ------------------------------------------------------------------------- the sum of shares as a rounded Gaussian
#: phi(1) / 4, phi the standard normal density: the constant of the rounding term E|Z^2 - 1| / 16 = 4 phi(1) / 16
_ROUNDING_CONSTANT = math.exp(-0.5) / math.sqrt(2.0 * math.pi) / 4.0


def _theta_excess(v: float) -> float:
    """omega(v) = 2 sum_{j >= 1} exp(-2 pi^2 v j^2), bounded above by 2 e^{-2 pi^2 v} / (1 - e^{-6 pi^2 v})
    (j^2 - 1 >= 3 (j - 1) for integers j >= 1)."""
    c = 2.0 * math.pi ** 2 * v
    return 2.0 * math.exp(-c) / -math.expm1(-3.0 * c)


def rounded_gaussian_total_variation(sigma: float, n_min: int, n_max: int | None = None) -> float:
    """An upper bound, over every number h in [n_min, n_max] of summed shares, on the total variation between the
    law of a sum of h independent N_Z(0, sigma^2) (one coordinate) and the law of round(N(0, h sigma^2)).

    Why it matters: with y = x + sum of h shares and x an integer vector, x + round(Z) = round(x + Z), so the
    "rounded Gaussian" release is a post-processing of the continuous Gaussian mechanism x + Z, Z ~ N(0, h sigma^2 I).
    The real release is within d times this bound (d coordinates, independent shares) of that post-processing, for
    every input: ``distributed_gaussian_event`` charges the continuous Gaussian with this total variation
    (``accounting.events.ApproximatedEvent``).

    Proof. Write g_V for the N(0, V) density, v = sigma^2, and omega(w) = 2 sum_{j >= 1} exp(-2 pi^2 w j^2). By
    Poisson summation, sum_k g_w(k - a) = 1 + 2 sum_{j >= 1} exp(-2 pi^2 w j^2) cos(2 pi j a), which lies in
    [1 - omega(w), 1 + omega(w)] for every real a, and equals Theta = 1 + omega(v) at w = v, a = 0, so
    N_Z(0, v) has mass g_v(k) / Theta at k.
    (1) The sum S_h of h shares has P[S_h = m] = g_{hv}(m) c_h(m) with c_h(m) in [L_h, U_h]: c_1 = 1 / Theta, and
    since g_{kv}(j) g_v(m - j) = g_{(k+1) v}(m) g_w(j - k m / (k + 1)) with w = k v / (k + 1) >= v / 2,
    P[S_{k+1} = m] = g_{(k+1) v}(m) / Theta sum_j c_k(j) g_w(j - k m / (k + 1)), so
    U_{k+1} = U_k (1 + omega(w)) / Theta and L_{k+1} = L_k (1 - omega(w)) / Theta. Hence
    U_h <= (1 + omega(v/2))^(h-1) and L_h >= (1 - omega(v/2))^(h-1) / (1 + omega(v))^h; let e_h be the larger of
    U_h - 1 and 1 - L_h. Then sum_m |P[S_h = m] - g_V(m)| <= e_h sum_m g_V(m) <= e_h (1 + omega(V)), V = h v.
    (2) round(N(0, V)) has mass r(m) = integral of g_V over [m - 1/2, m + 1/2]. Taylor's formula with integral
    remainder (the linear term integrates to 0 over the symmetric interval) gives
    |r(m) - g_V(m)| <= integral over [m - 1/2, m + 1/2] of |g_V''(t)| (1/2 - |t - m|)^2 / 2 dt
    <= (1/8) integral over [m - 1/2, m + 1/2] of |g_V''|, and the integral of |g_V''| over the line is
    E|Z^2 - 1| / V = 4 phi(1) / V. So sum_m |r(m) - g_V(m)| <= phi(1) / (2 V).
    The total variation is half the L1 distance: TV <= e_h (1 + omega(V)) / 2 + phi(1) / (4 V). e_h grows with h and
    the other terms shrink, so the bound at (e_{n_max}, V = n_min v) holds for every h in [n_min, n_max].

    With sigma in integer units of a fine quantiser (48 bits: sigma ~ 10^9 and more) the bound is ~1e-20 and below;
    at sigma ~ 1 it is ~0.05, too much for any delta (``privfl.privacy.secure``'s plans then charge the zCDP bound
    under rdp, or raise the noise under pld). Checked against exact convolutions in
    ``tests/mechanisms/test_rounded_gaussian.py`` (it holds, within 4x of the exact total variation).
    """
    sigma = _check_sigma(sigma)
    if isinstance(n_min, bool) or not isinstance(n_min, (int, np.integer)) or n_min < 1:
        raise ValueError(f"n_min must be a positive integer, got {n_min!r}")
    n_max = int(n_min) if n_max is None else n_max
    if isinstance(n_max, bool) or not isinstance(n_max, (int, np.integer)) or n_max < n_min:
        raise ValueError(f"n_max must be an integer >= n_min, got {n_max!r}")
    v = sigma * sigma
    if v < 1.0:
        return 1.0  # the bound is not useful here (omega(v/2) is no longer small); charge the zCDP bound instead
    half, whole = _theta_excess(v / 2.0), _theta_excess(v)
    h = int(n_max)
    upper = math.expm1((h - 1) * math.log1p(half))
    lower = -math.expm1((h - 1) * math.log1p(-half) - h * math.log1p(whole))
    excess = max(upper, lower)
    big_v = int(n_min) * v
    tv = excess * (1.0 + _theta_excess(big_v)) / 2.0 + _ROUNDING_CONSTANT / big_v
    return min(1.0, tv)


def distributed_gaussian_event(*, l2_sensitivity: float, sigma: float, n_min: int, dimension: int,
                               n_max: int | None = None):
    """The sum of ``n_min`` to ``n_max`` clients' N_Z(0, sigma^2)^d shares on an integer vector of L2 sensitivity
    ``l2_sensitivity`` (integer units), charged as the continuous Gaussian mechanism it nearly is:
    ``ApproximatedEvent(GaussianEvent(l2_sensitivity, sqrt(n_min) sigma), d * rounded_gaussian_total_variation)``.

    Sound for any number of shares h in [n_min, n_max]: with h > n_min shares the rounded Gaussian is
    round(x + Z_min + Z_extra), a post-processing of x + Z_min; the total variation bound covers every such h. The
    accountants compose the Gaussian (with Poisson sampling when the caller wraps it, the tight PLD of the sampled
    Gaussian) and add (1 + e^epsilon) times the summed total variation to delta, so the caller charges this event
    only where that term is small against its delta (``GAUSSIAN_PROXY_DELTA_SHARE``) and the zCDP bound
    (``distributed_discrete_gaussian_event``) otherwise: coarse quantisation, sigma of a few integer units.

    Like the zCDP bound, this accounts exact N_Z(0, sigma^2) shares. The secure sampler's probabilities are within a
    relative 1e-12 of them out to 1000 sigma (module docstring), a max-divergence of 1e-12 a share and coordinate,
    which would add at most 2e-12 n_max d per release to epsilon (2e-5 for 469 rounds of 10 shares of 1,970
    coordinates); it is not charged.
    """
    from ..accounting.events import ApproximatedEvent, GaussianEvent

    if isinstance(dimension, bool) or not isinstance(dimension, (int, np.integer)) or dimension < 1:
        raise ValueError(f"dimension must be a positive integer, got {dimension!r}")
    l2 = float(l2_sensitivity)
    if not math.isfinite(l2) or l2 <= 0:
        raise ValueError(f"l2_sensitivity must be finite and > 0, got {l2_sensitivity!r}")
    tv = min(0.5, int(dimension) * rounded_gaussian_total_variation(sigma, n_min, n_max))
    return ApproximatedEvent(GaussianEvent(l2, math.sqrt(int(n_min)) * float(sigma)), tv,
                             label="distributed_discrete_gaussian")


#: the share of a run's delta the total-variation term of ``distributed_gaussian_event`` may take, (1 + e^eps) times
#: the run's summed total variation at the target epsilon; above it a plan charges the zCDP bound instead
GAUSSIAN_PROXY_DELTA_SHARE = 0.01
