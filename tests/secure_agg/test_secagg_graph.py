import pytest

from privfl.secure_agg.graph import default_degree, neighbour_graph

SEED = b"g" * 32


@pytest.mark.parametrize("n, k", [(10, 2), (10, 4), (31, 8), (100, 28)])
def test_sparse_graph_is_k_regular_symmetric_without_self_loops(n, k):
    graph = neighbour_graph(range(1, n + 1), k, SEED)
    for c, peers in graph.items():
        assert len(peers) == k and c not in peers
        assert all(c in graph[p] for p in peers)


def test_graph_is_a_function_of_the_public_seed():
    ids = list(range(1, 41))
    assert neighbour_graph(ids, 6, SEED) == neighbour_graph(list(reversed(ids)), 6, SEED)
    assert neighbour_graph(ids, 6, SEED) != neighbour_graph(ids, 6, b"h" * 32)


@pytest.mark.parametrize("k", [4, 5, 100])
def test_degree_at_least_n_minus_1_gives_the_complete_graph(k):
    graph = neighbour_graph([3, 5, 8, 13, 21], k, SEED)
    assert all(peers == {3, 5, 8, 13, 21} - {c} for c, peers in graph.items())


def test_invalid_graphs_are_refused():
    with pytest.raises(ValueError, match="even"):
        neighbour_graph(range(1, 11), 3, SEED)
    with pytest.raises(ValueError):
        neighbour_graph([1], 1, SEED)
    with pytest.raises(ValueError):
        neighbour_graph([1, 1, 2], 1, SEED)
    with pytest.raises(ValueError):
        neighbour_graph(range(1, 11), 2, b"short")


def test_default_degree_is_logarithmic():
    assert default_degree(5) == 4 and default_degree(100) == 28 and default_degree(10_000) == 2 * 27
    assert default_degree(10_000) < 60
