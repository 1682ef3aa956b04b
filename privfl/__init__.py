"""privfl: privacy-first federated learning.

Every value a client sends out goes through one release pipeline (validate -> clip -> charge the ledger -> noise ->
optional secure-aggregation mask); the ledger turns what was charged into (epsilon, delta) per client.

Your own model and data (``privfl.federate``)::

    result = privfl.federate(model, {"hospital_a": (X_a, y_a), "hospital_b": (X_b, y_b)}, epsilon=3.0,
                             client_size=500, classes=[0, 1])  # public facts a private run declares
    result.model, result.history, result.audit

The pieces underneath::

    from privfl import FederationConfig, PrivacyConfig, Simulation, make_algorithm, make_federated

    privacy = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="client", clip=0.1)
    fed = FederationConfig(rounds=20, hidden=(), pool=2, local_epochs=2, lr=0.1)
    result = Simulation(make_algorithm("dp_fedavg", fed, privacy), make_federated("mnist5k", 10), fed, privacy,
                        ledger_path="runs/a.sqlite").run()
    result.audit["max_epsilon"]  # <= 3
"""

import importlib

__version__ = "0.1.0"

# Names are imported on first use (PEP 562), so that ``privfl calibrate`` and ``import privfl.core.public`` do not pay for
# torch; ``from privfl import Simulation`` works as before.
_EXPORTS = {
    "ALGORITHMS": "privfl.algorithms", "make_algorithm": "privfl.algorithms",
    "Channel": "privfl.core.channels", "ClippedValue": "privfl.core.channels", "NormClip": "privfl.core.channels",
    "PreClipped": "privfl.core.channels", "PrivatizedValue": "privfl.core.channels", "RangeBound": "privfl.core.channels",
    "TrainedPrivately": "privfl.core.channels", "FederationConfig": "privfl.core.config", "PrivacyConfig": "privfl.core.config",
    "federated_from_arrays": "privfl.data", "make_federated": "privfl.data", "PublicFacts": "privfl.core.public",
    "Release": "privfl.core.release", "ReleasePipeline": "privfl.core.release", "RunResult": "privfl.runtime.engine",
    "Simulation": "privfl.runtime.engine", "SecureAggregation": "privfl.privacy.secure", "federate": "privfl.apps.api",
    "FederatedResult": "privfl.apps.api", "Algorithm": "privfl.algorithms.plain", "LocalData": "privfl.algorithms.plain",
    "register_algorithm": "privfl.privacy.wrapper", "unregister_algorithm": "privfl.privacy.wrapper",
}

__all__ = [
    "ALGORITHMS", "Algorithm", "Channel", "ClippedValue", "FederatedResult", "FederationConfig", "LocalData", "NormClip", "PreClipped", "PrivacyConfig",
    "PrivatizedValue", "RangeBound", "Release", "ReleasePipeline", "RunResult", "SecureAggregation", "Simulation",
    "PublicFacts", "TrainedPrivately", "federate", "federated_from_arrays", "make_algorithm",
    "make_federated", "register_algorithm", "unregister_algorithm",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'privfl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
