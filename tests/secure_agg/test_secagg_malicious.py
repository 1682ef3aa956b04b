"""The malicious-server variant on its honest path: exact sums under dropouts at every stage, serialisable messages,
identity registries checked at construction, and the consistency round's counting of signatures."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from privfl.secure_agg import ProtocolAbort, run_round
from privfl.secure_agg import messages as M
from privfl.secure_agg.client import ClientSession
from privfl.secure_agg.identity import IdentityRegistry, generate_identity, identity_public_bytes
from privfl.secure_agg.protocol import SessionConfig
from privfl.secure_agg.server import ServerSession

pytestmark = pytest.mark.timeout(120)

STAGES5 = ("advertise_keys", "share_keys", "masked_input", "consistency_check", "unmask")


@pytest.mark.parametrize("stage", STAGES5)
def test_dropouts_at_each_stage_give_the_exact_sum(harness, stage):
    h = harness(n=7, d=20, bits=20, threshold=4, malicious=True)
    if stage == "consistency_check":
        h.advertise()
        h.share()
        h.mask()
        request = h.server.unmask_request()
        for c in request.alive:
            if c not in (2, 5):
                h.server.receive(h.clients[c].consistency_check(request))
        proofs = h.server.consistency_proofs()
        assert set(proofs) == {1, 3, 4, 6, 7}
        for c, proof in proofs.items():
            assert {t.client_id for t in proof.tags} == {1, 3, 4, 6, 7} - {c}
            h.server.receive(h.clients[c].unmask(proof))
        result = h.server.finalize()
        expected = h.config.client_ids  # their inputs are in U3: only their unmasking help is missing
    else:
        result = h.run({stage: [2, 5]})
        expected = h.config.client_ids if stage == "unmask" else (1, 3, 4, 6, 7)
    assert result.included == expected and np.array_equal(result.sum, h.expected(expected))


@pytest.mark.parametrize("n, degree", [(6, None), (30, 8)])
def test_run_round_malicious_with_serialisation(n, degree):
    rng = np.random.default_rng(0)
    values = {f"c{i}": rng.integers(0, 2 ** 24, size=16, dtype=np.uint64) for i in range(n)}
    result = run_round(values, bits=24, degree=degree, malicious=True, serialise=True,
                       drop_at={"masked_input": ["c1"], "consistency_check": ["c2"]})
    assert "c1" not in result.included and "c2" in result.included
    expected = sum(values[k] for k in result.included) % 2 ** 24
    assert np.array_equal(result.sum, expected) and result.config.malicious


def test_new_messages_round_trip_and_old_messages_still_load():
    sid = bytes(32)
    proof = M.ConsistencyProof(session_id=sid, recipient=1, alive=(1, 2), dropped=(3,), tags=(M.Tag(2, b"s" * 32),))
    assert M.message_from_dict(proof.to_dict()) == proof
    assert M.ConsistencyProof.from_bytes(proof.to_bytes()) == proof
    sig = M.ConsistencySignature(session_id=sid, sender=2, signature=b"t" * 64, tags=(M.Tag(1, b"u" * 32),))
    assert M.ConsistencySignature.from_bytes(sig.to_bytes()) == sig
    with pytest.raises(ValueError, match="tag must be 32 bytes"):
        M.Tag(1, b"u" * 64)
    old = {"type": "MaskedInput", "session_id": "AAAAAAAAAAAAAAAAAAAAAA==", "sender": 1, "masked": "AAAA"}
    assert M.message_from_dict(old).signature == b""
    with pytest.raises(ValueError, match="signature must be empty or 64 bytes"):
        M.MaskedInput(session_id=sid, sender=1, masked=b"x", signature=b"short")
    config = SessionConfig.create(range(1, 5), bits=8, dimension=2, malicious=True)
    assert SessionConfig.from_dict(config.to_dict()) == config and SessionConfig.from_dict(config.to_dict()).malicious


def test_identity_registry_and_sessions_are_checked_at_construction():
    keys = {c: generate_identity() for c in (1, 2, 3)}
    registry = IdentityRegistry({c: identity_public_bytes(k) for c, k in keys.items()})
    config = SessionConfig.create((1, 2, 3), bits=8, dimension=2, malicious=True)
    value = np.zeros(2, dtype=np.uint64)
    with pytest.raises(ValueError, match="identity_key and the deployment's IdentityRegistry"):
        ClientSession(config, 1, value)
    with pytest.raises(ValueError, match="not the key registered for client 1"):
        ClientSession(config, 1, value, identity_key=keys[2], registry=registry)
    with pytest.raises(ValueError, match="IdentityRegistry"):
        ServerSession(config)
    partial = IdentityRegistry({1: identity_public_bytes(keys[1])})
    with pytest.raises(ValueError, match="no key for client"):
        ClientSession(config, 1, value, identity_key=keys[1], registry=partial)
    with pytest.raises(ValueError, match="share one identity key"):
        IdentityRegistry({1: identity_public_bytes(keys[1]), 2: identity_public_bytes(keys[1])})
    with pytest.raises(ValueError, match="32 raw"):
        IdentityRegistry({1: b"short"})


def _at_proof(harness):
    h = harness(n=6, d=8, bits=16, threshold=4, malicious=True)
    h.advertise()
    h.share()
    h.mask()
    request = h.server.unmask_request()
    for c in request.alive:
        h.server.receive(h.clients[c].consistency_check(request))
    return h, h.server.consistency_proofs()


def test_a_proof_with_fewer_than_threshold_signatures_aborts(harness):
    h, proofs = _at_proof(harness)
    proof = proofs[1]
    short = dataclasses.replace(proof, tags=proof.tags[:2])  # threshold is 4: client 1 and two tags
    with pytest.raises(ProtocolAbort, match="only 3 of peer"):
        h.clients[1].unmask(short)


def test_signatures_the_server_makes_itself_do_not_count(harness):
    h, proofs = _at_proof(harness)
    proof = proofs[1]
    from privfl.secure_agg import identity as I

    # the best the server can do: tags under its own agreement with client 1's registered key, of the right content
    server = I.ClientIdentity(generate_identity())
    parts = (h.clients[1]._transcript, I.encode_ids(proof.alive), I.encode_ids(proof.dropped))
    fakes = tuple(M.Tag(c, I.tag(server.pairwise_key(c, 1, h.registry), I.content_digest(
        I.SURVIVORS_PURPOSE, h.config.session_id, c, *parts), 1)) for c in proof.alive if c != 1)
    forged = dataclasses.replace(proof, tags=proof.tags[:1] + fakes[1:])
    with pytest.raises(ProtocolAbort, match="signed this survivor set"):
        h.clients[1].unmask(forged)
    # another client's proof does not verify for us either
    with pytest.raises(ProtocolAbort, match="addressed to client 3"):
        h.clients[2].unmask(proofs[3])
    # the genuine proof works
    assert h.clients[4].unmask(proofs[4]).sender == 4


def test_the_server_ignores_survivor_signatures_of_another_set(harness):
    h = harness(n=6, d=8, bits=16, threshold=4, malicious=True)
    h.advertise()
    h.share()
    h.mask()
    request = h.server.unmask_request()
    other = dataclasses.replace(request, alive=request.alive[:-1], dropped=request.alive[-1:])
    message = h.clients[1].consistency_check(other)
    assert h.server.receive(message) is False and "does not verify" in h.server.ignored[-1][2]


# ---------------------------------------------------------------------------------------------- the session transcript
def _directories(harness):
    h = harness(n=6, d=8, bits=16, malicious=True)
    h.advertise()
    h.directories = h.server.key_directories()
    return h


@pytest.mark.parametrize("case, match", [
    ("missing_self", "does not hold the key bundle we advertised"),
    ("other_self", "does not hold the key bundle we advertised"),
    ("peer_digest", "is not the one in the session transcript"),
    ("hidden_neighbour", "whose keys we were not given"),
    ("twice", "listed twice in the session transcript"),
    ("unknown", "unknown client id 99"),
])
def test_a_transcript_that_does_not_match_what_we_hold_aborts(harness, case, match):
    h = _directories(harness)
    d = h.directories[1]
    entries = list(d.transcript)
    keys = list(d.keys)
    if case == "missing_self":
        entries = [e for e in entries if e.client_id != 1]
    elif case == "other_self":  # our id, with the bundle of another session of ours
        entries = [M.BundleDigest(1, bytes(32)) if e.client_id == 1 else e for e in entries]
    elif case == "peer_digest":
        entries = [M.BundleDigest(2, bytes(32)) if e.client_id == 2 else e for e in entries]
    elif case == "hidden_neighbour":
        keys = [k for k in keys if k.client_id != 2]
    elif case == "twice":
        entries = entries + entries[:1]
    else:
        entries = entries + [M.BundleDigest(99, bytes(32))]
    with pytest.raises(ProtocolAbort, match=match):
        h.clients[1].share_keys(dataclasses.replace(d, keys=tuple(keys), transcript=tuple(entries)))


def _to_unmask_request(config, keys, registry):
    """An honest session of zero inputs up to the server's unmask request: (server, clients, deliveries, inputs)."""
    server = ServerSession(config, registry=registry)
    clients = {c: ClientSession(config, c, np.zeros(4, dtype=np.uint64), identity_key=keys[c], registry=registry)
               for c in config.client_ids}
    for c in clients:
        server.receive(clients[c].advertise_keys())
    directories = server.key_directories()
    for c in clients:
        server.receive(clients[c].share_keys(directories[c]))
    deliveries = server.share_deliveries()
    inputs = {c: clients[c].masked_input(deliveries[c]) for c in clients}
    for m in inputs.values():
        assert server.receive(m)
    return server, clients, deliveries, inputs


