import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy import stats

from privfl.secure_agg import primitives as P

SESSION = b"s" * 32
KEY = bytes(range(32))


def test_key_agreement_is_symmetric_and_keys_are_domain_separated():
    a, b = P.generate_private_key(), P.generate_private_key()
    shared = P.key_agreement(a, P.public_bytes(b))
    assert shared == P.key_agreement(b, P.public_bytes(a)) and len(shared) == 32
    assert P.pairwise_mask_key(shared, SESSION, 3, 7) == P.pairwise_mask_key(shared, SESSION, 7, 3)
    derived = {P.pairwise_mask_key(shared, SESSION, 3, 7), P.pairwise_mask_key(shared, SESSION, 3, 8),
               P.pairwise_mask_key(shared, b"t" * 32, 3, 7), P.share_encryption_key(shared, SESSION),
               P.self_mask_key(shared, SESSION, 3)}
    assert len(derived) == 5


def test_key_agreement_rejects_malformed_and_low_order_keys():
    a = P.generate_private_key()
    with pytest.raises(ValueError):
        P.key_agreement(a, b"\x00" * 31)
    with pytest.raises(ValueError):
        P.key_agreement(a, b"\x00" * 32)  # the identity point gives an all-zero secret


def test_private_key_round_trips_through_bytes():
    a = P.generate_private_key()
    assert P.public_bytes(P.private_key_from_bytes(P.private_bytes(a))) == P.public_bytes(a)


@pytest.mark.parametrize("bits", [1, 8, 32, 33, 64])
def test_mask_is_the_little_endian_keystream_reduced_mod_2k(bits):
    d = 1000
    mask = P.prg_mask(KEY, d, bits)
    word = 4 if bits <= 32 else 8
    stream = Cipher(algorithms.AES(KEY), modes.CTR(bytes(16))).encryptor().update(bytes(word * d))
    expected = [int.from_bytes(stream[i * word:(i + 1) * word], "little") % (1 << bits) for i in range(d)]
    assert mask.tolist() == expected
    assert np.array_equal(mask, P.prg_mask(KEY, d, bits))  # deterministic in the key


@pytest.mark.parametrize("bits", [8, 40])
def test_mask_values_are_uniform_chi_square(bits):
    d = 256 * 400
    mask = P.prg_mask(KEY, d, bits).astype(np.uint64) & np.uint64(255)  # low byte of Z_{2^bits} is uniform too
    counts = np.bincount(mask.astype(np.int64), minlength=256)
    assert stats.chisquare(counts).pvalue > 1e-4


def test_mask_bits_are_fair_for_64_bit_words():
    d = 100_000
    mask = P.prg_mask(KEY, d, 64)
    ones = np.array([((mask >> np.uint64(b)) & np.uint64(1)).sum() for b in range(64)], dtype=float)
    z = (ones - d / 2) / np.sqrt(d / 4)
    assert np.abs(z).max() < 5


def test_expander_add_then_subtract_cancels_and_wraps():
    expander = P.MaskExpander(1000, 32)
    acc = np.full(1000, 2 ** 32 - 1, dtype=np.uint32)
    before = acc.copy()
    expander.add(acc, KEY, +1)
    assert not np.array_equal(acc, before)
    expander.add(acc, KEY, -1)
    assert np.array_equal(acc, before)


def test_word_dtype_validates_bits():
    assert P.word_dtype(32) == np.dtype("<u4") and P.word_dtype(33) == np.dtype("<u8")
    for bad in (0, 65, 3.0, True):
        with pytest.raises(ValueError):
            P.word_dtype(bad)


def test_share_encryption_round_trip_and_binding():
    key = P.hkdf(b"k" * 32, salt=SESSION, info=b"test")
    ct = P.encrypt_share(key, b"secret share", session_id=SESSION, sender=1, recipient=2)
    assert P.decrypt_share(key, ct, session_id=SESSION, sender=1, recipient=2) == b"secret share"
    tampered = ct[:-1] + bytes([ct[-1] ^ 1])
    cases = [
        (key, tampered, SESSION, 1, 2),        # tampered ciphertext
        (key, ct, b"o" * 32, 1, 2),            # replayed into another session
        (key, ct, SESSION, 1, 3),              # misaddressed
        (key, ct, SESSION, 2, 1),              # reflected back to its sender
        (bytes(32), ct, SESSION, 1, 2),        # wrong key
        (key, ct[:20], SESSION, 1, 2),         # truncated
    ]
    for k, c, session, sender, recipient in cases:
        with pytest.raises(P.InvalidTag):
            P.decrypt_share(k, c, session_id=session, sender=sender, recipient=recipient)


def test_ciphertexts_use_fresh_nonces():
    key = bytes(32)
    assert P.encrypt_share(key, b"x", session_id=SESSION, sender=1, recipient=2) != \
        P.encrypt_share(key, b"x", session_id=SESSION, sender=1, recipient=2)
