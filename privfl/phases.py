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

:func:`run_fedbnr` is the FedBNR front end kept for scripts: it builds the two-phase FedBNR and runs it here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from privfl.algorithms.base import phases_of
from privfl.config import FederationConfig, PrivacyConfig
from privfl.errors import ConfigurationError
from privfl.public import SEEDED_NOISE_WARNING, PublicFacts
from privfl.runtime import EXECUTORS, RoundRecord, RunResult, Simulation


def composed_epsilon(ledgers, delta: float, accountant: str) -> dict[str, float]:
    """Each client's epsilon at ``delta`` over the charges of several ledgers (one per phase), composed: each ledger's
    rounds grouped as the ledger groups them (``accounting.rounds.round_events``: a round's sampled channels share one
    coin), the phases one after the other."""
    from privfl.accounting.ledger import composed_epsilon as history_epsilon, history_key

    histories: dict[str, tuple] = {}
    for ledger in ledgers:
        by_client: dict[str, list] = {}
        for charge in ledger.charges():
            by_client.setdefault(charge.client_id, []).append((charge.round, charge.event))
        for cid, charged in by_client.items():
            histories[cid] = histories.get(cid, ()) + history_key(charged)
    return {cid: history_epsilon(accountant, key, delta) for cid, key in histories.items()}


def phase_runs_of(path: str, run_id: str, held) -> dict[str, object]:
    """The ledger runs of ``path`` (among ``held``) that are the phases of the multi-phase run ``run_id``, in phase
    order, as ``{phase name: PrivacyLedger}`` opened for reading (close them); ``{}`` when there are none."""
    from privfl.accounting.ledger import PrivacyLedger

    found = []
    for rid in held:
        ledger = PrivacyLedger.open_existing(path, rid)
        meta = ledger.meta
        if meta.get("phase_of") == run_id:
            found.append((meta.get("phase_index", 0), meta.get("phase", rid), ledger))
        else:
            ledger.close()
    return {name: ledger for _, name, ledger in sorted(found, key=lambda f: f[0])}


def composed_audit(phases: Mapping[str, object], run_id: str, delta: float, accountant: str,
                   epsilon_budget: float) -> dict:
    """The audit of a multi-phase run (``phases``: phase name -> its ledger), shaped as ``PrivacyLedger.audit``:
    each client's ``epsilon`` is composed over every phase's charges; ``rho``, ``releases`` and ``charges`` add up
    over the phases; ``phase_epsilons`` is each phase's own. ``runs`` names the phases' ledger runs."""
    audits = {name: ledger.audit(delta) for name, ledger in phases.items()}
    total = composed_epsilon(phases.values(), delta, accountant)
    clients: dict[str, dict] = {}
    for name, audit in audits.items():
        for cid, v in audit["clients"].items():
            c = clients.setdefault(cid, {"epsilon": total[cid], "rho": 0.0, "releases": 0, "charges": 0,
                                         "phase_epsilons": {}})
            c["rho"] = None if c["rho"] is None or v["rho"] is None else c["rho"] + v["rho"]
            c["releases"] += v["releases"]
            c["charges"] += v["charges"]
            c["phase_epsilons"][name] = v["epsilon"]
    clients = dict(sorted(clients.items(), key=lambda kv: (len(kv[0]), kv[0])))
    return {"delta": delta, "max_epsilon": max((v["epsilon"] for v in clients.values()), default=0.0),
            "run_id": run_id, "runs": [a["run_id"] for a in audits.values()], "accountant": accountant,
            "epsilon_budget": epsilon_budget, "clients": clients}


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
        steps = phases_of(self.algorithm, self.public)
        phase, offset = next(steps), 0
        while True:
            self._open_phase_run(phase, len(self.phase_runs))
            sim = Simulation(phase.algorithm, self.data, phase.fed, phase.privacy, ledger_path=self.ledger_path,
                             run_id=f"{self.run_id}-{phase.name}", secure=self.secure, public=self._given_public,
                             executor=self.executor, blas_threads=self.blas_threads)
            earlier = [p.ledger for p in self.phase_runs]
            sim.progress = self._recorder(phase.name, offset, earlier, sim)
            run = PhaseRun(phase.name, sim)
            self.phase_runs.append(run)
            self.ledger = sim.ledger
            run.result = sim.run()
            history.extend(run.result.history)
            offset += phase.fed.rounds
            try:
                phase = steps.send(sim.algorithm)
            except StopIteration:
                break
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
        meta = {"algorithm": phase.algorithm.name, "dataset": getattr(self.data, "name", "?"),
                "noise": "secure" if privacy.secure_noise else "seeded", "phase_of": self.run_id,
                "phase": phase.name, "phase_index": index, "epsilon_target": self.privacy.epsilon}
        if privacy.private and not privacy.secure_noise:
            meta["warning"] = SEEDED_NOISE_WARNING
        PrivacyLedger(self.ledger_path, f"{self.run_id}-{phase.name}", delta=privacy.delta,
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


__all__ = ["FedBNRRun", "PhaseRun", "PhasedSimulation", "composed_audit", "composed_epsilon", "phase_runs_of",
           "run_fedbnr"]
