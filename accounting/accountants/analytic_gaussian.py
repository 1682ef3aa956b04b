"""The exact (epsilon, delta) curve of a Gaussian mechanism, as a function of mu = sensitivity / noise_std.

A mu-Gaussian-DP mechanism (Dong, Roth and Su 2019) is (epsilon, delta)-DP exactly when

    delta(epsilon) = Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2)

(Balle and Wang 2018, Theorem 8; Dong, Roth and Su 2019, Corollary 2.13). Nothing in between is loose: this is the
tight privacy profile, so its inverse is the smallest epsilon any accountant could certify for that mechanism.

Everything is evaluated in log space so that tiny deltas, large epsilons and large mu neither overflow nor cancel:
with a = -epsilon/mu + mu/2 and b = -epsilon/mu - mu/2 one has b^2 - a^2 = 2 epsilon, hence, for a < 0,

    e^epsilon Phi(b) / Phi(a) = erfcx(-b/sqrt 2) / erfcx(-a/sqrt 2)   and   delta = Phi(a) (1 - that ratio).
"""

from __future__ import annotations

import math

from scipy import optimize, special

_SQRT2 = math.sqrt(2.0)
_MAX_BRACKET_STEPS = 200


def gaussian_log_delta(mu: float, epsilon: float) -> float:
    """log delta(epsilon) of a mu-GDP mechanism (Balle and Wang 2018, Thm 8); mu, epsilon >= 0; -inf when delta = 0."""
    if mu == 0.0:
        return -math.inf
    if math.isinf(mu):
        return 0.0
    a = -epsilon / mu + mu / 2.0
    b = -epsilon / mu - mu / 2.0
    if a < 0.0:
        ratio = special.erfcx(-b / _SQRT2) / special.erfcx(-a / _SQRT2)
        if ratio >= 1.0:
            return -math.inf
        return float(special.log_ndtr(a)) + math.log1p(-ratio)
    if epsilon < 1.0:
        # Phi(a) - e^eps Phi(b) = [Phi(a) - Phi(b)] - expm1(eps) Phi(b), and with b < 0 <= a the bracket is a sum of two
        # positive erf terms, so nothing cancels when mu and epsilon are tiny.
        delta = 0.5 * (special.erf(a / _SQRT2) + special.erf(-b / _SQRT2)) - math.expm1(epsilon) * special.ndtr(b)
        return math.log(delta) if delta > 0.0 else -math.inf
    # Here a >= 0 and epsilon >= 1, so mu >= sqrt(2) and delta >= 1/2 - e Phi(-sqrt 2) > 0.28: no cancellation.
    log_first = float(special.log_ndtr(a))
    log_second = epsilon + float(special.log_ndtr(b))
    if log_second >= log_first:
        return -math.inf
    return log_first + math.log1p(-math.exp(log_second - log_first))


def gaussian_delta(mu: float, epsilon: float) -> float:
    """delta(epsilon) of a mu-GDP mechanism (Balle and Wang 2018, Thm 8), in [0, 1]."""
    return min(1.0, math.exp(gaussian_log_delta(mu, epsilon)))


def _standard_zcdp_epsilon(mu: float, delta: float) -> float:
    """rho + 2 sqrt(rho log(1/delta)) with rho = mu^2/2 (Bun and Steinke 2016, Prop. 1.3): an upper bound on epsilon."""
    return mu * mu / 2.0 + mu * math.sqrt(2.0 * math.log(1.0 / delta))


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The smallest epsilon >= 0 with delta(epsilon) <= delta for a mu-GDP mechanism.

    delta(epsilon) is decreasing, so a bracketed root find in log space is robust; the returned value always satisfies
    delta(epsilon) <= delta (the safe side of the root). Returns 0 when (0, delta)-DP already holds.
    """
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    log_target = math.log(delta)

    def gap(eps: float) -> float:
        return gaussian_log_delta(mu, eps) - log_target

    if gap(0.0) <= 0.0:
        return 0.0
    hi = max(_standard_zcdp_epsilon(mu, delta), 1e-300)
    for _ in range(_MAX_BRACKET_STEPS):
        if gap(hi) <= 0.0:
            break
        hi *= 2.0
    else:  # pragma: no cover - the zCDP bound always brackets; guard against a hang regardless
        return math.inf
    xtol = 1e-14 * hi + 1e-300
    root = optimize.brentq(gap, 0.0, hi, xtol=xtol, rtol=4 * 2.220446049250313e-16, maxiter=500)
    return _safe_side(gap, root, hi, step=xtol, upward=True)


def gaussian_mu(epsilon: float, delta: float) -> float:
    """The largest mu whose Gaussian mechanism is (epsilon, delta)-DP, i.e. the inverse of delta(epsilon) in mu.

    delta(epsilon; mu) increases with mu. The zCDP bound gives a safe lower bracket; the result always satisfies
    delta(epsilon; mu) <= delta (the safe side of the root).
    """
    log_target = math.log(delta)

    def gap(mu: float) -> float:
        return gaussian_log_delta(mu, epsilon) - log_target

    root_log = math.sqrt(2.0 * math.log(1.0 / delta))
    # Solve mu^2/2 + mu sqrt(2 log 1/delta) = epsilon for mu; that mu meets the target under the looser zCDP bound.
    lo = 2.0 * epsilon / (root_log + math.sqrt(root_log * root_log + 2.0 * epsilon))
    for _ in range(_MAX_BRACKET_STEPS):
        if gap(lo) <= 0.0:
            break
        lo /= 2.0  # only numerical noise can bring us here
    hi = 2.0 * lo
    for _ in range(_MAX_BRACKET_STEPS):
        if gap(hi) > 0.0:
            break
        lo, hi = hi, 2.0 * hi
    xtol = 1e-14 * hi
    root = optimize.brentq(gap, lo, hi, xtol=xtol, rtol=4 * 2.220446049250313e-16, maxiter=500)
    return _safe_side(gap, root, lo, step=xtol, upward=False)


def _safe_side(gap, root: float, fallback: float, *, step: float, upward: bool) -> float:
    """Move ``root`` a few steps towards safety until gap(root) <= 0; ``fallback`` is known to be safe."""
    for i in range(8):
        if gap(root) <= 0.0:
            return root
        root = root + step * 2 ** i if upward else root - step * 2 ** i
    return fallback


__all__ = ["gaussian_log_delta", "gaussian_delta", "gaussian_epsilon", "gaussian_mu"]
