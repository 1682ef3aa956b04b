"""Organisations' data through Flower Datasets (privfl.data.flower_datasets), offline: a CSV the test writes, loaded
by the datasets library's csv builder through Flower's FederatedDataset."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from privfl.data.flower_datasets import is_flower_dataset, load_partition, parse
from privfl.errors import ConfigurationError

pytest.importorskip("flwr_datasets")


@pytest.fixture()
def csv(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # the datasets library's cache: the test's own
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.normal(size=(90, 4)).round(6), columns=[f"f{i}" for i in range(4)])
    frame["label"] = rng.integers(0, 3, 90)
    frame["price"] = rng.normal(size=90)
    path = tmp_path / "all.csv"
    frame.to_csv(path, index=False)
    return path, frame


def _load(source, partition_id=None, num_partitions=3, task="classification", num_classes=3):
    return load_partition(source, partition_id=partition_id, num_partitions=num_partitions, task=task,
                          num_classes=num_classes)


def test_a_source_is_parsed_into_the_dataset_privfls_options_and_loading_keywords():
    assert is_flower_dataset("flwr-datasets:csv") and not is_flower_dataset("/data/org0.npz")
    assert parse("flwr-datasets:csv?y=label&x=a,b&data_files=/d/x.csv&partitioner=iid") == (
        "csv", {"y": "label", "x": "a,b", "partitioner": "iid"}, {"data_files": "/d/x.csv"})
    with pytest.raises(ConfigurationError, match="name the dataset"):
        parse("flwr-datasets:?y=label")
    with pytest.raises(ConfigurationError, match="given twice"):
        parse("flwr-datasets:csv?y=a&y=b")


def test_the_whole_split_is_the_organisations_data_by_default(csv):
    path, frame = csv
    data = _load(f"flwr-datasets:csv?data_files={path}&x=f0,f1,f2,f3")
    np.testing.assert_allclose(data.x, frame[[f"f{i}" for i in range(4)]].to_numpy(np.float32))
    np.testing.assert_array_equal(data.y, frame["label"].to_numpy())
    assert data.y.dtype == np.int64
    regression = _load(f"flwr-datasets:csv?data_files={path}&x=f0,f1&y=price", task="regression", num_classes=1)
    np.testing.assert_allclose(regression.y, frame["price"].to_numpy(np.float32))


def test_partitions_cut_the_split_into_the_runs_clients(csv):
    path, frame = csv
    source = f"flwr-datasets:csv?data_files={path}&x=f0,f1,f2,f3&partitioner=iid"
    parts = [_load(source, partition_id=k) for k in range(3)]
    assert [len(p) for p in parts] == [30, 30, 30]
    union = np.sort(np.concatenate([p.x[:, 0] for p in parts]))
    np.testing.assert_allclose(union, np.sort(frame["f0"].to_numpy(np.float32)))
    again = _load(source, partition_id=1)  # the partition is a public function of the seed
    np.testing.assert_array_equal(again.x, parts[1].x)
    skewed = [_load(f"flwr-datasets:csv?data_files={path}&partitioner=dirichlet:0.5&x=f0", partition_id=k)
              for k in range(3)]
    assert sum(len(p) for p in skewed) == 90


@pytest.mark.parametrize("source, says", [
    ("flwr-datasets:csv?data_files={path}&y=nolabel", "no column 'nolabel'"),
    ("flwr-datasets:csv?data_files={path}&x=f9", "set x="),
    ("flwr-datasets:csv?data_files={path}&partitioner=dirichlet:-1", "ALPHA > 0"),
    ("flwr-datasets:csv?data_files={path}&partitioner=shards", "none, iid or dirichlet"),
    ("flwr-datasets:csv?data_files={path}&seed=abc", "seed must be an integer"),
    ("flwr-datasets:csv?data_files={path}.missing", "cannot load"),
])
def test_mistakes_name_what_to_change(csv, source, says):
    path, _ = csv
    with pytest.raises(ConfigurationError, match=says):
        _load(source.format(path=path), partition_id=0)


def test_a_partitioned_source_needs_a_partition_id(csv):
    path, _ = csv
    with pytest.raises(ConfigurationError, match="no partition id"):
        _load(f"flwr-datasets:csv?data_files={path}&partitioner=iid")


def test_records_the_run_cannot_use_are_left_out_one_by_one_never_a_failure(tmp_path, monkeypatch, caplog):
    """A failure one record could cause would tell the server (an error reply instead of a release) whether that
    record is there: a feature beyond float32's range or not a number, a label not an integer or outside the run's
    classes leave that record out, with a warning in the organisation's own log that shows no value."""
    import logging

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    good = pd.DataFrame({"f0": [0.5, 1.5, 2.5, 3.5], "f1": [1.0, 2.0, 3.0, 4.0], "label": ["0", "1", "2", "1"]})
    bad = pd.DataFrame({"f0": ["1e39", "abc", "0.25", "0.75"], "f1": [1.0, 2.0, 3.0, 4.0],
                        "label": ["1", "2", "7", "1.5"]})
    path = tmp_path / "org.csv"
    pd.concat([good, bad]).to_csv(path, index=False)
    with caplog.at_level(logging.WARNING, logger="privfl.data"):
        data = _load(f"flwr-datasets:csv?data_files={path}&x=f0,f1")
    np.testing.assert_array_equal(data.x, good[["f0", "f1"]].to_numpy(np.float32))
    np.testing.assert_array_equal(data.y, [0, 1, 2, 1])
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "left out" in logged and "1e39" not in logged and "abc" not in logged and "1.5" not in logged
    # a regression target column read as class labels: every record left out (an empty data set, no failure)
    assert len(_load(f"flwr-datasets:csv?data_files={path}&x=f1&y=f0")) == 0
    assert len(load_partition(f"flwr-datasets:csv?data_files={path}&x=f1&y=f0", partition_id=None,
                              num_partitions=1, task="regression", num_classes=1)) == 6


def test_a_split_without_records_is_an_empty_data_set_of_the_runs_input_shape(tmp_path, monkeypatch):
    """A header-only CSV (the organisation's data removed: client level's neighbour) is an empty data set, as an empty
    .npz is; without the run's input shape the load still says the split holds no record."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    path = tmp_path / "empty.csv"
    pd.DataFrame({"f0": [], "f1": [], "label": []}).to_csv(path, index=False)
    source = f"flwr-datasets:csv?data_files={path}"
    data = load_partition(source, partition_id=None, num_partitions=1, task="classification", num_classes=3,
                          input_shape=(2,))
    assert data.x.shape == (0, 2) and data.y.shape == (0,) and data.y.dtype == np.int64
    with pytest.raises(ConfigurationError, match="no record|cannot load"):
        _load(source)
