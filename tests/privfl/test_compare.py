"""privfl compare: schema, resume after interruption, and every run's ledger within its target."""

import json
import math
import os

import pytest

from accounting.ledger import PrivacyLedger
from privfl.cli import main
from privfl.compare import CompareConfig, compare, grid
from privfl.data import make_federated
from privfl.errors import ConfigurationError


def small(tmp_path, **kw):
    base = dict(dataset="digits", clients=3, partition="iid", epsilons=(2.0, math.inf), seeds=(0, 1), rounds=2,
                algorithms=("fedavg", "dp_fedavg"), out_dir=str(tmp_path / "out"),
                overrides={"fedavg": {"hidden": [8]}, "dp_fedavg": {"hidden": [], "pool": 1}})
    base.update(kw)
    return CompareConfig(**base)


@pytest.mark.timeout(300)
def test_compare_writes_schema_figures_and_resumes(tmp_path, monkeypatch):
    config = small(tmp_path)
    assert len(grid(config)) == 2 + 4  # fedavg only without DP; dp_fedavg at both targets; two seeds
    rows = compare(config, progress=False)
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text())["results"]
    assert len(results) == 6
    for r in results:
        assert {"algorithm", "epsilon_target", "seed", "accuracy", "nll", "ece", "epsilon_spent_max"} <= set(r)
        # the global models here are calibrated on the whole test split
        assert sum(r["reliability"]["count"]) == len(make_federated("digits", 3, partition="iid", seed=r["seed"]).test)
        if math.isfinite(r["epsilon_target"]):
            led = PrivacyLedger.open_existing(r["ledger"])
            assert led.audit()["max_epsilon"] <= r["epsilon_target"] * (1 + 1e-9)
            assert r["epsilon_spent_max"] <= r["epsilon_target"] * (1 + 1e-9)
    assert (out / "results.csv").read_text().startswith("algorithm,epsilon_target,seed,accuracy")
    for fig in ("accuracy_vs_epsilon.png", "epsilon_per_client.png", "reliability.png"):
        assert (out / fig).stat().st_size > 5000

    # Interrupted: one result lost. Only that run is redone.
    os.remove(out / "runs" / "dp_fedavg-eps2-seed1.json")
    calls = []
    import privfl.compare as mod

    real = mod.run_one
    monkeypatch.setattr(mod, "run_one", lambda c, s, d: calls.append(s.key) or real(c, s, d))
    again = compare(config, progress=False)
    assert calls == ["dp_fedavg-eps2-seed1"]
    assert len(again) == len(rows)


def test_cli_compare_json(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('dataset = "digits"\nclients = 3\npartition = "iid"\nepsilons = [2.0]\nseeds = [0]\nrounds = 1\n'
                   f'algorithms = ["dp_fedavg"]\nout_dir = "{tmp_path / "o"}"\n'
                   '[overrides.dp_fedavg]\nhidden = []\npool = 1\n')
    code = main(["compare", str(cfg), "--json", str(tmp_path / "r.json"), "--quiet"])
    assert code == 0
    res = json.loads((tmp_path / "r.json").read_text())["results"]
    assert res[0]["algorithm"] == "dp_fedavg" and res[0]["epsilon_spent_max"] <= 2.0 * (1 + 1e-9)
    assert "dp_fedavg" in capsys.readouterr().out


def test_bad_configs(tmp_path):
    with pytest.raises(ConfigurationError, match="unknown algorithms"):
        small(tmp_path, algorithms=("nope",))
    with pytest.raises(ConfigurationError, match="epsilons"):
        small(tmp_path, epsilons=(0.0,))
    bad = tmp_path / "b.toml"
    bad.write_text('datasets = "digits"\n')
    with pytest.raises(ConfigurationError, match="unknown keys"):
        CompareConfig.from_toml(str(bad))
