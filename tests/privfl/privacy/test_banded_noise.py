"""Correlated noise for DP-FedSGD (issue 29): the banded Toeplitz strategy (``privfl.mechanisms.matrix_factorization``),
what a banded run charges (one Poisson-sampled Gaussian per block of b rounds, at the group's rate b q, and a no-op
in the rounds the block covers), what a client sends (its records' groups drawn once and kept, its last b sums
mixed), what the server decodes (the clients' group sums, exactly, when no noise is drawn), the same releases'
metadata and block sensitivity on neighbouring data sets over whole runs, and the refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from privfl.accounting.accountants import make_accountant
from privfl.accounting.calibration import calibrate
from privfl.accounting.events import GaussianEvent, NoOpEvent, PoissonSampledEvent
from privfl.algorithms import ALGORITHMS
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays
from privfl.errors import ConfigurationError
from privfl.mechanisms import InvalidRelease
from privfl.mechanisms.matrix_factorization import (BandedDecoder, BandedEncoder, banded_toeplitz,
                                                    square_root_coefficients, squared_error, workload)
from privfl.mechanisms.noise import NoiseSource
from privfl.runtime.engine import Simulation

K, N, DIM, CLASSES = 3, 40, 5, 3


class ZeroNoise(NoiseSource):
    """No noise at all: what the clients' values sum to, exactly."""

    def standard_normal(self, shape):
        return np.zeros(shape)


def _groups(sim, k):
    """Client ``k``'s records' groups, from the state it keeps (the server half never holds them)."""
    return sim.client_states[k]["_banded"]["groups"]


def _toeplitz(c, n):
    m = np.zeros((n, n))
    for k, v in enumerate(c):
        m += v * np.eye(n, k=-k)
    return m


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("n", [12, 410])
def test_the_strategy_has_unit_columns_and_less_error_with_more_bands(n, momentum):
    """||c|| = 1 (every column of C at most 1: the sensitivity the accounting assumes); the error ||A C^-1||_F^2,
    checked against the dense matrices, falls as b grows, never above the banded square root it starts from nor
    above independent noise."""
    a = _toeplitz(workload(n, momentum), n)
    errors = []
    for b in (1, 2, 4, 8):
        c = banded_toeplitz(n, b, momentum)
        C = _toeplitz(c, n)
        assert len(c) == min(b, n) and np.linalg.norm(c) == pytest.approx(1.0)
        assert np.linalg.norm(C, axis=0).max() <= 1 + 1e-12
        dense = np.linalg.norm(a @ np.linalg.inv(C)) ** 2
        assert squared_error(c, n, momentum) == pytest.approx(dense, rel=1e-8)
        assert squared_error(c, n, momentum) <= squared_error(square_root_coefficients(n, b, momentum), n,
                                                              momentum) * (1 + 1e-9)
        errors.append(dense)
    assert errors[0] == pytest.approx(np.linalg.norm(a) ** 2)  # b = 1: the identity, independent noise
    assert all(later < earlier for earlier, later in zip(errors, errors[1:]))
    assert np.array_equal(banded_toeplitz(n, 4, momentum), banded_toeplitz(n, 4, momentum))  # cached, public


def test_the_decoder_inverts_the_encoder_and_bad_arguments_are_refused():
    c = banded_toeplitz(30, 4)
    enc, dec = BandedEncoder(c), BandedDecoder(c)
    xs = np.random.default_rng(0).normal(size=(30, 7))
    ys = np.array([enc.encode(x) for x in xs])
    assert np.allclose(ys, _toeplitz(c, 30) @ xs)  # y = C x
    assert np.allclose([dec.decode(y) for y in ys], xs, atol=1e-12)
    for bad in (dict(n=0, bands=2), dict(n=5, bands=0), dict(n=5, bands=2.0), dict(n=5, bands=2, momentum=1.0)):
        with pytest.raises(InvalidRelease):
            banded_toeplitz(**bad)


def test_missed_steps_count_as_zero_sums_on_both_sides():
    """A client that misses rounds mixes by absolute round (``skip``): what it sends is C x with the missed rounds'
    x = 0, so a value enters only the b rows from its own round on; the server, skipping the same rounds, decodes the
    values exactly."""
    c = banded_toeplitz(12, 4)
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(12, 3))
    ran = [0, 1, 3, 4, 8, 9, 10]  # rounds 2, 5-7 and 11 missed
    full = np.zeros_like(xs)
    full[ran] = xs[ran]
    expected = _toeplitz(c, 12) @ full
    enc, dec, last = BandedEncoder(c), BandedDecoder(c), -1
    for t in ran:
        enc.skip(t - last - 1)
        dec.skip(t - last - 1)
        y = enc.encode(xs[t])
        assert np.allclose(y, expected[t])
        assert np.allclose(dec.decode(y), xs[t])
        last = t


