import itertools
import os

import pytest

from privfl.secure_agg import shamir


def test_any_threshold_subset_reconstructs_a_32_byte_secret():
    secret = os.urandom(32)
    shares = shamir.split(secret, 3, [1, 2, 5, 9, 11])
    for subset in itertools.combinations(shares.items(), 3):
        assert shamir.int_to_bytes(shamir.combine(subset, 3), 32) == secret
    assert shamir.int_to_bytes(shamir.combine(shares, 3), 32) == secret  # extras are checked, not harmful


def test_fewer_than_threshold_shares_are_refused():
    shares = shamir.split(12345, 3, [1, 2, 3])
    with pytest.raises(ValueError, match="need 3"):
        shamir.combine(list(shares.items())[:2], 3)


def test_corrupted_share_is_detected_when_extra_shares_exist():
    shares = shamir.split(777, 2, [1, 2, 3, 4])
    shares[3] = (shares[3] + 1) % shamir.PRIME
    with pytest.raises(ValueError, match="inconsistent"):
        shamir.combine(shares, 2)


def test_shares_are_randomised():
    assert shamir.split(5, 2, [1, 2]) != shamir.split(5, 2, [1, 2])


@pytest.mark.parametrize("threshold, holders", [(0, [1, 2]), (3, [1, 2]), (2, [1, 1]), (2, [0, 1]),
                                                (2, [1, shamir.PRIME])])
def test_split_validates(threshold, holders):
    with pytest.raises(ValueError):
        shamir.split(1, threshold, holders)


def test_combine_rejects_conflicting_duplicates_and_out_of_field_values():
    with pytest.raises(ValueError):
        shamir.combine([(1, 5), (1, 6)], 1)
    with pytest.raises(ValueError):
        shamir.combine([(1, shamir.PRIME)], 1)
    with pytest.raises(ValueError):
        shamir.bytes_to_int(b"\xff" * 66)
