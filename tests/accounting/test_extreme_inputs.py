"""Every public entry point of ``accounting``, fed extreme and malformed values: each call answers with a sane value
(finite, or inf where inf is the honest answer) or raises one of the package's own exceptions, within seconds, and a
refused ledger call writes no row. The limits themselves are documented in ``accounting.validation``."""

from __future__ import annotations

import functools
import math
import sqlite3
import time

import pytest

from privfl.accounting import (Calibration, ComposedEvent, GaussianEvent, NoOpEvent, PoissonSampledEvent, PrivacyError,
                        SelfComposedEvent, UnsupportedEvent, ZCDPEvent, calibrate, epsilon_for, event_from_dict,
                        make_accountant, round_event)
from privfl.accounting.accountants import ACCOUNTANTS, Accountant
from privfl.accounting.events import PrivacyEvent
from privfl.accounting.ledger import Charge, ChargeRequest, PrivacyLedger

SECONDS = 10.0  # the wall-clock limit of one call (pytest-timeout stops a hang; the assertion below the slow ones)
pytestmark = pytest.mark.timeout(2 * SECONDS)

EXTREMES = {
    "zero": 0, "zero_float": 0.0, "subnormal": 1e-320, "tiny": 1e-300, "small": 1e-100, "huge": 1e300,
    "inf": math.inf, "-inf": -math.inf, "nan": math.nan, "negative": -1.0, "negative_int": -3, "true": True,
    "none": None, "string": "1e-5", "word": "banana", "empty_string": "", "big_int": 10 ** 9, "bigger_int": 10 ** 400,
    "list": [1.0], "dict": {"a": 1.0},
}

G = GaussianEvent(1.0, 2.0)
SAMPLED = PoissonSampledEvent(0.1, GaussianEvent(1.0, 1.0))


def composed(name: str, event=G):
    return make_accountant(name).compose(event)


@functools.lru_cache(maxsize=None)
def sampled_accountant(name: str):
    """One composed accountant per backend, shared by the query cases (queries never change its state)."""
    return make_accountant(name).compose(SAMPLED, 10)


# -- what a sane answer is ------------------------------------------------------------------------------------------

def epsilon_value(x):
    assert isinstance(x, float) and not math.isnan(x) and x >= 0.0, x


def delta_value(x):
    assert isinstance(x, float) and 0.0 <= x <= 1.0, x


def an_event(x):
    assert isinstance(x, PrivacyEvent)
    assert event_from_dict(x.to_dict()) == x  # what is built also round-trips through the ledger's storage


def an_accountant(x):
    assert isinstance(x, Accountant)


def a_calibration(x):
    assert isinstance(x, Calibration)
    assert x.epsilon <= x.target_epsilon
    assert all(math.isfinite(z) and z > 0 for z in x.noise_multipliers.values())


def anything(x):
    return None


