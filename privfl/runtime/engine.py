"""The in-process simulation runtime: the embedded default.

It runs the clients one after another on this machine, routes every client output through that client's
:class:`ReleasePipeline`, and gives the server only weighted sums. The algorithm's client and server steps do not
depend on it, so a deployment runtime can carry the same :class:`Release` objects between machines.

The algorithm is set up from the federation's :class:`privfl.core.public.PublicFacts` only (never from the clients' data),
and what one client sends in one round is :meth:`Simulation.client_step`: the client's work, then its release
pipeline. The neighbouring-dataset contract test runs exactly that step on neighbouring datasets.

Halves and plan. Every noise level and seed stream comes from one :class:`privfl.core.plan.RunPlan`, built once in
:meth:`Simulation.prepare`. The algorithm object given to the runtime is the server half; an algorithm that declares
its broadcast (``broadcast_state``, :mod:`privfl.algorithms.base`) has its client steps run on a separate client
half, which learns the server's state only from each round's :class:`privfl.algorithms.base.Broadcast` and keeps
each client's own state (``client_state``) on the client side, as a deployment does; the others still run both
halves in one object.

Executors. An algorithm whose local step is the same computation on every client (FedAvg, FedProx, DP-FedAvg; it
offers ``client_updates`` and says ``vectorisable``) has a round's clients trained together by the vectorised executor
(``privfl.training.stacked``); each client's output then goes through its own pipeline exactly as ``client_step`` sends it
(:meth:`Simulation.client_steps`). ``executor="per_client"`` forces the loop; ``"auto"`` (the default) picks.

Threads. BLAS thread pools (numpy's OpenBLAS/MKL) are limited to ``blas_threads`` (default 1) while a run executes:
the runtime's numpy work is on vectors of a few hundred thousand floats, where a threaded pool on a busy machine
costs far more in synchronisation than it saves. torch's own intra-op threads are left as the user set them.

Phases. ``Simulation(algorithm, ...)`` of a multi-phase algorithm (FedBNR with kernel rounds) is a
:class:`PhasedSimulation`: each phase a run of its own, with the loop and ledger runs of :mod:`privfl.runtime.phases`.
:func:`run_fedbnr` is the FedBNR front end kept for scripts: it builds the two-phase FedBNR and runs it here.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping

import numpy as np

from privfl.accounting.errors import PrivacyBudgetExceeded
from privfl.accounting.ledger import PrivacyLedger
from privfl.mechanisms import SecureNoise, SeededNoise
from privfl.core.aggregation import noise_only_sums, weighted_sums
from privfl.algorithms.base import FederatedAlgorithm, Phase, check_kept_state
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.core.plan import RunPlan, seed_stream
from privfl.core.release import Release, mark_round_released
from privfl.core.plan import noise_multipliers_for as plan_multipliers
from privfl.errors import ConfigurationError
from privfl.runtime.phase_ledgers import composed_audit, composed_epsilon, phase_ledger_meta, phase_run_id
from privfl.runtime.local_step import fallback_on_failure, releases_as_removed, removed_output, run_local_step
from privfl.runtime.phases import run_phases
from privfl.runtime.rounds import RoundOutcome, RoundRecord, run_rounds
from privfl.core.public import SEEDED_NOISE_WARNING, PublicFacts, client_sampler
from privfl.privacy.secure import SecureAggregation, local_noise_stds, public_weight_bound, secure_weighted_sums
from privfl.secure_agg import ProtocolAbort


@dataclass
class RunResult:
    algorithm: str
    dataset: str
    clients: int
    rounds: int
    epsilon_target: float
    delta: float
    accountant: str
    noise_multipliers: dict[str, float] | None
    history: list[RoundRecord] = field(default_factory=list)
    audit: dict = field(default_factory=dict)
    ledger: str = ":memory:"
    run_id: str = "default"
    noise: str = "secure"
    #: a multi-phase run's phases, in order: name, ledger run id, rounds, target, noise multipliers, final, audit
    phases: list[dict] = field(default_factory=list)

    @property
    def final(self) -> dict[str, float]:
        return self.history[-1].metrics if self.history else {}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["final"] = self.final
        return d


def noise_multipliers_for(algorithm: FederatedAlgorithm, privacy: PrivacyConfig, rounds: int,
                          channels=None) -> dict[str, float] | None:
    """The noise multiplier of each of ``algorithm``'s private channels (``privfl.core.plan.noise_multipliers_for``)."""
    return plan_multipliers(channels if channels is not None else algorithm.channels(), privacy, rounds)


