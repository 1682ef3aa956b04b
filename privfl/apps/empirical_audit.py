"""Empirical privacy audit of the release path (a statistical lower bound on epsilon, Jagielski et al. 2020 style).

One client's worst-case neighbour: it contributes a vector of norm exactly C (neighbouring data: it contributes
zero). Each trial runs the release path the pipeline uses — per-client clip (``NormClip``) -> Gaussian noise of std
z*C -> stochastic quantisation to Z_{2^bits} -> modular sum with the other clients' (zero) contributions -> decode —
and a distinguisher thresholds the output's projection on the contribution's direction. Clopper-Pearson intervals on
its false- and true-positive rates give epsilon_lb with log((TPR_low - delta) / FPR_high) <= epsilon (for confidence
1 - 2 alpha). The threshold is chosen on half of the trials and evaluated on the other half, so the bound is honest.

If the implementation were wrong (noise too small, clipping missing) the lower bound would exceed the claimed epsilon:
``mutation`` injects exactly those faults so the tests can check that the audit notices them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

from privfl.accounting.accountants import make_accountant
from privfl.accounting.events import GaussianEvent
from privfl.mechanisms import GaussianMechanism, clip_per_example
from privfl.secure_agg import Quantiser

MUTATIONS = ("none", "half_noise", "no_clip")
#: the most trials one audit draws (about 250 bytes each: 10^7 trials take some 2.5 GB and a minute)
MAX_TRIALS = 10 ** 7
#: the largest noise multiplier audited: beyond it the claimed epsilon is below 1e-5 (a release of pure noise), and
#: far beyond it the noise's scale overflows
MAX_NOISE_MULTIPLIER = 1e6


@dataclass(frozen=True)
class AuditResult:
    claimed_epsilon: float
    epsilon_lower_bound: float
    delta: float
    trials: int
    noise_multiplier: float
    mutation: str
    threshold: float
    fpr_high: float
    tpr_low: float

    @property
    def passed(self) -> bool:
        return self.epsilon_lower_bound <= self.claimed_epsilon

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def _clopper_pearson(successes: int, n: int, alpha: float) -> tuple[float, float]:
    lo = 0.0 if successes == 0 else float(stats.beta.ppf(alpha, successes, n - successes + 1))
    hi = 1.0 if successes == n else float(stats.beta.ppf(1 - alpha, successes + 1, n - successes))
    return lo, hi


def epsilon_lower_bound(score_in: np.ndarray, score_out: np.ndarray, *, delta: float, alpha: float = 0.025
                        ) -> tuple[float, float, float, float]:
    """A black-box lower bound on epsilon from a distinguisher's scores on two neighbouring inputs (higher: more
    likely ``in``). The threshold is chosen on the first half of each sample (the point estimate of
    log(TPR / FPR) with FPR >= 10 / half), the rates are bounded on the second half by Clopper-Pearson intervals at
    level ``alpha`` each. Returns (epsilon lower bound, threshold, FPR upper bound, TPR lower bound)."""
    score_in, score_out = np.asarray(score_in, float), np.asarray(score_out, float)
    half = min(len(score_in), len(score_out)) // 2
    candidates = np.quantile(score_out[:half], np.linspace(0.5, 1 - 10.0 / half, 200))
    best_t, best = candidates[0], -np.inf
    for t in candidates:
        fpr = max(np.mean(score_out[:half] > t), 1.0 / half)
        tpr = np.mean(score_in[:half] > t)
        if tpr > delta and math.log((tpr - delta) / fpr) > best:
            best, best_t = math.log((tpr - delta) / fpr), t
    fp, n_out = int(np.sum(score_out[half:] > best_t)), len(score_out) - half
    tp, n_in = int(np.sum(score_in[half:] > best_t)), len(score_in) - half
    fpr_hi = _clopper_pearson(fp, n_out, alpha)[1]
    tpr_lo = _clopper_pearson(tp, n_in, alpha)[0]
    eps_lb = max(0.0, math.log((tpr_lo - delta) / fpr_hi)) if tpr_lo > delta else 0.0
    return eps_lb, float(best_t), fpr_hi, tpr_lo


def _release_path(contribution: np.ndarray, bound: float, noise_multiplier: float, *, mutation: str, clients: int,
                  bits: int, rng: np.random.Generator) -> np.ndarray:
    """Run every trial (rows of ``contribution``) through clip -> noise -> quantise -> modular sum -> decode."""
    clipped = contribution if mutation == "no_clip" else clip_per_example(contribution, bound).value
    z = noise_multiplier / 2 if mutation == "half_noise" else noise_multiplier
    noisy = clipped + GaussianMechanism(bound, z).noise(clipped.shape, rng)
    half = float(np.abs(noisy).max()) * 1.01 + bound
    quantiser = Quantiser(low=-half, high=half, bits=bits, n_clients=clients)
    total = quantiser.quantise(noisy.ravel(), rng)
    zero = quantiser.quantise(np.zeros(noisy.size), rng)
    for _ in range(clients - 1):  # the other clients contribute zero (noise-free here: the worst case)
        total = (total + zero) & np.uint64(quantiser.modulus - 1)
    return quantiser.decode_sum(total, clients).reshape(noisy.shape)


def audit_gaussian_release(noise_multiplier: float, *, delta: float = 1e-5, trials: int = 100_000, dimension: int = 4,
                           bound: float = 1.0, mutation: str = "none", clients: int = 3, bits: int = 48,
                           alpha: float = 0.025, seed: int = 0) -> AuditResult:
    """Lower-bound epsilon of one release of the path with noise multiplier ``noise_multiplier``.

    The claimed epsilon is the exact accountant's for one GaussianEvent(C, z*C) at ``delta``.
    """
    if mutation not in MUTATIONS:
        raise ValueError(f"mutation must be one of {MUTATIONS}, got {mutation!r}")
    if isinstance(trials, bool) or not isinstance(trials, int) or not 1000 <= trials <= MAX_TRIALS:
        raise ValueError(f"trials must be an integer between 1000 and {MAX_TRIALS} (memory grows with them), got "
                         f"{trials!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if (isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, (int, float))
            or not 0 < noise_multiplier <= MAX_NOISE_MULTIPLIER):
        raise ValueError(f"noise_multiplier must be a number in (0, {MAX_NOISE_MULTIPLIER:g}] (beyond it the release "
                         f"is pure noise, its claimed epsilon below 1e-5), got {noise_multiplier!r}")
    rng = np.random.default_rng(seed)
    direction = np.ones(dimension) / math.sqrt(dimension)
    # The adversary's contribution: norm exactly C, or 4C when it hopes the clip is missing.
    scale = 4.0 if mutation == "no_clip" else 1.0
    present = np.tile(direction * bound * scale, (trials, 1))
    absent = np.zeros((trials, dimension))
    score_in = _release_path(present, bound, noise_multiplier, mutation=mutation, clients=clients, bits=bits,
                             rng=rng) @ direction
    score_out = _release_path(absent, bound, noise_multiplier, mutation=mutation, clients=clients, bits=bits,
                              rng=rng) @ direction
    eps_lb, best_t, fpr_hi, tpr_lo = epsilon_lower_bound(score_in, score_out, delta=delta, alpha=alpha)
    claimed = make_accountant("exact").compose(GaussianEvent(bound, noise_multiplier * bound)).get_epsilon(delta)
    return AuditResult(claimed, eps_lb, delta, trials, noise_multiplier, mutation, float(best_t), fpr_hi, tpr_lo)
