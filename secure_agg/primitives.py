"""Cryptographic primitives of the protocol, all from ``cryptography``.

- key agreement: X25519 (RFC 7748);
- key derivation: HKDF-SHA256 (RFC 5869), salted with the session id, with a distinct ``info`` per purpose;
- mask PRG: AES-256-CTR keyed by HKDF of the *full* 32-byte shared secret (or self-mask seed); its keystream is read as
  little-endian unsigned words (uint32 when k <= 32, else uint64) and reduced mod 2^k. Because 2^k divides 2^32
  (or 2^64), a uniform word reduced mod 2^k is exactly uniform on Z_{2^k}: no modulo bias;
- share transport: AES-256-GCM with a random 96-bit nonce, the session id, sender and recipient bound in the associated
  data, so a ciphertext replayed from another session, reflected, or delivered to the wrong client fails to decrypt.

Masks are generated and added with numpy in one pass over a reused buffer (no per-element Python loop).
"""

from __future__ import annotations

import os

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = [
    "PROTOCOL_LABEL", "InvalidTag", "KEY_BYTES", "SEED_BYTES",
    "generate_private_key", "public_bytes", "private_bytes", "private_key_from_bytes", "load_public_key",
    "key_agreement", "hkdf",
    "pairwise_mask_key", "self_mask_key", "seed_commitment", "share_encryption_key", "encode_id",
    "word_dtype", "reduce_mod", "MaskExpander", "prg_mask", "encrypt_share", "decrypt_share", "random_seed",
]

PROTOCOL_LABEL = b"privfl/secagg/v1"
KEY_BYTES = 32
SEED_BYTES = 32
_NONCE_BYTES = 12
_CTR_NONCE = bytes(16)  # every mask key is used for exactly one keystream, so a fixed counter block is safe


def random_seed() -> bytes:
    """32 bytes from the operating system's CSPRNG (self-mask seeds, session ids, graph seeds)."""
    return os.urandom(SEED_BYTES)