EXECUTORS = ("auto", "vectorised", "per_client")

def _client_names(data, n_clients: int) -> list[str]:
    """The clients' names where the data records them (own data, ``privfl.federate``), else their indices."""
    names = (getattr(data, "info", None) or {}).get("clients")
    if isinstance(names, (list, tuple)) and len(names) == n_clients:
        return [str(n) for n in names]
    return [str(k) for k in range(n_clients)]


def check_schedules_fit(algorithm: FederatedAlgorithm, data) -> None:
    """Refuse a client too small for its public DP-SGD schedule, before anything is charged.

    "Too small": under the schedule each local step samples each record with probability q (batch_size over the
    public size the schedule is planned for: the design size ``client_size``, or the client's declared count), and
    the noise of a step is sized for the schedule's expected batch. A client of n records with q * n < 1, fewer
    than one record per step on average, sees no record at all in a share (1 - q)^n of its steps: its updates are
    almost pure noise that still spend its budget and are averaged in with the others. Such a client
    needs at least ceil(1 / q) records (ceil(client_size / batch_size) at the design size).

    The check reads the clients' record counts, which are private: it runs where the user holds every client (the
    in-process runtime behind ``privfl.federate``, ``privfl run`` and ``privfl compare``), and its error goes to
    that user only. With declared public counts (replace-one) q * n = min(n, batch_size), so it never fires.
    """
    if getattr(algorithm, "accountant", None) is None:  # the DP-SGD accountant of an algorithm that trains by DP-SGD
        return
    from privfl.privacy.record_level import dpsgd_schedule

    parts = data.train_parts
    names = None
    for k, part in enumerate(parts):
        schedule = dpsgd_schedule(algorithm, k)
        n, q = len(part), float(schedule.sample_rate)
        if q * n >= 1:
            continue
        names = names or _client_names(data, len(parts))
        need = math.ceil(1.0 / q - 1e-9)
        raise ConfigurationError(
            f"client {names[k]!r} holds {n} training record{'s' if n != 1 else ''}, too few for {algorithm.name}'s "
            f"DP-SGD schedule: each local step samples each record with probability q = {q:.3g} (batch_size "
            f"{algorithm.fed.batch_size} / the public client size {schedule.size}), so it would see {q * n:.2g} "
            f"records per step on average (none at all in {100 * (1 - q) ** n:.0f}% of its steps): its updates would "
            f"be almost pure noise that still spends its budget. Under this schedule a client needs at least {need} "
            f"records (ceil(client_size / batch_size)). Declare a smaller design size (client_size=, --client-size) "
            f"close to your smallest client's, raise batch_size (--batch-size), declare the record counts public (--adjacency replace_one, "
            f"PrivacyConfig(adjacency='replace_one')), or leave this client out; nothing was charged")


def _blas_limit(threads: int | None):
    """Limit numpy's BLAS pools to ``threads`` (threadpoolctl, shipped with scikit-learn) for a run."""
    if threads is None:
        return contextlib.nullcontext()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - scikit-learn brings it
        return contextlib.nullcontext()
    return threadpool_limits(limits=threads, user_api="blas")


