"""Resuming a run id on Flower, checked on privfl's ClientApp and ServerApp functions directly (no Flower process):
a client refuses a round its own ledger has released, answers the rounds it released when asked, and the server
refuses a resume that has nothing left to run or that would redraw seeded noise."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Context, Message, RecordDict  # noqa: E402

from privfl.core.config import FederationConfig, PrivacyConfig  # noqa: E402
from privfl.data import federated_from_arrays, load_digits  # noqa: E402
from privfl.flower import app as flower_app  # noqa: E402
from privfl.flower.app import (BROADCAST, IDENTIFY, QUERY, REPLY, SPEC_KEY, DeploymentError, RunSpec,  # noqa: E402
                               client_identify, client_train)
from privfl.flower.records import from_record, to_record  # noqa: E402


@pytest.fixture
def setting(tmp_path, monkeypatch):
    # flwr builds a Message from the identity of the process's task, which a ServerApp or ClientApp process has
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_task_id", "_run_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)
    digits = load_digits(flatten=True)
    parts = [digits.subset(np.arange(k * 60, (k + 1) * 60)) for k in range(2)]
    federation = federated_from_arrays(parts, digits.subset(np.arange(200, 260)), name="digits2",
                                       design_size=round(sum(map(len, parts)) / len(parts)))
    fed = FederationConfig(rounds=3, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=4)
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="local")
    spec = RunSpec.of("dp_fedavg", federation, fed, privacy, run_id="resume-unit")
    data = str(tmp_path / "org0.npz")
    np.savez(data, x=parts[0].x, y=parts[0].y)
    node = {"partition-id": 0, "data-path": data, "ledger-path": str(tmp_path / "org0.sqlite")}
    return spec, node


def _context(spec, node):
    return Context(run_id=1, node_id=1, node_config=dict(node), state=RecordDict(),
                   run_config={SPEC_KEY: spec.to_json()})


def _train(spec, node, rnd):
    alg = flower_app._setup(spec)
    broadcast = {"round": rnd, "noise_multipliers": flower_app._run_plan(alg, spec).noise_multipliers,
                 "values": dict(alg.broadcast(rnd).values)}
    msg = Message(to_record(broadcast, BROADCAST), dst_node_id=1, message_type="train")
    return from_record(client_train(msg, _context(spec, node)).content, REPLY)


def _released(spec, node):
    msg = Message(to_record({"round": -1}, IDENTIFY), dst_node_id=1, message_type=QUERY)
    return from_record(client_identify(msg, _context(spec, node)).content, IDENTIFY)["released"]


def test_a_client_reports_its_released_rounds_and_refuses_to_release_one_again(setting):
    spec, node = setting
    assert _released(spec, node) == []  # no ledger yet
    reply = _train(spec, node, 0)
    assert not reply["sat_out"] and len(reply["releases"]) == 1
    assert _released(spec, node) == [0]
    with pytest.raises(DeploymentError, match="run 'resume-unit'.*already released round 0"):
        _train(spec, node, 0)  # a new flwr run (a fresh Context.state) asking for the same round
    assert _released(spec, node) == [0]
    _train(spec, node, 1)
    assert _released(spec, node) == [0, 1]
    other = RunSpec.from_json(spec.to_json().replace('"resume-unit"', '"another-run"'))
    assert _released(other, node) == []  # released rounds are per run id


def test_a_round_the_client_was_left_out_of_counts_as_spent_on_resume(setting):
    """A round charged for a client that client sampling left out can never be released; a resumed run that redid it
    (a new sample could pick the client) would fail at that client's ledger, so the client reports it as spent."""
    from privfl.accounting.events import GaussianEvent
    from privfl.accounting.ledger import ChargeRequest, PrivacyLedger

    spec, node = setting
    ledger = PrivacyLedger(node["ledger-path"], spec.run_id, delta=spec.privacy.delta,
                           epsilon_budget=spec.privacy.epsilon, accountant=spec.privacy.resolved_accountant)
    try:
        ledger.charge_all("0", 1, [ChargeRequest("update", GaussianEvent(1.0, 8.0), "client")], left_out=True)
    finally:
        ledger.close()
    assert _released(spec, node) == [1]


