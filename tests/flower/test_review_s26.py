"""Session 26's review of the Flower ClientApp: each test plays the server against the real ClientApp handlers
(``client_identify``, ``client_train``, ``client_secagg``) with the messages it would forge, on neighbouring data sets
D and D', and checks that what the server sees does not tell them apart (or is charged).

1. The alignment set's path came from the run config (the server's side): naming the organisation's own data file
   made a ``query`` an uncharged oracle (its digest, or an empty file's refusal) and FedBNN release a value of shape
   (record count, classes). A SuperNode now reads its own copy (node config ``alignment-path``) and the spec carries
   only the digest, which must be there and match.
2. One record (a feature of 1e39, a label outside the spec's classes) turned a charged release into an uncharged
   error reply. Such records are now left out one by one, with a local warning.
3. A Flower Datasets source with no record (a header-only CSV: the organisation's data removed) failed where an empty
   .npz releases the removed client's zeros; it is now an empty data set of the run's input shape.
4. Under secure aggregation a round is served again until its masked input leaves, and each replay trained again
   from the state the last one kept; the new state now waits with the round's session and is kept only when the
   masked input is marked released.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sqlite3
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Context, Message, RecordDict  # noqa: E402

import privfl  # noqa: E402
from privfl.core.config import FederationConfig, PrivacyConfig  # noqa: E402
from privfl.data import federated_from_arrays, load_digits  # noqa: E402
from privfl.flower import app as A  # noqa: E402
from privfl.flower.records import from_bytes, from_record, to_record  # noqa: E402


@pytest.fixture(autouse=True)
def identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_task_id", "_run_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


DIGITS = load_digits(flatten=True)
FED = FederationConfig(rounds=2, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=4, client_size=60)
TERMS = dict(epsilon=4.0, delta=1e-5, epsilon_total=8.0, delta_total=1e-4, placement="distributed")


def federation_of():
    parts = [DIGITS.subset(np.arange(k * 60, (k + 1) * 60)) for k in range(2)]
    return federated_from_arrays(parts, DIGITS.subset(np.arange(200, 260)), name="digits2")


def spec_of(algorithm="dp_fedavg", privacy=None, fed=FED, run_id="r", **kw):
    privacy = privacy or PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="local")
    return A.RunSpec.of(algorithm, federation_of(), fed, privacy, run_id=run_id, **kw)


def write(path, x, y):
    np.savez(path, x=x, y=y)
    return str(path)


def add_remove(tmp_path, n=60):
    """D: 60 digits; D': D plus the next one (add/remove neighbours)."""
    return {"D": write(tmp_path / "d0.npz", DIGITS.x[:n], DIGITS.y[:n]),
            "D'": write(tmp_path / "d1.npz", DIGITS.x[:n + 1], DIGITS.y[:n + 1])}


def context(spec_json, data, ledger, node=None):
    config = {"partition-id": 1, "data-path": str(data), "ledger-path": str(ledger), **(node or {})}
    return Context(run_id=1, node_id=1, node_config=config, state=RecordDict(), run_config={A.SPEC_KEY: spec_json})


def broadcast(spec, rnd=0, extra=None):
    alg = A._setup(spec)
    body = {"round": rnd, "noise_multipliers": A._run_plan(alg, spec).noise_multipliers,
            "values": dict(alg.broadcast(rnd).values), **(extra or {})}
    return Message(to_record(body, A.BROADCAST), dst_node_id=1, message_type="train")


def session_config(spec):
    from privfl.privacy.secure import round_min_inputs
    from privfl.secure_agg import SessionConfig

    encodings = A._encodings(A._run_plan(A._setup(spec), spec), spec)
    return SessionConfig.create([A._session_id(str(k)) for k in range(spec.n_clients)], bits=spec.secure.bits,
                                dimension=sum(e.size for e in encodings.values()),
                                min_inputs=round_min_inputs(encodings), malicious=bool(spec.secure.malicious),
                                dropout=spec.secure.dropout, corruption=spec.secure.corruption)


def secure_broadcast(spec, rnd=0):
    return broadcast(spec, rnd, {"secagg": session_config(spec).to_dict()})


