"""The client's side of the protocol as a state machine (Bonawitz et al. CCS 2017, Fig. 4, with the neighbour graph of
Bell et al. CCS 2020).

A ``ClientSession`` answers exactly one message per stage, in the order of ``STAGES``. Anything unexpected makes it
abort for good (``ProtocolAbort``), wiping its secrets, before it sends anything: a message for another session or
another client, an out-of-order stage, a peer listed twice, an unknown or non-neighbour id, duplicate public keys,
fewer than ``threshold`` live share holders, a peer listed both alive and dropped, itself listed as dropped, or a share
ciphertext that fails authentication. It reveals, per peer, the self-seed share (peer alive) or the mask-key share
(peer dropped), never both, and never for a survivor set smaller than the session's ``min_inputs`` or one that cuts
the neighbour graph into a part smaller than that (``protocol.survivor_set_problem``).

Malicious-server variant (``config.malicious``; needs the client's long-term Ed25519 ``identity_key``, or the
``identity.ClientIdentity`` that wraps it and caches its pairwise keys, and the deployment's ``IdentityRegistry``,
and, to check the server's configuration, the client's declared ``params.ThreatModel``). What a client tells the
server it signs (the server checks); what it tells one peer it tags under the key the two share (``identity.tag``:
only that peer can check it, and neither the server nor any third client can make it). The client

1. refuses a configuration other than the one it derives from its threat model (degree, threshold, survivor floor,
   variant; ``protocol.threat_model_problem``), and a semi-honest one whenever it holds an identity key (no downgrade);
2. signs its fresh key bundle and tags it for each neighbour, and aborts on a peer bundle whose tag does not verify
   (key substitution); both cover the session's parameters and the client's own ``context``
   (``protocol.session_binding``), so a peer given another graph, or bound to another context (a deployment's run,
   phase, round and noise plan), fails this first check, before any share leaves;
3. checks the session's transcript (the digest of every advertised bundle) holds its own bundle and its neighbours',
   and hashes it: every later signature covers this transcript hash, so no signature verifies outside the one session
   in which it was made (a session id reused by the server does not help: the bundles are fresh);
4. signs its masked input with the transcript hash and the exact set R(u) of peers it masked with (its attestation);
5. in the consistency round checks the survivor set U and dropped set D (``_check_survivors``: R(u) = N(u) & (U | D),
   at least ``required_inputs`` survivors, its part of the graph restricted to U at least that large) and signs
   (transcript hash, U, D), tagging the same for every survivor within three hops (all who may count it in check 6);
6. before revealing anything (``_check_proof``), for every survivor b within two hops of it in the graph restricted to
   U (b in {a} | N(a) & U for a = itself or an alive peer whose self-seed share it reveals): b proves it took part in
   this very session with R(b) = N(b) & (U | D), by its tag of (transcript, U, D) or by its signed input attestation;
   and ``threshold`` of b's share holders tagged (transcript, U, D) for us. The same count is required for every
   dropped peer whose mask-key share it reveals. ("Signed" below: signed or tagged; a tag from an honest client to an
   honest one is as unforgeable as a signature, and a client tags one survivor set per session.)

Why this suffices (an active server colluding with at most C clients, C below ``2 threshold - degree - 1`` holders of
any client, which ``params.derive_parameters`` guarantees; C = 0 on a sparse graph): the server learns a linear
combination sum_u c_u x_u of honest inputs only if every unknown mask cancels. Let a be honest with c_a != 0. Then a's
self-seed was reconstructed, so an honest holder w revealed it after check 6 on some (E, U, D) with a proven under
transcript E; a made signatures under one transcript only, and every client id stands for one bundle in E, so all
signatures counted under E come from one running session per client, each signing one (U, D). For every survivor b
that w checked, ``threshold`` of b's holders signed (E, U, D); were b's mask key revealed, ``threshold`` holders would
have signed a set with b dropped, and two such groups share more than C holders, one of them honest and signing twice:
impossible. So for honest b in N(a) & U the pairwise mask of a and b is unknown, both masked with it (R(a), R(b) are
proven), and c_b = c_a: b is in the sum, and b's own revealers checked b's neighbours in turn. The sum therefore holds
the whole part of the graph restricted to U that contains a, which every honest revealer checked holds at least
``required_inputs`` clients (less the C corrupt ones; on the complete graph, all of U). The README's threat model
names the test of each step.
"""

from __future__ import annotations

import json

import numpy as np
from cryptography.hazmat.primitives import serialization

