"""A real Flower deployment on loopback: one flower-superlink and three flower-supernode OS processes (insecure
mode), ``flwr run`` of privfl's ServerApp and ClientApp, compared with the in-process runtime on the same seeds.

FedAvg is compared bit for bit; DP-FedAvg with local, seeded noise too (the client's generators are kept in its
Flower Context.state between rounds, so it draws the same noise as the in-process client). The in-process reference
runs in a process of its own and every process gets ``MKL_CBWR=COMPATIBLE`` (conftest.py explains why). Each
SuperNode charges its own SQLite ledger, which must audit.

Every deployment here runs each SuperNode with ``--isolation process`` and a warm privfl worker
(``privfl.flower.warm``: one long-lived process serving every ClientApp message, a third of the time of Flower's
default isolation, which starts a fresh ``flwr-clientapp`` process per message and runs the same ClientApp). The
module's shared deployment starts its SuperNodes under ``experiments/fast_supernode.py --poll-interval 0.05`` (a
test tool, not part of privfl: Flower's SuperNode with its fixed 3 s / 0.5 s / 1 s waits shortened), which takes seconds
off every run; the kill-and-restart test keeps Flower's own ``flower-supernode`` binary, as test_warm.py does.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

pytest.importorskip("flwr")

from privfl.accounting.ledger import PrivacyLedger  # noqa: E402
from privfl.core.config import FederationConfig, PrivacyConfig  # noqa: E402
from privfl.data import load_digits  # noqa: E402
from privfl.flower.app import RunSpec, read_result, write_app  # noqa: E402
from privfl.flower.local import LocalDeployment  # noqa: E402

N_CLIENTS, ROUNDS = 3, 3
RUN_TIMEOUT = 240  # seconds for one flwr run (3 rounds)


@pytest.fixture(scope="module")
def deployment(federation, tmp_path_factory, write_orgs, quick_deployment):
    work = tmp_path_factory.mktemp("flower")
    # each organisation reads FedBNN's public alignment set from its own node config (the run config's path is the
    # server's, never read by a SuperNode that has its own data-path); test_fedbnn_deployed_equals_in_process writes it
    configs = [{**config, "alignment-path": str(work / "alignment.npz")} for config in write_orgs(federation, work)]
    # warm workers (privfl.flower.warm) on SuperNodes with shortened waits (conftest.QUICK)
    with quick_deployment(work, configs) as dep:
        yield dep
    assert all(p.poll() is not None for p in dep.procs)


def _spec(name, federation, fed, privacy, tag, options=None):
    return RunSpec.of(name, federation, fed, privacy, run_id=f"{name}-{tag}", node_wait=60, round_timeout=120,
                      options=options or {})


@pytest.fixture
def _deploy(deploy):
    return lambda deployment, spec, tag: deploy(deployment, spec, tag, RUN_TIMEOUT)


def _ledgers(deployment, spec):
    audits = {}
    for k, config in enumerate(deployment.node_configs):
        path = config["ledger-path"]
        assert os.path.isfile(path), f"organisation {k} has no ledger file"
        ledger = PrivacyLedger.open_existing(path, spec.run_id)
        try:
            audit = ledger.audit()
        finally:
            ledger.close()
        assert set(audit["clients"]) == {str(k)}, "a SuperNode's ledger holds only its own organisation"
        audits[k] = audit["clients"][str(k)]
    return audits


def test_fedavg_deployment_equals_in_process(deployment, federation, in_process_reference, _deploy):
    fed = FederationConfig(rounds=ROUNDS, local_epochs=1, batch_size=32, lr=0.1, hidden=(16,), seed=7)
    spec = _spec("fedavg", federation, fed, PrivacyConfig(), "fedavg")
    expected = in_process_reference(spec, deployment.workdir)["global_params"]
    result = _deploy(deployment, spec, "fedavg")
    got = result["state"]["global_params"]
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert np.array_equal(got, expected), f"max abs difference {np.max(np.abs(got - expected))}"
    assert [h["participants"] for h in result["history"]] == [N_CLIENTS] * ROUNDS
    for k, audit in _ledgers(deployment, spec).items():
        assert audit["releases"] == ROUNDS and audit["epsilon"] == math.inf  # non-private: charged, honestly inf
        assert result["audits"][str(k)]["releases"] == ROUNDS


@pytest.mark.slow  # make test-all (CI time): the secure deployment keeps DP noise on Flower in make test
def test_dp_fedavg_local_noise_deployment_equals_in_process(deployment, federation, in_process_reference, _deploy):
    fed = FederationConfig(rounds=ROUNDS, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=11)
    privacy = PrivacyConfig(epsilon=8.0, delta=1e-5, unit="client", clip=0.5, placement="local", secure_noise=False)
    spec = _spec("dp_fedavg", federation, fed, privacy, "dpfedavg")
    reference = in_process_reference(spec, deployment.workdir)
    result = _deploy(deployment, spec, "dpfedavg")
    got, expected = result["state"]["global_params"], reference["global_params"]
    assert np.array_equal(got, expected), f"max abs difference {np.max(np.abs(got - expected))}"
    assert result["noise_multipliers"] == reference["noise_multipliers"]
    sim_clients = reference["audit"]["clients"]
    for k, audit in _ledgers(deployment, spec).items():
        assert audit["releases"] == ROUNDS
        assert audit["epsilon"] <= privacy.epsilon * (1 + 1e-9)
        assert math.isclose(audit["epsilon"], sim_clients[str(k)]["epsilon"], rel_tol=1e-12)


@pytest.mark.slow  # make test-all (CI time): test_resume.py checks the checkpoint and ledger logic in process
def test_a_resumed_run_continues_from_the_checkpoint_and_equals_an_uninterrupted_run(deployment, federation,
                                                                                   in_process_reference, _deploy):
    """Resume (issue 31): a run id launched with 2 rounds, then again with 3. The second ``flwr run`` resumes at round
    2 (the ledgers released rounds 0 and 1) from the ServerApp's checkpoint of round 1 (``<result>.checkpoint``), and
    each SuperNode's ClientApp (a new Flower run: an empty Context) takes its generators from the client-state file
    beside its ledger, so the model after round 3 is the uninterrupted 3-round run's, bit for bit."""
    import dataclasses

    fed = FederationConfig(rounds=3, local_epochs=1, batch_size=32, lr=0.1, hidden=(16,), seed=19)
    spec = _spec("fedavg", federation, fed, PrivacyConfig(), "resume")
    expected = in_process_reference(spec, deployment.workdir)["global_params"]
    first = _deploy(deployment, dataclasses.replace(spec, fed=dataclasses.replace(fed, rounds=2)), "resume")
    assert first["start_round"] == 0 and [h["round"] for h in first["history"]] == [0, 1]
    os.remove(os.path.join(deployment.workdir, "resume-result.bin"))  # the second launch must write its own
    second = _deploy(deployment, spec, "resume")
    assert second["start_round"] == 2 and [h["round"] for h in second["history"]] == [2]
    got = second["state"]["global_params"]
    assert np.array_equal(got, expected), f"max abs difference {np.max(np.abs(got - expected))}"
    for audit in _ledgers(deployment, spec).values():
        assert audit["releases"] == 3  # each round released once over the two launches