def _data(seed=0, extra=False):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(DIM, CLASSES))
    parts = []
    for k in range(K):
        x = (rng.normal(size=(N, DIM)) * 2).astype(np.float32)
        parts.append((x, np.argmax(x @ w, 1).astype(np.int64)))
    if extra:  # D': client 0 holds one record more, far from the rest (its clipped gradient at norm C)
        x0, y0 = parts[0]
        parts[0] = (np.concatenate([x0, np.full((1, DIM), 30.0, np.float32)]), np.concatenate([y0, [1]]))
    x = rng.normal(size=(30, DIM)).astype(np.float32)
    return federated_from_arrays(parts, (x, np.argmax(x @ w, 1).astype(np.int64)), task="classification",
                                 num_classes=CLASSES, name="toy", design_size=N)


def _run(bands=4, rounds=10, lot_size=15, epsilon=3.0, extra=False, lr=0.3, zero_noise=False, **privacy):
    fed = FederationConfig(rounds=rounds, lr=lr, hidden=(), seed=1, momentum=0.5)
    cfg = PrivacyConfig(epsilon=epsilon, delta=1e-5, unit="example", clip=1.0, secure_noise=False,
                        accountant="pld", **privacy)
    sim = Simulation(ALGORITHMS["dp_fedsgd"](fed, cfg, lot_size=lot_size, bands=bands), _data(extra=extra), fed, cfg)
    if zero_noise:  # every preparation (run() prepares anew) leaves the clients and the server without noise
        prepare = sim.prepare

        def quiet():
            prepare()
            for p in sim.pipelines:
                p.noise = ZeroNoise()
            sim.server_noise = ZeroNoise()

        sim.prepare = quiet
        quiet()
    return sim


def test_a_banded_run_charges_one_sampled_event_per_block_at_the_groups_rate():
    """bands = 4 over 10 rounds: rounds 0, 4 and 8 charged PoissonSampled(4 q, Gaussian(C, z C)), the others a
    no-op; z is calibrated for ceil(10 / 4) = 3 such events, and the run's epsilon is the target's."""
    sim = _run()
    result = sim.run()
    q = 15 / (K * N)
    z = calibrate(3.0, 1e-5, 3, sampling_rate=4 * q, accountant="pld").noise_multipliers["update"]
    (channel,) = sim.channels
    assert channel.record_bands == 4 and channel.record_sampling_rate == pytest.approx(4 * q)
    assert sim.plan.noise_multipliers["gradient_sum"] == pytest.approx(z, rel=1e-9)
    block = PoissonSampledEvent(4 * q, GaussianEvent(1.0, z), relation="add_remove")
    for k in range(K):
        charges = sim.ledger.charges(str(k))
        assert [c.round for c in charges] == list(range(10))
        for c in charges:
            expected = block if c.round % 4 == 0 else NoOpEvent()
            assert c.event.kind == expected.kind
            if c.round % 4 == 0:
                assert c.event.sampling_rate == pytest.approx(4 * q)
                assert c.event.event.noise_std == pytest.approx(z, rel=1e-9)
        accountant = make_accountant("pld")
        for c in charges:
            accountant.compose(c.event)
        eps = accountant.get_epsilon(1e-5)
        assert 2.9 <= eps <= 3.0 + 1e-9
    assert math.isfinite(result.history[-1].metrics["accuracy"])
    spent = [r.epsilon_max for r in result.history]  # the block's charge is paid when it opens, then flat
    assert spent[0] == spent[3] < spent[4] == spent[7] < spent[8] == spent[9]
    # a last block cut short by the run's end is charged whole, when it opens
    short = _run(rounds=6, bands=4)
    short.run()
    assert [c.event.kind for c in short.ledger.charges("0")] == ["poisson_sampled"] + ["noop"] * 3 + \
        ["poisson_sampled", "noop"]


def _per_record_clipped(model_params, x, y, clip=1.0):
    """Each record's cross-entropy gradient of the linear model at the flat parameters, clipped to ``clip``."""
    w = torch.tensor(model_params, dtype=torch.float64)
    weight, bias = w[:CLASSES * DIM].reshape(CLASSES, DIM), w[CLASSES * DIM:]
    out = []
    for xi, yi in zip(torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y)):
        wt, bt = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy((xi @ wt.T + bt)[None], yi[None])
        loss.backward()
        g = torch.cat([wt.grad.reshape(-1), bt.grad]).numpy()
        out.append(g * min(1.0, clip / max(np.linalg.norm(g), 1e-300)))
    return np.array(out)


