"""An active server that puts clients of different runs, or of different rounds, into ONE secure-aggregation session
(one ``SessionConfig``), through the real ClientApp handlers (``client_train``, ``client_secagg``).

A review found nothing in a session tied to a run, a phase, a round or the clients' noise plans: a server ran a
victim on run A (epsilon 3 over 30 rounds: large discrete-Gaussian shares) and its peers on run B (epsilon 3 over 10
rounds: small shares), both admitted by every node's federation file, relayed the messages between them, and every
check passed. The sum held the victim's share and the peers' small ones while the victim's ledger charged the
Gaussian of honest shares of its own sigma (the review, 10 clients: the whole run, ledger epsilon 3.000, real 5.08,
past the file's cap of 3; one round of a victim at epsilon 1 over 50 rounds: charged z 26.4, real z 8.8). Now each client binds its session to the context it
computes itself (``privfl.privacy.secure.client_secure_context``: run, phase, round, encodings and noise plan), and
every client with a neighbour of another run (or round) aborts at the first tag check, before any share or masked
input leaves: on the complete graph (3 clients here) every client; on a sparse one the victim and its neighbours (a
client whose neighbours all run its own run, round and plan may go on: what it could join is a sum of its own
run). The attacker here checks no signature and relays every key bundle, tag and transcript faithfully: the same
relay completes the key exchange of an honest run (the control)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Context, Message, RecordDict  # noqa: E402

from privfl.accounting.ledger import PrivacyLedger  # noqa: E402
from privfl.core.config import FederationConfig, PrivacyConfig  # noqa: E402
from privfl.data import federated_from_arrays, load_digits  # noqa: E402
from privfl.flower import app as A  # noqa: E402
from privfl.flower.identity import make_identities  # noqa: E402
from privfl.flower.records import from_record, to_record  # noqa: E402
from privfl.privacy import secure as S  # noqa: E402
from privfl.privacy.secure import SecureAggregation  # noqa: E402
from privfl.secure_agg import ProtocolAbort, SessionConfig  # noqa: E402
from privfl.secure_agg import identity as I  # noqa: E402
from privfl.secure_agg.messages import AdvertiseKeys, BundleDigest, KeyDirectory, PublicKeys  # noqa: E402

N = 3  # the complete graph: every client is the victim's neighbour
SEC = SecureAggregation(malicious=True, bits=48)
DIGITS = load_digits(flatten=True)


@pytest.fixture(autouse=True)
def identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_task_id", "_run_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


@pytest.fixture
def federation(tmp_path):
    return make_federation(tmp_path, N)


def make_federation(tmp_path, n):
    keys, fed_file, identities = make_identities(str(tmp_path / "ids"), n, SEC, placement="distributed",
                                                 unit="client", epsilon=3.0, delta=1e-5, epsilon_total=9.0,
                                                 delta_total=3e-5)
    parts = [DIGITS.subset(np.arange(k * 60, (k + 1) * 60)) for k in range(n)]
    fedset = federated_from_arrays(parts, DIGITS.subset(np.arange(900, 960)), name=f"digits{n}")
    for k in range(n):
        np.savez(tmp_path / f"d{k}.npz", x=parts[k].x, y=parts[k].y)
    return keys, fed_file, identities, fedset


def spec(federation, run_id, rounds, epsilon=3.0):
    _, _, identities, fedset = federation
    fed = FederationConfig(rounds=rounds, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=4, client_size=60)
    priv = PrivacyConfig(epsilon=epsilon, delta=1e-5, unit="client", clip=0.5, placement="distributed")
    return A.RunSpec.of("dp_fedavg", fedset, fed, priv, run_id=run_id, secure=SEC, identities=identities)


def node(tmp_path, federation, k, s):
    keys, fed_file, _, _ = federation
    return Context(run_id=1, node_id=k + 1, state=RecordDict(), run_config={A.SPEC_KEY: s.to_json()},
                   node_config={"partition-id": k, "data-path": str(tmp_path / f"d{k}.npz"),
                                "ledger-path": str(tmp_path / f"l{k}.sqlite"), "identity-key": keys[k],
                                "federation": fed_file})


def one_session(s):
    """The session the attacker hands every client: built for run ``s``'s dimension and survivor floor."""
    encodings = A._encodings(A._run_plan(A._setup(s), s), s)
    return SessionConfig.create([k + 1 for k in range(s.n_clients)], bits=SEC.bits, dimension=sum(e.size for e in
                                encodings.values()), min_inputs=S.round_min_inputs(encodings), malicious=True,
                                dropout=0.0, corruption=0.0)


