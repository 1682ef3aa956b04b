"""Adaptive clipping at client level (issue 29; DP-FedAvg, Andrew et al.'s client-level algorithm): each client sends
its model change over the broadcast clip C_t (clipped to norm 1 by the pipeline) and its centred bit
[||change|| <= C_t] - 1/2 on a channel of its own, the budget split by the one rule, both charged in every ledger
(one sampled event per round under client sampling); the server multiplies the sum back by C_t and moves the clip by
Andrew et al.'s geometric step on the noisy count over the expected participants.

Checked here: the channels and their split; what a client sends against plain DP-FedAvg's change; the server's step;
the clip reaching the quantile of the clients' change norms; the ledger; secure aggregation giving the plain run's
clips and model; the command line; and a black-box audit of one round's two releases that stays below the claim and
catches a quarter of the noise.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from privfl.accounting.rounds import round_events
from privfl.algorithms import ALGORITHMS
from privfl.algorithms.dp_fedavg import DPFedAvg
from privfl.apps.cli import main
from privfl.apps.empirical_audit import epsilon_lower_bound
from privfl.core.aggregation import Aggregate, noise_only_sums, weighted_sums
from privfl.core.channels import NormClip
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.core.release import Release
from privfl.data import federated_from_arrays
from privfl.errors import ConfigurationError
from privfl.privacy.record_level import AdaptiveClip
from privfl.runtime.engine import Simulation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_adaptive_clip import secure_run_equals_plain  # noqa: E402  (the record-level tests' helper)

K, N, DIM, CLASSES = 10, 30, 6, 3


def _data(seed=0, clients=K):
    """Clients whose inputs have different scales, so their changes have different norms."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(DIM, CLASSES))
    parts = []
    for k in range(clients):
        x = (rng.normal(size=(N, DIM)) * (0.3 + 0.4 * k)).astype(np.float32)
        parts.append((x, np.argmax(x @ w + rng.normal(size=(N, CLASSES)), 1).astype(np.int64)))
    x = rng.normal(size=(40, DIM)).astype(np.float32)
    return federated_from_arrays(parts, (x, np.argmax(x @ w, 1).astype(np.int64)), task="classification",
                                 num_classes=CLASSES, name="toy", design_size=N)


def _configs(quantile=0.5, rounds=2, epsilon=3.0, **kw):
    fed = FederationConfig(rounds=rounds, local_epochs=1, batch_size=10, lr=0.05, hidden=(), pool=1, seed=3)
    privacy = PrivacyConfig(epsilon=epsilon, delta=1e-5, unit="client", clip=0.1, secure_noise=False,
                            clip_quantile=quantile, **kw)
    return fed, privacy


def test_two_channels_the_budget_split_by_the_one_rule():
    fed, privacy = _configs(clip_share=0.05)
    sim = Simulation(DPFedAvg(fed, privacy), _data(), fed, privacy)
    sim.prepare()
    update, count = sim.channels
    assert (update.name, update.clip, update.budget_share) == ("update", NormClip(1.0), pytest.approx(0.95))
    assert (count.name, count.shape, count.clip, count.budget_share) == ("clip_count", (1,), NormClip(0.5),
                                                                         pytest.approx(0.05))
    z = sim.plan.noise_multipliers
    # each channel its share of rho: z_update = z / sqrt(0.95), z_count = z / sqrt(0.05), for the round's one z
    assert z["update"] * math.sqrt(0.95) == pytest.approx(z["clip_count"] * math.sqrt(0.05))
    assert ALGORITHMS["dp_fedavg"].adaptive_clipping


def test_a_client_sends_its_change_over_the_clip_and_its_bit():
    data = _data()
    fed, adaptive = _configs()
    _, fixed = _configs(quantile=None)
    outs = {}
    for name, privacy in (("adaptive", adaptive), ("fixed", fixed)):
        alg = DPFedAvg(fed, privacy)
        alg.setup(data, np.random.default_rng(0))
        alg.current_clip = 0.07
        outs[name] = dict(alg._local_updates(list(range(K)), data.train_parts,
                                             [np.random.default_rng([1, k]) for k in range(K)], vectorised=True))
    bits = []
    for k in range(K):
        change = np.asarray(outs["fixed"][k].values["update"], dtype=np.float64)
        sent = outs["adaptive"][k].values
        norm = np.linalg.norm(change)  # clipped to C_t, then over C_t (the pipeline's NormClip(1) then holds)
        np.testing.assert_allclose(sent["update"], change / max(norm, 0.07), rtol=1e-6, atol=1e-9)
        assert np.linalg.norm(sent["update"]) <= 1 + 1e-12
        assert sent["clip_count"].tolist() == [0.5 if np.linalg.norm(change) <= 0.07 else -0.5]
        bits.append(sent["clip_count"][0])
    assert set(bits) == {0.5, -0.5}  # the toy's norms straddle the clip


