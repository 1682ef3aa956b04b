import math
import sqlite3

import pytest

from privfl.accounting.errors import InvalidPrivacyParameter, LedgerError, PrivacyBudgetExceeded
from privfl.accounting.events import GaussianEvent, NonPrivateEvent, PoissonSampledEvent
from privfl.accounting.ledger import ChargeRequest, PrivacyLedger


def ledger(tmp_path, **kw):
    kw.setdefault("delta", 1e-5)
    return PrivacyLedger(tmp_path / "ledger.sqlite", kw.pop("run_id", "run"), **kw)


def test_one_row_per_client_round_channel_with_parameters(tmp_path):
    led = ledger(tmp_path)
    led.charge_all("0", 0, [ChargeRequest("mean", GaussianEvent(1.0, 2.0), "example"),
                            ChargeRequest("precision", GaussianEvent(0.5, 2.0), "example")])
    rows = sqlite3.connect(tmp_path / "ledger.sqlite").execute(
        "SELECT run_id, client_id, round, channel, mechanism, sensitivity, noise_std, sampling_rate, unit, charged_at "
        "FROM charges ORDER BY channel").fetchall()
    assert [r[:9] for r in rows] == [("run", "0", 0, "mean", "gaussian", 1.0, 2.0, 1.0, "example"),
                                     ("run", "0", 0, "precision", "gaussian", 0.5, 2.0, 1.0, "example")]
    assert all(r[9] > 0 for r in rows)


def test_budget_is_checked_before_charging_and_a_refusal_writes_nothing(tmp_path):
    led = ledger(tmp_path, epsilon_budget=1.0)
    led.charge("a", 0, "u", GaussianEvent(1.0, 6.0))
    before = led.charges("a")
    with pytest.raises(PrivacyBudgetExceeded) as info:
        led.charge_all("a", 1, [ChargeRequest("u", GaussianEvent(1.0, 6.0)),
                                ChargeRequest("v", GaussianEvent(1.0, 0.5))])
    assert info.value.client_id == "a" and info.value.epsilon_after > 1.0
    assert led.charges("a") == before  # neither channel of the refused round was charged
    assert led.epsilon("a") <= 1.0


def test_replay_charges_nothing_twice_and_conflicting_replay_is_refused(tmp_path):
    led = ledger(tmp_path)
    first = led.charge("a", 3, "u", GaussianEvent(1.0, 2.0))
    again = led.charge("a", 3, "u", GaussianEvent(1.0, 2.0))
    assert first == again and len(led.charges()) == 1
    with pytest.raises(LedgerError, match="already charged"):
        led.charge("a", 3, "u", GaussianEvent(1.0, 1.0))


def test_a_value_is_released_at_most_once(tmp_path):
    led = ledger(tmp_path)
    c = led.charge("a", 0, "u", GaussianEvent(1.0, 2.0))
    led.mark_released(c)
    with pytest.raises(LedgerError, match="already released"):
        led.mark_released(c)


def test_reopen_continues_the_run(tmp_path):
    led = ledger(tmp_path, epsilon_budget=3.0)
    led.charge("a", 0, "u", GaussianEvent(1.0, 2.0))
    eps = led.epsilon("a")
    led.close()
    again = PrivacyLedger.open_existing(tmp_path / "ledger.sqlite")
    assert again.epsilon_budget == 3.0 and again.epsilon("a") == pytest.approx(eps)
    again.charge("a", 1, "u", GaussianEvent(1.0, 2.0))
    assert again.epsilon("a") > eps
    with pytest.raises(LedgerError, match="reopen it with the same values"):
        PrivacyLedger(tmp_path / "ledger.sqlite", "run", delta=1e-6, epsilon_budget=3.0)


def test_exact_composition_in_the_ledger_matches_a_single_gaussian(tmp_path):
    # 4 releases with sigma/Delta = 2 compose to one Gaussian with sigma/Delta = 1.
    led = ledger(tmp_path)
    for r in range(4):
        led.charge("a", r, "u", GaussianEvent(1.0, 2.0))
    single = ledger(tmp_path, run_id="single")
    single.charge("a", 0, "u", GaussianEvent(1.0, 1.0))
    assert led.epsilon("a") == pytest.approx(single.epsilon("a"), rel=1e-9)


