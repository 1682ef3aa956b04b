"""The same privfl Flower app on Flower's Simulation Engine (a SuperLink with ``--simulation``, virtual SuperNodes
on Ray): FedAvg equals the in-process runtime bit for bit, and each virtual organisation keeps its own ledger file.

The virtual SuperNodes only know their ``partition-id``; the app's run config gives the data and ledger paths as
templates. Needs flwr with its ``simulation`` extra (Ray).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

from privfl.accounting.ledger import PrivacyLedger  # noqa: E402
from privfl.core.config import FederationConfig, PrivacyConfig  # noqa: E402
from privfl.data import federated_from_arrays, load_digits  # noqa: E402
from privfl.flower.app import RunSpec, read_result, write_app  # noqa: E402
from privfl.flower.local import LocalDeployment  # noqa: E402

N_CLIENTS, ROUNDS = 3, 2


def _run_on_engine(tmp_path, spec, data_path_template: str, env) -> np.ndarray:
    """``spec`` on a simulation SuperLink with ``N_CLIENTS`` virtual SuperNodes (data from ``data_path_template``,
    ledgers ``tmp_path/org{k}-ledger.sqlite``): the final global parameters."""
    result_path = str(tmp_path / "result.bin")
    app = write_app(str(tmp_path / "app"), spec, result_path=result_path, data_path_template=data_path_template,
                    ledger_path_template=str(tmp_path / "org{partition-id}-ledger.sqlite"))
    work = tmp_path / "engine"
    work.mkdir()
    with LocalDeployment(str(work), [], simulation=True, env=env) as dep:
        dep.run(app, timeout=300, federation_config=f"num-supernodes={N_CLIENTS} client-resources-num-cpus=1")
    if not os.path.exists(result_path):
        pytest.fail("the ServerApp wrote no result; flwr run log:\n"
                    + open(work / "flwr-run.log", errors="replace").read()[-4000:])
    return read_result(result_path)["state"]["global_params"]


@pytest.mark.slow  # make test-all (CI time): test_runtime_contract.py checks the same run on the engine
def test_fedavg_on_the_simulation_engine_equals_in_process(tmp_path, in_process_reference, repro_env):
    digits = load_digits(flatten=True)
    idx = np.random.default_rng(1).permutation(len(digits))
    parts = [digits.subset(idx[k * 100:(k + 1) * 100]) for k in range(N_CLIENTS)]
    data = federated_from_arrays(parts, digits.subset(idx[1500:1600]), name="digits-sim",
                                 design_size=round(sum(map(len, parts)) / len(parts)))
    fed = FederationConfig(rounds=ROUNDS, local_epochs=1, batch_size=32, lr=0.1, hidden=(8,), seed=5)
    privacy = PrivacyConfig()
    for k, part in enumerate(data.train_parts):
        np.savez(tmp_path / f"org{k}.npz", x=part.x, y=part.y)
    spec = RunSpec.of("fedavg", data, fed, privacy, run_id="fedavg-sim", node_wait=60, round_timeout=180)
    expected = in_process_reference(spec, tmp_path)["global_params"]
    got = _run_on_engine(tmp_path, spec, str(tmp_path / "org{partition-id}.npz"), repro_env)
    assert np.array_equal(got, expected), f"max abs difference {np.max(np.abs(got - expected))}"
    for k in range(N_CLIENTS):
        ledger = PrivacyLedger.open_existing(str(tmp_path / f"org{k}-ledger.sqlite"), "fedavg-sim")
        try:
            assert ledger.audit()["clients"][str(k)]["releases"] == ROUNDS
        finally:
            ledger.close()


@pytest.mark.slow  # make test-all (CI time): Ray's start-up, about two minutes
def test_virtual_organisations_load_their_partitions_through_flower_datasets(tmp_path, in_process_reference,
                                                                             repro_env):
    """Issue 31: the Simulation Engine's virtual SuperNodes take their data from Flower Datasets (one CSV cut into the
    run's three IID partitions by Flower's partitioner, ``data-path-template = "flwr-datasets:csv?..."``); FedAvg
    equals the in-process run on the same partitions, bit for bit."""
    pytest.importorskip("flwr_datasets")
    import pandas as pd

    from privfl.data.flower_datasets import load_partition

    env = {**repro_env, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1"}
    os.environ.update({k: v for k, v in env.items() if k.startswith("HF_")})  # this process's loads below
    try:
        digits = load_digits(flatten=True)
        rows = np.random.default_rng(2).permutation(len(digits))[:300]
        frame = pd.DataFrame(digits.x[rows], columns=[f"p{i}" for i in range(digits.x.shape[1])])
        frame["label"] = digits.y[rows]
        frame.to_csv(tmp_path / "digits.csv", index=False)
        source = f"flwr-datasets:csv?data_files={tmp_path / 'digits.csv'}&partitioner=iid"
        parts = [load_partition(source, partition_id=k, num_partitions=N_CLIENTS, task="classification",
                                num_classes=10, name=f"org{k}") for k in range(N_CLIENTS)]
    finally:
        for key in ("HF_HOME", "HF_DATASETS_OFFLINE"):
            os.environ.pop(key, None)
    test = digits.subset(np.random.default_rng(2).permutation(len(digits))[1500:1600])
    data = federated_from_arrays(parts, test, name="digits-fds", design_size=100)
    for k, part in enumerate(data.train_parts):  # the in-process reference reads the same partitions from files
        np.savez(tmp_path / f"org{k}.npz", x=part.x, y=part.y)
    fed = FederationConfig(rounds=ROUNDS, local_epochs=1, batch_size=32, lr=0.1, hidden=(8,), seed=5)
    spec = RunSpec.of("fedavg", data, fed, PrivacyConfig(), run_id="fedavg-fds", node_wait=60, round_timeout=180)
    expected = in_process_reference(spec, tmp_path)["global_params"]
    got = _run_on_engine(tmp_path, spec, source, env)
    assert np.array_equal(got, expected), f"max abs difference {np.max(np.abs(got - expected))}"
