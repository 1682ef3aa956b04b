"""FOLA (Liu et al.): local precision of eq. 24 from the online per-example Fisher, the Gaussian-product server in
each privacy mode, the Fisher channel's sensitivity on neighbouring data, and audited end-to-end runs."""

import dataclasses

import numpy as np
import pytest

from privfl.accounting import GaussianEvent, SelfComposedEvent
from privfl.core.public import PublicFacts
from privfl.core.aggregation import Aggregate
from privfl.algorithms import ALGORITHMS
from privfl.privacy.record_level import DPSGDSchedule
from privfl.algorithms.fola import FOLA
from privfl.algorithms.gaussian_product import combine, product_of_gaussians
from privfl.core.channels import ClippedValue, NormClip, PreClipped, PrivatizedValue, TrainedPrivately, Unclipped
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import FederatedData, make_federated
from privfl.errors import ConfigurationError
from privfl.training.fisher import per_example_fisher
from privfl.runtime.engine import Simulation
from privfl.training.local import load_flat_parameters

FED = FederationConfig(rounds=2, local_epochs=1, batch_size=32, lr=0.1, hidden=(16,), seed=0)
FROZEN = FederationConfig(rounds=2, local_epochs=2, batch_size=32, lr=1e-12, hidden=(16,), seed=0)  # params fixed
EXAMPLE = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="example", clip=0.5)




@pytest.fixture(scope="module")
def digits():
    """Three clients of 160 digits (one DP-SGD schedule, so one calibration) and a small test set."""
    d = make_federated("digits", 3, partition="dirichlet", alpha=0.5, seed=0)
    return FederatedData([p.subset(np.arange(160)) for p in d.train_parts], d.test.subset(np.arange(200)), d.name,
                         d.num_classes, d.input_shape, design_size=160)


def reference_fisher(alg, part, clip=None):
    model = alg.model
    load_flat_parameters(model, alg.mean)
    x, y = part.tensors()
    return per_example_fisher(model, x, y, clip=clip).squared.double().numpy()


def test_local_precision_is_eq_24_from_the_per_example_fisher(digits):
    alg = FOLA(FROZEN, PrivacyConfig())
    alg.setup(digits, np.random.default_rng(0))
    part, n = digits.train_parts[1], 160
    fisher = reference_fisher(alg, part) / n  # eq. 22 at fixed parameters: the per-example average
    out = alg.client_update(1, part, 0, np.random.default_rng(1))  # round r = 1
    np.testing.assert_allclose(out.values["precision"], fisher, rtol=1e-4, atol=1e-12)
    np.testing.assert_allclose(out.values["natural_mean"], fisher * alg.mean, rtol=1e-4, atol=1e-12)
    assert out.weight == n
    alg.precision = np.full(alg.dim, 0.3)  # a later round: half likelihood, half prior
    out = alg.client_update(1, part, 1, np.random.default_rng(1))  # round r = 2
    np.testing.assert_allclose(out.values["precision"], fisher / 2 + 0.3 / 2, rtol=1e-4)


def aggregate(name, values, weights, noise_std=0.0):
    return Aggregate(name, sum(w * v for w, v in zip(weights, values)), float(sum(weights)), len(values), noise_std)


