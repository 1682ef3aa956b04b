"""Multi-phase runs: an algorithm whose run is several algorithms one after the other (FedBNR: kernel learning, then
Bayesian linear regression on the learnt features), run by the in-process runtime.

The protocol is :func:`privfl.algorithms.base.phases_of`: the algorithm fixes each phase's share of the budget up
front, from public inputs, yields a :class:`privfl.algorithms.base.Phase` (an algorithm with its federation and
privacy configuration), is sent that phase's trained server half back, and yields the next. A
:class:`privfl.runtime.Simulation` given such an algorithm is a :class:`PhasedSimulation`: each phase is a run of its
own, with its plan, pipelines and executor, charged in the ledger run ``<run id>-<phase>``; the phases' rounds are
numbered one after the other in the run's history (each record says its phase), and each client's epsilon, after
every round and in ``result.audit``, is its charges over all phases so far composed under the run's accountant (the
phases' ledger runs hold the same clients; their budgets are the phases' shares, whose composition meets the
target). What the phases release goes through their pipelines exactly as in a one-phase run.

The same logic serves a deployment (``privfl.flower.app``), whose server and clients are apart: :func:`run_phases`
is the loop over the phases (the server runs each phase and hands its trained server half to the next),
:func:`phase_run_id` and :func:`phase_ledger_meta` name and describe each phase's ledger run on every party's
ledger (they and the composition of a run's ledgers live in :mod:`privfl.phase_ledgers`, which a client can import
without the runtime), and :func:`phase_at` rebuilds a phase on a client, which never holds the earlier phases' server halves:
it is given their final server states (their last broadcasts, post-processing of what was released) instead. That
is enough because of the protocol's rule for a phase handed to the next one: the next phase is built from what the
trained half holds in its ``broadcast_state`` and what its ``setup`` built from public facts (FedBNR's phase 2 takes
phase 1's ``kernel()``, its set-up network with the broadcast ``global_params``).

:func:`run_fedbnr` is the FedBNR front end kept for scripts: it builds the two-phase FedBNR and runs it here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from privfl.algorithms.base import Broadcast, ClientHalf, Phase, phases_of
from privfl.config import FederationConfig, PrivacyConfig
from privfl.errors import ConfigurationError
from privfl.phase_ledgers import (composed_audit, composed_epsilon, phase_ledger_meta, phase_run_id,  # noqa: F401
                                  phase_runs_of)
from privfl.public import SEEDED_NOISE_WARNING, PublicFacts
from privfl.runtime import EXECUTORS, RoundRecord, RunResult, Simulation


def setup_phase(phase: Phase, public: PublicFacts) -> None:
    """Set a phase's algorithm up as a one-phase run does: from the public facts, with the setup stream of the
    phase's own seed (``privfl.plan.seed_stream``)."""
    from privfl.plan import seed_stream

    phase.algorithm.setup(public, np.random.default_rng(seed_stream(phase.fed.seed, "setup")))


def run_phases(algorithm, public: PublicFacts, run_phase) -> list:
    """Run the phases of ``algorithm`` one after the other (:func:`privfl.algorithms.base.phases_of`):
    ``run_phase(index, phase)`` runs one and returns its trained server half, which is handed to the next phase.
    Returns ``[(phase, trained server half)]`` in order. The loop of every runtime that runs phases."""
    done = []
    steps = phases_of(algorithm, public)
    phase = next(steps)
    while True:
        trained = run_phase(len(done), phase)
        done.append((phase, trained))
        try:
            phase = steps.send(trained)
        except StopIteration:
            return done


def final_state(phase: Phase, trained) -> dict:
    """What a phase hands to the next on a party that did not run its server half: the trained half's
    ``broadcast_state`` after its last round (the broadcast of round ``phase.fed.rounds``), as message values."""
    return dict(trained.broadcast(phase.fed.rounds).values)


def phase_at(algorithm, public: PublicFacts, index: int, handed_over, setup=None) -> Phase:
    """Phase ``index`` of ``algorithm``, rebuilt where the earlier phases' server halves are not (a deployment's
    client): each earlier phase's algorithm is set up (``setup(phase)``, default :func:`setup_phase` on
    ``public``), given the server state the run's server handed over (``handed_over[j]``: :func:`final_state` of
    phase ``j``) and sent back as that phase's trained half, so phase ``index`` is built as the server built it.
    The returned phase's algorithm is not set up."""
    from privfl.errors import CorruptMessage

    if isinstance(index, bool) or not isinstance(index, int) or index < 0 or len(handed_over) != index:
        raise CorruptMessage(f"{algorithm.name}: phase {index!r} needs the final states of the {index!r} phases "
                             f"before it, got {len(handed_over)}")
    setup = setup or (lambda p: setup_phase(p, public))
    steps = phases_of(algorithm, public)
    phase = next(steps)
    for j in range(index):
        setup(phase)
        ClientHalf(phase.algorithm).load(Broadcast(phase.fed.rounds, handed_over[j]))
        try:
            phase = steps.send(phase.algorithm)
        except StopIteration:
            raise CorruptMessage(f"{algorithm.name} has {j + 1} phases; there is no phase {index}") from None
    return phase


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
    """A :class:`Simulation` of a multi-phase algorithm (see the module docstring). ``Simulation(algorithm, ...)``
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
    kernel_rounds=..., ...)`` through :class:`privfl.runtime.Simulation`, ledger runs ``<id>-kernel`` and
    ``<id>-regression`` (``<id>``: ``run_id``, default ``fedbnr-<seed>``).

    ``kernel_fed``: the FederationConfig of phase 1 (default ``fed``; its rounds are replaced by ``kernel_rounds``).
    ``kernel_options`` / ``options``: keyword arguments of ``FedBNRKernel`` (its default network, ``hidden=(32,)``,
    unless given) / ``FedBNR``. ``secure``: a :class:`privfl.secure.SecureAggregation` for both phases.
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


__all__ = ["FedBNRRun", "PhaseRun", "PhasedSimulation", "composed_audit", "composed_epsilon", "final_state",
           "phase_at", "phase_ledger_meta", "phase_run_id", "phase_runs_of", "run_fedbnr", "run_phases",
           "setup_phase"]
