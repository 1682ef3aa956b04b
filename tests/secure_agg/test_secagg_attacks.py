"""Attacks of an active server (and of the network) from issue 14, each mounted for real.

Every test first mounts the attack where it used to work (the semi-honest variant, or the check it defeats switched
off) and shows that it succeeds there, so the test can fail; then mounts it against the defence and shows a clean
``ProtocolAbort`` (or the forged message ignored) with nothing wrong ever summed.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from privfl.secure_agg import ProtocolAbort
from privfl.secure_agg import client as client_module
from privfl.secure_agg import messages as M
from privfl.secure_agg import primitives as P
from privfl.secure_agg import shamir

pytestmark = pytest.mark.timeout(120)

GRAPH_SEED = bytes(range(32))


# ---------------------------------------------------------------------------------------------- the server's tools
def ring_order(config) -> list[int]:
    """The public ring of the Harary graph (``graph.neighbour_graph``), recomputed from the public seed."""
    return sorted(config.client_ids,
                  key=lambda c: hashlib.sha256(config.graph_seed + int(c).to_bytes(8, "big")).digest())


def unmasked_sum(h, subset, seeds: dict, mask_keys: dict) -> np.ndarray | None:
    """What a server can compute from the masked inputs of ``subset``, the self-mask ``seeds`` and the mask private
    keys (``mask_keys``, raw bytes) it reconstructed: the sum of the subset's inputs, or None if a mask stays."""
    cfg = h.config
    total = np.zeros(cfg.dimension, dtype=P.word_dtype(cfg.bits))
    expander = P.MaskExpander(cfg.dimension, cfg.bits)
    for a in subset:
        if a not in seeds:
            return None
        total += np.frombuffer(h.sent["masked_input"][a].masked, dtype=total.dtype)
        expander.add(total, P.self_mask_key(seeds[a], cfg.session_id, a), -1)
        for v in cfg.neighbours(a):
            if v in subset:
                continue  # cancels inside the subset
            if v in mask_keys:
                private = P.private_key_from_bytes(mask_keys[v])
                shared = P.key_agreement(private, h.sent["advertise_keys"][a].mask_key)
            elif a in mask_keys:
                private = P.private_key_from_bytes(mask_keys[a])
                shared = P.key_agreement(private, h.sent["advertise_keys"][v].mask_key)
            else:
                return None
            expander.add(total, P.pairwise_mask_key(shared, cfg.session_id, a, v), -1 if a < v else +1)
    return P.reduce_mod(total, cfg.bits).astype(np.uint64)


def reconstruct(responses, threshold: int) -> tuple[dict, dict]:
    """Every self-mask seed and mask key that ``threshold`` revealed shares determine."""
    pools = ({}, {})
    for sender, message in responses.items():
        for pool, shares in zip(pools, (message.self_mask_shares, message.mask_key_shares)):
            for s in shares:
                pool.setdefault(s.owner, {})[s.x] = s.value
    seeds, keys = ({o: shamir.int_to_bytes(shamir.combine(sh, threshold), 32)
                    for o, sh in pool.items() if len(sh) >= threshold} for pool in pools)
    return seeds, keys


def to_share_keys(h, drop=()):
    h.advertise()
    h.share()
    h.mask(drop=drop)


# ---------------------------------------------------------------------------------------------- (a) divergent lists
def _divergent_views(h, victim_position: int = 0) -> tuple[int, dict[int, set[int]]]:
    """Per-client dropped lists (Harary ring, k = 4, t = 3) that make the clients reveal the victim's self-mask seed and
    the mask keys of all its four neighbours, each client seeing a list that passes its local checks."""
    ring = ring_order(h.config)
    n = len(ring)
    at = lambda offset: ring[(victim_position + offset) % n]  # noqa: E731
    views = {c: set() for c in ring}
    views[at(0)] = {at(-1), at(1)}
    views[at(-1)] = {at(-2), at(1)}
    views[at(1)] = {at(2), at(-1)}
    views[at(-3)] = {at(-2), at(-1)}
    views[at(3)] = {at(2), at(1)}
    views[at(-4)] = {at(-2)}
    views[at(4)] = {at(2)}
    return at(0), views


