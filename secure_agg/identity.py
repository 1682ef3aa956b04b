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
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .primitives import PROTOCOL_LABEL, encode_id

__all__ = ["IdentityRegistry", "generate_identity", "identity_public_bytes", "sign", "SIGNATURE_BYTES",
           "KEYS_PURPOSE", "INPUT_PURPOSE", "SURVIVORS_PURPOSE", "digest", "encode_ids", "bundle_digest",
           "transcript_hash"]

SIGNATURE_BYTES = 64
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


def transcript_hash(session_id: bytes, entries: Iterable[tuple[int, bytes]]) -> bytes:
    """The session's transcript hash: SHA-256 over the session id and every (client id, bundle digest) the server
    announced, in client-id order. Signatures made after the keys are advertised cover it."""
    body = b"".join(encode_id(c) + d for c, d in sorted(entries))
    return hashlib.sha256(PROTOCOL_LABEL + b"/transcript" + _framed(session_id, body)).digest()


def _transcript(purpose: bytes, session_id: bytes, signer: int, parts: tuple[bytes, ...]) -> bytes:
    out = [PROTOCOL_LABEL, b"/sig/", purpose, len(session_id).to_bytes(2, "big"), session_id, encode_id(signer)]
    for part in parts:
        out += [len(part).to_bytes(4, "big"), part]
    return b"".join(out)


def sign(key: Ed25519PrivateKey, purpose: bytes, session_id: bytes, signer: int, *parts: bytes) -> bytes:
    return key.sign(_transcript(purpose, session_id, signer, parts))


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
        raws = [k.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw) for k in keys.values()]
        if len(set(raws)) != len(raws):
            raise ValueError("two clients share one identity key; every client needs its own")
        self._keys = keys

    def __contains__(self, client_id) -> bool:
        return client_id in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def ids(self) -> frozenset[int]:
        return frozenset(self._keys)

    def public_key(self, client_id: int) -> Ed25519PublicKey:
        return self._keys[client_id]

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
