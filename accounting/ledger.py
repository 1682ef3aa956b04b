"""The per-client privacy ledger (SQLite).

One row per (run, client, round, channel): the event's parameters, the privacy unit and a timestamp. The release
pipeline charges a row in a committed transaction *before* the value is revealed, so a crash can lose a release but
never a charge. A per-client budget is checked inside the same transaction: a charge that would take the client past
its budget raises :class:`PrivacyBudgetExceeded` and writes nothing.

A row also records whether its value was released. Replaying a charge (same client, round and channel, same event)
charges nothing twice; releasing the same row twice is refused, because a second noisy copy of a value would need a
second charge. A row charged for a round the client was left out of (``charge_all(..., left_out=True)``: Poisson
client sampling accounts for every member's round, sampled or not) is spent without a release and can never be
released: the event covered that round's coin and its outcome, and a value released against it later would be a
release the ledger never charged (column ``released``: 0 charged, 1 released, 2 left out).

Keys are checked before anything is written (``accounting.validation``): a client id is a non-empty string or an
integer (stored as its decimal string), a round an integer in [0, 1e9], a channel a non-empty string, the unit
``"example"`` or ``"client"``. A refused call (bad argument, unsupported event, budget) writes no row.

Incremental accounting. The rows are the source of truth; each ledger object keeps, per client, a cache of what they
compose to. A client's history is the path of its rounds' contributions in round order (a contribution: the
``round_events`` of the round's channels, flattened to (leaf event, count) pairs), and its epsilon is that of an
accountant given one composition per round along the path (``composed_epsilon``: the same fold from scratch). The
paths of all clients form a tree whose nodes keep their epsilon and, for the nodes clients stand on, the composed
accountant state: a new round composes only that round into its parent's state (a PLD convolution, not a rebuild),
identical histories share nodes (every client charged the same events each round composes once), and an audit is a
lookup per client. The "would this exceed?" check finds the node the round leads to (for a round after every
other, one step down the tree; otherwise on a copy of the client's state) and changes nothing. The cache is
synchronised with the rows inside every charge's transaction and before every read: ``PRAGMA data_version`` tells
whether another connection committed; if one did, the rows past the last rowid seen are applied and the run's row
count is compared with the cache's, and any disagreement rebuilds the cache from all rows. A refused charge leaves
the cache as it was; the cache is updated only with rows written in the current transaction, and rebuilt if that
transaction is rolled back.

Transactions. Each charge commits (``synchronous=FULL``) before it returns, unless it runs inside
:meth:`PrivacyLedger.transaction`: then the charges and release marks of many clients (one simulated round) share
one durable commit at the end of the block, each charge still atomic (a savepoint) and budget-checked. A runtime
that uses it hands nothing to the server before the block has committed, so "no release without its row" still
holds: a crash inside the block loses the round's rows and its releases together.

Concurrent writers. Several processes may charge one ledger file (in WAL mode readers never wait; one writer at a
time). Every write is one ``BEGIN IMMEDIATE`` transaction (taking the write lock before reading what the budget check
needs, so no two writers check against the same stale state), SQLite's busy timeout waits for the lock, and an
operation that still meets a busy or locked database (SQLite answers some of those at once, without waiting: a race
to create the file, a recovery) is rolled back and retried, with short randomised pauses, until ``lock_timeout``
seconds (default 60) have passed since it began. Past that bound it raises :class:`LedgerBusy` (a
:class:`LedgerError`) naming the file, having written nothing; no ``sqlite3`` error escapes for a busy file. A
charge that several writers make at once lands exactly once (the others are replays), and a budget holds across
writers. Inside a :meth:`PrivacyLedger.transaction` block the lock is held for the whole block, so the block's
charges never wait; its start and its commit do.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import pathlib
import random
import sqlite3
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

from .accountants import make_accountant
from .accountants.tree import unamplified_rho
from .errors import InvalidLedgerArgument, InvalidPrivacyParameter, LedgerError, PrivacyBudgetExceeded
from .rounds import round_events
from .events import (ApproximatedEvent, ComposedEvent, GaussianEvent, NonPrivateEvent, PoissonSampledEvent,
                     PrivacyEvent, SelfComposedEvent, event_from_dict, flatten)
from .validation import (check_client_id, check_delta, check_epsilon, check_name, check_round,
                                   check_unit)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    delta REAL NOT NULL,
    epsilon_budget REAL NOT NULL,
    accountant TEXT NOT NULL,
    created_at REAL NOT NULL,
    meta TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS charges (
    run_id TEXT NOT NULL,
    client_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    channel TEXT NOT NULL,
    mechanism TEXT NOT NULL,
    sensitivity REAL,
    noise_std REAL,
    sampling_rate REAL NOT NULL,
    unit TEXT NOT NULL,
    event TEXT NOT NULL,
    charged_at REAL NOT NULL,
    released INTEGER NOT NULL DEFAULT 0,
    released_at REAL,
    PRIMARY KEY (run_id, client_id, round, channel),
    FOREIGN KEY (run_id) REFERENCES runs(run_id)
);
"""

# Relative slack when comparing a recomputed epsilon with the budget: accountants sum floats in different orders.
_BUDGET_RTOL = 1e-9

#: How long (seconds) one ledger operation waits for another writer's lock before raising :class:`LedgerBusy`.
DEFAULT_LOCK_TIMEOUT = 60.0
_FIRST_PAUSE, _MAX_PAUSE = 0.002, 0.05  # randomised back-off between retries of an operation that met a busy file


class LedgerBusy(LedgerError):
    """Another connection held the ledger file locked past the ledger's ``lock_timeout``; nothing was written by the
    operation that raised it (retry it later)."""


#: the ``released`` column's values
_CHARGED, _RELEASED, _LEFT_OUT = 0, 1, 2


