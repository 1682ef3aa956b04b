"""A run refused after its ledger run was opened (calibration's range, an interruption before the first charge)
charged nothing and binds nothing: the corrected call under the same run id runs (a review, session 26: the rerun was
refused, 'was opened with epsilon_budget=1e-07', or 'already holds run ... same run again'). A run that charged
something still binds its terms."""

from __future__ import annotations

import sqlite3
import warnings

import numpy as np
import pytest
import torch.nn as nn

import privfl
from privfl.accounting.errors import InvalidPrivacyParameter, LedgerError
from privfl.accounting.ledger import PrivacyLedger
from privfl.errors import ConfigurationError


def _data(rng, n):
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64)


def test_federate_reruns_a_refused_run_under_its_run_id(tmp_path):
    rng = np.random.default_rng(0)
    clients, test = {k: _data(rng, 60) for k in "abc"}, _data(rng, 40)
    ledger = str(tmp_path / "l.sqlite")
    args = dict(algorithm="dpsgd_fedavg", rounds=1, test=test, client_size=60, ledger=ledger, run_id="study-1",
                classes=[0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((ConfigurationError, InvalidPrivacyParameter)):
            privfl.federate(nn.Linear(4, 2), clients, epsilon=1e-7, **args)  # below calibration's range
        assert PrivacyLedger.charged_run_ids(ledger) == []
        result = privfl.federate(nn.Linear(4, 2), clients, epsilon=0.1, **args)
    assert result.epsilon <= 0.1 + 1e-9
    assert PrivacyLedger.charged_run_ids(ledger) == ["study-1"]
    with sqlite3.connect(ledger) as conn:
        assert conn.execute("SELECT epsilon_budget FROM runs").fetchall() == [(0.1,)]


def test_a_run_without_charges_takes_new_terms_and_one_with_charges_keeps_its_own(tmp_path):
    path = str(tmp_path / "l.sqlite")
    first = PrivacyLedger(path, "r", epsilon_budget=1.0, delta=1e-5)
    first.record_meta("trust", "central")
    first.close()
    again = PrivacyLedger(path, "r", epsilon_budget=2.0, delta=1e-6)  # nothing charged: new terms
    again.record_meta("trust", "local")
    assert again.epsilon_budget == 2.0
    from privfl.accounting.events import GaussianEvent

    again.charge("0", 0, "update", GaussianEvent(1.0, 5.0))
    again.close()
    with pytest.raises(LedgerError, match="was opened with"):
        PrivacyLedger(path, "r", epsilon_budget=3.0, delta=1e-6)
    kept = PrivacyLedger(path, "r", epsilon_budget=2.0, delta=1e-6)
    with pytest.raises(LedgerError, match="was charged under trust"):
        kept.record_meta("trust", "central")
    kept.close()


def test_a_run_reopened_with_other_terms_before_its_first_charge_refuses_that_charge(tmp_path):
    """Two processes, one run id: A opens it (budget 1, central trust); before A's first charge B reopens it with
    other terms (budget 8, local trust), which a run without charges allows. A's charge would then sit under B's
    terms: refused, nothing written (a review, session 26)."""
    from privfl.accounting.events import GaussianEvent

    path = str(tmp_path / "l.sqlite")
    a = PrivacyLedger(path, "R", epsilon_budget=1.0)
    a.record_meta("trust", "central")
    b = PrivacyLedger(path, "R", epsilon_budget=8.0)
    b.record_meta("trust", "local")
    with pytest.raises(LedgerError, match="opened again by another process"):
        a.charge("0", 0, "update", GaussianEvent(1.0, 5.0))
    assert PrivacyLedger.charged_run_ids(path) == []
    b.charge("0", 0, "update", GaussianEvent(1.0, 5.0))  # B's terms are the run's now
    assert PrivacyLedger.charged_run_ids(path) == ["R"]
    a.close()
    b.close()