def test_divergent_survivor_lists_reveal_a_victim_in_the_semi_honest_variant_only(harness):
    h = harness(n=20, d=12, bits=16, degree=4, threshold=3, graph_seed=GRAPH_SEED)
    to_share_keys(h)
    h.server.unmask_request()  # the server closes the stage, then talks to each client on its own
    victim, views = _divergent_views(h)
    responses = {}
    for c, dropped in views.items():
        if not dropped and c != victim:
            continue
        alive = tuple(sorted(set(h.config.client_ids) - dropped))
        request = M.UnmaskRequest(session_id=h.config.session_id, alive=alive, dropped=tuple(sorted(dropped)))
        responses[c] = h.clients[c].unmask(request)
    seeds, keys = reconstruct(responses, h.config.threshold)
    assert victim in seeds and all(v in keys for v in h.config.neighbours(victim))
    # the victim's exact input, from its masked input alone: the attack the consistency round must stop
    assert np.array_equal(unmasked_sum(h, {victim}, seeds, keys), h.values[victim])


def test_divergent_survivor_lists_abort_in_the_malicious_variant(harness):
    h = harness(n=20, d=12, bits=16, degree=4, threshold=3, graph_seed=GRAPH_SEED, malicious=True)
    to_share_keys(h)
    h.server.unmask_request()
    victim, views = _divergent_views(h)
    askers = [c for c, dropped in views.items() if dropped]
    signatures, requests = {}, {}
    for c in askers:
        dropped = views[c]
        alive = tuple(sorted(set(h.config.client_ids) - dropped))
        requests[c] = M.UnmaskRequest(session_id=h.config.session_id, alive=alive, dropped=tuple(sorted(dropped)))
        signatures[c] = h.clients[c].consistency_check(requests[c])  # each view is locally plausible: signed
    revealed = 0
    for c in askers:  # every signer's tag for c, whichever view it signed
        every = tuple(M.Tag(s, t.tag) for s, m in sorted(signatures.items()) for t in m.tags if t.client_id == c)
        proof = M.ConsistencyProof(session_id=h.config.session_id, recipient=c, alive=requests[c].alive,
                                   dropped=requests[c].dropped, tags=every)
        with pytest.raises(ProtocolAbort, match="signed this survivor set"):
            revealed += len(h.clients[c].unmask(proof).self_mask_shares)
    assert revealed == 0 and all(h.clients[c].stage == "aborted" for c in askers)


def test_a_proof_for_another_set_than_the_one_signed_aborts(harness):
    h = harness(n=6, d=8, bits=16, malicious=True)
    to_share_keys(h)
    request = h.server.unmask_request()
    for c in request.alive:
        h.server.receive(h.clients[c].consistency_check(request))
    proof = h.server.consistency_proofs()[1]
    tampered = dataclasses.replace(proof, alive=proof.alive[:-1], dropped=proof.alive[-1:])
    with pytest.raises(ProtocolAbort, match="differs from the one we signed"):
        h.clients[1].unmask(tampered)


# ---------------------------------------------------------------------------------------------- (b) key substitution
def _substitute(h, victim):
    """The server replaces the victim's neighbours' keys (in the victim's directory) by its own."""
    own = {}
    entries = []
    for e in h.directories[victim].keys:
        enc, mask = P.generate_private_key(), P.generate_private_key()
        own[e.client_id] = enc
        entries.append(dataclasses.replace(e, encryption_key=P.public_bytes(enc), mask_key=P.public_bytes(mask)))
    return own, dataclasses.replace(h.directories[victim], keys=tuple(entries))


@pytest.mark.parametrize("malicious", [False, True])
def test_key_substitution_reveals_the_victims_secrets_unless_keys_are_signed(harness, malicious):
    h = harness(n=6, d=8, bits=16, malicious=malicious)
    h.advertise()
    h.directories = h.server.key_directories()
    victim = 1
    own, forged = _substitute(h, victim)
    if malicious:
        with pytest.raises(ProtocolAbort, match="do not carry its tag .*key substitution"):
            h.clients[victim].share_keys(forged)
        assert h.clients[victim].stage == "aborted"
        return
    message = h.clients[victim].share_keys(forged)
    victim_pub = h.sent["advertise_keys"][victim].encryption_key
    key_shares = {}
    for share in message.shares:  # the server opens every share meant for the victim's neighbours
        key = P.share_encryption_key(P.key_agreement(own[share.recipient], victim_pub), h.config.session_id)
        raw = P.decrypt_share(key, share.ciphertext, session_id=h.config.session_id, sender=victim,
                              recipient=share.recipient)
        key_shares[share.recipient] = client_module._parse_share_plaintext(raw)[2]
    mask_key = shamir.int_to_bytes(shamir.combine(key_shares, h.config.threshold), 32)
    assert P.public_bytes(P.private_key_from_bytes(mask_key)) == h.sent["advertise_keys"][victim].mask_key


