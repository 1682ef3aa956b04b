"""A privfl ServerApp and ClientApp on Flower's Message API (flwr 1.41): every registered algorithm — FedAvg, FedProx,
DP-FedAvg, DP-SGD FedAvg, FOLA, HBFL, FedBNN and FedBNR with its phases (:func:`runs_on_flower`) — across machines,
one SuperNode per organisation. A client's own state (HBFL's local model,
FedBNN's personalised BNN) is kept as a message in its SuperNode's ``Context.state`` between rounds and never leaves
it; the metrics of those models (``local_metrics``) are not reported to the server. The run spec carries the
algorithm's options (``RunSpec.options``, given to ``make_algorithm`` on both halves) and, for FedBNN, the public
alignment set's SHA-256 (``RunSpec.alignment_digest``; labels never read): the server reads the file at
``RunSpec.alignment_path``, each SuperNode its own copy at its node config's ``alignment-path``
(:func:`_node_alignment`).

Restart and resume: every run starts by asking each SuperNode which rounds of the run id its own ledger has released
(:func:`_identify`), and runs from the first round after all of them, so a second ``flwr run`` of a run id (after a
SuperNode was killed and restarted with the same ledger) never asks for a round twice; a client refuses a round its
ledger has released, and each ledger refuses the rounds that would take it past its budget (the client sits out).
A run id whose rounds are all released is refused with a message naming it, and so is a resume with seeded central
noise (the server's generator would redraw noise already used); with seeded local or distributed noise each client
refuses to go on if its saved generators are older than its ledger's charges (:func:`_check_seeded_resume`). A launch
with ``pause-after=N`` in its run config stops the run after N rounds (the plan stays that of all its rounds) for a
later launch of the run id to resume. After every round the ServerApp checkpoints the server half's
state (:meth:`privfl.algorithms.base.FederatedAlgorithm.checkpoint`: the broadcast state and what the server step
carries beyond it) to the run config's ``checkpoint-path`` (default: the result path with ".checkpoint" added), and
each ClientApp keeps its generators and its client's own state in a client-state file beside its ledger: a resumed
run id continues from the last aggregated global state (:func:`_resume_from`; rounds released after it but never
aggregated stay charged) with the clients' generators where they left them, so a resumed seeded non-private run
equals the uninterrupted one. An algorithm whose server keeps more than it declares (FedBNR) is not resumed.

The server half (:func:`server_main`) sets the algorithm up from the run's public facts, builds the run plan
(``privfl.core.plan.RunPlan``), and each round sends the algorithm's :class:`privfl.algorithms.base.Broadcast`, receives
only :class:`privfl.core.release.Release` values and weights, sums them with :func:`privfl.core.aggregation.weighted_sums` and
calls ``server_update``. The client half (:func:`client_train`) runs in the organisation's SuperNode: it builds its
own client half from the public run specification (checking that its plan's noise equals the server's), takes the
broadcast, trains on its own data (node config ``data-path``), and releases through its own
:class:`privfl.core.release.ReleasePipeline`, charging its own SQLite ledger (node config ``ledger-path``), which refuses
to release past the budget. It returns the releases and its audit summary; nothing else leaves it.

Seeds are the run plan's streams (``privfl.core.plan.seed_stream``: setup, sampling, server, clients, secure
aggregation), and a client's generators are kept between rounds in its Flower ``Context.state``, so a run with
seeded noise releases exactly what the in-process runtime with ``executor="per_client"`` releases.

Placements: ``local`` (each client noises its own release) and ``central`` (the ServerApp adds the noise to the sum,
a trusted aggregator, as in the simulation), and, under secure aggregation, ``distributed``.

Secure aggregation (``RunSpec.secure``, a :class:`privfl.privacy.secure.SecureAggregation`): each round runs privfl's own protocol (``secure_agg``) as Flower message rounds (:func:`_secure_round`): the training
message carries the round's public session configuration and the client answers with its advertised keys and its
release headers (never a value); then share keys, masked input and unmask are ``train.secagg`` messages. The
client's step is the in-process runtime's (``privfl.privacy.secure.encode_for_secure_sum``, with the client's own generator
kept in its Context.state, as are its session's secrets between stages); the server unmasks only the sum. A SuperNode
that fails a stage is a dropout, recovered from the survivors' shares, or the round aborts revealing nothing. Its
ledger rows are charged at training and marked released just before its masked input leaves, and the client state
the round's training left is kept only then (until then it waits with the session, so a replayed round trains again
from the state kept before it). Against an active
server (``malicious=True``, the default of ``SecureAggregation``), each SuperNode signs with its own identity key and
trusts only its federation file, both in its node config (``privfl.flower.identity``): the registry of the
organisations' keys and the threat model it derives degree, threshold and floor from; the consistency round runs
between masked input and unmask. ``malicious=False`` trusts the server to follow the protocol (and Flower's node
authentication to authenticate the clients); a SuperNode that holds an identity key refuses it.

Multi-phase algorithms (FedBNR with ``kernel_rounds > 0``: kernel learning, then Bayesian linear regression;
``privfl.algorithms.base.phases_of``) run as the in-process :class:`privfl.runtime.engine.PhasedSimulation` runs them, with
its logic (``privfl.runtime.phases``): the ServerApp runs each phase as a run of its own (its plan, its seed streams, its
noise) and hands the phase's trained server half to the next (:func:`privfl.runtime.phases.run_phases`); each phase is
charged in the ledger run ``<run id>-<phase>`` of every SuperNode's own ledger, under the phase's share of the
budget, and the SuperNodes report their epsilon composed over the phases so far. Every message of a phase names it
and carries the final server state of the phases before it (their last broadcasts: post-processing of what was
released), from which the ClientApp rebuilds the phase exactly as the server built it (:func:`privfl.runtime.phases.phase_at`)
and serves its client half. A multi-phase run is not resumed (the earlier phases' server halves are not
checkpointed): a run id with released rounds is refused.

Not yet here (issue 13): client sampling under secure aggregation, FedBNR-KD (its server-held labelled distillation set is
not in the spec).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass

import numpy as np

from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.errors import ConfigurationError
from privfl.flower.records import MessageError, from_bytes, from_record, to_bytes, to_record
from privfl.flower.launch import LOG_RESULT_KEY, result_lines
from privfl.core.public import SEEDED_NOISE_WARNING, PublicFacts, client_sampler


def _flwr_log(level: str, message: str, *args) -> None:
    """A line in Flower's log stream (what ``flwr run --stream`` and ``flwr log`` show); flwr is imported on use, as
    everywhere in this module. ``level``: "INFO" or "WARNING"."""
    import logging

    from flwr.common.logger import log

    log(getattr(logging, level), message, *args)


def runs_on_flower(algorithm: str) -> bool:
    """Whether ``algorithm`` runs on Flower: it is registered and its halves can be apart (``splittable``: its client
    step reads only its broadcast, possibly empty, and its own client state). An algorithm that needs a public
    alignment set (FedBNN) gets it from the spec's ``alignment_path``; a multi-phase one (FedBNR with kernel rounds)
    runs phase after phase. Every registered algorithm does."""
    from privfl.algorithms import ALGORITHMS

    cls = ALGORITHMS.get(algorithm)
    return cls is not None and cls.splittable


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
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):  # e.g. FedBNR's kernel_options
        return {k: _option_value(f"{name}.{k}", v) for k, v in sorted(value.items())}
    raise ConfigurationError(f"the run spec carries algorithm options as JSON values (numbers, strings, booleans, "
                             f"lists and mappings of them); option {name!r} is {value!r}")


def _file_digest(path: str) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
#: run-config keys (Flower ``[tool.flwr.app.config]``) and node-config keys (``flower-supernode --node-config``)
SPEC_KEY, RESULT_KEY, TEST_KEY = "privfl-spec", "result-path", "test-path"
#: run-config key: true when the test file holds the clients' own held-out records (a simulation's split, never
#: charged), so in a private run no metric on it may decide when the run stops (privfl.runtime.rounds.divergence)
TEST_FROM_CLIENTS_KEY = "test-from-clients"
#: run-config key: where the ServerApp keeps the global state after each aggregated round (default: the result path
#: with ".checkpoint" added); a resumed run id continues from it
CHECKPOINT_KEY = "checkpoint-path"
#: run-config key: end this launch after that many rounds of the run (0: run them all); the run keeps the plan of all
#: its rounds, and launching its run id again resumes it (an operator's pause, e.g. for a maintenance window)
PAUSE_KEY = "pause-after"
#: run-config key: JSON list of the files (in the written app) that register the run's own algorithms
MODULES_KEY = "algorithm-modules"
PARTITION_KEY, DATA_KEY, LEDGER_KEY = "partition-id", "data-path", "ledger-path"
#: node-config key: where this SuperNode reads a run's public alignment set (FedBNN's), the organisation's own copy;
#: the run's spec carries only its SHA-256 for the node (see :func:`_node_alignment`)
ALIGNMENT_KEY = "alignment-path"
#: run-config paths with ``{partition-id}`` for SuperNodes whose node config has no paths (the Simulation Engine's
#: virtual SuperNodes only know their partition-id)
TEMPLATE_KEYS = {DATA_KEY: "data-path-template", LEDGER_KEY: "ledger-path-template"}
#: Flower message type of a round and privfl message kinds
TRAIN = "train"
BROADCAST, REPLY, RESULT, CLIENT_STATE = "privfl.broadcast", "privfl.reply", "privfl.result", "privfl.client-state"
CHECKPOINT, CLIENT_STATE_FILE = "privfl.checkpoint", "privfl.client-state-file"
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
    #: secure aggregation (``privfl.privacy.secure.SecureAggregation``, semi-honest variant): each round then runs
    #: secure_agg's stages as Flower message rounds; None: plaintext releases
    secure: object = None
    #: the algorithm's options (``privfl.algorithms.algorithm_options``, e.g. FedBNN's ``warmup_epochs``), given to
    #: ``make_algorithm`` on the server and on every client: a mapping of JSON values, kept as sorted (name, value)
    options: tuple = ()
    #: a public alignment set (FedBNN's AD): an ``.npz`` whose array ``x`` holds its inputs (any labels in it are
    #: never read). ``alignment_path`` is where the *server* reads it; ``alignment_digest`` is its SHA-256, filled in
    #: when the spec is built. A SuperNode never reads the spec's path (the server's side writes the run config, and
    #: a path it chose could name the organisation's own data file): it reads its own copy at its node config's
    #: ``alignment-path`` (:data:`ALIGNMENT_KEY`) and refuses the run unless that file has this digest
    alignment_path: str | None = None
    alignment_digest: str = ""
    #: the organisations' identity public keys, (partition id, hex) pairs, for the malicious-server variant of
    #: secure aggregation (``privfl.flower.identity``): the ServerApp checks the signatures it forwards with them.
    #: Clients never read them from here: each trusts its own federation file, agreed out of band.
    identities: tuple = ()
    #: plaintext rounds: how many organisations must reply for a round to complete with the survivors (a SuperNode
    #: that fails or does not reply in time is left out of that round, named in the log, and asked again the next
    #: round); None: every organisation must reply, and a missing one stops the run. Under secure aggregation the
    #: protocol's own dropout recovery decides.
    min_replies: int | None = None
    #: SuperNode authentication (Flower's ``--enable-supernode-auth``): each organisation's registered key, as
    #: (partition id, :func:`privfl.flower.identity.node_key_digest`) pairs naming every partition. The ServerApp
    #: then asks only the SuperNodes whose authenticated key is declared, and refuses one whose node config claims
    #: another partition than its key's (before anything is charged); () trusts each node config's partition-id.
    node_keys: tuple = ()

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
        try:
            identities = tuple(sorted((int(p), str(k)) for p, k in (self.identities.items() if isinstance(
                self.identities, dict) else self.identities)))
        except (TypeError, ValueError):
            raise ConfigurationError(f"identities must be (partition id, public key hex) pairs, got "
                                     f"{self.identities!r}") from None
        object.__setattr__(self, "identities", identities)
        try:
            node_keys = tuple(sorted((int(p), str(k).lower()) for p, k in (self.node_keys.items() if isinstance(
                self.node_keys, dict) else self.node_keys)))
        except (TypeError, ValueError):
            raise ConfigurationError(f"node_keys must be (partition id, SHA-256 hex of the SuperNode's public key) "
                                     f"pairs, got {self.node_keys!r}") from None
        if node_keys and ([p for p, _ in node_keys] != list(range(self.n_clients))
                          or len({k for _, k in node_keys}) != len(node_keys)
                          or not all(len(k) == 64 and all(c in "0123456789abcdef" for c in k) for _, k in node_keys)):
            raise ConfigurationError(f"node_keys must name each partition 0..{self.n_clients - 1} once, each with its "
                                     f"own key's SHA-256 (privfl.flower.identity.node_key_digest), got "
                                     f"{list(node_keys)}")
        object.__setattr__(self, "node_keys", node_keys)
        bad = sorted({k for k, _ in options} - set(algorithm_options(self.algorithm)))
        if bad or len({k for k, _ in options}) != len(options):
            raise ConfigurationError(f"{self.algorithm} takes no option {bad} (or an option twice); its options are "
                                     f"{list(algorithm_options(self.algorithm))}")
        if dict(options).get("kernel_aggregation") == "distillation":
            raise ConfigurationError(f"{self.algorithm}: kernel distillation (FedBNR-KD) needs the server's own "
                                     f"labelled distillation set, which the Flower runtime does not carry yet; use "
                                     f"kernel_aggregation='fedavg' or run it in process")
        if getattr(ALGORITHMS[self.algorithm], "uses_alignment", False) and not self.alignment_path:
            raise ConfigurationError(f"{self.algorithm} needs a public alignment set on Flower: give the spec "
                                     f"alignment_path, an .npz with its inputs x that the server and every SuperNode "
                                     f"can read")
        if self.alignment_digest:
            # a spec read from JSON (the run config, on either side) carries the digest: no file is read here; the
            # file a party uses is checked against it when it is loaded (load_alignment)
            if not (isinstance(self.alignment_digest, str) and len(self.alignment_digest) == 64
                    and all(c in "0123456789abcdef" for c in self.alignment_digest)):
                raise ConfigurationError(f"alignment_digest must be the SHA-256 (64 lower-case hex digits) of the "
                                         f"alignment set, got {self.alignment_digest!r}")
            if not self.alignment_path:
                raise ConfigurationError("the spec has an alignment_digest but no alignment_path")
        elif self.alignment_path:  # the building side (the coordinator's own file): its digest, its shape checked
            try:
                digest = _file_digest(self.alignment_path)
            except OSError as exc:
                raise ConfigurationError(f"cannot read the alignment set {self.alignment_path!r}: {exc}") from None
            object.__setattr__(self, "alignment_digest", digest)
            load_alignment(self.alignment_path, self)
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
        if self.min_replies is not None and (type(self.min_replies) is not int
                                             or not 1 <= self.min_replies <= self.n_clients):
            raise ConfigurationError(f"min_replies must be an integer in [1, {self.n_clients}] or None, got "
                                     f"{self.min_replies!r}")
        for name in ("node_wait", "round_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigurationError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        if self.torch_threads is not None and (type(self.torch_threads) is not int or self.torch_threads < 1):
            raise ConfigurationError(f"torch_threads must be an integer >= 1 or None, got {self.torch_threads!r}")
        self._facts(None)  # validates the facts

    @classmethod
    def of(cls, algorithm: str, data, fed: FederationConfig, privacy: PrivacyConfig, *, run_id: str | None = None,
           **kwargs) -> "RunSpec":
        """The spec of a run on ``data`` (a FederatedData), with the public facts the in-process runtime derives."""
        public = PublicFacts.of(data, privacy, fed)
        return cls(algorithm, fed, privacy, public.n_clients, public.task, public.num_classes, public.input_shape,
                   public.client_size, public.client_sizes, public.record_cap, public.name,
                   run_id or f"{algorithm}-eps{privacy.epsilon:g}-seed{fed.seed}", **kwargs)

    def public_facts(self, test=None) -> PublicFacts:
        """The run's public facts, with its alignment set read from ``alignment_path`` and checked against
        ``alignment_digest`` (a ClientApp first puts its node config's own path there: :func:`_node_alignment`)."""
        alignment = load_alignment(self.alignment_path, self) if self.alignment_path else None
        return self._facts(alignment, test)

    def _facts(self, alignment, test=None) -> PublicFacts:
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
            d["identities"] = tuple((p, k) for p, k in d.get("identities", ()))
            d["node_keys"] = tuple((p, k) for p, k in d.get("node_keys", ()))
            if d.get("alignment_path") and not d.get("alignment_digest"):
                # refused before anything reads the path: a spec built by RunSpec(...) always carries the digest
                raise ConfigurationError(f"the run config's {SPEC_KEY!r} names an alignment set without its SHA-256 "
                                         "(alignment_digest); refused")
            if d.get("secure") is not None:
                from privfl.privacy.secure import SecureAggregation

                d["secure"] = SecureAggregation(**d["secure"])
            return cls(fed=FederationConfig(**fed), privacy=PrivacyConfig(**privacy), **d)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, ConfigurationError):
                raise
            raise ConfigurationError(f"the run config's {SPEC_KEY!r} is not a privfl run spec: {exc}") from None