@pytest.mark.parametrize("broadcast", [2e-310, 0.0, -0.1, math.nan, math.inf, 1e-12, 50.0, "0.1"])
def test_a_clip_no_honest_server_reaches_is_refused_before_any_record_is_read(monkeypatch, broadcast):
    """An active server's C_t = 2e-310 made change / C_t overflow for the clients whose change exceeded about 0.036
    and not for the others: which clients erred was one bit of each client's data, outside every channel (found by a
    review). The client now checks the broadcast against what adaptive clipping can reach from the public start in
    the rounds so far, before its records are read, and the refusal's text is the same on neighbouring data."""
    fed, privacy = _configs()
    texts = []
    for seed in (0, 1):  # two different data sets: the refusal may not depend on them
        data = _data(seed)
        alg = DPFedAvg(fed, privacy)
        alg.setup(data, np.random.default_rng(0))
        alg.current_clip = broadcast

        def no_records(*a, **k):
            raise AssertionError("a record was read")

        monkeypatch.setattr(DPFedAvg.__mro__[1], "_local_updates", no_records)
        with pytest.raises(ConfigurationError, match="broadcast") as err:
            list(alg.client_updates(list(range(K)), data.train_parts, 1,
                                    [np.random.default_rng([1, k]) for k in range(K)]))
        with pytest.raises(ConfigurationError, match="broadcast"):
            alg.client_update(0, data.train_parts[0], 1, np.random.default_rng(1))
        monkeypatch.undo()
        texts.append(str(err.value))
    assert texts[0] == texts[1]


def test_the_clips_an_honest_server_reaches_are_accepted_and_scaled_without_overflow():
    """Every clip the server's step can reach, whatever the noisy counts (extreme ones included), passes the check;
    at the smallest clip a client accepts every client's scaled change is finite with norm <= 1."""
    rule = AdaptiveClip(0.5, lr=0.2)
    for counts in ([1e9] * 60, [-1e9] * 60, list(np.random.default_rng(0).normal(0, 50, 60))):
        clip = 0.1
        for t, count in enumerate(counts):
            assert rule.check_broadcast(clip, 0.1, t) == clip
            clip = rule.step(clip, count, 5.0)
    with pytest.raises(ConfigurationError):  # one update beyond the fastest descent
        rule.check_broadcast(0.1 * math.exp(-0.2 * 0.5 * 3) * 0.999, 0.1, 1)
    data = _data()
    fed, privacy = _configs()
    alg = DPFedAvg(fed, privacy)
    alg.setup(data, np.random.default_rng(0))
    alg.current_clip = 1e-30
    outs = dict(alg._local_updates(list(range(K)), data.train_parts,
                                   [np.random.default_rng([1, k]) for k in range(K)], vectorised=True))
    for out in outs.values():
        assert np.all(np.isfinite(out.values["update"])) and np.linalg.norm(out.values["update"]) <= 1 + 1e-12


def test_the_server_steps_the_clip_on_the_noisy_count_over_the_expected_participants():
    fed, privacy = _configs(sampling_rate=0.5)
    alg = DPFedAvg(fed, privacy)
    alg.setup(_data(), np.random.default_rng(0))
    start = alg.global_params.copy()
    update = Aggregate("update", np.ones(alg.dim), total_weight=4.0, participants=4, noise_std=0.3)
    count = Aggregate("clip_count", np.array([1.0]), total_weight=4.0, participants=4, noise_std=5.0)
    alg.server_update({"update": update, "clip_count": count}, 0)
    np.testing.assert_allclose(alg.global_params - start, 0.1 * np.ones(alg.dim) / 4.0)  # in units of C_0 = 0.1
    # expected participants 0.5 x 10 = 5 (public; never the round's realised 4): b = 1 / 5 + 1/2
    assert alg.current_clip == pytest.approx(AdaptiveClip(0.5).step(0.1, 1.0, 5.0))
    assert alg.current_clip == pytest.approx(0.1 * math.exp(-0.2 * (0.7 - 0.5)))
    assert alg.round_clip() == alg.current_clip