# (entry point, check of its answer); each takes the extreme value v.
ENTRIES = {
    # events
    "GaussianEvent.sensitivity": (lambda v: GaussianEvent(v, 1.0), an_event),
    "GaussianEvent.noise_std": (lambda v: GaussianEvent(1.0, v), an_event),
    "ZCDPEvent.rho": (lambda v: ZCDPEvent(v), an_event),
    "ZCDPEvent.label": (lambda v: ZCDPEvent(0.1, v), an_event),
    "PoissonSampledEvent.sampling_rate": (lambda v: PoissonSampledEvent(v, G), an_event),
    "PoissonSampledEvent.event": (lambda v: PoissonSampledEvent(0.5, v), an_event),
    "PoissonSampledEvent.relation": (lambda v: PoissonSampledEvent(0.5, G, v), an_event),
    "SelfComposedEvent.count": (lambda v: SelfComposedEvent(G, v), an_event),
    "SelfComposedEvent.event": (lambda v: SelfComposedEvent(v, 2), an_event),
    "ComposedEvent.events": (lambda v: ComposedEvent(v), an_event),
    "UnsupportedEvent.reason": (lambda v: UnsupportedEvent(v), an_event),
    "event_from_dict": (lambda v: event_from_dict(v), an_event),
    "event_from_dict.gaussian": (lambda v: event_from_dict({"kind": "gaussian", "sensitivity": v, "noise_std": 1}),
                                 an_event),
    "event_from_dict.sampled": (lambda v: event_from_dict({"kind": "poisson_sampled", "sampling_rate": 0.5,
                                                           "relation": v, "event": G.to_dict()}), an_event),
    # accountant construction
    "make_accountant.name": (lambda v: make_accountant(v), an_accountant),
    "make_accountant.pld_interval": (lambda v: make_accountant("pld", value_discretization_interval=v),
                                     an_accountant),
    "make_accountant.rdp_orders": (lambda v: make_accountant("rdp", orders=v), an_accountant),
    "make_accountant.rdp_order": (lambda v: make_accountant("rdp", orders=[2.0, v]), an_accountant),
    # calibration (exact without sampling, pld with it, and the other backends)
    "calibrate.target_epsilon": (lambda v: calibrate(v, 1e-5, 10), a_calibration),
    "calibrate.target_delta": (lambda v: calibrate(1.0, v, 10), a_calibration),
    "calibrate.rounds": (lambda v: calibrate(1.0, 1e-5, v), a_calibration),
    "calibrate.sampled.target_epsilon": (lambda v: calibrate(v, 1e-5, 10, sampling_rate=0.1), a_calibration),
    "calibrate.sampled.target_delta": (lambda v: calibrate(1.0, v, 10, sampling_rate=0.1), a_calibration),
    "calibrate.sampled.rounds": (lambda v: calibrate(1.0, 1e-5, v, sampling_rate=0.1), a_calibration),
    "calibrate.sampling_rate": (lambda v: calibrate(1.0, 1e-5, 10, sampling_rate=v), a_calibration),
    "calibrate.channels": (lambda v: calibrate(1.0, 1e-5, 10, channels=v), a_calibration),
    "calibrate.channel_share": (lambda v: calibrate(1.0, 1e-5, 10, channels={"a": v, "b": 1.0}), a_calibration),
    "calibrate.sampled.channel_share": (
        lambda v: calibrate(1.0, 1e-5, 10, sampling_rate=0.1, channels={"a": 1.0, "b": v}), a_calibration),
    "calibrate.channel_name": (lambda v: calibrate(1.0, 1e-5, 10, channels={v: 1.0} if _hashable(v) else v),
                               a_calibration),
    "calibrate.accountant": (lambda v: calibrate(1.0, 1e-5, 10, accountant=v), a_calibration),
    "calibrate.tol": (lambda v: calibrate(1.0, 1e-5, 10, sampling_rate=0.1, tol=v), a_calibration),
    "calibrate.relation": (lambda v: calibrate(1.0, 1e-5, 10, sampling_rate=0.1, relation=v), a_calibration),
    "calibrate.rdp.rounds": (lambda v: calibrate(1.0, 1e-5, v, sampling_rate=0.1, accountant="rdp"),
                             a_calibration),
    "calibrate.zcdp.target_delta": (lambda v: calibrate(1.0, v, 10, accountant="zcdp"), a_calibration),
    "Calibration.noise_multipliers": (
        lambda v: Calibration(noise_multipliers=v, epsilon=1.0, delta=1e-5, accountant="exact"), anything),
    "Calibration.epsilon": (lambda v: Calibration({"u": 1.0}, epsilon=v, delta=1e-5, accountant="exact"), anything),
    "Calibration.delta": (lambda v: Calibration({"u": 1.0}, epsilon=1.0, delta=v, accountant="exact"), anything),
    "Calibration.accountant": (lambda v: Calibration({"u": 1.0}, epsilon=1.0, delta=1e-5, accountant=v), anything),
    "Calibration.rounds": (lambda v: Calibration({"u": 1.0}, 1.0, 1e-5, "exact", rounds=v), anything),
    "Calibration.relation": (lambda v: Calibration({"u": 1.0}, 1.0, 1e-5, "exact", relation=v), anything),
    "epsilon_for.noise_multipliers": (lambda v: epsilon_for(v, 10), epsilon_value),
    "epsilon_for.rounds": (lambda v: epsilon_for(1.0, v), epsilon_value),
    "epsilon_for.sampled.noise_multipliers": (lambda v: epsilon_for({"a": v}, 10, 0.1), epsilon_value),
    "epsilon_for.sampling_rate": (lambda v: epsilon_for(1.0, 10, v), epsilon_value),
    "epsilon_for.delta": (lambda v: epsilon_for(1.0, 10, 0.1, v), epsilon_value),
    "epsilon_for.relation": (lambda v: epsilon_for(1.0, 10, 0.1, 1e-5, "pld", v), epsilon_value),
    "round_event.noise_multipliers": (lambda v: round_event(v), an_event),
    "round_event.sampling_rate": (lambda v: round_event(1.0, v), an_event),
}
for _name in sorted(ACCOUNTANTS):
    ENTRIES |= {
        f"{_name}.compose.event": (lambda v, n=_name: make_accountant(n).compose(v), an_accountant),
        f"{_name}.compose.count": (lambda v, n=_name: make_accountant(n).compose(G, v).get_epsilon(1e-5),
                                   epsilon_value),
        f"{_name}.compose.noise": (lambda v, n=_name: composed(n, GaussianEvent(1.0, v)).get_epsilon(1e-5),
                                   epsilon_value),
        f"{_name}.compose.sensitivity": (lambda v, n=_name: composed(n, GaussianEvent(v, 1.0)).get_delta(1.0),
                                         delta_value),
        f"{_name}.compose.rho": (lambda v, n=_name: composed(n, ZCDPEvent(v)).get_epsilon(1e-5), epsilon_value),
        f"{_name}.get_epsilon": (lambda v, n=_name: composed(n).get_epsilon(v), epsilon_value),
        f"{_name}.get_delta": (lambda v, n=_name: composed(n).get_delta(v), delta_value),
        f"{_name}.sampled.noise": (
            lambda v, n=_name: composed(n, PoissonSampledEvent(0.1, GaussianEvent(1.0, v))).get_epsilon(1e-5),
            epsilon_value),
        f"{_name}.sampled.rate": (
            lambda v, n=_name: make_accountant(n).compose(PoissonSampledEvent(v, G), 100).get_epsilon(1e-5),
            epsilon_value),
        f"{_name}.sampled.count": (lambda v, n=_name: make_accountant(n).compose(SAMPLED, v).get_epsilon(1e-5),
                                   epsilon_value),
        f"{_name}.sampled.replace_one.count": (
            lambda v, n=_name: make_accountant(n).compose(
                PoissonSampledEvent(0.1, GaussianEvent(2.0, 1.0), "replace_one"), v).get_epsilon(1e-5),
            epsilon_value),
        f"{_name}.sampled.get_epsilon": (lambda v, n=_name: sampled_accountant(n).get_epsilon(v), epsilon_value),
        f"{_name}.sampled.get_delta": (lambda v, n=_name: sampled_accountant(n).get_delta(v), delta_value),
    }


