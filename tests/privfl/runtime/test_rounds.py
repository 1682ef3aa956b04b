"""The one round loop (privfl.runtime.rounds.run_rounds) that the in-process runtime and Flower's ServerApp both run:
what it decides for every transport (sampling, exhausted budgets, aborted rounds, divergence, resume), checked with
a scripted transport, and that both runtimes really go through it."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from privfl.errors import TrainingDiverged
from privfl.runtime.rounds import RoundOutcome, run_rounds


class Alg:
    name = "scripted"

    def __init__(self):
        self.global_params = np.zeros(2)
        self.updates = []

    def server_update(self, aggregates, rnd):
        self.updates.append((rnd, aggregates))


class Scripted:
    """A transport that records who it was asked to train and to charge; ``refuse`` maps round -> clients whose
    budget refuses that round; ``abort`` lists rounds secure aggregation aborts."""

    def __init__(self, refuse=None, abort=()):
        self.calls, self.refuse, self.abort = [], dict(refuse or {}), set(abort)

    def round(self, rnd, chosen, left_out):
        self.calls.append((rnd, list(chosen), list(left_out)))
        refused = tuple(k for k in self.refuse.get(rnd, ()) if k in chosen or k in left_out)
        trained = [k for k in chosen if k not in refused]
        if rnd in self.abort:
            return RoundOutcome(None, 0, refused, aborted=True)
        return RoundOutcome({"sum": float(len(trained))} if trained else None, len(trained), refused)

    def epsilons(self):
        return [0.5, 1.5]


def test_an_exhausted_client_is_never_asked_again_and_sits_out_every_later_round():
    alg, t = Alg(), Scripted(refuse={1: (2,)})
    records = run_rounds(alg, t, n_clients=4, rounds=4)
    assert [c[1] for c in t.calls] == [[0, 1, 2, 3]] * 2 + [[0, 1, 3]] * 2
    assert [r.sat_out for r in records] == [[], ["2"], ["2"], ["2"]]
    assert [r.participants for r in records] == [4, 3, 3, 3]
    assert records[-1].epsilon_max == 1.5 and records[-1].epsilon_mean == 1.0


def test_an_aborted_round_reaches_no_server_step_and_says_so():
    alg, t = Alg(), Scripted(abort={1})
    records = run_rounds(alg, t, n_clients=3, rounds=3)
    assert [rnd for rnd, _ in alg.updates] == [0, 2]
    assert [r.aborted for r in records] == [False, True, False]


def test_sampling_draws_the_whole_population_every_round_and_a_resumed_run_draws_where_the_first_left_off():
    q, n = 0.4, 6
    first = Scripted(refuse={0: (1,)})
    run_rounds(Alg(), first, n_clients=n, rounds=5, sampling_rate=q, sampler=np.random.default_rng(7))
    draws = np.random.default_rng(7)
    for rnd, chosen, left_out in first.calls:
        drawn = draws.random(n) < q  # one draw of every member, exhausted or not
        live = [k for k in range(n) if not (rnd > 0 and k == 1)]
        assert chosen == [k for k in live if drawn[k]] and left_out == [k for k in live if not drawn[k]]
    resumed = Scripted()
    run_rounds(Alg(), resumed, n_clients=n, rounds=5, first_round=3, sampling_rate=q,
               sampler=np.random.default_rng(7))
    plain = Scripted()
    run_rounds(Alg(), plain, n_clients=n, rounds=5, sampling_rate=q, sampler=np.random.default_rng(7))
    assert resumed.calls == plain.calls[3:]


def test_a_diverged_model_stops_the_run_on_every_transport():
    alg = Alg()

    class Diverging(Scripted):
        def round(self, rnd, chosen, left_out):
            if rnd == 1:
                alg.global_params = np.array([np.nan, 0.0])
            return super().round(rnd, chosen, left_out)

    seen = []
    with pytest.raises(TrainingDiverged, match="round 2 of 3"):
        run_rounds(alg, Diverging(), n_clients=2, rounds=3, on_round=seen.append)
    assert [r.round for r in seen] == [0]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="sampling_rate"):
        run_rounds(Alg(), Scripted(), n_clients=2, rounds=1, sampling_rate=0.0)
    with pytest.raises(ValueError, match="sampler"):
        run_rounds(Alg(), Scripted(), n_clients=2, rounds=1, sampling_rate=0.5)


def test_both_runtimes_run_the_one_loop():
    """The in-process runtime and Flower's ServerApp call run_rounds, and neither holds a loop over rounds of its own
    (the only ``for rnd in range`` of either module is gone)."""
    from privfl.flower import app
    from privfl.runtime import engine

    for source in (inspect.getsource(engine.Simulation._run), inspect.getsource(app._serve)):
        assert "run_rounds(" in source
    for module in (engine, app):
        assert "for rnd in range(" not in inspect.getsource(module)


def test_privacy_snr_estimates_the_signal_from_the_noisy_sum_alone():
    from privfl.core.aggregation import Aggregate
    from privfl.runtime.rounds import privacy_snr

    rng = np.random.default_rng(0)
    d, sigma = 200_000, 0.01
    signal = rng.normal(size=d)
    signal *= 3.0 / np.linalg.norm(signal)  # ||S|| = 3, noise norm sigma sqrt(d) = 4.47
    noisy = Aggregate("update", signal + rng.normal(0, sigma, d), 5.0, 5, sigma)
    assert privacy_snr({"update": noisy})["update"] == pytest.approx(3.0 / (sigma * np.sqrt(d)), rel=0.02)
    # no signal: ||N||^2 - d sigma^2 fluctuates by sigma^2 sqrt(2 d), so the estimate is about (2 / d)^(1/4) = 0.06
    # at most (never negative), far below the signal's 0.67 above
    drowned = Aggregate("update", rng.normal(0, sigma, d), 5.0, 5, sigma)
    assert 0.0 <= privacy_snr({"update": drowned})["update"] < 0.1
    # no noise the server knows of (non-private, DP-SGD-trained): no ratio; an aborted round: none either
    assert privacy_snr({"update": Aggregate("update", signal, 5.0, 5, 0.0)}) == {}
    assert privacy_snr(None) == {}


def test_the_snr_reaches_the_run_json_from_privfl_run(tmp_path):
    """From the user's entry point: a private run's JSON carries each round's SNR per noised channel; a
    non-private one's rounds carry none."""
    import json

    from privfl.apps.cli import main

    def run(*extra):
        out = tmp_path / f"run{len(extra)}.json"
        assert main(["run", "--algorithm", "dp_fedavg", "--dataset", "digits", "--clients", "4", "--rounds", "2",
                     "--hidden", "8", "--json", str(out), "--quiet", *extra]) == 0
        return json.loads(out.read_text())

    private = run("--epsilon", "3")
    assert len(private["snr_per_round"]) == 2
    assert all(set(r) == {"update"} and r["update"] >= 0 for r in private["snr_per_round"])
    plain = run("--epsilon", "inf", "--algorithm", "fedavg")
    assert plain["snr_per_round"] == [{}, {}]


