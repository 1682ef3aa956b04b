"""Own data's labels are read one value at a time, never by the column's dtype.

pandas types a column by all its values: one record whose label is a declared text class (``unknown``) turns a
client's 0/1 column into text, one record written ``1.0`` turns it into floats. The held-out coin hashed the label by
the column's dtype (0 as float64 bytes, or as the text "0"), so that one record redrew every other record's coin in
its client; and the labels were matched to the declared classes as the text of the column's dtype ("1.0" is not
"1"), so that one record refused its whole client with a text counting all of its records. Each test starts where a
user starts (``privfl run --data``, ``privfl.federate``) and compares D with a neighbour D'."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import pytest

from privfl.apps.cli import main

FEATURES = ["f0", "f1", "f2", "f3"]


class _Stop(BaseException):
    """Raised once a run is prepared (nothing charged)."""


@pytest.fixture
def prepared(monkeypatch):
    from privfl.runtime.engine import Simulation

    seen: list = []
    original = Simulation.prepare

    def prepare(self):
        original(self)
        seen.append(self.data)
        raise _Stop

    monkeypatch.setattr(Simulation, "prepare", prepare)
    return seen


def _frames(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name in ("c0", "c1", "c2"):
        x = rng.normal(size=(150, 4)).round(4)
        out[name] = pd.DataFrame(x, columns=FEATURES).assign(y=(x[:, 0] > 0).astype(np.int64))
    return out


def _rows(x) -> set:
    return {r.tobytes() for r in np.asarray(x, dtype=np.float32)}


def _write(folder, frames: dict) -> str:
    folder.mkdir(parents=True)
    for name, frame in frames.items():
        frame.to_csv(folder / f"{name}.csv", index=False)
    return str(folder / "*.csv")


def _run(data: str, classes: str, *extra) -> list:
    return ["run", "--algorithm", "dpsgd_fedavg", "--epsilon", "3", "--data", data, "--target", "y", "--classes",
            classes, "--client-size", "100", "--rounds", "1", "--standardize", "none", "--quiet", *extra]


def _assert_differ_by_at_most(a, b, record) -> None:
    """Every client's training set and the test set of ``a`` and ``b`` differ in ``record`` at most."""
    allowed = _rows(np.asarray([record], dtype=np.float32))
    for k in range(len(a.train_parts)):
        assert _rows(a.train_parts[k].x) ^ _rows(b.train_parts[k].x) <= allowed, k
    assert _rows(a.test.x) ^ _rows(b.test.x) <= allowed


UNKNOWN = pd.DataFrame([[0.5, 0.5, 0.5, 0.5, "unknown"]], columns=FEATURES + ["y"])


def test_privfl_run_a_text_label_added_moves_no_other_records_coin(tmp_path, prepared, capsys):
    """D' = D plus one record of c0 whose label is the declared class ``unknown`` (its CSV column then reads as text).
    Every other record keeps its side of the split: the training and test sets differ in that record at most (the
    review saw 35 of c0's records change sides)."""
    frames = _frames()
    worlds = {"D": frames, "D2": {**frames, "c0": pd.concat([frames["c0"], UNKNOWN], ignore_index=True)}}
    data = {}
    for world, tables in worlds.items():
        with pytest.raises(_Stop):
            main(_run(_write(tmp_path / world, tables), "0,1,unknown"))
        capsys.readouterr()
        data[world] = prepared[-1]
    _assert_differ_by_at_most(data["D"], data["D2"], [0.5] * 4)
    assert 0 < len(data["D"].test) < 0.5 * 450


def test_federate_a_text_label_added_moves_no_other_records_coin(prepared):
    """The same through ``privfl.federate`` on DataFrames (classes declared, no test=)."""
    from torch import nn

    import privfl

    frames = _frames(1)
    worlds = {"D": frames, "D2": {**frames, "c0": pd.concat([frames["c0"], UNKNOWN], ignore_index=True)}}
    data = {}
    for world, clients in worlds.items():
        with pytest.raises(_Stop):
            privfl.federate(nn.Linear(4, 3), clients, target="y", algorithm="dpsgd_fedavg", epsilon=3.0,
                            classes=[0, 1, "unknown"], client_size=100, rounds=1)
        data[world] = prepared[-1]
    _assert_differ_by_at_most(data["D"], data["D2"], [0.5] * 4)


def test_a_numeric_label_columns_coins_are_unchanged():
    """The coin of an all-numeric label column is what it was when labels were hashed by the column's dtype (float64
    bytes of the column): committed runs' splits stay as they were (a guard: this held before the fix too)."""
    from privfl.data.own import holdout_mask

    rng = np.random.default_rng(3)
    x = rng.normal(size=(400, 4)).astype(np.float32)
    for y in (rng.integers(0, 3, 400), rng.integers(0, 2, 400).astype(bool), rng.normal(size=400),
              rng.normal(size=(400, 2)).astype(np.float32)):
        key = hashlib.blake2b(b"privfl-holdout-split:5", digest_size=32).digest()
        labels = np.ascontiguousarray(np.asarray(y).astype(np.float64).reshape(len(y), -1))
        expected = []
        for row, label in zip(x, labels):
            digest = hashlib.blake2b(row.tobytes(), key=key, digest_size=8)
            digest.update(b"\x00label\x00" + label.tobytes())
            expected.append((int.from_bytes(digest.digest(), "big") >> 11) * 2.0 ** -53 < 0.3)
        np.testing.assert_array_equal(holdout_mask(x, y, 0.3, 5), expected)


