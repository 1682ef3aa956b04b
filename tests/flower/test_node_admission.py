"""A SuperNode that trusts no server admits each run id once, for the ledger runs it charges, and never takes its
ledger path from the server's run config (a review, session 26). Both broke the node's total budget, the federation
file's ``epsilon_total``, without any flaw in secure aggregation: a run id admitted for one-phase FedBNR came back as
two-phase FedBNR and charged two fresh ledger runs under the one admission (epsilon 6 against a total of 3); and a
node started without ``ledger-path`` took the run config's template, so each launch named a fresh ledger and node
budget (four launches: epsilon 12 against 3). The ClientApp's train handler is driven with hand-built messages."""

from __future__ import annotations

import os

import numpy as np
import pytest

from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays, load_diabetes
from privfl.flower.identity import make_identities
from privfl.privacy.secure import SecureAggregation

pytest.importorskip("flwr")

from flwr.app import Context, Message, RecordDict  # noqa: E402

from privfl.flower import app as A  # noqa: E402
from privfl.flower.records import from_record, to_record  # noqa: E402
from privfl.privacy import secure as S  # noqa: E402
from privfl.secure_agg import SessionConfig  # noqa: E402

N, SEC = 3, SecureAggregation(malicious=True, bits=48)


@pytest.fixture(autouse=True)
def identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_task_id", "_run_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


@pytest.fixture
def org(tmp_path):
    keys, fed_file, ids = make_identities(str(tmp_path / "ids"), N, SEC, placement="local", unit="example",
                                          epsilon=3.0, delta=1e-5, epsilon_total=3.0, delta_total=1e-5)
    d = load_diabetes()
    idx = np.random.default_rng(0).permutation(len(d))
    parts = [d.subset(idx[k * 40:(k + 1) * 40]) for k in range(N)]
    fs = federated_from_arrays(parts, d.subset(idx[300:360]), name="diabetes3", design_size=40)
    for k in range(N):
        np.savez(tmp_path / f"d{k}.npz", x=parts[k].x, y=parts[k].y)
    fed = FederationConfig(rounds=1, local_epochs=1, lr=0.05, hidden=(4,), seed=5)
    priv = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=1.0, placement="local")

    def spec(run_id, kernel_rounds):
        opts = {"num_samples": 10, **({"kernel_rounds": kernel_rounds} if kernel_rounds else {})}
        return A.RunSpec.of("fedbnr", fs, fed, priv, run_id=run_id, secure=SEC, identities=ids, options=opts)
    return str(tmp_path), keys, fed_file, spec


def node(work, k, spec, keys, fed_file, drop=()):
    cfg = {"partition-id": k, "data-path": os.path.join(work, f"d{k}.npz"),
           "ledger-path": os.path.join(work, f"l{k}.sqlite"), "identity-key": keys[k], "federation": fed_file}
    for key in drop:
        cfg.pop(key, None)
    return Context(run_id=1, node_id=k + 1, state=RecordDict(), run_config={A.SPEC_KEY: spec.to_json()},
                   node_config=cfg)


def train(ctx, run_spec, rnd, k, phase_info=None):
    """One train message for round ``rnd`` (of the phase ``phase_info``): the client's decoded reply, or the
    exception its handler raised."""
    spec, alg, _ = A._party(run_spec, phase_info)
    plan = A._run_plan(alg, spec)
    encodings = A._encodings(plan, spec)
    session = SessionConfig.create([c + 1 for c in range(spec.n_clients)], bits=run_spec.secure.bits,
                                   dimension=sum(e.size for e in encodings.values()),
                                   min_inputs=S.round_min_inputs(encodings), malicious=True)
    body = {"round": rnd, "noise_multipliers": plan.noise_multipliers, "values": dict(alg.broadcast(rnd).values),
            "secagg": session.to_dict()}
    if phase_info is not None:
        body["phase"] = phase_info
    try:
        out = A.client_train(Message(to_record(body, A.BROADCAST), dst_node_id=k + 1, message_type="train"), ctx)
        return from_record(out.content, A.REPLY)
    except Exception as exc:  # noqa: BLE001
        return exc


KERNEL = {"name": "kernel", "index": 0, "handed_over": []}


def test_a_run_id_admitted_for_one_phase_is_refused_as_two_phases(org):
    work, keys, fed_file, spec = org
    plain = spec("R", 0)
    assert "advertise" in train(node(work, 0, plain, keys, fed_file), plain, 0, 0)
    phased = spec("R", 1)
    out = train(node(work, 0, phased, keys, fed_file), phased, 0, 0, KERNEL)
    assert isinstance(out, A.DeploymentError) and "ledger runs" in str(out), out


def test_a_run_id_admitted_for_two_phases_is_refused_as_one(org):
    work, keys, fed_file, spec = org
    phased = spec("R", 1)
    assert "advertise" in train(node(work, 0, phased, keys, fed_file), phased, 0, 0, KERNEL)
    plain = spec("R", 0)
    out = train(node(work, 0, plain, keys, fed_file), plain, 0, 0)
    assert isinstance(out, A.DeploymentError) and "ledger runs" in str(out), out


def test_a_new_run_id_naming_an_admitted_runs_phase_ledger_is_refused(org):
    work, keys, fed_file, spec = org
    phased = spec("R", 1)
    assert "advertise" in train(node(work, 0, phased, keys, fed_file), phased, 0, 0, KERNEL)
    from privfl.runtime.phase_ledgers import phase_run_id

    clash = spec(phase_run_id("R", "regression"), 0)  # a one-phase run whose ledger run is R's second phase's
    out = train(node(work, 0, clash, keys, fed_file), clash, 0, 0)
    assert isinstance(out, A.DeploymentError) and "which a run admitted before" in str(out), out


def test_a_node_that_trusts_no_server_never_takes_its_ledger_path_from_the_run_config(org):
    work, keys, fed_file, spec = org
    plain = spec("R", 0)
    ctx = node(work, 0, plain, keys, fed_file, drop=("ledger-path",))
    ctx.run_config[A.TEMPLATE_KEYS[A.LEDGER_KEY]] = os.path.join(work, "server-{partition-id}.sqlite")
    out = train(ctx, plain, 0, 0)
    assert isinstance(out, A.ConfigurationError) and "ledger-path" in str(out), out
    assert not os.path.exists(os.path.join(work, "server-0.sqlite"))
