"""The prior-corrected decision rule from every front end (issue 28): ``federate(class_prior=...)``, ``privfl run
--class-prior`` and a compare TOML's ``class_prior``. The correction comes from the declared prior and the run's
class weights only: two federations differing in one record's label decide differently only through their trained
models; a prior that is not one base rate per class is refused before anything is charged (the CLI exits 2)."""

import json
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from privfl import FederationConfig, PrivacyConfig, make_algorithm
from privfl.apps.api import federate
from privfl.apps.cli import main
from privfl.apps.settings import resolve_prior_correction
from privfl.errors import ConfigurationError
from privfl.training.local import predict_proba


def _rare(n=120, seed=0):
    """Four features, about 10 % positives."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, (x[:, 0] > 1.3).astype(np.int64)


def _clients(flip: int | None = None):
    clients = {f"org{k}": _rare(seed=k) for k in range(3)}
    if flip is not None:  # the neighbour: one record of org0 with its label changed
        x, y = clients["org0"]
        y = y.copy()
        y[flip] = 1 - y[flip]
        clients["org0"] = (x, y)
    return clients


def _without_metrics(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "metrics"}


def test_federate_decides_with_the_declared_prior_and_reports_it():
    test = _rare(300, seed=9)
    result = federate(lambda: nn.Linear(4, 2), _clients(), algorithm="fedavg", rounds=2, lr=0.3, test=test,
                      class_prior=[0.9, 0.1])
    rule = result.decision
    np.testing.assert_allclose(rule.factors, [0.1, 0.9])
    proba = predict_proba(result.model, torch.as_tensor(test[0]))
    np.testing.assert_array_equal(result.predict(test[0]), (proba * rule.factors).argmax(axis=1))
    assert result.prior_corrected["metrics"] == rule.metrics(proba, test[1])
    assert result.prior_corrected["threshold"] == pytest.approx(0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # one round of the argmax may predict one class: warned
        plain = federate(lambda: nn.Linear(4, 2), _clients(), algorithm="fedavg", rounds=1, lr=0.3, test=test)
    assert plain.decision is None and plain.prior_corrected is None
    np.testing.assert_array_equal(plain.predict(test[0]),
                                  predict_proba(plain.model, torch.as_tensor(test[0])).argmax(axis=1))


def test_neighbouring_federations_get_the_same_correction():
    """D and D' differ in one record's label, through the real entry point: the rule (declared prior, the run's
    weights, training prior, factors, threshold) is the same, so their decisions differ only through the trained
    models; a federation with very different label counts gets the same rule too (nothing is counted)."""
    weighted = nn.CrossEntropyLoss(weight=torch.tensor([0.25, 1.0]))
    common = dict(algorithm="dpsgd_fedavg", epsilon=3.0, client_size=120, rounds=1, lr=0.1, loss=weighted,
                  test=_rare(200, seed=9), class_prior=[0.9, 0.1])
    flip = int(np.flatnonzero(_clients()["org0"][1] == 1)[0])
    d, d2 = federate(lambda: nn.Linear(4, 2), _clients(), **common), \
        federate(lambda: nn.Linear(4, 2), _clients(flip=flip), **common)
    assert _without_metrics(d.prior_corrected) == _without_metrics(d2.prior_corrected)
    np.testing.assert_array_equal(d.decision.factors, d2.decision.factors)
    assert d.decision.class_weights == pytest.approx((0.25, 1.0))
    balanced = {k: (x, (x[:, 0] > 0).astype(np.int64)) for k, (x, _) in _clients().items()}  # about 50 % positives
    other = federate(lambda: nn.Linear(4, 2), balanced, **common)
    np.testing.assert_array_equal(other.decision.factors, d.decision.factors)
    for result in (d, d2):  # each decides with its own model and the shared factors
        x = common["test"][0]
        proba = predict_proba(result.model, torch.as_tensor(x))
        np.testing.assert_array_equal(result.predict(x), (proba * d.decision.factors).argmax(axis=1))


@pytest.mark.parametrize("algorithm, options", [("dpsgd_fedavg", {"class_weights": (0.2, 1.0)}),
                                                ("dp_fedsgd", {"class_weights": (0.2, 1.0)}),
                                                ("dpsgd_fedavg", {"loss": nn.CrossEntropyLoss(
                                                    weight=torch.tensor([0.2, 1.0]))})])
def test_the_rule_accounts_for_the_weights_the_run_trains_with(algorithm, options):
    alg = make_algorithm(algorithm, FederationConfig(client_size=100),
                         PrivacyConfig(epsilon=3.0, unit="example"), model=nn.Linear(4, 2), **options)
    rule = resolve_prior_correction([0.96, 0.04], alg, task="classification", num_classes=2)
    assert rule.class_weights == pytest.approx((0.2, 1.0))
    assert rule.threshold == pytest.approx(0.04 / (0.96 * 0.2 + 0.04))


def test_federate_refuses_a_bad_prior_before_anything_is_charged(tmp_path):
    ledger = tmp_path / "l.sqlite"
    with pytest.raises(ConfigurationError, match="class_prior has 3 values for 2 classes"):
        federate(lambda: nn.Linear(4, 2), _clients(), algorithm="dpsgd_fedavg", epsilon=3.0, client_size=120,
                 rounds=1, class_prior=[0.8, 0.1, 0.1], ledger=str(ledger), classes=[0, 1])
    assert not ledger.exists()
    with pytest.raises(ConfigurationError, match="class_prior must sum to 1"):
        federate(lambda: nn.Linear(4, 2), _clients(), algorithm="fedavg", rounds=1, class_prior=[0.9, 0.2])
    x, y = _rare()
    regression = {f"c{k}": (x[k::2], y[k::2].astype(np.float32)) for k in range(2)}
    with pytest.raises(ConfigurationError, match="a regression run has none"):
        federate(lambda: nn.Linear(4, 1), regression, algorithm="fedavg", rounds=1, class_prior=[0.5, 0.5])
    fedbnn = make_algorithm("fedbnn", FederationConfig(), PrivacyConfig(epsilon=3.0, unit="example"))
    with pytest.raises(ConfigurationError, match="fedbnn has no global model"):
        resolve_prior_correction([0.5, 0.5], fedbnn, task="classification", num_classes=2)


def _write_orgs(folder):
    folder.mkdir()
    for k in range(3):
        x, y = _rare(60, seed=k)
        pd.DataFrame(x, columns=[f"f{i}" for i in range(4)]).assign(y=y).to_csv(folder / f"org{k}.csv", index=False)


def test_the_cli_reports_the_prior_corrected_decisions_and_exits_2_on_a_bad_prior(tmp_path, capsys):
    _write_orgs(tmp_path / "orgs")
    common = ["run", "--data", str(tmp_path / "orgs" / "*.csv"), "--target", "y", "--rounds", "1", "--epsilon", "3",
              "--algorithm", "dpsgd_fedavg", "--client-size", "60", "--hidden", "8", "--quiet", "--classes", "0,1",
              "--standardize", "none", "--option", "class_weights=[0.25,1.0]"]
    plain, corrected = tmp_path / "plain.json", tmp_path / "corrected.json"
    assert main([*common, "--json", str(plain)]) == 0
    assert main([*common, "--class-prior", "0.9,0.1", "--json", str(corrected)]) == 0
    out = json.loads(corrected.read_text())
    assert out["prior_corrected"]["class_prior"] == [0.9, 0.1]
    assert out["prior_corrected"]["class_weights"] == [0.25, 1.0]
    assert set(out["prior_corrected"]["metrics"]) >= {"balanced_accuracy", "recall", "positive_rate"}
    assert "prior_corrected" not in json.loads(plain.read_text())
    # post-processing: the run itself (its id, hence its settings) is the one without the prior
    assert out["run_id"] == json.loads(plain.read_text())["run_id"]
    capsys.readouterr()
    for bad, says in (("0.9,0.05,0.05", "--class-prior has 3 values for 2 classes"),
                      ("0.5,0.3", "--class-prior must sum to 1"), ("0,1", "--class-prior must be finite numbers > 0")):
        assert main([*common, "--class-prior", bad]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_:  # not numbers: argparse's usage error, exit 2
        main([*common, "--class-prior", "0.9,high"])
    assert exit_.value.code == 2 and "expected comma-separated numbers" in capsys.readouterr().err


def test_a_compare_toml_takes_class_prior(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('dataset = "digits"\nclients = 3\npartition = "iid"\nepsilons = [3.0]\nseeds = [0]\nrounds = 1\n'
                   f'algorithms = ["fedavg", "dp_fedsgd"]\nout_dir = "{tmp_path / "o"}"\nval_fraction = 0.1\n'
                   f'class_prior = {[0.1] * 10}\n'
                   '[overrides.dp_fedsgd]\nhidden = []\npool = 2\n'
                   'class_weights = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]\n')
    assert main(["compare", str(cfg), "--json", str(tmp_path / "r.json"), "--quiet"]) == 0
    rows = {r["algorithm"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    assert rows["dp_fedsgd"]["prior_corrected"]["class_weights"][0] == 0.5
    assert rows["fedavg"]["prior_corrected"]["class_weights"] is None
    for row in rows.values():
        assert row["prior_balanced_accuracy"] == row["prior_corrected"]["metrics"]["balanced_accuracy"]
        assert "val_prior_balanced_accuracy" in row
        assert row["settings"]["data"]["class_prior"] == [0.1] * 10
    header = (tmp_path / "o" / "results.csv").read_text().splitlines()[0]
    assert "prior_balanced_accuracy" in header
    cfg.write_text(cfg.read_text().replace(f"class_prior = {[0.1] * 10}", "class_prior = [0.9, 0.1]")
                   .replace(str(tmp_path / "o"), str(tmp_path / "o2")))
    assert main(["compare", str(cfg), "--quiet"]) == 2
