"""Own data from tables: one file per client or a client column, the public label set, the held-out split rule, and
standardisation from public data only."""

import numpy as np
import pandas as pd
import pytest
from sklearn.datasets import load_breast_cancer, load_wine

from privfl.data import DatasetError, client_tables, federated_from_tables, load_entry, read_table
from privfl.data.own import holdout_split


@pytest.fixture(scope="module")
def cancer():
    return load_breast_cancer(as_frame=True).frame.rename(columns={"target": "y"})


def _write_clients(folder, frame, k=4, suffix=".csv"):
    folder.mkdir()
    for i in range(k):
        part = frame.iloc[i::k]
        if suffix == ".csv":
            part.to_csv(folder / f"h{i}.csv", index=False)
    return str(folder / f"*{suffix}")


def test_one_file_per_client_and_a_client_column_give_the_same_clients(tmp_path, cancer):
    pattern = _write_clients(tmp_path / "clients", cancer)
    by_file = client_tables(pattern)
    assert list(by_file) == ["h0", "h1", "h2", "h3"]
    tagged = cancer.assign(site=[f"h{i % 4}" for i in range(len(cancer))])
    tagged.to_csv(tmp_path / "all.csv", index=False)
    by_column = client_tables(str(tmp_path / "all.csv"), client_column="site")
    assert list(by_column) == list(by_file)
    for name in by_file:
        np.testing.assert_allclose(by_file[name].to_numpy(), by_column[name].to_numpy())


def test_federation_from_tables_with_a_test_file(cancer):
    test = cancer.iloc[::5]
    train = cancer.drop(test.index)
    clients = {f"h{i}": train.iloc[i::4] for i in range(4)}
    data = federated_from_tables(clients, "y", test=test)
    assert data.num_classes == 2 and data.input_shape == (30,) and len(data.test) == len(test)
    assert [len(p) for p in data.train_parts] == [len(c) for c in clients.values()]
    assert data.info["classes"] == ["0", "1"] and data.info["test"] == "test data"


def test_held_out_split_is_each_records_own_coin(cancer):
    clients = {f"h{i}": cancer.iloc[i::4] for i in range(4)}
    data = federated_from_tables(clients, "y", classes=[0, 1], test_fraction=0.25, seed=3)
    n = [len(c) for c in clients.values()]
    held = [holdout_split(c.drop(columns=["y"]).to_numpy(np.float32), c["y"].to_numpy(), 0.25, 3)[1]
            for c in clients.values()]
    assert [len(p) for p in data.train_parts] == [k - len(h) for k, h in zip(n, held)]
    assert len(data.test) == sum(len(h) for h in held)
    assert abs(len(data.test) / sum(n) - 0.25) < 4 * np.sqrt(0.25 * 0.75 / sum(n))  # the fraction in expectation
    # a client's split is the same whatever the other clients hold, and a record's side whatever its own client's
    # other records are (the first 20 records of h1 keep their sides)
    fewer = federated_from_tables({"h0": clients["h0"], "h1": clients["h1"].iloc[:20]}, "y", classes=[0, 1],
                                  test_fraction=0.25, seed=3)
    np.testing.assert_array_equal(fewer.train_parts[0].x, data.train_parts[0].x)
    first20 = {tuple(r) for r in clients["h1"].iloc[:20].drop(columns=["y"]).to_numpy(np.float32)}
    assert {tuple(r) for r in fewer.train_parts[1].x} == {tuple(r) for r in data.train_parts[1].x} & first20
    # another seed, another split
    other = federated_from_tables(clients, "y", classes=[0, 1], test_fraction=0.25, seed=4)
    assert not np.array_equal(other.test.x, data.test.x)