def _dp_fedavg_sampled(clients: int, rounds: int, sampling_rate: float, placement: str = "central", seed: int = 0):
    """DP-FedAvg at client level with client sampling on a toy federation: (algorithm, data, fed, privacy)."""
    from privfl.algorithms import ALGORITHMS
    from privfl.core.config import FederationConfig, PrivacyConfig
    from privfl.data import federated_from_arrays

    rng = np.random.default_rng(seed)
    parts = [(rng.normal(size=(12, 4)).astype(np.float32), rng.integers(0, 2, 12)) for _ in range(clients)]
    data = federated_from_arrays(parts, parts[0], task="classification", num_classes=2, name="toy", design_size=12)
    fed = FederationConfig(rounds=rounds, local_epochs=1, batch_size=6, lr=0.1, hidden=(), pool=1, seed=0)
    privacy = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="client", clip=0.5, placement=placement,
                            sampling_rate=sampling_rate, accountant="pld", secure_noise=False)
    return ALGORITHMS["dp_fedavg"](fed, privacy), data, fed, privacy


@pytest.mark.parametrize("placement", ["central", "local"])
def test_an_amplified_run_divides_by_the_expected_participants_never_the_realised(placement):
    """Client-level DP-FedAvg with client sampling under central noise (the one amplified case): the server's step
    gets the sums over sampling_rate x clients, whatever the round's sample size, so the published model's noise
    scale does not tell how many took part (amplification holds only while the sample stays secret; a review
    measured the realised denominator's leak between 10 and 9 clients: a lower bound of 3.52 against 3). Without
    amplification (local noise: the server sees who sent) the realised total stays."""
    from privfl.runtime.engine import Simulation

    alg, data, fed, privacy = _dp_fedavg_sampled(10, 6, 0.5, placement)
    seen = []
    step = alg.server_update

    def server_update(aggregates, rnd):
        seen.append((aggregates["update"].total_weight, aggregates["update"].participants))
        return step(aggregates, rnd)

    alg.server_update = server_update
    result = Simulation(alg, data, fed, privacy).run()
    realised = [r.participants for r in result.history if r.participants]
    assert len(set(realised)) > 1  # the sample sizes differ between rounds
    if placement == "central":  # what the server step reads: the expected count, weight and participants alike
        assert len(seen) == fed.rounds and all(weight == count == 5.0 for weight, count in seen)
    else:
        assert [count for _, count in seen] == realised and all(weight == count for weight, count in seen)