def reply(handler, msg, ctx, kind=A.REPLY):
    """What the server sees: ("error", code), or the decoded reply."""
    out = A._guarded(handler)(msg, ctx)
    if out.has_error():
        return ("error", out.error.code)
    return from_record(out.content, kind)


def rows(ledger) -> int:
    if not os.path.exists(ledger):
        return 0
    with sqlite3.connect(ledger) as conn:
        if not conn.execute("SELECT name FROM sqlite_master WHERE name='charges'").fetchone():
            return 0
        return conn.execute("SELECT COUNT(*) FROM charges").fetchone()[0]


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def federation_node(tmp_path, n_clients=2, **terms):
    from privfl.flower.identity import FEDERATION_KEY, IDENTITY_KEY, make_identities
    from privfl.privacy.secure import SecureAggregation

    keys, federation, public = make_identities(str(tmp_path / "ids"), n_clients, SecureAggregation(malicious=True),
                                               **{**TERMS, **terms})
    return {IDENTITY_KEY: keys[1], FEDERATION_KEY: federation}, public, keys, federation


# -- 1. the alignment set is the node's own file; the spec carries its digest only ------------------------------------

def forged(spec, path, digest):
    d = json.loads(spec.to_json())
    d["alignment_path"], d["alignment_digest"] = path, digest
    return json.dumps(d, sort_keys=True)


def query():
    return Message(to_record({"round": -1}, A.IDENTIFY), dst_node_id=1, message_type="query")


def test_a_run_config_naming_the_nodes_data_file_as_alignment_set_answers_alike_on_neighbours(tmp_path):
    """The review's oracle (s26b r1), on a node with an identity key and a federation file: the server names the
    organisation's data file with D's digest. The old query answered on D and refused on D' (nothing charged,
    repeatable); with the digest left out it answered on D and refused on an emptied file (client level's removed
    organisation). Now the query reads no file and answers alike, and a train message is refused alike (this node
    has data-path but no alignment-path), nothing charged."""
    from privfl.privacy.secure import SecureAggregation

    paths = add_remove(tmp_path)
    paths["removed"] = write(tmp_path / "empty.npz", DIGITS.x[:0], DIGITS.y[:0])
    node, public, _, _ = federation_node(tmp_path)
    agreed = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="distributed")
    honest = spec_of(privacy=agreed, secure=SecureAggregation(malicious=True), identities=public, run_id="agreed")
    for name, spec_json in (("digest of D", forged(honest, paths["D"], sha256(paths["D"]))),
                            ("no digest", forged(honest, paths["D"], ""))):
        answers = {}
        for data_name, data in paths.items():
            ledger = tmp_path / f"{len(answers)}-{name[:2]}.sqlite"
            ctx = context(forged(honest, data, json.loads(spec_json)["alignment_digest"]), data, ledger, node)
            answers[data_name] = (reply(A.client_identify, query(), ctx, kind=A.IDENTIFY),
                                  reply(A.client_train, secure_broadcast(honest), ctx))
            assert rows(ledger) == 0, (name, data_name)
        assert len({repr(a) for a in answers.values()}) == 1, (name, answers)
        asked, train = answers["D"]
        assert train == ("error", A.CLIENT_ERROR_CODES["configuration"])
        if name == "digest of D":
            assert asked == {"client_id": "1", "round": -1, "released": []}
        else:  # a spec with a path and no digest is refused before anything reads the path
            assert asked == ("error", A.CLIENT_ERROR_CODES["configuration"])


FEDBNN_FED = FederationConfig(rounds=2, local_epochs=1, batch_size=32, lr=0.1, hidden=(8,), seed=4, client_size=60)
FEDBNN_OPTIONS = {"warmup_epochs": 1, "prior_steps": 1, "alignment_size": 100000}