class Simulation:
    """Runs ``algorithm`` on ``data`` for ``fed.rounds`` rounds under ``privacy``, charging ``ledger``. A multi-phase
    algorithm (``privfl.algorithms.base.phases_of``) runs its phases one after the other: the simulation is then a
    :class:`PhasedSimulation`."""

    def __new__(cls, algorithm=None, *args, **kwargs):
        from privfl.algorithms.base import is_phased

        if cls is Simulation and is_phased(algorithm):
            return super().__new__(PhasedSimulation)
        return super().__new__(cls)

    def __init__(self, algorithm: FederatedAlgorithm, data, fed: FederationConfig, privacy: PrivacyConfig, *,
                 ledger_path: str = ":memory:", run_id: str | None = None,
                 progress: Callable[[RoundRecord], None] | None = None, secure: SecureAggregation | None = None,
                 public: PublicFacts | None = None, executor: str = "auto", blas_threads: int | None = 1):
        if executor not in EXECUTORS:
            raise ConfigurationError(f"executor must be one of {EXECUTORS}, got {executor!r}")
        if blas_threads is not None and (isinstance(blas_threads, bool) or not isinstance(blas_threads, int)
                                         or blas_threads < 1):
            raise ConfigurationError(f"blas_threads must be an integer >= 1 or None, got {blas_threads!r}")
        self.executor = executor
        self.blas_threads = blas_threads
        self.algorithm = algorithm
        self.data = data
        self.fed = fed
        self.privacy = privacy
        self.progress = progress
        self.secure = secure
        self.public = public if public is not None else PublicFacts.of(data, privacy, fed)
        self.run_id = run_id or f"{algorithm.name}-eps{privacy.epsilon:g}-seed{fed.seed}"
        noise = "secure" if privacy.secure_noise else "seeded"
        meta = {"algorithm": algorithm.name, "dataset": getattr(data, "name", "?"), "noise": noise}
        if privacy.private and not privacy.secure_noise:
            meta["warning"] = SEEDED_NOISE_WARNING
        self.ledger = PrivacyLedger(ledger_path, self.run_id, delta=privacy.delta, epsilon_budget=privacy.epsilon,
                                    accountant=privacy.resolved_accountant, meta=meta)
        if any(c.round < fed.rounds for c in self.ledger.charges()):
            # a second run under the same id would release against the first's charges of its rounds (a round a
            # client was left out of, or an unreleased charge) and compose both runs' releases as one: refused, as
            # `privfl run` does (a charge at a round this run never reaches only spends budget, as any would)
            self.ledger.close()
            raise ConfigurationError(f"the ledger {ledger_path} already holds charges of run {self.run_id!r} (the "
                                     "default run id is <algorithm>-eps<epsilon>-seed<seed>, so this may be the same "
                                     "run again): pass a new run_id (or another ledger) to start a new run; "
                                     f"`privfl audit {ledger_path} --run-id {self.run_id}` reads the old one")
        self.ledger_path = ledger_path
        self._prepared = False

    def _noise(self, seq: np.random.SeedSequence):
        return SecureNoise() if self.privacy.secure_noise else SeededNoise(np.random.default_rng(seq))

    def prepare(self) -> None:
        """Set the algorithm up from the public facts, build the run plan (every noise level, once) and one pipeline
        per client."""
        fed, privacy, alg = self.fed, self.privacy, self.algorithm
        n_clients = self.public.n_clients
        if len(self.data.train_parts) != n_clients:
            raise ConfigurationError(f"the public facts declare {n_clients} clients but the data has "
                                     f"{len(self.data.train_parts)}")
        setup_seq = seed_stream(fed.seed, "setup")
        alg.setup(self.public, np.random.default_rng(setup_seq))
        plan = self.plan = RunPlan.build(alg, privacy, fed, self.public, self.secure)
        self.ledger.record_meta("trust", plan.trust)  # before the first charge: what every charge holds under
        # The client side: a separate instance that learns the server's state only from each round's broadcast
        # (privfl.algorithms.base); an algorithm that has not declared its broadcast runs both halves in one object.
        self.split = bool(alg.splittable and alg.broadcast_state)
        self.client_half = (alg.client_half(self.public, np.random.default_rng(setup_seq)) if self.split
                            else None)
        self.client_states: list[dict | None] = [None] * n_clients
        self._broadcast = None
        self.secure_rng = np.random.default_rng(plan.stream("secure"))  # simulated dropouts only
        # each client's own encoding generator (rounding coins, noise shares), as a deployment's client holds it
        self.secure_rngs = {str(k): plan.secure_rng(k) for k in range(n_clients)}
        self.train_rngs = [plan.train_rng(k) for k in range(n_clients)]
        self.pipelines = [plan.pipeline(k, self.ledger, self._noise(plan.client_stream(k)))
                          for k in range(n_clients)]
        self.server_noise = self._noise(plan.stream("server"))
        self.sampler = client_sampler(plan.stream("sample"), self.privacy.secure_noise and self.privacy.private)
        self.channels, self.plans, self.multipliers = list(plan.channels), plan.distributed, plan.noise_multipliers
        check_schedules_fit(alg, self.data)  # before anything is charged: every client can fill its schedule
        self._prepared = True

    def client_step(self, k: int, rnd: int) -> dict[str, Release]:
        """Everything client ``k`` sends in round ``rnd``: its local work on its own data, then its release pipeline
        (validate, clip, charge, noise). Raises :class:`PrivacyBudgetExceeded` (nothing charged or released)."""
        if not self._prepared:
            self.prepare()
        out = self._client_update(k, rnd)
        return self.pipelines[k].release(rnd, out.values, out.weight)

    def broadcast(self, rnd: int):
        """The server half's broadcast for round ``rnd`` (made once per round; None in single-object mode)."""
        if not self.split:
            return None
        if self._broadcast is None or self._broadcast.round != rnd:
            self._broadcast = self.algorithm.broadcast(rnd)
        return self._broadcast

    def _client_update(self, k: int, rnd: int):
        """Client ``k``'s local work: on its client half, from the broadcast and its own state. In a private run a
        client-level client without records releases zeros without a local step, and an exception its local step
        raises is released as the data-independent fallback (:mod:`privfl.runtime.local_step`)."""
        dataset = self.data.train_parts[k]
        if releases_as_removed(self.privacy, dataset):
            return removed_output(self.algorithm, self.pipelines[k], k, self.plan.trained_events.get(k))
        on_failure = fallback_on_failure(self.algorithm, self.privacy, self.pipelines[k], k, rnd,
                                         self.plan.trained_events.get(k))
        if not self.split:
            return run_local_step(lambda: self.algorithm.client_update(k, dataset, rnd, self.train_rngs[k]),
                                  on_failure)
        check_kept_state(self.algorithm, k, self.client_states[k], self.ledger.has_charges(str(k)))
        out, self.client_states[k] = self.client_half.client_update(
            k, self.broadcast(rnd), dataset, self.client_states[k], self.train_rngs[k], on_failure=on_failure)
        return out

    @property
    def vectorised(self) -> bool:
        """Whether this run's rounds use the vectorised executor (see the module docstring)."""
        if self.executor == "per_client":
            return False
        split = self._prepared and self.split
        alg = self.client_half.algorithm if split else self.algorithm
        able = hasattr(alg, "client_updates") and bool(getattr(alg, "vectorisable", False))
        if self.executor == "vectorised" and not able:
            raise ConfigurationError(f"{alg.name} with this model cannot run on the vectorised executor; use "
                                     f"executor='auto' or 'per_client'")
        return able

    def client_steps(self, clients, rnd: int):
        """``(k, releases)`` for each client of ``clients``: what :meth:`client_step` would send, with the local work
        of all of them done by the round's executor; ``releases`` is the :class:`PrivacyBudgetExceeded` raised by a
        client whose budget is spent (nothing charged or released for it)."""
        if not self._prepared:
            self.prepare()
        clients = [int(k) for k in clients]
        # a client-level client without records: zeros, no local step (privfl.runtime.local_step)
        removed = [k for k in clients if releases_as_removed(self.privacy, self.data.train_parts[k])]
        trained = [k for k in clients if k not in removed]
        outputs = itertools.chain(((k, self._client_update(k, rnd)) for k in removed),
                                  self._local_steps(trained, rnd) if trained else ())
        for k, out in outputs:
            try:
                # under secure aggregation a value leaves as its masked input: marked released then (_mark_sent)
                yield k, self.pipelines[k].release(rnd, out.values, out.weight, mark=self.secure is None)
            except PrivacyBudgetExceeded as exc:
                yield k, exc

    def _local_steps(self, clients, rnd: int):
        """``(k, output)`` of the round's executor for ``clients``. In a private run an exception raised inside the
        vectorised executor (one client's records can make the stacked step fail for all) does not fail the others:
        the clients it had not yet given out are run one by one, where a client whose own step raises releases the
        fallback (:meth:`_client_update`)."""
        if not self.vectorised:
            for k in clients:
                yield k, self._client_update(k, rnd)
            return
        datasets, rngs = [self.data.train_parts[k] for k in clients], [self.train_rngs[k] for k in clients]
        if self.split:
            steps = self._kept(self.client_half.client_updates(
                clients, self.broadcast(rnd), datasets, [self.client_states[k] for k in clients], rngs))
        else:
            steps = self.algorithm.client_updates(clients, datasets, rnd, rngs)
        done = set()
        try:
            for k, out in steps:
                done.add(k)
                yield k, out
        except Exception:  # noqa: BLE001 - retried client by client, where a refusal raises again
            if not self.privacy.private:
                raise
            for k in clients:
                if k not in done:
                    yield k, self._client_update(k, rnd)

    def _kept(self, steps):
        """``(k, output)`` of the client half's ``(k, output, state)``, keeping each client's state on its side."""
        for k, out, state in steps:
            self.client_states[k] = state
            yield k, out

    def local_metrics(self, dataset) -> dict[str, float]:
        """Metrics of the clients' own models on ``dataset`` (the algorithm's ``local_metrics``), computed where the
        client states live: on the client half with every client's state loaded, or on the one object."""
        if not self.split:
            return self.algorithm.local_metrics(dataset)
        return self.client_half.local_metrics(self.client_states, dataset)

    def diagnostic_algorithm(self) -> FederatedAlgorithm:
        """The object to read post-run diagnostics from (``calibration_predictions``, ``predict_proba``, a saved
        model): the algorithm itself in single-object mode; with the halves apart, a copy of the client half holding
        the server's current state (its broadcast) and every client's state (shared: read it, do not train it)."""
        if not self._prepared:
            self.prepare()
        if not self.split:
            return self.algorithm
        return self.client_half.view(self.client_states, self.algorithm.broadcast(self.fed.rounds))

    def _mark_sent(self, clients, rnd: int) -> None:
        """Mark the round's rows of ``clients`` released: their masked inputs are about to leave (a simulated
        dropout's rows stay charged and unmarked, as on a deployment)."""
        with self.ledger.transaction():
            for cid in clients:
                mark_round_released(self.ledger, cid, rnd)

    def run(self) -> RunResult:
        with _blas_limit(self.blas_threads):
            return self._run()

    def _run(self) -> RunResult:
        fed, privacy, alg = self.fed, self.privacy, self.algorithm
        self.prepare()
        result = RunResult(alg.name, getattr(self.data, "name", "?"), self.public.n_clients, fed.rounds,
                           privacy.epsilon, privacy.delta, privacy.resolved_accountant, self.multipliers,
                           ledger=self.ledger_path, run_id=self.run_id,
                           noise="secure" if privacy.secure_noise else "seeded")

        def on_round(record: RoundRecord) -> None:
            result.history.append(record)
            if self.progress is not None:
                self.progress(record)

        test = self.data.test
        # the clients' own held-out records (never charged) may not decide how many rounds a private run releases
        held_out = bool(getattr(self.data, "test_from_clients", False)) and privacy.private
        run_rounds(alg, InProcess(self), n_clients=self.public.n_clients, rounds=fed.rounds,
                   sampling_rate=privacy.sampling_rate, sampler=self.sampler,
                   evaluate=lambda: alg.evaluate(test), local_evaluate=lambda: self.local_metrics(test), test=test,
                   on_round=on_round, fixed_denominator=self.plan.amplified, test_private=held_out)
        result.audit = self.ledger.audit()
        if privacy.private and not privacy.secure_noise:
            result.audit["warning"] = SEEDED_NOISE_WARNING
        return result


