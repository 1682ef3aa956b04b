"""FedBNN (Makhija, Ghosh and Ho): the probability channel and its sensitivity on neighbouring data, the server's
weighted average and post-processing, prior tuning (eqs. 3-4), heterogeneous architectures, secure aggregation,
a private run audited at its target, the CLI, and the MCE / Brier metrics."""

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from privfl.accounting import GaussianEvent
from privfl.accounting.ledger import PrivacyLedger
from privfl.mechanisms import InvalidRelease
from privfl.core.aggregation import weighted_sums
from privfl.algorithms import ALGORITHMS, make_algorithm
from privfl.algorithms.fedbnn import (CHANNEL, Architecture, FedBNN, clip_and_renormalise, label_shifted,
                                      mc_predict, release_reliability, soft_cross_entropy)
from privfl.core.channels import RangeBound, Unclipped
from privfl.apps.cli import main
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import FederatedData, make_federated
from privfl.errors import ConfigurationError
from privfl.metrics import brier_score, classification_metrics, maximum_calibration_error
from privfl.models import ModelPrior, model_kl_divergence, num_parameters
from privfl.core.release import ReleasePipeline
from privfl.runtime.engine import Simulation
from privfl.privacy.secure import SecureAggregation

FED = FederationConfig(rounds=2, local_epochs=1, batch_size=32, hidden=(16,), seed=0)
NONPRIVATE = PrivacyConfig()
SMALL = dict(warmup_epochs=5, prior_steps=3, mc_samples=2, alignment_size=40, small_fraction=0.0, bbb_lr=1e-2)




@pytest.fixture(scope="module")
def digits():
    """Three clients holding 5 of the 10 digit classes each, 120 examples each; a public alignment set of 40."""
    d = make_federated("digits", 3, partition="disjoint_class", classes_per_client=5, seed=0, alignment_size=40)
    return FederatedData([p.subset(np.arange(120)) for p in d.train_parts], d.test.subset(np.arange(150)), d.name,
                         d.num_classes, d.input_shape, alignment=d.alignment, design_size=120)


def ready(data, privacy=NONPRIVATE, fed=FED, **kw) -> FedBNN:
    alg = FedBNN(fed, privacy, **{**SMALL, **kw})
    alg.setup(data, np.random.default_rng(0))
    return alg


def test_registered_with_local_noise_by_default():
    assert ALGORITHMS["fedbnn"] is FedBNN
    assert isinstance(make_algorithm("fedbnn", FED, NONPRIVATE), FedBNN)
    assert FedBNN.defaults["placement"] == "local"
    alg = FedBNN(FED, NONPRIVATE)  # the paper's settings are the constructor's
    assert (alg.warmup_epochs, alg.alignment_size, alg.prior_steps, alg.prior_lr, alg.bbb_lr, alg.gamma,
            alg.small_fraction) == (50, 2000, 100, 1e-4, 1e-3, 0.7, 0.3)


