"""FedBNR on a user's feature extractor (issue 15): ``privfl.federate(model, ..., algorithm="fedbnr")`` and
``make_algorithm("fedbnr", ..., model=...)`` train on a real regression set (diabetes, standardised with public
statistics), private runs audit within the target, the user's module is never changed, phase 2 on the extractor as
given is exactly centralised Bayesian linear regression on the same features, both halves build the same network,
the paired scatter sensitivity still holds on neighbouring data, and extractors that mix examples are refused."""

import copy
import math
import threading

import numpy as np
import pytest
import torch
from sklearn.datasets import load_diabetes
from torch import nn

import privfl
from privfl.algorithms import make_algorithm
from privfl.algorithms.fedbnr import FedBNR, FedBNRKernel, PairedScatter, centralised_blr
from privfl.core.channels import ClippedValue, NormClip
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import ArrayDataset
from privfl.data.federated import federated_from_arrays
from privfl.errors import ConfigurationError
from privfl.models.features import fourier_frequencies
from privfl.runtime.engine import Simulation

M = 20  # frequencies (2M features)
LATENT = 4
ONE_ROUND = FederationConfig(rounds=1, seed=0)
NON_PRIVATE = PrivacyConfig()
RECORD_DP = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", accountant="exact", secure_noise=False)
KERNEL_FED = FederationConfig(rounds=2, local_epochs=10, lr=0.02, seed=0)


def _diabetes(n_clients=4):
    """Diabetes split into a public reference sample (its statistics standardise features and targets: public
    facts), ``n_clients`` clients and a test set."""
    x, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    public, rest = slice(0, 62), slice(62, None)
    mu, sd, y_mu, y_sd = x[public].mean(0), x[public].std(0), y[public].mean(), y[public].std()
    x = ((x[rest] - mu) / sd).astype(np.float32)
    y = ((y[rest] - y_mu) / y_sd).astype(np.float32)
    test = (x[:60], y[:60])
    parts = np.array_split(np.arange(60, len(y)), n_clients)
    clients = {f"clinic_{k}": (x[idx], y[idx]) for k, idx in enumerate(parts)}
    return clients, test


def _data(n_clients=4):
    clients, test = _diabetes(n_clients)
    return federated_from_arrays(list(clients.values()), test, task="regression", name="diabetes",
                                 design_size=round(sum(len(y) for _, y in clients.values()) / len(clients)))


def _extractor(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, LATENT))


def _mean_rmse(y) -> float:
    """RMSE of predicting the public mean (0 after standardisation): the baseline a regressor must beat."""
    return float(np.sqrt(np.mean(np.asarray(y, dtype=np.float64) ** 2)))


def _snapshot(net: nn.Module):
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, net.training, \
        next(net.parameters()).dtype


def _assert_unchanged(net: nn.Module, snap) -> None:
    state, training, dtype = snap
    assert net.training == training and next(net.parameters()).dtype == dtype
    for k, v in net.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)


def _relative(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(b)), 1e-300))


# -- phase 2 on the extractor as given ---------------------------------------------------------------------------

def test_phase2_on_a_users_extractor_equals_centralised_blr_on_its_random_features():
    data, net = _data(), _extractor()
    snap = _snapshot(net)
    alg = make_algorithm("fedbnr", ONE_ROUND, NON_PRIVATE, model=net, num_samples=M)
    result = Simulation(alg, data, ONE_ROUND, NON_PRIVATE).run()
    pooled = data.pooled_train()
    # the features are RFF (public seed, lengthscale sqrt(latent dim)) of the user's extractor as given
    with torch.no_grad():
        h = copy.deepcopy(net).double()(torch.as_tensor(pooled.x, dtype=torch.float64)).numpy()
    proj = h @ fourier_frequencies(LATENT, M, 0) / math.sqrt(LATENT)
    phi = np.concatenate([np.cos(proj), np.sin(proj)], axis=1) / math.sqrt(M)
    np.testing.assert_allclose(alg.feature_map(pooled.x), phi, rtol=0, atol=1e-6)
    central = centralised_blr(alg.feature_map(pooled.x), pooled.y, alg.noise_std, alg.prior_std)
    assert _relative(alg.posterior.mean, central.mean) < 1e-8
    assert _relative(alg.posterior.precision, central.precision) < 1e-8
    mean, var = alg.predict(data.test)
    ref_mean, ref_var = central.predict(alg.feature_map(data.test.x))
    assert _relative(mean, ref_mean) < 1e-8 and _relative(var, ref_var) < 1e-8
    assert result.final["rmse"] < 0.95 * _mean_rmse(data.test.y)  # it regresses (a random extractor: weakly)
    _assert_unchanged(net, snap)