def _hashable(v) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def _run(call, check):
    start = time.perf_counter()
    try:
        result = call()
    except PrivacyError:
        result = None
    else:
        check(result)
    elapsed = time.perf_counter() - start
    assert elapsed < SECONDS, f"took {elapsed:.1f} s"
    return result


@pytest.mark.parametrize("value", list(EXTREMES.values()), ids=list(EXTREMES))
@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_entry_point_answers_sanely_or_refuses_clearly(entry, value):
    call, check = ENTRIES[entry]
    _run(lambda: call(value), check)


# -- the ledger: the same, and a refused call writes nothing --------------------------------------------------------

def _rows(path) -> tuple[int, int]:
    conn = sqlite3.connect(path)
    try:
        return (conn.execute("SELECT COUNT(*) FROM charges").fetchone()[0],
                conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0])
    finally:
        conn.close()


LEDGER_CALLS = {
    "charge.client_id": lambda led, v: led.charge(v, 5, "u", G),
    "charge.round": lambda led, v: led.charge("a", v, "u", G),
    "charge.channel": lambda led, v: led.charge("a", 5, v, G),
    "charge.event": lambda led, v: led.charge("a", 5, "u", v),
    "charge.unit": lambda led, v: led.charge("a", 5, "u", G, unit=v),
    "charge.noise": lambda led, v: led.charge("a", 5, "u", GaussianEvent(1.0, v)),
    "charge.sampled_noise": lambda led, v: led.charge("a", 5, "u", PoissonSampledEvent(0.1, GaussianEvent(1.0, v))),
    "charge.relation": lambda led, v: led.charge("a", 5, "u", PoissonSampledEvent(0.1, G, v)),
    "charge_all.requests": lambda led, v: led.charge_all("a", 5, v),
    "charge_all.request": lambda led, v: led.charge_all("a", 5, [v]),
    "charge_all.request_channel": lambda led, v: led.charge_all("a", 5, [ChargeRequest(v, G)]),
    "charge_all.request_unit": lambda led, v: led.charge_all("a", 5, [ChargeRequest("u", G, v)]),
    "epsilon.client_id": lambda led, v: led.epsilon(v),
    "epsilon.delta": lambda led, v: led.epsilon("a", delta=v),
    "remaining.client_id": lambda led, v: led.remaining(v),
    "charges.client_id": lambda led, v: led.charges(v),
    "audit.delta": lambda led, v: led.audit(delta=v),
    "epsilon_by_round.delta": lambda led, v: led.epsilon_by_round(delta=v),
    "mark_released": lambda led, v: led.mark_released(v),
}


