"""The server's Gaussian product over natural parameters (HBFL eq. 3.12, FOLA eq. 12), from weighted sums only.

A client k with diagonal Gaussian N(mu_k, Lambda_k^-1) releases its natural parameters: the natural mean
``eta_k = Lambda_k * mu_k`` and the precision ``Lambda_k`` (two channels). With weights q_k (e.g. n_k / n) the
product prod_k N(mu_k, Lambda_k^-1)^{q_k} is, up to normalisation, the Gaussian with

    Lambda = sum_k q_k Lambda_k,        mu = Lambda^-1 sum_k q_k Lambda_k mu_k = Lambda^-1 sum_k q_k eta_k.

Both sums are weighted sums of releases, so the server needs nothing but :class:`privfl.core.aggregation.Aggregate`
objects and secure aggregation can hide every individual upload. With equal precisions mu is FedAvg's weighted mean.

Post-processing (after release, so it costs no privacy; see ARCHITECTURE.md):

- **precision floor**: a noisy precision can be tiny or negative; it is raised to ``precision_floor`` (the prior
  precision: a posterior is never meant to be vaguer than the prior) before dividing, so mu stays finite.
- **known noise variance**: the aggregates carry the std of the DP noise they contain.
  With a ``reference_mean`` m0 (a noise-free guess such as the previous global mean), the division eta / Lambda is
  regularised against the precision's noise s_Lambda: mu = argmin_m (eta - Lambda m)^2 + s_Lambda^2 (m - m0)^2
  = m0 + Lambda (eta - Lambda m0) / (Lambda^2 + s_Lambda^2). It equals eta / Lambda without noise and tends to m0
  where the precision is mostly noise (a noisy precision near 0 would otherwise blow the mean up).
  With ``fold_noise`` the noise in eta and Lambda is folded into the result's uncertainty: by the delta method the
  mean has error variance v = (s_eta^2 + mu^2 s_Lambda^2) / Lambda^2, and the returned precision is
  1 / (1/Lambda + v): the noisier the release, the less the next round's prior trusts the mean.
- **empirical Bayes** (:func:`shrink_by_known_noise`): where a coordinate's released value is mostly noise, the
  per-coordinate rules above still pass much of that noise on. Pooling a group of coordinates (a layer) gives a
  method-of-moments estimate of how much of their spread is signal; each value is then shrunk towards the group's
  centre by exactly that fraction (FOLA's record-level server uses it for its Fisher and its Fisher-weighted
  correction).

Usage (server step of HBFL or FOLA)::

    post = gaussian_product(aggregates["natural_mean"], aggregates["precision"], precision_floor=prior_precision)
    global_mean, global_precision = post.mean, post.precision
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from privfl.core.aggregation import Aggregate
from privfl.errors import ConfigurationError


@dataclass(frozen=True)
class GaussianProduct:
    """The aggregated diagonal Gaussian: ``mean``, ``precision``, and how many precision coordinates were floored."""

    mean: np.ndarray
    precision: np.ndarray
    floored: int = 0

    @property
    def natural_mean(self) -> np.ndarray:
        return self.mean * self.precision


def natural_parameters(mean: np.ndarray, precision: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Client side: (natural mean Lambda * mu, precision Lambda), the two values a client releases."""
    mean = np.asarray(mean, dtype=np.float64)
    precision = np.asarray(precision, dtype=np.float64)
    if mean.shape != precision.shape:
        raise ConfigurationError(f"mean and precision must have the same shape, got {mean.shape} and "
                                 f"{precision.shape}")
    if np.any(precision <= 0) or not np.all(np.isfinite(precision)):
        raise ConfigurationError("a precision must be finite and > 0 everywhere")
    return mean * precision, precision


def _floor(value, name: str) -> np.ndarray | float:
    arr = np.asarray(value, dtype=np.float64)
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ConfigurationError(f"{name} must be finite and > 0 (the prior precision), got {value!r}")
    return arr


