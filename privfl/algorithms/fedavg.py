"""FedAvg (McMahan et al. 2017): clients run local SGD from the global model and upload their model change; the
server averages the changes weighted by the clients' example counts.

Non-private: the upload is released unclipped and charged as non-private (epsilon = inf).

The user's own objects (``privfl.training.local.UserTraining``): ``model`` (an ``nn.Module`` or a zero-argument factory;
default the built-in ``FederationConfig.model``), ``loss``, ``optimizer`` (a factory of parameters) and extra test
``metrics``; the whole family (FedProx, DP-FedAvg, DP-SGD FedAvg) takes them. Regression (float targets) trains on
mean squared error by default and reports RMSE, MAE and R^2 in the data's own units.
"""

from __future__ import annotations

import contextlib
import hashlib

from typing import Iterator, Mapping, Sequence

import copy

import numpy as np
import torch

from privfl.core.aggregation import Aggregate
from privfl.algorithms.base import ClientOutput, FederatedAlgorithm
from privfl.privacy.units import channel as unit_channel
from privfl.errors import ConfigurationError
from privfl.training.stacked import VectorisedSGD, vectorisable
from privfl.metrics import classification_metrics, point_regression_metrics
from privfl.models import make_model
from privfl.core.public import release_weight
from privfl.training.local import (UserTraining, flat_parameters, load_flat_parameters, predict_outputs, predict_proba,
                             train_epochs)


@contextlib.contextmanager
def own_layer_randomness(rng: np.random.Generator):
    """Within: torch's global generator seeded from a child of ``rng`` (the client's own stream), in a forked torch
    state, for the layers' own draws (dropout) in one client's local training (see :meth:`FedAvg.local_train`)."""
    # the seed is a hash of the stream's state as this training starts: it leaves the stream's draws as they were, and
    # a runtime that restores the stream's state (Flower's ClientApp, message by message) gets the same seeds as one
    # that keeps the generator (a spawn counter is not part of that state: every round drew the same masks there)
    state = repr(rng.bit_generator.state).encode()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int.from_bytes(hashlib.sha256(b"privfl layers" + state).digest()[:8], "big") >> 1)
        yield