def test_the_clip_goes_to_the_quantile_of_the_clients_change_norms():
    """With little noise (epsilon 1000, half of it on the count), a tiny model step (the norms barely move) and clip
    step 0.5, 40 rounds from a clip over 5x every norm: the clip ends between the clients' change norms around the median."""
    fed, privacy = _configs(rounds=40, epsilon=1000.0, clip_share=0.5, clip_lr=0.5)
    fed = FederationConfig(**{**fed.__dict__, "lr": 1e-3})
    privacy = PrivacyConfig(**{**privacy.__dict__, "clip": 0.2})
    data = _data()
    alg = DPFedAvg(fed, privacy)
    result = Simulation(alg, data, fed, privacy).run()
    alg_fixed = DPFedAvg(fed, PrivacyConfig(**{**privacy.__dict__, "clip_quantile": None}))
    alg_fixed.setup(data, np.random.default_rng(0))
    alg_fixed.global_params = alg.global_params.copy()
    norms = sorted(np.linalg.norm(np.asarray(out.values["update"], dtype=np.float64)) for _, out in
                   alg_fixed._local_updates(list(range(K)), data.train_parts,
                                            [np.random.default_rng(k) for k in range(K)], vectorised=True))
    clips = [r.clip for r in result.history]
    assert clips[0] == 0.2 > 5 * norms[-1]  # it came down from far above every norm
    assert norms[2] <= alg.current_clip <= norms[7], (alg.current_clip, norms)
    assert result.audit["max_epsilon"] <= privacy.epsilon * (1 + 1e-9)


def test_every_ledger_charges_both_channels_as_one_sampled_event_a_round():
    fed, privacy = _configs(sampling_rate=0.5)
    sim = Simulation(DPFedAvg(fed, privacy), _data(), fed, privacy)
    result = sim.run()
    assert 2.9 < result.audit["max_epsilon"] <= 3.0 * (1 + 1e-9)
    charged = {c.channel for k in range(K) for c in sim.ledger.charges(str(k))}
    assert charged == {"update", "clip_count"}
    (event,) = round_events((0, e) for e in sim.plan.round_events(0).values())
    assert event.sampling_rate == 0.5
    # both channels inside the one sampled event (a composition of their two Gaussians), not beside it
    inner = event.event
    assert len(getattr(inner, "events", ())) == 2, inner
    released_in = {r.round: r.participants for r in result.history}
    for k in range(K):
        rows = sim.ledger.charges(str(k))
        for rnd in range(fed.rounds):  # every client, every round: both rows, released only where it was sampled
            mine = {c.channel: c for c in rows if c.round == rnd}
            assert set(mine) == {"update", "clip_count"}, (k, rnd)
            assert mine["update"].released == mine["clip_count"].released
        assert len(rows) == 2 * fed.rounds
    released = [sum(c.released for k in range(K) for c in sim.ledger.charges(str(k)) if c.round == rnd
                    and c.channel == "update") for rnd in range(fed.rounds)]
    assert released == [released_in[rnd] for rnd in range(fed.rounds)]


def test_secure_aggregation_gives_the_plain_runs_clips_and_model():
    fed, privacy = _configs(rounds=3)
    secure_run_equals_plain(lambda: DPFedAvg(fed, privacy), _data(), fed, privacy)


def test_privfl_run_takes_clip_adaptive_for_dp_fedavg(tmp_path):
    out = tmp_path / "run.json"
    assert main(["run", "--algorithm", "dp_fedavg", "--dataset", "digits", "--clients", "4", "--rounds", "3",
                 "--epsilon", "3", "--clip", "adaptive", "--clip-quantile", "0.7", "--quiet", "--json",
                 str(out)]) == 0
    run = json.loads(out.read_text())
    assert set(run["noise_applied"]) == {"update", "clip_count"}
    assert len(run["clip_per_round"]) == 3 and run["clip_per_round"][0] == 0.1  # dp_fedavg's default clip
    assert run["epsilon_spent_max"] <= 3.0 * (1 + 1e-9)


