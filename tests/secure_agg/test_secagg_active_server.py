"""An active server against the malicious-server variant (issue 26): it reorders, drops, trims and replays messages
within and across sessions, with every client a real ``ClientSession`` holding its own signing key.

``ActiveServer`` plays the server: it builds every server message itself (validly signed material only, replayed from
any session it ran) and records what each client sent and was sent. ``knowledge`` is the server's view of the whole
transcript, all sessions together: which secrets it can reconstruct from the shares it was given (plus everything the
clients colluding with it know), and which sums of inputs it can then compute; every sum it reports is recomputed
from the masked inputs and compared with the true one, so the model of what is learnable is checked against the
bytes. Each attack is mounted twice where that makes sense: once with the defence switched off (issue 14's checks,
or signatures not bound to the session's fresh keys), where it must work (so the test can fail), and once against
the defence, where every client aborts or the server learns nothing beyond a sum over at least the session's
``required_inputs`` clients, less the colluding ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Iterable

import numpy as np
import pytest

from privfl.secure_agg import ClientSession, ProtocolAbort, SessionConfig, ThreatModel
from privfl.secure_agg import client as client_module
from privfl.secure_agg import identity as I
from privfl.secure_agg import messages as M
from privfl.secure_agg import primitives as P
from privfl.secure_agg import shamir
from privfl.secure_agg.identity import IdentityRegistry, generate_identity, identity_public_bytes

pytestmark = pytest.mark.timeout(300)

DIM, BITS = 4, 16


# ============================================================================================== the server's tools
def ring_order(config) -> list[int]:
    """The public ring of the Harary graph (``graph.neighbour_graph``), recomputed from the public seed."""
    return sorted(config.client_ids,
                  key=lambda c: hashlib.sha256(config.graph_seed + int(c).to_bytes(8, "big")).digest())


class Instance:
    """One running ``ClientSession`` (one client in one session) as the server sees it."""

    def __init__(self, session: ClientSession, value: np.ndarray, corrupt: bool):
        self.session, self.value, self.corrupt = session, value, corrupt
        self.id, self.config = session.client_id, session.config
        self.advert = None          # its AdvertiseKeys
        self.peers: dict[int, Instance] = {}      # peer id -> the instance whose key bundle it was given
        self.shares_out: dict[int, bytes] = {}    # recipient id -> the ciphertext it made for it
        self.delivered: dict[int, Instance] = {}  # sender id -> the instance whose ciphertext it was given
        self.masked = None          # its MaskedInput
        self.survivor_signature = None
        self.revealed = None        # its UnmaskShares
        self.abort: ProtocolAbort | None = None
        self.context = session.context  # what the client bound its session to (a deployment: run, phase, round)
        self.secrets = None         # (seed, mask private key) of a corrupt client
        self.held: list[tuple[Instance, str, int, int]] = []  # a corrupt client's shares: (owner, kind, x, y)

    def __repr__(self):
        return f"Instance({self.id}, session {self.config.session_id.hex()[:6]})"


class ActiveServer:
    """A server that sends whatever it likes. ``corrupt`` clients collude with it: it knows their secrets, every share
    they hold, and signs anything with their identity keys."""

    def __init__(self, config: SessionConfig, *, corrupt: Iterable[int] = (), threat_model: ThreatModel | None = None,
                 seed: int = 0):
        self.config = config
        self.corrupt = frozenset(corrupt)
        self.threat_model = threat_model
        self.identities = {c: generate_identity() for c in config.client_ids}
        self.registry = IdentityRegistry({c: identity_public_bytes(k) for c, k in self.identities.items()})
        self.rng = np.random.default_rng(seed)
        self.instances: list[Instance] = []

    # ------------------------------------------------------------------ sessions
    def open(self, ids=None, config: SessionConfig | None = None, contexts: dict[int, bytes] | None = None,
             bind: bool = True) -> dict[int, Instance]:
        """Fresh client sessions (fresh inputs) for ``ids`` under ``config`` (default: the server's, so its session
        id: the server may reuse one as often as it likes), keys advertised. ``contexts``: client -> the context it
        binds (default none); ``bind=False`` labels the instances with them without binding (the control)."""
        config = config or self.config
        out = {}
        for c in (config.client_ids if ids is None else ids):
            value = self.rng.integers(0, 2 ** BITS, size=DIM, dtype=np.uint64)
            context = (contexts or {}).get(c, b"")
            session = ClientSession(config, c, value, identity_key=self.identities[c], registry=self.registry,
                                    threat_model=self.threat_model, context=context if bind else b"")
            inst = Instance(session, value, c in self.corrupt)
            inst.context = context
            inst.advert = session.advertise_keys()
            if inst.corrupt:
                inst.secrets = (session._self_seed, P.private_bytes(session._mask_key), session._enc_key)
            out[c] = inst
            self.instances.append(inst)
        return out

    @staticmethod
    def _call(inst: Instance, method: str, message):
        try:
            return getattr(inst.session, method)(message)
        except ProtocolAbort as exc:
            inst.abort = exc
            return None

    def share(self, inst: Instance, peers: Iterable[Instance], transcript: Iterable[Instance] | None = None):
        """Give ``inst`` the key bundles of ``peers`` (from any session) and a transcript listing ``transcript``
        (default: itself and its peers); it answers with its encrypted shares."""
        peers = sorted(peers, key=lambda p: p.id)
        listed = {p.id: p for p in (transcript if transcript is not None else peers)}
        listed.setdefault(inst.id, inst)
        sid = inst.config.session_id
        entries = tuple(M.BundleDigest(c, I.bundle_digest(sid, c, p.advert.encryption_key, p.advert.mask_key,
                                                          p.advert.seed_commitment))
                        for c, p in sorted(listed.items()))
        keys = tuple(M.PublicKeys(p.id, p.advert.encryption_key, p.advert.mask_key, p.advert.seed_commitment,
                                  {t.client_id: t.tag for t in p.advert.tags}.get(inst.id, b"")) for p in peers)
        message = self._call(inst, "share_keys", M.KeyDirectory(session_id=sid, recipient=inst.id, keys=keys,
                                                                 transcript=entries))
        if message is not None:
            inst.peers = {p.id: p for p in peers}
            inst.shares_out = {s.recipient: s.ciphertext for s in message.shares}
        return message

    def deliver(self, inst: Instance, senders: Iterable[Instance]):
        """Forward to ``inst`` the ciphertexts ``senders`` made for its id; it answers with its masked input."""
        senders = sorted(senders, key=lambda s: s.id)
        shares = tuple(M.EncryptedShare(s.id, inst.id, s.shares_out[inst.id]) for s in senders)
        message = self._call(inst, "masked_input", M.ShareDelivery(session_id=inst.config.session_id,
                                                                    recipient=inst.id, shares=shares))
        if message is not None:
            inst.delivered = {s.id: s for s in senders}
            inst.masked = message
            if inst.corrupt:  # a colluding client hands over every share it holds, of both kinds
                key_share, seed_share = inst.session._own_shares
                inst.held += [(inst, "key", inst.id, key_share), (inst, "seed", inst.id, seed_share)]
                sid = inst.config.session_id
                for s in senders:
                    shared = P.key_agreement(inst.secrets[2], inst.peers[s.id].advert.encryption_key)
                    try:
                        raw = P.decrypt_share(P.share_encryption_key(shared, sid), s.shares_out[inst.id],
                                              session_id=sid, sender=s.id, recipient=inst.id)
                    except P.InvalidTag:
                        continue  # a ciphertext made for another instance of this client
                    _, _, key_share, seed_share = client_module._parse_share_plaintext(raw)
                    inst.held += [(s, "key", inst.id, key_share), (s, "seed", inst.id, seed_share)]
        return message

    def sign(self, inst: Instance, alive, dropped):
        """Show ``inst`` a survivor set; returns its ``ConsistencySignature`` (its signature and its tags of the set
        for the survivors that may count it) or None: it aborted. A corrupt client signs whatever it is shown, under
        the transcript it has."""
        request = M.UnmaskRequest(session_id=inst.config.session_id, alive=tuple(sorted(alive)),
                                  dropped=tuple(sorted(dropped)))
        if inst.corrupt:
            return self.forge(inst, alive, dropped)
        message = self._call(inst, "consistency_check", request)
        if message is not None:
            inst.survivor_signature = message
            return message
        return None

    def forge(self, inst: Instance, alive, dropped) -> M.ConsistencySignature:
        """A colluding client's signature and tags (for every other client) of any survivor set, under its session's
        transcript."""
        sid, parts = inst.config.session_id, (inst.session._transcript, I.encode_ids(sorted(alive)),
                                              I.encode_ids(sorted(dropped)))
        identity = I.ClientIdentity(self.identities[inst.id])
        content = I.content_digest(I.SURVIVORS_PURPOSE, sid, inst.id, *parts)
        tags = tuple(M.Tag(w, I.tag(identity.pairwise_key(inst.id, w, self.registry), content, w))
                     for w in inst.config.client_ids if w != inst.id)
        return M.ConsistencySignature(session_id=sid, sender=inst.id, tags=tags, signature=I.sign(
            self.identities[inst.id], I.SURVIVORS_PURPOSE, sid, inst.id, *parts))

    def unmask(self, inst: Instance, alive, dropped, signatures: Iterable[tuple[int, M.ConsistencySignature]],
               attested: Iterable[Instance] = ()):
        """Send ``inst`` a consistency proof with any survivor-set signatures (the tags they hold for ``inst``'s id,
        from whichever session) and input attestations; returns its shares."""
        tags = []
        for c, message in signatures:
            mine = {t.client_id: t.tag for t in message.tags}.get(inst.id)
            if mine is not None:
                tags.append(M.Tag(c, mine))
        proof = M.ConsistencyProof(
            session_id=inst.config.session_id, recipient=inst.id, alive=tuple(sorted(alive)),
            dropped=tuple(sorted(dropped)), tags=tuple(tags),
            inputs=tuple(M.InputAttestation(a.id, I.digest(a.masked.masked), a.masked.signature)
                         for a in attested if a.masked is not None))
        if inst.corrupt:
            return None  # its shares are known already
        message = self._call(inst, "unmask", proof)
        inst.revealed = message
        return message

    # ------------------------------------------------------------------ the honest moves, as building blocks
    def honest_until_masked(self, insts: dict[int, Instance], trim: dict[int, set[int]] | None = None):
        """Directories, shares and deliveries as an honest server sends them, except that ``trim[c]`` lists the
        senders whose ciphertexts ``c`` gets (a trimmed delivery)."""
        cfg = next(iter(insts.values())).config
        for c, inst in insts.items():
            self.share(inst, [insts[v] for v in sorted(cfg.neighbours(c))], transcript=insts.values())
        for c, inst in insts.items():
            if inst.abort is None:
                senders = (trim or {}).get(c, cfg.neighbours(c))
                self.deliver(inst, [insts[v] for v in sorted(senders) if insts[v].abort is None])


# ============================================================================================== what the server learns
@dataclasses.dataclass
class Learnable:
    members: frozenset  # of Instance
    honest: frozenset   # the honest clients whose inputs are in the sum

    def __repr__(self):
        return f"Learnable(honest={sorted(self.honest)}, size={len(self.members)})"


def _reconstruct(insts: list[Instance]) -> tuple[dict, dict]:
    """Every self-mask seed and mask private key (per instance) the server can rebuild from revealed shares and the
    colluding clients' knowledge."""
    pools: dict[tuple[int, str], dict[int, int]] = {}
    owners: dict[int, Instance] = {}

    def add(owner: Instance, kind: str, x: int, y: int):
        owners[id(owner)] = owner
        pools.setdefault((id(owner), kind), {})[x] = y

    for r in insts:
        for owner, kind, x, y in r.held:
            add(owner, kind, x, y)
        if r.revealed is None:
            continue
        for kind, shares in (("seed", r.revealed.self_mask_shares), ("key", r.revealed.mask_key_shares)):
            for s in shares:
                owner = r if s.owner == r.id else r.delivered.get(s.owner)
                if owner is not None:
                    add(owner, kind, s.x, s.value)
    seeds, keys = {}, {}
    for inst in insts:
        if inst.secrets is not None:
            seeds[id(inst)], keys[id(inst)] = inst.secrets[:2]
    for (key, kind), points in pools.items():
        owner = owners[key]
        if len(points) < owner.config.threshold:
            continue
        try:
            secret = shamir.int_to_bytes(shamir.combine(points, owner.config.threshold), 32)
        except ValueError:
            continue
        sid = owner.config.session_id
        if kind == "seed" and P.seed_commitment(secret, sid, owner.id) == owner.advert.seed_commitment:
            seeds[key] = secret
        elif kind == "key" and P.public_bytes(P.private_key_from_bytes(secret)) == owner.advert.mask_key:
            keys[key] = secret
    return seeds, keys


