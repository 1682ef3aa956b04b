"""Secure aggregation against an active server on a real Flower deployment (issue 26): a flower-superlink and three
flower-supernode OS processes on loopback, each SuperNode holding its own Ed25519 identity key and the federation
file (the organisations' public keys and the agreed threat model), both in its node config, out of band.

- With dropouts: a SuperNode killed after sharing its keys is recovered from the survivors' signed shares; the
  survivors' ledgers mark exactly what they sent.
- An active ServerApp (its own code altered: it substitutes the X25519 keys of one organisation in the key
  directories it forwards, the attack that recovers any input from the semi-honest variant) learns nothing: every
  other organisation refuses the forged bundle, no masked input leaves any SuperNode (no ledger row is marked
  released), and the round aborts with the global model unchanged.
- A run config that asks for a weaker threat model than the federation file, or for the semi-honest variant from
  SuperNodes that hold keys, is refused by every SuperNode before anything is charged.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3

import numpy as np
import pytest

pytest.importorskip("flwr")

from privfl.core.config import FederationConfig, PrivacyConfig  # noqa: E402
from privfl.flower.app import RunSpec, read_result, write_app  # noqa: E402
from privfl.flower.identity import FEDERATION_KEY, IDENTITY_KEY, make_identities  # noqa: E402
from privfl.flower.warm import TRUSTED_MODULES_KEY  # noqa: E402
from privfl.privacy.secure import SecureAggregation  # noqa: E402

N_CLIENTS = 3
RUN_TIMEOUT = 240
SECURE = SecureAggregation(bits=48, malicious=True, dropout=0.34)

#: The adversary's ServerApp: privfl's own, with one change in its process: every key directory it forwards carries
#: fresh X25519 keys of the server's in place of organisation 0's (protocol id 1), under organisation 0's tags.
#: Shipped as a module of the app (write_app(modules=...)), which the SuperNodes here list as trusted by its SHA-256
#: (node config trusted-modules): a SuperNode that holds a federation file runs only privfl's own app
#: (privfl.flower.warm.check_fab), so a real active server alters its own privfl instead; the change is in the
#: ServerApp's process either way, and the module patches server code only.
ACTIVE_SERVER_APP = '''"""An active server: privfl's ServerApp substituting organisation 0's keys (a test of issue 26)."""

import dataclasses

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from privfl.flower import app as _privfl
from privfl.secure_agg import server as _server

_honest = _server.ServerSession.key_directories


def _fresh():
    return X25519PrivateKey.generate().public_key().public_bytes(serialization.Encoding.Raw,
                                                                 serialization.PublicFormat.Raw)


def _substituted(self):
    out = {}
    for client, directory in _honest(self).items():
        keys = tuple(dataclasses.replace(k, encryption_key=_fresh(), mask_key=_fresh()) if k.client_id == 1 else k
                     for k in directory.keys)
        out[client] = dataclasses.replace(directory, keys=keys)
    return out


_server.ServerSession.key_directories = _substituted
'''


def _rows(path, run_id):
    """(round, channel, released) of every charge of ``run_id`` in a SuperNode's ledger ([] if it holds none)."""
    if not os.path.exists(path):
        return []
    with sqlite3.connect(path) as conn:
        if not conn.execute("SELECT name FROM sqlite_master WHERE name='charges'").fetchone():
            return []
        return sorted(conn.execute("SELECT round, channel, released FROM charges WHERE run_id=?", (run_id,)))


def _logs(folder) -> str:
    """Every log the deployment's processes wrote under ``folder``."""
    return "".join(p.read_text(errors="replace") for p in sorted(folder.glob("*.log")))


def _configs(federation, tmp_path, write_orgs, secure=SECURE):
    configs = write_orgs(federation, tmp_path)
    # the privacy terms the file pins: _spec's (local noise, seeded to compare runs; epsilon 8, one run's worth)
    keys, federation_file, public = make_identities(str(tmp_path / "identities"), N_CLIENTS, secure,
                                                    placement="local", secure_noise=False, epsilon=8.0, delta=1e-5,
                                                    epsilon_total=8.0, delta_total=1e-5)
    for config, key in zip(configs, keys):
        config.update({IDENTITY_KEY: key, FEDERATION_KEY: federation_file})
    return configs, public


def _spec(federation, public, run_id, secure=SECURE, placement="local"):
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=5)
    privacy = PrivacyConfig(epsilon=8.0, delta=1e-5, unit="client", clip=0.5, placement=placement,
                            secure_noise=False)
    return RunSpec.of("dp_fedavg", federation, fed, privacy, run_id=run_id, node_wait=60, round_timeout=60,
                      secure=secure, identities=public)