class InProcess:
    """The in-process transport of :func:`privfl.runtime.rounds.run_rounds`: each client's local work and release
    pipeline run here (:meth:`Simulation.client_steps`), the sums are made here (in the clear, or through secure
    aggregation's protocol run in memory)."""

    def __init__(self, sim: Simulation):
        self.sim = sim
        self._released_any = False

    def round(self, rnd: int, chosen, left_out) -> RoundOutcome:
        sim, privacy = self.sim, self.sim.privacy
        releases, sat_out = [], []
        # The round's charges and release marks share one durable commit; nothing reaches the server (the sums
        # below) before it, so no release leaves without its row.
        with sim.ledger.transaction():
            for k in left_out:
                try:
                    sim.pipelines[k].charge_only(rnd)
                except PrivacyBudgetExceeded:
                    sat_out.append(k)
            for k, sent in sim.client_steps(chosen, rnd):
                if isinstance(sent, PrivacyBudgetExceeded):
                    sat_out.append(k)
                else:
                    releases.extend(sent.values())
        releases.sort(key=lambda r: int(r.client_id))  # sums in client order, whichever executor trained them
        participants = len({r.client_id for r in releases})
        self._released_any = self._released_any or bool(releases)
        if not releases:
            if privacy.private and sim.plan.amplified:  # nobody sampled: the model still moves by the round's noise
                return RoundOutcome(noise_only_sums(sim.channels, sim.plan.noise_multipliers, sim.server_noise),
                                    participants, tuple(sat_out))
            return RoundOutcome(None, participants, tuple(sat_out))
        by_name = {c.name: c for c in sim.channels}
        try:
            if sim.secure is not None:
                aggregates = secure_weighted_sums(
                    releases, by_name, sim.secure, sim.secure_rng, sim.server_noise, distributed=sim.plans,
                    secure_noise=privacy.secure_noise, client_rngs=sim.secure_rngs,
                    weight_bound=public_weight_bound(privacy, sim.public), n_clients=sim.public.n_clients,
                    local_stds=local_noise_stds(sim.channels, sim.plan.placement, sim.multipliers),
                    on_masked_input=lambda sent: sim._mark_sent(sent, rnd))
            else:
                aggregates = weighted_sums(releases, by_name, sim.server_noise)
        except ProtocolAbort:  # the round could not be aggregated safely: nothing is revealed, the global state stays
            return RoundOutcome(None, participants, tuple(sat_out), aborted=True)
        return RoundOutcome(aggregates, participants, tuple(sat_out))

    def epsilons(self) -> list[float]:
        if self.sim.privacy.private:
            return [v["epsilon"] for v in self.sim.ledger.audit()["clients"].values()]
        # every release of a non-private run is charged NonPrivateEvent: epsilon = inf once one is made
        return [math.inf] if self._released_any else [0.0]


