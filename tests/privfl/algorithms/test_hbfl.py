"""HBFL (Yang, Yan and Ren 2023): the Gaussian product, temperature invariance, distillation, DP-SGD of the meme
model, and end-to-end runs (non-private through the CLI, client-level and example-level DP audited)."""

import json
import math

import numpy as np
import pytest
import torch

from privfl.accounting import GaussianEvent, NoOpEvent, SelfComposedEvent
from privfl.accounting.ledger import PrivacyLedger
from privfl.core.aggregation import weighted_sums
from privfl.algorithms import ALGORITHMS, make_algorithm
from privfl.privacy.record_level import DPSGDSchedule
from privfl.algorithms.hbfl import HBFL, distillation_loss, dpsgd_gradients
from privfl.core.channels import NormClip, PrivatizedValue, TrainedPrivately, Unclipped
from privfl.apps.cli import main
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import make_federated
from privfl.errors import ConfigurationError
from privfl.models import CNN1, MLP, LeNet5, make_bayesian_model
from privfl.core.release import ReleasePipeline
from privfl.runtime.engine import Simulation

FED = FederationConfig(rounds=2, local_epochs=1, batch_size=32, lr=0.05, hidden=(16,), seed=0)
NONPRIVATE = PrivacyConfig()




@pytest.fixture(scope="module")
def digits():
    return make_federated("digits", 3, partition="iid", seed=0)


def _ready(data, privacy=NONPRIVATE, fed=FED, **kw) -> HBFL:
    alg = HBFL(fed, privacy, **kw)
    alg.setup(data, np.random.default_rng(0))
    return alg


def _aggregate(alg: HBFL, uploads, weights):
    """Non-private releases of ``uploads`` (channel values per client) through the pipeline, then weighted sums."""
    channels = alg.channels()
    ledger = PrivacyLedger(":memory:", "t", delta=1e-5, epsilon_budget=math.inf)
    releases = []
    for k, (values, w) in enumerate(zip(uploads, weights)):
        releases += ReleasePipeline(str(k), channels, ledger, None).release(0, values, w).values()
    return weighted_sums(releases, {c.name: c for c in channels})


def test_registered_by_name():
    assert ALGORITHMS["hbfl"] is HBFL
    assert isinstance(make_algorithm("hbfl", FED, NONPRIVATE), HBFL)


def test_channels_follow_the_privacy_unit(digits):
    plain = _ready(digits).channels()
    assert [c.name for c in plain] == ["natural_mean", "precision"]
    assert all(isinstance(c.clip, Unclipped) and c.shape == (plain[0].shape[0],) for c in plain)
    client = _ready(digits, PrivacyConfig(epsilon=2.0, unit="client", clip=0.5), precision_clip=0.2).channels()
    assert [c.clip for c in client] == [NormClip(0.5), NormClip(0.2)]
    assert [c.budget_share for c in client] == [0.7, 0.3] and all(c.unit == "client" for c in client)
    example = _ready(digits, PrivacyConfig(epsilon=2.0, unit="example", accountant="pld")).channels()
    assert all(isinstance(c.clip, TrainedPrivately) and c.unit == "example" for c in example)


@pytest.mark.parametrize("bad", [
    dict(privacy=PrivacyConfig(epsilon=2.0, unit="example", accountant="exact")),  # exact cannot compose sampling
    dict(privacy=PrivacyConfig(epsilon=2.0, unit="example", accountant="pld", sampling_rate=0.5)),
    # replace-one (sizes declared public) is supported under pld since the privacy-soundness issue; rdp cannot
    dict(privacy=PrivacyConfig(epsilon=2.0, unit="example", accountant="rdp", adjacency="replace_one")),
    dict(local_models=("resnet",)),
    dict(distill_weight=1.5),
    dict(temperature=0.0),
    dict(meme_optimizer="adamw"),
])
def test_bad_configuration_is_a_clear_error(bad):
    privacy = bad.pop("privacy", NONPRIVATE)
    with pytest.raises(ConfigurationError):
        HBFL(FED, privacy, **bad)


