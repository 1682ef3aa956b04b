"""The rdp backend computes each leaf's RDP vector once (cached) and composes by adding vectors, so a ledger under
rdp charges and reopens at the cost of the distinct leaves it holds, as under pld, and gives what a composition
without the cache gives."""

import functools
import json
import sqlite3

import dp_accounting
import pytest
from dp_accounting import rdp as dp_rdp

from privfl.accounting.accountants import make_accountant
from privfl.accounting.accountants import rdp as rdp_module
from privfl.accounting.accountants.dp_events import to_dp_event
from privfl.accounting.events import (ComposedEvent, GaussianEvent, PoissonSampledEvent, SelfComposedEvent,
                                      ZCDPEvent, event_from_dict)
from privfl.accounting.ledger import (ChargeRequest, PrivacyLedger, _contribution_event, composed_epsilon,
                                      history_key)

pytestmark = pytest.mark.timeout(120)

DELTA = 1e-5
SAMPLED = PoissonSampledEvent(0.1, GaussianEvent(1.0, 1.1))
SAMPLED_2 = PoissonSampledEvent(0.1, GaussianEvent(1.0, 1.4))
# Histories of the kinds a run charges: sampled Gaussian rounds (two channels on one coin), an unsampled Gaussian
# channel, a zCDP event (distributed discrete Gaussian) and a Poisson-sampled zCDP event, with rounds skipped.
HISTORIES = {
    "sampled": [(r, [("update", SAMPLED)]) for r in range(5)],
    "two_channels": [(r, [("mean", SAMPLED), ("precision", SAMPLED_2)]) for r in range(4)],
    "mixed": [(r, [("update", SAMPLED if r % 3 else SAMPLED_2), ("fisher", GaussianEvent(2.0, 9.0))])
              for r in range(0, 12, 2)],
    "zcdp": [(r, [("update", ZCDPEvent(0.002, "distributed_discrete_gaussian"))]) for r in range(6)]
    + [(r, [("update", PoissonSampledEvent(0.2, ZCDPEvent(0.01)))]) for r in range(6, 9)],
}


def _fill(path: str) -> None:
    with PrivacyLedger(path, "run", delta=DELTA, accountant="rdp") as ledger:
        for client, rounds in HISTORIES.items():
            for rnd, channels in rounds:
                ledger.charge_all(client, rnd, [ChargeRequest(ch, ev) for ch, ev in channels])


def _history(path: str, client: str) -> tuple:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT round, event FROM charges WHERE run_id='run' AND client_id=? "
                            "ORDER BY round, channel", (client,)).fetchall()
    finally:
        conn.close()
    return history_key([(r, event_from_dict(json.loads(e))) for r, e in rows])


def test_a_reopened_rdp_ledger_gives_the_epsilon_of_a_composition_without_the_cache(tmp_path, monkeypatch):
    path = str(tmp_path / "ledger.sqlite")
    _fill(path)
    rdp_module._leaf_rdp.cache_clear()
    with PrivacyLedger.open_existing(path) as ledger:
        cached = {client: ledger.epsilon(client) for client in HISTORIES}
    # Distinct leaves, not rows, were computed on reopening: 5 (the two-channel rounds' coin is one leaf) for 34 rows.
    assert rdp_module._leaf_rdp.cache_info().misses == 5
    assert all(0.5 < eps < 50 for eps in cached.values())

    # The same fold with every leaf's RDP recomputed (the cache bypassed) ...
    monkeypatch.setattr(rdp_module, "_leaf_rdp", rdp_module._leaf_rdp.__wrapped__)
    for client in HISTORIES:
        assert composed_epsilon("rdp", _history(path, client), DELTA, fresh=True) == pytest.approx(
            cached[client], rel=1e-12)
    # ... and dp-accounting's own accountant given one composition per round (no sampled zCDP event: it has none).
    for client in ("sampled", "mixed"):
        reference = dp_rdp.RdpAccountant(orders=list(rdp_module.DEFAULT_ORDERS))
        for contribution in _history(path, client):
            reference.compose(to_dp_event(_contribution_event(contribution), allow_zcdp=True))
        assert reference.get_epsilon(DELTA) == pytest.approx(cached[client], rel=1e-9)


def test_a_repeated_leaf_is_computed_once_and_composing_it_again_is_a_vector_addition(monkeypatch):
    calls = []
    real = rdp_module._leaf_rdp.__wrapped__

    def counting(leaf, orders):
        calls.append(leaf)
        return real(leaf, orders)

    monkeypatch.setattr(rdp_module, "_leaf_rdp", functools.lru_cache(maxsize=None)(counting))
    accountant = make_accountant("rdp")
    for _ in range(30):
        accountant.compose(ComposedEvent((SAMPLED, SelfComposedEvent(GaussianEvent(1.0, 4.0), 2))))
    copy = accountant.copy()
    copy.compose(SAMPLED, count=5)
    assert len(calls) == 2 and set(calls) == {SAMPLED, GaussianEvent(1.0, 4.0)}
    # the copy is independent, and the sums are those of the counts
    assert accountant.get_epsilon(DELTA) < copy.get_epsilon(DELTA)
    once = make_accountant("rdp").compose(SAMPLED, count=35).compose(GaussianEvent(1.0, 4.0), count=60)
    assert copy.get_epsilon(DELTA) == pytest.approx(once.get_epsilon(DELTA), rel=1e-12)


def test_the_cached_leaf_vector_cannot_be_changed_by_a_composition():
    accountant = make_accountant("rdp").compose(SAMPLED)
    vector = rdp_module._leaf_rdp(SAMPLED, tuple(rdp_module.DEFAULT_ORDERS))
    before = vector.copy()
    accountant.compose(SAMPLED, count=3)
    assert (vector == before).all() and not vector.flags.writeable
    with pytest.raises(ValueError):
        vector += 1.0


def test_unsupported_events_are_still_refused_before_anything_changes():
    accountant = make_accountant("rdp").compose(SAMPLED)
    before = accountant.get_epsilon(DELTA)
    with pytest.raises(Exception, match="replace"):
        accountant.compose(PoissonSampledEvent(0.1, GaussianEvent(1.0, 1.0), "replace_one"))
    assert accountant.get_epsilon(DELTA) == before and len(accountant.events) == 1
    assert isinstance(to_dp_event(SAMPLED, allow_zcdp=True), dp_accounting.PoissonSampledDpEvent)