def knowledge(insts: list[Instance]) -> list[Learnable]:
    """The smallest sums of inputs the server can compute from everything it holds (all sessions together).

    A linear combination sum_i c_i y_i of masked inputs is free of masks iff c_i = 0 wherever the self-mask seed is
    unknown, every unknown pairwise mask cancels (it must sit on an edge both ends masked with, with c equal at both
    ends), and no unknown mask is left on an edge only one end masked with. So the learnable sums are the classes of
    instances joined by two-sided unknown masks that contain no instance forced to zero. Each is recomputed from the
    bytes and compared with the true sum; those holding an honest input are returned.
    """
    seeds, keys = _reconstruct(insts)
    nodes = [i for i in insts if i.masked is not None]
    index = {id(i): i for i in nodes}
    parent = {id(i): id(i) for i in nodes}

    def find(k):
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    def known(a: Instance, b: Instance) -> bool:
        return id(a) in keys or id(b) in keys

    def two_sided(a: Instance, b: Instance) -> bool:
        return id(b) in index and a.id in b.delivered and b.peers.get(a.id) is a

    zero = set()
    for i in nodes:
        if id(i) not in seeds:
            zero.add(id(i))
        for v in i.delivered:
            j = i.peers[v]
            if known(i, j):
                continue
            if two_sided(i, j):
                parent[find(id(i))] = find(id(j))
            else:
                zero.add(id(i))
    classes: dict[int, set[int]] = {}
    for i in nodes:
        classes.setdefault(find(id(i)), set()).add(id(i))
    out = []
    for members in classes.values():
        if members & zero:
            continue
        group = [index[k] for k in members]
        _check_against_the_bytes(group, seeds, keys)
        honest = frozenset(i.id for i in group if not i.corrupt)
        if honest:  # a sum of colluding clients' inputs only tells the server what it knew
            out.append(Learnable(frozenset(group), honest))
    return out


