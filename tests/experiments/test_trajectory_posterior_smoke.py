"""``experiments/run_trajectory_posterior.py --smoke`` runs one seeded DP-FedSGD run to the end and reports both of its
predictions (point estimate and trajectory posterior), so the committed script does not rot."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "run_trajectory_posterior.py"


@pytest.mark.timeout(300)
def test_the_trajectory_posterior_comparison_runs(capsys, monkeypatch):
    monkeypatch.chdir(SCRIPT.parents[1])  # it reads experiments/results/record_level.json's chosen settings
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("run_trajectory_posterior", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| 3 | global model (last iterate) |" in out and "| 3 | trajectory posterior |" in out
    assert "NOT a measurement" in out
    sys.modules.pop("run_record_level", None)