def test_probability_channel_declaration(digits):
    plain = ready(digits).channels()
    assert [(c.name, c.shape) for c in plain] == [(CHANNEL, (40, 10))]
    assert isinstance(plain[0].clip, Unclipped) and plain[0].coordinate_bound == 1.0
    # record level: sqrt(2) per row whatever the adjacency; client level: sqrt(|AD|) under add/remove (tightened from
    # sqrt(2 |AD|): the removed upload itself has norm <= sqrt(|AD|)), sqrt(2 |AD|) under replace-one
    for unit, adjacency, sensitivity in [("example", "add_remove", math.sqrt(2 * 40)),
                                         ("example", "replace_one", math.sqrt(2 * 40)),
                                         ("client", "add_remove", math.sqrt(40)),
                                         ("client", "replace_one", math.sqrt(2 * 40))]:
        privacy = PrivacyConfig(epsilon=2.0, unit=unit, adjacency=adjacency, accountant="exact")
        ch = ready(digits, privacy).channels()[0]
        assert ch.clip == RangeBound(math.sqrt(2), 40, unit=unit) and ch.unit == unit and ch.value_bound == 1.0
        assert ch.clip.unit == ch.unit and ch.coordinate_bound == 1.0
        assert ch.sensitivity == pytest.approx(sensitivity)
    # local noise without secure aggregation: the server sees each upload of a client it knows took part, so the
    # runtime charges client level as replace-one (one rule for every algorithm: privfl.core.channels.charged_channels)
    from privfl.core.channels import charged_channels

    privacy = PrivacyConfig(epsilon=2.0, unit="client", placement="local", accountant="exact")
    (ch,) = charged_channels(ready(digits, privacy).channels(), privacy, secure_aggregation=False)
    assert ch.adjacency == "replace_one" and ch.sensitivity == pytest.approx(math.sqrt(2 * 40))
    (ch,) = charged_channels(ready(digits, privacy).channels(), privacy, secure_aggregation=True)
    assert ch.adjacency == "add_remove" and ch.sensitivity == pytest.approx(math.sqrt(40))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_upload_moves_at_most_the_declared_sensitivity_on_neighbouring_data(digits, seed):
    """Add/remove one record of client 0 (warm-up round, and a collaboration round with a global output): the
    uploads differ by no more than sqrt(2 |AD|), and by no more than sqrt(2) per alignment point."""
    rng = np.random.default_rng(100 + seed)
    part = digits.train_parts[0]
    neighbour = part.subset(np.delete(np.arange(len(part)), rng.integers(len(part))))
    privacy = PrivacyConfig(epsilon=2.0, unit="example", accountant="exact")
    global_probs = rng.dirichlet(np.full(10, 0.3), size=40)
    for collaborating in (False, True):
        uploads = []
        for data in (part, neighbour):
            alg = ready(digits, privacy)
            if collaborating:
                alg.warmed_up.add(0)
                alg.global_probs = global_probs
            uploads.append(alg.client_update(0, data, 1, np.random.default_rng(seed)).values[CHANNEL])
        diff = uploads[0] - uploads[1]
        assert 0 < np.linalg.norm(diff) <= alg.channels()[0].sensitivity
        assert np.all(np.linalg.norm(diff, axis=1) <= math.sqrt(2) + 1e-12)
        for u in uploads:
            np.testing.assert_allclose(u.sum(axis=1), 1.0, atol=1e-12)
    # the bound is attained (so it is the sensitivity, not a loose bound): one-hot rows on different classes
    worst = np.eye(10)[np.zeros(40, int)] - np.eye(10)[np.ones(40, int)]
    assert np.linalg.norm(worst) == pytest.approx(alg.channels()[0].sensitivity)


def _probability_rows(data, rows: int, classes: int) -> np.ndarray:
    """Adversarial probability matrices: one-hot rows, near one-hot rows (softmax of extreme logits), uniform rows,
    sparse Dirichlet rows, and duplicates of one row, mixed row by row."""
    kinds = data.draw(st.lists(st.sampled_from(["one_hot", "extreme", "uniform", "dirichlet"]), min_size=rows,
                               max_size=rows))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    out = np.empty((rows, classes))
    for r, kind in enumerate(kinds):
        if kind == "one_hot":
            out[r] = np.eye(classes)[rng.integers(classes)]
        elif kind == "extreme":
            logits = rng.normal(size=classes) * 60.0
            out[r] = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        elif kind == "uniform":
            out[r] = 1.0 / classes
        else:
            out[r] = rng.dirichlet(np.full(classes, 0.05))
    if data.draw(st.booleans()):
        out[:] = out[0]  # every row the same (a constant model)
    return out


@settings(max_examples=200, deadline=None)
@given(data=st.data(), rows=st.integers(1, 30), classes=st.integers(2, 10),
       unit=st.sampled_from(["example", "client"]), adjacency=st.sampled_from(["add_remove", "replace_one"]))
