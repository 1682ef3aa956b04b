"""Several writers on one ledger file: every charge lands exactly once, budgets hold across writers, a busy file is
waited for and retried within ``lock_timeout``, and past it the ledger's own error names the file (no raw sqlite3
error escapes)."""

import math
import multiprocessing
import sqlite3
import threading
import time

import pytest

from privfl.accounting.accountants.analytic_gaussian import gaussian_epsilon
from privfl.accounting.errors import LedgerError, PrivacyBudgetExceeded
from privfl.accounting.events import GaussianEvent
from privfl.accounting.ledger import LedgerBusy, PrivacyLedger

pytestmark = pytest.mark.timeout(60)

DELTA = 1e-5
WRITERS = 3
ROUNDS = 80
SMALL = GaussianEvent(1.0, 20.0)  # 40 rounds: mu = 0.32, far below the budget
BIG = GaussianEvent(1.0, 2.0)     # k rounds: mu = sqrt(k) / 2
CAPPED_ROUNDS = 10                # the budget admits exactly this many BIG rounds for one client
BUDGET = 0.5 * (gaussian_epsilon(math.sqrt(CAPPED_ROUNDS) / 2, DELTA)
                + gaussian_epsilon(math.sqrt(CAPPED_ROUNDS + 1) / 2, DELTA))
BLOCK_EVERY = 5

needs_fork = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                                reason="the writers are forked (the test modules are not importable by name)")


def _writer(paths: list[str], index: int, barrier, results) -> None:
    """One writer process. On each of ``paths`` but the last, all writers race to create the fresh file, open the
    run and charge and release the same key. On the last: its own clients, keys every writer charges, a client whose
    budget all writers compete for, and transaction blocks. Reports what it saw (any exception other than a budget
    refusal is a failure)."""
    errors: list[str] = []
    capped = 0

    def failed(exc: BaseException) -> None:
        errors.append(f"{type(exc).__module__}.{type(exc).__name__}: {exc}")

    for path in paths[:-1]:
        try:
            barrier.wait(timeout=30)
            with PrivacyLedger(path, "run", delta=DELTA, lock_timeout=30) as ledger:
                charge = ledger.charge("first", 0, "update", SMALL)
                ledger.charge(f"own{index}", 0, "update", SMALL)
                try:
                    ledger.mark_released(charge)
                except LedgerError as exc:
                    if "already released" not in str(exc):  # one writer releases it; the others are told so
                        raise
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the test
            failed(exc)
    try:
        barrier.wait(timeout=30)
        ledger = PrivacyLedger(paths[-1], "run", delta=DELTA, epsilon_budget=BUDGET, lock_timeout=30)
        for j in range(ROUNDS):
            try:
                ledger.mark_released(ledger.charge(f"own{index}", j, "update", SMALL))
                ledger.charge("shared", j, "update", SMALL)  # every writer charges these keys: one row each
                try:
                    ledger.charge("capped", 1000 * index + j, "update", BIG)
                    capped += 1
                except PrivacyBudgetExceeded:
                    pass
                if j % BLOCK_EVERY == 0:
                    with ledger.transaction():
                        for c in range(3):
                            ledger.mark_released(ledger.charge(f"block{c}", 1000 * index + j, "update", SMALL))
            except Exception as exc:  # noqa: BLE001
                failed(exc)
        ledger.close()
    except Exception as exc:  # noqa: BLE001
        failed(exc)
    results.put((index, capped, errors))


def _rows(path: str) -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT client_id, round, channel, released FROM charges WHERE run_id='run'").fetchall()
    finally:
        conn.close()


