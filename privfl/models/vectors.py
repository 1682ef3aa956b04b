"""A model's parameters as one float64 numpy vector and back, in a stable order: ``model.named_parameters()``
(registration order, fixed by the architecture). Bayesian models also map to and from (mean, precision) vectors
(mu, 1/std^2) over their Gaussian parameters, in ``bayes_modules`` order, weight before bias: the form in which
HBFL and FOLA upload a posterior and the server multiplies Gaussians.

float32 -> float64 -> float32 is exact, so ``vector_to_parameters(parameters_to_vector(m), m)`` restores ``m``
bit for bit. The (mean, precision) round trip is exact for the means and within float32 rounding of rho for the
precisions.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from privfl.models.bayes import bayes_modules, inverse_softplus, softplus
from privfl.models.errors import ModelConfigError


def parameter_layout(model: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter, in vector order."""
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def parameters_to_vector(model: nn.Module) -> np.ndarray:
    """All parameters of ``model`` (for a Bayesian model: every mu and rho) as one float64 vector."""
    params = [p.detach().reshape(-1).to("cpu", torch.float64) for _, p in model.named_parameters()]
    if not params:
        return np.zeros(0, dtype=np.float64)
    return torch.cat(params).numpy()


def _as_vector(vector, size: int, what: str) -> np.ndarray:
    v = np.asarray(vector, dtype=np.float64)
    if v.ndim != 1 or v.shape[0] != size:
        raise ModelConfigError(f"{what} must be a 1-D vector of length {size}, got shape {v.shape}")
    if not np.all(np.isfinite(v)):
        raise ModelConfigError(f"{what} has non-finite entries")
    return v


@torch.no_grad()
def vector_to_parameters(vector: np.ndarray, model: nn.Module) -> None:
    """Write ``vector`` (``parameters_to_vector`` order) into ``model``'s parameters in place."""
    layout = [(name, p) for name, p in model.named_parameters()]
    v = _as_vector(vector, sum(p.numel() for _, p in layout), "vector")
    offset = 0
    for _, p in layout:
        n = p.numel()
        p.copy_(torch.from_numpy(v[offset:offset + n]).reshape(p.shape).to(p.device, p.dtype))
        offset += n


def _gaussian_entries(model: nn.Module):
    entries = []
    for layer, m in bayes_modules(model):
        for pname, (mu, rho) in m.gaussian_parameters().items():
            entries.append((layer, pname, mu, rho))
    if not entries:
        raise ModelConfigError("the model has no Bayesian layers; build it with make_bayesian_model")
    return entries


def gaussian_layout(model: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(``layer.weight``/``layer.bias``, shape) of every Gaussian parameter, in (mean, precision) vector order."""
    return tuple((f"{layer}.{p}" if layer else p, tuple(mu.shape)) for layer, p, mu, _ in _gaussian_entries(model))


def mean_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The mean parameters (mu) of a Bayesian model's Gaussian weights, in (mean, precision) vector order."""
    return [mu for _, _, mu, _ in _gaussian_entries(model)]


def get_mean_precision(model: nn.Module) -> tuple[np.ndarray, np.ndarray]:
    """(mean, precision) float64 vectors of a Bayesian model: mu and 1 / softplus(rho)^2."""
    entries = _gaussian_entries(model)
    mean = torch.cat([mu.detach().reshape(-1).to("cpu", torch.float64) for _, _, mu, _ in entries])
    std = torch.cat([softplus(rho.detach().reshape(-1).to("cpu", torch.float64)) for _, _, _, rho in entries])
    return mean.numpy(), (1.0 / std ** 2).numpy()


@torch.no_grad()
def set_mean_precision(model: nn.Module, mean: np.ndarray, precision: np.ndarray) -> None:
    """Set mu = ``mean`` and rho = softplus^-1(precision^-1/2) in place (``get_mean_precision`` order)."""
    entries = _gaussian_entries(model)
    size = sum(mu.numel() for _, _, mu, _ in entries)
    mean = _as_vector(mean, size, "mean")
    precision = _as_vector(precision, size, "precision")
    if not np.all(precision > 0):
        raise ModelConfigError("precision must be positive everywhere; floor noisy precisions before setting them")
    rho = inverse_softplus(torch.from_numpy(precision ** -0.5)).numpy()
    offset = 0
    for _, _, mu, r in entries:
        n = mu.numel()
        mu.copy_(torch.from_numpy(mean[offset:offset + n]).reshape(mu.shape).to(mu.device, mu.dtype))
        r.copy_(torch.from_numpy(rho[offset:offset + n]).reshape(r.shape).to(r.device, r.dtype))
        offset += n


def split_gaussian_vectors(model: nn.Module, mean: np.ndarray, precision: np.ndarray,
                           ) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """{layer: {"weight"/"bias": (mean tensor, precision tensor)}} on each parameter's device and dtype."""
    entries = _gaussian_entries(model)
    size = sum(mu.numel() for _, _, mu, _ in entries)
    mean = _as_vector(mean, size, "mean")
    precision = _as_vector(precision, size, "precision")
    if not np.all(precision > 0):
        raise ModelConfigError("prior precision must be positive everywhere")
    out: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    offset = 0
    for layer, pname, mu, _ in entries:
        n = mu.numel()
        to = dict(device=mu.device, dtype=mu.dtype)
        out.setdefault(layer, {})[pname] = (
            torch.from_numpy(mean[offset:offset + n].copy()).reshape(mu.shape).to(**to),
            torch.from_numpy(precision[offset:offset + n].copy()).reshape(mu.shape).to(**to))
        offset += n
    return out


__all__ = ["gaussian_layout", "get_mean_precision", "mean_parameters", "num_parameters", "parameter_layout",
           "parameters_to_vector", "set_mean_precision", "split_gaussian_vectors", "vector_to_parameters"]