def test_any_probability_uploads_move_by_at_most_the_range_bound(data, rows, classes, unit, adjacency):
    """Whatever the training does, an upload is a matrix of probability rows. Client level, add/remove: the
    neighbour lacks the whole upload, which moves the sum by its norm <= sqrt(|AD|); otherwise the upload is
    replaced by another one (a record changed it, or another client sent it): <= sqrt(2 |AD|)."""
    clip = RangeBound(math.sqrt(2), rows, unit=unit)
    a = clip.apply(_probability_rows(data, rows, classes))
    b = clip.apply(_probability_rows(data, rows, classes))
    moved = np.linalg.norm(a) if (unit, adjacency) == ("client", "add_remove") else np.linalg.norm(a - b)
    assert moved <= clip.sensitivity(adjacency) * (1 + 1e-9)


def test_range_bound_sensitivity_follows_unit_and_adjacency():
    assert RangeBound(math.sqrt(2), 40).sensitivity("add_remove") == pytest.approx(math.sqrt(80))  # default: example
    assert RangeBound(math.sqrt(2), 40, unit="client").sensitivity("add_remove") == pytest.approx(math.sqrt(40))
    assert RangeBound(math.sqrt(2), 40, unit="client").sensitivity("replace_one") == pytest.approx(math.sqrt(80))
    assert RangeBound(math.sqrt(2), 40, unit="client", row_norm=0.5).sensitivity("add_remove") == \
        pytest.approx(0.5 * math.sqrt(40))
    for bad in (dict(unit="record"), dict(row_norm=0.0), dict(rows=0)):
        with pytest.raises(InvalidRelease):
            RangeBound(**{"per_row_sensitivity": math.sqrt(2), "rows": 40, **bad})


@pytest.mark.timeout(120)
def test_client_level_uploads_respect_and_attain_the_tightened_sensitivity(digits):
    """Client level: dropping a client moves the sum by its upload, at most sqrt(|AD|); replacing a client by
    another moves it by at most sqrt(2 |AD|). Real uploads of trained clients respect both, and confident clients,
    each trained on one class only (3, then 7), come within 3% of both bounds: they are tight."""
    pool = make_federated("digits", 3, partition="iid", seed=0).train_parts[0]
    parts = [digits.train_parts[0], digits.train_parts[1]] + \
        [pool.subset(np.flatnonzero(pool.y == c)) for c in (3, 7)]
    sens = {}
    uploads = []
    for part in parts:
        uploads.append({})
        for adjacency in ("add_remove", "replace_one"):
            privacy = PrivacyConfig(epsilon=2.0, unit="client", adjacency=adjacency, accountant="exact")
            alg = ready(digits, privacy, warmup_epochs=10, bbb_lr=3e-2)
            sens[adjacency] = alg.channels()[0].sensitivity
            uploads[-1][adjacency] = alg.channels()[0].clip.apply(
                alg.client_update(0, part, 0, np.random.default_rng(0)).values[CHANNEL])
    assert sens == pytest.approx({"add_remove": math.sqrt(40), "replace_one": math.sqrt(80)})
    removed = [np.linalg.norm(u["add_remove"]) for u in uploads]
    replaced = [np.linalg.norm(u["replace_one"] - v["replace_one"]) for u in uploads for v in uploads]
    assert max(removed) <= sens["add_remove"] * (1 + 1e-9)
    assert max(replaced) <= sens["replace_one"] * (1 + 1e-9)
    assert removed[2] >= 0.97 * sens["add_remove"]  # the one-class client: nearly one-hot rows
    assert np.linalg.norm(uploads[2]["replace_one"] - uploads[3]["replace_one"]) >= 0.97 * sens["replace_one"]


def test_pipeline_refuses_a_non_probability_upload_before_charging(digits):
    alg = ready(digits, PrivacyConfig(epsilon=2.0, accountant="exact"))
    ledger = PrivacyLedger(":memory:", "t", delta=1e-5, epsilon_budget=2.0, accountant="exact")
    pipe = ReleasePipeline("0", alg.channels(), ledger, {CHANNEL: 3.0}, placement="local")
    with pytest.raises(InvalidRelease, match="probability"):
        pipe.release(0, {CHANNEL: np.full((40, 10), 0.2)})
    assert ledger.charges() == []


