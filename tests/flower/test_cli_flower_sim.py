"""``privfl run --runtime flower-sim`` (issue 13) from the command line: what it refuses before anything starts
(exit 2, a message, no traceback), ``privfl audit`` of a folder of per-client ledgers, and one run on Flower's
Simulation Engine that writes the outputs an in-process run writes."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

import privfl.flower.sim as flower_sim
from privfl.accounting.events import GaussianEvent
from privfl.accounting.ledger import PrivacyLedger
from privfl.apps.cli import main

SMALL = ["--dataset", "digits", "--clients", "3", "--rounds", "2", "--hidden", "", "--quiet"]
HAS_ENGINE = importlib.util.find_spec("flwr") is not None and importlib.util.find_spec("ray") is not None


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def engine_installed(monkeypatch):
    """Refusals that come after the install check are tested whether or not flwr is installed here."""
    monkeypatch.setattr(flower_sim, "require_flower", lambda: None)


def test_without_flower_the_runtime_exits_2_naming_the_extra(capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(flower_sim.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("flwr", "ray") else real(name, *a))
    code, _, err = run_cli(capsys, "run", "--algorithm", "fedavg", *SMALL, "--epsilon", "inf",
                           "--runtime", "flower-sim")
    assert code == 2 and "pip install 'privfl[flower]'" in err and "Traceback" not in err


def test_an_algorithm_that_does_not_run_on_flower_exits_2_naming_it(capsys, engine_installed, monkeypatch):
    import privfl.flower.app as app

    monkeypatch.setattr(app, "runs_on_flower", lambda name: name != "fedprox")  # every algorithm runs on Flower now
    code, _, err = run_cli(capsys, "run", "--algorithm", "fedprox", *SMALL, "--epsilon", "inf",
                           "--runtime", "flower-sim")
    assert code == 2 and "fedprox" in err and "--runtime inprocess" in err and "Traceback" not in err


def test_a_multi_phase_run_exits_2(capsys, engine_installed):
    code, _, err = run_cli(capsys, "run", "--algorithm", "fedbnr", "--dataset", "synthetic1d", "--clients", "3",
                           "--rounds", "1", "--kernel-rounds", "1", "--quiet", "--runtime", "flower-sim")
    assert code == 2 and "fedbnr" in err and "--kernel-rounds 0" in err and "Traceback" not in err


@pytest.mark.parametrize("extra, needle", [
    (["--secure-agg"], "--secure-agg"),
    (["--placement", "distributed"], "--placement distributed"),
    (["--ledger", ":memory:"], "--ledger :memory:"),
    (["--save-model", "m.pt", "--algorithm", "hbfl"], "--save-model"),
])
def test_combinations_flower_sim_cannot_honour_exit_2(capsys, engine_installed, tmp_path, extra, needle):
    extra = [str(tmp_path / a) if a == "m.pt" else a for a in extra]
    code, _, err = run_cli(capsys, "run", *SMALL, "--runtime", "flower-sim", "--flower-dir", str(tmp_path / "run"),
                           *extra)
    assert code == 2 and needle in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "run"), "nothing is written before the refusal"


def test_flower_dir_without_the_flower_runtime_is_refused(capsys, tmp_path):
    code, _, err = run_cli(capsys, "run", *SMALL, "--flower-dir", str(tmp_path))
    assert code == 2 and "--flower-dir" in err and "--runtime flower-sim" in err


def test_a_ledger_file_or_a_folder_holding_the_run_is_refused(capsys, engine_installed, tmp_path):
    afile = tmp_path / "l.sqlite"
    afile.write_bytes(b"")
    code, _, err = run_cli(capsys, "run", *SMALL, "--runtime", "flower-sim", "--ledger", str(afile))
    assert code == 2 and "is a file" in err and "client<k>.sqlite" in err
    folder = tmp_path / "ledgers"
    folder.mkdir()
    held = PrivacyLedger(str(folder / "client1.sqlite"), "mine")  # a run that charged something (one that charged
    held.charge("1", 0, "update", GaussianEvent(1.0, 5.0), "client")  # nothing binds nothing: session 26)
    held.close()
    code, _, err = run_cli(capsys, "run", *SMALL, "--runtime", "flower-sim", "--ledger", str(folder),
                           "--run-id", "mine")
    assert code == 2 and "already holds run 'mine'" in err and "privfl audit" in err


def _client_ledgers(folder, run_id="r", stds=(2.0, 3.0, 4.0), rounds=2):
    folder.mkdir(exist_ok=True)
    for k, std in enumerate(stds):
        ledger = PrivacyLedger(str(folder / f"client{k}.sqlite"), run_id, delta=1e-5, epsilon_budget=10.0,
                               accountant="exact", meta={"noise": "secure"})
        try:
            for rnd in range(rounds):
                ledger.mark_released(ledger.charge(str(k), rnd, "update", GaussianEvent(1.0, std), "client"))
        finally:
            ledger.close()


def test_audit_of_a_folder_composes_the_clients_own_ledgers(capsys, tmp_path):
    folder = tmp_path / "ledgers"
    _client_ledgers(folder)
    code, out, err = run_cli(capsys, "audit", str(folder), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert set(report["clients"]) == {"0", "1", "2"} and report["run_id"] == "r"
    for k in range(3):
        with PrivacyLedger.open_existing(str(folder / f"client{k}.sqlite"), "r") as ledger:
            assert report["clients"][str(k)] == json.loads(json.dumps(ledger.audit()["clients"][str(k)]))
    assert report["max_epsilon"] == max(v["epsilon"] for v in report["clients"].values())
    png = tmp_path / "eps.png"
    code, out, _ = run_cli(capsys, "audit", str(folder), "--png", str(png))
    assert code == 0 and png.exists() and "max epsilon" in out
    _client_ledgers(folder, run_id="other", rounds=1)
    code, _, err = run_cli(capsys, "audit", str(folder))
    assert code == 2 and "--run-id" in err and "other" in err


@pytest.mark.slow  # make test-all (CI time): Ray's start-up, about two minutes
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAS_ENGINE, reason="Flower's Simulation Engine is not installed (pip install "
                                           "'privfl[flower]')")
def test_a_flower_sim_run_writes_what_an_in_process_run_writes(capsys, tmp_path):
    argv = ["run", "--algorithm", "dp_fedavg", *SMALL, "--placement", "local", "--seeded-noise", "--epsilon", "3"]
    code, _, err = run_cli(capsys, *argv, "--json", str(tmp_path / "inprocess.json"),
                           "--save-model", str(tmp_path / "inprocess.pt"))
    assert code == 0, err
    flower_dir = tmp_path / "flower"
    code, _, err = run_cli(capsys, *argv, "--runtime", "flower-sim", "--flower-dir", str(flower_dir),
                           "--json", str(tmp_path / "flower.json"), "--save-model", str(tmp_path / "flower.pt"))
    assert code == 0, err
    import torch

    saved = torch.load(tmp_path / "flower.pt"), torch.load(tmp_path / "inprocess.pt")
    assert saved[0].keys() == saved[1].keys()
    for name in saved[1]:  # the in-process default executor trains all clients at once: equal to float tolerance
        assert torch.allclose(saved[0][name], saved[1][name], atol=1e-4), name
    inprocess = json.loads((tmp_path / "inprocess.json").read_text())
    flower = json.loads((tmp_path / "flower.json").read_text())
    assert set(flower) == set(inprocess) | {"ledgers", "flower_dir"}
    assert flower["runtime"] == "flower-sim" and inprocess["runtime"] == "inprocess"
    assert flower["run_id"] != inprocess["run_id"], "the runtime is a setting of the run: its own id"
    assert flower["noise_multipliers"] == inprocess["noise_multipliers"]
    assert flower["epsilon_spent"] == inprocess["epsilon_spent"]
    assert flower["epsilon_spent_per_round"] == pytest.approx(inprocess["epsilon_spent_per_round"])
    assert flower["noise_applied"] == inprocess["noise_applied"]
    assert len(flower["accuracy_per_round"]) == 2 and flower["final"].keys() == inprocess["final"].keys()
    assert flower["ledgers"] == [str(flower_dir / "ledgers" / f"client{k}.sqlite") for k in range(3)]
    code, out, _ = run_cli(capsys, "audit", flower["ledger"], "--json")
    assert code == 0 and {k: v["epsilon"] for k, v in json.loads(out)["clients"].items()} == flower["epsilon_spent"]
    # the same run again: its ledgers hold the run id
    code, _, err = run_cli(capsys, *argv, "--runtime", "flower-sim", "--flower-dir", str(flower_dir))
    assert code == 2 and "already holds run" in err
