"""A secure-aggregation run that can only abort is refused before anything is charged, and a run whose every round
was aborted exits non-zero (a review, session 26: --min-survivors 100 with 3 clients aborted 3 of 3 rounds, the whole
budget charged, exit 0)."""

from __future__ import annotations

import os

import pytest

from privfl.apps import cli


def test_min_survivors_above_the_federation_is_refused_before_any_charge(tmp_path, capsys):
    ledger = tmp_path / "L.sqlite"
    rc = cli.main(["run", "--algorithm", "dp_fedavg", "--dataset", "digits", "--clients", "3", "--rounds", "2",
                   "--epsilon", "3", "--secure-agg", "--min-survivors", "100", "--ledger", str(ledger)])
    assert rc == 2
    assert "--min-survivors 100 exceeds" in capsys.readouterr().err
    if os.path.exists(ledger):
        import sqlite3

        with sqlite3.connect(ledger) as conn:
            assert conn.execute("SELECT COUNT(*) FROM charges").fetchone()[0] == 0


def test_a_run_whose_every_round_aborted_exits_non_zero(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_aborted_rounds", lambda out, secure, history, offset=0: [r.round for r in history])
    rc = cli.main(["run", "--algorithm", "dp_fedavg", "--dataset", "digits", "--clients", "3", "--rounds", "1",
                   "--epsilon", "3", "--secure-agg", "--ledger", str(tmp_path / "L.sqlite")])
    assert rc == 1
    assert "every round (1) was aborted" in capsys.readouterr().err