@pytest.mark.slow  # make test-all (CI time): test_resume.py checks pause and resume in process
def test_a_paused_private_run_resumes_and_equals_an_uninterrupted_run(deployment, federation, in_process_reference):
    """Pause and resume (issue 31): DP-FedAvg with seeded local noise, 3 rounds planned, launched with
    ``--run-config pause-after=2`` (the plan stays that of 3 rounds), then launched again: the second launch resumes at
    round 2 from the checkpoint and the clients' client-state files, and the model is the uninterrupted run's, bit
    for bit (the noise included), each round charged once and every ledger within its target."""
    from privfl.flower.app import read_result, write_app

    fed = FederationConfig(rounds=3, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=23)
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="local", secure_noise=False)
    spec = _spec("dp_fedavg", federation, fed, privacy, "paused")
    expected = in_process_reference(spec, deployment.workdir)["global_params"]
    result_path = os.path.join(deployment.workdir, "paused-result.bin")
    app = write_app(os.path.join(deployment.workdir, "app-paused"), spec, result_path=result_path)
    deployment.run(app, timeout=RUN_TIMEOUT, run_config="pause-after=2")
    first = read_result(result_path)
    assert first["paused_after"] == 2 and [h["round"] for h in first["history"]] == [0, 1]
    os.remove(result_path)
    deployment.run(app, timeout=RUN_TIMEOUT)
    second = read_result(result_path)
    assert second["start_round"] == 2 and "paused_after" not in second
    got = second["state"]["global_params"]
    assert np.array_equal(got, expected), f"max abs difference {np.max(np.abs(got - expected))}"
    for audit in _ledgers(deployment, spec).values():
        assert audit["releases"] == 3 and audit["epsilon"] <= privacy.epsilon * (1 + 1e-9)


