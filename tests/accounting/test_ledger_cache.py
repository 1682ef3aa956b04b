"""The ledger's incremental accountant state is a cache of its SQLite rows and must always agree with them.

After any sequence of charges, refusals, replays, reopens and writes by a second ledger object on the same file, every
client's epsilon from the cached state equals a from-scratch composition of the rows read straight from the file, to
1e-9 relative, for every accountant.
"""

import json
import math
import sqlite3

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from privfl.accounting.errors import LedgerError, PrivacyBudgetExceeded
from privfl.accounting.events import GaussianEvent, PoissonSampledEvent, ZCDPEvent, event_from_dict
from privfl.accounting.ledger import ChargeRequest, PrivacyLedger, composed_epsilon, history_key

DELTA = 1e-5
BUDGET = 2.5
CLIENTS = ("0", "1", "2")
CHANNELS = ("mean", "precision", "fisher")

# Events each accountant composes (pld and rdp: one sampling relation per client, as a run has).
POOLS = {
    "exact": [GaussianEvent(1.0, 4.0), GaussianEvent(1.0, 8.0), GaussianEvent(0.5, 3.0),
              PoissonSampledEvent(1.0, GaussianEvent(1.0, 6.0))],
    "zcdp": [GaussianEvent(1.0, 4.0), GaussianEvent(1.0, 8.0), ZCDPEvent(0.01), ZCDPEvent(0.05, "dgauss")],
    "rdp": [GaussianEvent(1.0, 6.0), PoissonSampledEvent(0.2, GaussianEvent(1.0, 1.5)),
            PoissonSampledEvent(0.2, GaussianEvent(1.0, 3.0)), ZCDPEvent(0.02)],
    "pld": [GaussianEvent(1.0, 6.0), PoissonSampledEvent(0.2, GaussianEvent(1.0, 1.5)),
            PoissonSampledEvent(0.2, GaussianEvent(1.0, 3.0)), PoissonSampledEvent(0.5, GaussianEvent(1.0, 2.0))],
}


