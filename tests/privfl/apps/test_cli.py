"""The command-line contracts (flags and JSON keys) are checked by automated tools exactly as documented."""

import json

import pytest

from privfl.apps.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("accountant", [None, "exact", "zcdp", "rdp"])
def test_calibrate_json_without_sampling(capsys, accountant):
    argv = ["calibrate", "--epsilon", "3", "--delta", "1e-5", "--rounds", "10", "--json"]
    if accountant:
        argv += ["--accountant", accountant]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    obj = json.loads(out)
    assert obj["accountant"] == (accountant or "exact")
    assert obj["noise_multiplier"] > 0 and obj["epsilon"] <= 3 and obj["delta"] == 1e-5


def test_calibrate_json_with_sampling_defaults_to_pld(capsys):
    code, out, _ = run_cli(capsys, "calibrate", "--epsilon", "3", "--delta", "1e-5", "--rounds", "50",
                           "--sampling-rate", "0.1", "--json")
    obj = json.loads(out)
    assert code == 0 and obj["accountant"] == "pld" and 0 < obj["epsilon"] <= 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, needle", [
    (["--epsilon", "0", "--delta", "1e-5", "--rounds", "10"], "epsilon"),
    (["--epsilon", "-1", "--delta", "1e-5", "--rounds", "10"], "epsilon"),
    (["--epsilon", "nan", "--delta", "1e-5", "--rounds", "10"], "epsilon"),
    (["--epsilon", "3", "--delta", "0", "--rounds", "10"], "delta"),
    (["--epsilon", "3", "--delta", "1", "--rounds", "10"], "delta"),
    (["--epsilon", "3", "--delta", "nan", "--rounds", "10"], "delta"),
    (["--epsilon", "3", "--delta", "1e-5", "--rounds", "0"], "rounds"),
    (["--epsilon", "3", "--delta", "1e-5", "--rounds", "10", "--sampling-rate", "nan"], "sampling"),
    (["--epsilon", "3", "--delta", "1e-5", "--rounds", "10", "--sampling-rate", "1.5"], "sampling"),
    (["--epsilon", "3", "--delta", "1e-5", "--rounds", "10", "--sampling-rate", "0.1", "--accountant", "exact"],
     "exact"),
])
def test_calibrate_bad_input_is_a_clear_error(capsys, argv, needle):
    code, out, err = run_cli(capsys, "calibrate", *argv, "--json")
    assert code == 2 and out == ""
    assert needle in err


@pytest.mark.timeout(240)
def test_run_then_audit(tmp_path, capsys):
    ledger, result = tmp_path / "ledger.sqlite", tmp_path / "result.json"
    code, _, _ = run_cli(capsys, "run", "--algorithm", "dp_fedavg", "--dataset", "digits", "--clients", "4",
                         "--rounds", "3", "--epsilon", "2", "--delta", "1e-5", "--hidden", "16",
                         "--ledger", str(ledger), "--json", str(result), "--quiet")
    assert code == 0
    res = json.loads(result.read_text())
    assert len(res["accuracy_per_round"]) == 3 and 0 <= res["accuracy"] <= 1
    assert 0 < res["epsilon_spent_max"] <= 2 * (1 + 1e-9)
    code, out, _ = run_cli(capsys, "audit", str(ledger), "--delta", "1e-5", "--json")
    audit = json.loads(out)
    assert code == 0 and audit["delta"] == 1e-5
    assert set(audit["clients"]) == {"0", "1", "2", "3"}
    for v in audit["clients"].values():
        assert set(v) >= {"epsilon", "rho", "releases"}
        assert 0 < v["epsilon"] <= 2 * (1 + 1e-9) and v["releases"] == 3
    assert audit["max_epsilon"] == pytest.approx(max(v["epsilon"] for v in audit["clients"].values()))
    png = tmp_path / "eps.png"
    code, out, _ = run_cli(capsys, "audit", str(ledger), "--png", str(png))
    assert code == 0 and "max epsilon" in out and png.stat().st_size > 1000
    # at a smaller delta the same ledger reports a larger epsilon
    _, out, _ = run_cli(capsys, "audit", str(ledger), "--delta", "1e-8", "--json")
    assert json.loads(out)["max_epsilon"] > audit["max_epsilon"]


@pytest.mark.timeout(240)
def test_non_private_run(tmp_path, capsys):
    result = tmp_path / "r.json"
    code, _, _ = run_cli(capsys, "run", "--algorithm", "fedavg", "--dataset", "digits", "--clients", "3",
                         "--rounds", "2", "--epsilon", "inf", "--hidden", "16", "--json", str(result), "--quiet")
    assert code == 0
    res = json.loads(result.read_text())
    assert res["epsilon_spent_max"] == "inf" and res["noise_multipliers"] is None  # strict JSON: no Infinity


def test_run_refuses_private_fedavg_and_unknown_names(capsys):
    code, _, err = run_cli(capsys, "run", "--algorithm", "fedavg", "--epsilon", "3", "--dataset", "digits")
    assert code == 2 and "dp_fedavg" in err
    code, _, err = run_cli(capsys, "run", "--algorithm", "nope", "--dataset", "digits")
    assert code == 2 and "choose one of" in err
    code, _, err = run_cli(capsys, "run", "--dataset", "nope")
    assert code == 2 and "dataset" in err


def test_audit_of_a_missing_ledger(tmp_path, capsys):
    code, _, err = run_cli(capsys, "audit", str(tmp_path / "none.sqlite"), "--json")
    assert code == 2 and "no ledger" in err


@pytest.mark.parametrize("flag, value, needle", [("--delta", "-1e-5", "delta"), ("--delta", "-0.5", "delta"),
                                                 ("--epsilon", "-3", "epsilon"), ("--epsilon", "-inf", "epsilon"),
                                                 ("--delta", "1e-320", "delta")])
def test_negative_and_extreme_numbers_reach_validation(capsys, flag, value, needle):
    """``--delta -1e-5`` used to be read by argparse as an option ("expected one argument"); it must reach the
    validation that says what is wrong, exit 2, and print no traceback."""
    argv = {"--delta": "1e-5", "--epsilon": "3"}
    argv[flag] = value
    code, out, err = run_cli(capsys, "calibrate", "--epsilon", argv["--epsilon"], "--delta", argv["--delta"],
                             "--rounds", "3")
    assert code == 2
    assert needle in err and "Traceback" not in err and "expected one argument" not in err


def test_run_refuses_a_negative_delta_cleanly(capsys):
    code, _, err = run_cli(capsys, "run", "--algorithm", "dp_fedavg", "--dataset", "digits", "--rounds", "1",
                           "--delta", "-1e-5", "--quiet")
    assert code == 2 and "delta" in err and "Traceback" not in err