# Each deployment takes a minute or more (every ClientApp call is a fresh process): these are `slow`, outside the
# default run (CI's 20-minute budget), run by `make test-all`. FOLA under secure aggregation stays in the default run
# (tests/flower/test_secure_deployment.py).
@pytest.mark.parametrize("name, privacy, options", [
    pytest.param("fola", PrivacyConfig(epsilon=8.0, delta=1e-5, unit="client", clip=0.5, placement="local",
                                       secure_noise=False), {}, marks=pytest.mark.slow),
    pytest.param("fola", PrivacyConfig(epsilon=8.0, delta=1e-5, unit="example", clip=1.0, secure_noise=False), {},
                 marks=pytest.mark.slow),
    pytest.param("dpsgd_fedavg", PrivacyConfig(epsilon=8.0, delta=1e-5, unit="example", clip=1.0,
                                               secure_noise=False), {}, marks=pytest.mark.slow),
    # a client's own local model kept in its SuperNode's Context.state between rounds
    pytest.param("hbfl", PrivacyConfig(epsilon=8.0, delta=1e-5, unit="client", clip=0.5, placement="local",
                                       secure_noise=False), {}, marks=pytest.mark.slow),
    # the two noise-once posteriors (issue 27): FOLA's Laplace (a second channel on the lot), HBFL's variational meme
    pytest.param("dp_fedsgd", PrivacyConfig(epsilon=8.0, delta=1e-5, unit="example", clip=1.0, accountant="pld",
                                            secure_noise=False), {"posterior": "laplace", "lot_size": 64},
                 marks=pytest.mark.slow),
    pytest.param("dp_fedsgd", PrivacyConfig(epsilon=8.0, delta=1e-5, unit="example", clip=1.0, accountant="pld",
                                            secure_noise=False), {"posterior": "variational", "lot_size": 64},
                 marks=pytest.mark.slow),
    # adaptive clipping (issue 29): the round's clip in the broadcast (DP-SGD FedAvg's counts a channel of its own)
    pytest.param("dp_fedsgd", PrivacyConfig(epsilon=8.0, delta=1e-5, unit="example", clip=1.0, accountant="pld",
                                            secure_noise=False, clip_quantile=0.7), {"lot_size": 64},
                 marks=pytest.mark.slow),
    pytest.param("dpsgd_fedavg", PrivacyConfig(epsilon=8.0, delta=1e-5, unit="example", clip=1.0,
                                               secure_noise=False, clip_quantile=0.7), {},
                 marks=pytest.mark.slow),
    # correlated noise (issue 29): each client's record groups and last sums in its SuperNode's state
    pytest.param("dp_fedsgd", PrivacyConfig(epsilon=8.0, delta=1e-5, unit="example", clip=1.0, accountant="pld",
                                            secure_noise=False), {"lot_size": 64, "bands": 2},
                 marks=pytest.mark.slow),
], ids=["fola-client", "fola-example", "dpsgd_fedavg", "hbfl-client", "dp_fedsgd-laplace", "dp_fedsgd-variational",
        "dp_fedsgd-adaptive", "dpsgd_fedavg-adaptive", "dp_fedsgd-banded"])
