"""Client partitions: disjointness, coverage, the properties each recipe promises, seeding and errors."""

from __future__ import annotations

import numpy as np
import pytest

from privfl.data import (PartitionError, PartitionWarning, dirichlet_partition, disjoint_class_partition,
                         iid_partition, most_correlated_feature, sorted_chunk_partition)

LABELS = np.repeat(np.arange(10), 60)  # 600 examples, 10 balanced classes


def _assert_disjoint(parts, n=None):
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx), "parts overlap"
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)
    if n is not None:
        assert np.array_equal(np.sort(allidx), np.arange(n)), "parts do not cover the data"


def test_iid_sizes_and_cover():
    parts = iid_partition(LABELS, 7, np.random.default_rng(0))
    _assert_disjoint(parts, len(LABELS))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert iid_partition(10, 10, np.random.default_rng(0))[0].shape == (1,)


@pytest.mark.parametrize("alpha", [0.05, 0.1, 1.0, 100.0])
def test_dirichlet_cover_and_min_size(alpha):
    parts = dirichlet_partition(LABELS, 10, alpha, np.random.default_rng(1), min_size=10)
    _assert_disjoint(parts, len(LABELS))
    assert min(len(p) for p in parts) >= 10


def test_dirichlet_skew_grows_as_alpha_shrinks():
    def skew(alpha):
        parts = dirichlet_partition(LABELS, 10, alpha, np.random.default_rng(2), min_size=1)
        hist = np.stack([np.bincount(LABELS[p], minlength=10) for p in parts]).astype(float)
        return np.mean(hist.max(axis=1) / hist.sum(axis=1))
    assert skew(0.05) > skew(1.0) > skew(1000.0)
    assert skew(1000.0) < 0.2  # near-uniform class mix at large alpha


def test_dirichlet_is_reproducible():
    a = dirichlet_partition(LABELS, 5, 0.3, np.random.default_rng(9))
    b = dirichlet_partition(LABELS, 5, 0.3, np.random.default_rng(9))
    assert all(np.array_equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan"), float("inf")])
def test_dirichlet_rejects_bad_alpha(alpha):
    with pytest.raises(PartitionError, match="alpha"):
        dirichlet_partition(LABELS, 5, alpha, np.random.default_rng(0))


def test_dirichlet_gives_up_with_a_clear_error():
    with pytest.raises(PartitionError, match="attempts"):
        dirichlet_partition(LABELS, 50, 0.01, np.random.default_rng(0), min_size=11, max_attempts=3)
    with pytest.raises(PartitionError, match="only 600 exist"):
        dirichlet_partition(LABELS, 61, 1.0, np.random.default_rng(0), min_size=10)


def test_too_many_clients_and_bad_rng():
    with pytest.raises(PartitionError, match="larger than"):
        iid_partition(LABELS, 601, np.random.default_rng(0))
    with pytest.raises(PartitionError, match="Generator"):
        iid_partition(LABELS, 3, 0)
    with pytest.raises(PartitionError, match="integer class labels"):
        dirichlet_partition(np.linspace(0, 1, 50), 2, 1.0, np.random.default_rng(0))


def test_disjoint_class_each_client_holds_exactly_k_classes():
    parts = disjoint_class_partition(LABELS, 20, 5, np.random.default_rng(3))
    _assert_disjoint(parts, len(LABELS))  # every class is held, so all data is used
    held = [set(np.unique(LABELS[p])) for p in parts]
    assert all(len(h) == 5 for h in held)
    holders = np.bincount(np.concatenate([list(h) for h in held]), minlength=10)
    assert np.all(holders == 10)  # 20 clients x 5 classes spread evenly over 10 classes


def test_disjoint_class_examples_per_class_subset():
    labels = np.repeat(np.arange(10), 500)
    parts = disjoint_class_partition(labels, 20, 5, np.random.default_rng(4), examples_per_class="small")
    _assert_disjoint(parts)
    for p in parts:
        assert np.array_equal(np.sort(np.bincount(labels[p], minlength=10))[-5:], [50] * 5)
        assert np.count_nonzero(np.bincount(labels[p], minlength=10)) == 5


def test_disjoint_class_caps_where_data_is_short():
    with pytest.warns(PartitionWarning, match="exceeds"):
        parts = disjoint_class_partition(LABELS, 20, 5, np.random.default_rng(5), examples_per_class="full")
    _assert_disjoint(parts, len(LABELS))  # capped at an even share: 60 examples / 10 holders = 6 each
    assert all(len(p) == 30 for p in parts)


@pytest.mark.parametrize("kwargs", [dict(classes_per_client=0), dict(classes_per_client=11),
                                    dict(classes_per_client=2, examples_per_class="huge"),
                                    dict(classes_per_client=2, examples_per_class=0)])
def test_disjoint_class_validation(kwargs):
    with pytest.raises(PartitionError):
        disjoint_class_partition(LABELS, 4, rng=np.random.default_rng(0), **kwargs)


def test_disjoint_class_with_unused_classes():
    parts = disjoint_class_partition(LABELS, 3, 2, np.random.default_rng(6))
    _assert_disjoint(parts)
    used = set(np.unique(LABELS[np.concatenate(parts)]))
    assert len(used) == 6  # 3 clients x 2 classes: the other 4 classes are held by nobody


def test_sorted_chunk_partition_follows_fedbnr():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(203, 4))
    y = -3 * x[:, 2] + 0.1 * rng.normal(size=203)
    assert most_correlated_feature(x, y) == 2  # negative correlation counts by its absolute value
    parts = sorted_chunk_partition(x, y, 5, 2, np.random.default_rng(8))
    _assert_disjoint(parts, 203)
    order = np.argsort(x[:, 2], kind="stable")
    rank = np.empty(203, int)
    rank[order] = np.arange(203)
    chunk_bounds = np.cumsum([len(c) for c in np.array_split(np.arange(203), 10)])
    for p in parts:
        chunks = set(np.searchsorted(chunk_bounds, rank[p], side="right"))
        assert len(chunks) == 2  # each client holds exactly two contiguous chunks of the sorted order


def test_sorted_chunk_validation_and_constant_features():
    x = np.column_stack([np.ones(20), np.arange(20.0)])
    assert most_correlated_feature(x, np.arange(20.0)) == 1  # constant column counts as zero correlation
    with pytest.raises(PartitionError, match="at least 22"):
        sorted_chunk_partition(x, np.arange(20.0), 11, 2, np.random.default_rng(0))
    with pytest.raises(PartitionError, match="Generator"):
        sorted_chunk_partition(x, np.arange(20.0), 2)