def test_server_takes_the_weighted_average_and_post_processes():
    noisy = np.array([[0.5, 0.7, -0.2], [-1.0, -0.5, -0.1], [0.2, 0.2, 0.6], [3.0, 0.5, 0.0]])
    out = clip_and_renormalise(noisy)
    np.testing.assert_allclose(out, [[0.5 / 1.2, 0.7 / 1.2, 0], [1 / 3] * 3, [0.2, 0.2, 0.6], [1 / 1.5, 0.5 / 1.5, 0]])
    data = make_federated("digits", 3, partition="iid", seed=0, alignment_size=5)
    alg = ready(data, alignment_size=5)
    uploads = [np.random.default_rng(k).dirichlet(np.ones(10), size=5) for k in range(3)]
    weights = [1.0, 2.0, 5.0]
    ledger = PrivacyLedger(":memory:", "t", delta=1e-5, epsilon_budget=math.inf)
    releases = []
    for k, (u, w) in enumerate(zip(uploads, weights)):
        releases += ReleasePipeline(str(k), alg.channels(), ledger, None).release(0, {CHANNEL: u}, w).values()
    alg.server_update(weighted_sums(releases, {c.name: c for c in alg.channels()}), 0)
    np.testing.assert_allclose(alg.global_probs, sum(w * u for w, u in zip(weights, uploads)) / 8.0)


def test_release_reliability_is_the_signal_share_of_the_spread():
    rng = np.random.default_rng(0)
    clean = rng.dirichlet(np.full(10, 0.3), size=2000)  # peaked probability rows
    assert release_reliability(clean, 0.0) == 1.0  # no noise: gamma unchanged, the paper's algorithm
    signal = float(np.mean((clean - 0.1) ** 2))
    for s in (0.05, 0.1, 0.2):
        noisy = clean + rng.normal(0.0, s, clean.shape)
        expected = signal / (signal + s * s)
        assert release_reliability(noisy, s) == pytest.approx(expected, abs=0.03)
    swamped = clean + rng.normal(0.0, 31.0, clean.shape)  # the noise of FedBNN at epsilon 3 with |AD| = 500
    assert release_reliability(swamped, 31.0) < 0.05  # sampling error of the spread only


@pytest.mark.timeout(120)
def test_noise_aware_gamma_follows_the_release_and_is_gamma_without_noise(digits):
    fed = FederationConfig(rounds=2, local_epochs=1, batch_size=32, hidden=(16,), seed=0)
    plain = FedBNN(fed, NONPRIVATE, **SMALL)
    Simulation(plain, digits, fed, NONPRIVATE).run()
    assert plain.reliability == 1.0 and plain.effective_gamma == plain.gamma
    # seeded noise (reproducible): the reliability's sampling error over 400 coordinates is a few percent
    privacy = PrivacyConfig(epsilon=1.0, delta=1e-5, unit="example", accountant="exact", placement="local",
                            secure_noise=False)
    for aware in (True, False):
        alg = FedBNN(fed, privacy, noise_aware=aware, **SMALL)
        Simulation(alg, digits, fed, privacy).run()
        assert 0.0 <= alg.reliability < 0.05  # 3 clients at epsilon 1: the noise swamps the probabilities
        assert alg.effective_gamma == pytest.approx(alg.gamma * alg.reliability if aware else alg.gamma)


def test_label_shift_reweights_by_the_clients_own_class_frequencies():
    probs = np.full((2, 4), 0.25)
    out = label_shifted(probs, np.array([0, 0, 0, 1]), 4)  # counts + 1: 4, 2, 1, 1
    np.testing.assert_allclose(out, [[0.5, 0.25, 0.125, 0.125]] * 2)
    peaked = np.array([[0.1, 0.2, 0.3, 0.4]])
    np.testing.assert_allclose(label_shifted(peaked, np.arange(4), 4), peaked)  # balanced labels: unchanged


