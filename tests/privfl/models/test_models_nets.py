"""The papers' networks: output shapes on MNIST, CIFAR and 8x8 digits inputs, architecture facts, and errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from privfl.models import (CNN1, CNN2, MLP, MODELS, BayesConv2d, BayesianMLP, BayesLinear, LeNet5, ModelConfigError,
                           make_bayesian_model, make_model, num_parameters)

SHAPES = [(1, 28, 28), (1, 8, 8), (3, 32, 32)]


@pytest.mark.parametrize("bayesian", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_output_shapes(name, shape, bayesian):
    torch.manual_seed(0)
    model = make_model(name, shape, 10, bayesian=bayesian)
    out = model(torch.rand(3, *shape))
    assert out.shape == (3, 10) and torch.all(torch.isfinite(out))
    assert model.is_bayesian == bayesian
    assert model.input_shape == shape and model.num_classes == 10


def test_flat_inputs_and_regression_head():
    assert make_model("mlp", (64,), 10)(torch.rand(2, 64)).shape == (2, 10)
    assert make_model("mlp", 13, 1, hidden=(8,))(torch.rand(5, 13)).shape == (5, 1)
    logistic = make_model("mlp", (1, 8, 8), 10, hidden=())  # no hidden layer: multinomial logistic regression
    assert num_parameters(logistic) == 64 * 10 + 10 and logistic(torch.rand(2, 1, 8, 8)).shape == (2, 10)


def test_fola_mlp_is_784_500_300_10():
    m = make_model("mlp", (1, 28, 28), 10)
    linears = [l for l in m.modules() if isinstance(l, nn.Linear)]
    assert [(l.in_features, l.out_features) for l in linears] == [(784, 500), (500, 300), (300, 10)]
    assert num_parameters(m) == 784 * 500 + 500 + 500 * 300 + 300 + 300 * 10 + 10


def test_conv_architectures_follow_hbfl():
    lenet = LeNet5((3, 32, 32), 10)
    convs = [c for c in lenet.modules() if isinstance(c, nn.Conv2d)]
    fcs = [l for l in lenet.modules() if isinstance(l, nn.Linear)]
    assert [(c.out_channels, c.kernel_size) for c in convs] == [(6, (5, 5)), (16, (5, 5))]
    assert [l.out_features for l in fcs] == [120, 84, 10] and fcs[0].in_features == 16 * 5 * 5
    cnn1 = CNN1((3, 32, 32), 100)
    assert [l.out_features for l in cnn1.modules() if isinstance(l, nn.Linear)] == [120, 100]
    cnn2 = CNN2((3, 32, 32), 10)
    assert [c.out_channels for c in cnn2.modules() if isinstance(c, nn.Conv2d)] == [32, 64, 64]
    assert cnn2.flat_features == 64 * 4 * 4
    assert [l.out_features for l in cnn2.modules() if isinstance(l, nn.Linear)] == [64, 10]


def test_padding_auto_keeps_paper_nets_and_pads_small_inputs():
    assert LeNet5((1, 28, 28), 10).padding == 0
    assert CNN2((1, 8, 8), 10).padding == "same"
    with pytest.raises(ModelConfigError, match="8x8"):
        CNN2((1, 8, 8), 10, padding=0)
    with pytest.raises(ModelConfigError, match="cannot run on 2x2"):
        LeNet5((1, 2, 2), 10)


def test_bayesian_twins_use_bayes_layers():
    m = make_bayesian_model("cnn1", (1, 28, 28), 10, init_rho=-4.0, reparameterization="weight")
    kinds = {type(l) for l in m.modules()}
    assert BayesConv2d in kinds and BayesLinear in kinds and nn.Linear not in kinds and nn.Conv2d not in kinds
    assert all(l.init_rho == -4.0 for l in m.modules() if isinstance(l, (BayesLinear, BayesConv2d)))
    assert isinstance(make_bayesian_model("mlp", (64,), 10), BayesianMLP)
    assert isinstance(BayesianMLP(64, (16,), 10), MLP)


@pytest.mark.parametrize("call, match", [
    (lambda: make_model("resnet", (1, 28, 28), 10), "unknown model"),
    (lambda: make_model("lenet5", (784,), 10), r"\(C, H, W\)"),
    (lambda: make_model("mlp", (1, 8, 8), 0), "num_classes"),
    (lambda: make_model("mlp", (1, 8, 8), 10, hidden=(0,)), "hidden"),
    (lambda: make_model("mlp", (1, 8, 8), 10, init_rho=-3.0), "Bayesian models only"),
    (lambda: make_bayesian_model("mlp", (64,), 10, prior_sigma=1.0), "unknown Bayesian"),
    (lambda: make_model("cnn2", (1, 8, 8), 10, padding="full"), "padding"),
    (lambda: make_model("mlp", (64,), 10, padding=1), "padding"),
    (lambda: make_bayesian_model("mlp", (64,), 10, reparameterization="flipout"), "reparameterization"),
])
def test_clear_errors(call, match):
    with pytest.raises(ModelConfigError, match=match):
        call()
