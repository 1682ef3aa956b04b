"""The session context: opaque bytes each client computes itself and binds, with the session's public parameters,
into its signed and tagged keys and the transcript hash (``protocol.session_binding``). Clients of one session
whose contexts differ (a deployment binds its run, phase, round and noise plan) abort at the first tag check, before
any share or masked input leaves, whatever the server relays; clients with equal contexts run as before."""

from __future__ import annotations

import numpy as np
import pytest

from privfl.secure_agg import ProtocolAbort, run_round
from privfl.secure_agg import identity as I
from privfl.secure_agg.client import ClientSession
from privfl.secure_agg.identity import IdentityRegistry, generate_identity, identity_public_bytes
from privfl.secure_agg.messages import BundleDigest, KeyDirectory, PublicKeys, ShareKeys
from privfl.secure_agg.protocol import SessionConfig, session_binding
from privfl.secure_agg.server import ServerSession

pytestmark = pytest.mark.timeout(120)


def clients_of(config, contexts, seed=0):
    rng = np.random.default_rng(seed)
    keys = {c: generate_identity() for c in config.client_ids}
    registry = IdentityRegistry({c: identity_public_bytes(k) for c, k in keys.items()})
    return {c: ClientSession(config, c, rng.integers(0, 2 ** config.bits, size=config.dimension, dtype=np.uint64),
                             identity_key=keys[c], registry=registry, context=contexts[c])
            for c in config.client_ids}, registry


def relay(config, adverts):
    """An active server's key directories: every bundle, tag and transcript entry as it came, nothing checked."""
    sid = config.session_id
    transcript = tuple(BundleDigest(c, I.bundle_digest(sid, c, a.encryption_key, a.mask_key, a.seed_commitment))
                       for c, a in sorted(adverts.items()))
    return {c: KeyDirectory(session_id=sid, recipient=c, transcript=transcript, keys=tuple(
        PublicKeys(v, adverts[v].encryption_key, adverts[v].mask_key, adverts[v].seed_commitment,
                   {t.client_id: t.tag for t in adverts[v].tags}.get(c, b""))
        for v in sorted(config.neighbours(c) & adverts.keys()))) for c in adverts}


@pytest.mark.parametrize("n, degree", [(5, 4), (9, 2)], ids=["complete", "ring"])
def test_clients_bound_to_different_contexts_abort_at_the_first_tag_check(n, degree):
    """Client 1 bound to context A, the others to B, one SessionConfig, everything relayed: client 1 and every
    neighbour of it abort when they check the first peer tags (share_keys), sending nothing; clients whose
    neighbours all share their context go on (on the complete graph, none)."""
    config = SessionConfig.create(range(1, n + 1), bits=16, dimension=8, degree=degree, threshold=degree // 2 + 1,
                                  malicious=True, check=False)
    contexts = {c: b"run A" if c == 1 else b"run B" for c in config.client_ids}
    clients, _ = clients_of(config, contexts)
    adverts = {c: s.advertise_keys() for c, s in clients.items()}
    directories = relay(config, adverts)
    crossing = {1} | set(config.neighbours(1))
    for c, session in clients.items():
        if c in crossing:
            with pytest.raises(ProtocolAbort, match="do not carry its tag") as info:
                session.share_keys(directories[c])
            assert info.value.stage == "share_keys" and session.stage == "aborted"
        else:
            assert isinstance(session.share_keys(directories[c]), ShareKeys)
    assert (crossing == set(config.client_ids)) == (degree == n - 1)  # on the ring, 3 abort and 6 go on


def test_equal_contexts_run_the_round_and_an_honest_server_drops_keys_of_another_context():
    values = {k: np.full(6, k + 1, dtype=np.uint64) for k in range(6)}
    result = run_round(values, bits=16, malicious=True, dropout=0.0, context=b"run B round 3")
    assert result.included == tuple(range(6)) and np.array_equal(result.sum, np.full(6, 21))
    # one client bound elsewhere: the honest server ignores its keys (their signature does not verify under the
    # server's context), so it is left out from the start, and the others' sum is exact
    result = run_round(values, bits=16, malicious=True, degree=5, threshold=4, min_inputs=4, check=False,
                       context=b"run B round 3", contexts={0: b"run A round 3"})
    assert result.included == (1, 2, 3, 4, 5) and np.array_equal(result.sum, np.full(6, 20))