#: run-config keys a coordinator may override with ``flwr run ... --run-config "rounds=5 epsilon=3.0 run-id='b'"``
#: (their app defaults, 0 and "", mean "as the spec says"); the server and every client apply the same overrides
OVERRIDE_KEYS = ("rounds", "epsilon", "run-id")


def import_algorithm_modules(run_config, import_new: bool = True) -> None:
    """Import the files that register the run's own algorithms (``write_app(modules=...)``), once per process:
    the app module imports them where Flower loads it (a SuperNode of the Deployment Engine), but the Simulation
    Engine loads the ClientApp once and hands the object to its Ray workers, which then only import privfl.

    The run config comes from whoever starts the run, so it may name only what the app itself brought: a module the
    app module already imported (by its name), or a ``.py`` file in a folder that holds the app module
    (``privfl_flower_app.py``, which ``write_app`` writes beside its copies). Anything else, such as a script elsewhere
    on a SuperNode's disk or an installed module the app never imported, is refused, not imported. With
    ``import_new=False`` (a SuperNode that trusts no server: :func:`_distrusts_server`) only modules the app module
    already imported are accepted: the app privfl's worker checked (``privfl.flower.warm``) imports every module it
    brings, and a file elsewhere on the node (an earlier app's folder) is never imported on the run config's word."""
    import importlib.util
    import sys

    raw = run_config.get(MODULES_KEY, "") or "[]"
    try:
        paths = json.loads(str(raw))
    except ValueError:
        paths = None
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise ConfigurationError(f"the run config's {MODULES_KEY!r} is not a JSON list of file paths")
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        if name in sys.modules:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not import_new:
            raise ConfigurationError(f"the run's algorithm module {path!r} is not imported by the app, and this "
                                     "SuperNode trusts no server (it holds a federation file): refusing to import it")
        if not (path.endswith(".py") and os.path.isfile(path)
                and os.path.isfile(os.path.join(folder, f"{APP_MODULE}.py"))):
            raise ConfigurationError(f"the run's algorithm module {path!r} is neither imported by the app nor a .py "
                                     f"file inside a privfl app folder (beside {APP_MODULE}.py); refusing to import "
                                     "it (write the app with write_app(modules=[...]))")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise


def read_run_spec(run_config, import_new: bool = True) -> "RunSpec":
    """The run's spec from a Flower run config: the ``privfl-spec`` JSON with the overrides of :data:`OVERRIDE_KEYS`
    applied (``--run-config``), validated again. A new epsilon or round count with the same run id is refused by the
    ledgers that already hold the run: give it a new ``run-id`` too. ``import_new``: see
    :func:`import_algorithm_modules`."""
    import_algorithm_modules(run_config, import_new)
    spec = RunSpec.from_json(str(run_config[SPEC_KEY]))
    rounds, epsilon, run_id = (run_config.get(k) for k in OVERRIDE_KEYS)
    try:
        fed = spec.fed if rounds in (None, 0, "") else dataclasses.replace(spec.fed, rounds=int(rounds))
        privacy = (spec.privacy if epsilon in (None, 0, 0.0, "") else
                   dataclasses.replace(spec.privacy, epsilon=float(epsilon)))
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"--run-config: {exc}") from None
    if fed is spec.fed and privacy is spec.privacy and not run_id:
        return spec
    return dataclasses.replace(spec, fed=fed, privacy=privacy, run_id=str(run_id) if run_id else spec.run_id)


def _check_secure(spec: "RunSpec") -> None:
    """Refuse up front a secure-aggregation setting the deployment cannot run safely."""
    from privfl.privacy.secure import SecureAggregation

    sec = spec.secure
    if not isinstance(sec, SecureAggregation):
        raise ConfigurationError(f"secure must be a privfl.privacy.secure.SecureAggregation or None, got {sec!r}")
    if sec.malicious and [p for p, _ in spec.identities] != list(range(spec.n_clients)):
        raise ConfigurationError("the malicious-server variant of secure aggregation needs every organisation's "
                                 "identity public key: give RunSpec(identities=...) (privfl.flower.identity."
                                 "make_identities, or each organisation's write_identity), and start each SuperNode "
                                 "with identity-key and federation in its node config; or use "
                                 "SecureAggregation(malicious=False), which trusts the server to be honest")
    if not spec.privacy.private:
        raise ConfigurationError("secure aggregation on Flower needs a private run: a non-private run's ranges (and "
                                 "weights, its record counts) are not public facts; set an epsilon or turn secure "
                                 "aggregation off")
    sec.check(spec.n_clients)


def client_seed(seed: int, client: int) -> np.random.SeedSequence:
    """Client ``client``'s stream of the run plan (``privfl.core.plan.seed_stream``), as the in-process runtime uses it."""
    from privfl.core.plan import seed_stream

    return seed_stream(seed, "clients", client)


def _noise(privacy: PrivacyConfig, seq: np.random.SeedSequence):
    from privfl.mechanisms import SecureNoise, SeededNoise

    return SecureNoise() if privacy.secure_noise else SeededNoise(np.random.default_rng(seq))


def _run_plan(alg, spec: RunSpec):
    """The run plan (``privfl.core.plan.RunPlan``: channels as charged, noise multipliers, placement, distributed-noise
    plans), built from the public spec exactly as the in-process runtime builds it."""
    from privfl.core.plan import RunPlan

    return RunPlan.build(alg, spec.privacy, spec.fed, alg.public, spec.secure)


def _encodings(plan, spec: RunSpec):
    """Each channel's secure-aggregation encoding, from the plan and the public facts only: the server and every
    client compute the same (``privfl.privacy.secure.channel_encodings``)."""
    from privfl.privacy.secure import channel_encodings, local_noise_stds, public_weight_bound

    return channel_encodings(plan.channels, spec.secure, n_clients=spec.n_clients,
                             local_stds=local_noise_stds(plan.channels, plan.placement, plan.noise_multipliers),
                             weight_bound=public_weight_bound(spec.privacy, spec.public_facts()),
                             distributed=plan.distributed)


def _setup_seq(spec: RunSpec) -> np.random.SeedSequence:
    from privfl.core.plan import seed_stream

    return seed_stream(spec.fed.seed, "setup")


def _algorithm(spec: RunSpec):
    """The run's algorithm as the user builds it (not set up: a multi-phase one sets up each phase instead)."""
    from privfl.algorithms import make_algorithm

    return make_algorithm(spec.algorithm, spec.fed, spec.privacy, **spec.algorithm_options())


def _setup(spec: RunSpec, test=None):
    alg = _algorithm(spec)
    alg.setup(spec.public_facts(test), np.random.default_rng(_setup_seq(spec)))
    return alg


@dataclass(frozen=True)
class PhaseOf:
    """Where a message of a multi-phase run belongs: ``phase`` (its algorithm set up), its ``index``, and ``run``,
    the spec of the whole run (the phase's own spec is :func:`phase_spec`)."""

    phase: object  # privfl.algorithms.base.Phase
    index: int
    run: RunSpec

    @property
    def name(self) -> str:
        return self.phase.name


def phase_spec(spec: RunSpec, phase) -> RunSpec:
    """The spec of one phase of the run ``spec``: its federation configuration (rounds, seed), its share of the
    budget and its ledger run ``<run id>-<phase>``; everything else is the run's."""
    from privfl.runtime.phase_ledgers import phase_run_id

    return dataclasses.replace(spec, fed=phase.fed, privacy=phase.privacy, run_id=phase_run_id(spec.run_id,
                                                                                                  phase.name))


def _party(spec: RunSpec, info, test=None):
    """What a message of the run ``spec`` asks a party to serve: ``(spec, algorithm set up, None)`` for a one-phase
    run, or, for a multi-phase run, ``(the phase's spec, the phase's algorithm set up, PhaseOf)``, the phase
    (``info``: its name, index and the final states of the phases before it) rebuilt as the server built it
    (:func:`privfl.runtime.phases.phase_at`)."""
    from privfl.algorithms.base import is_phased
    from privfl.runtime.phases import phase_at, setup_phase

    top = _algorithm(spec)
    if not is_phased(top):
        if info is not None:
            raise DeploymentError(f"run {spec.run_id!r}: {spec.algorithm} has one phase, and the server sent a "
                                  f"message of phase {info.get('name')!r}")
        top.setup(spec.public_facts(test), np.random.default_rng(_setup_seq(spec)))
        return spec, top, None
    if not isinstance(info, dict) or not {"name", "index", "handed_over"} <= set(info):
        raise DeploymentError(f"run {spec.run_id!r}: {spec.algorithm} runs as phases {list(top.phase_plan)}, and a "
                              f"message named none")
    public = spec.public_facts(test)
    phase = phase_at(top, public, info["index"], list(info["handed_over"]))
    if phase.name != info["name"]:
        raise DeploymentError(f"run {spec.run_id!r}: phase {info['index']} is {phase.name!r} here, the server sent "
                              f"{info['name']!r}; run one privfl version")
    setup_phase(phase, public)
    return phase_spec(spec, phase), phase.algorithm, PhaseOf(phase, int(info["index"]), spec)


