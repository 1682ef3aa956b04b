"""``privfl run --option KEY=VALUE`` (issue 16): an algorithm's options from the command line, parsed and normalised
as ``privfl compare``'s TOML overrides are (:mod:`privfl.core.options`), checked against what the algorithm takes, and
part of the run id that hashes every setting."""

import json

import pytest

import privfl.algorithms
from privfl.apps.cli import main
from privfl.apps.compare import CompareConfig, _options
from privfl.errors import ConfigurationError
from privfl.core.options import option_value, parse_option, parse_options

SMALL = ["--dataset", "digits", "--clients", "3", "--rounds", "1", "--hidden", "8", "--quiet"]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("text, expected", [
    ("meme_lr=0.01", ("meme_lr", 0.01)),
    ("warmup_epochs=3", ("warmup_epochs", 3)),
    ("budget_shares=[0.6, 0.4]", ("budget_shares", (0.6, 0.4))),
    ('budget_shares={"mean": 0.7, "fisher": [1, 2]}', ("budget_shares", {"mean": 0.7, "fisher": (1, 2)})),
    ("noise_aware=false", ("noise_aware", False)),
    ("precision_clip=null", ("precision_clip", None)),
    ("weighting=uniform", ("weighting", "uniform")),  # not JSON: the string itself, no quotes needed
    ('weighting="uniform"', ("weighting", "uniform")),
    ("local_models=mlp,cnn1", ("local_models", "mlp,cnn1")),
    ("x=", ("x", "")),
    ("a=b=c", ("a", "b=c")),
])
def test_values_are_json_where_they_are_json_else_strings(text, expected):
    assert parse_option(text) == expected


@pytest.mark.parametrize("text", ["meme_lr", "=1", "not a name=1", "1x=2"])
def test_malformed_options_are_refused(text):
    with pytest.raises(ConfigurationError, match="KEY=VALUE"):
        parse_option(text)


def test_an_option_given_twice_is_refused():
    with pytest.raises(ConfigurationError, match="given twice"):
        parse_options(["meme_lr=0.1", "meme_lr=0.2"])


def test_the_cli_and_compare_normalise_options_alike():
    """A TOML override and an --option of the same value reach make_algorithm as the same value."""
    config = CompareConfig(algorithms=("hbfl", "fola"), overrides={
        "hbfl": {"budget_shares": [0.6, 0.4], "meme_lr": 0.01},
        "fola": {"budget_shares": {"mean": 0.5, "precision": 0.5}}})
    assert _options(config, "hbfl") == dict(parse_options(["budget_shares=[0.6,0.4]", "meme_lr=0.01"]))
    assert _options(config, "fola") == dict(parse_options(['budget_shares={"mean": 0.5, "precision": 0.5}']))
    assert option_value([[1, 2], {"a": [3]}]) == ((1, 2), {"a": (3,)})


def test_options_reach_the_algorithm_and_its_settings(capsys, tmp_path, monkeypatch):
    seen = {}
    make = privfl.algorithms.make_algorithm

    def spy(name, fed, privacy, **options):
        seen.update(options)
        return make(name, fed, privacy, **options)

    monkeypatch.setattr(privfl.algorithms, "make_algorithm", spy)
    out = tmp_path / "r.json"
    code, _, err = run_cli(capsys, "run", "--algorithm", "hbfl", *SMALL, "--epsilon", "inf", "--json", str(out),
                           "--option", "meme_lr=0.01", "--option", "budget_shares=[0.6,0.4]",
                           "--option", "carry_precision=true")
    assert code == 0, err
    assert seen["meme_lr"] == 0.01 and seen["budget_shares"] == (0.6, 0.4) and seen["carry_precision"] is True
    options = json.loads(out.read_text())["settings"]["algorithm_options"]
    assert options["meme_lr"] == 0.01 and options["budget_shares"] == [0.6, 0.4] and options["carry_precision"]


def test_an_unknown_option_exits_2_naming_it_and_the_valid_ones(capsys):
    code, _, err = run_cli(capsys, "run", "--algorithm", "fedprox", *SMALL, "--epsilon", "inf",
                           "--option", "meme_lr=0.01")
    assert code == 2 and "Traceback" not in err
    assert "meme_lr" in err and "fedprox" in err and "mu" in err


@pytest.mark.parametrize("algorithm, option, needle", [
    ("fedavg", "model=mlp", "--entry"),  # a Python object: your own model
    ("fedavg", "loss=mse", "Python object"),
    ("fedbnn", "alignment_size=20", "--alignment-size"),  # a flag of its own
    ("fedbnr", "kernel_rounds=2", "--kernel-rounds"),
])
def test_options_with_another_way_in_are_refused_with_that_way(capsys, algorithm, option, needle):
    code, _, err = run_cli(capsys, "run", "--algorithm", algorithm, *SMALL, "--epsilon", "inf", "--option", option)
    assert code == 2 and needle in err and option.split("=")[0] in err and "Traceback" not in err


def test_a_value_the_algorithm_refuses_exits_2_naming_the_option(capsys):
    code, _, err = run_cli(capsys, "run", "--algorithm", "hbfl", *SMALL, "--epsilon", "inf",
                           "--option", "meme_lr=fast")
    assert code == 2 and "--option meme_lr" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, "run", "--algorithm", "hbfl", *SMALL, "--epsilon", "inf",
                           "--option", "meme_lr")
    assert code == 2 and "KEY=VALUE" in err


def test_options_enter_the_run_id_so_a_run_with_other_options_is_another_run(capsys, tmp_path):
    ledger = str(tmp_path / "l.sqlite")
    base = ["run", "--algorithm", "fedprox", *SMALL, "--epsilon", "inf", "--ledger", ledger]
    ids = []
    for extra in ([], ["--option", "mu=0.5"], ["--option", "mu=0.25"]):
        out = tmp_path / f"r{len(ids)}.json"
        code, _, err = run_cli(capsys, *base, *extra, "--json", str(out))
        assert code == 0, err
        ids.append(json.loads(out.read_text())["run_id"])
    assert len(set(ids)) == 3, ids
    # the same options again are the same run, which the ledger holds already: refused, naming the run
    code, _, err = run_cli(capsys, *base, "--option", "mu=0.5")
    assert code == 2 and f"already holds run '{ids[1]}'" in err
    # resuming a run id with other options is refused too (the ledger holds that id)
    code, _, err = run_cli(capsys, *base, "--option", "mu=0.75", "--run-id", ids[1])
    assert code == 2 and ids[1] in err and "Traceback" not in err