def test_prior_tuning_pulls_the_prior_function_towards_the_corrected_target(digits):
    """Eqs. 3-4: started from the posterior, the prior's Monte-Carlo output on AD moves towards the target; the
    posterior itself is left alone, and the KL of eq. 5 is taken to exactly the tuned prior."""
    alg = ready(digits, prior_steps=40, prior_lr=1e-2)
    model = alg.local_model(0)
    posterior = [p.detach().clone() for p in model.parameters()]
    target = np.eye(10)[np.full(40, 7)]  # every alignment point a 7
    gen = torch.Generator().manual_seed(0)
    before = mc_predict(model, alg.alignment_x, 4, gen)
    net, loss = alg.prior_network(model, target, gen)
    after = mc_predict(net, alg.alignment_x, 4, gen)
    assert after[:, 7].mean() > before[:, 7].mean() + 0.2
    t = torch.as_tensor(target, dtype=torch.float32)
    assert loss < float(soft_cross_entropy(torch.log(torch.as_tensor(before, dtype=torch.float32)), t))
    assert all(torch.equal(a, b) for a, b in zip(posterior, model.parameters()))
    prior = ModelPrior.from_model(net)
    with torch.no_grad():
        assert float(model_kl_divergence(net, prior)) == pytest.approx(0.0, abs=1e-3)
        assert float(model_kl_divergence(model, prior)) > 1.0


@pytest.mark.timeout(120)
def test_runs_with_heterogeneous_architectures(digits):
    fed = FederationConfig(rounds=2, local_epochs=2, batch_size=32, hidden=(16,), seed=0)
    archs = [Architecture("mlp", (24,)), Architecture("mlp", (4,)), Architecture("cnn1", (8,))]
    alg = FedBNN(fed, NONPRIVATE, **{**SMALL, "small_fraction": None, "warmup_epochs": 20}, architectures=archs)
    sim = Simulation(alg, digits, fed, NONPRIVATE)
    result = sim.run()
    assert sim.split and not alg.models  # the personalised models stay with their clients
    sizes = [num_parameters(sim.diagnostic_algorithm().models[k]) for k in range(3)]
    assert len(set(sizes)) == 3
    final = result.final
    assert {"accuracy", "nll", "ece", "mce", "brier", "accuracy_all_classes"} <= set(final)
    assert all(np.isfinite(v) for v in final.values())
    assert final["accuracy"] > 0.6  # each client on its own 5 classes, well above chance (0.2)
    # the paper's setting: a random share of the clients runs the small net
    alg = FedBNN(fed, NONPRIVATE, **{**SMALL, "small_fraction": 0.3})
    alg.setup(digits, np.random.default_rng(0))
    assert len(alg.small_clients) == 1
    assert [a == alg.small_architecture for a in alg.client_architectures].count(True) == 1


def test_evaluation_is_per_client_on_its_own_classes(digits):
    alg = ready(digits)
    for k in range(3):
        alg.client_update(k, digits.train_parts[k], 0, np.random.default_rng(k))
    assert set(alg.evaluate(digits.test)) == {"effective_gamma"}  # the server half holds no personal model
    out = alg.local_metrics(digits.test)
    y = digits.test.y
    preds = alg.client_predictions(digits.test)
    own = [np.mean(p[np.isin(y, alg.client_classes[k])].argmax(1) == y[np.isin(y, alg.client_classes[k])])
           for k, p in preds.items()]
    assert out["accuracy"] == pytest.approx(np.mean(own))
    assert out["accuracy_all_classes"] == pytest.approx(np.mean([np.mean(p.argmax(1) == y) for p in preds.values()]))
    assert alg.predict_proba(digits.test) is None  # no global model
    # calibration (and privfl compare's reliability diagram) is over the pooled own-class predictions
    proba, labels = alg.calibration_predictions(digits.test)
    masks = [np.isin(y, alg.client_classes[k]) for k in preds]
    np.testing.assert_array_equal(labels, np.concatenate([y[m] for m in masks]))
    np.testing.assert_allclose(proba, np.concatenate([p[m] for p, m in zip(preds.values(), masks)]))
    assert out["ece"] == pytest.approx(classification_metrics(proba, labels)["ece"])
    assert out["brier"] == pytest.approx(brier_score(proba, labels))


