"""Parameters that carry their guarantee (issue 14): derivation, refusal, and an exhaustive property test that no set of
messages the server can collect reveals a sum over fewer than the declared minimum of honest clients."""

from __future__ import annotations

import itertools

import pytest

from privfl.secure_agg import client as client_module
from privfl.secure_agg import protocol
from privfl.secure_agg.params import ParameterError, check_parameters, derive_parameters, threshold_for
from privfl.secure_agg.protocol import SessionConfig

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------------------------------------- derivation, refusal
def test_derived_parameters_pass_their_own_check_and_grow_with_the_threat():
    for n in (5, 12, 40, 100, 300):
        previous = 0
        for dropout in (0.0, 0.1, 0.2, 0.3):
            p = derive_parameters(n, dropout=dropout)
            check_parameters(n, p.degree, p.threshold, dropout=dropout)
            assert p.degree >= previous and 2 * p.threshold > p.degree + 1
            previous = p.degree
    active = derive_parameters(50, dropout=0.1, corruption=0.1, malicious=True)
    assert active.degree == 49 and 2 * active.threshold - 50 > 5  # Bonawitz Thm 6.4: t > (n + corrupt) / 2


@pytest.mark.parametrize("n, degree, threshold, kwargs, needle", [
    (200, 2, 2, dict(dropout=0.16), "live holders|cut the graph"),  # the k = 2 configuration
    (200, 8, 5, dict(dropout=0.16), "fewer than 5 live holders"),
    (100, 20, 11, dict(dropout=0.1, corruption=0.05, malicious=True), "sparse graph unseen"),
    (9, 8, 5, dict(corruption=0.34, malicious=True), "Thm. 6.4"),
    (9, 8, 5, dict(dropout=0.6), "fewer than the threshold"),
])
def test_parameters_outside_the_bounds_are_refused_with_what_to_change(n, degree, threshold, kwargs, needle):
    with pytest.raises(ParameterError, match=needle) as info:
        check_parameters(n, degree, threshold, **kwargs)
    assert "degree=" in str(info.value) or "no degree" in str(info.value)
    with pytest.raises(ParameterError):
        SessionConfig.create(range(1, n + 1), bits=16, dimension=1, degree=degree, threshold=threshold, **kwargs)
    # the explicit, documented opt-out (tests only)
    SessionConfig.create(range(1, n + 1), bits=16, dimension=1, degree=degree, threshold=threshold, check=False,
                         **kwargs)


def test_session_config_derives_degree_and_threshold_from_the_declared_threat():
    config = SessionConfig.create(range(1, 101), bits=16, dimension=1, dropout=0.2)
    p = derive_parameters(100, dropout=0.2)
    assert (config.degree, config.threshold) == (p.degree, p.threshold)
    with pytest.raises(ParameterError, match="no degree and threshold protect"):
        derive_parameters(4, dropout=0.3, corruption=0.3, malicious=True)


# ---------------------------------------------------------------------------------------------- the property
def learnable_sums(config, corrupt: frozenset, alive: frozenset, decide) -> list[frozenset]:
    """The smallest sets of honest clients whose input sum the server (with the corrupt clients) can compute, when it
    announces survivor set ``alive`` (one set: the consistency round) and each honest survivor reveals iff
    ``decide(config, client, alive)`` is None and it keeps ``threshold`` live holders (the client's own checks).

    Honest survivors that reveal give the self-seed share of survivors and the mask-key share of the others; corrupt
    clients give every share. A linear combination of the masked inputs is free of masks iff it is constant on each
    connected component of the honest clients joined by the pairwise masks the server cannot remove, and zero on
    those with an unknown self mask: the learnable sums are those components with all self masks known.
    """
    t, ids = config.threshold, config.client_ids
    honest = [c for c in ids if c not in corrupt]
    revealers = {c for c in honest if c in alive and decide(config, c, alive) is None
                 and len(config.holders(c) & alive) >= t}

    def shares(owner, of_seed: bool) -> int:
        helpers = config.holders(owner) & revealers if (owner in alive) == of_seed else set()
        return len(helpers) + len(config.holders(owner) & corrupt)

    seed_known = {c for c in honest if shares(c, True) >= t}
    key_known = {c for c in honest if shares(c, False) >= t} | set(corrupt)
    parent = {c: c for c in honest}

    def find(c):
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    for a in honest:
        for v in config.neighbours(a):
            if v in parent and a not in key_known and v not in key_known:
                parent[find(a)] = find(v)
    groups: dict[int, set] = {}
    for c in honest:
        groups.setdefault(find(c), set()).add(c)
    return [frozenset(g) for g in groups.values() if g <= seed_known]


