"""Mean-field Gaussian Bayes-by-Backprop layers (Blundell et al. 2015).

Each weight w ~ N(mu, std^2) with ``std = softplus(rho)``; ``weight_mu``/``weight_rho`` (and ``bias_mu``/
``bias_rho``) are the trainable parameters. Two sampling schemes:

- ``"local"`` (default; Kingma, Salimans & Welling 2015): sample each *pre-activation* from its exact Gaussian,
  N(x mu^T + b_mu, x^2 std^2^T + b_std^2) (the same with convolutions), independently per example. Same
  expectation as weight sampling, lower gradient variance, no weight-sized noise tensor.
- ``"weight"``: draw one weight sample ``mu + std * eps`` per forward call, shared by the batch.

With ``sampling`` off (``deterministic(model)`` or ``model.deterministic()``) a layer uses its means, exactly a plain
``nn.Linear``/``nn.Conv2d`` with weights ``mu``. Train/eval mode does not change sampling, so Monte-Carlo prediction
works in eval mode. Noise comes from ``layer.generator`` (a ``torch.Generator``) when one is set.

Priors are diagonal Gaussians given by mean and *precision* (1/variance), scalar or per parameter, so the global
posterior (mu, Lambda) of HBFL/FOLA and FedBNN's tuned priors plug in directly.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from privfl.models.errors import ModelConfigError

REPARAMETERIZATIONS = ("local", "weight")
_VAR_FLOOR = 1e-16  # keeps sqrt differentiable where a pre-activation variance is exactly 0


def softplus(rho: torch.Tensor) -> torch.Tensor:
    """std = log(1 + exp(rho)), computed stably."""
    return F.softplus(rho)


def inverse_softplus(std: torch.Tensor | float) -> torch.Tensor:
    """rho with softplus(rho) = std, stable for tiny and large std: rho = std + log(-expm1(-std))."""
    std = torch.as_tensor(std, dtype=torch.float64)
    if not bool(torch.all(std > 0)):
        raise ModelConfigError("standard deviations must be positive to invert the softplus")
    return std + torch.log(-torch.expm1(-std))


@dataclass(frozen=True)
class GaussianPrior:
    """N(mean, 1/precision) per parameter; ``mean``/``precision`` are floats (isotropic) or tensors broadcastable to
    the parameter's shape."""

    mean: float | torch.Tensor = 0.0
    precision: float | torch.Tensor = 1.0

    def __post_init__(self) -> None:
        p = torch.as_tensor(self.precision)
        if not bool(torch.all(torch.isfinite(p) & (p > 0))):
            raise ModelConfigError("prior precision must be positive and finite everywhere")
        if not bool(torch.all(torch.isfinite(torch.as_tensor(self.mean)))):
            raise ModelConfigError("prior mean must be finite")

    @classmethod
    def from_std(cls, std: float, mean: float = 0.0) -> "GaussianPrior":
        if not (math.isfinite(std) and std > 0):
            raise ModelConfigError(f"prior std must be positive and finite, got {std}")
        return cls(mean, 1.0 / std ** 2)


def gaussian_kl(mu: torch.Tensor, std: torch.Tensor, prior: GaussianPrior) -> torch.Tensor:
    """Sum over entries of KL(N(mu, std^2) || N(m0, 1/p0)) = 1/2 [p0 std^2 + p0 (mu - m0)^2 - 1 - log(p0 std^2)]."""
    m0 = torch.as_tensor(prior.mean, dtype=mu.dtype, device=mu.device)
    p0 = torch.as_tensor(prior.precision, dtype=mu.dtype, device=mu.device)
    var = std * std
    return 0.5 * (p0 * var + p0 * (mu - m0) ** 2 - 1.0 - torch.log(p0 * var)).sum()


