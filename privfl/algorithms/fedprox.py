"""FedProx (Li et al., MLSys 2020): FedAvg whose local objective adds the proximal term mu/2 ||w - w_global||^2,
which keeps heterogeneous clients near the global model (FOLA reads it as a Gaussian prior N(w_global, I / mu)).

Non-private baseline: the upload is FedAvg's unclipped model change, released as non-private (epsilon = inf).
"""

from __future__ import annotations

import math

import torch

from privfl.algorithms.fedavg import FedAvg, own_layer_randomness
from privfl.errors import ConfigurationError
from privfl.training.local import train_epochs


class FedProx(FedAvg):
    name = "fedprox"
    supports_privacy = False
    #: default proximal coefficient (FedProx's experiments use mu in {0.001, 0.01, 0.1, 1})
    default_mu = 0.01

    def __init__(self, fed, privacy, mu: float | None = None, model=None, loss=None, optimizer=None, metrics=None):
        super().__init__(fed, privacy, model=model, loss=loss, optimizer=optimizer, metrics=metrics)
        mu = self.default_mu if mu is None else mu
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not math.isfinite(mu) or mu < 0:
            raise ConfigurationError(f"fedprox: mu must be a finite number >= 0, got {mu!r}")
        self.mu = float(mu)
        self.prox_mu = self.mu  # the vectorised executor adds the same proximal term

    @property
    def vectorisable(self) -> bool:
        return self._vectorises(FedProx.local_train)

    def local_train(self, model, dataset, rng) -> None:
        anchor = [p.detach().clone() for p in model.parameters()]  # the global model this round started from

        def proximal(m: torch.nn.Module) -> torch.Tensor:
            return 0.5 * self.mu * sum((p - a).pow(2).sum() for p, a in zip(m.parameters(), anchor))

        x, y = dataset.tensors()
        with own_layer_randomness(rng):  # one client's records never move another's dropout draws
            train_epochs(model, x, y, epochs=self.fed.local_epochs, batch_size=self.fed.batch_size, lr=self.fed.lr,
                         momentum=self.fed.momentum, rng=rng, extra_loss=proximal if self.mu > 0 else None,
                         loss=self.user.loss, optimizer=self.user.optimizer)
