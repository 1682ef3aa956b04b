"""FedAvg (McMahan et al. 2017): clients run local SGD from the global model and upload their model change; the
server averages the changes weighted by the clients' example counts.

Non-private: the upload is released unclipped and charged as non-private (epsilon = inf).
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from privfl.aggregation import Aggregate
from privfl.algorithms.base import ClientOutput, FederatedAlgorithm
from privfl.channels import Channel, Unclipped
from privfl.errors import ConfigurationError
from privfl.executor import VectorisedSGD, vectorisable
from privfl.metrics import classification_metrics
from privfl.models import make_model
from privfl.public import release_weight
from privfl.training import flat_parameters, load_flat_parameters, predict_proba, train_epochs


class FedAvg(FederatedAlgorithm):
    name = "fedavg"
    supports_privacy = False

    def __init__(self, fed, privacy):
        super().__init__(fed, privacy)
        if privacy.private and not self.supports_privacy:
            raise ConfigurationError(f"{self.name} is a non-private baseline; run it with epsilon = inf or choose "
                                     f"dp_fedavg for client-level DP")
        self.model: torch.nn.Module | None = None
        self.global_params: np.ndarray | None = None
        self._local: torch.nn.Module | None = None  # one working copy, reloaded for every client (no deepcopy)

    def setup(self, data, rng):
        public = self.bind_public(data)
        torch.manual_seed(int(rng.integers(0, 2 ** 31 - 1)))
        self.model = make_model(self.fed.model, public.input_shape, public.num_classes, **self.fed.model_kwargs())
        self.global_params = flat_parameters(self.model)
        self._local = make_model(self.fed.model, public.input_shape, public.num_classes, **self.fed.model_kwargs())

    @property
    def dim(self) -> int:
        return int(self.global_params.size)

    def channels(self):
        return [Channel("update", (self.dim,), unit="client", clip=Unclipped(), description="local model change")]

    def local_train(self, model, dataset, rng) -> None:
        x, y = dataset.tensors()
        train_epochs(model, x, y, epochs=self.fed.local_epochs, batch_size=self.fed.batch_size, lr=self.fed.lr,
                     momentum=self.fed.momentum, rng=rng)

    def release_weight(self, dataset, client: int = 0) -> float:
        """A public constant (``privfl.public.release_weight``): n_k only when sizes are public or nothing is."""
        return release_weight(self.privacy, self.public, client, dataset)

    def client_update(self, client, dataset, round, rng):
        local = self._local
        start = torch.as_tensor(self.global_params, dtype=torch.float32)
        torch.nn.utils.vector_to_parameters(start.clone(), local.parameters())  # the parameters become its views
        self.local_train(local, dataset, rng)
        # float32 end to end, as the model trains (the vectorised executor gives the same rows); the release pipeline
        # turns what it clips or noises into float64
        update = (torch.nn.utils.parameters_to_vector(local.parameters()).detach() - start).numpy()
        return ClientOutput({"update": update}, weight=self.release_weight(dataset, client))

    #: FedProx's proximal coefficient on the vectorised path (0: plain FedAvg)
    prox_mu: float = 0.0

    @property
    def vectorisable(self) -> bool:
        """Whether :meth:`client_updates` trains clients together (``privfl.executor``): the local step is plain
        SGD on cross-entropy (a subclass that overrides ``local_train`` differently runs per client) and the model is
        built of stateless layers."""
        return self._vectorises(FedAvg.local_train)

    def _vectorises(self, local_train) -> bool:
        cls = type(self)
        same_step = cls.client_update is FedAvg.client_update and cls.local_train is local_train
        return same_step and self.model is not None and vectorisable(self.model)

    def client_updates(self, clients: Sequence[int], datasets, round, rngs) -> "Iterator[tuple[int, ClientOutput]]":
        """``(k, client_update(k, ...))`` for every client of ``clients``, computed together by the vectorised
        executor when :attr:`vectorisable` (the same outputs to float tolerance), else one after another. Yields in
        chunks, so a large federation never holds every client's training state at once."""
        if not self.vectorisable:
            for k, dataset, rng in zip(clients, datasets, rngs):
                yield k, self.client_update(k, dataset, round, rng)
            return
        sgd = VectorisedSGD(self.model, epochs=self.fed.local_epochs, batch_size=self.fed.batch_size, lr=self.fed.lr,
                            momentum=self.fed.momentum, prox_mu=self.prox_mu)
        for i, update in sgd.train(self.global_params, [d.tensors() for d in datasets], rngs):
            k = clients[i]
            yield k, ClientOutput({"update": update}, weight=self.release_weight(datasets[i], k))

    def server_update(self, aggregates: Mapping[str, Aggregate], round):
        agg = aggregates["update"]
        self.global_params = self.global_params + self.fed.server_lr * agg.total / agg.total_weight

    def predict_proba(self, dataset):
        load_flat_parameters(self.model, self.global_params)
        return predict_proba(self.model, dataset.tensors()[0])

    def evaluate(self, dataset):
        return classification_metrics(self.predict_proba(dataset), dataset.tensors()[1].numpy())
