"""Privacy units and placements as a wrapper around a non-private :class:`privfl.algorithms.plain.Algorithm`.

:func:`register_algorithm` turns an algorithm's class into a registered privfl algorithm (``privfl.algorithms.
ALGORITHMS``), so every entry point runs it (``privfl.federate``, the Python runtime, Flower's Simulation Engine). The
wrapper decides everything the algorithm does not:

- **client level** (``unit="client"``): each channel is the client's value clipped to L2 norm ``clip`` by the release
  pipeline, released with the public weight 1; the noise is added by the client (``local``), the aggregator
  (``central``) or shared by the clients under secure aggregation (``distributed``), calibrated by the run plan;
- **record level** (``unit="example"``): ``data.train`` is the one DP-SGD engine (``privfl.privacy.record_level.
  dpsgd_train``: opacus, Poisson sampling, the user's loss and optimizer), the client step cannot read its records any
  other way, and may train once per round; the one channel it returns is post-processing of that training and charges
  the round's planned DP-SGD event (reported to the run plan by :meth:`PrivateAlgorithm.planned_events`, calibrated
  once per schedule). ``update_bound`` clips each coordinate of that value to a public range (post-processing), which
  secure aggregation needs;
- **non-private** (``epsilon = inf``): plain local training, the public example-count weights of FedAvg.

The server step receives each channel's weighted mean (``Aggregate.total / total_weight``) whatever the placement.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np
import torch

from privfl.algorithms.base import ClientOutput
from privfl.privacy.record_level import (DPSGD, calibrate_dpsgd, check_dpsgd_privacy, check_opacus_model,
                                         check_user_loss, dpsgd_schedule)
from privfl.algorithms.fedavg import FedAvg
from privfl.algorithms.plain import Algorithm, LocalData
from privfl.core.channels import Channel, NormClip, PrivatizedValue, TrainedPrivately, Unclipped
from privfl.errors import ConfigurationError, UsageError
from privfl.training.local import TaskLoss, flat_parameters, load_flat_parameters


#: the record-level refusals of a client step, the same from a real round's data and the dry run's
TRAINS_ONCE = ("{name}: at record level a client step trains once per round (its release is charged one round of "
               "DP-SGD); call data.train once")
READS_THROUGH_TRAIN = ("{name}: at record level a client step reads its data only through data.train (DP-SGD); "
                       "anything else it computed from the records would leave unprotected")


class ClientStepContract(RuntimeError):
    """A registered algorithm's client step returned something its contract does not allow, on some data: in a
    private run its round releases the charged fallback (:meth:`PrivateAlgorithm.check_client_step` refused the
    program's own breaches up front), elsewhere it is an error."""


class _ClientData(LocalData):
    """A client's data at client level and without privacy: local training, and the records themselves (a client-level
    channel is clipped as a whole, so any function of them is covered)."""

    def __init__(self, owner: "PrivateAlgorithm", dataset, rng: np.random.Generator):
        self._owner, self._dataset, self._rng = owner, dataset, rng
        self.metrics: dict[str, float] = {}

    def train(self, params: np.ndarray) -> np.ndarray:
        local = self._owner._local
        load_flat_parameters(local, np.asarray(params, dtype=np.float32))
        self._owner.local_train(local, self._dataset, self._rng)
        return flat_parameters(local)

    def tensors(self):
        """The client's records ``(x, y)`` as tensors."""
        return self._dataset.tensors()


class _RecordLevelData(LocalData):
    """A client's data at record level: one DP-SGD training per round, and no other access to its records."""

    def __init__(self, owner: "PrivateAlgorithm", client: int, dataset, rng: np.random.Generator):
        self._owner, self._client, self._dataset, self._rng = owner, client, dataset, rng
        self.schedule = dpsgd_schedule(owner, client)
        self.noise_multiplier = owner.noise_multiplier(self.schedule)
        self.trained = False
        self.metrics: dict[str, float] = {"noise_multiplier": self.noise_multiplier}
        self._stats: dict[str, float] = {}

    def train(self, params: np.ndarray) -> np.ndarray:
        owner = self._owner
        if self.trained:
            raise UsageError(TRAINS_ONCE.format(name=owner.name))
        self.trained = True
        engine = DPSGD(owner.model, self.schedule, noise_multiplier=self.noise_multiplier, clip=owner.privacy.clip,
                       lr=owner.fed.lr, momentum=owner.fed.momentum, secure_noise=owner.privacy.secure_noise,
                       loss=owner.user.loss, optimizer=owner.user.optimizer, algorithm=owner.name)
        [(_, trained, stats)] = engine.train(params, [self._dataset.tensors()], [self._rng], vectorised=False)
        # DP-SGD's own statistics (the lot's plain mean loss) are functions of the records, not of the noised
        # training: kept from the client step, which could fold them into its release (a review, session 26: a
        # q-FFL-style step weighting its update by the loss told D from D' in 4 runs of 5), and added to the
        # round's local metrics (never sent) after it returns
        self._stats = dict(stats)
        return trained

    def tensors(self):
        raise UsageError(READS_THROUGH_TRAIN.format(name=self._owner.name))

    @property
    def event(self):
        return self.schedule.round_event(self.noise_multiplier)


#: the public probe records of :meth:`PrivateAlgorithm.check_client_step`'s dry run
_DRY_RECORDS = 4


class _DryData(LocalData):
    """The data of :meth:`PrivateAlgorithm.check_client_step`'s dry run: a few public probe records (standard normal
    features, zero targets; no client's), and a ``train`` that moves the parameters by a small fixed public vector
    (a step that divides by its change's norm must not fail on a change of zero: the contract is about shapes, so no
    training is run). At record level the records are not readable and ``train`` runs once, as in a real round."""

    def __init__(self, owner: "PrivateAlgorithm", records, rng: np.random.Generator, *, record_level: bool):
        self._owner, self._records, self._record_level = owner, records, record_level
        self._shift = 1e-3 * rng.standard_normal(owner.dim).astype(np.float32)
        self.trained = False
        self.metrics: dict[str, float] = (
            {"noise_multiplier": owner.noise_multiplier(dpsgd_schedule(owner, 0))} if record_level else {})

    def train(self, params: np.ndarray) -> np.ndarray:
        if self._record_level and self.trained:
            raise UsageError(TRAINS_ONCE.format(name=self._owner.name))
        self.trained = True
        return np.asarray(params, dtype=np.float32) + self._shift

    def tensors(self):
        if self._record_level:
            raise UsageError(READS_THROUGH_TRAIN.format(name=self._owner.name))
        return self._records.tensors()


def _message_mapping(value, what: str, name: str) -> dict:
    if not isinstance(value, Mapping):
        raise UsageError(f"{name}: {what} must be a mapping of arrays and numbers, got "
                                 f"{type(value).__name__}")
    return {str(k): v for k, v in value.items()}


class PrivateAlgorithm(FedAvg):
    """A registered non-private algorithm (``plain``) run under the run's privacy unit and placement (module
    docstring). Built by :func:`register_algorithm`; its options are the algorithm's dataclass fields."""

    plain_type: type[Algorithm] = Algorithm
    supports_privacy = True
    units = ("client", "example")
    #: the client step reads the algorithm's broadcast only
    broadcast_state = ("broadcast_values",)
    #: the algorithm's whole server state (broadcast_values is derived from it): what a checkpoint holds
    server_only_state = ("server_state",)
    #: each client's own state, kept on its side
    client_state = ("client_states",)

    def __init__(self, fed, privacy, model=None, loss=None, optimizer=None, metrics=None, update_bound=None,
                 **options):
        super().__init__(fed, privacy, model=model, loss=loss, optimizer=optimizer, metrics=metrics)
        try:
            self.plain = self.plain_type(**options)
        except TypeError as exc:
            raise ConfigurationError(f"{self.name}: {exc}") from None
        channels = tuple(self.plain.channels)
        if not channels or len(set(channels)) != len(channels) or not all(isinstance(c, str) for c in channels):
            raise ConfigurationError(f"{self.name}: channels must be distinct names, got {channels!r}")
        if update_bound is not None and (isinstance(update_bound, bool) or not isinstance(update_bound, (int, float))
                                         or not math.isfinite(update_bound) or update_bound <= 0):
            raise ConfigurationError(f"{self.name}: update_bound must be a finite number > 0 or None, got "
                                     f"{update_bound!r}")
        self.update_bound = None if update_bound is None else float(update_bound)
        self.accountant = None
        if self.record_level:
            self.accountant = check_dpsgd_privacy(privacy, self.name)
            if len(channels) != 1:
                raise ConfigurationError(f"{self.name}: at record level a client step releases one channel (the "
                                         f"post-processing of its DP-SGD training); it declares {list(channels)}")
            if loss is not None:
                TaskLoss(loss).require_per_example(self.name)
        self.server_state: dict[str, Any] = {}
        self.broadcast_values: dict[str, Any] = {}
        self.client_states: dict[int, dict] = {}

    @property
    def record_level(self) -> bool:
        return bool(self.privacy.private and self.privacy.unit == "example")

    # -- the model and the server's state ------------------------------------------------------------------------

    def build_model(self, public):
        net = super().build_model(public)
        if self.record_level and self.user.model is not None:
            check_opacus_model(net, self.name, public.input_shape)
        if self.record_level:
            check_user_loss(net, self.user.loss, self.name, public)
        return net

    def setup(self, data, rng):
        super().setup(data, rng)
        self._set_server(self.plain.init(self.global_params.copy()), "init")
        if self.privacy.private:
            self.check_client_step()

    def _set_server(self, state, step: str) -> None:
        state = _message_mapping(state, f"{step}() must return the server state, which", self.name)
        params = np.asarray(state.get("params"), dtype=np.float32) if "params" in state else None
        if params is None or params.shape != (self.dim,):
            raise ConfigurationError(f"{self.name}: the server state from {step}() must hold 'params', a vector of "
                                     f"the model's {self.dim} parameters")
        if not np.all(np.isfinite(params)):
            from privfl.errors import TrainingDiverged

            raise TrainingDiverged(f"{self.name}: {step}() produced non-finite global parameters")
        self.server_state = state
        self.global_params = params
        self.broadcast_values = _message_mapping(self.plain.broadcast(MappingProxyType(dict(state))),
                                                 "broadcast() must return what clients receive, which", self.name)

    def check_broadcast(self, round) -> None:
        """After a client half loads a broadcast: the model it evaluates is the broadcast's ``params`` when it carries
        them (a review, session 26: the diagnostic view, read for ``class_prior`` decisions, compare's calibration and
        the CLI's model description, evaluated the untrained initial model)."""
        super().check_broadcast(round)
        params = self.broadcast_values.get("params") if isinstance(self.broadcast_values, Mapping) else None
        if params is not None and np.shape(params) == (self.dim,):
            self.global_params = np.asarray(params, dtype=np.float32)

    # -- channels and what each release charges --------------------------------------------------------------------

    def channels(self):
        names = tuple(self.plain.channels)
        adjacency = self.privacy.adjacency
        if not self.privacy.private:
            return [Channel(n, (self.dim,), unit="client", clip=Unclipped(), description=f"{self.name} {n}")
                    for n in names]
        if self.record_level:
            return [Channel(names[0], (self.dim,), unit="example", clip=TrainedPrivately(), adjacency=adjacency,
                            value_bound=self.update_bound,
                            description=f"{self.name} {names[0]} after DP-SGD training (post-processing)")]
        return [Channel(n, (self.dim,), unit="client", clip=NormClip(self.privacy.clip), adjacency=adjacency,
                        description=f"{self.name} {n}, clipped to C") for n in names]

    def release_weight(self, dataset, client: int = 0) -> float:
        if self.privacy.private and self.privacy.unit == "client":
            return 1.0  # an example count would make a client's influence data-dependent
        return super().release_weight(dataset, client)

    def noise_multiplier(self, schedule) -> float:
        """DP-SGD's z for a client with ``schedule`` (``calibrate_dpsgd`` computes it once per schedule and target)."""
        return calibrate_dpsgd(self.privacy.epsilon, self.privacy.delta, self.fed.rounds, schedule, self.accountant)

    def planned_events(self, client: int) -> dict:
        """The per-round event of ``client``'s release at record level (the run plan's); empty otherwise."""
        if not self.record_level:
            return {}
        schedule = dpsgd_schedule(self, client)
        return {self.plain.channels[0]: schedule.round_event(self.noise_multiplier(schedule))}

    # -- the two steps ---------------------------------------------------------------------------------------------

    @property
    def vectorisable(self) -> bool:
        return False

    def _checked_output(self, out) -> tuple[dict, Any]:
        """``client_step``'s ``(values, state)`` against its contract (a pair; a mapping of exactly the declared
        channels, each a vector of the model's parameters), or :class:`ClientStepContract`."""
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ClientStepContract(f"{self.name}: client_step must return (values, state)")
        values, new_state = out
        try:
            values = _message_mapping(values, "client_step's values", self.name)
        except UsageError as exc:
            raise ClientStepContract(str(exc)) from None
        if set(values) != set(self.plain.channels):
            raise ClientStepContract(f"{self.name}: client_step returned {sorted(values)}, its channels are "
                                     f"{list(self.plain.channels)}")
        vectors = {}
        for name in self.plain.channels:
            v = np.asarray(values[name])
            if v.shape != (self.dim,):
                raise ClientStepContract(f"{self.name}: client_step's {name!r} has shape {v.shape}; a channel is a "
                                         f"vector of the model's {self.dim} parameters")
            vectors[name] = v
        if new_state is not None:
            try:
                new_state = _message_mapping(new_state, "client_step's state", self.name)
            except UsageError as exc:
                raise ClientStepContract(str(exc)) from None
        return vectors, new_state

    def check_client_step(self) -> None:
        """The client step's contract, checked once before any record is read, on public facts alone: a dry run on a
        client of no records, of the data's public input shape, at the initial broadcast (its own randomness from a
        fixed public seed; nothing is released or charged). A breach there is the program's, the same on every
        neighbouring dataset: a :class:`UsageError` up front. A breach only on some data is decided by the records:
        in a private run the round then releases the charged fallback (:mod:`privfl.runtime.local_step`), never an
        error the server would see uncharged (a review, session 26: a step making one pass per 100 records returned a
        0-d mean on 99 records and released on 100). Any other exception of the dry run is not the contract's and is
        left to the run."""
        public = self.public
        probe = np.random.default_rng(0)
        n = _DRY_RECORDS
        if public.task == "classification":
            labels = np.zeros(n, dtype=np.int64)
        elif public.num_classes == 1:
            labels = np.zeros(n, dtype=np.float32)
        else:
            labels = np.zeros((n, int(public.num_classes)), dtype=np.float32)
        from privfl.data import ArrayDataset

        records = ArrayDataset(probe.standard_normal((n, *public.input_shape)).astype(np.float32), labels, public.task,
                               public.num_classes, "dry run")
        data = _DryData(self, records, probe, record_level=self.record_level)
        try:
            with torch.random.fork_rng(devices=[]):
                out = self.plain.client_step(MappingProxyType(dict(self.broadcast_values)), data, None, probe)
        except UsageError:
            raise
        except Exception:  # noqa: BLE001 - not a breach of the contract (a step may refuse public probe records)
            return
        try:
            self._checked_output(out)
        except ClientStepContract as exc:
            raise UsageError(str(exc)) from None

    def client_update(self, client, dataset, round, rng):
        if self.record_level:
            data = _RecordLevelData(self, client, dataset, rng)
        else:
            data = _ClientData(self, dataset, rng)
        state = self.client_states.get(client)
        out = self.plain.client_step(MappingProxyType(dict(self.broadcast_values)), data,
                                     None if state is None else MappingProxyType(dict(state)), rng)
        vectors, new_state = self._checked_output(out)
        if new_state is None:
            self.client_states.pop(client, None)
        else:
            self.client_states[client] = new_state
        if self.record_level:
            name = self.plain.channels[0]
            value = vectors[name]
            if self.update_bound is not None:
                value = np.clip(value, -self.update_bound, self.update_bound)
            vectors[name] = PrivatizedValue(value, data.event)
        metrics = {**data.metrics, **getattr(data, "_stats", {})}
        return ClientOutput(vectors, weight=self.release_weight(dataset, client), metrics=metrics)

    def checkpoint(self) -> dict[str, Any]:
        """The algorithm's server state (its broadcast and global parameters follow from it)."""
        return {"server_state": copy.deepcopy(dict(self.server_state))}

    def restore(self, values) -> None:
        if set(values) != {"server_state"}:
            from privfl.errors import CorruptMessage

            raise CorruptMessage(f"{self.name}: a checkpoint holds ['server_state'], got {sorted(values)}")
        self._set_server(values["server_state"], "restore")

    def server_update(self, aggregates, round):
        means = {name: np.asarray(agg.total, dtype=np.float64) / agg.total_weight for name, agg in aggregates.items()}
        self._set_server(self.plain.server_step(MappingProxyType(dict(self.server_state)), MappingProxyType(means)),
                         "server_step")


def register_algorithm(name: str):
    """Class decorator: register a non-private :class:`Algorithm` (a frozen dataclass of its options) as the privfl
    algorithm ``name``, run under any privacy unit and placement by :class:`PrivateAlgorithm`. Returns the class
    unchanged; ``privfl.algorithms.ALGORITHMS[name]`` is the wrapper. A name privfl already uses is refused."""
    from privfl.algorithms import ALGORITHMS

    if not (isinstance(name, str) and name.isidentifier() and name == name.lower()):
        raise ConfigurationError(f"an algorithm name is a lower-case identifier, got {name!r}")

    def register(cls):
        if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
            raise ConfigurationError(f"register_algorithm({name!r}) takes a subclass of privfl.Algorithm")
        if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
            raise ConfigurationError(f"{cls.__name__}: write the algorithm as a frozen dataclass of its options "
                                     "(@dataclasses.dataclass(frozen=True))")
        existing = ALGORITHMS.get(name)
        if existing is not None and getattr(existing, "plain_type", None) is not cls:
            raise ConfigurationError(f"the algorithm name {name!r} is taken; choose another")
        fields = [f for f in dataclasses.fields(cls) if f.init]
        taken = {"fed", "privacy", "model", "loss", "optimizer", "metrics", "update_bound"} & {f.name for f in fields}
        if taken:
            raise ConfigurationError(f"{cls.__name__}: option name(s) {sorted(taken)} are privfl's own; rename them")

        def __init__(self, fed, privacy, model=None, loss=None, optimizer=None, metrics=None, update_bound=None,
                     **options):
            PrivateAlgorithm.__init__(self, fed, privacy, model=model, loss=loss, optimizer=optimizer,
                                      metrics=metrics, update_bound=update_bound, **options)

        base = inspect.signature(__init__)
        own = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                 default=f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty)
               for f in fields]
        __init__.__signature__ = base.replace(parameters=[p for p in base.parameters.values()
                                                         if p.kind is not p.VAR_KEYWORD] + own)
        defaults = {"hidden": (100,), **dict(cls.defaults)}
        wrapper = type(cls.__name__ + "Private", (PrivateAlgorithm,),
                       {"name": name, "plain_type": cls, "defaults": defaults, "__init__": __init__,
                        "__doc__": cls.__doc__, "__module__": cls.__module__})
        ALGORITHMS[name] = wrapper
        return cls

    return register


def unregister_algorithm(name: str) -> None:
    """Remove an algorithm :func:`register_algorithm` registered (privfl's own cannot be removed)."""
    from privfl.algorithms import ALGORITHMS

    cls = ALGORITHMS.get(name)
    if cls is None or not issubclass(cls, PrivateAlgorithm):
        raise ConfigurationError(f"{name!r} is not an algorithm registered with register_algorithm")
    del ALGORITHMS[name]


__all__ = ["PrivateAlgorithm", "register_algorithm", "unregister_algorithm"]