def _is_busy(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` is SQLite's SQLITE_BUSY or SQLITE_LOCKED (any extended code): another connection's lock."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    text = str(exc).lower()
    return "database is locked" in text or "database table is locked" in text or "busy" in text


def _check_lock_timeout(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidLedgerArgument(f"lock_timeout must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def _retried(what: str):
    """Run a method of :class:`PrivacyLedger` that is one atomic operation (it rolls back what it began), retrying it
    while the file is busy, up to the ledger's ``lock_timeout``; then :class:`LedgerBusy`. Inside a
    :meth:`PrivacyLedger.transaction` block the write lock is held and nothing is retried (a busy error there, which
    WAL does not produce, becomes :class:`LedgerBusy` at once)."""
    def decorate(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            if self._batch_depth:
                try:
                    return method(self, *args, **kwargs)
                except sqlite3.OperationalError as exc:
                    if _is_busy(exc):
                        raise self._busy(what) from None
                    raise
            return self._retry(lambda: method(self, *args, **kwargs), what)
        return run
    return decorate


@dataclass(frozen=True)
class ChargeRequest:
    """One channel release a client asks to be charged for."""

    channel: str
    event: PrivacyEvent
    unit: str = "example"

    def __post_init__(self):
        check_name("channel", self.channel)
        if not isinstance(self.event, PrivacyEvent):
            raise InvalidPrivacyParameter(f"channel {self.channel!r}: event must be a PrivacyEvent, got "
                                          f"{type(self.event).__name__}")
        check_unit(self.unit)


@dataclass(frozen=True)
class Charge:
    """A committed ledger row."""

    run_id: str
    client_id: str
    round: int
    channel: str
    event: PrivacyEvent
    unit: str
    charged_at: float
    released: bool
    #: charged for a round the client was left out of: spent, never to be released
    left_out: bool = False

    @property
    def release_id(self) -> str:
        return f"{self.run_id}/{self.client_id}/{self.round}/{self.channel}"


def _describe(event: PrivacyEvent) -> tuple[str, float | None, float | None, float]:
    """(mechanism, sensitivity, noise_std, sampling rate) of an event, for the ledger's columns."""
    q = 1.0
    inner = event
    if isinstance(inner, PoissonSampledEvent):
        q, inner = inner.sampling_rate, inner.event
    if isinstance(inner, ApproximatedEvent):  # charged as the Gaussian it approximates (plus its total variation)
        inner = inner.event
    if isinstance(inner, GaussianEvent):
        return event.mechanism, inner.sensitivity, inner.noise_std, q
    return event.mechanism, None, None, q


def _same_terms(row, delta: float, epsilon_budget: float, accountant: str) -> bool:
    """Whether a stored run row ``(delta, epsilon_budget, accountant)`` has these terms."""
    return (math.isclose(row[0], delta) and (row[1] == epsilon_budget or math.isclose(row[1], epsilon_budget))
            and row[2] == accountant)


class PrivacyLedger:
    """A persistent ledger for one run; reopening the same path and run id continues the run.

    Args:
        path: SQLite file (created if missing); ``":memory:"`` for a throwaway ledger.
        run_id: the run this ledger object charges to.
        delta: the delta at which budgets are checked and audits reported.
        epsilon_budget: each client's epsilon budget at ``delta`` (``math.inf`` for none).
        accountant: name of the accountant that composes each client's events (``exact``, ``pld``, ``rdp``, ``zcdp``).
        lock_timeout: seconds one operation waits for another writer's lock on the file (waiting and retrying)
            before it raises :class:`LedgerBusy`, having written nothing.
    """

    def __init__(self, path: str | os.PathLike, run_id: str = "default", *, delta: float = 1e-5,
                 epsilon_budget: float = math.inf, accountant: str = "exact", meta: dict | None = None,
                 lock_timeout: float = DEFAULT_LOCK_TIMEOUT):
        check_name("run_id", run_id)
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise InvalidLedgerArgument(f"path must be a file path (or ':memory:'), got {path!r}")
        self.path = str(path)
        self.run_id = run_id
        self.lock_timeout = _check_lock_timeout(lock_timeout)
        self._batch_depth = 0
        delta = check_delta(delta)
        epsilon_budget = check_epsilon(epsilon_budget, allow_inf=True)
        make_accountant(accountant)  # validates the name before anything is written
        if meta is not None and not isinstance(meta, dict):
            raise InvalidLedgerArgument(f"meta must be a dict of JSON values, got {type(meta).__name__}")
        try:
            meta_json = json.dumps(meta or {}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidLedgerArgument(f"meta must hold JSON values only (strings, finite numbers, lists, dicts): "
                                        f"{exc}") from None
        try:
            self._conn = sqlite3.connect(self.path, timeout=self.lock_timeout, isolation_level=None)
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open a ledger at {self.path}: {exc}; pass a writable file path") from None

        def open_run():
            conn = self._conn
            conn.execute("PRAGMA journal_mode=WAL" if self.path != ":memory:" else "PRAGMA journal_mode=MEMORY")
            conn.execute("PRAGMA synchronous=FULL")
            conn.executescript(_SCHEMA)
            select = "SELECT delta, epsilon_budget, accountant FROM runs WHERE run_id=?"
            found = conn.execute(select, (run_id,)).fetchone()
            if found is not None and _same_terms(found, delta, epsilon_budget, accountant):
                return found
            with self._write():  # another process may be creating the same run: one of them inserts it
                found = conn.execute(select, (run_id,)).fetchone()
                if found is None:
                    conn.execute("INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?)",
                                 (run_id, delta, epsilon_budget, accountant, time.time(), meta_json))
                elif not _same_terms(found, delta, epsilon_budget, accountant) and conn.execute(
                        "SELECT 1 FROM charges WHERE run_id=? LIMIT 1", (run_id,)).fetchone() is None:
                    # a run that never charged anything (an entry point refused after opening it, an interruption
                    # before its first charge) binds nothing: opened again with other terms, it takes them (a review,
                    # session 26: a refused run blocked its corrected rerun)
                    conn.execute("UPDATE runs SET delta=?, epsilon_budget=?, accountant=?, created_at=?, meta=? "
                                 "WHERE run_id=?", (delta, epsilon_budget, accountant, time.time(), meta_json, run_id))
                    found = None
            return found

        try:
            row = self._retry(open_run, "opened")
        except sqlite3.Error as exc:
            self._conn.close()
            raise LedgerError(f"cannot open a ledger at {self.path}: {exc}; pass a writable file path") from None
        except BaseException:
            self._conn.close()
            raise
        if row is not None:
            stored = (row[0], row[1], row[2])
            if not (math.isclose(stored[0], delta) and (stored[1] == epsilon_budget
                                                        or math.isclose(stored[1], epsilon_budget))
                    and stored[2] == accountant):
                raise LedgerError(
                    f"run {run_id!r} in {self.path} was opened with delta={stored[0]}, epsilon_budget={stored[1]}, "
                    f"accountant={stored[2]!r}; reopen it with the same values or use a new run_id")
        self.delta = delta
        self.epsilon_budget = epsilon_budget
        self.accountant = accountant
        self._recorded: dict = {}  # the metadata this object recorded (its charges hold under them)
        self._reset_cache()

    # -- reading -------------------------------------------------------------------------------------------------

    @classmethod
    def open_existing(cls, path: str | os.PathLike, run_id: str | None = None, *,
                      lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> "PrivacyLedger":
        """Reopen a ledger with the parameters stored in it (the only run, or ``run_id``)."""
        if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
            raise LedgerError(f"no ledger at {path!r}; pass the path written by `privfl run --ledger`")
        if run_id is not None:
            check_name("run_id", run_id)
        lock_timeout = _check_lock_timeout(lock_timeout)
        try:
            conn = sqlite3.connect(str(path), timeout=lock_timeout)
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open {path}: {exc}") from None
        try:
            rows = conn.execute("SELECT run_id, delta, epsilon_budget, accountant FROM runs").fetchall()
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) and _is_busy(exc):
                raise LedgerBusy(f"the ledger {path} stayed locked by another connection for {lock_timeout:g} s; "
                                 "retry when it is done, or pass a larger lock_timeout") from None
            raise LedgerError(f"{path} is not a privfl ledger: {exc}") from None
        finally:
            conn.close()
        if run_id is not None:
            rows = [r for r in rows if r[0] == run_id]
        if len(rows) != 1:
            names = ", ".join(r[0] for r in rows) or "none"
            raise LedgerError(f"{path} holds runs [{names}]; pass run_id to choose one")
        rid, delta, budget, accountant = rows[0]
        return cls(path, rid, delta=delta, epsilon_budget=budget, accountant=accountant, lock_timeout=lock_timeout)

    @property
    @_retried("read")
    def meta(self) -> dict:
        """The run's metadata, as stored when the run was first opened (a fresh copy)."""
        row = self._conn.execute("SELECT meta FROM runs WHERE run_id=?", (self.run_id,)).fetchone()
        try:
            return json.loads(row[0]) if row else {}
        except (TypeError, ValueError):
            raise LedgerError(f"run {self.run_id!r} in {self.path} has corrupt metadata: {row[0]!r}") from None

    def record_meta(self, key: str, value) -> None:
        """Store ``key`` in the run's metadata, before its first charge (e.g. the trust assumption every charge of the
        run holds under). A key already stored must keep its value: a run resumed under another assumption is
        refused (:class:`LedgerError`), since its earlier charges were made under the stored one. One write
        transaction (read, compare, update), retried while another writer holds the file."""
        check_name("meta key", key)
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidLedgerArgument(f"meta {key!r} must be a JSON value: {exc}") from None
        self._record_meta(key, value)

    @_retried("recorded")
    def _record_meta(self, key: str, value) -> None:
        with self._write() as (conn, _):
            row = conn.execute("SELECT meta FROM runs WHERE run_id=?", (self.run_id,)).fetchone()
            try:
                meta = json.loads(row[0]) if row else {}
            except (TypeError, ValueError):
                raise LedgerError(f"run {self.run_id!r} in {self.path} has corrupt metadata: {row[0]!r}") from None
            if key in meta and meta[key] != value and conn.execute(
                    "SELECT 1 FROM charges WHERE run_id=? LIMIT 1", (self.run_id,)).fetchone() is None:
                meta[key] = value  # nothing was charged under the stored value: it binds nothing
                conn.execute("UPDATE runs SET meta=? WHERE run_id=?", (json.dumps(meta), self.run_id))
            if key in meta and meta[key] != value:
                raise LedgerError(f"run {self.run_id!r} in {self.path} was charged under {key} {meta[key]!r}, not "
                                  f"{value!r}; resume it with the same settings or use a new run_id")
            if key not in meta:
                meta[key] = value
                conn.execute("UPDATE runs SET meta=? WHERE run_id=?", (json.dumps(meta), self.run_id))
        self.__dict__.setdefault("_recorded", {})[key] = value

    def _check_terms(self, conn: sqlite3.Connection) -> None:
        """Inside the write lock, before a new charge: the run's stored terms (budget, delta, accountant) and the
        metadata this object recorded are still its own. A run without charges takes new terms when opened again (a
        refused run binds nothing), so another process may have reopened it between this object's opening and its
        first charge (a review, session 26: the file then said budget 8 and local trust over a charge made under
        budget 1 and central trust); that charge is refused."""
        row = conn.execute("SELECT delta, epsilon_budget, accountant, meta FROM runs WHERE run_id=?",
                           (self.run_id,)).fetchone()
        try:
            meta = json.loads(row[3]) if row and row[3] else {}
        except (TypeError, ValueError):
            meta = None
        if (row is None or not _same_terms(row, self.delta, self.epsilon_budget, self.accountant) or meta is None
                or any(meta.get(k) != v for k, v in getattr(self, "_recorded", {}).items())):
            raise LedgerError(f"run {self.run_id!r} in {self.path} was opened again by another process with other "
                              "terms before its first charge; nothing was charged: use one run id per run")

    @contextlib.contextmanager
    def _write(self):
        """One write: its own ``BEGIN IMMEDIATE`` ... ``COMMIT`` (rolled back on any error), or, inside a
        :meth:`transaction` block, part of that block. Yields (connection, whether inside a block)."""
        conn = self._conn
        batched = self._batch_depth > 0
        if not batched:
            conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn, batched
            if not batched:
                conn.execute("COMMIT")
        except BaseException:
            if not batched and conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    @staticmethod
    def charged_run_ids(path: str | os.PathLike) -> list[str]:
        """The ids of the runs of a ledger file that hold at least one charge (a run opened and then refused, or
        interrupted before its first charge, binds nothing and is not among them). Read only, as :meth:`run_ids`."""
        if not PrivacyLedger.run_ids(path):
            return []
        uri = pathlib.Path(path).resolve().as_uri() + "?mode=ro"
        conn = sqlite3.connect(uri, uri=True, timeout=DEFAULT_LOCK_TIMEOUT)
        try:
            return [r[0] for r in conn.execute("SELECT run_id FROM runs WHERE EXISTS (SELECT 1 FROM charges WHERE "
                                               "charges.run_id = runs.run_id) ORDER BY created_at")]
        finally:
            conn.close()

    @staticmethod
    def run_ids(path: str | os.PathLike) -> list[str]:
        """The ids of the runs a ledger file holds, oldest first; none where no run has written one yet (no file, or
        an empty database). Read only: asking never creates a file. Another SQLite database (tables, none of them a
        ledger's) raises ``sqlite3.DatabaseError``, as a file that is not SQLite does."""
        if not os.path.isfile(path):
            return []
        uri = pathlib.Path(path).resolve().as_uri() + "?mode=ro"
        conn = sqlite3.connect(uri, uri=True, timeout=DEFAULT_LOCK_TIMEOUT)
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not tables:
                return []
            return [r[0] for r in conn.execute("SELECT run_id FROM runs ORDER BY created_at")]
        finally:
            conn.close()

    def _rows(self, client_id: str | None = None, conn: sqlite3.Connection | None = None) -> list[Charge]:
        conn = conn or self._conn
        sql = ("SELECT client_id, round, channel, event, unit, charged_at, released FROM charges WHERE run_id=?")
        args: tuple = (self.run_id,)
        if client_id is not None:
            sql += " AND client_id=?"
            args += (client_id,)
        sql += " ORDER BY round, client_id, channel"
        return [Charge(self.run_id, c, r, ch, _parse_event(ev), unit, t, rel == _RELEASED, rel == _LEFT_OUT)
                for c, r, ch, ev, unit, t, rel in conn.execute(sql, args)]

    @_retried("read")
    def charges(self, client_id: str | None = None) -> list[Charge]:
        """All committed charges of this run (of one client if given), in round order."""
        return self._rows(None if client_id is None else check_client_id(client_id))

    @_retried("read")
    def has_charges(self, client_id: str) -> bool:
        """Whether this run holds any charge of ``client_id``: a lookup in the synchronised cache, not a read of the
        client's rows (a check made every round)."""
        client_id = check_client_id(client_id)
        self._sync()
        state = self._states.get(client_id)
        return state is not None and state.charges > 0

    @_retried("read")
    def clients(self) -> list[str]:
        return [r[0] for r in self._conn.execute(
            "SELECT DISTINCT client_id FROM charges WHERE run_id=? ORDER BY client_id", (self.run_id,))]

    @_retried("read")
    def epsilon(self, client_id: str, delta: float | None = None) -> float:
        """The epsilon a client has spent so far at ``delta`` (default: the ledger's delta), from the cached state."""
        client_id = check_client_id(client_id)
        delta = self.delta if delta is None else check_delta(delta)
        self._sync()
        state = self._states.get(client_id)
        return 0.0 if state is None else self._tree.epsilon(state.node, delta)

    def remaining(self, client_id: str) -> float:
        return self.epsilon_budget - self.epsilon(client_id)

    # -- charging ------------------------------------------------------------------------------------------------

    def charge(self, client_id: str, round: int, channel: str, event: PrivacyEvent, unit: str = "example"
               ) -> Charge:
        """Charge one release; see :meth:`charge_all`."""
        return self.charge_all(client_id, round, [ChargeRequest(channel, event, unit)])[0]

    @_retried("charged")
    def charge_all(self, client_id: str, round: int, requests: list[ChargeRequest], *,
                   release: bool = False, left_out: bool = False) -> list[Charge]:
        """Charge a round's releases of one client together: all are committed, or none is.

        Already-charged rows with an identical event are returned as they are (a replay charges nothing twice);
        a replay with a different event raises :class:`LedgerError`. Raises :class:`PrivacyBudgetExceeded`
        (nothing written) if the client's composed epsilon at the ledger's delta would exceed its budget.

        ``release``: the caller reveals the values as soon as this returns, with nothing in between that can fail
        (the release pipeline when no noise is left to draw on the client). The rows are then written released (a
        charge and its mark in one statement, the same transaction as :meth:`mark_released` after the charge); a
        replayed row not yet released is marked; a replayed row already released (or left out) raises
        :class:`LedgerError` and nothing is written or marked.

        ``left_out``: the round the client was left out of by Poisson client sampling (``ReleasePipeline.charge_only``):
        the new rows are written spent and never releasable (a later ``release`` or :meth:`mark_released` of them is
        refused). Not with ``release``.
        """
        client_id = check_client_id(client_id)
        round = check_round(round)
        if isinstance(requests, (str, bytes, dict)) or not isinstance(requests, (list, tuple)):
            raise InvalidLedgerArgument(f"requests must be a list of ChargeRequest, got {type(requests).__name__}")
        if not requests:
            raise InvalidLedgerArgument("charge_all needs at least one ChargeRequest")
        for r in requests:
            if not isinstance(r, ChargeRequest):
                raise InvalidLedgerArgument(f"requests must be ChargeRequest(channel, event, unit), got {r!r}")
        if release and left_out:
            raise InvalidLedgerArgument("a round is either released or left out, not both")
        names = [r.channel for r in requests]
        if len(set(names)) != len(names):
            raise LedgerError(f"channels charged twice in one request: {names}")
        conn = self._conn
        batched = self._batch_depth > 0
        # Inside a transaction() block a charge of one row needs no savepoint: the budget check refuses before
        # anything is written, and a single INSERT is atomic on its own.
        savepoint = batched and len(requests) > 1
        if savepoint:
            conn.execute("SAVEPOINT charge")
        elif not batched:
            conn.execute("BEGIN IMMEDIATE")
        try:
            if not batched:  # a transaction() block synced when it took the write lock: no one else can commit
                self._sync()
            state = self._states.get(client_id)
            existing = {} if state is None else state.rounds.get(round, {})
            new: list[ChargeRequest] = []
            replayed: list[ChargeRequest] = []
            for r in requests:
                old = existing.get(r.channel)
                if old is None:
                    new.append(r)
                elif old[0] != r.event or old[1] != r.unit:
                    raise LedgerError(
                        f"release {self.run_id}/{client_id}/{round}/{r.channel} was already charged as "
                        f"{old[0].to_dict()} ({old[1]}); a replay must carry the same event")
                else:
                    replayed.append(r)
            inserted: list[tuple[int, str, int, str, PrivacyEvent, str]] = []
            now = time.time()
            if new:
                self._check_terms(conn)
                # "Would this exceed?": the node the round's new channels lead to, the cached state unchanged (a
                # round after every other: one step down the tree; anything else: on a copy of the state).
                channels = {r.channel: (r.event, r.unit) for r in new}
                if state is not None and round > state.latest:
                    trial, node = None, state.next_node(round, channels, self._tree)
                else:
                    trial = _ClientState() if state is None else state.copy()
                    trial.add_round(round, channels, self._tree)
                    node = trial.node
                after = self._tree.epsilon(node, self.delta)
                if after > self.epsilon_budget * (1 + _BUDGET_RTOL):
                    raise PrivacyBudgetExceeded(
                        f"client {client_id} would spend epsilon={after:.4g} (delta={self.delta:g}) after round "
                        f"{round}, over its budget {self.epsilon_budget:g}; it sits this round out "
                        f"(raise the budget or the noise to let it take part)",
                        client_id=client_id, epsilon_after=after, epsilon_budget=self.epsilon_budget)
                for r in new:
                    mech, sens, std, q = _describe(r.event)
                    cur = conn.execute(
                        "INSERT INTO charges (run_id, client_id, round, channel, mechanism, sensitivity, noise_std, "
                        "sampling_rate, unit, event, charged_at, released, released_at) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (self.run_id, client_id, round, r.channel, mech, sens, std, q, r.unit,
                         _event_json(r.event), now, _RELEASED if release else _LEFT_OUT if left_out else _CHARGED,
                         now if release else None))
                    inserted.append((cur.lastrowid, client_id, round, r.channel, r.event, r.unit))
            if release:
                for r in replayed:
                    if conn.execute("UPDATE charges SET released=1, released_at=? WHERE run_id=? AND client_id=? "
                                    "AND round=? AND channel=? AND released=0",
                                    (now, self.run_id, client_id, round, r.channel)).rowcount != 1:
                        raise LedgerError(f"release {self.run_id}/{client_id}/{round}/{r.channel} was already "
                                          f"released, or charged for a round the client was left out of; releasing "
                                          f"against it would need a second charge")
            if len(new) == len(requests):  # nothing was there before: the rows are the ones just written
                result = [Charge(self.run_id, client_id, round, r.channel, r.event, r.unit, now, release, left_out)
                          for r in requests]
            else:  # read inside the transaction, so that nothing after the commit can fail (and be retried)
                rows = {ch: Charge(self.run_id, client_id, round, ch, _parse_event(ev), unit, t, rel == _RELEASED,
                                   rel == _LEFT_OUT)
                        for ch, ev, unit, t, rel in conn.execute(
                            "SELECT channel, event, unit, charged_at, released FROM charges WHERE run_id=? AND "
                            "client_id=? AND round=?", (self.run_id, client_id, round))}
                result = [rows[r.channel] for r in requests]
            if savepoint:
                conn.execute("RELEASE charge")
            elif not batched:
                # Until the cache has learnt these rows, the next sync must look at the file (an interrupt between
                # the commit and the update below then costs a re-read, never a stale cache).
                synced, self._data_version = self._data_version, None
                conn.execute("COMMIT")
        except BaseException:
            if savepoint:
                conn.execute("ROLLBACK TO charge")
                conn.execute("RELEASE charge")
            elif not batched:
                conn.execute("ROLLBACK")
            raise
        if inserted:  # written in this transaction (committed unless batched): now, and only now, the cache learns
            # them, as the state the budget check composed (the rows it added are exactly these)
            if trial is None:
                state.add_next(round, channels, node)
                trial = state
            trial.charges += len(inserted)
            self._states[client_id] = trial
            self._row_count += len(inserted)
            self._last_rowid = max(self._last_rowid, max(row[0] for row in inserted))
        if release and self._released is not None:
            self._released[client_id] = self._released.get(client_id, 0) + len(requests)
        if not batched:
            self._data_version = synced
        return result

    @contextlib.contextmanager
    def transaction(self):
        """One durable commit for every charge and release mark made inside the block (e.g. one round's clients).

        Each charge is still atomic and budget-checked; a charge refused inside the block leaves no trace and the
        block goes on. An exception escaping the block rolls back everything written in it. Nothing charged inside
        the block may be revealed before the block has exited normally (the commit). Blocks nest (inner ones join).
        """
        if self._batch_depth:
            self._batch_depth += 1
            try:
                yield self
            finally:
                self._batch_depth -= 1
            return
        conn = self._conn
        self._retry(lambda: conn.execute("BEGIN IMMEDIATE"), "charged (the transaction block could not begin)")
        self._batch_depth = 1
        try:
            self._sync()
            synced, self._data_version = self._data_version, None
            yield self
        except BaseException:
            self._batch_depth = 0
            conn.execute("ROLLBACK")
            self._reset_cache()  # the cache learnt rows that are gone now
            raise
        self._batch_depth = 0
        try:
            # a COMMIT that meets a busy file leaves the transaction open, and may be retried
            self._retry(self._commit, "committed (the transaction block was rolled back)")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            self._reset_cache()
            raise
        self._data_version = synced

    # -- the cache ----------------------------------------------------------------------------------------------

    def _commit(self) -> None:
        """The durable commit that closes a :meth:`transaction` block."""
        self._conn.execute("COMMIT")

    def _retry(self, operation, what: str):
        """``operation()``, retried while SQLite reports the file busy or locked (``operation`` must leave nothing
        half done when it raises), until ``lock_timeout`` seconds have passed; then :class:`LedgerBusy`. SQLite's
        busy timeout does the waiting where it can; the pauses here cover the busy answers it gives at once."""
        deadline = time.monotonic() + self.lock_timeout
        pause = _FIRST_PAUSE
        shortened = False
        try:
            while True:
                try:
                    return operation()
                except sqlite3.OperationalError as exc:
                    if not _is_busy(exc):
                        raise
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise self._busy(what) from None
                    time.sleep(min(remaining, pause * (0.5 + random.random())))
                    pause = min(2 * pause, _MAX_PAUSE)
                    remaining = max(deadline - time.monotonic(), 0.001)
                    self._conn.execute(f"PRAGMA busy_timeout={max(1, int(remaining * 1000))}")  # the rest only
                    shortened = True
        finally:
            if shortened:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.execute(f"PRAGMA busy_timeout={int(self.lock_timeout * 1000)}")

    def _busy(self, what: str) -> LedgerBusy:
        return LedgerBusy(
            f"the ledger {self.path} stayed locked by another writer for {self.lock_timeout:g} s (run "
            f"{self.run_id!r}): nothing was {what}. Another process holds a long transaction on this file: retry "
            f"when it is done, pass a larger lock_timeout, or give each concurrent run its own ledger file")

    def _reset_cache(self) -> None:
        self._tree = _CompositionTree(self.accountant)
        self._states: dict[str, _ClientState] = {}
        self._released: dict[str, int] | None = None  # per client; None: read from the file at the next audit
        self._last_rowid = 0
        self._row_count = 0
        self._data_version: int | None = None

    def _sync(self) -> None:
        """Bring the cache up to date with the rows: a no-op unless another connection committed since the last sync
        (``PRAGMA data_version``); then apply the rows past the last rowid seen and compare the run's row count with
        the cache's, rebuilding from all rows on any disagreement."""
        conn = self._conn
        version = conn.execute("PRAGMA data_version").fetchone()[0]
        if version == self._data_version:
            return
        self._released = None  # another connection may have marked rows released
        rows = conn.execute("SELECT rowid, client_id, round, channel, event, unit FROM charges WHERE run_id=? AND "
                            "rowid>? ORDER BY rowid", (self.run_id, self._last_rowid)).fetchall()
        applied = self._apply([(rid, c, r, ch, _parse_event(ev), unit) for rid, c, r, ch, ev, unit in rows])
        count = conn.execute("SELECT COUNT(*) FROM charges WHERE run_id=?", (self.run_id,)).fetchone()[0]
        if not applied or count != self._row_count:
            self._reset_cache()
            rows = conn.execute("SELECT rowid, client_id, round, channel, event, unit FROM charges WHERE run_id=? "
                                "ORDER BY rowid", (self.run_id,)).fetchall()
            if not self._apply([(rid, c, r, ch, _parse_event(ev), unit) for rid, c, r, ch, ev, unit in rows]):
                raise LedgerError(f"run {self.run_id!r} in {self.path} holds a (client, round, channel) twice; "
                                  "the ledger file was edited outside privfl")
            self._row_count = len(rows)
        self._data_version = version

    def _apply(self, rows: list[tuple[int, str, int, str, PrivacyEvent, str]]) -> bool:
        """Add committed rows (rowid, client, round, channel, event, unit) to the cache; False if one is already
        there (the rows changed under the cache, which must then be rebuilt)."""
        by_round: dict[tuple[str, int], dict[str, tuple[PrivacyEvent, str]]] = {}
        for rowid, client_id, rnd, channel, event, unit in rows:
            by_round.setdefault((client_id, rnd), {})[channel] = (event, unit)
            self._last_rowid = max(self._last_rowid, rowid)
        for (client_id, rnd), channels in by_round.items():
            state = self._states.get(client_id)
            if state is None:
                state = self._states[client_id] = _ClientState()
            if any(ch in state.rounds.get(rnd, ()) for ch in channels):
                return False
            state.add_round(rnd, channels, self._tree)
            state.charges += len(channels)
        self._row_count += len(rows)
        return True

    @_retried("marked released")
    def mark_released(self, charge: Charge) -> None:
        """Record that ``charge``'s value has been revealed; refuses a second release of the same row."""
        if not isinstance(charge, Charge):
            raise InvalidLedgerArgument(f"mark_released takes the Charge returned by charge(), got {charge!r}")
        with self._write() as (conn, batched):
            if not batched:
                self._sync()  # the released counts must be the file's before this mark is added to them
            cur = conn.execute(
                "UPDATE charges SET released=1, released_at=? WHERE run_id=? AND client_id=? AND round=? AND "
                "channel=? AND released=0", (time.time(), charge.run_id, charge.client_id, charge.round,
                                             charge.channel))
            if cur.rowcount != 1:
                raise LedgerError(f"release {charge.release_id} is not charged, was already released or was charged "
                                  f"for a round the client was left out of; releasing it would need a second charge")
        if self._released is not None:
            self._released[charge.client_id] = self._released.get(charge.client_id, 0) + 1

    # -- auditing ------------------------------------------------------------------------------------------------

    @_retried("read")
    def audit(self, delta: float | None = None) -> dict:
        """``{"delta", "max_epsilon", "clients": {id: {"epsilon", "rho", "releases"}}}`` for this run.

        ``rho`` is the zCDP parameter of the client's composition, without amplification by sampling (a valid upper
        bound); ``releases`` counts rows whose value was revealed.
        """
        delta = self.delta if delta is None else check_delta(delta)
        self._sync()
        if self._released is None:
            self._released = {c: int(rel or 0) for c, rel in self._conn.execute(
                "SELECT client_id, SUM(released = 1) FROM charges WHERE run_id=? GROUP BY client_id",
                (self.run_id,))}
        clients = {}
        tree = self._tree
        for cid in sorted(self._states, key=_natural_key):
            state = self._states[cid]
            clients[cid] = {"epsilon": tree.epsilon(state.node, delta), "rho": tree.rho(state.node),
                            "releases": self._released.get(cid, 0), "charges": state.charges}
        max_eps = max((v["epsilon"] for v in clients.values()), default=0.0)
        return {"delta": delta, "max_epsilon": max_eps, "run_id": self.run_id, "accountant": self.accountant,
                "epsilon_budget": self.epsilon_budget, "clients": clients}

    @_retried("read")
    def epsilon_by_round(self, delta: float | None = None) -> dict[str, list[tuple[int, float]]]:
        """Each client's cumulative epsilon after each round it was charged in."""
        delta = self.delta if delta is None else check_delta(delta)
        self._sync()
        out: dict[str, list[tuple[int, float]]] = {}
        tree = self._tree
        for cid in sorted(self._states, key=_natural_key):
            state = self._states[cid]
            node, series = tree.root, []
            for rnd in sorted(state.rounds):  # prefixes in order: each composes one round into its parent's state
                node = tree.child(node, state.contributions[rnd])
                series.append((rnd, tree.epsilon(node, delta)))
            out[cid] = series
        return out

    def close(self) -> None:
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _ClientState:
    """One client's cached composition: its rounds' channels, each round's contribution, its row count and the node
    of the composition tree its history leads to."""

    __slots__ = ("rounds", "contributions", "node", "charges", "latest")

    def __init__(self) -> None:
        self.rounds: dict[int, dict[str, tuple[PrivacyEvent, str]]] = {}
        self.contributions: dict[int, tuple[tuple[PrivacyEvent, int], ...]] = {}
        self.node: _Node | None = None
        self.charges = 0
        self.latest = -1  # the last round charged (max of ``rounds``), -1 before any

    def copy(self) -> "_ClientState":
        other = _ClientState()
        other.rounds = dict(self.rounds)  # a round's dict is replaced, never mutated, by add_round
        other.contributions = dict(self.contributions)
        other.node = self.node
        other.charges = self.charges
        other.latest = self.latest
        return other

    def next_node(self, rnd: int, channels: dict[str, tuple[PrivacyEvent, str]],
                  tree: "_CompositionTree") -> "_Node":
        """The node a new round ``rnd`` after every charged one (``rnd > latest``) would lead to; changes nothing."""
        contribution = _round_contribution(tuple(channels[ch][0] for ch in sorted(channels)))
        return tree.child(self.node if self.node is not None else tree.root, contribution)

    def add_next(self, rnd: int, channels: dict[str, tuple[PrivacyEvent, str]], node: "_Node") -> None:
        """Record the new round ``rnd > latest`` whose node :meth:`next_node` gave."""
        self.rounds[rnd] = dict(channels)
        self.contributions[rnd] = node.contribution
        self.node = node
        self.latest = rnd

    def add_round(self, rnd: int, channels: dict[str, tuple[PrivacyEvent, str]], tree: "_CompositionTree") -> None:
        """Add channels charged in round ``rnd`` (the round's sampled channels share one coin). A round after every
        other is one step down the tree; anything else (a round filled in, an earlier round) re-walks the path."""
        latest = self.latest
        self.latest = max(latest, rnd)
        merged = {**self.rounds.get(rnd, {}), **channels}
        self.rounds[rnd] = merged
        contribution = _round_contribution(tuple(merged[ch][0] for ch in sorted(merged)))
        self.contributions[rnd] = contribution
        if rnd > latest and self.node is not None:
            self.node = tree.child(self.node, contribution)
        else:
            self.node = tree.path(self.contributions[r] for r in sorted(self.contributions))

    def key(self) -> tuple:
        """The client's history: its rounds' contributions in round order (what ``composed_epsilon`` composes)."""
        return tuple(self.contributions[r] for r in sorted(self.contributions))


class _Node:
    """A history in the composition tree: its parent's history and one more round's contribution."""

    __slots__ = ("parent", "contribution", "children", "last", "epsilons", "non_private", "_rho", "__weakref__")

    def __init__(self, parent: "_Node | None", contribution: tuple) -> None:
        self.parent = parent
        self.contribution = contribution
        self.children: dict[tuple, _Node] = {}
        self.last: tuple | None = None  # (contribution, child) of the last step taken: usually the same object
        self.epsilons: dict[float, float] = {}
        self.non_private = (parent is not None and parent.non_private) or any(
            isinstance(e, NonPrivateEvent) for e, _ in contribution)
        self._rho: float | None | bool = False  # False: not computed yet


class _CompositionTree:
    """Every history a ledger has seen, as paths from an empty root, one round's contribution per step; each node
    memoises its epsilon per delta, and the accountant states of recently used nodes are kept (``states`` of them,
    least recently used dropped), so a child's state is its parent's plus one composition."""

    def __init__(self, accountant: str, states: int = 256) -> None:
        self.accountant = accountant
        self.root = _Node(None, ())
        self._states: OrderedDict[_Node, object] = OrderedDict()
        self._capacity = states

    def child(self, node: _Node, contribution: tuple) -> _Node:
        last = node.last
        if last is not None and last[0] is contribution:  # contributions are cached tuples: identity is equality
            return last[1]
        found = node.children.get(contribution)
        if found is None:
            found = node.children[contribution] = _Node(node, contribution)
        node.last = (contribution, found)
        return found

    def path(self, contributions: Iterable[tuple]) -> _Node:
        node = self.root
        for contribution in contributions:
            node = self.child(node, contribution)
        return node

    def state(self, node: _Node):
        """The accountant composed along the path to ``node``: the nearest kept ancestor's state, copied, with the
        rounds below it composed (one composition per round, as ``composed_epsilon`` does)."""
        kept = self._states.get(node)
        if kept is not None:
            self._states.move_to_end(node)
            return kept
        chain = []
        cur = node
        while cur is not self.root and cur not in self._states:
            chain.append(cur)
            cur = cur.parent
        accountant = make_accountant(self.accountant) if cur is self.root else self._states[cur].copy()
        for step in reversed(chain):
            accountant.compose(_contribution_event(step.contribution))
        self._states[node] = accountant
        if len(self._states) > self._capacity:
            self._states.popitem(last=False)
        return accountant

    def epsilon(self, node: _Node | None, delta: float) -> float:
        if node is None or node is self.root:
            return 0.0
        value = node.epsilons.get(delta)
        if value is None:
            value = math.inf if node.non_private else float(self.state(node).get_epsilon(delta))
            node.epsilons[delta] = value
        return value

    def rho(self, node: _Node | None) -> float | None:
        """zCDP of the path without amplification by sampling (an upper bound); None if a leaf has no rho."""
        if node is None or node is self.root:
            return 0.0
        chain = []
        cur = node
        while cur is not self.root and cur._rho is False:
            chain.append(cur)
            cur = cur.parent
        total = 0.0 if cur is self.root else cur._rho
        for step in reversed(chain):
            part = _contribution_rho(step.contribution)
            total = None if total is None or part is None else total + part
            step._rho = total
        return node._rho


@functools.lru_cache(maxsize=4096)
def _parse_event(text: str) -> PrivacyEvent:
    """A stored event (JSON) back to its frozen event; identical rows share one parse."""
    return event_from_dict(json.loads(text))


@functools.lru_cache(maxsize=4096)
def _event_json(event: PrivacyEvent) -> str:
    return json.dumps(event.to_dict())


@functools.lru_cache(maxsize=4096)
def _round_contribution(events: tuple[PrivacyEvent, ...]) -> tuple[tuple[PrivacyEvent, int], ...]:
    """The (leaf, count) pairs one round's events (in channel order) add to a client's composition."""
    return tuple(flatten(ComposedEvent(tuple(round_events((0, e) for e in events)))))


@functools.lru_cache(maxsize=4096)
def _contribution_event(contribution: tuple[tuple[PrivacyEvent, int], ...]) -> PrivacyEvent:
    """One round's contribution as the single event an accountant composes for it."""
    parts = tuple(e if c == 1 else SelfComposedEvent(e, c) for e, c in contribution)
    return parts[0] if len(parts) == 1 else ComposedEvent(parts)


@functools.lru_cache(maxsize=4096)
def _contribution_rho(contribution: tuple[tuple[PrivacyEvent, int], ...]) -> float | None:
    return unamplified_rho(ComposedEvent(tuple(SelfComposedEvent(e, c) for e, c in contribution)))


def history_key(charged: Iterable[tuple[int, PrivacyEvent]]) -> tuple[tuple[tuple[PrivacyEvent, int], ...], ...]:
    """A client's history from its (round, event) charges, from scratch: each round's contribution (its
    ``round_events``, flattened), in round order. Events of one round must come in channel order (as the rows do)."""
    by_round: dict[int, list[PrivacyEvent]] = {}
    for rnd, event in charged:
        by_round.setdefault(rnd, []).append(event)
    return tuple(_round_contribution(tuple(by_round[r])) for r in sorted(by_round))


_MEMO_SIZE = 4096
_memo: dict[tuple, float] = {}


def composed_epsilon(accountant: str, key: tuple, delta: float, *, remember: bool = True,
                     fresh: bool = False) -> float:
    """Epsilon at ``delta`` of the history ``key`` (``history_key``: per round, its contribution) under
    ``accountant``: a fresh accountant composes each round's contribution, in order, once.

    A pure function of its arguments, memoised (``remember``); ``fresh`` recomputes it regardless of the memo (what
    the equality tests compare the ledger's incremental state against)."""
    memo_key = (accountant, key, delta)
    if not fresh:
        hit = _memo.get(memo_key)
        if hit is not None:
            return hit
    if not key:
        value = 0.0
    elif any(isinstance(e, NonPrivateEvent) for contribution in key for e, _ in contribution):
        value = math.inf
    else:
        acct = make_accountant(accountant)
        for contribution in key:
            acct.compose(_contribution_event(contribution))
        value = float(acct.get_epsilon(delta))
    if remember and not fresh:
        if len(_memo) >= _MEMO_SIZE:
            _memo.pop(next(iter(_memo)))
        _memo[memo_key] = value
    return value


def _natural_key(s: str):
    return (0, int(s), "") if s.isdecimal() else (1, 0, s)