def test_without_an_alignment_set_it_is_carved_from_the_test_set_and_left_out_of_evaluation():
    d = make_federated("digits", 3, partition="iid", seed=0)
    assert d.alignment is None
    alg = FedBNN(FED, NONPRIVATE, **{**SMALL, "alignment_size": 2000})
    alg.setup(d, np.random.default_rng(0))
    assert alg.alignment_rows == len(d.test) // 2
    rest = alg._eval_set(d.test)
    assert len(rest) == len(d.test) - alg.alignment_rows
    ad = {row.tobytes() for row in alg.alignment_x.numpy()}
    assert not any(row.tobytes() in ad for row in rest.x)
    assert not any(row.tobytes() in ad for p in d.train_parts for row in p.x)


@pytest.mark.timeout(120)
def test_secure_aggregation_gives_the_plain_average_and_runs_privately(digits):
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=32, hidden=(16,), seed=0)
    globals_ = []
    for secure in (None, SecureAggregation(bits=48)):
        alg = FedBNN(fed, NONPRIVATE, **SMALL)
        Simulation(alg, digits, fed, NONPRIVATE, secure=secure).run()
        globals_.append(alg.global_probs)
    np.testing.assert_allclose(globals_[0], globals_[1], atol=1e-9)
    privacy = PrivacyConfig(epsilon=2.0, delta=1e-5, accountant="exact", placement="local")
    fed2 = FederationConfig(rounds=2, local_epochs=1, batch_size=32, hidden=(16,), seed=0)
    alg = FedBNN(fed2, privacy, **SMALL)
    result = Simulation(alg, digits, fed2, privacy, secure=SecureAggregation(bits=48)).run()
    assert result.audit["max_epsilon"] <= 2.0
    assert np.all(alg.global_probs >= 0) and np.allclose(alg.global_probs.sum(axis=1), 1.0)
    assert np.isfinite(result.final["accuracy"])


@pytest.mark.timeout(120)
def test_private_run_is_charged_one_gaussian_per_round_and_audits_at_the_target(digits):
    fed = FederationConfig(rounds=3, local_epochs=1, batch_size=32, hidden=(16,), seed=0)
    privacy = PrivacyConfig(epsilon=2.0, delta=1e-5, unit="example", accountant="exact", placement="local")
    alg = FedBNN(fed, privacy, **SMALL)
    sim = Simulation(alg, digits, fed, privacy)
    result = sim.run()
    z = result.noise_multipliers[CHANNEL]
    sens = math.sqrt(2 * 40)
    charges = sim.ledger.charges("0")
    assert [c.event for c in charges] == [GaussianEvent(sens, z * sens)] * 3
    assert 0.999 * 2.0 <= result.audit["max_epsilon"] <= 2.0
    assert len(result.audit["clients"]) == 3


@pytest.mark.parametrize("kw, privacy, needle", [
    (dict(weighting="size"), PrivacyConfig(epsilon=1.0), "uniform"),
    ({}, PrivacyConfig(epsilon=1.0, placement="distributed", accountant="zcdp"), "placement='local'"),
    (dict(gamma=1.5), NONPRIVATE, "gamma"),
    (dict(architectures=["mlp", "cnn1"], small_fraction=0.3), NONPRIVATE, "not both"),
    (dict(architectures=["transformer"]), NONPRIVATE, "architecture"),
    (dict(prior_steps=-1), NONPRIVATE, "prior_steps"),
    (dict(noise_aware="yes"), NONPRIVATE, "noise_aware"),
    (dict(label_shift=1), NONPRIVATE, "label_shift"),
])
def test_invalid_configurations_are_refused(kw, privacy, needle):
    with pytest.raises(ConfigurationError, match=needle):
        FedBNN(FED, privacy, **kw)