def _state_key(key: str, phased: PhaseOf | None) -> str:
    """A Context.state key, one per phase: each phase's generators and client state start afresh, as each phase
    of the in-process runtime is a run of its own."""
    return key if phased is None else f"{key}.{phased.name}"


def load_dataset(path: str, spec: RunSpec, partition: int | None = None):
    """An organisation's data: an ``.npz`` file holding ``x`` and ``y`` (privfl's ArrayDataset layout), or a Flower
    Datasets source (``flwr-datasets:...``, :mod:`privfl.data.flower_datasets`; ``partition``: this node's
    partition id, for a source partitioned over the run's clients), checked against the spec's input shape.

    A record the run cannot use (a feature not finite in float32, a label outside the spec's classes, ...) is left
    out with a warning in this node's own log (:func:`privfl.data.flower_datasets.usable_records`), never a failure:
    a review found one such record turned the charged release into an uncharged error reply, so the server told a
    data set from its neighbour with certainty, as often as it liked. Only the file's layout (readable, ``x`` at least
    2-D, as many labels as records) can still fail."""
    from privfl.data import ArrayDataset
    from privfl.data.flower_datasets import is_flower_dataset, load_partition, usable_records

    if is_flower_dataset(path):
        data = load_partition(path, partition_id=partition, num_partitions=spec.n_clients, task=spec.task,
                              num_classes=spec.num_classes, name=f"partition-{partition}",
                              input_shape=spec.input_shape)
        if tuple(data.x.shape[1:]) != tuple(spec.input_shape):
            raise ConfigurationError(f"{path!r} gives inputs of shape {tuple(data.x.shape[1:])}; the run's inputs "
                                     f"have shape {tuple(spec.input_shape)} (choose the feature columns with x=)")
        return data
    try:
        with np.load(path, allow_pickle=False) as f:
            x, y = f["x"], f["y"]
    except (OSError, KeyError, ValueError) as exc:
        raise ConfigurationError(f"cannot read the data file {path!r} ({exc}); give an .npz with arrays x and y"
                                 ) from None
    name = os.path.basename(path)
    x, y, _ = usable_records(x, y, spec.task, spec.num_classes, name)
    return ArrayDataset(x, y, spec.task, spec.num_classes, name)


def load_alignment(path: str, spec: RunSpec):
    """The public alignment set: the inputs ``x`` of an ``.npz`` (its labels, if any, are never read: the dataset's
    targets are zeros), checked against the spec's SHA-256 (``alignment_digest``, when it has one) and input shape."""
    from privfl.data import ArrayDataset

    if spec.alignment_digest:
        try:
            digest = _file_digest(path)
        except OSError as exc:
            raise ConfigurationError(f"cannot read the alignment set {path!r}: {exc}") from None
        if digest != spec.alignment_digest:
            raise ConfigurationError(f"the alignment set at {path!r} is not the one this run was planned with "
                                     f"(SHA-256 {digest}, the spec says {spec.alignment_digest}); give every party "
                                     f"the same file")
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
    from privfl.core.release import Release

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
    secure aggregation each round's sums come from the protocol's stages (:func:`_secure_round`). A multi-phase
    algorithm runs phase after phase (:func:`privfl.runtime.phases.run_phases`), each phase such a run of its own."""
    from privfl.algorithms.base import is_phased

    spec = read_run_spec(context.run_config)
    test_path = str(context.run_config.get(TEST_KEY, "") or "")
    test = load_dataset(test_path, spec) if test_path else None
    test_private = bool(context.run_config.get(TEST_FROM_CLIENTS_KEY, False)) and spec.privacy.private
    top = _algorithm(spec)
    phased = is_phased(top)
    nodes = _wait_for_nodes(grid, spec.n_clients, spec.node_wait)
    bound = _bind_nodes(grid, spec)
    if bound is not None:
        nodes = sorted(bound)  # only the SuperNodes whose authenticated key the spec declares are asked anything
    audits, node_client = {}, {}
    node_of, first_round = _identify(grid, spec, nodes, node_client, bound)
    pause = _pause_after(context.run_config, spec, first_round, phased)
    _check_resume(spec, first_round, phased=phased)
    if phased:
        from privfl.runtime.phases import final_state, run_phases, setup_phase

        public = spec.public_facts(test)
        history, phases, handed_over = [], [], []

        def run_phase(index: int, phase):
            setup_phase(phase, public)
            info = {"name": phase.name, "index": index, "handed_over": list(handed_over)}
            part = phase_spec(spec, phase)
            rounds, multipliers = _serve(grid, part, phase.algorithm, nodes, node_of, node_client, 0, test, audits,
                                         info, test_private=test_private)
            offset = sum(p["rounds"] for p in phases)  # the run's history numbers the phases' rounds in a row
            history.extend({**h, "round": offset + h["round"], "phase": phase.name} for h in rounds)
            handed_over.append(final_state(phase, phase.algorithm))
            phases.append({"name": phase.name, "run_id": part.run_id, "rounds": phase.fed.rounds,
                           "epsilon_target": phase.privacy.epsilon, "noise_multipliers": multipliers,
                           "state": handed_over[-1]})
            return phase.algorithm

        run_phases(top, public, run_phase)
        state, multipliers = handed_over[-1], {p["name"]: p["noise_multipliers"] for p in phases}
    else:
        alg = _setup(spec, test)
        checkpoint = checkpoint_path(context.run_config)
        if first_round:
            _resume_from(checkpoint, spec, alg, first_round)
        history, multipliers = _serve(grid, spec, alg, nodes, node_of, node_client, first_round, test, audits,
                                      checkpoint=checkpoint, last_round=pause, test_private=test_private)
        state, phases = dict(alg.broadcast(spec.fed.rounds).values), None
    result_path = str(context.run_config.get(RESULT_KEY, "") or "")
    in_log = bool(context.run_config.get(LOG_RESULT_KEY, False))
    if result_path or in_log:
        result = {"run_id": spec.run_id, "state": state, "history": history, "audits": audits,
                  "noise_multipliers": multipliers, "start_round": first_round}
        if phases is not None:
            result["phases"] = phases
        if pause is not None:
            result["paused_after"] = pause
        data = to_bytes(result, RESULT)
        if result_path:
            tmp = f"{result_path}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, result_path)  # the result appears whole or not at all
        if in_log:  # the coordinator's copy, through Flower's log stream (privfl.flower.launch --result)
            for line in result_lines(data):
                _flwr_log("INFO", "%s", line)


def _pause_after(run_config, spec: RunSpec, first_round: int, phased: bool) -> int | None:
    """The round before which this launch pauses the run (run config ``pause-after``; None: it runs to the end)."""
    raw = run_config.get(PAUSE_KEY, 0) or 0
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise DeploymentError(f"{PAUSE_KEY} must be a whole number of rounds >= 0 (0: no pause), got {raw!r}")
    if raw == 0 or raw >= spec.fed.rounds:
        return None
    if phased:
        raise DeploymentError(f"run {spec.run_id!r}: a multi-phase run is not resumed, so it cannot pause; drop "
                              f"{PAUSE_KEY}")
    if raw <= first_round:
        raise DeploymentError(f"run {spec.run_id!r}: {PAUSE_KEY}={raw}, but the run has already released rounds up "
                              f"to {first_round - 1}: nothing to run before the pause; raise it or drop it")
    return raw


def _serve(grid, spec, alg, nodes, node_of, node_client, first_round, test, audits, phase=None, checkpoint="",
           last_round: int | None = None, test_private: bool = False):
    """Rounds ``first_round..`` of one run, or of one phase (``spec`` is then the phase's, ``phase`` the name, index
    and handed-over states every message of the phase carries): the plan and the seed streams as the in-process
    runtime builds them, and its round loop (:func:`privfl.runtime.rounds.run_rounds`) over Flower's messages
    (:class:`FlowerRounds`). With ``checkpoint`` (a path) the server's state is written there after every round
    (:func:`write_checkpoint`); ``last_round``: pause before that round (:func:`_pause_after`); ``test_private``: the
    test file holds the clients' own held-out records in a private run (run config ``test-from-clients``), so no
    metric on it decides when the run stops. Returns (the rounds' history, the plan's noise multipliers)."""
    from privfl.core.plan import seed_stream
    from privfl.runtime.rounds import run_rounds

    plan = _run_plan(alg, spec)
    transport = FlowerRounds(grid, spec, alg, plan, nodes, node_of, node_client, audits, phase)
    sampler = None
    if spec.privacy.sampling_rate < 1:  # the CSPRNG unless seeded on purpose: then the run plan's stream
        secure = spec.privacy.secure_noise and spec.privacy.private  # a non-private run claims nothing: seeded
        sampler = client_sampler(seed_stream(spec.fed.seed, "sample"), secure)
    history = []

    def on_round(record) -> None:
        history.append({"round": record.round, "participants": record.participants, "aborted": record.aborted,
                        "sat_out": list(record.sat_out), "metrics": record.metrics, "seconds": record.seconds,
                        "snr": dict(record.snr), "clip": record.clip})
        _log_round(spec, history[-1], audits, phase)
        if checkpoint:
            write_checkpoint(checkpoint, spec, alg, record.round)

    run_rounds(alg, transport, n_clients=spec.n_clients, rounds=spec.fed.rounds, first_round=first_round,
               sampling_rate=spec.privacy.sampling_rate, sampler=sampler,
               evaluate=(lambda: alg.evaluate(test)) if test is not None else None, test=test, on_round=on_round,
               last_round=last_round, fixed_denominator=plan.amplified, test_private=test_private)
    if last_round is not None:
        _flwr_log("INFO", "privfl %s paused after round %d of %d (%s=%d): launch the run id again to resume it",
            spec.run_id, last_round, spec.fed.rounds, PAUSE_KEY, last_round)
    return history, plan.noise_multipliers


class FlowerRounds:
    """The Flower transport of :func:`privfl.runtime.rounds.run_rounds` (Deployment Engine and Simulation Engine
    alike): a round is the broadcast sent as Flower messages to the SuperNodes of the sampled clients, each of which
    trains, charges its own ledger and replies with its releases (:func:`_plain_round`), or the stages of secure
    aggregation as message rounds (:func:`_secure_round`); under amplification by sampling the SuperNodes of the
    clients left out charge their round first (:func:`_charge_round`)."""

    def __init__(self, grid, spec, alg, plan, nodes, node_of, node_client, audits, phase=None):
        from privfl.core.plan import seed_stream

        self.grid, self.spec, self.alg, self.plan = grid, spec, alg, plan
        self.nodes, self.node_of, self.node_client, self.audits, self.phase = nodes, node_of, node_client, audits, phase
        self.by_name = {c.name: c for c in plan.channels}
        self.server_noise = _noise(spec.privacy, seed_stream(spec.fed.seed, "server"))

    def _nodes(self, clients) -> list[int]:
        return [self.node_of[str(k)] for k in clients]

    def round(self, rnd, chosen, left_out):
        from privfl.core.aggregation import noise_only_sums
        from privfl.runtime.rounds import RoundOutcome

        spec, alg = self.spec, self.alg
        broadcast = {"round": rnd, "noise_multipliers": self.plan.noise_multipliers,
                     "values": dict(alg.broadcast(rnd).values), "phase": self.phase}
        refused = []
        if left_out and self.plan.amplified:
            refused = _charge_round(self.grid, spec, rnd, self._nodes(left_out), self.audits, self.node_client,
                                    self.phase)
        aborted = False
        if spec.secure is None:
            whole = not left_out and len(chosen) == spec.n_clients
            aggregates, participants, sat_out = _plain_round(
                self.grid, spec, rnd, self._nodes(chosen), broadcast, self.by_name, self.server_noise, self.audits,
                self.node_client, all_nodes=whole)
        else:
            aggregates, participants, sat_out, aborted = _secure_round(
                self.grid, spec, rnd, self._nodes(chosen), broadcast, self.plan, self.by_name, self.server_noise,
                self.audits, self.node_client)
        if aggregates is None and not aborted and spec.privacy.private and self.plan.amplified:
            # nobody sampled (or every sampled client sat out): the model still moves by the round's noise
            aggregates = noise_only_sums(self.plan.channels, self.plan.noise_multipliers, self.server_noise)
        return RoundOutcome(aggregates, participants, tuple(int(c) for c in [*refused, *sat_out]), aborted)

    def epsilons(self) -> list[float]:
        """The epsilon each organisation's ledger reported with its last reply."""
        return [float(a["epsilon"]) for a in self.audits.values() if a and a.get("epsilon") is not None]


