"""One record that makes a user's model raise (a category code outside its embedding) adds the zero term to the DP-SGD
steps that sample it, decided on that record alone, instead of making the whole local step fail (a review, session 26:
a DP-SGD-trained channel then released the data-independent fallback, exact zeros with no noise, where its
neighbour released a noisy update; under central noise the zeros moved the client's whole clipped sum, not C).
Neighbouring pairs through ``privfl.federate``: D, and D' = D plus the raising record, with seeded noise and a
sampling rate of 1, so that every step's lot and noise are the same: the releases must be equal."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import privfl
import privfl.runtime.engine as engine
from privfl.core.release import LocalStepFailed

VOCAB, LENGTH, WIDTH = 10, 3, 4


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.out = nn.Linear(WIDTH, 2)

    def forward(self, x):
        return self.out(self.emb(x.long()).mean(1))


def _data(rng, n):
    x = rng.integers(0, VOCAB, (n, LENGTH)).astype(np.float32)
    return x, (x[:, 0] > 4).astype(np.int64)


def _releases(monkeypatch, clients, algorithm, **kw):
    seen = []
    original = engine.weighted_sums

    def spy(releases, *a, **k):
        seen.extend((r.client_id, r.channel, np.asarray(r.value, dtype=np.float64).copy()) for r in releases)
        return original(releases, *a, **k)

    monkeypatch.setattr(engine, "weighted_sums", spy)
    rng = np.random.default_rng(9)
    test = _data(rng, 20)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        privfl.federate(Tokens(), clients, algorithm=algorithm, epsilon=3.0, unit="example", test=test,
                        classes=[0, 1], rounds=2, lr=0.1, clip=1.0, secure_noise=False, seed=3, **kw)
    assert not [w for w in caught if issubclass(w.category, LocalStepFailed)]
    return [v for cid, _, v in seen if str(cid) in ("0", "a")]


@pytest.mark.parametrize("algorithm, kw", [
    ("dpsgd_fedavg", {"client_size": 8, "batch_size": 8, "local_epochs": 1}),  # the opacus loop (an embedding)
    ("dpsgd_fedavg", {"client_size": 8, "batch_size": 8, "local_epochs": 1, "loss": nn.CrossEntropyLoss()}),
    ("dp_fedsgd", {"client_size": 8, "batch_size": 8, "lot_size": 8}),  # per-example vmap
])
def test_a_record_that_makes_the_model_raise_adds_zero_and_the_release_is_the_neighbours(monkeypatch, algorithm, kw):
    rng = np.random.default_rng(4)
    (xa, ya), (xb, yb) = _data(rng, 8), _data(rng, 8)
    d = {"a": (xa, ya), "b": (xb, yb)}
    outside = np.concatenate([xa, [[VOCAB, 1, 2]]]).astype(np.float32)  # token VOCAB: the embedding raises on it
    d2 = {"a": (outside, np.concatenate([ya, [1]])), "b": (xb, yb)}
    mine = _releases(monkeypatch, d, algorithm, **kw)
    theirs = _releases(monkeypatch, d2, algorithm, **kw)
    assert len(mine) == len(theirs) == 2
    for a, b in zip(mine, theirs):
        assert np.any(b != 0)  # never the exact-zero fallback
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class TripwireExtractor(nn.Module):
    """A user's feature extractor that raises on an input beyond float32's comfortable range."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        if bool((x.abs() > 1e30).any()):
            raise FloatingPointError("a record overflowed the extractor")
        return self.linear(x)


def test_fedbnr_contains_a_record_its_extractor_raises_on(monkeypatch):
    """FedBNR's scatter sums are sums of per-record terms: a record its user extractor raises on adds the zero row
    (the fallback's zeros would have moved the client's whole sums: not covered at record level)."""
    rng = np.random.default_rng(2)
    parts = [(rng.normal(size=(30, 4)).astype(np.float32), rng.normal(size=30).astype(np.float32)) for _ in range(3)]
    test = (rng.normal(size=(20, 4)).astype(np.float32), rng.normal(size=20).astype(np.float32))
    x, y = parts[0]
    extreme = (np.concatenate([x, np.full((1, 4), 1e35, np.float32)]), np.concatenate([y, y[:1]]))
    runs = []
    original = engine.weighted_sums
    for first in (parts[0], extreme):
        seen = []

        def spy(releases, *a, **k):
            seen.extend((str(r.client_id), r.channel, np.asarray(r.value, dtype=np.float64).copy()) for r in releases)
            return original(releases, *a, **k)

        monkeypatch.setattr(engine, "weighted_sums", spy)
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            privfl.federate(TripwireExtractor(), {"a": first, "b": parts[1], "c": parts[2]}, algorithm="fedbnr",
                            epsilon=3.0, unit="example", test=test, task="regression", rounds=1, client_size=30,
                            secure_noise=False, seed=0)
        assert not [w for w in caught if issubclass(w.category, LocalStepFailed)]
        runs.append({(c, ch): v for c, ch, v in seen if c == "0"})
    assert runs[0].keys() == runs[1].keys() and runs[0]
    for key in runs[0]:
        assert np.any(runs[1][key] != 0)
        np.testing.assert_allclose(runs[0][key], runs[1][key], rtol=1e-9, atol=1e-12)


class CheckedReLU(nn.ReLU):
    """A user's activation, a subclass of a stack layer with a forward of its own: raises on a far-out input."""

    def forward(self, x):
        if bool((x.abs() > 1e30).any()):
            raise FloatingPointError("a record overflowed the activation")
        return super().forward(x)


