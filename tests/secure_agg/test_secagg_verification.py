"""What each client verifies in the malicious-server variant.

``ClientSession._check_proof`` counts a peer's signing holders by verifying (the pairwise tags the signers made for
it), among the holders not yet decided, first the survivors its two-hop check needs anyway and stops at ``threshold``.
That ordering may only change how many tags a client verifies, never what it decides: here every tampered proof gets
exactly the verdict (and the reason) of a reference check that verifies every tag offered, and on an honest round
every client still verifies the bundle tag of every neighbour it shares with and the survivor-set tag of every survivor
within two hops, each once.
"""

from __future__ import annotations

import collections
import dataclasses
import random

import numpy as np
import pytest

from privfl.secure_agg import ProtocolAbort, derive_parameters
from privfl.secure_agg import identity as I
from privfl.secure_agg import messages as M
from privfl.secure_agg.client import ClientSession

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------------------------- the reference check
def reference_reason(session: ClientSession, proof: M.ConsistencyProof) -> str | None:
    """Check 6 of ``client``'s docstring with every offered signature verified up front: the start of the reason a
    client must abort with, or None."""
    cfg, me, registry = session.config, session.client_id, session._registry
    if proof.recipient != me:
        return f"consistency proof addressed to client {proof.recipient}"
    sid, t = cfg.session_id, cfg.threshold
    alive_t, dropped_t = session._survivors
    if tuple(sorted(proof.alive)) != alive_t or tuple(sorted(proof.dropped)) != dropped_t:
        return "the survivor set in the consistency proof differs"
    alive, listed = set(alive_t), set(alive_t) | set(dropped_t)
    parts = (session._transcript, I.encode_ids(alive_t), I.encode_ids(dropped_t))
    first: dict[int, bytes] = {}
    for e in proof.tags:
        if e.client_id in alive and e.client_id != me:
            first.setdefault(e.client_id, e.tag)
    ok = {c for c, tag in first.items()
          if session._tagged(c, I.content_digest(I.SURVIVORS_PURPOSE, sid, c, *parts), tag)} | {me}
    attested: dict[int, M.InputAttestation] = {}
    for e in proof.inputs:
        if e.client_id in alive:
            attested.setdefault(e.client_id, e)

    def proven(b):
        e = attested.get(b)
        return b in ok or (e is not None and registry.verify(e.signature, I.INPUT_PURPOSE, sid, b, session._transcript,
                                                             e.digest, I.encode_ids(cfg.neighbours(b) & listed)))

    senders = set(session._received)
    checked = set()
    for a in {me} | (senders & alive):
        checked |= {a} | (cfg.neighbours(a) & alive)
    for b in sorted(checked):
        count = len(cfg.holders(b) & ok)
        if count < t:
            return f"only {count} of peer {b}'s share holders signed"
        if not proven(b):
            return f"survivor {b} shows neither"
    for p in sorted(senders - alive):
        count = len(cfg.holders(p) & ok)
        if count < t:
            return f"only {count} of peer {p}'s share holders signed"
    return None


def _at_proof(harness, n=14, degree=6, threshold=4, drop=(3, 9)):
    """A sparse round run up to the consistency proof, two clients dropped before masking (so clients reveal
    mask-key shares too, and some proofs carry input attestations)."""
    h = harness(n=n, d=4, bits=16, degree=degree, threshold=threshold, malicious=True,
                graph_seed=bytes(range(32)))
    h.advertise()
    h.share()
    h.mask(drop=drop)
    request = h.server.unmask_request()
    for c in request.alive:
        h.server.receive(h.clients[c].consistency_check(request))
    return h, h.server.consistency_proofs()


def _clone(h, c: int) -> ClientSession:
    return ClientSession.from_state(h.config, h.clients[c].to_state(), identity_key=h.identities[c],
                                    registry=h.registry)


def _tamper(rng: random.Random, h, proof: M.ConsistencyProof, proofs: dict) -> M.ConsistencyProof:
    """A proof the server may send: tags left out, corrupted, taken from another client's proof, preceded by a bad
    duplicate (the first one counts), survivors' attestations added or left out."""
    sigs = []
    others = [p for p in proofs.values() if p.recipient != proof.recipient]
    for s in proof.tags:
        roll = rng.random()
        if roll < 0.12:
            continue  # left out
        if roll < 0.2:
            sigs.append(M.Tag(s.client_id, bytes([s.tag[0] ^ 1]) + s.tag[1:]))
            continue
        if roll < 0.25:
            sigs.append(M.Tag(s.client_id, bytes(32)))  # a bad duplicate first
        if roll < 0.3:  # the same signer's tag for another client
            other = {t.client_id: t for t in rng.choice(others).tags}.get(s.client_id)
            if other is not None:
                sigs.append(other)
                continue
        sigs.append(s)
    rng.shuffle(sigs)
    inputs = [a for a in proof.inputs if rng.random() < 0.7]
    signers = {s.client_id for s in sigs}
    for c in proof.alive:  # attestations of survivors whose signature is missing: good ones, or one made elsewhere
        if c not in signers and rng.random() < 0.5:
            masked = h.sent["masked_input"][c]
            digest = I.digest(masked.masked) if rng.random() < 0.7 else bytes(32)
            inputs.append(M.InputAttestation(c, digest, masked.signature))
    return dataclasses.replace(proof, tags=tuple(sigs), inputs=tuple(inputs))


