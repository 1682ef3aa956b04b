"""``experiments/run_adaptive_clipping.py --smoke`` (two fixed clips and the adaptive run, 20 rounds of the default
comparison's DP-FedSGD) goes to the end and prints its table, so the committed script does not rot."""

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
    assert "| 3 | adaptive |" in out and "(best fixed)" in out and "NOT a measurement" in out