def checkpoint_path(run_config) -> str:
    """The run's checkpoint path: the run config's ``checkpoint-path``, else its ``result-path`` with ".checkpoint"
    added, else none ("")."""
    path = str(run_config.get(CHECKPOINT_KEY, "") or "")
    if path:
        return path
    result = str(run_config.get(RESULT_KEY, "") or "")
    return f"{result}.checkpoint" if result else ""


def write_checkpoint(path: str, spec: RunSpec, alg, rnd: int) -> None:
    """Write the server half's state after round ``rnd`` (:meth:`FederatedAlgorithm.checkpoint`) to ``path``,
    whole or not at all, with the run id and algorithm it belongs to. Nothing in it is private: the global state
    is what every client is broadcast (and the server's own post-processing of the released sums)."""
    if not alg.checkpointable:
        return
    payload = {"run_id": spec.run_id, "algorithm": spec.algorithm, "round": int(rnd), "state": alg.checkpoint()}
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(to_bytes(payload, CHECKPOINT))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_checkpoint(path: str) -> dict:
    """A checkpoint :func:`write_checkpoint` wrote."""
    with open(path, "rb") as f:
        return from_bytes(f.read(), CHECKPOINT)


def _resume_from(path: str, spec: RunSpec, alg, first_round: int) -> None:
    """Restore the global state a resumed run continues from: the server's state after the last round it
    aggregated (its checkpoint), which may be older than the last round the ledgers released (a run that failed
    after the clients released a round and before the server aggregated it: that round's privacy cost stays spent,
    its aggregate is lost). Refused when the state cannot be known."""
    if not alg.checkpointable:
        raise DeploymentError(f"run {spec.run_id!r}: the ledgers have released rounds up to {first_round - 1}, and "
                              f"{spec.algorithm}'s server state is not checkpointed, so it cannot be resumed; give "
                              f"a new run a new run_id")
    if not path:
        raise DeploymentError(f"run {spec.run_id!r}: the ledgers have released rounds up to {first_round - 1}; "
                              f"resuming continues from the server's checkpoint, and this run has none (set "
                              f"result-path or checkpoint-path in the run config, as the first run did)")
    if not os.path.exists(path):
        _flwr_log("WARNING", "privfl %s: resuming at round %d from the initial global state: no round was "
            "aggregated before (no checkpoint at %s)", spec.run_id, first_round + 1, path)
        return
    try:
        saved = read_checkpoint(path)
    except (OSError, MessageError) as exc:
        raise DeploymentError(f"run {spec.run_id!r}: the checkpoint {path} cannot be read ({exc}); give a new run "
                              f"a new run_id") from exc
    if saved.get("run_id") != spec.run_id or saved.get("algorithm") != spec.algorithm:
        raise DeploymentError(f"run {spec.run_id!r}: the checkpoint {path} belongs to run {saved.get('run_id')!r} "
                              f"of {saved.get('algorithm')!r}; point checkpoint-path at this run's")
    last = int(saved["round"])
    if last >= first_round:
        raise DeploymentError(f"run {spec.run_id!r}: the checkpoint {path} is of round {last}, after the last round "
                              f"the ledgers released ({first_round - 1}): it is not this run's")
    alg.restore(saved["state"])
    if last < first_round - 1:
        _flwr_log("WARNING", "privfl %s: resuming at round %d from the global state after round %d; rounds %d..%d "
            "were released but never aggregated (their privacy cost stays spent)", spec.run_id, first_round + 1,
            last + 1, last + 2, first_round)


def _log_round(spec: RunSpec, record: dict, audits: dict, phase=None) -> None:
    """One line per round in Flower's log stream (what ``flwr run --stream`` and ``flwr log`` show): round,
    participants, who sat out, whether secure aggregation aborted it, the largest epsilon the organisations report
    having spent, each noised channel's privacy SNR (``privfl.runtime.rounds.privacy_snr``) and the round's
    seconds."""
    spent = [float(a["epsilon"]) for a in audits.values() if a and a.get("epsilon") is not None]
    name = f" phase {phase['name']}" if isinstance(phase, dict) and phase.get("name") else ""
    snr = "".join(f", SNR {k} {v:.3g}" for k, v in sorted(dict(record.get("snr") or {}).items()))
    _flwr_log("INFO", "privfl %s%s round %d/%d: %d participants, sat out %s%s, epsilon spent max %s (target %g)%s, "
        "%.2f s", spec.run_id, name, record["round"] + 1, spec.fed.rounds, record["participants"],
        record["sat_out"] or "none", ", ABORTED (nothing revealed)" if record["aborted"] else "",
        f"{max(spent):.4g}" if spent else "n/a", spec.privacy.epsilon, snr, record["seconds"])


#: seconds between two pulls of replies (flwr's ``Grid.send_and_receive`` waits 3 s, a round trip's worth of
#: latency in every message exchange of a round). The ServerApp's environment may set another with
#: ``PRIVFL_REPLY_POLL`` (an operator's setting, as Flower's own ``FLWR_*`` polls are: the ServerApp process gets
#: the SuperLink's environment); the run config and the spec do not carry it.
REPLY_POLL = 0.2
REPLY_POLL_ENV = "PRIVFL_REPLY_POLL"


def reply_poll() -> float:
    """:data:`REPLY_POLL`, or the seconds ``$PRIVFL_REPLY_POLL`` gives (0.01 to 60)."""
    raw = os.environ.get(REPLY_POLL_ENV, "").strip()
    if not raw:
        return REPLY_POLL
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.01 <= value <= 60:
        raise DeploymentError(f"{REPLY_POLL_ENV}={raw!r}: give the seconds between two pulls of replies, from 0.01 "
                              f"to 60, or unset it for {REPLY_POLL:g}")
    return value


def _send_and_receive(grid, messages, timeout: float, dest: dict | None = None) -> list:
    """``grid.send_and_receive`` with a short poll: push ``messages``, then pull the replies every
    :func:`reply_poll` seconds until each has one or ``timeout`` seconds have passed. ``dest`` (if given) is filled
    with message id -> the SuperNode it was sent to (an error reply the SuperLink makes for an unreachable node does
    not come from that node)."""
    poll = reply_poll()
    ids = list(grid.push_messages(messages))
    if dest is not None:
        dest.update(zip(ids, (m.metadata.dst_node_id for m in messages)))
    pending = set(ids)
    deadline = time.monotonic() + timeout
    replies: list = []
    while pending:
        got = list(grid.pull_messages(pending))
        replies.extend(got)
        pending.difference_update(msg.metadata.reply_to_message_id for msg in got)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(poll)
    return replies


def _replies(grid, spec, messages, rnd, kind, node_client, audits, *, what: str, dropouts: bool = False,
             where: str | None = None):
    """Send ``messages`` (one per SuperNode) and collect the replies of ``kind``: ``[(client id, node id,
    reply)]``, each reply's client checked against the round and what its node said before, and its audit summary
    kept in ``audits``. A SuperNode that fails or does not reply within the round timeout is a DeploymentError
    saying it did not ``what``; with ``dropouts`` it is left out (secure aggregation's dropout)."""
    where = where or f"round {rnd}"
    dest: dict = {}
    replies = _send_and_receive(grid, messages, spec.round_timeout, dest) if messages else []
    seen: set[str] = set()
    out = []
    for msg in replies:
        node = msg.metadata.src_node_id
        if msg.has_error():
            node = dest.get(msg.metadata.reply_to_message_id, node)
            if dropouts:
                continue
            raise DeploymentError(f"{where}: SuperNode {node} ({_organisation(node, node_client)}) failed to "
                                  f"{what}: {msg.error.reason} (code {msg.error.code})")
        reply = from_record(msg.content, kind)
        cid = _reply_client(reply, rnd, node, seen, node_client)
        if reply.get("audit") is not None:
            audits[cid] = reply["audit"]
        out.append((cid, node, reply))
    if not dropouts and len(seen) != len(messages):
        answered = {node for _, node, _ in out}
        silent = [f"SuperNode {m.metadata.dst_node_id} ({_organisation(m.metadata.dst_node_id, node_client)})"
                  for m in messages if m.metadata.dst_node_id not in answered]
        raise DeploymentError(f"{where}: {len(messages) - len(seen)} of {len(messages)} SuperNodes did not {what} "
                              f"within {spec.round_timeout:g} s: {', '.join(silent)}")
    return out


def _organisation(node: int, node_client: dict) -> str:
    """How an error names a SuperNode's organisation: its partition id, once the node has said it."""
    cid = node_client.get(node)
    return f"partition {cid}" if cid is not None else "partition not known yet"


def _bind_nodes(grid, spec: RunSpec) -> dict[int, int] | None:
    """With ``spec.node_keys``: node id -> partition id of every connected SuperNode whose authenticated key (Flower's
    ``Grid.get_nodes()``: the key the coordinator registered for that node id, each request of the node signed with
    it) the spec declares, once every declared partition has one (waiting up to ``spec.node_wait`` s); SuperNodes of
    other keys are left out. None without node_keys. Refused when the SuperLink authenticates no keys (they are then
    the nodes' own, proving nothing) or a declared partition's SuperNode does not connect in time."""
    if not spec.node_keys:
        return None
    from privfl.flower.identity import node_key_digest

    partition_of = {digest: p for p, digest in spec.node_keys}
    deadline = time.monotonic() + spec.node_wait
    while True:
        infos = list(grid.get_nodes())
        bound = {}
        for info in infos:
            raw = bytes(getattr(info, "public_key", b"") or b"")
            if not raw:
                raise DeploymentError("the run's spec binds partitions to SuperNode keys (node_keys), but the "
                                      f"SuperLink reports no key for node {info.node_id}: start it with "
                                      "--enable-supernode-auth and register each organisation's key")
            try:
                digest = node_key_digest(raw)
            except ConfigurationError:
                continue
            if digest in partition_of:
                bound[int(info.node_id)] = partition_of[digest]
        if set(bound.values()) == set(range(spec.n_clients)):
            return bound
        if time.monotonic() > deadline:
            missing = sorted(set(range(spec.n_clients)) - set(bound.values()))
            raise DeploymentError(f"no SuperNode with the registered key of partition(s) {missing} connected within "
                                  f"{spec.node_wait:g} s (node_keys); start each organisation's SuperNode with its "
                                  f"registered key")
        time.sleep(0.5)


def _identify(grid, spec, nodes, node_client, bound: dict[int, int] | None = None) -> tuple[dict[str, int], int]:
    """Ask every SuperNode which organisation (partition id) it speaks for (client sampling draws clients, and the
    server must know which node to send a sampled client's round to) and which rounds of this run id its own ledger
    has already released. Returns (client id -> node id, the first round after every released one): a second
    ``flwr run`` of a run id resumes there, so no round is released twice."""
    from flwr.app import Message

    messages = [Message(to_record({"round": -1}, IDENTIFY), dst_node_id=node, message_type=QUERY, group_id="identify")
                for node in nodes]
    start = 0
    for _, _, reply in _replies(grid, spec, messages, -1, IDENTIFY, node_client, {}, what="identify itself",
                                where="the start of the run"):
        start = max([start, *(int(r) + 1 for r in reply.get("released", []))])
    for node in nodes if bound is not None else ():
        if int(node_client[node]) != bound[node]:
            raise DeploymentError(f"SuperNode {node}, authenticated with the registered key of partition "
                                  f"{bound[node]}, claims partition-id {node_client[node]} in its node config; "
                                  f"nothing was charged: give each SuperNode its own organisation's partition-id")
    _check_partitions({node_client[n] for n in nodes}, spec)
    return {c: n for n, c in node_client.items()}, start


def _check_resume(spec: RunSpec, start: int, phased: bool = False) -> None:
    """A run id whose ledgers have released rounds resumes at ``start``; refuse what cannot be resumed safely."""
    if start and phased:
        raise DeploymentError(f"run {spec.run_id!r}: the SuperNodes' ledgers have already released rounds of its "
                              f"phases; a multi-phase run is not resumed (the trained server half of an earlier "
                              f"phase is not checkpointed); give a new run a new run_id")
    if start >= spec.fed.rounds:
        raise DeploymentError(f"run {spec.run_id!r}: the SuperNodes' ledgers have already released rounds up to "
                              f"{start - 1} of it, and this spec has {spec.fed.rounds} rounds: nothing is left to "
                              f"run (a round is released once); give a new run a new run_id")
    if start and spec.privacy.private and not spec.privacy.secure_noise and spec.privacy.placement == "central":
        # each client keeps its generators in its client-state file and refuses to go on without them
        # (_check_seeded_resume); the server's own noise stream is not checkpointed and would restart from the seed
        raise DeploymentError(f"run {spec.run_id!r} would resume at round {start} with seeded central noise, whose "
                              f"server generator restarts from the seed and would redraw noise already released; "
                              f"resume with secure_noise=True or give a new run a new run_id")