# -- multi-phase runs (privfl.runtime.phases) -----------------------------------------------------------------------------

@dataclass
class PhaseRun:
    """One phase of a run: its name, the simulation that ran it (its ledger, plan, trained algorithm) and result."""

    name: str
    simulation: Simulation
    result: RunResult | None = None

    @property
    def algorithm(self):
        return self.simulation.algorithm

    @property
    def ledger(self):
        return self.simulation.ledger


class PhasedSimulation(Simulation):
    """A :class:`Simulation` of a multi-phase algorithm (see :mod:`privfl.runtime.phases`). ``Simulation(algorithm, ...)``
    returns one when ``algorithm`` is phased; the arguments mean what they mean there. After :meth:`run`,
    ``phase_runs`` holds each phase's :class:`PhaseRun`, ``ledger`` the last phase's ledger."""

    def __init__(self, algorithm, data, fed: FederationConfig, privacy: PrivacyConfig, *,
                 ledger_path: str = ":memory:", run_id: str | None = None, progress=None, secure=None,
                 public: PublicFacts | None = None, executor: str = "auto", blas_threads: int | None = 1):
        if executor not in EXECUTORS:
            raise ConfigurationError(f"executor must be one of {EXECUTORS}, got {executor!r}")
        self.executor, self.blas_threads = executor, blas_threads
        self.algorithm, self.data, self.fed, self.privacy = algorithm, data, fed, privacy
        self.progress, self.secure = progress, secure
        self._given_public = public
        self.public = public if public is not None else PublicFacts.of(data, privacy, fed)
        self.run_id = run_id or f"{algorithm.name}-eps{privacy.epsilon:g}-seed{fed.seed}"
        self.ledger_path = ledger_path
        self.ledger = None
        self.phase_runs: list[PhaseRun] = []
        self._prepared = False

    def prepare(self) -> None:
        raise ConfigurationError(f"{self.algorithm.name} runs as several phases, each prepared when it starts: call "
                                 "run()")

    def client_step(self, k: int, rnd: int):
        raise ConfigurationError(f"{self.algorithm.name} runs as several phases; a client step belongs to one of "
                                 "them (run each phase's algorithm in a Simulation of its own)")

    @property
    def final_algorithm(self):
        """The last phase's trained server half (what the run learnt: a saved model comes from it)."""
        if not self.phase_runs:
            raise RuntimeError(f"{self.algorithm.name}: run() first")
        return self.phase_runs[-1].algorithm

    def diagnostic_algorithm(self):
        """The last phase's trained algorithm, to read post-run diagnostics from (a saved model, predictions)."""
        if not self.phase_runs:
            raise RuntimeError(f"{self.algorithm.name}: run() first")
        return self.phase_runs[-1].simulation.diagnostic_algorithm()

    def epsilon_by_round(self, delta: float | None = None) -> dict[str, list[tuple[int, float]]]:
        """Each client's epsilon after each round it was charged in, the phases' rounds numbered one after the other
        and composed over every phase so far (as ``PrivacyLedger.epsilon_by_round`` for one run)."""
        from privfl.accounting.ledger import composed_epsilon as history_epsilon, history_key

        delta = self.privacy.delta if delta is None else delta
        charged: dict[str, list] = {}
        offset = 0
        for p in self.phase_runs:
            for c in p.ledger.charges():
                charged.setdefault(c.client_id, []).append((offset + c.round, c.event))
            offset += p.simulation.fed.rounds
        accountant = self.privacy.resolved_accountant
        out = {}
        for cid, items in sorted(charged.items(), key=lambda kv: (len(kv[0]), kv[0])):
            rounds = sorted({r for r, _ in items})
            out[cid] = [(r, history_epsilon(accountant, history_key([i for i in items if i[0] <= r]), delta))
                        for r in rounds]
        return out

    def _epsilons(self, ledgers) -> list[float]:
        eps = composed_epsilon(ledgers, self.privacy.delta, self.privacy.resolved_accountant)
        return list(eps.values()) or [0.0]

    def run(self) -> RunResult:
        privacy = self.privacy
        history: list[RoundRecord] = []
        self.phase_runs = []
        offset = 0

        def run_phase(index: int, phase: Phase):
            nonlocal offset
            self._open_phase_run(phase, index)
            sim = Simulation(phase.algorithm, self.data, phase.fed, phase.privacy, ledger_path=self.ledger_path,
                             run_id=phase_run_id(self.run_id, phase.name), secure=self.secure,
                             public=self._given_public, executor=self.executor, blas_threads=self.blas_threads)
            earlier = [p.ledger for p in self.phase_runs]
            sim.progress = self._recorder(phase.name, offset, earlier, sim)
            run = PhaseRun(phase.name, sim)
            self.phase_runs.append(run)
            self.ledger = sim.ledger
            run.result = sim.run()
            history.extend(run.result.history)
            offset += phase.fed.rounds
            return sim.algorithm

        run_phases(self.algorithm, self.public, run_phase)
        ledgers = {p.name: p.ledger for p in self.phase_runs}
        accountant = privacy.resolved_accountant
        result = RunResult(self.algorithm.name, getattr(self.data, "name", "?"), self.public.n_clients,
                           self.fed.rounds, privacy.epsilon, privacy.delta, accountant,
                           {p.name: p.result.noise_multipliers for p in self.phase_runs}, history,
                           ledger=self.ledger_path, run_id=self.run_id,
                           noise="secure" if privacy.secure_noise else "seeded")
        result.audit = composed_audit(ledgers, self.run_id, privacy.delta, accountant, privacy.epsilon)
        if privacy.private and not privacy.secure_noise:
            result.audit["warning"] = SEEDED_NOISE_WARNING
        if privacy.private and result.audit["max_epsilon"] > privacy.epsilon * (1 + 1e-9):
            raise RuntimeError(f"{self.algorithm.name}: the phases composed to epsilon "
                                 f"{result.audit['max_epsilon']} > the target {privacy.epsilon}; this is a bug")
        result.phases = [{"name": p.name, "run_id": p.result.run_id, "rounds": p.result.rounds,
                          "epsilon_target": p.result.epsilon_target, "noise_multipliers": p.result.noise_multipliers,
                          "final": p.result.final, "audit": p.result.audit} for p in self.phase_runs]
        return result

    def _open_phase_run(self, phase, index: int) -> None:
        """Open the phase's ledger run first with the metadata that ties it to this run (``phase_of``, ``phase``,
        ``phase_index``, ``epsilon_target``: what ``privfl audit --run-id <run id>`` composes); the phase's
        simulation then continues that run."""
        if self.ledger_path == ":memory:":
            return
        from privfl.accounting.ledger import PrivacyLedger

        privacy = phase.privacy
        meta = phase_ledger_meta(phase, index, self.run_id, getattr(self.data, "name", "?"), self.privacy.epsilon)
        PrivacyLedger(self.ledger_path, phase_run_id(self.run_id, phase.name), delta=privacy.delta,
                      epsilon_budget=privacy.epsilon, accountant=privacy.resolved_accountant, meta=meta).close()

    def _recorder(self, name: str, offset: int, earlier: list, sim: Simulation):
        """The progress hook of phase ``name``: numbers its rounds after the earlier phases', marks them with the
        phase, and gives each the clients' epsilon composed over the earlier phases and this one so far."""

        def record(rec: RoundRecord) -> None:
            rec.round += offset
            rec.phase = name
            if self.privacy.private:
                eps = self._epsilons([*earlier, sim.ledger])
                rec.epsilon_max, rec.epsilon_mean = float(max(eps)), float(np.mean(eps))
            elif earlier and any(math.isinf(r.epsilon_max) for p in self.phase_runs[:-1] for r in p.result.history):
                rec.epsilon_max = rec.epsilon_mean = math.inf  # a non-private release of an earlier phase
            if self.progress is not None:
                self.progress(rec)

        return record


