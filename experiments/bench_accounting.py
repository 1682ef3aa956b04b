"""Cost of privacy accounting in a private run, printed as ``key=value`` lines measured side by side in one run.

- ``accounting_share_R<R>``: for record-level ``dpsgd_fedavg`` and ``fola`` (epsilon 3, 10 IID clients of MNIST-5k,
  privfl's default federation: MLP 784-100-10, batch 32, one local epoch), the time spent in calibration
  (``calibrate``, ``calibrate_dpsgd``), ledger charges (``PrivacyLedger.charge_all``), release marks, the round's
  commit and audits (``PrivacyLedger.audit``, ``epsilon_by_round``) over the run's wall time, the larger of the two
  algorithms, for R in {5, 50, 200} rounds. Goal <= 0.05 at every R. Every cache (calibrations, PLDs) is cleared
  before each run, so each run pays its own accounting from nothing.
- ``accounting_share_tiny_R<R>``: the same on a tiny model (logistic regression on 2x2-pooled images, batch 64),
  whose rounds take ~0.15 s: a stress case where the fixed cost of calibration shows.
- ``charge_ms_R<R>``: the median time of one ``charge_all`` (one client's round of channels) over both default runs;
  goal: flat, within 1.5x from R = 5 to R = 200.
- ``audit_ms_1000x200``: ``audit()`` of a ledger (PLD accountant) holding 1,000 clients x 200 rounds x 3 channels,
  on the ledger object that wrote it; goal <= 2000. ``audit_reopen_ms_1000x200``: the first audit after reopening
  the file (the cache is rebuilt from the rows once).
- ``commit_ms``: the median charge whose accounting is trivial, i.e. the durable SQLite commit (``synchronous=FULL``)
  that a charge outside a round's transaction pays before its value is released, on this disk.

Timers wrap the entry points from outside (nothing in privfl is changed); nested calls are counted once.
Run: ``python experiments/bench_accounting.py`` (about 30 minutes on 2 cores; ``--quick`` runs R = 5 and 50 only).

Usage: python experiments/bench_accounting.py [--quick] [--smoke]

``--smoke``: every phase at its smallest, in seconds: 2 clients of 64 MNIST-5k images, R = 2, 3 and 4 rounds
printed under the default keys (``..._R5``, ``..._R50``, ``..._R200``), the audit of a 2 clients x 2 rounds ledger
printed as ``audit_ms_1000x200``, 2 commits; a smoke test that every patched entry point still exists and is called,
whose values are not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import statistics
import tempfile
import time

import numpy as np
import torch

import privfl.accounting.calibration as calibration_entry
import privfl.accounting.ledger as ledger_module
import privfl.algorithms.dpsgd_fedavg as dpsgd_module
import privfl.privacy.record_level as record_level_module
import privfl.algorithms.fola as fola_module
from privfl.accounting.events import GaussianEvent, PoissonSampledEvent
from privfl.accounting.ledger import ChargeRequest, PrivacyLedger
from privfl import FederationConfig, PrivacyConfig, make_algorithm, make_federated
from privfl.data import federated_from_arrays
from privfl.runtime.engine import Simulation

ROUNDS = (5, 50, 200)
SMOKE_ROUNDS = (2, 3, 4)  # run under the keys of ROUNDS by --smoke (1 round is the warm-up run's ledger)
ALGORITHMS = ("dpsgd_fedavg", "fola")


class Timers:
    """Wall time inside wrapped accounting entry points (outermost calls only) and each charge's duration."""

    def __init__(self) -> None:
        self.total = 0.0
        self.charges: list[float] = []
        self._depth = 0

    def wrap(self, fn, *, charge: bool = False):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self._depth -= 1
                self.total += elapsed
                if charge:
                    self.charges.append(elapsed)
        return timed


