"""A malicious ServerApp's messages to the privfl ClientApp: each test plays the server, drives the client half
(``client_train``, ``client_charge``) with the message it would forge, and checks the client refuses it before any
record is read or anything charged, or answers in a way that does not depend on the records.

The data sets are neighbours where it matters: ``D`` holds 60 digits whose pixel 1 is 0, ``D'`` replaces one of them
by a digit whose pixel 1 is not (the weight on that pixel then moves in local training for ``D'`` only)."""

from __future__ import annotations

import os
import sqlite3

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Context, Message, RecordDict  # noqa: E402

from privfl.core.config import FederationConfig, PrivacyConfig  # noqa: E402
from privfl.data import federated_from_arrays, load_digits  # noqa: E402
from privfl.flower import app as A  # noqa: E402
from privfl.flower.records import from_record, to_record  # noqa: E402


@pytest.fixture(autouse=True)
def identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_task_id", "_run_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


DIGITS = load_digits(flatten=True)
FED = FederationConfig(rounds=2, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=4, client_size=60)
PRIVACY = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="local")


def spec_of(algorithm="dp_fedavg", privacy=PRIVACY, fed=FED, run_id="r", **kw):
    parts = [DIGITS.subset(np.arange(k * 60, (k + 1) * 60)) for k in range(2)]
    federation = federated_from_arrays(parts, DIGITS.subset(np.arange(200, 260)), name="digits2")
    return A.RunSpec.of(algorithm, federation, fed, privacy, run_id=run_id, **kw)


def neighbours(tmp_path):
    """``{"D": path, "D'": path}``: 60 records whose pixel 1 is 0, and the same with one record replaced."""
    x, y = DIGITS.x, DIGITS.y
    zero = np.where(x[:, 1] == 0)[0][:60]
    other = np.where(x[:, 1] > 0.1)[0][0]
    out = {}
    for name, swap in (("D", False), ("D'", True)):
        xs, ys = x[zero].copy(), y[zero].copy()
        if swap:
            xs[0], ys[0] = x[other], y[other]
        path = tmp_path / ("d1.npz" if swap else "d0.npz")
        np.savez(path, x=xs, y=ys)
        out[name] = str(path)
    return out


def context(spec, data, ledger, node=None):
    config = {"partition-id": 1, "data-path": str(data), "ledger-path": str(ledger), **(node or {})}
    return Context(run_id=1, node_id=1, node_config=config, state=RecordDict(),
                   run_config={A.SPEC_KEY: spec.to_json()})


def train_message(spec, rnd=0, values=None):
    alg = A._setup(spec)
    body = {"round": rnd, "noise_multipliers": A._run_plan(alg, spec).noise_multipliers,
            "values": dict(alg.broadcast(0).values) if values is None else values}
    return Message(to_record(body, A.BROADCAST), dst_node_id=1, message_type="train"), alg


def reply(handler, msg, ctx, kind=A.REPLY):
    """The ClientApp's answer as the server sees it: ("error", code) or the decoded reply."""
    out = A._guarded(handler)(msg, ctx)
    if out.has_error():
        return ("error", out.error.code)
    return from_record(out.content, kind)


def rows(ledger, run_id) -> int:
    if not os.path.exists(ledger):
        return 0
    with sqlite3.connect(ledger) as conn:
        if not conn.execute("SELECT name FROM sqlite_master WHERE name='charges'").fetchone():
            return 0
        return conn.execute("SELECT COUNT(*) FROM charges WHERE run_id=?", (run_id,)).fetchone()[0]


# -- 1. the round index --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("clip", [1e-30, 1e120])
def test_a_round_outside_the_plan_is_refused_before_anything_is_read_or_charged(tmp_path, clip):
    """Round 3000 of a 2-round run: adaptive clipping's accepted clip range grows with the round, so the old client
    took any clip in [1e-30, ~1e130] and charged and released it. Refused now, with the same code on neighbouring data
    sets and on a data path that does not exist (nothing was read), nothing charged."""
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="local", clip_quantile=0.5)
    spec = spec_of(privacy=privacy, run_id="adaptive")
    alg = A._setup(spec)
    values = {"global_params": alg.global_params, "current_clip": clip}
    msg, _ = train_message(spec, rnd=3000, values=values)
    paths = {**neighbours(tmp_path), "missing": str(tmp_path / "absent.npz")}
    answers = {}
    for name, data in paths.items():
        ledger = tmp_path / f"{len(answers)}.sqlite"
        answers[name] = reply(A.client_train, msg, context(spec, data, ledger))
        assert rows(ledger, spec.run_id) == 0
    assert set(answers.values()) == {("error", A.CLIENT_ERROR_CODES["deployment"])}
    # the same clip in a planned round is refused by the clip check itself (round 0: a range around C_0)
    msg0, _ = train_message(spec, rnd=0, values=values)
    assert reply(A.client_train, msg0, context(spec, paths["D"], tmp_path / "r0.sqlite"))[0] == "error"


