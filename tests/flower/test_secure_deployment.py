"""Secure aggregation on a real Flower deployment: one flower-superlink and three flower-supernode OS processes on
loopback, each round run as secure_agg's stages over Flower messages (advertise keys with the training reply, share
keys, masked input, unmask), compared with the in-process runtime on the same seeds.

Each client encodes (quantises, adds its discrete-Gaussian share) with its own generator, so with seeded noise the
deployment's sums are the in-process sums: the final models agree up to quantisation (asserted to 1e-9). Each
SuperNode's own ledger must audit to at most the target, and hold a released mark only for a value that left as a
masked input. The fault test kills one SuperNode once it has shared its keys: the round completes from the survivors
(dropout recovery), and no ledger holds a release without its charge nor a mark for a value that was not sent.
"""

from __future__ import annotations

import math
import os
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flwr")

from privfl.accounting.ledger import PrivacyLedger  # noqa: E402
from privfl.core.config import FederationConfig, PrivacyConfig  # noqa: E402
from privfl.flower.app import RunSpec, read_result  # noqa: E402
from privfl.flower.records import from_bytes  # noqa: E402
from privfl.privacy.secure import SecureAggregation  # noqa: E402

N_CLIENTS = 3
RUN_TIMEOUT = 240

_REFERENCE = """
import sys
import numpy as np
import torch
from privfl.algorithms import make_algorithm
from privfl.data import ArrayDataset, federated_from_arrays
from privfl.flower.app import RunSpec
from privfl.flower.records import to_bytes
from privfl.runtime.engine import Simulation

spec_path, data_dir, out_path = sys.argv[1:4]
spec = RunSpec.from_json(open(spec_path).read())
parts = []
for k in range(spec.n_clients):
    with np.load(f"{data_dir}/org{k}.npz") as f:
        parts.append(ArrayDataset(f["x"], f["y"], spec.task, spec.num_classes, f"org{k}"))
data = federated_from_arrays(parts, parts[0], name=spec.name)
torch.set_num_threads(spec.torch_threads or 1)
sim = Simulation(make_algorithm(spec.algorithm, spec.fed, spec.privacy), data, spec.fed, spec.privacy,
                 executor="per_client", public=spec.public_facts(), secure=spec.secure)
result = sim.run()
with open(out_path, "wb") as f:
    state = dict(sim.algorithm.broadcast(spec.fed.rounds).values)
    f.write(to_bytes({"state": state, "audit": result.audit, "aborted": [h.aborted for h in result.history],
                      "noise_multipliers": result.noise_multipliers}, "reference"))
"""


def _reference(spec, work, repro_env):
    """The in-process runtime on the organisations' files, in its own process (conftest.py explains why)."""
    spec_path, out_path = work / f"{spec.run_id}.json", work / f"{spec.run_id}-reference.bin"
    spec_path.write_text(spec.to_json())
    subprocess.run([sys.executable, "-c", _REFERENCE, str(spec_path), str(work), str(out_path)], check=True,
                   timeout=300, env=dict(os.environ, **repro_env))
    return from_bytes(out_path.read_bytes(), "reference")


def _rows(path, run_id):
    """(round, channel, released) of every charge row of ``run_id`` in a SuperNode's ledger file."""
    with sqlite3.connect(path) as conn:
        return sorted(conn.execute("SELECT round, channel, released FROM charges WHERE run_id=?", (run_id,)))


def _audit(path, run_id, k):
    ledger = PrivacyLedger.open_existing(path, run_id)
    try:
        audit = ledger.audit()
    finally:
        ledger.close()
    assert set(audit["clients"]) <= {str(k)}, "a SuperNode's ledger holds only its own organisation"
    return audit["clients"].get(str(k))


def _deploy_two_rounds(spec, federation, tmp_path, repro_env, write_orgs, deploy,
                                                    quick_deployment):
    """The organisations' node configs, the in-process reference (its own process) and the deployment's result
    (3 warm SuperNodes under ``tmp_path``) of a two-round run that no round may abort on either runtime."""
    configs = write_orgs(federation, tmp_path)
    reference = _reference(spec, tmp_path, repro_env)
    assert reference["aborted"] == [False, False]
    with quick_deployment(tmp_path, configs) as dep:
        result = deploy(dep, spec, spec.run_id, RUN_TIMEOUT)
    assert [(h["participants"], h["aborted"]) for h in result["history"]] == [(N_CLIENTS, False)] * 2
    return configs, reference, result


