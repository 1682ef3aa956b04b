"""On Flower's ClientApp, as in process (``privfl.runtime.local_step``): a private client whose local step raises on
its records releases the data-independent fallback, charged, instead of the error reply its ``_guarded`` handler
would send uncharged (D1); a client-level client without records releases exact zeros without a local step (D2)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Context, Message, RecordDict  # noqa: E402

from privfl.algorithms.dp_fedavg import DPFedAvg  # noqa: E402
from privfl.core.config import FederationConfig, PrivacyConfig  # noqa: E402
from privfl.core.release import LocalStepFailed  # noqa: E402
from privfl.data import federated_from_arrays, load_digits  # noqa: E402
from privfl.flower import app as flower_app  # noqa: E402
from privfl.flower.app import BROADCAST, REPLY, SPEC_KEY, RunSpec, client_train, decode_release  # noqa: E402
from privfl.flower.records import from_record, to_record  # noqa: E402


@pytest.fixture
def identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_task_id", "_run_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


@pytest.fixture
def tripwire(monkeypatch):
    """DP-FedAvg's local step raises on a record beyond 1e30 (a stand-in for an overflow one record causes)."""
    original = DPFedAvg.client_update

    def client_update(self, client, dataset, round, rng):
        if np.abs(np.asarray(dataset.x)).max(initial=0.0) > 1e30:
            raise FloatingPointError("a record overflowed the local step")
        return original(self, client, dataset, round, rng)

    monkeypatch.setattr(DPFedAvg, "client_update", client_update)


def _spec(digits, algorithm="dp_fedavg"):
    parts = [digits.subset(np.arange(k * 60, (k + 1) * 60)) for k in range(2)]
    federation = federated_from_arrays(parts, digits.subset(np.arange(200, 260)), name="digits2")
    fed = FederationConfig(rounds=2, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=4, client_size=60)
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="central",
                            secure_noise=False)
    return RunSpec.of(algorithm, federation, fed, privacy, run_id="fallback")


def _train(tmp_path, spec, x, y, tag):
    """Round 0 of partition 1 holding (x, y), through the guarded ClientApp handler: (reply, LocalStepFailed
    warnings)."""
    data = tmp_path / f"{tag}.npz"
    np.savez(data, x=x, y=y)
    node = {"partition-id": 1, "data-path": str(data), "ledger-path": str(tmp_path / f"{tag}.sqlite")}
    context = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={SPEC_KEY: spec.to_json()})
    alg = flower_app._setup(spec)
    broadcast = {"round": 0, "noise_multipliers": flower_app._run_plan(alg, spec).noise_multipliers,
                 "values": dict(alg.broadcast(0).values)}
    msg = Message(to_record(broadcast, BROADCAST), dst_node_id=1, message_type="train")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reply = flower_app._guarded(client_train)(msg, context)
    return reply, [w for w in caught if issubclass(w.category, LocalStepFailed)]


def _releases(reply):
    assert not reply.has_error(), reply.error.reason
    content = from_record(reply.content, REPLY)
    return content, [decode_release(d) for d in content["releases"]]


def test_a_local_step_that_raises_on_a_record_releases_the_fallback(tmp_path, identity, tripwire):
    digits = load_digits(flatten=True)
    spec = _spec(digits)
    x, y = digits.x[60:120], digits.y[60:120]
    prime, prime_failures = _train(tmp_path, spec, x, y, "prime")
    full, failures = _train(tmp_path, spec, np.concatenate([x, np.full((1, x.shape[1]), 1e35, x.dtype)]),
                            np.concatenate([y, y[:1]]), "full")
    (pc, pr), (fc, fr) = _releases(prime), _releases(full)
    assert not prime_failures and failures and "FloatingPointError" in str(failures[0].message)
    assert [r.header.to_dict() for r in fr] == [r.header.to_dict() for r in pr]  # weight, noise, ledger row
    assert fc["audit"] == pc["audit"] and fc["sat_out"] is pc["sat_out"] is False
    assert all(not r.value.any() for r in fr) and all(r.value.any() for r in pr)


@pytest.mark.parametrize("algorithm", ["dp_fedavg", "hbfl"])
def test_a_client_level_client_without_records_releases_zeros(tmp_path, identity, algorithm):
    """HBFL's empty client uploaded a norm-C change; now zeros, as the charged sensitivity assumes."""
    digits = load_digits(flatten=True)
    spec = _spec(digits, algorithm)
    x, y = digits.x[60:120], digits.y[60:120]
    with_data, _ = _train(tmp_path, spec, x, y, "with")
    removed, failures = _train(tmp_path, spec, x[:0], y[:0], "removed")
    (wc, wr), (rc, rr) = _releases(with_data), _releases(removed)
    assert not failures
    assert [r.header.to_dict() for r in rr] == [r.header.to_dict() for r in wr]
    assert rc["audit"] == wc["audit"]
    assert all(not r.value.any() for r in rr) and all(r.value.any() for r in wr)