class BayesModule(nn.Module):
    """Base of the Bayesian layers: Gaussian parameters (mu, rho) by name, sampling switch, KL to a prior."""

    gaussian_names: tuple[str, ...] = ()

    def _init_gaussian(self, shapes: Mapping[str, tuple[int, ...]], init_rho: float, reparameterization: str,
                       ) -> None:
        if reparameterization not in REPARAMETERIZATIONS:
            raise ModelConfigError(f"reparameterization must be one of {REPARAMETERIZATIONS}, got "
                                   f"{reparameterization!r}")
        if not math.isfinite(init_rho):
            raise ModelConfigError(f"init_rho must be finite, got {init_rho}")
        self.reparameterization = reparameterization
        self.init_rho = float(init_rho)
        self.sampling = True
        self.generator: torch.Generator | None = None
        names = []
        for name, shape in shapes.items():
            self.register_parameter(f"{name}_mu", nn.Parameter(torch.empty(shape)))
            self.register_parameter(f"{name}_rho", nn.Parameter(torch.empty(shape)))
            names.append(name)
        self.gaussian_names = tuple(names)

    def gaussian_parameters(self) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
        """{"weight": (weight_mu, weight_rho), "bias": (bias_mu, bias_rho)} (bias only if the layer has one)."""
        return {n: (getattr(self, f"{n}_mu"), getattr(self, f"{n}_rho")) for n in self.gaussian_names}

    def std(self, name: str = "weight") -> torch.Tensor:
        """softplus(rho) of the named Gaussian parameter."""
        return softplus(getattr(self, f"{name}_rho"))

    def _noise(self, like: torch.Tensor) -> torch.Tensor:
        return torch.randn(like.shape, dtype=like.dtype, device=like.device, generator=self.generator)

    def _sample(self, name: str) -> torch.Tensor | None:
        if name not in self.gaussian_names:
            return None
        mu = getattr(self, f"{name}_mu")
        if not self.sampling:
            return mu
        return mu + self.std(name) * self._noise(mu)

    def kl_divergence(self, prior: GaussianPrior | Mapping[str, GaussianPrior]) -> torch.Tensor:
        """KL(q || prior) summed over this layer's weights and bias; ``prior`` is one ``GaussianPrior`` for all, or a
        mapping ``{"weight": ..., "bias": ...}`` (e.g. per-parameter tensors of a global posterior)."""
        total = torch.zeros((), dtype=self.weight_mu.dtype, device=self.weight_mu.device)
        for name, (mu, rho) in self.gaussian_parameters().items():
            if isinstance(prior, GaussianPrior):
                p = prior
            elif name in prior:
                p = prior[name]
            else:
                raise ModelConfigError(f"the prior has no entry for {name!r}; give one per Gaussian parameter "
                                       f"{self.gaussian_names}")
            total = total + gaussian_kl(mu, softplus(rho), p)
        return total

    @torch.no_grad()
    def reset_std(self, std: float) -> None:
        """Set every std to ``std`` (e.g. HBFL's re-initialised variance each round), means unchanged."""
        rho = float(inverse_softplus(std))
        for _, r in self.gaussian_parameters().values():
            r.fill_(rho)

    def _reset(self, fan_in: int) -> None:
        # means as torch's default nn.Linear/nn.Conv2d init (kaiming-uniform weights, uniform bias)
        nn.init.kaiming_uniform_(self.weight_mu, a=math.sqrt(5))
        if "bias" in self.gaussian_names:
            bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            nn.init.uniform_(self.bias_mu, -bound, bound)
        with torch.no_grad():
            for _, r in self.gaussian_parameters().values():
                r.fill_(self.init_rho)

    def extra_repr(self) -> str:
        return f"reparameterization={self.reparameterization!r}, sampling={self.sampling}"


