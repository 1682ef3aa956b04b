"""Preprocessing is public: a client's preprocessed records depend only on its own raw records and public inputs.

Regression test for the audit finding that ``make_federated`` fitted its standardiser on the clients' pooled training
data, so one added record moved every client's data (and FedBNR's scatter uploads, outside the ledger). Here D' is D
with one extreme record added to, removed from or replaced in one client's raw training data, run through the same
preprocessing: every other client's data, the modified client's other rows and every shared set must be bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from privfl.data import (ArrayDataset, DatasetError, FederatedData, Standardizer, federated_from_arrays,
                         load_diabetes, make_federated)

N_CLIENTS, MODIFIED = 4, 1


def _raw_twin(fd: FederatedData, name: str, options: dict) -> FederatedData:
    """The same seeded splits as ``fd`` with no preprocessing: the raw records the clients hold."""
    public_size = len(fd.public) if fd.public is not None else 0
    return make_federated(name, N_CLIENTS, seed=0, **{**options, "standardize": None, "public_size": public_size})


def _preprocess(raw: FederatedData, parts: list, option) -> FederatedData:
    return federated_from_arrays(parts, raw.test, name=raw.name, standardize=option, public=raw.public, val=raw.val,
                                 alignment=raw.alignment, partition=raw.partition)


def _same(a, b) -> bool:
    """Bit-identical records and target units (both None counts as the same)."""
    if a is None or b is None:
        return a is None and b is None
    return (a.x.tobytes() == b.x.tobytes() and a.y.tobytes() == b.y.tobytes() and a.x.shape == b.x.shape
            and (a.target_offset, a.target_scale) == (b.target_offset, b.target_scale))


def _extreme(part) -> tuple[np.ndarray, np.ndarray]:
    """One record far outside the data in every feature and in the target."""
    return np.full((1, *part.input_shape), 1e6, np.float32), np.full((1, *part.y.shape[1:]), -1e6, np.float32)


def _neighbour(part, relation: str) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray, np.ndarray]:
    """(D' arrays of this client, indices of D's rows kept, their indices in D')."""
    x, y = part.x.copy(), part.y.copy()
    ex, ey = _extreme(part)
    n = len(part)
    if relation == "add":
        return (np.concatenate([x, ex]), np.concatenate([y, ey])), np.arange(n), np.arange(n)
    if relation == "remove":
        return (x[1:], y[1:]), np.arange(1, n), np.arange(n - 1)
    x[0], y[0] = ex[0], ey[0]
    return (x, y), np.arange(1, n), np.arange(1, n)


CASES = [("diabetes", {}), ("synthetic1d", {}), ("diabetes", {"partition": "iid", "val_fraction": 0.1,
                                                             "alignment_size": 35}),
         ("synthetic1d", {"standardize": "public"}), ("synthetic1d", {"standardize": "public", "public_size": 2})]


@pytest.mark.parametrize("name, options", CASES)
def test_make_federated_is_federated_from_arrays_of_its_raw_records(name, options):
    """So D' built below through ``federated_from_arrays`` goes through make_federated's own preprocessing."""
    fd = make_federated(name, N_CLIENTS, seed=0, **options)
    raw = _raw_twin(fd, name, options)
    again = _preprocess(raw, raw.train_parts, fd.info["standardize"])
    assert all(_same(a, b) for a, b in zip(again.train_parts, fd.train_parts))
    assert all(_same(getattr(again, s), getattr(fd, s)) for s in ("test", "val", "alignment", "public"))


@pytest.mark.parametrize("relation", ["add", "remove", "replace"])
@pytest.mark.parametrize("name, options", CASES)
def test_one_clients_record_changes_no_other_preprocessed_record(name, options, relation):
    fd = make_federated(name, N_CLIENTS, seed=0, **options)
    raw = _raw_twin(fd, name, options)
    option = fd.info["standardize"]
    target = raw.train_parts[MODIFIED]
    changed, kept_d, kept_d2 = _neighbour(target, relation)
    parts = [p if k != MODIFIED else changed for k, p in enumerate(raw.train_parts)]
    d, d2 = _preprocess(raw, raw.train_parts, option), _preprocess(raw, parts, option)
    for k in range(N_CLIENTS):
        if k != MODIFIED:
            assert _same(d.train_parts[k], d2.train_parts[k]), f"client {k} changed with client {MODIFIED}'s record"
    mine, mine2 = d.train_parts[MODIFIED], d2.train_parts[MODIFIED]
    assert _same(mine.subset(kept_d), mine2.subset(kept_d2)), "the modified client's other rows changed"
    for split in ("test", "val", "alignment", "public"):
        assert _same(getattr(d, split), getattr(d2, split)), f"the {split} set changed"
    s, s2 = d.info.get("standardizer"), d2.info.get("standardizer")
    assert (s is None and s2 is None) or all(np.array_equal(getattr(s, f), getattr(s2, f))
                                             for f in ("x_mean", "x_std", "y_mean", "y_std"))


@pytest.mark.parametrize("name, options", [("diabetes", {}), ("diabetes", {"val_fraction": 0.1, "alignment_size": 35}),
                                           ("synthetic1d", {"standardize": "public"}),
                                           ("digits", {"standardize": "public"}),
                                           ("mnist5k", {"public_size": 50, "alignment_size": 40})])
def test_public_split_is_held_by_no_client_and_not_in_the_test_set(name, options):
    fd = make_federated(name, N_CLIENTS, seed=0, **options)
    raw = _raw_twin(fd, name, options)
    assert fd.public is not None and len(fd.public) >= 2

    def rows(d):
        return {d.x[i].tobytes() + d.y[i].tobytes() for i in range(len(d))} if d is not None else set()

    public = rows(raw.public)
    assert len(public) == len(raw.public)
    for part in raw.train_parts:
        assert not public & rows(part)
    for split in (raw.test, raw.val, raw.alignment):
        assert not public & rows(split)
    others = sum(len(d) for d in (raw.test, raw.val, raw.alignment) if d is not None)
    assert raw.client_sizes.sum() + others + len(raw.public) == fd.info["n_total"]
    if fd.info["standardize"] == "public":  # fitted on that split and nothing else
        ref = Standardizer.fit(raw.public)
        s = fd.info["standardizer"]
        assert np.array_equal(s.x_mean, ref.x_mean) and np.array_equal(s.x_std, ref.x_std)
        assert (s.y_mean, s.y_std) == (ref.y_mean, ref.y_std)


@pytest.mark.parametrize("name", ["digits", "mnist5k", "diabetes", "synthetic1d"])
def test_every_default_is_public(name):
    fd = make_federated(name, N_CLIENTS, seed=0)
    assert fd.info["standardize"] in (None, "public")
    if name == "diabetes":
        assert fd.info["standardize"] == "public" and len(fd.public) == 22
    else:  # pixels are scaled by public constants, synthetic1d is O(1) by construction: no map, no public split
        assert fd.info["standardize"] is None and fd.public is None and "standardizer" not in fd.info
    fd1 = make_federated(name, N_CLIENTS, seed=0, standardize=None)
    assert fd1.info["standardize"] is None and "standardizer" not in fd1.info


def test_splits_do_not_depend_on_the_standardize_option():
    a = make_federated("diabetes", 3, seed=2, public_size=30)
    b = make_federated("diabetes", 3, seed=2, standardize=None, public_size=30)
    assert np.array_equal(a.client_sizes, b.client_sizes)
    for p, q in zip(a.train_parts, b.train_parts):
        assert np.allclose(p.to_original_units(p.y), q.y, atol=1e-3)


def test_a_user_standardizer_is_applied_as_given_and_carves_nothing():
    raw = load_diabetes(standardized=False)
    given = Standardizer.from_bounds(0.0, 400.0, raw.input_shape, y_low=0.0, y_high=400.0)
    fd = make_federated("diabetes", 3, seed=0, standardize=given)
    assert fd.public is None and fd.info["standardizer"] is given and fd.info["standardize"] is given
    plain = make_federated("diabetes", 3, seed=0, standardize=None)
    for p, q in zip(fd.train_parts, plain.train_parts):
        assert np.allclose(p.x, (q.x.astype(np.float64) - 200.0) / 200.0, atol=1e-6)
        assert np.allclose(p.to_original_units(p.y), q.y, atol=1e-3)


def test_standardize_true_and_other_values_are_refused_with_what_to_pass():
    with pytest.raises(DatasetError, match="'public'"):
        make_federated("diabetes", 3, standardize=True)
    with pytest.raises(DatasetError, match="Standardizer"):
        make_federated("diabetes", 3, standardize="pooled")
    with pytest.raises(DatasetError, match="at least 2"):
        make_federated("diabetes", 3, public_size=1)
    with pytest.raises(DatasetError, match="public_size"):
        make_federated("diabetes", 3, public_size=-1)
    with pytest.raises(DatasetError, match="public_size"):
        make_federated("synthetic1d", 3, public_size=5000)


# -- federated_from_arrays -----------------------------------------------------------------------------------------

def _arrays(seed: int, n: int, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 3)) * scale, rng.normal(size=n) * scale