@pytest.mark.parametrize("rnd", [-1, 2, 10**6, 1.5, True])
def test_a_round_index_the_plan_does_not_hold_is_refused_in_train_and_charge_messages(tmp_path, rnd):
    spec = spec_of(run_id="rounds")
    data = neighbours(tmp_path)["D"]
    msg, alg = train_message(spec, rnd=rnd)
    ledger = tmp_path / "l.sqlite"
    assert reply(A.client_train, msg, context(spec, data, ledger)) == ("error", A.CLIENT_ERROR_CODES["deployment"])
    # a charge-only message (client sampling under amplification) names its round too
    sampled = spec_of(privacy=PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="central",
                                            sampling_rate=0.5), run_id="sampled")
    charge = Message(to_record({"round": rnd, "phase": None}, A.CHARGE), dst_node_id=1, message_type="query")
    out = reply(A.client_charge, charge, context(sampled, data, ledger), kind=A.CHARGE)
    assert out == ("error", A.CLIENT_ERROR_CODES["deployment"])
    assert rows(ledger, spec.run_id) == 0 and rows(ledger, sampled.run_id) == 0
    # the last planned round is served
    last, _ = train_message(spec, rnd=FED.rounds - 1)
    assert reply(A.client_train, last, context(spec, data, ledger))["round"] == FED.rounds - 1


# -- 2. the broadcast's values ---------------------------------------------------------------------------------------

def extreme_model(alg):
    """The review's broadcast: logistic regression's weight on pixel 1 and the bias of class 0 near float32's max;
    training overflows only where a record's pixel 1 is not 0."""
    g = np.array(alg.global_params, dtype=np.float64)
    g[1] = 3.3e38
    g[10 * 64] = 3.3e38
    return g


def test_a_model_made_to_fail_on_some_records_gets_an_ordinary_release_on_every_data_set(tmp_path):
    """The old client failed on D' (error 4199, nothing charged) and released on D: an uncharged bit about the
    records. Now both release one update, both charged; D's client says in its own warning that it released no
    change, and the reply says nothing of it."""
    from privfl.core.release import LocalResultNotFinite

    spec = spec_of(run_id="extreme")
    alg = A._setup(spec)
    msg, _ = train_message(spec, values={"global_params": extreme_model(alg)})
    answers = {}
    for name, data in neighbours(tmp_path).items():
        ledger = tmp_path / f"{len(answers)}.sqlite"
        with pytest.warns(LocalResultNotFinite) if name == "D'" else _no_warning(LocalResultNotFinite):
            answers[name] = reply(A.client_train, msg, context(spec, data, ledger))
        assert rows(ledger, spec.run_id) == 1
    for out in answers.values():
        assert not isinstance(out, tuple), out
        (release,) = out["releases"]
        assert release["channel"] == "update" and np.all(np.isfinite(release["value"]))
    d, d2 = answers["D"], answers["D'"]
    assert set(d) == set(d2) and set(d["releases"][0]) == set(d2["releases"][0])
    assert "finite" not in repr(d2) and "fallback" not in repr(d2)


class _no_warning:
    def __init__(self, category):
        self.category = category

    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self.caught = self._catch.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        assert not [w for w in self.caught if issubclass(w.category, self.category)]


def test_the_fallback_is_the_in_process_runtime_s_release_too(tmp_path):
    """The in-process runtime's client releases what the Flower ClientApp releases for the same broadcast, data and
    seeds: the fallback comes from the release pipeline both share."""
    from privfl.core.release import LocalResultNotFinite
    from privfl.data import ArrayDataset
    from privfl.runtime.engine import Simulation

    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="local", secure_noise=False)
    spec = spec_of(privacy=privacy, run_id="alike")
    alg = A._setup(spec)
    g = extreme_model(alg)
    msg, _ = train_message(spec, values={"global_params": g})
    path = neighbours(tmp_path)["D'"]
    with pytest.warns(LocalResultNotFinite):
        flower = reply(A.client_train, msg, context(spec, path, tmp_path / "flower.sqlite"))
    with np.load(path) as f:
        mine = ArrayDataset(f["x"], f["y"], spec.task, spec.num_classes, "org1")
    parts = [DIGITS.subset(np.arange(60)), mine]
    from privfl.algorithms import make_algorithm

    sim = Simulation(make_algorithm(spec.algorithm, spec.fed, spec.privacy), federated_from_arrays(parts, parts[0]),
                     spec.fed, spec.privacy, executor="per_client", public=spec.public_facts(),
                     ledger_path=str(tmp_path / "process.sqlite"))
    sim.prepare()
    sim.algorithm.global_params = g
    with pytest.warns(LocalResultNotFinite):
        released = sim.client_step(1, 0)
    np.testing.assert_array_equal(released["update"].value, flower["releases"][0]["value"])


