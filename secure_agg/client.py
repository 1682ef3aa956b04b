"""The client's side of the protocol as a state machine (Bonawitz et al. CCS 2017, Fig. 4, with the neighbour graph of
Bell et al. CCS 2020).

A ``ClientSession`` answers exactly one message per stage, in the order of ``STAGES``. Anything unexpected makes it
abort for good (``ProtocolAbort``), wiping its secrets, before it sends anything: a message for another session or
another client, an out-of-order stage, a peer listed twice, an unknown or non-neighbour id, duplicate public keys,
fewer than ``threshold`` live share holders, a peer listed both alive and dropped, itself listed as dropped, or a share
ciphertext that fails authentication. It reveals, per peer, the self-seed share (peer alive) or the mask-key share
(peer dropped), never both.
"""

from __future__ import annotations

import numpy as np

from secure_agg import primitives as P
from secure_agg import shamir
from secure_agg.errors import ProtocolAbort
from secure_agg.messages import (AdvertiseKeys, EncryptedShare, KeyDirectory, MaskedInput, RevealedShare,
                                 ShareDelivery, ShareKeys, UnmaskRequest, UnmaskShares)
from secure_agg.protocol import ADVERTISE_KEYS, DONE, MASKED_INPUT, SHARE_KEYS, STAGES, UNMASK, SessionConfig

__all__ = ["ClientSession", "check_input_vector"]

_SELF_SEED = "self_mask_seed"
_MASK_KEY = "mask_key"


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

    ``value`` is the client's (already quantised, possibly noised) vector in Z_{2^bits}^dimension.
    """

    def __init__(self, config: SessionConfig, client_id: int, value: np.ndarray):
        if not isinstance(config, SessionConfig):
            raise TypeError("config must be a SessionConfig")
        if client_id not in config.client_ids:
            raise ValueError(f"client {client_id!r} is not in the session's roster")
        self.config = config
        self.client_id = client_id
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
        return AdvertiseKeys(session_id=self.config.session_id, sender=self.client_id,
                             encryption_key=P.public_bytes(self._enc_key), mask_key=P.public_bytes(self._mask_key))

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
        if len(seen) + 1 < self.config.threshold:
            self._abort(f"only {len(seen) + 1} live share holders, fewer than the threshold {self.config.threshold}")
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
        self._next += 1
        return MaskedInput(session_id=self.config.session_id, sender=self.client_id, masked=masked.tobytes())

    # ------------------------------------------------------------------ stage 4
    def unmask(self, request: UnmaskRequest) -> UnmaskShares:
        self._enter(UNMASK)
        if not isinstance(request, UnmaskRequest):
            self._abort(f"expected an UnmaskRequest, got {type(request).__name__}")
        self._check_session(request)
        roster = set(self.config.client_ids)
        for name, listed in (("alive", request.alive), ("dropped", request.dropped)):
            if len(set(listed)) != len(listed):
                twice = sorted({c for c in listed if listed.count(c) > 1})
                self._abort(f"peer(s) {twice} listed twice as {name}")
            unknown = sorted(set(listed) - roster)
            if unknown:
                self._abort(f"unknown client id(s) {unknown} listed as {name}")
        alive, dropped = set(request.alive), set(request.dropped)
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