def _check_against_the_bytes(group: list[Instance], seeds: dict, keys: dict) -> None:
    """Unmask the class's sum from the masked inputs with the reconstructed secrets: it must be the true sum."""
    members = {id(i) for i in group}
    cfg = group[0].config
    total = np.zeros(DIM, dtype=P.word_dtype(BITS))
    expander = P.MaskExpander(DIM, BITS)
    for i in group:
        total += np.frombuffer(i.masked.masked, dtype=total.dtype)
        expander.add(total, P.self_mask_key(seeds[id(i)], i.config.session_id, i.id), -1)
        for v in i.delivered:
            j = i.peers[v]
            if id(j) in members and i.id in j.delivered and j.peers.get(i.id) is i:
                continue  # cancels inside the class
            if id(i) in keys:
                shared = P.key_agreement(P.private_key_from_bytes(keys[id(i)]), j.advert.mask_key)
            else:
                shared = P.key_agreement(P.private_key_from_bytes(keys[id(j)]), i.advert.mask_key)
            expander.add(total, P.pairwise_mask_key(shared, i.config.session_id, i.id, v), -1 if i.id < v else +1)
    got = P.reduce_mod(total, cfg.bits).astype(np.uint64)
    expected = sum(i.value for i in group) % (1 << BITS)
    assert np.array_equal(got, expected), "the model of what is learnable disagrees with the bytes"


def smallest(learned: list[Learnable]) -> int | None:
    return min((len(g.honest) for g in learned), default=None)


def floor_of(config: SessionConfig, corrupt) -> int:
    """The fewest honest inputs any sum may hold: the session's required inputs less the colluding clients."""
    return config.required_inputs - len(set(corrupt))


def assert_nothing_below_the_floor(adv: ActiveServer, config: SessionConfig | None = None):
    config = config or adv.config
    learned = knowledge(adv.instances)
    floor = floor_of(config, adv.corrupt)
    assert all(len(g.honest) >= floor for g in learned), (floor, learned)
    return learned


# --------------------------------------------------------------------------------------------- the defence switched off
def issue14_check(self, proof):
    """The check clients made before issue 26: ``threshold`` holders of each peer we reveal for signed the set we
    signed. Nothing about who masked with whom, nor about survivors two hops away."""
    alive, dropped = self._survivors
    if tuple(sorted(proof.alive)) != alive or tuple(sorted(proof.dropped)) != dropped:
        self._abort("the survivor set in the consistency proof differs from the one we signed")
    parts = (self._transcript, I.encode_ids(alive), I.encode_ids(dropped))
    ok = {e.client_id for e in proof.tags
          if self._tagged(e.client_id, I.content_digest(I.SURVIVORS_PURPOSE, self.config.session_id, e.client_id,
                                                        *parts), e.tag)}
    for peer in set(self._received) | {self.client_id}:
        if len(self.config.holders(peer) & (ok | {self.client_id})) < self.config.threshold:
            self._abort("too few of a peer's holders signed this survivor set")