def test_fedbnn_reads_the_nodes_own_alignment_file_never_the_path_the_server_names(tmp_path, caplog):
    """FedBNN (s26b r2): the server named the organisation's data file as the "public" alignment set, and the
    client released its probabilities on the records, a value of shape (n_k, 10) (60 on D, 61 on D'). Now the client
    reads the file at its node config's alignment-path, checked against the spec's digest: whatever path the server
    writes (here the data file), the release has the public set's shape on both neighbours; a node file of another
    digest, or a node without alignment-path, is refused alike on both, nothing charged."""
    public = tmp_path / "public_align.npz"
    np.savez(public, x=DIGITS.x[1000:1012])
    own_copy = tmp_path / "node" / "alignment.npz"
    own_copy.parent.mkdir()
    np.savez(own_copy, x=DIGITS.x[1000:1012])
    assert sha256(own_copy) == sha256(public)
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="example", clip=0.5, placement="local", secure_noise=False)
    spec = spec_of("fedbnn", privacy=privacy, fed=FEDBNN_FED, run_id="bnn", alignment_path=str(public),
                   options=FEDBNN_OPTIONS)
    paths = add_remove(tmp_path)
    other = tmp_path / "other.npz"
    np.savez(other, x=DIGITS.x[1100:1112])
    cases = {"own copy": {"alignment-path": str(own_copy)}, "another file": {"alignment-path": str(other)},
             "none": {}}
    for case, node in cases.items():
        shapes = {}
        for name, data in paths.items():
            spec_json = forged(spec, data, spec.alignment_digest)  # the spec's path: the organisation's data file
            ledger = tmp_path / f"{case[:3]}{len(name)}.sqlite"
            out = reply(A.client_train, broadcast(spec), context(spec_json, data, ledger, node))
            if case == "own copy":
                (release,) = out["releases"]
                shapes[name] = (release["channel"], np.shape(release["value"]))
                assert rows(ledger) == 1
            else:
                shapes[name] = out
                assert rows(ledger) == 0
        if case == "own copy":
            assert shapes == {"D": ("alignment_probs", (12, 10)), "D'": ("alignment_probs", (12, 10))}
        else:
            assert set(shapes.values()) == {("error", A.CLIENT_ERROR_CODES["configuration"])}, (case, shapes)


def test_the_simulation_engines_virtual_nodes_take_the_specs_alignment_path(tmp_path):
    """A node without data-path in its node config takes its data path from the run config (the Simulation
    Engine's virtual SuperNodes): it trusts the run config's files, the alignment set's too."""
    public = tmp_path / "public_align.npz"
    np.savez(public, x=DIGITS.x[1000:1012])
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="example", clip=0.5, placement="local", secure_noise=False)
    spec = spec_of("fedbnn", privacy=privacy, fed=FEDBNN_FED, run_id="bnn-sim", alignment_path=str(public),
                   options=FEDBNN_OPTIONS)
    data = add_remove(tmp_path)["D"]
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 1}, state=RecordDict(),
                  run_config={A.SPEC_KEY: spec.to_json(), A.TEMPLATE_KEYS[A.DATA_KEY]: data,
                              A.TEMPLATE_KEYS[A.LEDGER_KEY]: str(tmp_path / "sim.sqlite")})
    (release,) = reply(A.client_train, broadcast(spec), ctx)["releases"]
    assert np.shape(release["value"]) == (12, 10)


# -- 2. a record the run cannot use is left out, never an error reply ------------------------------------------------