def test_the_server_refuses_a_resume_with_nothing_left_or_with_seeded_noise(setting):
    spec, _ = setting
    flower_app._check_resume(spec, 0)
    flower_app._check_resume(spec, 2)  # secure noise: rounds 2.. can run
    with pytest.raises(DeploymentError, match="run 'resume-unit'.*nothing is left to run"):
        flower_app._check_resume(spec, 3)
    import dataclasses

    seeded = dataclasses.replace(spec, privacy=dataclasses.replace(spec.privacy, secure_noise=False))
    flower_app._check_resume(seeded, 0)
    flower_app._check_resume(seeded, 1)  # local noise: each client keeps its generators (the next test)
    central = dataclasses.replace(seeded, privacy=dataclasses.replace(seeded.privacy, placement="central"))
    flower_app._check_resume(central, 0)
    with pytest.raises(DeploymentError, match="seeded central noise"):
        flower_app._check_resume(central, 1)  # the server's own generator is not checkpointed


def test_a_seeded_client_whose_generators_are_older_than_its_releases_refuses_to_repeat_its_noise(setting):
    """Seeded local noise: a client's generators live in its client-state file between Flower runs; a client whose
    ledger released a round after the one its saved generators were left at (the file lost, or written before a
    crash) refuses the next round before anything is charged."""
    import dataclasses

    spec, node = setting
    seeded = dataclasses.replace(spec, privacy=dataclasses.replace(spec.privacy, secure_noise=False))
    assert not _train(seeded, node, 0)["sat_out"]
    assert not _train(seeded, node, 1)["sat_out"]  # a fresh Context: the generators come from the file
    os.remove(node["ledger-path"] + ".client-state")
    with pytest.raises(DeploymentError, match="would repeat noise already released"):
        _train(seeded, node, 2)
    assert _released(seeded, node) == [0, 1]  # nothing charged for round 2


def test_a_seeded_client_given_back_an_older_state_file_refuses_to_repeat_its_noise(setting):
    """A stale client-state file (a backup of round 0's, put back after round 1 was released) is refused as a
    missing one is: its generators would redraw round 1's released noise."""
    import dataclasses
    import shutil

    spec, node = setting
    seeded = dataclasses.replace(spec, privacy=dataclasses.replace(spec.privacy, secure_noise=False))
    state = node["ledger-path"] + ".client-state"
    _train(seeded, node, 0)
    shutil.copyfile(state, state + ".round0")
    _train(seeded, node, 1)
    shutil.copyfile(state + ".round0", state)  # the older file replayed
    with pytest.raises(DeploymentError, match="saved after round 0"):
        _train(seeded, node, 2)
    assert _released(seeded, node) == [0, 1]


def test_a_pause_is_a_whole_number_of_rounds_before_the_end(setting):
    """``pause-after=N`` (run config) ends a launch before round N of the run's 3; 0, or N past the end, is no
    pause; a pause before the rounds already released, a negative or fractional one, is refused."""
    spec, _ = setting
    assert flower_app._pause_after({}, spec, 0, False) is None
    assert flower_app._pause_after({"pause-after": 0}, spec, 0, False) is None
    assert flower_app._pause_after({"pause-after": 3}, spec, 0, False) is None
    assert flower_app._pause_after({"pause-after": 2}, spec, 1, False) == 2
    for bad, says in ((-1, "whole number"), (1.5, "whole number"), (True, "whole number")):
        with pytest.raises(DeploymentError, match=says):
            flower_app._pause_after({"pause-after": bad}, spec, 0, False)
    with pytest.raises(DeploymentError, match="nothing to run before the pause"):
        flower_app._pause_after({"pause-after": 1}, spec, 2, False)
    with pytest.raises(DeploymentError, match="multi-phase"):
        flower_app._pause_after({"pause-after": 1}, spec, 0, True)


