"""Adaptive clipping inside DP-SGD's step (issue 29; ``privfl.privacy.record_level.AdaptiveClip``), as DP-SGD FedAvg
runs it: the step's one noise multiplier split between the gradient and the clip counts by the budget rule, the
step's event unchanged, every client training a round at the broadcast clip and sending its noisy counts, the
server's next clip the quantile they estimate, and the configurations it cannot run refused before anything is
charged."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import privfl.privacy.record_level as R
from privfl.accounting.events import NoOpEvent
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
    z, on the update; the clip counts a no-op (drawn inside those steps). Drawn: every step's gradient noise at std
    z / sqrt(1 - share) x the round's clip, then its counts' at sqrt(K) / 2 z / sqrt(share); the clip is fixed within
    a round and moves between rounds."""
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
        result = sim.run()
        monkeypatch.setattr(R, "step_noise", real)
        charged[quantile] = [[c.event for c in sim.ledger.charges(str(k)) if c.channel == "update"]
                             for k in range(K)]
        z = sim.algorithm.noise_multiplier(R.dpsgd_schedule(sim.algorithm, 0))
        if quantile is None:
            assert draws and all(std == pytest.approx(z) for _, std in draws)
            continue
        others = {c.event for k in range(K) for c in sim.ledger.charges(str(k)) if c.channel == "clip_count"}
        assert others == {NoOpEvent()}
        share, ratios = privacy.clip_share, len(R.CLIP_RATIOS)
        counts = [std for shape, std in draws if shape == (ratios,)]
        grads = [std / (z / math.sqrt(1 - share)) for shape, std in draws if shape != (ratios,)]
        assert counts and all(c == pytest.approx(0.5 * math.sqrt(ratios) * z / math.sqrt(share)) for c in counts)
        schedule = R.dpsgd_schedule(sim.algorithm, 0)
        per_round = len(grads) // fed.rounds
        assert {round(g, 9) for g in grads[:per_round]} == {1.0}  # round 0 at the run's clip throughout
        clips = [r.clip for r in result.history]
        assert clips[0] == 1.0 and clips[1] != 1.0
        assert {round(g, 6) for g in grads[per_round:]} == {round(clips[1], 6)}
        assert len(counts) == K * fed.rounds * schedule.steps
    assert charged[None] == charged[0.5]


def _norms(model, x, y):
    norms = []
    for j in range(len(y)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[j:j + 1]), y[j:j + 1]).backward()
        norms.append(float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))))
    return np.array(norms)


def test_the_clients_fractions_estimate_how_many_norms_lie_below_each_threshold():
    """Almost no noise and a model that does not move: each client's fractions are those of its records' norms
    below r C (minus 1/2), up to the Poisson lots' own spread."""
    data = _data()
    model = nn.Linear(DIM, CLASSES)
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    schedule = DPSGDSchedule.for_client(N, 30, 150)
    datasets = [p.tensors() for p in data.train_parts]
    engine = VectorisedDPSGD(model, schedule=schedule, noise_multiplier=1e-4, clip=1.0, lr=1e-12, momentum=0.0,
                             secure_noise=False, adaptive=AdaptiveClip(0.5))
    gens = [(torch.Generator().manual_seed(2 * i), torch.Generator().manual_seed(2 * i + 1)) for i in range(K)]
    for i, _, stats in engine.train_models(start, datasets, gens, clips=[1.5] * K):
        norms = _norms(model, *datasets[i])
        expected = np.array([np.mean(norms <= 1.5 * r) - 0.5 for r in R.CLIP_RATIOS])
        assert np.abs(stats["clip_fractions"] - expected).max() < 0.06, (i, stats["clip_fractions"], expected)


def test_the_federations_clip_goes_to_the_quantile_of_the_clients_norms():
    """The server's rule on exact fractions: the quantile read off log-linearly, then lr of the way in log space;
    a quantile beyond the thresholds is met at the edge, a factor 4 a round."""
    norms = np.random.default_rng(0).lognormal(mean=-1.0, sigma=0.7, size=20_000)
    for quantile in (0.2, 0.5, 0.8):
        target = float(np.quantile(norms, quantile))
        for lr in (1.0, 0.5):
            clip = 1.0
            for _ in range(12):
                fractions = [np.mean(norms <= clip * r) - 0.5 for r in R.CLIP_RATIOS]
                clip = AdaptiveClip(quantile, lr=lr).round_clip(clip, fractions)
            assert clip == pytest.approx(target, rel=0.05), (quantile, lr, clip, target)
    adaptive = AdaptiveClip(0.5, lr=1.0)
    assert adaptive.round_clip(2.0, [0.5] * len(R.CLIP_RATIOS)) == pytest.approx(0.5)
    assert adaptive.round_clip(2.0, [-0.5] * len(R.CLIP_RATIOS)) == pytest.approx(8.0)
    assert AdaptiveClip(0.5, lr=0.5).round_clip(2.0, [-0.5] * len(R.CLIP_RATIOS)) == pytest.approx(4.0)
    noisy = [-0.5, -0.2, -0.25, 0.1, 0.2, 0.15, 0.4, 0.5, 0.6]  # noise breaks the order: a running maximum
    assert AdaptiveClip(0.4).round_quantile(1.0, noisy) == pytest.approx(2 ** (-1 + 0.5 / 3))  # 0.3 at 2^-1
    with pytest.raises(ValueError, match="finite fractions"):
        adaptive.round_clip(1.0, [float("nan")] * len(R.CLIP_RATIOS))


