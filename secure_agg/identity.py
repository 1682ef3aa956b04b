"""Long-term identity keys (Ed25519, RFC 8032) for the malicious-server variant (Bonawitz et al. CCS 2017, Sec. 6.2).

Each client holds an Ed25519 signing key for its whole deployment; the deployment registers the matching public keys
out of band (an ``IdentityRegistry``: client id -> public key; in a Flower deployment, the SuperNodes' identities) and
hands the same registry to every client and to the server. The server can then neither substitute its own
X25519 keys for a client's (every advertised key bundle is signed), nor forge a masked input, nor show clients
different survivor sets (each client signs the one it saw, and checks the others' signatures before unmasking).

Every signature covers a domain-separated transcript: the protocol label, the purpose, the session id, the signer and
the signed content, each length-prefixed, so a signature never verifies for another purpose, session or signer.

The session id is the server's choice, so it does not make a session unique: a server can run several sessions under
one id. What does is the session's fresh key material. After the keys are advertised, the server sends every client
the digest of every advertised key bundle (``bundle_digest``); each client checks that the list holds its own bundle
and the bundles it was given, and hashes the list into the session's **transcript hash** (``transcript_hash``). Every
later signature (masked input, survivor set) covers it. A client's bundle is drawn fresh for each session it takes part
in, so a signature made in one session never verifies in another, whatever their ids, and within one transcript each
client id stands for exactly one running session of that client.

**Pairwise tags.** What one client tells one other client (its key bundle to a neighbour, its survivor set to the
clients that count it) needs no signature anyone can check: a MAC under a key only the two of them hold does, at a
fiftieth of the cost (HMAC-SHA256 against an Ed25519 verification). Every registered identity also names a static X25519
key: the Montgomery form of the same curve point (RFC 7748's birational map u = (1 + y) / (1 - y) mod 2^255 - 19, with
the private scalar Ed25519 derives from its seed, as libsodium's ``crypto_sign_ed25519_*_to_curve25519`` do), so the
registry needs nothing new. Two clients' X25519 agreement, through HKDF with both ids, is their **pairwise key**
(``ClientIdentity.pairwise_key``; cached for the identity's lifetime, since the registry does not change), and a
**tag** (``tag``) is HMAC-SHA256 under it of the signed content's digest, the sender and the recipient: it verifies
only for that recipient, only from that sender, for that purpose, session and transcript. A corrupt client knows the
keys it shares with others, so it can forge tags to itself or from itself only, as it could sign its own messages.
Using one key pair for Ed25519 signatures and static X25519 agreement is an assumption of the threat model:
Thormarker (2021, "On using the same key pair for Ed25519 and an X25519 based KEM") proves the joint security of
Ed25519 and an X25519-based KEM in the random-oracle model, the same kind of reuse though not exactly this static
Diffie-Hellman (libsodium's conversion functions exist for it). We write the map ourselves (a dozen lines) because
``cryptography`` does not expose it, and check it against ``cryptography``'s own X25519 on every identity we build.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from .primitives import PROTOCOL_LABEL, encode_id, hkdf

__all__ = ["IdentityRegistry", "ClientIdentity", "generate_identity", "montgomery_public_bytes", "content_digest", "tag",
           "check_tag",
           "TAG_BYTES", "identity_public_bytes", "sign", "SIGNATURE_BYTES",
           "KEYS_PURPOSE", "INPUT_PURPOSE", "SURVIVORS_PURPOSE", "digest", "encode_ids", "bundle_digest",
           "transcript_hash"]

SIGNATURE_BYTES = 64
TAG_BYTES = 32
_P = 2 ** 255 - 19
KEYS_PURPOSE = b"advertise-keys"
INPUT_PURPOSE = b"masked-input"
SURVIVORS_PURPOSE = b"survivor-set"


def generate_identity() -> Ed25519PrivateKey:
    """A fresh long-term Ed25519 identity key (keep it with the client; register its public half)."""
    return Ed25519PrivateKey.generate()


def identity_public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def encode_ids(ids: Iterable[int]) -> bytes:
    return b"".join(encode_id(c) for c in sorted(ids))


def _framed(*parts: bytes) -> bytes:
    return b"".join(len(part).to_bytes(4, "big") + part for part in parts)


def bundle_digest(session_id: bytes, client_id: int, encryption_key: bytes, mask_key: bytes,
                  seed_commitment: bytes) -> bytes:
    """SHA-256 of one advertised key bundle (what the transcript lists for its client)."""
    return hashlib.sha256(PROTOCOL_LABEL + b"/bundle" + _framed(session_id, encode_id(client_id), encryption_key,
                                                               mask_key, seed_commitment)).digest()


def transcript_hash(session_id: bytes, entries: Iterable[tuple[int, bytes]], config_digest: bytes) -> bytes:
    """The session's transcript hash: SHA-256 over the session id, the digest of the session's public parameters
    (``SessionConfig.digest``: roster, degree, threshold, graph seed, ...) and every (client id, bundle digest) the
    server announced, in client-id order. Signatures made after the keys are advertised cover it, so they bind the
    parameters each signer ran with."""
    body = b"".join(encode_id(c) + d for c, d in sorted(entries))
    return hashlib.sha256(PROTOCOL_LABEL + b"/transcript" + _framed(session_id, config_digest, body)).digest()


def _transcript(purpose: bytes, session_id: bytes, signer: int, parts: tuple[bytes, ...]) -> bytes:
    out = [PROTOCOL_LABEL, b"/sig/", purpose, len(session_id).to_bytes(2, "big"), session_id, encode_id(signer)]
    for part in parts:
        out += [len(part).to_bytes(4, "big"), part]
    return b"".join(out)


def sign(key: Ed25519PrivateKey, purpose: bytes, session_id: bytes, signer: int, *parts: bytes) -> bytes:
    return key.sign(_transcript(purpose, session_id, signer, parts))


def montgomery_public_bytes(ed25519_public: bytes) -> bytes:
    """The X25519 public key (u-coordinate, 32 bytes little-endian) of the curve point an Ed25519 public key encodes
    (its y-coordinate; the sign bit of x does not change u). ValueError for an encoding that names no such key
    (y >= p, or y = 1, the neutral point)."""
    if not isinstance(ed25519_public, (bytes, bytearray)) or len(ed25519_public) != 32:
        raise ValueError("an Ed25519 public key is 32 raw bytes")
    y = int.from_bytes(ed25519_public, "little") & ((1 << 255) - 1)
    if y >= _P or y == 1:
        raise ValueError("the Ed25519 public key is not a usable curve point")
    return ((1 + y) * pow(1 - y, _P - 2, _P) % _P).to_bytes(32, "little")


def tag(key: bytes, content: bytes, recipient: int) -> bytes:
    """The pairwise tag of ``content`` (a ``content_digest``, which names purpose, session, sender and the signed
    parts) for ``recipient``, under the pairwise key of sender and recipient."""
    return hmac.digest(key, PROTOCOL_LABEL + b"/tag" + encode_id(recipient) + content, "sha256")


def content_digest(purpose: bytes, session_id: bytes, sender: int, *parts: bytes) -> bytes:
    """SHA-256 of what a tag (or signature) covers: computed once, then tagged for each recipient."""
    return hashlib.sha256(_transcript(purpose, session_id, sender, parts)).digest()


def check_tag(key: bytes, content: bytes, recipient: int, value) -> bool:
    """True iff ``value`` is the tag of ``content`` for ``recipient`` under ``key`` (compared in constant time)."""
    return isinstance(value, bytes) and len(value) == TAG_BYTES and hmac.compare_digest(tag(key, content, recipient),
                                                                                      value)


class ClientIdentity:
    """A client's long-term identity: its Ed25519 signing key (``signing_key``) and, derived from it, the static X25519
    key of the same point, with the pairwise keys it shares with its peers, cached for the identity's lifetime.

    Keep one per client for the whole deployment (pass it as ``ClientSession(identity_key=...)`` in every session):
    a session then derives a pairwise key only for a peer it has not met before. A bare Ed25519 key works too; its
    pairwise keys are then derived afresh in each session.
    """

    def __init__(self, signing_key: Ed25519PrivateKey):
        if not isinstance(signing_key, Ed25519PrivateKey):
            raise TypeError("a ClientIdentity is built from the client's Ed25519 private key (generate_identity())")
        self.signing_key = signing_key
        self.public_bytes = identity_public_bytes(signing_key)
        # the X25519 private scalar of the same point: the first half of SHA-512(seed), which X25519 clamps as
        # Ed25519 does (RFC 8032 Sec. 5.1.5, RFC 7748 Sec. 5)
        self._agreement = X25519PrivateKey.from_private_bytes(
            hashlib.sha512(signing_key.private_bytes_raw()).digest()[:32])
        own = self._agreement.public_key().public_bytes_raw()
        if own != montgomery_public_bytes(self.public_bytes):
            raise ValueError("the X25519 form of this identity key does not match its Ed25519 public key")
        self._montgomery = own
        self._pairwise: dict[tuple[int, int, bytes], bytes] = {}

    def pairwise_key(self, own_id: int, peer_id: int, registry: "IdentityRegistry") -> bytes:
        """The key this client (``own_id``) shares with ``peer_id``'s registered identity. ValueError when the peer is
        not registered or its key admits no agreement (a low-order point: the peer is not a real client)."""
        peer = registry.agreement_key(peer_id)
        slot = (own_id, peer_id, peer)
        key = self._pairwise.get(slot)
        if key is None:
            shared = self._agreement.exchange(X25519PublicKey.from_public_bytes(peer))  # ValueError: low order
            lo, hi = sorted(((own_id, self._montgomery), (peer_id, peer)))
            key = hkdf(shared, salt=b"", info=PROTOCOL_LABEL + b"/pairwise-key" + encode_id(lo[0]) + lo[1]
                       + encode_id(hi[0]) + hi[1])
            self._pairwise[slot] = key
        return key

    def known_pairwise(self, own_id: int) -> dict[int, tuple[bytes, bytes]]:
        """The pairwise keys derived so far as ``own_id``: peer -> (peer's X25519 key, pairwise key). Secret: for a
        client's own saved state only (``ClientSession.to_state``)."""
        return {peer: (agreement, key) for (own, peer, agreement), key in self._pairwise.items() if own == own_id}

    def remember_pairwise(self, own_id: int, known: Mapping[int, tuple[bytes, bytes]]) -> None:
        """Take back what :meth:`known_pairwise` gave (an entry is used only while the registry still names the same
        key for its peer)."""
        for peer, (agreement, key) in known.items():
            self._pairwise[(own_id, int(peer), bytes(agreement))] = bytes(key)


class IdentityRegistry:
    """The deployment's out-of-band record of who is who: client id -> Ed25519 public key (32 raw bytes).

    Build it from raw public keys (``IdentityRegistry({id: key_bytes})``); it is immutable. A client or server given a
    registry runs the malicious-server variant and accepts a signature only from the key registered for its signer.
    """

    def __init__(self, public_keys: Mapping[int, bytes | Ed25519PublicKey]):
        keys = {}
        for client_id, raw in dict(public_keys).items():
            if isinstance(client_id, bool) or not isinstance(client_id, int) or not 1 <= client_id < 2 ** 63:
                raise ValueError(f"registry ids must be client ids (integers in [1, 2^63)), got {client_id!r}")
            if isinstance(raw, Ed25519PublicKey):
                keys[client_id] = raw
                continue
            if not isinstance(raw, (bytes, bytearray)) or len(raw) != 32:
                raise ValueError(f"the identity key of client {client_id} must be 32 raw Ed25519 public-key bytes")
            keys[client_id] = Ed25519PublicKey.from_public_bytes(bytes(raw))
        raws = {c: k.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw) for c, k in keys.items()}
        if len(set(raws.values())) != len(raws):
            raise ValueError("two clients share one identity key; every client needs its own")
        agreement = {}
        for c, raw in raws.items():
            try:
                agreement[c] = montgomery_public_bytes(raw)
            except ValueError as exc:
                raise ValueError(f"the identity key of client {c}: {exc}") from None
        if len(set(agreement.values())) != len(agreement):
            # P and -P share one X25519 form: a registry holding both would give two ids one pairwise key material
            raise ValueError("two identity keys differ only in sign (one X25519 form); every client needs its own")
        self._keys = keys
        self._agreement = agreement

    def __contains__(self, client_id) -> bool:
        return client_id in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def ids(self) -> frozenset[int]:
        return frozenset(self._keys)

    def public_key(self, client_id: int) -> Ed25519PublicKey:
        return self._keys[client_id]

    def agreement_key(self, client_id: int) -> bytes:
        """The static X25519 public key of ``client_id``'s identity (``montgomery_public_bytes``). ValueError for an
        unregistered id."""
        key = self._agreement.get(client_id)
        if key is None:
            raise ValueError(f"client {client_id!r} is not in the identity registry")
        return key

    def verify(self, signature: bytes, purpose: bytes, session_id: bytes, signer: int, *parts: bytes) -> bool:
        """True iff ``signature`` is ``signer``'s registered key's signature of this transcript."""
        key = self._keys.get(signer)
        if key is None or not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            return False
        try:
            key.verify(signature, _transcript(purpose, session_id, signer, parts))
        except InvalidSignature:
            return False
        return True