def generate_private_key() -> X25519PrivateKey:
    return X25519PrivateKey.generate()


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def private_key_from_bytes(raw: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(raw)


def load_public_key(raw: bytes) -> X25519PublicKey:
    """Parse a 32-byte X25519 public key (ValueError if malformed)."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != KEY_BYTES:
        raise ValueError("an X25519 public key is 32 raw bytes")
    return X25519PublicKey.from_public_bytes(bytes(raw))


def key_agreement(private_key: X25519PrivateKey, peer_public: bytes | X25519PublicKey) -> bytes:
    """X25519 shared secret (32 bytes). Raises ValueError for a malformed or low-order peer key."""
    if not isinstance(peer_public, X25519PublicKey):
        peer_public = load_public_key(peer_public)
    return private_key.exchange(peer_public)


def hkdf(secret: bytes, *, salt: bytes, info: bytes, length: int = KEY_BYTES) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(secret)


def encode_id(client_id: int) -> bytes:
    return int(client_id).to_bytes(8, "big")


def pairwise_mask_key(shared_secret: bytes, session_id: bytes, a: int, b: int) -> bytes:
    """AES key of the mask shared by clients a and b (symmetric in a, b)."""
    lo, hi = sorted((int(a), int(b)))
    return hkdf(shared_secret, salt=session_id, info=PROTOCOL_LABEL + b"/pairwise-mask" + encode_id(lo) + encode_id(hi))


def self_mask_key(seed: bytes, session_id: bytes, owner: int) -> bytes:
    """AES key of the self mask of ``owner`` (double masking, Bonawitz et al. 2017, Sec. 4)."""
    return hkdf(seed, salt=session_id, info=PROTOCOL_LABEL + b"/self-mask" + encode_id(owner))


def seed_commitment(seed: bytes, session_id: bytes, owner: int) -> bytes:
    """A binding commitment to a self-mask seed (HKDF of the 32 random bytes; hiding since the seed is uniform). The
    server checks a reconstructed seed against it, so a corrupted share can never silently change the sum."""
    return hkdf(seed, salt=session_id, info=PROTOCOL_LABEL + b"/seed-commitment" + encode_id(owner))


def share_encryption_key(shared_secret: bytes, session_id: bytes) -> bytes:
    return hkdf(shared_secret, salt=session_id, info=PROTOCOL_LABEL + b"/share-encryption")


def word_dtype(bits: int) -> np.dtype:
    """Machine word that holds Z_{2^bits}: uint32 for bits <= 32, else uint64 (little-endian)."""
    if not isinstance(bits, (int, np.integer)) or isinstance(bits, bool) or not 1 <= bits <= 64:
        raise ValueError(f"bits must be an integer in [1, 64], got {bits!r}")
    return np.dtype("<u4") if bits <= 32 else np.dtype("<u8")


def reduce_mod(words: np.ndarray, bits: int) -> np.ndarray:
    """Reduce in place mod 2^bits (a bit mask, exact because 2^bits divides the word modulus)."""
    if bits < 8 * words.dtype.itemsize:
        np.bitwise_and(words, words.dtype.type((1 << bits) - 1), out=words)
    return words


class MaskExpander:
    """Expands 32-byte keys into AES-CTR keystreams of ``dimension`` words and adds/subtracts them to an accumulator.

    Reuses one zero plaintext and one output buffer, so each mask costs one AES pass plus one numpy add. Arithmetic is
    mod 2^32 or 2^64 (native unsigned wrap-around); reduce mod 2^k once at the end with ``reduce_mod``.
    """

    def __init__(self, dimension: int, bits: int):
        if not isinstance(dimension, (int, np.integer)) or dimension < 1:
            raise ValueError(f"dimension must be a positive integer, got {dimension!r}")
        self.dimension = int(dimension)
        self.bits = int(bits)
        self.dtype = word_dtype(bits)
        nbytes = self.dimension * self.dtype.itemsize
        self._zeros = bytes(nbytes)
        self._out = bytearray(nbytes + 15)
        self._view = np.frombuffer(self._out, dtype=self.dtype, count=self.dimension)

    def keystream(self, key: bytes) -> np.ndarray:
        """The keystream as words, a view into an internal buffer overwritten by the next call."""
        encryptor = Cipher(algorithms.AES(key), modes.CTR(_CTR_NONCE)).encryptor()
        encryptor.update_into(self._zeros, self._out)
        return self._view

    def add(self, accumulator: np.ndarray, key: bytes, sign: int = 1) -> None:
        stream = self.keystream(key)
        if sign > 0:
            np.add(accumulator, stream, out=accumulator)
        else:
            np.subtract(accumulator, stream, out=accumulator)

    def zeros(self) -> np.ndarray:
        return np.zeros(self.dimension, dtype=self.dtype)


def prg_mask(key: bytes, dimension: int, bits: int) -> np.ndarray:
    """One mask in Z_{2^bits}^dimension (a fresh array, reduced)."""
    expander = MaskExpander(dimension, bits)
    return reduce_mod(expander.keystream(key).copy(), bits)


def _aad(session_id: bytes, sender: int, recipient: int) -> bytes:
    return PROTOCOL_LABEL + b"/share" + len(session_id).to_bytes(2, "big") + session_id + encode_id(sender) + \
        encode_id(recipient)


def encrypt_share(key: bytes, plaintext: bytes, *, session_id: bytes, sender: int, recipient: int) -> bytes:
    """AES-GCM; returns nonce || ciphertext || tag."""
    nonce = os.urandom(_NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, _aad(session_id, sender, recipient))


def decrypt_share(key: bytes, ciphertext: bytes, *, session_id: bytes, sender: int, recipient: int) -> bytes:
    """Inverse of ``encrypt_share``; raises ``InvalidTag`` if the key, session, sender, recipient or bytes differ."""
    if len(ciphertext) < _NONCE_BYTES + 16:
        raise InvalidTag()
    return AESGCM(key).decrypt(ciphertext[:_NONCE_BYTES], ciphertext[_NONCE_BYTES:],
                               _aad(session_id, sender, recipient))
