"""The ServerApp and ClientApp of privfl's Flower app (``privfl.flower.app.server_main`` and ``client_app``) run in one
process over a loopback Grid (experiments/loopback_grid.py): each message pushed is handed to the addressed
organisation's ClientApp as Flower would deliver it, and an organisation that has "died" never answers. What this shows
in seconds, without a SuperLink: the plaintext survivor rule of the ServerApp (``RunSpec(min_replies=...)``: a round
completes with the organisations that replied, the silent one named in the log by its partition id; fewer replies than
min_replies stop the run with an error), secure aggregation's dropout recovery through the ServerApp's and ClientApp's
own stages (semi-honest and malicious: an organisation that dies after sharing its keys), and that no ledger holds a row
that was not released, nor a release without its row. The same on real deployments (a SuperNode process killed mid-run)
is tests/flower/test_survivors.py, test_secure_deployment.py and test_malicious_deployment.py, in make test-all."""

from __future__ import annotations

import importlib.util
import logging
import os
import sqlite3

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from privfl.core.config import FederationConfig, PrivacyConfig  # noqa: E402
from privfl.flower import app as flower_app  # noqa: E402
from privfl.flower.app import DeploymentError, RunSpec, read_result  # noqa: E402
from privfl.flower.identity import FEDERATION_KEY, IDENTITY_KEY, make_identities  # noqa: E402
from privfl.privacy.secure import SecureAggregation  # noqa: E402


def _test_tool(name: str):
    """A module of experiments/ (a test tool, not part of privfl), loaded from its file."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "experiments",
                        f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LoopbackGrid = _test_tool("loopback_grid").LoopbackGrid


def _released(path, run_id):
    if not os.path.exists(path):
        return []
    with sqlite3.connect(path) as conn:
        return sorted(conn.execute("SELECT round, released FROM charges WHERE run_id=?", (run_id,)).fetchall())


def _from_round(nodes, first):
    """Silence for ``nodes`` from round ``first`` on (a message's group id: its round, or "round.stage")."""
    def silent(node, message):
        head = message.metadata.group_id.split(".")[0]
        return node in nodes and head.isdigit() and int(head) >= first
    return silent


def _configs(rounds=3, clip_quantile=None):
    fed = FederationConfig(rounds=rounds, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=2)
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="local",
                            secure_noise=False, clip_quantile=clip_quantile)
    return fed, privacy


def _run(federation, tmp_path, write_orgs, monkeypatch, *, silent, min_replies=None, secure=None, rounds=3,
         clip_quantile=None):
    monkeypatch.setenv("PRIVFL_REPLY_POLL", "0.01")
    for name in ("_run_id", "_node_id", "_task_id"):  # what Flower's runtime sets in a ServerApp's process
        monkeypatch.setattr(TaskIdentity, name, 1)
    configs = write_orgs(federation, tmp_path)
    identities = None
    if secure is not None and secure.malicious:  # each organisation's identity key and the federation file
        # the privacy terms the file pins: the run's own (_configs: local noise, seeded to compare runs)
        keys, federation_file, identities = make_identities(
            str(tmp_path / "identities"), len(configs), secure, placement="local", secure_noise=False, epsilon=4.0,
            delta=1e-5, epsilon_total=4.0, delta_total=1e-5)
        for config, key in zip(configs, keys):
            config.update({IDENTITY_KEY: key, FEDERATION_KEY: federation_file})
    fed, privacy = _configs(rounds, clip_quantile)
    spec = RunSpec.of("dp_fedavg", federation, fed, privacy, run_id="loopback", node_wait=1, round_timeout=0.5,
                      min_replies=min_replies, secure=secure, **({} if identities is None else
                                                                 {"identities": identities}))
    result_path = str(tmp_path / "result.bin")
    run_config = {flower_app.SPEC_KEY: spec.to_json(), flower_app.RESULT_KEY: result_path}  # one run's, for all
    apps = {100 + k: (flower_app.client_app, Context(run_id=1, node_id=100 + k, node_config=config,
                                                     state=RecordDict(), run_config=run_config))
            for k, config in enumerate(configs)}
    grid = LoopbackGrid(apps, silent)
    flower_app.server_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                         run_config=run_config))
    return spec, configs, read_result(result_path)


