"""Every clip-derived sensitivity holds on random neighbouring inputs (property tests)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from privfl.mechanisms import (InvalidRelease, clip_per_client, clip_per_example, clip_rows, clip_values,
                        cross_sensitivity, squared_sum_sensitivity, sum_sensitivity)

finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)
bounds = st.floats(0.01, 10.0)
adjacency = st.sampled_from(["add_remove", "replace_one"])


def matrices(min_rows=2, max_rows=12, cols=st.integers(1, 6)):
    return cols.flatmap(lambda d: st.integers(min_rows, max_rows).flatmap(
        lambda n: arrays(np.float64, (n, d), elements=finite)))


def neighbour(rows: np.ndarray, adj: str, data) -> tuple[np.ndarray, np.ndarray]:
    """(D, D') differing in one row: removed (add/remove) or replaced by a random row (replace one)."""
    i = data.draw(st.integers(0, len(rows) - 1))
    if adj == "add_remove":
        return rows, np.delete(rows, i, axis=0)
    other = rows.copy()
    other[i] = data.draw(arrays(np.float64, rows.shape[1:], elements=finite))
    return rows, other


@settings(max_examples=150, deadline=None)
@given(rows=matrices(), bound=bounds, adj=adjacency, data=st.data())
def test_sum_of_per_example_clipped_terms(rows, bound, adj, data):
    d, d2 = neighbour(rows, adj, data)
    a = clip_per_example(d, bound, adj)
    b = clip_per_example(d2, bound, adj)
    moved = np.linalg.norm(a.value.sum(0) - b.value.sum(0))
    assert moved <= a.sensitivity * (1 + 1e-9) + 1e-12
    assert a.sensitivity == sum_sensitivity(bound, adj)
    assert np.all(np.linalg.norm(a.value, axis=1) <= bound * (1 + 1e-12))


@settings(max_examples=150, deadline=None)
@given(rows=matrices(), bound=bounds, adj=adjacency, data=st.data())
def test_sum_of_squares_and_outer_products(rows, bound, adj, data):
    d, d2 = neighbour(rows, adj, data)
    a, b = clip_rows(d, bound, adj).value, clip_rows(d2, bound, adj).value
    sens = squared_sum_sensitivity(bound, adj)
    assert np.linalg.norm((a ** 2).sum(0) - (b ** 2).sum(0)) <= sens * (1 + 1e-9) + 1e-12
    assert np.linalg.norm(a.T @ a - b.T @ b) <= sens * (1 + 1e-9) + 1e-12


@settings(max_examples=150, deadline=None)
@given(rows=matrices(), bound=bounds, ybound=bounds, adj=adjacency, data=st.data())
def test_cross_products(rows, bound, ybound, adj, data):
    y = data.draw(arrays(np.float64, (len(rows),), elements=finite))
    full = np.column_stack([rows, y])
    d, d2 = neighbour(full, adj, data)
    phi, phi2 = clip_rows(d[:, :-1], bound).value, clip_rows(d2[:, :-1], bound).value
    t, t2 = clip_values(d[:, -1], ybound).value, clip_values(d2[:, -1], ybound).value
    moved = np.linalg.norm(phi.T @ t - phi2.T @ t2)
    assert moved <= cross_sensitivity(bound, ybound, adj) * (1 + 1e-9) + 1e-12


@settings(max_examples=150, deadline=None)
@given(clients=matrices(min_rows=2, max_rows=8), bound=bounds, adj=adjacency, data=st.data())
def test_sum_of_client_clipped_uploads(clients, bound, adj, data):
    d, d2 = neighbour(clients, adj, data)
    total = sum(clip_per_client(u, bound, adj).value for u in d)
    total2 = sum(clip_per_client(u, bound, adj).value for u in d2)
    assert np.linalg.norm(total - total2) <= sum_sensitivity(bound, adj) * (1 + 1e-9) + 1e-12


def test_clip_reports_what_it_clipped():
    res = clip_per_example(np.array([[3.0, 4.0], [0.3, 0.4]]), 1.0)
    np.testing.assert_array_equal(res.clipped, [True, False])
    np.testing.assert_allclose(res.norms, [5.0, 0.5])
    np.testing.assert_allclose(res.value, [[0.6, 0.8], [0.3, 0.4]])
    assert res.fraction_clipped == 0.5
    assert clip_per_client(np.zeros(3), 1.0).value.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("fn", [clip_per_client, clip_per_example, clip_values])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_inputs_and_bounds_are_refused(fn, bad):
    with pytest.raises(InvalidRelease):
        fn(np.array([[1.0, bad]]), 1.0)
    with pytest.raises(InvalidRelease):
        fn(np.ones((2, 2)), bad)
    with pytest.raises(InvalidRelease):
        fn(np.ones((2, 2)), 0.0)


def test_unknown_adjacency_is_refused():
    with pytest.raises(InvalidRelease, match="adjacency"):
        sum_sensitivity(1.0, "swap")
    with pytest.raises(InvalidRelease, match="2-D"):
        clip_rows(np.ones(3), 1.0)


@pytest.mark.parametrize("shape", [(1, 3), (1, 8192), (1, 8193), (1, 79510), (5, 20000), (256, 31), (3, 0)])
def test_squared_norms_match_a_plain_sum_of_squares(shape):
    """The chunked BLAS dots of the norm clip give each row's sum of squares (float64 tolerance), for rows shorter,
    equal to and longer than a chunk, and for strided rows."""
    from privfl.mechanisms.clipping import _squared_norms
    rows = np.random.default_rng(0).standard_normal(shape)
    expect = np.array([math.fsum(float(v) ** 2 for v in row) for row in rows])
    assert np.allclose(_squared_norms(rows), expect, rtol=1e-12, atol=0)
    wide = np.random.default_rng(1).standard_normal((shape[0], 2 * shape[1]))[:, ::2]  # non-contiguous rows
    assert np.allclose(_squared_norms(wide), [math.fsum(float(v) ** 2 for v in r) for r in wide], rtol=1e-12)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_squared_norms_carry_a_non_finite_entry_in_any_chunk(bad):
    from privfl.mechanisms.clipping import _squared_norms
    for where in (0, 8191, 8192, 20000):
        rows = np.ones((2, 20001))
        rows[1, where] = bad
        out = _squared_norms(rows)
        assert out[0] == 20001.0 and not np.isfinite(out[1])
