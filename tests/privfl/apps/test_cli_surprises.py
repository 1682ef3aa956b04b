"""The CLI never surprises (issue 15, item 4), continued: every flag that takes a value says its default, the default
run id tells runs apart, the audit explains its rho column when clients were sampled, ``calibrate`` loads no torch,
and FedBNR's unit and record cap are explicit (item 5)."""

import json
import math
import subprocess
import sys

import pytest

from privfl.algorithms import default_unit
from privfl.apps.cli import RHO_SAMPLED_NOTE, build_parser, default_run_id, main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _subparsers():
    (action,) = build_parser()._subparsers._group_actions
    return dict(action.choices)


def test_every_flag_that_takes_a_value_shows_its_default_or_is_required():
    for name, sub in _subparsers().items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if action.dest == "help" or action.nargs == 0 or action.required or not action.option_strings:
                continue
            text = formatter._expand_help(action)
            assert "default" in text, f"privfl {name} {action.option_strings[0]}: the help shows no default"
            if action.choices is None and action.dest in ("unit", "accountant", "placement", "partition"):
                pytest.fail(f"privfl {name} --{action.dest} lists no choices")


def _run_args(*extra):
    """The parsed ``privfl run`` arguments with the defaults ``cmd_run`` fills in, and the configurations built."""
    from privfl.core.config import FederationConfig, PrivacyConfig

    args = build_parser().parse_args(["run", "--dataset", "digits", "--clients", "3", *extra])
    args.unit = args.unit or default_unit(args.algorithm)
    for key, value in {"clip": 1.0, "local_epochs": 1, "lr": 0.05, "model": "mlp", "partition": "iid"}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    fed = FederationConfig(rounds=args.rounds, local_epochs=args.local_epochs, lr=args.lr, model=args.model,
                           seed=args.seed)
    privacy = PrivacyConfig(epsilon=args.epsilon, delta=args.delta, unit=args.unit, clip=args.clip)
    return args, fed, privacy


def test_the_default_run_id_names_the_run_and_hashes_every_other_setting():
    base = default_run_id(*_run_args())
    assert base.startswith("dp_fedavg-client-eps3-seed0-")
    assert default_run_id(*_run_args()) == base  # the same run has the same id
    changed = {default_run_id(*_run_args(*flags)) for flags in (["--rounds", "7"], ["--lr", "0.2"],
                                                                ["--clients", "4"], ["--clip", "0.5"],
                                                                ["--partition", "dirichlet", "--alpha", "0.5"])}
    assert base not in changed and len(changed) == 5  # any other setting gives another id
    assert default_run_id(*_run_args("--seed", "3")).startswith("dp_fedavg-client-eps3-seed3-")
    assert default_run_id(*_run_args("--unit", "example")).startswith("dp_fedavg-example-eps3-seed0-")


def _ledger(path, sampling_rate: float, run_id: str = "r"):
    from privfl.accounting.events import GaussianEvent, PoissonSampledEvent
    from privfl.accounting.ledger import PrivacyLedger

    accountant = "pld" if sampling_rate < 1 else "exact"
    with PrivacyLedger(str(path), run_id, delta=1e-5, epsilon_budget=10.0, accountant=accountant) as ledger:
        for rnd in range(5):
            event = GaussianEvent(sensitivity=1.0, noise_std=2.0)
            if sampling_rate < 1:
                event = PoissonSampledEvent(sampling_rate, event)
            ledger.mark_released(ledger.charge("0", rnd, "update", event, unit="client"))
    return str(path)


def test_the_audit_explains_rho_when_clients_were_sampled(tmp_path, capsys):
    sampled = _ledger(tmp_path / "sampled.sqlite", 0.1)
    code, out, err = run_cli(capsys, "audit", sampled, "--json")
    report = json.loads(out)
    assert code == 0, err
    rho, epsilon = report["clients"]["0"]["rho"], report["clients"]["0"]["epsilon"]
    # what needs explaining: rho ignores the sampling, so its zCDP conversion exceeds the epsilon reported
    assert rho + 2 * math.sqrt(rho * math.log(1 / 1e-5)) > epsilon
    assert report["rho_note"] == RHO_SAMPLED_NOTE and "without amplification by sampling" in RHO_SAMPLED_NOTE
    code, out, _ = run_cli(capsys, "audit", sampled)
    assert code == 0 and "rho*" in out.splitlines()[1] and f"rho*: {RHO_SAMPLED_NOTE}" in out
    unsampled = _ledger(tmp_path / "plain.sqlite", 1.0)
    code, out, _ = run_cli(capsys, "audit", unsampled, "--json")
    assert code == 0 and "rho_note" not in json.loads(out)
    code, out, _ = run_cli(capsys, "audit", unsampled)
    assert code == 0 and "rho*" not in out
    assert "rho*" in _subparsers()["audit"].format_help()  # the legend is in --help too


def test_calibrate_loads_no_torch_through_the_installed_package():
    code = ("import sys\n"
            "from privfl.apps.cli import main\n"
            "assert main(['calibrate', '--epsilon', '3', '--rounds', '10', '--json']) == 0\n"
            "heavy = sorted(m for m in ('torch', 'opacus', 'matplotlib', 'pandas') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import")}
    assert "privfl.apps.cli" in imported and not {m for m in imported if m.split(".")[0] == "torch"}
    assert json.loads(proc.stdout)["noise_multiplier"] > 0