def test_every_signature_after_the_keys_covers_the_transcript_hash():
    """The same roster, session id and survivor set in two sessions: the survivor-set signatures and the input
    attestations of one do not verify in the other, because each session's bundles are fresh."""
    from privfl.secure_agg import identity as I

    config = SessionConfig.create(range(1, 6), bits=16, dimension=4, malicious=True)
    keys = {c: generate_identity() for c in config.client_ids}
    registry = IdentityRegistry({c: identity_public_bytes(k) for c, k in keys.items()})
    runs = []
    for _ in range(2):  # the server runs the session twice under the same id
        server, clients, deliveries, inputs = _to_unmask_request(config, keys, registry)
        request = server.unmask_request()
        signatures = {c: clients[c].consistency_check(request) for c in request.alive}
        runs.append((server.transcript_hash, request, inputs, signatures, deliveries))
    (ta, request, inputs_a, sig_a, deliveries), (tb, _, _, sig_b, _) = runs
    assert ta != tb
    ids = (I.encode_ids(request.alive), I.encode_ids(request.dropped))
    sid = config.session_id
    for c in config.client_ids:
        assert registry.verify(sig_a[c].signature, I.SURVIVORS_PURPOSE, sid, c, ta, *ids)
        assert not registry.verify(sig_b[c].signature, I.SURVIVORS_PURPOSE, sid, c, ta, *ids)
        content = I.content_digest(I.SURVIVORS_PURPOSE, sid, c, ta, *ids)
        tags_a, tags_b = ({t.client_id: t.tag for t in sig.tags} for sig in (sig_a[c], sig_b[c]))
        assert set(tags_a) == set(tags_b) == set(config.client_ids) - {c}
        for w in tags_a:  # the tags c made for w: those of session a verify there, those of session b do not
            key = I.ClientIdentity(keys[w]).pairwise_key(w, c, registry)
            assert I.check_tag(key, content, w, tags_a[w]) and not I.check_tag(key, content, w, tags_b[w])
        senders = I.encode_ids(s.sender for s in deliveries[c].shares)
        assert registry.verify(inputs_a[c].signature, I.INPUT_PURPOSE, sid, c, ta, I.digest(inputs_a[c].masked),
                               senders)
        assert not registry.verify(inputs_a[c].signature, I.INPUT_PURPOSE, sid, c, tb,
                                   I.digest(inputs_a[c].masked), senders)


