"""``experiments/run_laplace_posterior.py --smoke`` runs its validation choice and both test runs (DP-FedSGD, and
DP-FedSGD with the Laplace posterior) to the end, so the committed script does not rot."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "run_laplace_posterior.py"


@pytest.mark.timeout(300)
def test_the_laplace_posterior_comparison_runs(capsys, monkeypatch):
    monkeypatch.chdir(SCRIPT.parents[1])  # it reads experiments/results/record_level.json's chosen settings
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("run_laplace_posterior", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| 3 | DP-FedSGD (global model) |" in out and "| 3 | laplace |" in out
    assert "NOT a measurement" in out
    for name in ("run_record_level", "run_trajectory_posterior"):
        sys.modules.pop(name, None)