def test_equal_precisions_reduce_to_fedavg(digits):
    """Sec. 3.2: with equal local precisions the Gaussian product is FedAvg's weighted mean sum_k n_k mu_k / n."""
    alg = _ready(digits)
    rng = np.random.default_rng(1)
    means = [alg.global_mean + rng.normal(0, 0.1, alg.dim) for _ in range(3)]
    precision = np.full(alg.dim, 37.0 / alg.temperature)
    sizes = [len(p) for p in digits.train_parts]
    alg.server_update(_aggregate(alg, [alg.encode_posterior(m, precision) for m in means], sizes), 0)
    fedavg = sum(n * m for n, m in zip(sizes, means)) / sum(sizes)
    np.testing.assert_allclose(alg.global_mean, fedavg, rtol=1e-10, atol=1e-12)


def test_gaussian_product_weights_clients_by_precision(digits):
    """Lambda = sum q_k Lambda_k, mu = Lambda^-1 sum q_k Lambda_k mu_k with q_k = n_k / n (Algorithm 1, line 5)."""
    alg = _ready(digits)
    rng = np.random.default_rng(2)
    means = [rng.normal(0, 1, alg.dim) for _ in range(3)]
    precisions = [rng.uniform(0.5, 5.0, alg.dim) / alg.temperature for _ in range(3)]
    sizes = [len(p) for p in digits.train_parts]
    alg.server_update(_aggregate(alg, [alg.encode_posterior(m, p) for m, p in zip(means, precisions)], sizes), 0)
    q = np.array(sizes) / sum(sizes)
    lam = sum(qk * p for qk, p in zip(q, precisions))
    np.testing.assert_allclose(alg.global_mean, sum(qk * p * m for qk, p, m in zip(q, precisions, means)) / lam,
                               rtol=1e-9)
    np.testing.assert_allclose(alg.global_model_precision(), lam, rtol=1e-9)


def test_aggregated_mean_does_not_depend_on_the_temperature(digits):
    """Eq. 4.1's optimum has Lambda_k = H_k / T for every client, so T cancels in the mean (PAPERS.md, HBFL checks):
    the same local likelihoods tempered at different T give the same global mean and precisions scaled by 1 / T."""
    rng = np.random.default_rng(3)
    probe = _ready(digits)
    means = [rng.normal(0, 1, probe.dim) for _ in range(3)]
    hessians = [rng.uniform(0.1, 10.0, probe.dim) for _ in range(3)]
    sizes = [len(p) for p in digits.train_parts]
    results = {}
    for t in (1e-4, 1e-2, 1.0):
        alg = _ready(digits, temperature=t)
        uploads = [alg.encode_posterior(m, h / t) for m, h in zip(means, hessians)]
        alg.server_update(_aggregate(alg, uploads, sizes), 0)
        results[t] = (alg.global_mean, alg.global_model_precision() * t)
    for t in (1e-2, 1.0):
        np.testing.assert_allclose(results[t][0], results[1e-4][0], rtol=1e-9)
        np.testing.assert_allclose(results[t][1], results[1e-4][1], rtol=1e-9)


def test_client_update_uploads_the_meme_posterior_as_changes(digits):
    alg = _ready(digits, temperature=1e-3)
    out = alg.client_update(0, digits.train_parts[0], 0, np.random.default_rng(4))
    assert out.weight == len(digits.train_parts[0])
    assert set(out.values) == {"natural_mean", "precision"}
    precision = out.values["precision"] + alg.global_precision  # untempered T * Lambda_k
    mean = (out.values["natural_mean"] + alg.global_natural_mean) / precision
    assert np.all(precision > 0)
    assert not np.allclose(mean, alg.global_mean)  # the meme trained
    assert np.max(np.abs(mean - alg.global_mean)) < 0.5  # ... from the global mean (Adam 1e-3, a few steps)
    np.testing.assert_allclose(np.median(precision), alg.init_precision, rtol=0.5)  # std reset each round