def _refused_alike_on_every_data_set(tmp_path, spec, msg) -> dict:
    """``msg`` sent to a client on D, on D' and on a data path that does not exist: the same configuration error from
    each, nothing charged. Returns the data paths by name."""
    paths = {**neighbours(tmp_path), "missing": str(tmp_path / "absent.npz")}
    answers = set()
    for i, data in enumerate(paths.values()):
        answers.add(reply(A.client_train, msg, context(spec, data, tmp_path / f"{i}.sqlite")))
        assert rows(tmp_path / f"{i}.sqlite", spec.run_id) == 0
    assert answers == {("error", A.CLIENT_ERROR_CODES["configuration"])}
    return paths


@pytest.mark.parametrize("poison", ["nan", "inf", "1e300", "shape", "complex"])
def test_a_broadcast_model_no_honest_server_sends_is_refused_before_anything_is_read(tmp_path, poison):
    """NaN, infinite, beyond float32's range (it becomes infinite in the model), another shape than the model's, not
    real numbers: refused with the same code on neighbouring data sets and on a data path that does not exist."""
    spec = spec_of(run_id="poison")
    alg = A._setup(spec)
    g = np.array(alg.global_params, dtype=np.float64)
    if poison == "shape":
        g = g[:-1]
    elif poison == "complex":
        g = g.astype(np.complex128)
    else:
        g[1] = float(poison)
    msg, _ = train_message(spec, values={"global_params": g})
    _refused_alike_on_every_data_set(tmp_path, spec, msg)


@pytest.mark.parametrize("precision", [1e300, 0.0, -1.0, np.nan])
def test_a_fola_precision_no_honest_server_sends_is_refused_before_anything_is_read(tmp_path, precision):
    """FOLA's broadcast precision: the review's 1e300 on the weights of pixel 1 (the prior term overflowed only for a
    data set whose record moved them), and entries no honest precision has (<= 0, NaN)."""
    fed = FederationConfig(rounds=2, local_epochs=3, batch_size=32, lr=0.1, hidden=(), seed=4, client_size=60)
    spec = spec_of("fola", fed=fed, run_id="fola")
    alg = A._setup(spec)
    prec, mean = np.array(alg.precision, copy=True), np.array(alg.mean, copy=True)
    for c in range(10):
        prec[c * 64 + 1], mean[c * 64 + 1] = precision, 0.0
    msg, _ = train_message(spec, values={"mean": mean, "precision": prec})
    paths = _refused_alike_on_every_data_set(tmp_path, spec, msg)
    # an honest precision in the same message is served
    ok, _ = train_message(spec, values={"mean": mean, "precision": alg.precision})
    assert reply(A.client_train, ok, context(spec, paths["D"], tmp_path / "ok.sqlite"))["round"] == 0


# -- 3. the terms a federation file pins ----------------------------------------------------------------------------

AGREED_PRIVACY = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="distributed")
TERMS = dict(epsilon=4.0, delta=1e-5, epsilon_total=8.0, delta_total=1e-4, placement="distributed")


def federation_node(tmp_path, **terms):
    """Organisation 1's node config entries and the public keys of a two-organisation federation file."""
    from privfl.flower.identity import FEDERATION_KEY, IDENTITY_KEY, make_identities
    from privfl.privacy.secure import SecureAggregation

    keys, federation, public = make_identities(str(tmp_path / "ids"), 2, SecureAggregation(malicious=True),
                                               **{**TERMS, **terms})
    return {IDENTITY_KEY: keys[1], FEDERATION_KEY: federation}, public