def combine(natural_mean: np.ndarray, precision: np.ndarray, *, precision_floor: float | np.ndarray,
            natural_noise_std: float | np.ndarray = 0.0, precision_noise_std: float | np.ndarray = 0.0,
            fold_noise: bool = False,
            reference_mean: np.ndarray | None = None) -> GaussianProduct:
    """The Gaussian with natural parameters (``natural_mean``, ``precision``): both already *averaged*
    (sum_k q_k eta_k and sum_k q_k Lambda_k with sum_k q_k = 1), possibly noisy.

    ``precision_floor``: scalar or per-coordinate floor (> 0). ``*_noise_std``: per-coordinate std of the noise in
    the averaged values (0 when there is none). ``reference_mean``: regularise the division towards it by the
    precision's noise; ``fold_noise``: fold the noise into the precision (both in the module docstring).
    """
    eta = np.asarray(natural_mean, dtype=np.float64)
    lam = np.asarray(precision, dtype=np.float64)
    if eta.shape != lam.shape:
        raise ConfigurationError(f"natural mean and precision must have the same shape, got {eta.shape} and "
                                 f"{lam.shape}")
    if not (np.all(np.isfinite(eta)) and np.all(np.isfinite(lam))):
        raise ConfigurationError("the aggregated natural parameters have non-finite entries")
    for name, s in (("natural_noise_std", natural_noise_std), ("precision_noise_std", precision_noise_std)):
        arr = np.asarray(s, dtype=np.float64)
        if not (np.all(np.isfinite(arr)) and np.all(arr >= 0)) or arr.shape not in ((), eta.shape):
            raise ConfigurationError(f"{name} must be finite, >= 0, and a scalar or per coordinate, got {s!r}")
    natural_noise_std = np.asarray(natural_noise_std, dtype=np.float64)
    precision_noise_std = np.asarray(precision_noise_std, dtype=np.float64)
    floor = _floor(precision_floor, "precision_floor")
    below = lam < floor
    lam = np.maximum(lam, floor)
    if reference_mean is not None and np.any(precision_noise_std > 0):
        m0 = np.asarray(reference_mean, dtype=np.float64)
        if m0.shape != eta.shape or not np.all(np.isfinite(m0)):
            raise ConfigurationError(f"reference_mean must be finite with shape {eta.shape}")
        mean = m0 + lam * (eta - lam * m0) / (lam ** 2 + precision_noise_std ** 2)
    else:
        mean = eta / lam
    if fold_noise and (np.any(natural_noise_std > 0) or np.any(precision_noise_std > 0)):
        mean_var = (natural_noise_std ** 2 + mean ** 2 * precision_noise_std ** 2) / lam ** 2
        lam = 1.0 / (1.0 / lam + mean_var)
    return GaussianProduct(mean, lam, int(np.count_nonzero(below)))