def test_the_server_aborts_when_too_few_holders_of_a_survivor_sign():
    """Survivors that drop before the consistency round stay in the sum (their input attestations are forwarded), but
    each survivor needs ``threshold`` signing holders, or the clients would refuse: the server says so first."""
    config = SessionConfig.create(range(1, 21), bits=16, dimension=4, degree=4, threshold=3, malicious=True)
    keys = {c: generate_identity() for c in config.client_ids}
    registry = IdentityRegistry({c: identity_public_bytes(k) for c, k in keys.items()})
    server, clients, _, _ = _to_unmask_request(config, keys, registry)
    request = server.unmask_request()
    silent = set(sorted(config.neighbours(1))[:3])  # three of client 1's five holders do not sign
    for c in request.alive:
        if c not in silent:
            server.receive(clients[c].consistency_check(request))
    with pytest.raises(ProtocolAbort, match="share holders of client 1 signed the survivor set"):
        server.consistency_proofs()


def test_run_round_clients_check_the_configuration_against_the_declared_threat_model(monkeypatch):
    from privfl.secure_agg import ThreatModel
    from privfl.secure_agg import runtime

    seen = []
    real = runtime.ClientSession

    def spy(*args, **kwargs):
        seen.append(kwargs.get("threat_model"))
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime, "ClientSession", spy)
    values = {i: np.full(4, i, dtype=np.uint64) for i in range(12)}
    result = run_round(values, bits=16, malicious=True, dropout=0.1, min_inputs=8)
    assert np.array_equal(result.sum, np.full(4, sum(range(12)), dtype=np.uint64))
    assert seen and all(m == ThreatModel(dropout=0.1, min_inputs=8, malicious=True, n_clients=12) for m in seen)


