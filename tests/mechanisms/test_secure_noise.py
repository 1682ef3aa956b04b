"""SecureNoise: full-resolution uniforms, tails without a bound (past the old 53-bit limit of 8.57 sigma and the old
run cap of 37.64 sigma), covering the smallest noise multiplier calibration returns, and a Gaussian output.

Statistical tests draw fresh bits from os.urandom (SecureNoise cannot be seeded); each threshold is set so that a
correct sampler fails with probability below 1e-6.
"""

import math
import os

import numpy as np
import pytest
from scipy import stats

from privfl.accounting.calibration import calibrate
from privfl.accounting.validation import MAX_TARGET_EPSILON, MIN_DELTA
from privfl.mechanisms import ReleaseMisuse, SecureNoise
from privfl.mechanisms.noise import _exponential, _half_uniform, _half_uniform_parts, _radius

P_FAIL = 1e-6
Z_FAIL = stats.norm.isf(P_FAIL / 2)       # two-sided normal threshold, about 4.9
OLD_LIMIT = math.sqrt(-2 * math.log(2.0 ** -53))   # 8.57: the largest radius of 53-bit Box-Muller
OLD_CAP = math.sqrt(2 * 1022 * math.log(2))        # 37.64: the old run cap, V = 2^-1022
ALL_ONES = (1 << 64) - 1


class Stream:
    """A random_bytes function that hands out given 64-bit words in order and fails when they run out."""

    def __init__(self, words):
        self.data = b"".join(int(w).to_bytes(8, "little") for w in words)
        self.pos = 0

    def __call__(self, n):
        if self.pos + n > len(self.data):
            raise AssertionError(f"sampler asked for {n} more bytes than the crafted stream holds")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    @property
    def exhausted(self):
        return self.pos == len(self.data)


class Then:
    """Hands out the given words first, then os.urandom."""

    def __init__(self, words):
        self.head = Stream(words)

    def __call__(self, n):
        if not self.head.exhausted:
            return self.head(n)
        return os.urandom(n)


def random_word():
    return int.from_bytes(os.urandom(8), "little")


def bits_to_words(bits):
    """Pad a bit list with random bits to whole 64-bit words, most significant bit first."""
    bits = list(bits) + [int(b) for b in np.unpackbits(np.frombuffer(os.urandom(8), np.uint8))][:(-len(bits)) % 64]
    return [int("".join(map(str, bits[i:i + 64])), 2) for i in range(0, len(bits), 64)]


def stream_for(upper, run, mantissa):
    """The words that encode U with first bit ``upper``, then ``run`` repeats of it, then the other bit, then the
    52-bit ``mantissa`` (in the same word if it fits after the run, else on top of a fresh word)."""
    s = int(upper)
    head = [s] * (1 + run) + [1 - s]
    if len(head) + 52 <= 64:
        return bits_to_words(head + [(mantissa >> (51 - j)) & 1 for j in range(52)]), []
    return bits_to_words(head), [(mantissa << 12) | (random_word() & 0xFFF)]


def expected_v(run, mantissa):
    return math.ldexp(1 + mantissa * 2.0 ** -52, -(run + 2))


def threshold_stream(r):
    """The words whose U1 is exp(-r^2 / 2) rounded down to 53 significant bits (below 1/2): the draw at which the
    radius passes r. The sampler's radius exceeds r exactly on the U1 below it, an event of probability
    exp(-r^2 / 2) (to 2^-52 relative)."""
    log2_v = -r * r / (2 * math.log(2))
    run = math.ceil(-log2_v) - 2                      # V in [2^-(run + 2), 2^-(run + 1))
    f = 2.0 ** (log2_v + run + 2)                     # in [1, 2)
    head, fresh = stream_for(False, run, int((f - 1) * 2 ** 52))
    return head + fresh


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("run", [0, 1, 9, 10, 11, 12, 40, 51, 52, 53, 61, 62, 63, 64, 65, 127, 128, 500, 1019, 1020,
                                 1021, 1100])
def test_crafted_stream_gives_exactly_its_uniform(upper, run):
    mantissa = random_word() >> 12
    head, fresh = stream_for(upper, run, mantissa)
    stream = Stream(head + fresh)
    v, up = _half_uniform(1, stream)
    assert stream.exhausted
    assert bool(up[0]) == upper
    assert v[0] == expected_v(run, mantissa)


