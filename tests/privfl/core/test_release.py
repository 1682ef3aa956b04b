"""The release pipeline: validate -> clip -> charge -> noise -> release, all or nothing."""

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref

import numpy as np
import pytest

from privfl.accounting.errors import PrivacyBudgetExceeded
from privfl.accounting.events import GaussianEvent
from privfl.accounting.ledger import PrivacyLedger
from privfl.mechanisms import InvalidRelease
from privfl.core.aggregation import weighted_sums
from privfl.core.channels import Channel, ClippedValue, NormClip, PreClipped, RangeBound, Unclipped
from privfl.core.release import ReleasePipeline


def make(tmp_path, *, budget=math.inf, multipliers=None, channels=None, placement="local", noise=0):
    led = PrivacyLedger(tmp_path / "l.sqlite", "run", delta=1e-5, epsilon_budget=budget)
    channels = channels or [Channel("update", (3,), unit="client", clip=NormClip(1.0))]
    multipliers = {"update": 2.0} if multipliers is None else multipliers
    return led, ReleasePipeline("7", channels, led, multipliers, placement=placement, noise=noise)


def test_release_clips_charges_then_noises(tmp_path):
    led, pipe = make(tmp_path)
    out = pipe.release(0, {"update": np.array([30.0, 40.0, 0.0])})["update"]
    (charge,) = led.charges("7")
    assert charge.event == GaussianEvent(1.0, 2.0) and charge.released
    assert out.local_noise_std == 2.0 and out.central_noise_std == 0.0
    assert out.release_id == "run/7/0/update"
    # the noise is around the clipped value (0.6, 0.8, 0), never the raw one
    assert np.linalg.norm(out.value - np.array([0.6, 0.8, 0.0])) < 2.0 * 6


NON_FINITE = [np.array([1.0, np.nan, 0.0]), np.array([np.inf, 0.0, 0.0]),
              # float32: checked finite by the norm clip of the float64 copy (deferred check)
              np.array([1.0, np.nan, 0.0], dtype=np.float32), np.array([np.inf, 0.0, 0.0], dtype=np.float32),
              np.array([-np.inf, np.inf, np.nan], dtype=np.float32)]


@pytest.mark.parametrize("value", [np.ones(4), np.ones((3, 1)), np.full(4, np.nan)])
def test_values_of_another_shape_release_and_charge_nothing(tmp_path, value):
    led, pipe = make(tmp_path)
    with pytest.raises(InvalidRelease):
        pipe.release(0, {"update": value})
    assert led.charges() == []


@pytest.mark.parametrize("value", NON_FINITE)
def test_a_non_private_non_finite_value_is_refused_and_charges_nothing(tmp_path, value):
    led = PrivacyLedger(tmp_path / "l.sqlite", "run")
    pipe = ReleasePipeline("7", [Channel("update", (3,), unit="client", clip=Unclipped())], led, None)
    with pytest.raises(InvalidRelease, match="channel update.*NaN or Inf.*diverged"):
        pipe.release(0, {"update": value})
    assert led.charges() == []


@pytest.mark.parametrize("value", NON_FINITE)
def test_a_private_non_finite_value_releases_the_fallback_charged_as_usual(tmp_path, value):
    """Whether a client's training failed depends on its records: a private release does not refuse (an uncharged
    error the server would see) but releases no change, charged and noised exactly as the value would have been;
    only a warning on the client's side says so."""
    from privfl.core.release import LocalResultNotFinite

    led, pipe = make(tmp_path, placement="central")  # central: the value handed over is the clipped one
    with pytest.warns(LocalResultNotFinite, match="client 7, round 0.*not finite"):
        out = pipe.release(0, {"update": value})["update"]
    assert np.array_equal(out.value, np.zeros(3)) and out.central_noise_std == 2.0
    (charge,) = led.charges("7")
    assert charge.event == GaussianEvent(1.0, 2.0) and charge.released
    finite = pipe.release(1, {"update": np.array([3.0, 4.0, 0.0])})["update"]  # what the server sees is alike
    assert (out.weight, out.local_noise_std, out.central_noise_std, out.value.shape) == (
        finite.weight, finite.local_noise_std, finite.central_noise_std, finite.value.shape)