@needs_fork
def test_three_writer_processes_land_every_charge_exactly_once(tmp_path):
    # Four fresh files to race on (a race to create one failed about half the time before), then the workload.
    paths = [str(tmp_path / f"ledger{k}.sqlite") for k in range(4)]
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(WRITERS), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(paths, i, barrier, results)) for i in range(WRITERS)]
    for p in procs:
        p.start()
    try:
        reports = sorted(results.get(timeout=50) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
    assert [errors for _, _, errors in reports] == [[]] * WRITERS
    assert all(p.exitcode == 0 for p in procs)

    for path in paths[:-1]:
        assert sorted(_rows(path)) == [("first", 0, "update", 1)] + [(f"own{i}", 0, "update", 0)
                                                                    for i in range(WRITERS)]
    rows = _rows(paths[-1])
    keys = [(c, r, ch) for c, r, ch, _ in rows]
    assert len(keys) == len(set(keys))  # the primary key, and nothing lost below
    blocks = range(0, ROUNDS, BLOCK_EVERY)
    expected = ({(f"own{i}", j, "update") for i in range(WRITERS) for j in range(ROUNDS)}
                | {("shared", j, "update") for j in range(ROUNDS)}
                | {(f"block{c}", 1000 * i + j, "update") for c in range(3) for i in range(WRITERS) for j in blocks})
    assert set(keys) - {k for k in keys if k[0] == "capped"} == expected
    released = {(c, r, ch) for c, r, ch, rel in rows if rel}
    assert released == {k for k in expected if k[0] != "shared"}
    # The budget held across writers: exactly CAPPED_ROUNDS rounds of the capped client, as the writers report.
    assert sum(1 for k in keys if k[0] == "capped") == CAPPED_ROUNDS == sum(c for _, c, _ in reports)
    with PrivacyLedger.open_existing(paths[-1]) as ledger:
        assert ledger.epsilon("capped") <= BUDGET
        assert ledger.epsilon("shared") == pytest.approx(gaussian_epsilon(math.sqrt(ROUNDS) / 20, DELTA), rel=1e-9)


def _hold_write_lock(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN IMMEDIATE")
    return conn


def test_a_file_locked_past_the_bound_raises_the_ledgers_own_error_naming_it(tmp_path):
    path = str(tmp_path / "ledger.sqlite")
    ledger = PrivacyLedger(path, "run", delta=DELTA, lock_timeout=0.3)
    first = ledger.charge("a", 0, "update", SMALL)
    blocker = _hold_write_lock(path)
    try:
        for attempt in (lambda: ledger.charge("a", 1, "update", SMALL),
                        lambda: ledger.mark_released(first),
                        lambda: ledger.transaction().__enter__(),
                        lambda: PrivacyLedger(path, "another run", delta=DELTA, lock_timeout=0.3)):
            start = time.monotonic()
            with pytest.raises(LedgerBusy, match="stayed locked") as info:
                attempt()
            elapsed = time.monotonic() - start
            assert isinstance(info.value, LedgerError) and not isinstance(info.value, sqlite3.Error)
            assert path in str(info.value) and "lock_timeout" in str(info.value)
            assert 0.25 <= elapsed < 5.0
        # Readers never wait for a writer (WAL): the audit answers while the lock is held.
        assert ledger.audit()["clients"]["a"]["charges"] == 1
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert [c.round for c in ledger.charges("a")] == [0] and not ledger.charges("a")[0].released
    ledger.charge("a", 1, "update", SMALL)  # the lock is gone: the same charge goes through
    ledger.mark_released(first)
    assert [(c.round, c.released) for c in ledger.charges("a")] == [(0, True), (1, False)]
    ledger.close()


def test_a_lock_held_for_a_while_is_waited_for(tmp_path):
    path = str(tmp_path / "ledger.sqlite")
    ledger = PrivacyLedger(path, "run", delta=DELTA, lock_timeout=20)
    blocker = _hold_write_lock(path)
    timer = threading.Timer(0.3, lambda: blocker.execute("COMMIT"))
    timer.start()
    try:
        start = time.monotonic()
        ledger.charge("a", 0, "update", SMALL)
        assert time.monotonic() - start >= 0.2
    finally:
        timer.join()
        blocker.close()
    assert len(ledger.charges()) == 1
    ledger.close()


class _BusyAtFirst:
    """A connection whose first ``n`` BEGIN IMMEDIATE answer 'database is locked' at once (as SQLite does, without
    waiting, in a race to create a file or during a recovery); everything else goes to the real connection."""

    def __init__(self, conn: sqlite3.Connection, n: int):
        self._conn, self.left, self.pragmas = conn, n, []

    def execute(self, sql, *args):
        if sql == "BEGIN IMMEDIATE" and self.left:
            self.left -= 1
            raise sqlite3.OperationalError("database is locked")
        if sql.startswith("PRAGMA busy_timeout"):
            self.pragmas.append(sql)
        return self._conn.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self._conn, name)


def test_an_immediate_busy_answer_is_retried_and_the_charge_lands_once(tmp_path):
    path = str(tmp_path / "ledger.sqlite")
    ledger = PrivacyLedger(path, "run", delta=DELTA, lock_timeout=10)
    real = ledger._conn
    ledger._conn = flaky = _BusyAtFirst(real, 3)
    try:
        ledger.charge("a", 0, "update", SMALL)
        assert flaky.left == 0
        assert flaky.pragmas[-1] == "PRAGMA busy_timeout=10000"  # restored after the retries shortened it
        flaky.left = 10 ** 9  # busy for ever: the bound ends it with the ledger's error, nothing written
        ledger.lock_timeout = 0.2
        with pytest.raises(LedgerBusy, match="nothing was charged"):
            ledger.charge("a", 1, "update", SMALL)
    finally:
        ledger._conn = real
    assert [c.round for c in ledger.charges()] == [0]
    ledger.close()


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "5"])
def test_lock_timeout_is_validated(tmp_path, bad):
    with pytest.raises(LedgerError, match="lock_timeout"):
        PrivacyLedger(str(tmp_path / "l.sqlite"), "run", lock_timeout=bad)
