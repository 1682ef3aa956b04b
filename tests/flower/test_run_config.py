"""Run settings overridable with Flower's ``--run-config`` (issue 31): rounds, epsilon and the run id, applied alike by
the ServerApp and every ClientApp (``privfl.flower.app.read_run_spec``)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("flwr")

from privfl.core.config import FederationConfig, PrivacyConfig  # noqa: E402
from privfl.errors import ConfigurationError  # noqa: E402
from privfl.flower.app import SPEC_KEY, RunSpec, read_result, read_run_spec, write_app  # noqa: E402


def _spec(federation, rounds=2):
    fed = FederationConfig(rounds=rounds, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=7)
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="local")
    return RunSpec.of("dp_fedavg", federation, fed, privacy, run_id="long", node_wait=60, round_timeout=60)


def test_overrides_apply_to_the_spec_and_bad_ones_are_refused(federation):
    spec = _spec(federation)
    config = {SPEC_KEY: spec.to_json(), "rounds": 0, "epsilon": 0.0, "run-id": ""}
    assert read_run_spec(config) == spec  # the app's defaults keep the spec's settings
    got = read_run_spec({**config, "rounds": 1, "epsilon": 2.5, "run-id": "short"})
    assert (got.fed.rounds, got.privacy.epsilon, got.run_id) == (1, 2.5, "short")
    assert got.fed.seed == spec.fed.seed and got.client_size == spec.client_size
    with pytest.raises(ConfigurationError):
        read_run_spec({**config, "rounds": -3})


@pytest.mark.slow  # make test-all (CI time): the overrides are tested on the spec above
@pytest.mark.timeout(300)
def test_flwr_run_config_overrides_rounds_and_run_id(federation, tmp_path, quick_deployment, write_orgs):
    spec = _spec(federation, rounds=3)
    configs = write_orgs(federation, tmp_path)
    result_path = str(tmp_path / "result.bin")
    with quick_deployment(tmp_path, configs) as dep:
        app = write_app(str(tmp_path / "app"), spec, result_path=result_path)
        dep.run(app, timeout=240, run_config="rounds=1 run-id='short'")
    assert os.path.exists(result_path), open(tmp_path / "flwr-run.log", errors="replace").read()[-3000:]
    result = read_result(result_path)
    assert len(result["history"]) == 1 and result["run_id"] == "short"
    import sqlite3

    for config in configs:
        with sqlite3.connect(config["ledger-path"]) as conn:
            assert conn.execute("SELECT DISTINCT run_id FROM charges").fetchall() == [("short",)]
