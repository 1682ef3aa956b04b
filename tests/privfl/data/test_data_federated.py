"""make_federated: every offline data set end to end, reproducibility, and argument validation."""

from __future__ import annotations

import numpy as np
import pytest

from privfl.data import DATASETS, DatasetError, PartitionError, Standardizer, make_federated


def _rows(fd):
    """Each client/test row as bytes, to check that splits never share an example."""
    def keys(d):
        return {d.x[i].tobytes() + np.asarray(d.y[i]).tobytes() for i in range(len(d))}
    return [keys(p) for p in fd.train_parts], keys(fd.test)


@pytest.mark.parametrize("name, shape, task", [("digits", (1, 8, 8), "classification"),
                                               ("mnist5k", (1, 28, 28), "classification"),
                                               ("diabetes", (10,), "regression"),
                                               ("synthetic1d", (1,), "regression")])
def test_offline_datasets_end_to_end(name, shape, task):
    fd = make_federated(name, 4, seed=0)
    assert fd.task == task and fd.input_shape == shape and fd.n_clients == 4
    assert fd.partition == ("dirichlet" if task == "classification" else "sorted_chunk")
    n_all = fd.info["n_total"]
    assert len(fd.test) == round(0.2 * n_all)
    n_public = len(fd.public) if fd.public is not None else 0  # the public reference split (diabetes: 5%)
    assert fd.client_sizes.sum() + len(fd.test) + n_public == n_all
    clients, test = _rows(fd)
    for c in clients:
        assert not (c & test)


def test_reproducible_from_seed():
    a = make_federated("digits", 5, alpha=0.5, seed=3)
    b = make_federated("digits", 5, alpha=0.5, seed=3)
    c = make_federated("digits", 5, alpha=0.5, seed=4)
    assert all(np.array_equal(p.x, q.x) for p, q in zip(a.train_parts, b.train_parts))
    assert np.array_equal(a.test.y, b.test.y)
    assert not np.array_equal(a.client_sizes, c.client_sizes)


def test_regression_standardised_with_public_statistics_only():
    fd = make_federated("diabetes", 3, "iid", seed=1)
    assert fd.info["standardize"] == "public" and len(fd.public) == 22  # 5% of 442
    assert np.allclose(fd.public.x.mean(axis=0), 0, atol=1e-5) and abs(fd.public.y.mean()) < 1e-5
    assert abs(fd.pooled_train().y.mean()) > 1e-4  # the clients' statistics are never fitted
    assert abs(fd.test.y.mean()) > 1e-4  # test set uses the public statistics, not its own
    assert fd.target_scale == pytest.approx(fd.info["standardizer"].y_std)
    raw = make_federated("diabetes", 3, "iid", seed=1, standardize=False, public_size=22)
    assert np.array_equal(fd.info["standardizer"].x_mean, Standardizer.fit(raw.public).x_mean)
    assert np.allclose(fd.test.to_original_units(fd.test.y), raw.test.y, atol=1e-3)


def test_partitions_through_the_entry_point():
    fd = make_federated("mnist5k", 10, "disjoint_class", classes_per_client=2, examples_per_class=20, seed=0)
    hist = fd.label_histogram()
    assert np.all((hist > 0).sum(axis=1) == 2) and np.all(hist[hist > 0] == 20)
    iid = make_federated("digits", 6, "iid", seed=0)
    assert fd.num_classes == 10 and max(iid.client_sizes) - min(iid.client_sizes) <= 1
    chunk = make_federated("synthetic1d", 2, "sorted_chunk", chunks_per_client=1, n=100, seed=0)
    ranges = sorted((p.x.min(), p.x.max()) for p in chunk.train_parts)
    assert ranges[0][1] <= ranges[1][0] and chunk.info["sort_feature"] == 0


def test_validation_and_alignment_sets():
    fd = make_federated("digits", 3, "iid", seed=0, test_fraction=0.1, val_fraction=0.1, alignment_size=100)
    assert len(fd.val) == round(0.1 * 1797) and len(fd.alignment) == 100
    assert fd.client_sizes.sum() + len(fd.val) + len(fd.alignment) + len(fd.test) == 1797


@pytest.mark.parametrize("kwargs, match", [
    (dict(dataset="imagenet", n_clients=2), "choose one of"),
    (dict(dataset="digits", n_clients=0), "n_clients"),
    (dict(dataset="digits", n_clients=2000), "larger than"),
    (dict(dataset="digits", n_clients=2, alpha=0), "alpha"),
    (dict(dataset="digits", n_clients=2, alpha=-1.0), "alpha"),
    (dict(dataset="digits", n_clients=2, partition="random"), "unknown partition"),
    (dict(dataset="digits", n_clients=2, test_fraction=1.5), "test_fraction"),
    (dict(dataset="digits", n_clients=2, seed=-1), "seed"),
    (dict(dataset="diabetes", n_clients=2, partition="dirichlet"), "regression task"),
    (dict(dataset="digits", n_clients=2, partition="sorted_chunk"), "sorted_chunk"),
    (dict(dataset="digits", n_clients=2, classes_per_client=3), "disjoint_class"),
    (dict(dataset="digits", n_clients=2, chunks_per_client=3), "sorted_chunk"),
    (dict(dataset="digits", n_clients=2, bogus=1), "loader options"),
    (dict(dataset="digits", n_clients=2, alignment_size=5000), "alignment_size"),
])
def test_argument_errors_are_clear(kwargs, match):
    with pytest.raises(DatasetError, match=match):
        make_federated(**kwargs)


def test_unknown_dataset_lists_every_name():
    with pytest.raises(DatasetError) as info:
        make_federated("nope", 2)
    for name in DATASETS:
        assert name in str(info.value)


def test_impossible_dirichlet_is_a_partition_error():
    with pytest.raises(PartitionError, match="min_size"):
        make_federated("digits", 100, alpha=0.01, min_size=15)  # 1,500 examples needed, 1,437 in training
