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
