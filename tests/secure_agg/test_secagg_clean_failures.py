"""Crash cases of issue 14 at the package level: each is now exact, or a clean refusal or abort."""

import numpy as np
import pytest

from privfl.secure_agg import ProtocolAbort, Quantiser, QuantisationRangeError, run_round

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("bits", [2, 8, 31, 32, 33, 62, 63, 64])
def test_centred_decoding_is_exact_at_every_width_including_63_bits(bits):
    q = Quantiser(low=-1.0, high=1.0, bits=bits, n_clients=1)
    half = 1 << (bits - 1)
    words = np.array([0, 1, half - 1, half, (1 << bits) - 1], dtype=np.uint64)
    expected = [0, 1, half - 1, -half, -1]
    assert q.centred(words).tolist() == expected


def test_63_bit_quantised_sums_decode_exactly():
    q = Quantiser(low=-1.0, high=1.0, bits=63, n_clients=3)
    rng = np.random.default_rng(0)
    values = [np.array([0.5, -0.25, 1.0, -1.0]), np.array([-1.0, 0.75, 0.0, -1.0]), np.array([0.1, 0.1, -0.3, -1.0])]
    total = sum(q.quantise(v, rng) for v in values) & np.uint64((1 << 63) - 1)
    np.testing.assert_allclose(q.decode_sum(total, 3), sum(values), atol=3 * q.step)


def test_a_range_wider_than_float64_is_refused():
    with pytest.raises(QuantisationRangeError, match="wider than float64"):
        Quantiser(low=-1.5e308, high=1.5e308, bits=32, n_clients=2)


def test_run_round_with_fewer_clients_than_min_inputs_aborts_instead_of_raising_a_value_error():
    values = {k: np.zeros(4, dtype=np.uint64) for k in "abc"}
    with pytest.raises(ProtocolAbort, match="fewer than min_inputs=4"):
        run_round(values, bits=16, min_inputs=4)


def test_the_consistency_stage_is_only_a_drop_stage_of_the_malicious_variant():
    values = {k: np.zeros(4, dtype=np.uint64) for k in "abcd"}
    with pytest.raises(ValueError, match="consistency check only in the malicious variant"):
        run_round(values, bits=16, drop_at={"consistency_check": ["a"]})