def _charge_round(grid, spec, rnd, nodes, audits, node_client, phase=None) -> list[str]:
    """Under amplification by sampling every member's round is charged, sampled or not: the SuperNodes of the
    clients left out charge their own ledgers (``ReleasePipeline.charge_only``). Returns the clients whose budget
    refused the charge (they take no further part)."""
    from flwr.app import Message

    messages = [Message(to_record({"round": rnd, "phase": phase}, CHARGE), dst_node_id=node,
                        message_type=CHARGE_TYPE, group_id=f"{rnd}.charge") for node in nodes]
    return [cid for cid, _, reply in _replies(grid, spec, messages, rnd, CHARGE, node_client, audits,
                                              what="charge its round") if reply["sat_out"]]


def _plain_round(grid, spec, rnd, nodes, broadcast, by_name, server_noise, audits, node_client,
                 all_nodes: bool = True):
    """One round without secure aggregation: every SuperNode of ``nodes`` replies with its releases in the clear
    (``all_nodes``: they are the whole federation, whose partition ids are checked). Returns (the weighted sums or
    None when nobody released, the clients that released, the clients whose budget refused the round)."""
    from flwr.app import Message

    from privfl.core.aggregation import weighted_sums

    messages = [Message(to_record(broadcast, BROADCAST), dst_node_id=node, message_type=TRAIN,
                        group_id=str(rnd)) for node in nodes]
    tolerant = spec.min_replies is not None
    replies = _replies(grid, spec, messages, rnd, REPLY, node_client, audits, what="reply", dropouts=tolerant)
    if tolerant:
        answered = {node for _, node, _ in replies}
        missing = [n for n in nodes if n not in answered]
        if missing:
            _log_missing(spec, rnd, missing, node_client)
        if len(replies) < min(spec.min_replies, len(nodes)):
            raise DeploymentError(f"round {rnd}: {len(replies)} of {len(nodes)} organisations replied, fewer than "
                                  f"min_replies={spec.min_replies}; missing: "
                                  f"{', '.join(_organisation(n, node_client) for n in missing)}")
        all_nodes = all_nodes and not missing
    releases, sat_out = [], []
    for cid, _, reply in replies:
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
    if all_nodes:
        _check_partitions({cid for cid, _, _ in replies}, spec)
    releases.sort(key=lambda r: int(r.client_id))  # the in-process runtime's summation order
    aggregates = weighted_sums(releases, by_name, server_noise) if releases else None
    return aggregates, len({r.client_id for r in releases}), sat_out


def _log_missing(spec, rnd: int, missing, node_client) -> None:
    _flwr_log("WARNING", "privfl %s round %d/%d: no reply from %s; the round completes with the others", spec.run_id,
        rnd + 1, spec.fed.rounds, ", ".join(f"SuperNode {n} ({_organisation(n, node_client)})" for n in missing))


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


def _stage_messages(malicious: bool = False):
    from privfl.secure_agg.messages import (AdvertiseKeys, ConsistencyProof, ConsistencySignature, KeyDirectory,
                                            MaskedInput, ShareDelivery, ShareKeys, UnmaskRequest, UnmaskShares)

    # stage -> (what the server sends, what the client answers), in protocol order
    if malicious:
        return {"share_keys": (KeyDirectory, ShareKeys), "masked_input": (ShareDelivery, MaskedInput),
                "consistency_check": (UnmaskRequest, ConsistencySignature),
                "unmask": (ConsistencyProof, UnmaskShares)}, AdvertiseKeys
    return {"share_keys": (KeyDirectory, ShareKeys), "masked_input": (ShareDelivery, MaskedInput),
            "unmask": (UnmaskRequest, UnmaskShares)}, AdvertiseKeys


def _secure_round(grid, spec, rnd, nodes, broadcast, plan, by_name, server_noise, audits, node_client):
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

    from privfl.privacy.secure import decode_secure_sum, round_min_inputs, secure_context
    from privfl.secure_agg import ProtocolAbort, ServerSession, SessionConfig
    from privfl.secure_agg.params import ParameterError
    from privfl.core.release import ReleaseHeader

    malicious = bool(spec.secure.malicious)
    stages, advertise_type = _stage_messages(malicious)
    encodings = _encodings(plan, spec)
    dimension = sum(e.size for e in encodings.values())
    try:
        config = SessionConfig.create([_session_id(str(k)) for k in range(spec.n_clients)], bits=spec.secure.bits,
                                      dimension=dimension, min_inputs=round_min_inputs(encodings), malicious=malicious,
                                      dropout=spec.secure.dropout, corruption=spec.secure.corruption)
    except (ParameterError, ValueError) as exc:
        raise DeploymentError(f"round {rnd}: no secure-aggregation session for {spec.n_clients} clients: {exc}"
                              ) from exc
    phase = (broadcast.get("phase") or {}).get("name")
    # what the clients of this run, phase and round bind their keys to (each computes it itself: _secure_advertise)
    context = secure_context(spec.run_id, rnd, encodings, phase=phase, distributed=plan.distributed)
    server = ServerSession(config, registry=_spec_registry(spec) if malicious else None, context=context)
    messages = [Message(to_record({**broadcast, "secagg": config.to_dict()}, BROADCAST), dst_node_id=node,
                        message_type=TRAIN, group_id=str(rnd)) for node in nodes]
    headers, sat_out = {}, []
    client_node: dict[str, int] = {}
    # a SuperNode that fails before advertising its keys is a dropout: the session goes on without it
    replies = _replies(grid, spec, messages, rnd, REPLY, node_client, audits, what="advertise keys", dropouts=True)
    for cid, node, reply in replies:
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
    _check_partitions({cid for cid, _, _ in replies}, spec)
    node_of = {_session_id(c): n for c, n in client_node.items()}
    try:
        outgoing = server.key_directories()
        for stage in stages:
            for answer in _exchange(grid, spec, rnd, stage, outgoing, node_of, stages[stage][1], audits, phase):
                server.receive(answer)
            if stage == "share_keys":
                outgoing = server.share_deliveries()
            elif stage == "masked_input":
                request = server.unmask_request()
                outgoing = {c: request for c in request.alive}
            elif stage == "consistency_check":
                outgoing = server.consistency_proofs()
        result = server.finalize()
    except ProtocolAbort:
        return None, 0, sat_out, True  # nothing of the round is revealed; the global state stays
    included = [headers[c] for c in result.included]
    return decode_secure_sum(result.sum, encodings, by_name, included, server_noise), len(included), sat_out, False


def _exchange(grid, spec, rnd, stage, outgoing, node_of, answer_type, audits, phase=None):
    """Send each client its message of ``stage`` (of phase ``phase``, in a multi-phase run); yield the answers of
    those that reply (the others dropped)."""
    from flwr.app import Message

    messages = [Message(to_record({"round": rnd, "stage": stage, "phase": phase, "message": m.to_bytes()},
                                  SECAGG_REQUEST),
                        dst_node_id=node_of[c], message_type=SECAGG, group_id=f"{rnd}.{stage}")
                for c, m in sorted(outgoing.items()) if c in node_of]
    by_node = {n: c for c, n in node_of.items()}
    for msg in _send_and_receive(grid, messages, spec.round_timeout) if messages else []:
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
    """The node config's ``key``; on a SuperNode that trusts the server (none of its keys), else the run config's
    path template for it (the Simulation Engine's virtual SuperNodes have no node config). A SuperNode that trusts
    no server never takes a path from the server's side: a template naming a fresh ledger file each run would reset
    its ledger and its node budget (a review, session 26: four launches of one run id, epsilon 12 against a total of
    3)."""
    template = "" if _distrusts_server(context) else str(context.run_config.get(TEMPLATE_KEYS.get(key, ""), "") or "")
    if key not in context.node_config and template and PARTITION_KEY in context.node_config:
        return template.replace("{partition-id}", str(int(context.node_config[PARTITION_KEY])))
    if key not in context.node_config:
        raise ConfigurationError(f"this SuperNode has no {key!r}; start it with flower-supernode --node-config "
                                 f"\"{PARTITION_KEY}=K {DATA_KEY}='...' {LEDGER_KEY}='...'\"")
    return context.node_config[key]


def _generators(spec: RunSpec, client: int, context, phased: PhaseOf | None = None):
    """The client's training generator and noise source: fresh from its seed stream in its first round (of the run,
    or of its phase), then as its previous round left them (kept in the SuperNode's Context.state, which never
    leaves the organisation)."""
    from flwr.app import ConfigRecord
    from privfl.mechanisms import SeededNoise

    from privfl.core.plan import seed_stream

    key = _state_key(CLIENT_STATE, phased)
    seq = client_seed(spec.fed.seed, client)
    train_rng = np.random.default_rng(seq.spawn(1)[0])
    noise = _noise(spec.privacy, seq)
    secure_rng = np.random.default_rng(seed_stream(spec.fed.seed, "secure", client))  # RunPlan.secure_rng
    if key in context.state:
        saved = from_bytes(context.state[key]["envelope"], CLIENT_STATE)
        train_rng.bit_generator.state = saved["train"]
        if isinstance(noise, SeededNoise):
            noise.rng.bit_generator.state = saved["noise"]
        if saved.get("secure") is not None:
            secure_rng.bit_generator.state = saved["secure"]

    def save() -> None:
        state = {"train": train_rng.bit_generator.state,
                 "noise": noise.rng.bit_generator.state if isinstance(noise, SeededNoise) else None,
                 "secure": secure_rng.bit_generator.state}
        context.state[key] = ConfigRecord({"envelope": to_bytes(state, CLIENT_STATE)})

    return train_rng, noise, secure_rng, save


def _distrusts_server(context) -> bool:
    """Whether this SuperNode trusts no server: it holds an identity key or a federation file
    (``privfl.flower.identity``)."""
    from privfl.flower.identity import FEDERATION_KEY, IDENTITY_KEY

    return bool(context.node_config.get(IDENTITY_KEY) or context.node_config.get(FEDERATION_KEY))


def _node_run_spec(context) -> RunSpec:
    """The run's spec as this SuperNode reads it: from the run config (:func:`read_run_spec`; on a node that trusts
    no server, importing no module its app did not import) with its own alignment set (:func:`_node_alignment`)."""
    return _node_alignment(context, read_run_spec(context.run_config, import_new=not _distrusts_server(context)))


def _node_alignment(context, spec: RunSpec) -> RunSpec:
    """``spec`` with the alignment set this SuperNode reads: the file at its node config's ``alignment-path``
    (:data:`ALIGNMENT_KEY`, the organisation's own choice), checked against the spec's digest when it is loaded
    (:func:`load_alignment`). The spec's ``alignment_path`` comes from the run config, which the server's side writes:
    a review found that a server naming the organisation's own data file there got an uncharged oracle (a ``query``
    answered on one data set and refused on its neighbour, by the file's digest or by an empty file's refusal) and,
    for FedBNN, a release of shape (record count, classes). It is never read on a node that has its own
    ``data-path``; only a node that takes its data path from the run config as well (the Simulation Engine's virtual
    SuperNodes, which have no node config) takes the spec's path. Every refusal here depends on the node config and
    the spec, never on the records."""
    if not spec.alignment_path and not spec.alignment_digest:
        return spec
    if not spec.alignment_digest:
        raise ConfigurationError(f"run {spec.run_id!r} names an alignment set without its SHA-256; refused")
    if ALIGNMENT_KEY in context.node_config:
        path = str(context.node_config[ALIGNMENT_KEY])
    elif DATA_KEY not in context.node_config:
        return spec  # a node whose data path is the run config's too (Simulation Engine) trusts its files
    else:
        raise ConfigurationError(f"run {spec.run_id!r} uses a public alignment set, and this SuperNode has no "
                                 f"{ALIGNMENT_KEY!r} in its node config (the run config's path names a file on the "
                                 f"server's side and is never read here): start it with --node-config \"... "
                                 f"{ALIGNMENT_KEY}='/data/alignment.npz'\", the agreed public file (SHA-256 "
                                 f"{spec.alignment_digest})")
    return dataclasses.replace(spec, alignment_path=path)


def _client_spec(context) -> tuple[RunSpec, int]:
    """The run's spec (from the run config, with this node's own alignment set: :func:`_node_alignment`) and this
    SuperNode's partition id, torch's threads set as it says."""
    spec = _node_run_spec(context)
    if spec.torch_threads is not None:
        import torch

        torch.set_num_threads(spec.torch_threads)
    client = int(_node_value(context, PARTITION_KEY))
    if not 0 <= client < spec.n_clients:
        raise ConfigurationError(f"partition-id {client} is outside 0..{spec.n_clients - 1}")
    return spec, client


