"""Own data at the user's entry points (``privfl run --data``, ``privfl.federate``): what a run publishes, and what
its refusals say, must not follow one client's record. Each test starts where a user starts and compares D with a
neighbour D'."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from privfl.apps.cli import main

FEATURES = ("a", "b", "c")


def _frame(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, len(FEATURES)))
    frame = pd.DataFrame(x, columns=list(FEATURES))
    frame["y"] = (x[:, 0] > 0).astype(np.int64)
    return frame


def _write_clients(folder, frames: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for name, frame in frames.items():
        frame.to_csv(folder / f"{name}.csv", index=False)
    return str(folder / "*.csv")


def _base_frames() -> dict:
    return {name: _frame(30, k) for k, name in enumerate(("alpha", "beta", "gamma"))}


# -- 5. a label outside the declared set: the refusal names no value ---------------------------------------------------

def test_an_undeclared_label_is_refused_without_echoing_it(tmp_path, capsys):
    """``privfl run --data --classes 0,1`` where one of alpha's records carries a label outside the set: exit 2 with a
    text that says what to change (neither how many records nor which value), the same whichever value the record
    carries."""
    errors = []
    for world, label in (("D", "zebra"), ("D2", "31337")):
        frames = _base_frames()
        frames["alpha"]["y"] = frames["alpha"]["y"].astype(object)
        frames["alpha"].loc[4, "y"] = label
        data = _write_clients(tmp_path / world, frames)
        code = main(["run", "--algorithm", "dpsgd_fedavg", "--epsilon", "1", "--data", data, "--target", "y",
                     "--classes", "0,1", "--client-size", "24", "--rounds", "1", "--standardize", "none",
                     "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err
        assert label not in err
        assert "records whose label is outside the declared label set" in err and "--classes" in err
        assert "1 record" not in err  # no count either: it is the client's data
        errors.append(err)
    assert errors[0] == errors[1]


# -- 1. the held-out split: each record's own coin ---------------------------------------------------------------------

class _Stop(BaseException):
    """Raised once a run is prepared (nothing charged): the entry point goes no further."""


@pytest.fixture
def prepared(monkeypatch):
    """Simulation.prepare records the run's data and stops the entry point there."""
    from privfl.runtime.engine import Simulation

    seen: list = []
    original = Simulation.prepare

    def prepare(self):
        original(self)
        seen.append(self.data)
        raise _Stop

    monkeypatch.setattr(Simulation, "prepare", prepare)
    return seen


def _rows(x) -> set:
    return {tuple(float(v) for v in np.round(r, 5)) for r in np.asarray(x, dtype=np.float32)}


def _neighbours() -> dict:
    """D; D' without alpha's record 7 (add/remove); D'' with it replaced (replace-one)."""
    base = _base_frames()
    removed = {k: v.copy() for k, v in base.items()}
    removed["alpha"] = base["alpha"].drop(index=7).reset_index(drop=True)
    replaced = {k: v.copy() for k, v in base.items()}
    replaced["alpha"].loc[7, list(FEATURES)] = [3.0, -3.0, 3.0]
    return {"D": base, "D-removed": removed, "D-replaced": replaced}


def _assert_only_that_record_moves(data: dict, base: dict) -> None:
    changed = _rows(np.array([base["alpha"].loc[7, list(FEATURES)].to_numpy(np.float32), [3.0, -3.0, 3.0]],
                             dtype=np.float32))
    d = data["D"]
    for world in ("D-removed", "D-replaced"):
        other = data[world]
        for k in range(3):
            assert _rows(d.train_parts[k].x) ^ _rows(other.train_parts[k].x) <= changed, (world, k)
        assert _rows(d.test.x) ^ _rows(other.test.x) <= changed, world
    held = len(d.test) / sum(len(frame) for frame in base.values())
    assert 0 < held < 0.5  # about the 0.2 asked for (90 records)