from . import identity as I
from . import primitives as P
from . import shamir
from .errors import ProtocolAbort
from .messages import (AdvertiseKeys, ConsistencyProof, ConsistencySignature, EncryptedShare, KeyDirectory,
                       MaskedInput, RevealedShare, ShareDelivery, ShareKeys, Tag, UnmaskRequest, UnmaskShares)
from .params import ThreatModel
from .protocol import (ADVERTISE_KEYS, CONSISTENCY, DONE, MASKED_INPUT, SHARE_KEYS, STAGES, UNMASK,
                                 SessionConfig, check_context, session_binding, survivor_set_problem,
                                 threat_model_problem)

__all__ = ["ClientSession", "check_input_vector"]

_SELF_SEED = "self_mask_seed"
_MASK_KEY = "mask_key"


def _raw_public(key) -> str:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def check_input_vector(value: np.ndarray, bits: int, dimension: int) -> np.ndarray:
    """A 1-D integer vector of length ``dimension`` with entries in [0, 2^bits), as mask words (a copy)."""
    x = np.asarray(value)
    if x.ndim != 1 or x.shape[0] != dimension:
        raise ValueError(f"input must be a 1-D vector of length {dimension}, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"input must be integers mod 2^{bits} (quantise first), got dtype {x.dtype}")
    if x.size and (int(x.min()) < 0 or int(x.max()) >= 1 << bits):
        raise ValueError(f"input entries must lie in [0, 2^{bits}); reduce mod 2^{bits} (Quantiser.encode does)")
    return x.astype(P.word_dtype(bits), copy=True)


def _share_plaintext(sender: int, recipient: int, key_share: int, seed_share: int) -> bytes:
    n = shamir.SHARE_BYTES
    return P.encode_id(sender) + P.encode_id(recipient) + key_share.to_bytes(n, "big") + seed_share.to_bytes(n, "big")


def _parse_share_plaintext(raw: bytes) -> tuple[int, int, int, int]:
    n = shamir.SHARE_BYTES
    if len(raw) != 16 + 2 * n:
        raise ValueError("malformed share plaintext")
    return (int.from_bytes(raw[:8], "big"), int.from_bytes(raw[8:16], "big"),
            int.from_bytes(raw[16:16 + n], "big"), int.from_bytes(raw[16 + n:], "big"))


class ClientSession:
    """One client in one round. Feed it the server's messages; it returns its own messages.

    ``value`` is the client's (already quantised, possibly noised) vector in Z_{2^bits}^dimension. In the malicious
    variant pass the client's ``identity_key`` (its ``identity.ClientIdentity``, kept for the deployment so that the
    pairwise keys are derived once, or the bare Ed25519 private key) and the deployment's ``registry``. ``min_inputs``:
    the survivor floor this client's (distributed) noise was charged for; a session configured below it is refused.
    ``threat_model``: the client's declared ``params.ThreatModel`` (dropout, corruption, min_inputs, variant); the
    configuration must then be exactly the one derived from it (``protocol.threat_model_problem``). Without it the
    client accepts any degree and threshold that form a strict majority: against an active server that is safe only
    if no client colludes with it (the privacy argument then rests on the checks of the last stage alone).
    ``context``: opaque bytes this client computes itself (never from a server message) and binds, in the malicious
    variant, with the session's parameters into its signed and tagged keys and the transcript hash
    (``protocol.session_binding``): a peer's keys count only if the peer bound the very same context, so clients
    whose contexts differ (another run, round or noise plan of the caller) abort at the first tag check.
    """

    def __init__(self, config: SessionConfig, client_id: int, value: np.ndarray, *, identity_key=None,
                 registry: I.IdentityRegistry | None = None, min_inputs: int | None = None,
                 threat_model: ThreatModel | None = None, context: bytes = b""):
        if not isinstance(config, SessionConfig):
            raise TypeError("config must be a SessionConfig")
        if client_id not in config.client_ids:
            raise ValueError(f"client {client_id!r} is not in the session's roster")
        if threat_model is not None and not isinstance(threat_model, ThreatModel):
            raise TypeError("threat_model must be a params.ThreatModel")
        context = check_context(context)
        if min_inputs is not None and config.required_inputs < min_inputs:
            # the configuration comes from the server: a client holds it to the floor its own noise was charged for
            raise ProtocolAbort(f"the session requires only {config.required_inputs} inputs, fewer than the "
                                f"{min_inputs} our noise share was charged for; refusing to take part",
                                party=client_id, stage=ADVERTISE_KEYS)
        if threat_model is not None:
            problem = threat_model_problem(config, threat_model)
            if problem is not None:
                raise ProtocolAbort(f"refusing the server's session configuration: {problem}", party=client_id,
                                    stage=ADVERTISE_KEYS)
        if not config.malicious and (identity_key is not None or registry is not None):
            raise ProtocolAbort("the server proposes the semi-honest variant (no signatures, no consistency round) "
                                "to a client that holds an identity key: refusing the downgrade", party=client_id,
                                stage=ADVERTISE_KEYS)
        if config.malicious:
            if not isinstance(registry, I.IdentityRegistry) or identity_key is None:
                raise ValueError("the malicious-server variant needs the client's identity_key and the deployment's "
                                 "IdentityRegistry (client id -> Ed25519 public key)")
            missing = sorted(set(config.client_ids) - registry.ids())
            if missing:
                raise ValueError(f"the identity registry has no key for client(s) {missing[:5]}; register every "
                                 f"client of the roster")
            if not isinstance(identity_key, I.ClientIdentity):
                identity_key = I.ClientIdentity(identity_key)
            if identity_key.public_bytes != registry.public_key(client_id).public_bytes_raw():
                raise ValueError(f"identity_key is not the key registered for client {client_id}")
        self._identity: I.ClientIdentity | None = identity_key
        self._registry = registry
        self._survivors: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (alive, dropped) we signed
        self._transcript = b""  # the session's transcript hash (malicious variant), fixed at share_keys
        self.config = config
        self.client_id = client_id
        #: the caller's context, bound with the configuration (``protocol.session_binding``; malicious variant)
        self.context = context
        self._bound = session_binding(config, context)
        self._value = check_input_vector(value, config.bits, config.dimension)
        self._next = 0  # index in STAGES of the next stage this client may enter
        self._aborted: ProtocolAbort | None = None
        self._neighbours = config.neighbours(client_id)
        self._enc_key = None
        self._mask_key = None
        self._self_seed: bytes | None = None
        self._peer_keys: dict[int, tuple] = {}  # peer -> parsed (encryption, mask) public keys
        self._own_shares: tuple[int, int] | None = None  # (mask-key share, self-seed share) held for ourselves
        self._received: dict[int, bytes] = {}  # sender -> ciphertext of its shares for us
        self._revealed: dict[int, str] = {}

    # ------------------------------------------------------------------ keeping a session between processes
    def to_state(self) -> bytes:
        """The session's whole state, secrets included, as bytes: for a transport whose client runs each stage in a
        fresh process (a Flower ClientApp). Keep it where only this client can read it (Flower's ``Context.state``
        stays on the SuperNode); never send it. An aborted session has no state to keep."""
        if self._aborted is not None:
            raise ProtocolAbort(f"client already aborted: {self._aborted.reason}", party=self.client_id)
        raw = (lambda b: None if b is None else b.hex())
        state = {
            "session_id": self.config.session_id.hex(), "client_id": self.client_id, "next": self._next,
            "context": self.context.hex(),
            "value": None if self._value is None else self._value.tobytes().hex(),
            "enc_key": None if self._enc_key is None else P.private_bytes(self._enc_key).hex(),
            "mask_key": None if self._mask_key is None else P.private_bytes(self._mask_key).hex(),
            "self_seed": raw(self._self_seed),
            "peer_keys": {str(c): [_raw_public(e), _raw_public(m)] for c, (e, m) in self._peer_keys.items()},
            "own_shares": None if self._own_shares is None else [str(v) for v in self._own_shares],
            "received": {str(c): ct.hex() for c, ct in self._received.items()},
            "revealed": {str(c): kind for c, kind in self._revealed.items()},
            "survivors": None if self._survivors is None else [list(self._survivors[0]), list(self._survivors[1])],
            "transcript": self._transcript.hex(),
            # the pairwise keys derived so far, so that a client restored for the next stage derives none again
            "pairwise": ({} if self._identity is None else
                         {str(c): [a.hex(), k.hex()] for c, (a, k) in
                          self._identity.known_pairwise(self.client_id).items()}),
        }
        return json.dumps(state, sort_keys=True).encode("ascii")

    @classmethod
    def from_state(cls, config: SessionConfig, state: bytes, *, identity_key=None,
                   registry: I.IdentityRegistry | None = None, min_inputs: int | None = None,
                   threat_model: ThreatModel | None = None, context: bytes | None = None) -> "ClientSession":
        """The session :meth:`to_state` saved, under the same public ``config`` (checked: the session id must
        match); the identity key, registry and threat model are given again (malicious variant). The context is
        the saved one; a ``context`` given must equal it."""
        try:
            d = json.loads(bytes(state).decode("ascii"))
            if bytes.fromhex(d["session_id"]) != config.session_id:
                raise ValueError("the saved session belongs to another session")
            saved_context = bytes.fromhex(d.get("context", ""))
            if context is not None and check_context(context) != saved_context:
                raise ValueError("the saved session was bound to another context")
            value = (np.zeros(config.dimension, dtype=P.word_dtype(config.bits)) if d["value"] is None else
                     np.frombuffer(bytes.fromhex(d["value"]), dtype=P.word_dtype(config.bits)))
            session = cls(config, int(d["client_id"]), value, identity_key=identity_key, registry=registry,
                          min_inputs=min_inputs, threat_model=threat_model, context=saved_context)
            if d["value"] is None:
                session._value = None
            session._next = int(d["next"])
            if not 0 <= session._next < len(STAGES):
                raise ValueError("saved stage out of range")
            session._enc_key = None if d["enc_key"] is None else P.private_key_from_bytes(bytes.fromhex(d["enc_key"]))
            session._mask_key = (None if d["mask_key"] is None
                                 else P.private_key_from_bytes(bytes.fromhex(d["mask_key"])))
            session._self_seed = None if d["self_seed"] is None else bytes.fromhex(d["self_seed"])
            session._peer_keys = {int(c): (P.load_public_key(bytes.fromhex(e)), P.load_public_key(bytes.fromhex(m)))
                                  for c, (e, m) in d["peer_keys"].items()}
            session._own_shares = None if d["own_shares"] is None else tuple(int(v) for v in d["own_shares"])
            session._received = {int(c): bytes.fromhex(ct) for c, ct in d["received"].items()}
            session._revealed = {int(c): str(kind) for c, kind in d["revealed"].items()}
            session._survivors = (None if d["survivors"] is None
                                  else (tuple(d["survivors"][0]), tuple(d["survivors"][1])))
            session._transcript = bytes.fromhex(d.get("transcript", ""))
            if session._identity is not None:
                session._identity.remember_pairwise(session.client_id, {
                    int(c): (bytes.fromhex(a), bytes.fromhex(k)) for c, (a, k) in d.get("pairwise", {}).items()})
        except (KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
            raise ProtocolAbort(f"the saved client session cannot be restored: {exc}") from None
        except RecursionError:
            raise ProtocolAbort("the saved client session cannot be restored: nested too deeply") from None
        return session

    # ------------------------------------------------------------------ state machine plumbing
    @property
    def stage(self) -> str:
        """The next stage this client will answer (``"done"`` after unmasking); ``"aborted"`` after an abort."""
        return "aborted" if self._aborted is not None else STAGES[self._next]

    @property
    def aborted(self) -> ProtocolAbort | None:
        return self._aborted

    def _abort(self, reason: str):
        stage = STAGES[self._next]
        self._aborted = ProtocolAbort(reason, party=self.client_id, stage=stage)
        self._enc_key = self._mask_key = self._self_seed = None
        self._own_shares = None
        self._received = {}
        raise self._aborted

    def _enter(self, stage: str) -> None:
        if self._aborted is not None:
            raise ProtocolAbort(f"client already aborted: {self._aborted.reason}", party=self.client_id, stage=stage)
        if STAGES[self._next] != stage:
            self._abort(f"out-of-order message: expected stage {STAGES[self._next]!r}, got {stage!r}")

    def _check_session(self, message) -> None:
        if message.session_id != self.config.session_id:
            self._abort("message belongs to another session")

    def _check_recipient(self, message) -> None:
        if message.recipient != self.client_id:
            self._abort(f"message addressed to client {message.recipient}, not to us")

    def handle(self, message):
        """Dispatch a server message to the stage that consumes it (for transports that deliver generic messages)."""
        if isinstance(message, KeyDirectory):
            return self.share_keys(message)
        if isinstance(message, ShareDelivery):
            return self.masked_input(message)
        if isinstance(message, UnmaskRequest):
            return self.consistency_check(message) if self.config.malicious else self.unmask(message)
        if isinstance(message, ConsistencyProof):
            return self.unmask(message)
        if self._aborted is not None:
            raise ProtocolAbort(f"client already aborted: {self._aborted.reason}", party=self.client_id)
        self._abort(f"unexpected message type {type(message).__name__}")

    # ------------------------------------------------------------------ stage 1
    def advertise_keys(self) -> AdvertiseKeys:
        self._enter(ADVERTISE_KEYS)
        self._enc_key = P.generate_private_key()
        self._mask_key = P.generate_private_key()
        self._self_seed = P.random_seed()
        self._next += 1
        sid, enc, mask = self.config.session_id, P.public_bytes(self._enc_key), P.public_bytes(self._mask_key)
        commitment = P.seed_commitment(self._self_seed, sid, self.client_id)
        signature, tags = b"", ()
        if self.config.malicious:
            # the session's parameters as this client runs them (SessionConfig.digest) and its own context
            bound = self._bound
            signature = I.sign(self._identity.signing_key, I.KEYS_PURPOSE, sid, self.client_id, enc, mask, commitment,
                               bound)
            tags = self._tags(sorted(self._neighbours),
                              I.content_digest(I.KEYS_PURPOSE, sid, self.client_id, enc, mask, commitment, bound))
        return AdvertiseKeys(session_id=sid, sender=self.client_id, encryption_key=enc, mask_key=mask,
                             seed_commitment=commitment, signature=signature, tags=tags)

    def _pairwise(self, peer: int) -> bytes | None:
        """The key we share with ``peer``'s registered identity (None if its key admits no agreement)."""
        try:
            return self._identity.pairwise_key(self.client_id, peer, self._registry)
        except ValueError:
            return None

    def _tags(self, recipients, content: bytes) -> tuple[Tag, ...]:
        out = []
        for peer in recipients:
            key = self._pairwise(peer)
            if key is not None:
                out.append(Tag(peer, I.tag(key, content, peer)))
        return tuple(out)

    def _tagged(self, sender: int, content: bytes, value: bytes) -> bool:
        """Whether ``value`` is ``sender``'s tag of ``content`` for us."""
        key = self._pairwise(sender)
        return key is not None and I.check_tag(key, content, self.client_id, value)

    # ------------------------------------------------------------------ stage 2
    def share_keys(self, directory: KeyDirectory) -> ShareKeys:
        self._enter(SHARE_KEYS)
        if not isinstance(directory, KeyDirectory):
            self._abort(f"expected a KeyDirectory, got {type(directory).__name__}")
        self._check_session(directory)
        self._check_recipient(directory)
        roster = set(self.config.client_ids)
        seen: set[int] = set()
        public_keys = {P.public_bytes(self._enc_key), P.public_bytes(self._mask_key)}
        for entry in directory.keys:
            c = entry.client_id
            if c in seen:
                self._abort(f"peer {c} listed twice in the key directory")
            seen.add(c)
            if c not in roster:
                self._abort(f"unknown client id {c} in the key directory")
            if c == self.client_id:
                self._abort("the key directory lists our own id")
            if c not in self._neighbours:
                self._abort(f"client {c} is not our neighbour")
            for key in (entry.encryption_key, entry.mask_key):
                if key in public_keys:
                    self._abort(f"duplicate public key (peer {c})")
                public_keys.add(key)
            if self.config.malicious and not self._tagged(c, I.content_digest(
                    I.KEYS_PURPOSE, self.config.session_id, c, entry.encryption_key, entry.mask_key,
                    entry.seed_commitment, self._bound), entry.tag):
                self._abort(f"the keys of peer {c} do not carry its tag under our pairwise identity key for this "
                            f"session's parameters and our context (key substitution, a peer given another graph, "
                            f"or a peer bound to another context: another run, round or noise plan?)")
        if len(seen) + 1 < self.config.threshold:
            self._abort(f"only {len(seen) + 1} live share holders, fewer than the threshold {self.config.threshold}")
        if self.config.malicious:
            self._transcript = self._check_transcript(directory)
        try:
            self._peer_keys = {e.client_id: (P.load_public_key(e.encryption_key), P.load_public_key(e.mask_key))
                               for e in directory.keys}
        except ValueError:
            self._abort("malformed public key in the key directory")

        holders = sorted(seen | {self.client_id})
        key_shares = shamir.split(P.private_bytes(self._mask_key), self.config.threshold, holders)
        seed_shares = shamir.split(self._self_seed, self.config.threshold, holders)
        self._own_shares = (key_shares[self.client_id], seed_shares[self.client_id])
        out = []
        for peer in sorted(seen):
            key = self._share_key(peer)
            plaintext = _share_plaintext(self.client_id, peer, key_shares[peer], seed_shares[peer])
            out.append(EncryptedShare(sender=self.client_id, recipient=peer, ciphertext=P.encrypt_share(
                key, plaintext, session_id=self.config.session_id, sender=self.client_id, recipient=peer)))
        self._next += 1
        return ShareKeys(session_id=self.config.session_id, sender=self.client_id, shares=tuple(out))

    def _check_transcript(self, directory: KeyDirectory) -> bytes:
        """The session's transcript hash, after checking the transcript lists our own fresh bundle and exactly the
        bundles we were given for our neighbours (malicious variant)."""
        sid, roster = self.config.session_id, set(self.config.client_ids)
        table: dict[int, bytes] = {}
        for entry in directory.transcript:
            if entry.client_id in table:
                self._abort(f"client {entry.client_id} listed twice in the session transcript")
            if entry.client_id not in roster:
                self._abort(f"unknown client id {entry.client_id} in the session transcript")
            table[entry.client_id] = entry.digest
        own = I.bundle_digest(sid, self.client_id, P.public_bytes(self._enc_key), P.public_bytes(self._mask_key),
                              P.seed_commitment(self._self_seed, sid, self.client_id))
        if table.get(self.client_id) != own:
            self._abort("the session transcript does not hold the key bundle we advertised (a replayed or other "
                        "session?)")
        for e in directory.keys:
            if table.get(e.client_id) != I.bundle_digest(sid, e.client_id, e.encryption_key, e.mask_key,
                                                         e.seed_commitment):
                self._abort(f"the key bundle of peer {e.client_id} is not the one in the session transcript")
        hidden = sorted((self._neighbours & table.keys()) - {e.client_id for e in directory.keys})
        if hidden:
            self._abort(f"the session transcript lists neighbour(s) {hidden[:5]} whose keys we were not given")
        return I.transcript_hash(sid, table.items(), self._bound)

    def _share_key(self, peer: int) -> bytes:
        try:
            shared = P.key_agreement(self._enc_key, self._peer_keys[peer][0])
        except ValueError:
            self._abort(f"invalid encryption public key of peer {peer}")
        return P.share_encryption_key(shared, self.config.session_id)

    # ------------------------------------------------------------------ stage 3
    def masked_input(self, delivery: ShareDelivery) -> MaskedInput:
        self._enter(MASKED_INPUT)
        if not isinstance(delivery, ShareDelivery):
            self._abort(f"expected a ShareDelivery, got {type(delivery).__name__}")
        self._check_session(delivery)
        self._check_recipient(delivery)
        received: dict[int, bytes] = {}
        for share in delivery.shares:
            if share.recipient != self.client_id:
                self._abort(f"delivered a ciphertext addressed to client {share.recipient}")
            if share.sender in received:
                self._abort(f"peer {share.sender} listed twice in the share delivery")
            if share.sender not in self._peer_keys:
                self._abort(f"share from unknown peer {share.sender} (no public key from it)")
            received[share.sender] = share.ciphertext
        if len(received) + 1 < self.config.threshold:
            self._abort(f"only {len(received) + 1} live share holders, fewer than the threshold "
                        f"{self.config.threshold}")
        self._received = received

        bits, d = self.config.bits, self.config.dimension
        expander = P.MaskExpander(d, bits)
        masked = self._value.copy()
        expander.add(masked, P.self_mask_key(self._self_seed, self.config.session_id, self.client_id))
        for peer in sorted(received):
            try:
                shared = P.key_agreement(self._mask_key, self._peer_keys[peer][1])
            except ValueError:
                self._abort(f"invalid mask public key of peer {peer}")
            key = P.pairwise_mask_key(shared, self.config.session_id, self.client_id, peer)
            expander.add(masked, key, +1 if self.client_id < peer else -1)
        P.reduce_mod(masked, bits)
        self._value = None  # the plain input is no longer needed
        self._next += 1 if self.config.malicious else 2  # the consistency round is the malicious variant's
        payload = masked.tobytes()
        signature = (I.sign(self._identity.signing_key, I.INPUT_PURPOSE, self.config.session_id, self.client_id, self._transcript,
                            I.digest(payload), I.encode_ids(received)) if self.config.malicious else b"")
        return MaskedInput(session_id=self.config.session_id, sender=self.client_id, masked=payload,
                           signature=signature)

    # ------------------------------------------------------------------ consistency round (malicious variant)
    def consistency_check(self, request: UnmaskRequest) -> ConsistencySignature:
        """Check the survivor set the server announces and sign it (Bonawitz et al. 2017, Fig. 5, round 3)."""
        self._enter(CONSISTENCY)
        if not isinstance(request, UnmaskRequest):
            self._abort(f"expected an UnmaskRequest, got {type(request).__name__}")
        self._check_session(request)
        alive, dropped = self._check_survivors(request.alive, request.dropped)
        self._survivors = (tuple(sorted(alive)), tuple(sorted(dropped)))
        self._next += 1
        parts = (self._transcript, I.encode_ids(alive), I.encode_ids(dropped))
        signature = I.sign(self._identity.signing_key, I.SURVIVORS_PURPOSE, self.config.session_id, self.client_id,
                           *parts)
        # every survivor that may count us in its check 6: the survivors within two hops of it and their holders
        readers = sorted((self.config.within(self.client_id, 3) & alive) - {self.client_id})
        tags = self._tags(readers, I.content_digest(I.SURVIVORS_PURPOSE, self.config.session_id, self.client_id,
                                                    *parts))
        return ConsistencySignature(session_id=self.config.session_id, sender=self.client_id, signature=signature,
                                    tags=tags)

    def _check_survivors(self, listed_alive, listed_dropped) -> tuple[set[int], set[int]]:
        roster = set(self.config.client_ids)
        for name, listed in (("alive", listed_alive), ("dropped", listed_dropped)):
            listed = list(listed)
            if len(set(listed)) != len(listed):
                twice = sorted({c for c in listed if listed.count(c) > 1})
                self._abort(f"peer(s) {twice} listed twice as {name}")
            unknown = sorted(set(listed) - roster)
            if unknown:
                self._abort(f"unknown client id(s) {unknown} listed as {name}")
        alive, dropped = set(listed_alive), set(listed_dropped)
        both = sorted(alive & dropped)
        if both:
            self._abort(f"peer(s) {both} listed both alive and dropped")
        if self.client_id in dropped:
            self._abort("we are listed as dropped although we sent our masked input")
        if self.client_id not in alive:
            self._abort("we are not listed among the alive clients")
        senders = set(self._received)
        for peer in (alive | dropped) & self._neighbours:
            if peer not in senders:
                self._abort(f"neighbour {peer} is listed but never sent us its shares")
        unlisted = sorted(senders - alive - dropped)
        if unlisted:
            self._abort(f"neighbour(s) {unlisted} sent us shares but are listed neither alive nor dropped")
        live_holders = len(alive & self.config.holders(self.client_id))
        if live_holders < self.config.threshold:
            self._abort(f"only {live_holders} live share holders, fewer than the threshold {self.config.threshold}")
        problem = survivor_set_problem(self.config, self.client_id, alive)
        if problem is not None:
            self._abort(problem)
        return alive, dropped

    def _check_proof(self, proof: ConsistencyProof) -> None:
        """Check 6 of the module docstring: before revealing anything, every survivor within two hops took part in this
        session with the peers the survivor set implies, and ``threshold`` share holders of each of them (and of each
        dropped peer we reveal for) tagged for us the very survivor set we signed."""
        if proof.recipient != self.client_id:
            self._abort(f"consistency proof addressed to client {proof.recipient}, not to us")
        alive_t, dropped_t = self._survivors
        if tuple(sorted(proof.alive)) != alive_t or tuple(sorted(proof.dropped)) != dropped_t:
            self._abort("the survivor set in the consistency proof differs from the one we signed")
        cfg, sid, transcript = self.config, self.config.session_id, self._transcript
        alive, listed = set(alive_t), set(alive_t) | set(dropped_t)
        alive_ids, dropped_ids = I.encode_ids(alive_t), I.encode_ids(dropped_t)
        offered: dict[int, bytes] = {}
        for entry in proof.tags:
            if entry.client_id in alive and entry.client_id != self.client_id:
                offered.setdefault(entry.client_id, entry.tag)  # one per signer: the first
        attested = {}
        for entry in proof.inputs:
            if entry.client_id in alive:
                attested.setdefault(entry.client_id, entry)
        valid: dict[int, bool] = {self.client_id: True}  # signer -> verified (we know we signed)
        good: set[int] = {self.client_id}  # the signers whose tag verified

        def signed(c: int) -> bool:
            if c not in valid:
                ok = c in offered and self._tagged(c, I.content_digest(I.SURVIVORS_PURPOSE, sid, c, transcript,
                                                                       alive_ids, dropped_ids), offered[c])
                valid[c] = ok
                if ok:
                    good.add(c)
            return valid[c]

        def proven(b: int) -> bool:
            if signed(b):
                return True
            entry = attested.get(b)
            return entry is not None and self._registry.verify(
                entry.signature, I.INPUT_PURPOSE, sid, b, transcript, entry.digest,
                I.encode_ids(cfg.neighbours(b) & listed))

        t = cfg.threshold
        senders = set(self._received)
        revealed_seeds = {self.client_id} | (senders & alive)
        checked: set[int] = set()
        for a in revealed_seeds:
            checked |= {a} | (cfg.neighbours(a) & alive)
        # Whether t of a peer's holders signed does not depend on which of them we verify first, only how many
        # signatures it takes: verify first the survivors whose signature the two-hop check needs anyway (checked),
        # then the holders of most checked survivors, so the counts verify few signatures beyond ``checked``.
        order: dict[int, tuple] = {}

        def rank(c: int) -> tuple:
            if c not in order:
                order[c] = (c not in checked, -len(cfg.neighbours(c) & checked), c)
            return order[c]

        def signers(peer: int) -> int:
            holders = cfg.holders(peer)
            count = len(holders & good)
            if count < t:
                for holder in sorted((holders & offered.keys()) - valid.keys(), key=rank):
                    if signed(holder):
                        count += 1
                        if count >= t:
                            break
            return count

        for b in sorted(checked):
            count = signers(b)
            if count < t:
                self._abort(f"only {count} of peer {b}'s share holders signed this survivor set (threshold {t}): the "
                            f"server may be showing clients different sets")
            if not proven(b):
                self._abort(f"survivor {b} shows neither its signature of this survivor set nor an attestation that "
                            f"it masked, in this session, with exactly the peers the set implies: its part of the sum "
                            f"cannot be verified")
        for p in sorted(senders - alive):
            count = signers(p)
            if count < t:
                self._abort(f"only {count} of peer {p}'s share holders signed this survivor set (threshold {t}): the "
                            f"server may be showing clients different sets")
        # Every survivor, not only those within reach of our tags: its identity signature of this survivor set (or
        # its input attestation) under our transcript hash, which binds the session's context. A client of another
        # run, phase, round or plan that the server put into this session, however far from us in the graph, signed
        # another transcript: its part of the sum would not be what our noise plan assumed.
        survivor_signatures: dict[int, bytes] = {}
        for entry in proof.signatures:
            survivor_signatures.setdefault(entry.client_id, entry.signature)
        for b in sorted(alive - checked - good - {self.client_id}):  # the others verified above, by tag or attestation
            ok = b in survivor_signatures and self._registry.verify(
                survivor_signatures[b], I.SURVIVORS_PURPOSE, sid, b, transcript, alive_ids, dropped_ids)
            if not ok:
                entry = attested.get(b)
                ok = entry is not None and self._registry.verify(
                    entry.signature, I.INPUT_PURPOSE, sid, b, transcript, entry.digest,
                    I.encode_ids(cfg.neighbours(b) & listed))
            if not ok:
                self._abort(f"survivor {b} shows no signature of this survivor set, nor of its masked input, under "
                            f"our session's transcript: it may belong to another session, run, phase or round")

    # ------------------------------------------------------------------ unmasking (the last stage)
    def unmask(self, request: UnmaskRequest | ConsistencyProof) -> UnmaskShares:
        """Reveal the shares that remove the masks: answers an ``UnmaskRequest`` (semi-honest variant) or the
        ``ConsistencyProof`` of the consistency round (malicious variant)."""
        self._enter(UNMASK)
        expected = ConsistencyProof if self.config.malicious else UnmaskRequest
        if not isinstance(request, expected):
            self._abort(f"expected a {expected.__name__}, got {type(request).__name__}")
        self._check_session(request)
        if self.config.malicious:
            self._check_proof(request)
            alive = set(self._survivors[0])
        else:
            alive, _ = self._check_survivors(request.alive, request.dropped)
        senders = set(self._received)

        self_mask_shares, mask_key_shares = [], []
        for peer in sorted(senders | {self.client_id}):
            kind = _SELF_SEED if peer in alive else _MASK_KEY
            if self._revealed.get(peer, kind) != kind:
                self._abort(f"refusing to reveal both shares of peer {peer}")
            key_share, seed_share = self._open(peer)
            self._revealed[peer] = kind
            value = seed_share if kind == _SELF_SEED else key_share
            share = RevealedShare(owner=peer, x=self.client_id, y=value.to_bytes(shamir.SHARE_BYTES, "big"))
            (self_mask_shares if kind == _SELF_SEED else mask_key_shares).append(share)
        self._next = STAGES.index(DONE)
        self._enc_key = self._mask_key = self._self_seed = None
        return UnmaskShares(session_id=self.config.session_id, sender=self.client_id,
                            self_mask_shares=tuple(self_mask_shares), mask_key_shares=tuple(mask_key_shares))

    def _open(self, peer: int) -> tuple[int, int]:
        if peer == self.client_id:
            return self._own_shares
        try:
            raw = P.decrypt_share(self._share_key(peer), self._received[peer], session_id=self.config.session_id,
                                  sender=peer, recipient=self.client_id)
            sender, recipient, key_share, seed_share = _parse_share_plaintext(raw)
        except (P.InvalidTag, ValueError):
            self._abort(f"authentication of the shares from peer {peer} failed")
        if sender != peer or recipient != self.client_id or key_share >= shamir.PRIME or seed_share >= shamir.PRIME:
            self._abort(f"the shares from peer {peer} are not addressed from {peer} to us")
        return key_share, seed_share