@pytest.mark.parametrize("argv, needle", [
    (["run", "--dataset", "digits", "--clients", "3", "--rounds", "1", "--dropout", "0.2"], "--dropout"),
    (["run", "--dataset", "digits", "--clients", "1", "--rounds", "1"], "--clients 1"),
    (["run", "--dataset", "digits", "--rounds", "1", "--kernel-rounds", "2"], "--kernel-rounds"),
    (["run", "--dataset", "digits", "--rounds", "1", "--target", "y"], "--target"),
])
def test_ignored_input_is_refused_before_any_work(capsys, argv, needle):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err and "round" not in out


def test_fedbnr_defaults_to_the_record_level_unit_it_is_stated_in(tmp_path, capsys):
    out = tmp_path / "r.json"
    code, _, err = run_cli(capsys, "run", "--algorithm", "fedbnr", "--dataset", "synthetic1d", "--clients", "3",
                           "--rounds", "1", "--quiet", "--json", str(out))
    assert code == 0, err
    assert "privacy unit 'example' (the default for fedbnr" in err
    assert json.loads(out.read_text())["settings"]["privacy"]["unit"] == "example"
    (unit,) = [a for a in _subparsers()["run"]._actions if a.dest == "unit"]
    assert "dpsgd_fedavg and fedbnr" in unit.help


def test_fedbnr_traps_are_told_on_the_command_line_once_and_without_a_source_line():
    """Unstandardised targets and a client-level record cap that clips are warned as ``privfl run: warning: ...``
    (once, not per client), and ``--unit client`` states the cap it uses (item 5)."""
    small = ["run", "--algorithm", "fedbnr", "--dataset", "diabetes", "--clients", "3", "--rounds", "1", "--quiet"]
    code = ("import sys\nfrom privfl.apps.cli import main\n"
            f"assert main({small + ['--standardize', 'none']!r}) == 0\n"
            "print('---', file=sys.stderr)\n"
            f"assert main({small + ['--unit', 'client', '--record-cap', '50']!r}) == 0\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    raw, capped = proc.stderr.split("---\n")
    assert raw.count("privfl run: warning: fedbnr: more than half of a client's regression targets") == 1
    assert "--standardize public" in raw and "fedbnr.py" not in raw and "Traceback" not in raw
    assert "at most 50 records (--record-cap)" in capped
    assert capped.count("privfl run: warning: fedbnr: a client holds more records than the public record cap "
                        "(50") == 1


@pytest.mark.parametrize("argv, start", [
    (["run", "--dataset", "digits", "--clients", "3", "--rounds", "0", "--quiet"], "--rounds: rounds must be"),
    (["run", "--dataset", "digits", "--clients", "3", "--rounds", "1", "--batch-size", "0", "--quiet"],
     "--batch-size: batch_size must be"),
    (["run", "--dataset", "digits", "--clients", "3", "--rounds", "1", "--sampling-rate", "0", "--quiet"],
     "--sampling-rate: sampling_rate must"),
    (["calibrate", "--epsilon", "3", "--rounds", "0"], "--rounds: rounds must be"),
])
def test_a_setting_out_of_range_is_reported_with_its_flag(capsys, argv, start):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and f"privfl {argv[0]}: error: {start}" in err and "Traceback" not in err


def test_the_audit_of_a_ledger_with_several_runs_names_them_and_the_flag(tmp_path, capsys):
    path = tmp_path / "two.sqlite"
    _ledger(path, 1.0, "first"), _ledger(path, 1.0, "second")
    code, _, err = run_cli(capsys, "audit", str(path))
    assert code == 2 and "holds the runs [first, second]" in err and "--run-id" in err
    code, _, err = run_cli(capsys, "audit", str(path), "--run-id", "third")
    assert code == 2 and "[first, second], not 'third'" in err and "Traceback" not in err
    code, out, _ = run_cli(capsys, "audit", str(path), "--run-id", "second", "--json")
    assert code == 0 and json.loads(out)["run_id"] == "second"


def test_the_model_and_data_set_names_in_the_help_are_the_built_in_ones():
    from privfl.apps.cli import DATASET_NAMES, MODEL_NAMES
    from privfl.data import DATASETS
    from privfl.models import MODELS

    assert MODEL_NAMES == tuple(sorted(MODELS)) and DATASET_NAMES == tuple(sorted(DATASETS))
    run_help = " ".join(_subparsers()["run"].format_help().split())
    assert f"one of {', '.join(MODEL_NAMES)}" in run_help and f"one of {', '.join(DATASET_NAMES)}" in run_help


@pytest.mark.parametrize("flag", ["--ledger", "--json", "--save-model"])
def test_an_output_path_under_a_file_names_the_flag_and_the_file(tmp_path, capsys, flag):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    code, out, err = run_cli(capsys, "run", "--dataset", "digits", "--clients", "3", "--rounds", "1", "--quiet",
                             flag, str(blocker / "sub" / "out.x"))
    assert code == 2 and f"{flag} {blocker}" in err and "is a file, not a folder" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, "compare", "--out-dir", str(blocker), "--quiet")
    assert code == 2 and f"--out-dir {blocker}" in err and "is a file, not a folder" in err