def test_the_clip_is_broadcast_state_and_clients_keep_none():
    """The round's clip is the server's, in the broadcast; the clients hold no clip of their own between rounds, and
    the clip counts are a channel of every client's release (boxed to [-1, 1])."""
    fed, privacy = _configs(0.8)
    alg = ALGORITHMS["dpsgd_fedavg"](fed, privacy)
    sim = Simulation(alg, _data(), fed, privacy)
    result = sim.run()
    assert alg.client_state == () and "current_clip" in alg.broadcast(fed.rounds).values
    assert result.history[0].clip == 1.0 != result.history[1].clip  # each round's clip, before the server step
    assert [c.name for c in alg.channels()] == ["update", "clip_count"]
    assert alg.channels()[1].value_bound == 1.0 and alg.channels()[1].shape == (len(R.CLIP_RATIOS),)


@pytest.mark.parametrize("algorithm", ["dp_fedsgd", "dpsgd_fedavg"])
@pytest.mark.parametrize("broadcast", [2e-310, 0.0, math.nan, 1e6])
def test_a_broadcast_clip_no_honest_server_reaches_is_refused_before_training(algorithm, broadcast):
    """The record-level clients check the broadcast C_t as DP-FedAvg's do (``AdaptiveClip.check_broadcast``): a
    clip no run of the rule reaches from the public start in the rounds so far is refused before any record is
    read, with the same text on neighbouring data; the clips an honest run reaches pass (the runs above)."""
    fed, privacy = _configs(0.5)
    texts = []
    for seed in (0, 1):
        data = _data(seed)
        alg = ALGORITHMS[algorithm](fed, privacy)
        alg.setup(data, np.random.default_rng(0))
        alg.current_clip = broadcast
        with pytest.raises(ConfigurationError, match="broadcast the clip") as err:
            list(alg.client_updates(list(range(K)), data.train_parts, 1,
                                    [np.random.default_rng([1, k]) for k in range(K)]))
        texts.append(str(err.value))
    assert texts[0] == texts[1]


def test_the_round_clip_rule_stays_within_what_the_check_accepts():
    rule = AdaptiveClip(0.5, lr=0.3)
    low, high = [-0.5] * len(R.CLIP_RATIOS), [0.5] * len(R.CLIP_RATIOS)
    for fractions in (low, high):
        clip = 1.0
        for t in range(30):
            assert rule.check_broadcast(clip, 1.0, t, rule="round_clip") == clip
            clip = rule.round_clip(clip, fractions)


def test_a_clip_step_beyond_the_quantile_is_refused():
    fed, privacy = _configs(0.5, clip_lr=1.5)
    with pytest.raises(ConfigurationError, match="clip_lr must be at most 1"):
        ALGORITHMS["dpsgd_fedavg"](fed, privacy)


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


def _step_scores(noise_scale: float, trials: int = 20_000, z: float = 0.8, quantile: float = 0.5):
    """``trials`` one-step runs of the vectorised engine with adaptive clipping on D = {an outlier record} and
    D' = {} at q = 1/2, one run per stacked client: the noisy gradient read back from the model's change and the
    noisy clip counts the client sends (the audit sees both); the likelihood-ratio score of both against the
    outlier's clipped gradient and its centred bits (-1/2 at every threshold: its norm is above 4 C).
    ``noise_scale`` scales the noise the engine draws while the claim stays at z. Returns (scores on D, scores on
    D', claimed epsilon)."""
    from privfl.accounting.accountants import make_accountant

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    x, y = torch.full((1, 4), 30.0), torch.tensor([0])  # the class the model gets wrong: a large gradient
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    g = torch.cat([p.grad.reshape(-1) for p in (model.weight, model.bias)]).double().numpy()
    assert np.linalg.norm(g) > 4 * max(R.CLIP_RATIOS)
    u = g / np.linalg.norm(g)  # its gradient clipped to C = 1 (the norm is far above 4: every bit 0, centred -1/2)
    schedule = DPSGDSchedule(0.5, 1, 1, 2)  # q = 1/2, one step, expected batch 1
    adaptive = AdaptiveClip(quantile)
    z_g, z_c = adaptive.multipliers(z)
    count_std = 0.5 * math.sqrt(len(R.CLIP_RATIOS)) * z_c
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
            counts = stats["clip_fractions"]  # over one step's expected batch of 1: the noisy counts themselves
            out[i] = grad @ u / z_g ** 2 + counts.sum() * -0.5 / count_std ** 2
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


@pytest.mark.timeout(240)
def test_the_clip_counts_go_through_secure_aggregation_and_give_the_plain_runs_clips():
    """Under secure aggregation (the update's public range from update_bound, the counts' [-1, 1]) the server sees only
    the sums, and the clips and the model equal the plain run's up to quantisation; every ledger holds its target."""
    from privfl.algorithms import make_algorithm

    fed, privacy = _configs(0.5)
    secure_run_equals_plain(lambda: make_algorithm("dpsgd_fedavg", fed, privacy, update_bound=0.5), _data(), fed,
                            privacy)


def secure_run_equals_plain(make, data, fed, privacy) -> None:
    """A run of ``make()`` under secure aggregation gives the plain run's clips (every round's, then the next) and
    model, up to quantisation; every ledger within its target; the clip moves every round. (Also used by the
    client-level tests.)"""
    from privfl.privacy.secure import SecureAggregation

    runs = {}
    for secure in (None, SecureAggregation(bits=48)):
        alg = make()
        result = Simulation(alg, data, fed, privacy, secure=secure).run()
        assert result.audit["max_epsilon"] <= privacy.epsilon * (1 + 1e-9)
        runs[secure is not None] = ([r.clip for r in result.history] + [alg.current_clip], alg.global_params)
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-6)
    np.testing.assert_allclose(runs[True][1], runs[False][1], atol=1e-6)
    assert len(set(runs[True][0])) == fed.rounds + 1
