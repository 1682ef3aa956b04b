"""Reports whose test set is the clients' own held-out records say their metrics are not covered by epsilon.

Without a test set no client holds, the test set is each client's held-out records, never charged. compare's
``results.json`` published the reliability diagram's per-bin counts (they sum to the held-out set's size: D', one
record added that its public coin holds out, showed exactly +1 with identical ledgers), and every report presented
accuracy, NLL, ECE, ... as a private run's results. Now the published reports keep the metric keys, add
``test_from_clients`` and ``test_metrics_privacy``, drop the per-bin counts, and a private run warns once. Each test
starts where a user starts (a compare TOML, ``privfl run --json``, ``privfl.federate``) on a neighbouring pair."""

from __future__ import annotations

import csv
import json
import warnings

import numpy as np
import pandas as pd
import pytest

from privfl.apps.cli import main
from privfl.apps.held_out import NOTE, WARNING
from privfl.data.own import holdout_mask

FEATURES = ["f0", "f1", "f2", "f3"]


def _parts() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(3):
        x = rng.normal(size=(120, 4)).round(4)
        out.append((x, (x[:, 0] + x[:, 1] > 0).astype(int)))
    return out


def _held_out_record() -> np.ndarray:
    """A record (label 1) whose public coin (seed 0, fraction 0.2) holds it out: it never trains."""
    rng = np.random.default_rng(1)
    while True:
        cand = rng.normal(size=(1, 4)).round(4)
        if holdout_mask(cand, np.array([1]), 0.2, 0)[0]:
            return cand


def _write_clients(folder, extra: bool) -> None:
    (folder / "clients").mkdir(parents=True)
    for k, (x, y) in enumerate(_parts()):
        if extra and k == 0:
            x, y = np.concatenate([x, _held_out_record()]), np.concatenate([y, [1]])
        pd.DataFrame(x, columns=FEATURES).assign(y=y).to_csv(folder / "clients" / f"c{k}.csv", index=False)


def _toml(folder, test_data: bool = False) -> str:
    text = ('data = "clients/*.csv"\ntarget = "y"\nclasses = [0, 1]\nclient_size = 96\nunit = "example"\n'
            'epsilons = [3.0]\nseeds = [0]\nrounds = 1\nalgorithms = ["dpsgd_fedavg"]\n')
    if test_data:
        text += 'test_data = "test.csv"\n'
    (folder / "grid.toml").write_text(text + '[overrides.dpsgd_fedavg]\nhidden = []\n')
    return str(folder / "grid.toml")


def _keys(obj) -> set:
    """Every key of a JSON value, at any depth."""
    if isinstance(obj, dict):
        return set(obj) | set().union(*(_keys(v) for v in obj.values()))
    if isinstance(obj, list):
        return set().union(*(_keys(v) for v in obj))
    return set()


def test_compare_on_held_out_records_publishes_no_counts_and_marks_its_metrics(tmp_path, capsys):
    """D and D' (one added record held out by its coin) through a compare TOML without test_data: results.json,
    results.csv and runs/<key>.json carry the accuracy/NLL/ECE keys with test_from_clients and the note, the
    reliability diagram has no per-bin counts (the review read the held-out size off them: 72 on D, 73 on D'), and the
    warning is printed once."""
    for world, extra in (("D", False), ("D2", True)):
        folder = tmp_path / world
        _write_clients(folder, extra)
        out = folder / "out"
        assert main(["compare", _toml(folder), "--out-dir", str(out), "--quiet"]) == 0
        err = capsys.readouterr().err
        assert err.count(WARNING) == 1
        row = json.loads((out / "results.json").read_text())["results"][0]
        for key in ("accuracy", "nll", "ece", "final", "epsilon_spent_max"):  # tools read these keys
            assert key in row
        assert row["test_from_clients"] is True and row["test_metrics_privacy"] == NOTE
        assert "count" not in row["reliability"] and "confidence" in row["reliability"]
        assert "count" not in _keys(row)
        (run_file,) = (out / "runs").glob("*.json")
        saved = json.loads(run_file.read_text())
        assert saved["test_from_clients"] is True and "count" not in saved["reliability"]
        with open(out / "results.csv") as f:
            (line,) = list(csv.DictReader(f))
        assert line["test_from_clients"] == "True" and line["test_metrics_privacy"] == NOTE
        assert "accuracy" in line and "nll" in line
        assert (out / "reliability.png").exists()


