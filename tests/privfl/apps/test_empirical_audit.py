"""Mechanism-level empirical audit: the lower bound never exceeds the claim; injected faults are caught."""

import functools

import numpy as np
import pytest

from privfl.apps.empirical_audit import audit_gaussian_release


@pytest.mark.timeout(120)
@pytest.mark.parametrize("z", [1.0, 2.0])
def test_lower_bound_stays_below_the_claimed_epsilon(z):
    result = audit_gaussian_release(z, trials=100_000, seed=1)
    assert 0 < result.epsilon_lower_bound <= result.claimed_epsilon
    assert result.passed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mutation", ["half_noise", "no_clip"])
def test_mutations_are_caught(mutation):
    result = audit_gaussian_release(2.0, trials=100_000, mutation=mutation, seed=2)
    assert result.epsilon_lower_bound > result.claimed_epsilon, result


def test_bad_arguments():
    with pytest.raises(ValueError, match="mutation"):
        audit_gaussian_release(1.0, mutation="other")
    with pytest.raises(ValueError, match="trials"):
        audit_gaussian_release(1.0, trials=10)


# -- DP-FedSGD: the algorithm's own client step, black box -----------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _client_sums(sim, data, channel, trials: int, seed: int) -> list[np.ndarray]:
    """``trials`` draws of the canary client's release on D (its one record) and on D' (no record), each draw with
    its own generator: what the client half sends, as it sends it."""
    half, broadcast, present = sim.client_half, sim.broadcast(0), data.train_parts[0]
    sums = []
    for dataset in (present, present.subset(np.arange(0))):
        rngs = [np.random.default_rng([seed, i]) for i in range(trials)]
        sums.append(np.stack([out.values[channel.name].value for _, out, _ in
                              half.client_updates(range(trials), broadcast, [dataset] * trials, [None] * trials,
                                                  rngs)]))
    return sums


def _dp_fedsgd_sums(trials: int = 30_000, epsilon: float = 4.0, delta: float = 1e-5):
    """``trials`` runs of DP-FedSGD's client step (Poisson coin at q = 1/2, per-example clip, box) on D = {an outlier
    record} and on its neighbour D' = {} (the worst case: nothing else in the sum), projected on the outlier's clipped
    gradient; the std of the plan's central noise; and the epsilon the ledger claims for that round."""

    from privfl.accounting.accountants import make_accountant
    from privfl.algorithms.dp_fedsgd import DPFedSGD
    from privfl.core.config import FederationConfig, PrivacyConfig
    from privfl.data import federated_from_arrays
    from privfl.runtime.engine import Simulation

    rng = np.random.default_rng(3)
    canary = (np.full((1, 4), 50.0, np.float32), np.array([1], np.int64))  # gradient norm >> C: clipped to C
    test = (rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 2, 8).astype(np.int64))
    data = federated_from_arrays([canary], test, task="classification", num_classes=2, name="canary")
    fed = FederationConfig(rounds=1, hidden=(), client_size=2, seed=0)  # public total 2, lot 1: q = 1/2
    privacy = PrivacyConfig(epsilon=epsilon, delta=delta, unit="example", clip=1.0, secure_noise=False)
    sim = Simulation(DPFedSGD(fed, privacy, lot_size=1), data, fed, privacy)
    sim.prepare()
    (channel,) = sim.channels
    assert channel.record_sampling_rate == 0.5
    sums = _client_sums(sim, data, channel, trials, seed=5)
    drawn = np.linalg.norm(sums[0], axis=1)
    assert 0.4 < np.mean(drawn > 0) < 0.6 and not np.any(sums[1])  # the coin of q = 1/2; D' sends zeros
    direction = sums[0][drawn.argmax()] / drawn.max()  # the outlier's clipped gradient (norm C)
    std = sim.plan.noise_multipliers[channel.name] * channel.sensitivity
    claimed = make_accountant("pld").compose(sim.plan.round_events(0)[channel.name]).get_epsilon(delta)
    return sums[0] @ direction, sums[1] @ direction, std, claimed