def test_the_fallback_keeps_every_channel_s_form_and_charge(tmp_path):
    """Every channel of the round falls back together, each wrapped as the algorithm wrapped it (a pre-clipped
    statistic's certificate), a probability channel to uniform rows."""
    from privfl.core.release import LocalResultNotFinite

    chans = [Channel("a", (2,), unit="client", clip=NormClip(1.0)),
             Channel("fisher", (2,), unit="example", clip=PreClipped(0.5, "squared_sum")),
             Channel("probs", (2, 4), unit="example", clip=RangeBound(math.sqrt(2), 2))]
    led, pipe = make(tmp_path, channels=chans, multipliers={"a": 2.0, "fisher": 3.0, "probs": 1.0},
                     placement="central")
    probs = np.full((2, 4), 0.25)
    probs[0] = [1.0, 0.0, 0.0, 0.0]
    with pytest.warns(LocalResultNotFinite, match=r"\['fisher'\]"):
        out = pipe.release(0, {"a": np.array([0.3, 0.4]),
                               "fisher": ClippedValue(np.array([np.nan, 1.0]), 0.5, "squared_sum"),
                               "probs": probs})
    assert np.array_equal(out["a"].value, np.zeros(2)) and np.array_equal(out["fisher"].value, np.zeros(2))
    assert np.array_equal(out["probs"].value, np.full((2, 4), 0.25))
    assert sorted(c.channel for c in led.charges("7")) == ["a", "fisher", "probs"]


def test_float32_upload_is_clipped_exactly_and_left_untouched(tmp_path):
    led, pipe = make(tmp_path, placement="central")  # central: the pipeline hands over the clipped value as it is
    raw = np.array([3.0, 4.0, 0.0], dtype=np.float32)
    out = pipe.release(0, {"update": raw})["update"]
    assert out.value.dtype == np.float64 and np.array_equal(out.value, np.array([3.0, 4.0, 0.0]) * (1.0 / 5.0))
    assert np.array_equal(raw, np.array([3.0, 4.0, 0.0], dtype=np.float32))  # the algorithm's array is never touched
    assert len(led.charges()) == 1


def test_missing_or_undeclared_channels_are_refused(tmp_path):
    led, pipe = make(tmp_path)
    with pytest.raises(InvalidRelease, match="missing"):
        pipe.release(0, {})
    with pytest.raises(InvalidRelease, match="undeclared"):
        pipe.release(0, {"update": np.zeros(3), "extra": np.zeros(3)})
    assert led.charges() == []


def test_over_budget_client_sits_out_and_nothing_is_charged(tmp_path):
    led, pipe = make(tmp_path, budget=1.0, multipliers={"update": 1.0})
    with pytest.raises(PrivacyBudgetExceeded):
        pipe.release(0, {"update": np.zeros(3)})
    assert led.charges() == []


def test_all_channels_of_a_round_are_charged_together(tmp_path):
    chans = [Channel("a", (2,), unit="client", clip=NormClip(1.0)),
             Channel("b", (2,), unit="client", clip=NormClip(1.0))]
    led, pipe = make(tmp_path, channels=chans, multipliers={"a": 2.0, "b": 2.0})
    with pytest.raises(InvalidRelease):
        pipe.release(0, {"a": np.zeros(2), "b": np.zeros(3)})
    assert led.charges() == []
    out = pipe.release(0, {"a": np.zeros(2), "b": np.zeros(2)})
    assert set(out) == {"a", "b"} and len(led.charges()) == 2


def test_a_round_cannot_be_released_twice(tmp_path):
    led, pipe = make(tmp_path)
    pipe.release(0, {"update": np.zeros(3)})
    with pytest.raises(Exception, match="already released"):
        pipe.release(0, {"update": np.zeros(3)})
    assert len(led.charges()) == 1


def test_central_placement_leaves_noise_to_the_aggregator(tmp_path):
    chans = [Channel("update", (20_000,), unit="client", clip=NormClip(1.0))]
    led, pipe = make(tmp_path, channels=chans, placement="central")
    rel = pipe.release(0, {"update": np.zeros(20_000)})["update"]
    assert rel.central_noise_std == 2.0 and np.all(rel.value == 0)
    agg = weighted_sums([rel], {"update": chans[0]}, noise=1)["update"]
    assert agg.total.std() == pytest.approx(2.0, rel=0.03) and agg.noise_std == 2.0


