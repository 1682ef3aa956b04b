"""A privfl ServerApp and ClientApp on Flower's Message API (flwr 1.41): every algorithm whose two halves are apart
(``privfl.algorithms.base``) — FedAvg, FedProx, DP-FedAvg, DP-SGD FedAvg, FOLA, HBFL and FedBNN
(:func:`runs_on_flower`) — across machines, one SuperNode per organisation. A client's own state (HBFL's local model,
FedBNN's personalised BNN) is kept as a message in its SuperNode's ``Context.state`` between rounds and never leaves
it; the metrics of those models (``local_metrics``) are not reported to the server. The run spec carries the
algorithm's options (``RunSpec.options``, given to ``make_algorithm`` on both halves) and, for FedBNN, the public
alignment set as a file every party reads (``RunSpec.alignment_path``, checked by its SHA-256; labels never read).

Restart and resume: every run starts by asking each SuperNode which rounds of the run id its own ledger has released
(:func:`_identify`), and runs from the first round after all of them, so a second ``flwr run`` of a run id (after a
SuperNode was killed and restarted with the same ledger) never asks for a round twice; a client refuses a round its
ledger has released, and each ledger refuses the rounds that would take it past its budget (the client sits out).
A run id whose rounds are all released is refused with a message naming it, and so is a resume with seeded noise
(its generators would redraw noise already used). The global model is not checkpointed: a resumed run continues the
rounds and the budget, from the algorithm's initial server state.

The server half (:func:`server_main`) sets the algorithm up from the run's public facts, builds the run plan
(``privfl.plan.RunPlan``), and each round sends the algorithm's :class:`privfl.algorithms.base.Broadcast`, receives
only :class:`privfl.release.Release` values and weights, sums them with :func:`privfl.aggregation.weighted_sums` and
calls ``server_update``. The client half (:func:`client_train`) runs in the organisation's SuperNode: it builds its
own client half from the public run specification (checking that its plan's noise equals the server's), takes the
broadcast, trains on its own data (node config ``data-path``), and releases through its own
:class:`privfl.release.ReleasePipeline`, charging its own SQLite ledger (node config ``ledger-path``), which refuses
to release past the budget. It returns the releases and its audit summary; nothing else leaves it.

Seeds are the run plan's streams (``privfl.plan.seed_stream``: setup, sampling, server, clients, secure
aggregation), and a client's generators are kept between rounds in its Flower ``Context.state``, so a run with
seeded noise releases exactly what the in-process runtime with ``executor="per_client"`` releases.

Placements: ``local`` (each client noises its own release) and ``central`` (the ServerApp adds the noise to the sum,
a trusted aggregator, as in the simulation), and, under secure aggregation, ``distributed``.

Secure aggregation (``RunSpec.secure``, a :class:`privfl.secure.SecureAggregation` with ``malicious=False``): each
round runs privfl's own protocol (``secure_agg``) as Flower message rounds (:func:`_secure_round`): the training
message carries the round's public session configuration and the client answers with its advertised keys and its
release headers (never a value); then share keys, masked input and unmask are ``train.secagg`` messages. The
client's step is the in-process runtime's (``privfl.secure.encode_for_secure_sum``, with the client's own generator
kept in its Context.state, as are its session's secrets between stages); the server unmasks only the sum. A SuperNode
that fails a stage is a dropout, recovered from the survivors' shares, or the round aborts revealing nothing. Its
ledger rows are charged at training and marked released just before its masked input leaves.

Not yet here (issue 13): client sampling under secure aggregation, the malicious-server variant of secure
aggregation (an identity registry of the SuperNodes' keys), algorithms with phases (FedBNR), and a checkpoint of the
server's state for resumed runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass

import numpy as np

from privfl.config import FederationConfig, PrivacyConfig
from privfl.errors import ConfigurationError
from privfl.flower.records import MessageError, from_bytes, from_record, to_bytes, to_record
from privfl.public import SEEDED_NOISE_WARNING, PublicFacts



def runs_on_flower(algorithm: str) -> bool:
    """Whether ``algorithm``'s halves can be apart on Flower: it declares its broadcast (an algorithm that needs a
    public alignment set, FedBNN, gets it from the spec's ``alignment_path``); FedBNR's phases do not run on Flower
    yet."""
    from privfl.algorithms import ALGORITHMS

    cls = ALGORITHMS.get(algorithm)
    return cls is not None and cls.splittable and bool(cls.broadcast_state)


def _option_value(name: str, value):
    """An algorithm option as the spec carries it: a JSON scalar, or a tuple of them (a JSON list)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)) and math.isfinite(value):
        return float(value)
    if isinstance(value, (list, tuple)):
        return tuple(_option_value(name, v) for v in value)
    raise ConfigurationError(f"the run spec carries algorithm options as JSON values (numbers, strings, booleans, "
                             f"lists of them); option {name!r} is {value!r}")


def _file_digest(path: str) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
#: run-config keys (Flower ``[tool.flwr.app.config]``) and node-config keys (``flower-supernode --node-config``)
SPEC_KEY, RESULT_KEY, TEST_KEY = "privfl-spec", "result-path", "test-path"
PARTITION_KEY, DATA_KEY, LEDGER_KEY = "partition-id", "data-path", "ledger-path"
#: run-config paths with ``{partition-id}`` for SuperNodes whose node config has no paths (the Simulation Engine's
#: virtual SuperNodes only know their partition-id)
TEMPLATE_KEYS = {DATA_KEY: "data-path-template", LEDGER_KEY: "ledger-path-template"}
#: Flower message type of a round and privfl message kinds
TRAIN = "train"
BROADCAST, REPLY, RESULT, CLIENT_STATE = "privfl.broadcast", "privfl.reply", "privfl.result", "privfl.client-state"
#: the Flower message types of "which client are you, and which rounds of this run has your ledger released" (the
#: start of every run) and of a left-out member's charge under client sampling, and their kinds
QUERY, CHARGE_TYPE = "query", "train.charge"
IDENTIFY, CHARGE = "privfl.identify", "privfl.charge"
#: the Context.state key of the algorithm's per-client state (privfl.algorithms.base: client_state)
ALGORITHM_STATE = "privfl.algorithm-state"


class DeploymentError(MessageError):
    """A Flower round could not be completed (a SuperNode failed, replied out of protocol or too late)."""