def _planned_round(spec: RunSpec, value) -> int:
    """The round a server message names, checked against the plan before any record is read or anything charged:
    an integer in ``[0, rounds)`` of the run (or of the phase the message names). The server chooses the index, and
    what a client accepts may depend on it (adaptive clipping's accepted clip range widens with the round:
    ``AdaptiveClip.check_broadcast``), so a round the plan does not hold is refused, not served."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DeploymentError(f"run {spec.run_id!r}: the server named round {value!r}, not an integer; refused "
                              "before any record was read")
    rnd = int(value)
    if not 0 <= rnd < spec.fed.rounds:
        raise DeploymentError(f"run {spec.run_id!r}: the server named round {rnd}, outside the plan's rounds 0.."
                              f"{spec.fed.rounds - 1}; refused before any record was read or anything charged")
    return rnd


def _pinned_terms(context, run_spec: RunSpec, spec: RunSpec) -> dict | None:
    """Refuse, before any record is read or anything charged, a run weaker than what this SuperNode's federation file
    pins (``privfl.flower.identity``): the run config is written on the server's side, and a SuperNode that holds an
    identity key and a federation file does not trust the server. Refused: secure aggregation off (clipped updates in
    the clear), secure-aggregation settings or a roster other than the file's (the semi-honest variant included),
    another placement or unit, seeded noise where the file asks for the CSPRNG's, an epsilon or delta above the
    file's. ``run_spec``: the whole run's; ``spec``: the phase's (the same for a one-phase run). Returns the pinned
    terms, or None for a SuperNode without a federation file (it trusts the run config)."""
    from privfl.flower.identity import AGREED, FEDERATION_KEY, IDENTITY_KEY, read_federation

    key_path, federation = context.node_config.get(IDENTITY_KEY), context.node_config.get(FEDERATION_KEY)
    if not key_path and not federation:
        return None
    if not federation:
        raise ConfigurationError(f"this SuperNode holds an identity key ({IDENTITY_KEY}) but no {FEDERATION_KEY} "
                                 "file: it has no agreed terms to hold a run to; give it the federation file "
                                 "(privfl.flower.identity.write_federation)")
    identities, agreed, terms = read_federation(str(federation))
    weaker = []
    if spec.secure is None:
        weaker.append("secure aggregation off (each clipped update would leave in the clear)")
    else:
        asked = {k: getattr(spec.secure, k) for k in AGREED}
        if asked != agreed or spec.n_clients != len(identities):
            weaker.append(f"secure aggregation {asked} over {spec.n_clients} clients where this SuperNode's "
                          f"federation file agreed {agreed} over {len(identities)}")
    for privacy in {id(p): p for p in (run_spec.privacy, spec.privacy)}.values():
        if privacy.placement != terms["placement"]:
            weaker.append(f"{privacy.placement} noise where the file pins {terms['placement']}")
        if privacy.unit != terms["unit"]:
            weaker.append(f"the {privacy.unit} unit where the file pins {terms['unit']}")
        if terms["secure_noise"] and not privacy.secure_noise:
            weaker.append("seeded noise (from a seed the server's side knows) where the file asks for the OS "
                          "CSPRNG's")
    if not run_spec.privacy.epsilon <= terms["epsilon"]:
        weaker.append(f"epsilon {run_spec.privacy.epsilon:g} above the file's {terms['epsilon']:g}")
    if not run_spec.privacy.delta <= terms["delta"]:
        weaker.append(f"delta {run_spec.privacy.delta:g} above the file's {terms['delta']:g}")
    if weaker:
        raise DeploymentError(f"run {run_spec.run_id!r} is weaker than this SuperNode's federation file: "
                              f"{'; '.join(dict.fromkeys(weaker))}; refused before any record was read or anything "
                              "charged")
    return terms


#: the node-level budget file beside a SuperNode's ledger: each run id it admitted and the budget it set aside
NODE_BUDGET_SUFFIX = ".node-budget"


def _admit_run(context, run_spec: RunSpec, terms: dict) -> None:
    """Admit the run ``run_spec`` against this SuperNode's total budget (the federation file's ``epsilon_total`` and
    ``delta_total``), before any record is read or anything charged: every run id gets a fresh ledger budget, so a
    server could otherwise start run after run. Each run id is admitted once, for its whole (epsilon, delta) (the most
    its ledger lets it spend, whatever rounds it runs or resumes), in ``<ledger-path>.node-budget``, one SQLite
    transaction that holds the file's write lock, so two runs admitted at once cannot both take the last of it. The
    admitted runs, plus every run of the node's ledger file that no admitted run covers (one of an earlier privfl, at
    its budget), must stay within the totals (basic composition over runs). A run id admitted before is admitted again
    only with a budget no larger than it was admitted for."""
    import sqlite3

    from privfl.accounting.ledger import PrivacyLedger
    from privfl.algorithms.base import is_phased
    from privfl.runtime.phase_ledgers import phase_run_id

    ledger_path = str(_node_value(context, LEDGER_KEY))
    eps, delta = float(run_spec.privacy.epsilon), float(run_spec.privacy.delta)
    top = _algorithm(run_spec)
    covers = ([phase_run_id(run_spec.run_id, name) for name, _ in top.phase_plan] if is_phased(top)
              else [run_spec.run_id])
    conn = sqlite3.connect(f"{ledger_path}{NODE_BUDGET_SUFFIX}", timeout=60, isolation_level=None)
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS admitted (run_id TEXT PRIMARY KEY, epsilon REAL NOT NULL, "
                     "delta REAL NOT NULL, covers TEXT NOT NULL, admitted_at REAL NOT NULL)")
        conn.execute("BEGIN IMMEDIATE")
        try:
            rows = conn.execute("SELECT run_id, epsilon, delta, covers FROM admitted").fetchall()
            mine = [r for r in rows if r[0] == run_spec.run_id]
            covered = {c for r in rows for c in json.loads(r[3])}
            if mine:
                if eps > mine[0][1] or delta > mine[0][2]:
                    raise DeploymentError(f"run {run_spec.run_id!r} was admitted on this SuperNode for epsilon "
                                          f"{mine[0][1]:g}, delta {mine[0][2]:g}; it now asks for {eps:g}, {delta:g}: "
                                          "refused (give a new run a new run_id)")
                if sorted(covers) != sorted(json.loads(mine[0][3])):
                    # the admitted budget is per ledger run: one run id back with other phases (a one-phase run
                    # relaunched as two, or the reverse) would charge fresh ledger runs under one admission
                    raise DeploymentError(f"run {run_spec.run_id!r} was admitted on this SuperNode for the ledger "
                                          f"runs {json.loads(mine[0][3])}; it now charges {covers}: refused (give a "
                                          "new run a new run_id)")
            else:
                clash = sorted((covered | {r[0] for r in rows}) & set(covers))
                if clash:  # a new run id whose ledger runs an admitted run charges already
                    raise DeploymentError(f"run {run_spec.run_id!r} would charge the ledger runs {clash}, which a run "
                                          "admitted before on this SuperNode charges: refused (give a new run a new "
                                          "run_id)")
                spent_eps, spent_delta = sum(r[1] for r in rows), sum(r[2] for r in rows)
                others = []
                for held in PrivacyLedger.run_ids(ledger_path) if os.path.exists(ledger_path) else []:
                    if held in covered or held in covers:
                        continue
                    ledger = PrivacyLedger.open_existing(ledger_path, held)
                    try:
                        spent_eps, spent_delta = spent_eps + ledger.epsilon_budget, spent_delta + ledger.delta
                    finally:
                        ledger.close()
                    others.append(held)
                total_eps, total_delta = spent_eps + eps, spent_delta + delta
                if total_eps > terms["epsilon_total"] * (1 + 1e-12) or total_delta > terms["delta_total"] * (
                        1 + 1e-12):
                    raise DeploymentError(
                        f"run {run_spec.run_id!r} (epsilon {eps:g}, delta {delta:g}) would take this SuperNode's runs "
                        f"to epsilon {total_eps:g}, delta {total_delta:g} in all ({len(rows)} admitted run(s)"
                        f"{f', and its ledger runs {others} at their budgets' if others else ''}), past its "
                        f"federation file's epsilon_total {terms['epsilon_total']:g}, delta_total "
                        f"{terms['delta_total']:g}: refused before any record was read or anything charged")
                conn.execute("INSERT INTO admitted VALUES (?, ?, ?, ?, ?)",
                             (run_spec.run_id, eps, delta, json.dumps(covers), time.time()))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
    finally:
        conn.close()


def client_train(msg, context):
    """The ClientApp's train step: the client's own work on its own data, released through its own pipeline (of the
    run, or of the phase the message names)."""
    from flwr.app import Message

    from privfl.accounting.errors import PrivacyBudgetExceeded

    run_spec, client = _client_spec(context)
    from privfl.algorithms.base import Broadcast, check_kept_state
    from privfl.runtime.local_step import fallback_on_failure, releases_as_removed, removed_output

    broadcast = from_record(msg.content, BROADCAST)
    # the client's own instance, from the public spec (and, in a later phase, the earlier phases' final states): it
    # plans the run, or the phase, as the server does
    spec, alg, phased = _party(run_spec, broadcast.get("phase"))
    rnd = _planned_round(spec, broadcast["round"])
    pinned = _pinned_terms(context, run_spec, spec)
    half = alg.client_half(alg.public, np.random.default_rng(_setup_seq(spec)))
    plan = _run_plan(alg, spec)
    multipliers = plan.noise_multipliers
    if multipliers != broadcast["noise_multipliers"]:
        raise DeploymentError(f"the server planned noise multipliers {broadcast['noise_multipliers']} but this "
                              f"client computes {multipliers} from the same public spec; run one privfl version")
    secure = spec.secure is not None
    # read once, before anything is charged: a run this SuperNode's federation file did not agree to is refused here
    identity = _client_identity(context, spec, None) if secure else {}
    # the broadcast's values, checked as the client half takes them (finite, in float32's range, its own shapes, the
    # algorithm's public bounds: ClientHalf.load), so a broadcast made to fail on some records is refused on its own
    half.load(Broadcast(rnd, broadcast["values"]))
    if pinned is not None:  # the last refusal: it sets the run's whole budget aside on this node when it admits it
        _admit_run(context, run_spec, pinned)
    # every refusal above depends on the messages and the node's own files only; the records are read from here on
    dataset = load_dataset(str(_node_value(context, DATA_KEY)), run_spec, partition=client)
    state_key = _state_key(ALGORITHM_STATE, phased)
    kept = _recover_client_state(context, spec, phased, rnd)
    train_rng, noise, secure_rng, save = _generators(spec, client, context, phased)
    ledger = _ledger(spec, context, phased, plan)
    try:
        released_rounds = {c.round for c in ledger.charges(str(client)) if c.released}
        _check_seeded_resume(spec, released_rounds, kept)
        if rnd in released_rounds:
            raise DeploymentError(f"run {spec.run_id!r}: this SuperNode's ledger has already released round {rnd}; "
                                  f"a round is released once (a second flwr run of a run id resumes after the "
                                  f"rounds its ledgers released); give a new run a new run_id")
        pipeline = plan.pipeline(client, ledger, noise)
        state = (half.decode_state(client, context.state[state_key]["envelope"])
                 if state_key in context.state else None)
        check_kept_state(half.algorithm, client, state, ledger.has_charges(str(client)))
        # a private client's local step that raises releases the fallback, and a client-level client without
        # records releases zeros without one, as in process (privfl.runtime.local_step)
        events = plan.trained_events.get(client)
        if releases_as_removed(spec.privacy, dataset):
            out = removed_output(half.algorithm, pipeline, client, events)
        else:
            out, state = half.client_update(client, Broadcast(rnd, broadcast["values"]), dataset, state, train_rng,
                                            on_failure=fallback_on_failure(half.algorithm, spec.privacy, pipeline,
                                                                           client, rnd, events))
        # the client's own state (HBFL's local model, FedBNN's personalised model) stays on its SuperNode
        new_state = half.encode_state(client, state)
        try:
            # The charges (and, in the clear, the release marks) are durable before anything is sent. Under secure
            # aggregation the values leave only as the masked input, two stages later: marked then.
            with ledger.transaction():
                released = pipeline.release(rnd, out.values, out.weight, mark=not secure)
            sat_out = False
        except PrivacyBudgetExceeded:
            released, sat_out = {}, True
        # The new state is kept once the round's values are released (in the clear: now), never before: under secure
        # aggregation a round is served again until its masked input leaves, and a review found each such replay
        # trained on the records again from the state the last one kept (5 train messages for round 0: 5 DP-SGD
        # trainings compounded in the kept state, epsilon 5.88 against the ledger's one row, 3.09). It waits with the
        # round's session (client_secagg keeps it when the masked input is marked released); a replay starts again
        # from the state kept before the round. A round that sat out keeps nothing (nothing of it was released).
        if not secure and not sat_out:
            _keep(context, state_key, new_state)
        reply = {"client_id": str(client), "round": rnd, "sat_out": sat_out}
        if secure and not sat_out:
            reply.update(_secure_advertise(spec, plan, client, rnd, broadcast, released, secure_rng, context,
                                           phased, _composition(run_spec, phased), identity,
                                           pending=(state_key, new_state)))
        elif not secure:
            reply["releases"] = [encode_release(r) for r in released.values()]
        save()
        _persist_client_state(context, spec, phased, rnd)
        reply["audit"] = _audit(context, ledger, client, _composition(run_spec, phased))
    finally:
        ledger.close()
    return Message(to_record(reply, REPLY), reply_to=msg)


def _client_state_file(context) -> str:
    """Where this SuperNode keeps its clients' states between runs: beside its ledger, on its own machine."""
    return f"{_node_value(context, LEDGER_KEY)}.client-state"