def _sane_ledger_answer(result):
    if isinstance(result, float):
        assert not math.isnan(result)
    elif isinstance(result, dict) and "max_epsilon" in result:
        assert not math.isnan(result["max_epsilon"])


@pytest.mark.parametrize("value", list(EXTREMES.values()), ids=list(EXTREMES))
@pytest.mark.parametrize("call", sorted(LEDGER_CALLS))
def test_ledger_call_answers_or_refuses_and_a_refusal_writes_no_row(tmp_path, call, value):
    path = tmp_path / "ledger.sqlite"
    with PrivacyLedger(path, "run", delta=1e-5, epsilon_budget=50.0, accountant="pld") as led:
        led.charge("a", 0, "u", PoissonSampledEvent(0.1, GaussianEvent(1.0, 1.0)))
        before = _rows(path)
        start = time.perf_counter()
        try:
            result = LEDGER_CALLS[call](led, value)
        except PrivacyError:
            assert _rows(path) == before, "a refused call wrote to the ledger"
        else:
            _sane_ledger_answer(result)
            if isinstance(result, Charge):
                assert isinstance(result.client_id, str) and result.client_id
                assert result.unit in ("example", "client")
        assert time.perf_counter() - start < SECONDS


LEDGER_CONSTRUCTOR = {
    "path": lambda v: PrivacyLedger(v, "run"),
    "run_id": lambda v: PrivacyLedger("ledger.sqlite", v),
    "delta": lambda v: PrivacyLedger("ledger.sqlite", "run", delta=v),
    "epsilon_budget": lambda v: PrivacyLedger("ledger.sqlite", "run", epsilon_budget=v),
    "accountant": lambda v: PrivacyLedger("ledger.sqlite", "run", accountant=v),
    "meta": lambda v: PrivacyLedger("ledger.sqlite", "run", meta=v),
    "open_existing": lambda v: PrivacyLedger.open_existing(v),
}