def test_local_models_are_heterogeneous_and_kept_by_their_clients(digits):
    alg = _ready(digits, local_models=("mlp", "lenet5"))
    rng = np.random.default_rng(5)
    for k in range(3):
        alg.client_update(k, digits.train_parts[k], 0, rng)
    assert [type(alg.client_models[k]) for k in range(3)] == [MLP, LeNet5, MLP]
    kept = alg.client_models[1]
    before = [p.detach().clone() for p in kept.parameters()]
    alg.client_update(1, digits.train_parts[1], 1, rng)
    assert alg.client_models[1] is kept
    assert any(not torch.equal(b, p) for b, p in zip(before, kept.parameters()))
    assert isinstance(_ready(digits, local_models="cnn1").local_model(0), CNN1)


def test_distillation_loss_is_eq_4_2():
    torch.manual_seed(0)
    student, teacher_logits = torch.randn(6, 4), torch.randn(6, 4)
    y = torch.randint(0, 4, (6,))
    teacher = torch.softmax(teacher_logits, dim=1)
    ce = torch.nn.functional.cross_entropy(student, y)
    kl = (teacher * (teacher.log() - torch.log_softmax(student, dim=1))).sum(dim=1).mean()
    torch.testing.assert_close(distillation_loss(student, teacher, y, weight=0.3), 0.3 * ce + 0.7 * kl)
    torch.testing.assert_close(distillation_loss(student, teacher, y, weight=1.0), ce)
    self_teacher = torch.softmax(student, dim=1)
    torch.testing.assert_close(distillation_loss(student, self_teacher, y, weight=0.0), torch.tensor(0.0))


def _flat_grad(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_dpsgd_clips_each_example_to_the_bound():
    """The sensitivity DP-SGD's event declares: one example moves the summed gradient by at most C."""
    torch.manual_seed(0)
    model = make_bayesian_model("mlp", (1, 8, 8), 10, hidden=(8,))
    x, y = 50.0 * torch.randn(5, 1, 8, 8), torch.randint(0, 10, (5,))
    for i in range(5):
        model.zero_grad(set_to_none=True)
        dpsgd_gradients(model, x[i:i + 1], y[i:i + 1], clip=0.3, noise_multiplier=0.0, expected_batch=1.0,
                        generator=torch.Generator(), secure=False)
        assert float(_flat_grad(model).norm()) == pytest.approx(0.3, rel=1e-5)  # large gradients are clipped
    model.zero_grad(set_to_none=True)
    dpsgd_gradients(model, x, y, clip=0.3, noise_multiplier=0.0, expected_batch=1.0, generator=torch.Generator(),
                    secure=False)
    assert float(_flat_grad(model).norm()) <= 5 * 0.3 * (1 + 1e-6)


def test_dpsgd_noise_has_the_declared_std():
    """An empty Poisson batch still takes a noisy step: N(0, (z C)^2) / expected batch per coordinate."""
    model = make_bayesian_model("mlp", (1, 8, 8), 10, hidden=(64,))
    dpsgd_gradients(model, torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long), clip=0.5,
                    noise_multiplier=2.0, expected_batch=4.0, generator=torch.Generator().manual_seed(0),
                    secure=False)
    g = _flat_grad(model).double().numpy()
    assert g.size > 9_000 and np.std(g) == pytest.approx(2.0 * 0.5 / 4.0, rel=0.03)


