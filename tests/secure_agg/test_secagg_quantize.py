import numpy as np
import pytest

from privfl.secure_agg import QuantisationRangeError, Quantiser, noise_headroom


def test_default_step_is_the_finest_that_cannot_wrap():
    q = Quantiser(low=-1.0, high=1.0, bits=16, n_clients=10)
    assert q.max_level == (2 ** 15 - 1) // 10
    assert q.n_clients * q.max_level <= 2 ** 15 - 1
    assert q.step == pytest.approx(1.0 / q.max_level)


def test_quantise_then_decode_is_within_one_step():
    rng = np.random.default_rng(0)
    q = Quantiser(low=-3.0, high=5.0, bits=24, n_clients=4)
    xs = [rng.uniform(-3, 5, size=200) for _ in range(4)]
    total = np.zeros(200, dtype=np.uint64)
    for x in xs:
        total = (total + q.quantise(x, rng)) % np.uint64(q.modulus)
    assert np.abs(q.decode_sum(total, 4) - sum(xs)).max() <= 4 * q.step + 1e-9


def test_stochastic_rounding_is_unbiased():
    rng = np.random.default_rng(1)
    q = Quantiser(low=-1.0, high=1.0, bits=8, n_clients=1)
    x = np.full(200_000, 0.3 * q.step + 2 * q.step)  # between two grid points, 30% of the way
    ints = q.to_integers(x, rng)
    assert set(np.unique(ints)) == {2, 3}
    mean = ints.mean()
    se = np.sqrt(0.3 * 0.7 / x.size)
    assert abs(mean - 2.3) < 5 * se
    # and it is exact on grid points
    assert np.array_equal(q.to_integers(np.array([0.0, q.step, -q.step]), rng), [0, 1, -1])


@pytest.mark.parametrize("bad", [np.array([1.0000001]), np.array([-2.0]), np.array([np.nan]), np.array([np.inf])])
def test_values_outside_the_range_raise_instead_of_wrapping(bad):
    q = Quantiser(low=-1.0, high=1.0, bits=16, n_clients=2)
    with pytest.raises(QuantisationRangeError, match="outside the declared range"):
        q.quantise(bad, np.random.default_rng(0))


@pytest.mark.parametrize("bits", [8, 32, 64])
def test_sums_at_the_edge_of_the_modulus_decode_exactly(bits):
    rng = np.random.default_rng(2)
    n = 7
    q = Quantiser(low=-1.0, high=1.0, bits=bits, n_clients=n)
    for edge in (1.0, -1.0):
        words = [q.quantise(np.full(5, edge), rng) for _ in range(n)]
        total = np.zeros(5, dtype=object)
        for w in words:
            total = (total + w.astype(object)) % q.modulus
        total = total.astype(np.uint64)
        signed = q.centred(total)
        assert np.all(signed == int(np.sign(edge)) * n * q.max_level)
        if bits <= 53:
            assert abs(abs(int(signed[0])) - (2 ** (bits - 1) - 1)) < n  # the budget is used up to the last client
        assert np.allclose(q.decode_sum(total, n), n * edge)


def test_noise_headroom_is_reserved_and_enforced():
    q = Quantiser(low=-1.0, high=1.0, bits=16, n_clients=10, noise_headroom=1000)
    assert q.n_clients * q.max_level + 1000 <= 2 ** 15 - 1
    ok = np.array([q.max_level + 1000, -(q.max_level + 1000)])
    assert np.array_equal(q.centred(q.encode(ok)), ok)
    with pytest.raises(QuantisationRangeError):
        q.encode(np.array([q.max_level + 1001]))
    assert noise_headroom(3.0) == 30


def test_an_explicit_step_that_could_wrap_is_refused_with_advice():
    with pytest.raises(ValueError, match="use more bits"):
        Quantiser(low=-1.0, high=1.0, bits=8, n_clients=10, step=0.01)
    assert Quantiser(low=-1.0, high=1.0, bits=16, n_clients=10, step=0.01).max_level == 100


@pytest.mark.parametrize("kwargs", [dict(low=1.0, high=1.0), dict(bits=1), dict(bits=65), dict(n_clients=0),
                                    dict(noise_headroom=-1), dict(low=float("nan")), dict(bits=4, n_clients=100)])
def test_constructor_validates(kwargs):
    args = dict(low=-1.0, high=1.0, bits=16, n_clients=2)
    args.update(kwargs)
    with pytest.raises(ValueError):
        Quantiser(**args)


def test_decode_refuses_more_clients_than_sized_for_and_rng_is_required():
    q = Quantiser(low=-1.0, high=1.0, bits=16, n_clients=2)
    with pytest.raises(ValueError, match="n_summed"):
        q.decode_sum(np.zeros(3, dtype=np.uint64), 3)
    with pytest.raises(TypeError):
        q.to_integers(np.zeros(3), rng=np.random.RandomState(0))


def test_rounded_sensitivity_adds_sqrt_d():
    q = Quantiser(low=-1.0, high=1.0, bits=16, n_clients=2, step=0.01)
    assert q.rounded_l2_sensitivity(1.0, 100) == pytest.approx(100 + 10)