def test_an_amplified_round_that_samples_nobody_still_steps_by_its_noise():
    """Under amplification a round in which nobody was sampled used to publish no step: an observer of the model
    then knew that, conditioned on a published round, each client had been sampled with more than the amplified
    rate (1 - (1 - q)^n of the rounds are published: 3 clients at q = 0.2 give 0.2 / 0.488 = 0.41, not 0.2). Now the
    server adds the round's central noise to a zero sum and steps (``noise_only_sums``), as in any other round."""
    from privfl.runtime.engine import Simulation

    alg, data, fed, privacy = _dp_fedavg_sampled(3, 12, 0.2, seed=1)
    steps = []
    step = alg.server_update

    def server_update(aggregates, rnd):
        steps.append((rnd, np.asarray(aggregates["update"].total), aggregates["update"].noise_std))
        return step(aggregates, rnd)

    alg.server_update = server_update
    sim = Simulation(alg, data, fed, privacy)
    result = sim.run()
    empty = [r.round for r in result.history if r.participants == 0]
    assert empty and [rnd for rnd, _, _ in steps] == list(range(fed.rounds))  # every round steps
    expected_std = sim.plan.noise_multipliers["update"] * 0.5
    for rnd, total, std in steps:
        assert std == pytest.approx(expected_std)
        if rnd in empty:  # noise alone, of the round's std
            assert 0.5 * expected_std < np.std(total) < 1.5 * expected_std


def test_secure_aggregation_under_amplifying_client_sampling_is_refused_up_front():
    """A round under secure aggregation aborts below its survivor floor, so one client's participation could decide
    whether the others' sum is published: client sampling does not amplify there, and the run is refused before
    anything is charged, naming what to change."""
    from privfl.errors import ConfigurationError
    from privfl.privacy.secure import SecureAggregation
    from privfl.runtime.engine import Simulation

    alg, data, fed, privacy = _dp_fedavg_sampled(4, 2, 0.5, seed=1)
    sim = Simulation(alg, data, fed, privacy, secure=SecureAggregation(bits=48))
    with pytest.raises(ConfigurationError, match="sampling_rate=1"):
        sim.run()
    assert not any(sim.ledger.charges(str(k)) for k in range(4))
