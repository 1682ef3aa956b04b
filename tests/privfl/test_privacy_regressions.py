"""One regression test per bug of the privacy-soundness issue (bug 2, pooled standardisation, is tested in
tests/privfl/data/test_data_public_preprocessing.py; bug 6, the secure sampler's tails, in
tests/mechanisms/test_secure_noise.py). The neighbouring-dataset contract (test_neighbouring_contract.py) covers
bugs 1-4 across every configuration; these pin each bug on its own, with a black-box distinguisher where one
applies."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits

from privfl.accounting.accountants import make_accountant
from privfl.accounting.ledger import PrivacyLedger
from privfl.algorithms.dp_fedavg import DPFedAvg
from privfl.algorithms.dpsgd_fedavg import DPSGDFedAvg
from privfl.core.channels import Channel, NormClip, PreClipped
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays
from privfl.apps.empirical_audit import epsilon_lower_bound
from privfl.errors import ConfigurationError
from privfl.core.public import SEEDED_NOISE_WARNING, PublicFacts
from privfl.core.release import ReleasePipeline
from privfl.runtime.engine import Simulation
from privfl.privacy.secure import SecureAggregation, calibrate_distributed, check_secure_channels, plan_distributed_noise



def _digits(sizes):
    d = load_digits()
    x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
    parts, start = [], 0
    for n in sizes:
        parts.append((x[start:start + n], y[start:start + n]))
        start += n
    return federated_from_arrays(parts, (x[1500:1600], y[1500:1600]), task="classification", num_classes=10,
                                 design_size=round(sum(len(y) for _, y in parts) / len(parts)))


# ---------------------------------------------------------------------------------------------- bug 1: n_k


def _dpsgd_update(data, public, privacy, fed, seed):
    alg = DPSGDFedAvg(fed, privacy)
    alg.setup(public, np.random.default_rng(0))
    out = alg.client_update(0, data.train_parts[0], 0, np.random.default_rng(seed))
    return out


def test_record_count_leaves_no_trace_in_dpsgd_metadata():
    """63 vs 64 vs 65 records: same weight, same schedule, same event (q, steps, z) -- the landed code sent the
    weight n_k and derived q, the step count and z from it."""
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=0)
    privacy = PrivacyConfig(epsilon=1.0, unit="example", accountant="pld")
    public = PublicFacts(n_clients=1, task="classification", num_classes=10, input_shape=(64,), client_size=64)
    outs = [_dpsgd_update(_digits([n]), public, privacy, fed, 0) for n in (63, 64, 65)]
    assert {o.weight for o in outs} == {1.0}
    assert len({o.values["update"].event for o in outs}) == 1


@pytest.mark.timeout(300)
def test_63_vs_64_records_are_not_distinguishable_beyond_the_claim():
    """Black box: the audit's distinguisher (the update's norm, which grew with the step count the record count set)
    on 300 runs per side; its Clopper-Pearson lower bound on epsilon must stay below the claimed epsilon = 1."""
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=32, lr=0.5, hidden=(), seed=0)
    privacy = PrivacyConfig(epsilon=1.0, unit="example", accountant="pld")
    public = PublicFacts(n_clients=1, task="classification", num_classes=10, input_shape=(64,), client_size=64)
    d63, d64 = _digits([63]), _digits([64])
    trials = 300
    norms = {n: np.array([np.linalg.norm(_dpsgd_update(d, public, privacy, fed, s).values["update"].value)
                          for s in range(trials)]) for n, d in ((63, d63), (64, d64))}
    lower = max(epsilon_lower_bound(norms[64], norms[63], delta=1e-5)[0],
                epsilon_lower_bound(-norms[64], -norms[63], delta=1e-5)[0])
    assert lower <= 1.0


# ---------------------------------------------------------------------------------- bug 3: distributed noise


def test_distributed_noise_is_planned_for_the_channels_relation():
    """A replace-one channel (sensitivity 2C) gets twice the noise of an add/remove one and is charged the KLS
    bound of its rounded replace-one sensitivity; the landed code planned both alike (rho under-charged 4x)."""
    cfg = SecureAggregation(bits=48)
    add = Channel("u", (10,), unit="client", clip=NormClip(1.0), adjacency="add_remove")
    rep = Channel("u", (10,), unit="client", clip=NormClip(1.0), adjacency="replace_one")
    for accountant in ("zcdp", "pld"):
        plan_add = calibrate_distributed([add], 1.0, 1e-5, 1, 3, cfg, accountant=accountant)["u"]
        plan_rep = calibrate_distributed([rep], 1.0, 1e-5, 1, 3, cfg, accountant=accountant)["u"]
        assert plan_rep.noise_multiplier == pytest.approx(plan_add.noise_multiplier, rel=0.05)  # z per sensitivity
        assert plan_rep.noise_std(3) == pytest.approx(2 * plan_add.noise_std(3), rel=0.05)  # so twice the noise
        for plan in (plan_add, plan_rep):
            assert make_accountant(accountant).compose(plan.event).get_epsilon(1e-5) <= 1.0
        # the add/remove plan's noise (multiplier z of C), charged honestly for a replace-one channel (z / 2 of
        # 2C), costs about 4x the rho (twice the Gaussian's sensitivity over the same noise)
        same = plan_distributed_noise(1.0, 10, plan_add.noise_multiplier / 2, 3, 3, 48, sensitivity=2.0,
                                      relation="replace_one", gaussian=accountant == "pld")
        assert same.noise_std(3) == pytest.approx(plan_add.noise_std(3), rel=1e-6)
        if accountant == "zcdp":
            assert same.event.rho > 3.5 * plan_add.event.rho
        else:
            assert same.event.event.mu > 1.9 * plan_add.event.event.mu


# -------------------------------------------------------------------------------- bug 4: quantiser ranges


def test_secure_aggregation_refuses_a_private_channel_without_a_public_range():
    unbounded = Channel("scatter", (4,), unit="example", clip=PreClipped(1.0, "squared_sum"))
    with pytest.raises(ConfigurationError, match="public coordinate bound"):
        check_secure_channels([unbounded])
    check_secure_channels([Channel("scatter", (4,), unit="example", clip=PreClipped(1.0, "squared_sum"),
                                   value_bound=50.0)])


def test_quantiser_range_does_not_depend_on_the_uploads():
    from privfl.privacy.secure import _range

    ch = Channel("scatter", (4,), unit="example", clip=PreClipped(1.0, "squared_sum"), value_bound=50.0)
    led = PrivacyLedger(":memory:", "r", delta=1e-5)
    pipe = ReleasePipeline("0", [ch], led, {"scatter": 2.0}, placement="central", noise=0)
    from privfl.core.channels import ClippedValue

    small = pipe.release(0, {"scatter": ClippedValue(np.full(4, 0.1), 1.0, "squared_sum")})["scatter"]
    large = pipe.release(1, {"scatter": ClippedValue(np.full(4, 9.0), 1.0, "squared_sum")})["scatter"]
    assert _range(ch, [small]) == _range(ch, [large]) == 50.0


# ---------------------------------------------------------------------------------- bug 5: predictable noise


def _dp_fedavg_run(data, secure_noise):
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=16, lr=0.1, hidden=(), seed=0)
    privacy = PrivacyConfig(epsilon=3.0, unit="client", clip=0.5, placement="local", secure_noise=secure_noise)
    sim = Simulation(DPFedAvg(fed, privacy), data, fed, privacy)
    sim.prepare()
    releases = {k: sim.client_step(k, 0)["update"].value for k in range(2)}
    return sim, releases


def test_same_seed_on_other_data_does_not_reveal_the_noise_by_default():
    """An adversary re-runs the public configuration (same seed) on dummy data and subtracts: with the default
    secure noise what remains is noise, not the client's clipped update; only an explicitly seeded run gives the
    noise away, and its ledger and audit say so."""
    real = _digits([40, 40])
    dummy = federated_from_arrays([(np.zeros((40, 64), np.float32), np.zeros(40, np.int64))] * 2,
                                  (real.test.x, real.test.y), task="classification", num_classes=10,
                                  design_size=40)
    for secure in (True, False):
        sim_real, r_real = _dp_fedavg_run(real, secure)
        sim_dummy, r_dummy = _dp_fedavg_run(dummy, secure)
        noise_std = sim_real.pipelines[0].mechanisms["update"].noise_std
        # the clipped, un-noised values, from the same runs with the noise switched off
        recovered = r_real[0] - r_dummy[0]
        if secure:
            # the difference still carries two independent noise draws: sqrt(2) sigma per coordinate
            assert np.std(recovered) > noise_std
            assert sim_real.ledger.meta.get("noise") == "secure"
        else:
            assert np.std(recovered) < 0.1 * noise_std  # the noise cancels: the update is exposed
            assert sim_real.ledger.meta.get("noise") == "seeded"
            assert sim_real.ledger.meta.get("warning") == SEEDED_NOISE_WARNING
            result = Simulation(DPFedAvg(sim_real.fed, sim_real.privacy), real, sim_real.fed, sim_real.privacy).run()
            assert result.audit["warning"] == SEEDED_NOISE_WARNING and result.noise == "seeded"


def test_private_runs_draw_noise_from_the_os_by_default():
    assert PrivacyConfig(epsilon=1.0).secure_noise is True


@pytest.mark.parametrize("seeded", [False, True])
def test_the_audit_says_when_noise_was_seeded(tmp_path, capsys, seeded):
    import json

    from privfl.apps.cli import main

    ledger = str(tmp_path / "l.sqlite")
    flags = ["run", "--algorithm", "dp_fedavg", "--dataset", "digits", "--clients", "3", "--rounds", "1",
             "--ledger", ledger, "--run-id", "r", "--quiet"] + (["--seeded-noise"] if seeded else [])
    assert main(flags) == 0
    err = capsys.readouterr().err
    assert ("only against parties who do not know the seed" in err) == seeded
    assert main(["audit", ledger, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["noise"] == ("seeded" if seeded else "secure")
    assert ("warning" in report) == seeded
    assert main(["audit", ledger]) == 0
    assert ("warning:" in capsys.readouterr().out) == seeded


def _distributed_scores(plan, value, direction, trials, rng):
    """The server's view of one distributed-noise round in which client 0 sends ``value`` and two others send 0:
    the decoded sum, projected on ``direction`` (integer arithmetic, no wrap at 48 bits)."""
    from privfl.mechanisms.discrete_gaussian import sample_discrete_gaussian

    q, d = plan.quantiser, value.size
    total = np.zeros((trials, d), dtype=np.int64)
    for contribution in (value, np.zeros(d), np.zeros(d)):
        ints = q.to_integers(np.tile(contribution, (trials, 1)).ravel(), rng).reshape(trials, d)
        total += ints + sample_discrete_gaussian(plan.local_sigma, (trials, d), rng=rng)
    return (total * q.step) @ direction


@pytest.mark.timeout(120)
def test_replace_one_distributed_noise_is_not_distinguishable_beyond_the_claim():
    """Black box for bug 3: a replace-one channel's client sends +C or -C (2C apart) under distributed noise planned
    for epsilon = 1 in one round. With the noise planned for the relation the distinguisher's lower bound stays
    below the claim; with the landed plan (the add/remove noise for a 2C displacement) it exceeds it."""
    cfg = SecureAggregation(bits=48)
    d = 1
    value = np.ones(d)  # norm C = 1
    rng = np.random.default_rng(5)
    trials = 1_000_000  # a tail distinguisher: the false-positive rate it needs is ~1e-4
    bounds = {}
    for adjacency in ("replace_one", "add_remove"):  # add_remove: the landed plan, which ignored the relation
        ch = Channel("u", (d,), unit="client", clip=NormClip(1.0), adjacency=adjacency)
        plan = calibrate_distributed([ch], 1.0, 1e-5, 1, 3, cfg)["u"]
        plus = _distributed_scores(plan, value, value, trials, rng)
        minus = _distributed_scores(plan, -value, value, trials, rng)
        bounds[adjacency] = epsilon_lower_bound(plus, minus, delta=1e-5)[0]
    assert bounds["replace_one"] <= 1.0
    assert bounds["add_remove"] > 1.0  # the test has the power to see the landed bug


def test_record_level_distributed_noise_rounds_both_neighbours():
    """At record level a client uploads with and without the record, and both uploads are stochastically rounded:
    the integer vectors differ by less than clip/step + 2 sqrt(d). The landed plan charged the + sqrt(d) of a whole
    upload added or removed (client level) for record-level add/remove channels too (rho under-charged)."""
    from privfl.mechanisms.discrete_gaussian import distributed_discrete_gaussian_event

    from privfl.mechanisms.discrete_gaussian import distributed_gaussian_event

    record = plan_distributed_noise(1.0, 100, 1.0, 3, 3, 20, sensitivity=1.0, record_level=True, gaussian=False)
    client = plan_distributed_noise(1.0, 100, 1.0, 3, 3, 20, sensitivity=1.0, gaussian=False)
    two_sided = record.quantiser.rounded_l2_sensitivity(1.0, 100, replace_one=True)
    expected = distributed_discrete_gaussian_event(l2_sensitivity=two_sided, sigma=record.local_sigma, n_min=3,
                                                   n_max=3, dimension=100)
    assert record.event == expected and record.event.rho > client.event.rho
    # the Gaussian charge (the default) takes the same two-sided sensitivity
    record_g = plan_distributed_noise(1.0, 100, 1.0, 3, 3, 20, sensitivity=1.0, record_level=True)
    client_g = plan_distributed_noise(1.0, 100, 1.0, 3, 3, 20, sensitivity=1.0)
    assert record_g.event == distributed_gaussian_event(l2_sensitivity=two_sided, sigma=record.local_sigma, n_min=3,
                                                        n_max=3, dimension=100)
    assert record_g.event.event.sensitivity == two_sided > client_g.event.event.sensitivity
    # calibrate_distributed plans a record-level (unit "example") add/remove channel with the two-sided rounding,
    # under zcdp (the KLS bound) and pld (the Gaussian)
    cfg = SecureAggregation(bits=20)
    chan = Channel("s", (100,), unit="example", clip=PreClipped(1.0), value_bound=1.0)
    for accountant, gaussian in (("zcdp", False), ("pld", True)):
        plan = calibrate_distributed([chan], 1.0, 1e-5, 1, 3, cfg, accountant=accountant)["s"]
        again = plan_distributed_noise(1.0, 100, plan.noise_multiplier, 3, 3, 20, sensitivity=chan.sensitivity,
                                       record_level=True, gaussian=gaussian)
        assert plan.event == again.event
        assert make_accountant(accountant).compose(plan.event).get_epsilon(1e-5) <= 1.0
