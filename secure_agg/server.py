"""The server's side of the protocol as a state machine.

The server collects one message per client per stage (``receive``), then closes the stage with the matching method
(``key_directories``, ``share_deliveries``, ``unmask_request``, ``finalize``), which fixes the set of survivors and
produces the next messages. Messages for another session, from unknown clients, duplicated, malformed, for a stage that
is not the current one, or from a client already declared dropped are ignored (``receive`` returns False and records
why in ``ignored``): in particular a masked input that arrives after its sender was declared dropped never enters the
sum, and double masking means the server could not unmask it anyway.

The server aborts (``ProtocolAbort``) rather than reveal anything when fewer than ``threshold`` (or ``min_inputs``)
clients remain, when the survivors split the neighbour graph into a part smaller than that, or when some secret needed
to remove a mask has fewer than ``threshold`` shares. A reconstructed secret is checked before use: a mask key against
its advertised public key, a self-mask seed against its owner's commitment, so a corrupted share (even with exactly
``threshold`` holders answering, where interpolation cannot notice) aborts instead of giving a wrong sum.

Malicious-server variant (``config.malicious``, with the deployment's ``IdentityRegistry``): advertised keys and masked
inputs whose signature does not verify are ignored (so a forged masked input never enters the sum); the key directories
carry the session's transcript (the digest of every advertised bundle, ``transcript_hash``), which every later
signature covers, and each neighbour's pairwise tag of its keys for the recipient; the consistency round
(``consistency_proofs``) collects the survivors' signatures of (transcript, U3, dropped set) between
``unmask_request`` and ``finalize`` and forwards to each survivor the tags of the same the others made for it, with the
input attestations of the survivors that did not sign, aborting first if some client's holders could not reach
``threshold`` signatures (the clients would refuse).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import identity as I
from . import primitives as P
from . import shamir
from .errors import ProtocolAbort
from .messages import (AdvertiseKeys, BundleDigest, ConsistencyProof, ConsistencySignature, InputAttestation,
                       SurvivorSignature,
                       KeyDirectory, MaskedInput, PublicKeys, ShareDelivery, ShareKeys, Tag, UnmaskRequest,
                       UnmaskShares)
from .protocol import (ADVERTISE_KEYS, CONSISTENCY, MASKED_INPUT, SHARE_KEYS, STAGES, UNMASK, SessionConfig,
                                 check_context, component_of, session_binding)

__all__ = ["ServerSession", "AggregateResult"]


@dataclass(frozen=True, eq=False)
class AggregateResult:
    """The unmasked sum mod 2^bits (uint64) of the inputs of ``included``; ``dropped`` lists the other roster ids."""

    sum: np.ndarray
    included: tuple[int, ...]
    dropped: tuple[int, ...]
    bits: int


class ServerSession:
    """The server in one round; it never sees an individual input in the clear.

    ``context``: the context the server expects its clients to bind (``protocol.session_binding``; malicious
    variant): keys signed under another context are ignored. It protects nothing for the clients (each binds its
    own and checks its peers'); an honest server computes the same as its clients so that their signatures verify."""

    def __init__(self, config: SessionConfig, *, registry: I.IdentityRegistry | None = None, context: bytes = b""):
        if not isinstance(config, SessionConfig):
            raise TypeError("config must be a SessionConfig")
        self.context = check_context(context)
        self._bound = session_binding(config, self.context)
        if config.malicious and not isinstance(registry, I.IdentityRegistry):
            raise ValueError("the malicious-server variant needs the deployment's IdentityRegistry to check signatures")
        self.config = config
        self._registry = registry
        self._survivor_signatures: dict[int, bytes] = {}
        self._survivor_tags: dict[int, dict[int, bytes]] = {}  # signer -> recipient -> tag (malicious variant)
        self._attestations: dict[int, InputAttestation] = {}  # masked-input signatures (malicious variant)
        self._delivered: dict[int, tuple[int, ...]] = {}  # client -> the peers whose shares we forwarded to it
        self.transcript_hash = b""  # fixed when the key directories go out (malicious variant)
        self.u4: frozenset[int] = frozenset()  # signed the survivor set (malicious variant)
        self._stage = 0
        self._roster = set(config.client_ids)
        self._keys: dict[int, AdvertiseKeys] = {}
        self._seen_public_keys: set[bytes] = set()
        self._share_msgs: dict[int, ShareKeys] = {}
        self._inputs: set[int] = set()
        self._sum = np.zeros(config.dimension, dtype=P.word_dtype(config.bits))
        self._unmask: dict[int, UnmaskShares] = {}
        self.u1: frozenset[int] = frozenset()  # advertised keys (after pruning)
        self.u2: frozenset[int] = frozenset()  # shared keys (after pruning)
        self.u3: frozenset[int] = frozenset()  # sent masked inputs: the inputs in the sum
        self.ignored: list[tuple[str, object, str]] = []
        self._aborted: ProtocolAbort | None = None

    @property
    def stage(self) -> str:
        """The stage whose messages the server accepts now; ``"aborted"`` after an abort."""
        return "aborted" if self._aborted is not None else STAGES[self._stage]

    @property
    def aborted(self) -> ProtocolAbort | None:
        return self._aborted

    def _abort(self, reason: str, stage: str | None = None):
        """Abort for good; ``stage`` defaults to the stage being closed."""
        self._aborted = ProtocolAbort(reason, party="server", stage=stage or STAGES[max(self._stage - 1, 0)])
        self._sum = None
        raise self._aborted

    def _close(self, stage: str) -> None:
        if self._aborted is not None:
            raise ProtocolAbort(f"server already aborted: {self._aborted.reason}", party="server", stage=stage)
        if STAGES[self._stage] != stage:
            self._abort(f"cannot close stage {stage!r} while in stage {self.stage!r}", stage=stage)
        self._stage += 1

    # ------------------------------------------------------------------ receiving
    def _ignore(self, message, reason: str) -> bool:
        self.ignored.append((type(message).__name__, getattr(message, "sender", None), reason))
        return False

    def receive(self, message) -> bool:
        """Accept a client message for the current stage; returns False (and records why) if it is ignored."""
        if self._aborted is not None:
            return self._ignore(message, "server aborted")
        kinds = {AdvertiseKeys: ADVERTISE_KEYS, ShareKeys: SHARE_KEYS, MaskedInput: MASKED_INPUT,
                 ConsistencySignature: CONSISTENCY, UnmaskShares: UNMASK}
        stage = kinds.get(type(message))
        if stage is None:
            return self._ignore(message, "not a client message")
        if message.session_id != self.config.session_id:
            return self._ignore(message, "other session")
        sender = message.sender
        if sender not in self._roster:
            return self._ignore(message, "unknown sender")
        if stage != self.stage:
            return self._ignore(message, f"stage {stage!r} is not the current stage {self.stage!r} (late or early)")
        eligible = {ADVERTISE_KEYS: self._roster, SHARE_KEYS: self.u1, MASKED_INPUT: self.u2, CONSISTENCY: self.u3,
                    UNMASK: self.u4 if self.config.malicious else self.u3}[stage]
        if sender not in eligible:
            return self._ignore(message, "sender was declared dropped")
        if stage == ADVERTISE_KEYS:
            return self._receive_keys(message)
        if stage == SHARE_KEYS:
            return self._receive_shares(message)
        if stage == MASKED_INPUT:
            return self._receive_input(message)
        if stage == CONSISTENCY:
            return self._receive_consistency(message)
        return self._receive_unmask(message)

    def _receive_keys(self, message: AdvertiseKeys) -> bool:
        if message.sender in self._keys:
            return self._ignore(message, "duplicate")
        keys = {message.encryption_key, message.mask_key}
        if len(keys) < 2 or keys & self._seen_public_keys:
            return self._ignore(message, "public key already in use")
        if self.config.malicious and not (len(message.seed_commitment) == 32 and self._registry.verify(
                message.signature, I.KEYS_PURPOSE, self.config.session_id, message.sender, message.encryption_key,
                message.mask_key, message.seed_commitment, self._bound)):
            return self._ignore(message, "keys not signed by the sender's registered identity key for this session's "
                                         "parameters and context")
        if self.config.malicious and {t.client_id for t in message.tags} != set(self.config.neighbours(message.sender)):
            return self._ignore(message, "key tags not addressed to exactly the sender's neighbours")
        self._seen_public_keys |= keys
        self._keys[message.sender] = message
        return True

    def _receive_shares(self, message: ShareKeys) -> bool:
        if message.sender in self._share_msgs:
            return self._ignore(message, "duplicate")
        expected = self.config.neighbours(message.sender) & self.u1
        recipients = [s.recipient for s in message.shares]
        if any(s.sender != message.sender for s in message.shares) or len(set(recipients)) != len(recipients) \
                or set(recipients) != expected:
            return self._ignore(message, "shares not addressed to exactly the live neighbours")
        self._share_msgs[message.sender] = message
        return True

    def _receive_input(self, message: MaskedInput) -> bool:
        if message.sender in self._inputs:
            return self._ignore(message, "duplicate")
        if len(message.masked) != self._sum.nbytes:
            return self._ignore(message, "wrong length")
        words = np.frombuffer(message.masked, dtype=self._sum.dtype)
        if self.config.bits < 8 * self._sum.itemsize and int(words.max()) >> self.config.bits:
            return self._ignore(message, f"entries not reduced mod 2^{self.config.bits}")
        if self.config.malicious:
            digest = I.digest(message.masked)
            if not self._registry.verify(message.signature, I.INPUT_PURPOSE, self.config.session_id, message.sender,
                                         self.transcript_hash, digest, I.encode_ids(self._delivered[message.sender])):
                return self._ignore(message, "masked input not signed by the sender's registered identity key, with "
                                             "this session's transcript and the peers we forwarded to it (forged?)")
            self._attestations[message.sender] = InputAttestation(message.sender, digest, message.signature)
        np.add(self._sum, words, out=self._sum)
        self._inputs.add(message.sender)
        return True

    def _receive_consistency(self, message: ConsistencySignature) -> bool:
        if message.sender in self._survivor_signatures:
            return self._ignore(message, "duplicate")
        if not self._registry.verify(message.signature, I.SURVIVORS_PURPOSE, self.config.session_id, message.sender,
                                     self.transcript_hash, I.encode_ids(self.u3), I.encode_ids(self.u2 - self.u3)):
            return self._ignore(message, "signature of the survivor set does not verify")
        self._survivor_signatures[message.sender] = message.signature
        self._survivor_tags[message.sender] = {t.client_id: t.tag for t in message.tags}
        return True

    def _receive_unmask(self, message: UnmaskShares) -> bool:
        if message.sender in self._unmask:
            return self._ignore(message, "duplicate")
        self._unmask[message.sender] = message
        return True

    # ------------------------------------------------------------------ closing stages
    def _prune(self, alive: set[int]) -> frozenset[int]:
        """Drop, until stable, clients with fewer than ``threshold`` live share holders (they would abort anyway)."""
        alive = set(alive)
        t = self.config.threshold
        changed = True
        while changed:
            changed = False
            for c in sorted(alive):
                if len(self.config.holders(c) & alive) < t:
                    alive.discard(c)
                    changed = True
        return frozenset(alive)

    def _require(self, survivors, what: str) -> None:
        need = self.config.required_inputs
        if len(survivors) < need:
            self._abort(f"only {len(survivors)} clients {what}; at least {need} are required")

    def key_directories(self) -> dict[int, KeyDirectory]:
        """Close stage 1: each live client gets its live neighbours' public keys."""
        self._close(ADVERTISE_KEYS)
        self.u1 = self._prune(set(self._keys))
        self._require(self.u1, "advertised keys")
        transcript = ()
        if self.config.malicious:
            sid = self.config.session_id
            transcript = tuple(BundleDigest(c, I.bundle_digest(sid, c, self._keys[c].encryption_key,
                                                               self._keys[c].mask_key, self._keys[c].seed_commitment))
                               for c in sorted(self.u1))
            self.transcript_hash = I.transcript_hash(sid, ((e.client_id, e.digest) for e in transcript),
                                                     self._bound)
        tags = {v: {t.client_id: t.tag for t in self._keys[v].tags} for v in self.u1}
        out = {}
        for c in sorted(self.u1):
            entries = tuple(PublicKeys(client_id=v, encryption_key=self._keys[v].encryption_key,
                                       mask_key=self._keys[v].mask_key, seed_commitment=self._keys[v].seed_commitment,
                                       tag=tags[v].get(c, b""))
                            for v in sorted(self.config.neighbours(c) & self.u1))
            out[c] = KeyDirectory(session_id=self.config.session_id, recipient=c, keys=entries, transcript=transcript)
        return out

    def share_deliveries(self) -> dict[int, ShareDelivery]:
        """Close stage 2: forward each ciphertext to its holder."""
        self._close(SHARE_KEYS)
        self.u2 = self._prune(set(self._share_msgs))
        self._require(self.u2, "shared their keys")
        inbox: dict[int, list] = {c: [] for c in self.u2}
        for sender in sorted(self.u2):
            for share in self._share_msgs[sender].shares:
                if share.recipient in inbox:
                    inbox[share.recipient].append(share)
        self._delivered = {c: tuple(sorted(s.sender for s in inbox[c])) for c in inbox}
        return {c: ShareDelivery(session_id=self.config.session_id, recipient=c, shares=tuple(inbox[c]))
                for c in sorted(self.u2)}

    def unmask_request(self) -> UnmaskRequest:
        """Close stage 3: fix the inputs in the sum and ask for the shares that remove the masks."""
        self._close(MASKED_INPUT)
        self.u3 = frozenset(self._inputs)
        self._require(self.u3, "sent masked inputs")
        t = self.config.threshold
        for c in sorted(self.u2):
            if c not in self.u3 and not (self.config.neighbours(c) & self.u3):
                continue  # dropped, and nobody in the sum masked with it
            live = len(self.config.holders(c) & self.u3)
            if live < t:
                self._abort(f"the masks of client {c} cannot be removed: only {live} of its share holders are alive "
                            f"(threshold {t})")
        need = self.config.required_inputs
        if self.config.degree < self.config.n_clients - 1:
            left = set(self.u3)
            while left:
                part = component_of(self.config, min(left), self.u3)
                if len(part) < need:
                    self._abort(f"the survivors split the neighbour graph: a part of {len(part)} clients (fewer than "
                                f"{need}) could be unmasked on its own; use a larger degree")
                left -= part
        if not self.config.malicious:
            self._stage += 1  # no consistency round in the semi-honest variant
        return UnmaskRequest(session_id=self.config.session_id, alive=tuple(sorted(self.u3)),
                             dropped=tuple(sorted(self.u2 - self.u3)))

    def consistency_proofs(self) -> dict[int, ConsistencyProof]:
        """Close the consistency round (malicious variant): forward to every signer the tags of U3 the others made for
        it, with the input attestations of the survivors that did not sign."""
        self._close(CONSISTENCY)
        self.u4 = frozenset(self._survivor_signatures)
        self._require(self.u4, "signed the survivor set")
        t = self.config.threshold
        dropped = self.u2 - self.u3
        for c in sorted(self.u3 | {d for d in dropped if self.config.neighbours(d) & self.u3}):
            signed = len(self.config.holders(c) & self.u4)
            if signed < t:
                self._abort(f"only {signed} share holders of client {c} signed the survivor set (threshold {t}): the "
                            f"clients would refuse to unmask")
        alive, gone = tuple(sorted(self.u3)), tuple(sorted(dropped))
        inputs = tuple(self._attestations[c] for c in sorted(self.u3 - self.u4))
        signatures = tuple(SurvivorSignature(c, self._survivor_signatures[c]) for c in sorted(self.u4))
        return {w: ConsistencyProof(session_id=self.config.session_id, recipient=w, alive=alive, dropped=gone,
                                    tags=tuple(Tag(c, self._survivor_tags[c][w]) for c in sorted(self.u4)
                                               if w in self._survivor_tags[c]),
                                    inputs=inputs, signatures=signatures)
                for w in sorted(self.u4)}

    def finalize(self) -> AggregateResult:
        """Close stage 4: reconstruct the secrets, remove all masks, return the sum of the alive clients' inputs."""
        self._close(UNMASK)
        cfg = self.config
        seed_shares: dict[int, dict[int, int]] = {c: {} for c in self.u3}
        key_shares: dict[int, dict[int, int]] = {c: {} for c in self.u2 - self.u3}
        for responder, message in self._unmask.items():
            for pool, shares in ((seed_shares, message.self_mask_shares), (key_shares, message.mask_key_shares)):
                for s in shares:
                    if s.owner in pool and s.x == responder and responder in cfg.holders(s.owner):
                        pool[s.owner][s.x] = s.value

        expander = P.MaskExpander(cfg.dimension, cfg.bits)
        total = self._sum.copy()
        for owner in sorted(self.u3):
            seed = self._reconstruct(owner, seed_shares[owner], "self-mask seed")
            commitment = self._keys[owner].seed_commitment
            if commitment and P.seed_commitment(seed, cfg.session_id, owner) != commitment:
                self._abort(f"reconstructed self-mask seed of client {owner} does not match its commitment: a share "
                            f"was corrupted")
            expander.add(total, P.self_mask_key(seed, cfg.session_id, owner), -1)
        for owner in sorted(self.u2 - self.u3):
            alive_neighbours = sorted(cfg.neighbours(owner) & self.u3)
            if not alive_neighbours:
                continue
            raw = self._reconstruct(owner, key_shares[owner], "mask key")
            private = P.private_key_from_bytes(raw)
            if P.public_bytes(private) != self._keys[owner].mask_key:
                self._abort(f"reconstructed mask key of client {owner} does not match its public key")
            for u in alive_neighbours:
                shared = P.key_agreement(private, self._keys[u].mask_key)
                key = P.pairwise_mask_key(shared, cfg.session_id, u, owner)
                # u added +PRG if u < owner, -PRG otherwise; undo it
                expander.add(total, key, -1 if u < owner else +1)
        P.reduce_mod(total, cfg.bits)
        self._sum = None
        return AggregateResult(sum=total.astype(np.uint64), included=tuple(sorted(self.u3)),
                               dropped=tuple(sorted(self._roster - self.u3)), bits=cfg.bits)

    def _reconstruct(self, owner: int, shares: dict[int, int], what: str) -> bytes:
        t = self.config.threshold
        if len(shares) < t:
            self._abort(f"cannot remove the masks of client {owner}: {len(shares)} shares of its {what}, "
                        f"threshold {t}")
        try:
            return shamir.int_to_bytes(shamir.combine(shares, t), P.SEED_BYTES)
        except ValueError as exc:
            self._abort(f"shares of the {what} of client {owner} are inconsistent: {exc}")
