"""The ledgers of a multi-phase run (``privfl.runtime.phases``): each phase is charged in a ledger run of its own,
``<run id>-<phase>``, opened with metadata that ties it to its run; a client's guarantee is its charges over every
phase composed. Kept apart from the runtime (no torch, no algorithm is imported here) so that a deployment's client
can report its composed audit from any step of the protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from privfl.core.public import SEEDED_NOISE_WARNING

if TYPE_CHECKING:
    from privfl.algorithms.base import Phase


def phase_run_id(run_id: str, phase: str) -> str:
    """The ledger run of phase ``phase`` of the multi-phase run ``run_id`` (on every ledger that charges it)."""
    return f"{run_id}-{phase}"


def phase_ledger_meta(phase: Phase, index: int, run_id: str, dataset: str, epsilon_target: float) -> dict:
    """The metadata a phase's ledger run is opened with, which ties it to its run (``phase_of``, ``phase``,
    ``phase_index``, ``epsilon_target``: what :func:`phase_runs_of` and ``privfl audit --run-id <run id>``
    compose)."""
    privacy = phase.privacy
    meta = {"algorithm": phase.algorithm.name, "dataset": dataset,
            "noise": "secure" if privacy.secure_noise else "seeded", "phase_of": run_id, "phase": phase.name,
            "phase_index": int(index), "epsilon_target": epsilon_target}
    if privacy.private and not privacy.secure_noise:
        meta["warning"] = SEEDED_NOISE_WARNING
    return meta


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


__all__ = ["composed_audit", "composed_epsilon", "phase_ledger_meta", "phase_run_id", "phase_runs_of"]
