"""The offline loaders: digits, mnist5k, diabetes and FedBNR's 1-D synthetic task."""

from __future__ import annotations

import numpy as np
import pytest

from privfl.data import (DatasetError, load_diabetes, load_digits, load_mnist5k, sorted_chunk_partition, synthetic1d,
                         synthetic1d_function)


def test_digits_shape_and_range():
    d = load_digits()
    assert d.x.shape == (1797, 1, 8, 8) and d.x.dtype == np.float32
    assert d.x.min() == 0.0 and d.x.max() == 1.0
    assert d.num_classes == 10 and set(np.unique(d.y)) == set(range(10))
    assert load_digits(flatten=True).x.shape == (1797, 64)


def test_mnist5k_shape_range_and_balance():
    d = load_mnist5k()
    assert d.x.shape == (5000, 1, 28, 28) and d.x.dtype == np.float32
    assert 0.0 <= d.x.min() and d.x.max() == 1.0
    assert np.array_equal(d.label_counts(), np.full(10, 500))
    assert load_mnist5k(flatten=True).input_shape == (784,)


def test_diabetes_is_standardised_with_recoverable_units():
    d = load_diabetes()
    assert d.x.shape == (442, 10) and d.task == "regression"
    assert np.allclose(d.x.mean(axis=0), 0, atol=1e-5) and np.allclose(d.x.std(axis=0), 1, atol=1e-5)
    raw = load_diabetes(standardized=False)
    assert raw.y.min() == 25 and raw.y.max() == 346
    assert np.allclose(d.to_original_units(d.y), raw.y, atol=1e-3)
    assert d.target_scale == pytest.approx(raw.y.astype(np.float64).std(), rel=1e-6)


def test_synthetic1d_matches_its_definition():
    d = synthetic1d(200, seed=5)
    assert d.x.shape == (200, 1) and d.y.shape == (200,)
    assert d.x.min() >= -5 and d.x.max() <= 5
    resid = d.y - synthetic1d_function(d.x[:, 0])
    assert 0.4 < resid.std() < 0.6  # sigma = 0.5 (FedBNR Sec. 5.1)
    noiseless = synthetic1d(50, seed=5, noise_std=0.0)
    assert np.allclose(noiseless.y, synthetic1d_function(noiseless.x[:, 0]), atol=1e-6)


def test_synthetic1d_is_reproducible_and_validated():
    assert np.array_equal(synthetic1d(30, 1).x, synthetic1d(30, 1).x)
    assert not np.array_equal(synthetic1d(30, 1).x, synthetic1d(30, 2).x)
    with pytest.raises(DatasetError):
        synthetic1d(1)
    with pytest.raises(DatasetError):
        synthetic1d(10, noise_std=-1)


def test_synthetic1d_paper_two_client_split():
    d = synthetic1d(200, seed=0)
    parts = sorted_chunk_partition(d.x, d.y, 2, 1, np.random.default_rng(0))
    halves = sorted((d.x[p, 0].max() for p in parts))
    lows = sorted((d.x[p, 0].min() for p in parts))
    assert [len(p) for p in parts] == [100, 100]
    assert halves[0] <= lows[1]  # one client holds the left half, the other the right
