"""The posterior comparisons' ``--smoke`` runs (``experiments/run_trajectory_posterior.py``: one seeded DP-FedSGD run
predicting both ways; ``experiments/run_laplace_posterior.py`` and ``run_variational_posterior.py``: the validation
choice and both test runs) go to the
end and print their rows, so the committed scripts do not rot."""

import importlib.util
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script, rows", [
    ("run_trajectory_posterior", ("| 3 | global model (last iterate) |", "| 3 | trajectory posterior |")),
    ("run_laplace_posterior", ("| 3 | DP-FedSGD (global model) |", "| 3 | laplace |")),
    ("run_variational_posterior", ("| 3 | DP-FedSGD (global model) |", "| 3 | variational |"))])
def test_the_posterior_comparison_runs(capsys, monkeypatch, script, rows):
    monkeypatch.chdir(EXPERIMENTS.parent)  # they read experiments/results/record_level.json's chosen settings
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    spec = importlib.util.spec_from_file_location(script, EXPERIMENTS / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert all(row in out for row in rows) and "NOT a measurement" in out
    for name in ("run_record_level", "run_trajectory_posterior"):
        sys.modules.pop(name, None)