def undefended(monkeypatch, *, checks: bool = True, transcript: bool = False):
    """Switch parts of the defence off: ``checks`` restores issue 14's proof check; ``transcript`` makes the transcript
    hash a constant, so signatures no longer bind the session's fresh keys (what the old signatures covered)."""
    if checks:
        monkeypatch.setattr(ClientSession, "_check_proof", issue14_check)
    if transcript:
        monkeypatch.setattr(I, "transcript_hash", lambda session_id, entries, config_digest: bytes(32))


# ============================================================================================== attack 1: trimmed arc
def arc_attack(adv: ActiveServer):
    """Issue 26, attack 1. An arc of 3h + 1 consecutive ring positions (h = degree / 2): the h clients at each end get
    share deliveries holding only their neighbours inside the arc (received + 1 >= threshold still holds), are never
    asked to sign, and their input attestations are forwarded; everyone else is shown the full survivor set and signs
    it. Inside the arc every pairwise mask is two-sided, so without the defence the server unmasks the arc's sum."""
    cfg = adv.config
    ring = ring_order(cfg)
    h = cfg.degree // 2
    arc = ring[:3 * h + 1]
    ends = set(arc[:h]) | set(arc[2 * h + 1:])
    insts = adv.open()
    trim = {c: cfg.neighbours(c) & set(arc) for c in ends}
    adv.honest_until_masked(insts, trim)
    assert all(i.abort is None for i in insts.values())
    alive = set(cfg.client_ids)
    signatures = [(c, adv.sign(insts[c], alive, ())) for c in sorted(alive - ends)]
    signatures = [(c, s) for c, s in signatures if s is not None]
    for c, _ in signatures:
        adv.unmask(insts[c], alive, (), signatures, attested=[insts[e] for e in ends])
    return set(arc), insts


ARC_CASES = [  # (n, dropout, min_inputs): degree and threshold derived from the declared dropout
    pytest.param(100, 0.2, 80, id="n100-dropout0.2"),  # degree 40, threshold 21: the arc holds 61 clients
    pytest.param(40, 0.2, 30, id="n40-dropout0.2"),    # degree 18, threshold 10: 28 clients
    pytest.param(20, 0.1, 12, id="n20-dropout0.1"),    # degree 6, threshold 4: 10 clients
]


def _arc_server(n, dropout, min_inputs, seed=0):
    config = SessionConfig.create(range(1, n + 1), bits=BITS, dimension=DIM, malicious=True, dropout=dropout,
                                  min_inputs=min_inputs)
    model = ThreatModel(dropout=dropout, min_inputs=min_inputs, n_clients=n)
    return ActiveServer(config, threat_model=model, seed=seed)


@pytest.mark.parametrize("n, dropout, min_inputs", ARC_CASES)
def test_trimmed_deliveries_cut_out_an_arc_without_the_defence(monkeypatch, n, dropout, min_inputs):
    undefended(monkeypatch)
    adv = _arc_server(n, dropout, min_inputs)
    arc, insts = arc_attack(adv)
    learned = knowledge(adv.instances)
    assert any(g.honest == arc for g in learned)  # the exact sum of the arc (checked against the bytes)
    assert len(arc) < adv.config.required_inputs
    assert all(i.abort is None for i in insts.values())  # and nobody noticed


@pytest.mark.parametrize("n, dropout, min_inputs", ARC_CASES)
def test_trimmed_deliveries_are_refused(n, dropout, min_inputs):
    adv = _arc_server(n, dropout, min_inputs)
    arc, insts = arc_attack(adv)
    learned = assert_nothing_below_the_floor(adv)
    assert not learned  # every revealer aborted before revealing: no seed of the arc was rebuilt
    revealers = [i for i in insts.values() if i.survivor_signature is not None]
    assert revealers and all(i.abort is not None and i.revealed is None for i in revealers)
    assert any("masked, in this session, with exactly" in str(i.abort) for i in revealers)


def test_a_server_that_hides_the_arcs_outer_neighbours_is_refused_by_the_part_check():
    """The server's other move: list the arc ends' outer neighbours nowhere, so the ends' attestations match. Then
    the arc is a part of its own in the survivor graph, and its members refuse to sign."""
    adv = _arc_server(20, 0.1, 12)
    cfg = adv.config
    ring = ring_order(cfg)
    h = cfg.degree // 2
    arc = set(ring[:3 * h + 1])
    outer = set().union(*(cfg.neighbours(c) for c in arc)) - arc
    insts = adv.open()
    trim = {c: cfg.neighbours(c) - outer for c in cfg.client_ids}
    adv.honest_until_masked(insts, trim)
    alive = set(cfg.client_ids) - outer
    for c in sorted(arc):
        assert adv.sign(insts[c], alive, ()) is None
        assert "cuts the neighbour graph" in str(insts[c].abort)
    assert_nothing_below_the_floor(adv)


# ---------------------------------------------------------------------------------------------- a weak configuration
WEAK = dict(degree=2, threshold=2, min_inputs=8)


def test_clients_refuse_a_configuration_other_than_the_one_they_derive():
    ids = range(1, 13)
    weak = SessionConfig.create(ids, bits=BITS, dimension=DIM, malicious=True, check=False, **WEAK)
    model = ThreatModel(dropout=0.1, min_inputs=8)
    key = generate_identity()
    registry = IdentityRegistry({c: identity_public_bytes(key if c == 1 else generate_identity()) for c in ids})
    value = np.zeros(DIM, dtype=np.uint64)
    with pytest.raises(ProtocolAbort, match="differ from the degree .* derived from our declared threat model"):
        ClientSession(weak, 1, value, identity_key=key, registry=registry, threat_model=model)
    derived = SessionConfig.create(ids, bits=BITS, dimension=DIM, malicious=True, dropout=0.1, min_inputs=8)
    ClientSession(derived, 1, value, identity_key=key, registry=registry, threat_model=model)  # accepted
    for change, needle in ((dict(min_inputs=5), "requires only"), (dict(malicious=False), "semi-honest variant")):
        bad = derived.replace(**change)
        with pytest.raises(ProtocolAbort, match=needle):
            ClientSession(bad, 1, value, identity_key=key if bad.malicious else None,
                          registry=registry if bad.malicious else None, threat_model=model)
    with pytest.raises(ProtocolAbort, match="roster has 12 clients, the deployment declared 20"):
        ClientSession(derived, 1, value, identity_key=key, registry=registry,
                      threat_model=dataclasses.replace(model, n_clients=20))
    with pytest.raises(ProtocolAbort, match="refusing the downgrade"):  # semi-honest to a client with a key
        ClientSession(derived.replace(malicious=False), 1, value, identity_key=key, registry=registry)