def test_weighted_sums_without_noise_are_exact(tmp_path):
    chans = {"update": Channel("update", (3,), unit="client", clip=Unclipped())}
    led = PrivacyLedger(":memory:", "r")
    rels = []
    for k in range(4):
        pipe = ReleasePipeline(str(k), list(chans.values()), led, None)
        rels += pipe.release(0, {"update": np.full(3, float(k))}, weight=k + 1).values()
    agg = weighted_sums(rels, chans)["update"]
    np.testing.assert_allclose(agg.total, sum((k + 1) * k for k in range(4)) * np.ones(3))
    assert agg.total_weight == 10 and agg.participants == 4 and agg.noise_std == 0
    assert math.isinf(led.audit()["max_epsilon"])


def test_pre_clipped_channel_needs_a_matching_certificate(tmp_path):
    chans = [Channel("fisher_diag", (2,), unit="example", clip=PreClipped(0.5, "squared_sum"))]
    led, pipe = make(tmp_path, channels=chans, multipliers={"fisher_diag": 3.0})
    assert chans[0].sensitivity == 0.25
    with pytest.raises(InvalidRelease, match="ClippedValue"):
        pipe.release(0, {"fisher_diag": np.zeros(2)})
    with pytest.raises(InvalidRelease, match="declares"):
        pipe.release(0, {"fisher_diag": ClippedValue(np.zeros(2), 1.0, "squared_sum")})
    assert led.charges() == []
    pipe.release(0, {"fisher_diag": ClippedValue(np.zeros(2), 0.5, "squared_sum")})
    assert led.charges()[0].event == GaussianEvent(0.25, 0.75)


def test_range_bound_channel_checks_probabilities(tmp_path):
    chans = [Channel("alignment_probs", (4, 3), unit="example", clip=RangeBound(math.sqrt(2), 4))]
    led, pipe = make(tmp_path, channels=chans, multipliers={"alignment_probs": 1.0})
    assert chans[0].sensitivity == pytest.approx(math.sqrt(8))
    with pytest.raises(InvalidRelease, match="probability"):
        pipe.release(0, {"alignment_probs": np.ones((4, 3))})
    pipe.release(0, {"alignment_probs": np.full((4, 3), 1 / 3)})


def test_private_runs_refuse_unclipped_channels_and_missing_multipliers(tmp_path):
    led = PrivacyLedger(":memory:", "r")
    with pytest.raises(InvalidRelease, match="unclipped"):
        ReleasePipeline("0", [Channel("u", (1,), unit="client", clip=Unclipped())], led, {"u": 1.0})
    with pytest.raises(InvalidRelease, match="no noise multiplier"):
        ReleasePipeline("0", [Channel("u", (1,), unit="client", clip=NormClip(1.0))], led, {})
    with pytest.raises(InvalidRelease, match="no noise multiplier"):
        ReleasePipeline("0", [Channel("u", (1,), unit="client", clip=NormClip(1.0))], led, None)


CHILD = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from privfl.accounting.ledger import PrivacyLedger
    from privfl.mechanisms.gaussian import GaussianMechanism
    from privfl.core.channels import Channel, NormClip
    from privfl.core.release import ReleasePipeline

    path, outbox, marker, crash = sys.argv[1:5]
    if crash == "1":
        def stall(self, *a, **k):
            open(marker, "w").write("charged")
            time.sleep(600)
        GaussianMechanism.noise = stall
    led = PrivacyLedger(path, "run", delta=1e-5, epsilon_budget=5.0)
    pipe = ReleasePipeline("0", [Channel("update", (3,), unit="client", clip=NormClip(1.0))], led, {"update": 2.0})
    for rnd in range(3):
        rel = pipe.release(rnd, {"update": np.ones(3)})["update"]
        with open(outbox, "a") as f:
            f.write(json.dumps({"release_id": rel.release_id}) + "\\n")
