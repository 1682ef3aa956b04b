"""``experiments/run_correlated_noise.py --smoke`` (bands 1 and 2, 4 rounds of the default comparison's DP-FedSGD,
central and distributed) and ``experiments/run_audit_default.py --smoke`` (the run audit of 3 rounds, honest and
with each fault, and the ideal auditor's table) go to the end and print their tables, so the committed scripts do
not rot."""

import importlib.util
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def _main(name):
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_the_correlated_noise_comparison_runs(capsys, monkeypatch):
    monkeypatch.chdir(EXPERIMENTS.parent)  # it reads experiments/configs/default.toml
    assert _main("run_correlated_noise").main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| 3 | central | 1" in out and "| 3 | central | 2" in out and "| 3 | distributed |" in out
    assert "NOT a measurement" in out


@pytest.mark.timeout(300)
def test_the_default_run_audit_runs(capsys, monkeypatch):
    monkeypatch.chdir(EXPERIMENTS.parent)
    assert _main("run_audit_default").main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| 3 | none |" in out and "| 3 | no_clip |" in out and "| 3 | half_noise |" in out
    assert "an ideal auditor" in out and "NOT a measurement" in out