def test_the_server_decodes_exactly_the_clients_group_sums():
    """No noise, b q = 1 (every record of the round's group in its lot): the server's decoded sum of round t is the
    sum, over clients, of their records of group t mod b's clipped gradients at the broadcast model (autograd, one
    record at a time); what each client sent was its last b sums mixed by c."""
    bands, rounds = 3, 7
    sim = _run(bands=bands, rounds=rounds, lot_size=K * N // bands, zero_noise=True, lr=0.05)
    alg = sim.algorithm
    decoded, sent, expected = [], [], []
    real = alg.server_update

    def spy(aggregates, rnd):
        sent.append(np.asarray(aggregates["gradient_sum"].total, dtype=np.float64).copy())
        params = np.asarray(alg.global_params, dtype=np.float64).copy()
        real(aggregates, rnd)
        decoded.append(alg._decoded[0].copy())
        total = 0.0
        for k in range(K):
            x, y = sim.data.train_parts[k].tensors()
            mine = _groups(sim, k) == rnd % bands
            total = total + _per_record_clipped(params, x.numpy()[mine], y.numpy()[mine]).sum(0)
        expected.append(total)

    alg.server_update = spy
    sim.run()
    assert len(decoded) == rounds
    for t in range(rounds):
        assert np.allclose(decoded[t], expected[t], atol=1e-4), t
    groups = np.concatenate([_groups(sim, k) for k in range(K)])
    assert not alg._banded  # the server half holds no client's groups or sums
    assert set(np.unique(groups)) == set(range(bands))  # the groups cover every band
    c = alg.band_coefficients
    assert np.allclose(sent, _toeplitz(c, rounds) @ np.array(expected), atol=1e-4)


def test_neighbours_send_the_same_metadata_every_round_and_each_block_moves_by_at_most_the_clip():
    """D and D' (client 0 with one far record more), seeded alike, no noise, b q = 1 and a tiny step: every round
    the same charges, weights, noise levels and shapes; the released stream differs only in the added record's
    group's blocks, each by at most C (its column of C has norm <= 1)."""
    bands, rounds = 2, 6
    runs = []
    for extra in (False, True):
        sim = _run(bands=bands, rounds=rounds, lot_size=K * N // bands, zero_noise=True, lr=1e-9, extra=extra)
        streams = {k: [] for k in range(K)}
        for rnd in range(rounds):
            for k in range(K):
                releases = sim.client_step(k, rnd)
                streams[k].append(releases["gradient_sum"])
            if rnd == 0:
                assert all(len(_groups(sim, k)) == len(sim.data.train_parts[k]) for k in range(K))
        runs.append((sim, streams))
    (a, sa), (b, sb) = runs
    for k in range(K):
        assert [c.event for c in a.ledger.charges(str(k))] == [c.event for c in b.ledger.charges(str(k))]
        for ra, rb in zip(sa[k], sb[k]):
            assert (ra.weight, ra.local_noise_std, ra.central_noise_std, ra.value.shape) == \
                   (rb.weight, rb.local_noise_std, rb.central_noise_std, rb.value.shape)
    group = int(_groups(b, 0)[-1])  # the added record's group (the others' are D's)
    assert np.array_equal(_groups(b, 0)[:-1], _groups(a, 0))
    diff = np.array([rb.value - ra.value for ra, rb in zip(sa[0], sb[0])])
    for start in range(rounds):
        rows = diff[start:start + bands]
        if start % bands == group:  # a block the record took part in: at most C over the whole block
            assert 0 < np.linalg.norm(rows) <= 1.0 + 1e-4
        elif start < group:
            assert np.linalg.norm(diff[start]) < 1e-4  # before the record's first turn nothing moved
    for k in (1, 2):
        assert np.allclose([r.value for r in sa[k]], [r.value for r in sb[k]], atol=1e-4)


@pytest.mark.parametrize("kwargs, says", [
    (dict(bands=0), "bands must be an integer >= 1"),
    (dict(bands=2.0), "bands must be an integer >= 1"),
    (dict(bands=True), "bands must be an integer >= 1"),
    (dict(bands=5, lot_size=40), "set bands to at most 3"),
    (dict(bands=20, lot_size=4), "exceeds the run's 10 rounds"),
    (dict(bands=2, posterior="laplace"), "bands > 1 is planned for the gradient alone"),
    (dict(bands=2, clip_quantile=0.5), "bands > 1 mixes rounds released at one fixed clip"),
])
def test_configurations_a_banded_run_cannot_account_are_refused_before_anything_is_charged(kwargs, says):
    quantile = kwargs.pop("clip_quantile", None)
    fed = FederationConfig(rounds=10, hidden=(), seed=1)
    cfg = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=1.0, secure_noise=False, accountant="pld",
                        clip_quantile=quantile)
    with pytest.raises(ConfigurationError, match=says):
        sim = Simulation(ALGORITHMS["dp_fedsgd"](fed, cfg, **kwargs), _data(), fed, cfg)
        sim.prepare()
        assert not sim.ledger.charges("0")


def test_a_non_private_run_ignores_the_bands():
    fed = FederationConfig(rounds=3, hidden=(), seed=1)
    cfg = PrivacyConfig(epsilon=math.inf, unit="example")
    alg = ALGORITHMS["dp_fedsgd"](fed, cfg, bands=2)
    assert alg.bands == 1


def test_a_client_that_misses_a_blocks_first_round_is_charged_at_its_first_release_in_the_block():
    """The block's event is charged by the client's first release in each block of b rounds, whatever rounds it
    missed (a dropped node, a round sat out): bands 4, client 0 releasing in rounds 1, 2, 5 and 9 only is charged
    the block event in rounds 1, 5 and 9 and a no-op in round 2; each of its values mixes by absolute round."""
    sim = _run(bands=4, rounds=10)
    sim.prepare()
    for rnd in (1, 2, 5, 9):
        sim.client_step(0, rnd)
    kinds = {c.round: c.event.kind for c in sim.ledger.charges("0")}
    assert kinds == {1: "poisson_sampled", 2: "noop", 5: "poisson_sampled", 9: "poisson_sampled"}
    assert _groups(sim, 0) is not None and sim.client_states[0]["_banded"]["round"] == 9
    # a pipeline rebuilt in the middle of a block (a deployment's client, a fresh process each round) reads the
    # block's charge from the ledger: no second block event
    fresh = sim.plan.pipeline(0, sim.ledger, 0)
    assert not fresh.opens_block("gradient_sum", 10) and fresh.opens_block("gradient_sum", 12)


def test_a_refused_block_charge_leaves_the_block_unopened():
    """A client whose block charge is refused (its budget spent, e.g. by an earlier run on the same ledger) sits the
    round out, and its next release in the block is refused as the block's opening too: no value of the block goes
    out on a no-op."""
    from privfl.accounting.ledger import PrivacyBudgetExceeded

    sim = _run(bands=4, rounds=10)
    sim.prepare()
    pipe = sim.pipelines[0]
    assert pipe.opens_block("gradient_sum", 0)
    real = sim.ledger.charge_all

    def refuse(client, rnd, requests, **kw):
        if any(r.event.kind != "noop" for r in requests):
            raise PrivacyBudgetExceeded("spent")
        return real(client, rnd, requests, **kw)

    sim.ledger.charge_all = refuse
    for rnd in (0, 1):
        with pytest.raises(PrivacyBudgetExceeded):
            sim.client_step(0, rnd)
    assert sim.ledger.charges("0") == [] and pipe.opens_block("gradient_sum", 2)


def test_a_round_asked_out_of_order_or_again_is_refused_before_any_record_is_drawn():
    """Banded noise mixes a client's rounds in increasing order, b apart for each record. A review's server asked
    rounds 8, 4, 0, 11, 7, ...: the client mixed them as if consecutive and one record's participations piled into
    overlapping rows (a shift of norm 2.55 between neighbours where the three charged events allow 1.73). A round not
    after the client's last one is refused, the same text whatever the data."""
    sim = _run(bands=4, rounds=12, lot_size=30, zero_noise=True)
    sim.prepare()
    sim.client_step(0, 8)
    for earlier in (4, 8):
        with pytest.raises(ConfigurationError, match="increasing order"):
            sim.client_step(0, earlier)
    assert [c.round for c in sim.ledger.charges("0")] == [8]  # nothing charged for the refused rounds
    sim.client_step(0, 9)


def test_a_client_that_lost_its_record_groups_mid_run_is_refused():
    """A review: when a client's kept state is gone (a retried round of a resumed Flower run ignores the saved
    entry), its groups were drawn afresh and 11 of 40 records took part in two rounds of one block, charged once.
    A client with charges in the run and no state is refused before any record is read."""
    sim = _run(bands=4, rounds=8, lot_size=30, zero_noise=True)
    sim.prepare()
    for rnd in (0, 1):
        sim.client_step(0, rnd)
    sim.client_states[0] = None
    with pytest.raises(ConfigurationError, match="state its guarantee rests on"):
        sim.client_step(0, 2)
    assert [c.round for c in sim.ledger.charges("0")] == [0, 1]
