"""privfl compare: schema, resume after interruption, and every run's ledger within its target."""

import json
import math
import os

import pytest

from privfl.accounting.ledger import PrivacyLedger
from privfl.apps.cli import main
from privfl.apps.compare import CompareConfig, compare, grid, summary_table
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
        assert {"balanced_accuracy", "auroc", "settings", "config_hash", "privfl_version", "noise_applied"} <= set(r)
        # issue 27: selective accuracy (the 80 % most confident test points) beside NLL and ECE in every row
        assert r["selective_accuracy"] == r["final"]["selective_accuracy"] and 0 <= r["selective_accuracy"] <= 1
        assert r["settings"]["federation"]["rounds"] == 2 and r["settings"]["data"]["clients"] == 3
        assert os.path.getsize(r["model_path"]) > 0
        assert not any(k.startswith("val_") for k in r)  # no validation split asked for: no validation columns
        if r["epsilon_target"] != "inf":  # strict JSON: infinity is the string "inf"
            assert r["noise_applied"]["update"][0]["noise_multiplier"] > 0
            led = PrivacyLedger.open_existing(r["ledger"])
            assert led.audit()["max_epsilon"] <= r["epsilon_target"] * (1 + 1e-9)
            assert r["epsilon_spent_max"] <= r["epsilon_target"] * (1 + 1e-9)
            # issue 29: each round's privacy SNR of the noised update, and its median in the row
            assert len(r["snr_per_round"]) == 2 and all(set(x) == {"update"} for x in r["snr_per_round"])
            assert r["snr_median"] >= 0
        else:
            assert r["snr_per_round"] == [{}, {}] and r["snr_median"] is None
    assert "Infinity" not in (out / "results.json").read_text() and "NaN" not in (out / "results.json").read_text()
    assert (out / "results.csv").read_text().startswith("algorithm,epsilon_target,seed,accuracy")
    assert "selective_accuracy" in (out / "results.csv").read_text().splitlines()[0].split(",")
    assert all(0 <= t["selective_accuracy"] <= 1 for t in summary_table(rows))
    assert json.loads((out / "config.json").read_text())["rounds"] == 2
    for fig in ("accuracy_vs_epsilon.png", "epsilon_per_client.png", "reliability.png"):
        assert (out / fig).stat().st_size > 5000

    # Interrupted: one result lost. Only that run is redone.
    os.remove(out / "runs" / "dp_fedavg-eps2-seed1.json")
    calls = []
    import privfl.apps.compare as mod

    real = mod.run_one
    monkeypatch.setattr(mod, "run_one", lambda c, s, d, **kw: calls.append(s.key) or real(c, s, d, **kw))
    again = compare(config, progress=False)
    assert calls == ["dp_fedavg-eps2-seed1"]
    assert len(again) == len(rows)
    assert sorted(r["epsilon_target"] for r in again) == sorted(r["epsilon_target"] for r in rows)  # floats again

    # The same folder with other settings: refused before anything runs, naming --out-dir; never silently reused.
    calls.clear()
    for changed in (dict(rounds=3), dict(clients=4), dict(overrides={"fedavg": {"hidden": [16]},
                                                                      "dp_fedavg": {"hidden": [], "pool": 1}})):
        with pytest.raises(ConfigurationError, match="--out-dir") as err:
            compare(small(tmp_path, **changed), progress=False)
        assert "then" in str(err.value) and calls == []


