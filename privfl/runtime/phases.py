"""Multi-phase runs: an algorithm whose run is several algorithms one after the other (FedBNR: kernel learning, then
Bayesian linear regression on the learnt features). This module holds the phase logic every runtime shares; the
in-process runtime runs such an algorithm as a :class:`privfl.runtime.engine.PhasedSimulation`, a deployment
(``privfl.flower.app``) across its server and clients.

The protocol is :func:`privfl.algorithms.base.phases_of`: the algorithm fixes each phase's share of the budget up
front, from public inputs, yields a :class:`privfl.algorithms.base.Phase` (an algorithm with its federation and
privacy configuration), is sent that phase's trained server half back, and yields the next. A
:class:`privfl.runtime.engine.Simulation` given such an algorithm is a :class:`privfl.runtime.engine.PhasedSimulation`: each phase
is a run of its own, with its plan, pipelines and executor, charged in the ledger run ``<run id>-<phase>``; the
phases' rounds are numbered one after the other in the run's history (each record says its phase), and each client's
epsilon, after every round and in ``result.audit``, is its charges over all phases so far composed under the run's
accountant (the phases' ledger runs hold the same clients; their budgets are the phases' shares, whose composition
meets the target). What the phases release goes through their pipelines exactly as in a one-phase run.

The same logic serves a deployment, whose server and clients are apart: :func:`run_phases` is the loop over the
phases (the server runs each phase and hands its trained server half to the next), :func:`phase_run_id` and
:func:`phase_ledger_meta` name and describe each phase's ledger run on every party's ledger (they and the composition
of a run's ledgers live in :mod:`privfl.runtime.phase_ledgers`, which a client can import without the runtime), and
:func:`phase_at` rebuilds a phase on a client, which never holds the earlier phases' server halves: it is given their
final server states (their last broadcasts, post-processing of what was released) instead. That is enough because of
the protocol's rule for a phase handed to the next one: the next phase is built from what the trained half holds in
its ``broadcast_state`` and what its ``setup`` built from public facts (FedBNR's phase 2 takes phase 1's
``kernel()``, its set-up network with the broadcast ``global_params``).

:func:`privfl.runtime.engine.run_fedbnr` is the FedBNR front end kept for scripts: it builds the two-phase FedBNR and runs it
in process.
"""

from __future__ import annotations

import numpy as np

from privfl.algorithms.base import Broadcast, ClientHalf, Phase, phases_of
from privfl.runtime.phase_ledgers import (composed_audit, composed_epsilon, phase_ledger_meta, phase_run_id,  # noqa: F401
                                  phase_runs_of)
from privfl.core.public import PublicFacts


def setup_phase(phase: Phase, public: PublicFacts) -> None:
    """Set a phase's algorithm up as a one-phase run does: from the public facts, with the setup stream of the
    phase's own seed (``privfl.core.plan.seed_stream``)."""
    from privfl.core.plan import seed_stream

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


__all__ = ["composed_audit", "composed_epsilon", "final_state", "phase_at", "phase_ledger_meta", "phase_run_id",
           "phase_runs_of", "run_phases", "setup_phase"]