def test_evaluate_reports_global_and_local_under_their_own_names(digits):
    alg = _ready(digits)
    before = alg.evaluate(digits.test)
    assert set(before) == {"accuracy", "accuracy_global", "balanced_accuracy", "auroc", "nll", "ece",
                           "selective_accuracy", "majority_prediction_share"}
    assert alg.local_metrics(digits.test) == {}  # no client has a local model yet
    alg.client_update(0, digits.train_parts[0], 0, np.random.default_rng(6))
    after = alg.evaluate(digits.test)
    assert set(after) == set(before)  # the server half reports the global model only
    assert after["accuracy"] == after["accuracy_global"]  # the global model's, never the better of the two
    assert after["accuracy_global"] == before["accuracy_global"]  # the global model changes on the server only
    local = alg.local_metrics(digits.test)  # computed where the local models live
    assert set(local) == {"accuracy_local", "balanced_accuracy_local"}
    x, y = digits.test.tensors()
    expected = np.mean(alg.client_models[0](x).argmax(1).numpy() == y.numpy())
    assert local["accuracy_local"] == pytest.approx(expected)


def test_cli_nonprivate_run(cli_run):
    result = cli_run("hbfl", "--epsilon", "inf", "--local-epochs", "1")
    final = result["final"]
    assert {"accuracy_global", "accuracy_local", "balanced_accuracy", "auroc", "nll", "ece"} <= set(final)
    assert final["accuracy"] == final["accuracy_global"]
    assert len(result["accuracy_per_round"]) == 2 and result["epsilon_spent_max"] == "inf"


def test_cli_client_level_private_run_audits_within_target(tmp_path, capsys):
    ledger = tmp_path / "l.sqlite"
    code = main(["run", "--algorithm", "hbfl", "--dataset", "digits", "--clients", "3", "--rounds", "2",
                 "--epsilon", "2", "--delta", "1e-5", "--unit", "client", "--hidden", "16", "--local-epochs", "1",
                 "--ledger", str(ledger), "--run-id", "hb", "--quiet"])
    capsys.readouterr()
    assert code == 0
    assert main(["audit", str(ledger), "--run-id", "hb", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert 0 < report["max_epsilon"] <= 2.0
    assert all(v["releases"] == 4 for v in report["clients"].values())  # 2 rounds x 2 channels
    events = {c.channel: c.event for c in PrivacyLedger.open_existing(str(ledger), "hb").charges()}
    assert all(isinstance(e, GaussianEvent) for e in events.values())


def test_example_level_private_run_charges_the_dpsgd_training(digits):
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=64, lr=0.05, hidden=(8,), seed=0)
    privacy = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=1.0, accountant="pld")
    alg = HBFL(fed, privacy)
    sim = Simulation(alg, digits, fed, privacy)
    result = sim.run()
    assert 0 < result.audit["max_epsilon"] <= 3.0
    for charge in sim.ledger.charges():
        if charge.channel == "natural_mean":
            # the schedule comes from the client's public size (the design size), never from len(dataset)
            plan = DPSGDSchedule.for_client(alg.public.size_of(int(charge.client_id)), 64, 1)
            assert charge.event == plan.round_event(alg.dpsgd_noise_multiplier(plan))
            assert isinstance(charge.event, SelfComposedEvent) and charge.event.count == plan.steps
        else:
            assert charge.event == NoOpEvent()  # the same training; charging it twice would double count


def test_privatized_values_carry_the_training_event(digits):
    alg = _ready(digits, PrivacyConfig(epsilon=3.0, unit="example", accountant="pld"),
                 fed=FederationConfig(rounds=1, local_epochs=1, batch_size=64, hidden=(8,)))
    out = alg.client_update(2, digits.train_parts[2], 0, np.random.default_rng(7))
    assert all(isinstance(v, PrivatizedValue) for v in out.values.values())
    assert out.weight == 1.0  # uniform weights: n_k is not protected by the training's event
    assert isinstance(out.values["natural_mean"].event, SelfComposedEvent)
    assert all(v.value.shape == (alg.dim,) and np.all(np.isfinite(v.value)) for v in out.values.values())


