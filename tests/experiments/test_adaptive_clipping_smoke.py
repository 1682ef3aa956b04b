"""``experiments/run_adaptive_clipping.py --smoke`` (two fixed clips and adaptive runs, 2 rounds of the default
comparison's DP-FedSGD and DP-SGD FedAvg) goes to the end and prints its table, so the committed script does not rot."""

import importlib.util
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


@pytest.mark.timeout(300)
def test_the_adaptive_clipping_comparison_runs(capsys, monkeypatch):
    monkeypatch.chdir(EXPERIMENTS.parent)  # it reads experiments/configs/default.toml
    spec = importlib.util.spec_from_file_location("run_adaptive_clipping", EXPERIMENTS / "run_adaptive_clipping.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| dp_fedsgd | 3 | adaptive Q 0.5, eta 0.2, share 0.01" in out and "| dpsgd_fedavg | 3 | adaptive Q" in out
    assert "(best fixed)" in out and "NOT a measurement" in out
