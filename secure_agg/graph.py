"""The sparse neighbour graph of Bell et al. (CCS 2020, "Secure single-server aggregation with (poly)logarithmic
overhead").

Each client masks only with, and secret-shares only to, its k neighbours, so a client's work is O(k d) instead of
O(n d). We use a Harary graph (a ring where each node links to the k/2 nodes on either side, exactly k-regular) over a
uniformly random relabelling of the clients derived from a public 32-byte seed: the labelling is random, the degree
exact, and every party recomputes the same graph from the seed. With k >= n - 1 it is the complete graph of Bonawitz
et al. (CCS 2017).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

__all__ = ["default_degree", "neighbour_graph"]


def default_degree(n_clients: int) -> int:
    """A k = O(log n) degree: the smallest even number >= 4 log2(n), or n - 1 (complete graph) if that is smaller.

    A heuristic in the spirit of Bell et al.: large enough that random dropouts of a few tens of percent leave every
    neighbourhood a majority of survivors with high probability. For a degree that carries a guarantee, declare the
    dropout (and corruption) to ``SessionConfig.create`` or use ``params.derive_parameters``.
    """
    if n_clients < 2:
        raise ValueError("secure aggregation needs at least 2 clients")
    k = 2 * math.ceil(2 * math.log2(n_clients))
    return min(k, n_clients - 1)


def neighbour_graph(client_ids: Sequence[int], degree: int, seed: bytes) -> dict[int, frozenset[int]]:
    """Symmetric neighbour sets (a client is not its own neighbour).

    ``degree >= n - 1`` gives the complete graph; otherwise ``degree`` must be even and >= 2.
    """
    ids = list(client_ids)
    n = len(ids)
    if len(set(ids)) != n:
        raise ValueError("client ids must be distinct")
    if n < 2:
        raise ValueError("secure aggregation needs at least 2 clients")
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"degree must be a positive integer, got {degree!r}")
    if degree >= n - 1:
        everyone = frozenset(ids)
        return {c: everyone - {c} for c in ids}
    if degree % 2:
        raise ValueError(f"a sparse neighbour graph needs an even degree (got {degree}); use {degree + 1}")
    if not isinstance(seed, (bytes, bytearray)) or len(seed) < 16:
        raise ValueError("the graph seed must be at least 16 random bytes")
    ring = sorted(ids, key=lambda c: hashlib.sha256(bytes(seed) + int(c).to_bytes(8, "big")).digest())
    half = degree // 2
    graph = {}
    for position, c in enumerate(ring):
        graph[c] = frozenset(ring[(position + offset) % n] for offset in range(-half, half + 1) if offset)
    return graph