def _weak_server(seed=0):
    config = SessionConfig.create(range(1, 13), bits=BITS, dimension=DIM, malicious=True, check=False, **WEAK)
    return ActiveServer(config, seed=seed)  # clients that declared no threat model: the weak config is accepted


def test_a_weak_configuration_gives_the_sum_of_four_without_the_defence(monkeypatch):
    undefended(monkeypatch)
    adv = _weak_server()
    arc, insts = arc_attack(adv)
    assert len(arc) == 4 and any(g.honest == arc for g in knowledge(adv.instances))


def test_a_weak_configuration_still_reveals_nothing_below_the_floor():
    """Even a client that declared no threat model, and so accepts degree 2 and threshold 2, does not reveal a sub-sum:
    with no colluding client the argument rests on the last stage's checks alone."""
    adv = _weak_server()
    arc_attack(adv)
    assert not assert_nothing_below_the_floor(adv)


# ==================================================================================== attack 2: replayed signatures
def divergent_views(cfg, victim_position: int = 0) -> tuple[int, dict[int, tuple[set, set]]]:
    """Per-client survivor sets (Harary ring, k = 4, t = 3) that make the clients reveal the victim's self-mask seed
    and the mask keys of all its four neighbours, each view passing its client's own checks (issue 14's attack)."""
    ring = ring_order(cfg)
    n = len(ring)
    at = lambda offset: ring[(victim_position + offset) % n]  # noqa: E731
    dropped = {at(0): {at(-1), at(1)}, at(-1): {at(-2), at(1)}, at(1): {at(2), at(-1)}, at(-3): {at(-2), at(-1)},
               at(3): {at(2), at(1)}, at(-4): {at(-2)}, at(4): {at(2)}}
    everyone = set(cfg.client_ids)
    return at(0), {c: (everyone - d, d) for c, d in dropped.items()}


def complete_views(cfg) -> tuple[int, dict[int, tuple[set, set]], dict[int, set]]:
    """The same on the complete graph (n = 7, t = 4): the victim's delivery is trimmed to t - 1 peers R; the other
    clients see views in which every member of R is dropped t times over, the victim a view of itself and R."""
    ids = sorted(cfg.client_ids)
    victim, real, others = ids[0], ids[1:4], ids[4:]
    views = {victim: ({victim, *real}, set())}
    for g in others:
        views[g] = ({victim, *others}, set(real))
    for r in real:
        views[r] = ({victim, r, *others}, set(real) - {r})
    return victim, views, {victim: set(real)}


def replay_attack(adv: ActiveServer, victim: int, views: dict, trim: dict | None = None, replay: bool = True):
    """Issue 26, attack 2. Per-client survivor sets as in ``views``; for each distinct set, a preparation session under
    the same session id in which every client alive in it signs it; those signatures are replayed into the real
    session's consistency proofs (with the colluding clients' forged ones and every input attestation)."""
    cfg = adv.config
    harvest: dict[tuple, list[tuple[int, bytes]]] = {}
    if replay:
        for alive, dropped in {(frozenset(a), frozenset(d)) for a, d in views.values()}:
            prep = adv.open()
            adv.honest_until_masked(prep)
            harvest[(alive, dropped)] = [(c, s) for c in sorted(alive)
                                         if (s := adv.sign(prep[c], alive, dropped)) is not None]
    insts = adv.open()
    adv.honest_until_masked(insts, trim)
    own = {c: adv.sign(insts[c], *views[c]) for c in views if c not in adv.corrupt}
    for c, (alive, dropped) in views.items():
        if c in adv.corrupt or own[c] is None:
            continue
        same = [(o, own[o]) for o in own if own[o] is not None and views[o] == views[c]]
        forged = [(k, adv.forge(insts[k], alive, dropped)) for k in sorted(adv.corrupt)]
        replayed = harvest.get((frozenset(alive), frozenset(dropped)), [])
        adv.unmask(insts[c], alive, dropped, same + forged + replayed, attested=insts.values())
    return insts


def _sparse_server(seed=0):
    config = SessionConfig.create(range(1, 21), bits=BITS, dimension=DIM, degree=4, threshold=3, malicious=True)
    return ActiveServer(config, seed=seed)


def _complete_server(corrupt=(), seed=0):
    config = SessionConfig.create(range(1, 8), bits=BITS, dimension=DIM, degree=6, threshold=4, malicious=True)
    return ActiveServer(config, corrupt=corrupt, seed=seed)


@pytest.mark.parametrize("graph", ["sparse", "complete"])
def test_without_replay_divergent_views_abort(graph):
    adv = _sparse_server() if graph == "sparse" else _complete_server()
    if graph == "sparse":
        victim, views = divergent_views(adv.config)
        replay_attack(adv, victim, views, replay=False)
    else:
        victim, views, trim = complete_views(adv.config)
        replay_attack(adv, victim, views, trim, replay=False)
    assert victim not in {c for g in knowledge(adv.instances) for c in g.honest if len(g.honest) == 1}
    assert_nothing_below_the_floor(adv)


def _replayed(graph: str):
    """The replay attack on a sparse or a complete graph: (server, victim, the views it shows, the instances)."""
    adv = _sparse_server() if graph == "sparse" else _complete_server()
    trim = None
    if graph == "sparse":
        victim, views = divergent_views(adv.config)
    else:
        victim, views, trim = complete_views(adv.config)
    return adv, victim, views, replay_attack(adv, victim, views, trim)


