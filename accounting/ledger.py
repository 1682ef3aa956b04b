"""The per-client privacy ledger (SQLite).

One row per (run, client, round, channel): the event's parameters, the privacy unit and a timestamp. The release
pipeline charges a row in a committed transaction *before* the value is revealed, so a crash can lose a release but
never a charge. A per-client budget is checked inside the same transaction: a charge that would take the client past
its budget raises :class:`PrivacyBudgetExceeded` and writes nothing.

A row also records whether its value was released. Replaying a charge (same client, round and channel, same event)
charges nothing twice; releasing the same row twice is refused, because a second noisy copy of a value would need a
second charge.

Keys are checked before anything is written (``accounting.validation``): a client id is a non-empty string or an
integer (stored as its decimal string), a round an integer in [0, 1e9], a channel a non-empty string, the unit
``"example"`` or ``"client"``. A refused call (bad argument, unsupported event, budget) writes no row.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from dataclasses import dataclass
from typing import Iterable

from accounting.accountants import make_accountant
from accounting.accountants.tree import unamplified_rho
from accounting.errors import InvalidLedgerArgument, InvalidPrivacyParameter, LedgerError, PrivacyBudgetExceeded
from accounting.events import (ComposedEvent, GaussianEvent, NonPrivateEvent, PoissonSampledEvent, PrivacyEvent,
                               event_from_dict, flatten)
from accounting.validation import (check_client_id, check_delta, check_epsilon, check_name, check_round,
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

    @property
    def release_id(self) -> str:
        return f"{self.run_id}/{self.client_id}/{self.round}/{self.channel}"


def _describe(event: PrivacyEvent) -> tuple[str, float | None, float | None, float]:
    """(mechanism, sensitivity, noise_std, sampling rate) of an event, for the ledger's columns."""
    q = 1.0
    inner = event
    if isinstance(inner, PoissonSampledEvent):
        q, inner = inner.sampling_rate, inner.event
    if isinstance(inner, GaussianEvent):
        return event.mechanism, inner.sensitivity, inner.noise_std, q
    return event.mechanism, None, None, q