def test_split_algorithms_deployed_equal_in_process(deployment, federation, in_process_reference, name, privacy,
                                                    _deploy, options):
    """An algorithm whose broadcast is more than a model (FOLA's posterior), record-level DP-SGD, whose noise and
    Poisson batches come from each client's own generators, HBFL, whose clients keep their local models between
    rounds on their own SuperNodes, DP-FedSGD with its two noise-once posteriors (options in the spec), adaptive
    clipping (the round's clip in the broadcast, moved by the clients' counts) and correlated noise (each
    client's record groups and last sums its own state): the same global state as the in-process run."""
    fed = FederationConfig(rounds=2, local_epochs=1, batch_size=32, lr=0.1, hidden=(16,), seed=13)
    tag = (f"{name}-{privacy.unit}-{options.get('posterior', '')}{'-adaptive' if privacy.clip_quantile else ''}"
           f"{'-banded' if options.get('bands', 1) > 1 else ''}")
    spec = _spec(name, federation, fed, privacy, tag, options)
    reference = in_process_reference(spec, deployment.workdir)
    result = _deploy(deployment, spec, tag)
    assert set(result["state"]) == set(reference["state"])
    for key, expected in reference["state"].items():
        got = result["state"][key]
        assert np.array_equal(got, expected), f"{key}: max abs difference {np.max(np.abs(got - expected))}"
    sim_clients = reference["audit"]["clients"]
    for k, audit in _ledgers(deployment, spec).items():
        assert audit["releases"] == sim_clients[str(k)]["releases"] > 0
        assert audit["epsilon"] <= privacy.epsilon * (1 + 1e-9)
        assert math.isclose(audit["epsilon"], sim_clients[str(k)]["epsilon"], rel_tol=1e-9)


@pytest.mark.slow
def test_fedbnn_deployed_equals_in_process(deployment, federation, in_process_reference, _deploy):
    """FedBNN with its public alignment set as a file every party reads (``RunSpec.alignment_path``; its labels are
    never read) and its options in the spec (a short warm-up and prior tuning): each client's personalised BNN stays
    in its SuperNode's Context.state between rounds, and the broadcast state (the noisy average of the clients'
    probabilities on the alignment set, and its reliability) equals the in-process run's; each ledger audits within
    its target."""
    digits = load_digits(flatten=True)
    idx = np.random.default_rng(0).permutation(len(digits))
    alignment = os.path.join(deployment.workdir, "alignment.npz")
    np.savez(alignment, x=digits.x[idx[1700:1740]])  # public inputs, disjoint from every organisation's data
    fed = FederationConfig(rounds=2, local_epochs=1, batch_size=32, lr=0.1, hidden=(16,), seed=17)
    privacy = PrivacyConfig(epsilon=8.0, delta=1e-5, unit="client", placement="local", secure_noise=False)
    options = {"warmup_epochs": 1, "prior_steps": 3, "mc_samples": 2, "alignment_size": 40}
    spec = RunSpec.of("fedbnn", federation, fed, privacy, run_id="fedbnn-client", node_wait=60, round_timeout=120,
                      alignment_path=alignment, options=options)
    assert len(spec.public_facts().alignment) == 40
    reference = in_process_reference(spec, deployment.workdir)
    result = _deploy(deployment, spec, "fedbnn")
    assert set(result["state"]) == set(reference["state"]) == {"global_probs", "reliability"}
    for key, expected in reference["state"].items():
        got = result["state"][key]
        assert np.array_equal(got, expected), f"{key}: max abs difference {np.max(np.abs(got - expected))}"
    assert result["state"]["global_probs"].shape == (40, 10)
    sim_clients = reference["audit"]["clients"]
    for k, audit in _ledgers(deployment, spec).items():
        assert audit["releases"] == sim_clients[str(k)]["releases"] == 2
        assert audit["epsilon"] <= privacy.epsilon * (1 + 1e-9)
        assert math.isclose(audit["epsilon"], sim_clients[str(k)]["epsilon"], rel_tol=1e-9)