def test_compare_with_test_data_keeps_its_counts_and_no_mark(tmp_path, capsys):
    """With test_data (no client's records) nothing changes: the counts stay, no mark, no warning."""
    folder = tmp_path / "D"
    _write_clients(folder, False)
    x, y = _parts()[0]
    pd.DataFrame(x[:40], columns=FEATURES).assign(y=y[:40]).to_csv(folder / "test.csv", index=False)
    out = folder / "out"
    assert main(["compare", _toml(folder, test_data=True), "--out-dir", str(out), "--quiet"]) == 0
    assert WARNING not in capsys.readouterr().err
    row = json.loads((out / "results.json").read_text())["results"][0]
    assert "test_from_clients" not in row and sum(row["reliability"]["count"]) == 40


def _run(folder, *extra) -> list:
    return ["run", "--algorithm", "dpsgd_fedavg", "--epsilon", "3", "--data", str(folder / "clients" / "*.csv"),
            "--target", "y", "--classes", "0,1", "--client-size", "96", "--rounds", "1", "--standardize", "none",
            "--hidden", "", "--quiet", *extra]


def test_privfl_run_json_marks_metrics_on_held_out_records(tmp_path, capsys):
    """``privfl run --json`` without --test-data on D and D': ``final`` and ``accuracy_per_round`` keep their keys,
    the JSON says they are the clients' uncharged held-out records' (test_from_clients, test_metrics_privacy), and
    the warning is printed once; with --test-data neither."""
    for world, extra in (("D", False), ("D2", True)):
        folder = tmp_path / world
        _write_clients(folder, extra)
        out = folder / "run.json"
        assert main(_run(folder, "--json", str(out))) == 0
        assert capsys.readouterr().err.count(WARNING) == 1
        result = json.loads(out.read_text())
        assert "final" in result and "accuracy_per_round" in result and "accuracy" in result
        assert result["test_from_clients"] is True and result["test_metrics_privacy"] == NOTE
    x, y = _parts()[1]
    pd.DataFrame(x[:40], columns=FEATURES).assign(y=y[:40]).to_csv(tmp_path / "test.csv", index=False)
    out = tmp_path / "with_test.json"
    assert main(_run(tmp_path / "D", "--json", str(out), "--test-data", str(tmp_path / "test.csv"))) == 0
    assert WARNING not in capsys.readouterr().err
    assert "test_from_clients" not in json.loads(out.read_text())


def test_federate_on_held_out_records_says_so(tmp_path):
    """``privfl.federate`` without test=: the result says its history's metrics are the clients' held-out records'
    and a private run warns once; with test= neither."""
    from torch import nn

    import privfl

    clients = {f"c{k}": (x.astype(np.float32), y) for k, (x, y) in enumerate(_parts())}
    with pytest.warns(UserWarning, match="not covered by the ledger's epsilon") as caught:
        result = privfl.federate(nn.Linear(4, 2), clients, algorithm="dpsgd_fedavg", epsilon=3.0, classes=[0, 1],
                                 client_size=96, rounds=1)
    assert sum(WARNING in str(w.message) for w in caught) == 1
    assert result.test_from_clients is True and result.test_metrics_privacy == NOTE
    assert "accuracy" in result.history[-1]["metrics"]
    x, y = _parts()[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = privfl.federate(nn.Linear(4, 2), clients, algorithm="dpsgd_fedavg", epsilon=3.0, classes=[0, 1],
                                 client_size=96, rounds=1, test=(x[:40].astype(np.float32), y[:40]))
    assert not any(WARNING in str(w.message) for w in caught)
    assert result.test_from_clients is False and result.test_metrics_privacy is None
