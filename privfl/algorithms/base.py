"""The contract every federated algorithm implements, and its two halves.

A client step returns its round's channel values (it never sends anything itself: the runtime hands the values to
the client's release pipeline). A server step sees only :class:`privfl.core.aggregation.Aggregate` objects, weighted sums
of releases, so secure aggregation can hide every upload without changing the algorithm.

**Two halves joined by messages.** The object a user builds is the server half: ``setup(public, rng)``,
:meth:`FederatedAlgorithm.broadcast`, ``server_update``. The client half (:class:`ClientHalf`, from
:meth:`FederatedAlgorithm.client_half`) is a separate instance of the same class, built from the same public
configuration and facts, that learns the server's state only from a :class:`Broadcast`:
``client_update(broadcast, dataset, state, rng) -> (ClientOutput, state)``, where ``state`` is the client's own (kept
by the runtime on the client's side; ``None`` before its first round). An algorithm declares what crosses:

- ``broadcast_state``: the attributes of the server half a client step reads (the broadcast carries exactly these,
  as message values: numpy arrays, numbers, strings, tuples, mappings);
- ``client_state``: attributes that hold per-client state keyed by client index (dicts, or sets of client
  indices); the client half keeps only the stepping client's entry, and the runtime keeps it between rounds.
  A client's state is ``{attribute: its entry}`` (a set's entry is whether the client is in it);
  :meth:`FederatedAlgorithm.encode_client_state` turns it into message values (e.g. a model as its state_dict's
  arrays) and :meth:`FederatedAlgorithm.decode_client_state` back, so a deployment can keep it between rounds.

Metrics of the clients' own models (personalised models, local models: never released) are not the server's to
compute: :meth:`FederatedAlgorithm.local_metrics` computes them where the client state lives, and ``evaluate`` covers
only what the server half holds. A runtime reports both.

A class whose client step needs something else declares ``splittable = False`` and runs only where one object plays
both halves (the in-process runtime's legacy path).
"""

from __future__ import annotations

import abc
import copy
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from privfl.core.aggregation import Aggregate
from privfl.core.channels import Channel, ClippedValue
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.core.public import PublicFacts
from privfl.privacy.units import check_unit


@dataclass
class ClientOutput:
    """One client's round: channel name -> value, the public weight of its release, and local diagnostics."""

    values: dict[str, np.ndarray | ClippedValue]
    weight: float = 1.0
    metrics: dict[str, float] = field(default_factory=dict)


BROADCAST_KIND = "privfl.broadcast"
CLIENT_STATE_KIND = "privfl.client_state"


@dataclass(frozen=True)
class Broadcast:
    """What the server half sends every client at the start of a round: the round and the server state the
    algorithm's client step reads (``broadcast_state``), as message values (:mod:`privfl.core.messages`)."""

    round: int
    values: Mapping[str, Any]

    def to_bytes(self) -> bytes:
        from privfl.core.messages import to_bytes

        return to_bytes({"round": int(self.round), "values": dict(self.values)}, BROADCAST_KIND)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Broadcast":
        from privfl.errors import CorruptMessage
        from privfl.core.messages import from_bytes

        msg = from_bytes(data, BROADCAST_KIND)
        if set(msg) != {"round", "values"} or type(msg["round"]) is not int or not isinstance(msg["values"], dict):
            raise CorruptMessage("a broadcast holds exactly an integer round and a mapping of values")
        return cls(msg["round"], msg["values"])


#: the largest magnitude a broadcast number may have: privfl's models train in float32, and a number beyond its range
#: (3.4e38) becomes infinite the moment a client loads it, which no honest server's state does
BROADCAST_BOUND = float(np.finfo(np.float32).max)


def check_kept_state(algorithm, client: int, state, charged_before: bool) -> None:
    """Refuse, before any record is read, a client whose algorithm's guarantee rests on state the client keeps
    between rounds (``needs_kept_state``: banded DP-FedSGD's record groups) when that state is missing although the
    client has charges in this run (``charged_before``, from its ledger): a resumed or retried round that lost the
    state would draw the groups afresh and could put one record in two rounds of a block, charged once."""
    from privfl.errors import ConfigurationError

    if getattr(algorithm, "needs_kept_state", False) and state is None and charged_before:
        raise ConfigurationError(f"{algorithm.name}: client {client} has charges in this run but not the state its "
                                 "guarantee rests on (banded noise: its records' groups, drawn at its first round); "
                                 "refused before any record was read: keep the client's state for the whole run")