def test_carry_precision_starts_the_meme_from_the_global_precision(digits):
    reset, carry = _ready(digits), _ready(digits, carry_precision=True)
    for alg in (reset, carry):
        alg.set_global(alg.global_mean, np.full(alg.dim, 8.0))
    outs = [alg.client_update(0, digits.train_parts[0], 0, np.random.default_rng(8)) for alg in (reset, carry)]
    started = [np.median(out.values["precision"] + 8.0) for out in outs]  # untempered T * Lambda_k
    assert started[0] == pytest.approx(reset.init_precision, rel=0.5) and started[1] == pytest.approx(8.0, rel=0.5)


def _first_step_change(digits, **kw):
    """The meme mean's change after one non-private step on one full batch (client 0, seeded)."""
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=10_000, lr=0.05, hidden=(16,), seed=0)
    alg = _ready(digits, fed=fed, **kw)
    out = alg.client_update(0, digits.train_parts[0], 0, np.random.default_rng(9))
    precision = out.values["precision"] + alg.global_precision
    return (out.values["natural_mean"] + alg.global_natural_mean) / precision - alg.global_mean


def test_meme_optimizer_sgd_steps_along_the_gradient_and_adam_by_its_sign(digits):
    """``meme_optimizer="sgd"``: the step is -lr * gradient, so it doubles with lr and its size follows the gradient's
    per coordinate; Adam's first step moves every coordinate with a gradient by about lr (m / sqrt(v) = sign)."""
    sgd = [_first_step_change(digits, meme_optimizer="sgd", meme_lr=lr) for lr in (1e-2, 2e-2)]
    # float32 weights of O(0.1): each mean is rounded to about 1e-8
    np.testing.assert_allclose(sgd[1], 2 * sgd[0], rtol=1e-3, atol=5e-8)
    moved = np.abs(sgd[0])[np.abs(sgd[0]) > 1e-6]
    assert moved.std() / moved.mean() > 0.5  # sizes spread with the gradient, not one size for all
    adam = np.abs(_first_step_change(digits, meme_lr=1e-3))
    adam = adam[adam > 1e-7]
    np.testing.assert_allclose(adam, 1e-3, rtol=0.02)


def test_meme_optimizer_is_an_option_of_the_cli(cli_run, capsys):
    result = cli_run("hbfl", "--epsilon", "inf", "--option", "meme_optimizer=sgd", "--option", "meme_lr=0.3")
    assert result["settings"]["algorithm_options"]["meme_optimizer"] == "sgd"
    code = main(["run", "--algorithm", "hbfl", "--dataset", "digits", "--clients", "3", "--rounds", "1",
                 "--hidden", "8", "--quiet", "--epsilon", "inf", "--option", "meme_optimizer=rmsprop"])
    err = capsys.readouterr().err
    assert code == 2 and "meme_optimizer" in err and "sgd" in err and "Traceback" not in err


def test_meme_optimizer_names_are_case_insensitive():
    assert HBFL(FED, NONPRIVATE, meme_optimizer="SGD").meme_optimizer == "sgd"


@pytest.mark.parametrize("secure", [True, False])
def test_the_memes_weight_noise_is_secret_in_a_private_run(digits, secure):
    """The meme's weight noise goes to the lot's records by position, so a draw an adversary could compute from the
    public run seed would let one record added or removed move every later record's term beyond the clip. With secure
    noise the generator a client's meme draws from is the OS CSPRNG's: the same seeds give other draws; a seeded run
    (secure_noise=False) draws the same, as before."""
    privacy = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=1.0, accountant="pld",
                            secure_noise=secure)
    draws = []
    for _ in range(2):
        alg = _ready(digits, privacy)
        _, g = alg._prepare(0, np.random.default_rng(7))
        draws.append(torch.randn(64, generator=g))
    assert (not torch.equal(draws[0], draws[1])) if secure else torch.equal(draws[0], draws[1])
