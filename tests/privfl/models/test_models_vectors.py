"""Flat parameter vectors and (mean, precision) vectors: exact round trips, stable order, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from privfl.models import (ModelConfigError, gaussian_layout, get_mean_precision, make_bayesian_model, make_model,
                           num_parameters, parameter_layout, parameters_to_vector, set_mean_precision,
                           vector_to_parameters)


@pytest.mark.parametrize("name, shape", [("mlp", (1, 8, 8)), ("lenet5", (1, 28, 28)), ("cnn2", (1, 8, 8))])
@pytest.mark.parametrize("bayesian", [False, True])
def test_vector_round_trip_is_exact(name, shape, bayesian):
    torch.manual_seed(0)
    model = make_model(name, shape, 10, bayesian=bayesian)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    vec = parameters_to_vector(model)
    assert vec.dtype == np.float64 and vec.shape == (num_parameters(model),)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    vector_to_parameters(vec, model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, original[k]), k
    assert np.array_equal(parameters_to_vector(model), vec)


def test_order_is_stable_across_instances():
    a, b = make_model("cnn1", (1, 28, 28), 10), make_model("cnn1", (1, 28, 28), 10)
    assert parameter_layout(a) == parameter_layout(b)
    vector_to_parameters(parameters_to_vector(a), b)
    assert np.array_equal(parameters_to_vector(a), parameters_to_vector(b))
    x = torch.rand(2, 1, 28, 28)
    assert torch.equal(a(x), b(x))
    names = [n for n, _ in parameter_layout(a)]
    assert names[0].startswith("features.0.") and names[-1].startswith("classifier.")


def test_vector_validation():
    model = make_model("mlp", (4,), 2, hidden=(3,))
    with pytest.raises(ModelConfigError, match="length 23"):
        vector_to_parameters(np.zeros(5), model)
    with pytest.raises(ModelConfigError, match="non-finite"):
        vector_to_parameters(np.full(23, np.nan), model)


def test_mean_precision_round_trip():
    model = make_bayesian_model("lenet5", (1, 8, 8), 10)
    rng = np.random.default_rng(0)
    layout = gaussian_layout(model)
    size = sum(int(np.prod(s)) for _, s in layout)
    mean = rng.normal(size=size)
    precision = np.exp(rng.uniform(-4, 12, size=size))  # std from ~7 down to ~2.5e-3
    set_mean_precision(model, mean, precision)
    m2, p2 = get_mean_precision(model)
    assert m2.dtype == np.float64 and p2.dtype == np.float64
    assert np.allclose(m2, mean.astype(np.float32), rtol=0, atol=0)  # means exact to float32
    assert np.allclose(p2, precision, rtol=1e-5)  # precisions up to float32 rounding of rho
    assert [n for n, _ in layout][:2] == ["features.0.weight", "features.0.bias"]


def test_mean_precision_is_mu_and_inverse_variance():
    model = make_bayesian_model("mlp", (3,), 2, hidden=(2,))
    mean, precision = get_mean_precision(model)
    layer = model.net[1]
    std = layer.std("weight").detach().double().reshape(-1).numpy()
    assert np.array_equal(mean[:6], layer.weight_mu.detach().double().reshape(-1).numpy())
    assert np.allclose(precision[:6], 1.0 / std ** 2)


def test_mean_precision_validation():
    model = make_bayesian_model("mlp", (3,), 2, hidden=(2,))
    n = len(get_mean_precision(model)[0])
    with pytest.raises(ModelConfigError, match="positive"):
        set_mean_precision(model, np.zeros(n), np.zeros(n))
    with pytest.raises(ModelConfigError, match="length"):
        set_mean_precision(model, np.zeros(n + 1), np.ones(n + 1))
    with pytest.raises(ModelConfigError, match="no Bayesian layers"):
        get_mean_precision(make_model("mlp", (3,), 2))
