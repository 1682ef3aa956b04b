"""Command-line conventions (issue 28): ``--data clients/*.csv`` as the shell expands it, DP-FedAvg's and
DP-FedSGD's image-only pooling default on tabular data, compare's table header per row, a compare TOML keeping
another algorithm's overrides, and progress lines when stdout is not a terminal."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from privfl.apps.cli import main

REPO = Path(__file__).resolve().parents[3]


def _privfl() -> str:
    """The installed ``privfl`` entry point of the interpreter running the tests."""
    found = Path(sys.executable).parent / "privfl"
    if found.exists():
        return str(found)
    which = shutil.which("privfl")
    if which is None:
        pytest.skip("the privfl entry point is not installed")
    return which


def _write_clients(folder: Path, n_clients: int = 3, rows: int = 50) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for k in range(n_clients):
        x = rng.normal(size=(rows, 4)).astype(np.float32)
        frame = pd.DataFrame(x, columns=["a", "b", "c", "d"])
        frame["y"] = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(int)
        frame.to_csv(folder / f"org{k}.csv", index=False)


# -- --data clients/*.csv, unquoted, through a real shell ------------------------------------------------------------

@pytest.mark.timeout(120)
def test_unquoted_glob_expanded_by_the_shell_is_one_client_per_file(tmp_path):
    _write_clients(tmp_path / "clients")
    command = (f"{_privfl()} run --data clients/*.csv --target y --classes 0,1 --algorithm fedavg --epsilon inf "
               "--rounds 1 --standardize none --quiet --json out.json")
    proc = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "unrecognized arguments" not in proc.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["clients"] == 3
    assert result["settings"]["data"]["data"] == [f"clients/org{k}.csv" for k in range(3)]


def test_quoted_glob_and_explicit_lists_read_the_same_clients(tmp_path, monkeypatch, capsys):
    _write_clients(tmp_path / "clients")
    monkeypatch.chdir(tmp_path)
    base = ["run", "--target", "y", "--classes", "0,1", "--algorithm", "fedavg", "--epsilon", "inf", "--rounds", "1",
            "--standardize", "none", "--quiet"]
    assert main([*base, "--data", "clients/*.csv", "--json", "a.json"]) == 0
    assert main([*base, "--data", "clients/org0.csv", "clients/org1.csv", "clients/org2.csv", "--json", "b.json"]) == 0
    a, b = (json.loads(Path(p).read_text()) for p in ("a.json", "b.json"))
    assert a["settings"]["data"]["data"] == "clients/*.csv"  # one value stays one string (its run id is unchanged)
    assert a["final"] == b["final"]
    # one file is one client: still refused, naming the fix
    assert main([*base, "--data", "clients/org0.csv"]) == 2
    assert "one file per client" in capsys.readouterr().err


# -- DP-FedAvg's and DP-FedSGD's pooling default applies to images only ------------------------------------------------

@pytest.mark.parametrize("algorithm", ["dp_fedavg", "dp_fedsgd"])
def test_pool_default_does_not_stop_a_tabular_run(tmp_path, capsys, algorithm):
    _write_clients(tmp_path / "clients")
    out = tmp_path / "r.json"
    argv = ["run", "--algorithm", algorithm, "--epsilon", "3", "--data", str(tmp_path / "clients" / "*.csv"),
            "--target", "y", "--classes", "0,1", "--rounds", "2", "--standardize", "none", "--client-size", "40",
            "--seeded-noise", "--quiet"]
    assert main([*argv, "--json", str(out)]) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["settings"]["federation"]["pool"] == 1 and result["model"]["pool"] == 1
    assert result["settings"]["federation"]["hidden"] == []  # the algorithm's other defaults still apply
    # a pool the user asks for on tabular data is still checked against the input
    assert main([*argv, "--pool", "2"]) == 2
    assert "needs an image input" in capsys.readouterr().err


def test_pool_default_stays_on_images():
    from privfl.algorithms import algorithm_defaults
    from privfl.apps.compare import CompareConfig, RunSpec, _configs
    from privfl.data.federated import is_image_dataset

    assert is_image_dataset("mnist5k") and is_image_dataset("digits") and not is_image_dataset("diabetes")
    for name in ("dp_fedavg", "dp_fedsgd"):
        assert algorithm_defaults(name)["pool"] == 2 and "pool" not in algorithm_defaults(name, image=False)
        images = CompareConfig(dataset="digits", algorithms=(name,), epsilons=(3.0,), overrides={})
        assert _configs(images, RunSpec(name, 3.0, 0))[0].pool == 2
        tabular = CompareConfig(dataset="diabetes", algorithms=(name,), epsilons=(3.0,), overrides={})
        assert _configs(tabular, RunSpec(name, 3.0, 0))[0].pool == 1


def test_published_comparisons_keep_their_settings():
    """Every committed compare row still hashes to the settings it was run with: the image defaults are unchanged."""
    from privfl.apps.compare import CompareConfig, grid, run_settings, settings_hash

    checked = 0
    for toml, results in (("default.toml", "default_compare"), ("weight_space.toml", "weight_space")):
        path = REPO / "experiments" / "results" / results / "results.json"
        if not path.exists():
            continue
        config = CompareConfig.from_toml(str(REPO / "experiments" / "configs" / toml))
        specs = {s.key: s for s in grid(config)}
        for row in json.loads(path.read_text())["results"]:
            eps = row["epsilon_target"]
            key = f"{row['algorithm']}-eps{'inf' if eps == 'inf' else format(float(eps), 'g')}-seed{row['seed']}"
            assert settings_hash(run_settings(config, specs[key])) == row["config_hash"], key
            checked += 1
    if not checked:
        pytest.skip("no committed comparison results")


# -- compare's table header, per row --------------------------------------------------------------------------------

def _row(algorithm, rounds, eps=3.0):
    return {"algorithm": algorithm, "epsilon_target": eps, "seed": 0, "accuracy": 0.8, "nll": 0.5, "ece": 0.05,
            "balanced_accuracy": 0.8, "auroc": 0.9, "epsilon_spent_max": min(eps, 2.9), "epsilon_spent_mean": 2.0,
            "unit": "example", "rounds": rounds}


def _compare_table(monkeypatch, capsys, tmp_path, rows):
    import privfl.apps.compare as mod

    monkeypatch.setattr(mod, "compare", lambda config, progress=True, toml_path=None: rows)
    assert main(["compare", "--out-dir", str(tmp_path / "o"), "--quiet"]) == 0
    return capsys.readouterr().out


def test_compare_header_tells_the_rounds_per_row(monkeypatch, capsys, tmp_path):
    rows = [_row("fedavg", 30, math.inf), _row("dpsgd_fedavg", 10), _row("fola", 50)]
    out = _compare_table(monkeypatch, capsys, tmp_path, rows)
    title = out.splitlines()[0] + out.splitlines()[1]
    assert "rounds," not in title  # the grid's 15 would be true of no row
    cells = {c[1]: c for c in (re.split("[│┃]", line) for line in out.splitlines()) if len(c) > 4}
    cells = {name.strip(): [c.strip() for c in row] for name, row in cells.items()}
    assert cells["algorithm"][4] == "rounds"
    for algorithm, rounds in (("fedavg", "30"), ("dpsgd_fedavg", "10"), ("fola", "50")):
        assert cells[algorithm][4] == rounds


def test_compare_header_names_the_rounds_when_every_row_ran_the_same(monkeypatch, capsys, tmp_path):
    out = _compare_table(monkeypatch, capsys, tmp_path, [_row("fedavg", 10, math.inf), _row("fola", 10)])
    assert "10 rounds" in out and "rounds ┃" not in out


# -- a TOML keeping another algorithm's overrides; progress lines without a terminal ---------------------------------

@pytest.mark.timeout(180)
def test_compare_into_a_log_file_prints_progress_and_notes_unused_overrides(tmp_path):
    """stdout redirected to a file, as ``make demo > log`` or CI: progress lines appear there as runs start and end;
    the TOML's [overrides.fola] (fola is not in the grid) is accepted with a note on stderr."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('dataset = "digits"\nclients = 3\npartition = "iid"\nepsilons = [inf]\nseeds = [0]\nrounds = 2\n'
                   f'algorithms = ["fedavg"]\nout_dir = "{tmp_path / "o"}"\n'
                   '[overrides.fedavg]\nhidden = [8]\nlocal_epochs = 1\n[overrides.fola]\nhidden = [16]\n')
    command = f"{_privfl()} compare {cfg} > log.txt 2> err.txt"
    proc = subprocess.run(command, shell=True, cwd=tmp_path, timeout=180,
                          env={**os.environ, "COLUMNS": "160"})
    log, err = (tmp_path / "log.txt").read_text(), (tmp_path / "err.txt").read_text()
    assert proc.returncode == 0, err[-2000:]
    assert "compare: run 1/1 fedavg-epsinf-seed0: 0/2 rounds" in log
    assert "compare: 2/2 rounds done in" in log
    assert log.index("compare: run 1/1") < log.index("privfl compare:")  # progress before the table
    assert "privfl compare: warning: [overrides.fola] is for an algorithm not in the grid" in err
    assert "Traceback" not in err
    assert json.loads((tmp_path / "o" / "results.json").read_text())["results"][0]["algorithm"] == "fedavg"


def test_line_progress_reports_rounds_elapsed_and_eta():
    import io

    from privfl.apps.compare import LineProgress

    stream = io.StringIO()
    bar = LineProgress(stream=stream, interval=0)
    bar.start()
    task = bar.add_task("compare", total=3)
    bar.update(task, description="run 1/2 fedavg-epsinf-seed0")
    for _ in range(3):
        bar.advance(task)
    bar.stop()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("compare: run 1/2 fedavg-epsinf-seed0: 0/3 rounds, elapsed 0:00:00, ETA ?")
    assert lines[-2].startswith("compare: run 1/2 fedavg-epsinf-seed0: 3/3 rounds") and "ETA 0:00:00" in lines[-2]
    assert lines[-1].startswith("compare: 3/3 rounds done in")
    quiet = io.StringIO()
    slow = LineProgress(stream=quiet, interval=3600)
    slow.start()
    slow.add_task("compare", total=5)
    slow.update(0, description="run 1/1 x")
    slow.advance(0)
    assert len(quiet.getvalue().splitlines()) == 1  # within the interval only the run's start is reported