class FedAvg(FederatedAlgorithm):
    name = "fedavg"
    supports_privacy = False
    #: a client step reads the global model only (privfl.algorithms.base: the two halves)
    broadcast_state = ("global_params",)

    def __init__(self, fed, privacy, model=None, loss=None, optimizer=None, metrics=None):
        super().__init__(fed, privacy)
        if privacy.private and not self.supports_privacy:
            raise ConfigurationError(f"{self.name} is a non-private baseline; run it with epsilon = inf or choose "
                                     f"dp_fedavg for client-level DP")
        self.user = UserTraining.of(self.name, model, loss, optimizer, metrics)
        self.model: torch.nn.Module | None = None
        self.global_params: np.ndarray | None = None
        self._local: torch.nn.Module | None = None  # one working copy, reloaded for every client (no deepcopy)

    def build_model(self, public) -> torch.nn.Module:
        """The user's model (a fresh copy) or the built-in architecture, checked against the task's output width."""
        if self.user.model is None:
            return make_model(self.fed.model, public.input_shape, public.num_classes, **self.fed.model_kwargs())
        net = self.user.model()
        if not any(p.requires_grad for p in net.parameters()):
            raise ConfigurationError(f"{self.name}: the model has no trainable parameters")
        was_training = net.training
        try:
            with torch.no_grad():
                net.eval()
                out = net(torch.zeros((1, *public.input_shape)))
        except Exception as exc:  # the user's forward on the data's input shape: say what it was fed
            raise ConfigurationError(f"{self.name}: the model failed on an input of shape "
                                     f"{(1, *public.input_shape)} (one example of the clients' data): "
                                     f"{type(exc).__name__}: {exc}") from None
        finally:
            net.train(was_training)
        width = int(out.reshape(1, -1).shape[1]) if isinstance(out, torch.Tensor) else -1
        if width != public.num_classes:
            what = "classes" if public.task == "classification" else "target values per example"
            raise ConfigurationError(f"{self.name}: the model outputs {width} values per example but the data has "
                                     f"{public.num_classes} {what}; make its last layer output {public.num_classes}")
        return net

    def setup(self, data, rng):
        public = self.bind_public(data)
        torch.manual_seed(int(rng.integers(0, 2 ** 31 - 1)))
        self.model = self.build_model(public)
        self.global_params = flat_parameters(self.model)
        self._local = copy.deepcopy(self.model)

    @property
    def dim(self) -> int:
        return int(self.global_params.size)

    def channels(self):
        return [unit_channel(self.privacy, "update", (self.dim,), description="local model change")]

    def local_train(self, model, dataset, rng) -> None:
        """Local training of ``model`` on ``dataset``, its shuffles from ``rng`` (the client's own stream) and its
        layers' own randomness (dropout masks) from a child of that stream, in a forked torch state: one client's
        records never move another client's draws (a review, session 26: every client trained on one shared torch
        generator, so one client's record count shifted every later client's dropout masks; at client level one
        client's data removed moved the others' clipped updates, a sum of 1.87 C against a charged C). The child
        leaves ``rng``'s own draws as they were, so seeded results without such layers are unchanged."""
        x, y = dataset.tensors()
        with own_layer_randomness(rng):
            train_epochs(model, x, y, epochs=self.fed.local_epochs, batch_size=self.fed.batch_size, lr=self.fed.lr,
                         momentum=self.fed.momentum, rng=rng, loss=self.user.loss, optimizer=self.user.optimizer)

    def release_weight(self, dataset, client: int = 0) -> float:
        """A public constant (``privfl.core.public.release_weight``): n_k only when sizes are public or nothing is."""
        return release_weight(self.privacy, self.public, client, dataset)

    def client_update(self, client, dataset, round, rng):
        self.check_broadcast(round)
        [(_, out)] = self._local_updates([client], [dataset], [rng], vectorised=False)
        return out

    #: the clip rule of a subclass with adaptive clipping (``AdaptiveClip.check_broadcast``'s ``rule``)
    clip_rule = "step"

    def check_broadcast(self, round) -> None:
        """A client's check of the round's broadcast state before any record is read: with adaptive clipping (DP-FedAvg,
        DP-FedSGD, DP-SGD FedAvg: ``self.adaptive``), the broadcast C_t against what :attr:`clip_rule` can reach from
        the public start clip (``AdaptiveClip.check_broadcast``: a clip no honest server reaches is refused, on the
        broadcast and public facts alone); FedAvg's model needs none."""
        adaptive = getattr(self, "adaptive", None)
        if adaptive:
            self.current_clip = adaptive.check_broadcast(self.current_clip, self.privacy.clip, round,
                                                         rule=self.clip_rule)

    def _local_updates(self, clients, datasets, rngs, *, vectorised: bool):
        """The client step, written once: each client's change from the broadcast model after local training, by
        the vectorised executor (``privfl.training.stacked.VectorisedSGD``) or one client after another
        (:meth:`local_train`). Float32 end to end, as the model trains (both give the same rows to float tolerance);
        the release pipeline turns what it clips or noises into float64."""
        if vectorised:
            sgd = VectorisedSGD(self.model, epochs=self.fed.local_epochs, batch_size=self.fed.batch_size,
                                lr=self.fed.lr, momentum=self.fed.momentum, prox_mu=self.prox_mu)
            rows = sgd.train(self.global_params, [d.tensors() for d in datasets], rngs)
        else:
            rows = ((i, self._train_one(d, rng)) for i, (d, rng) in enumerate(zip(datasets, rngs)))
        for i, update in rows:
            yield clients[i], ClientOutput({"update": update}, weight=self.release_weight(datasets[i], clients[i]))

    def _train_one(self, dataset, rng) -> np.ndarray:
        local = self._local
        start = torch.as_tensor(self.global_params, dtype=torch.float32)
        torch.nn.utils.vector_to_parameters(start.clone(), local.parameters())  # the parameters become its views
        self.local_train(local, dataset, rng)
        return (torch.nn.utils.parameters_to_vector(local.parameters()).detach() - start).numpy()

    #: FedProx's proximal coefficient on the vectorised path (0: plain FedAvg)
    prox_mu: float = 0.0

    @property
    def vectorisable(self) -> bool:
        """Whether :meth:`client_updates` trains clients together (``privfl.training.stacked``): the local step is plain
        SGD on cross-entropy (a subclass that overrides ``local_train`` differently, a user's loss or optimizer, or
        regression runs per client) and the model is built of stateless layers."""
        return self._vectorises(FedAvg.local_train)

    @property
    def default_step(self) -> bool:
        """Whether the local step is what the vectorised executor computes: SGD on cross-entropy."""
        return not self.user.custom_step and (self.public is None or self.public.task == "classification")

    def _vectorises(self, local_train) -> bool:
        cls = type(self)
        same_step = cls.client_update is FedAvg.client_update and cls.local_train is local_train
        return same_step and self.default_step and self.model is not None and vectorisable(self.model)

    def client_updates(self, clients: Sequence[int], datasets, round, rngs) -> "Iterator[tuple[int, ClientOutput]]":
        """``(k, client_update(k, ...))`` for every client of ``clients``, computed together by the vectorised
        executor when :attr:`vectorisable` (the same outputs to float tolerance), else one after another. Yields in
        chunks, so a large federation never holds every client's training state at once."""
        self.check_broadcast(round)
        if not self.vectorisable:  # a subclass's own client_update, or a step the executor cannot batch
            for k, dataset, rng in zip(clients, datasets, rngs):
                yield k, self.client_update(k, dataset, round, rng)
            return
        yield from self._local_updates(clients, datasets, rngs, vectorised=True)

    def server_update(self, aggregates: Mapping[str, Aggregate], round):
        agg = aggregates["update"]
        self.global_params = self.global_params + self.fed.server_lr * agg.total / agg.total_weight

    def global_model(self) -> torch.nn.Module:
        """The global model with the current global parameters (the algorithm's own module: copy it to keep it)."""
        load_flat_parameters(self.model, self.global_params)
        return self.model

    def predict_proba(self, dataset):
        if dataset.task == "regression":
            return None
        return predict_proba(self.global_model(), dataset.tensors()[0])

    def evaluate(self, dataset):
        y = dataset.y
        if dataset.task == "regression":
            pred = predict_outputs(self.global_model(), dataset.tensors()[0]).reshape(y.shape)
            scores, truth = dataset.to_original_units(pred), dataset.to_original_units(y)
            metrics = point_regression_metrics(scores, truth)
        else:
            scores, truth = self.predict_proba(dataset), y
            metrics = classification_metrics(scores, truth)
        for name, fn in self.user.metrics.items():
            metrics[name] = float(fn(truth, scores))
        return metrics
