"""Protocol messages: frozen dataclasses that carry only bytes and integers.

Every message names its session; client-to-server messages name their ``sender``, server-to-client messages their
``recipient``. ``to_dict``/``from_dict`` give JSON-compatible dicts and ``to_bytes``/``from_bytes`` JSON bytes, so any
transport (the in-process runtime, Flower, gRPC, a queue) can carry them. ``message_from_dict`` dispatches on the
``"type"`` key. Construction checks shapes (32-byte keys, positive ids); protocol rules are checked by the parties.
``signature`` fields (Ed25519, 64 bytes) are empty outside the malicious-server variant, and so are the fields that
carry the session's transcript (``KeyDirectory.transcript``, ``ConsistencyProof.inputs``) and the pairwise tags
(``Tag``: HMAC-SHA256, 32 bytes, under the key of one sender and one recipient; ``identity.tag``).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import codec
from .errors import MessageFormatError
from .protocol import ADVERTISE_KEYS, CONSISTENCY, MASKED_INPUT, SHARE_KEYS, UNMASK
from .shamir import PRIME

__all__ = ["Tag", "AdvertiseKeys", "PublicKeys", "BundleDigest", "KeyDirectory", "InputAttestation", "SurvivorSignature",
           "EncryptedShare",
           "ShareKeys", "ShareDelivery",
           "MaskedInput", "UnmaskRequest", "ConsistencySignature", "ConsistencyProof", "RevealedShare",
           "UnmaskShares", "message_from_dict", "MESSAGE_TYPES"]


def _check_id(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2 ** 63:
        raise ValueError(f"{name} must be a client id (integer in [1, 2^63)), got {value!r}")


def _check_bytes(name: str, value, length: int | None = None) -> None:
    if not isinstance(value, bytes):
        raise ValueError(f"{name} must be bytes")
    if length is not None and len(value) != length:
        raise ValueError(f"{name} must be {length} bytes, got {len(value)}")


def _check_optional(name: str, value, length: int) -> None:
    """Empty bytes (the field is unused in this variant) or exactly ``length`` bytes."""
    _check_bytes(name, value)
    if value and len(value) != length:
        raise ValueError(f"{name} must be empty or {length} bytes, got {len(value)}")


class _Message:
    stage: str = ""

    def _check_session(self):
        _check_bytes("session_id", self.session_id)

    def to_dict(self) -> dict:
        return codec.to_plain(self)

    @classmethod
    def from_dict(cls, data: dict):
        return codec.from_plain(cls, data)

    def to_bytes(self) -> bytes:
        return codec.to_json_bytes(self)

    @classmethod
    def from_bytes(cls, raw: bytes):
        return codec.from_json_bytes(cls, raw)


def _check_tags(name: str, tags) -> tuple:
    tags = tuple(tags)
    if not all(isinstance(t, Tag) for t in tags):
        raise ValueError(f"{name} must be Tag entries")
    return tags


@dataclass(frozen=True)
class Tag:
    """A pairwise tag (``identity.tag``): ``client_id`` is the other party, the recipient in a client's message, the
    sender in a message the server forwards to the recipient."""

    client_id: int
    tag: bytes

    def __post_init__(self):
        _check_id("client_id", self.client_id)
        _check_bytes("tag", self.tag, 32)


@dataclass(frozen=True)
class AdvertiseKeys(_Message):
    """Stage 1, client -> server: the client's two X25519 public keys, a commitment to its self-mask seed (checked after
    reconstruction, so a corrupted share is detected), and (malicious variant) its identity key's signature of all
    three (which the server checks) and one pairwise tag of them for each neighbour (which the neighbour checks)."""

    session_id: bytes
    sender: int
    encryption_key: bytes
    mask_key: bytes
    seed_commitment: bytes = b""
    signature: bytes = b""
    tags: tuple[Tag, ...] = ()
    stage = ADVERTISE_KEYS

    def __post_init__(self):
        self._check_session()
        _check_id("sender", self.sender)
        _check_bytes("encryption_key", self.encryption_key, 32)
        _check_bytes("mask_key", self.mask_key, 32)
        _check_optional("seed_commitment", self.seed_commitment, 32)
        _check_optional("signature", self.signature, 64)
        object.__setattr__(self, "tags", _check_tags("tags", self.tags))


@dataclass(frozen=True)
class PublicKeys:
    """One peer's advertised keys as forwarded by the server (in the malicious variant with the peer's pairwise tag of
    them for the directory's recipient)."""

    client_id: int
    encryption_key: bytes
    mask_key: bytes
    seed_commitment: bytes = b""
    tag: bytes = b""

    def __post_init__(self):
        _check_id("client_id", self.client_id)
        _check_bytes("encryption_key", self.encryption_key, 32)
        _check_bytes("mask_key", self.mask_key, 32)
        _check_optional("seed_commitment", self.seed_commitment, 32)
        _check_optional("tag", self.tag, 32)