# -- FedBNR's front end -------------------------------------------------------------------------------------------

@dataclass
class FedBNRRun:
    """Both phases of a FedBNR run: the phase results, the fitted phase-2 algorithm (the global GP), and each
    client's epsilon composed over both phases."""

    regression: RunResult
    algorithm: object  # privfl.algorithms.fedbnr.FedBNR, phase 2's
    kernel: RunResult | None = None  # phase 1's, if run
    kernel_algorithm: object | None = None  # privfl.algorithms.fedbnr.FedBNRKernel
    epsilon_per_client: dict[str, float] = field(default_factory=dict)
    phase_epsilons: tuple[float, float] | None = None
    ledgers: list = field(default_factory=list)  # the phases' PrivacyLedgers, kernel first
    result: RunResult | None = None  # the whole run (every phase's rounds, the composed audit)

    @property
    def epsilon(self) -> float:
        return max(self.epsilon_per_client.values(), default=0.0)

    @property
    def final(self) -> dict[str, float]:
        return self.regression.final


def run_fedbnr(data, fed, privacy, *, kernel_rounds: int = 0, kernel_fed=None, kernel_share: float = 0.5,
               kernel_options: Mapping | None = None, options: Mapping | None = None, secure=None,
               ledger_path: str = ":memory:", run_id: str | None = None, progress=None) -> FedBNRRun:
    """Run FedBNR: phase 1 for ``kernel_rounds`` rounds (skipped when 0: pure RFF), then phase 2 for ``fed.rounds``
    rounds (1 suffices), on the same clients, within one (epsilon, delta) per client: ``FedBNR(fed, privacy,
    kernel_rounds=..., ...)`` through :class:`privfl.runtime.engine.Simulation`, ledger runs ``<id>-kernel`` and
    ``<id>-regression`` (``<id>``: ``run_id``, default ``fedbnr-<seed>``).

    ``kernel_fed``: the FederationConfig of phase 1 (default ``fed``; its rounds are replaced by ``kernel_rounds``).
    ``kernel_options`` / ``options``: keyword arguments of ``FedBNRKernel`` (its default network, ``hidden=(32,)``,
    unless given) / ``FedBNR``. ``secure``: a :class:`privfl.privacy.secure.SecureAggregation` for both phases.
    """
    from privfl.algorithms import make_algorithm

    options = dict(options or {})
    base_id = run_id or f"fedbnr-{fed.seed}"
    if isinstance(kernel_rounds, bool) or not isinstance(kernel_rounds, int) or kernel_rounds < 0:
        raise ConfigurationError(f"kernel_rounds must be an integer >= 0, got {kernel_rounds!r}")
    if kernel_rounds == 0:
        alg = make_algorithm("fedbnr", fed, privacy, **options)
        sim = Simulation(alg, data, fed, privacy, ledger_path=ledger_path, run_id=f"{base_id}-regression",
                         progress=progress, secure=secure)
        result = sim.run()
        eps = composed_epsilon([sim.ledger], privacy.delta, privacy.resolved_accountant)
        return FedBNRRun(result, alg, epsilon_per_client=eps, ledgers=[sim.ledger], result=result)
    kernel_options = {"hidden": (32,), **dict(kernel_options or {})}
    alg = make_algorithm("fedbnr", fed, privacy, kernel_rounds=kernel_rounds, kernel_fed=kernel_fed,
                         kernel_share=kernel_share, kernel_options=kernel_options, **options)
    sim = Simulation(alg, data, fed, privacy, ledger_path=ledger_path, run_id=base_id, progress=progress,
                     secure=secure)
    result = sim.run()
    kernel, regression = sim.phase_runs
    return FedBNRRun(regression.result, regression.algorithm, kernel.result, kernel.algorithm,
                     {cid: v["epsilon"] for cid, v in result.audit["clients"].items()}, alg.phase_epsilons,
                     ledgers=[kernel.ledger, regression.ledger], result=result)