@pytest.mark.timeout(400)
def test_dp_fedavg_distributed_noise_under_secure_aggregation_equals_in_process(federation, tmp_path, repro_env,
                                                                             write_orgs, deploy, quick_deployment):
    fed = FederationConfig(rounds=2, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=11)
    privacy = PrivacyConfig(epsilon=8.0, delta=1e-5, unit="client", clip=0.5, placement="distributed",
                            accountant="zcdp", secure_noise=False)
    spec = RunSpec.of("dp_fedavg", federation, fed, privacy, run_id="dpfedavg-secagg", node_wait=60,
                      round_timeout=120, secure=SecureAggregation(bits=48, malicious=False))
    configs, reference, result = _deploy_two_rounds(spec, federation, tmp_path, repro_env, write_orgs, deploy,
                                                    quick_deployment)
    got, expected = result["state"]["global_params"], reference["state"]["global_params"]
    # each client's encoding draws from its own generator on both runtimes: the same words, the same sum
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-9)
    assert not np.array_equal(got, np.zeros_like(got))
    assert result["noise_multipliers"] == reference["noise_multipliers"]
    sim_clients = reference["audit"]["clients"]
    for k, config in enumerate(configs):
        # every charge was marked released (each value left as a masked input), and only those
        assert _rows(config["ledger-path"], spec.run_id) == [(0, "update", 1), (1, "update", 1)]
        audit = _audit(config["ledger-path"], spec.run_id, k)
        assert audit["releases"] == 2
        assert audit["epsilon"] <= privacy.epsilon * (1 + 1e-9)
        assert math.isclose(audit["epsilon"], sim_clients[str(k)]["epsilon"], rel_tol=1e-9)


@pytest.mark.slow  # make test-all: the DP-FedAvg deployment above keeps distributed noise under secure aggregation in make test
@pytest.mark.timeout(400)
def test_fola_client_level_distributed_noise_under_secure_aggregation_equals_in_process(
        federation, tmp_path, repro_env, write_orgs, deploy, quick_deployment):
    """FOLA at client level: its two channels (the changes of the natural mean and of the precision) have norm
    clips, so their quantiser ranges are public; each round runs secure_agg's stages over Flower messages and the
    server's posterior equals the in-process run's up to quantisation (the same words on both runtimes)."""
    fed = FederationConfig(rounds=2, local_epochs=1, batch_size=32, lr=0.1, hidden=(16,), seed=13)
    privacy = PrivacyConfig(epsilon=8.0, delta=1e-5, unit="client", clip=0.5, placement="distributed",
                            accountant="zcdp", secure_noise=False)
    spec = RunSpec.of("fola", federation, fed, privacy, run_id="fola-secagg", node_wait=60,
                      round_timeout=120, secure=SecureAggregation(bits=48, malicious=False))
    configs, reference, result = _deploy_two_rounds(spec, federation, tmp_path, repro_env, write_orgs, deploy,
                                                    quick_deployment)
    assert set(result["state"]) == set(reference["state"])
    for key, expected in reference["state"].items():
        got = np.asarray(result["state"][key])
        np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9, err_msg=key)
    assert result["noise_multipliers"] == reference["noise_multipliers"]
    sim_clients = reference["audit"]["clients"]
    channels = ["natural_mean_delta", "precision_delta"]
    for k, config in enumerate(configs):
        assert _rows(config["ledger-path"], spec.run_id) == [(r, c, 1) for r in (0, 1) for c in channels]
        audit = _audit(config["ledger-path"], spec.run_id, k)
        assert audit["epsilon"] <= privacy.epsilon * (1 + 1e-9)
        assert math.isclose(audit["epsilon"], sim_clients[str(k)]["epsilon"], rel_tol=1e-9)


