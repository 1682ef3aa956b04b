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
        proof = h.server.consistency_proof()
        assert {s.client_id for s in proof.signatures} == {1, 3, 4, 6, 7}
        for s in proof.signatures:
            h.server.receive(h.clients[s.client_id].unmask(proof))
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
    proof = M.ConsistencyProof(session_id=sid, alive=(1, 2), dropped=(3,), signatures=(M.SignedBy(1, b"s" * 64),))
    assert M.message_from_dict(proof.to_dict()) == proof
    assert M.ConsistencyProof.from_bytes(proof.to_bytes()) == proof
    sig = M.ConsistencySignature(session_id=sid, sender=2, signature=b"t" * 64)
    assert M.ConsistencySignature.from_bytes(sig.to_bytes()) == sig
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
    return h, h.server.consistency_proof()


def test_a_proof_with_fewer_than_threshold_signatures_aborts(harness):
    h, proof = _at_proof(harness)
    short = dataclasses.replace(proof, signatures=proof.signatures[:3])  # threshold is 4
    with pytest.raises(ProtocolAbort, match="only 3 of peer"):
        h.clients[1].unmask(short)


def test_signatures_the_server_makes_itself_do_not_count(harness):
    h, proof = _at_proof(harness)
    server_key = generate_identity()
    from privfl.secure_agg import identity as I

    content = I.encode_ids(proof.alive)
    fakes = tuple(M.SignedBy(c, I.sign(server_key, I.SURVIVORS_PURPOSE, h.config.session_id, c, content))
                  for c in proof.alive)
    forged = dataclasses.replace(proof, signatures=proof.signatures[:1] + fakes[1:])
    with pytest.raises(ProtocolAbort, match="signed this survivor set"):
        h.clients[1].unmask(forged)
    # the genuine proof works
    assert h.clients[2].unmask(proof).sender == 2


def test_the_server_ignores_survivor_signatures_of_another_set(harness):
    h = harness(n=6, d=8, bits=16, threshold=4, malicious=True)
    h.advertise()
    h.share()
    h.mask()
    request = h.server.unmask_request()
    other = dataclasses.replace(request, alive=request.alive[:-1], dropped=request.alive[-1:])
    message = h.clients[1].consistency_check(other)
    assert h.server.receive(message) is False and "does not verify" in h.server.ignored[-1][2]