def test_cli_compare_json(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('dataset = "digits"\nclients = 3\npartition = "iid"\nepsilons = [2.0]\nseeds = [0]\nrounds = 1\n'
                   f'algorithms = ["dp_fedavg"]\nout_dir = "{tmp_path / "o"}"\n'
                   '[overrides.dp_fedavg]\nhidden = []\npool = 1\n')
    code = main(["compare", str(cfg), "--json", str(tmp_path / "r.json"), "--quiet"])
    assert code == 0
    res = json.loads((tmp_path / "r.json").read_text())["results"]
    assert res[0]["algorithm"] == "dp_fedavg" and res[0]["epsilon_spent_max"] <= 2.0 * (1 + 1e-9)
    out = capsys.readouterr().out
    assert "dp_fedavg" in out and "SNR" in out  # the table's privacy signal-to-noise column


def test_bad_configs(tmp_path):
    with pytest.raises(ConfigurationError, match="unknown algorithms"):
        small(tmp_path, algorithms=("nope",))
    with pytest.raises(ConfigurationError, match="epsilons"):
        small(tmp_path, epsilons=(0.0,))
    bad = tmp_path / "b.toml"
    bad.write_text('datasets = "digits"\n')
    with pytest.raises(ConfigurationError, match="unknown keys"):
        CompareConfig.from_toml(str(bad))


def test_bad_grids_are_refused(tmp_path):
    with pytest.raises(ConfigurationError, match=r"overrides.folla\] names no algorithm"):
        small(tmp_path, overrides={"folla": {"hidden": [8]}})
    with pytest.raises(ConfigurationError, match=r"overrides.fola\] has unknown keys"):  # checked all the same
        small(tmp_path, overrides={"fola": {"hiden": [8]}})
    with pytest.raises(ConfigurationError, match="at least 2 clients"):
        small(tmp_path, clients=1)
    # the built-in sizes cover every algorithm; a grid of a few of them keeps only theirs
    assert set(CompareConfig(algorithms=("fedavg",), out_dir=str(tmp_path)).overrides) == {"fedavg"}


@pytest.mark.parametrize("content, needle", [(None, "does not exist"), (b"rounds = = 2\n", "not valid TOML"),
                                             (b"\xff\xfe\x00", "TOML"), ("dir", "directory"),
                                             (b'algorithms = ["fedavg"]\n[overrides.fola]\nhiden = [8]\n',
                                              "[overrides.fola] has unknown keys"),
                                             (b'rounds = "x"\n', "rounds must be an integer >= 1, got 'x'"),
                                             (b"delta = 2\n", "delta must be a number in (0, 1)"),
                                             (b"epsilons = 3\n", "epsilons must be a list"),
                                             (b"overrides = 3\n", "overrides must be TOML tables"),
                                             (b"val_fraction = 1.0\n", "val_fraction must be a number in [0, 1)"),
                                             (b'val_fraction = "0.1"\n', "val_fraction must be a number in [0, 1)"),
                                             (b'algorithms = ["fedavg"]\n[overrides.fedavg]\nrounds = 0\n',
                                              "[overrides.fedavg] rounds must be an integer >= 1")])
def test_cli_compare_file_errors_exit_2_without_traceback(tmp_path, capsys, content, needle):
    cfg = tmp_path / "c.toml"
    if content == "dir":
        cfg.mkdir()
    elif content is not None:
        cfg.write_bytes(content)
    code = main(["compare", str(cfg), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and str(cfg) in err and "Traceback" not in err


def test_cli_compare_copies_its_toml_and_reports_progress_per_round(tmp_path, capsys, monkeypatch):
    import privfl.apps.compare as mod

    cfg = tmp_path / "c.toml"
    cfg.write_text('dataset = "digits"\nclients = 3\npartition = "iid"\nepsilons = [2.0]\nseeds = [0]\nrounds = 2\n'
                   f'algorithms = ["dp_fedavg"]\nout_dir = "{tmp_path / "o"}"\n'
                   '[overrides.dp_fedavg]\nhidden = []\npool = 1\n')
    rounds_seen = []
    real = mod.run_one

    def spy(c, s, d, progress=None):
        assert progress is not None  # the bar advances once per round, with an ETA
        return real(c, s, d, progress=lambda rec: (rounds_seen.append(rec.round), progress(rec)))

    monkeypatch.setattr(mod, "run_one", spy)
    assert main(["compare", str(cfg)]) == 0
    assert rounds_seen == [0, 1]
    # the table's title names the unit each row ran at: dp_fedavg is client-level in a record-level grid
    assert "unit=example (dp_fedavg: client)" in capsys.readouterr().out
    assert (tmp_path / "o" / "config.toml").read_text() == cfg.read_text()
    assert (tmp_path / "o" / "models" / "dp_fedavg-eps2-seed0.pt").stat().st_size > 0


@pytest.mark.timeout(300)
def test_reference_rows_centralised_and_local_only(tmp_path):
    config = small(tmp_path, algorithms=("fedavg",), epsilons=(math.inf,), seeds=(0,), rounds=2,
                   overrides={"fedavg": {"hidden": [8]}}, references=("centralised", "local_only"))
    rows = {r["algorithm"]: r for r in compare(config, progress=False)}
    assert set(rows) == {"fedavg", "centralised", "local_only"}
    central, local = rows["centralised"], rows["local_only"]
    assert central["epsilon_spent_max"] == math.inf and local["epsilon_spent_max"] == 0.0
    assert central["settings"]["federation"]["hidden"] == [8] == local["settings"]["federation"]["hidden"]
    # on digits with 3 iid clients pooling helps: the ceiling beats each client alone
    assert central["accuracy"] > local["accuracy"]
    for r in (central, local):
        assert 0 <= r["balanced_accuracy"] <= 1 and len(r["accuracy_per_round"]) == 2
    with pytest.raises(ConfigurationError, match="references"):
        small(tmp_path, references=("oracle",))


def test_overrides_take_an_algorithms_own_options_and_refuse_unknown_ones():
    from privfl.apps.compare import CompareConfig, _options

    config = CompareConfig(algorithms=("fedbnn", "hbfl"), epsilons=(3.0,),
                           overrides={"fedbnn": {"warmup_epochs": 3, "hidden": [8]}, "hbfl": {"meme_lr": 0.01}})
    assert _options(config, "fedbnn") == {"warmup_epochs": 3}
    assert _options(config, "hbfl") == {"meme_lr": 0.01}
    with pytest.raises(ConfigurationError, match="warmup_epochs"):  # the message lists what fedbnn takes
        CompareConfig(algorithms=("fedbnn",), overrides={"fedbnn": {"warmup_epoch": 3}})
    from privfl.algorithms import make_algorithm
    from privfl.core.config import FederationConfig, PrivacyConfig

    alg = make_algorithm("fedbnn", FederationConfig(), PrivacyConfig(), warmup_epochs=3)
    assert alg.warmup_epochs == 3
    with pytest.raises(ConfigurationError, match="takes no option"):
        make_algorithm("fedavg", FederationConfig(), PrivacyConfig(), mu=0.1)


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5, True, "0.1", math.nan])
def test_val_fraction_is_validated(tmp_path, value):
    with pytest.raises(ConfigurationError, match=r"val_fraction must be a number in \[0, 1\)"):
        small(tmp_path, val_fraction=value)


def test_val_fraction_refuses_own_data(tmp_path):
    with pytest.raises(ConfigurationError, match="val_fraction"):
        CompareConfig(data=str(tmp_path / "*.csv"), target="y", clients=2, algorithms=("fedavg",), val_fraction=0.1,
                      out_dir=str(tmp_path / "o"))


def test_validation_split_is_disjoint_from_test_and_clients(tmp_path):
    from privfl.apps.compare import federation

    data = federation(small(tmp_path, val_fraction=0.2), 0)
    assert len(data.val) == round(0.2 * 1797)  # digits: every image is distinct, so rows identify records
    rows = lambda ds: {r.tobytes() for r in ds.x.reshape(len(ds.x), -1)}  # noqa: E731
    val, test = rows(data.val), rows(data.test)
    assert not val & test
    for part in data.train_parts:
        assert not val & rows(part)
    # the test split is the one a grid without validation split uses
    assert rows(federation(small(tmp_path), 0).test) == test


@pytest.mark.timeout(300)
def test_compare_reports_validation_metrics_and_per_algorithm_rounds(tmp_path):
    config = small(tmp_path, seeds=(0,), epsilons=(2.0,), val_fraction=0.2,
                   overrides={"fedavg": {"hidden": [8], "rounds": 3}, "dp_fedavg": {"hidden": [], "pool": 1}})
    rows = {r["algorithm"]: r for r in compare(config, progress=False)}
    for r in rows.values():
        assert 0 <= r["val_accuracy"] <= 1 and 0 <= r["val_balanced_accuracy"] <= 1 and r["val_nll"] > 0
        assert {"val_auroc", "val_ece", "val_final", "accuracy", "nll", "ece"} <= set(r)
        assert r["settings"]["data"]["val_fraction"] == 0.2
    assert rows["fedavg"]["rounds"] == 3 == rows["fedavg"]["settings"]["federation"]["rounds"]
    assert len(rows["fedavg"]["accuracy_per_round"]) == 3
    assert rows["dp_fedavg"]["rounds"] == 2 == len(rows["dp_fedavg"]["accuracy_per_round"])
    out = tmp_path / "out"
    header = (out / "results.csv").read_text().splitlines()[0]
    assert header.startswith("algorithm,epsilon_target,seed,accuracy") and header.endswith(
        "val_accuracy,val_balanced_accuracy,val_auroc,val_nll,val_ece")
    saved = json.loads((out / "results.json").read_text())["results"]
    assert all(isinstance(r["val_accuracy"], float) for r in saved)
    from privfl.apps.compare import summary_table

    assert all(0 <= t["val_accuracy"] <= 1 for t in summary_table(list(rows.values())))
    # a rounds override is a setting like any other: another count in the same folder is refused
    with pytest.raises(ConfigurationError, match="rounds"):
        compare(small(tmp_path, seeds=(0,), epsilons=(2.0,), val_fraction=0.2,
                      overrides={"fedavg": {"hidden": [8], "rounds": 4}, "dp_fedavg": {"hidden": [], "pool": 1}}),
                progress=False)


def test_without_val_fraction_rows_and_settings_are_unchanged(tmp_path):
    from privfl.apps.compare import RunSpec, run_settings

    config = small(tmp_path)
    assert "val_fraction" not in run_settings(config, RunSpec("fedavg", math.inf, 0))["data"]  # old runs still resume


@pytest.mark.timeout(300)
def test_a_variant_is_its_own_row_of_its_algorithm_with_its_own_options(tmp_path):
    """[variants.<label>]: a registered algorithm under another row name, its [overrides.<algorithm>] then its own
    keys (DP-FedSGD predicting with FOLA's Laplace posterior beside DP-FedSGD itself)."""
    from privfl.apps.compare import _options

    over = {"dp_fedsgd": {"hidden": [], "pool": 1, "lot_size": 64, "batch_size": 64, "rounds": 3, "lr": 0.5}}
    config = small(tmp_path, algorithms=("dp_fedsgd", "fola_noise_once"), epsilons=(3.0,), seeds=(0,), overrides=over,
                   unit="example", variants={"fola_noise_once": {"algorithm": "dp_fedsgd", "posterior": "laplace",
                                                                 "posterior_scale": 0.1}})
    assert _options(config, "fola_noise_once") == {"lot_size": 64, "posterior": "laplace", "posterior_scale": 0.1}
    assert [s.algorithm for s in grid(config)] == ["dp_fedsgd", "fola_noise_once"]
    rows = {r["algorithm"]: r for r in compare(config, progress=False)}
    assert set(rows) == {"dp_fedsgd", "fola_noise_once"}
    variant = rows["fola_noise_once"]
    assert variant["settings"]["algorithm_options"]["posterior"] == "laplace"
    assert variant["settings"]["federation"]["rounds"] == 3 and variant["epsilon_spent_max"] <= 3.0
    ledger = PrivacyLedger(os.path.join(config.out_dir, "ledgers", "fola_noise_once-eps3-seed0.sqlite"),
                           "fola_noise_once-eps3-seed0", delta=1e-5, epsilon_budget=3.0, accountant="pld")
    assert {c.channel for c in ledger.charges()} == {"gradient_sum", "fisher_trace"}


@pytest.mark.parametrize("variants, needle", [
    ({"fedavg": {"algorithm": "dp_fedsgd"}}, "choose another label"),
    ({"v": {"algorithm": "nope"}}, "needs algorithm"),
    ({"v": {"algorithm": "dp_fedsgd", "posteriors": "laplace"}}, "unknown keys"),
    ({"V x": {"algorithm": "dp_fedsgd"}}, "lower-case identifier")])
def test_bad_variants_are_refused_naming_the_fix(tmp_path, variants, needle):
    with pytest.raises(ConfigurationError, match=needle):
        small(tmp_path, algorithms=("fedavg",), variants=variants)


def test_a_grid_wide_clip_reaches_every_row_and_adaptive_only_those_that_clip_adaptively(tmp_path):
    """``clip = "adaptive"`` (and ``clip_quantile``) at the top of a compare TOML (issue 29): DP-FedSGD's and DP-SGD
    FedAvg's rows clip adaptively, FOLA's keeps its own clip (a note names it); a number applies to every row unless
    the algorithm's table sets its own; a quantile without adaptive clipping is refused."""
    from privfl.apps.compare import CompareNote, RunSpec, _configs

    toml = tmp_path / "c.toml"
    toml.write_text('dataset = "digits"\nclients = 3\nalgorithms = ["dp_fedsgd", "dpsgd_fedavg", "fola"]\n'
                    'epsilons = [3.0]\nclip = "adaptive"\nclip_quantile = 0.7\n')
    with pytest.warns(CompareNote, match=r"\['fola'\] keep their own clip"):
        config = CompareConfig.from_toml(str(toml))
    for name in ("dp_fedsgd", "dpsgd_fedavg"):
        assert _configs(config, RunSpec(name, 3.0, 0))[1].clip_quantile == 0.7
    fola = _configs(config, RunSpec("fola", 3.0, 0))[1]
    assert fola.clip_quantile is None and fola.clip == _configs(CompareConfig(
        dataset="digits", clients=3, algorithms=("fola",), epsilons=(3.0,)), RunSpec("fola", 3.0, 0))[1].clip
    toml.write_text('dataset = "digits"\nclients = 3\nalgorithms = ["dp_fedsgd", "fola"]\nepsilons = [3.0]\n'
                    'clip = 0.3\n[overrides.fola]\nclip = 2.0\n')
    config = CompareConfig.from_toml(str(toml))
    assert _configs(config, RunSpec("dp_fedsgd", 3.0, 0))[1].clip == 0.3
    assert _configs(config, RunSpec("fola", 3.0, 0))[1].clip == 2.0
    for text, needle in (('clip_quantile = 0.7\n', "clip_quantile is adaptive clipping's target quantile"),
                         ('clip = "auto"\n', 'clip must be a number > 0 or "adaptive"')):
        toml.write_text('dataset = "digits"\nclients = 3\nalgorithms = ["dp_fedsgd"]\nepsilons = [3.0]\n' + text)
        with pytest.raises(ConfigurationError, match=needle):
            CompareConfig.from_toml(str(toml))