def advertise(specs, rounds, contexts, config):
    """Each client's train step under the one session: it trains, charges its own ledger and advertises its keys."""
    adverts = {}
    for k, s in specs.items():
        alg = A._setup(s)
        body = {"round": rounds[k], "noise_multipliers": A._run_plan(alg, s).noise_multipliers,
                "values": dict(alg.broadcast(rounds[k]).values), "secagg": config.to_dict()}
        out = A.client_train(Message(to_record(body, A.BROADCAST), dst_node_id=k + 1, message_type="train"),
                             contexts[k])
        reply = from_record(out.content, A.REPLY)
        assert not reply["sat_out"]
        adverts[k + 1] = AdvertiseKeys.from_bytes(reply["advertise"])
    return adverts


def relay(config, adverts):
    """An attacker's key directories: every bundle, tag and transcript entry forwarded as it came, no signature
    checked (an honest ServerSession would drop what does not verify under its own run's context)."""
    sid = config.session_id
    transcript = tuple(BundleDigest(c, I.bundle_digest(sid, c, a.encryption_key, a.mask_key, a.seed_commitment))
                       for c, a in sorted(adverts.items()))
    out = {}
    for c in adverts:
        keys = []
        for v in sorted(config.neighbours(c) & adverts.keys()):
            a = adverts[v]
            keys.append(PublicKeys(client_id=v, encryption_key=a.encryption_key, mask_key=a.mask_key,
                                   seed_commitment=a.seed_commitment,
                                   tag={t.client_id: t.tag for t in a.tags}.get(c, b"")))
        out[c] = KeyDirectory(session_id=sid, recipient=c, keys=tuple(keys), transcript=transcript)
    return out


def stage(contexts, rounds, name, messages):
    """Each client's answer to one later stage: the decoded reply, or the exception its handler raised."""
    answers = {}
    for c, m in sorted(messages.items()):
        k = c - 1
        req = {"round": rounds[k], "stage": name, "phase": None, "message": m.to_bytes()}
        try:
            out = A.client_secagg(Message(to_record(req, A.SECAGG_REQUEST), dst_node_id=c, message_type=A.SECAGG),
                                  contexts[k])
            answers[k] = from_record(out.content, A.SECAGG_REPLY)
        except Exception as exc:  # noqa: BLE001 - the test reads what the client refused
            answers[k] = exc
    return answers


def released_rows(tmp_path, s, k):
    ledger = PrivacyLedger.open_existing(str(tmp_path / f"l{k}.sqlite"), s.run_id)
    try:
        return [(c.round, c.released) for c in ledger.charges(str(k))]
    finally:
        ledger.close()


def assert_aborts_at_the_first_tag_check(tmp_path, specs, rounds, contexts, config, adverts, victim=0):
    """The victim and every client with a neighbour of another run or round abort at the first tag check (on the
    complete graph: every client); the others (all neighbours of their own run and round) answer. Returns the
    clients that aborted."""
    answers = stage(contexts, rounds, "share_keys", relay(config, adverts))
    crossing = {k for k in specs if any((specs[k].run_id, rounds[k]) != (specs[v - 1].run_id, rounds[v - 1])
                                        for v in config.neighbours(k + 1))}
    assert victim in crossing
    for k in sorted(set(specs) - crossing):
        assert isinstance(answers[k], dict) and answers[k]["stage"] == "share_keys", (k, answers[k])
    for k in sorted(crossing):
        exc = answers[k]
        assert isinstance(exc, ProtocolAbort), (k, exc)  # before the fix: ShareKeys, the Shamir shares leaving
        assert exc.stage == "share_keys" and "do not carry its tag" in exc.reason, (k, exc)
        assert A.SECAGG_STATE not in contexts[k].state  # nothing of the aborted session is kept
        # charged, never released: no masked input left, and none can (no session to answer the next stage)
        assert released_rows(tmp_path, specs[k], k) == [(rounds[k], False)]
        with pytest.raises(A.DeploymentError, match="no secure-aggregation session"):
            A.client_secagg(Message(to_record({"round": rounds[k], "stage": "masked_input", "phase": None,
                                               "message": b""}, A.SECAGG_REQUEST), dst_node_id=k + 1,
                                    message_type=A.SECAGG), contexts[k])
    return crossing