def _client_state_entry(spec: RunSpec, phased: PhaseOf | None) -> str:
    return json.dumps([spec.run_id, phased.name if phased is not None else None])


def _recover_client_state(context, spec: RunSpec, phased: PhaseOf | None, rnd: int) -> float:
    """A SuperNode that holds no state of this run in its Context (a resumed run id is a new Flower run; a restarted
    SuperNode starts empty) takes it from its client-state file: its generators where the last round it answered
    left them, and the algorithm's state of its client (HBFL's local model, FedBNN's posterior), so a resumed run
    goes on as the uninterrupted one would. A state saved at round ``rnd`` or later is not this run's past (the run
    id launched again from the start): it is ignored. Returns the round after which the generators now held were
    saved (infinity for this Flower run's own state, kept in its Context; -1 when there is none)."""
    key = _state_key(CLIENT_STATE, phased)
    if key in context.state:
        return math.inf
    path = _client_state_file(context)
    if not os.path.exists(path):
        return -1
    with open(path, "rb") as f:
        saved = from_bytes(f.read(), CLIENT_STATE_FILE)
    entry = saved.get(_client_state_entry(spec, phased))
    if entry is None or int(entry["round"]) >= rnd:
        return -1
    for name in (CLIENT_STATE, ALGORITHM_STATE):
        if name in entry:
            _keep(context, _state_key(name, phased), entry[name])
    return int(entry["round"]) if CLIENT_STATE in entry else -1


def _check_seeded_resume(spec: RunSpec, released_rounds, kept: float) -> None:
    """Refuse, before anything is charged, a private run with seeded noise whose client has released rounds of the
    run (``released_rounds``, from its ledger) after the round its generators were saved at (``kept``, from
    :func:`_recover_client_state`): its noise would repeat draws that left in a release. (A round charged but never released, a sampled-out round's charge or a
    secure round stopped before the masked input, revealed no draw.) With the OS CSPRNG nothing repeats."""
    if not spec.privacy.private or spec.privacy.secure_noise:
        return
    last = max(released_rounds, default=-1)
    if last > kept:
        raise DeploymentError(f"run {spec.run_id!r}: this SuperNode released round {last} of the run with seeded "
                              f"noise, but its generators were saved after round {int(kept)} (its client-state file "
                              f"'<ledger-path>.client-state' is missing or older): they would repeat noise already "
                              f"released; give a new run a new run_id")


def _persist_client_state(context, spec: RunSpec, phased: PhaseOf | None, rnd: int) -> None:
    """Write this run's Context state of the client (generators, algorithm state) to its client-state file, whole
    or not at all (see :func:`_recover_client_state`)."""
    _persist_entry(context, spec.run_id, None if phased is None else phased.name, rnd)


def _persist_entry(context, run_id: str, phase: str | None, rnd: int) -> None:
    """:func:`_persist_client_state` of the ledger run ``run_id`` (a phase's own run id) and its ``phase`` name."""
    path = _client_state_file(context)
    saved = {}
    if os.path.exists(path):
        with open(path, "rb") as f:
            saved = dict(from_bytes(f.read(), CLIENT_STATE_FILE))
    entry = {"round": int(rnd)}
    for name in (CLIENT_STATE, ALGORITHM_STATE):
        key = name if phase is None else f"{name}.{phase}"
        if key in context.state:
            entry[name] = bytes(context.state[key]["envelope"])
    saved[json.dumps([run_id, phase])] = entry
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(to_bytes(saved, CLIENT_STATE_FILE))
    os.replace(tmp, path)


def _keep(context, key: str, envelope: bytes) -> None:
    from flwr.app import ConfigRecord

    context.state[key] = ConfigRecord({"envelope": envelope})


def _ledger(spec: RunSpec, context, phased: PhaseOf | None = None, plan=None):
    """This SuperNode's ledger, the run of ``spec`` (a phase's ledger run is opened first with the metadata that
    ties it to its run: ``privfl.runtime.phase_ledgers.phase_ledger_meta``, as the in-process runtime opens it), with the
    trust assumption of ``plan`` recorded before any charge."""
    from privfl.accounting.ledger import PrivacyLedger

    privacy = spec.privacy
    if phased is not None:
        from privfl.runtime.phase_ledgers import phase_ledger_meta

        meta = phase_ledger_meta(phased.phase, phased.index, phased.run.run_id, spec.name, phased.run.privacy.epsilon)
    else:
        meta = {"algorithm": spec.algorithm, "dataset": spec.name,
                "noise": "secure" if privacy.secure_noise else "seeded"}
        if privacy.private and not privacy.secure_noise:
            meta["warning"] = SEEDED_NOISE_WARNING
    ledger = PrivacyLedger(str(_node_value(context, LEDGER_KEY)), spec.run_id, delta=privacy.delta,
                           epsilon_budget=privacy.epsilon, accountant=privacy.resolved_accountant, meta=meta)
    if plan is not None:
        try:
            ledger.record_meta("trust", plan.trust)
        except BaseException:
            ledger.close()
            raise
    return ledger


def _composition(run_spec: RunSpec, phased: PhaseOf | None) -> dict | None:
    """What a client of a multi-phase run composes its audit over: the run id and its (delta, accountant, target);
    None for a one-phase run. Plain values, kept with a secure-aggregation session so its later stages need no
    spec (and no torch)."""
    if phased is None:
        return None
    privacy = run_spec.privacy
    return {"run_id": run_spec.run_id, "delta": privacy.delta, "accountant": privacy.resolved_accountant,
            "epsilon": privacy.epsilon}


def _audit(context, ledger, client: int, composition: dict | None) -> dict | None:
    """The audit summary this client reports (``PrivacyLedger.audit``'s entry for it): of its ledger run, or, in a
    multi-phase run (``composition``: :func:`_composition`), composed over the phases its ledger holds so far
    (``privfl.runtime.phase_ledgers.composed_audit``)."""
    if composition is None:
        return ledger.audit()["clients"].get(str(client))
    from privfl.accounting.ledger import PrivacyLedger
    from privfl.runtime.phase_ledgers import composed_audit, phase_runs_of

    path = str(_node_value(context, LEDGER_KEY))
    run_id = composition["run_id"]
    phases = phase_runs_of(path, run_id, PrivacyLedger.run_ids(path))
    try:
        audit = composed_audit(phases, run_id, composition["delta"], composition["accountant"],
                               composition["epsilon"])
    finally:
        for held in phases.values():
            held.close()
    return audit["clients"].get(str(client))


def _spec_registry(spec: RunSpec):
    """The ServerApp's registry of the organisations' identity keys (``RunSpec.identities``), by protocol id."""
    from privfl.secure_agg import IdentityRegistry

    try:
        return IdentityRegistry({_session_id(str(p)): bytes.fromhex(k) for p, k in spec.identities})
    except ValueError as exc:
        raise ConfigurationError(f"RunSpec identities: {exc}") from None


def _client_identity(context, spec: RunSpec | None, floor: int | None, malicious: bool | None = None) -> dict:
    """The ``ClientSession`` keywords of this SuperNode. Under the malicious variant: its identity key, the registry
    and the threat model of its federation file, all read from its node config (out of band, never from the run
    config, which the server's side writes); a run whose secure-aggregation settings differ from the federation
    file's is refused. Under the semi-honest variant: none, and a SuperNode that holds an identity key refuses it
    (no downgrade)."""
    from privfl.flower.identity import AGREED, FEDERATION_KEY, IDENTITY_KEY, load_identity, read_federation
    from privfl.secure_agg import IdentityRegistry, ThreatModel, identity_public_bytes

    if malicious is None:
        malicious = bool(spec.secure.malicious)
    key_path, federation = context.node_config.get(IDENTITY_KEY), context.node_config.get(FEDERATION_KEY)
    if not malicious:
        if key_path:
            raise DeploymentError(f"this SuperNode holds an identity key ({IDENTITY_KEY} in its node config), so it "
                                  "runs secure aggregation against an active server only; the run asks for the "
                                  "semi-honest variant, refused")
        return {}
    if not key_path or not federation:
        raise ConfigurationError(f"secure aggregation against an active server needs this SuperNode's {IDENTITY_KEY} "
                                 f"and {FEDERATION_KEY} in its node config (privfl.flower.identity)")
    key = load_identity(str(key_path))
    identities, agreed, _ = read_federation(str(federation))
    partition = int(_node_value(context, PARTITION_KEY))
    if identities.get(partition) != identity_public_bytes(key):
        raise ConfigurationError(f"the federation file registers another key for partition {partition} than this "
                                 f"SuperNode's {IDENTITY_KEY}")
    if spec is not None:
        asked = {k: getattr(spec.secure, k) for k in AGREED}
        if asked != agreed or spec.n_clients != len(identities):
            raise DeploymentError(f"the run asks for secure aggregation {asked} over {spec.n_clients} clients; this "
                                  f"SuperNode's federation file agreed {agreed} over {len(identities)}: refused")
    registry = IdentityRegistry({_session_id(str(p)): raw for p, raw in identities.items()})
    model = ThreatModel(dropout=float(agreed["dropout"]), corruption=float(agreed["corruption"]), min_inputs=floor,
                        malicious=True, n_clients=len(identities))
    return {"identity_key": key, "registry": registry, "threat_model": model}


def _secure_advertise(spec, plan, client, rnd, broadcast, released, secure_rng, context, phased=None,
                      composition=None, identity=None, pending=None) -> dict:
    """The client's first stage under secure aggregation: encode its (charged, noised) releases with its own
    generator into the public encodings it computes itself, open its protocol session under the server's public
    configuration (refused if it asks for fewer inputs than the client's noise was charged for) and advertise its
    keys. The session's secrets (and the ledger run it marks) stay in the SuperNode's Context.state. ``identity``:
    this SuperNode's :func:`_client_identity` (read by the caller before anything was charged).

    The session is bound to the client's own context (``privfl.privacy.secure.client_secure_context``): the ledger
    run, phase and round it charged and its encodings and noise plan for the round, computed here from its own spec
    and ledger rows, never from the server's message. A peer of another run, phase, round or plan that the server
    put into the same session fails our first tag check (and we fail its), before any share or masked input leaves."""
    from flwr.app import ConfigRecord

    from privfl.privacy.secure import client_secure_context, encode_for_secure_sum, round_min_inputs
    from privfl.secure_agg import ClientSession, SessionConfig

    encodings = _encodings(plan, spec)
    config = SessionConfig.from_dict(broadcast["secagg"])
    words = encode_for_secure_sum(released, encodings, secure_rng, secure_noise=spec.privacy.secure_noise)
    if (config.bits != spec.secure.bits or config.dimension != words.size
            or config.malicious != bool(spec.secure.malicious)):
        raise DeploymentError(f"the server's session ({config.bits} bits, dimension {config.dimension}, "
                              f"{'malicious' if config.malicious else 'semi-honest'} variant) does not match the "
                              f"run's encodings ({spec.secure.bits} bits, dimension {words.size})")
    floor = round_min_inputs(encodings)
    identity = dict(identity if identity is not None else _client_identity(context, spec, None))
    if "threat_model" in identity:  # the floor this round's noise was charged for
        identity["threat_model"] = dataclasses.replace(identity["threat_model"], min_inputs=floor)
    if any(r.round != rnd for r in released.values()) or any(
            r.release_id != f"{spec.run_id}/{client}/{rnd}/{name}" for name, r in released.items()):
        raise DeploymentError(f"round {rnd}: the releases to mask are not this run's round {rnd}")
    bound = client_secure_context(released, encodings, phase=None if phased is None else phased.name,
                                  distributed=plan.distributed)
    session = ClientSession(config, _session_id(str(client)), words, min_inputs=floor, context=bound, **identity)
    advert = session.advertise_keys()
    state = {"round": rnd, "config": config.to_dict(), "session": session.to_state(), "floor": floor,
             "run_id": spec.run_id, "phase": None if phased is None else phased.name, "composition": composition}
    if pending is not None:  # the client state this round's training left, kept when the masked input leaves
        state["pending_state"] = {"key": pending[0], "envelope": bytes(pending[1])}
    context.state[SECAGG_STATE] = ConfigRecord({"envelope": to_bytes(state, SECAGG_STATE)})
    return {"headers": [r.header.to_dict() for r in released.values()], "advertise": advert.to_bytes()}


