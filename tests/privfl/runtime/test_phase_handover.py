"""A phase rebuilt where the earlier phases' server halves are not (a deployment's client, ``privfl.runtime.phases.phase_at``)
from their handed-over final states is the phase the runtime built from the trained server halves."""

from __future__ import annotations

import numpy as np
import pytest

from privfl.algorithms import make_algorithm
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import make_federated
from privfl.errors import CorruptMessage
from privfl.runtime.phases import phase_at, setup_phase
from privfl.core.public import PublicFacts
from privfl.runtime.engine import Simulation

FED = FederationConfig(rounds=1, local_epochs=3, lr=0.05, hidden=(4,), seed=2)
PRIVACY = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", accountant="exact", secure_noise=False)


def test_a_phase_rebuilt_from_the_handed_over_states_is_the_phase_the_server_built():
    data = make_federated("synthetic1d", 3, seed=0, n=120)
    options = {"kernel_rounds": 2, "num_samples": 10}
    sim = Simulation(make_algorithm("fedbnr", FED, PRIVACY, **options), data, FED, PRIVACY, executor="per_client")
    sim.run()
    kernel, regression = sim.phase_runs
    handed = [dict(kernel.algorithm.broadcast(kernel.simulation.fed.rounds).values)]  # phases.final_state
    public = PublicFacts.of(data, PRIVACY, FED)
    rebuilt = phase_at(make_algorithm("fedbnr", FED, PRIVACY, **options), public, 1, handed)
    assert rebuilt.name == "regression" and rebuilt.privacy == regression.simulation.privacy
    setup_phase(rebuilt, public)
    x = data.test.x
    np.testing.assert_array_equal(rebuilt.algorithm.feature_map(x), regression.algorithm.feature_map(x))
    # its client step is the server's phase's: the same statistics of the same data
    out = rebuilt.algorithm.client_update(0, data.train_parts[0], 0, np.random.default_rng(0))
    ref = regression.algorithm.client_update(0, data.train_parts[0], 0, np.random.default_rng(0))
    for name in ("scatter", "cross"):
        np.testing.assert_array_equal(np.asarray(out.values[name].value), np.asarray(ref.values[name].value))
    with pytest.raises(CorruptMessage, match="final states"):
        phase_at(make_algorithm("fedbnr", FED, PRIVACY, **options), public, 1, [])