@pytest.mark.parametrize("n", [N, 6], ids=["complete-graph", "ring"])
def test_clients_of_two_runs_in_one_session_abort_at_the_first_tag_check(tmp_path, n):
    """The reviewer's mix: partition 0 on run A (epsilon 3, 30 rounds), the others on run B (epsilon 3, 10
    rounds), one SessionConfig. Both runs are within every node's federation file, so every admission check
    passes, and the victim's noise share is ~1.7 times the peers' (the ledger would charge ~1.6 times the noise the
    sum holds)."""
    federation = make_federation(tmp_path, n)
    runs = {"A": spec(federation, "A", 30), "B": spec(federation, "B", 10)}
    specs = {k: runs["A" if k == 0 else "B"] for k in range(n)}
    (name, plan_a), = A._run_plan(A._setup(runs["A"]), runs["A"]).distributed.items()
    plan_b = A._run_plan(A._setup(runs["B"]), runs["B"]).distributed[name]
    assert plan_a.local_sigma > 1.5 * plan_b.local_sigma  # what the attack would have gained
    rounds = {k: 0 for k in range(n)}
    contexts = {k: node(tmp_path, federation, k, specs[k]) for k in range(n)}
    config = one_session(runs["A"])
    assert config.replace(session_id=b"0" * 32, graph_seed=b"0" * 32) == one_session(runs["B"]).replace(
        session_id=b"0" * 32, graph_seed=b"0" * 32)  # one session fits both runs: nothing in it tells them apart
    adverts = advertise(specs, rounds, contexts, config)
    aborted = assert_aborts_at_the_first_tag_check(tmp_path, specs, rounds, contexts, config, adverts)
    assert aborted == (set(range(n)) if n == N else {0} | {v - 1 for v in config.neighbours(1)})


def test_clients_of_two_rounds_of_one_run_in_one_session_abort_at_the_first_tag_check(tmp_path, federation):
    """One run, one plan, one session: the victim asked for round 1, its peers for round 0 (each round a fresh
    release charged once; a session must hold one round)."""
    s = spec(federation, "R", 10)
    specs = {k: s for k in range(N)}
    rounds = {k: 1 if k == 0 else 0 for k in range(N)}
    contexts = {k: node(tmp_path, federation, k, s) for k in range(N)}
    config = one_session(s)
    adverts = advertise(specs, rounds, contexts, config)
    assert assert_aborts_at_the_first_tag_check(tmp_path, specs, rounds, contexts, config, adverts) == set(range(N))


def test_the_same_relay_completes_the_key_exchange_of_an_honest_run(tmp_path, federation):
    """The control: every client on run B, round 0, under the same kind of session and the same relay: every tag
    verifies and every client answers with its encrypted shares (the clients of one run, phase and round compute one
    context from what each holds)."""
    s = spec(federation, "B", 10)
    specs = {k: s for k in range(N)}
    rounds = {k: 0 for k in range(N)}
    contexts = {k: node(tmp_path, federation, k, s) for k in range(N)}
    config = one_session(s)
    adverts = advertise(specs, rounds, contexts, config)
    answers = stage(contexts, rounds, "share_keys", relay(config, adverts))
    for k in range(N):
        assert isinstance(answers[k], dict) and answers[k]["stage"] == "share_keys", (k, answers[k])
        assert A.SECAGG_STATE in contexts[k].state


def test_an_honest_run_through_the_server_app_and_client_app_binds_one_context_on_both_sides(tmp_path, federation,
                                                                                          monkeypatch):
    """privfl's ServerApp and ClientApps in one process (experiments/loopback_grid.py), malicious variant,
    distributed noise, two rounds: the ServerApp's context (``_secure_round``) and every client's
    (``_secure_advertise``) agree, so every key bundle verifies, every round is summed and every charge released."""
    import importlib.util

    from privfl.flower.app import read_result

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "experiments",
                        "loopback_grid.py")
    loader = importlib.util.spec_from_file_location("loopback_grid", path)
    grid_module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(grid_module)
    monkeypatch.setenv("PRIVFL_REPLY_POLL", "0.01")
    s = dataclasses.replace(spec(federation, "honest", 2), node_wait=5, round_timeout=60)
    result_path = str(tmp_path / "result.bin")
    run_config = {A.SPEC_KEY: s.to_json(), A.RESULT_KEY: result_path}
    apps = {}
    for k in range(N):
        ctx = node(tmp_path, federation, k, s)
        apps[100 + k] = (A.client_app, Context(run_id=1, node_id=100 + k, node_config=ctx.node_config,
                                               state=RecordDict(), run_config=run_config))
    A.server_main(grid_module.LoopbackGrid(apps), Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                          run_config=run_config))
    history = read_result(result_path)["history"]
    assert [(h["participants"], h["aborted"]) for h in history] == [(N, False)] * 2
    for k in range(N):
        assert released_rows(tmp_path, s, k) == [(0, True), (1, True)]