def test_privfl_run_data_split_moves_only_the_neighbouring_record(tmp_path, prepared, capsys):
    worlds = _neighbours()
    data = {}
    for world, frames in worlds.items():
        files = _write_clients(tmp_path / world, frames)
        with pytest.raises(_Stop):
            main(["run", "--algorithm", "dpsgd_fedavg", "--epsilon", "1", "--data", files, "--target", "y",
                  "--classes", "0,1", "--client-size", "24", "--rounds", "1", "--standardize", "none", "--quiet"])
        capsys.readouterr()
        data[world] = prepared[-1]
    _assert_only_that_record_moves(data, worlds["D"])


def test_federate_split_moves_only_the_neighbouring_record(prepared):
    from torch import nn

    import privfl

    worlds = _neighbours()
    data = {}
    for world, frames in worlds.items():
        clients = {k: (v[list(FEATURES)].to_numpy(np.float32), v["y"].to_numpy()) for k, v in frames.items()}
        with pytest.raises(_Stop):
            privfl.federate(nn.Linear(3, 2), clients, algorithm="dpsgd_fedavg", epsilon=1.0, rounds=1,
                            client_size=24, batch_size=8, classes=[0, 1])
        data[world] = prepared[-1]
    _assert_only_that_record_moves(data, worlds["D"])
    # identical rows get the same coin: a client holding a record twice holds both out or neither
    from privfl.data.own import holdout_mask

    x = np.repeat(worlds["D"]["alpha"][list(FEATURES)].to_numpy(np.float32), 2, axis=0)
    y = np.repeat(worlds["D"]["alpha"]["y"].to_numpy(), 2)
    mask = holdout_mask(x, y, 0.2, 0)
    np.testing.assert_array_equal(mask[0::2], mask[1::2])


# -- 2. FedBNN's alignment set is never the clients' held-out records --------------------------------------------------

def test_federate_fedbnn_without_a_test_set_is_refused_before_anything_is_charged(tmp_path):
    """Without ``test=`` FedBNN fell back to the test set, the clients' pooled held-out records, as its public
    alignment set: one client's records reached every upload's inputs. Refused, naming ``test=``, on D and D' alike,
    with no ledger written; with ``test=`` (data no client holds) the same call is accepted."""
    from torch import nn

    import privfl
    from privfl.errors import ConfigurationError

    texts = []
    for world, frames in _neighbours().items():
        clients = {k: (v[list(FEATURES)].to_numpy(np.float32), v["y"].to_numpy()) for k, v in frames.items()}
        ledger = tmp_path / f"{world}.sqlite"
        with pytest.raises(ConfigurationError) as excinfo:
            privfl.federate(lambda: nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)), clients,
                            algorithm="fedbnn", epsilon=1.0, rounds=1, client_size=24, classes=[0, 1],
                            warmup_epochs=1, prior_steps=1, mc_samples=1, alignment_size=6, ledger=str(ledger))
        assert "test=" in str(excinfo.value) and "alignment" in str(excinfo.value)
        assert not ledger.exists()
        texts.append(str(excinfo.value))
    assert len(set(texts)) == 1


def test_the_data_says_when_its_test_set_is_the_clients_records(tmp_path, prepared, capsys):
    """``FederatedData.test_from_clients``: True where the test set is the clients' held-out records (an algorithm
    carving a public set from the test set must refuse it), False where the user gave a test set."""
    from torch import nn

    import privfl

    frames = _base_frames()
    clients = {k: (v[list(FEATURES)].to_numpy(np.float32), v["y"].to_numpy()) for k, v in frames.items()}
    test = _frame(20, 9)
    for given, expected in ((None, True), ((test[list(FEATURES)].to_numpy(np.float32), test["y"].to_numpy()), False)):
        with pytest.raises(_Stop):
            privfl.federate(nn.Linear(3, 2), clients, algorithm="dpsgd_fedavg", epsilon=1.0, rounds=1,
                            client_size=24, batch_size=8, classes=[0, 1], test=given)
        assert prepared[-1].test_from_clients is expected
    files = _write_clients(tmp_path / "D", frames)
    test.to_csv(tmp_path / "test.csv", index=False)
    for extra, expected in (([], True), (["--test-data", str(tmp_path / "test.csv")], False)):
        with pytest.raises(_Stop):
            main(["run", "--algorithm", "dpsgd_fedavg", "--epsilon", "1", "--data", files, "--target", "y",
                  "--classes", "0,1", "--client-size", "24", "--rounds", "1", "--standardize", "none", "--quiet",
                  *extra])
        capsys.readouterr()
        assert prepared[-1].test_from_clients is expected


