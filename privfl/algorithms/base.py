"""The contract every federated algorithm implements.

A client step returns its round's channel values (it never sends anything itself: the runtime hands the values to
the client's release pipeline). A server step sees only :class:`privfl.aggregation.Aggregate` objects, weighted sums
of releases, so secure aggregation can hide every upload without changing the algorithm.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from privfl.aggregation import Aggregate
from privfl.channels import Channel, ClippedValue
from privfl.config import FederationConfig, PrivacyConfig
from privfl.public import PublicFacts


@dataclass
class ClientOutput:
    """One client's round: channel name -> value, the public weight of its release, and local diagnostics."""

    values: dict[str, np.ndarray | ClippedValue]
    weight: float = 1.0
    metrics: dict[str, float] = field(default_factory=dict)


class FederatedAlgorithm(abc.ABC):
    """A federated algorithm over channels. Subclasses set ``name`` and implement the five steps."""

    name: str = "abstract"
    #: whether a finite epsilon is meaningful for this algorithm (non-private baselines refuse one)
    supports_privacy: bool = True
    #: settings ``privfl run`` uses for flags the user leaves out (FederationConfig / PrivacyConfig field names)
    defaults: dict = {"hidden": (100,), "local_epochs": 2, "lr": 0.05, "clip": 1.0}

    def __init__(self, fed: FederationConfig, privacy: PrivacyConfig):
        self.fed = fed
        self.privacy = privacy
        self.public: PublicFacts | None = None

    @abc.abstractmethod
    def setup(self, public: PublicFacts, rng: np.random.Generator) -> None:
        """Build the global state from the federation's :class:`privfl.public.PublicFacts` alone (a
        :class:`privfl.data.FederatedData` is accepted too and reduced to its public facts by :meth:`bind_public`)."""

    def bind_public(self, data) -> PublicFacts:
        """Keep the public facts of ``data`` (nothing else of it) for the client and server steps."""
        self.public = PublicFacts.of(data, self.privacy, self.fed)
        return self.public

    @abc.abstractmethod
    def channels(self) -> list[Channel]:
        """The channels every client releases each round (available after :meth:`setup`)."""

    @abc.abstractmethod
    def client_update(self, client: int, dataset, round: int, rng: np.random.Generator) -> ClientOutput:
        """Local work of ``client`` on its ``dataset`` from the current global state."""

    @abc.abstractmethod
    def server_update(self, aggregates: Mapping[str, Aggregate], round: int) -> None:
        """Update the global state from the round's weighted sums."""

    @abc.abstractmethod
    def evaluate(self, dataset) -> dict[str, float]:
        """Metrics of the global model on ``dataset`` (accuracy, nll, ece for classification)."""

    def predict_proba(self, dataset) -> np.ndarray | None:
        """Class probabilities of the global model on ``dataset`` (for reliability diagrams); None if not offered."""
        return None

    def calibration_predictions(self, dataset) -> tuple[np.ndarray, np.ndarray] | None:
        """The (probabilities, labels) pairs this algorithm's calibration metrics are computed on: the global model
        on the whole of ``dataset`` by default; None when there are none (no global model, no override)."""
        proba = self.predict_proba(dataset)
        if proba is None:
            return None
        return proba, np.asarray(dataset.y)