def test_many_crafted_streams_at_once_match_one_at_a_time():
    # The vectorised path: all first words, then continuation words of the long runs in order, then fresh mantissas.
    runs = [3, 11, 0, 70, 10, 52, 200, 5, 62, 1]
    cases = [(bool(i % 3 == 0), r, random_word() >> 12) for i, r in enumerate(runs)]
    encoded = [stream_for(*case) for case in cases]
    first = [head[0] for head, _ in encoded]
    continued = [w for head, _ in encoded for w in head[1:]]
    fresh = [w for _, fresh in encoded for w in fresh]
    stream = Stream(first + continued + fresh)
    v, up = _half_uniform(len(cases), stream)
    assert stream.exhausted
    np.testing.assert_array_equal(up, [u for u, _, _ in cases])
    np.testing.assert_array_equal(v, [expected_v(r, m) for _, r, m in cases])


def test_a_zero_word_takes_the_radius_past_the_old_limit():
    # 64 zero bits: U < 2^-64 whatever follows, so R > sqrt(2 * 64 ln 2) = 9.42.
    for _ in range(200):
        r = _radius(1, Then([0]))
        assert r[0] > 9 > OLD_LIMIT
    r = _radius(1, Stream([0, 1 << 63, 0]))      # U = 2^-65 exactly
    assert r[0] == pytest.approx(math.sqrt(2 * 65 * math.log(2)), rel=1e-15)


def test_a_word_of_ones_gives_a_tiny_radius():
    # U > 1 - 2^-64: log1p keeps its resolution, R = sqrt(2 * -log1p(-V)) with V < 2^-64.
    r = _radius(1, Then([ALL_ONES]))
    assert 0 < r[0] < math.sqrt(2 * 2.0 ** -64) * 1.0001


@pytest.mark.parametrize("run", [1020, 1021, 1100, 5000, 100_000])
def test_runs_past_the_normal_floats_are_counted_to_their_end(run):
    # No cap: the run is counted across as many words as it takes, and E = -ln U1 is computed without forming V.
    mantissa = random_word() >> 12
    head, fresh = stream_for(False, run, mantissa)
    stream = Stream(head + fresh)
    got_run, f, up = _half_uniform_parts(1, stream)
    assert stream.exhausted and not up[0]
    assert got_run[0] == run and f[0] == 1 + mantissa * 2.0 ** -52
    e = _exponential(1, Stream(head + fresh))
    assert e[0] == pytest.approx((run + 2) * math.log(2) - math.log(f[0]), rel=1e-15)
    r = _radius(1, Stream(head + fresh))
    assert r[0] == pytest.approx(math.sqrt(2 * e[0]), rel=1e-15)
    if run > 1020:
        assert r[0] > OLD_CAP
    # Above 1/2 the same run gives U1 within 2^-(run + 1) of 1: a tiny radius (V subnormal or 0 past the floats).
    head, fresh = stream_for(True, run, mantissa)
    e = _exponential(1, Stream(head + fresh))
    assert 0.0 <= e[0] <= max(2.0 ** -(run + 1), 2.0 ** -1074) and np.isfinite(_radius(1, Stream(head + fresh))).all()


@pytest.mark.parametrize("r", [OLD_LIMIT, 10.0, 20.0, OLD_CAP, 37.7, 40.0, 60.0, 100.0, 300.0, 1000.0])
def test_every_multiple_of_sigma_is_passed_at_its_gaussian_probability(r):
    # The radius is decreasing in U1 and equals r at U1 = exp(-r^2/2) (rounded down to 53 bits): it passes r exactly
    # on {U1 < exp(-r^2/2)}, of probability exp(-r^2/2) (2.2e-308 at the old cap, 3.4e-2172 at 100 sigma), never 0.
    words = threshold_stream(r)
    assert _radius(1, Stream(words))[0] == pytest.approx(r, rel=1e-9)


