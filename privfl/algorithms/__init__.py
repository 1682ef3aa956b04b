"""The federated algorithms, by name."""

from __future__ import annotations

from privfl.algorithms.base import ClientOutput, FederatedAlgorithm
from privfl.algorithms.dp_fedavg import DPFedAvg
from privfl.algorithms.dpsgd_fedavg import DPSGDFedAvg
from privfl.algorithms.fedavg import FedAvg
from privfl.algorithms.fedbnr import FedBNR
from privfl.algorithms.fedbnn import FedBNN
from privfl.algorithms.fedprox import FedProx
from privfl.algorithms.fola import FOLA
from privfl.algorithms.hbfl import HBFL
from privfl.errors import ConfigurationError

ALGORITHMS: dict[str, type[FederatedAlgorithm]] = {cls.name: cls for cls in (FedAvg, DPFedAvg, HBFL, FedProx,
                                                                              DPSGDFedAvg, FOLA, FedBNN, FedBNR)}


def make_algorithm(name: str, fed, privacy) -> FederatedAlgorithm:
    if name not in ALGORITHMS:
        raise ConfigurationError(f"unknown algorithm {name!r}; choose one of {sorted(ALGORITHMS)}")
    return ALGORITHMS[name](fed, privacy)


__all__ = ["ALGORITHMS", "ClientOutput", "FederatedAlgorithm", "make_algorithm"]