def test_a_server_that_expects_another_context_ignores_every_key_bundle():
    config = SessionConfig.create(range(1, 4), bits=16, dimension=4, malicious=True, dropout=0.0)
    clients, registry = clients_of(config, {c: b"mine" for c in config.client_ids})
    server = ServerSession(config, registry=registry, context=b"theirs")
    assert not any(server.receive(s.advertise_keys()) for s in clients.values())
    assert {why for _, _, why in server.ignored} == {"keys not signed by the sender's registered identity key for "
                                                     "this session's parameters and context"}


def test_an_empty_context_binds_the_configuration_alone_and_a_context_changes_the_binding():
    config = SessionConfig.create(range(1, 4), bits=16, dimension=4, malicious=True, dropout=0.0)
    assert session_binding(config) == session_binding(config, b"") == config.digest
    assert len({session_binding(config, c) for c in (b"", b"a", b"b", b"a" * 33)}) == 4
    with pytest.raises(TypeError):
        session_binding(config, "text")
    with pytest.raises(ValueError):
        session_binding(config, bytes(2000))


def test_the_context_survives_the_saved_state_and_a_different_one_is_refused():
    config = SessionConfig.create(range(1, 4), bits=16, dimension=4, malicious=True, dropout=0.0)
    clients, registry = clients_of(config, {c: b"ctx" for c in config.client_ids})
    session = clients[1]
    session.advertise_keys()
    key = session._identity
    restored = ClientSession.from_state(config, session.to_state(), identity_key=key, registry=registry)
    assert restored.context == b"ctx"
    assert ClientSession.from_state(config, session.to_state(), identity_key=key, registry=registry,
                                    context=b"ctx").context == b"ctx"
    with pytest.raises(ProtocolAbort, match="another context"):
        ClientSession.from_state(config, session.to_state(), identity_key=key, registry=registry, context=b"other")


@pytest.mark.parametrize("tamper", ["withheld", "another transcript"])
def test_every_survivor_of_a_sparse_graph_must_show_its_signature_under_our_transcript(harness, tamper):
    """A client's tags reach only survivors within a few hops; on a sparse graph a server could add survivors of
    another run, phase or round far from it (they signed another transcript, which binds their context). Every
    survivor's identity signature of the survivor set now comes with the consistency proof and is checked: a far
    survivor whose signature is withheld, or made under another transcript, makes the client abort before it reveals
    anything (until session 25 it went on)."""
    h = harness(n=12, d=4, bits=16, degree=2, threshold=2, malicious=True, graph_seed=bytes(range(32)))
    h.advertise()
    h.share()
    h.mask()
    h.request = h.server.unmask_request()
    h._talk("consistency_check", h.request.alive, lambda c: h.clients[c].consistency_check(h.request), ())
    proofs = h.server.consistency_proofs()
    cfg = h.config
    victim = 1
    reach = set()
    for a in {victim} | (cfg.neighbours(victim) & set(proofs[victim].alive)):
        reach |= {a} | cfg.within(a, 3)
    far = max(set(proofs[victim].alive) - reach)  # a survivor none of the victim's tags reach
    proof = proofs[victim]
    if tamper == "withheld":
        signatures = tuple(s for s in proof.signatures if s.client_id != far)
    else:
        forged = I.sign(h.identities[far].signing_key if hasattr(h.identities[far], "signing_key") else h.identities[far],
                        I.SURVIVORS_PURPOSE, cfg.session_id, far, b"\x07" * 32, I.encode_ids(proof.alive),
                        I.encode_ids(proof.dropped))
        signatures = tuple(type(s)(s.client_id, forged) if s.client_id == far else s for s in proof.signatures)
    import dataclasses

    with pytest.raises(ProtocolAbort, match=f"survivor {far} shows no signature"):
        h.clients[victim].unmask(dataclasses.replace(proof, signatures=signatures))
    # the untouched proofs pass: an honest round unmasks as before
    for c in sorted(set(proofs) - {victim}):
        h.clients[c].unmask(proofs[c])