def test_audit_reports_epsilon_rho_and_releases(tmp_path):
    led = ledger(tmp_path, epsilon_budget=10.0)
    for rnd in range(3):
        for cid in ("1", "0", "10"):
            c = led.charge(cid, rnd, "u", GaussianEvent(1.0, 4.0))
            if cid != "10":
                led.mark_released(c)
    report = led.audit()
    assert list(report["clients"]) == ["0", "1", "10"]
    assert report["clients"]["0"]["rho"] == pytest.approx(3 / (2 * 16))
    assert report["clients"]["0"]["releases"] == 3 and report["clients"]["10"]["releases"] == 0
    assert report["max_epsilon"] == pytest.approx(report["clients"]["0"]["epsilon"])
    series = led.epsilon_by_round()["0"]
    assert [r for r, _ in series] == [0, 1, 2]
    assert series[0][1] < series[1][1] < series[2][1]


def test_sampled_events_need_a_sampling_accountant(tmp_path):
    led = ledger(tmp_path, accountant="pld", epsilon_budget=5.0)
    led.charge("a", 0, "u", PoissonSampledEvent(0.1, GaussianEvent(1.0, 1.0)))
    assert 0 < led.epsilon("a") < 5.0
    exact = ledger(tmp_path, run_id="exact")
    with pytest.raises(Exception, match="cannot compose"):
        exact.charge("a", 0, "u", PoissonSampledEvent(0.1, GaussianEvent(1.0, 1.0)))
    assert exact.charges() == []


def test_non_private_release_is_audited_as_infinite(tmp_path):
    led = ledger(tmp_path)
    led.charge("a", 0, "u", NonPrivateEvent())
    assert math.isinf(led.audit()["max_epsilon"])
    bounded = ledger(tmp_path, run_id="bounded", epsilon_budget=1.0)
    with pytest.raises(PrivacyBudgetExceeded):
        bounded.charge("a", 0, "u", NonPrivateEvent())


@pytest.mark.parametrize("kw", [{"delta": 0.0}, {"delta": 1.0}, {"delta": math.nan}, {"epsilon_budget": 0.0},
                                {"epsilon_budget": -1.0}, {"epsilon_budget": math.nan}])
def test_bad_ledger_parameters(tmp_path, kw):
    with pytest.raises(InvalidPrivacyParameter):
        ledger(tmp_path, **kw)
    assert not (tmp_path / "ledger.sqlite").exists()


def test_bad_round_and_unknown_accountant(tmp_path):
    led = ledger(tmp_path)
    with pytest.raises(LedgerError):
        led.charge("a", -1, "u", GaussianEvent(1.0, 1.0))
    with pytest.raises(ValueError):
        PrivacyLedger(tmp_path / "x.sqlite", "r", accountant="moments")


def test_open_existing_refuses_a_missing_or_foreign_file(tmp_path):
    with pytest.raises(LedgerError, match="no ledger"):
        PrivacyLedger.open_existing(tmp_path / "none.sqlite")
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database at all" * 100)
    with pytest.raises(LedgerError):
        PrivacyLedger.open_existing(junk)


def test_sampled_channels_of_one_round_share_one_coin_as_in_calibration(tmp_path):
    from privfl.accounting.calibration import epsilon_for

    led = ledger(tmp_path, accountant="pld", epsilon_budget=50.0)
    for rnd in range(5):
        led.charge_all("a", rnd, [ChargeRequest("mean", PoissonSampledEvent(0.2, GaussianEvent(1.0, 1.5))),
                                  ChargeRequest("precision", PoissonSampledEvent(0.2, GaussianEvent(1.0, 3.0)))])
    expected = epsilon_for({"mean": 1.5, "precision": 3.0}, rounds=5, sampling_rate=0.2, delta=1e-5,
                           accountant="pld")
    assert led.epsilon("a") == pytest.approx(expected, rel=1e-6)