@pytest.mark.timeout(120)
def test_cli_runs_fedbnn_non_private(cli_run):
    result = cli_run("fedbnn", "--epsilon", "inf")
    assert result["algorithm"] == "fedbnn" and len(result["accuracy_per_round"]) == 2
    assert 0.5 < result["accuracy"] <= 1.0 and "mce" in result["final"]


def test_mce_and_brier_closed_forms():
    proba = np.array([[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.3, 0.7]])
    y = np.array([0, 1, 0, 1])
    # bins (15 equal): conf 0.9 -> acc 0.5 (gap 0.4); conf 0.6 -> acc 1 (gap 0.4); conf 0.7 -> acc 1 (gap 0.3)
    assert maximum_calibration_error(proba, y) == pytest.approx(0.4)
    assert classification_metrics(proba, y)["ece"] <= maximum_calibration_error(proba, y)
    expected = np.mean([0.1 ** 2 * 2, 0.9 ** 2 * 2, 0.4 ** 2 * 2, 0.3 ** 2 * 2])
    assert brier_score(proba, y) == pytest.approx(expected)
    assert brier_score(np.eye(3), np.arange(3)) == 0.0 and maximum_calibration_error(np.eye(3), np.arange(3)) == 0.0
    with pytest.raises(ValueError, match="labels"):
        brier_score(proba, np.array([0, 1, 2, 1]))


@pytest.mark.timeout(120)
def test_cli_alignment_size_holds_out_training_examples(tmp_path, monkeypatch):
    import privfl.data

    built = []

    def recording(*args, **kw):
        built.append(make_federated(*args, **kw))
        return built[-1]

    monkeypatch.setattr(privfl.data, "make_federated", recording)
    out = tmp_path / "r.json"
    code = main(["run", "--algorithm", "fedbnn", "--dataset", "digits", "--clients", "3", "--rounds", "1",
                 "--epsilon", "3", "--hidden", "16", "--alignment-size", "60", "--json", str(out), "--quiet"])
    assert code == 0
    assert json.loads(out.read_text())["epsilon_spent_max"] <= 3.0 + 1e-9
    (data,) = built
    plain = make_federated("digits", 3, seed=0)
    assert len(data.alignment) == 60 and len(data.test) == len(plain.test)  # held out of training, not of test
    assert sum(len(p) for p in data.train_parts) + 60 == sum(len(p) for p in plain.train_parts)


def test_cli_refuses_alignment_size_for_algorithms_without_one(capsys):
    code = main(["run", "--algorithm", "fedavg", "--dataset", "digits", "--clients", "2", "--rounds", "1",
                 "--epsilon", "inf", "--alignment-size", "50", "--quiet"])
    assert code == 2
    assert "--alignment-size" in capsys.readouterr().err


def test_fedbnn_never_takes_the_clients_held_out_records_as_its_alignment_set():
    """Without an alignment set FedBNN carves one from the test set; when that test set is the clients' own held-out
    records (``test_from_clients``: privfl run --data or federate without a test file) every client's upload would be
    its predictions on other clients' records, uncharged. Refused in FedBNN's own setup, whatever the entry point."""
    from privfl.core.config import FederationConfig, PrivacyConfig
    from privfl.data import federated_from_arrays
    from privfl.errors import ConfigurationError

    rng = np.random.default_rng(0)
    parts = [(rng.normal(size=(20, 4)).astype(np.float32), rng.integers(0, 3, 20)) for _ in range(3)]
    test = (rng.normal(size=(30, 4)).astype(np.float32), rng.integers(0, 3, 30))
    fed = FederationConfig(rounds=1, seed=0)
    privacy = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="client")
    for held_out in (True, False):
        data = federated_from_arrays(parts, test, task="classification", num_classes=3, name="toy", design_size=20,
                                     test_from_clients=held_out)
        alg = FedBNN(fed, privacy, alignment_size=10)
        if held_out:
            with pytest.raises(ConfigurationError, match="held by no client"):
                alg.setup(data, np.random.default_rng(0))
        else:
            alg.setup(data, np.random.default_rng(0))
            assert len(alg.alignment_x) == 10