class PrivacyLedger:
    """A persistent ledger for one run; reopening the same path and run id continues the run.

    Args:
        path: SQLite file (created if missing); ``":memory:"`` for a throwaway ledger.
        run_id: the run this ledger object charges to.
        delta: the delta at which budgets are checked and audits reported.
        epsilon_budget: each client's epsilon budget at ``delta`` (``math.inf`` for none).
        accountant: name of the accountant that composes each client's events (``exact``, ``pld``, ``rdp``, ``zcdp``).
    """

    def __init__(self, path: str | os.PathLike, run_id: str = "default", *, delta: float = 1e-5,
                 epsilon_budget: float = math.inf, accountant: str = "exact", meta: dict | None = None):
        check_name("run_id", run_id)
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise InvalidLedgerArgument(f"path must be a file path (or ':memory:'), got {path!r}")
        self.path = str(path)
        self.run_id = run_id
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
            self._conn = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL" if self.path != ":memory:" else "PRAGMA journal_mode=MEMORY")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.executescript(_SCHEMA)
            row = self._conn.execute("SELECT delta, epsilon_budget, accountant FROM runs WHERE run_id=?",
                                     (run_id,)).fetchone()
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open a ledger at {self.path}: {exc}; pass a writable file path") from None
        if row is None:
            self._conn.execute("INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?)",
                               (run_id, delta, epsilon_budget, accountant, time.time(), meta_json))
        else:
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

    # -- reading -------------------------------------------------------------------------------------------------

    @classmethod
    def open_existing(cls, path: str | os.PathLike, run_id: str | None = None) -> "PrivacyLedger":
        """Reopen a ledger with the parameters stored in it (the only run, or ``run_id``)."""
        if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
            raise LedgerError(f"no ledger at {path!r}; pass the path written by `privfl run --ledger`")
        if run_id is not None:
            check_name("run_id", run_id)
        try:
            conn = sqlite3.connect(str(path))
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open {path}: {exc}") from None
        try:
            rows = conn.execute("SELECT run_id, delta, epsilon_budget, accountant FROM runs").fetchall()
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"{path} is not a privfl ledger: {exc}") from None
        finally:
            conn.close()
        if run_id is not None:
            rows = [r for r in rows if r[0] == run_id]
        if len(rows) != 1:
            names = ", ".join(r[0] for r in rows) or "none"
            raise LedgerError(f"{path} holds runs [{names}]; pass run_id to choose one")
        rid, delta, budget, accountant = rows[0]
        return cls(path, rid, delta=delta, epsilon_budget=budget, accountant=accountant)

    @property
    def meta(self) -> dict:
        """The run's metadata, as stored when the run was first opened (a fresh copy)."""
        row = self._conn.execute("SELECT meta FROM runs WHERE run_id=?", (self.run_id,)).fetchone()
        try:
            return json.loads(row[0]) if row else {}
        except (TypeError, ValueError):
            raise LedgerError(f"run {self.run_id!r} in {self.path} has corrupt metadata: {row[0]!r}") from None

    @staticmethod
    def run_ids(path: str | os.PathLike) -> list[str]:
        conn = sqlite3.connect(str(path))
        try:
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
        return [Charge(self.run_id, c, r, ch, event_from_dict(json.loads(ev)), unit, t, bool(rel))
                for c, r, ch, ev, unit, t, rel in conn.execute(sql, args)]

    def charges(self, client_id: str | None = None) -> list[Charge]:
        """All committed charges of this run (of one client if given), in round order."""
        return self._rows(None if client_id is None else check_client_id(client_id))

    def clients(self) -> list[str]:
        return [r[0] for r in self._conn.execute(
            "SELECT DISTINCT client_id FROM charges WHERE run_id=? ORDER BY client_id", (self.run_id,))]

    def _epsilon_of(self, charged: Iterable[tuple[int, PrivacyEvent]], delta: float) -> float:
        """Epsilon of a client's (round, event) charges: the round's mechanisms composed over rounds."""
        merged = flatten(ComposedEvent(tuple(round_events(charged))))
        if not merged:
            return 0.0
        if any(isinstance(e, NonPrivateEvent) for e, _ in merged):
            return math.inf
        accountant = make_accountant(self.accountant)
        for event, count in merged:
            accountant.compose(event, count)
        return float(accountant.get_epsilon(delta))

    def epsilon(self, client_id: str, delta: float | None = None) -> float:
        """The epsilon a client has spent so far at ``delta`` (default: the ledger's delta)."""
        client_id = check_client_id(client_id)
        delta = self.delta if delta is None else check_delta(delta)
        return self._epsilon_of(((c.round, c.event) for c in self._rows(client_id)), delta)

    def remaining(self, client_id: str) -> float:
        return self.epsilon_budget - self.epsilon(client_id)

    # -- charging ------------------------------------------------------------------------------------------------

    def charge(self, client_id: str, round: int, channel: str, event: PrivacyEvent, unit: str = "example"
               ) -> Charge:
        """Charge one release; see :meth:`charge_all`."""
        return self.charge_all(client_id, round, [ChargeRequest(channel, event, unit)])[0]

    def charge_all(self, client_id: str, round: int, requests: list[ChargeRequest]) -> list[Charge]:
        """Charge a round's releases of one client together: all are committed, or none is.

        Already-charged rows with an identical event are returned as they are (a replay charges nothing twice);
        a replay with a different event raises :class:`LedgerError`. Raises :class:`PrivacyBudgetExceeded`
        (nothing written) if the client's composed epsilon at the ledger's delta would exceed its budget.
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
        names = [r.channel for r in requests]
        if len(set(names)) != len(names):
            raise LedgerError(f"channels charged twice in one request: {names}")
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            existing = {c.channel: c for c in self._rows(client_id, conn) if c.round == round}
            new: list[ChargeRequest] = []
            for r in requests:
                old = existing.get(r.channel)
                if old is None:
                    new.append(r)
                elif old.event != r.event or old.unit != r.unit:
                    raise LedgerError(
                        f"release {self.run_id}/{client_id}/{round}/{r.channel} was already charged as "
                        f"{old.event.to_dict()} ({old.unit}); a replay must carry the same event")
            if new:
                history = [(c.round, c.event) for c in self._rows(client_id, conn)]
                after = self._epsilon_of(history + [(round, r.event) for r in new], self.delta)
                if after > self.epsilon_budget * (1 + _BUDGET_RTOL):
                    raise PrivacyBudgetExceeded(
                        f"client {client_id} would spend epsilon={after:.4g} (delta={self.delta:g}) after round "
                        f"{round}, over its budget {self.epsilon_budget:g}; it sits this round out "
                        f"(raise the budget or the noise to let it take part)",
                        client_id=client_id, epsilon_after=after, epsilon_budget=self.epsilon_budget)
                now = time.time()
                for r in new:
                    mech, sens, std, q = _describe(r.event)
                    conn.execute(
                        "INSERT INTO charges (run_id, client_id, round, channel, mechanism, sensitivity, noise_std, "
                        "sampling_rate, unit, event, charged_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (self.run_id, client_id, round, r.channel, mech, sens, std, q, r.unit,
                         json.dumps(r.event.to_dict()), now))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        rows = {c.channel: c for c in self._rows(client_id) if c.round == round}
        return [rows[r.channel] for r in requests]

    def mark_released(self, charge: Charge) -> None:
        """Record that ``charge``'s value has been revealed; refuses a second release of the same row."""
        if not isinstance(charge, Charge):
            raise InvalidLedgerArgument(f"mark_released takes the Charge returned by charge(), got {charge!r}")
        cur = self._conn.execute(
            "UPDATE charges SET released=1, released_at=? WHERE run_id=? AND client_id=? AND round=? AND channel=? "
            "AND released=0", (time.time(), charge.run_id, charge.client_id, charge.round, charge.channel))
        if cur.rowcount != 1:
            raise LedgerError(f"release {charge.release_id} is not charged or was already released; releasing a "
                              f"value twice would need a second charge")

    # -- auditing ------------------------------------------------------------------------------------------------

    def audit(self, delta: float | None = None) -> dict:
        """``{"delta", "max_epsilon", "clients": {id: {"epsilon", "rho", "releases"}}}`` for this run.

        ``rho`` is the zCDP parameter of the client's composition, without amplification by sampling (a valid upper
        bound); ``releases`` counts rows whose value was revealed.
        """
        delta = self.delta if delta is None else check_delta(delta)
        by_client: dict[str, list[Charge]] = {}
        for c in self._rows():
            by_client.setdefault(c.client_id, []).append(c)
        clients = {}
        for cid in sorted(by_client, key=_natural_key):
            events = [(c.round, c.event) for c in by_client[cid]]
            clients[cid] = {
                "epsilon": self._epsilon_of(events, delta),
                "rho": _rho_upper_bound([e for _, e in events]),
                "releases": sum(c.released for c in by_client[cid]),
                "charges": len(events),
            }
        max_eps = max((v["epsilon"] for v in clients.values()), default=0.0)
        return {"delta": delta, "max_epsilon": max_eps, "run_id": self.run_id, "accountant": self.accountant,
                "epsilon_budget": self.epsilon_budget, "clients": clients}

    def epsilon_by_round(self, delta: float | None = None) -> dict[str, list[tuple[int, float]]]:
        """Each client's cumulative epsilon after each round it was charged in."""
        delta = self.delta if delta is None else check_delta(delta)
        out: dict[str, list[tuple[int, float]]] = {}
        by_client: dict[str, dict[int, list[PrivacyEvent]]] = {}
        for c in self._rows():
            by_client.setdefault(c.client_id, {}).setdefault(c.round, []).append(c.event)
        for cid in sorted(by_client, key=_natural_key):
            history: list[tuple[int, PrivacyEvent]] = []
            series = []
            for rnd in sorted(by_client[cid]):
                history.extend((rnd, e) for e in by_client[cid][rnd])
                series.append((rnd, self._epsilon_of(history, delta)))
            out[cid] = series
        return out

    def close(self) -> None:
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def round_events(charged: Iterable[tuple[int, PrivacyEvent]]) -> list[PrivacyEvent]:
    """The mechanisms a client's charges describe, one list entry per round's mechanism.

    A round's channels released on one Poisson sample share one sampling coin: ``PoissonSampled(q, A)`` and
    ``PoissonSampled(q, B)`` charged in the same round are the mechanism ``PoissonSampled(q, Composed(A, B))``, which
    is what calibration composes (charging them as two independent samples would be a different mechanism). Events
    are grouped by (sampling rate, relation); a run has one relation, and the accountant refuses a mix.
    """
    by_round: dict[int, list[PrivacyEvent]] = {}
    for rnd, event in charged:
        by_round.setdefault(rnd, []).append(event)
    out: list[PrivacyEvent] = []
    for rnd in sorted(by_round):
        sampled: dict[tuple[float, str], list[PrivacyEvent]] = {}
        for event in by_round[rnd]:
            if isinstance(event, PoissonSampledEvent):
                sampled.setdefault((event.sampling_rate, event.relation), []).append(event.event)
            else:
                out.append(event)
        for (q, relation), inner in sampled.items():
            out.append(PoissonSampledEvent(q, inner[0] if len(inner) == 1 else ComposedEvent(tuple(inner)), relation))
    return out


def _rho_upper_bound(events: list[PrivacyEvent]) -> float | None:
    """zCDP of a client's charges without amplification by sampling (an upper bound); None if one has no rho."""
    return unamplified_rho(ComposedEvent(tuple(events)))


def _natural_key(s: str):
    return (0, int(s), "") if s.isdecimal() else (1, 0, s)
