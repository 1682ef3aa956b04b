"""FedProx: FedAvg plus the proximal term mu/2 ||w - w_global||^2 in local training; a non-private baseline."""

import copy

import numpy as np
import pytest
import torch

from privfl.algorithms import ALGORITHMS, make_algorithm
from privfl.algorithms.fedavg import FedAvg
from privfl.algorithms.fedprox import FedProx
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import make_federated
from privfl.errors import ConfigurationError

FED = FederationConfig(rounds=2, local_epochs=2, batch_size=32, lr=0.1, hidden=(16,), seed=0)




@pytest.fixture(scope="module")
def digits():
    return make_federated("digits", 3, partition="dirichlet", alpha=0.3, seed=0)


def local_update(alg, data, seed=5):
    alg.setup(data, np.random.default_rng(0))
    return alg.client_update(0, data.train_parts[0], 0, np.random.default_rng(seed)).values["update"]


def test_mu_zero_is_fedavg_and_mu_pulls_towards_the_global_model(digits):
    fedavg = local_update(FedAvg(FED, PrivacyConfig()), digits)
    np.testing.assert_allclose(local_update(FedProx(FED, PrivacyConfig(), mu=0.0), digits), fedavg)
    norms = [np.linalg.norm(local_update(FedProx(FED, PrivacyConfig(), mu=mu), digits)) for mu in (0.0, 1.0, 10.0)]
    assert norms[0] > norms[1] > norms[2] > 0


def test_proximal_gradient_is_mu_times_the_distance(digits):
    """Two full-batch SGD steps: the first starts at w_global (proximal gradient 0), the second adds
    lr * mu * (w_1 - w_global), so w_2(mu) - w_2(0) = -lr mu (w_1 - w_global)."""
    lr, mu = 0.1, 2.0
    fed = FederationConfig(rounds=1, local_epochs=2, batch_size=10_000, lr=lr, hidden=(8,), seed=0)
    part = digits.train_parts[0]
    w0 = w1 = None
    finals = {}
    for m in (0.0, mu):
        alg = FedProx(fed, PrivacyConfig(), mu=m)
        alg.setup(digits, np.random.default_rng(0))
        model = copy.deepcopy(alg.model)
        w0 = torch.nn.utils.parameters_to_vector(model.parameters()).detach().double().numpy()
        alg.local_train(model, part, np.random.default_rng(1))
        finals[m] = torch.nn.utils.parameters_to_vector(model.parameters()).detach().double().numpy()
        if m == 0.0:
            one = FedProx(FederationConfig(rounds=1, local_epochs=1, batch_size=10_000, lr=lr, hidden=(8,), seed=0),
                          PrivacyConfig(), mu=0.0)
            one.setup(digits, np.random.default_rng(0))
            model1 = copy.deepcopy(one.model)
            one.local_train(model1, part, np.random.default_rng(1))
            w1 = torch.nn.utils.parameters_to_vector(model1.parameters()).detach().double().numpy()
    np.testing.assert_allclose(finals[mu] - finals[0.0], -lr * mu * (w1 - w0), atol=1e-6)


def test_fedprox_is_registered_and_non_private():
    assert ALGORITHMS["fedprox"] is FedProx
    assert isinstance(make_algorithm("fedprox", FED, PrivacyConfig()), FedProx)
    with pytest.raises(ConfigurationError, match="non-private"):
        FedProx(FED, PrivacyConfig(epsilon=1.0))
    with pytest.raises(ConfigurationError, match="mu"):
        FedProx(FED, PrivacyConfig(), mu=-1.0)


@pytest.mark.timeout(120)
def test_cli_runs_fedprox_non_private(cli_run):
    result = cli_run("fedprox", "--epsilon", "inf")
    assert result["algorithm"] == "fedprox" and len(result["accuracy_per_round"]) == 2
    assert 0.0 <= result["accuracy"] <= 1.0