class Centre(nn.Identity):
    """A user's 'identity' that centres over the batch (mixes the examples of a lot)."""

    def forward(self, x):
        return x - x.mean(dim=-2, keepdim=True)


def _plain_parts(seed, sizes, features=4):
    rng = np.random.default_rng(seed)
    return [(x := rng.normal(size=(n, features)).astype(np.float32), (x[:, 0] > 0).astype(np.int64)) for n in sizes]


def _client_a(monkeypatch, model_fn, first, algorithm, **kw):
    seen = []
    original = engine.weighted_sums

    def spy(releases, *a, **k):
        seen.extend((str(r.client_id), r.round, r.channel, np.asarray(r.value, dtype=np.float64).copy())
                    for r in releases)
        return original(releases, *a, **k)

    monkeypatch.setattr(engine, "weighted_sums", spy)
    parts = _plain_parts(3, (40, 40))
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        privfl.federate(model_fn(), {"a": first, "b": parts[0], "c": parts[1]}, algorithm=algorithm, epsilon=3.0,
                        unit="example", classes=[0, 1], test=_plain_parts(4, (30,))[0], rounds=1, client_size=40,
                        batch_size=40, lr=0.05, clip=1.0, seed=0, secure_noise=False, placement="central", **kw)
    monkeypatch.setattr(engine, "weighted_sums", original)
    assert not [w for w in caught if issubclass(w.category, LocalStepFailed)]
    return {(rnd, ch): v for c, rnd, ch, v in seen if c == "0"}


@pytest.mark.parametrize("algorithm, kw", [("dp_fedsgd", {"lot_size": 120}), ("dpsgd_fedavg", {"local_epochs": 1})])
def test_a_subclassed_stack_layer_is_not_run_on_the_whole_lot(monkeypatch, algorithm, kw):
    """The stacked executors' fast path (ghost clipping of a Linear/activation stack) ran a layer accepted by
    isinstance on the whole lot at once: a user's subclass that raises on one record failed every client's step (a
    review: releases of exact zeros on D'), and one that centres over the lot mixed the records (one record moved
    DP-FedSGD's clipped sum 21.9 C). Layers are taken by exact type now; anything else goes one example at a time."""
    def raising():
        return nn.Sequential(nn.Linear(4, 8), CheckedReLU(), nn.Linear(8, 2))

    x, y = _plain_parts(5, (40,))[0]
    extreme = (np.concatenate([x, np.full((1, 4), 1e35, np.float32)]), np.concatenate([y, [0]]))
    mine, theirs = _client_a(monkeypatch, raising, (x, y), algorithm, **kw), \
        _client_a(monkeypatch, raising, extreme, algorithm, **kw)
    assert mine.keys() == theirs.keys() and mine
    for key in mine:
        assert np.any(theirs[key] != 0)
        np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-4, atol=1e-5)
    if algorithm != "dp_fedsgd":
        return

    def centring():
        return nn.Sequential(nn.Linear(4, 8), Centre(), nn.ReLU(), nn.Linear(8, 2))

    far = (np.concatenate([x, np.full((1, 4), 1000.0, np.float32)]), np.concatenate([y, [0]]))
    base = _client_a(monkeypatch, centring, (x, y), algorithm, **kw)
    moved = _client_a(monkeypatch, centring, far, algorithm, **kw)
    for key in base:  # central placement, q = 1: the pre-noise clipped sum; one record moves it by C at most
        assert np.linalg.norm(moved[key] - base[key]) <= 1.0 + 1e-5


def test_fola_per_client_fisher_contains_a_raising_record(monkeypatch):
    """FOLA's per-client path (regression here) reads the Fisher with layer hooks over the batch: a record the model
    raises on failed the whole step (a review: every channel released as zeros on D'). The batch is redone with the
    per-example torch.func pass, where that record adds zero."""
    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.codes = torch.eye(5)  # a constant lookup table, a plain attribute (no buffer)
            self.linear = nn.Linear(6, 1)

        def forward(self, x):
            return self.linear(torch.cat([self.codes[x[:, 0].long()], x[:, 1:]], dim=1))

    def part(seed, n):
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(n, 2)).astype(np.float32)
        x[:, 0] = rng.integers(0, 5, n)
        return x, (0.1 * x[:, 0] + 0.3 * x[:, 1]).astype(np.float32)

    a, b, c, test = part(1, 40), part(2, 40), part(3, 40), part(4, 20)
    outside = (np.concatenate([a[0], [[7.0, 0.1]]]).astype(np.float32), np.concatenate([a[1], [0.5]]).astype(np.float32))
    original = engine.weighted_sums
    runs = []
    for first in (a, outside):
        seen = []

        def spy(releases, *args, **k):
            seen.extend((str(r.client_id), r.channel, np.asarray(r.value, dtype=np.float64).copy())
                        for r in releases)
            return original(releases, *args, **k)

        monkeypatch.setattr(engine, "weighted_sums", spy)
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            privfl.federate(Table(), {"a": first, "b": b, "c": c}, algorithm="fola", epsilon=3.0, unit="example",
                            task="regression", test=test, rounds=1, local_epochs=1, client_size=40, batch_size=10,
                            lr=0.05, seed=0, secure_noise=False, placement="central")
        assert not [w for w in caught if issubclass(w.category, LocalStepFailed)]
        runs.append({ch: v for cid, ch, v in seen if cid == "0"})
    assert runs[0].keys() == runs[1].keys() and runs[0]
    for channel, value in runs[0].items():
        if np.any(value != 0):
            assert np.any(runs[1][channel] != 0), channel