def test_one_unusable_record_leaves_the_release_of_its_neighbour_unchanged(tmp_path, caplog):
    """s26c f3: record level, seeded noise. D' = D plus one record with a feature of 1e39 (finite in float64, inf in
    float32), a label of 10, or a label of -1: the old ClientApp answered D with a charged release and D' with an
    uncharged error (kind "data"), as often as asked. Now the record is left out (a per-record filter: neighbours
    stay neighbours) and D' gets D's very release, bit for bit, charged once; the organisation's log says a record was
    left out, and shows no value."""
    fed = FederationConfig(rounds=2, local_epochs=1, batch_size=16, lr=0.1, hidden=(), seed=4, client_size=60)
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="example", clip=1.0, secure_noise=False)
    spec = spec_of("dpsgd_fedavg", privacy=privacy, fed=fed, run_id="validation")
    x, y = DIGITS.x[60:120].astype(np.float64), DIGITS.y[60:120]
    big = np.zeros((1, x.shape[1]))
    big[0, 5] = 1e39
    variants = {"D": (x, y), "feature 1e39": (np.concatenate([x, big]), np.concatenate([y, y[:1]])),
                "label 10": (np.concatenate([x, x[:1]]), np.concatenate([y, [10]])),
                "label -1": (np.concatenate([x, x[:1]]), np.concatenate([y, [-1]]))}
    answers = {}
    for name, (xs, ys) in variants.items():
        data = write(tmp_path / f"{len(answers)}.npz", xs, ys)
        ledger = tmp_path / f"{len(answers)}.sqlite"
        with caplog.at_level(logging.WARNING, logger="privfl.data"):
            answers[name] = reply(A.client_train, broadcast(spec), context(spec.to_json(), data, ledger))
        assert not isinstance(answers[name], tuple), (name, answers[name])
        assert rows(ledger) == 1
    reference = answers.pop("D")
    for name, out in answers.items():
        assert [r["release_id"].split("/", 1)[1] for r in out["releases"]] == [
            r["release_id"].split("/", 1)[1] for r in reference["releases"]]
        for got, expected in zip(out["releases"], reference["releases"]):
            assert np.array_equal(got["value"], expected["value"]), name
        assert out["audit"] == reference["audit"]
    logged = [r.getMessage() for r in caplog.records if r.name == "privfl.data"]
    assert len(logged) == 3 and all("1 record(s) left out" in m for m in logged)
    assert not any("1e+39" in m or "1e39" in m for m in logged)


def test_a_label_domain_the_server_narrows_answers_alike_under_a_federation_file(tmp_path):
    """s26b r3: the strongest setting (identity key, federation file, secure aggregation), the server's spec lowers
    num_classes to 9; D holds no 9, D' one more record, a 9. The old ClientApp advertised on D and refused D' (error
    "data", nothing charged, the admitted run id reusable for probe after probe). Now both advertise and charge."""
    from privfl.privacy.secure import SecureAggregation

    base = np.where(DIGITS.y != 9)[0][:60]
    nine = np.where(DIGITS.y == 9)[0][0]
    paths = {"D": write(tmp_path / "d.npz", DIGITS.x[base], DIGITS.y[base]),
             "D'": write(tmp_path / "d1.npz", DIGITS.x[np.r_[base, nine]], DIGITS.y[np.r_[base, nine]])}
    node, public, _, _ = federation_node(tmp_path)
    agreed = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="distributed")
    honest = spec_of(privacy=agreed, secure=SecureAggregation(malicious=True), identities=public, run_id="probe")
    narrowed = dataclasses.replace(honest, num_classes=9)
    for name, data in paths.items():
        ledger = tmp_path / f"{len(name)}.sqlite"
        for _ in range(2):  # a second probe under the admitted run id answers alike too
            out = reply(A.client_train, secure_broadcast(narrowed), context(narrowed.to_json(), data, ledger, node))
            assert isinstance(out, dict) and out["advertise"] and not out["sat_out"], (name, out)
        assert rows(ledger) == 1


# -- 3. a Flower Datasets source with no record is the removed organisation ----------------------------------------

def test_a_removed_organisation_behind_a_flower_datasets_source_releases_what_an_empty_npz_releases(tmp_path,
                                                                                                  monkeypatch):
    """s26c f1: client level, central noise. D: organisation 1's 60 records in a CSV; D': its data removed, a
    header-only CSV (README: an organisation's data is the whole split). The old ClientApp released on D and replied
    error 4100 on D'; an empty .npz released the removed client's zeros. Now the CSV does too: the same reply."""
    pytest.importorskip("flwr_datasets")
    pd = pytest.importorskip("pandas")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="central",
                            secure_noise=False)
    spec = spec_of(privacy=privacy, run_id="empty-flwr-ds")
    columns = [f"f{i}" for i in range(DIGITS.x.shape[1])]

    def csv(x, y, tag):
        frame = pd.DataFrame(x, columns=columns)
        frame["label"] = y
        path = tmp_path / f"{tag}.csv"
        frame.to_csv(path, index=False)
        return f"flwr-datasets:csv?data_files={path}&y=label"

    x, y = DIGITS.x[60:120], DIGITS.y[60:120]
    sources = {"D (csv)": csv(x, y, "with"), "D' (csv, removed)": csv(x[:0], y[:0], "removed"),
               "D' (npz, removed)": write(tmp_path / "removed.npz", x[:0], y[:0])}
    answers = {}
    for name, source in sources.items():
        ledger = tmp_path / f"{len(answers)}.sqlite"
        answers[name] = reply(A.client_train, broadcast(spec), context(spec.to_json(), source, ledger))
        assert not isinstance(answers[name], tuple), (name, answers[name])
        assert rows(ledger) == 1
    csv_removed, npz_removed = answers["D' (csv, removed)"], answers["D' (npz, removed)"]
    assert csv_removed["audit"] == npz_removed["audit"] == answers["D (csv)"]["audit"]
    for got, expected in zip(csv_removed["releases"], npz_removed["releases"], strict=True):
        assert np.array_equal(got["value"], expected["value"]) and got["weight"] == expected["weight"]