def test_the_proof_check_decides_as_if_it_verified_every_signature(harness):
    h, proofs = _at_proof(harness)
    rng = random.Random(26)
    verdicts = collections.Counter()
    signers = sorted(proofs)
    for trial in range(160):
        c = signers[trial % len(signers)]
        proof = proofs[c]
        tampered = proof if trial < len(signers) else _tamper(rng, h, proof, proofs)
        expected = reference_reason(_clone(h, c), tampered)
        client = _clone(h, c)
        try:
            client.unmask(tampered)
        except ProtocolAbort as exc:
            assert expected is not None and exc.reason.startswith(expected), (trial, c, expected, exc.reason)
            verdicts[expected.split(" ")[0] + " " + expected.split(" ")[-1]] += 1
        else:
            assert expected is None, (trial, c, expected)
            verdicts["revealed"] += 1
    # the trials reached both verdicts and both kinds of abort
    assert verdicts["revealed"] >= len(signers) and sum(verdicts.values()) - verdicts["revealed"] >= 40, verdicts
    assert any(k.startswith("only") for k in verdicts) and any(k.startswith("survivor") for k in verdicts), verdicts


def test_every_client_verifies_each_signature_it_relies_on_once(harness, monkeypatch):
    """An honest round at N = 40 with the parameters derived for dropout 0.2 (degree 18, threshold 10), 8 clients gone
    before masking: each client verifies the bundle tag of every neighbour in its key directory and the survivor-set
    tag of every survivor within two hops of it, no tag twice, and few others; and an Ed25519 signature only of each
    survivor beyond those (every survivor's signature of the set binds the session's context), none twice."""
    calls: dict[object, list] = collections.defaultdict(list)
    who = {"party": "server", "stage": None}
    tagged, verify = ClientSession._tagged, I.IdentityRegistry.verify
    purposes = {"share_keys": I.KEYS_PURPOSE, "unmask": I.SURVIVORS_PURPOSE}

    def recording_tag(self, sender, content, value):
        calls[self.client_id].append((purposes[who["stage"]], sender, value))
        return tagged(self, sender, content, value)

    def recording(self, signature, purpose, session_id, signer, *parts):
        calls[who["party"]].append((b"ed25519:" + purpose, signer, signature))
        return verify(self, signature, purpose, session_id, signer, *parts)

    def as_client(name):
        method = getattr(ClientSession, name)

        def run(self, *args):
            who["party"], who["stage"] = self.client_id, name
            try:
                return method(self, *args)
            finally:
                who["party"], who["stage"] = "server", None
        monkeypatch.setattr(ClientSession, name, run)

    for name in ("share_keys", "masked_input", "consistency_check", "unmask"):
        as_client(name)
    monkeypatch.setattr(ClientSession, "_tagged", recording_tag)
    monkeypatch.setattr(I.IdentityRegistry, "verify", recording)
    params = derive_parameters(40, dropout=0.2, malicious=True)
    h = harness(n=40, d=4, bits=16, degree=params.degree, threshold=params.threshold, malicious=True,
                graph_seed=bytes(range(32)))
    result = h.run({"masked_input": range(1, 9)})
    cfg, alive = h.config, set(result.included)
    assert np.array_equal(result.sum, h.expected(alive)) and len(alive) == 32
    extra = 0
    for c, session in h.clients.items():
        made = calls[c]
        assert len(made) == len(set(made)), f"client {c} verified a tag twice"
        signatures = [m for m in made if m[0].startswith(b"ed25519:")]
        # Ed25519 only for what tags cannot reach: one survivor-set signature per survivor beyond the tag checks
        # (every survivor's signature binds the session's context), never twice, never before the last stage
        assert all(m[0] == b"ed25519:" + I.SURVIVORS_PURPOSE for m in signatures), f"client {c}: {signatures[:2]}"
        assert len(signatures) == len({m[1] for m in signatures}), f"client {c} verified a signature twice"
        bundles = {signer for purpose, signer, _ in made if purpose == I.KEYS_PURPOSE}
        assert bundles == cfg.neighbours(c)  # everyone advertised: every neighbour's bundle
        if c not in alive:
            continue
        senders = set(session._received)
        checked = set()
        for a in {c} | (senders & alive):
            checked |= {a} | (cfg.neighbours(a) & alive)
        survivors = {signer for purpose, signer, _ in made if purpose == I.SURVIVORS_PURPOSE}
        assert checked - {c} <= survivors, f"client {c} did not verify {sorted(checked - {c} - survivors)}"
        extra += len(survivors - checked)
        by_signature = {m[1] for m in signatures}
        assert not by_signature & (checked | survivors), f"client {c} verified by signature a survivor its tags cover"
        assert by_signature | survivors | {c} >= alive, f"client {c} left survivors unverified"
    # beyond the survivors it must check anyway, a client verifies only the few holders that complete the counts:
    # under one extra signature per client here (the ordering before, holders in id order: 60 for the 32)
    assert extra < len(alive), extra