def _checkpointed(spec, path, rnd):
    """The server half after ``rnd + 1`` rounds of made-up sums, checkpointed at ``path``."""
    alg = flower_app._setup(spec)
    alg.global_params = alg.global_params + 0.25 * (rnd + 1)
    flower_app.write_checkpoint(str(path), spec, alg, rnd)
    return alg


def test_the_server_resumes_from_its_checkpoint_and_refuses_one_it_cannot_trust(setting, tmp_path):
    """Resume continues from the server's state after the last round it aggregated (issue 31), which may be older
    than the last round the ledgers released (a run that failed in between: that round stays charged, its sum is
    lost); a checkpoint of another run, of a later round, or none where one is needed is refused before any round."""
    spec, _ = setting
    path = tmp_path / "run.checkpoint"
    saved = _checkpointed(spec, path, 1)
    fresh = flower_app._setup(spec)
    assert not np.array_equal(fresh.global_params, saved.global_params)
    flower_app._resume_from(str(path), spec, fresh, 2)
    assert np.array_equal(fresh.global_params, saved.global_params)
    older = flower_app._setup(spec)
    flower_app._resume_from(str(path), spec, older, 3)  # round 2 released, never aggregated: from round 1's state
    assert np.array_equal(older.global_params, saved.global_params)
    with pytest.raises(DeploymentError, match="of round 1, after the last round the ledgers released"):
        flower_app._resume_from(str(path), spec, flower_app._setup(spec), 1)
    other = RunSpec.from_json(spec.to_json().replace('"resume-unit"', '"another-run"'))
    with pytest.raises(DeploymentError, match="belongs to run 'resume-unit'"):
        flower_app._resume_from(str(path), other, flower_app._setup(other), 2)
    with pytest.raises(DeploymentError, match="this run has none"):
        flower_app._resume_from("", spec, flower_app._setup(spec), 2)
    untouched = flower_app._setup(spec)  # nothing aggregated before: the initial state, said in the log
    flower_app._resume_from(str(tmp_path / "absent.checkpoint"), spec, untouched, 1)
    assert np.array_equal(untouched.global_params, flower_app._setup(spec).global_params)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(DeploymentError, match="cannot be read"):
        flower_app._resume_from(str(path), spec, flower_app._setup(spec), 2)


def test_a_client_resumed_in_a_new_flower_run_continues_its_generators_from_its_state_file(setting):
    """A resumed run id is a new Flower run (a fresh Context.state): the client takes its generators from the
    client-state file beside its ledger, so round 1 of the second launch releases what round 1 of an uninterrupted
    run releases; a state saved at the round asked or later (the run id started again) is ignored, and a client
    without its file refuses to go on rather than repeat its released noise."""
    import dataclasses

    spec, node = setting
    seeded = dataclasses.replace(spec, privacy=dataclasses.replace(spec.privacy, secure_noise=False),
                                 run_id="resume-seeded")
    context = _context(seeded, node)  # one Flower run: the Context keeps the generators between rounds
    alg = flower_app._setup(seeded)
    plan = flower_app._run_plan(alg, seeded)

    def train(ctx, rnd):
        broadcast = {"round": rnd, "noise_multipliers": plan.noise_multipliers,
                     "values": dict(alg.broadcast(rnd).values)}
        msg = Message(to_record(broadcast, BROADCAST), dst_node_id=1, message_type="train")
        return from_record(client_train(msg, ctx).content, REPLY)["releases"][0]["value"]

    train(context, 0)
    uninterrupted = train(context, 1)
    other = dict(node, **{"ledger-path": node["ledger-path"] + ".b"})
    train(_context(seeded, other), 0)  # a first launch answers round 0, then stops
    resumed = train(_context(seeded, other), 1)  # a second launch: a fresh Context, generators from the file
    assert np.array_equal(resumed, uninterrupted)
    third = dict(node, **{"ledger-path": node["ledger-path"] + ".c"})
    train(_context(seeded, third), 0)
    os.remove(third["ledger-path"] + ".client-state")  # without the file the generators would restart from the seed
    with pytest.raises(DeploymentError, match="would repeat noise"):  # and repeat round 0's released noise: refused
        train(_context(seeded, third), 1)