def test_the_smallest_noise_multiplier_calibration_returns_is_covered():
    # Calibration's smallest noise: one unsampled round at the largest target epsilon it accepts (1000). A unit
    # release's neighbours are then 1/z sigmas apart; the coupling bound (module docstring) needs the sampler exact
    # out to B = sqrt(2 (epsilon + ln ceil(d/2) + 800)) sigmas beyond that, here for d = 1e12.
    eps, d = MAX_TARGET_EPSILON, 10 ** 12
    reach_needed = math.sqrt(2 * (eps + math.log(math.ceil(d / 2)) + 800))
    for delta in (MIN_DELTA, 1e-5, 0.999):
        z = calibrate(eps, delta, rounds=1).noise_multiplier
        assert 0.02 < z < 0.04
        reach = 1.0 / z + reach_needed                 # 88 to 109 sigmas
        assert _radius(1, Stream(threshold_stream(reach)))[0] == pytest.approx(reach, rel=1e-9)
        # The old cap at 37.64 sigmas lost more than delta: outputs beyond it under one neighbour, none under the other.
        assert stats.norm.sf(OLD_CAP - 1.0 / z) > delta


def test_random_bytes_must_deliver_what_was_asked():
    with pytest.raises(ValueError, match="returned"):
        _half_uniform(2, lambda n: b"\0" * (n - 1))


def test_run_length_is_geometric_and_the_rest_uniform():
    n = 4_000_000
    v, upper = _half_uniform(n, os.urandom)
    mantissa, exponent = np.frexp(v)
    run = -exponent - 1                          # V in [2^-(run + 2), 2^-(run + 1))
    assert run.min() >= 0
    # Runs 0..K-1 in their own bins (expected count >= 60), the rest in one: P(run = k) = 2^-(k+1).
    k_max = int(math.log2(n / 60))
    counts = np.bincount(np.minimum(run, k_max), minlength=k_max + 1)
    probs = np.array([2.0 ** -(k + 1) for k in range(k_max)] + [2.0 ** -k_max])
    chi2 = stats.chisquare(counts, n * probs)
    assert chi2.pvalue > P_FAIL, (counts, n * probs)
    # The side of 1/2 is a fair coin, and the top 6 bits of the mantissa are uniform.
    assert abs(upper.mean() - 0.5) < Z_FAIL * 0.5 / math.sqrt(n)
    top = ((mantissa * 2 - 1) * 64).astype(np.int64)
    assert stats.chisquare(np.bincount(top, minlength=64)).pvalue > P_FAIL
    # Once the run passes 10 the mantissa comes from a fresh word: it is still uniform there.
    long = top[run > 10]
    assert long.size > 1000
    assert stats.chisquare(np.bincount(long // 8, minlength=8)).pvalue > P_FAIL


def test_radius_squared_is_exponential():
    r = _radius(1_000_000, os.urandom)
    assert stats.kstest(r ** 2 / 2, "expon").pvalue > P_FAIL


def test_moments_and_ks_on_a_million_draws():
    n = 1_000_000
    x = SecureNoise().standard_normal(n)
    assert x.dtype == np.float64 and np.isfinite(x).all()
    assert abs(x.mean()) < Z_FAIL / math.sqrt(n)
    assert abs(x.var() - 1) < Z_FAIL * math.sqrt(2 / n)
    assert abs((x ** 4).mean() - 3) < Z_FAIL * math.sqrt(96 / n)     # var(X^4) = 105 - 9
    assert abs((x > 0).mean() - 0.5) < Z_FAIL * 0.5 / math.sqrt(n)
    assert stats.kstest(x, "norm").pvalue > P_FAIL


@pytest.mark.parametrize("seed", [0, 1, np.random.default_rng(0)])
def test_secure_source_still_refuses_a_seed(seed):
    with pytest.raises(ReleaseMisuse, match="cannot be seeded"):
        SecureNoise(seed=seed)


@pytest.mark.parametrize("shape", [(), 0, 1, 7, (7,), (1, 1), (3, 5), (4, 1, 3), (0, 3)])
def test_shapes(shape):
    x = SecureNoise().standard_normal(shape)
    expected = np.random.default_rng(0).standard_normal(shape)
    assert x.shape == expected.shape
    assert x.dtype == np.float64 and np.isfinite(x).all()
    if x.size > 1:
        assert np.unique(x).size == x.size
