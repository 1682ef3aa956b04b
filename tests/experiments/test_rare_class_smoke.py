"""``experiments/run_rare_class.py --smoke`` runs every method of the rare-class comparison to the end (one seed, one
setting, two rounds: not a measurement) and prints its summary, ``+prior`` (prior-corrected) variants included, so the
committed script does not rot."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "run_rare_class.py"


@pytest.mark.timeout(300)
def test_the_rare_class_comparison_runs_every_method(capsys):
    spec = importlib.util.spec_from_file_location("run_rare_class", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--smoke"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert {line.split(" ")[0] for line in lines[:-1]} == set(module.METHODS)
    summary = json.loads(lines[-1])
    method, _, rule = summary["best_private"].partition("+")
    assert method in module.METHODS and rule in ("", "prior") and "gap_to_weighted_fedavg" in summary
    assert summary["best_private_without_prior"] in module.METHODS and "gap_without_prior" in summary
