"""``privfl.federate(..., algorithm="fedbnr")`` returns a usable model (issue 28): its posterior predictive, as an
``nn.Module`` whose output is the predictive mean and whose ``predict`` adds the predictive variance, in the targets'
units; it reproduces the run's own test metrics."""

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import privfl
from privfl.algorithms.fedbnr import BLRPredictor


def _regression(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, size=(n, 3)).astype(np.float32)
    y = (np.sin(2 * x[:, 0]) + 0.5 * x[:, 1] + 0.1 * rng.normal(size=n)).astype(np.float32)
    return x, y


def _federate(model=None, **kw):
    clients = {f"org{k}": _regression(120, k) for k in range(3)}
    test = _regression(60, 99)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = privfl.federate(model, clients, algorithm="fedbnr", test=test, rounds=1, secure_noise=False, **kw)
    return result, test


def _rmse(pred, y):
    return float(np.sqrt(np.mean((np.asarray(pred, dtype=np.float64) - y) ** 2)))


@pytest.mark.parametrize("epsilon", [math.inf, 3.0])
def test_the_model_is_the_posterior_predictive_and_reproduces_the_test_metrics(epsilon):
    result, (x, y) = _federate(epsilon=epsilon, client_size=120)
    model = result.model
    assert isinstance(model, BLRPredictor) and isinstance(model, nn.Module)
    assert not list(model.parameters())  # inference only: nothing trainable
    out = model(torch.as_tensor(x))
    assert out.shape == (len(x), 1) and out.dtype == torch.float32
    mean, var = model.predict(x)
    assert mean.shape == var.shape == (len(x),)
    np.testing.assert_allclose(out.numpy()[:, 0], mean, rtol=1e-6, atol=1e-6)
    assert np.all(np.isfinite(var)) and np.all(var > 0)
    assert _rmse(mean, y) == pytest.approx(result.final["rmse"], rel=1e-9)  # the run's own evaluation
    assert result.final["rmse"] < float(np.std(y))  # it learnt something: better than predicting the mean
    # a tensor, an array and a data set give the same predictions
    np.testing.assert_allclose(model.predict(torch.as_tensor(x))[0], mean)


def test_predictions_in_the_targets_units():
    """A run on standardised targets predicts in the data's own units: mean * scale + offset, variance * scale^2."""
    result, (x, _) = _federate(epsilon=math.inf)
    mean, var = result.model.predict(x)
    scaled = BLRPredictor(result.model.feature_map, result.model.posterior, target_offset=2.0, target_scale=3.0)
    smean, svar = scaled.predict(x)
    np.testing.assert_allclose(smean, mean * 3 + 2)
    np.testing.assert_allclose(svar, var * 9)


def test_a_users_feature_extractor_and_phase_one_give_a_model_too():
    torch.manual_seed(0)
    extractor = nn.Sequential(nn.Linear(3, 8), nn.Tanh())
    result, (x, y) = _federate(extractor, epsilon=math.inf, kernel_rounds=1)
    mean, var = result.model.predict(x)
    assert _rmse(mean, y) == pytest.approx(result.final["rmse"], rel=1e-9)
    assert np.all(var > 0)