# -- 4. a replayed secure round does not compound training in the kept state ---------------------------------------

@dataclass(frozen=True)
class Personal(privfl.Algorithm):
    """Each client goes on from its own model (its kept state) and uploads its change from the global model; the
    state counts the trainings it carries."""

    def init(self, params):
        return {"params": params}

    def client_step(self, broadcast, data, state, rng):
        start = state["local"] if state else broadcast["params"]
        trained = data.train(start)
        steps = (state["steps"] if state else np.zeros(1)) + 1
        return {"update": trained - broadcast["params"]}, {"local": trained, "steps": steps}

    def server_step(self, server, means):
        return {"params": server["params"] + means["update"]}


@pytest.fixture
def personal():
    """``Personal`` registered for the test only (a registration left behind changes every later test's registry)."""
    from privfl.privacy.wrapper import unregister_algorithm

    privfl.register_algorithm("personal_review_s26")(Personal)
    try:
        yield
    finally:
        unregister_algorithm("personal_review_s26")


def personal_spec(public, run_id="personal"):
    from privfl.privacy.secure import SecureAggregation

    fed = FederationConfig(rounds=2, local_epochs=1, batch_size=16, lr=0.1, hidden=(), seed=4, client_size=60)
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="example", clip=0.5, placement="local")
    return spec_of("personal_review_s26", privacy=privacy, fed=fed, run_id=run_id,
                   secure=SecureAggregation(malicious=True), identities=public, options={"update_bound": 0.5})


def test_a_replayed_secure_round_keeps_no_state_until_its_masked_input_leaves(tmp_path, personal):
    """s26b r5: 5 train messages for round 0 in one Flower run (one Context): the old ClientApp trained 5 times,
    each from the state the last kept (5 DP-SGD trainings in the state, real epsilon 5.88 against the ledger's one
    row, 3.09, and the file's cap 4). Now no state is kept before the masked input leaves, and each replay trains
    once from the state kept before the round: the state waiting with the session carries one training."""
    node, public, _, _ = federation_node(tmp_path, placement="local", unit="example")
    spec = personal_spec(public)
    data = add_remove(tmp_path)["D"]
    ledger = tmp_path / "l.sqlite"
    ctx = context(spec.to_json(), data, ledger, node)
    alg = A._setup(spec)
    half = alg.client_half(alg.public, np.random.default_rng(0))
    for _ in range(5):
        out = reply(A.client_train, secure_broadcast(spec), ctx)
        assert isinstance(out, dict) and out["advertise"], out
        assert A.ALGORITHM_STATE not in ctx.state  # nothing kept: the round has not been released
        saved = from_bytes(ctx.state[A.SECAGG_STATE]["envelope"], A.SECAGG_STATE)
        pending = half.decode_state(1, saved["pending_state"]["envelope"])
        assert saved["pending_state"]["key"] == A.ALGORITHM_STATE
        # one training, from the state kept before the round
        assert float(np.asarray(pending["client_states"]["steps"])[0]) == 1.0
    assert rows(ledger) == 1