@pytest.mark.slow  # make test-all (CI time): client sampling's neighbouring tests run in process
def test_client_sampling_deployed_equals_in_process(deployment, federation, in_process_reference, _deploy):
    """Poisson client sampling with central noise (amplified): the server draws the run plan's sampling stream as the
    in-process runtime does, sends the round to the sampled organisations only, and every left-out member charges its
    own ledger for the round; the model and every ledger equal the in-process run's."""
    fed = FederationConfig(rounds=ROUNDS, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=21)
    privacy = PrivacyConfig(epsilon=8.0, delta=1e-5, unit="client", clip=0.5, placement="central",
                            sampling_rate=0.5, secure_noise=False)
    spec = _spec("dp_fedavg", federation, fed, privacy, "sampled")
    reference = in_process_reference(spec, deployment.workdir)
    result = _deploy(deployment, spec, "sampled")
    got, expected = result["state"]["global_params"], reference["global_params"]
    assert np.array_equal(got, expected), f"max abs difference {np.max(np.abs(got - expected))}"
    participants = [h["participants"] for h in result["history"]]
    assert 0 < sum(participants) < N_CLIENTS * ROUNDS, "sampling left no one out (or everyone): a weak test"
    sim_clients = reference["audit"]["clients"]
    for k, audit in _ledgers(deployment, spec).items():
        assert audit["releases"] == sim_clients[str(k)]["releases"]
        assert math.isclose(audit["epsilon"], sim_clients[str(k)]["epsilon"], rel_tol=1e-9)
        assert audit["epsilon"] <= privacy.epsilon * (1 + 1e-9)
        ledger = PrivacyLedger.open_existing(deployment.node_configs[k]["ledger-path"], spec.run_id)
        try:
            assert {c.round for c in ledger.charges(str(k))} == set(range(ROUNDS)), "every round charged"
        finally:
            ledger.close()


def _spend_nearly_all(path, run_id, privacy, client_id):
    """Charge ``client_id`` in ``path`` an event that leaves less than any round of the run costs: the largest
    Gaussian (smallest noise, found by bisection on throwaway ledgers) that still fits under the budget."""
    from privfl.accounting.errors import PrivacyBudgetExceeded
    from privfl.accounting.events import GaussianEvent

    def fits(std):
        scratch = PrivacyLedger(":memory:", run_id, delta=privacy.delta, epsilon_budget=privacy.epsilon,
                                accountant=privacy.resolved_accountant)
        try:
            scratch.charge(client_id, 10_000, "earlier", GaussianEvent(1.0, std), "client")
            return True
        except PrivacyBudgetExceeded:
            return False
        finally:
            scratch.close()

    lo, hi = 1e-3, 1e3  # lo does not fit, hi fits
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    ledger = PrivacyLedger(path, run_id, delta=privacy.delta, epsilon_budget=privacy.epsilon,
                           accountant=privacy.resolved_accountant)
    try:
        ledger.charge(client_id, 10_000, "earlier", GaussianEvent(1.0, hi), "client")
        return ledger.epsilon(client_id)
    finally:
        ledger.close()


