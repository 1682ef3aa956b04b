"""Bayes-by-Backprop layers: parameterisation, closed-form KL, deterministic mode, sampling statistics, gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Normal, kl_divergence

from privfl.models import (BayesConv2d, BayesLinear, GaussianPrior, ModelConfigError, ModelPrior, deterministic,
                           get_mean_precision, inverse_softplus, make_bayesian_model, model_kl_divergence, reset_std,
                           set_generator, set_sampling)


def _randomise(layer, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mu, rho in layer.gaussian_parameters().values():
            mu.copy_(torch.randn(mu.shape, generator=g))
            rho.copy_(torch.randn(rho.shape, generator=g) - 1.0)
    return layer


def test_std_is_softplus_of_rho():
    layer = _randomise(BayesLinear(5, 3))
    expect = torch.log1p(torch.exp(layer.weight_rho))
    assert torch.allclose(layer.std("weight"), expect, atol=1e-6)
    assert torch.allclose(layer.std("bias"), torch.log1p(torch.exp(layer.bias_rho)), atol=1e-6)


def test_inverse_softplus_round_trip_over_many_scales():
    std = torch.tensor([1e-8, 1e-3, 0.5, 1.0, 30.0, 1e4], dtype=torch.float64)
    assert torch.allclose(F.softplus(inverse_softplus(std)), std, rtol=1e-12)
    with pytest.raises(ModelConfigError):
        inverse_softplus(0.0)


def test_default_init_rho():
    layer = BayesLinear(4, 2)
    assert torch.all(layer.weight_rho == -5.0)
    assert layer.std().max().item() == pytest.approx(math.log1p(math.exp(-5.0)), rel=1e-6)


def _closed_form(mu, std, m0, p0):
    mu, std = np.asarray(mu, np.float64), np.asarray(std, np.float64)
    var0 = 1.0 / np.asarray(p0, np.float64)
    return float(np.sum(np.log(np.sqrt(var0) / std) + (std ** 2 + (mu - m0) ** 2) / (2 * var0) - 0.5))


@pytest.mark.parametrize("layer", [BayesLinear(6, 4), BayesConv2d(2, 3, 3)], ids=["linear", "conv"])
def test_kl_against_closed_form_with_scalar_prior(layer):
    _randomise(layer, 1)
    prior = GaussianPrior(mean=0.3, precision=2.5)
    got = layer.kl_divergence(prior).item()
    expect = sum(_closed_form(mu.detach(), F.softplus(rho).detach(), 0.3, 2.5)
                 for mu, rho in layer.gaussian_parameters().values())
    assert got == pytest.approx(expect, rel=1e-5)
    assert GaussianPrior.from_std(2.0).precision == pytest.approx(0.25)


def test_kl_against_torch_with_per_parameter_prior():
    layer = _randomise(BayesLinear(5, 4), 2)
    g = torch.Generator().manual_seed(3)
    prior = {name: GaussianPrior(torch.randn(mu.shape, generator=g), torch.rand(mu.shape, generator=g) + 0.1)
             for name, (mu, _) in layer.gaussian_parameters().items()}
    got = layer.kl_divergence(prior)
    expect = sum(kl_divergence(Normal(mu, F.softplus(rho)),
                               Normal(prior[n].mean, prior[n].precision ** -0.5)).sum()
                 for n, (mu, rho) in layer.gaussian_parameters().items())
    assert torch.allclose(got, expect, rtol=1e-5)


def test_kl_is_zero_against_itself_and_positive_otherwise():
    model = make_bayesian_model("mlp", (10,), 3, hidden=(7,))
    assert model_kl_divergence(model, ModelPrior.from_model(model)).item() == pytest.approx(0.0, abs=1e-3)
    assert model_kl_divergence(model, GaussianPrior()).item() > 0
    assert model_kl_divergence(model, ModelPrior.isotropic(1.0)).item() == pytest.approx(
        model_kl_divergence(model, GaussianPrior()).item())


def test_model_prior_from_vectors_matches_layer_priors():
    model = make_bayesian_model("mlp", (6,), 2, hidden=(4,))
    rng = np.random.default_rng(0)
    mean, _ = get_mean_precision(model)
    m0, p0 = rng.normal(size=mean.shape), rng.uniform(0.5, 3.0, size=mean.shape)
    prior = ModelPrior.from_vectors(model, m0, p0)
    mu, std = [], []
    for layer in (model.net[1], model.net[3]):
        for name in ("weight", "bias"):
            mu.append(getattr(layer, f"{name}_mu").detach().reshape(-1))
            std.append(layer.std(name).detach().reshape(-1))
    expect = _closed_form(torch.cat(mu), torch.cat(std), m0, p0)
    assert model_kl_divergence(model, prior).item() == pytest.approx(expect, rel=1e-5)


def test_invalid_priors_are_rejected():
    with pytest.raises(ModelConfigError):
        GaussianPrior(0.0, 0.0)
    with pytest.raises(ModelConfigError):
        GaussianPrior(0.0, torch.tensor([1.0, -1.0]))
    with pytest.raises(ModelConfigError):
        GaussianPrior(float("nan"), 1.0)
    model = make_bayesian_model("mlp", (6,), 2, hidden=(4,))
    with pytest.raises(ModelConfigError, match="positive"):
        ModelPrior.from_vectors(model, np.zeros(38), np.zeros(38))
    with pytest.raises(ModelConfigError, match="length 38"):
        ModelPrior.from_vectors(model, np.zeros(5), np.ones(5))
    with pytest.raises(ModelConfigError, match="no Bayesian layers"):
        model_kl_divergence(torch.nn.Linear(2, 2), GaussianPrior())


@pytest.mark.parametrize("reparameterization", ["local", "weight"])
def test_deterministic_mode_equals_plain_layers_with_means(reparameterization):
    lin = _randomise(BayesLinear(5, 3, reparameterization=reparameterization))
    conv = _randomise(BayesConv2d(2, 4, 3, padding=1, reparameterization=reparameterization))
    x, img = torch.randn(7, 5), torch.randn(2, 2, 6, 6)
    with deterministic(lin), deterministic(conv):
        assert torch.equal(lin(x), F.linear(x, lin.weight_mu, lin.bias_mu))
        assert torch.equal(conv(img), F.conv2d(img, conv.weight_mu, conv.bias_mu, padding=1))
    assert lin.sampling and conv.sampling  # restored after the block
    assert not torch.equal(lin(x), F.linear(x, lin.weight_mu, lin.bias_mu))


def test_model_deterministic_method_and_eval_mode_still_samples():
    model = make_bayesian_model("cnn2", (1, 8, 8), 10)
    x = torch.rand(2, 1, 8, 8)
    model.eval()
    assert not torch.equal(model(x), model(x))  # Monte-Carlo prediction works in eval mode
    with model.deterministic():
        assert torch.equal(model(x), model(x))
    set_sampling(model, False)
    assert torch.equal(model(x), model(x))


@pytest.mark.parametrize("reparameterization", ["local", "weight"])
def test_output_moments_match_the_gaussian_weights(reparameterization):
    torch.manual_seed(0)
    lin = _randomise(BayesLinear(4, 2, reparameterization=reparameterization), 4)
    x = torch.randn(1, 4)
    if reparameterization == "local":
        out = lin(x.expand(20000, 4)).detach()  # independent per row
    else:
        out = torch.cat([lin(x).detach() for _ in range(4000)])
    mean = F.linear(x, lin.weight_mu, lin.bias_mu)[0].detach()
    var = (F.linear(x ** 2, lin.std("weight") ** 2, lin.std("bias") ** 2))[0].detach()
    n = out.shape[0]
    assert torch.all((out.mean(0) - mean).abs() < 5 * torch.sqrt(var / n))
    assert torch.allclose(out.var(0), var, rtol=0.1)


def test_conv_local_reparameterisation_variance():
    torch.manual_seed(1)
    conv = _randomise(BayesConv2d(1, 2, 3), 5)
    img = torch.randn(1, 1, 5, 5)
    out = conv(img.expand(8000, 1, 5, 5)).detach()
    var = F.conv2d(img ** 2, conv.std("weight") ** 2, conv.std("bias") ** 2)[0].detach()
    assert torch.allclose(out.var(0), var, rtol=0.1)


@pytest.mark.parametrize("reparameterization", ["local", "weight"])
@pytest.mark.parametrize("cls, shape", [(lambda r: BayesLinear(4, 3, reparameterization=r), (5, 4)),
                                        (lambda r: BayesConv2d(2, 3, 3, reparameterization=r), (2, 2, 5, 5))])
def test_gradients_reach_mu_and_rho(cls, shape, reparameterization):
    layer = cls(reparameterization)
    loss = layer(torch.randn(*shape)).pow(2).sum() + layer.kl_divergence(GaussianPrior())
    loss.backward()
    for mu, rho in layer.gaussian_parameters().values():
        assert mu.grad is not None and rho.grad is not None
        assert torch.all(torch.isfinite(mu.grad)) and torch.all(torch.isfinite(rho.grad))
        assert mu.grad.abs().sum() > 0 and rho.grad.abs().sum() > 0


def test_zero_inputs_without_bias_give_finite_gradients():
    layer = BayesConv2d(1, 2, 3, bias=False)
    layer(torch.zeros(2, 1, 5, 5)).sum().backward()
    assert torch.all(torch.isfinite(layer.weight_mu.grad)) and torch.all(torch.isfinite(layer.weight_rho.grad))


def test_generator_makes_sampling_reproducible():
    model = make_bayesian_model("mlp", (8,), 3, hidden=(5,))
    x = torch.rand(4, 8)
    set_generator(model, torch.Generator().manual_seed(11))
    a = model(x)
    set_generator(model, torch.Generator().manual_seed(11))
    assert torch.equal(a, model(x))


def test_reset_std_and_no_bias_layers():
    model = make_bayesian_model("mlp", (8,), 3, hidden=(5,))
    reset_std(model, 0.1)
    _, precision = get_mean_precision(model)
    assert np.allclose(precision, 100.0, rtol=1e-5)
    layer = BayesLinear(3, 2, bias=False)
    assert set(layer.gaussian_parameters()) == {"weight"} and layer(torch.ones(1, 3)).shape == (1, 2)


def test_bayesian_twin_of_a_users_module_keeps_its_forward_at_the_means():
    from privfl.models import bayesian_twin, deterministic, get_mean_precision, softplus

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 3, 3, stride=2, padding=1, dilation=1), nn.ReLU(), nn.Flatten(),
                        nn.Linear(3 * 4 * 4, 5), nn.Tanh(), nn.Linear(5, 2, bias=False))
    before = [p.detach().clone() for p in net.parameters()]
    twin = bayesian_twin(net, init_rho=-4.0)
    assert [type(m).__name__ for m in twin] == ["BayesConv2d", "ReLU", "Flatten", "BayesLinear", "Tanh",
                                                 "BayesLinear"]
    x = torch.randn(7, 1, 8, 8)
    with torch.no_grad(), deterministic(twin):
        torch.testing.assert_close(twin(x), net(x), rtol=0, atol=0)
    mean, precision = get_mean_precision(twin)  # the plain module's parameter order
    np.testing.assert_array_equal(mean, np.concatenate([p.detach().double().numpy().ravel() for p in net.parameters()]))
    np.testing.assert_allclose(precision, float(softplus(torch.tensor(-4.0, dtype=torch.float64))) ** -2)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), before))  # the user's module is not touched
    assert type(bayesian_twin(nn.Linear(3, 2))).__name__ == "BayesLinear"


@pytest.mark.parametrize("net, match", [
    (nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)), r"\['1.weight', '1.bias'\] would stay point estimates"),
    (nn.Sequential(nn.Conv2d(2, 2, 3, groups=2)), "groups=1 and zero padding; '0' has groups=2"),
    (nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect")), "padding_mode='reflect'"),
])
def test_bayesian_twin_refuses_what_it_would_leave_out(net, match):
    from privfl.models import ModelConfigError, bayesian_twin

    with pytest.raises(ModelConfigError, match=match):
        bayesian_twin(net)