def _dp_fedsgd_scores(noise_scale: float):
    """The projected releases with ``noise_scale`` times the plan's noise, and the claimed epsilon."""

    projected_in, projected_out, std, claimed = _dp_fedsgd_sums()
    rng = np.random.default_rng(int(noise_scale * 1000))
    # the noise is isotropic: its projection on the unit direction is N(0, std^2)
    return (projected_in + rng.normal(scale=std * noise_scale, size=projected_in.shape),
            projected_out + rng.normal(scale=std * noise_scale, size=projected_out.shape), claimed)




# -- DP-FedSGD with distributed noise: the client's encoding under secure aggregation, black box ------------------

@functools.lru_cache(maxsize=1)
def _dp_fedsgd_distributed(trials: int = 20_000, epsilon: float = 4.0, delta: float = 1e-5, clients: int = 3):
    """DP-FedSGD with ``placement="distributed"``: client 0 holds one outlier record (D) or none (D'), the other
    clients none (the worst case: nothing else in the sum). ``trials`` runs of client 0's own step (Poisson coin at
    q = 1/2, per-example clip, box); the run's encodings (quantiser and discrete-Gaussian share, from public facts);
    the outlier's clipped direction; and the epsilon the ledger claims for the round (the plan's event: the sampled
    Gaussian the shares' sum nearly is, with its total-variation term, under pld)."""

    from privfl.accounting.accountants import make_accountant
    from privfl.algorithms.dp_fedsgd import DPFedSGD
    from privfl.core.config import FederationConfig, PrivacyConfig
    from privfl.data import federated_from_arrays
    from privfl.runtime.engine import Simulation
    from privfl.privacy.secure import (SecureAggregation, channel_encodings, local_noise_stds, public_weight_bound)

    rng = np.random.default_rng(4)
    canary = (np.full((1, 4), 50.0, np.float32), np.array([1], np.int64))  # gradient norm >> C: clipped to C
    empty = (np.zeros((0, 4), np.float32), np.zeros(0, np.int64))
    test = (rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 2, 8).astype(np.int64))
    data = federated_from_arrays([canary] + [empty] * (clients - 1), test, task="classification", num_classes=2,
                                 name="canary")
    fed = FederationConfig(rounds=1, hidden=(), client_size=2, seed=0)  # public total 2 per client
    privacy = PrivacyConfig(epsilon=epsilon, delta=delta, unit="example", clip=1.0, secure_noise=False,
                            placement="distributed")  # the pld accountant: the shares' sum charged as a Gaussian
    secure = SecureAggregation(min_survivors=clients, malicious=False)
    sim = Simulation(DPFedSGD(fed, privacy, lot_size=clients), data, fed, privacy, secure=secure)  # q = 1/2
    sim.prepare()
    (channel,) = sim.channels
    assert channel.record_sampling_rate == 0.5
    encodings = channel_encodings(sim.channels, secure, n_clients=clients,
                                  local_stds=local_noise_stds(sim.channels, sim.plan.placement, sim.multipliers),
                                  weight_bound=public_weight_bound(privacy, sim.public), distributed=sim.plans)
    assert encodings[channel.name].noise_sigma > 0 and encodings[channel.name].min_inputs == clients
    sums = _client_sums(sim, data, channel, trials, seed=6)
    drawn = np.linalg.norm(sums[0], axis=1)
    assert 0.4 < np.mean(drawn > 0) < 0.6 and not np.any(sums[1])
    direction = sums[0][drawn.argmax()] / drawn.max()
    assert privacy.resolved_accountant == "pld"
    claimed = make_accountant("pld").compose(sim.plan.round_events(0)[channel.name]).get_epsilon(delta)
    return sums, channel, encodings, direction, claimed


