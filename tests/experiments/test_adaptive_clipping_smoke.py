"""``experiments/run_adaptive_clipping.py --smoke`` (two fixed clips and adaptive runs, 2 rounds of the default
comparison's DP-FedSGD and DP-SGD FedAvg) and its ``--fresh-seeds --smoke`` (the committed choices on one fresh seed)
go to the end and print their tables, as do ``--fresh-hindsight --smoke`` and ``--client-level --smoke``, so the
committed script does not rot."""

import importlib.util
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def _module():
    spec = importlib.util.spec_from_file_location("run_adaptive_clipping", EXPERIMENTS / "run_adaptive_clipping.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_the_adaptive_clipping_comparison_runs(capsys, monkeypatch):
    monkeypatch.chdir(EXPERIMENTS.parent)  # it reads experiments/configs/default.toml
    assert _module().main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| dp_fedsgd | 3 | adaptive Q 0.5, eta 0.2, share 0.01" in out and "| dpsgd_fedavg | 3 | adaptive Q" in out
    assert "(best fixed)" in out and "NOT a measurement" in out


@pytest.mark.timeout(300)
def test_the_fresh_seed_check_runs(capsys, monkeypatch):
    monkeypatch.chdir(EXPERIMENTS.parent)  # it reads the committed adaptive_clipping.json
    assert _module().main(["--fresh-seeds", "--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| dpsgd_fedavg | 3 | 0.25 | adaptive Q 0.1, eta 0.2, share 0.01 | 1 |" in out and "NOT a measurement" in out


@pytest.mark.timeout(300)
def test_the_hindsight_on_fresh_seeds_and_the_client_level_comparisons_run(capsys, monkeypatch):
    monkeypatch.chdir(EXPERIMENTS.parent)  # they read the committed adaptive_clipping_fresh.json and the config
    module = _module()
    assert module.main(["--fresh-hindsight", "--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| dpsgd_fedavg (1 seeds) | 0.1: " in out and "best in hindsight" in out and "NOT a measurement" in out
    assert module.main(["--client-level", "--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| dp_fedavg | 3 | adaptive Q 0.5, eta 0.2, share 0.01" in out and "(best fixed)" in out
    assert "NOT a measurement" in out
