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


#: settings of the algorithms' ``defaults`` that apply to image inputs (C, H, W) only (DP-FedAvg's and DP-FedSGD's
#: 2x2 average pooling): :func:`algorithm_defaults` leaves them out for any other input, so a tabular run is not
#: stopped by a setting it never asked for (one the user gives explicitly is still checked against the input)
IMAGE_ONLY_DEFAULTS = ("pool",)


def algorithm_defaults(name: str, *, image: bool = True) -> dict:
    """The settings a run of ``name`` uses for what the user leaves out (the class's ``defaults``), for an input that
    is an image (``image``) or not: without :data:`IMAGE_ONLY_DEFAULTS` for a non-image input."""
    defaults = dict(ALGORITHMS[name].defaults)
    if not image:
        for key in IMAGE_ONLY_DEFAULTS:
            defaults.pop(key, None)
    return defaults


def default_unit(name: str) -> str:
    """The privacy unit a run of ``name`` uses unless told: the class's ``default_unit`` (the unit its guarantee is
    stated in: record level for DP-SGD FedAvg, DP-FedSGD and FedBNR), else ``"client"``."""
    return getattr(ALGORITHMS.get(name), "default_unit", "client")


def user_training_options(given: dict, algorithm: str, source: str, choose: str) -> dict:
    """``given`` (the user's own ``model``, ``loss``, ``optimizer``, ``metrics`` from an entry point) if
    ``algorithm`` takes every one of them; else a ConfigurationError naming what it does not take and the algorithms
    that take them all (``source`` names where they came from; ``choose``, a format string with one ``{}`` for the
    list of those algorithms, says how to pick one)."""
    takes = set(algorithm_options(algorithm)) if algorithm in ALGORITHMS else set()
    missing = [k for k in given if k not in takes]
    if not missing:
        return dict(given)
    able = ", ".join(sorted(a for a in ALGORITHMS if set(given) <= set(algorithm_options(a))))
    if "model" in missing:
        module = given["model"]
        kind = getattr(module, "__name__", type(module).__name__)
        raise ConfigurationError(f"{source} returned your own model ({kind}), and {algorithm} builds its own models "
                                 f"from a built-in architecture: {choose.format(able)}, or have the entry return a "
                                 "built-in model's name or settings (e.g. {'model': 'mlp', 'hidden': [16]})")
    raise ConfigurationError(f"{source} returned your own {' and '.join(missing)}, which {algorithm} does not take "
                             f"(it trains with its own): {choose.format(able)}, or drop "
                             f"{'it' if len(missing) == 1 else 'them'} from the entry's result")


def make_algorithm(name: str, fed, privacy, **options) -> FederatedAlgorithm:
    """``ALGORITHMS[name](fed, privacy, **options)``; an option the algorithm does not take is a clear error."""
    if name not in ALGORITHMS:
        raise ConfigurationError(f"unknown algorithm {name!r}; choose one of {sorted(ALGORITHMS)}")
    bad = sorted(set(options) - set(algorithm_options(name)))
    if bad:
        raise ConfigurationError(f"{name} takes no option {bad}; its options are {list(algorithm_options(name))}")
    return ALGORITHMS[name](fed, privacy, **options)


__all__ = ["ALGORITHMS", "ClientOutput", "FederatedAlgorithm", "IMAGE_ONLY_DEFAULTS", "algorithm_defaults",
           "algorithm_options", "default_unit", "make_algorithm",
           "user_training_options"]