def test_both_halves_build_the_same_extractor_from_a_factory():
    data = _data(3)

    def factory():  # random initialisation: only the setup stream's seed makes the halves agree
        return nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, LATENT))

    alg = make_algorithm("fedbnr", ONE_ROUND, NON_PRIVATE, model=factory, num_samples=M)
    alg.setup(data, np.random.default_rng(5))
    client = alg.client_half(rng=np.random.default_rng(5)).algorithm
    x = data.test.x
    np.testing.assert_array_equal(client.feature_map(x), alg.feature_map(x))
    other = make_algorithm("fedbnr", ONE_ROUND, NON_PRIVATE, model=factory, num_samples=M)
    other.setup(data, np.random.default_rng(6))
    assert not np.allclose(other.feature_map(x), alg.feature_map(x))  # the seed does build the network
    kernel = FedBNRKernel(KERNEL_FED, NON_PRIVATE, model=factory, num_samples=M)
    kernel.setup(data, np.random.default_rng(5))
    np.testing.assert_array_equal(kernel.client_half(rng=np.random.default_rng(5)).algorithm.global_params,
                                  kernel.global_params)


def test_the_extractor_runs_in_eval_mode_so_a_records_features_are_its_own():
    from privfl.models.features import KernelNetwork

    torch.manual_seed(0)
    user = nn.Sequential(nn.Linear(10, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, LATENT)).train()
    net = KernelNetwork(10, num_samples=M, extractor=copy.deepcopy(user), lengthscale=None).train()
    x = torch.as_tensor(_data(3).test.x)
    first, second = net(x), net(x)  # in phase 1's training mode: no dropout draws
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    torch.testing.assert_close(net(x[:1]), first[:1])
    assert net.training and not net.extractor.training and user.training
    assert net.latent_dim == LATENT and net.lengthscale == pytest.approx(math.sqrt(LATENT))


# -- privacy -------------------------------------------------------------------------------------------------------

def test_record_level_channels_keep_the_paired_scatter_bound_whatever_the_extractor():
    data, net = _data(), _extractor()
    alg = make_algorithm("fedbnr", ONE_ROUND, RECORD_DP, model=net, num_samples=M, client_rows=200)
    alg.setup(data, np.random.default_rng(0))
    scatter, cross = alg.channels()
    assert scatter.clip == PairedScatter(1.0, pairs=M)
    bound = scatter.clip.sensitivity("add_remove")
    assert bound == pytest.approx(math.sqrt((1 + 1 / M) / 2))
    client = data.train_parts[0]
    x, y = np.asarray(client.x), np.asarray(client.y)
    rng = np.random.default_rng(1)
    # neighbours: every record removed in turn, plus an added record (random, and the all-zero input)
    extra = [rng.normal(size=(1, 10)).astype(np.float32) * 3, np.zeros((1, 10), np.float32)]
    base = alg.client_update(0, ArrayDataset(x, y, "regression", 1), 0, rng).values
    iu = np.triu_indices(alg.dim)
    moves = []
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        out = alg.client_update(0, ArrayDataset(x[keep], y[keep], "regression", 1), 0, rng).values
        assert isinstance(out["scatter"], ClippedValue)
        moves.append(np.linalg.norm((base["scatter"].value - out["scatter"].value)[iu]))
        assert np.linalg.norm(base["cross"].value - out["cross"].value) <= cross.clip.sensitivity("add_remove") \
            + 1e-9
    for record in extra:
        added = ArrayDataset(np.concatenate([x, record]), np.append(y, 3.0).astype(np.float32), "regression", 1)
        out = alg.client_update(0, added, 0, rng).values
        moves.append(np.linalg.norm((out["scatter"].value - base["scatter"].value)[iu]))
    assert max(moves) <= bound + 1e-9
    assert min(moves) >= math.sqrt(0.5) - 1e-9  # unit rows, never clipped: a record moves it by sqrt(1/2) at least


def test_private_run_through_simulation_audits_within_target():
    data, net = _data(), _extractor()
    snap = _snapshot(net)
    alg = make_algorithm("fedbnr", ONE_ROUND, RECORD_DP, model=net, num_samples=M, kernel_rounds=2,
                         kernel_fed=KERNEL_FED, kernel_clip=0.1)
    sim = Simulation(alg, data, ONE_ROUND, RECORD_DP)
    result = sim.run()
    assert 2.9 < result.audit["max_epsilon"] <= 3.0 + 1e-9
    assert [r.phase for r in result.history] == ["kernel", "kernel", "regression"]
    trained = sim.final_algorithm
    assert isinstance(trained, FedBNR) and trained.kernel is not None
    n_params = sum(p.numel() for p in net.parameters()) + 3  # the extractor and log l, log sigma, log lambda
    assert trained.kernel.dim == 2 * M and trained.kernel.latent_dim == LATENT
    kernel_phase = sim.phase_runs[0].algorithm
    assert isinstance(kernel_phase, FedBNRKernel)
    update = kernel_phase.channels()[0]  # the whole network's change, clipped as one vector: any architecture
    assert update.shape == (n_params,) and update.clip == NormClip(0.1) and update.adjacency == "replace_one"
    assert math.isfinite(result.final["rmse"]) and result.final["rmse"] < 2.0
    _assert_unchanged(net, snap)


