"""Issue 28's silent mistakes made loud, before anything is charged where they can be seen then: a client too small
for its DP-SGD schedule, a model with more outputs than the classes, and a run that diverges (an error naming the
likely causes; the CLI exits 2 without a traceback)."""

import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import privfl
from privfl.accounting.ledger import PrivacyLedger
from privfl.apps.cli import main
from privfl.errors import ConfigurationError, InvalidRelease, TrainingDiverged
from privfl.runtime.rounds import EXPLODED_RMSE, divergence

QUIET = {"rounds": 1, "secure_noise": False, "seed": 0}


def _classification(n, seed, features=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64)


def _test_set():
    return _classification(40, 99)


def _run_dpsgd(sizes, ledger=":memory:", **kw):
    clients = {f"org{k}": _classification(n, k) for k, n in enumerate(sizes)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return privfl.federate(nn.Linear(3, 2), clients, algorithm="dpsgd_fedavg", epsilon=3.0, client_size=100,
                               batch_size=32, test=_test_set(), ledger=ledger, **QUIET, **kw)


# -- a client too small for its schedule ---------------------------------------------------------------------------

def test_a_client_below_one_record_per_step_is_refused_before_anything_is_charged(tmp_path):
    """q = batch_size / client_size = 0.32: a client needs ceil(1 / q) = 4 records (q * n >= 1 record per step on
    average); 3 records are refused by name, with the rule and what to change, and the ledger holds no charge."""
    ledger = tmp_path / "l.sqlite"
    with pytest.raises(ConfigurationError) as err:
        _run_dpsgd([100, 100, 3], ledger=str(ledger))
    text = str(err.value)
    for needle in ("'org2'", "3 training records", "q = 0.32", "at least 4 records", "client_size", "batch_size",
                   "replace_one", "nothing was charged"):
        assert needle in text, needle
    for run in PrivacyLedger.run_ids(str(ledger)):
        assert PrivacyLedger.open_existing(str(ledger), run).charges() == []
    # at the boundary (q * n = 1.28 >= 1) the same federation runs
    result = _run_dpsgd([100, 100, 4])
    assert 0 < result.epsilon <= 3.0 * (1 + 1e-9)


def test_only_dpsgd_schedules_are_checked():
    """The rule reads the public DP-SGD schedule: a non-private run (no schedule) takes a 3-record client."""
    clients = {"a": _classification(100, 0), "b": _classification(3, 1)}
    result = privfl.federate(nn.Linear(3, 2), clients, algorithm="fedavg", test=_test_set(), **QUIET)
    assert result.history and result.model is not None


def test_cli_tiny_client_is_exit_2_without_traceback_and_public_counts_lift_the_rule(tmp_path, capsys):
    for k, n in enumerate((60, 60, 2)):
        x, y = _classification(n, k)
        frame = pd.DataFrame(x, columns=["a", "b", "c"])
        frame["y"] = y
        frame.to_csv(tmp_path / f"org{k}.csv", index=False)
    argv = ["run", "--algorithm", "dpsgd_fedavg", "--epsilon", "3", "--data", *sorted(map(str, tmp_path.glob("*.csv"))),
            "--target", "y", "--classes", "0,1", "--test-fraction", "0.2", "--standardize", "none", "--rounds", "1",
            "--client-size", "100", "--seeded-noise", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "privfl run: error: client 'org2' holds" in err and "too few" in err and "Traceback" not in err
    # with the record counts declared public each client samples from its own count: the schedule fits (declared
    # counts need a test set no client holds: with the held-out split one record's coin would move them)
    x, y = _classification(40, 9)
    pd.DataFrame(x, columns=["a", "b", "c"]).assign(y=y).to_csv(tmp_path / "test.csv", index=False)
    argv = [a for a in argv if a not in ("--test-fraction", "0.2")]
    assert main([*argv, "--adjacency", "replace_one", "--accountant", "pld", "--test-data",
                 str(tmp_path / "test.csv")]) == 0, capsys.readouterr().err


# -- a model whose outputs do not match the classes ------------------------------------------------------------------

def test_federate_refuses_more_outputs_than_the_labels_use():
    clients = {"a": _classification(60, 0), "b": _classification(60, 1)}
    with pytest.raises(ConfigurationError, match=r"outputs 3 values.*0\.\.1 \(2 classes\).*classes=\[\.\.\.\]"):
        privfl.federate(nn.Linear(3, 3), clients, algorithm="fedavg", **QUIET)
    # a private run reads no client's label for this: its classes come from classes= or the test data's labels
    with pytest.raises(ConfigurationError, match=r"outputs 3 values.*labels of the test data lie in 0\.\.1"):
        privfl.federate(nn.Linear(3, 3), clients, algorithm="dpsgd_fedavg", epsilon=3.0, client_size=50,
                        test=_classification(40, 2), **QUIET)
    with pytest.raises(ConfigurationError, match=r"label set is a public fact.*classes=\[\.\.\.\].*test="):
        privfl.federate(nn.Linear(3, 3), clients, algorithm="dpsgd_fedavg", epsilon=3.0, client_size=50, **QUIET)
    # declared: a third class no client holds is the user's to name
    result = privfl.federate(nn.Linear(3, 3), clients, algorithm="fedavg", classes=[0, 1, 2], **QUIET)
    assert result.model.out_features == 3
    # fewer outputs than labels were refused already
    with pytest.raises(ConfigurationError, match="outside 0..0"):
        privfl.federate(nn.Linear(3, 1), clients, algorithm="fedavg", task="classification", **QUIET)


ENTRY = '''
import numpy as np
from torch import nn


def three_outputs():
    rng = np.random.default_rng(0)
    clients = {}
    for k in range(3):
        x = rng.normal(size=(30, 3)).astype(np.float32)
        clients[f"h{k}"] = (x, (x[:, 0] > 0).astype(np.int64))
    return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 3)), clients
'''


@pytest.mark.parametrize("algorithm", ["fedavg", "fola"])
def test_entry_with_a_three_output_model_for_binary_labels_is_exit_2(tmp_path, monkeypatch, capsys, algorithm):
    (tmp_path / "threeout.py").write_text(ENTRY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["run", "--entry", "threeout:three_outputs", "--classes", "0,1", "--algorithm", algorithm,
                 "--epsilon", "inf", "--rounds", "1", "--standardize", "none", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "outputs 3 values" in err and "2 classes" in err and "Traceback" not in err


# -- a run that diverges -------------------------------------------------------------------------------------------

def _unstandardised_regression(seed):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(80, 4)) * [1, 10, 1000, 5000] + [0, 50, 2000, 10000]).astype(np.float32)
    y = (x @ np.array([1.0, 0.5, 0.01, 0.002]) + rng.normal(size=80)).astype(np.float32)
    return x, y


def test_exploding_regression_is_an_error_naming_the_likely_causes(tmp_path):
    """On a test set the server holds (test=): without one a private run's test set is the clients' held-out records,
    whose metrics decide nothing (tests/privfl/apps/test_own_data_neighbours.py)."""
    clients = {f"org{k}": _unstandardised_regression(k) for k in range(3)}
    ledger = tmp_path / "l.sqlite"
    torch.manual_seed(0)
    with pytest.raises(TrainingDiverged) as err:
        privfl.federate(nn.Linear(4, 1), clients, algorithm="dpsgd_fedavg", epsilon=3.0, client_size=64, rounds=5,
                        lr=0.5, secure_noise=False, ledger=str(ledger), test=_unstandardised_regression(9))
    text = str(err.value)
    assert "diverged in round" in text and "of 5" in text and "standard deviation of the test targets" in text
    assert "standardise" in text and "learning rate" in text and "stay charged" in text
    # it stopped at the round that exploded: the rounds up to it are charged, none after
    stopped = int(text.split("diverged in round ")[1].split(" ")[0])
    assert stopped < 5
    (run,) = PrivacyLedger.run_ids(str(ledger))
    assert {c.round for c in PrivacyLedger.open_existing(str(ledger), run).charges()} == set(range(stopped))


def _overflowing_clients():
    clients = {}
    for k in range(2):
        x, y = _unstandardised_regression(k)
        clients[f"org{k}"] = (x * 1e16, y)
    return clients


def test_non_finite_training_is_refused_before_release_naming_the_likely_causes():
    """Features around 1e20: the squared loss overflows float32 in the first step, the upload is not finite; a
    non-private run refuses it before anything leaves (nothing to hide: a clear error), naming the causes."""
    with pytest.raises(InvalidRelease, match=r"non-finite|NaN or Inf") as err:
        privfl.federate(nn.Linear(4, 1), _overflowing_clients(), algorithm="fedavg", rounds=2, secure_noise=False)
    text = str(err.value)
    assert "nothing was released" in text and "diverged" in text and "standardise" in text and "lower --lr" in text


def test_a_private_client_whose_training_fails_releases_no_change_and_the_server_stops_the_run(tmp_path):
    """The same in a private run: whether training fails depends on a client's records, so an error in its place
    would be an uncharged bit for the server; each client releases the fallback (no change), charged, and says so
    in a warning of its own (privfl.core.release.LocalResultNotFinite). The user still gets a clear error: the
    server's divergence check on the global model (on the test set it holds) stops the run, naming the causes."""
    from privfl.core.release import LocalResultNotFinite

    ledger = tmp_path / "l.sqlite"
    with pytest.warns(LocalResultNotFinite, match="not finite.*fallback.*standardise") as caught:
        with pytest.raises(TrainingDiverged) as err:
            x, y = _unstandardised_regression(9)
            privfl.federate(nn.Linear(4, 1), _overflowing_clients(), algorithm="dp_fedavg", rounds=2,
                            secure_noise=False, epsilon=3.0, client_size=64, ledger=str(ledger), test=(x * 1e16, y))
    assert {str(w.message).split(",")[0] for w in caught if w.category is LocalResultNotFinite} == {
        "client 0", "client 1"}
    text = str(err.value)
    assert "diverged in round 1 of 2" in text and "standardise" in text and "learning rate" in text
    (run,) = PrivacyLedger.run_ids(str(ledger))
    charges = PrivacyLedger.open_existing(str(ledger), run).charges()
    assert sorted((c.client_id, c.round, c.released) for c in charges) == [("0", 0, True), ("1", 0, True)]


def test_divergence_rules():
    from privfl.data import ArrayDataset

    class Global:
        global_params = np.array([0.0, np.nan])

    class Other:
        pass

    reg = ArrayDataset(np.zeros((4, 1), np.float32), np.array([0.0, 1.0, 2.0, 3.0], np.float32), "regression", 1)
    spread = float(np.std(reg.y))
    assert "parameters are not finite" in divergence(Global(), {"rmse": 1.0}, reg)
    assert divergence(Other(), {"rmse": 0.5}, reg) is None
    assert divergence(Other(), {"rmse": EXPLODED_RMSE * spread * 0.99}, reg) is None  # poor, not exploded
    assert "exploded" in divergence(Other(), {"rmse": EXPLODED_RMSE * spread * 1.01}, reg)
    assert "not finite" in divergence(Other(), {"rmse": math.inf}, reg)
    cls = ArrayDataset(np.zeros((2, 1), np.float32), np.array([0, 1]), "classification", 2)
    assert "not finite" in divergence(Other(), {"accuracy": 0.5, "nll": math.nan}, cls)
    assert divergence(Other(), {"accuracy": 0.5, "nll": 27.6}, cls) is None  # a confident, wrong model is not NaN


def test_cli_divergence_exits_2_without_traceback(tmp_path, capsys):
    for k in range(3):
        x, y = _unstandardised_regression(k)
        frame = pd.DataFrame(x, columns=["a", "b", "c", "d"])
        frame["y"] = y
        frame.to_csv(tmp_path / f"org{k}.csv", index=False)
    x, y = _unstandardised_regression(9)  # a test file the server holds: its metrics may stop a private run
    pd.DataFrame(x, columns=["a", "b", "c", "d"]).assign(y=y).to_csv(tmp_path / "test.csv", index=False)
    code = main(["run", "--algorithm", "dpsgd_fedavg", "--epsilon", "3", "--data", str(tmp_path / "org*.csv"),
                 "--target", "y", "--task", "regression", "--rounds", "5", "--lr", "0.5", "--client-size", "64",
                 "--seeded-noise", "--quiet", "--json", str(tmp_path / "r.json"), "--test-data",
                 str(tmp_path / "test.csv")])
    err = capsys.readouterr().err
    assert code == 2 and "privfl run: error: dpsgd_fedavg diverged in round 1" in err and "Traceback" not in err
    assert "--public-data" in err and not (tmp_path / "r.json").exists()


def test_a_run_that_learns_is_not_flagged():
    """Standardised features, the same federation: it runs to the end."""
    clients = {}
    for k in range(3):
        x, y = _unstandardised_regression(k)
        clients[f"org{k}"] = ((x - x.mean(0)) / x.std(0), (y - 60.0) / 20.0)
    result = privfl.federate(nn.Linear(4, 1), clients, algorithm="dpsgd_fedavg", epsilon=3.0, client_size=64,
                             rounds=3, lr=0.5, secure_noise=False)
    assert len(result.history) == 3 and math.isfinite(result.final["rmse"])
    assert isinstance(result.model, nn.Module) and torch.isfinite(result.model.weight).all()