def client_secagg(msg, context):
    """The ClientApp's answer to one later stage of secure aggregation (share keys, masked input, unmask), from
    the session its train step left in Context.state. Before the masked input leaves, the round's ledger rows are
    marked released; a client that stops before then holds charges, never an unmarked release. Everything it needs
    is in that session's state (no spec is parsed: the stage imports no algorithm, hence no torch)."""
    from flwr.app import ConfigRecord, Message

    from privfl.accounting.ledger import PrivacyLedger
    from privfl.core.release import mark_round_released
    from privfl.secure_agg import ClientSession, SessionConfig

    client = int(_node_value(context, PARTITION_KEY))
    request = from_record(msg.content, SECAGG_REQUEST)
    rnd, stage, phase = int(request["round"]), str(request["stage"]), request.get("phase")
    if SECAGG_STATE not in context.state:
        raise DeploymentError(f"round {rnd}: no secure-aggregation session for stage {stage!r} on this SuperNode")
    saved = from_bytes(context.state[SECAGG_STATE]["envelope"], SECAGG_STATE)
    if saved["round"] != rnd or saved.get("phase") != phase:
        raise DeploymentError(f"round {rnd} (phase {phase}): this SuperNode's session is for round {saved['round']} "
                              f"(phase {saved.get('phase')})")
    config = SessionConfig.from_dict(saved["config"])
    stages, _ = _stage_messages(config.malicious)
    if stage not in stages:
        raise DeploymentError(f"round {rnd}: no stage {stage!r} in this SuperNode's secure-aggregation session")
    session = ClientSession.from_state(config, saved["session"], min_inputs=saved["floor"],
                                       **_client_identity(context, None, saved["floor"], config.malicious))
    try:
        answer = session.handle(stages[stage][0].from_bytes(request["message"]))
    finally:
        if session.aborted is not None or session.stage == "done":
            del context.state[SECAGG_STATE]  # nothing of a finished or aborted session is kept
    reply = {"client_id": str(client), "round": rnd, "stage": stage, "audit": None}
    if stage == "masked_input":
        # the ledger run the train step charged (the run's, or its phase's), with the parameters stored in it
        ledger = PrivacyLedger.open_existing(str(_node_value(context, LEDGER_KEY)), saved["run_id"])
        try:
            with ledger.transaction():  # durable before the masked input is handed to Flower
                mark_round_released(ledger, str(client), rnd)
            reply["audit"] = _audit(context, ledger, client, saved.get("composition"))
        finally:
            ledger.close()
        pending = saved.pop("pending_state", None)
        if pending is not None:  # the round is released: its training's client state is now the client's
            _keep(context, str(pending["key"]), bytes(pending["envelope"]))
            _persist_entry(context, saved["run_id"], saved.get("phase"), rnd)
    if session.stage != "done":
        saved["session"] = session.to_state()
        context.state[SECAGG_STATE] = ConfigRecord({"envelope": to_bytes(saved, SECAGG_STATE)})
    reply["message"] = answer.to_bytes()
    return Message(to_record(reply, SECAGG_REPLY), reply_to=msg)


def client_identify(msg, context):
    """The ClientApp's answer to :func:`_identify`: the partition id its node config gives it (public) and the
    rounds of this run id its ledger has released (the server saw them all; nothing else of the ledger). In a
    multi-phase run, the rounds of its phases' ledger runs, numbered one phase after the other."""
    from flwr.app import Message

    from privfl.accounting.ledger import PrivacyLedger
    from privfl.algorithms.base import is_phased
    from privfl.runtime.phase_ledgers import phase_run_id

    spec = read_run_spec(context.run_config, import_new=not _distrusts_server(context))  # reads no file of the spec
    client = int(_node_value(context, PARTITION_KEY))
    path = str(_node_value(context, LEDGER_KEY))
    top = _algorithm(spec)
    runs = ([(phase_run_id(spec.run_id, name), rounds) for name, rounds in top.phase_plan] if is_phased(top)
            else [(spec.run_id, spec.fed.rounds)])
    released: set[int] = set()
    held = PrivacyLedger.run_ids(path) if os.path.exists(path) else []
    offset = 0
    for run_id, rounds in runs:
        if run_id in held:
            ledger = PrivacyLedger.open_existing(path, run_id)
            try:
                # a round the client was left out of is spent as well: a resumed run must not redo it (its row can
                # never be released, and a new sample could pick the client for it)
                released |= {offset + c.round for c in ledger.charges(str(client)) if c.released or c.left_out}
            finally:
                ledger.close()
        offset += rounds
    reply = {"client_id": str(client), "round": -1, "released": sorted(released)}
    return Message(to_record(reply, IDENTIFY), reply_to=msg)


def client_charge(msg, context):
    """A round in which sampling left this client out, under amplification: it charges its own ledger for the round
    (``ReleasePipeline.charge_only``), or sits out for good if its budget refuses; nothing is released."""
    from flwr.app import Message

    from privfl.accounting.errors import PrivacyBudgetExceeded

    run_spec = _node_run_spec(context)
    client = int(_node_value(context, PARTITION_KEY))
    request = from_record(msg.content, CHARGE)
    spec, alg, phased = _party(run_spec, request.get("phase"))
    rnd = _planned_round(spec, request["round"])
    pinned = _pinned_terms(context, run_spec, spec)
    if pinned is not None:
        _admit_run(context, run_spec, pinned)
    plan = _run_plan(alg, spec)
    ledger = _ledger(spec, context, phased, plan)
    try:
        pipeline = plan.pipeline(client, ledger, _noise(spec.privacy, client_seed(spec.fed.seed, client)))
        try:
            with ledger.transaction():
                pipeline.charge_only(rnd)
            sat_out = False
        except PrivacyBudgetExceeded:
            sat_out = True
        audit = _audit(context, ledger, client, _composition(run_spec, phased))
    finally:
        ledger.close()
    reply = {"client_id": str(client), "round": rnd, "sat_out": sat_out, "audit": audit}
    return Message(to_record(reply, CHARGE), reply_to=msg)


#: The error codes a ClientApp replies with (``Error.code``): the server learns which kind of failure, and of which
#: partition, never the text, which may quote the organisation's data (a file path, a label out of range).
CLIENT_ERROR_CODES = {"configuration": 4100, "data": 4101, "deployment": 4102, "protocol": 4103, "internal": 4199}


def _client_error_kind(exc: BaseException) -> str:
    from privfl.data.errors import DatasetError
    from privfl.secure_agg.errors import ProtocolAbort

    if isinstance(exc, DatasetError):
        return "data"
    if isinstance(exc, ConfigurationError):
        return "configuration"
    if isinstance(exc, DeploymentError):
        return "deployment"
    if isinstance(exc, (ProtocolAbort, MessageError)):
        return "protocol"
    return "internal"


def client_error_reply(msg, context, exc: BaseException):
    """The reply of a ClientApp whose handler raised ``exc``: the full text and traceback go to this SuperNode's own
    log (``logging``, logger ``privfl.flower``); the server gets an error code and the partition id only."""
    import logging
    import traceback

    from flwr.app import Error, Message

    kind = _client_error_kind(exc)
    try:
        partition = str(int(context.node_config[PARTITION_KEY]))
    except Exception:  # noqa: BLE001 - a node without a partition id still answers
        partition = "unknown"
    logging.getLogger("privfl.flower").error("privfl ClientApp (partition %s) failed [%s]:\n%s", partition, kind,
                                             "".join(traceback.format_exception(exc)))
    reason = (f"privfl-client-error kind={kind} partition={partition}: the reason is in that organisation's "
              f"SuperNode log")
    return Message(error=Error(code=CLIENT_ERROR_CODES[kind], reason=reason), reply_to=msg)


def _guarded(handler):
    """``handler`` with every exception turned into :func:`client_error_reply` (nothing data-derived crosses)."""
    import functools

    @functools.wraps(handler)
    def guarded(msg, context):
        try:
            return handler(msg, context)
        except Exception as exc:  # noqa: BLE001 - whatever failed, its text stays on the SuperNode
            return client_error_reply(msg, context, exc)

    return guarded


def _apps():
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    server, client = ServerApp(), ClientApp()
    server.main()(server_main)
    client.train()(_guarded(client_train))
    client.train(SECAGG.split(".", 1)[1])(_guarded(client_secagg))
    client.train(CHARGE_TYPE.split(".", 1)[1])(_guarded(client_charge))
    client.query()(_guarded(client_identify))
    return server, client


def __getattr__(name):  # flwr is imported when a Flower component is looked up, not when privfl.flower.app is
    if name in ("server_app", "client_app"):
        server, client = _apps()
        globals().update(server_app=server, client_app=client)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- the Flower app directory -------------------------------------------------------------------------------------

APP_MODULE = "privfl_flower_app"


def algorithm_modules(algorithm: str, modules=()) -> list[str]:
    """``modules`` (paths of Python files that define and register the run's own algorithms) checked: each a ``.py``
    file whose name is a module name; and when ``algorithm`` was registered with ``privfl.register_algorithm`` from a
    file, that file is among them (the Flower app must import it to know the algorithm)."""
    from privfl.algorithms import ALGORITHMS

    paths = [os.path.abspath(str(m)) for m in modules]
    for path in paths:
        stem, ext = os.path.splitext(os.path.basename(path))
        if ext != ".py" or not stem.isidentifier() or stem == APP_MODULE or not os.path.isfile(path):
            raise ConfigurationError(f"modules: {path} is not a Python file whose name is a module name")
    if len({os.path.basename(p) for p in paths}) != len(paths):
        raise ConfigurationError("modules: two files with the same name")
    plain = getattr(ALGORITHMS.get(algorithm), "plain_type", None)
    if plain is not None and not plain.__module__.startswith("privfl."):
        code = plain.client_step.__code__  # the algorithm's own step (abstract in the base): it knows its file
        source = None if code.co_filename.startswith("<") else os.path.abspath(code.co_filename)
        if source not in paths:
            where = source or f"module {plain.__module__}"
            raise ConfigurationError(f"the algorithm {algorithm!r} is registered in this process only: pass "
                                     f"modules=[{where!r}] (the file that registers it), so the Flower app imports it "
                                     "on the server and every client")
    return paths


def write_app(directory: str, spec: RunSpec, *, result_path: str = "", test_path: str = "",
              data_path_template: str = "", ledger_path_template: str = "", modules=(),
              checkpoint_path: str = "", test_from_clients: bool = False) -> str:
    """Write a Flower app (``pyproject.toml`` and a two-line module) that runs ``spec`` with privfl's ServerApp and
    ClientApp; ``flwr run DIRECTORY CONNECTION`` ships it to the SuperLink. privfl must be installed where the
    SuperLink and SuperNodes run (the app declares no dependencies, so nothing is installed at run time).
    The path templates (``{partition-id}`` in them) serve SuperNodes without data-path / ledger-path in their node
    config: the Simulation Engine's. ``modules``: Python files that register the run's own algorithms
    (``privfl.register_algorithm``), copied into the app, which imports them before the ServerApp and ClientApp run.
    ``checkpoint_path``: where the ServerApp keeps the global state after each round (default: ``result_path`` with
    ".checkpoint" added), which a resumed run id continues from. ``test_from_clients``: the test file holds the
    clients' own held-out records (a simulation's split), so a private run never stops on its metrics."""
    import shutil

    paths = algorithm_modules(spec.algorithm, modules)
    os.makedirs(directory, exist_ok=True)
    copies = []
    for path in paths:
        copies.append(os.path.join(os.path.abspath(directory), os.path.basename(path)))
        shutil.copyfile(path, copies[-1])
    # TOML basic strings share JSON's escapes, so json.dumps of a string is a valid TOML string.
    config = {SPEC_KEY: spec.to_json(), RESULT_KEY: result_path, LOG_RESULT_KEY: False, TEST_KEY: test_path,
              CHECKPOINT_KEY: checkpoint_path, PAUSE_KEY: 0, TEST_FROM_CLIENTS_KEY: bool(test_from_clients),
              TEMPLATE_KEYS[DATA_KEY]: data_path_template, TEMPLATE_KEYS[LEDGER_KEY]: ledger_path_template,
              "rounds": 0, "epsilon": 0.0, "run-id": "",  # OVERRIDE_KEYS: 0 and "" keep the spec's
              MODULES_KEY: json.dumps(copies)}
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
        f.write(app_module_source([os.path.splitext(os.path.basename(p))[0] for p in paths]))
    return directory


def app_module_source(module_names) -> str:
    """The text of the app module ``write_app`` writes (``privfl_flower_app.py``), importing ``module_names`` (the
    run's own algorithm modules, in order) before privfl's components: what ``privfl.flower.warm`` compares a FAB's
    app module with on a SuperNode that trusts no server."""
    imports = "".join(f"import {name}  # registers its algorithm\n" for name in module_names)
    return ('"""privfl\'s Flower components (see privfl.flower.app)."""\n\n' + imports +
            "from privfl.flower import app as _privfl\n\n"
            "server_app = _privfl.server_app  # flwr finds components by assignment (it reads this file's AST)\n"
            "client_app = _privfl.client_app\n")


__all__ = ["ALIGNMENT_KEY", "CLIENT_ERROR_CODES", "DeploymentError", "MODULES_KEY", "algorithm_modules",
           "app_module_source", "import_algorithm_modules", "OVERRIDE_KEYS", "RunSpec", "client_error_reply", "client_seed",
           "client_train", "read_result", "read_run_spec", "runs_on_flower", "server_main", "write_app"]