# ---------------------------------------------------------------------------------------------- corrupted share
def _corrupt_with_exactly_t_holders(h, commit: bool):
    """n = 5, t = 3: two clients drop at unmasking, so exactly t shares of each seed arrive; one is crafted to shift
    the reconstructed seed of client 1 by one (a wrong seed that still fits in 32 bytes)."""
    h.advertise()
    if not commit:  # the old messages carried no commitment
        for c, m in h.sent["advertise_keys"].items():
            h.server._keys[c] = dataclasses.replace(m, seed_commitment=b"")
    h.share()
    h.mask()
    request = h.server.unmask_request()
    answering = [1, 2, 3]
    responses = {c: h.clients[c].unmask(request) for c in answering}
    xs = sorted(answering)
    j = 3
    lam = 1
    for x in xs:
        if x != j:
            lam = lam * (-x) * pow(j - x, -1, shamir.PRIME) % shamir.PRIME
    delta = pow(lam, -1, shamir.PRIME)  # adds exactly 1 to the interpolated secret
    msg = responses[j]
    shares = tuple(dataclasses.replace(s, y=((s.value + delta) % shamir.PRIME).to_bytes(shamir.SHARE_BYTES, "big"))
                   if s.owner == 1 else s for s in msg.self_mask_shares)
    responses[j] = dataclasses.replace(msg, self_mask_shares=shares)
    for c in answering:
        assert h.server.receive(responses[c])
    return h


def test_a_crafted_share_with_exactly_t_holders_gave_a_wrong_sum_without_the_commitment(harness):
    h = _corrupt_with_exactly_t_holders(harness(n=5, d=8, bits=16, threshold=3), commit=False)
    result = h.server.finalize()
    assert not np.array_equal(result.sum, h.expected(result.included))  # silently wrong: what the commitment stops


def test_a_crafted_share_with_exactly_t_holders_aborts(harness):
    h = _corrupt_with_exactly_t_holders(harness(n=5, d=8, bits=16, threshold=3), commit=True)
    with pytest.raises(ProtocolAbort, match="does not match its commitment"):
        h.server.finalize()


def test_a_random_bit_flip_in_a_share_with_exactly_t_holders_aborts(harness):
    rng = np.random.default_rng(3)
    for trial in range(10):
        h = harness(n=5, d=8, bits=16, threshold=3, seed=trial)
        to_share_keys(h)
        request = h.server.unmask_request()
        responses = {c: h.clients[c].unmask(request) for c in (1, 2, 3)}
        msg = responses[2]
        k = int(rng.integers(len(msg.self_mask_shares)))
        s = msg.self_mask_shares[k]
        flipped = (s.value ^ (1 << int(rng.integers(500)))) % shamir.PRIME
        bad = dataclasses.replace(s, y=flipped.to_bytes(shamir.SHARE_BYTES, "big"))
        responses[2] = dataclasses.replace(msg, self_mask_shares=msg.self_mask_shares[:k] + (bad,)
                                           + msg.self_mask_shares[k + 1:])
        for c, m in responses.items():
            h.server.receive(m)
        with pytest.raises(ProtocolAbort):
            h.server.finalize()


# ---------------------------------------------------------------------------------------------- forged masked input
@pytest.mark.parametrize("malicious", [False, True])
def test_a_forged_masked_input_changes_the_sum_unless_inputs_are_signed(harness, malicious):
    h = harness(n=5, d=8, bits=16, malicious=malicious)
    h.advertise()
    h.share()
    h.deliveries = h.server.share_deliveries()
    for c in sorted(h.deliveries):
        message = h.clients[c].masked_input(h.deliveries[c])
        if c == 2:  # the network rewrites client 2's upload (keeping its signature, if any)
            words = np.frombuffer(message.masked, dtype=P.word_dtype(16)).copy()
            words[0] = (int(words[0]) + 1000) % 2 ** 16
            message = dataclasses.replace(message, masked=words.tobytes())
        accepted = h.server.receive(message)
        assert accepted is (not (malicious and c == 2))
    h.sent["masked_input"] = {}
    h.unmask()
    result = h.server.finalize()
    if malicious:
        assert any(kind == "MaskedInput" and who == 2 and "forged" in why for kind, who, why in h.server.ignored)
        assert 2 not in result.included and np.array_equal(result.sum, h.expected(result.included))
    else:
        assert 2 in result.included and not np.array_equal(result.sum, h.expected(result.included))


