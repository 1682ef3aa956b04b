"""The CLI never surprises: --version, help on every flag, file errors and ignored input as exit 2 with a message
naming the flag or file (no traceback), the privacy unit that fits the algorithm, strict JSON, self-describing
results, a saved model, no third-party warnings, and a ``calibrate`` that does not import torch."""

import json
import os
import re
import subprocess
import sys
import warnings

import pytest

import privfl
from privfl.apps.cli import ALGORITHM_NAMES, RECORD_LEVEL_ALGORITHMS, build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SMALL = ["--dataset", "digits", "--clients", "3", "--rounds", "1", "--hidden", "8", "--quiet"]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"privfl {privfl.__version__}"


def _subparsers():
    parser = build_parser()
    (action,) = parser._subparsers._group_actions
    return {name: p for name, p in action.choices.items()}


def test_every_flag_has_help_and_the_help_shows_defaults():
    for name, sub in _subparsers().items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"privfl {name} {action.option_strings or action.dest} has no help"
    run_help = _subparsers()["run"].format_help()
    assert "(default: 20)" in run_help and "(default: dp_fedavg)" in run_help  # --rounds, --algorithm
    assert "default mnist5k" in run_help and "default 10" in run_help  # --dataset, --clients (None: own data)
    for algorithm in ALGORITHM_NAMES:
        assert algorithm in run_help


def test_the_algorithm_names_in_the_help_are_the_registered_ones():
    from privfl.algorithms import ALGORITHMS, default_unit

    assert tuple(sorted(ALGORITHMS)) == ALGORITHM_NAMES
    assert all(default_unit(name) in ("client", "example") for name in ALGORITHMS)
    assert RECORD_LEVEL_ALGORITHMS == tuple(sorted(n for n in ALGORITHMS if default_unit(n) == "example"))


@pytest.mark.parametrize("argv, needle", [
    (["run", *SMALL, "--dropout", "0.2"], "--dropout"),
    (["run", *SMALL, "--min-survivors", "2"], "--min-survivors"),
    (["run", *SMALL, "--secagg-bits", "32"], "--secagg-bits"),
    (["run", *SMALL, "--clients", "1"], "--clients 1"),
    (["run", *SMALL, "--alpha", "0.5"], "--alpha"),
])
def test_silently_ignored_input_is_refused(capsys, argv, needle):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err


def test_file_errors_exit_2_with_a_message_naming_the_file(tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    code, _, err = run_cli(capsys, "audit", str(folder))
    assert code == 2 and "directory" in err and str(folder) in err
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"this is not a database" * 100)
    code, _, err = run_cli(capsys, "audit", str(corrupt))
    assert code == 2 and "not a privfl ledger" in err and str(corrupt) in err
    code, _, err = run_cli(capsys, "run", *SMALL, "--ledger", str(corrupt))
    assert code == 2 and "--ledger" in err and str(corrupt) in err
    code, _, err = run_cli(capsys, "run", *SMALL, "--json", str(folder))
    assert code == 2 and "--json" in err and "Traceback" not in err


@pytest.mark.timeout(240)
def test_a_ledger_holding_the_run_is_refused_and_png_into_a_missing_folder(tmp_path, capsys):
    ledger, out = str(tmp_path / "l.sqlite"), str(tmp_path / "r.json")
    argv = ["run", "--algorithm", "dp_fedavg", *SMALL, "--hidden", "", "--ledger", ledger]
    assert run_cli(capsys, *argv, "--json", out)[0] == 0
    first = json.loads(open(out).read())["run_id"]
    assert re.fullmatch(r"dp_fedavg-client-eps3-seed0-[0-9a-f]{8}", first)
    code, _, err = run_cli(capsys, *argv)  # the same run again
    assert code == 2 and f"already holds run '{first}'" in err and "--run-id" in err and ledger in err
    # a run that differs in any setting (here the learning rate) gets its own id, next to the first
    assert run_cli(capsys, *argv, "--lr", "0.2", "--json", out)[0] == 0
    second = json.loads(open(out).read())["run_id"]
    assert second != first and second.startswith("dp_fedavg-client-eps3-seed0-")
    missing = tmp_path / "no" / "such" / "eps.png"
    code, _, err = run_cli(capsys, "audit", ledger, "--run-id", second, "--png", str(missing))
    assert code == 2 and "--png" in err and "does not exist" in err and not missing.parent.exists()


@pytest.mark.timeout(240)
def test_the_unit_defaults_to_the_algorithms_and_is_printed(tmp_path, capsys):
    out = tmp_path / "r.json"
    code, _, err = run_cli(capsys, "run", "--algorithm", "dpsgd_fedavg", "--epsilon", "3", *SMALL, "--json", str(out))
    assert code == 0, err
    assert "privacy unit 'example'" in err
    result = json.loads(out.read_text())
    assert result["settings"]["privacy"]["unit"] == "example"
    # DP-SGD: the noise each client used per step is reported from the ledger, not the empty release multipliers
    applied = result["noise_applied"]["update"]
    assert result["noise_multipliers"] == {} and applied and all(a["noise_multiplier"] > 0 and a["steps"] >= 1
                                                                 for a in applied)
    code, _, err = run_cli(capsys, "run", "--algorithm", "dp_fedavg", *SMALL, "--hidden", "")
    assert code == 0 and "privacy unit 'client'" in err