@pytest.mark.parametrize("graph", ["sparse", "complete"])
def test_replayed_signatures_recover_an_input_when_signatures_do_not_bind_the_fresh_keys(monkeypatch, graph):
    """The old signatures covered (purpose, session id, signer, set): a session id reused for preparation sessions
    lets the server collect honest signatures on the sets it needs. Our proof check stays on: only the transcript
    hash is made constant, so this test shows that binding the fresh keys is what stops the replay."""
    undefended(monkeypatch, checks=False, transcript=True)
    adv, victim, views, insts = _replayed(graph)
    learned = knowledge(adv.instances)
    assert any(g.honest == {victim} and g.members == {insts[victim]} for g in learned)  # the victim's own input


@pytest.mark.parametrize("graph", ["sparse", "complete"])
def test_replayed_signatures_do_not_verify_in_another_session(graph):
    adv, victim, views, insts = _replayed(graph)
    askers = [insts[c] for c in views if insts[c].survivor_signature is not None]
    assert askers and all(i.abort is not None and i.revealed is None for i in askers)
    assert not assert_nothing_below_the_floor(adv)


def test_a_colluding_client_does_not_make_the_replay_work():
    """The complete graph with one client colluding with the server (it signs every set, hands over every share)."""
    adv = _complete_server(corrupt={7})
    victim, views, trim = complete_views(adv.config)
    replay_attack(adv, victim, views, trim)
    assert_nothing_below_the_floor(adv)


def test_concurrent_sessions_under_one_id_with_cross_wired_bundles_reveal_nothing_small():
    """Two sessions under one session id at once. In the preparation session the ghosts' instances are given the
    victim's real-session bundle, so the ciphertexts they make there open in the real session, and the preparation
    session declares the ghosts dropped, so their mask keys are revealed there. In the real session the victim is
    given the ghosts' preparation bundles (validly signed: a bundle signature covers the session id only) and their
    ciphertexts, and masks with keys the server knows. But the ghosts cannot take part in the victim's transcript (it
    lists bundles their running sessions do not hold), so nobody else's signature counts in it and the victim
    refuses to reveal: its input stays hidden."""
    adv = _complete_server()
    cfg = adv.config
    ids = sorted(cfg.client_ids)
    victim, ghosts, real = ids[0], ids[1:3], ids[3:]
    prep, insts = adv.open(), adv.open()
    wiring = {v: (insts[victim] if v == victim else prep[v]) for v in ids}
    for c in ids[1:]:  # the preparation session, with the victim's real bundle in it
        adv.share(prep[c], [wiring[v] for v in ids if v != c], transcript=wiring.values())
    for c in ids[1:]:
        adv.deliver(prep[c], [prep[v] for v in ids[1:] if v != c])
    alive, dropped = set(real), set(ghosts)
    signatures = [(c, sig) for c in real if (sig := adv.sign(prep[c], alive, dropped)) is not None]
    for c in real:
        adv.unmask(prep[c], alive, dropped, signatures, attested=prep.values())
    assert all(id(prep[g]) in _reconstruct(adv.instances)[1] for g in ghosts)  # the ghosts' keys are known
    mixed = {v: (prep[v] if v in ghosts else insts[v]) for v in ids}
    adv.share(insts[victim], [mixed[v] for v in ids if v != victim], transcript=mixed.values())
    for c in ids[1:]:
        adv.share(insts[c], [insts[v] for v in ids if v != c], transcript=insts.values())
    adv.deliver(insts[victim], [mixed[v] for v in ids if v != victim])
    for c in ids[1:]:
        adv.deliver(insts[c], [insts[v] for v in ids if v != c])
    assert insts[victim].masked is not None and all(insts[victim].peers[g] is prep[g] for g in ghosts)
    everyone = set(ids)
    offered = [(c, sig) for c in ids if (sig := adv.sign(insts[c], everyone, ())) is not None]
    for c in ids:
        if insts[c].survivor_signature is not None:
            adv.unmask(insts[c], everyone, (), offered, attested=[*insts.values(), *prep.values()])
    assert insts[victim].abort is not None and insts[victim].revealed is None
    learned = assert_nothing_below_the_floor(adv)
    assert all(victim not in g.honest for g in learned)


