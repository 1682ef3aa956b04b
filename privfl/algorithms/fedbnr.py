"""FedBNR (Yu et al. 2022): a global federated GP by Bayesian linear regression on a kernel network's features, made
record-level private by sufficient-statistics perturbation.

The model: f(x) = w^T phi(x), w ~ N(0, lambda^2 I), y = f(x) + N(0, sigma^2), where phi is a kernel network
(``privfl.models.features``: random Fourier features from a public seed, optionally after a learned extractor) or,
by default when neither an extractor nor phase 1 is used, a linear block with a bias beside the random Fourier
features (``LinearRandomFourierFeatures``, prior share ``linear_share``: the kernel a k_lin + (1 - a) k_gauss). The
posterior over w is N(w_bar, A^-1) with (eqs. 20-21)

    A = sigma^-2 sum_c Phi_c^T Phi_c + lambda^-2 I,        w_bar = sigma^-2 A^-1 sum_c Phi_c^T y_c,

so the clients' **scatter** ``Phi_c^T Phi_c`` and **cross** ``Phi_c^T y_c`` sums are sufficient statistics: phase 2
is exact, equal to centralised Bayesian linear regression on the pooled data. (The paper's second upload
``sigma^-2 A^-1 Phi_c^T y_c`` is a public linear map of ``Phi_c^T y_c``; privfl releases the latter and lets the
server apply A^-1, which needs one round instead of two.) The prediction at x is N(phi^T w_bar, sigma^2 +
phi^T A^-1 phi) (eq. 13).

Privacy (record level, add/remove one record unless the config says replace one)
--------------------------------------------------------------------------------
- ``scatter``: each feature row is clipped (scaled) to norm B (``privacy.clip``; RFF rows have norm 1, so B = 1
  clips nothing). The channel is ``symmetric``: Gaussian noise on the upper triangle including the diagonal,
  mirrored (Analyze Gauss, Dwork et al. 2014), so what one record moves is the upper triangle of phi phi^T, of
  squared norm (|phi|^4 + sum_i phi_i^4) / 2. For any rows that is at most B^4: ``PreClipped(B, "squared_sum")``
  (sqrt(2) B^2 under replace-one). The feature maps of ``privfl.models.features`` make rows of m (cos, sin) pairs of equal
  norm, whatever extractor comes first, so sum_i phi_i^4 <= |phi|^4 / m and the release moves by at most
  B^2 sqrt((1 + 1/m) / 2) (add/remove) or B^2 sqrt(1 + 1/m) (replace-one), both attained:
  :class:`PairedScatter`, declared when ``cos_sin_pairs`` recognises the feature map (m = ``num_samples``, the
  number of frequencies, not the 2m features), with every row's pairs checked before release. At m = 20 that is
  0.7246 B^2, at m = 50 0.7141 B^2. The default features with a linear block are not pairs only: they declare T,
  the sup over rows clipped to B of the upper triangle's norm of phi phi^T, computed per radius of the linear block
  (``LinearRandomFourierFeatures.term_square_bound``); the release moves by at most T (add/remove) or sqrt(2) T
  (replace-one), :class:`ScatterBound`, and every row's term is checked against it before release (at a = 0.9,
  m = 50, B = 1: T = 0.838, approached by rows with |u| = 1 on one axis; the cruder B^2 sqrt((1 + kappa) / 2) with
  kappa the sup ratio would be 0.914, since the sup ratio is reached at u = 0, where |phi|^2 is only 0.55).
- ``cross``: targets are clipped to [-B_y, B_y] (``target_clip``), so each term phi_i y_i has norm <= B B_y and the
  sum moves by B B_y: ``PreClipped(B * B_y, "sum")`` on a ``ClippedValue`` of bound B B_y. No new clip kind is needed.
- the budget is split between the two by ``scatter_share`` (calibration gives each channel its share of rho).
- ``unit="client"``: each client's matrices are clipped as wholes (``NormClip``) to ``client_rows * B^2`` and
  ``client_rows * B * B_y``, the bounds a client of at most ``client_rows`` records respects (a public cap).
- public coordinate bounds (secure aggregation's quantisation ranges, ``value_bound``), at both units, from the same
  public cap: |entry of Phi^T Phi| <= client_rows B^2, |entry of Phi^T y| <= client_rows B B_y. A client holding
  more records has its sums clipped entrywise into them before release: an entrywise clip is a contraction (of the
  upper triangle too), so the sensitivities above still hold, and it only costs that client's utility.
- nothing else leaves a client: weights are 1, the shapes follow the public feature map, every record is used, and
  the feature map (seed, lengthscale, phase 1's network) and sigma, lambda are public or phase 1's private result.

Post-processing on the server (free, after release; AdaSSP-style, Wang 2018): the noisy scatter is symmetrised,
projected to the PSD cone (eigenvalues floored at 0), and given a ridge ``ridge_scale * 2 sqrt(d) * s`` where s is
the per-entry noise std of the released sum (2 sqrt(d) s is the spectral norm of d x d symmetric Gaussian noise). The
server knows s and the cross noise std s_b, and folds them into the predictive variance (``fold_noise``): to first
order the released noise perturbs w_bar by sigma^-2 A^-1 (e_b - E w_bar), whose covariance
sigma^-4 A^-1 (s_b^2 I + s^2 (|w_bar|^2 I + w_bar w_bar^T - diag(w_bar^2))) A^-1 is added to the posterior's in
predictions.

Two phases, two algorithms
--------------------------
The runtime releases the same declared channels every round and calibrates their noise over all rounds, so a single
algorithm switching from a model-update channel (phase 1) to scatter channels (phase 2) would be charged for all three
in every round. FedBNR is therefore two algorithms run one after the other on the same clients, as the phases of one
run (``privfl.algorithms.base.phases_of``: the runtime runs them, this module only describes them):

1. :class:`FedBNRKernel` (phase 1, optional): a kernel network (extractor weights, log lengthscale, sigma, lambda),
   each client maximising its local BLR marginal likelihood (eq. 18) from the broadcast global network, aggregated
   by FedAvg of the weights (channel ``update``) or by kernel distillation (FedBNR-KD, below). Under DP it is charged
   like DP-FedAvg: the upload is clipped to a norm as a client-level channel, uniform weights. A client-level clip
   bounds any one record's influence too, so record-level runs get a guarantee as well, but a record *changes* its
   client's clipped upload rather than removing it: under ``unit="example"`` the channel's adjacency is replace-one
   (sensitivity 2C, whatever the record adjacency); under ``unit="client"`` it is the configured one (C or 2C).
2. :class:`FedBNR` (phase 2, registered as ``fedbnr``): one release of ``scatter`` and ``cross`` under the fixed
   kernel network (the phase-1 result, or pure RFF with public hyperparameters when phase 1 is skipped). One round is
   all it needs; with R > 1 rounds every round re-releases and the server averages the R sums, which for Gaussian
   noise costs nothing (R releases at multiplier z sqrt(R) average to one release at z) and is exact without noise.

``FedBNR(..., kernel_rounds=K)`` (``privfl run --algorithm fedbnr --kernel-rounds K``, with ``--kernel-aggregation
distillation --alignment-size N`` for FedBNR-KD) is a two-phase run: its constructor splits the budget between the
phases in Gaussian DP (:func:`phase_budgets`: mu^2, i.e. rho, adds) and checks the composition of the two
calibrations under the run's accountant; :meth:`FedBNR.phases` yields phase 1, is sent its trained kernel, and yields
phase 2. The runtime charges them as the ledger runs ``<id>-kernel`` and ``<id>-regression`` and reports each
client's epsilon composed over both.

Kernel distillation (FedBNR-KD, eq. 19)
---------------------------------------
The server holds a small labelled set X_kd, y_kd disjoint from every client's data (``data.alignment``, from
``make_federated(..., alignment_size=N)``; the paper uses about 8% of the data). Its inputs are broadcast with the
global network; its targets never leave the server. Each round each client trains as above from the global network
and uploads, instead of its weights, the change of its Gram matrix on X_kd,
Delta K_c = Phi_c(X_kd) Phi_c(X_kd)^T - Phi(X_kd) Phi(X_kd)^T (the global Gram is public: the server broadcast
theta). Every Gram of unit feature rows has a unit diagonal, so Delta K_c has a zero diagonal and is determined by its
strict upper triangle, which is what the channel ``gram`` carries (a vector of n_kd (n_kd - 1) / 2 entries):
clipping that vector to norm C (``gram_clip``) and adding isotropic noise spends the whole clip on entries that
carry information, sqrt(2) less noise than a Frobenius clip of the full matrix with symmetric noise on its upper
triangle (whose upper triangle moves by at most C / sqrt(2) here, but would be charged C). Sensitivity as for
``update``: C (add/remove a client) or 2C (replace one; every record-level run). The upload is a sum over clients,
so secure aggregation applies, and no weights leave the clients. The server's mean client Gram (eq. 19's
sum_c theta_c(X_kd)^T theta_c(X_kd) / |S|, uniform weights with or without DP) is
K_bar = K_glob + mean_c Delta K_c, mirrored (post-processing; the noise is left unbiased, not clipped to [-1, 1],
because the loss is linear in K_bar). The server step (:func:`distill_kernel`) takes ``kd_steps`` Adam steps
(``kd_lr``) from the current global theta, sigma, lambda on

    NLML(X_kd, y_kd; theta, sigma, lambda) / n_kd + alpha * mean((Phi_theta(X_kd) Phi_theta(X_kd)^T - K_bar)^2),

the paper's L^KD with its log likelihood negated (it is maximised there). The Gram does not depend on sigma and
lambda: in FedBNR-KD they are learned from the server's set only, as in the paper. The released network is a
function of X_kd, y_kd, which this library does not protect (they are the server's own data).

The user's feature extractor (``model=``, ``privfl.federate(model, ..., algorithm="fedbnr")``)
----------------------------------------------------------------------------------------------
f in g(omega, f(x)) may be the user's ``nn.Module`` (copied, never changed) or a zero-argument factory of one, built
from a torch seed drawn from the run's setup stream, so the server half and every client half build the same network
(constructor arguments must be deep-copyable: a client half is built from copies of them). Its latent dimension is
read from a forward pass on one zero input of the public input shape; an output that is not one flat vector per
example, batch normalisation, or any layer whose output for one example moves with the other examples of its batch
is refused (``privfl.models.features.check_extractor``), and the extractor always runs in eval mode (no batch statistics,
no dropout). With ``kernel_rounds=0`` it is used as given, random Fourier features on top of it; with
``kernel_rounds > 0`` phase 1 trains it (with l, sigma, lambda) and phase 2 runs on the result. The sensitivities
above do not depend on it:

- phase 1 releases the change of *all* the kernel network's parameters (or its Gram change) clipped to a norm as one
  vector: the bound C (2C replace-one) holds for any architecture; the architecture and its initial weights are
  public facts of the run (the user's agreed model), the same on every neighbouring dataset.
- phase 2's rows are m (cos, sin) pairs of *whatever* latent vector comes first, so every row has unit norm and
  sum_i phi_i^4 <= |phi|^4 / m whatever f is (``cos_sin_pairs`` recognises the kernel network's feature map, and
  every row is checked before release); the row and target clips make the declared bounds true. What the argument
  needs of f is that a record's row is a function of that record alone (then adding or removing a record adds or
  removes exactly one term of each sum): hence the refusals and eval mode above. f's weights are public (as given)
  or phase 1's private result, so using them is post-processing.

Not done: distributed discrete noise for phase 2 (the scatter channel is a matrix, which ``privfl.privacy.secure`` does not
plan noise for).
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import numpy as np
import torch
from scipy.linalg import cho_factor, cho_solve, solve_triangular

from privfl.accounting.accountants.analytic_gaussian import gaussian_epsilon, gaussian_mu
from privfl.accounting.calibration import calibrate, calibrate_noise, round_event
from privfl.accounting.errors import InvalidPrivacyParameter
from privfl.accounting.events import ComposedEvent, PrivacyEvent, SelfComposedEvent
from privfl.mechanisms import InvalidRelease, clip_rows, clip_values
from privfl.mechanisms.clipping import check_adjacency
from privfl.core.aggregation import Aggregate
from privfl.algorithms.base import ClientOutput, FederatedAlgorithm, Phase
from privfl.core.channels import ClippedValue, NormClip, PreClipped
from privfl.privacy.units import channel as unit_channel
from privfl.errors import ConfigurationError, UsageError
from privfl.models.features import (KernelNetwork, LinearRandomFourierFeatures, RandomFourierFeatures,
                                   blr_log_marginal_likelihood, check_extractor, cos_sin_pairs, extractor_factory,
                                   pair_squared_norms, scatter_term_square_bound)
from privfl.metrics.regression import regression_metrics
from privfl.training.local import flat_parameters, load_flat_parameters


# -- the scatter channel's clip when feature rows spread their mass ---------------------------------------------

@dataclass(frozen=True)
class ScatterBound(PreClipped):
    """``Phi^T Phi`` of feature rows clipped (by scaling) to norm B, released on a ``symmetric`` channel (noise on
    the upper triangle including the diagonal, mirrored), where every record's term restricted to the upper triangle
    U has squared norm (|phi|^4 + sum_i phi_i^4) / 2 <= ``term_square`` = T^2: T is the add/remove sensitivity, and
    sqrt(2) T the replace-one one (|U(phi phi^T - psi psi^T)|^2 is the two terms' squared norms minus
    (phi.psi)^2 + sum_i phi_i^2 psi_i^2 >= 0). Any row gives at most B^4 (PreClipped's bounds);
    :class:`PairedScatter` is T^2 = B^4 (1 + 1/m) / 2; a feature map may declare its own
    (``LinearRandomFourierFeatures.term_square_bound``), and the algorithm checks every row's term against it before
    release."""

    statistic: str = "squared_sum"
    term_square: float | None = None  # None: B^4, what any row gives

    def __post_init__(self):
        super().__post_init__()
        if self.statistic != "squared_sum":
            raise InvalidRelease(f"{type(self).__name__} bounds a squared_sum statistic, got {self.statistic!r}")
        t2 = self.bound ** 4 if self.term_square is None else self.term_square
        if isinstance(t2, bool) or not isinstance(t2, (int, float)) or not 0 < t2 <= self.bound ** 4 * (1 + 1e-12):
            raise InvalidRelease(f"term_square must lie in (0, B^4], got {t2!r}")
        object.__setattr__(self, "term_square", float(t2))

    def sensitivity(self, adjacency: str) -> float:
        return math.sqrt(self.term_square * (1.0 if check_adjacency(adjacency) == "add_remove" else 2.0))

    @property
    def unit_norm(self) -> float:
        """The largest norm of one record's term on the released upper triangle: T."""
        return math.sqrt(self.term_square)


@dataclass(frozen=True)
class PairedScatter(ScatterBound):
    """``Phi^T Phi`` of feature rows clipped (by scaling) to norm B, each row made of ``pairs`` = m disjoint
    (cos, sin) pairs of equal norm (``privfl.models.features``), released on a ``symmetric`` channel: noise on the upper
    triangle including the diagonal, mirrored. Only for such a channel (noise on every entry would release the full
    matrix, which one record moves by |phi|^2 = B^2).

    A record's term phi phi^T restricted to the upper triangle U has squared norm sum_{i <= j} phi_i^2 phi_j^2 =
    (|phi|^4 + sum_i phi_i^4) / 2, and sum_i phi_i^4 <= sum_k (cos_k^2 + sin_k^2)^2 = |phi|^4 / m. Hence

    - add/remove: U moves by at most B^2 sqrt((1 + 1/m) / 2), attained by the all-cosine row
      B (1, ..., 1, 0, ..., 0) / sqrt(m) (RFF at x = 0);
    - replace-one: D = phi phi^T - psi psi^T has |U(D)|^2 = (|D|_F^2 + sum_i D_ii^2) / 2
      = (|phi|^4 + sum_i phi_i^4 + |psi|^4 + sum_i psi_i^4) / 2 - (phi.psi)^2 - sum_i phi_i^2 psi_i^2
      <= B^4 (1 + 1/m), so B^2 sqrt(1 + 1/m), attained by the all-cosine row against the all-sine row.

    m = 1 gives PreClipped's B^2 and sqrt(2) B^2, the bounds for any rows. The value is the ClippedValue
    (B, ``"squared_sum"``) of a PreClipped channel; the algorithm checks every row's pairs before release.
    """

    pairs: int = 1

    def __post_init__(self):
        if isinstance(self.pairs, bool) or not isinstance(self.pairs, (int, np.integer)) or self.pairs < 1:
            raise InvalidRelease(f"pairs must be an integer >= 1, got {self.pairs!r}")
        object.__setattr__(self, "pairs", int(self.pairs))
        object.__setattr__(self, "term_square", self.bound ** 4 * (1.0 + 1.0 / self.pairs) / 2.0)
        super().__post_init__()


def _check_pairs(rows: np.ndarray, pairs: int) -> None:
    """Refuse (before anything is released) rows that are not ``pairs`` (cos, sin) pairs of equal norm: the premise
    of :class:`PairedScatter`'s sensitivity."""
    per_pair = pair_squared_norms(rows, pairs)
    expected = np.sum(rows * rows, axis=1, keepdims=True) / pairs
    if not np.allclose(per_pair, expected, rtol=1e-9, atol=1e-12):
        raise InvalidRelease("the scatter channel's sensitivity assumes feature rows of (cos, sin) pairs of equal "
                             "norm, and these rows are not; nothing was released")


def _check_scatter_terms(rows: np.ndarray, term_square: float) -> None:
    """Refuse (before anything is released) clipped rows whose upper-triangle term (|phi|^4 + sum_i phi_i^4) / 2
    exceeds ``term_square``: the premise of :class:`ScatterBound`'s sensitivity."""
    rows = np.asarray(rows, dtype=np.float64)
    sq = np.sum(rows * rows, axis=1)
    if np.any((sq * sq + np.sum(rows ** 4, axis=1)) / 2.0 > term_square * (1 + 1e-9) + 1e-15):
        raise InvalidRelease("the scatter channel's sensitivity assumes every record's upper-triangle term of "
                             f"phi phi^T has squared norm <= {term_square:.6g}, and one does not; nothing was released")


# -- Bayesian linear regression from sufficient statistics (server side) ------------------------------------------

@dataclass(frozen=True)
class BLRPosterior:
    """N(mean, precision^-1) over the last layer's weights, the likelihood's noise std sigma, and (optionally) the
    extra weight covariance due to release noise that the server folds into predictions."""

    mean: np.ndarray
    precision: np.ndarray
    noise_std: float
    release_cov: np.ndarray | None = None

    @property
    def covariance(self) -> np.ndarray:
        return cho_solve(cho_factor(self.precision, lower=True), np.eye(len(self.mean)))

    def predict(self, phi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Predictive mean phi^T w and variance sigma^2 + phi^T A^-1 phi (+ phi^T release_cov phi), eq. 13."""
        phi = np.asarray(phi, dtype=np.float64)
        chol = np.linalg.cholesky(self.precision)
        v = solve_triangular(chol, phi.T, lower=True)
        var = self.noise_std ** 2 + np.sum(v * v, axis=0)
        if self.release_cov is not None:
            var = var + np.einsum("ij,jk,ik->i", phi, self.release_cov, phi)
        return phi @ self.mean, var


class BLRPredictor(torch.nn.Module):
    """FedBNR's trained model as a module: the posterior predictive of the Bayesian linear regression on the kernel
    network's features (eq. 13), in the targets' own units.

    ``model(x)`` (a tensor or array of inputs, shape ``(n, *input_shape)``) is the predictive mean as a float32 tensor
    of shape ``(n, 1)``, like a regression network's output; ``model.predict(x)`` returns ``(mean, variance)`` as
    float64 numpy arrays of shape ``(n,)``, the variance being sigma^2 + phi^T A^-1 phi (plus the release noise's
    share when the server folded it in). It holds no trainable parameter: the posterior is the run's result, used
    for prediction only (post-processing of what was released)."""

    def __init__(self, feature_map: Callable[[np.ndarray], np.ndarray], posterior: BLRPosterior,
                 target_offset: float = 0.0, target_scale: float = 1.0):
        super().__init__()
        self.feature_map = feature_map
        self.posterior = posterior
        self.target_offset, self.target_scale = float(target_offset), float(target_scale)

    def predict(self, x) -> tuple[np.ndarray, np.ndarray]:
        """Predictive mean and variance at ``x`` (a tensor, an array or a data set), in the targets' units."""
        x = getattr(x, "x", x)
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().numpy()
        mean, var = self.posterior.predict(self.feature_map(np.asarray(x, dtype=np.float32)))
        return mean * self.target_scale + self.target_offset, var * self.target_scale ** 2

    def forward(self, x) -> torch.Tensor:
        mean, _ = self.predict(x)
        return torch.as_tensor(mean, dtype=torch.float32).reshape(-1, 1)


def prior_posterior(dim: int, noise_std: float, prior_std: float) -> BLRPosterior:
    """The prior N(0, lambda^2 I) as a posterior with no data."""
    return BLRPosterior(np.zeros(dim), np.eye(dim) / prior_std ** 2, float(noise_std))


def repair_scatter(scatter: np.ndarray, floor: float = 0.0) -> np.ndarray:
    """Symmetrise and project to {S : S >= floor I} by flooring eigenvalues (post-processing of a noisy release)."""
    s = 0.5 * (np.asarray(scatter, dtype=np.float64) + np.asarray(scatter, dtype=np.float64).T)
    evals, evecs = np.linalg.eigh(s)
    return (evecs * np.maximum(evals, floor)) @ evecs.T


def blr_from_statistics(scatter: np.ndarray, cross: np.ndarray, noise_std: float, prior_std: float, *,
                        ridge: float = 0.0, psd_floor: float | None = None, scatter_noise_std: float = 0.0,
                        cross_noise_std: float = 0.0, fold_noise: bool = False) -> BLRPosterior:
    """Eqs. 20-21 from summed statistics: A = sigma^-2 (S + ridge I) + lambda^-2 I, w = sigma^-2 A^-1 b.

    ``psd_floor``: repair S first (:func:`repair_scatter`); ``fold_noise``: add the first-order weight covariance
    of the known release noise (per-entry std ``scatter_noise_std`` of the symmetric noise on S, ``cross_noise_std``
    on b) to predictions (see the module docstring).
    """
    s = np.asarray(scatter, dtype=np.float64)
    b = np.asarray(cross, dtype=np.float64).reshape(-1)
    d = len(b)
    if s.shape != (d, d):
        raise ConfigurationError(f"scatter must be {d} x {d} to match cross, got {s.shape}")
    s = repair_scatter(s, psd_floor) if psd_floor is not None else 0.5 * (s + s.T)
    if ridge:
        s = s + ridge * np.eye(d)
    s2 = float(noise_std) ** 2
    precision = s / s2 + np.eye(d) / float(prior_std) ** 2
    factor = cho_factor(precision, lower=True)
    mean = cho_solve(factor, b) / s2
    release_cov = None
    if fold_noise and (scatter_noise_std > 0 or cross_noise_std > 0):
        # Cov(E w) for symmetric E with iid N(0, s^2) upper triangle: s^2 (|w|^2 I + w w^T - diag(w * w))
        inner = (cross_noise_std ** 2 + scatter_noise_std ** 2 * float(mean @ mean)) * np.eye(d) \
            + scatter_noise_std ** 2 * (np.outer(mean, mean) - np.diag(mean * mean))
        a_inv = cho_solve(factor, np.eye(d))
        release_cov = a_inv @ inner @ a_inv / s2 ** 2
        release_cov = 0.5 * (release_cov + release_cov.T)
    return BLRPosterior(mean, precision, float(noise_std), release_cov)


def centralised_blr(phi: np.ndarray, y: np.ndarray, noise_std: float, prior_std: float) -> BLRPosterior:
    """Bayesian linear regression on pooled features (eqs. 11-12): the reference phase 2 must equal."""
    phi = np.asarray(phi, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    s2 = float(noise_std) ** 2
    precision = phi.T @ phi / s2 + np.eye(phi.shape[1]) / float(prior_std) ** 2
    mean = np.linalg.solve(precision, phi.T @ y) / s2
    return BLRPosterior(mean, precision, float(noise_std))


def _targets(dataset) -> np.ndarray:
    y = np.asarray(dataset.y, dtype=np.float64)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise ConfigurationError(f"FedBNR regresses one scalar target; got targets of shape {y.shape}")
    return y


def _check_regression(data, name: str) -> None:
    if getattr(data, "task", None) != "regression":
        raise ConfigurationError(f"{name} is a regression algorithm; choose a regression data set such as diabetes "
                                 f"or synthetic1d (got a {getattr(data, 'task', '?')} task)")


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


# -- phase 2: exact Bayesian linear regression from released scatter matrices -------------------------------------

class FedBNRClippingWarning(UserWarning):
    """A client's clips cut most of its signal (unstandardised targets, feature rows above the clip, or more records
    than the public record cap): raised on the client's side, from values it never releases."""


#: FedBNR's default features without a model or kernel network: a linear block of this prior share beside the
#: random Fourier features (``LinearRandomFourierFeatures``), its inputs at this scale; chosen on the validation
#: splits of diabetes, star98 and fair (``experiments/run_fedbnr.py --linear``, results/fedbnr_linear.md)
DEFAULT_LINEAR_SHARE, DEFAULT_LINEAR_SCALE = 0.9, 1.0


def _contained_features(feature_map, x, y: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """A private client's feature rows and targets, a record's failure contained to that record: when the batched
    feature map raises (a user's extractor failing on one record), the rows are recomputed one record at a time and a
    record whose own row raises gets the zero row and target, adding nothing to either sum (the scatter sums are
    sums of per-record terms, so one record deciding between a release and the fallback would not be covered)."""
    try:
        return np.asarray(feature_map(x), dtype=np.float64), y
    except UsageError:
        raise
    except Exception:  # noqa: BLE001 - one record made the batched pass raise
        pass
    phi = np.zeros((len(y), dim))
    y = np.array(y, dtype=np.float64, copy=True)
    for i in range(len(y)):
        try:
            phi[i] = np.asarray(feature_map(x[i:i + 1]), dtype=np.float64).reshape(-1)
        except UsageError:
            raise
        except Exception:  # noqa: BLE001
            y[i] = 0.0
    return phi, y


class FedBNR(FederatedAlgorithm):
    """FedBNR phase 2 over a fixed kernel network; see the module docstring.

    Args:
        model: the user's feature extractor f (an ``nn.Module``, copied and never changed, or a zero-argument
            factory; see the module docstring): random Fourier features are taken of f(x) instead of x, as given
            (``kernel_rounds=0``) or after phase 1 trains it. Neither with ``kernel``. The RFF lengthscale then
            defaults to sqrt(f's output width).
        kernel: a trained :class:`KernelNetwork` (phase 1's result: its feature map, sigma and lambda), or None for
            pure random Fourier features built from ``num_samples``, ``lengthscale`` and ``feature_seed``.
        num_samples: m, the number of omega samples (2m features). Default 50, the paper's.
        lengthscale: RFF lengthscale (default sqrt(input dimension), for standardised inputs).
        linear_share: a in [0, 1): without ``model``, ``kernel`` or phase 1, the features are
            :class:`~privfl.models.features.LinearRandomFourierFeatures` (a linear block with a bias, of prior share
            a, beside the random Fourier features) when a > 0, and pure random Fourier features (the paper's) when
            a = 0. Default (None): ``DEFAULT_LINEAR_SHARE`` for the pure feature map, 0 with a model or a kernel
            network (they bring their own features; a > 0 is refused there).
        linear_scale: c, the linear block's input scale: u = x / (c sqrt(d)), scaled down to norm 1 where longer
            (default ``DEFAULT_LINEAR_SCALE``).
        noise_std, prior_std: sigma and lambda (default: the kernel's, else 0.5 and 1.0).
        feature_seed: the public seed of omega.
        target_clip: B_y, targets are clipped to [-B_y, B_y] under DP (default 2, for standardised targets: chosen
            among {1.5, 2, 3} x scatter share {0.2, ..., 0.5} on the issue-16 sets' validation splits,
            ``experiments/results/fedbnr_budget.md``; 3 until then).
        scatter_share: the scatter channel's share of the budget (the cross channel gets the rest).
        ridge_scale: ridge = ridge_scale * 2 sqrt(d) * (noise std of the released scatter); 0 for none. The
            default 0.25 was the best of {0, 0.25, 0.5, 1, 2} on diabetes and synthetic1d at epsilon = 3 (0: unusable).
        fold_noise: fold the known release noise into the predictive variance.
        client_rows: the public cap on a client's records (both units): it sizes the clips of the client's matrices
            under ``unit="client"``, and the public coordinate bounds (secure aggregation's quantisation ranges)
            under both. A client holding more records has its sums clipped into those bounds, and is warned
            (:class:`FedBNRClippingWarning`). Default: the run's public record cap (``FederationConfig.record_cap``,
            ``--record-cap``; else 4 x the design size of a client), never a hidden constant.

    Privacy with the user's extractor (``model``): unchanged. The scatter bound needs rows of m (cos, sin) pairs of
    equal norm, which the random-feature layer after f gives whatever f computes (and every row is checked before
    release), plus a row that depends on its own record only, which the refusal of batch normalisation and of any
    layer mixing a batch's examples, and eval mode, ensure; the cross bound needs only the row and target clips.
    Phase 1 clips the whole network's change as one vector, whatever its architecture (the module docstring).

    Under DP a client whose targets mostly lie outside [-B_y, B_y] (unstandardised targets) or whose feature rows
    mostly exceed B is warned on its own side (the fractions are never released): most of its signal is clipped away
    and the fit can be worse than predicting the mean.
    """

    name = "fedbnr"
    supports_privacy = True
    defaults = {"clip": 1.0}
    #: the privacy unit a run uses unless told: record level (the scatter channels are sums over records)
    default_unit = "example"
    #: the server accumulates the rounds' sums into its posterior: not checkpointed (a run is not resumed)
    checkpointable = False
    #: at ``unit="client"`` each client's sums are clipped as if it held at most the public record cap
    clips_to_record_cap = True
    #: whether the run needs a server-held labelled set (``data.alignment``): FedBNR-KD's phase 1 (per instance)
    uses_alignment = False

    def __init__(self, fed, privacy, *, model=None, kernel: KernelNetwork | None = None, num_samples: int = 50,
                 lengthscale: float | None = None, linear_share: float | None = None,
                 linear_scale: float | None = None, noise_std: float | None = None, prior_std: float | None = None,
                 feature_seed: int = 0, target_clip: float = 2.0, scatter_share: float = 0.5,
                 ridge_scale: float = 0.25, fold_noise: bool = True, client_rows: int | None = None,
                 kernel_rounds: int = 0, kernel_aggregation: str = "fedavg", kernel_clip: float | None = None,
                 kernel_share: float = 0.5, kernel_fed=None, kernel_options: Mapping | None = None):
        super().__init__(fed, privacy)
        if kernel is not None and not isinstance(kernel, KernelNetwork):
            raise ConfigurationError("kernel must be a privfl.models.features.KernelNetwork (phase 1's result) or None")
        if model is not None and kernel is not None:
            raise ConfigurationError("fedbnr: give either model (your feature extractor, from which the kernel network "
                                     "is built) or kernel (a trained kernel network), not both")
        self.extractor = None if model is None else extractor_factory(model, self.name)
        if privacy.private and privacy.sampling_rate < 1:
            raise ConfigurationError("fedbnr sums every client's scatter matrices; client sampling would leave them "
                                     "out; set sampling_rate=1")
        if privacy.private and privacy.placement == "distributed":
            raise ConfigurationError("fedbnr's scatter channel is a matrix, for which distributed discrete noise is "
                                     "not planned; use --placement central or local")
        if not 0 < scatter_share < 1:
            raise ConfigurationError(f"scatter_share must lie in (0, 1), got {scatter_share!r}")
        if client_rows is not None and (isinstance(client_rows, bool) or not isinstance(client_rows, int)
                                        or client_rows < 1):
            raise ConfigurationError(f"client_rows must be an integer >= 1 (or None: the public record cap), got "
                                     f"{client_rows!r}")
        if not (isinstance(ridge_scale, (int, float)) and math.isfinite(ridge_scale) and ridge_scale >= 0):
            raise ConfigurationError(f"ridge_scale must be a finite number >= 0, got {ridge_scale!r}")
        self._plan_phases(kernel, kernel_rounds, kernel_aggregation, kernel_clip, kernel_share, kernel_fed,
                          kernel_options, scatter_share, model, num_samples, feature_seed)
        self.kernel = kernel
        self.num_samples = int(num_samples)
        self.lengthscale = None if lengthscale is None else _positive("lengthscale", lengthscale)
        own_features = model is not None or kernel is not None or kernel_rounds
        if linear_share is None:
            linear_share = 0.0 if own_features else DEFAULT_LINEAR_SHARE
        if isinstance(linear_share, bool) or not isinstance(linear_share, (int, float)) or not 0 <= linear_share < 1:
            raise ConfigurationError(f"linear_share must lie in [0, 1), got {linear_share!r}")
        if linear_share and own_features:
            raise ConfigurationError("fedbnr: linear_share adds a linear block to the pure random-feature map; with "
                                     "a model, a kernel network or phase 1 (kernel_rounds) leave it out (or 0)")
        self.linear_share = float(linear_share)
        self.linear_scale = _positive("linear_scale", DEFAULT_LINEAR_SCALE if linear_scale is None else linear_scale)
        self.noise_std = _positive("noise_std", noise_std if noise_std is not None else
                                   (kernel.noise_std if kernel is not None else 0.5))
        self.prior_std = _positive("prior_std", prior_std if prior_std is not None else
                                   (kernel.prior_std if kernel is not None else 1.0))
        self.feature_seed = int(feature_seed)
        self.target_clip = _positive("target_clip", target_clip)
        self.scatter_share = float(scatter_share)
        self.ridge_scale = float(ridge_scale)
        self.fold_noise = bool(fold_noise)
        self._client_rows = client_rows
        self.client_rows = client_rows
        self.feature_map: Callable[[np.ndarray], np.ndarray] | None = None
        self.dim = 0
        self.posterior: BLRPosterior | None = None
        self._sums: dict[str, np.ndarray] = {}
        self._noise_var: dict[str, float] = {}
        self._releases = 0

    # -- phase 1 before this phase (a multi-phase run: privfl.algorithms.base.phases_of) ---------------------------

    def _plan_phases(self, kernel, kernel_rounds, aggregation, kernel_clip, kernel_share, kernel_fed, kernel_options,
                     scatter_share, model=None, num_samples=50, feature_seed=0) -> None:
        """Check phase 1's options and split the budget between the phases (:func:`phase_budgets`), before anything
        runs: from public inputs only."""
        if isinstance(kernel_rounds, bool) or not isinstance(kernel_rounds, int) or kernel_rounds < 0:
            raise ConfigurationError(f"kernel_rounds must be an integer >= 0, got {kernel_rounds!r}")
        if aggregation not in AGGREGATIONS:
            raise ConfigurationError(f"kernel_aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        if aggregation == "distillation" and kernel_rounds == 0:
            raise ConfigurationError("kernel distillation is phase 1: add --kernel-rounds N (N >= 1; "
                                     "kernel_rounds=N)")
        self.kernel_rounds = kernel_rounds
        self.phase_epsilons: tuple[float, float] | None = None
        self.uses_alignment = kernel_rounds > 0 and aggregation == "distillation"
        if kernel_rounds == 0:
            return
        if kernel is not None:
            raise ConfigurationError("give either a trained kernel (phase 2 alone) or kernel_rounds > 0 (phase 1 "
                                     "learns it), not both")
        options = dict(kernel_options or {})
        options.setdefault("aggregation", aggregation)
        # the feature map's frequencies are phase 1's too (phase 2 runs on phase 1's network)
        options.setdefault("num_samples", num_samples)
        options.setdefault("feature_seed", feature_seed)
        if kernel_clip is not None:
            options.setdefault("update_clip", kernel_clip)
        kfed = replace(kernel_fed or self.fed, rounds=kernel_rounds)
        # the design size and record cap are facts of the federation, not of a phase: a kernel_fed that leaves them
        # out takes the run's
        kfed = replace(kfed, **{k: getattr(self.fed, k) for k in ("client_size", "record_cap")
                                if getattr(kfed, k) is None and getattr(self.fed, k) is not None})
        if model is not None:
            if "hidden" in options or "latent_dim" in options or "model" in options:
                raise ConfigurationError("fedbnr: model is the feature extractor phase 1 trains; leave hidden, "
                                         "latent_dim and model out of kernel_options")
            options["model"] = model
        else:
            options.setdefault("hidden", tuple(kfed.hidden) if kfed.hidden is not None else ())
        FedBNRKernel(kfed, self.privacy, **options)  # validates phase 1's options before anything runs
        privacy_k = privacy_r = self.privacy
        if self.privacy.private:
            if not 0 < scatter_share < 1:
                raise ConfigurationError(f"scatter_share must lie in (0, 1), got {scatter_share!r}")
            accountant = self.privacy.resolved_accountant
            kernel_shares = {"gram" if options["aggregation"] == "distillation" else "update": 1.0}
            self.phase_epsilons = phase_budgets(
                self.privacy.epsilon, self.privacy.delta, kernel_rounds, self.fed.rounds,
                {"scatter": scatter_share, "cross": 1.0 - scatter_share}, accountant, kernel_share,
                kernel_shares=kernel_shares)
            privacy_k = replace(self.privacy, epsilon=self.phase_epsilons[0], accountant=accountant)
            privacy_r = replace(self.privacy, epsilon=self.phase_epsilons[1], accountant=accountant)
        self._phase_plan = (kfed, privacy_k, options, privacy_r)

    @property
    def phase_plan(self) -> tuple[tuple[str, int], ...]:
        """Each phase's name and rounds, in order, known before the run (``()`` for a one-phase run)."""
        return (("kernel", self.kernel_rounds), ("regression", self.fed.rounds)) if self.phased else ()

    @property
    def phased(self) -> bool:
        """Whether this run has phase 1 (``kernel_rounds > 0``): a runtime then runs :meth:`phases`."""
        return self.kernel_rounds > 0

    def phases(self, public):
        """Phase 1 (``"kernel"``: :class:`FedBNRKernel` for ``kernel_rounds`` rounds), then phase 2
        (``"regression"``: FedBNR on the kernel network phase 1 was sent back with), each under its share of the
        budget (:attr:`phase_epsilons`); see :func:`privfl.algorithms.base.phases_of`."""
        if not self.phased:
            raise ConfigurationError("fedbnr runs as one phase unless kernel_rounds > 0")
        kfed, privacy_k, options, privacy_r = self._phase_plan
        kernel = FedBNRKernel(kfed, privacy_k, **options)
        if kernel.aggregation == "distillation":  # refused before phase 1 charges anything
            _check_regression(public, kernel.name)
            _distillation_set(public)
        trained = yield Phase("kernel", kernel, kfed, privacy_k)
        args, kwargs = self._init_args
        regression_options = {k: v for k, v in kwargs.items() if k not in PHASE_ONE_OPTIONS}
        yield Phase("regression", FedBNR(self.fed, privacy_r, kernel=trained.kernel(), **regression_options),
                    self.fed, privacy_r)

    def describe_phases(self) -> dict:
        """What a report says of the phase split: phase 1's rounds and aggregation, and each phase's epsilon."""
        return {"kernel_rounds": self.kernel_rounds, "kernel_aggregation": self._phase_plan[2]["aggregation"],
                "phase_epsilons": list(self.phase_epsilons) if self.phase_epsilons else None}

    @property
    def feature_clip(self) -> float:
        """B, the norm every feature row is clipped to under DP."""
        return float(self.privacy.clip)

    def setup(self, data, rng):
        public = self.bind_public(data)
        _check_regression(public, self.name)
        # the record cap is a public fact of the run (declared, or 4 x the design size), not a constant of FedBNR
        self.client_rows = self._client_rows if self._client_rows is not None else int(public.record_cap)
        input_dim = int(np.prod(public.input_shape))
        if self.kernel is not None:
            if self.kernel.input_dim != input_dim:
                raise ConfigurationError(f"the kernel network takes {self.kernel.input_dim} inputs but the data has "
                                         f"{input_dim}")
            net = copy.deepcopy(self.kernel).double()  # float64 rows: one record's row ignores the rest of its batch
            self.feature_map, self.dim = net.features, net.dim
        elif self.extractor is not None:  # the user's extractor as given, random features on top (no phase 1)
            net = _built_kernel(self.extractor, public.input_shape, rng, self.name, num_samples=self.num_samples,
                                lengthscale=self.lengthscale, noise_std=self.noise_std, prior_std=self.prior_std,
                                seed=self.feature_seed).double()
            self.feature_map, self.dim = net.features, net.dim
        elif self.linear_share:
            hybrid = LinearRandomFourierFeatures(input_dim, self.num_samples, self.lengthscale or math.sqrt(input_dim),
                                                 self.feature_seed, self.linear_share, self.linear_scale)
            self.feature_map, self.dim = hybrid, hybrid.dim
        else:
            rff = RandomFourierFeatures(input_dim, self.num_samples, self.lengthscale or math.sqrt(input_dim),
                                        self.feature_seed)
            self.feature_map, self.dim = rff, rff.dim
        self.posterior = prior_posterior(self.dim, self.noise_std, self.prior_std)
        self._sums = {"scatter": np.zeros((self.dim, self.dim)), "cross": np.zeros(self.dim)}
        self._noise_var = {"scatter": 0.0, "cross": 0.0}
        self._releases = 0

    def channels(self):
        d, p = self.dim, self.privacy
        if not p.private:
            return [unit_channel(p, "scatter", (d, d), symmetric=True, description="Phi^T Phi"),
                    unit_channel(p, "cross", (d,), description="Phi^T y")]
        b, by = self.feature_clip, self.target_clip
        scatter_bound, cross_bound = self.coordinate_bounds
        pairs, term_square = self.feature_pairs, scatter_term_square_bound(self.feature_map, b)
        record = (PairedScatter(b, pairs=pairs) if pairs else
                  ScatterBound(b, term_square=term_square) if term_square is not None else PreClipped(b, "squared_sum"))
        # a record's term is a row clipped to B (its target to B_y); a client's whole sums lie within the public
        # record cap's bounds, which the pipeline's norm clips enforce
        return [unit_channel(p, "scatter", (d, d), client=NormClip(scatter_bound), record=record,
                             budget_share=self.scatter_share, symmetric=True, value_bound=scatter_bound,
                             description="Phi^T Phi of rows clipped to B, entries within client_rows B^2"),
                unit_channel(p, "cross", (d,), client=NormClip(cross_bound), record=PreClipped(b * by, "sum"),
                             budget_share=1.0 - self.scatter_share, value_bound=cross_bound,
                             description="Phi^T y of rows clipped to B and targets to B_y, entries within "
                                         "client_rows B B_y")]

    @property
    def feature_pairs(self) -> int | None:
        """m when the feature map's rows are m (cos, sin) pairs (``privfl.models.features.cos_sin_pairs``), else None."""
        return cos_sin_pairs(self.feature_map)

    @property
    def coordinate_bounds(self) -> tuple[float, float]:
        """Public bounds on |entry| of the private scatter and cross sums: a client of at most ``client_rows`` records
        has |sum_i phi_ia phi_ib| <= client_rows B^2 and |sum_i phi_ia y_i| <= client_rows B B_y."""
        b = self.feature_clip
        return self.client_rows * b * b, self.client_rows * b * self.target_clip

    def private_release_weight(self, client: int) -> float:
        return 1.0

    def client_update(self, client, dataset, round, rng):
        if not self.privacy.private:
            phi = np.asarray(self.feature_map(dataset.x), dtype=np.float64)
            y = _targets(dataset)
            return ClientOutput({"scatter": phi.T @ phi, "cross": phi.T @ y}, weight=1.0)
        phi, y = _contained_features(self.feature_map, dataset.x, _targets(dataset), self.dim)
        b, by = self.feature_clip, self.target_clip
        rows, targets = clip_rows(phi, b), clip_values(y, by)
        term_square = None if self.feature_pairs else scatter_term_square_bound(self.feature_map, b)
        if self.feature_pairs:
            _check_pairs(rows.value, self.feature_pairs)
        elif term_square is not None:
            _check_scatter_terms(rows.value, term_square)
        scatter, cross = rows.value.T @ rows.value, rows.value.T @ targets.value
        # into the public coordinate bounds (binds only beyond client_rows records): an entrywise clip is a
        # contraction, of the upper triangle too, so the declared sensitivities still hold. Beyond them a
        # client-level run's norm clips (to the same bounds) cut a larger client too: both are reported
        scatter_bound, cross_bound = self.coordinate_bounds
        sums_clipped = bool(np.any(np.abs(scatter) > scatter_bound) or np.any(np.abs(cross) > cross_bound)
                            or np.linalg.norm(scatter) > scatter_bound or np.linalg.norm(cross) > cross_bound)
        scatter, cross = np.clip(scatter, -scatter_bound, scatter_bound), np.clip(cross, -cross_bound, cross_bound)
        metrics = {"rows_clipped": rows.fraction_clipped, "targets_clipped": targets.fraction_clipped,
                   "sums_clipped": float(sums_clipped)}
        self._warn_clipping(metrics)
        return ClientOutput({"scatter": ClippedValue(scatter, b, "squared_sum"),
                             "cross": ClippedValue(cross, b * by, "sum")}, weight=1.0, metrics=metrics)

    def _warn_clipping(self, metrics: Mapping[str, float]) -> None:
        """Tell the client (on its own side: nothing here is released) when its clips cut most of its signal."""
        if metrics["targets_clipped"] > 0.5:
            warnings.warn(f"fedbnr: more than half of a client's regression targets lie outside [-B_y, B_y] = "
                          f"[-{self.target_clip:g}, {self.target_clip:g}] and were clipped: the fit can be worse "
                          "than predicting the mean. Standardise the targets with public statistics (privfl run "
                          "--standardize public, or --public-data FILE with your own data) or raise FedBNR's "
                          "target_clip", FedBNRClippingWarning, stacklevel=2)
        if metrics["rows_clipped"] > 0.5:
            warnings.warn(f"fedbnr: more than half of a client's feature rows have norm above B = "
                          f"{self.feature_clip:g} and were scaled down; raise the clip (--clip) to the feature "
                          "map's row norm", FedBNRClippingWarning, stacklevel=2)
        if metrics["sums_clipped"]:
            warnings.warn(f"fedbnr: a client holds more records than the public record cap ({self.client_rows}: "
                          "client_rows, or --record-cap) and its scatter sums were clipped to the bounds that cap "
                          "gives, biasing the fit; raise --record-cap to a bound on every client's record count",
                          FedBNRClippingWarning, stacklevel=2)

    def server_update(self, aggregates: Mapping[str, Aggregate], round):
        for name in ("scatter", "cross"):
            self._sums[name] = self._sums[name] + aggregates[name].total
            self._noise_var[name] += aggregates[name].noise_std ** 2
        self._releases += 1
        r = self._releases
        scatter, cross = self._sums["scatter"] / r, self._sums["cross"] / r
        s_a, s_b = math.sqrt(self._noise_var["scatter"]) / r, math.sqrt(self._noise_var["cross"]) / r
        noisy = s_a > 0
        self.posterior = blr_from_statistics(
            scatter, cross, self.noise_std, self.prior_std,
            ridge=self.ridge_scale * 2.0 * math.sqrt(self.dim) * s_a, psd_floor=0.0 if noisy else None,
            scatter_noise_std=s_a, cross_noise_std=s_b, fold_noise=self.fold_noise)

    def predict(self, x) -> tuple[np.ndarray, np.ndarray]:
        """Predictive mean and variance at inputs ``x`` (an array or a data set), in the data's (standardised)
        target units."""
        x = getattr(x, "x", x)
        return self.posterior.predict(self.feature_map(x))

    def predictor(self, target_offset: float = 0.0, target_scale: float = 1.0) -> BLRPredictor:
        """The trained model as a :class:`BLRPredictor` (predictive mean and variance; a copy of the feature map and
        posterior, independent of this object), predicting ``y * target_scale + target_offset`` units (the data's
        own, when its targets were standardised)."""
        if self.posterior is None or self.feature_map is None:
            raise ConfigurationError(f"{self.name}: setup() and a round must run before its model can predict")
        return BLRPredictor(copy.deepcopy(self.feature_map), copy.deepcopy(self.posterior), target_offset,
                            target_scale)

    def evaluate(self, dataset):
        """RMSE, Gaussian NLL and interval calibration (ECE, MCE, Brier) in the data set's original units."""
        mean, var = self.predict(dataset)
        scale = float(dataset.target_scale)
        return regression_metrics(dataset.to_original_units(mean), var * scale ** 2,
                                  dataset.to_original_units(_targets(dataset)))


# -- phase 1: the kernel network by FedAvg or by kernel distillation ---------------------------------------------

AGGREGATIONS = ("fedavg", "distillation")
#: FedBNR's options that configure phase 1 (the phase-2 algorithm of a two-phase run takes the others)
PHASE_ONE_OPTIONS = ("kernel_rounds", "kernel_aggregation", "kernel_clip", "kernel_share", "kernel_fed",
                     "kernel_options", "model")
#: FedBNR-KD defaults (see FedBNRKernel): Gram matching weight, server Adam steps and rate, and the root-mean-square
#: change per Gram entry that the default clip allows
KD_ALPHA, KD_STEPS, KD_LR, KD_GRAM_RMS = 1000.0, 10, 0.01, 0.02


def _gram(net: KernelNetwork, x: torch.Tensor) -> torch.Tensor:
    """Phi(x) Phi(x)^T of ``net`` on ``x`` (float64; unit diagonal, every entry in [-1, 1])."""
    phi = net(x)
    return phi @ phi.T


def _upper(matrix: np.ndarray) -> np.ndarray:
    """The strict upper triangle of a square matrix, row by row."""
    return np.asarray(matrix, dtype=np.float64)[np.triu_indices(len(matrix), 1)]


def _symmetric(upper: np.ndarray, n: int) -> np.ndarray:
    """The symmetric n x n matrix with zero diagonal whose strict upper triangle is ``upper``."""
    out = np.zeros((n, n))
    out[np.triu_indices(n, 1)] = upper
    return out + out.T


def distillation_loss(net: KernelNetwork, x: torch.Tensor, y: torch.Tensor, target_gram: torch.Tensor,
                      alpha: float) -> torch.Tensor:
    """FedBNR's eq. 19 as a loss to minimise: NLML(X_kd, y_kd) / n_kd + alpha * mean((K_theta(X_kd) - K_bar)^2).

    The paper's L^ML is a log likelihood (to maximise), so its negative is used; dividing it by n_kd keeps ``alpha``
    on the same per-record scale whatever the size of the distillation set.
    """
    phi = net(x)
    nlml = -blr_log_marginal_likelihood(phi, y, net.log_noise_std.exp(), net.log_prior_std.exp()) / len(y)
    return nlml + alpha * torch.mean((phi @ phi.T - target_gram) ** 2)


def distill_kernel(net: KernelNetwork, x, y, target_gram, *, alpha: float, steps: int, lr: float) -> list[float]:
    """The server step of FedBNR-KD: ``steps`` full-batch Adam steps (learning rate ``lr``, fresh moments) on
    :func:`distillation_loss` from ``net``'s current weights, in place. Returns the loss before each step and after
    the last."""
    x = torch.as_tensor(x)
    y = torch.as_tensor(np.asarray(y, dtype=np.float64))
    target = torch.as_tensor(np.asarray(target_gram, dtype=np.float64))
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = distillation_loss(net, x, y, target, alpha)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        losses.append(float(distillation_loss(net, x, y, target, alpha)))
    return losses


def _distillation_set(data):
    """The server's labelled distillation set ``data.alignment``, or a ConfigurationError saying how to get one."""
    kd = getattr(data, "alignment", None)
    if kd is None or len(kd) < 2:
        raise ConfigurationError("aggregation='distillation' needs a server-held labelled distillation set, disjoint "
                                 "from the clients' data: build the data with make_federated(..., alignment_size=N) "
                                 "(the paper uses about 8% of the data), or use aggregation='fedavg'")
    return kd


def _built_kernel(extractor: Callable, input_shape, rng: np.random.Generator, what: str,
                  **options) -> KernelNetwork:
    """A :class:`KernelNetwork` on the user's extractor (``extractor``: a builder from
    :func:`privfl.models.features.extractor_factory`), built under a torch seed drawn from the run's setup stream ``rng``
    (not global state), so the server half and every client half, set up from the same stream, build the same
    network; the extractor is checked (flat output, no mixing of examples) and runs in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(rng.integers(0, 2 ** 31 - 1)))
        module = extractor()
    check_extractor(module, input_shape, f"{what}: your model (the feature extractor)")
    return KernelNetwork(int(np.prod(input_shape)), extractor=module, input_shape=input_shape, **options)


class FedBNRKernel(FederatedAlgorithm):
    """FedBNR phase 1: a :class:`KernelNetwork` (extractor weights, log lengthscale, log sigma, log lambda) learned
    by clients each taking ``fed.local_epochs`` full-batch Adam steps (``fed.lr``) from the broadcast global network
    on their negative local log marginal likelihood per record (eq. 18), and aggregated by

    - ``aggregation="fedavg"``: FedAvg of the weights (channel ``update``, the change of the flat parameters);
    - ``aggregation="distillation"`` (FedBNR-KD, eq. 19): each client uploads the change of its Gram matrix on the
      server's distillation inputs X_kd (channel ``gram``: its strict upper triangle, the diagonal being 1 always),
      the server forms the clients' mean Gram and takes ``kd_steps`` Adam steps (``kd_lr``) on
      :func:`distillation_loss` (its own X_kd, y_kd and weight ``alpha``). X_kd is ``data.alignment``; its inputs
      are broadcast to the clients, its targets stay on the server. See the module docstring.

    ``hidden=()`` learns only the RFF hyperparameters; ``hidden`` defaults to (32,) and ``latent_dim`` to 4.
    ``model``: the user's feature extractor instead of the built-in MLP (neither with ``hidden`` nor ``latent_dim``;
    see the module docstring): an ``nn.Module`` (copied) or a zero-argument factory, built identically on both
    halves from the run's setup stream; the lengthscale defaults to sqrt(its output width).

    Distillation options (defaults measured on 10% validation splits, seed 10, never on a test set: 10 clients, 20
    rounds of 10 local steps, a server set of 8% of the data; one seed, so treat them as sensible, not tuned):
        alpha: weight of the Gram matching term (default 1000). The Gram entries' mean squared change is ~1e-3 to
            1e-2, so smaller weights let the server fit its few labelled points alone: on diabetes with a deep
            kernel and 35 points, alpha in {1, 10, 100} collapsed sigma (validation NLL 34 to 45,000), 1000 did not
            (5.5; the RFF-only kernel was insensitive to alpha).
        kd_steps, kd_lr: server Adam steps per round and their rate (defaults 10 and 0.01; 50 steps overfitted the
            deep kernel more: validation ECE 0.15 vs 0.08).
        gram_clip: C of the ``gram`` channel (default: 0.02 root-mean-square change per entry, see
            :attr:`gram_clip`; the best of {0.02, 0.05, 0.15} at epsilon = 3 on synthetic1d, by 2-8% in NLL).

    Non-private: FedAvg weighs clients by n_c; distillation averages the Grams uniformly (eq. 19 divides by |S|).
    Private: the upload (``update`` or ``gram``) is clipped to a norm (``update_clip``, default ``privacy.clip``;
    ``gram_clip``) as a client-level channel, clients weigh equally (DP-FedAvg's accounting). Under
    ``unit="example"`` the channel's adjacency is replace-one: a record changes its client's clipped upload by up to
    twice the clip.
    """

    name = "fedbnr_kernel"
    supports_privacy = True
    #: what a client step reads of the server half (``privfl.algorithms.base``): the global network's weights, and
    #: under distillation the global Gram on X_kd (None under FedAvg)
    broadcast_state = ("global_params", "global_gram")
    checkpointable = False  # the server keeps the distillation's Adam steps and losses beyond its broadcast

    def __init__(self, fed, privacy, *, model=None, hidden: tuple[int, ...] | None = None,
                 latent_dim: int | None = None, num_samples: int = 50,
                 lengthscale: float | None = None, noise_std: float = 0.5, prior_std: float = 1.0,
                 feature_seed: int = 0, update_clip: float | None = None, aggregation: str = "fedavg",
                 alpha: float = KD_ALPHA, kd_steps: int = KD_STEPS, kd_lr: float = KD_LR,
                 gram_clip: float | None = None):
        super().__init__(fed, privacy)
        if aggregation not in AGGREGATIONS:
            raise ConfigurationError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0:
            raise ConfigurationError(f"alpha (the weight of the Gram matching term of eq. 19) must be a finite number "
                                     f">= 0, got {alpha!r}")
        if isinstance(kd_steps, bool) or not isinstance(kd_steps, int) or kd_steps < 1:
            raise ConfigurationError(f"kd_steps must be an integer >= 1, got {kd_steps!r}")
        if model is not None and (hidden is not None or latent_dim is not None):
            raise ConfigurationError(f"{self.name}: give either model (your feature extractor; its latent dimension is "
                                     "read from its output) or hidden and latent_dim (the built-in tanh MLP), not both")
        self.extractor = None if model is None else extractor_factory(model, self.name)
        self.options = dict(num_samples=num_samples, noise_std=noise_std, prior_std=prior_std, seed=feature_seed)
        if model is None:
            self.options.update(hidden=tuple((32,) if hidden is None else hidden),
                                latent_dim=4 if latent_dim is None else latent_dim)
        self.lengthscale = lengthscale
        self.update_clip = _positive("update_clip", update_clip if update_clip is not None else privacy.clip)
        self.aggregation = aggregation
        self.alpha = float(alpha)
        self.kd_steps = kd_steps
        self.kd_lr = _positive("kd_lr", kd_lr)
        self._gram_clip = None if gram_clip is None else _positive("gram_clip", gram_clip)
        self.net: KernelNetwork | None = None
        self.global_params: np.ndarray | None = None
        self.kd_x: torch.Tensor | None = None
        self.kd_y: np.ndarray | None = None
        self.global_gram: np.ndarray | None = None
        self.mean_gram: np.ndarray | None = None  # the last released mean client Gram K_bar (distillation)
        self.kd_losses: list[list[float]] = []

    @property
    def gram_clip(self) -> float:
        """C of the ``gram`` channel: ``gram_clip``, or by default ``KD_GRAM_RMS`` times the root of the number of
        entries (a root-mean-square change of 0.02 per Gram entry), so the default transfers across n_kd."""
        if self._gram_clip is not None:
            return self._gram_clip
        if self.kd_y is None:
            raise ConfigurationError("the default gram_clip depends on the distillation set; call setup first")
        n = len(self.kd_y)
        return KD_GRAM_RMS * math.sqrt(n * (n - 1) / 2)

    @property
    def channel_name(self) -> str:
        return "gram" if self.aggregation == "distillation" else "update"

    @property
    def channel_shares(self) -> dict[str, float]:
        """The budget shares of the channels this phase releases (for calibration before :meth:`setup`)."""
        return {self.channel_name: 1.0}

    def setup(self, data, rng):
        public = self.bind_public(data)
        _check_regression(public, self.name)
        if self.aggregation == "distillation":
            kd = _distillation_set(public)
            self.kd_x = torch.as_tensor(np.asarray(kd.x, dtype=np.float32))
            self.kd_y = _targets(kd)
        if self.extractor is not None:  # sqrt(latent dim) unless given: the user's latent scale is unknown
            self.net = _built_kernel(self.extractor, public.input_shape, rng, self.name, lengthscale=self.lengthscale,
                                     **self.options)
        else:
            input_dim = int(np.prod(public.input_shape))
            default_scale = 1.0 if self.options["hidden"] else math.sqrt(input_dim)
            with torch.random.fork_rng(devices=[]):  # the initial network from the run's public seed, not global state
                torch.manual_seed(int(rng.integers(0, 2 ** 31 - 1)))
                self.net = KernelNetwork(input_dim, lengthscale=self.lengthscale or default_scale, **self.options)
        self.global_params = flat_parameters(self.net)
        if self.aggregation == "distillation":
            self.global_gram = self._gram_of(self.global_params)

    @property
    def dim(self) -> int:
        return int(self.global_params.size)

    def _gram_of(self, params: np.ndarray) -> np.ndarray:
        net = copy.deepcopy(self.net)
        load_flat_parameters(net, params)
        with torch.no_grad():
            return _gram(net, self.kd_x).numpy()

    def channels(self):
        # a whole-value clip only: at record level a record changes its client's clipped upload (privfl.privacy.units)
        if self.aggregation == "distillation":
            n = len(self.kd_y)
            return [unit_channel(self.privacy, "gram", (n * (n - 1) // 2,), client=NormClip(self.gram_clip),
                                 description="strict upper triangle of the change of the client's Gram on X_kd, "
                                             "clipped to C")]
        return [unit_channel(self.privacy, "update", (self.dim,), client=NormClip(self.update_clip),
                             description="kernel network change, clipped to C")]

    def private_release_weight(self, client: int) -> float:
        return 1.0

    def client_update(self, client, dataset, round, rng):
        # trained in float64, network and loss: a finite record far out (a target of 1e20, whose square and gradient
        # overflow float32) made the gradients infinite, Adam's step NaN and the next step's Cholesky factor fail
        local = copy.deepcopy(self.net)
        load_flat_parameters(local, self.global_params)
        local = local.double()
        n = len(dataset)
        loss_value = math.nan
        if n:  # no records: the evidence of none is a constant (0), so the change is zero (nothing to train on)
            x = torch.as_tensor(np.asarray(dataset.x))
            y = torch.as_tensor(_targets(dataset))
            opt = torch.optim.Adam(local.parameters(), lr=self.fed.lr)
            for _ in range(self.fed.local_epochs):
                opt.zero_grad(set_to_none=True)
                loss = -blr_log_marginal_likelihood(local(x), y, local.log_noise_std.exp(),
                                                    local.log_prior_std.exp()) / n
                loss.backward()
                opt.step()
                loss_value = float(loss.detach())
        if self.aggregation == "distillation":
            with torch.no_grad():
                change = (_upper(_gram(local, self.kd_x).numpy() - self.global_gram) if n
                          else np.zeros(len(self.kd_y) * (len(self.kd_y) - 1) // 2))
            return ClientOutput({"gram": change}, weight=1.0,
                                metrics={"gram_change_norm": float(np.linalg.norm(change)), "nlml": loss_value})
        update = flat_parameters(local) - self.global_params if n else np.zeros_like(self.global_params)
        weight = 1.0 if self.privacy.private else float(len(dataset))
        return ClientOutput({"update": update}, weight=weight,
                            metrics={"update_norm": float(np.linalg.norm(update)), "nlml": loss_value})

    def server_update(self, aggregates: Mapping[str, Aggregate], round):
        if self.aggregation == "fedavg":
            agg = aggregates["update"]
            self.global_params = self.global_params + self.fed.server_lr * agg.total / agg.total_weight
            return
        agg = aggregates["gram"]
        self.mean_gram = self.global_gram + _symmetric(agg.total / agg.total_weight, len(self.kd_y))
        net = self.kernel()
        self.kd_losses.append(distill_kernel(net, self.kd_x, self.kd_y, self.mean_gram, alpha=self.alpha,
                                             steps=self.kd_steps, lr=self.kd_lr))
        self.global_params = flat_parameters(net)
        self.global_gram = self._gram_of(self.global_params)

    def kernel(self) -> KernelNetwork:
        """The current global kernel network (a copy), to hand to :class:`FedBNR`."""
        net = copy.deepcopy(self.net)
        load_flat_parameters(net, self.global_params)
        return net

    def evaluate(self, dataset):
        """The global kernel's negative log marginal likelihood per record on ``dataset`` and its hyperparameters
        (phase 1 has no predictor of its own: that needs phase 2's statistics)."""
        net = self.kernel()
        with torch.no_grad():
            y = torch.as_tensor(_targets(dataset))
            nlml = -blr_log_marginal_likelihood(net(torch.as_tensor(dataset.x)), y, net.log_noise_std.exp(),
                                                net.log_prior_std.exp()) / len(y)
        return {"nlml": float(nlml), "noise_std": net.noise_std, "prior_std": net.prior_std,
                "lengthscale": net.lengthscale}


# -- both phases --------------------------------------------------------------------------------------------------

def phase_budgets(epsilon: float, delta: float, kernel_rounds: int, regression_rounds: int,
                  regression_shares: Mapping[str, float], accountant: str, kernel_share: float = 0.5,
                  kernel_shares: Mapping[str, float] | None = None) -> tuple[float, float]:
    """Per-phase epsilons (kernel, regression) whose composition meets (epsilon, delta) under ``accountant``.

    Gaussian releases compose by adding mu^2 (Gaussian DP; rho in zCDP), so phase 1 gets ``kernel_share`` of
    mu(epsilon, delta)^2 and phase 2 the rest; each share is turned back into an epsilon at ``delta``. Then the
    noise both calibrations will choose is composed under ``accountant`` (which may be slightly looser than exact),
    and both shares shrink by the smallest factor (to 1e-4) for which the composition meets the target.
    ``kernel_shares``: the kernel phase's channels and budget shares (default ``{"update": 1.0}``, FedAvg; FedBNR-KD
    releases ``{"gram": 1.0}``: :attr:`FedBNRKernel.channel_shares`).
    """
    if not 0 < kernel_share < 1:
        raise ConfigurationError(f"kernel_share must lie in (0, 1), got {kernel_share!r}")
    mu = gaussian_mu(epsilon, delta)

    def split(s: float) -> tuple[float, float]:
        """Each phase's epsilon when the phases share mu / s (s >= 1 shrinks both)."""
        return (gaussian_epsilon(mu * math.sqrt(kernel_share) / s, delta),
                gaussian_epsilon(mu * math.sqrt(1.0 - kernel_share) / s, delta))

    def both_phases(s: float) -> PrivacyEvent:
        """The run's events when each phase is calibrated to its share of mu / s: the factory the search uses."""
        eps_k, eps_r = split(s)
        cal_k = calibrate(eps_k, delta, kernel_rounds, channels=dict(kernel_shares or {"update": 1.0}),
                          accountant=accountant)
        cal_r = calibrate(eps_r, delta, regression_rounds, channels=dict(regression_shares), accountant=accountant)
        return ComposedEvent((SelfComposedEvent(round_event(cal_k.noise_multipliers), kernel_rounds),
                              SelfComposedEvent(round_event(cal_r.noise_multipliers), regression_rounds)))

    # The one search (accounting.calibration.calibrate_noise) over the shrink s: the exact accountant lands on s = 1
    # up to float error; looser accountants need s a little above 1.
    try:
        s, _ = calibrate_noise(both_phases, epsilon, delta, accountant, guess=1.0, step=1.001, tol=1e-4,
                               lower=1e-3, upper=1e3)
    except InvalidPrivacyParameter as exc:
        raise ConfigurationError(f"could not split epsilon={epsilon} between FedBNR's phases under the "
                                 f"{accountant} accountant ({exc}); use the exact or zcdp accountant") from None
    return split(s)


__all__ = ["BLRPosterior", "BLRPredictor", "FedBNR", "FedBNRClippingWarning", "FedBNRKernel", "PairedScatter",
           "blr_from_statistics", "centralised_blr", "distill_kernel", "distillation_loss", "phase_budgets",
           "prior_posterior", "repair_scatter"]
