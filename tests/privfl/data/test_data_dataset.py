"""ArrayDataset, FederatedData, the seeded split and the standardiser."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from privfl.data import (ArrayDataset, DatasetError, FederatedData, Standardizer, standardize,
                         train_test_split_indices)


def _cls(n=20, k=4, shape=(3,)):
    rng = np.random.default_rng(0)
    return ArrayDataset(rng.normal(size=(n, *shape)), np.arange(n) % k, "classification", k, "toy")


def test_array_dataset_casts_and_subsets():
    d = _cls()
    assert d.x.dtype == np.float32 and d.y.dtype == np.int64
    assert len(d) == 20 and d.input_shape == (3,)
    s = d.subset([3, 1, 1])
    assert len(s) == 3 and np.array_equal(s.y, d.y[[3, 1, 1]]) and s.num_classes == 4
    assert np.array_equal(d.label_counts(), [5, 5, 5, 5])


def test_to_torch_types():
    x, y = _cls().to_torch().tensors
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (20, 3)
    reg = ArrayDataset(np.ones((4, 2)), np.arange(4.0), "regression", 1)
    assert reg.to_torch().tensors[1].dtype == torch.float32


@pytest.mark.parametrize("kwargs, match", [
    (dict(x=np.ones((3, 2)), y=np.zeros(2, int), task="classification", num_classes=2), "different lengths"),
    (dict(x=np.ones((3, 2)), y=np.array([0, 1, 2]), task="classification", num_classes=2), r"\[0, 2\)"),
    (dict(x=np.ones((3, 2)), y=np.array([0.5, 1, 0]), task="classification", num_classes=2), "integers"),
    (dict(x=np.ones(3), y=np.zeros(3, int), task="classification", num_classes=2), "reshape"),
    (dict(x=np.ones((3, 2)), y=np.zeros(3), task="ranking", num_classes=1), "task"),
    (dict(x=np.full((3, 2), np.nan), y=np.zeros(3), task="regression", num_classes=1), "non-finite"),
])
def test_array_dataset_rejects_bad_input(kwargs, match):
    with pytest.raises(DatasetError, match=match):
        ArrayDataset(**kwargs)


def test_subset_rejects_masks_and_out_of_range():
    d = _cls()
    with pytest.raises(DatasetError, match="boolean"):
        d.subset(np.ones(20, bool))
    with pytest.raises(DatasetError, match="out of range"):
        d.subset([25])


def test_original_units_round_trip():
    x = np.random.default_rng(1).normal(size=(50, 2))
    y = 100 + 7 * np.random.default_rng(2).normal(size=50)
    raw = ArrayDataset(x, y, "regression", 1)
    std = standardize(raw)
    assert abs(std.y.mean()) < 1e-5 and abs(std.y.std() - 1) < 1e-5
    assert np.allclose(std.to_original_units(std.y), raw.y, atol=1e-4)
    assert std.target_scale == pytest.approx(raw.y.astype(np.float64).std(), rel=1e-6)


def test_standardizer_fits_on_train_only_and_handles_constant_features():
    x = np.column_stack([np.arange(10.0), np.full(10, 3.0)])
    train = ArrayDataset(x[:6], np.arange(6.0), "regression", 1)
    test = ArrayDataset(x[6:], np.arange(6.0, 10.0), "regression", 1)
    s = Standardizer.fit(train)
    assert s.x_std[1] == 1.0  # constant column is not divided by zero
    out = s.transform(test)
    assert np.allclose(out.x[:, 0], (np.arange(6.0, 10.0) - 2.5) / np.std(np.arange(6.0)), atol=1e-6)
    assert np.allclose(out.to_original_units(out.y), np.arange(6.0, 10.0), atol=1e-5)


@pytest.mark.parametrize("frac", [0.1, 0.2, 0.33])
def test_stratified_split_is_disjoint_covering_and_proportional(frac):
    labels = np.repeat(np.arange(5), [100, 50, 30, 17, 3])
    tr, te = train_test_split_indices(labels, frac, np.random.default_rng(0))
    assert len(np.intersect1d(tr, te)) == 0
    assert np.array_equal(np.sort(np.concatenate([tr, te])), np.arange(len(labels)))
    assert len(te) == round(frac * len(labels))
    counts = np.bincount(labels[te], minlength=5)
    assert np.all(np.abs(counts - frac * np.bincount(labels)) <= 1)


def test_split_is_reproducible_and_seed_dependent():
    labels = np.arange(200) % 7
    a = train_test_split_indices(labels, 0.25, np.random.default_rng(3))
    b = train_test_split_indices(labels, 0.25, np.random.default_rng(3))
    c = train_test_split_indices(labels, 0.25, np.random.default_rng(4))
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    assert not np.array_equal(a[1], c[1])


@pytest.mark.parametrize("frac", [0.0, 1.0, -0.1, 1e-6])
def test_split_rejects_bad_fractions(frac):
    with pytest.raises(DatasetError):
        train_test_split_indices(100, frac, np.random.default_rng(0))


def test_split_requires_a_generator():
    with pytest.raises(DatasetError, match="Generator"):
        train_test_split_indices(10, 0.2, 0)


def test_federated_data_checks_and_helpers():
    d = _cls(40)
    fd = FederatedData([d.subset(range(0, 20)), d.subset(range(20, 40))], d.subset(range(5)), "toy", 4, (3,))
    assert fd.n_clients == 2 and list(fd.client_sizes) == [20, 20] and fd.task == "classification"
    assert fd.label_histogram().sum() == 40 and len(fd.pooled_train()) == 40
    with pytest.raises(DatasetError, match="input shape"):
        FederatedData([d], d, "toy", 4, (5,))
    with pytest.raises(DatasetError, match="at least one"):
        FederatedData([], d, "toy", 4, (3,))