def test_a_supernode_refuses_to_release_past_its_own_budget(deployment, federation):
    """Organisation 1's own ledger has (almost) no budget left for this run: its SuperNode sits every round out,
    releases nothing and charges nothing, while the other two train; the server only learns that it sat out."""
    fed = FederationConfig(rounds=2, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=3)
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="local")
    run_id = "dp_fedavg-budget"
    ledger_path = deployment.node_configs[1]["ledger-path"]
    spent = _spend_nearly_all(ledger_path, run_id, privacy, "1")
    assert privacy.epsilon * 0.99 < spent <= privacy.epsilon * (1 + 1e-9)
    spec = RunSpec.of("dp_fedavg", federation, fed, privacy, run_id=run_id, node_wait=60, round_timeout=120)
    result_path = os.path.join(deployment.workdir, "budget-result.bin")
    deployment.run(write_app(os.path.join(deployment.workdir, "app-budget"), spec, result_path=result_path),
                   timeout=RUN_TIMEOUT)
    assert os.path.exists(result_path), "the ServerApp wrote no result"
    result = read_result(result_path)
    assert [h["sat_out"] for h in result["history"]] == [["1"], ["1"]]
    assert [h["participants"] for h in result["history"]] == [2, 2]
    ledger = PrivacyLedger.open_existing(ledger_path, run_id)
    try:
        assert [(c.round, c.channel) for c in ledger.charges("1")] == [(10_000, "earlier")]
        assert ledger.epsilon("1") == spent
    finally:
        ledger.close()
    audits = _ledgers_of(deployment, run_id, [0, 2])
    assert all(a["releases"] == 2 and a["epsilon"] <= privacy.epsilon * (1 + 1e-9) for a in audits.values())


def _ledgers_of(deployment, run_id, orgs):
    out = {}
    for k in orgs:
        ledger = PrivacyLedger.open_existing(deployment.node_configs[k]["ledger-path"], run_id)
        try:
            out[k] = ledger.audit()["clients"][str(k)]
        finally:
            ledger.close()
    return out


def _rows(path, run_id):
    """A ledger's rows of ``run_id``: (client, round, channel) -> (event, charged_at, released)."""
    ledger = PrivacyLedger.open_existing(path, run_id)
    try:
        return {(c.client_id, c.round, c.channel): (c.event, c.charged_at, c.released) for c in ledger.charges()}
    finally:
        ledger.close()