@dataclass(frozen=True)
class RunSpec:
    """Everything public about a run, identical on the server and on every client: the algorithm, its configuration,
    the privacy target and the federation's public facts. Carried as JSON in the Flower run config."""

    algorithm: str
    fed: FederationConfig
    privacy: PrivacyConfig
    n_clients: int
    task: str
    num_classes: int
    input_shape: tuple[int, ...]
    client_size: int
    client_sizes: tuple[int, ...] | None = None
    record_cap: int | None = None
    name: str = "data"
    run_id: str = "default"
    #: seconds the server waits for every SuperNode to connect, and for one round's replies
    node_wait: float = 120.0
    round_timeout: float = 600.0
    #: torch intra-op threads in the client (1: reproducible sums and a fair share of a shared machine)
    torch_threads: int | None = 1
    #: secure aggregation (``privfl.secure.SecureAggregation``, semi-honest variant): each round then runs
    #: secure_agg's stages as Flower message rounds; None: plaintext releases
    secure: object = None
    #: the algorithm's options (``privfl.algorithms.algorithm_options``, e.g. FedBNN's ``warmup_epochs``), given to
    #: ``make_algorithm`` on the server and on every client: a mapping of JSON values, kept as sorted (name, value)
    options: tuple = ()
    #: a public alignment set (FedBNN's AD): an ``.npz`` whose array ``x`` holds its inputs (any labels in it are
    #: never read), at a path the server and every SuperNode can read; ``alignment_digest`` is its SHA-256, filled
    #: in when the spec is built, so that a SuperNode holding another file refuses the run
    alignment_path: str | None = None
    alignment_digest: str = ""

    def __post_init__(self):
        from privfl.algorithms import ALGORITHMS, algorithm_options

        if not runs_on_flower(self.algorithm):
            raise ConfigurationError(f"the Flower runtime runs {sorted(a for a in ALGORITHMS if runs_on_flower(a))} "
                                     f"so far, got {self.algorithm!r}")
        items = self.options.items() if isinstance(self.options, dict) else self.options
        try:
            options = tuple(sorted((str(k), _option_value(str(k), v)) for k, v in items))
        except ConfigurationError:
            raise
        except (TypeError, ValueError):
            raise ConfigurationError(f"options must be a mapping of option names to JSON values, got "
                                     f"{self.options!r}") from None
        object.__setattr__(self, "options", options)
        bad = sorted({k for k, _ in options} - set(algorithm_options(self.algorithm)))
        if bad or len({k for k, _ in options}) != len(options):
            raise ConfigurationError(f"{self.algorithm} takes no option {bad} (or an option twice); its options are "
                                     f"{list(algorithm_options(self.algorithm))}")
        if getattr(ALGORITHMS[self.algorithm], "uses_alignment", False) and not self.alignment_path:
            raise ConfigurationError(f"{self.algorithm} needs a public alignment set on Flower: give the spec "
                                     f"alignment_path, an .npz with its inputs x that the server and every SuperNode "
                                     f"can read")
        if self.alignment_path:
            try:
                digest = _file_digest(self.alignment_path)
            except OSError as exc:
                raise ConfigurationError(f"cannot read the alignment set {self.alignment_path!r}: {exc}") from None
            if self.alignment_digest and self.alignment_digest != digest:
                raise ConfigurationError(f"the alignment set at {self.alignment_path!r} is not the one this run was "
                                         f"planned with (SHA-256 {digest}, the spec says {self.alignment_digest}); "
                                         f"give every party the same file")
            object.__setattr__(self, "alignment_digest", digest)
        if not isinstance(self.fed, FederationConfig) or not isinstance(self.privacy, PrivacyConfig):
            raise ConfigurationError("fed and privacy must be a FederationConfig and a PrivacyConfig")
        if self.privacy.sampling_rate < 1 and self.secure is not None:
            raise ConfigurationError("client sampling with secure aggregation is not supported by the Flower runtime "
                                     "yet; set sampling_rate=1 or turn secure aggregation off")
        if self.secure is not None:
            _check_secure(self)
        elif self.privacy.placement == "distributed":
            raise ConfigurationError("distributed noise is added by the clients under secure aggregation; give the "
                                     "spec secure=SecureAggregation(malicious=False) or choose local or central "
                                     "placement")
        for name in ("node_wait", "round_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigurationError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        if self.torch_threads is not None and (type(self.torch_threads) is not int or self.torch_threads < 1):
            raise ConfigurationError(f"torch_threads must be an integer >= 1 or None, got {self.torch_threads!r}")
        self.public_facts()  # validates the facts

    @classmethod
    def of(cls, algorithm: str, data, fed: FederationConfig, privacy: PrivacyConfig, *, run_id: str | None = None,
           **kwargs) -> "RunSpec":
        """The spec of a run on ``data`` (a FederatedData), with the public facts the in-process runtime derives."""
        public = PublicFacts.of(data, privacy, fed)
        return cls(algorithm, fed, privacy, public.n_clients, public.task, public.num_classes, public.input_shape,
                   public.client_size, public.client_sizes, public.record_cap, public.name,
                   run_id or f"{algorithm}-eps{privacy.epsilon:g}-seed{fed.seed}", **kwargs)

    def public_facts(self, test=None) -> PublicFacts:
        alignment = load_alignment(self.alignment_path, self) if self.alignment_path else None
        return PublicFacts(self.n_clients, self.task, self.num_classes, self.input_shape, self.client_size,
                           self.client_sizes, self.record_cap, self.name, alignment, test)

    def algorithm_options(self) -> dict:
        """The options ``make_algorithm`` takes for this run (JSON lists as tuples)."""
        return dict(self.options)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)  # secure (a frozen dataclass) becomes its fields
        d["privacy"]["epsilon"] = float(self.privacy.epsilon).hex()  # exact, and inf survives JSON
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        try:
            d = json.loads(text)
            fed = dict(d.pop("fed"))
            if fed.get("hidden") is not None:
                fed["hidden"] = tuple(fed["hidden"])
            privacy = dict(d.pop("privacy"))
            privacy["epsilon"] = float.fromhex(privacy["epsilon"])
            d["input_shape"] = tuple(d["input_shape"])
            if d.get("client_sizes") is not None:
                d["client_sizes"] = tuple(d["client_sizes"])
            d["options"] = tuple((k, v) for k, v in d.get("options", ()))
            if d.get("secure") is not None:
                from privfl.secure import SecureAggregation

                d["secure"] = SecureAggregation(**d["secure"])
            return cls(fed=FederationConfig(**fed), privacy=PrivacyConfig(**privacy), **d)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, ConfigurationError):
                raise
            raise ConfigurationError(f"the run config's {SPEC_KEY!r} is not a privfl run spec: {exc}") from None