@contextlib.contextmanager
def instrumented(timers: Timers):
    patches = [(ledger_module.PrivacyLedger, "charge_all", True), (ledger_module.PrivacyLedger, "audit", False),
               (ledger_module.PrivacyLedger, "mark_released", False), (ledger_module.PrivacyLedger, "_commit", False),
               (ledger_module.PrivacyLedger, "epsilon_by_round", False),
               # the run plan imports calibrate from its module at call time (privfl.core.plan.noise_multipliers_for)
               (calibration_entry, "calibrate", False), (dpsgd_module, "calibrate_dpsgd", False),
               (fola_module, "calibrate_dpsgd", False)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, charge in patches:
        setattr(owner, name, timers.wrap(getattr(owner, name), charge=charge))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


WORKLOADS = {"": {}, "tiny_": {"hidden": (), "pool": 2, "batch_size": 64}}


def clear_caches() -> None:
    """Forget every memoised calibration and privacy loss distribution, so a run pays its accounting in full."""
    import privfl.accounting.accountants.pld as pld_module
    import privfl.accounting.calibration as calibration_module

    for fn in (calibration_module._calibrate_named, record_level_module._calibrate_dpsgd, pld_module._single_pld,
               pld_module._leaf_pld, pld_module._block_pld, pld_module._widths, pld_module._leaf_moments):
        fn.cache_clear()
    ledger_module._memo.clear()


def private_run(name: str, rounds: int, data, tmp: str, workload: str = "") -> tuple[float, Timers]:
    fed = FederationConfig(rounds=rounds, local_epochs=1, seed=0, **WORKLOADS[workload])
    privacy = PrivacyConfig(epsilon=3.0, delta=1e-5, clip=1.0, unit="example")
    clear_caches()
    timers = Timers()
    with instrumented(timers):
        start = time.perf_counter()
        sim = Simulation(make_algorithm(name, fed, privacy), data, fed, privacy,
                         ledger_path=os.path.join(tmp, f"{workload}{name}_{rounds}.sqlite"))
        sim.run()
        wall = time.perf_counter() - start
    return wall, timers


def audit_bench(tmp: str, clients: int = 1000, rounds: int = 200) -> tuple[float, float]:
    path = os.path.join(tmp, "audit.sqlite")
    event = PoissonSampledEvent(0.05, GaussianEvent(1.0, 1.0))
    fixed = GaussianEvent(1.0, 20.0)
    led = PrivacyLedger(path, "audit", delta=1e-5, accountant="pld")
    rows = []
    for rnd in range(rounds):  # written in bulk (the charging path is what the runs above time)
        for k in range(clients):
            for channel, ev in (("natural_mean", event), ("precision", event), ("fisher_diag", fixed)):
                rows.append(("audit", str(k), rnd, channel, ev.mechanism, 1.0, 1.0, 1.0, "example",
                             ledger_module.json.dumps(ev.to_dict()), time.time()))
    with led._conn:
        led._conn.execute("BEGIN")
        led._conn.executemany(
            "INSERT INTO charges (run_id, client_id, round, channel, mechanism, sensitivity, noise_std, "
            "sampling_rate, unit, event, charged_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        led._conn.execute("COMMIT")
    led.audit()  # the writer's cache is now warm, as in a run
    start = time.perf_counter()
    audit = led.audit()
    warm = time.perf_counter() - start
    led.close()
    assert len(audit["clients"]) == clients
    start = time.perf_counter()
    with PrivacyLedger.open_existing(path, "audit") as again:
        again.audit()
    cold = time.perf_counter() - start
    return warm, cold


def commit_ms(tmp: str, n: int = 200) -> float:
    """Median time of a charge whose accounting is trivial (exact accountant, one unsampled Gaussian per client):
    the durable SQLite commit every charge pays before its release, on this disk."""
    led = PrivacyLedger(os.path.join(tmp, "commit.sqlite"), "commit", delta=1e-5)
    times = []
    for k in range(n):
        start = time.perf_counter()
        led.charge_all(str(k), 0, [ChargeRequest("update", GaussianEvent(1.0, 10.0))])
        times.append(time.perf_counter() - start)
    led.close()
    return 1000 * statistics.median(times)


def small_federation(n_clients: int, per_client: int):
    """``n_clients`` clients of ``per_client`` MNIST-5k training images each (disjoint), for ``--smoke``."""
    base = make_federated("mnist5k", 10, partition="iid", seed=0)
    x = np.concatenate([p.x for p in base.train_parts])
    y = np.concatenate([p.y for p in base.train_parts])
    parts = [(x[k * per_client:(k + 1) * per_client], y[k * per_client:(k + 1) * per_client])
             for k in range(n_clients)]
    return federated_from_arrays(parts, (base.test.x, base.test.y), task="classification",
                                 num_classes=base.num_classes, name="mnist5k-smoke", design_size=per_client)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="R = 5 and 50 only")
    parser.add_argument("--smoke", action="store_true", help="every phase at its smallest (a smoke test; seconds)")
    args = parser.parse_args(argv)
    # (key label, rounds run): the keys are named after the default rounds, which --smoke runs smaller
    rounds_grid = tuple(zip(ROUNDS, SMOKE_ROUNDS if args.smoke else ROUNDS))[:2 if args.quick else 3]
    torch.set_num_threads(1)
    print(f"machine={platform.machine()} cpus={os.cpu_count()} python={platform.python_version()}")
    data = small_federation(2, 64) if args.smoke else make_federated("mnist5k", 10, partition="iid", seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        private_run("dpsgd_fedavg", 1, data, tmp, "tiny_")  # imports (opacus) out of the timed runs
        for workload in ("tiny_", ""):
            for label, rounds in rounds_grid:
                shares, charges = [], []
                for name in ALGORITHMS:
                    wall, timers = private_run(name, rounds, data, tmp, workload)
                    shares.append(timers.total / wall)
                    charges.extend(timers.charges)
                    print(f"{workload}{name}_wall_s_R{label}={wall:.2f} "
                          f"{workload}{name}_accounting_s_R{label}={timers.total:.3f}", flush=True)
                print(f"accounting_share_{workload}R{label}={max(shares):.4f}")
                print(f"charge_ms_{workload}R{label}={1000 * statistics.median(charges):.3f}", flush=True)
        print(f"commit_ms={commit_ms(tmp, n=2 if args.smoke else 200):.3f}")
        warm, cold = audit_bench(tmp, clients=2, rounds=2) if args.smoke else audit_bench(tmp)
        print(f"audit_ms_1000x200={1000 * warm:.1f}")
        print(f"audit_reopen_ms_1000x200={1000 * cold:.1f}")


if __name__ == "__main__":
    main()