def test_from_arrays_fits_on_the_public_set_only():
    clients = [_arrays(k, 20, 10.0) for k in range(3)]
    public = _arrays(9, 15, 10.0)
    fd = federated_from_arrays(clients, _arrays(7, 10), task="regression", name="mine", standardize="public",
                               public=public)
    ref = Standardizer.fit(ArrayDataset(public[0], public[1], "regression", 1))
    assert np.array_equal(fd.info["standardizer"].x_mean, ref.x_mean)
    assert fd.n_clients == 3 and fd.name == "mine" and fd.train_parts[2].name == "mine-client2"
    assert np.allclose(fd.public.x.mean(axis=0), 0, atol=1e-5)
    assert np.allclose(fd.train_parts[0].x, (clients[0][0] - ref.x_mean) / ref.x_std, atol=1e-5)
    raw = federated_from_arrays(clients, _arrays(7, 10), task="regression")
    assert np.array_equal(raw.train_parts[1].x, clients[1][0].astype(np.float32)) and raw.public is None


def test_from_arrays_accepts_datasets_and_empty_clients():
    base = load_diabetes(standardized=False)
    parts = [base.subset(range(0, 50)), base.subset(range(50, 50)), base.subset(range(50, 90))]
    fd = federated_from_arrays(parts, base.subset(range(400, 442)), standardize="public",
                               public=base.subset(range(300, 330)))
    assert list(fd.client_sizes) == [50, 0, 40] and fd.num_classes == 1 and fd.input_shape == (10,)