def _check_secure(spec: "RunSpec") -> None:
    """Refuse up front a secure-aggregation setting the deployment cannot run safely."""
    from privfl.secure import SecureAggregation

    sec = spec.secure
    if not isinstance(sec, SecureAggregation):
        raise ConfigurationError(f"secure must be a privfl.secure.SecureAggregation or None, got {sec!r}")
    if sec.malicious:
        raise ConfigurationError("the Flower runtime runs the semi-honest variant of secure aggregation: the "
                                 "malicious-server variant needs every SuperNode's Ed25519 identity key registered "
                                 "out of band, which it does not carry yet; use SecureAggregation(malicious=False) "
                                 "(and Flower's node authentication so that the transport authenticates clients)")
    if not spec.privacy.private:
        raise ConfigurationError("secure aggregation on Flower needs a private run: a non-private run's ranges (and "
                                 "weights, its record counts) are not public facts; set an epsilon or turn secure "
                                 "aggregation off")
    sec.check(spec.n_clients)


def client_seed(seed: int, client: int) -> np.random.SeedSequence:
    """Client ``client``'s stream of the run plan (``privfl.plan.seed_stream``), as the in-process runtime uses it."""
    from privfl.plan import seed_stream

    return seed_stream(seed, "clients", client)


def _noise(privacy: PrivacyConfig, seq: np.random.SeedSequence):
    from privfl.mechanisms import SecureNoise, SeededNoise

    return SecureNoise() if privacy.secure_noise else SeededNoise(np.random.default_rng(seq))


def _run_plan(alg, spec: RunSpec):
    """The run plan (``privfl.plan.RunPlan``: channels as charged, noise multipliers, placement, distributed-noise
    plans), built from the public spec exactly as the in-process runtime builds it."""
    from privfl.plan import RunPlan

    return RunPlan.build(alg, spec.privacy, spec.fed, alg.public, spec.secure)


def _encodings(plan, spec: RunSpec):
    """Each channel's secure-aggregation encoding, from the plan and the public facts only: the server and every
    client compute the same (``privfl.secure.channel_encodings``)."""
    from privfl.secure import channel_encodings, local_noise_stds, public_weight_bound

    return channel_encodings(plan.channels, spec.secure, n_clients=spec.n_clients,
                             local_stds=local_noise_stds(plan.channels, plan.placement, plan.noise_multipliers),
                             weight_bound=public_weight_bound(spec.privacy, spec.public_facts()),
                             distributed=plan.distributed)


def _setup_seq(spec: RunSpec) -> np.random.SeedSequence:
    from privfl.plan import seed_stream

    return seed_stream(spec.fed.seed, "setup")


def _setup(spec: RunSpec, test=None):
    from privfl.algorithms import make_algorithm

    alg = make_algorithm(spec.algorithm, spec.fed, spec.privacy, **spec.algorithm_options())
    setup_seq = _setup_seq(spec)
    alg.setup(spec.public_facts(test), np.random.default_rng(setup_seq))
    return alg


def load_dataset(path: str, spec: RunSpec):
    """An organisation's data file: an ``.npz`` holding ``x`` and ``y`` (privfl's ArrayDataset layout)."""
    from privfl.data import ArrayDataset

    try:
        with np.load(path, allow_pickle=False) as f:
            x, y = f["x"], f["y"]
    except (OSError, KeyError, ValueError) as exc:
        raise ConfigurationError(f"cannot read the data file {path!r} ({exc}); give an .npz with arrays x and y"
                                 ) from None
    return ArrayDataset(x, y, spec.task, spec.num_classes, os.path.basename(path))


def load_alignment(path: str, spec: RunSpec):
    """The public alignment set: the inputs ``x`` of an ``.npz`` (its labels, if any, are never read: the dataset's
    targets are zeros), checked against the spec's input shape."""
    from privfl.data import ArrayDataset

    try:
        with np.load(path, allow_pickle=False) as f:
            x = np.asarray(f["x"], dtype=np.float32)
    except (OSError, KeyError, ValueError) as exc:
        raise ConfigurationError(f"cannot read the alignment set {path!r} ({exc}); give an .npz with an array x of "
                                 f"its inputs") from None
    if x.ndim < 1 or len(x) < 1 or tuple(x.shape[1:]) != tuple(spec.input_shape):
        raise ConfigurationError(f"the alignment set {path!r} has inputs of shape {x.shape}; the run's inputs have "
                                 f"shape {tuple(spec.input_shape)}")
    y = np.zeros(len(x), dtype=np.int64 if spec.task == "classification" else np.float32)
    return ArrayDataset(x, y, spec.task, spec.num_classes, f"{spec.name}-alignment")


def encode_release(r) -> dict:
    return {"client_id": r.client_id, "round": r.round, "channel": r.channel, "value": np.asarray(r.value),
            "weight": r.weight, "local_noise_std": r.local_noise_std, "central_noise_std": r.central_noise_std,
            "release_id": r.release_id}