def test_a_silent_organisation_is_left_out_and_the_run_completes(federation, tmp_path, write_orgs, monkeypatch,
                                                                 caplog):
    with caplog.at_level(logging.WARNING):
        spec, configs, result = _run(federation, tmp_path, write_orgs, monkeypatch, min_replies=2,
                                     silent=_from_round({102}, 1))
    assert [(h["round"], h["participants"], h["aborted"]) for h in result["history"]] == [
        (0, 3, False), (1, 2, False), (2, 2, False)]
    assert np.all(np.isfinite(result["state"]["global_params"]))
    assert "(partition 2)" in caplog.text and "completes with the others" in caplog.text
    for k, config in enumerate(configs):  # every row released; the silent one charged nothing it did not send
        assert _released(config["ledger-path"], spec.run_id) == ([(r, 1) for r in range(3)] if k != 2 else [(0, 1)])


def test_fewer_replies_than_min_replies_stop_the_run(federation, tmp_path, write_orgs, monkeypatch):
    with pytest.raises(DeploymentError, match="1 of 3 organisations replied, fewer than min_replies=2"):
        _run(federation, tmp_path, write_orgs, monkeypatch, min_replies=2, silent=_from_round({101, 102}, 1))


def test_without_min_replies_a_silent_organisation_stops_the_run(federation, tmp_path, write_orgs, monkeypatch):
    with pytest.raises(DeploymentError, match="did not reply"):
        _run(federation, tmp_path, write_orgs, monkeypatch, silent=_from_round({102}, 1))


@pytest.mark.parametrize("malicious", [False, True], ids=["semi-honest", "malicious"])
def test_an_organisation_that_dies_after_sharing_its_keys_is_recovered_from_the_survivors(
        federation, tmp_path, write_orgs, monkeypatch, malicious):
    """Secure aggregation (both variants; the malicious one with signed messages and the federation file): partition
    2 answers the share-keys stage and never anything after. The round completes from the two survivors, whose
    shares of its mask key remove its masks; its ledger keeps the charge, never marked released (its masked input
    never left); the survivors' ledgers mark exactly what they sent."""
    secure = SecureAggregation(bits=48, malicious=malicious, dropout=0.34)
    stages = ("masked_input", "consistency_check", "unmask")
    dead = lambda node, message: node == 102 and message.metadata.group_id.split(".")[-1] in stages  # noqa: E731
    spec, configs, result = _run(federation, tmp_path, write_orgs, monkeypatch, silent=dead, secure=secure,
                                 rounds=1)
    (round0,) = result["history"]
    assert (round0["participants"], round0["aborted"]) == (2, False)
    assert np.all(np.isfinite(result["state"]["global_params"]))
    assert [_released(c["ledger-path"], spec.run_id) for c in configs] == [[(0, 1)], [(0, 1)], [(0, 0)]]


def test_client_level_adaptive_clipping_through_the_apps_equals_in_process(federation, tmp_path, write_orgs,
                                                                           monkeypatch):
    """DP-FedAvg with adaptive clipping (issue 29, client level) through the ServerApp and ClientApp under secure
    aggregation: the broadcast clip and the clip counts travel as Flower messages, and the clips and the model equal
    the in-process run's (same seeds; secure aggregation's quantisation aside); every organisation's ledger marks both
    channels' rows released."""
    from privfl.algorithms.dp_fedavg import DPFedAvg
    from privfl.runtime.engine import Simulation

    secure = SecureAggregation(bits=48)
    spec, configs, result = _run(federation, tmp_path, write_orgs, monkeypatch, silent=lambda *_: False,
                                 secure=secure, clip_quantile=0.5)
    fed, privacy = _configs(3, 0.5)
    alg = DPFedAvg(fed, privacy)
    local = Simulation(alg, federation, fed, privacy, secure=secure).run()
    clips = [h["clip"] for h in result["history"]]
    assert len(set(clips)) > 1  # the clip moved
    np.testing.assert_allclose(clips, [h.clip for h in local.history], rtol=1e-6)
    np.testing.assert_allclose(result["state"]["global_params"], alg.global_params, atol=1e-5)
    for config in configs:
        with sqlite3.connect(config["ledger-path"]) as conn:
            rows = conn.execute("SELECT channel, released FROM charges WHERE run_id=?", (spec.run_id,)).fetchall()
        assert sorted(set(rows)) == [("clip_count", 1), ("update", 1)]