@pytest.mark.slow  # make test-all (CI time): the same through the apps in process: test_loopback.py
@pytest.mark.timeout(400)
def test_a_supernode_killed_after_sharing_keys_is_recovered_from_the_survivors(federation, tmp_path, quick_deployment,
                                                                              write_orgs, run_killing_after_share_keys):
    """SuperNode 2 is killed as soon as it has answered the share-keys stage (charged, not released): the round
    completes from the two survivors, whose shares of its mask key remove its masks. Its ledger keeps the charge,
    never marked released; the survivors' ledgers mark exactly what they sent."""
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=5)
    privacy = PrivacyConfig(epsilon=8.0, delta=1e-5, unit="client", clip=0.5, placement="local",
                            secure_noise=False)
    secure = SecureAggregation(bits=48, malicious=False, dropout=0.34)
    spec = RunSpec.of("dp_fedavg", federation, fed, privacy, run_id="dpfedavg-secagg-kill", node_wait=60,
                      round_timeout=90, secure=secure)
    configs = write_orgs(federation, tmp_path)
    victim = 2
    with quick_deployment(tmp_path, configs) as dep:
        result_path = run_killing_after_share_keys(dep, spec, tmp_path, victim, RUN_TIMEOUT)
    (round0,) = read_result(result_path)["history"]
    # the victim's row: charged, never marked released (its masked input never left)
    assert _rows(configs[victim]["ledger-path"], spec.run_id) == [(0, "update", 0)]
    survivors = [k for k in range(N_CLIENTS) if k != victim]
    # it dropped after sharing its keys: the survivors' shares of its mask key remove its masks from their sum
    assert (round0["participants"], round0["aborted"]) == (len(survivors), False)
    result = read_result(result_path)
    assert np.all(np.isfinite(result["state"]["global_params"]))
    for k in survivors:
        assert _rows(configs[k]["ledger-path"], spec.run_id) == [(0, "update", 1)], "sent, charged and marked"
        assert _audit(configs[k]["ledger-path"], spec.run_id, k)["epsilon"] <= privacy.epsilon * (1 + 1e-9)
        assert result["audits"][str(k)]["releases"] == 1


def test_a_secure_spec_round_trips_and_unsafe_settings_are_refused_up_front(federation):
    from privfl.errors import ConfigurationError

    fed = FederationConfig(rounds=1, hidden=(), seed=0)
    private = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="distributed",
                            accountant="zcdp")
    spec = RunSpec.of("dp_fedavg", federation, fed, private, secure=SecureAggregation(bits=40, malicious=False,
                                                                                      min_survivors=2))
    assert RunSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ConfigurationError, match="identity public key"):
        RunSpec.of("dp_fedavg", federation, fed, private, secure=SecureAggregation(malicious=True))
    with pytest.raises(ConfigurationError, match="private run"):
        RunSpec.of("fedavg", federation, fed, PrivacyConfig(), secure=SecureAggregation(malicious=False))
    with pytest.raises(ConfigurationError, match="secure"):
        RunSpec.of("dp_fedavg", federation, fed, private)  # distributed noise needs secure aggregation


@pytest.mark.slow  # make test-all: two secure launches and a reference, about two minutes
@pytest.mark.timeout(600)
def test_a_paused_secure_run_resumes_and_equals_an_uninterrupted_run(federation, tmp_path, repro_env, quick_deployment,
                                                                     write_orgs):
    """Resume under secure aggregation (issue 31, "up to quantisation"): DP-FedAvg with distributed noise and seeded
    generators, 3 rounds planned, launched with ``pause-after=2``, then again. The second launch resumes at round 2
    from the ServerApp's checkpoint and each SuperNode's generators (training, noise, encoding) from its client-state
    file: the model equals the in-process 3-round run up to the quantisation's float rounding, and every ledger holds
    each round once, released."""
    from privfl.flower.app import read_result, write_app

    fed = FederationConfig(rounds=3, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=13)
    privacy = PrivacyConfig(epsilon=8.0, delta=1e-5, unit="client", clip=0.5, placement="distributed",
                            accountant="zcdp", secure_noise=False)
    spec = RunSpec.of("dp_fedavg", federation, fed, privacy, run_id="secagg-paused", node_wait=60,
                      round_timeout=120, secure=SecureAggregation(bits=48, malicious=False))
    configs = write_orgs(federation, tmp_path)
    reference = _reference(spec, tmp_path, repro_env)
    result_path = str(tmp_path / "paused-result.bin")
    with quick_deployment(tmp_path, configs) as dep:
        app = write_app(str(tmp_path / "app"), spec, result_path=result_path)
        dep.run(app, timeout=RUN_TIMEOUT, run_config="pause-after=2")
        assert read_result(result_path)["paused_after"] == 2
        os.remove(result_path)
        dep.run(app, timeout=RUN_TIMEOUT)
    second = read_result(result_path)
    assert second["start_round"] == 2 and [h["round"] for h in second["history"]] == [2]
    np.testing.assert_allclose(second["state"]["global_params"], reference["state"]["global_params"], rtol=0,
                               atol=1e-9)
    for k, config in enumerate(configs):
        assert _rows(config["ledger-path"], spec.run_id) == [(r, "update", 1) for r in range(3)]
        assert _audit(config["ledger-path"], spec.run_id, k)["epsilon"] <= privacy.epsilon * (1 + 1e-9)