""")


def _run_child(tmp_path, crash: bool):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    paths = [str(tmp_path / n) for n in ("ledger.sqlite", "outbox.jsonl", "marker")]
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, str(script), *paths, "1" if crash else "0"], env=env)
    return proc, paths


@pytest.mark.timeout(120)
def test_crash_between_charge_and_release(tmp_path):
    proc, (ledger_path, outbox, marker) = _run_child(tmp_path, crash=True)
    deadline = time.time() + 90
    while not os.path.exists(marker):
        assert proc.poll() is None, "child exited before charging"
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    led = PrivacyLedger.open_existing(ledger_path)
    (charge,) = led.charges()
    assert charge.round == 0 and not charge.released  # the charge survived the crash, no value left
    assert not os.path.exists(outbox)
    # Restarted, the client may release that charged round once, without a second charge.
    pipe = ReleasePipeline("0", [Channel("update", (3,), unit="client", clip=NormClip(1.0))], led, {"update": 2.0})
    pipe.release(0, {"update": np.ones(3)})
    assert len(led.charges()) == 1 and led.charges()[0].released


@pytest.mark.timeout(120)
def test_no_release_exists_without_a_ledger_row(tmp_path):
    proc, (ledger_path, outbox, _) = _run_child(tmp_path, crash=False)
    assert proc.wait(timeout=100) == 0
    import json

    released = [json.loads(line)["release_id"] for line in open(outbox)]
    rows = {c.release_id: c for c in PrivacyLedger.open_existing(ledger_path).charges()}
    assert released == ["run/0/0/update", "run/0/1/update", "run/0/2/update"]
    assert all(rid in rows and rows[rid].released for rid in released)


def test_dpsgd_trained_channel_is_charged_with_its_training_event(tmp_path):
    from privfl.accounting.events import PoissonSampledEvent, SelfComposedEvent
    from privfl.core.channels import PrivatizedValue, TrainedPrivately

    chans = [Channel("update", (3,), unit="example", clip=TrainedPrivately())]
    led = PrivacyLedger(tmp_path / "l.sqlite", "run", delta=1e-5, epsilon_budget=10.0, accountant="rdp")
    pipe = ReleasePipeline("0", chans, led, {})
    training = SelfComposedEvent(PoissonSampledEvent(0.1, GaussianEvent(1.0, 1.1)), 50)
    with pytest.raises(InvalidRelease, match="PrivatizedValue"):
        pipe.release(0, {"update": np.ones(3)})
    assert led.charges() == []
    out = pipe.release(0, {"update": PrivatizedValue(np.ones(3), training)})["update"]
    np.testing.assert_array_equal(out.value, np.ones(3))  # post-processing: no extra noise
    assert led.charges()[0].event == training
    with pytest.raises(InvalidRelease):
        PrivatizedValue(np.ones(3), "not an event")


def test_range_bound_sensitivity_holds_for_any_two_probability_tables():
    rng = np.random.default_rng(0)
    ch = Channel("alignment_probs", (20, 10), unit="example", clip=RangeBound(math.sqrt(2), 20))
    worst = 0.0
    for _ in range(2000):
        p = rng.dirichlet(np.full(10, rng.uniform(0.01, 2)), size=20)
        q = rng.dirichlet(np.full(10, rng.uniform(0.01, 2)), size=20)
        worst = max(worst, np.linalg.norm(p - q))
    one_hot = np.eye(10)[np.zeros(20, int)], np.eye(10)[np.ones(20, int)]
    assert np.linalg.norm(one_hot[0] - one_hot[1]) == pytest.approx(ch.sensitivity)  # the bound is attained
    assert worst <= ch.sensitivity


def test_norm_clip_channel_sensitivity_on_neighbouring_federations():
    rng = np.random.default_rng(1)
    for adjacency in ("add_remove", "replace_one"):
        ch = Channel("update", (30,), unit="client", clip=NormClip(0.5), adjacency=adjacency)
        for _ in range(200):
            uploads = rng.normal(scale=rng.uniform(0.01, 3), size=(8, 30))
            other = uploads[1:] if adjacency == "add_remove" else np.vstack([rng.normal(size=(1, 30)) * 5,
                                                                             uploads[1:]])
            moved = np.linalg.norm(sum(ch.clip.apply(u) for u in uploads) - sum(ch.clip.apply(u) for u in other))
            assert moved <= ch.sensitivity * (1 + 1e-12)


def test_record_level_runs_refuse_client_clips_under_add_remove():
    """Removing a record moves a client-clipped upload between two clipped values (up to 2C apart): a record-level
    run must declare such channels replace-one."""
    from privfl.core.config import PrivacyConfig
    from privfl.errors import ConfigurationError
    from privfl.core.channels import check_record_level_clips

    record = PrivacyConfig(epsilon=1.0, unit="example")
    add_remove = [Channel("update", (3,), unit="client", clip=NormClip(1.0))]
    with pytest.raises(ConfigurationError, match="replace_one"):
        check_record_level_clips(add_remove, record)
    replace = [Channel("update", (3,), unit="client", clip=NormClip(1.0), adjacency="replace_one")]
    check_record_level_clips(replace, record)
    assert replace[0].sensitivity == 2.0
    check_record_level_clips(add_remove, PrivacyConfig(epsilon=1.0, unit="client"))  # a client's removal: C
    check_record_level_clips(add_remove, PrivacyConfig())  # non-private


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("scale", [0.1, 10.0])  # under and over the clip
def test_clipping_never_touches_the_algorithms_own_array(dtype, scale):
    """The pipeline clips in place only the float64 copy validation made; an upload the algorithm handed over (in
    either precision, clipped or not) is left exactly as it was, and the release holds the clipped value."""
    ch = Channel("update", (50,), unit="client", clip=NormClip(1.0))
    pipe = ReleasePipeline("0", [ch], PrivacyLedger(":memory:", "r"), {"update": 2.0}, placement="central")
    upload = (scale * np.random.default_rng(0).normal(size=50) / 7.0).astype(dtype)
    before = upload.copy()
    value = pipe.release(0, {"update": upload})["update"].value
    np.testing.assert_array_equal(upload, before)
    assert not np.shares_memory(value, upload)
    np.testing.assert_allclose(np.linalg.norm(value), min(1.0, np.linalg.norm(before.astype(np.float64))),
                               rtol=1e-12)
    assert np.linalg.norm(value) <= 1.0 * (1 + 1e-12)


def test_pipeline_reuses_its_buffer_only_when_no_release_holds_it(tmp_path):
    """A float32 upload is converted into the float64 array of the pipeline's previous release only once nothing
    outside holds that array: a release still held keeps its value whatever the pipeline releases next."""
    led, pipe = make(tmp_path, placement="central", channels=[Channel("update", (4,), unit="client",
                                                                      clip=NormClip(10.0))])
    first = pipe.release(0, {"update": np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)})["update"]
    kept = first.value.copy()
    second = pipe.release(1, {"update": np.array([-5.0, 0.0, 5.0, 0.0], dtype=np.float32)})["update"]
    assert np.array_equal(first.value, kept)  # held: not overwritten
    assert not np.shares_memory(first.value, second.value)
    view = second.value[:2]  # a view keeps the array held too
    del second
    third = pipe.release(2, {"update": np.array([0.0, 1.0, 0.0, 0.0], dtype=np.float32)})["update"]
    assert np.array_equal(view, [-5.0, 0.0]) and not np.shares_memory(view, third.value)
    del view
    buffer_before = weakref.ref(third.value.base if third.value.base is not None else third.value)
    del third
    fourth = pipe.release(3, {"update": np.array([2.0, 0.0, 0.0, 0.0], dtype=np.float32)})["update"]
    assert buffer_before() is not None and np.shares_memory(fourth.value, buffer_before())  # nothing held it: reused
    assert np.array_equal(fourth.value, [2.0, 0.0, 0.0, 0.0])
    assert [c.released for c in led.charges("7")] == [True] * 4


@pytest.mark.parametrize("placement", ["local", "central"])
def test_rows_are_released_once_whichever_way_they_are_marked(tmp_path, placement):
    """Central (no noise left to draw on the client): the rows are written released with the charge; local: the
    row is charged, the noise drawn, then the row marked. Either way each value leaves once."""
    led, pipe = make(tmp_path, placement=placement)
    pipe.release(0, {"update": np.array([0.3, 0.4, 0.0])})
    (charge,) = led.charges("7")
    assert charge.released and led.audit()["clients"]["7"]["releases"] == 1
    with pytest.raises(Exception, match="released"):
        pipe.release(0, {"update": np.array([0.3, 0.4, 0.0])})
    assert len(led.charges("7")) == 1 and led.audit()["clients"]["7"]["releases"] == 1
    # a round charged but not yet released (a masked input, mark=False) is released by a later marked release
    pipe.release(1, {"update": np.array([0.3, 0.4, 0.0])}, mark=False)
    assert not [c for c in led.charges("7") if c.round == 1][0].released
    pipe.release(1, {"update": np.array([0.3, 0.4, 0.0])})
    assert all(c.released for c in led.charges("7")) and led.audit()["clients"]["7"]["releases"] == 2


@pytest.mark.parametrize("placement", ["local", "central"])
def test_a_symmetric_channel_releases_only_its_upper_triangle_mirrored(placement):
    """Noise on a symmetric channel is drawn for the upper triangle and mirrored, so a value that is not exactly
    symmetric let V - V^T out with no noise at all: two neighbouring antisymmetric values were told apart with
    certainty while the ledger charged a Gaussian (a review: epsilon 1.06 charged, infinite in truth). What leaves is
    the upper triangle, mirrored: the released matrix is symmetric and the same for both neighbours' lower halves."""
    ch = Channel("m", (2, 2), unit="client", clip=NormClip(1.0), symmetric=True)
    ledger = PrivacyLedger(":memory:", "r", delta=1e-5, epsilon_budget=10.0, accountant="exact")
    pipeline = ReleasePipeline("0", [ch], ledger, {"m": 5.0}, placement=placement, noise=np.random.default_rng(1))
    for rnd, v in enumerate([np.array([[0.0, 0.5], [-0.5, 0.0]]), np.array([[0.0, -0.5], [0.5, 0.0]])]):
        release = pipeline.release(rnd, {"m": v})["m"]
        out = release.value if placement == "local" else weighted_sums([release], {"m": ch}, 0)["m"].total
        np.testing.assert_array_equal(out, out.T)
        if placement == "central":
            assert np.all(np.asarray(release.value) == np.triu(v) + np.triu(v, 1).T)


