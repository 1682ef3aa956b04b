"""Renyi DP of a Poisson-subsampled mechanism known only to be rho-zCDP (e.g. a sum of discrete Gaussians).

Zhu and Wang (ICML 2019, "Poisson Subsampled Renyi Differential Privacy", Theorem 6, the general upper bound): if M
satisfies (l, eps(l))-RDP for every integer order l, then for every integer alpha >= 2 the mechanism that runs M on a
Poisson sample (each record kept with probability q; add/remove neighbours, both directions of the divergence) has

    eps'(alpha) <= 1/(alpha-1) log[ (1-q)^(alpha-1) (alpha q - q + 1)
                                    + C(alpha,2) q^2 (1-q)^(alpha-2) e^{eps(2)}
                                    + 3 sum_{l=3}^{alpha} C(alpha,l) (1-q)^(alpha-l) q^l e^{(l-1) eps(l)} ].

A rho-zCDP mechanism has eps(l) = rho l (Bun and Steinke 2016, Def. 1.1), so the exponents are (l-1) l rho. The factor
3 pays for the direction D_alpha(M(X) || M(X + x)); without it the sum is exactly the subsampled Gaussian's RDP for
rho = 1/(2 z^2) (Mironov, Talwar and Zhang 2019), which is why the bound is never below that.

Computed without cancellation: with w_l = C(alpha,l) (1-q)^(alpha-l) q^l, the first two terms of the sum are w_0 + w_1,
and sum_l w_l = 1, so the bracket is 1 + sum_{l>=2} w_l (c_l e^{(l-1) l rho} - 1), with c_2 = 1 and c_l = 3 above.
Every term of that sum is positive; its logarithm is a log-sum-exp of log w_l (log-binomials) and log(c_l e^x - 1),
so eps' is positive, never overflows at large alpha, and keeps full relative precision when it is tiny. The result
is also capped by rho alpha (sampling never costs privacy). Fractional orders get rho alpha only (the theorem is
for integer orders).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import special

_LOG_3 = math.log(3.0)


def _log_expm1(x: np.ndarray) -> np.ndarray:
    """log(e^x - 1) for x > 0, accurate for tiny and huge x."""
    return x + np.log(-np.expm1(-x))


def _integer_order_bound(q: float, rho: float, alpha: int) -> float:
    """Zhu and Wang's Theorem 6 at one integer order alpha >= 2 with eps(l) = rho l (not yet capped by rho alpha)."""
    ell = np.arange(2, alpha + 1, dtype=np.float64)
    log_binomial = special.gammaln(alpha + 1.0) - special.gammaln(ell + 1.0) - special.gammaln(alpha - ell + 1.0)
    log_weight = log_binomial + ell * math.log(q) + (alpha - ell) * math.log1p(-q)  # q < 1 here
    exponent = (ell - 1.0) * ell * rho
    # log(c_l e^x - 1): c_2 = 1; c_l = 3 for l >= 3, where 3 e^x - 1 = 2 + 3 (e^x - 1) > 0 even at x = 0
    excess = np.empty_like(exponent)
    excess[0] = _log_expm1(exponent[:1])[0] if exponent[0] > 0.0 else -np.inf
    rest = exponent[1:]
    excess[1:] = np.logaddexp(math.log(2.0), _LOG_3 + _log_expm1(np.maximum(rest, 1e-300)))
    with np.errstate(divide="ignore"):
        log_sum = float(special.logsumexp(log_weight + excess))
    return float(np.logaddexp(0.0, log_sum)) / (alpha - 1.0)


@functools.lru_cache(maxsize=512)
def _bound_cached(q: float, rho: float, orders: tuple[float, ...]) -> tuple[float, ...]:
    out = []
    for alpha in orders:
        cap = rho * alpha
        if alpha >= 2.0 and float(alpha).is_integer() and q < 1.0:
            out.append(min(cap, _integer_order_bound(q, rho, int(alpha))))
        else:
            out.append(cap)
    return tuple(out)


def poisson_sampled_zcdp_rdp(sampling_rate: float, rho: float, orders) -> np.ndarray:
    """RDP epsilon at each of ``orders`` of one Poisson-sampled (rate q, add/remove) rho-zCDP mechanism: Zhu and
    Wang's Theorem 6 at integer orders >= 2, capped by rho alpha; rho alpha alone at fractional orders. q = 1 is the
    mechanism itself (rho alpha); rho = inf gives inf."""
    q, rho = float(sampling_rate), float(rho)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sampling_rate must lie in (0, 1], got {sampling_rate!r}")
    if not rho >= 0.0:
        raise ValueError(f"rho must be >= 0, got {rho!r}")
    orders = tuple(float(a) for a in np.asarray(orders, dtype=np.float64).ravel())
    if rho == 0.0:
        return np.zeros(len(orders))
    if math.isinf(rho):
        return np.full(len(orders), math.inf)
    return np.array(_bound_cached(q, rho, orders), dtype=np.float64)


__all__ = ["poisson_sampled_zcdp_rdp"]