@pytest.mark.slow  # make test-all (CI time): three launches on stock SuperNodes, about three minutes
def test_a_supernode_killed_mid_run_aborts_then_restarted_resumes_within_budget(federation, tmp_path, write_orgs):
    """Organisation 2's SuperNode (and its ClientApp) is killed once its ledger holds the release of round 0: for the
    round in flight the ServerApp gets Flower's "node unavailable" error reply (or no reply within its round timeout)
    and aborts with a DeploymentError; no model is published, no organisation is asked for a later round, and the
    killed organisation's ledger holds nothing released after the kill.

    Then the SuperNode is restarted with the same node config (the same ledger) and the run id is launched again,
    with more rounds: the server resumes at the first round no ledger has released, every ledger keeps the rows of
    the first run as they were and releases no (round, channel) twice, and each refuses the rounds that would take
    it past its budget (it sits out; charging one more round would indeed exceed it), so every audit stays within
    the target. A third launch of the run id, whose rounds are all released, is refused with a message naming it."""
    import dataclasses
    import shutil
    import sqlite3
    import threading
    import time

    from privfl.accounting.errors import PrivacyBudgetExceeded

    configs = write_orgs(federation, tmp_path)
    fed = FederationConfig(rounds=3, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=2)
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="local")
    spec = RunSpec.of("dp_fedavg", federation, fed, privacy, run_id="fault", node_wait=60, round_timeout=40)
    result_path = str(tmp_path / "result.bin")
    app = write_app(str(tmp_path / "app"), spec, result_path=result_path)

    def released_rounds(path):
        if not os.path.exists(path):
            return set()
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            return {r for (r,) in conn.execute("SELECT round FROM charges WHERE released=1")}
        except sqlite3.OperationalError:  # the schema is not written yet
            return set()
        finally:
            conn.close()

    def log_text():
        return open(os.path.join(dep.workdir, "flwr-run.log"), errors="replace").read()

    # Flower's own flower-supernode (not privfl's launcher); killing a node kills its worker too
    dep = LocalDeployment(str(tmp_path / "dep"), configs, warm=True)
    os.makedirs(dep.workdir, exist_ok=True)
    try:
        dep.start()
        runner = threading.Thread(target=dep.run, args=(app,), kwargs={"timeout": RUN_TIMEOUT}, daemon=True)
        runner.start()
        deadline = time.monotonic() + 150
        while 0 not in released_rounds(configs[2]["ledger-path"]):
            assert time.monotonic() < deadline, "organisation 2 never released round 0"
            time.sleep(0.5)
        dep.kill_node(2)
        killed_after = released_rounds(configs[2]["ledger-path"])
        runner.join(RUN_TIMEOUT + 30)
        assert not runner.is_alive()
        assert not os.path.exists(result_path), "an aborted run must not publish a model"
        log = log_text()
        assert "DeploymentError" in log and ("did not reply" in log or "failed" in log), log[-3000:]
        assert "(partition 2)" in log, "the error names the organisation that failed"
        assert released_rounds(configs[2]["ledger-path"]) == killed_after and max(killed_after) <= 1
        first = {}
        for config in configs:
            first[config["partition-id"]] = rows = _rows(config["ledger-path"], "fault")
            assert rows and max(r for (_, r, _) in rows) <= 1, "no one was asked for a round after the aborted one"
            assert all(released for (_, _, released) in rows.values()), "a plaintext row is marked with its charge"
        start = 1 + max(r for rows in first.values() for (_, r, _), (_, _, rel) in rows.items() if rel)

        # restart organisation 2's SuperNode and launch the run id again, with 7 rounds: the noise is calibrated for
        # 7, so the rounds of the first run (calibrated for 3) leave too little budget for all of the new ones
        dep.restart_node(2)
        longer = dataclasses.replace(spec, fed=dataclasses.replace(fed, rounds=7))
        resumed_path = str(tmp_path / "resumed.bin")
        dep.run(write_app(str(tmp_path / "app-resumed"), longer, result_path=resumed_path), timeout=RUN_TIMEOUT)
        assert os.path.exists(resumed_path), f"the resumed run published nothing:\n{log_text()[-4000:]}"
        resumed = read_result(resumed_path)
        assert resumed["start_round"] == start
        assert [h["round"] for h in resumed["history"]] == list(range(start, 7))
        assert "2" in resumed["history"][-1]["sat_out"], "the restarted organisation never reached its budget"
        after = {}
        for config in configs:
            k = config["partition-id"]
            after[k] = rows = _rows(config["ledger-path"], "fault")
            assert {key: rows[key] for key in first[k]} == first[k], "the first run's rows are kept as they were"
            new = sorted(r for (_, r, _) in set(rows) - set(first[k]))
            assert all(released for (_, _, released) in rows.values()), "every charge marked, nothing else"
            assert new == list(range(start, start + len(new))), f"organisation {k} released rounds {new}"
            assert len(new) < 7 - start, f"organisation {k} released every round: its budget never refused one"
            assert [h["round"] for h in resumed["history"] if str(k) in h["sat_out"]] == \
                list(range(start + len(new), 7))
            ledger = PrivacyLedger.open_existing(config["ledger-path"], "fault")
            try:
                assert ledger.epsilon(str(k)) <= privacy.epsilon * (1 + 1e-9)
                last = max(ledger.charges(str(k)), key=lambda c: c.round)
            finally:
                ledger.close()
            # the refusal was needed: one more round's charge, on a copy of the ledger, would exceed the budget
            scratch = str(tmp_path / f"scratch{k}.sqlite")
            shutil.copyfile(config["ledger-path"], scratch)
            ledger = PrivacyLedger.open_existing(scratch, "fault")
            try:
                with pytest.raises(PrivacyBudgetExceeded):
                    ledger.charge(str(k), 7, last.channel, last.event, last.unit)
            finally:
                ledger.close()
            if k == 2:
                assert new, "the restarted organisation took no part in the resumed run"

        # a third launch of the run id: every one of its 3 rounds is released, so it is refused, naming the run
        again_path = str(tmp_path / "again.bin")
        dep.run(write_app(str(tmp_path / "app-again"), spec, result_path=again_path), timeout=RUN_TIMEOUT)
        assert not os.path.exists(again_path)
        assert "run 'fault'" in log_text() and "nothing is left to run" in log_text(), log_text()[-3000:]
        assert {c["partition-id"]: _rows(c["ledger-path"], "fault") for c in configs} == after
    finally:
        dep.close()