def test_a_round_charged_as_left_out_by_client_sampling_is_never_released_later(tmp_path):
    """A round a client was left out of (Poisson client sampling) is charged as spent; releasing a value against it
    later (a second run under the same id, a retried round that samples the client) was accepted as a replay of the
    unreleased row: a release the ledger never charged (a review: two runs of one run id, epsilon 1.998 in the
    ledger against 2.53 spent)."""
    from privfl.accounting.errors import LedgerError

    led = PrivacyLedger(tmp_path / "l.sqlite", "r", delta=1e-5, epsilon_budget=3.0, accountant="pld")
    pipe = ReleasePipeline("0", [Channel("update", (3,), "client", NormClip(1.0))], led, {"update": 2.0},
                           placement="central", sampling_rate=0.1, noise="secure", privacy_unit="client")
    pipe.charge_only(0)
    spent = led.audit()["max_epsilon"]
    (row,) = led.charges("0")
    assert row.left_out and not row.released
    with pytest.raises(LedgerError, match="left out"):
        pipe.release(0, {"update": np.ones(3)})
    with pytest.raises(LedgerError, match="left out"):
        led.mark_released(row)
    assert led.charges("0") == [row] and led.audit()["max_epsilon"] == spent
    assert led.audit()["clients"]["0"]["releases"] == 0
    # charge_only again is a replay (nothing charged twice); the next round releases as usual
    pipe.charge_only(0)
    pipe.release(1, {"update": np.ones(3)})
    assert led.audit()["clients"]["0"]["releases"] == 1
    assert [(c.round, c.released, c.left_out) for c in PrivacyLedger.open_existing(tmp_path / "l.sqlite").charges()] \
        == [(0, False, True), (1, True, False)]