def _dp_fedsgd_distributed_scores(sigma_scale: float):
    """Each trial's secure sum as the server decodes it (client 0's encoding of its sampled sum plus the others'
    encodings of zero sums, each with its own discrete-Gaussian share, summed mod 2^bits), projected on the
    outlier's direction; ``sigma_scale`` scales every share's std (a fault to catch when < 1).

    The trials go through the real encoder and decoder in one call each: every step of both (clip into the range,
    stochastic rounding, the discrete-Gaussian share, the words mod 2^bits, decoding the sum) acts on each coordinate
    alone with the quantiser's scalar range and step, so a channel of ``trials x d`` coordinates is ``trials``
    independent rounds of the ``d``-coordinate channel, drawn from the same distributions."""
    import dataclasses

    from privfl.core.release import Release
    from privfl.privacy.secure import decode_secure_sum, encode_for_secure_sum

    sums, channel, encodings, direction, claimed = _dp_fedsgd_distributed()
    (enc,) = encodings.values()
    assert np.ndim(enc.quantiser.low) == 0 and np.ndim(enc.quantiser.high) == 0  # coordinate-wise, as said above
    modulus = np.uint64(1) << np.uint64(enc.quantiser.bits) if enc.quantiser.bits < 64 else None
    clients = enc.min_inputs
    rng = np.random.default_rng(int(sigma_scale * 1000) + 7)
    scores = []
    for values in sums:
        trials = len(values)
        batched = {channel.name: dataclasses.replace(enc, shape=(trials * enc.size,),
                                                     noise_sigma=enc.noise_sigma * sigma_scale)}
        zero = np.zeros(trials * enc.size)
        releases = [{channel.name: Release(str(k), 0, channel.name, values.ravel() if k == 0 else zero, 1.0, 0.0,
                                           0.0, f"audit/{k}")} for k in range(clients)]
        words = [encode_for_secure_sum(r, batched, rng, secure_noise=False) for r in releases]
        total = words[0]
        for w in words[1:]:
            total = total + w
        if modulus is not None:
            total = total % modulus
        agg = decode_secure_sum(total, batched, {channel.name: channel},
                                [{channel.name: r[channel.name].header} for r in releases])
        scores.append(agg[channel.name].total.reshape(trials, enc.size) @ direction)
    return scores[0], scores[1], claimed



# -- DP-FedSGD with its Laplace posterior: two channels (gradient sums, Fisher traces) on one lot, black box ----------

@functools.lru_cache(maxsize=3)
def _dp_fedsgd_posterior(posterior: str, trials: int = 20_000, epsilon: float = 4.0, delta: float = 1e-5):
    """``trials`` runs of the client step of ``dp_fedsgd`` with ``posterior`` (``"laplace"``: two channels on one lot;
    ``"variational"``: the Bayesian twin's gradient, each record at weight noise of its own; ``"adaptive"``: no
    posterior, adaptive clipping's two channels on one lot, the gradient in clips and the clip count; Poisson coin at
    q = 1/2) on D = {an outlier record} and D' = {}: every channel as the client sends it, its noise std, and the
    epsilon the ledger claims for the round (a lot's sampled events grouped into one, as the ledger composes them)."""
    from privfl.accounting.accountants import make_accountant
    from privfl.accounting.rounds import round_events
    from privfl.algorithms.dp_fedsgd import DPFedSGD
    from privfl.core.config import FederationConfig, PrivacyConfig
    from privfl.data import federated_from_arrays
    from privfl.runtime.engine import Simulation

    rng = np.random.default_rng(4)
    canary = (np.full((1, 4), 50.0, np.float32), np.array([1], np.int64))
    test = (rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 2, 8).astype(np.int64))
    data = federated_from_arrays([canary], test, task="classification", num_classes=2, name="canary")
    fed = FederationConfig(rounds=1, hidden=(), client_size=2, seed=0)
    adaptive = posterior == "adaptive"
    privacy = PrivacyConfig(epsilon=epsilon, delta=delta, unit="example", clip=1.0, secure_noise=False,
                            clip_quantile=0.5 if adaptive else None)
    sim = Simulation(DPFedSGD(fed, privacy, lot_size=1, posterior="none" if adaptive else posterior), data, fed,
                     privacy)
    sim.prepare()
    released = {}
    for channel in sim.channels:
        assert channel.record_sampling_rate == 0.5
        _client_sums.cache_clear()
        released[channel.name] = (_client_sums(sim, data, channel, trials, seed=6),
                                  sim.plan.noise_multipliers[channel.name] * channel.sensitivity)
    (event,) = round_events((0, e) for e in sim.plan.round_events(0).values())
    claimed = make_accountant("pld").compose(event).get_epsilon(delta)
    return released, claimed


