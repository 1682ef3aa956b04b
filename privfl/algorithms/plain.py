"""A federated algorithm as its non-private maths: a client step and a server step, nothing about privacy.

Write an algorithm as a frozen dataclass of its options (checked in ``__post_init__``) that subclasses
:class:`Algorithm`, and register it with :func:`privfl.register_algorithm`; privfl then runs it at client level and at
record level, with local, central or distributed noise, under secure aggregation, in process and on Flower. The
README's "Writing your own algorithm" shows FedAdam in about 30 lines.

The algorithm works over the model's parameters as one flat vector (``numpy`` float32, the model's own order):

- :meth:`Algorithm.init` ``(params) -> server state``: the server's state from the initial parameters (a mapping of
  arrays and numbers; ``"params"`` holds the global parameters the server evaluates);
- :meth:`Algorithm.broadcast` ``(server) -> values``: what every client receives at the start of a round (default:
  the parameters);
- :meth:`Algorithm.client_step` ``(broadcast, data, state, rng) -> (values, state)``: one client's round. ``values``
  maps each name of :attr:`Algorithm.channels` to a vector of the parameters' length; ``state`` is the client's own
  (``None`` before its first round; a mapping of arrays and numbers, or ``None``), kept on the client's side between
  rounds. ``data`` is the client's :class:`LocalData`: ``data.train(params)`` runs the client's local training from
  ``params`` (epochs, batch size, the user's model, loss and optimizer: the run's settings) and returns the trained
  parameters. That call is where record-level privacy enters: at record level it is DP-SGD, and it is the only way a
  client step reads its data (once per round);
- :meth:`Algorithm.server_step` ``(server, means) -> server``: the next server state from the weighted mean of each
  channel over the round's releases (noised, clipped and possibly securely aggregated: the step never knows).

What an algorithm never does: read the privacy unit, clip, calibrate, add noise, weigh clients or import the runtime.
Those are :mod:`privfl.privacy`'s, which wraps the algorithm for the run's privacy configuration.
"""

from __future__ import annotations

import abc
from typing import Any, Mapping

import numpy as np


class LocalData(abc.ABC):
    """A client's data as a client step sees it: its local training, and nothing else at record level."""

    @abc.abstractmethod
    def train(self, params: np.ndarray) -> np.ndarray:
        """The parameters after the client's local training from ``params``."""


class Algorithm(abc.ABC):
    """A federated algorithm's non-private maths (see the module docstring). Subclasses are frozen dataclasses of
    their options."""

    #: the names of the vectors a client step returns, each of the parameters' length
    channels: tuple[str, ...] = ("update",)
    #: settings a run uses for what the user leaves out (FederationConfig / PrivacyConfig field names)
    defaults: Mapping[str, Any] = {"local_epochs": 1, "lr": 0.05, "clip": 1.0}

    def init(self, params: np.ndarray) -> Mapping[str, Any]:
        """The server's state from the initial global parameters."""
        return {"params": params}

    def broadcast(self, server: Mapping[str, Any]) -> Mapping[str, Any]:
        """What every client receives at the start of a round."""
        return {"params": server["params"]}

    @abc.abstractmethod
    def client_step(self, broadcast: Mapping[str, Any], data: LocalData, state: Mapping[str, Any] | None,
                    rng: np.random.Generator) -> tuple[Mapping[str, np.ndarray], Mapping[str, Any] | None]:
        """One client's round: its channel values and its next state."""

    @abc.abstractmethod
    def server_step(self, server: Mapping[str, Any], means: Mapping[str, np.ndarray]) -> Mapping[str, Any]:
        """The next server state from each channel's weighted mean over the round's releases."""


__all__ = ["Algorithm", "LocalData"]