@dataclass(frozen=True)
class BundleDigest:
    """One entry of the session's transcript: the SHA-256 digest of the key bundle ``client_id`` advertised
    (``identity.bundle_digest``)."""

    client_id: int
    digest: bytes

    def __post_init__(self):
        _check_id("client_id", self.client_id)
        _check_bytes("digest", self.digest, 32)


@dataclass(frozen=True)
class KeyDirectory(_Message):
    """Server -> client after stage 1: the public keys of the recipient's neighbours that advertised keys, and
    (malicious variant) the transcript: the digest of every key bundle in the session, which later signatures
    cover."""

    session_id: bytes
    recipient: int
    keys: tuple[PublicKeys, ...]
    transcript: tuple[BundleDigest, ...] = ()
    stage = ADVERTISE_KEYS

    def __post_init__(self):
        self._check_session()
        _check_id("recipient", self.recipient)
        if not all(isinstance(k, PublicKeys) for k in self.keys):
            raise ValueError("keys must be PublicKeys entries")
        if not all(isinstance(e, BundleDigest) for e in self.transcript):
            raise ValueError("transcript must be BundleDigest entries")
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "transcript", tuple(self.transcript))


@dataclass(frozen=True)
class EncryptedShare:
    """AES-GCM ciphertext of the sender's shares for one holder; only the recipient can open it."""

    sender: int
    recipient: int
    ciphertext: bytes

    def __post_init__(self):
        _check_id("sender", self.sender)
        _check_id("recipient", self.recipient)
        _check_bytes("ciphertext", self.ciphertext)


@dataclass(frozen=True)
class ShareKeys(_Message):
    """Stage 2, client -> server: one encrypted share per neighbour."""

    session_id: bytes
    sender: int
    shares: tuple[EncryptedShare, ...]
    stage = SHARE_KEYS

    def __post_init__(self):
        self._check_session()
        _check_id("sender", self.sender)
        if not all(isinstance(s, EncryptedShare) for s in self.shares):
            raise ValueError("shares must be EncryptedShare entries")
        object.__setattr__(self, "shares", tuple(self.shares))


@dataclass(frozen=True)
class ShareDelivery(_Message):
    """Server -> client after stage 2: the ciphertexts addressed to the recipient (their senders form U2 locally)."""

    session_id: bytes
    recipient: int
    shares: tuple[EncryptedShare, ...]
    stage = SHARE_KEYS

    def __post_init__(self):
        self._check_session()
        _check_id("recipient", self.recipient)
        if not all(isinstance(s, EncryptedShare) for s in self.shares):
            raise ValueError("shares must be EncryptedShare entries")
        object.__setattr__(self, "shares", tuple(self.shares))


@dataclass(frozen=True)
class MaskedInput(_Message):
    """Stage 3, client -> server: the masked vector as little-endian words (uint32 if bits <= 32, else uint64)."""

    session_id: bytes
    sender: int
    masked: bytes
    # malicious variant: the sender's signature of (session, sender, transcript hash, SHA-256 of masked, the peers it
    # masked with): its attestation that it masked with exactly those peers in this session
    signature: bytes = b""
    stage = MASKED_INPUT

    def __post_init__(self):
        self._check_session()
        _check_id("sender", self.sender)
        _check_bytes("masked", self.masked)
        _check_optional("signature", self.signature, 64)


@dataclass(frozen=True)
class UnmaskRequest(_Message):
    """Server -> clients after stage 3: whose input is in the sum (alive) and who shared keys but dropped. Clients of
    the semi-honest variant answer it with their shares; those of the malicious variant first check and sign it
    (``ConsistencySignature``)."""

    session_id: bytes
    alive: tuple[int, ...]
    dropped: tuple[int, ...]
    stage = MASKED_INPUT

    def __post_init__(self):
        self._check_session()
        for c in tuple(self.alive) + tuple(self.dropped):
            _check_id("listed id", c)
        object.__setattr__(self, "alive", tuple(self.alive))
        object.__setattr__(self, "dropped", tuple(self.dropped))


