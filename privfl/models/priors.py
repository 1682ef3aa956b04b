"""Priors over a whole Bayesian model: :class:`ModelPrior`, a diagonal Gaussian per layer and per entry (built from
the flat (mean, precision) vectors of :mod:`privfl.models.vectors`, from a model's current posterior, or isotropic),
and :func:`model_kl_divergence`, the KL of a model's posterior to such a prior summed over its Bayesian layers (the
complexity cost of the ELBO). The layers and the per-layer :class:`privfl.models.bayes.GaussianPrior` are in
:mod:`privfl.models.bayes`.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from privfl.models.bayes import GaussianPrior, bayes_modules, softplus
from privfl.models.errors import ModelConfigError
from privfl.models.vectors import split_gaussian_vectors


class ModelPrior:
    """A diagonal Gaussian prior over all Bayesian parameters of a model, per layer and per entry.

    Build it from the flat (mean, precision) vectors of ``get_mean_precision`` order (a server's global posterior,
    HBFL/FOLA eq. 12) with ``from_vectors``, from a model's current posterior with ``from_model``, or as one
    isotropic prior for every layer with ``isotropic``.
    """

    def __init__(self, layers: Mapping[str, Mapping[str, GaussianPrior]] | None = None,
                 default: GaussianPrior | None = None) -> None:
        if layers is None and default is None:
            raise ModelConfigError("a ModelPrior needs per-layer priors or a default prior")
        self.layers = {k: dict(v) for k, v in (layers or {}).items()}
        self.default = default

    @classmethod
    def isotropic(cls, std: float = 1.0, mean: float = 0.0) -> "ModelPrior":
        return cls(default=GaussianPrior.from_std(std, mean))

    @classmethod
    def from_vectors(cls, model: nn.Module, mean, precision) -> "ModelPrior":
        return cls({layer: {p: GaussianPrior(m, lam) for p, (m, lam) in per.items()}
                    for layer, per in split_gaussian_vectors(model, mean, precision).items()})

    @classmethod
    def from_model(cls, model: nn.Module) -> "ModelPrior":
        """The model's current q (detached) as a prior."""
        layers = {}
        for name, m in bayes_modules(model):
            layers[name] = {p: GaussianPrior(mu.detach().clone(), (softplus(rho.detach()) ** -2).clone())
                            for p, (mu, rho) in m.gaussian_parameters().items()}
        return cls(layers)

    def for_layer(self, name: str) -> GaussianPrior | Mapping[str, GaussianPrior]:
        if name in self.layers:
            return self.layers[name]
        if self.default is None:
            raise ModelConfigError(f"the prior has no entry for layer {name!r}; was it built for another model?")
        return self.default


def model_kl_divergence(model: nn.Module, prior: GaussianPrior | ModelPrior) -> torch.Tensor:
    """KL(q || prior) summed over every Bayesian layer of ``model`` (the complexity cost of the ELBO)."""
    layers = list(bayes_modules(model))
    if not layers:
        raise ModelConfigError("the model has no Bayesian layers; build it with make_bayesian_model")
    total = None
    for name, m in layers:
        part = m.kl_divergence(prior if isinstance(prior, GaussianPrior) else prior.for_layer(name))
        total = part if total is None else total + part
    return total


__all__ = ["ModelPrior", "model_kl_divergence"]
