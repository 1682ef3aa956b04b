"""Adaptive clipping inside DP-SGD's step (issue 29; ``privfl.privacy.record_level.AdaptiveClip``), as DP-SGD FedAvg
runs it: the step's one noise multiplier split between the gradient and the clip count by the budget rule, the
step's event unchanged, each client's clip following the quantile of its own records' norms and kept as its own
state, and the configurations it cannot run refused before anything is charged."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import privfl.privacy.record_level as R
from privfl.algorithms import ALGORITHMS
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays
from privfl.errors import ConfigurationError
from privfl.privacy.record_level import AdaptiveClip, DPSGDSchedule, VectorisedDPSGD
from privfl.runtime.engine import Simulation

K, N, DIM, CLASSES = 3, 60, 8, 3


def _data(seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(DIM, CLASSES))
    parts = []
    for _ in range(K):
        x = (rng.normal(size=(N, DIM)) * rng.uniform(0.2, 3.0, size=(N, 1))).astype(np.float32)  # spread norms
        parts.append((x, np.argmax(x @ w + rng.normal(size=(N, CLASSES)), 1).astype(np.int64)))
    x = rng.normal(size=(40, DIM)).astype(np.float32)
    return federated_from_arrays(parts, (x, np.argmax(x @ w, 1).astype(np.int64)), task="classification",
                                 num_classes=CLASSES, name="toy", design_size=N)


def _configs(quantile=None, **kw):
    fed = FederationConfig(rounds=2, local_epochs=2, batch_size=15, lr=0.2, hidden=(), seed=3)
    privacy = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=1.0, secure_noise=False,
                            clip_quantile=quantile, **kw)
    return fed, privacy


def test_the_step_event_is_the_fixed_clips_and_the_noise_is_split_by_the_budget_rule(monkeypatch):
    """Charged: the same SelfComposed(PoissonSampled(q, Gaussian(1, z)), steps) per round as a fixed clip, at the same
    z. Drawn: every step's gradient noise at std z / sqrt(1 - share) x the client's clip in force, then its count's at
    0.5 z / sqrt(share); the clip in force starts at the run's and moves."""
    charged = {}
    for quantile in (None, 0.5):
        fed, privacy = _configs(quantile)
        draws = []
        real = R.step_noise

        def spy(shape, std, generator, secure, dtype=torch.float32):
            draws.append((tuple(shape), float(std)))
            return real(shape, std, generator, secure, dtype)

        monkeypatch.setattr(R, "step_noise", spy)
        sim = Simulation(ALGORITHMS["dpsgd_fedavg"](fed, privacy), _data(), fed, privacy)
        sim.run()
        monkeypatch.setattr(R, "step_noise", real)
        charged[quantile] = [[c.event for c in sim.ledger.charges(str(k))] for k in range(K)]
        z = sim.algorithm.noise_multiplier(R.dpsgd_schedule(sim.algorithm, 0))
        if quantile is None:
            assert draws and all(std == pytest.approx(z) for _, std in draws)
            continue
        share = privacy.clip_share
        counts = [std for shape, std in draws if shape == (1,)]
        grads = [std / (z / math.sqrt(1 - share)) for shape, std in draws if shape != (1,)]
        assert counts and all(c == pytest.approx(0.5 * z / math.sqrt(share)) for c in counts)
        assert grads[0] == pytest.approx(1.0) and len({round(g, 6) for g in grads}) > 10  # the clip moves
        schedule = R.dpsgd_schedule(sim.algorithm, 0)
        assert len(counts) == K * fed.rounds * schedule.steps
    assert charged[None] == charged[0.5]


def test_each_clients_clip_tracks_the_quantile_of_its_own_norms():
    """Almost no noise and a model that does not move: each client's clip settles where a fraction Q of its records'
    gradient norms lie below it."""
    data = _data()
    model = nn.Linear(DIM, CLASSES)
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    schedule = DPSGDSchedule.for_client(N, 30, 150)
    datasets = [p.tensors() for p in data.train_parts]
    for quantile in (0.25, 0.75):
        engine = VectorisedDPSGD(model, schedule=schedule, noise_multiplier=1e-4, clip=1.0, lr=1e-12, momentum=0.0,
                                 secure_noise=False, adaptive=AdaptiveClip(quantile, lr=0.2))
        gens = [(torch.Generator().manual_seed(2 * i), torch.Generator().manual_seed(2 * i + 1)) for i in range(K)]
        for i, _, stats in engine.train_models(start, datasets, gens):
            x, y = datasets[i]
            norms = []
            for j in range(len(y)):
                model.zero_grad()
                nn.functional.cross_entropy(model(x[j:j + 1]), y[j:j + 1]).backward()
                norms.append(float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))))
            below = np.mean(np.array(norms) <= stats["clip"])
            assert abs(below - quantile) < 0.1, (i, quantile, stats["clip"], below)