@dataclass(frozen=True)
class ConsistencySignature(_Message):
    """Consistency round, client -> server (malicious variant): the sender's signature of the survivor set it saw (which
    the server checks) and its pairwise tag of the same for each survivor that may count it (``tags``: every survivor
    within three hops of the sender in the neighbour graph)."""

    session_id: bytes
    sender: int
    signature: bytes
    tags: tuple[Tag, ...] = ()
    stage = CONSISTENCY

    def __post_init__(self):
        self._check_session()
        _check_id("sender", self.sender)
        _check_bytes("signature", self.signature, 64)
        object.__setattr__(self, "tags", _check_tags("tags", self.tags))


@dataclass(frozen=True)
class InputAttestation:
    """A survivor's masked-input signature, forwarded in the consistency proof for a survivor that did not sign the
    survivor set: ``digest`` is the SHA-256 of its masked input; the signature also covers the transcript hash and the
    peers it masked with, which the verifier recomputes from the survivor set."""

    client_id: int
    digest: bytes
    signature: bytes

    def __post_init__(self):
        _check_id("client_id", self.client_id)
        _check_bytes("digest", self.digest, 32)
        _check_bytes("signature", self.signature, 64)


@dataclass(frozen=True)
class SurvivorSignature:
    """A survivor's identity-key signature of the survivor set (its :class:`ConsistencySignature`'s), forwarded to
    every survivor, so each can check every other survivor signed the same set under the same transcript hash (which
    binds the session's context: a client of another run, phase or round signs another)."""

    client_id: int
    signature: bytes

    def __post_init__(self):
        _check_id("client_id", self.client_id)
        _check_bytes("signature", self.signature, 64)


@dataclass(frozen=True)
class ConsistencyProof(_Message):
    """Server -> one client after the consistency round: the survivor set, the tags of it the survivors made for the
    recipient (``Tag.client_id``: the signer), and the input attestations of the survivors that did not sign it."""

    session_id: bytes
    recipient: int
    alive: tuple[int, ...]
    dropped: tuple[int, ...]
    tags: tuple[Tag, ...]
    inputs: tuple[InputAttestation, ...] = ()
    signatures: tuple[SurvivorSignature, ...] = ()
    stage = CONSISTENCY

    def __post_init__(self):
        self._check_session()
        _check_id("recipient", self.recipient)
        for c in tuple(self.alive) + tuple(self.dropped):
            _check_id("listed id", c)
        if not all(isinstance(a, InputAttestation) for a in self.inputs):
            raise ValueError("inputs must be InputAttestation entries")
        object.__setattr__(self, "alive", tuple(self.alive))
        object.__setattr__(self, "dropped", tuple(self.dropped))
        object.__setattr__(self, "tags", _check_tags("tags", self.tags))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        if not all(isinstance(a, SurvivorSignature) for a in self.signatures):
            raise ValueError("signatures must be SurvivorSignature entries")
        object.__setattr__(self, "signatures", tuple(self.signatures))


@dataclass(frozen=True)
class RevealedShare:
    """The share (x = holder id, y) of one secret of ``owner``."""

    owner: int
    x: int
    y: bytes

    def __post_init__(self):
        _check_id("owner", self.owner)
        _check_id("x", self.x)
        _check_bytes("y", self.y)
        if int.from_bytes(self.y, "big") >= PRIME:
            raise ValueError("share value out of the field")

    @property
    def value(self) -> int:
        return int.from_bytes(self.y, "big")


@dataclass(frozen=True)
class UnmaskShares(_Message):
    """Stage 4, client -> server: self-seed shares of alive neighbours, mask-key shares of dropped ones."""

    session_id: bytes
    sender: int
    self_mask_shares: tuple[RevealedShare, ...]
    mask_key_shares: tuple[RevealedShare, ...]
    stage = UNMASK

    def __post_init__(self):
        self._check_session()
        _check_id("sender", self.sender)
        for s in tuple(self.self_mask_shares) + tuple(self.mask_key_shares):
            if not isinstance(s, RevealedShare):
                raise ValueError("shares must be RevealedShare entries")
        object.__setattr__(self, "self_mask_shares", tuple(self.self_mask_shares))
        object.__setattr__(self, "mask_key_shares", tuple(self.mask_key_shares))


MESSAGE_TYPES = {cls.__name__: cls for cls in (AdvertiseKeys, KeyDirectory, ShareKeys, ShareDelivery, MaskedInput,
                                               UnmaskRequest, ConsistencySignature, ConsistencyProof, UnmaskShares)}


def message_from_dict(data: dict):
    """Rebuild any protocol message from ``to_dict`` output (dispatch on ``"type"``)."""
    if not isinstance(data, dict) or data.get("type") not in MESSAGE_TYPES:
        kind = data.get("type") if isinstance(data, dict) else None
        raise MessageFormatError(f"not a secure-aggregation message: type={kind!r}")
    return MESSAGE_TYPES[data["type"]].from_dict(data)