# ============================================================================================== any strategy, small n
def _target(cfg, rng: random.Random) -> set[int]:
    """A small set the server would like the sum of: an arc of the ring (sparse graph) or any set (complete graph)."""
    ids = list(cfg.client_ids)
    if cfg.degree >= cfg.n_clients - 1:
        return set(rng.sample(ids, rng.randint(cfg.threshold - 1, cfg.n_clients - 2)))
    ring = ring_order(cfg)
    start, size = rng.randrange(len(ring)), rng.randint(cfg.degree // 2 * 3 + 1, len(ring) - cfg.degree // 2)
    return {ring[(start + i) % len(ring)] for i in range(size)}


def _random_strategy(adv: ActiveServer, rng: random.Random, contexts=None):
    """One random active server. It opens one to three sessions under the same session id at once and, in each,
    swaps key bundles for those of the client's other sessions, hides neighbours, lists what it likes in the
    transcripts, delivers ciphertexts from any session (or trims deliveries around a target set it wants the sum of:
    its members with enough neighbours inside get only those, and are not asked to sign), hands out one to four
    survivor sets to different clients (some fitted to what each masked with), and sends proofs built from any
    signatures and attestations it ever saw, forged ones of colluding clients included."""
    cfg = adv.config
    ids = list(cfg.client_ids)
    p = rng.choice((0.0, 0.0, 0.05, 0.15, 0.3))  # how far it strays from the honest moves at random
    count = rng.choice((1, 1, 2, 3)) if contexts is None else rng.choice((2, 3))
    sessions = [adv.open() if contexts is None else contexts(adv, rng) for _ in range(count)]
    everyone = [i for insts in sessions for i in insts.values()]
    plans = []
    for insts in sessions:
        target = _target(cfg, rng) if rng.random() < 0.5 else set()
        trimmed = {c for c in target if len(cfg.neighbours(c) & target) + 1 >= cfg.threshold
                   and cfg.neighbours(c) - target}
        plans.append((insts, target, trimmed))
        for c in ids:
            peers = []
            for v in sorted(cfg.neighbours(c)):
                if rng.random() < p:
                    continue  # hidden
                peers.append(rng.choice(sessions)[v] if rng.random() < p else insts[v])
            listed = {q.id: q for q in peers} | {c: insts[c]}
            for v in ids:
                if v not in listed and rng.random() > p:
                    listed[v] = insts[v]
            adv.share(insts[c], peers, transcript=listed.values())
    for insts, target, trimmed in plans:
        for c in ids:
            inst = insts[c]
            if inst.abort is not None:
                continue
            senders = {}
            for q in everyone:  # ciphertexts made for this very instance, from any session
                if q.id in inst.peers and q.peers.get(c) is inst and c in q.shares_out and rng.random() > p:
                    senders.setdefault(q.id, q)
            for v, q in inst.peers.items():  # or, now and then, one made for another instance of this client
                if v not in senders and c in q.shares_out and rng.random() < p:
                    senders[v] = q
            if c in trimmed:
                senders = {v: q for v, q in senders.items() if v in target}
            adv.deliver(inst, senders.values())
    seen: list[tuple[int, bytes]] = []
    shown = []
    for insts, target, trimmed in plans:
        sent = {c for c in ids if insts[c].masked is not None}
        sets = []
        for _ in range(rng.choice((1, 1, 2, 4))):
            alive = {c for c in sent if rng.random() > p}
            dropped = {c for c in ids if c not in alive and insts[c].shares_out and rng.random() > p}
            sets.append((alive, dropped))
        for c in sorted(sent - trimmed):
            alive, dropped = rng.choice(sets)
            if rng.random() < 0.5 + p:  # fit the set to what this client masked with, as a careful server would
                alive = alive | {c}
                dropped = (dropped - alive) | (set(insts[c].delivered) - alive)
            shown.append((insts[c], alive, dropped))
            sig = adv.sign(insts[c], alive, dropped)
            if sig is not None:
                seen.append((c, sig))
    attestable = [i for i in everyone if i.masked is not None]
    for inst, alive, dropped in shown:
        if inst.survivor_signature is None or inst.corrupt:
            continue
        offered = [x for x in seen if rng.random() > p]
        offered += [(k, adv.forge(i, alive, dropped)) for i in everyone if i.corrupt and i.masked is not None
                    for k in (i.id,)]
        adv.unmask(inst, alive, dropped, offered, attested=[a for a in attestable if rng.random() > p])


FUZZ = [  # (n, degree, threshold, min_inputs, corrupt)
    pytest.param(12, 4, 3, 9, (), id="sparse-n12-k4"),
    pytest.param(10, 2, 2, 7, (), id="sparse-n10-k2"),
    pytest.param(7, 6, 5, 6, (7,), id="complete-n7-one-colluding"),
    pytest.param(10, 9, 7, 8, (9, 10), id="derived-n10-dropout0.1-corruption0.2"),  # derive_parameters' choice
]


@pytest.mark.parametrize("n, degree, threshold, min_inputs, corrupt", FUZZ)
def test_random_active_servers_learn_nothing_below_the_floor(n, degree, threshold, min_inputs, corrupt):
    rng = random.Random(1)
    revealed = learned_any = 0
    for trial in range(60):
        config = SessionConfig.create(range(1, n + 1), bits=BITS, dimension=DIM, degree=degree,
                                      threshold=threshold, min_inputs=min_inputs, malicious=True,
                                      corruption=len(corrupt) / n, check=False).replace(graph_seed=rng.randbytes(32))
        adv = ActiveServer(config, corrupt=corrupt, seed=trial)
        _random_strategy(adv, rng)
        revealed += any(i.revealed is not None for i in adv.instances)
        learned = knowledge(adv.instances)
        learned_any += bool(learned)
        floor = floor_of(config, corrupt)
        assert all(len(g.honest) >= floor for g in learned), (trial, floor, learned)
    assert revealed >= 5 and learned_any >= 5  # the strategies did get clients to reveal, and sums out


def _context_sessions(bind: bool):
    """Sessions whose clients bind contexts of two runs (a deployment binds run, phase, round and noise plan): one
    session all of run A, or all of run B, or each client either (a server relaying two admitted runs' clients
    through one session, the session-25 attack)."""
    def open_session(adv: ActiveServer, rng: random.Random):
        mode = rng.choice(("A", "B", "mixed", "mixed"))
        ids = adv.config.client_ids
        contexts = {c: (rng.choice((b"run A", b"run B")) if mode == "mixed" else f"run {mode}".encode()) for c in ids}
        return adv.open(contexts=contexts, bind=bind)
    return open_session


@pytest.mark.parametrize("n, degree, threshold, min_inputs, corrupt", FUZZ[:3])
def test_random_active_servers_mixing_contexts_learn_no_sum_across_them(n, degree, threshold, min_inputs, corrupt):
    """The same random servers (reorder, drop, trim, replay within and across sessions under one id), now relaying
    clients bound to two runs' contexts through their sessions: every sum the server can compute holds the inputs
    of one context only, over at least the floor of honest inputs. Control: the same strategies with the contexts
    not bound do produce sums mixing the two runs."""
    rng = random.Random(2)
    learned_any = 0
    for trial in range(40):
        config = SessionConfig.create(range(1, n + 1), bits=BITS, dimension=DIM, degree=degree,
                                      threshold=threshold, min_inputs=min_inputs, malicious=True,
                                      corruption=len(corrupt) / n, check=False).replace(graph_seed=rng.randbytes(32))
        adv = ActiveServer(config, corrupt=corrupt, seed=trial)
        _random_strategy(adv, rng, contexts=_context_sessions(bind=True))
        floor = floor_of(config, corrupt)
        learned = knowledge(adv.instances)
        learned_any += bool(learned)
        for g in learned:
            honest = [i for i in g.members if not i.corrupt]
            assert len({i.context for i in honest}) == 1, (trial, g)
            assert len(g.honest) >= floor, (trial, floor, g)
    assert learned_any >= 5  # single-context sessions did reveal their sums


def test_random_active_servers_mix_contexts_when_the_contexts_are_not_bound():
    rng = random.Random(2)
    mixed = 0
    for trial in range(40):
        config = SessionConfig.create(range(1, 8), bits=BITS, dimension=DIM, degree=6, threshold=5, min_inputs=6,
                                      malicious=True, check=False).replace(graph_seed=rng.randbytes(32))
        adv = ActiveServer(config, seed=trial)
        _random_strategy(adv, rng, contexts=_context_sessions(bind=False))
        mixed += any(len({i.context for i in g.members if not i.corrupt}) > 1 for g in knowledge(adv.instances))
    assert mixed >= 3


def test_random_active_servers_do_find_small_sums_without_the_defence(monkeypatch):
    """Control for the test above: the same random servers, against issue 14's checks with unbound signatures."""
    undefended(monkeypatch, transcript=True)
    rng = random.Random(1)
    below = 0
    for trial in range(60):
        config = SessionConfig.create(range(1, 13), bits=BITS, dimension=DIM, degree=4, threshold=3, min_inputs=9,
                                      malicious=True, check=False).replace(graph_seed=rng.randbytes(32))
        adv = ActiveServer(config, seed=trial)
        _random_strategy(adv, rng)
        size = smallest(knowledge(adv.instances))
        below += size is not None and size < 9
    assert below >= 2


# ============================================================================================== after an abort
def test_an_aborted_round_reveals_at_most_the_survivor_sum():
    """An honest server whose round aborts after some survivors revealed (here: too few holders of a dropped
    client's key answer, so its masks cannot be removed). The transcript gives the server no smaller sum."""
    config = SessionConfig.create(range(1, 21), bits=BITS, dimension=DIM, malicious=True, dropout=0.1,
                                  min_inputs=12)
    adv = ActiveServer(config)
    insts = adv.open()
    adv.honest_until_masked(insts)
    ring = ring_order(config)
    dropped = {ring[0]}  # pretends it never sent its masked input
    alive = set(config.client_ids) - dropped
    for c in alive:
        insts[c].survivor_signature = adv.sign(insts[c], alive, dropped)
    signatures = [(c, insts[c].survivor_signature) for c in sorted(alive)]
    answering = sorted(alive - config.neighbours(ring[0]))  # none of the dropped client's holders answers
    for c in answering:
        adv.unmask(insts[c], alive, dropped, signatures, attested=insts.values())
    assert all(insts[c].revealed is not None for c in answering)
    learned = assert_nothing_below_the_floor(adv)
    assert all(g.honest == alive for g in learned)  # at most the survivors' total: here nothing at all
    assert not learned


def _seeded_config(base: SessionConfig, pred, start: int) -> SessionConfig:
    """The first of base's variants with graph seeds sha256(start), sha256(start + 1), ... that ``pred`` accepts."""
    for k in range(start, start + 100_000):
        cfg = base.replace(graph_seed=hashlib.sha256(k.to_bytes(8, "big")).digest())
        if pred(cfg):
            return cfg
    raise AssertionError("no graph seed found")


def test_a_server_that_gives_clients_different_graphs_under_one_session_is_refused():
    """A review's attack: the graph seed is the server's, and it was bound into nothing a client signs or tags, so a
    server could hand each client a differently seeded graph under one session id; each client then counted share
    holders in a graph of its own, and the server unmasked a sum of 2 inputs where every client required 8 (n = 10,
    degree 2, threshold 2). The session's public parameters (SessionConfig.digest) are now in every signed and
    tagged key bundle and in the transcript hash: a peer whose graph differs fails our tag check before we send it
    anything, and the session aborts."""
    n, a, b, z = 10, 1, 2, 5
    ids = list(range(1, n + 1))
    model = ThreatModel(dropout=0.0, corruption=0.0, min_inputs=8, malicious=True, n_clients=n)
    base = SessionConfig.create(ids, bits=16, dimension=4, malicious=True, dropout=0.0, min_inputs=8)
    cfg = {a: _seeded_config(base, lambda c: c.neighbours(a) == {b, z}, 0),
           b: _seeded_config(base, lambda c: c.neighbours(b) == {a, z}, 10_000)}
    assert cfg[a].graph_seed != cfg[b].graph_seed and cfg[a].digest != cfg[b].digest
    keys = {c: generate_identity() for c in ids}
    registry = IdentityRegistry({c: identity_public_bytes(k) for c, k in keys.items()})
    rng = np.random.default_rng(1)
    sessions = {c: ClientSession(cfg[c], c, rng.integers(0, 2 ** 16, 4, dtype=np.uint64), identity_key=keys[c],
                                 registry=registry, min_inputs=8, threat_model=model) for c in (a, b)}
    sid = base.session_id
    adv = {c: s.advertise_keys() for c, s in sessions.items()}
    transcript = tuple(M.BundleDigest(c, I.bundle_digest(sid, c, adv[c].encryption_key, adv[c].mask_key,
                                                         adv[c].seed_commitment)) for c in sorted(adv))
    for me, peer in ((a, b), (b, a)):
        e = adv[peer]
        tag = {t.client_id: t.tag for t in e.tags}[me]
        directory = M.KeyDirectory(sid, me, (M.PublicKeys(peer, e.encryption_key, e.mask_key, e.seed_commitment,
                                                          tag),), transcript)
        with pytest.raises(ProtocolAbort, match="session's parameters"):
            sessions[me].share_keys(directory)