def test_an_honest_secure_run_keeps_each_rounds_state_when_its_masked_input_leaves(tmp_path, monkeypatch, personal):
    """The control, through privfl's ServerApp and ClientApps in one process (experiments/loopback_grid.py), two
    rounds under secure aggregation against an active server: each round's state is kept when its masked input is
    marked released, so after two rounds every client's state carries two trainings, in its Context and in its
    client-state file beside the ledger (what a resumed run starts from)."""
    import importlib.util

    from privfl.accounting.ledger import PrivacyLedger

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    loader = importlib.util.spec_from_file_location("loopback_grid", os.path.join(root, "experiments",
                                                                                  "loopback_grid.py"))
    grid_module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(grid_module)
    monkeypatch.setenv("PRIVFL_REPLY_POLL", "0.01")
    node, public, keys, federation = federation_node(tmp_path, placement="local", unit="example")
    spec = dataclasses.replace(personal_spec(public, "personal-honest"), node_wait=5, round_timeout=120)
    run_config = {A.SPEC_KEY: spec.to_json(), A.RESULT_KEY: str(tmp_path / "result.bin")}
    apps, contexts = {}, {}
    for k in range(2):
        data = write(tmp_path / f"org{k}.npz", DIGITS.x[k * 60:(k + 1) * 60], DIGITS.y[k * 60:(k + 1) * 60])
        config = {"partition-id": k, "data-path": data, "ledger-path": str(tmp_path / f"org{k}.sqlite"),
                  "identity-key": keys[k], "federation": federation}
        contexts[k] = Context(run_id=1, node_id=100 + k, node_config=config, state=RecordDict(), run_config=run_config)
        apps[100 + k] = (A.client_app, contexts[k])
    A.server_main(grid_module.LoopbackGrid(apps), Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                          run_config=run_config))
    alg = A._setup(spec)
    half = alg.client_half(alg.public, np.random.default_rng(0))
    for k in range(2):
        ledger = PrivacyLedger.open_existing(str(tmp_path / f"org{k}.sqlite"), spec.run_id)
        try:
            assert [(c.round, c.released) for c in ledger.charges(str(k))] == [(0, True), (1, True)]
        finally:
            ledger.close()
        state = half.decode_state(k, contexts[k].state[A.ALGORITHM_STATE]["envelope"])
        assert float(np.asarray(state["client_states"]["steps"])[0]) == 2.0
        with open(tmp_path / f"org{k}.sqlite.client-state", "rb") as f:
            entry = from_bytes(f.read(), A.CLIENT_STATE_FILE)[json.dumps([spec.run_id, None])]
        assert entry["round"] == 1
        kept = half.decode_state(k, entry[A.ALGORITHM_STATE])
        assert float(np.asarray(kept["client_states"]["steps"])[0]) == 2.0


# -- 5. the app a SuperNode runs is the coordinator's code: privfl's worker loads only privfl's own app --------------

def _fab(app_dir):
    from pathlib import Path

    from flwr.cli.build import build_fab_from_disk
    from flwr.supercore.fab import Fab
    from flwr.supercore.run import Run

    content = build_fab_from_disk(Path(app_dir))
    fab = Fab(hashlib.sha256(content).hexdigest(), content, {})
    run = Run.create_empty(1)
    run.fab_id, run.fab_version, run.fab_hash = "privfl/privfl-run", "1.0.0", fab.hash_str
    return run, fab


STEAL = '''
from flwr.clientapp import ClientApp as _CA
from flwr.app import Message as _M, RecordDict as _RD, ArrayRecord as _AR, Array as _Arr
import numpy as _np
client_app = _CA()
@client_app.train()
def _steal(msg, context):
    with _np.load(context.node_config["data-path"]) as f:
        return _M(_RD({"loot": _AR({"x": _Arr(f["x"]), "y": _Arr(f["y"])})}), reply_to=msg)
'''