def test_the_label_set_is_public_never_read_from_clients(cancer):
    clients = {f"h{i}": cancer.iloc[i::4] for i in range(4)}
    with pytest.raises(DatasetError, match="--classes"):
        federated_from_tables(clients, "y")
    with pytest.raises(DatasetError, match="outside the declared label set"):
        federated_from_tables(clients, "y", classes=[0, 2])  # label 1 undeclared
    with pytest.raises(DatasetError, match="at least 2 classes"):
        federated_from_tables(clients, "y", classes=[0])


def test_standardisation_uses_the_public_data_only(cancer):
    public = cancer.iloc[:60]
    rest = cancer.iloc[60:]
    clients = {f"h{i}": rest.iloc[i::4] for i in range(4)}
    data = federated_from_tables(clients, "y", classes=[0, 1], standardize="public", public=public)
    x_public = public.drop(columns=["y"]).to_numpy()
    expected = (clients["h0"].drop(columns=["y"]).to_numpy() - x_public.mean(0)) / x_public.std(0)
    train0, _ = holdout_split(clients["h0"].drop(columns=["y"]).to_numpy(np.float32), clients["h0"]["y"].to_numpy(),
                              0.2, 0)
    np.testing.assert_allclose(data.train_parts[0].x, expected[train0], rtol=1e-4, atol=1e-4)
    with pytest.raises(DatasetError, match="--public-data"):
        federated_from_tables(clients, "y", classes=[0, 1], standardize="public")


def test_multiclass_and_arrays_and_regression():
    x, y = load_wine(return_X_y=True)
    clients = {f"c{i}": (x[i::3], y[i::3]) for i in range(3)}
    data = federated_from_tables(clients, None, classes=[0, 1, 2])
    assert data.num_classes == 3 and data.task == "classification"
    reg = federated_from_tables({k: (v[0], v[0][:, 0] * 2.0) for k, v in clients.items()}, None, task="regression")
    assert reg.task == "regression"


@pytest.mark.parametrize("make, needle", [
    (lambda d, t: str(t / "none-*.csv"), "no file matches"),
    (lambda d, t: str(t), "directory"),
])
def test_file_errors_name_the_flag(tmp_path, cancer, make, needle):
    with pytest.raises(DatasetError, match=needle):
        client_tables([make(cancer, tmp_path), make(cancer, tmp_path)])


def test_table_errors(tmp_path, cancer):
    (tmp_path / "a.csv").write_text("x,y\n1,0\n")
    (tmp_path / "b.csv").write_text("x,z\n1,0\n")
    clients = client_tables(str(tmp_path / "*.csv"))
    with pytest.raises(DatasetError, match="--target 'y' is not a column of client 'b'"):
        federated_from_tables(clients, "y", classes=[0, 1])
    (tmp_path / "b.csv").write_text("x,y\nabc,0\n")
    with pytest.raises(DatasetError, match="not numeric"):
        federated_from_tables(client_tables(str(tmp_path / "*.csv")), "y", classes=[0, 1])
    with pytest.raises(DatasetError, match="one file, which is one client"):
        client_tables(str(tmp_path / "a.csv"))
    (tmp_path / "c.txt").write_text("x")
    with pytest.raises(DatasetError, match="unknown file type"):
        read_table(str(tmp_path / "c.txt"))


def test_entry_point(tmp_path, monkeypatch):
    (tmp_path / "my_fed.py").write_text(
        "import numpy as np\n"
        "def federation():\n"
        "    rng = np.random.default_rng(0)\n"
        "    return {'model': 'mlp', 'hidden': [4]}, {f'c{i}': (rng.normal(size=(20, 3)), rng.integers(0, 2, 20))"
        " for i in range(3)}\n"
        "def bad():\n"
        "    return 'nothing'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    got = load_entry("my_fed:federation")
    assert got.model == {"model": "mlp", "hidden": [4]} and len(got.clients) == 3
    with pytest.raises(DatasetError, match="must return"):
        load_entry("my_fed:bad")
    with pytest.raises(DatasetError, match="module:function"):
        load_entry("my_fed")
    with pytest.raises(DatasetError, match="cannot import"):
        load_entry("no_such_module_here:f")
