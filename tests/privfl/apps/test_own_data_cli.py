"""Own data end to end: breast cancer over 4 "hospitals" as CSV files through ``privfl run --data ... --target y``
(DP-SGD FedAvg at epsilon 3: the audit within target and a utility floor), and through a compare TOML with an entry
point; every misuse is exit 2 with a message naming the flag."""

import json
import math

import pytest
from sklearn.datasets import load_breast_cancer

from privfl.apps.cli import main


@pytest.fixture(scope="module")
def hospitals(tmp_path_factory):
    """clients/h0..h3.csv, test.csv (the evaluator's) and public.csv (no client's: standardisation statistics)."""
    root = tmp_path_factory.mktemp("own")
    frame = load_breast_cancer(as_frame=True).frame.rename(columns={"target": "y"})
    test = frame.iloc[::5]
    train = frame.drop(test.index)
    public = train.iloc[::10]
    train = train.drop(public.index)
    (root / "clients").mkdir()
    for i in range(4):
        train.iloc[i::4].to_csv(root / "clients" / f"h{i}.csv", index=False)
    test.to_csv(root / "test.csv", index=False)
    public.to_csv(root / "public.csv", index=False)
    return root


@pytest.mark.timeout(300)
def test_run_on_csv_files_per_client(hospitals, tmp_path, capsys):
    out, ledger = tmp_path / "r.json", tmp_path / "l.sqlite"
    code = main(["run", "--algorithm", "dpsgd_fedavg", "--epsilon", "3", "--data", str(hospitals / "clients/*.csv"),
                 "--target", "y", "--test-data", str(hospitals / "test.csv"), "--public-data",
                 str(hospitals / "public.csv"), "--rounds", "3", "--hidden", "", "--ledger", str(ledger),
                 "--client-size", "90", "--json", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 0, err
    result = json.loads(out.read_text())
    assert result["clients"] == 4 and result["settings"]["data"]["target"] == "y"
    assert result["settings"]["privacy"]["unit"] == "example"
    assert 0 < result["epsilon_spent_max"] <= 3 * (1 + 1e-9)
    assert result["final"]["balanced_accuracy"] > 0.8 and result["final"]["auroc"] > 0.85  # chance is 0.5
    assert main(["audit", str(ledger), "--json"]) == 0
    audit = json.loads(capsys.readouterr().out)
    assert set(audit["clients"]) == {"0", "1", "2", "3"} and audit["max_epsilon"] <= 3 * (1 + 1e-9)


@pytest.mark.parametrize("extra, needle", [
    (["--dataset", "digits"], "choose one"),
    (["--partition", "iid"], "--partition"),
    (["--clients", "3"], "--clients 3"),
    (["--standardize", "public", "--public-data", None], "--public-data"),
    (["--test-fraction", "0.2"], "--test-fraction"),
    (["--target", "nope"], "--target 'nope'"),
])
def test_own_data_misuse_is_exit_2(hospitals, capsys, extra, needle):
    argv = ["run", "--algorithm", "fedavg", "--epsilon", "inf", "--data", str(hospitals / "clients/*.csv"),
            "--target", "y", "--test-data", str(hospitals / "test.csv"), "--rounds", "1", "--quiet"]
    if None in extra:
        argv = argv + ["--standardize", "public"]
    else:
        argv = argv + extra
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err


def test_own_data_flags_without_data_are_refused(capsys):
    assert main(["run", "--dataset", "digits", "--target", "y", "--quiet"]) == 2
    assert "--target" in capsys.readouterr().err


def _module_entry(tmp_path, monkeypatch, name, model="torch.nn.Linear(3, 2)"):
    """An entry point ``<name>:federation`` (a fresh module name: imports are cached per process)."""
    (tmp_path / f"{name}.py").write_text(
        "import torch, numpy as np\n"
        "def federation():\n"
        "    rng = np.random.default_rng(0)\n"
        f"    return {model}, {{f'c{{i}}': (rng.normal(size=(12, 3)).astype('float32'), rng.integers(0, 2, 12)) "
        "for i in range(2)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("model", ["torch.nn.Linear(3, 2)", "(lambda: torch.nn.Linear(3, 2))"])
def test_an_entry_returning_a_module_trains_it(tmp_path, monkeypatch, model):
    """Issue 15: the entry point returns the model (a module or a zero-argument factory) and the clients' data;
    FedAvg trains that module: the saved state is the Linear's."""
    name = "module_entry" if model.startswith("torch") else "factory_entry"
    _module_entry(tmp_path, monkeypatch, name, model)
    out, saved = tmp_path / "r.json", tmp_path / "m.pt"
    code = main(["run", "--algorithm", "fedavg", "--epsilon", "inf", "--entry", f"{name}:federation",
                 "--classes", "0,1", "--rounds", "2", "--quiet", "--json", str(out), "--save-model", str(saved)])
    assert code == 0
    import torch

    state = torch.load(saved)
    assert {k: tuple(v.shape) for k, v in state.items()} == {"weight": (2, 3), "bias": (2,)}
    assert len(json.loads(out.read_text())["accuracy_per_round"]) == 2


def test_an_entry_returning_a_module_is_refused_clearly_where_it_cannot_be_trained(tmp_path, monkeypatch, capsys):
    _module_entry(tmp_path, monkeypatch, "refused_entry")
    code = main(["run", "--algorithm", "fedbnr", "--epsilon", "inf", "--entry", "refused_entry:federation",
                 "--classes", "0,1", "--quiet"])
    err = capsys.readouterr().err
    # every algorithm takes a user's model now; fedbnr takes it as a feature extractor for regression, and this
    # entry's labelled classes are refused with the reason, before anything runs
    assert code == 2 and "fedbnr" in err and "regression" in err and "Traceback" not in err


@pytest.mark.timeout(300)
def test_compare_toml_entry_returning_a_module_trains_it_and_is_refused_where_it_cannot(tmp_path, monkeypatch,
                                                                                      capsys):
    _module_entry(tmp_path, monkeypatch, "compare_module_entry")
    cfg = tmp_path / "own.toml"
    cfg.write_text('entry = "compare_module_entry:federation"\nclasses = ["0", "1"]\nepsilons = [3.0]\nseeds = [0]\n'
                   f'rounds = 1\nclient_size = 10\nalgorithms = ["fedavg", "dp_fedavg"]\nout_dir = "{tmp_path / "out"}"\n')
    code = main(["compare", str(cfg), "--quiet", "--json", str(tmp_path / "r.json")])
    assert code == 0, capsys.readouterr().err
    import torch

    rows = json.loads((tmp_path / "r.json").read_text())["results"]
    assert {r["algorithm"] for r in rows} == {"fedavg", "dp_fedavg"}
    for r in rows:  # the entry's Linear(3, 2) is what was trained and saved
        state = torch.load(r["model_path"])
        assert {k: tuple(v.shape) for k, v in state.items()} == {"weight": (2, 3), "bias": (2,)}
    cfg.write_text(cfg.read_text().replace('["fedavg", "dp_fedavg"]', '["fedavg", "fedbnr"]'))
    code = main(["compare", str(cfg), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "fedbnr" in err and "regression" in err and "Traceback" not in err


@pytest.mark.timeout(300)
def test_compare_toml_with_an_entry_point(hospitals, tmp_path, monkeypatch, capsys):
    (tmp_path / "hospital_fed.py").write_text(
        "import pandas as pd\n"
        f"ROOT = {str(hospitals)!r}\n"
        "def federation():\n"
        "    clients = {f'h{i}': pd.read_csv(f'{ROOT}/clients/h{i}.csv') for i in range(4)}\n"
        "    return {'model': 'mlp', 'hidden': []}, clients, pd.read_csv(f'{ROOT}/test.csv')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "public.csv").write_text((hospitals / "public.csv").read_text())
    cfg = tmp_path / "own.toml"
    cfg.write_text('entry = "hospital_fed:federation"\ntarget = "y"\npublic_data = "public.csv"\nepsilons = [3.0]\n'
                   'seeds = [0]\nrounds = 3\nclient_size = 90\nalgorithms = ["fedavg", "dpsgd_fedavg"]\n'
                   f'out_dir = "{tmp_path / "out"}"\n')
    code = main(["compare", str(cfg), "--quiet", "--json", str(tmp_path / "r.json")])
    assert code == 0, capsys.readouterr().err
    rows = json.loads((tmp_path / "r.json").read_text())["results"]
    assert {r["algorithm"] for r in rows} == {"fedavg", "dpsgd_fedavg"}
    for r in rows:
        assert r["clients"] == 4 and r["dataset"] == "hospital_fed:federation"
        assert r["settings"]["federation"]["hidden"] == [] and r["settings"]["data"]["entry"] == "hospital_fed:federation"
        assert r["balanced_accuracy"] > 0.7  # chance is 0.5
        if r["epsilon_target"] != "inf":
            assert r["epsilon_spent_max"] <= 3 * (1 + 1e-9)
    assert (tmp_path / "out" / "config.toml").read_text() == cfg.read_text()
    assert not math.isnan(rows[0]["auroc"])


@pytest.mark.timeout(300)
def test_run_with_an_entry_point_and_the_split_rule(tmp_path, monkeypatch, capsys):
    """Arrays from Python, no test file: each client holds out 20% of its own records; the label set is declared."""
    (tmp_path / "wine_fed.py").write_text(
        "from sklearn.datasets import load_wine\n"
        "def federation():\n"
        "    x, y = load_wine(return_X_y=True)\n"
        "    x = (x - x.mean(0)) / x.std(0)  # stands in for the user's own public scaling\n"
        "    return {'model': 'mlp', 'hidden': [8]}, {f'site{i}': (x[i::3], y[i::3]) for i in range(3)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "r.json"
    code = main(["run", "--algorithm", "fedavg", "--epsilon", "inf", "--entry", "wine_fed:federation",
                 "--classes", "0,1,2", "--rounds", "3", "--lr", "0.1", "--json", str(out), "--quiet"])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["clients"] == 3 and result["settings"]["federation"]["hidden"] == [8]
    assert result["final"]["balanced_accuracy"] > 0.8  # three classes: chance is 1/3


def test_parquet_is_read_or_refused_with_the_fix(tmp_path, hospitals):
    import pandas as pd

    from privfl.data import DatasetError, read_table

    path = tmp_path / "c.parquet"
    frame = pd.read_csv(hospitals / "test.csv")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        path.write_bytes(b"PAR1")
        with pytest.raises(DatasetError, match="pyarrow"):
            read_table(str(path))
    else:
        frame.to_parquet(path)
        pd.testing.assert_frame_equal(read_table(str(path)), frame)


def test_a_private_compare_grid_on_one_file_split_by_client_column_declares_its_clients(hospitals, tmp_path):
    """As `privfl run --client-column` needs --client-names: the roster of a private grid is declared
    (client_names), never read off the rows, where one record with a new site value would add a client and change
    the run's settings; the declared roster is the federation's, in its order."""
    import pandas as pd

    from privfl.apps.compare import CompareConfig, federation
    from privfl.errors import ConfigurationError

    frames = [pd.read_csv(p).assign(site=f"h{i}") for i, p in enumerate(sorted((hospitals / "clients").glob("*.csv")))]
    pd.concat(frames).to_csv(tmp_path / "all.csv", index=False)
    base = ('data = "all.csv"\ntarget = "y"\nclient_column = "site"\ntest_data = "%s"\nclient_size = 90\n'
            'algorithms = ["dpsgd_fedavg"]\nseeds = [0]\n' % (hospitals / "test.csv"))
    (tmp_path / "a.toml").write_text(base + "epsilons = [3.0]\n")
    with pytest.raises(ConfigurationError, match="client_names"):
        CompareConfig.from_toml(str(tmp_path / "a.toml"))
    (tmp_path / "b.toml").write_text(base + 'epsilons = [3.0]\nclient_names = ["h2", "h0", "h1", "h3"]\n')
    config = CompareConfig.from_toml(str(tmp_path / "b.toml"))
    assert config.clients == 4
    data = federation(config, 0)
    assert [len(p) for p in data.train_parts] == [len(frames[i]) for i in (2, 0, 1, 3)]
    (tmp_path / "c.toml").write_text(base + "epsilons = [inf]\n")  # non-private: the values found, sorted
    assert CompareConfig.from_toml(str(tmp_path / "c.toml")).clients == 4