def test_server_is_the_gaussian_product_without_privacy_and_at_client_level():
    rng = np.random.default_rng(0)
    means = [rng.normal(size=10) for _ in range(3)]
    precs = [rng.uniform(0.01, 1.0, size=10) for _ in range(3)]
    sizes = [160.0] * 3
    expected = product_of_gaussians(means, precs, sizes)

    plain = FOLA(FED, PrivacyConfig())
    plain.mean, plain.precision = np.zeros(10), np.full(10, 1e-3)
    plain.server_update({"natural_mean": aggregate("natural_mean", [p * m for p, m in zip(precs, means)], sizes),
                         "precision": aggregate("precision", precs, sizes)}, 0)
    np.testing.assert_allclose(plain.mean, expected.mean, rtol=1e-12)
    np.testing.assert_allclose(plain.precision, expected.precision, rtol=1e-12)

    client = FOLA(FED, PrivacyConfig(epsilon=5.0, unit="client"))
    client.mean, client.precision = rng.normal(size=10), np.full(10, 0.2)
    prior_nat = client.precision * client.mean
    client.server_update({
        "natural_mean_delta": aggregate("natural_mean_delta", [p * m - prior_nat for p, m in zip(precs, means)],
                                        [1.0] * 3),
        "precision_delta": aggregate("precision_delta", [p - 0.2 for p in precs], [1.0] * 3)}, 0)
    np.testing.assert_allclose(client.mean, expected.mean, rtol=1e-10)  # equal sizes: uniform = n_k weights


def test_example_unit_server_matches_the_product_of_eq_24_posteriors():
    rng = np.random.default_rng(1)
    global_mean = rng.normal(size=8)
    means = [global_mean + 0.05 * rng.normal(size=8) for _ in range(3)]
    fishers = [rng.uniform(0, 50, size=8) for _ in range(3)]
    prior = rng.uniform(0.1, 0.5, size=8)
    r, n_k = 2, 160
    locals_ = [f / n_k / r + (r - 1) / r * prior for f in fishers]  # eq. 24 with F_k = fisher_sum / n_k
    expected = product_of_gaussians(means, locals_)  # equal sizes: q_k = 1/3

    def server(noise_std):
        alg = FOLA(FED, EXAMPLE)
        alg.public = PublicFacts(n_clients=3, task="classification", num_classes=10, input_shape=(8,),
                                 client_size=n_k)  # the server divides by the public record count 3 * n_k
        alg.mean, alg.precision = global_mean.copy(), prior.copy()
        changes = [f * (m - global_mean) for f, m in zip(fishers, means)]  # |change| < B: no clipping
        alg.server_update({"mean": aggregate("mean", means, [1.0] * 3),
                           "fisher_diag": aggregate("fisher_diag", fishers, [1.0] * 3, noise_std),
                           "fisher_natural_mean": aggregate("fisher_natural_mean", changes, [1.0] * 3, noise_std)},
                          r - 1)
        return alg

    exact = server(0.0)
    np.testing.assert_allclose(exact.mean, expected.mean, rtol=1e-10)
    np.testing.assert_allclose(exact.precision, expected.precision, rtol=1e-10)
    # known DP noise far above the values' spread (the aggregates here carry none, only its declared std): the
    # empirical-Bayes estimates pool everything, so the Fisher-weighted correction shrinks to 0 (the clients' average
    # mean) and the precision is the pooled mean Fisher's (one parameter group: this server has no model)
    fedavg = sum(means) / 3
    noisy = server(1e6)
    np.testing.assert_allclose(noisy.mean, fedavg, rtol=1e-12)
    pooled = np.mean(sum(fishers) / (3 * n_k))
    np.testing.assert_allclose(noisy.precision, pooled / r + (r - 1) / r * prior, rtol=1e-12)
    # moderate noise: between the two, never further from the exact product than the average is
    middle = server(50.0)
    assert np.linalg.norm(middle.mean - expected.mean) <= np.linalg.norm(fedavg - expected.mean)