def _dp_fedsgd_posterior_scores(posterior: str, noise_scale: float):
    """The likelihood-ratio score of the channels with ``noise_scale`` times the plan's noise: each channel's release
    projected on the canary's contribution (the largest drawn), over its noise variance, summed."""
    released, claimed = _dp_fedsgd_posterior(posterior)
    rng = np.random.default_rng(int(noise_scale * 1000) + 1)
    score_in = score_out = 0.0
    for (present, absent), std in released.values():
        assert not np.any(absent)  # D' sends zeros
        contribution = present[np.linalg.norm(present, axis=1).argmax()]
        sigma = std * noise_scale
        noisy_in = present + rng.normal(scale=sigma, size=present.shape)
        noisy_out = absent + rng.normal(scale=sigma, size=absent.shape)
        score_in = score_in + noisy_in @ contribution / sigma ** 2
        score_out = score_out + noisy_out @ contribution / sigma ** 2
    return score_in, score_out, claimed


@functools.lru_cache(maxsize=1)
def _dp_fedsgd_banded(trials: int = 20_000, epsilon: float = 4.0, delta: float = 1e-5, bands: int = 2):
    """DP-FedSGD with correlated noise (``bands`` = 2): one block of b rounds of the canary client's own step (its
    one outlier record in a group drawn at random, sampled at b q = 1/2 in its group's round; its last b sums mixed
    by the strategy) on D = {the outlier} and D' = {}, each trial a client of its own carried over the rounds with
    its state; the strategy's coefficients, the noise std, and the epsilon the ledger claims for the block (its
    rounds' charges composed: the block's sampled event, then a no-op)."""
    from privfl.accounting.accountants import make_accountant
    from privfl.algorithms.dp_fedsgd import DPFedSGD
    from privfl.core.config import FederationConfig, PrivacyConfig
    from privfl.data import federated_from_arrays
    from privfl.runtime.engine import Simulation

    rng = np.random.default_rng(7)
    canary = (np.full((1, 4), 50.0, np.float32), np.array([1], np.int64))
    test = (rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 2, 8).astype(np.int64))
    data = federated_from_arrays([canary], test, task="classification", num_classes=2, name="canary")
    fed = FederationConfig(rounds=bands, hidden=(), client_size=4, seed=0)  # public total 4, lot 1: q = 1/4
    privacy = PrivacyConfig(epsilon=epsilon, delta=delta, unit="example", clip=1.0, secure_noise=False)
    sim = Simulation(DPFedSGD(fed, privacy, lot_size=1, bands=bands), data, fed, privacy)
    sim.prepare()
    (channel,) = sim.channels
    assert channel.record_sampling_rate == 0.5 and channel.record_bands == bands
    half, present = sim.client_half, data.train_parts[0]
    streams = []
    for dataset in (present, present.subset(np.arange(0))):
        rngs = [np.random.default_rng([8, i]) for i in range(trials)]
        states, rows = [None] * trials, []
        for rnd in range(bands):
            out = list(half.client_updates(range(trials), sim.broadcast(rnd), [dataset] * trials, states, rngs))
            rows.append(np.stack([o.values[channel.name].value for _, o, _ in out]))
            states = [state for _, _, state in out]
        streams.append(np.stack(rows, axis=1))  # trials x rounds x d
    accountant = make_accountant("pld")
    for rnd in range(bands):
        accountant.compose(sim.pipelines[0].event_for(channel.name, None, opens=rnd == 0))
    std = sim.plan.noise_multipliers[channel.name] * channel.sensitivity
    return streams, sim.algorithm.band_coefficients, std, accountant.get_epsilon(delta)