# -- 3. a private run's classes: declared, or the test set's, never a client's labels ---------------------------------

def _one_positive(label: int) -> dict:
    """Three clients whose labels are all 0 except client a's record 0, which is ``label`` (replace-one)."""
    rng = np.random.default_rng(2)
    base = {n: (rng.normal(size=(30, 3)).astype(np.float32), np.zeros(30, dtype=np.int64)) for n in ("a", "b", "c")}
    base["a"][1][0] = label
    return base


def test_federate_private_run_is_refused_or_run_alike_whatever_one_label(prepared):
    """A 2-output model over clients whose only positive is one record: whether a private run was refused depended
    on that record's label (the width was checked against the clients' labels). Without classes= or test= it is
    refused on both with the same text naming classes=; with test= both are prepared alike."""
    from torch import nn

    import privfl
    from privfl.errors import ConfigurationError

    texts = []
    for label in (1, 0):
        with pytest.raises(ConfigurationError) as excinfo:
            privfl.federate(nn.Linear(3, 2), _one_positive(label), algorithm="dpsgd_fedavg", epsilon=1.0, rounds=1,
                            client_size=24, batch_size=8)
        texts.append(str(excinfo.value))
    assert texts[0] == texts[1] and "classes=" in texts[0] and "test=" in texts[0]
    test = (np.random.default_rng(5).normal(size=(20, 3)).astype(np.float32), np.arange(20) % 2)
    for label in (1, 0):
        for kw in ({"test": test}, {"classes": [0, 1]}):
            with pytest.raises(_Stop):
                privfl.federate(nn.Linear(3, 2), _one_positive(label), algorithm="dpsgd_fedavg", epsilon=1.0,
                                rounds=1, client_size=24, batch_size=8, **kw)
            assert prepared[-1].num_classes == 2
    # a test set whose labels use fewer classes than the model's outputs is refused, on both, from its labels alone
    texts = []
    for label in (1, 0):
        with pytest.raises(ConfigurationError) as excinfo:
            privfl.federate(nn.Linear(3, 2), _one_positive(label), algorithm="dpsgd_fedavg", epsilon=1.0, rounds=1,
                            client_size=24, batch_size=8, test=(test[0], np.zeros(20, dtype=np.int64)))
        texts.append(str(excinfo.value))
    assert texts[0] == texts[1] and "labels of the test data lie in 0..0" in texts[0]
    # a non-private run claims nothing and may still read every label for this check
    with pytest.raises(ConfigurationError, match="every client and the test data lie in 0..0"):
        privfl.federate(nn.Linear(3, 2), _one_positive(0), algorithm="fedavg", rounds=1)


# -- 4. --client-column: the roster is declared, never found in the rows ---------------------------------------------

