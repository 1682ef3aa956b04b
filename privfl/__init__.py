"""privfl: privacy-first federated learning.

Every value a client sends out goes through one release pipeline (validate -> clip -> charge the ledger -> noise ->
optional secure-aggregation mask); the ledger turns what was charged into (epsilon, delta) per client.

Typical use::

    from privfl import FederationConfig, PrivacyConfig, Simulation, make_algorithm, make_federated

    privacy = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="client", clip=0.1)
    fed = FederationConfig(rounds=20, hidden=(), pool=2, local_epochs=2, lr=0.1)
    result = Simulation(make_algorithm("dp_fedavg", fed, privacy), make_federated("mnist5k", 10), fed, privacy,
                        ledger_path="runs/a.sqlite").run()
    result.audit["max_epsilon"]  # <= 3
"""

from privfl.algorithms import ALGORITHMS, make_algorithm
from privfl.channels import Channel, ClippedValue, NormClip, PreClipped, PrivatizedValue, RangeBound, TrainedPrivately
from privfl.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays, make_federated
from privfl.public import PublicFacts
from privfl.release import Release, ReleasePipeline
from privfl.runtime import RunResult, Simulation
from privfl.secure import SecureAggregation

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS", "Channel", "ClippedValue", "FederationConfig", "NormClip", "PreClipped", "PrivacyConfig",
    "PrivatizedValue", "RangeBound", "Release", "ReleasePipeline", "RunResult", "SecureAggregation", "Simulation",
    "PublicFacts", "TrainedPrivately", "federated_from_arrays", "make_algorithm", "make_federated",
]