def test_record_level_server_keeps_release_noise_out_of_the_mean():
    """Fisher releases that are mostly noise (as at record level: a record adds at most C^2 over all coordinates),
    the noise actually drawn: the posterior mean stays far nearer the clients' average than the per-coordinate
    regularised division (combine with reference_mean) puts it, and with shrink_margin=2 it is the average; on a
    strong Fisher it moves towards the exact product, further than that division does."""
    rng = np.random.default_rng(5)
    d, n_k, r = 4000, 160, 3
    global_mean = rng.normal(size=d)
    means = [global_mean + 0.05 * rng.normal(size=d) for _ in range(3)]
    fedavg = sum(means) / 3
    prior = np.full(d, 1e-3)

    def server(scale, noise_std, **options):
        draw = np.random.default_rng(int(scale * 1000 + noise_std))  # the same releases for every option
        fishers = [scale * draw.uniform(0, 1, size=d) for _ in range(3)]
        changes = [f * (m - global_mean) for f, m in zip(fishers, means)]
        aggs = {"mean": aggregate("mean", means, [1.0] * 3),
                "fisher_diag": aggregate("fisher_diag", fishers, [1.0] * 3, noise_std),
                "fisher_natural_mean": aggregate("fisher_natural_mean", changes, [1.0] * 3, noise_std)}
        for name in ("fisher_diag", "fisher_natural_mean"):  # the DP noise itself, of the declared std
            a = aggs[name]
            aggs[name] = Aggregate(name, a.total + noise_std * draw.normal(size=d), a.total_weight, 3, noise_std)
        alg = FOLA(FED, EXAMPLE, **options)
        alg.public = PublicFacts(n_clients=3, task="classification", num_classes=10, input_shape=(8,),
                                 client_size=n_k)
        alg.mean, alg.precision = global_mean.copy(), prior.copy()
        alg.server_update(aggs, r - 1)
        records = 3 * n_k
        old = combine((aggs["fisher_diag"].total * global_mean + aggs["fisher_natural_mean"].total) / records / r
                      + (r - 1) / r * prior * fedavg, aggs["fisher_diag"].total / records / r + (r - 1) / r * prior,
                      precision_floor=1e-3, natural_noise_std=noise_std / records / r,
                      precision_noise_std=noise_std / records / r, fold_noise=True, reference_mean=fedavg)
        exact = product_of_gaussians(means, [f / n_k / r + (r - 1) / r * prior for f in fishers])
        return alg.mean, old.mean, exact.mean

    norm = np.linalg.norm
    new, old, _ = server(scale=0.01, noise_std=20.0)  # pure noise
    # the step stays in the public range the exact one lies in (|clip(change_k)| <= B = update_bound)
    bound = FOLA(FED, EXAMPLE).update_bound
    assert np.all(np.abs(new - fedavg) <= bound + np.abs(fedavg - global_mean) + 1e-12)
    assert norm(new - fedavg) < 0.5 * norm(old - fedavg)
    guarded, _, _ = server(scale=0.01, noise_std=20.0, shrink_margin=2.0)
    np.testing.assert_array_equal(guarded, fedavg)
    new, old, exact = server(scale=400.0, noise_std=5.0)  # a Fisher and a correction well above their noise
    assert norm(new - exact) < 0.7 * norm(fedavg - exact)
    assert norm(new - exact) < norm(old - exact)


def test_record_level_server_pools_its_estimates_per_layer_by_default(digits):
    sizes = {"layer": [64 * 16 + 16, 16 * 10 + 10], "tensor": [64 * 16, 16, 16 * 10, 10], "all": [64 * 16 + 16 + 170]}
    for groups, expected in sizes.items():
        alg = FOLA(FED, EXAMPLE, **({} if groups == "layer" else {"shrink_groups": groups}))
        alg.setup(digits, np.random.default_rng(0))
        slices = alg._parameter_groups()
        assert [b - a for a, b in slices] == expected
        assert slices[0][0] == 0 and slices[-1][1] == alg.dim
        assert all(a1 == b0 for (_, b0), (a1, _) in zip(slices, slices[1:]))
    with pytest.raises(ConfigurationError, match="shrink_groups"):
        FOLA(FED, EXAMPLE, shrink_groups="neuron")
    for margin in (-1.0, float("inf"), True, "2"):
        with pytest.raises(ConfigurationError, match="shrink_margin"):
            FOLA(FED, EXAMPLE, shrink_margin=margin)