# ---------------------------------------------------------------------------------------------- malformed bytes
@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"a":' * 100_000, b"\xff\xfe", b'{"type": "KeyDirectory"}', b"[]"])
def test_the_codec_raises_its_own_error_on_any_bytes(raw):
    from privfl.secure_agg import MessageFormatError

    for cls in (M.KeyDirectory, M.ConsistencyProof, M.UnmaskShares):
        with pytest.raises(MessageFormatError):
            cls.from_bytes(raw)
    with pytest.raises(MessageFormatError):
        M.message_from_dict({"type": "Nope"})


def test_a_deeply_nested_saved_state_is_refused_cleanly():
    config = SessionConfig.create((1, 2, 3), bits=8, dimension=2)
    with pytest.raises(ProtocolAbort, match="cannot be restored"):
        ClientSession.from_state(config, b"[" * 100_000)


def test_an_identity_has_one_x25519_form_and_each_pair_one_key():
    """The X25519 form of an identity (RFC 7748's map of its Ed25519 point) is the public key of the scalar Ed25519
    derives from the seed, as cryptography's own X25519 computes it; both ends of a pair derive the same key, and no
    third identity does; a registry refuses two keys of one X25519 form (a point and its negative) and the neutral
    point."""
    from privfl.secure_agg import identity as I

    keys = {c: generate_identity() for c in range(1, 9)}
    registry = IdentityRegistry({c: identity_public_bytes(k) for c, k in keys.items()})
    ids = {c: I.ClientIdentity(k) for c, k in keys.items()}  # each checks its X25519 form against the map
    for c in keys:
        assert registry.agreement_key(c) == I.montgomery_public_bytes(identity_public_bytes(keys[c]))
    assert ids[1].pairwise_key(1, 2, registry) == ids[2].pairwise_key(2, 1, registry)
    assert ids[1].pairwise_key(1, 2, registry) != ids[1].pairwise_key(1, 3, registry)
    assert ids[3].pairwise_key(3, 2, registry) != ids[1].pairwise_key(1, 2, registry)
    # a tag verifies for its recipient, from its sender, for its content only
    content = I.content_digest(I.SURVIVORS_PURPOSE, bytes(16), 1, b"transcript", b"ids")
    tag = I.tag(ids[1].pairwise_key(1, 2, registry), content, 2)
    assert I.check_tag(ids[2].pairwise_key(2, 1, registry), content, 2, tag)
    assert not I.check_tag(ids[2].pairwise_key(2, 1, registry), content, 1, tag)  # reflected
    assert not I.check_tag(ids[3].pairwise_key(3, 1, registry), content, 3, tag)  # another recipient
    other = I.content_digest(I.SURVIVORS_PURPOSE, bytes(16), 1, b"transcript", b"idz")
    assert not I.check_tag(ids[2].pairwise_key(2, 1, registry), other, 2, tag)
    raw = identity_public_bytes(keys[1])
    negative = raw[:31] + bytes([raw[31] ^ 0x80])  # -P: same y, other sign of x
    with pytest.raises(ValueError, match="differ only in sign"):
        IdentityRegistry({1: raw, 2: negative})
    with pytest.raises(ValueError, match="not a usable curve point"):
        I.montgomery_public_bytes((1).to_bytes(32, "little"))
    with pytest.raises(ValueError, match="not in the identity registry"):
        registry.agreement_key(99)