def check_broadcast_value(label: str, value, held=None) -> None:
    """Refuse a broadcast value a client must not train from, on the value alone (before any record is read): a
    number or numeric array with an entry that is NaN, infinite or beyond :data:`BROADCAST_BOUND`, an array that is
    not numeric, or an array whose shape differs from ``held``'s (what the client half holds in its place: its own
    set-up state or the previous round's broadcast, public). Mappings and sequences are checked entry by entry (their
    numbers only: a registered algorithm's own state may change shape). A value the server chose to make training
    fail on some records and not on their neighbours is refused here, for every client alike, instead of failing (or
    not) on the records."""
    from privfl.errors import ConfigurationError

    def refuse(why: str):
        raise ConfigurationError(f"the server broadcast {label} {why}; refused before any record was read")

    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            refuse(f"as an array of {value.dtype}, not numbers")
        if isinstance(held, np.ndarray) and value.shape != held.shape:
            refuse(f"with shape {value.shape}, where this client holds {held.shape}")
        if value.dtype.kind == "f" and value.size and not float(np.max(np.abs(value))) <= BROADCAST_BOUND:
            refuse(f"with entries that are NaN, infinite or beyond float32's range ({BROADCAST_BOUND:.3g})")
    elif isinstance(held, np.ndarray) and value is not None:
        refuse(f"as a {type(value).__name__}, where this client holds an array of shape {held.shape}")
    elif isinstance(value, (float, np.floating)):
        if not abs(float(value)) <= BROADCAST_BOUND:
            refuse(f"as {float(value)!r} (NaN, infinite or beyond float32's range)")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_broadcast_value(f"{label}[{key!r}]", item)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_broadcast_value(f"{label}[{i}]", item)