def _held_out_test(federation, tmp_path, *, extreme: bool, empty: bool = False) -> str:
    """The run's test file: organisation 0's first 20 records, plus one record of finite features so large that the
    global model's predictions on it overflow (``extreme``), or no record at all (``empty``)."""
    x, y = federation.train_parts[0].x[:20], federation.train_parts[0].y[:20]
    if extreme:
        x, y = np.concatenate([x, np.full((1, x.shape[1]), 3e38, dtype=np.float32)]), np.concatenate([y, y[:1]])
    if empty:
        x, y = x[:0], y[:0]
    path = str(tmp_path / f"test-{extreme}-{empty}.npz")
    np.savez(path, x=x, y=y)
    return path


@pytest.mark.parametrize("from_clients", [True, False], ids=["held-out-records", "server-test-file"])
def test_the_server_app_stops_on_held_out_records_only_when_they_are_its_own(federation, tmp_path, write_orgs,
                                                                             monkeypatch, from_clients):
    """The ServerApp's divergence check: a test file that holds the clients' own held-out records (run config
    ``test-from-clients``, what ``privfl run --runtime flower-sim`` writes without --test-data) never decides when a
    private run stops, so one held-out record whose predictions overflow leaves the run's rounds and ledger rows as
    they are, and an empty such file is not evaluated; a test file the server holds may still stop it
    (TrainingDiverged after round 1), as the in-process runtime does."""
    from privfl.errors import TrainingDiverged

    monkeypatch.setenv("PRIVFL_REPLY_POLL", "0.01")
    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)
    fed, privacy = _configs(rounds=2)
    spec = RunSpec.of("dp_fedavg", federation, fed, privacy, run_id="loopback", node_wait=1, round_timeout=5)
    rows = {}
    for tag, test in (("extreme", _held_out_test(federation, tmp_path, extreme=True)),
                      ("plain", _held_out_test(federation, tmp_path, extreme=False)),
                      ("empty", _held_out_test(federation, tmp_path, extreme=False, empty=True))):
        work = tmp_path / tag
        work.mkdir()
        configs = write_orgs(federation, work)
        result_path = str(work / "result.bin")
        run_config = {flower_app.SPEC_KEY: spec.to_json(), flower_app.RESULT_KEY: result_path,
                      flower_app.TEST_KEY: test, flower_app.TEST_FROM_CLIENTS_KEY: from_clients}
        apps = {100 + k: (flower_app.client_app, Context(run_id=1, node_id=100 + k, node_config=config,
                                                         state=RecordDict(), run_config=run_config))
                for k, config in enumerate(configs)}
        server = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
        if tag == "extreme" and not from_clients:
            with pytest.raises(TrainingDiverged, match="round 1 of 2"):
                flower_app.server_main(LoopbackGrid(apps, lambda *_: False), server)
            continue
        flower_app.server_main(LoopbackGrid(apps, lambda *_: False), server)
        history = read_result(result_path)["history"]
        assert len(history) == 2
        if tag == "empty":
            assert all(h["metrics"] == {} for h in history)
        rows[tag] = [_released(c["ledger-path"], spec.run_id) for c in configs]
    if from_clients:
        assert rows["extreme"] == rows["plain"] == rows["empty"] == [[(0, 1), (1, 1)]] * 3


def test_privfl_run_on_flower_sim_tells_the_server_app_where_its_test_set_comes_from(monkeypatch, tmp_path):
    """``run_simulation_engine`` (``privfl run --runtime flower-sim``) writes the app with ``test_from_clients`` as
    the data says (the clients' held-out records, or a test file no client holds)."""
    from privfl.flower import sim

    seen = []

    class Stop(Exception):
        pass

    def write_app(directory, spec, **kw):
        seen.append(kw.get("test_from_clients"))
        raise Stop

    monkeypatch.setattr(flower_app, "write_app", write_app)
    from privfl.data import federated_from_arrays

    rng = np.random.default_rng(0)
    parts = [(rng.normal(size=(20, 3)).astype(np.float32), np.arange(20) % 2) for _ in range(2)]
    fed = FederationConfig(rounds=1, hidden=(), client_size=20)
    privacy = PrivacyConfig(epsilon=3.0, unit="client", clip=1.0)
    for held in (True, False):
        data = federated_from_arrays(parts, parts[0], task="classification", num_classes=2,
                                     test_from_clients=held)
        with pytest.raises(Stop):
            sim.run_simulation_engine("dp_fedavg", data, fed, privacy, {}, str(tmp_path / str(held)), run_id="r")
    assert seen == [True, False]