def test_federate_refuses_a_ledger_that_already_holds_charges_of_its_run(tmp_path):
    """`privfl run` refused a ledger holding its run id; federate and Simulation went on and released a second model
    against the first run's rows. Refused before anything is trained or charged."""
    import torch

    import privfl
    from privfl.errors import ConfigurationError

    rng = np.random.default_rng(0)
    clients = {f"c{k}": (rng.normal(size=(60, 4)).astype(np.float32), rng.integers(0, 2, 60)) for k in range(8)}
    test = (rng.normal(size=(50, 4)).astype(np.float32), rng.integers(0, 2, 50))
    path = str(tmp_path / "l.sqlite")

    def go(seed, run_id="study"):
        torch.manual_seed(0)
        return privfl.federate(torch.nn.Linear(4, 2), clients, algorithm="dp_fedavg", epsilon=2.0, rounds=3,
                               sampling_rate=0.2, test=test, classes=[0, 1], ledger=path, client_size=60,
                               seed=seed, run_id=run_id, secure_noise=False)

    go(1)
    rows = PrivacyLedger.open_existing(path, "study").charges()
    with pytest.raises(ConfigurationError, match="already holds charges of run 'study'.*new run_id"):
        go(2)
    assert PrivacyLedger.open_existing(path, "study").charges() == rows
    go(2, run_id="study-2")  # a new run id is a new run