def _detached(value):
    """A copy of a broadcast value that shares no mutable buffer with the server half."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        return copy.deepcopy(value)
    return value


class FederatedAlgorithm(abc.ABC):
    """A federated algorithm over channels. Subclasses set ``name`` and implement the five steps."""

    #: attributes of the server half that a client step reads: what :meth:`broadcast` carries
    broadcast_state: tuple[str, ...] = ()
    #: attributes holding per-client state keyed by client index (dicts or sets): what a client half keeps
    client_state: tuple[str, ...] = ()
    #: whether the client step reads only ``broadcast_state`` and its own ``client_state`` (see the module docstring)
    splittable: bool = True
    #: attributes of the server half beyond its broadcast that the server step carries from round to round (an
    #: optimiser's moments): with ``broadcast_state`` they are the server's :meth:`checkpoint`
    server_only_state: tuple[str, ...] = ()
    #: whether :meth:`checkpoint` holds everything the server half carries between rounds (a run on Flower then
    #: resumes from it); an algorithm whose server keeps more (FedBNR's running sums) says False
    checkpointable: bool = True

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        # the constructor's arguments (public configuration): a client half is a fresh instance built from them
        self._init_args = (args, dict(kwargs))
        return self

    name: str = "abstract"
    #: the privacy units the algorithm gives a guarantee at (None: both); another is refused at construction
    units: tuple[str, ...] | None = None
    #: what to say to a user who asked for another unit (e.g. the algorithm that offers it)
    unit_hint: str = ""
    #: whether a finite epsilon is meaningful for this algorithm (non-private baselines refuse one)
    supports_privacy: bool = True
    #: settings ``privfl run`` uses for flags the user leaves out (FederationConfig / PrivacyConfig field names)
    defaults: dict = {"hidden": (100,), "local_epochs": 2, "lr": 0.05, "clip": 1.0}

    #: whether the algorithm clips adaptively when the run asks (``PrivacyConfig.clip_quantile``: a channel of its
    #: own releases the count the clip follows); one that does not refuses such a private run
    adaptive_clipping: bool = False

    def __init__(self, fed: FederationConfig, privacy: PrivacyConfig):
        check_unit(self.name, self.units, privacy, self.unit_hint)
        if privacy.private and privacy.clip_quantile is not None and not self.adaptive_clipping:
            from privfl.errors import ConfigurationError

            # the registry, loaded with this package (a lookup, not an import: base is what the registry imports)
            registry = getattr(sys.modules.get("privfl.algorithms"), "ALGORITHMS", {})
            able = sorted(n for n, cls in registry.items() if getattr(cls, "adaptive_clipping", False))
            raise ConfigurationError(f"{self.name} clips at a fixed bound; clip='adaptive' is available for {able}: "
                                     f"give a number for clip (or choose one of those algorithms)")
        self.fed = fed
        self.privacy = privacy
        self.public: PublicFacts | None = None

    @abc.abstractmethod
    def setup(self, public: PublicFacts, rng: np.random.Generator) -> None:
        """Build the global state from the federation's :class:`privfl.core.public.PublicFacts` alone (a
        :class:`privfl.data.FederatedData` is accepted too and reduced to its public facts by :meth:`bind_public`)."""

    def bind_public(self, data) -> PublicFacts:
        """Keep the public facts of ``data`` (nothing else of it) for the client and server steps."""
        self.public = PublicFacts.of(data, self.privacy, self.fed)
        return self.public

    @abc.abstractmethod
    def channels(self) -> list[Channel]:
        """The channels every client releases each round (available after :meth:`setup`)."""

    def planned_events(self, client: int) -> Mapping[str, Any]:
        """The event each DP-SGD-trained channel (``TrainedPrivately``) of ``client`` charges per round, fixed before
        any client trains: what the run plan records and every release of the channel must charge. An algorithm with
        such channels implements it (the run plan refuses a private run where one is missing); the others have none."""
        return {}

    @abc.abstractmethod
    def client_update(self, client: int, dataset, round: int, rng: np.random.Generator) -> ClientOutput:
        """Local work of ``client`` on its ``dataset`` from the current global state."""

    def private_release_weight(self, client: int) -> float:
        """The weight of ``client``'s release in a private run, known without its data (in a private run every weight
        is a public constant): what its ``client_update`` sends as ``ClientOutput.weight`` whatever its records. A
        runtime sends it with the data-independent releases it makes in the client's place (a local step that
        raised, ``privfl.runtime.local_step``; a client-level client without records). The default is
        ``privfl.core.public.release_weight``'s private answer (the declared record count when sizes are public at
        record level, else 1); an algorithm that sends another constant overrides it
        (``tests/contracts/test_local_step_failures.py`` checks every registered algorithm)."""
        from privfl.core.public import release_weight

        if not self.privacy.private:
            raise RuntimeError(f"{self.name}: a non-private run's release weight is the client's record count; "
                               "private_release_weight is for private runs")
        return release_weight(self.privacy, self.public, client, None)

    def check_broadcast(self, round: int) -> None:
        """A client's check of the broadcast state it holds for ``round``, before any record is read (the client half
        calls it whenever it loads a broadcast, after the generic checks of :func:`check_broadcast_value`): an
        algorithm whose broadcast has a public bound (adaptive clipping's C_t, a precision that is positive)
        refuses a value outside it here, on the broadcast and public facts alone. None by default."""

    def round_clip(self) -> float | None:
        """With adaptive clipping, the clip of the coming round's releases (public: set by earlier releases), for the
        run's report; None otherwise."""
        return None

    @abc.abstractmethod
    def server_update(self, aggregates: Mapping[str, Aggregate], round: int) -> None:
        """Update the global state from the round's weighted sums."""

    def broadcast(self, round: int) -> Broadcast:
        """The round's :class:`Broadcast`: copies of the ``broadcast_state`` attributes (available after setup)."""
        return Broadcast(int(round), {name: _detached(getattr(self, name)) for name in self.broadcast_state})

    def checkpoint(self) -> dict[str, Any]:
        """The server half's state after a round: copies of the ``broadcast_state`` and ``server_only_state``
        attributes (message values, :mod:`privfl.core.messages`). :meth:`restore` of it on a freshly set-up
        instance continues the run exactly."""
        if not self.checkpointable:
            raise NotImplementedError(f"{self.name}: its server half keeps more than it declares; it is not "
                                      "checkpointed")
        return {name: _detached(getattr(self, name)) for name in (*self.broadcast_state, *self.server_only_state)}

    def restore(self, values: Mapping[str, Any]) -> None:
        """Take the server state of a :meth:`checkpoint` (exactly its attributes)."""
        names = {*self.broadcast_state, *self.server_only_state}
        if not self.checkpointable or set(values) != names:
            from privfl.errors import CorruptMessage

            raise CorruptMessage(f"{self.name}: a checkpoint holds {sorted(names)}, got {sorted(values)}")
        for name in (*self.broadcast_state, *self.server_only_state):
            setattr(self, name, _detached(values[name]))

    def client_half(self, public: PublicFacts | None = None, rng: np.random.Generator | None = None) -> "ClientHalf":
        """A client half of this algorithm: a new instance built from the same constructor arguments and set up from
        the public facts (``public``, default this half's) with ``rng`` (the run's setup stream, so its structure
        is the server's); it knows nothing of this object's state."""
        if not self.splittable:
            raise NotImplementedError(f"{self.name}: the client step reads more than the broadcast; it runs only in "
                                      f"the in-process runtime's single-object mode")
        public = public if public is not None else self.public
        if public is None:
            raise RuntimeError(f"{self.name}: setup() must run before client_half() (or pass the public facts)")
        args, kwargs = self._init_args
        client = type(self)(*copy.deepcopy(args), **copy.deepcopy(kwargs))
        client.setup(public, rng if rng is not None else np.random.default_rng(0))
        return ClientHalf(client)

    def encode_client_state(self, client: int, state: Mapping[str, Any]) -> dict[str, Any]:
        """Client ``client``'s state (``{client_state attribute: entry}``) as message values (:mod:`privfl.core.messages`):
        the state itself by default, for entries that already are message values; an algorithm whose entries are
        objects (models) overrides this and :meth:`decode_client_state`."""
        return dict(state)

    def decode_client_state(self, client: int, values: Mapping[str, Any]) -> dict[str, Any]:
        """The inverse of :meth:`encode_client_state` (the client continues exactly as if it had kept its state)."""
        return dict(values)

    @abc.abstractmethod
    def evaluate(self, dataset) -> dict[str, float]:
        """Metrics of the global model on ``dataset`` (accuracy, nll, ece for classification): what the server half
        holds."""

    def local_metrics(self, dataset) -> dict[str, float]:
        """Metrics of the clients' own models on ``dataset`` (never released: a simulation's diagnostic), computed
        from the ``client_state`` entries loaded on this object; ``{}`` for algorithms without client models."""
        return {}

    def predict_proba(self, dataset) -> np.ndarray | None:
        """Class probabilities of the global model on ``dataset`` (for reliability diagrams); None if not offered."""
        return None

    def calibration_predictions(self, dataset) -> tuple[np.ndarray, np.ndarray] | None:
        """The (probabilities, labels) pairs this algorithm's calibration metrics are computed on: the global model
        on the whole of ``dataset`` by default; None when there are none (no global model, no override)."""
        proba = self.predict_proba(dataset)
        if proba is None:
            return None
        return proba, np.asarray(dataset.y)


def model_state_values(model) -> dict[str, np.ndarray]:
    """A torch module's ``state_dict`` (parameters and buffers) as numpy arrays: message values, bit for bit."""
    return {name: tensor.detach().cpu().numpy().copy() for name, tensor in model.state_dict().items()}


def load_model_state(model, values: Mapping[str, np.ndarray]):
    """Load :func:`model_state_values` into ``model`` (of the same architecture; every entry required); returns it."""
    import torch

    model.load_state_dict({name: torch.as_tensor(np.array(value, copy=True)) for name, value in values.items()},
                          strict=True)
    return model


class ClientHalf:
    """The client's side of an algorithm (see the module docstring): it reads the server's state only from the
    :class:`Broadcast` it is given, and a client's own state only from ``state``."""

    def __init__(self, algorithm: FederatedAlgorithm):
        self.algorithm = algorithm

    @property
    def name(self) -> str:
        return self.algorithm.name

    def channels(self) -> list[Channel]:
        return self.algorithm.channels()

    def load(self, broadcast: Broadcast) -> None:
        """Take the server state of ``broadcast`` (exactly the declared ``broadcast_state``), checked before any record
        is read: every number finite and within float32's range, every array numeric and of the shape this half
        holds (:func:`check_broadcast_value`), then the algorithm's own bounds
        (:meth:`FederatedAlgorithm.check_broadcast`). A refused broadcast leaves the half as it was."""
        alg = self.algorithm
        names = set(alg.broadcast_state)
        if set(broadcast.values) != names:
            from privfl.errors import CorruptMessage

            raise CorruptMessage(f"{alg.name}: a broadcast carries {sorted(names)}, got {sorted(broadcast.values)}")
        for name in alg.broadcast_state:
            check_broadcast_value(f"{alg.name}'s {name}", broadcast.values[name], getattr(alg, name, None))
        held = {name: getattr(alg, name, None) for name in alg.broadcast_state}
        for name in alg.broadcast_state:
            setattr(alg, name, _detached(broadcast.values[name]))
        try:
            alg.check_broadcast(broadcast.round)
        except BaseException:
            for name, value in held.items():
                setattr(alg, name, value)
            raise

    def _clear(self) -> None:
        for name in self.algorithm.client_state:
            getattr(self.algorithm, name).clear()

    def _put(self, client: int, state: Mapping | None) -> None:
        """Load client ``client``'s entries of ``state`` (next to whatever is loaded)."""
        if state is None:
            return
        for name in self.algorithm.client_state:
            if name not in state:
                continue
            holder = getattr(self.algorithm, name)
            if isinstance(holder, set):
                if state[name]:
                    holder.add(client)
            else:
                holder[client] = state[name]

    def _enter(self, client: int, state: dict | None) -> None:
        self._clear()
        self._put(client, state)

    def _take(self, client: int) -> dict:
        """Client ``client``'s entries, removed from the holders."""
        state = {}
        for name in self.algorithm.client_state:
            holder = getattr(self.algorithm, name)
            if isinstance(holder, set):
                state[name] = client in holder
                holder.discard(client)
            elif client in holder:
                state[name] = holder.pop(client)
        return state

    def _leave(self, client: int) -> dict:
        state = self._take(client)
        self._clear()
        return state

    def client_update(self, client: int, broadcast: Broadcast, dataset, state: dict | None,
                      rng: np.random.Generator, *, on_failure=None) -> tuple[ClientOutput, dict]:
        """Client ``client``'s round: its work on its own ``dataset`` from ``broadcast`` and its own ``state``.
        ``on_failure``: a function of an exception that the algorithm's local step itself raised (never the
        broadcast's checks, made before any record is read) returning the :class:`ClientOutput` to send in its place
        (a private run's fallback, ``privfl.runtime.local_step``); None: the exception propagates."""
        self.load(broadcast)
        self._enter(client, state)
        try:
            out = self.algorithm.client_update(client, dataset, broadcast.round, rng)
        except Exception as exc:  # noqa: BLE001 - the local step's failure, decided by the records
            if on_failure is None:
                raise
            out = on_failure(exc)
        finally:
            new_state = self._leave(client)
        return out, new_state

    @property
    def vectorisable(self) -> bool:
        alg = self.algorithm
        return hasattr(alg, "client_updates") and bool(getattr(alg, "vectorisable", False))

    def client_updates(self, clients, broadcast: Broadcast, datasets, states, rngs):
        """``(k, ClientOutput, state)`` for each client of ``clients``, trained together by the algorithm's
        vectorised executor. Every client's state is loaded first; a client's state is taken back when its output
        is yielded (an algorithm's ``client_updates`` yields a client once its own state is final)."""
        clients = [int(k) for k in clients]
        self.load(broadcast)
        self._clear()
        for k, state in zip(clients, states):
            self._put(k, state)
        try:
            for k, out in self.algorithm.client_updates(clients, datasets, broadcast.round, rngs):
                yield k, out, self._take(k)
        finally:
            self._clear()

    def local_metrics(self, states, dataset) -> dict[str, float]:
        """The algorithm's :meth:`FederatedAlgorithm.local_metrics` on ``dataset`` with every client's state loaded
        (``states[k]``: client k's, None for a client that has not stepped yet), computed where those states live."""
        self._clear()
        try:
            for k, state in enumerate(states):
                self._put(k, state)
            return self.algorithm.local_metrics(dataset)
        finally:
            self._clear()

    def view(self, states, broadcast: Broadcast | None = None) -> FederatedAlgorithm:
        """A copy of the client half holding ``broadcast``'s server state (if given) and every client's state, to
        read diagnostics from after a run (personalised predictions, a saved model). The states are shared, not
        copied: read them, do not train them. A simulation's view of what, in a deployment, each client computes
        on its own."""
        # a shallow copy: what setup built (models' structure, the public data sets it recognises by identity) is
        # shared; the client-state holders are the view's own, and a loaded broadcast replaces attributes on it only
        alg = copy.copy(self.algorithm)
        for name in alg.client_state:
            setattr(alg, name, type(getattr(alg, name))())
        half = ClientHalf(alg)
        if broadcast is not None:
            half.load(broadcast)
        for k, state in enumerate(states):
            half._put(k, state)
        return alg

    def encode_state(self, client: int, state: Mapping | None) -> bytes:
        """Client ``client``'s state as bytes (:meth:`FederatedAlgorithm.encode_client_state`, then
        :func:`privfl.core.messages.to_bytes`): what a deployment keeps between rounds."""
        from privfl.core.messages import to_bytes

        values = None if state is None else self.algorithm.encode_client_state(client, state)
        return to_bytes({"client": int(client), "state": values}, CLIENT_STATE_KIND)

    def decode_state(self, client: int, data: bytes) -> dict | None:
        """The state :meth:`encode_state` wrote for ``client`` (refused if it is another client's)."""
        from privfl.errors import CorruptMessage
        from privfl.core.messages import from_bytes

        msg = from_bytes(data, CLIENT_STATE_KIND)
        if set(msg) != {"client", "state"} or msg["client"] != int(client):
            raise CorruptMessage(f"{self.name}: this is not client {client}'s state")
        if msg["state"] is None:
            return None
        if not isinstance(msg["state"], dict):
            raise CorruptMessage(f"{self.name}: a client's state is a mapping of values")
        return self.algorithm.decode_client_state(client, msg["state"])


# -- multi-phase algorithms ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Phase:
    """One phase of a multi-phase algorithm: ``algorithm`` (a one-phase algorithm) run for ``fed.rounds`` rounds under
    ``privacy``, its share of the run's budget. ``name`` labels the phase's ledger run (``<run id>-<name>``) and its
    rounds in the run's history."""

    name: str
    algorithm: FederatedAlgorithm
    fed: FederationConfig
    privacy: PrivacyConfig


def is_phased(algorithm) -> bool:
    """Whether ``algorithm`` runs as several phases (:func:`phases_of`): it offers ``phases`` and says ``phased``."""
    return callable(getattr(algorithm, "phases", None)) and bool(getattr(algorithm, "phased", False))


def phases_of(algorithm, public: PublicFacts):
    """The phases of a multi-phase algorithm, one after the other.

    A multi-phase algorithm declares ``phased`` (true), ``phase_plan`` (each phase's name and rounds, in order,
    known before the run) and ``phases(public)``, a generator: it yields a
    :class:`Phase`, is sent that phase's trained server half back, and yields the next phase built from it (FedBNR's
    phase 2 takes phase 1's kernel network), until it returns. The phases' budgets are fixed before the first
    phase, from public inputs only, so that their composition meets the run's target; a runtime runs each phase
    as a run of its own (its plan, pipelines and ledger run) and composes the phases' charges per client.
    """
    steps = algorithm.phases(public)
    trained = None
    while True:
        try:
            phase = steps.send(trained) if trained is not None else next(steps)
        except StopIteration:
            return
        if not isinstance(phase, Phase):
            raise TypeError(f"{algorithm.name}.phases() must yield Phase objects, got {type(phase).__name__}")
        trained = yield phase
        if trained is None:
            raise RuntimeError(f"{algorithm.name}: send each phase's trained algorithm back before the next phase")