def _configs():
    seed = bytes(range(32))
    out = []
    for n in (4, 5, 6, 7, 8):
        for dropout, corruption in ((0.0, 0.0), (0.2, 0.0), (0.3, 0.0), (0.0, 0.15), (0.2, 0.15), (0.15, 0.25)):
            try:
                p = derive_parameters(n, dropout=dropout, corruption=corruption, malicious=True)
            except ParameterError:
                continue
            out.append((n, p.degree, p.threshold, p.min_inputs, p.max_corrupt, seed))
    for n, degree in ((9, 2), (10, 4), (11, 4), (12, 6)):  # sparse graphs: accepted without corruption
        for min_inputs in (None, 6):
            t = threshold_for(n, degree, malicious=True)
            check_parameters(n, degree, t, malicious=True)
            out.append((n, degree, t, max(t, min_inputs or t), 0, seed))
    return out


def _exhaust(n, degree, threshold, min_inputs, max_corrupt, seed, decide):
    config = SessionConfig(session_id=bytes(16), client_ids=tuple(range(1, n + 1)), bits=8, dimension=1,
                           threshold=threshold, degree=degree, graph_seed=seed, min_inputs=min_inputs, malicious=True)
    floor = config.required_inputs - max_corrupt
    worst, learned_anything = None, False
    ids = config.client_ids
    for size in range(max_corrupt + 1):
        for corrupt in itertools.combinations(ids, size):
            corrupt = frozenset(corrupt)
            for r in range(n + 1):
                for alive in itertools.combinations(ids, r):
                    for group in learnable_sums(config, corrupt, frozenset(alive), decide):
                        learned_anything = True
                        if worst is None or len(group) < len(worst[0]):
                            worst = (group, corrupt, alive)
    return floor, worst, learned_anything


@pytest.mark.parametrize("n, degree, threshold, min_inputs, max_corrupt, seed", _configs(),
                         ids=lambda v: v.hex()[:4] if isinstance(v, bytes) else str(v))
def test_no_survivor_set_reveals_a_sum_over_fewer_than_the_declared_honest_minimum(n, degree, threshold, min_inputs,
                                                                                   max_corrupt, seed):
    floor, worst, learned_anything = _exhaust(n, degree, threshold, min_inputs, max_corrupt, seed,
                                              protocol.survivor_set_problem)
    assert learned_anything  # the honest total is learnable: the test looks at real outcomes
    assert floor >= 1 and len(worst[0]) >= floor, f"sum over {sorted(worst[0])} with corrupt {sorted(worst[1])}"
    assert client_module.survivor_set_problem is protocol.survivor_set_problem  # the rule the clients really apply


def test_the_property_fails_without_the_clients_checks():
    """Control: with only the threshold check (the old clients), chosen survivor sets reveal small sub-sums."""
    n, degree, seed = 12, 4, bytes(range(32))
    t = threshold_for(n, degree, malicious=True)
    floor, worst, _ = _exhaust(n, degree, t, 6, 0, seed, lambda config, c, alive: None)
    assert len(worst[0]) < floor


def test_declared_corruption_raises_the_default_floor_to_two_honest_clients():
    p = derive_parameters(1000, dropout=0.1, corruption=0.1)
    assert p.min_honest >= 2 and p.min_inputs == 102
    config = SessionConfig.create(range(1, 41), bits=16, dimension=1, dropout=0.1, corruption=0.1)
    assert config.min_inputs - 4 >= 2  # 4 corrupt of 40
    with pytest.raises(ParameterError, match="declare dropout"):
        SessionConfig.create(range(1, 41), bits=16, dimension=1, corruption=0.1)


@pytest.mark.parametrize("n, dropout, corruption", [(40, 0.1, 0.05), (60, 0.1, 0.1)])
def test_semi_honest_sparse_parameters_hold_for_random_corruption_and_dropouts(n, dropout, corruption):
    """The semi-honest guarantee on a sparse graph is probabilistic (corrupt clients and dropouts independent of the
    graph seed): sample both, with a fresh graph seed each time, and check every learnable sum."""
    import random

    p = derive_parameters(n, dropout=dropout, corruption=corruption)
    assert p.degree < n - 1  # really sparse
    rng = random.Random(0)
    learned = 0
    for trial in range(150):
        config = SessionConfig(session_id=bytes(16), client_ids=tuple(range(1, n + 1)), bits=8, dimension=1,
                               threshold=p.threshold, degree=p.degree, graph_seed=rng.randbytes(32),
                               min_inputs=p.min_inputs)
        corrupt = frozenset(rng.sample(config.client_ids, p.max_corrupt))
        alive = frozenset(config.client_ids) - frozenset(rng.sample(config.client_ids, p.max_dropped))
        for group in learnable_sums(config, corrupt, alive, protocol.survivor_set_problem):
            assert len(group) >= p.min_honest, (trial, sorted(group))
            learned += 1
    assert learned >= 140  # almost always the honest survivors' total (the round succeeds), and nothing smaller