def frozen_example_client(digits, part):
    # seeded on purpose: D and D' then draw the same Fisher steps for the same positions (with secure noise each run
    # draws its own, and the frozen parameters' tiny drift between steps breaks the 1e-3 comparison below)
    alg = FOLA(FROZEN, dataclasses.replace(EXAMPLE, secure_noise=False), update_bound=0.5)
    alg.setup(digits, np.random.default_rng(0))
    alg._dpsgd_noise_multiplier = lambda schedule: 1.0  # no calibration needed: lr ~ 0 keeps the parameters
    return alg, alg.client_update(0, part, 0, np.random.default_rng(7))


@pytest.mark.parametrize("j", [0, 57, 159])
def test_example_unit_fisher_channels_move_within_their_sensitivity_on_neighbouring_data(digits, j):
    part = digits.train_parts[0]
    neighbour = part.subset(np.delete(np.arange(len(part)), j))
    alg, full = frozen_example_client(digits, part)
    _, without = frozen_example_client(digits, neighbour)
    c, b = EXAMPLE.clip, 0.5
    fisher, fisher_nat = full.values["fisher_diag"], full.values["fisher_natural_mean"]
    assert isinstance(fisher, ClippedValue) and (fisher.bound, fisher.statistic) == (c, "squared_sum")
    assert isinstance(fisher_nat, ClippedValue) and (fisher_nat.bound, fisher_nat.statistic) == (b * c ** 2, "sum")
    moved = np.linalg.norm(fisher.value - without.values["fisher_diag"].value)
    assert 0 < moved <= c ** 2 * (1 + 1e-5)
    assert np.linalg.norm(fisher_nat.value - without.values["fisher_natural_mean"].value) <= b * c ** 2 * (1 + 1e-5)
    np.testing.assert_array_equal(np.abs(fisher_nat.value) <= b * fisher.value + 1e-12, True)
    # every epoch saw record j once, at (almost) the same parameters: the difference is its clipped squared gradient
    own = reference_fisher(alg, part.subset([j]), clip=c)
    np.testing.assert_allclose(fisher.value - without.values["fisher_diag"].value, own, rtol=1e-3, atol=1e-7)
    assert isinstance(full.values["mean"], PrivatizedValue)
    assert full.values["mean"].event == DPSGDSchedule.for_client(160, 32, 2).round_event(1.0)


@pytest.mark.timeout(180)
def test_example_level_run_charges_dpsgd_and_fisher_and_meets_the_target(digits):
    privacy = EXAMPLE
    alg = FOLA(FED, privacy)
    sim = Simulation(alg, digits, FED, privacy)
    result = sim.run()
    clips = {c.name: c.clip for c in alg.channels()}
    assert clips == {"mean": TrainedPrivately(), "fisher_diag": PreClipped(0.5, "squared_sum"),
                     "fisher_natural_mean": PreClipped(0.1 * 0.25, "sum")}  # B C^2, B = 0.1
    assert result.accountant == "pld" and 3.6 <= result.audit["max_epsilon"] <= 4.0
    round0 = {c.channel: c.event for c in sim.ledger.charges("0") if c.round == 0}
    zs = result.noise_multipliers
    assert round0["fisher_diag"] == GaussianEvent(0.25, zs["fisher_diag"] * 0.25)
    assert round0["fisher_natural_mean"] == GaussianEvent(0.025, zs["fisher_natural_mean"] * 0.025)
    assert isinstance(round0["mean"], SelfComposedEvent) and round0["mean"].count == 5
    assert all(np.isfinite(r.metrics["accuracy"]) for r in result.history)
    assert np.all(alg.precision > 0) and np.all(np.isfinite(alg.mean))


@pytest.mark.timeout(120)
def test_client_level_run_clips_natural_parameter_changes(digits):
    privacy = PrivacyConfig(epsilon=5.0, delta=1e-5, unit="client", clip=1.0)
    alg = FOLA(FED, privacy)
    result = Simulation(alg, digits, FED, privacy).run()
    assert {c.name: c.clip for c in alg.channels()} == {"natural_mean_delta": NormClip(1.0),
                                                         "precision_delta": NormClip(1.0)}
    assert result.accountant == "exact" and 4.9 <= result.audit["max_epsilon"] <= 5.0
    assert np.all(alg.precision > 0) and np.all(np.isfinite(alg.mean))