def _one_file(folder, extra_rows: list[tuple[object, int]] = ()) -> str:
    """all.csv: 30 rows for each of the sites a, b, c (column ``site``), plus ``extra_rows`` (site, seed) rows."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = [_frame(30, k).assign(site=name) for k, name in enumerate(("a", "b", "c"))]
    parts += [_frame(1, 100 + seed).assign(site=site) for site, seed in extra_rows]
    pd.concat(parts, ignore_index=True).to_csv(folder / "all.csv", index=False)
    return str(folder / "all.csv")


def _run_column(path, *extra, epsilon="1"):
    return main(["run", "--algorithm", "dpsgd_fedavg" if epsilon != "inf" else "fedavg", "--epsilon", epsilon,
                 "--data", path, "--client-column", "site", "--target", "y", "--classes", "0,1", "--client-size",
                 "24", "--rounds", "1", "--standardize", "none", "--quiet", *extra])


def test_privfl_run_client_column_roster_is_declared(tmp_path, prepared, capsys):
    """One record with a new site value added a client: the client count, order and run id followed the data.
    A private run now needs --client-names (refused alike on D and D' without it); with it the roster, its order and
    the run id are the declaration's, a row of another site is refused without echoing its value, and a row of a
    declared site changes neither."""
    worlds = {"D": _one_file(tmp_path / "D"),
              "D-new-site": _one_file(tmp_path / "D-new-site", [("zz-secret-site", 1)]),
              "D-more-b": _one_file(tmp_path / "D-more-b", [("b", 2)])}
    texts = []
    for world in ("D", "D-new-site"):
        assert _run_column(worlds[world]) == 2
        err = capsys.readouterr().err
        assert "--client-names" in err and "Traceback" not in err
        texts.append(err)
    assert texts[0] == texts[1]
    seen = {}
    for world in ("D", "D-more-b"):
        with pytest.raises(_Stop):
            _run_column(worlds[world], "--client-names", "c,a,b")
        capsys.readouterr()
        data = prepared[-1]
        seen[world] = (data.info["clients"], data.n_clients)
        assert data.info["clients"] == ["c", "a", "b"] and data.n_clients == 3
    assert seen["D"] == seen["D-more-b"]
    assert _run_column(worlds["D-new-site"], "--client-names", "c,a,b") == 2
    err = capsys.readouterr().err
    assert "--client-names" in err and "zz-secret-site" not in err and "Traceback" not in err


def test_the_run_id_and_json_name_the_declared_roster(tmp_path, capsys, monkeypatch):
    import json

    ids = []
    for world, extra in (("D", []), ("D-more-b", [("b", 2)])):
        _one_file(tmp_path / world, extra)
        monkeypatch.chdir(tmp_path / world)  # the same relative path: the run id hashes the settings, paths included
        out = tmp_path / f"{world}.json"
        assert _run_column("all.csv", "--client-names", "a,b,c", "--json", str(out)) == 0, capsys.readouterr().err
        result = json.loads(out.read_text())
        assert result["clients"] == 3 and result["settings"]["data"]["client_names"] == ["a", "b", "c"]
        ids.append(result["run_id"])
    assert ids[0] == ids[1]


def test_a_row_without_a_client_is_an_error_never_dropped(tmp_path, capsys):
    path = _one_file(tmp_path / "D")
    frame = pd.read_csv(path)
    frame.loc[5, "site"] = None
    frame.to_csv(path, index=False)
    for args in (("--client-names", "a,b,c"), ()):
        assert _run_column(path, *args, epsilon="1" if args else "inf") == 2
        err = capsys.readouterr().err
        assert "empty in some rows" in err and "--client-column 'site'" in err and "Traceback" not in err


def test_a_non_private_run_may_still_find_its_clients(tmp_path, prepared, capsys):
    with pytest.raises(_Stop):
        _run_column(_one_file(tmp_path / "D"), epsilon="inf")
    capsys.readouterr()
    assert prepared[-1].info["clients"] == ["a", "b", "c"]
    assert main(["run", "--algorithm", "fedavg", "--epsilon", "inf", "--data", str(tmp_path / "D" / "all.csv"),
                 "--target", "y", "--client-names", "a,b,c", "--quiet"]) == 2
    assert "--client-names declares the clients of one file split by --client-column" in capsys.readouterr().err


# -- 6. the clients' held-out records never decide how many rounds are released ---------------------------------------

def _charges(path) -> list:
    """The ledger's rows as the server's bookkeeping sees them (client, round, channel, event, unit, released)."""
    import sqlite3

    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT client_id, round, channel, event, unit, released FROM charges "
                            "ORDER BY round, client_id, channel").fetchall()


def _held_out_record(make, seed: int = 0):
    """The first record ``make(k)`` gives whose public coin (seed ``seed``) says "held out"."""
    from privfl.data.own import holdout_mask

    for k in range(1000):
        x, y = make(k)
        if holdout_mask(x, y, 0.2, seed)[0]:
            return x, y
    raise AssertionError("no held-out record found")


def test_federate_a_held_out_record_does_not_stop_a_private_run(tmp_path):
    """The reviewer's pair: D' adds to client a one extreme but finite record that its coin holds out (never trained
    on, never charged). The held-out records' RMSE used to stop D' after round 1 (TrainingDiverged, its text quoting
    the held-out RMSE and target spread) while D ran its rounds: now both run the same rounds and write the same
    ledger rows."""
    import torch
    from torch import nn

    import privfl

    rng = np.random.default_rng(1)

    def client(n):
        x = rng.normal(size=(n, 4)).astype(np.float32)
        return x, (x @ np.array([1.0, -0.5, 0.3, 0.0]) + 0.1 * rng.normal(size=n)).astype(np.float32)

    d = {"a": client(60), "b": client(60)}
    extreme = _held_out_record(lambda k: (np.full((1, 4), 1e4 + k, dtype=np.float32), np.zeros(1, np.float32)))
    d2 = {"a": (np.concatenate([d["a"][0], extreme[0]]), np.concatenate([d["a"][1], extreme[1]])), "b": d["b"]}
    seen = []
    for world, clients in (("D", d), ("D2", d2)):
        torch.manual_seed(0)
        ledger = tmp_path / f"{world}.sqlite"
        result = privfl.federate(nn.Linear(4, 1), clients, algorithm="dpsgd_fedavg", epsilon=3.0, task="regression",
                                 client_size=40, rounds=3, seed=0, lr=0.05, ledger=str(ledger), run_id="r")
        seen.append((len(result.history), result.audit_rows, _charges(ledger)))
    assert seen[0][0] == 3 and seen[0] == seen[1]


def test_privfl_run_a_held_out_record_does_not_stop_a_private_run(tmp_path, capsys):
    """The same through ``privfl run --data``: client a's added record (held out by its coin) has finite features
    large enough that the global model's predictions on it overflow; D' used to exit 2 after round 1."""
    import json

    rng = np.random.default_rng(0)
    frames = {}
    for name in ("a", "b"):
        x = rng.normal(size=(50, 3))
        frames[name] = pd.DataFrame(x, columns=["f0", "f1", "f2"]).assign(y=(x[:, 0] > 0).astype(int))
    rec, _ = _held_out_record(lambda k: (np.full((1, 3), 3e38 - k * 1e31, dtype=np.float32), np.array([1])))
    extra = pd.DataFrame({f"f{i}": rec[:, i].astype(float) for i in range(3)}).assign(y=[1])
    seen = []
    for world, a in (("D", frames["a"]), ("D2", pd.concat([frames["a"], extra]))):
        folder = tmp_path / world
        folder.mkdir()
        a.to_csv(folder / "a.csv", index=False, float_format="%.9g")
        frames["b"].to_csv(folder / "b.csv", index=False, float_format="%.9g")
        ledger, out = tmp_path / f"{world}.sqlite", tmp_path / f"{world}.json"
        code = main(["run", "--data", str(folder / "a.csv"), str(folder / "b.csv"), "--target", "y", "--classes",
                     "0,1", "--algorithm", "dpsgd_fedavg", "--epsilon", "3", "--client-size", "40", "--rounds", "3",
                     "--standardize", "none", "--seed", "0", "--quiet", "--ledger", str(ledger), "--run-id", "r",
                     "--json", str(out)])
        err = capsys.readouterr().err
        assert code == 0, err
        result = json.loads(out.read_text())
        seen.append((len(result["epsilon_spent_per_round"]), result["epsilon_spent_per_round"], _charges(ledger)))
    assert seen[0][0] == 3 and seen[0] == seen[1]


def _split_records(n: int, held: bool, rng) -> tuple[np.ndarray, np.ndarray]:
    """``n`` records whose coin (seed 0) puts them all in training (``held`` False) or all held out."""
    from privfl.data.own import holdout_mask

    xs, ys = [], []
    while len(xs) < n:
        x, y = rng.normal(size=(1, 3)).astype(np.float32), np.array([len(xs) % 2])
        if holdout_mask(x, y, 0.2, 0)[0] == held:
            xs.append(x)
            ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


@pytest.mark.filterwarnings("ignore:the final model predicts one class")
def test_an_empty_held_out_set_is_not_evaluated(tmp_path, capsys):
    """No record held out (D) against one record held out (D'): D used to crash in round 1's evaluation after the
    round was charged (``torch.cat(): expected a non-empty list``). Both now run their rounds and write the same
    ledger rows, through ``privfl.federate`` and ``privfl run --data``; D has no test metrics."""
    from torch import nn

    import privfl

    rng = np.random.default_rng(3)
    a, b, h = _split_records(4, False, rng), _split_records(4, False, rng), _split_records(1, True, rng)
    worlds = {"D": {"a": a, "b": b}, "D2": {"a": (np.concatenate([a[0], h[0]]), np.concatenate([a[1], h[1]])),
                                            "b": b}}
    seen = {}
    for world, clients in worlds.items():
        ledger = tmp_path / f"{world}.sqlite"
        result = privfl.federate(nn.Linear(3, 2), clients, algorithm="dpsgd_fedavg", epsilon=3.0, classes=[0, 1],
                                 client_size=4, rounds=2, seed=0, ledger=str(ledger), run_id="r")
        seen[world] = (len(result.history), _charges(ledger))
        folder = tmp_path / f"{world}-csv"
        folder.mkdir()
        for name, (x, y) in clients.items():
            pd.DataFrame(x.astype(float), columns=["f0", "f1", "f2"]).assign(y=y).to_csv(
                folder / f"{name}.csv", index=False, float_format="%.9g")
        cli_ledger = tmp_path / f"{world}-cli.sqlite"
        code = main(["run", "--data", str(folder / "a.csv"), str(folder / "b.csv"), "--target", "y", "--classes",
                     "0,1", "--algorithm", "dpsgd_fedavg", "--epsilon", "3", "--client-size", "4", "--rounds", "2",
                     "--standardize", "none", "--seed", "0", "--quiet", "--ledger", str(cli_ledger), "--run-id", "r"])
        out = capsys.readouterr()
        assert code == 0, out.err
        seen[world] += (_charges(cli_ledger),)
        if world == "D":
            assert result.history[-1]["metrics"] == {} and "no test records to evaluate" in out.out
    assert seen["D"][0] == 2 and seen["D"] == seen["D2"]


# -- 7. declared record counts need a test set no client holds ---------------------------------------------------------

def _replace_one_pair():
    """Client a's training record replaced by an ordinary record whose coin (seed 0) says "held out": 50 rows each."""
    from privfl.data.own import holdout_mask

    rng = np.random.default_rng(0)
    frames = {}
    for name in ("a", "b"):
        x = rng.normal(size=(50, 3)).round(6)
        frames[name] = pd.DataFrame(x, columns=["f0", "f1", "f2"]).assign(y=(x[:, 0] > 0).astype(int))
    a = frames["a"]
    keep = ~holdout_mask(a[["f0", "f1", "f2"]].to_numpy(np.float32), a["y"].to_numpy(), 0.2, 0)
    i = int(np.flatnonzero(keep)[0])
    new, _ = _held_out_record(lambda k: (lambda r: (r, np.array([int(r[0, 0] > 0)])))(
        rng.normal(size=(1, 3)).round(6).astype(np.float32)))
    a2 = a.copy()
    a2.loc[i, ["f0", "f1", "f2"]] = new[0].astype(float)
    a2.loc[i, "y"] = int(new[0, 0] > 0)
    return {"D": frames, "D2": {"a": a2, "b": frames["b"]}}


def test_privfl_run_replace_one_with_a_held_out_split_is_refused(tmp_path, prepared, capsys):
    """``--adjacency replace_one`` at record level declared each client's training count public after the held-out
    coin: replacing a training record by one the coin holds out moved client a's count (43 -> 42), so its sampling
    rate, noise and release weight. Refused now (exit 2, the same text on D and D', naming --test-data, nothing
    charged); with --test-data the counts are the same on both."""
    test = _frame(20, 9).rename(columns={"a": "f0", "b": "f1", "c": "f2"})
    test.to_csv(tmp_path / "test.csv", index=False)
    texts, sizes = [], []
    for world, frames in _replace_one_pair().items():
        folder = tmp_path / world
        folder.mkdir()
        for name, frame in frames.items():
            frame.to_csv(folder / f"{name}.csv", index=False)
        argv = ["run", "--data", str(folder / "a.csv"), str(folder / "b.csv"), "--target", "y", "--classes", "0,1",
                "--algorithm", "dpsgd_fedavg", "--epsilon", "3", "--adjacency", "replace_one", "--rounds", "1",
                "--standardize", "none", "--seed", "0", "--quiet"]
        ledger = tmp_path / f"{world}.sqlite"
        assert main([*argv, "--ledger", str(ledger)]) == 2
        err = capsys.readouterr().err
        assert "--test-data" in err and "Traceback" not in err and not ledger.exists()
        texts.append(err)
        with pytest.raises(_Stop):
            main([*argv, "--test-data", str(tmp_path / "test.csv")])
        capsys.readouterr()
        sizes.append(tuple(len(p) for p in prepared[-1].train_parts))
    assert texts[0] == texts[1]
    assert sizes[0] == sizes[1] == (50, 50)


def test_python_api_and_compare_replace_one_with_a_held_out_split_are_refused(tmp_path, capsys):
    """The same refusal through the Python API (``privfl.Simulation`` over the own-data loader's federation, which
    ``privfl.federate`` and ``privfl run`` share; ``federate`` itself takes no ``adjacency``: its runs keep counts
    private) and a compare TOML whose ``[overrides]`` declare the counts for one algorithm: refused before any run
    of the grid charges anything."""
    import privfl
    from privfl.data.own import federated_from_tables
    from privfl.errors import ConfigurationError

    assert "adjacency" not in privfl.federate.__code__.co_varnames  # federate cannot declare counts public
    texts = []
    for world, frames in _replace_one_pair().items():
        data = federated_from_tables(frames, "y", classes=[0, 1], seed=0)
        fed = privfl.FederationConfig(rounds=1, hidden=())
        privacy = privfl.PrivacyConfig(epsilon=3.0, unit="example", adjacency="replace_one")
        ledger = tmp_path / f"{world}.sqlite"
        with pytest.raises(ConfigurationError) as excinfo:
            privfl.Simulation(privfl.make_algorithm("dpsgd_fedavg", fed, privacy), data, fed, privacy,
                              ledger_path=str(ledger)).run()
        assert "test=" in str(excinfo.value) and not ledger.exists()
        texts.append(str(excinfo.value))
    assert texts[0] == texts[1]
    folder = tmp_path / "D"
    folder.mkdir()
    for name, frame in _replace_one_pair()["D"].items():
        frame.to_csv(folder / f"{name}.csv", index=False)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'data = "D/*.csv"\ntarget = "y"\nclasses = [0, 1]\nepsilons = [3.0]\nseeds = [0]\nrounds = 1\n'
                   f'client_size = 40\nalgorithms = ["dp_fedavg", "dpsgd_fedavg"]\nout_dir = "{tmp_path / "out"}"\n'
                   '[overrides.dpsgd_fedavg]\nadjacency = "replace_one"\n')
    assert main(["compare", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "test_data =" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "ledgers").exists()


# -- 8. a regression target or label that is not a number: the text names neither a count nor the value -------------

def test_a_target_that_is_not_a_number_is_refused_without_echoing_it(tmp_path, capsys):
    texts = []
    for world, value in (("D", "MRN-0042-SMITH"), ("D2", "MRN-0043-JONES")):
        folder = tmp_path / world
        folder.mkdir()
        rng = np.random.default_rng(0)
        for name in ("a", "b"):
            x = rng.normal(size=(40, 3))
            frame = pd.DataFrame(x, columns=["f0", "f1", "f2"]).assign(y=x[:, 0])
            if name == "a":
                frame = pd.concat([frame, pd.DataFrame({"f0": [0.1], "f1": [0.2], "f2": [0.3], "y": [value]})])
            frame.to_csv(folder / f"{name}.csv", index=False)
        code = main(["run", "--data", str(folder / "a.csv"), str(folder / "b.csv"), "--target", "y", "--task",
                     "regression", "--algorithm", "dpsgd_fedavg", "--epsilon", "3", "--client-size", "30",
                     "--rounds", "1", "--standardize", "none", "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err
        assert "MRN" not in err and "records whose regression target is not a number" in err
        assert "1 record" not in err  # no count either: it is the client's data
        texts.append(err)
    assert texts[0] == texts[1]


def test_federated_from_arrays_label_outside_the_classes_is_not_echoed():
    from privfl.data import federated_from_arrays
    from privfl.data.errors import DatasetError

    rng = np.random.default_rng(0)
    xa, xb = rng.normal(size=(40, 3)).astype(np.float32), rng.normal(size=(40, 3)).astype(np.float32)
    ya, yb = (xa[:, 0] > 0).astype(np.int64), (xb[:, 0] > 0).astype(np.int64)
    texts = []
    for value in (31337, 99):
        y = ya.copy()
        y[7] = value
        with pytest.raises(DatasetError) as excinfo:
            federated_from_arrays([(xa, y), (xb, yb)], (xb, yb), task="classification", num_classes=2)
        assert str(value) not in str(excinfo.value) and "1 label outside [0, 2)" in str(excinfo.value)
        texts.append(str(excinfo.value))
    assert texts[0] == texts[1]


# -- 9. client level: a client whose data is removed still takes part ---------------------------------------------------

def test_an_empty_client_takes_part_at_client_level_on_every_entry_point(tmp_path, capsys):
    """D: client c holds one record; D': c's data removed (a header-only CSV, no row naming c in the one-file
    layout, an empty array pair). The README says c still takes part contributing zero: per-file CSVs were refused
    (its untyped columns "not numeric"), --client-column crashed in the held-out coin, federate said "client 'c' is
    empty". Now every entry point runs D' as D, c charged alike."""
    from torch import nn

    import privfl

    rng = np.random.default_rng(0)

    def frame(n):
        x = rng.normal(size=(n, 3))
        return pd.DataFrame(x, columns=["f0", "f1", "f2"]).assign(y=(x[:, 0] > 0).astype(int))

    a, b, c = frame(40), frame(40), frame(1)
    common = ["--target", "y", "--classes", "0,1", "--algorithm", "dp_fedavg", "--unit", "client", "--epsilon", "3",
              "--client-size", "30", "--rounds", "1", "--standardize", "none", "--quiet", "--run-id", "r"]
    seen = {}
    for world, cc in (("D", c), ("D2", c.iloc[:0])):
        folder = tmp_path / world
        folder.mkdir()
        for name, f in (("a", a), ("b", b), ("c", cc)):
            f.to_csv(folder / f"{name}.csv", index=False)
        one = folder / "one.csv"
        pd.concat([a.assign(site="a"), b.assign(site="b"), cc.assign(site="c")]).to_csv(one, index=False)
        rows = []
        for layout, argv in (("files", ["--data", *(str(folder / f"{n}.csv") for n in "abc")]),
                             ("column", ["--data", str(one), "--client-column", "site", "--client-names", "a,b,c"])):
            ledger = tmp_path / f"{world}-{layout}.sqlite"
            code = main(["run", *argv, *common, "--ledger", str(ledger)])
            err = capsys.readouterr().err
            assert code == 0, (layout, err)
            rows.append(_charges(ledger))
        clients = {n: (f[["f0", "f1", "f2"]].to_numpy(np.float32), f["y"].to_numpy())
                   for n, f in (("a", a), ("b", b), ("c", cc))}
        ledger = tmp_path / f"{world}-federate.sqlite"
        result = privfl.federate(nn.Linear(3, 2), clients, algorithm="dp_fedavg", epsilon=3.0, classes=[0, 1],
                                 client_size=30, rounds=1, ledger=str(ledger), run_id="r")
        assert sorted({row["client"] for row in result.audit_rows}) == ["a", "b", "c"]
        rows.append(_charges(ledger))
        seen[world] = rows
    assert all({r[0] for r in rows} == {"0", "1", "2"} for rows in seen["D"])
    assert seen["D"] == seen["D2"]
