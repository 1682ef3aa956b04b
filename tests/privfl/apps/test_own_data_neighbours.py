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
    text that says how many records and what to change, the same whichever value the record carries."""
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
        assert "1 record whose label is outside the declared label set" in err and "--classes" in err
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