def test_adaptive_clipping_run_json_lists_its_count_channel_and_the_clip_of_every_round(tmp_path, capsys):
    """``privfl run --clip adaptive --clip-quantile Q`` (issue 29's contract): ``noise_applied`` lists the quantile
    release's channel (``clip_count``) beside the gradient's, ``clip_per_round`` the clip each round used (the first
    the algorithm's default), the settings the quantile; a fixed clip's JSON has no clip per round."""
    out = tmp_path / "r.json"
    code, _, err = run_cli(capsys, "run", "--algorithm", "dp_fedsgd", "--epsilon", "3", *SMALL, "--rounds", "3",
                           "--clip", "adaptive", "--clip-quantile", "0.7", "--json", str(out))
    assert code == 0, err
    result = json.loads(out.read_text())
    assert set(result["noise_applied"]) == {"gradient_sum", "clip_count"}
    count = result["noise_applied"]["clip_count"][0]
    assert count["sensitivity"] == 0.5 and count["noise_multiplier"] > result["noise_applied"]["gradient_sum"][0][
        "noise_multiplier"]
    clips = result["clip_per_round"]
    assert len(clips) == 3 and clips[0] == 1.0 and all(c > 0 for c in clips) and len(set(clips)) == 3
    assert result["settings"]["privacy"]["clip_quantile"] == 0.7 and result["epsilon_spent_max"] <= 3.0
    code, _, err = run_cli(capsys, "run", "--algorithm", "dp_fedsgd", "--epsilon", "3", *SMALL, "--json", str(out))
    assert code == 0, err
    result = json.loads(out.read_text())
    assert result["clip_per_round"] is None and set(result["noise_applied"]) == {"gradient_sum"}


@pytest.mark.timeout(240)
def test_run_json_is_strict_describes_itself_and_the_model_is_saved(tmp_path, capsys):
    import torch

    out, model = tmp_path / "r.json", tmp_path / "models" / "m.pt"
    code, _, err = run_cli(capsys, "run", "--algorithm", "fedavg", "--epsilon", "inf", *SMALL, "--lr", "0.1",
                           "--json", str(out), "--save-model", str(model))
    assert code == 0, err
    text = out.read_text()
    assert "Infinity" not in text and "NaN" not in text
    result = json.loads(text)
    assert result["epsilon_target"] == "inf" and result["epsilon_spent_max"] == "inf"
    settings = result["settings"]
    assert settings["federation"]["lr"] == 0.1 and settings["federation"]["hidden"] == [8]
    assert settings["federation"]["batch_size"] == 32 and settings["federation"]["seed"] == 0
    assert settings["data"]["partition"] == "iid" and settings["privacy"]["clip"] == 1.0
    assert settings["algorithm_options"]["local_epochs"] == 2
    assert result["privfl_version"] == privfl.__version__ == settings["privfl_version"]
    assert {"balanced_accuracy", "auroc"} <= set(result["final"]) and result["model_path"] == str(model)
    state = torch.load(model)
    from privfl.models import make_model

    net = make_model("mlp", (1, 8, 8), 10, hidden=(8,))
    net.load_state_dict(state)  # the saved file is the global model's state_dict


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", ["fola", "dpsgd_fedavg"])
def test_no_warning_leaks_from_a_normal_run(capsys, algorithm):
    """No filter hides anything here: opacus's per-sample hooks (DP-SGD) and the Fisher hooks (FOLA) raise no
    warning on a normal record-level run, torch's full-backward-hook warning included."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, err = run_cli(capsys, "run", "--algorithm", algorithm, "--unit", "example", *SMALL)
    assert code == 0, err
    assert not [f"{w.category.__name__}: {w.message}" for w in caught]


def test_calibrate_does_not_import_torch():
    """The CLI's calibrate path imports no torch (the package's ``__init__`` is bypassed here: it imports the whole
    library eagerly)."""
    code = ("import sys, types, os\n"
            f"pkg = types.ModuleType('privfl'); pkg.__path__ = [os.path.join({ROOT!r}, 'privfl')]\n"
            "sys.modules['privfl'] = pkg\n"
            "from privfl.apps.cli import main\n"
            "assert main(['calibrate', '--epsilon', '3', '--delta', '1e-5', '--rounds', '10', '--json']) == 0\n"
            "assert 'torch' not in sys.modules, 'calibrate imported torch'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["noise_multiplier"] > 0