class BayesLinear(BayesModule):
    """Bayesian counterpart of ``nn.Linear``: y = x W^T + b with W, b mean-field Gaussian."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, init_rho: float = -5.0,
                 reparameterization: str = "local") -> None:
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ModelConfigError(f"BayesLinear needs positive sizes, got ({in_features}, {out_features})")
        self.in_features, self.out_features = int(in_features), int(out_features)
        shapes = {"weight": (self.out_features, self.in_features)}
        if bias:
            shapes["bias"] = (self.out_features,)
        self._init_gaussian(shapes, init_rho, reparameterization)
        self._reset(self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sampling or self.reparameterization == "weight":
            return F.linear(x, self._sample("weight"), self._sample("bias"))
        has_bias = "bias" in self.gaussian_names
        mean = F.linear(x, self.weight_mu, self.bias_mu if has_bias else None)
        var = F.linear(x * x, self.std("weight") ** 2, self.std("bias") ** 2 if has_bias else None)
        return mean + torch.sqrt(var.clamp_min(_VAR_FLOOR)) * self._noise(mean)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={'bias' in self.gaussian_names}, " + super().extra_repr())


class BayesConv2d(BayesModule):
    """Bayesian counterpart of ``nn.Conv2d`` (zero padding, groups=1)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int], stride: int = 1,
                 padding: int = 0, dilation: int = 1, bias: bool = True, *, init_rho: float = -5.0,
                 reparameterization: str = "local") -> None:
        super().__init__()
        k = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
        if in_channels < 1 or out_channels < 1 or min(k) < 1:
            raise ModelConfigError("BayesConv2d needs positive channels and kernel size")
        self.in_channels, self.out_channels, self.kernel_size = int(in_channels), int(out_channels), k
        self.stride, self.padding, self.dilation = stride, padding, dilation
        shapes = {"weight": (self.out_channels, self.in_channels, *k)}
        if bias:
            shapes["bias"] = (self.out_channels,)
        self._init_gaussian(shapes, init_rho, reparameterization)
        self._reset(self.in_channels * k[0] * k[1])

    def _conv(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sampling or self.reparameterization == "weight":
            return self._conv(x, self._sample("weight"), self._sample("bias"))
        has_bias = "bias" in self.gaussian_names
        mean = self._conv(x, self.weight_mu, self.bias_mu if has_bias else None)
        var = self._conv(x * x, self.std("weight") ** 2, self.std("bias") ** 2 if has_bias else None)
        return mean + torch.sqrt(var.clamp_min(_VAR_FLOOR)) * self._noise(mean)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, " + super().extra_repr())


def bayes_modules(model: nn.Module) -> Iterator[tuple[str, BayesModule]]:
    """(qualified name, layer) for every Bayesian layer, in ``named_modules`` order (the stable vector order)."""
    for name, module in model.named_modules():
        if isinstance(module, BayesModule):
            yield name, module


def is_bayesian(model: nn.Module) -> bool:
    return any(True for _ in bayes_modules(model))


@contextlib.contextmanager
def deterministic(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block every Bayesian layer of ``model`` uses its means; previous settings are restored after."""
    layers = [m for _, m in bayes_modules(model)]
    before = [m.sampling for m in layers]
    try:
        for m in layers:
            m.sampling = False
        yield model
    finally:
        for m, s in zip(layers, before):
            m.sampling = s


def set_sampling(model: nn.Module, sampling: bool) -> None:
    """Switch weight sampling on or off for every Bayesian layer of ``model``."""
    for _, m in bayes_modules(model):
        m.sampling = bool(sampling)


def set_generator(model: nn.Module, generator: torch.Generator | None) -> None:
    """Draw all of ``model``'s weight noise from ``generator`` (reproducible sampling from a seed); the generator
    must live on the model's device (``torch.Generator(device="cuda")`` for a model on the GPU)."""
    for _, m in bayes_modules(model):
        m.generator = generator


def reset_std(model: nn.Module, std: float) -> None:
    """Set every Bayesian std of ``model`` to ``std``, means unchanged."""
    for _, m in bayes_modules(model):
        m.reset_std(std)


def bayesian_twin(model: nn.Module, *, init_rho: float = -5.0, reparameterization: str = "local") -> nn.Module:
    """A copy of ``model`` (yours is not modified) with every ``nn.Linear`` and ``nn.Conv2d`` replaced by a
    ``BayesLinear`` / ``BayesConv2d`` whose means are the layer's weights and whose standard deviations are
    softplus(``init_rho``); the rest of the module (activations, pooling, reshapes, its forward) is kept as written.

    Refused (``ModelConfigError``, naming the layer) when a trainable parameter would be left outside a Bayesian
    layer (a batch norm, an embedding, a parameter of your own) or a convolution uses groups or a padding mode other
    than zeros: a mean-field posterior over part of the model is not what the twin promises."""
    twin = copy.deepcopy(model)

    def convert(name: str, child: nn.Module) -> nn.Module | None:
        if type(child) is nn.Linear:
            new = BayesLinear(child.in_features, child.out_features, bias=child.bias is not None, init_rho=init_rho,
                              reparameterization=reparameterization)
        elif type(child) is nn.Conv2d:
            if child.groups != 1 or child.padding_mode != "zeros":
                raise ModelConfigError(f"the Bayesian twin supports Conv2d with groups=1 and zero padding; {name!r} "
                                       f"has groups={child.groups}, padding_mode={child.padding_mode!r}")
            new = BayesConv2d(child.in_channels, child.out_channels, child.kernel_size, stride=child.stride,
                              padding=child.padding, dilation=child.dilation, bias=child.bias is not None,
                              init_rho=init_rho, reparameterization=reparameterization)
        else:
            return None
        with torch.no_grad():
            new.weight_mu.copy_(child.weight)
            if child.bias is not None:
                new.bias_mu.copy_(child.bias)
        return new.to(child.weight.device, child.weight.dtype)

    root = convert("the model", twin)
    if root is not None:
        return root
    for qualified, module in list(twin.named_modules()):
        for name, child in list(module.named_children()):
            new = convert(f"{qualified}.{name}" if qualified else name, child)
            if new is not None:
                setattr(module, name, new)
    plain = [n for n, p in twin.named_parameters() if p.requires_grad and not n.endswith(("_mu", "_rho"))]
    if plain:
        raise ModelConfigError(f"the Bayesian twin makes nn.Linear and nn.Conv2d layers Gaussian; {plain} would stay "
                               f"point estimates (write the model with those layers only, or freeze these "
                               f"parameters)")
    return twin


__all__ = ["BayesConv2d", "BayesLinear", "BayesModule", "GaussianPrior", "REPARAMETERIZATIONS", "bayes_modules",
           "bayesian_twin", "deterministic", "gaussian_kl", "inverse_softplus", "is_bayesian", "reset_std",
           "set_generator", "set_sampling", "softplus"]