def shrink_by_known_noise(observed: np.ndarray, noise_std: float | np.ndarray, groups: Sequence[tuple[int, int]], *,
                          centre: str = "group_mean", margin: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Empirical-Bayes estimates of noisy coordinates whose noise std is known (a DP release's), group by group.

    Within a group (e.g. one layer of a network) the true values are modelled as draws from
    N(c, v) and each observation as true value + N(0, s_i^2), s_i known. ``centre`` "group_mean": c is the group's
    mean observation; "zero": c = 0. v is the method-of-moments estimate, the observations' mean squared spread
    about c less the mean noise variance, floored at 0 (James and Stein's estimator with known variances). On pure
    noise that estimate keeps a fluctuation of order sqrt(2 / n) of the noise variance about half the time;
    ``margin`` lowers it by that many standard errors of the difference under pure noise (sqrt(2 mean(s^4) / n)), so
    that a group's spread counts as signal only where it stands clear of what noise alone produces (a guard for
    groups that may hold no signal at all, at the price of shrinking weak signal away too). Returns the posterior mean
    c + (x - c) v / (v + s^2) and the posterior variance v s^2 / (v + s^2) of every coordinate: with no noise the
    observations themselves (variance 0); where the spread is noise, c (the whole group pooled). ``groups``:
    ``(start, stop)`` slices that cover the vector. Post-processing of released values: it costs no privacy.
    """
    x = np.asarray(observed, dtype=np.float64)
    s2 = np.broadcast_to(np.asarray(noise_std, dtype=np.float64) ** 2, x.shape)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0 or math.isinf(margin):
        raise ConfigurationError(f"margin must be a finite number >= 0, got {margin!r}")
    if centre not in ("group_mean", "zero"):
        raise ConfigurationError(f"centre must be 'group_mean' or 'zero', got {centre!r}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(s2))):
        raise ConfigurationError("shrink_by_known_noise: observations and noise stds must be finite")
    covered = np.zeros(x.shape, dtype=bool)
    estimate, variance = np.empty_like(x), np.zeros_like(x)
    for start, stop in groups:
        if not 0 <= start < stop <= x.size or covered[start:stop].any():
            raise ConfigurationError(f"groups must be disjoint, non-empty slices of the {x.size} coordinates; got "
                                     f"({start}, {stop})")
        covered[start:stop] = True
        xs, ss = x[start:stop], s2[start:stop]
        c = float(xs.mean()) if centre == "group_mean" else 0.0
        spread = float(np.mean((xs - c) ** 2) - ss.mean())
        v = max(spread - margin * math.sqrt(2.0 * float(np.mean(ss ** 2)) / xs.size), 0.0)
        quiet = (v + ss) == 0  # no noise and no spread: the observation is the value
        total = np.where(quiet, 1.0, v + ss)
        estimate[start:stop] = c + (xs - c) * np.where(quiet, 1.0, v / total)
        variance[start:stop] = v * ss / total
    if not covered.all():
        raise ConfigurationError(f"groups must cover all {x.size} coordinates")
    return estimate, variance


def gaussian_product(natural_mean: Aggregate, precision: Aggregate, *, precision_floor: float | np.ndarray,
                     fold_noise: bool = False, reference_mean: np.ndarray | None = None) -> GaussianProduct:
    """Server step: the product of the clients' Gaussians from the two channels' weighted sums.

    Divides each sum by its total weight (so weights q_k = w_k / sum w), floors the precision, and uses the
    aggregates' known DP noise with ``reference_mean`` and ``fold_noise`` (module docstring).
    """
    for agg in (natural_mean, precision):
        if not isinstance(agg, Aggregate):
            raise ConfigurationError(f"gaussian_product takes Aggregate objects, got {type(agg).__name__}; for "
                                     "plain arrays use combine() or product_of_gaussians()")
        if not agg.total_weight > 0:
            raise ConfigurationError(f"channel {agg.channel}: total weight must be > 0, got {agg.total_weight}")
    if not np.isclose(natural_mean.total_weight, precision.total_weight):
        raise ConfigurationError(f"the natural mean and precision sums have different total weights "
                                 f"({natural_mean.total_weight} vs {precision.total_weight}): they must come from "
                                 "the same clients' releases")
    w = precision.total_weight
    return combine(natural_mean.total / w, precision.total / w, precision_floor=precision_floor,
                   natural_noise_std=natural_mean.noise_std / w, precision_noise_std=precision.noise_std / w,
                   fold_noise=fold_noise, reference_mean=reference_mean)


def product_of_gaussians(means: Sequence[np.ndarray], precisions: Sequence[np.ndarray],
                         weights: Sequence[float] | None = None, *,
                         precision_floor: float | np.ndarray = 1e-12) -> GaussianProduct:
    """The same product from per-client arrays (a reference for tests and centralised runs; the server never sees
    these): prod_k N(mu_k, Lambda_k^-1)^{q_k} with q_k = w_k / sum w (uniform if ``weights`` is None)."""
    if len(means) != len(precisions) or not len(means):
        raise ConfigurationError("give one precision per mean, for at least one client")
    w = np.ones(len(means)) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (len(means),) or np.any(w < 0) or not w.sum() > 0:
        raise ConfigurationError("weights must be one non-negative number per client, not all zero")
    q = w / w.sum()
    eta = sum(qk * natural_parameters(m, p)[0] for qk, m, p in zip(q, means, precisions))
    lam = sum(qk * np.asarray(p, dtype=np.float64) for qk, p in zip(q, precisions))
    return combine(eta, lam, precision_floor=precision_floor)


__all__ = ["GaussianProduct", "combine", "gaussian_product", "natural_parameters", "product_of_gaussians",
           "shrink_by_known_noise"]