def test_run_metadata_is_stored_and_read_back(tmp_path):
    led = ledger(tmp_path, meta={"algorithm": "hbfl", "noise": "secure"})
    assert led.meta == {"algorithm": "hbfl", "noise": "secure"}
    led.close()
    again = PrivacyLedger.open_existing(tmp_path / "ledger.sqlite")
    assert again.meta["noise"] == "secure"
    with pytest.raises(LedgerError, match="JSON"):
        ledger(tmp_path, run_id="other", meta={"bad": object()})
    assert PrivacyLedger.run_ids(tmp_path / "ledger.sqlite") == ["run"]


@pytest.mark.parametrize("batched", [False, True])
def test_charge_with_release_writes_released_rows_and_never_releases_twice(tmp_path, batched):
    """``charge_all(release=True)``: the charge and its mark in one statement; a replayed unreleased row is marked;
    a replayed released row is refused with nothing written (not even the request's new channel)."""
    led = ledger(tmp_path)
    with (led.transaction() if batched else _no_block()):
        (c,) = led.charge_all("a", 0, [ChargeRequest("u", GaussianEvent(1.0, 2.0))], release=True)
        assert c.released
        led.charge("a", 1, "u", GaussianEvent(1.0, 2.0))  # charged, not released (a masked input)
        (c1,) = led.charge_all("a", 1, [ChargeRequest("u", GaussianEvent(1.0, 2.0))], release=True)
        assert c1.released
        with pytest.raises(LedgerError, match="already released"):
            led.charge_all("a", 1, [ChargeRequest("u", GaussianEvent(1.0, 2.0)),
                                    ChargeRequest("v", GaussianEvent(1.0, 2.0))], release=True)
        with pytest.raises(LedgerError, match="already released"):
            led.mark_released(c)
    rows = sqlite3.connect(tmp_path / "ledger.sqlite").execute(
        "SELECT round, channel, released, released_at IS NOT NULL FROM charges ORDER BY round, channel").fetchall()
    assert rows == [(0, "u", 1, 1), (1, "u", 1, 1)]  # channel v of the refused request was not written
    assert led.audit()["clients"]["a"]["releases"] == 2
    fresh = PrivacyLedger.open_existing(tmp_path / "ledger.sqlite", "run")
    assert fresh.audit()["clients"]["a"]["releases"] == 2 and fresh.epsilon("a") == led.epsilon("a")


def test_rounds_charged_out_of_order_compose_as_from_scratch(tmp_path):
    """The budget check of a new last round steps down the cached tree without copying the client's state; an
    earlier round filled in re-walks the path. Both give the epsilon of the rows composed from scratch."""
    led = ledger(tmp_path)
    for rnd in (0, 2, 5):
        led.charge("a", rnd, "u", GaussianEvent(1.0, 3.0))
    led.charge("a", 1, "u", GaussianEvent(1.0, 1.5))   # filled in
    led.charge("a", 6, "u", GaussianEvent(1.0, 2.0))   # after every other
    led.charge("a", 6, "v", GaussianEvent(1.0, 2.0))   # a second channel of the latest round
    fresh = PrivacyLedger.open_existing(tmp_path / "ledger.sqlite", "run")
    assert led.epsilon("a") == pytest.approx(fresh.epsilon("a"), rel=1e-12)
    single = PrivacyLedger(tmp_path / "single.sqlite", "single", delta=1e-5)
    single.charge("a", 0, "all", GaussianEvent(1.0, (3 * 3.0 ** -2 + 1.5 ** -2 + 2 * 2.0 ** -2) ** -0.5))
    assert led.epsilon("a") == pytest.approx(single.epsilon("a"), rel=1e-9)


class _no_block:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_run_ids_of_a_path_no_run_wrote_are_none_and_nothing_is_created(tmp_path):
    import sqlite3

    missing = tmp_path / "none.sqlite"
    assert PrivacyLedger.run_ids(missing) == [] and not missing.exists()
    empty = tmp_path / "empty.sqlite"
    sqlite3.connect(str(empty)).close()  # an empty database (a path someone opened, no run wrote)
    assert PrivacyLedger.run_ids(empty) == []
    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(str(other))
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    with pytest.raises(sqlite3.DatabaseError):  # another application's database is not a ledger
        PrivacyLedger.run_ids(other)