def test_advertised_keys_with_a_bad_signature_are_ignored_by_the_server(harness):
    h = harness(n=5, d=8, bits=16, malicious=True)
    forged = dataclasses.replace(h.clients[1].advertise_keys(), signature=bytes(64))
    assert h.server.receive(forged) is False and "identity key" in h.server.ignored[-1][2]


# ---------------------------------------------------------------------------------------------- below-floor unmasking
@pytest.mark.parametrize("malicious", [False, True])
def test_a_server_cannot_unmask_fewer_inputs_than_min_inputs(harness, malicious):
    h = harness(n=7, d=8, bits=16, threshold=4, min_inputs=6, malicious=malicious)
    to_share_keys(h, drop=[6, 7])
    # the honest server refuses itself ...
    with pytest.raises(ProtocolAbort, match="at least 6"):
        h.server.unmask_request()
    # ... and a server that asks anyway (5 inputs, above the threshold 4, below the charged floor 6) is refused
    forged = M.UnmaskRequest(session_id=h.config.session_id, alive=(1, 2, 3, 4, 5), dropped=(6, 7))
    for c in (1, 2, 3, 4, 5):
        call = h.clients[c].consistency_check if malicious else h.clients[c].unmask
        with pytest.raises(ProtocolAbort, match="fewer than the session's minimum 6"):
            call(forged)


# ---------------------------------------------------------------------------------------------- chosen dropouts
def _cut_arc(h, arc_size: int):
    """Declare dropped two blocks of k/2 = 2 ring neighbours around an arc of ``arc_size`` clients."""
    ring = ring_order(h.config)
    arc = set(ring[2:2 + arc_size])
    dropped = set(ring[:2]) | set(ring[2 + arc_size:4 + arc_size])
    return arc, dropped


def _chosen_dropout_attack(h, arc, dropped):
    """Returns what the server computes for the arc's sum (None if a mask stays) and the clients that aborted."""
    h.advertise()
    h.share()
    h.mask()  # everyone sent a masked input; the server pretends some did not
    alive = tuple(sorted(set(h.config.client_ids) - dropped))
    request = M.UnmaskRequest(session_id=h.config.session_id, alive=alive, dropped=tuple(sorted(dropped)))
    responses, aborted = {}, {}
    for c in alive:
        try:
            responses[c] = h.clients[c].unmask(request)
        except ProtocolAbort as exc:
            aborted[c] = exc
    seeds, keys = reconstruct(responses, h.config.threshold)
    return unmasked_sum(h, arc, seeds, keys), aborted


def test_chosen_dropouts_cut_out_a_sub_sum_without_the_component_check(harness, monkeypatch):
    def count_only(config, client_id, alive):  # the old rule: only |alive| was (not even) checked
        return None

    monkeypatch.setattr(client_module, "survivor_set_problem", count_only)
    h = harness(n=20, d=8, bits=16, degree=4, threshold=3, min_inputs=10, graph_seed=GRAPH_SEED)
    arc, dropped = _cut_arc(h, 4)
    got, aborted = _chosen_dropout_attack(h, arc, dropped)
    assert not aborted and got is not None
    assert np.array_equal(got, h.expected(arc))  # the sum of 4 clients, below min_inputs 10


def test_chosen_dropouts_that_cut_the_graph_are_refused(harness):
    h = harness(n=20, d=8, bits=16, degree=4, threshold=3, min_inputs=10, graph_seed=GRAPH_SEED)
    arc, dropped = _cut_arc(h, 4)
    got, aborted = _chosen_dropout_attack(h, arc, dropped)
    assert got is None  # the arc's self masks stay: its members refused
    assert set(aborted) == arc and all("cuts the neighbour graph" in str(e) for e in aborted.values())


def test_the_honest_server_refuses_random_dropouts_that_cut_a_small_degree_graph(harness):
    h = harness(n=20, d=8, bits=16, degree=2, threshold=2, min_inputs=10, graph_seed=GRAPH_SEED)
    ring = ring_order(h.config)
    with pytest.raises(ProtocolAbort, match="split the neighbour graph"):
        h.run({"masked_input": [ring[0], ring[5]]})  # a ring of degree 2 falls apart into arcs of 4 and 14


def test_a_client_refuses_a_session_configured_below_its_charged_floor(harness):
    from privfl.secure_agg.client import ClientSession

    h = harness(n=7, d=8, bits=16, threshold=4, min_inputs=4)
    with pytest.raises(ProtocolAbort, match="fewer than the 6 our noise share was charged for"):
        ClientSession(h.config, 1, h.values[1], min_inputs=6)
    assert ClientSession(h.config, 1, h.values[1], min_inputs=4).stage == "advertise_keys"