# -- black-box audit of one round's two releases --------------------------------------------------------------------

def _round_scores(noise_scale: float, trials: int = 20_000, epsilon: float = 4.0, delta: float = 1e-5):
    """One round at client sampling rate 1/2, central noise: D = {the canary client, whose change is far above the
    clip: its update the unit vector u, its bit -1/2} against D' = {the canary without its data: it contributes
    nothing}. Each trial samples the canary with probability 1/2; the server's view comes from the aggregator
    (``weighted_sums`` over the release with the plan's central noise times ``noise_scale``, or ``noise_only_sums``
    for a round that sampled nobody); the score is the likelihood ratio over both channels against the canary's
    contribution. Returns (scores on D, on D', the epsilon the ledger claims for the round)."""
    from privfl.accounting.accountants import make_accountant

    data = _data(clients=1)
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=10, lr=5.0, hidden=(), pool=1, seed=3)
    privacy = PrivacyConfig(epsilon=epsilon, delta=delta, unit="client", clip=1e-3, secure_noise=False,
                            clip_quantile=0.5, sampling_rate=0.5)
    sim = Simulation(DPFedAvg(fed, privacy), data, fed, privacy)
    sim.prepare()
    [(_, out, _)] = list(sim.client_half.client_updates([0], sim.broadcast(0), data.train_parts, [None],
                                                        [np.random.default_rng(0)]))
    contributions, stds = {}, {}
    for channel in sim.channels:
        contributions[channel.name] = np.asarray(channel.clip.apply(channel.validate(out.values[channel.name])),
                                                 dtype=np.float64)
        stds[channel.name] = sim.plan.noise_multipliers[channel.name] * channel.sensitivity
    assert np.linalg.norm(contributions["update"]) == pytest.approx(1.0) and contributions["clip_count"][0] == -0.5
    (event,) = round_events((0, e) for e in sim.plan.round_events(0).values())
    claimed = make_accountant("pld").compose(event).get_epsilon(delta)
    # the server's view is drawn through the aggregator itself: weighted_sums over the round's release (the canary's
    # contribution on D, a zero contribution on D': the roster is public, its data present or not) when the canary is
    # sampled, noise_only_sums when nobody is (an amplified round still steps by its noise)
    channels = {ch.name: ch for ch in sim.channels}
    multipliers = {name: z * noise_scale for name, z in sim.plan.noise_multipliers.items()}
    source = np.random.default_rng(int(noise_scale * 1000) + 5)
    scores = []
    for world in ("D", "D'"):
        score = np.zeros(trials)
        for t in range(trials):
            if source.random() < 0.5:
                releases = [Release("0", 0, name, c if world == "D" else np.zeros_like(c), 1.0, 0.0,
                                    stds[name] * noise_scale, f"audit/0/0/{name}") for name, c in contributions.items()]
                seen = weighted_sums(releases, channels, source)
            else:
                seen = noise_only_sums(list(channels.values()), multipliers, source)
            for name, c in contributions.items():
                sigma = stds[name] * noise_scale
                assert seen[name].noise_std == pytest.approx(sigma)  # the aggregator's noise is the plan's
                score[t] += np.asarray(seen[name].total) @ c / sigma ** 2
        scores.append(score)
    return scores[0], scores[1], claimed


def test_a_black_box_audit_of_the_round_stays_below_the_claim_and_catches_a_quarter_of_the_noise():
    """Measured (20,000 trials per world, the noise drawn by the aggregator): 1.63 against the claimed 4.00; with half
    the noise 3.85, a quarter 6.40 (caught)."""
    score_in, score_out, claimed = _round_scores(1.0)
    honest, *_ = epsilon_lower_bound(score_in, score_out, delta=1e-5)
    assert honest <= claimed, (honest, claimed)
    score_in, score_out, claimed = _round_scores(0.25)
    faulty, *_ = epsilon_lower_bound(score_in, score_out, delta=1e-5)
    assert faulty > claimed, (faulty, claimed)
