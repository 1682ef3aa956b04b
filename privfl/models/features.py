"""Kernel networks in the unifying-random-kernel sense (FedBNR, Yu et al., Sec. 4.1): random features whose random
weights omega come from a public seed, optionally after a learned feature extractor.

A kernel network maps an input x to ``phi(x) = s^m(x) / sqrt(m)``, the concatenation of m samples of
``z_omega(h(x)) = [cos(omega^T h(x) / l), sin(omega^T h(x) / l)]`` with omega ~ N(0, I) (eqs. 14-17): random Fourier
features (Rahimi and Recht 2007) of the Gaussian kernel exp(-|h - h'|^2 / (2 l^2)) on ``h(x)``, where h is the
identity (pure RFF, the default), a small MLP (deep kernel, learned in FedBNR's phase 1) or the user's own
``nn.Module`` (:func:`check_extractor` says which ones: a flat vector per example, no layer mixing the examples of a
batch; the extractor is always evaluated in eval mode, so a record's features are a function of that record alone).

Facts the privacy analysis of FedBNR's phase 2 uses:

- omega is drawn from a seed every party knows, so the feature map costs no privacy; only the extractor's weights
  (learned from data) are charged, in phase 1.
- each (cos, sin) pair has norm 1, so **every feature row has norm exactly 1**: clipping rows to B = 1 never changes
  a row, and ``Phi^T Phi`` has trace n.
- the row is made of m = ``num_samples`` disjoint (cos, sin) pairs, coordinates k and m + k, each of squared norm
  |phi|^2 / m, and nothing else (no bias feature); scaling a row (the row clip) keeps that. Whatever h is, then
  sum_i phi_i^4 <= sum_k (cos_k^2 + sin_k^2)^2 = |phi|^4 / m, which FedBNR's symmetric scatter release uses
  (:func:`cos_sin_pairs` declares m for a feature map of this module, :func:`pair_squared_norms` checks it on rows).
  m counts frequencies, not features (2m); reading it as 2m would understate that bound.

:class:`LinearRandomFourierFeatures` (FedBNR's default without an extractor) puts a linear block with a bias beside
random Fourier features: its rows have norm at most 1 (not exactly 1) and are not pairs only, so it declares the
bound on one record's scatter term itself (:func:`scatter_term_square_bound`), which FedBNR checks on every row.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from privfl.errors import ConfigurationError
from privfl.models.checks import mixes_examples, module_dtype as _module_dtype

#: distinguishes the feature map's stream from any other use of the same public seed
_OMEGA_STREAM = 0x46424E52  # "FBNR"


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not math.isfinite(value) \
            or value <= 0:
        raise ConfigurationError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigurationError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def fourier_frequencies(input_dim: int, num_samples: int, seed: int) -> np.ndarray:
    """omega ~ N(0, I), shape ``(input_dim, num_samples)``, from the public ``seed`` alone (never from a run's data
    or training randomness), so every client and the server derive the same map."""
    input_dim, num_samples = _count("input_dim", input_dim), _count("num_samples", num_samples)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigurationError(f"feature seed must be an integer >= 0, got {seed!r}")
    rng = np.random.default_rng(np.random.SeedSequence([_OMEGA_STREAM, int(seed), input_dim, num_samples]))
    return rng.standard_normal((input_dim, num_samples))


# -- a user's feature extractor -----------------------------------------------------------------------------------

def extractor_factory(model, what: str) -> Callable[[], nn.Module]:
    """A zero-argument builder of the feature extractor ``model``: a copy of an ``nn.Module`` (the user's module is
    never trained or changed), or the module a zero-argument factory returns. ``model`` must be deep-copyable, since
    an algorithm's client half is built from deep copies of its server half's constructor arguments."""
    if not isinstance(model, nn.Module) and not callable(model):
        raise ConfigurationError(f"{what}: model must be a torch.nn.Module or a zero-argument function returning one "
                                 f"(the feature extractor f of g(omega, f(x))), got {type(model).__name__}")
    try:
        copy.deepcopy(model)
    except Exception as exc:
        raise ConfigurationError(f"{what}: the model must be deep-copyable (the client half is built from copies of "
                                 f"the server half's arguments): {type(exc).__name__}: {exc}") from None
    if isinstance(model, nn.Module):
        refuse_batch_norm(model, f"{what}: the model")
        return lambda: copy.deepcopy(model)

    def build() -> nn.Module:
        try:
            net = model()
        except TypeError as exc:
            raise ConfigurationError(f"{what}: the model factory must take no arguments ({exc}); pass an nn.Module "
                                     "or e.g. lambda: MyExtractor(10, 4)") from None
        if not isinstance(net, nn.Module):
            raise ConfigurationError(f"{what}: the model factory returned a {type(net).__name__}, not a "
                                     "torch.nn.Module")
        return net

    return build


def refuse_batch_norm(extractor: nn.Module, what: str) -> None:
    """Refuse an extractor with batch normalisation (see :func:`check_extractor`), naming its layers."""
    mixing = [f"{name or '<model>'} ({type(m).__name__})" for name, m in extractor.named_modules()
              if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if mixing:
        raise ConfigurationError(f"{what}: batch normalisation ({', '.join(mixing[:8])}) mixes the examples of a "
                                 "batch (its statistics are the batch's in training and the data's otherwise), so a "
                                 "record's features would not be its own and FedBNR's sensitivities would not hold; "
                                 "remove it (standardise the inputs with public statistics instead), or use a "
                                 "per-example normalisation such as nn.LayerNorm")


def check_extractor(extractor: nn.Module, input_shape: Sequence[int], what: str = "the feature extractor") -> int:
    """The width of ``extractor``'s output (the latent dimension), read from a forward pass on one zero input of the
    public ``input_shape``; refuses (ConfigurationError) an extractor whose output is not one flat, finite vector per
    example, or that mixes the examples of a batch.

    FedBNR's channels are sums of per-record terms (phase 2) and its sensitivities assume a record's feature row is a
    function of that record alone. Batch normalisation breaks that (batch statistics in training, running statistics
    of data otherwise) and is refused by type; any other layer that does (e.g. ``x - x.mean(0)``) is caught by moving
    the other rows of a batch of random inputs and checking, in float64, that the first row's output does not move
    (:func:`privfl.models.checks.mixes_examples`, the probe the DP-SGD model check shares).
    The probes run on a copy in eval mode, under a forked torch random state."""
    input_shape = tuple(int(s) for s in input_shape)
    refuse_batch_norm(extractor, what)
    probe = copy.deepcopy(extractor).eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = probe(torch.zeros((1, *input_shape), dtype=_module_dtype(probe, torch.float32)))
    except Exception as exc:
        raise ConfigurationError(f"{what} failed on an input of shape {(1, *input_shape)} (one record of the "
                                 f"clients' data): {type(exc).__name__}: {exc}") from None
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != 1 or out.shape[1] < 1:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigurationError(f"{what} must return one flat vector per example, a tensor of shape (n, k); on an "
                                 f"input of shape {(1, *input_shape)} it returned {shape}. End it with nn.Flatten() "
                                 "(or reshape to (n, -1)) before the random features")
    if not torch.isfinite(out).all():
        raise ConfigurationError(f"{what} returned non-finite features on a zero input")
    try:
        wide = probe.double()
        gen = torch.Generator().manual_seed(0)
        batch = torch.randn((3, *input_shape), generator=gen, dtype=torch.float64)
        moved = batch.clone()
        moved[1:] = 3.0 * torch.randn((2, *input_shape), generator=gen, dtype=torch.float64)
        # the first row's output, with the other rows moved and with them left out (privfl.models.checks)
        mixing = mixes_examples(wide, batch, moved) or mixes_examples(wide, batch, batch[:1])
    except Exception as exc:
        raise ConfigurationError(f"{what} failed on a batch of 3 random inputs in float64: "
                                 f"{type(exc).__name__}: {exc}") from None
    if mixing:
        raise ConfigurationError(f"{what} mixes the examples of a batch: one record's output changed when the other "
                                 "records of its batch did, so a record's features would not be its own and FedBNR's "
                                 "sensitivities would not hold; use layers that act on each example alone")
    return int(out.shape[1])


class RandomFourierFeatures:
    """phi(x) = [cos(x omega / l), sin(x omega / l)] / sqrt(m): ``2 * num_samples`` features approximating the
    Gaussian kernel with lengthscale ``lengthscale`` (FedBNR Theorem 2). Rows have norm exactly 1.

    Inputs of any shape ``(n, *input_shape)`` are flattened; the result is float64 of shape ``(n, 2m)``.
    """

    def __init__(self, input_dim: int, num_samples: int = 50, lengthscale: float = 1.0, seed: int = 0):
        self.input_dim = _count("input_dim", input_dim)
        self.num_samples = _count("num_samples", num_samples)
        self.lengthscale = _positive("lengthscale", lengthscale)
        self.seed = int(seed)
        self.omega = fourier_frequencies(self.input_dim, self.num_samples, self.seed)

    @property
    def dim(self) -> int:
        return 2 * self.num_samples

    def __call__(self, x) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        x = x.reshape(len(x), -1)
        if x.shape[1] != self.input_dim:
            raise ConfigurationError(f"feature map expects inputs of dimension {self.input_dim}, got {x.shape[1]}")
        proj = x @ (self.omega / self.lengthscale)
        return np.concatenate([np.cos(proj), np.sin(proj)], axis=1) / math.sqrt(self.num_samples)

    def kernel(self, x1, x2) -> np.ndarray:
        """The exact Gaussian kernel that the features approximate (for references and tests)."""
        a = np.asarray(x1, dtype=np.float64).reshape(len(x1), -1)
        b = np.asarray(x2, dtype=np.float64).reshape(len(x2), -1)
        sq = (a ** 2).sum(1)[:, None] + (b ** 2).sum(1)[None, :] - 2.0 * a @ b.T
        return np.exp(-np.maximum(sq, 0.0) / (2.0 * self.lengthscale ** 2))


class LinearRandomFourierFeatures:
    """A linear block beside random Fourier features, the feature map of the kernel
    ``a k_lin(x, x') + (1 - a) k_gauss(x, x')``: ``phi(x) = [sqrt(a) l(x), sqrt(1 - a) r(x)]`` where

    - ``l(x) = [u(x), 1] / sqrt(2)``, ``u(x) = x / (c sqrt(d))`` scaled down to norm 1 where it is longer (c =
      ``linear_scale``; standardised inputs have |x| ~ sqrt(d), so u is mostly inside the ball), the constant
      coordinate a bias: ``d + 1`` features of squared norm (1 + |u|^2) / 2 in [1/2, 1];
    - ``r(x)``: :class:`RandomFourierFeatures` (m = ``num_samples`` (cos, sin) pairs, norm exactly 1);

    so every row has norm at most 1 (clipping rows to B = 1 changes none), shape ``(n, d + 1 + 2m)``, float64.

    Why: on small federations under DP the Gaussian kernel's 2m directions each carry little of the pooled signal
    and the released scatter's noise drowns them, while a linear trend (most of many tabular targets) lives in d + 1
    directions that each carry much of it. ``a = linear_share`` is the prior's share of the linear part (the two
    blocks are orthogonal, so a is the weight of k_lin in the kernel).

    ``kappa`` bounds sum_i phi_i^4 / |phi|^4 over every possible row: with s = |u|^2 in [0, 1], sum_i l_i^4 <= (1 + s^2) / 4 and sum_i r_i^4 <= 1 / m,
    so the ratio is at most f(s) = (A (1 + s^2) + C) / (B (1 + s) + D)^2 with A = a^2 / 4, C = (1 - a)^2 / m,
    B = a / 2, D = 1 - a. Its derivative vanishes only at s* = B (A + C) / (A (B + D)), so kappa = the largest of
    f(0), f(1) and f(s*) when s* lies in [0, 1]. Row clipping scales a row, which leaves the ratio unchanged.
    The sup ratio (at s = 0 for a large share) and the sup norm (s = 1) belong to different rows, so the release is
    charged by :meth:`term_square_bound`, the sup of the two together per s, which is smaller than B^4 (1 + kappa) / 2.
    """

    def __init__(self, input_dim: int, num_samples: int = 50, lengthscale: float = 1.0, seed: int = 0,
                 linear_share: float = 0.5, linear_scale: float = 1.0):
        self.rff = RandomFourierFeatures(input_dim, num_samples, lengthscale, seed)
        self.input_dim, self.num_samples = self.rff.input_dim, self.rff.num_samples
        self.lengthscale, self.seed = self.rff.lengthscale, self.rff.seed
        share = linear_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
            raise ConfigurationError(f"linear_share must lie in (0, 1), got {share!r}")
        self.linear_share = float(share)
        self.linear_scale = _positive("linear_scale", linear_scale)
        a, m = self.linear_share, self.num_samples
        big_a, c, big_b, big_d = a * a / 4.0, (1.0 - a) ** 2 / m, a / 2.0, 1.0 - a

        def ratio(s: float) -> float:
            return (big_a * (1.0 + s * s) + c) / (big_b * (1.0 + s) + big_d) ** 2

        self._ratio = ratio
        self._stationary = big_b * (big_a + c) / (big_a * (big_b + big_d))
        self._fourth = lambda s: big_a * (1.0 + s * s) + c  # N(s) >= sum_i phi_i^4 of a row at s = |u|^2
        self._square = lambda s: big_b * (1.0 + s) + big_d  # L(s) = |phi|^2 of a row at s
        #: sup over rows of sum_i phi_i^4 / |phi|^4 (see the class docstring)
        self.kappa = self._max_ratio(0.0, 1.0)

    def _max_ratio(self, low: float, high: float) -> float:
        """The largest f(s) for s in [low, high]: at an end or at the one stationary point."""
        candidates = [low, high] + ([self._stationary] if low <= self._stationary <= high else [])
        return max(self._ratio(s) for s in candidates)

    def term_square_bound(self, clip: float) -> float:
        """T^2, the sup over rows scaled down to norm ``clip`` where longer of (|phi|^4 + sum_i phi_i^4) / 2: the
        squared norm of the upper triangle of one record's phi phi^T, so T is the symmetric scatter release's
        add/remove sensitivity (``ScatterBound``). Per s = |u|^2: a row inside the clip gives at most
        (L(s)^2 + N(s)) / 2, which grows with s; a row scaled to the clip gives at most clip^4 (1 + f(s)) / 2 (scaling
        keeps the ratio). Rows are scaled where L(s) > clip^2, s > s_c, so T^2 is the larger of the first at
        min(1, s_c) (when s_c >= 0) and the second with f's largest value on [max(0, s_c), 1] (when s_c < 1). Tight as
        a sup: a row with u on one axis at |u| = 1 and every (cos, sin) pair all cosine or all sine (approached along
        that axis) reaches N(1) (the same for the clipped form's ratio), though no input need attain it exactly."""
        clip = _positive("clip", clip)
        a = self.linear_share
        s_c = (clip * clip - 1.0 + a / 2.0) * 2.0 / a  # L(s_c) = clip^2
        values = []
        if s_c >= 0.0:
            s = min(1.0, s_c)
            values.append((self._square(s) ** 2 + self._fourth(s)) / 2.0)
        if s_c < 1.0:
            values.append(clip ** 4 * (1.0 + self._max_ratio(max(0.0, s_c), 1.0)) / 2.0)
        return max(values)

    @property
    def dim(self) -> int:
        return self.input_dim + 1 + self.rff.dim

    def linear_block(self, x) -> np.ndarray:
        """``l(x)``: the scaled inputs (within the unit ball) and the bias, over sqrt(2)."""
        x = np.asarray(x, dtype=np.float64)
        x = x.reshape(len(x), -1)
        if x.shape[1] != self.input_dim:
            raise ConfigurationError(f"feature map expects inputs of dimension {self.input_dim}, got {x.shape[1]}")
        u = x / (self.linear_scale * math.sqrt(self.input_dim))
        u = u / np.maximum(np.linalg.norm(u, axis=1, keepdims=True), 1.0)
        return np.concatenate([u, np.ones((len(u), 1))], axis=1) / math.sqrt(2.0)

    def __call__(self, x) -> np.ndarray:
        a = self.linear_share
        return np.concatenate([math.sqrt(a) * self.linear_block(x), math.sqrt(1.0 - a) * self.rff(x)], axis=1)


class KernelNetwork(nn.Module):
    """A kernel network g(omega, f(x)) with its Bayesian linear regression hyperparameters.

    - ``hidden`` empty and no ``extractor``: f is the identity and the network is pure RFF with a learnable
      lengthscale; ``hidden``: f is an MLP ``input_dim -> hidden... -> latent_dim`` (tanh), the deep feature
      extractor; ``extractor``: f is that ``nn.Module`` (taken as is: pass a copy), fed inputs of ``input_shape``
      (default ``(input_dim,)``), its latent dimension read by :func:`check_extractor`, which also refuses one that
      mixes the examples of a batch. The extractor always runs in eval mode (``train()`` leaves it there): a record's
      features depend on that record alone, in phase 1's training as in phase 2's release.
    - omega is a frozen buffer from ``seed`` (public, never trained, never uploaded).
    - learnable in phase 1 (eq. 18): the extractor, log lengthscale, log noise std sigma, log prior std lambda.
    - ``lengthscale`` None: sqrt of the latent dimension (the RFF default for standardised coordinates).

    ``forward(x)`` returns Phi, float64 of shape ``(n, 2 * num_samples)`` with unit-norm rows.
    """

    def __init__(self, input_dim: int, num_samples: int = 50, hidden: Sequence[int] = (), latent_dim: int = 8,
                 lengthscale: float | None = 1.0, noise_std: float = 0.5, prior_std: float = 1.0, seed: int = 0,
                 extractor: nn.Module | None = None, input_shape: Sequence[int] | None = None):
        super().__init__()
        self.input_dim = _count("input_dim", input_dim)
        self.num_samples = _count("num_samples", num_samples)
        self.input_shape = (self.input_dim,) if input_shape is None else tuple(int(s) for s in input_shape)
        if int(np.prod(self.input_shape)) != self.input_dim:
            raise ConfigurationError(f"input_shape {self.input_shape} does not hold input_dim={self.input_dim} values")
        hidden = tuple(hidden)
        for h in hidden:
            _count("hidden width", h)
        if extractor is not None and hidden:
            raise ConfigurationError("give either hidden (the built-in tanh MLP extractor) or extractor (your own "
                                     "module), not both")
        self.hidden = hidden
        if extractor is not None:
            if not isinstance(extractor, nn.Module):
                raise ConfigurationError(f"extractor must be a torch.nn.Module, got {type(extractor).__name__}")
            width = check_extractor(extractor, self.input_shape)
            self.extractor = extractor
        else:
            layers: list[nn.Module] = []
            width = self.input_dim
            if hidden:
                for h in hidden:
                    layers += [nn.Linear(width, h), nn.Tanh()]
                    width = h
                layers.append(nn.Linear(width, _count("latent_dim", latent_dim)))
                width = latent_dim
            self.extractor = nn.Sequential(*layers)
        self.deep = bool(hidden) or extractor is not None
        self.latent_dim = width
        self.seed = int(seed)
        omega = fourier_frequencies(width, self.num_samples, self.seed)
        self.register_buffer("omega", torch.as_tensor(omega, dtype=torch.float64))
        lengthscale = math.sqrt(width) if lengthscale is None else lengthscale
        self.log_lengthscale = nn.Parameter(torch.tensor(math.log(_positive("lengthscale", lengthscale))))
        self.log_noise_std = nn.Parameter(torch.tensor(math.log(_positive("noise_std", noise_std))))
        self.log_prior_std = nn.Parameter(torch.tensor(math.log(_positive("prior_std", prior_std))))
        self.extractor.eval()

    def train(self, mode: bool = True) -> "KernelNetwork":
        """Set the mode of the hyperparameters; the extractor stays in eval mode (no batch statistics, no dropout:
        a record's features are its own)."""
        super().train(mode)
        self.extractor.eval()
        return self

    @property
    def dim(self) -> int:
        return 2 * self.num_samples

    @property
    def noise_std(self) -> float:
        return float(self.log_noise_std.detach().exp())

    @property
    def prior_std(self) -> float:
        return float(self.log_prior_std.detach().exp())

    @property
    def lengthscale(self) -> float:
        return float(self.log_lengthscale.detach().exp())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.as_tensor(x)
        if self.deep:  # in the extractor's own precision (float32 for training; float64 after ``.double()``)
            x = x.reshape(len(x), *self.input_shape)
            h = self.extractor(x.to(_module_dtype(self.extractor, torch.float64))).reshape(len(x), self.latent_dim)
            h = h.double()
        else:  # (n, latent_dim), not (n, -1): a client without records has n = 0 rows
            h = x.reshape(len(x), self.latent_dim).double()
        proj = h @ self.omega / self.log_lengthscale.double().exp()
        return torch.cat([torch.cos(proj), torch.sin(proj)], dim=1) / math.sqrt(self.num_samples)

    @torch.no_grad()
    def features(self, x) -> np.ndarray:
        """Phi as a float64 numpy array (the fixed feature map of phase 2). On a ``.double()`` copy every row is
        computed in float64, so a record's row does not depend, beyond float64 rounding, on the other records of its
        batch (float32 matrix products do, by ~1e-8, with the batch's shape)."""
        was = self.training
        self.eval()
        try:
            return self(torch.as_tensor(np.asarray(x, dtype=np.float32))).numpy()
        finally:
            self.train(was)


def cos_sin_pairs(feature_map) -> int | None:
    """m, the number of (cos, sin) pairs every row of ``feature_map`` is made of, when the map is one of this module's
    (a :class:`RandomFourierFeatures`, a :class:`KernelNetwork` or its bound ``features``; not a subclass, which may
    change ``forward``); None for any other callable, of whose rows nothing is known beyond their clip."""
    if type(feature_map) in (RandomFourierFeatures, KernelNetwork):
        return feature_map.num_samples
    owner = getattr(feature_map, "__self__", None)
    if type(owner) is KernelNetwork and getattr(feature_map, "__func__", None) is KernelNetwork.features:
        return owner.num_samples
    return None


def scatter_term_square_bound(feature_map, clip: float) -> float | None:
    """T^2 (:meth:`LinearRandomFourierFeatures.term_square_bound`) for such a map and row clip, else None (pure
    (cos, sin) pairs have their own tight bound, ``PairedScatter``)."""
    if type(feature_map) is LinearRandomFourierFeatures:
        return feature_map.term_square_bound(clip)
    return None


def pair_squared_norms(phi: np.ndarray, pairs: int) -> np.ndarray:
    """cos_k^2 + sin_k^2 of each row of ``phi`` (shape ``(n, 2 pairs)``, the layout of this module's feature maps:
    m cosines, then m sines): an ``(n, pairs)`` array, every entry of a row equal to |phi|^2 / m for a feature row
    of this module, scaled or not."""
    phi = np.asarray(phi, dtype=np.float64)
    if phi.ndim != 2 or phi.shape[1] != 2 * pairs:
        raise ConfigurationError(f"rows of {pairs} (cos, sin) pairs have {2 * pairs} features, got shape {phi.shape}")
    return phi[:, :pairs] ** 2 + phi[:, pairs:] ** 2


def blr_log_marginal_likelihood(phi: torch.Tensor, y: torch.Tensor, noise_std: torch.Tensor,
                                prior_std: torch.Tensor) -> torch.Tensor:
    """log p(y | Phi; sigma, lambda) of Bayesian linear regression (FedBNR eq. 18 with its factors 1/2 and 2 pi):

        -n/2 log(2 pi sigma^2) - d log lambda - 1/2 log|A| - y^T y / (2 sigma^2) + 1/2 b^T A^-1 b,

    with A = Phi^T Phi / sigma^2 + I / lambda^2 and b = Phi^T y / sigma^2 (Woodbury form of the GP evidence).
    Differentiable in Phi, sigma and lambda; computed in float64 through a Cholesky factor.
    """
    phi = phi.double()
    y = y.double().reshape(-1)
    n, d = phi.shape
    s2 = noise_std.double() ** 2
    lam = prior_std.double()
    a = phi.T @ phi / s2 + torch.eye(d, dtype=torch.float64) / lam ** 2
    chol = torch.linalg.cholesky(a)
    b = phi.T @ y / s2
    alpha = torch.cholesky_solve(b.unsqueeze(1), chol).squeeze(1)
    return (-0.5 * n * torch.log(2 * math.pi * s2) - d * torch.log(lam) - torch.log(torch.diagonal(chol)).sum()
            - 0.5 * (y @ y) / s2 + 0.5 * (b @ alpha))


__all__ = ["KernelNetwork", "LinearRandomFourierFeatures", "RandomFourierFeatures", "blr_log_marginal_likelihood",
           "check_extractor", "cos_sin_pairs", "extractor_factory", "fourier_frequencies",
           "pair_squared_norms", "refuse_batch_norm", "scatter_term_square_bound"]