@pytest.mark.parametrize("value", list(EXTREMES.values()), ids=list(EXTREMES))
@pytest.mark.parametrize("argument", sorted(LEDGER_CONSTRUCTOR))
def test_ledger_constructor_answers_or_refuses_without_writing(tmp_path, monkeypatch, argument, value):
    monkeypatch.chdir(tmp_path)  # a string value is a relative path: keep whatever it creates in tmp_path
    start = time.perf_counter()
    try:
        ledger = LEDGER_CONSTRUCTOR[argument](value)
    except PrivacyError:
        if argument != "path":
            assert not (tmp_path / "ledger.sqlite").exists(), "a refused ledger was created"
    else:
        assert isinstance(ledger, PrivacyLedger)
        ledger.close()
    assert time.perf_counter() - start < SECONDS


# -- named cases from the audit: fast, clear, and where it is cheap, an answer ----------------------------------------

@pytest.mark.parametrize("call", [
    lambda: make_accountant("pld").compose(GaussianEvent(1.0, 0.01)).get_epsilon(1e-5),
    lambda: make_accountant("pld").compose(PoissonSampledEvent(0.1, GaussianEvent(1.0, 0.01)), 100).get_epsilon(1e-5),
    lambda: make_accountant("pld").compose(PoissonSampledEvent(0.5, GaussianEvent(1.0, 0.6)), 10 ** 9).get_epsilon(
        1e-5),
    lambda: make_accountant("pld").compose(PoissonSampledEvent(0.01, GaussianEvent(1.0, 5.0)), 10 ** 7).get_epsilon(
        1e-5),
    lambda: make_accountant("pld").compose(PoissonSampledEvent(0.1, GaussianEvent(1.0, 1.0)), 10 ** 9).get_delta(1.0),
], ids=["pld_z_0.01", "pld_sampled_z_0.01", "pld_1e9_rounds", "pld_1e7_sparse_leaf", "pld_delta_1e9_rounds"])
def test_pld_answers_hard_compositions_quickly(call):
    value = _run(call, epsilon_value)
    assert value is not None


def test_calibrating_a_billion_sampled_rounds_answers_and_meets_the_target():
    cal = _run(lambda: calibrate(1.0, 1e-5, 10 ** 9, sampling_rate=0.1), a_calibration)
    assert cal is not None and cal.epsilon <= 1.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(target_epsilon=1e300, sampling_rate=0.1), "protects nothing"),
    (dict(target_epsilon=1e-300), "below"),
    (dict(target_delta=1e-320), "delta"),
    (dict(channels={"a": 1e308, "b": 1e-308}), "budget share"),
    (dict(tol=1e-300), "tol"),
    (dict(sampling_rate=0.1, relation="swap"), "relation"),
])
def test_audit_cases_get_clear_messages(kwargs, match):
    args = dict(target_epsilon=1.0, target_delta=1e-5, rounds=10) | kwargs
    with pytest.raises(PrivacyError, match=match):
        calibrate(**args)


def test_extreme_budget_shares_that_are_accepted_still_work():
    cal = calibrate(1.0, 1e-5, 10, channels={"a": 1e300, "b": 1e299})
    assert cal.epsilon <= 1.0
    assert cal.noise_multipliers["a"] < cal.noise_multipliers["b"]


def test_the_ledger_refuses_bad_units_and_client_ids(tmp_path):
    led = PrivacyLedger(tmp_path / "l.sqlite", "run")
    with pytest.raises(PrivacyError, match="unit"):
        led.charge("a", 0, "u", G, unit="banana")
    with pytest.raises(PrivacyError, match="client_id"):
        led.charge(None, 0, "u", G)
    assert led.charges() == []
    led.charge(7, 0, "u", G)  # an integer id is stored as its string
    assert led.clients() == ["7"] and led.epsilon(7) == led.epsilon("7") > 0


def test_noop_and_vanishing_releases_cost_nothing_everywhere():
    for name in ACCOUNTANTS:
        accountant = make_accountant(name).compose(NoOpEvent()).compose(GaussianEvent(1e-320, 1e10))
        assert accountant.get_epsilon(1e-5) == 0.0