def test_configuration_is_checked(digits):
    assert ALGORITHMS["fola"] is FOLA
    plain = FOLA(FED, PrivacyConfig())
    plain.setup(digits, np.random.default_rng(0))
    assert {c.name: c.clip for c in plain.channels()} == {"natural_mean": Unclipped(), "precision": Unclipped()}
    with pytest.raises(ConfigurationError, match="--accountant pld"):
        FOLA(FED, PrivacyConfig(epsilon=3.0, unit="example", accountant="exact"))
    with pytest.raises(ConfigurationError, match="budget_shares"):
        FOLA(FED, PrivacyConfig(epsilon=3.0, unit="client"), budget_shares={"natural_mean": 1.0})
    with pytest.raises(ConfigurationError, match="prior_weight"):
        FOLA(FED, PrivacyConfig(), prior_weight=-1.0)
    alg = FOLA(FED, PrivacyConfig(epsilon=3.0, unit="client"), budget_shares={"natural_mean_delta": 3.0,
                                                                              "precision_delta": 1.0})
    assert alg.budget_shares == {"natural_mean_delta": 3.0, "precision_delta": 1.0}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("privacy", [["--epsilon", "inf"], ["--epsilon", "4", "--unit", "example", "--clip", "0.5"]])
def test_cli_runs_fola(cli_run, privacy):
    result = cli_run("fola", "--clients", "2", *privacy)
    assert result["algorithm"] == "fola" and len(result["accuracy_per_round"]) == 2
    assert all(0.0 <= a <= 1.0 for a in result["accuracy_per_round"])
    assert float(result["epsilon_spent_max"]) <= float(privacy[1])


@pytest.mark.parametrize("secure", [True, False])
def test_the_fisher_steps_of_the_records_are_secret_in_a_private_run(monkeypatch, secure):
    """At record level each record's Fisher pass picks its step by its position in the client's data: with a draw
    that followed the public run seed, one record removed moved every later record's pass to another step (a review
    measured the Fisher sum move 2.1 C^2 against its sensitivity C^2). With secure noise the draws are the OS
    CSPRNG's: the same data and seed give other steps; a seeded run (secure_noise=False) draws the same, as before."""
    from sklearn.datasets import load_digits

    from privfl.data import federated_from_arrays
    from privfl.training.posterior import StepFisher

    d = load_digits()
    x, y = (d.data / 16).astype(np.float32), d.target.astype(np.int64)
    parts = [(x[k * 40:(k + 1) * 40], y[k * 40:(k + 1) * 40]) for k in range(3)]
    data = federated_from_arrays(parts, (x[1500:1600], y[1500:1600]), task="classification", num_classes=10,
                                 name="digits", design_size=40)
    privacy = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=1.0, placement="central",
                            accountant="pld", secure_noise=secure)
    fed = FederationConfig(rounds=2, local_epochs=1, batch_size=4, lr=0.5, hidden=(8,), seed=0)
    drawn = []
    records = StepFisher._records

    def spy(self, j, step):
        out = records(self, j, step)
        if step == 0:
            drawn.append(self.step_of[j].copy())
        return out

    monkeypatch.setattr(StepFisher, "_records", spy)
    for _ in range(2):
        sim = Simulation(ALGORITHMS["fola"](fed, privacy), data, fed, privacy,
                         public=PublicFacts.of(data, privacy, fed))
        sim.prepare()
        sim.algorithm.client_update(0, data.train_parts[0], 0, sim.train_rngs[0])
    assert len(drawn) == 2 and drawn[0].max() > 0  # more than one step an epoch: the assignment matters
    assert (not np.array_equal(drawn[0], drawn[1])) if secure else np.array_equal(drawn[0], drawn[1])