def test_privfls_worker_on_a_node_that_trusts_no_server_loads_only_privfls_own_app(tmp_path, monkeypatch):
    """s26b r4: the coordinator appends a ClientApp of its own to the app module write_app wrote; privfl's worker
    loader (ClientAppCache.get, what privfl-flower-worker runs for each task) loaded it, and on a node holding an
    identity key and a federation file it replied with the organisation's records. Now such a node's worker refuses
    the FAB before installing or importing anything of it (and a module the organisation did not list by digest);
    write_app's own app loads and is privfl's ClientApp."""
    from privfl.flower.warm import TRUSTED_MODULES_KEY, ClientAppCache, UntrustedApp
    from privfl.privacy.secure import SecureAggregation

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    node, public, _, _ = federation_node(tmp_path)
    agreed = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="distributed")
    spec = spec_of(privacy=agreed, secure=SecureAggregation(malicious=True), identities=public, run_id="fab")
    node_config = {"partition-id": 1, "data-path": add_remove(tmp_path)["D"],
                   "ledger-path": str(tmp_path / "l.sqlite"), **node}

    honest_dir, edited_dir, extra_dir = (str(tmp_path / name) for name in ("honest", "edited", "extra"))
    A.write_app(honest_dir, spec)
    A.write_app(edited_dir, spec)
    with open(os.path.join(edited_dir, A.APP_MODULE + ".py"), "a") as f:
        f.write(STEAL)
    module = tmp_path / "helper.py"
    module.write_text("import os  # anything the coordinator likes\n")
    A.write_app(extra_dir, spec)
    (tmp_path / "extra" / "helper.py").write_text(module.read_text())  # shipped in the FAB, not imported by the app

    run, fab = _fab(edited_dir)
    with pytest.raises(UntrustedApp, match="not the app module privfl's write_app writes"):
        ClientAppCache().get(run, fab, node_config)
    assert not (tmp_path / "flwr-home").exists() or not any((tmp_path / "flwr-home").rglob("privfl_flower_app.py"))
    run, fab = _fab(extra_dir)
    with pytest.raises(UntrustedApp, match="does not list"):
        ClientAppCache().get(run, fab, node_config)
    listed = {**node_config, TRUSTED_MODULES_KEY: sha256(module)}
    with pytest.raises(UntrustedApp, match="not the app module"):  # listed, but the app module does not import it
        ClientAppCache().get(run, fab, listed)

    with_module = str(tmp_path / "with-module")
    A.write_app(with_module, spec, modules=[str(module)])  # the app imports it: accepted once its digest is listed
    run, fab = _fab(with_module)
    with pytest.raises(UntrustedApp, match="does not list"):
        ClientAppCache().get(run, fab, node_config)
    assert ClientAppCache().get(run, fab, listed) is A.client_app

    run, fab = _fab(honest_dir)
    app = ClientAppCache().get(run, fab, node_config)
    assert app is A.client_app
    weaker = spec_of(privacy=PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="central"),
                     run_id="weaker")
    ctx = context(weaker.to_json(), node_config["data-path"], node_config["ledger-path"], node)
    out = app(message=broadcast(weaker), context=ctx)
    assert out.has_error() and out.error.code == A.CLIENT_ERROR_CODES["deployment"]  # privfl's refusal
    assert rows(node_config["ledger-path"]) == 0


def test_a_node_that_trusts_no_server_imports_no_module_the_run_config_names_from_elsewhere(tmp_path):
    """The run config's algorithm-modules may name a .py file in any folder holding a privfl_flower_app.py (an
    earlier app on the node): on a node with a federation file only modules its (checked) app imported are accepted;
    the old ClientApp imported, hence ran, the file on the run config's word, in an uncharged query."""
    from privfl.privacy.secure import SecureAggregation

    node, public, _, _ = federation_node(tmp_path)
    agreed = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="distributed")
    spec = spec_of(privacy=agreed, secure=SecureAggregation(malicious=True), identities=public, run_id="modules")
    earlier = tmp_path / "earlier-app"
    earlier.mkdir()
    (earlier / "privfl_flower_app.py").write_text("")
    marker = tmp_path / "ran"
    (earlier / "review_s26_payload.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    data = add_remove(tmp_path)["D"]
    ctx = context(spec.to_json(), data, tmp_path / "l.sqlite", node)
    ctx.run_config[A.MODULES_KEY] = json.dumps([str(earlier / "review_s26_payload.py")])
    assert reply(A.client_identify, query(), ctx, kind=A.IDENTIFY) == ("error", A.CLIENT_ERROR_CODES["configuration"])
    assert not marker.exists()