def secure_message(spec, rnd=0):
    """A train message of a run under secure aggregation: the broadcast and the round's session configuration, as
    the ServerApp sends them (``_secure_round``)."""
    from privfl.privacy.secure import round_min_inputs
    from privfl.secure_agg import SessionConfig

    msg, alg = train_message(spec, rnd)
    plan = A._run_plan(alg, spec)
    encodings = A._encodings(plan, spec)
    config = SessionConfig.create([A._session_id(str(k)) for k in range(spec.n_clients)], bits=spec.secure.bits,
                                  dimension=sum(e.size for e in encodings.values()),
                                  min_inputs=round_min_inputs(encodings), malicious=True,
                                  dropout=spec.secure.dropout, corruption=spec.secure.corruption)
    body = {"round": rnd, "noise_multipliers": plan.noise_multipliers, "values": dict(alg.broadcast(0).values),
            "secagg": config.to_dict()}
    return Message(to_record(body, A.BROADCAST), dst_node_id=1, message_type="train")


def agreed_spec(public, run_id="agreed", privacy=AGREED_PRIVACY, fed=FED):
    from privfl.privacy.secure import SecureAggregation

    return spec_of(privacy=privacy, fed=fed, secure=SecureAggregation(malicious=True), identities=public,
                   run_id=run_id)


def test_the_agreed_run_is_served(tmp_path):
    node, public = federation_node(tmp_path)
    spec = agreed_spec(public)
    out = reply(A.client_train, secure_message(spec), context(spec, neighbours(tmp_path)["D"], tmp_path / "l.sqlite",
                                                              node))
    assert not isinstance(out, tuple) and out["advertise"] and "releases" not in out
    assert rows(tmp_path / "l.sqlite", spec.run_id) == 1


def _weaker(public, which):
    import dataclasses

    from privfl.privacy.secure import SecureAggregation

    p = AGREED_PRIVACY
    if which == "plaintext, central":  # the review's downgrade: the clipped update in the clear, no noise on it
        return spec_of(privacy=dataclasses.replace(p, placement="central"), run_id=which), None
    if which == "plaintext, non-private":
        return spec_of("fedavg", privacy=PrivacyConfig(epsilon=float("inf")), run_id=which), None
    if which == "semi-honest":
        return spec_of(privacy=p, secure=SecureAggregation(malicious=False), run_id=which), None
    if which == "other dropout":
        return spec_of(privacy=p, secure=SecureAggregation(malicious=True, dropout=0.4), identities=public,
                       run_id=which), None
    changes = {"local noise": dict(placement="local"), "seeded noise": dict(secure_noise=False),
               "epsilon above the cap": dict(epsilon=4.5), "delta above the cap": dict(delta=1e-4)}[which]
    return agreed_spec(public, run_id=which.replace(" ", "-"), privacy=dataclasses.replace(p, **changes)), True


@pytest.mark.parametrize("which", ["plaintext, central", "plaintext, non-private", "semi-honest", "other dropout",
                                   "local noise", "seeded noise", "epsilon above the cap", "delta above the cap"])
def test_a_run_weaker_than_the_federation_file_is_refused_before_anything_is_read_or_charged(tmp_path, which,
                                                                                            caplog):
    """The run config is the server's: a SuperNode with an identity key and a federation file took secure=None with
    central placement (its clipped update in the clear), or seeded noise (a seed the server knows). Every weaker
    term is refused now, with the same code on a data path that does not exist (nothing read), nothing charged."""
    import logging

    node, public = federation_node(tmp_path)
    spec, secure = _weaker(public, which)
    msg = secure_message(spec) if secure else train_message(spec)[0]
    ledger = tmp_path / "l.sqlite"
    with caplog.at_level(logging.ERROR, logger="privfl.flower"):
        for data in (neighbours(tmp_path)["D"], str(tmp_path / "absent.npz")):
            assert reply(A.client_train, msg, context(spec, data, ledger, node)) == (
                "error", A.CLIENT_ERROR_CODES["deployment"])
    assert rows(ledger, spec.run_id) == 0
    assert "weaker than this SuperNode's federation file" in caplog.text


def test_a_charge_only_message_of_a_weaker_run_is_refused_too(tmp_path):
    """Client sampling's charge-only messages come from plaintext runs only (sampling with secure aggregation is
    refused): a SuperNode with a federation file refuses them before charging."""
    node, _ = federation_node(tmp_path)
    sampled = spec_of(privacy=PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="central",
                                            sampling_rate=0.5), run_id="sampled")
    charge = Message(to_record({"round": 0, "phase": None}, A.CHARGE), dst_node_id=1, message_type="query")
    out = reply(A.client_charge, charge, context(sampled, neighbours(tmp_path)["D"], tmp_path / "l.sqlite", node),
                kind=A.CHARGE)
    assert out == ("error", A.CLIENT_ERROR_CODES["deployment"]) and rows(tmp_path / "l.sqlite", "sampled") == 0