def from_scratch(path, accountant: str, client: str, delta: float = DELTA) -> float:
    """Epsilon of a client's rows, read with a fresh connection and composed by a fresh accountant (no memo)."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT round, event FROM charges WHERE run_id='run' AND client_id=? "
                            "ORDER BY round, channel", (client,)).fetchall()
    finally:
        conn.close()
    charged = [(r, event_from_dict(json.loads(e))) for r, e in rows]
    return composed_epsilon(accountant, history_key(charged), delta, fresh=True)


def close(a: float, b: float) -> bool:
    return a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-9 * max(abs(a), abs(b)))


operation = st.one_of(
    st.tuples(st.just("charge"), st.sampled_from(CLIENTS), st.integers(0, 4),
              st.lists(st.tuples(st.sampled_from(CHANNELS), st.integers(0, 3)), min_size=1, max_size=3,
                       unique_by=lambda t: t[0])),
    st.tuples(st.just("replay")),
    st.tuples(st.just("reopen")),
    st.tuples(st.just("other_writer"), st.sampled_from(CLIENTS), st.integers(5, 7), st.integers(0, 3)),
    # one transaction for several clients' charges (a simulated round), committed or rolled back as a whole
    st.tuples(st.just("batch"), st.integers(0, 4),
              st.lists(st.tuples(st.sampled_from(CLIENTS), st.integers(0, 3)), min_size=1, max_size=3),
              st.booleans()),
)


class Abandon(Exception):
    """Raised inside a transaction to roll it back."""


@pytest.mark.parametrize("accountant", sorted(POOLS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(operation, min_size=1, max_size=10))
def test_cached_epsilon_equals_a_from_scratch_composition_of_the_rows(tmp_path_factory, accountant, ops):
    path = str(tmp_path_factory.mktemp("ledger") / "ledger.sqlite")
    pool = POOLS[accountant]

    def open_ledger():
        return PrivacyLedger(path, "run", delta=DELTA, epsilon_budget=BUDGET, accountant=accountant)

    led = open_ledger()
    last = None
    try:
        for op in ops:
            if op[0] == "charge":
                _, client, rnd, picks = op
                requests = [ChargeRequest(ch, pool[i]) for ch, i in picks]
                before = led._states[client].key() if client in led._states else ()
                try:
                    led.charge_all(client, rnd, requests)
                    last = (client, rnd, requests)
                except PrivacyBudgetExceeded:
                    # refused: no row, and the cached state is exactly what it was
                    assert (led._states[client].key() if client in led._states else ()) == before
                except LedgerError as exc:  # a conflicting replay of an earlier round's channel
                    assert "already charged" in str(exc)
            elif op[0] == "replay" and last is not None:
                count = led._row_count
                led.charge_all(last[0], last[1], last[2])  # charges nothing twice
                assert led._row_count == count
            elif op[0] == "batch":
                _, rnd, picks, abandon = op
                rows = led._row_count
                try:
                    with led.transaction():
                        for client, i in picks:
                            try:
                                led.charge_all(client, rnd, [ChargeRequest("batched", pool[i])])
                            except (PrivacyBudgetExceeded, LedgerError):
                                pass  # refused inside the block: no trace, the block goes on
                        if abandon:
                            raise Abandon
                except Abandon:
                    assert led.audit() is not None and led._row_count == rows  # all of it rolled back
            elif op[0] == "reopen":
                led.close()
                led = open_ledger()
            elif op[0] == "other_writer":
                _, client, rnd, i = op
                with open_ledger() as other:
                    try:
                        other.charge(client, rnd, "other", pool[i])
                    except PrivacyBudgetExceeded:
                        pass
                    except LedgerError as exc:  # a conflicting replay
                        assert "already charged" in str(exc)
            audit = led.audit()
            for client in CLIENTS:
                expected = from_scratch(path, accountant, client)
                assert close(led.epsilon(client), expected), (client, led.epsilon(client), expected)
                if client in audit["clients"]:
                    assert close(audit["clients"][client]["epsilon"], expected)
                    assert expected <= BUDGET * (1 + 1e-9)
    finally:
        led.close()


def test_a_second_writer_on_the_same_file_never_leaves_the_cache_stale(tmp_path):
    path = str(tmp_path / "ledger.sqlite")
    a = PrivacyLedger(path, "run", delta=DELTA, epsilon_budget=3.0)
    b = PrivacyLedger(path, "run", delta=DELTA, epsilon_budget=3.0)
    a.charge("0", 0, "u", GaussianEvent(1.0, 3.0))
    assert a.epsilon("0") > 0 and b.epsilon("0") == a.epsilon("0")
    for rnd in range(1, 30):
        try:
            b.charge("0", rnd, "u", GaussianEvent(1.0, 3.0))
        except PrivacyBudgetExceeded:
            break
    # a's cache learns b's rows before answering, and refuses what b's rows leave no room for
    assert a.epsilon("0") == b.epsilon("0") == from_scratch(path, "exact", "0")
    with pytest.raises(PrivacyBudgetExceeded):
        a.charge("0", 100, "u", GaussianEvent(1.0, 3.0))
    assert a.audit()["clients"]["0"]["charges"] == len(b.charges("0"))
    a.close()
    b.close()


def test_a_refused_charge_leaves_no_trace_in_the_cache(tmp_path):
    led = PrivacyLedger(tmp_path / "l.sqlite", "run", delta=DELTA, epsilon_budget=1.0)
    led.charge("a", 0, "u", GaussianEvent(1.0, 6.0))
    key, rows, eps = led._states["a"].key(), led._row_count, led.epsilon("a")
    with pytest.raises(PrivacyBudgetExceeded):
        led.charge_all("a", 0, [ChargeRequest("v", GaussianEvent(1.0, 0.5))])  # a new channel in a charged round
    assert led._states["a"].key() == key and led._row_count == rows and led.epsilon("a") == eps
    assert led._states["a"].rounds[0].keys() == {"u"}


def test_identical_histories_share_one_composition(tmp_path):
    led = PrivacyLedger(tmp_path / "l.sqlite", "run", delta=DELTA, accountant="pld")
    event = PoissonSampledEvent(0.1, GaussianEvent(1.0, 1.0))
    for rnd in range(3):
        for client in range(5):
            led.charge(client, rnd, "update", event)
    keys = {led._states[str(c)].key() for c in range(5)}
    assert keys == {(((event, 1),),) * 3}  # the same history (one contribution per round) for every client
    assert len({id(led._states[str(c)].node) for c in range(5)}) == 1  # one node of the tree: composed once
    assert len({led.epsilon(c) for c in range(5)}) == 1


def test_a_new_round_composes_one_round_into_its_parents_state(tmp_path, monkeypatch):
    """Incremental: charging round r costs one composition into the state after round r - 1, never a rebuild."""
    import privfl.accounting.ledger as ledger_module

    led = PrivacyLedger(tmp_path / "l.sqlite", "run", delta=DELTA, accountant="pld")
    event = PoissonSampledEvent(0.1, GaussianEvent(1.0, 2.0))
    composed = []
    real = ledger_module._contribution_event

    def counting(contribution):
        composed.append(contribution)
        return real(contribution)

    monkeypatch.setattr(ledger_module, "_contribution_event", counting)
    for rnd in range(40):
        before = len(composed)
        for client in range(3):
            led.charge(client, rnd, "update", event)
        led.audit()
        assert len(composed) - before == 1  # one composition per round, whatever the round number
    assert led.epsilon(0) == pytest.approx(composed_epsilon("pld", led._states["0"].key(), DELTA, fresh=True),
                                           rel=1e-12)
