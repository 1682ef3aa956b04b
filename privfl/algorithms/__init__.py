"""The federated algorithms, by name."""

from __future__ import annotations

from privfl.algorithms.base import ClientOutput, FederatedAlgorithm
from privfl.algorithms.dp_fedavg import DPFedAvg
from privfl.algorithms.dp_fedsgd import DPFedSGD
from privfl.algorithms.dpsgd_fedavg import DPSGDFedAvg
from privfl.algorithms.fedavg import FedAvg
from privfl.algorithms.fedbnr import FedBNR
from privfl.algorithms.fedbnn import FedBNN
from privfl.algorithms.fedprox import FedProx
from privfl.algorithms.fola import FOLA
from privfl.algorithms.hbfl import HBFL
from privfl.errors import ConfigurationError

ALGORITHMS: dict[str, type[FederatedAlgorithm]] = {cls.name: cls for cls in (FedAvg, DPFedAvg, HBFL, FedProx,
                                                                              DPSGDFedAvg, DPFedSGD, FOLA, FedBNN,
                                                                              FedBNR)}


def algorithm_options(name: str) -> tuple[str, ...]:
    """The keyword options an algorithm's constructor takes besides (fed, privacy), e.g. FedBNN's ``warmup_epochs``
    or HBFL's ``meme_lr``."""
    import inspect

    params = inspect.signature(ALGORITHMS[name].__init__).parameters.values()
    return tuple(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                 and p.name not in ("self", "fed", "privacy"))


def default_unit(name: str) -> str:
    """The privacy unit a run of ``name`` uses unless told: the class's ``default_unit`` (the unit its guarantee is
    stated in: record level for DP-SGD FedAvg, DP-FedSGD and FedBNR), else ``"client"``."""
    return getattr(ALGORITHMS.get(name), "default_unit", "client")


def make_algorithm(name: str, fed, privacy, **options) -> FederatedAlgorithm:
    """``ALGORITHMS[name](fed, privacy, **options)``; an option the algorithm does not take is a clear error."""
    if name not in ALGORITHMS:
        raise ConfigurationError(f"unknown algorithm {name!r}; choose one of {sorted(ALGORITHMS)}")
    bad = sorted(set(options) - set(algorithm_options(name)))
    if bad:
        raise ConfigurationError(f"{name} takes no option {bad}; its options are {list(algorithm_options(name))}")
    return ALGORITHMS[name](fed, privacy, **options)


__all__ = ["ALGORITHMS", "ClientOutput", "FederatedAlgorithm", "algorithm_options", "default_unit", "make_algorithm"]