def test_a_labels_coin_is_its_value_whatever_the_columns_dtype():
    """The same labels as integers, text, text written 1.0, objects or float32 get the same coins."""
    from privfl.data.own import holdout_mask

    rng = np.random.default_rng(3)
    x = rng.normal(size=(400, 4)).astype(np.float32)
    y = rng.integers(0, 2, 400)
    mask = holdout_mask(x, y, 0.3, 5)
    for same in (y.astype(str), np.array([f"{v}.0" for v in y]), y.astype(object), y.astype(np.float32)):
        np.testing.assert_array_equal(holdout_mask(x, same, 0.3, 5), mask)


def test_privfl_run_a_label_written_1_0_is_the_class_1(tmp_path, prepared, capsys):
    """``--classes 0,1`` and one of c0's labels written ``1.0`` (pandas then reads c0's column as floats): the record
    is class 1, as on D where it is written ``1``; D' is prepared exactly as D. The review saw D' refused with a text
    counting all 150 of c0's records."""
    frames = _frames(2)
    odd = frames["c0"].copy()
    odd["y"] = odd["y"].astype(str)
    first = odd.index[odd["y"] == "1"][0]
    odd.loc[first, "y"] = "1.0"
    data = {}
    for world, tables in (("D", frames), ("D2", {**frames, "c0": odd})):
        with pytest.raises(_Stop):
            main(_run(_write(tmp_path / world, tables), "0,1"))
        capsys.readouterr()
        data[world] = prepared[-1]
    for k in range(3):
        np.testing.assert_array_equal(data["D"].train_parts[k].x, data["D2"].train_parts[k].x)
        np.testing.assert_array_equal(data["D"].train_parts[k].y, data["D2"].train_parts[k].y)
    np.testing.assert_array_equal(data["D"].test.y, data["D2"].test.y)


def test_federate_float_labels_match_the_declared_classes(prepared):
    """``privfl.federate(..., classes=[0, 1])`` where one client's label column holds 0.0/1.0: matched by value, and a
    classification (declared classes), prepared as with integer labels."""
    from torch import nn

    import privfl

    frames = _frames(4)
    data = []
    for clients in (frames, {**frames, "c1": frames["c1"].assign(y=frames["c1"]["y"].astype(float))}):
        with pytest.raises(_Stop):
            privfl.federate(nn.Linear(4, 2), clients, target="y", algorithm="dpsgd_fedavg", epsilon=3.0,
                            classes=[0, 1], client_size=100, rounds=1)
        data.append(prepared[-1])
    assert data[1].test.task == "classification"
    for k in range(3):
        np.testing.assert_array_equal(data[0].train_parts[k].y, data[1].train_parts[k].y)


def test_a_label_outside_the_classes_is_refused_without_a_count(tmp_path, capsys):
    """One or two of c0's records carry an undeclared label: the same text either way (no count of records, no
    value), through ``privfl run --data`` and ``privfl.federate``."""
    from torch import nn

    import privfl
    from privfl.errors import ConfigurationError

    texts, api_texts = [], []
    for world, bad in (("D", 1), ("D2", 2)):
        frames = _frames(5)
        c0 = frames["c0"].assign(y=frames["c0"]["y"].astype(object))
        c0.loc[: bad - 1, "y"] = 7
        frames["c0"] = c0
        assert main(_run(_write(tmp_path / world, frames), "0,1")) == 2
        err = capsys.readouterr().err
        assert "outside the declared label set" in err and "Traceback" not in err
        texts.append(err)
        with pytest.raises(ConfigurationError) as excinfo:
            privfl.federate(nn.Linear(4, 2), frames, target="y", algorithm="dpsgd_fedavg", epsilon=3.0,
                            classes=[0, 1], client_size=100, rounds=1)
        assert "outside classes=" in str(excinfo.value)
        api_texts.append(str(excinfo.value))
    assert texts[0] == texts[1] and api_texts[0] == api_texts[1]
    assert "150" not in texts[0] and " 1 record" not in texts[0] and "7" not in texts[0].split("set")[-1]


def test_two_declared_classes_of_one_value_are_refused(tmp_path, capsys):
    """``--classes 1,1.0``: two names of one value (labels are matched by value) are refused up front."""
    frames = _frames(6)
    assert main(_run(_write(tmp_path / "D", frames), "0,1,1.0")) == 2
    err = capsys.readouterr().err
    assert "same value" in err and "Traceback" not in err