# -- privfl.federate -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel_rounds", [0, 2])
def test_federate_trains_fedbnr_on_the_users_extractor(kernel_rounds):
    clients, test = _diabetes()
    net = _extractor()
    snap = _snapshot(net)
    result = privfl.federate(net, clients, algorithm="fedbnr", epsilon=math.inf, test=test, rounds=1,
                             num_samples=M, kernel_rounds=kernel_rounds,
                             **({"kernel_fed": KERNEL_FED} if kernel_rounds else {}))
    # phase 1 trains the user's extractor (and sigma, lambda, l) and does better than the extractor as given
    assert result.final["rmse"] < (0.85 if kernel_rounds else 0.95) * _mean_rmse(test[1])
    assert [h["round"] for h in result.history] == list(range(kernel_rounds + 1))
    _assert_unchanged(net, snap)


def test_federate_private_fedbnr_audits_every_client_within_target():
    clients, test = _diabetes()
    net = _extractor()
    snap = _snapshot(net)
    result = privfl.federate(net, clients, algorithm="fedbnr", epsilon=3.0, test=test, rounds=1, num_samples=M,
                             secure_noise=False, kernel_rounds=2, kernel_fed=KERNEL_FED, kernel_clip=0.1,
                             client_size=round(sum(len(y) for _, y in clients.values()) / len(clients)))
    assert set(result.audit) == set(clients)
    assert all(0 < row["epsilon"] <= 3.0 + 1e-9 for row in result.audit.values())
    assert result.epsilon <= 3.0 + 1e-9
    assert math.isfinite(result.final["rmse"]) and math.isfinite(result.final["nll"])
    _assert_unchanged(net, snap)


# -- refusals ------------------------------------------------------------------------------------------------------

class _CentreOnBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, LATENT)

    def forward(self, x):
        h = self.linear(x)
        return h - h.mean(0, keepdim=True)


class _Grid(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, 8)

    def forward(self, x):
        return self.linear(x).reshape(len(x), 2, 4)


class _Locked(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(10, LATENT))
        self.lock = threading.Lock()


def test_extractors_that_mix_examples_or_are_not_flat_are_refused():
    clients, test = _diabetes(3)
    batch_norm = nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, LATENT))
    with pytest.raises(ConfigurationError, match=r"fedbnr: the model: batch normalisation \(1 \(BatchNorm1d\)\)"):
        privfl.federate(batch_norm, clients, algorithm="fedbnr", epsilon=3.0, test=test, rounds=1)
    with pytest.raises(ConfigurationError, match=r"batch normalisation"):  # a factory: refused when built
        privfl.federate(lambda: copy.deepcopy(batch_norm), clients, algorithm="fedbnr", epsilon=math.inf,
                        test=test, rounds=1)
    with pytest.raises(ConfigurationError, match=r"mixes the examples of a batch"):
        privfl.federate(_CentreOnBatch(), clients, algorithm="fedbnr", epsilon=math.inf, test=test, rounds=1)
    with pytest.raises(ConfigurationError, match=r"one flat vector per example.*\(1, 2, 4\)"):
        privfl.federate(_Grid(), clients, algorithm="fedbnr", epsilon=math.inf, test=test, rounds=1,
                        kernel_rounds=1)
    with pytest.raises(ConfigurationError, match=r"deep-copyable"):
        make_algorithm("fedbnr", ONE_ROUND, NON_PRIVATE, model=_Locked())
    with pytest.raises(ConfigurationError, match=r"either model .* or kernel"):
        make_algorithm("fedbnr", ONE_ROUND, NON_PRIVATE, model=_extractor(), kernel=_kernel())
    with pytest.raises(ConfigurationError, match=r"either model .* or hidden"):
        FedBNRKernel(KERNEL_FED, NON_PRIVATE, model=_extractor(), hidden=(8,))
    with pytest.raises(ConfigurationError, match=r"leave hidden, latent_dim and model out"):
        make_algorithm("fedbnr", ONE_ROUND, NON_PRIVATE, model=_extractor(), kernel_rounds=1,
                       kernel_options={"hidden": (8,)})
    with pytest.raises(ConfigurationError, match=r"must be a torch.nn.Module or a zero-argument function"):
        make_algorithm("fedbnr", ONE_ROUND, NON_PRIVATE, model="mlp")


def _kernel():
    from privfl.models.features import KernelNetwork

    return KernelNetwork(10, num_samples=M, hidden=())