@pytest.mark.slow  # make test-all (CI time): the same through the apps in process: test_loopback.py
@pytest.mark.timeout(400)
def test_the_malicious_variant_runs_with_a_supernode_killed_after_sharing_keys(
        federation, tmp_path, quick_deployment, write_orgs, run_killing_after_share_keys):
    configs, public = _configs(federation, tmp_path, write_orgs)
    spec = _spec(federation, public, "malicious-kill")
    victim = 2
    with quick_deployment(tmp_path, configs) as dep:
        result_path = run_killing_after_share_keys(dep, spec, tmp_path, victim, RUN_TIMEOUT)
    result = read_result(result_path)
    (round0,) = result["history"]
    assert (round0["participants"], round0["aborted"]) == (N_CLIENTS - 1, False)
    assert np.all(np.isfinite(result["state"]["global_params"]))
    # the ServerApp logs each round to Flower's log stream, which flwr run --stream shows
    assert "privfl malicious-kill round 1/1: 2 participants" in (tmp_path / "flwr-run.log").read_text(errors="replace")
    assert _rows(configs[victim]["ledger-path"], spec.run_id) == [(0, "update", 0)]  # charged, never sent
    for k in range(N_CLIENTS):
        if k != victim:
            assert _rows(configs[k]["ledger-path"], spec.run_id) == [(0, "update", 1)]


@pytest.mark.timeout(600)
def test_an_active_server_learns_nothing_and_weaker_runs_are_refused(federation, tmp_path, quick_deployment,
                                                                     write_orgs, deploy):
    """On one deployment (its start shared; CI time): an active ServerApp substituting organisation 0's keys learns
    nothing, then a run weaker than the federation file and a semi-honest one are each refused by every SuperNode
    before anything is charged."""
    configs, public = _configs(federation, tmp_path, write_orgs)
    spec = _spec(federation, public, "malicious-substitution")
    weaker = _spec(federation, public, "weaker", secure=SecureAggregation(bits=48, malicious=True, dropout=0.0))
    semi_honest = _spec(federation, public, "semi", secure=SecureAggregation(bits=48, malicious=False))
    result_path = str(tmp_path / "result.bin")
    attack = tmp_path / "active_server.py"
    attack.write_text(ACTIVE_SERVER_APP)
    for config in configs:
        config[TRUSTED_MODULES_KEY] = hashlib.sha256(attack.read_bytes()).hexdigest()
    with quick_deployment(tmp_path, configs) as dep:
        app = write_app(str(tmp_path / "app"), spec, result_path=result_path, modules=[str(attack)])
        dep.run(app, timeout=RUN_TIMEOUT)
        substitution_logs = _logs(tmp_path)
        for refused in (weaker, semi_honest):
            refused_app = write_app(str(tmp_path / f"app-{refused.run_id}"), refused,
                                    result_path=str(tmp_path / f"{refused.run_id}.bin"))
            dep.run(refused_app, timeout=RUN_TIMEOUT)
            out = tmp_path / f"{refused.run_id}.bin"
            if out.exists():  # every SuperNode refused: each round aborted with nobody in it
                assert [(h["participants"], h["aborted"]) for h in read_result(str(out))["history"]] == [(0, True)]
            for config in configs:  # refused before anything was charged
                assert _rows(config["ledger-path"], refused.run_id) == []
    # the active server
    assert os.path.exists(result_path), open(tmp_path / "flwr-run.log", errors="replace").read()[-4000:]
    result = read_result(result_path)
    (round0,) = result["history"]
    assert round0["aborted"] and round0["participants"] == 0
    # no masked input left any organisation: every charge is unmarked
    for config in configs:
        assert _rows(config["ledger-path"], spec.run_id) == [(0, "update", 0)]
    # every organisation shown the forged bundle refused it (its reason in its own log; the server got a code)
    assert (substitution_logs.count("failed [protocol]") >= N_CLIENTS - 1
            and "key substitution" in substitution_logs), substitution_logs[-3000:]
    from privfl.flower import app as flower_app

    initial = flower_app._setup(spec).broadcast(0).values["global_params"]
    np.testing.assert_array_equal(result["state"]["global_params"], initial)  # the aborted round changed nothing
    # the weaker and the semi-honest runs: each SuperNode refused each, saying why in its own log
    logs = _logs(tmp_path)  # (the substitution run's refusals are "[protocol]" ones)
    assert logs.count("failed [deployment]") >= 2 * N_CLIENTS, logs[-3000:]
    assert "federation file agreed" in logs and "refused" in logs