def test_a_federation_file_without_the_privacy_terms_is_refused_with_what_to_add(tmp_path, caplog):
    import json
    import logging

    from privfl.flower.identity import FEDERATION_KEY, read_federation

    node, public = federation_node(tmp_path)
    with open(node[FEDERATION_KEY]) as f:
        old = json.load(f)
    del old["privacy"]  # what write_federation wrote before the terms were pinned
    with open(node[FEDERATION_KEY], "w") as f:
        json.dump(old, f)
    with pytest.raises(Exception, match=r"not the privacy terms.*write_federation\(.*epsilon_total"):
        read_federation(node[FEDERATION_KEY])
    spec = agreed_spec(public)
    with caplog.at_level(logging.ERROR, logger="privfl.flower"):
        out = reply(A.client_train, secure_message(spec), context(spec, neighbours(tmp_path)["D"],
                                                                  tmp_path / "l.sqlite", node))
    assert out == ("error", A.CLIENT_ERROR_CODES["configuration"]) and "earlier privfl" in caplog.text
    assert rows(tmp_path / "l.sqlite", spec.run_id) == 0


def test_a_federation_file_refuses_to_pin_central_noise_or_loose_caps(tmp_path):
    from privfl.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="central"):
        federation_node(tmp_path / "a", placement="central")
    with pytest.raises(ConfigurationError, match="epsilon_total"):
        federation_node(tmp_path / "b", epsilon_total=2.0)


def test_a_node_refuses_a_run_that_would_take_its_runs_past_the_file_s_total(tmp_path):
    """Each run id gets a fresh ledger budget, so a server could start run after run: the node admits each run id once,
    for its whole budget, and refuses the run that would take its runs together past epsilon_total (here 8: two runs
    of 4). A run admitted before is served again (a resumed run), an earlier privfl's ledger run counts at its
    budget."""
    from privfl.accounting.ledger import PrivacyLedger

    node, public = federation_node(tmp_path)
    data, ledger = neighbours(tmp_path)["D"], tmp_path / "l.sqlite"
    served = {}
    for run_id in ("b1", "b2", "b3"):
        spec = agreed_spec(public, run_id=run_id)
        served[run_id] = reply(A.client_train, secure_message(spec), context(spec, data, ledger, node))
    assert not isinstance(served["b1"], tuple) and not isinstance(served["b2"], tuple)
    assert served["b3"] == ("error", A.CLIENT_ERROR_CODES["deployment"]) and rows(ledger, "b3") == 0
    again = agreed_spec(public, run_id="b1")
    assert not isinstance(reply(A.client_train, secure_message(again, rnd=1), context(again, data, ledger, node)),
                          tuple)
    # a smaller run fits no more once the total is taken
    small = agreed_spec(public, run_id="small", privacy=PrivacyConfig(epsilon=0.5, delta=1e-5, unit="client", clip=0.5,
                                                                      placement="distributed"))
    assert reply(A.client_train, secure_message(small), context(small, data, ledger, node))[0] == "error"
    # a node whose ledger holds a run it never admitted (an earlier privfl's) counts it at its budget
    other = tmp_path / "other.sqlite"
    PrivacyLedger(str(other), "before-upgrade", delta=1e-5, epsilon_budget=6.0).close()
    fresh = agreed_spec(public, run_id="fresh")
    assert reply(A.client_train, secure_message(fresh), context(fresh, data, other, node)) == (
        "error", A.CLIENT_ERROR_CODES["deployment"])
    assert rows(other, "fresh") == 0


def test_the_total_delta_is_held_too(tmp_path):
    node, public = federation_node(tmp_path, epsilon_total=100.0, delta_total=2e-5)
    data, ledger = neighbours(tmp_path)["D"], tmp_path / "l.sqlite"
    small = PrivacyConfig(epsilon=0.5, delta=1e-5, unit="client", clip=0.5, placement="distributed")
    answers = [reply(A.client_train, secure_message(spec), context(spec, data, ledger, node))
               for spec in (agreed_spec(public, run_id=f"d{i}", privacy=small) for i in range(3))]
    assert [isinstance(a, tuple) for a in answers] == [False, False, True]
    # a run id admitted before, now asking for a larger budget than it was admitted for
    import dataclasses

    larger = agreed_spec(public, run_id="d0", privacy=dataclasses.replace(small, epsilon=1.0))
    assert reply(A.client_train, secure_message(larger, rnd=1), context(larger, data, ledger, node)) == (
        "error", A.CLIENT_ERROR_CODES["deployment"])