def decode_release(d: dict):
    from privfl.release import Release

    try:
        return Release(str(d["client_id"]), int(d["round"]), str(d["channel"]), d["value"], float(d["weight"]),
                       float(d["local_noise_std"]), float(d["central_noise_std"]), str(d["release_id"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise DeploymentError(f"a client's release is malformed: {exc}") from None


# -- the server half ----------------------------------------------------------------------------------------------

def _wait_for_nodes(grid, n: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= n:
            return nodes
        if time.monotonic() > deadline:
            raise DeploymentError(f"only {len(nodes)} of {n} SuperNodes connected within {timeout:g} s; start one "
                                  f"flower-supernode per organisation")
        time.sleep(0.5)


def server_main(grid, context) -> None:
    """The ServerApp's main: setup, then ``rounds`` x (broadcast, receive releases, weighted sums, server step); with
    secure aggregation each round's sums come from the protocol's stages (:func:`_secure_round`)."""
    from privfl.plan import seed_stream

    spec = RunSpec.from_json(str(context.run_config[SPEC_KEY]))
    test_path = str(context.run_config.get(TEST_KEY, "") or "")
    test = load_dataset(test_path, spec) if test_path else None
    alg = _setup(spec, test)
    plan = _run_plan(alg, spec)
    channels, multipliers = list(plan.channels), plan.noise_multipliers
    by_name = {c.name: c for c in channels}
    server_noise = _noise(spec.privacy, seed_stream(spec.fed.seed, "server"))
    nodes = _wait_for_nodes(grid, spec.n_clients, spec.node_wait)
    history, audits, node_client = [], {}, {}
    node_of, first_round = _identify(grid, spec, nodes, node_client)
    _check_resume(spec, first_round)
    sampled = spec.privacy.sampling_rate < 1
    if sampled:  # the run plan's sampling stream, drawn as the in-process runtime draws it
        sampler = np.random.default_rng(seed_stream(spec.fed.seed, "sample"))
        for _ in range(first_round):  # a resumed run draws its rounds' samples where the first run left off
            sampler.random(spec.n_clients)
    exhausted: set[str] = set()  # clients whose budget is spent take no further part, charged or not
    for rnd in range(first_round, spec.fed.rounds):
        start = time.perf_counter()
        broadcast = {"round": rnd, "noise_multipliers": multipliers, "values": dict(alg.broadcast(rnd).values)}
        if sampled:
            chosen = {str(k) for k in np.flatnonzero(sampler.random(spec.n_clients) < spec.privacy.sampling_rate)}
            live = sorted((c for c in node_of if c not in exhausted), key=int)
            refused = _charge_round(grid, spec, rnd, [node_of[c] for c in live if c not in chosen], audits,
                                    node_client) if plan.amplified else []
            exhausted.update(refused)
            participants, sat_out = _plain_round(grid, spec, alg, rnd, [node_of[c] for c in live if c in chosen],
                                                 broadcast, by_name, server_noise, audits, node_client,
                                                 all_nodes=False)
            exhausted.update(sat_out)
            sat_out = sorted(set(sat_out) | exhausted, key=int)
            aborted = False
        elif spec.secure is None:
            live = [n for n in nodes if node_client.get(n) not in exhausted]
            participants, sat_out = _plain_round(grid, spec, alg, rnd, live, broadcast, by_name, server_noise,
                                                 audits, node_client, all_nodes=len(live) == len(nodes))
            exhausted.update(sat_out)
            sat_out = sorted(set(sat_out) | exhausted, key=int)
            aborted = False
        else:
            participants, sat_out, aborted = _secure_round(grid, spec, alg, rnd, nodes, broadcast, plan, by_name,
                                                           server_noise, audits, node_client)
        metrics = alg.evaluate(test) if test is not None else {}
        history.append({"round": rnd, "participants": participants, "aborted": aborted,
                        "sat_out": sorted(sat_out, key=int), "metrics": metrics,
                        "seconds": time.perf_counter() - start})
    result_path = str(context.run_config.get(RESULT_KEY, "") or "")
    if result_path:
        result = {"run_id": spec.run_id, "state": dict(alg.broadcast(spec.fed.rounds).values),
                  "history": history, "audits": audits, "noise_multipliers": multipliers,
                  "start_round": first_round}
        tmp = f"{result_path}.tmp"
        with open(tmp, "wb") as f:
            f.write(to_bytes(result, RESULT))
        os.replace(tmp, result_path)  # the result appears whole or not at all


def _identify(grid, spec, nodes, node_client) -> tuple[dict[str, int], int]:
    """Ask every SuperNode which organisation (partition id) it speaks for (client sampling draws clients, and the
    server must know which node to send a sampled client's round to) and which rounds of this run id its own ledger
    has already released. Returns (client id -> node id, the first round after every released one): a second
    ``flwr run`` of a run id resumes there, so no round is released twice."""
    from flwr.app import Message

    messages = [Message(to_record({"round": -1}, IDENTIFY), dst_node_id=node, message_type=QUERY, group_id="identify")
                for node in nodes]
    replies = list(grid.send_and_receive(messages, timeout=spec.round_timeout))
    seen: set[str] = set()
    start = 0
    for msg in replies:
        if msg.has_error():
            raise DeploymentError(f"SuperNode {msg.metadata.src_node_id} failed to identify: {msg.error.reason}")
        reply = from_record(msg.content, IDENTIFY)
        _reply_client(reply, -1, msg.metadata.src_node_id, seen, node_client)
        released = [int(r) for r in reply.get("released", [])]
        start = max([start, *(r + 1 for r in released)])
    if len(seen) != len(nodes):
        raise DeploymentError(f"{len(nodes) - len(seen)} of {len(nodes)} SuperNodes did not identify themselves")
    _check_partitions(seen, spec)
    return {c: n for n, c in node_client.items()}, start


def _check_resume(spec: RunSpec, start: int) -> None:
    """A run id whose ledgers have released rounds resumes at ``start``; refuse what cannot be resumed safely."""
    if start >= spec.fed.rounds:
        raise DeploymentError(f"run {spec.run_id!r}: the SuperNodes' ledgers have already released rounds up to "
                              f"{start - 1} of it, and this spec has {spec.fed.rounds} rounds: nothing is left to "
                              f"run (a round is released once); give a new run a new run_id")
    if start and spec.privacy.private and not spec.privacy.secure_noise:
        raise DeploymentError(f"run {spec.run_id!r} would resume at round {start} with seeded noise, whose "
                              f"generators restart from the seed and would redraw noise already released; resume "
                              f"with secure_noise=True or give a new run a new run_id")


def _charge_round(grid, spec, rnd, nodes, audits, node_client) -> list[str]:
    """Under amplification by sampling every member's round is charged, sampled or not: the SuperNodes of the
    clients left out charge their own ledgers (``ReleasePipeline.charge_only``). Returns the clients whose budget
    refused the charge (they take no further part)."""
    from flwr.app import Message

    if not nodes:
        return []
    messages = [Message(to_record({"round": rnd}, CHARGE), dst_node_id=node, message_type=CHARGE_TYPE,
                        group_id=f"{rnd}.charge") for node in nodes]
    replies = list(grid.send_and_receive(messages, timeout=spec.round_timeout))
    refused, seen = [], set()
    for msg in replies:
        node = msg.metadata.src_node_id
        if msg.has_error():
            raise DeploymentError(f"round {rnd}: SuperNode {node} failed to charge its round: {msg.error.reason}")
        reply = from_record(msg.content, CHARGE)
        cid = _reply_client(reply, rnd, node, seen, node_client)
        audits[cid] = reply["audit"]
        if reply["sat_out"]:
            refused.append(cid)
    if len(seen) != len(nodes):
        raise DeploymentError(f"round {rnd}: {len(nodes) - len(seen)} of {len(nodes)} SuperNodes did not charge "
                              f"their round within {spec.round_timeout:g} s")
    return refused


def _plain_round(grid, spec, alg, rnd, nodes, broadcast, by_name, server_noise, audits, node_client,
                 all_nodes: bool = True):
    """One round without secure aggregation: every SuperNode of ``nodes`` replies with its releases in the clear
    (``all_nodes``: they are the whole federation, whose partition ids are checked)."""
    from flwr.app import Message

    from privfl.aggregation import weighted_sums

    messages = [Message(to_record(broadcast, BROADCAST), dst_node_id=node, message_type=TRAIN,
                        group_id=str(rnd)) for node in nodes]
    replies = list(grid.send_and_receive(messages, timeout=spec.round_timeout)) if messages else []
    releases, sat_out, seen = [], [], set()
    for msg in replies:
        node = msg.metadata.src_node_id
        if msg.has_error():
            raise DeploymentError(f"round {rnd}: SuperNode {node} failed: {msg.error.reason}")
        reply = from_record(msg.content, REPLY)
        cid = _reply_client(reply, rnd, node, seen, node_client)
        audits[cid] = reply["audit"]
        if reply["sat_out"]:
            sat_out.append(cid)
            continue
        got = [decode_release(d) for d in reply["releases"]]
        if sorted(r.channel for r in got) != sorted(by_name) or any(
                r.client_id != cid or r.round != rnd or np.shape(r.value) != by_name[r.channel].shape
                or not np.all(np.isfinite(r.value)) or not (math.isfinite(r.weight) and r.weight > 0)
                for r in got):
            raise DeploymentError(f"round {rnd}: client {cid} released {[r.channel for r in got]}, not finite "
                                  f"values of the declared channels {sorted(by_name)} and shapes with a weight > 0")
        releases.extend(got)
    if len(seen) != len(nodes):
        raise DeploymentError(f"round {rnd}: {len(nodes) - len(seen)} of {len(nodes)} SuperNodes did not reply "
                              f"within {spec.round_timeout:g} s")
    if all_nodes:
        _check_partitions(seen, spec)
    releases.sort(key=lambda r: int(r.client_id))  # the in-process runtime's summation order
    if releases:
        alg.server_update(weighted_sums(releases, by_name, server_noise), rnd)
    return len({r.client_id for r in releases}), sat_out


def _reply_client(reply, rnd, node, seen, node_client) -> str:
    """The client id a SuperNode's reply speaks for, checked against the round and what the node said before."""
    cid = str(reply["client_id"])
    if reply["round"] != rnd or cid in seen or node_client.setdefault(node, cid) != cid:
        raise DeploymentError(f"round {rnd}: SuperNode {node} replied out of protocol (client {cid}, round "
                              f"{reply['round']})")
    seen.add(cid)
    return cid


def _check_partitions(seen, spec) -> None:
    if not all(c.isdigit() and int(c) < spec.n_clients for c in seen) or len(seen) > spec.n_clients:
        raise DeploymentError(f"the SuperNodes' partition ids are {sorted(seen)}; give each of the "
                              f"{spec.n_clients} organisations a distinct partition-id 0..{spec.n_clients - 1}")
    if len(seen) == spec.n_clients and sorted(int(c) for c in seen) != list(range(spec.n_clients)):
        raise DeploymentError(f"the SuperNodes' partition ids are {sorted(seen, key=int)}; give each of the "
                              f"{spec.n_clients} organisations a distinct partition-id 0..{spec.n_clients - 1}")


# -- secure aggregation as Flower message rounds -------------------------------------------------------------------

#: the Flower message type of the protocol's later stages (``@client_app.train("secagg")``) and privfl's kinds
SECAGG = "train.secagg"
SECAGG_REQUEST, SECAGG_REPLY, SECAGG_STATE = "privfl.secagg-request", "privfl.secagg-reply", "privfl.secagg-state"


def _session_id(cid: str) -> int:
    """A client's id in the protocol (Shamir x-coordinates start at 1): partition k is k + 1."""
    return int(cid) + 1


def _stage_messages():
    from privfl.secure_agg.messages import (AdvertiseKeys, KeyDirectory, MaskedInput, ShareDelivery, ShareKeys,
                                            UnmaskRequest, UnmaskShares)

    # stage -> (what the server sends, what the client answers)
    return {"share_keys": (KeyDirectory, ShareKeys), "masked_input": (ShareDelivery, MaskedInput),
            "unmask": (UnmaskRequest, UnmaskShares)}, AdvertiseKeys


def _secure_round(grid, spec, alg, rnd, nodes, broadcast, plan, by_name, server_noise, audits, node_client):
    """One round under secure aggregation, secure_agg's stages as Flower message rounds:

    1. ``train`` (advertise keys): the broadcast and the round's public session configuration go out; each client
       trains, charges, noises and encodes its releases with its own generator, and answers with its
       ``AdvertiseKeys`` and its release headers (weights and noise levels, never values);
    2. ``share keys``: each gets its neighbours' keys and answers with its encrypted Shamir shares;
    3. ``masked input``: each gets the shares addressed to it and answers with its masked input (its ledger rows
       are marked released just before);
    4. ``unmask``: the survivors get the survivor set and answer with the shares that remove the masks.

    A SuperNode that fails or does not answer a stage is a dropout: the server session goes on without it, and
    recovers the masks of a client that dropped after sharing its keys from the survivors' shares; if too few
    survive (fewer than the threshold, or than the floor distributed noise was charged for) the round aborts:
    nothing of it is revealed and the global state stays. Returns (participants, sat_out, aborted)."""
    from flwr.app import Message

    from privfl.secure import decode_secure_sum, round_min_inputs
    from privfl.secure_agg import ProtocolAbort, ServerSession, SessionConfig
    from privfl.secure_agg.params import ParameterError
    from privfl.release import ReleaseHeader

    stages, advertise_type = _stage_messages()
    encodings = _encodings(plan, spec)
    dimension = sum(e.size for e in encodings.values())
    try:
        config = SessionConfig.create([_session_id(str(k)) for k in range(spec.n_clients)], bits=spec.secure.bits,
                                      dimension=dimension, min_inputs=round_min_inputs(encodings), malicious=False,
                                      dropout=spec.secure.dropout, corruption=spec.secure.corruption)
    except (ParameterError, ValueError) as exc:
        raise DeploymentError(f"round {rnd}: no secure-aggregation session for {spec.n_clients} clients: {exc}"
                              ) from exc
    server = ServerSession(config)
    messages = [Message(to_record({**broadcast, "secagg": config.to_dict()}, BROADCAST), dst_node_id=node,
                        message_type=TRAIN, group_id=str(rnd)) for node in nodes]
    headers, sat_out, seen = {}, [], set()
    client_node: dict[str, int] = {}
    for msg in grid.send_and_receive(messages, timeout=spec.round_timeout):
        node = msg.metadata.src_node_id
        if msg.has_error():
            continue  # a dropout before advertising keys: the session goes on without it
        reply = from_record(msg.content, REPLY)
        cid = _reply_client(reply, rnd, node, seen, node_client)
        audits[cid] = reply["audit"]
        if reply["sat_out"]:
            sat_out.append(cid)
            continue
        got = {}
        for d in reply["headers"]:
            h = ReleaseHeader.from_dict(d)
            if h.client_id != cid or h.round != rnd or h.channel not in by_name or h.channel in got:
                raise DeploymentError(f"round {rnd}: client {cid} sent a header for {h.channel!r} of client "
                                      f"{h.client_id}, round {h.round}")
            got[h.channel] = h
        if set(got) != set(by_name):
            raise DeploymentError(f"round {rnd}: client {cid} declared channels {sorted(got)}, not "
                                  f"{sorted(by_name)}")
        advert = advertise_type.from_bytes(reply["advertise"])
        if advert.sender != _session_id(cid):
            raise DeploymentError(f"round {rnd}: client {cid} advertised keys as protocol id {advert.sender}")
        headers[_session_id(cid)] = got
        client_node[cid] = node
        server.receive(advert)
    _check_partitions(seen, spec)
    node_of = {_session_id(c): n for c, n in client_node.items()}
    try:
        outgoing = server.key_directories()
        for stage in ("share_keys", "masked_input", "unmask"):
            for answer in _exchange(grid, spec, rnd, stage, outgoing, node_of, stages[stage][1], audits):
                server.receive(answer)
            if stage == "share_keys":
                outgoing = server.share_deliveries()
            elif stage == "masked_input":
                request = server.unmask_request()
                outgoing = {c: request for c in request.alive}
        result = server.finalize()
    except ProtocolAbort:
        return 0, sat_out, True  # nothing of the round is revealed; the global state stays
    included = [headers[c] for c in result.included]
    alg.server_update(decode_secure_sum(result.sum, encodings, by_name, included, server_noise), rnd)
    return len(included), sat_out, False


def _exchange(grid, spec, rnd, stage, outgoing, node_of, answer_type, audits):
    """Send each client its message of ``stage``; yield the answers of those that reply (the others dropped)."""
    from flwr.app import Message

    messages = [Message(to_record({"round": rnd, "stage": stage, "message": m.to_bytes()}, SECAGG_REQUEST),
                        dst_node_id=node_of[c], message_type=SECAGG, group_id=f"{rnd}.{stage}")
                for c, m in sorted(outgoing.items()) if c in node_of]
    by_node = {n: c for c, n in node_of.items()}
    for msg in grid.send_and_receive(messages, timeout=spec.round_timeout):
        node = msg.metadata.src_node_id
        if msg.has_error():
            continue  # a dropout at this stage
        reply = from_record(msg.content, SECAGG_REPLY)
        c = by_node.get(node)
        if c is None or reply["round"] != rnd or reply["stage"] != stage or _session_id(reply["client_id"]) != c:
            raise DeploymentError(f"round {rnd}: SuperNode {node} answered stage {stage!r} out of protocol")
        if reply.get("audit") is not None:
            audits[str(reply["client_id"])] = reply["audit"]
        answer = answer_type.from_bytes(reply["message"])
        if answer.sender != c:
            raise DeploymentError(f"round {rnd}: SuperNode {node} answered for protocol id {answer.sender}")
        yield answer


def read_result(path: str) -> dict:
    """The result a ServerApp wrote to its ``result-path``."""
    with open(path, "rb") as f:
        return from_bytes(f.read(), RESULT)


# -- the client half ----------------------------------------------------------------------------------------------

def _node_value(context, key: str):
    template = str(context.run_config.get(TEMPLATE_KEYS.get(key, ""), "") or "")
    if key not in context.node_config and template and PARTITION_KEY in context.node_config:
        return template.replace("{partition-id}", str(int(context.node_config[PARTITION_KEY])))
    if key not in context.node_config:
        raise ConfigurationError(f"this SuperNode has no {key!r}; start it with flower-supernode --node-config "
                                 f"\"{PARTITION_KEY}=K {DATA_KEY}='...' {LEDGER_KEY}='...'\"")
    return context.node_config[key]


def _generators(spec: RunSpec, client: int, context):
    """The client's training generator and noise source: fresh from its seed stream in its first round, then as
    its previous round left them (kept in the SuperNode's Context.state, which never leaves the organisation)."""
    from flwr.app import ConfigRecord
    from privfl.mechanisms import SeededNoise

    from privfl.plan import seed_stream

    seq = client_seed(spec.fed.seed, client)
    train_rng = np.random.default_rng(seq.spawn(1)[0])
    noise = _noise(spec.privacy, seq)
    secure_rng = np.random.default_rng(seed_stream(spec.fed.seed, "secure", client))  # RunPlan.secure_rng
    if CLIENT_STATE in context.state:
        saved = from_bytes(context.state[CLIENT_STATE]["envelope"], CLIENT_STATE)
        train_rng.bit_generator.state = saved["train"]
        if isinstance(noise, SeededNoise):
            noise.rng.bit_generator.state = saved["noise"]
        if saved.get("secure") is not None:
            secure_rng.bit_generator.state = saved["secure"]

    def save() -> None:
        state = {"train": train_rng.bit_generator.state,
                 "noise": noise.rng.bit_generator.state if isinstance(noise, SeededNoise) else None,
                 "secure": secure_rng.bit_generator.state}
        context.state[CLIENT_STATE] = ConfigRecord({"envelope": to_bytes(state, CLIENT_STATE)})

    return train_rng, noise, secure_rng, save


def client_train(msg, context):
    """The ClientApp's train step: the client's own work on its own data, released through its own pipeline."""
    from flwr.app import Message

    from privfl.accounting.errors import PrivacyBudgetExceeded

    spec = RunSpec.from_json(str(context.run_config[SPEC_KEY]))
    if spec.torch_threads is not None:
        import torch

        torch.set_num_threads(spec.torch_threads)
    client = int(_node_value(context, PARTITION_KEY))
    if not 0 <= client < spec.n_clients:
        raise ConfigurationError(f"partition-id {client} is outside 0..{spec.n_clients - 1}")
    dataset = load_dataset(str(_node_value(context, DATA_KEY)), spec)
    from privfl.algorithms.base import Broadcast

    broadcast = from_record(msg.content, BROADCAST)
    rnd = int(broadcast["round"])
    alg = _setup(spec)  # the client's own instance, from the public spec: it plans the run as the server does
    half = alg.client_half(alg.public, np.random.default_rng(_setup_seq(spec)))
    plan = _run_plan(alg, spec)
    multipliers = plan.noise_multipliers
    if multipliers != broadcast["noise_multipliers"]:
        raise DeploymentError(f"the server planned noise multipliers {broadcast['noise_multipliers']} but this "
                              f"client computes {multipliers} from the same public spec; run one privfl version")
    train_rng, noise, secure_rng, save = _generators(spec, client, context)
    ledger = _ledger(spec, context)
    secure = spec.secure is not None
    try:
        if any(c.round == rnd and c.released for c in ledger.charges(str(client))):
            raise DeploymentError(f"run {spec.run_id!r}: this SuperNode's ledger has already released round {rnd}; "
                                  f"a round is released once (a second flwr run of a run id resumes after the "
                                  f"rounds its ledgers released); give a new run a new run_id")
        pipeline = plan.pipeline(client, ledger, noise)
        state = (half.decode_state(client, context.state[ALGORITHM_STATE]["envelope"])
                 if ALGORITHM_STATE in context.state else None)
        out, state = half.client_update(client, Broadcast(rnd, broadcast["values"]), dataset, state, train_rng)
        # the client's own state (HBFL's local model, FedBNN's personalised model) stays on its SuperNode
        _keep(context, ALGORITHM_STATE, half.encode_state(client, state))
        try:
            # The charges (and, in the clear, the release marks) are durable before anything is sent. Under secure
            # aggregation the values leave only as the masked input, two stages later: marked then.
            with ledger.transaction():
                released = pipeline.release(rnd, out.values, out.weight, mark=not secure)
            sat_out = False
        except PrivacyBudgetExceeded:
            released, sat_out = {}, True
        reply = {"client_id": str(client), "round": rnd, "sat_out": sat_out}
        if secure and not sat_out:
            reply.update(_secure_advertise(spec, plan, client, rnd, broadcast, released, secure_rng, context))
        elif not secure:
            reply["releases"] = [encode_release(r) for r in released.values()]
        save()
        reply["audit"] = ledger.audit()["clients"].get(str(client))
    finally:
        ledger.close()
    return Message(to_record(reply, REPLY), reply_to=msg)


def _keep(context, key: str, envelope: bytes) -> None:
    from flwr.app import ConfigRecord

    context.state[key] = ConfigRecord({"envelope": envelope})


def _ledger(spec: RunSpec, context):
    from privfl.accounting.ledger import PrivacyLedger

    privacy = spec.privacy
    meta = {"algorithm": spec.algorithm, "dataset": spec.name, "noise": "secure" if privacy.secure_noise else "seeded"}
    if privacy.private and not privacy.secure_noise:
        meta["warning"] = SEEDED_NOISE_WARNING
    return PrivacyLedger(str(_node_value(context, LEDGER_KEY)), spec.run_id, delta=privacy.delta,
                         epsilon_budget=privacy.epsilon, accountant=privacy.resolved_accountant, meta=meta)


def _secure_advertise(spec, plan, client, rnd, broadcast, released, secure_rng, context) -> dict:
    """The client's first stage under secure aggregation: encode its (charged, noised) releases with its own
    generator into the public encodings it computes itself, open its protocol session under the server's public
    configuration (refused if it asks for fewer inputs than the client's noise was charged for) and advertise its
    keys. The session's secrets stay in the SuperNode's Context.state."""
    from flwr.app import ConfigRecord

    from privfl.secure import encode_for_secure_sum, round_min_inputs
    from privfl.secure_agg import ClientSession, SessionConfig

    encodings = _encodings(plan, spec)
    config = SessionConfig.from_dict(broadcast["secagg"])
    words = encode_for_secure_sum(released, encodings, secure_rng, secure_noise=spec.privacy.secure_noise)
    if config.bits != spec.secure.bits or config.dimension != words.size or config.malicious:
        raise DeploymentError(f"the server's session ({config.bits} bits, dimension {config.dimension}) does not "
                              f"match the run's encodings ({spec.secure.bits} bits, dimension {words.size})")
    floor = round_min_inputs(encodings)
    session = ClientSession(config, _session_id(str(client)), words, min_inputs=floor)
    advert = session.advertise_keys()
    state = {"round": rnd, "config": config.to_dict(), "session": session.to_state(), "floor": floor}
    context.state[SECAGG_STATE] = ConfigRecord({"envelope": to_bytes(state, SECAGG_STATE)})
    return {"headers": [r.header.to_dict() for r in released.values()], "advertise": advert.to_bytes()}


def client_secagg(msg, context):
    """The ClientApp's answer to one later stage of secure aggregation (share keys, masked input, unmask), from
    the session its train step left in Context.state. Before the masked input leaves, the round's ledger rows are
    marked released; a client that stops before then holds charges, never an unmarked release."""
    from flwr.app import ConfigRecord, Message

    from privfl.release import mark_round_released
    from privfl.secure_agg import ClientSession, SessionConfig

    spec = RunSpec.from_json(str(context.run_config[SPEC_KEY]))
    client = int(_node_value(context, PARTITION_KEY))
    request = from_record(msg.content, SECAGG_REQUEST)
    rnd, stage = int(request["round"]), str(request["stage"])
    stages, _ = _stage_messages()
    if stage not in stages or SECAGG_STATE not in context.state:
        raise DeploymentError(f"round {rnd}: no secure-aggregation session for stage {stage!r} on this SuperNode")
    saved = from_bytes(context.state[SECAGG_STATE]["envelope"], SECAGG_STATE)
    if saved["round"] != rnd:
        raise DeploymentError(f"round {rnd}: this SuperNode's session is for round {saved['round']}")
    session = ClientSession.from_state(SessionConfig.from_dict(saved["config"]), saved["session"],
                                       min_inputs=saved["floor"])
    try:
        answer = session.handle(stages[stage][0].from_bytes(request["message"]))
    finally:
        if session.aborted is not None or session.stage == "done":
            del context.state[SECAGG_STATE]  # nothing of a finished or aborted session is kept
    reply = {"client_id": str(client), "round": rnd, "stage": stage, "audit": None}
    if stage == "masked_input":
        ledger = _ledger(spec, context)
        try:
            with ledger.transaction():  # durable before the masked input is handed to Flower
                mark_round_released(ledger, str(client), rnd)
            reply["audit"] = ledger.audit()["clients"].get(str(client))
        finally:
            ledger.close()
    if session.stage != "done":
        saved["session"] = session.to_state()
        context.state[SECAGG_STATE] = ConfigRecord({"envelope": to_bytes(saved, SECAGG_STATE)})
    reply["message"] = answer.to_bytes()
    return Message(to_record(reply, SECAGG_REPLY), reply_to=msg)


def client_identify(msg, context):
    """The ClientApp's answer to :func:`_identify`: the partition id its node config gives it (public) and the
    rounds of this run id its ledger has released (the server saw them all; nothing else of the ledger)."""
    from flwr.app import Message

    from privfl.accounting.ledger import PrivacyLedger

    spec = RunSpec.from_json(str(context.run_config[SPEC_KEY]))
    client = int(_node_value(context, PARTITION_KEY))
    path = str(_node_value(context, LEDGER_KEY))
    released: list[int] = []
    if os.path.exists(path) and spec.run_id in PrivacyLedger.run_ids(path):
        ledger = PrivacyLedger.open_existing(path, spec.run_id)
        try:
            released = sorted({c.round for c in ledger.charges(str(client)) if c.released})
        finally:
            ledger.close()
    reply = {"client_id": str(client), "round": -1, "released": released}
    return Message(to_record(reply, IDENTIFY), reply_to=msg)


def client_charge(msg, context):
    """A round in which sampling left this client out, under amplification: it charges its own ledger for the round
    (``ReleasePipeline.charge_only``), or sits out for good if its budget refuses; nothing is released."""
    from flwr.app import Message

    from privfl.accounting.errors import PrivacyBudgetExceeded

    spec = RunSpec.from_json(str(context.run_config[SPEC_KEY]))
    client = int(_node_value(context, PARTITION_KEY))
    rnd = int(from_record(msg.content, CHARGE)["round"])
    alg = _setup(spec)
    plan = _run_plan(alg, spec)
    ledger = _ledger(spec, context)
    try:
        pipeline = plan.pipeline(client, ledger, _noise(spec.privacy, client_seed(spec.fed.seed, client)))
        try:
            with ledger.transaction():
                pipeline.charge_only(rnd)
            sat_out = False
        except PrivacyBudgetExceeded:
            sat_out = True
        audit = ledger.audit()["clients"].get(str(client))
    finally:
        ledger.close()
    reply = {"client_id": str(client), "round": rnd, "sat_out": sat_out, "audit": audit}
    return Message(to_record(reply, CHARGE), reply_to=msg)


def _apps():
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    server, client = ServerApp(), ClientApp()
    server.main()(server_main)
    client.train()(client_train)
    client.train(SECAGG.split(".", 1)[1])(client_secagg)
    client.train(CHARGE_TYPE.split(".", 1)[1])(client_charge)
    client.query()(client_identify)
    return server, client


def __getattr__(name):  # flwr is imported when a Flower component is looked up, not when privfl.flower.app is
    if name in ("server_app", "client_app"):
        server, client = _apps()
        globals().update(server_app=server, client_app=client)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- the Flower app directory -------------------------------------------------------------------------------------

APP_MODULE = "privfl_flower_app"


def write_app(directory: str, spec: RunSpec, *, result_path: str = "", test_path: str = "",
              data_path_template: str = "", ledger_path_template: str = "") -> str:
    """Write a Flower app (``pyproject.toml`` and a two-line module) that runs ``spec`` with privfl's ServerApp and
    ClientApp; ``flwr run DIRECTORY CONNECTION`` ships it to the SuperLink. privfl must be installed where the
    SuperLink and SuperNodes run (the app declares no dependencies, so nothing is installed at run time).
    The path templates (``{partition-id}`` in them) serve SuperNodes without data-path / ledger-path in their node
    config: the Simulation Engine's."""
    os.makedirs(directory, exist_ok=True)
    # TOML basic strings share JSON's escapes, so json.dumps of a string is a valid TOML string.
    config = {SPEC_KEY: spec.to_json(), RESULT_KEY: result_path, TEST_KEY: test_path,
              TEMPLATE_KEYS[DATA_KEY]: data_path_template, TEMPLATE_KEYS[LEDGER_KEY]: ledger_path_template}
    lines = [
        "[build-system]", 'requires = ["hatchling"]', 'build-backend = "hatchling.build"', "",
        "[project]", 'name = "privfl-run"', 'version = "1.0.0"', 'description = "A privfl run on Flower"',
        'license = "Apache-2.0"', "dependencies = []", "",
        "[tool.hatch.build.targets.wheel]", 'packages = ["."]', "",
        "[tool.flwr.app]", 'publisher = "privfl"', "",
        "[tool.flwr.app.components]", f'serverapp = "{APP_MODULE}:server_app"',
        f'clientapp = "{APP_MODULE}:client_app"', "", "[tool.flwr.app.config]",
        *(f"{key} = {json.dumps(value)}" for key, value in config.items()), "",
    ]
    with open(os.path.join(directory, "pyproject.toml"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(directory, f"{APP_MODULE}.py"), "w") as f:
        f.write('"""privfl\'s Flower components (see privfl.flower.app)."""\n\n'
                "from privfl.flower import app as _privfl\n\n"
                "server_app = _privfl.server_app  # flwr finds components by assignment (it reads this file's AST)\n"
                "client_app = _privfl.client_app\n")
    return directory


__all__ = ["DeploymentError", "RunSpec", "client_seed", "client_train", "read_result",
           "runs_on_flower", "server_main", "write_app"]