def test_from_arrays_errors_say_what_to_change():
    clients = [_arrays(0, 10), _arrays(1, 10)]
    with pytest.raises(DatasetError, match="public="):
        federated_from_arrays(clients, _arrays(2, 5), task="regression", standardize="public")
    with pytest.raises(DatasetError, match="task="):
        federated_from_arrays(clients, _arrays(2, 5))
    labels = [(np.ones((4, 2)), np.array([0, 1, 1, 0])), (np.ones((3, 2)), np.array([1, 1, 0]))]
    with pytest.raises(DatasetError, match="num_classes"):  # the label set is never inferred from labels
        federated_from_arrays(labels, labels[0], task="classification")
    fd = federated_from_arrays(labels, labels[0], task="classification", num_classes=3)
    assert fd.num_classes == 3
    with pytest.raises(DatasetError, match="disagree"):
        federated_from_arrays([_arrays(0, 10), (np.ones((4, 3)), np.ones((4, 2)))], _arrays(2, 5), task="regression")
    with pytest.raises(DatasetError, match="one ArrayDataset or"):
        federated_from_arrays(_arrays(0, 10), _arrays(2, 5), task="regression")
    with pytest.raises(DatasetError, match="'public'"):
        federated_from_arrays(clients, _arrays(2, 5), task="regression", standardize=True)
    with pytest.raises(DatasetError, match="fitted on inputs of shape"):
        federated_from_arrays(clients, _arrays(2, 5), task="regression",
                              standardize=Standardizer(np.zeros(4), np.ones(4)))
    scaled = load_diabetes()  # standardised: other target units than the raw parts
    raw = load_diabetes(standardized=False)
    with pytest.raises(DatasetError, match="target units"):
        federated_from_arrays([raw.subset(range(10))], scaled.subset(range(10, 20)))


def test_standardizer_is_validated_and_from_bounds_maps_to_unit_interval():
    with pytest.raises(DatasetError, match="positive x_std"):
        Standardizer(np.zeros(2), np.array([1.0, 0.0]))
    with pytest.raises(DatasetError, match="y_std"):
        Standardizer(np.zeros(2), np.ones(2), 0.0, -1.0)
    with pytest.raises(DatasetError, match="x_low < x_high"):
        Standardizer.from_bounds(1.0, 1.0, (2,))
    with pytest.raises(DatasetError, match="both"):
        Standardizer.from_bounds(0.0, 1.0, (2,), y_low=0.0)
    s = Standardizer.from_bounds(np.array([-5.0, 0.0]), np.array([5.0, 10.0]), (2,), y_low=-3.0, y_high=3.0)
    assert np.array_equal(s.x_mean, [0.0, 5.0]) and np.array_equal(s.x_std, [5.0, 5.0])
    assert (s.y_mean, s.y_std) == (0.0, 3.0)
    with pytest.raises(DatasetError, match="at least 2"):
        Standardizer.fit(load_diabetes(standardized=False).subset([0]))