def _dp_fedsgd_banded_scores(noise_scale: float):
    """The likelihood-ratio score of a block's released stream, the canary's group unknown: log of the mean over
    its groups g of exp(sum_t <y_t, c_(t-g) u> / s^2 - sum_t c_(t-g)^2 |u|^2 / (2 s^2)), u its clipped gradient,
    with ``noise_scale`` times the plan's noise (fresh every round, as the pipeline draws it)."""
    (present, absent), c, std, claimed = _dp_fedsgd_banded()
    assert not np.any(absent)  # D' sends zeros
    first = present[:, 0]
    u = first[np.linalg.norm(first, axis=1).argmax()] / c[0]  # the canary's clipped gradient (group 0, sampled)
    assert np.linalg.norm(u) == pytest.approx(1.0, rel=1e-5)
    rng = np.random.default_rng(int(noise_scale * 1000) + 2)
    sigma = std * noise_scale
    b = len(c)
    shifts = np.array([[c[t - g] if t >= g else 0.0 for t in range(b)] for g in range(b)])  # group x round
    scores = []
    for stream in (present, absent):
        noisy = stream + rng.normal(scale=sigma, size=stream.shape)
        projected = noisy @ u  # trials x rounds
        logits = (projected @ shifts.T - 0.5 * (shifts ** 2).sum(1)) / sigma ** 2
        scores.append(np.logaddexp.reduce(logits, axis=1))
    return scores[0], scores[1], claimed


# central: the plan's Gaussian added to the sum; distributed: the secure sum of the clients' encodings; laplace: the
# central Gaussian on both of the Laplace posterior's channels; variational: on the Bayesian twin's gradient; adaptive:
# on adaptive clipping's two channels (the gradient in clips, the clip count); banded: a block of correlated-noise
# rounds, each its fresh Gaussian
_DP_FEDSGD_SCORES = {"central": lambda scale: _dp_fedsgd_scores(scale),
                     "distributed": lambda scale: _dp_fedsgd_distributed_scores(scale),
                     "laplace": lambda scale: _dp_fedsgd_posterior_scores("laplace", scale),
                     "variational": lambda scale: _dp_fedsgd_posterior_scores("variational", scale),
                     "adaptive": lambda scale: _dp_fedsgd_posterior_scores("adaptive", scale),
                     "banded": lambda scale: _dp_fedsgd_banded_scores(scale)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("placement", sorted(_DP_FEDSGD_SCORES))
def test_dp_fedsgd_round_lower_bound_stays_below_the_claim_and_catches_a_quarter_of_the_noise(placement):
    """On the same draws of the client's releases (one test, so that they are drawn once): with the plan's noise the
    lower bound stays below the ledger's claim; with a quarter of the noise's std (the Gaussian's, or every
    discrete-Gaussian share's) it must be above it."""
    from privfl.apps.empirical_audit import epsilon_lower_bound

    score_in, score_out, claimed = _DP_FEDSGD_SCORES[placement](1.0)
    assert claimed <= 4.0
    eps_lb, *_ = epsilon_lower_bound(score_in, score_out, delta=1e-5)
    assert 0 < eps_lb <= claimed

    score_in, score_out, claimed = _DP_FEDSGD_SCORES[placement](0.25)
    eps_lb, *_ = epsilon_lower_bound(score_in, score_out, delta=1e-5)
    assert eps_lb > claimed


@pytest.mark.timeout(120)
def test_the_cli_exits_non_zero_when_a_claim_fails_or_a_mutation_is_missed(capsys):
    """`privfl audit-mechanism`: exit 0 when the claim holds, and with --mutation exit 0 only when the fault is
    caught; a missed mutation (at z = 0.5 halving the noise leaves the bound below the looser claim) exits 1 (it
    exited 0 whatever the audit found, so a CI step running a mutation could not fail)."""
    from privfl.apps.cli import main

    assert main(["audit-mechanism", "--noise-multiplier", "1", "--trials", "20000"]) == 0
    assert main(["audit-mechanism", "--noise-multiplier", "1", "--trials", "20000", "--mutation", "no_clip"]) == 0
    assert main(["audit-mechanism", "--noise-multiplier", "0.5", "--trials", "20000", "--mutation", "half_noise"]) == 1
    capsys.readouterr()