def test_a_clients_clip_is_its_own_state_between_rounds():
    """The clip a client ends a round at is where its next round starts; the server half never holds it."""
    fed, privacy = _configs(0.8)
    alg = ALGORITHMS["dpsgd_fedavg"](fed, privacy)
    sim = Simulation(alg, _data(), fed, privacy)
    sim.run()
    clips = [s["_clips"] for s in sim.client_states]
    assert len(set(clips)) == K and all(c != 1.0 for c in clips) and alg._clips == {}
    assert "_clips" not in alg.broadcast(fed.rounds).values


def test_adaptive_clipping_needs_the_vectorised_executor():
    fed, privacy = _configs(0.5)
    alg = ALGORITHMS["dpsgd_fedavg"](fed, privacy, loss=nn.CrossEntropyLoss(label_smoothing=0.1))
    with pytest.raises(ConfigurationError, match="adaptive clipping needs the vectorised DP-SGD executor"):
        Simulation(alg, _data(), fed, privacy).run()


def test_the_clips_step_follows_the_count_and_no_noise_moves_it_further_than_exp_lr():
    adaptive = AdaptiveClip(0.3, lr=0.2)
    assert adaptive.step(2.0, 4.0, 20.0) == pytest.approx(2.0 * math.exp(-0.2 * (0.7 - 0.3)))
    assert adaptive.step(2.0, 1e9, 20.0) == pytest.approx(2.0 * math.exp(-0.2 * 0.7))
    assert adaptive.step(2.0, -1e9, 20.0) == pytest.approx(2.0 * math.exp(0.2 * 0.3))


def test_the_split_keeps_the_steps_privacy():
    """(g / (C z_g), 2 b / z_b) has norm at most 1 / z whenever ||g|| <= C and |b| <= 1/2: the count inside the
    step's Gaussian(1, z), for every share."""
    for share in (1e-4, 0.01, 0.5, 0.99):
        z_g, z_b = AdaptiveClip(0.5, share=share).multipliers(2.0)
        assert (1 / z_g) ** 2 + (2 * 0.5 / z_b) ** 2 == pytest.approx(1 / 2.0 ** 2)


# -- black-box audit of one adaptive step: everything the step computes, as if the client sent it ------------------


def _step_scores(noise_scale: float, trials: int = 40_000, z: float = 0.8, quantile: float = 0.5):
    """``trials`` one-step runs of the vectorised engine with adaptive clipping on D = {an outlier record} and
    D' = {} at q = 1/2, one run per stacked client: the noisy gradient read back from the model's change and the
    noisy count from the clip the step ended at (so the audit sees more than the client ever sends); the
    likelihood-ratio score of both against the outlier's clipped gradient and centred bit. ``noise_scale`` scales
    the noise the engine draws while the claim stays at z. Returns (scores on D, scores on D', claimed epsilon)."""
    from privfl.accounting.accountants import make_accountant

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    x, y = torch.full((1, 4), 30.0), torch.tensor([0])  # the class the model gets wrong: a large gradient
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    g = torch.cat([p.grad.reshape(-1) for p in (model.weight, model.bias)]).double().numpy()
    u = g / np.linalg.norm(g)  # its gradient clipped to C = 1 (the norm is far above 1: the bit is 0, centred -1/2)
    schedule = DPSGDSchedule(0.5, 1, 1, 2)  # q = 1/2, one step, expected batch 1
    adaptive = AdaptiveClip(quantile)
    z_g, z_c = adaptive.multipliers(z)
    lr = 0.1
    scores = []
    for present in (True, False):
        data = [(x, y) if present else (x[:0], y[:0])] * trials
        gens = [(torch.Generator().manual_seed(2 * i + present), torch.Generator().manual_seed(10 ** 7 + i))
                for i in range(trials)]
        engine = VectorisedDPSGD(model, schedule=schedule, noise_multiplier=z * noise_scale, clip=1.0, lr=lr,
                                 momentum=0.0, secure_noise=False, adaptive=adaptive, memory_budget=2 ** 30)
        out = np.empty(trials)
        for i, final, stats in engine.train_models(start, data, gens):
            grad = (start - final.astype(np.float64)) / lr  # over the expected batch of 1
            count = -math.log(stats["clip"]) / adaptive.lr - 0.5 + quantile
            out[i] = grad @ u / z_g ** 2 + count * -0.5 / (0.5 * z_c) ** 2
        scores.append(out)
    claimed = make_accountant("pld").compose(schedule.step_event(z)).get_epsilon(1e-5)
    return scores[0], scores[1], claimed


@pytest.mark.timeout(300)
def test_the_adaptive_steps_audit_stays_below_the_claim_and_catches_a_quarter_of_the_noise():
    from privfl.apps.empirical_audit import epsilon_lower_bound

    score_in, score_out, claimed = _step_scores(1.0)
    honest, *_ = epsilon_lower_bound(score_in, score_out, delta=1e-5)
    assert 0 < honest <= claimed, (honest, claimed)
    score_in, score_out, claimed = _step_scores(0.25)
    faulty, *_ = epsilon_lower_bound(score_in, score_out, delta=1e-5)
    assert faulty > claimed, (faulty, claimed)
