"""The in-process simulation runtime: the embedded default.

It runs the clients one after another on this machine, routes every client output through that client's
:class:`ReleasePipeline`, and gives the server only weighted sums. The algorithm's client and server steps do not
depend on it, so a deployment runtime can carry the same :class:`Release` objects between machines.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from accounting.calibration import calibrate
from accounting.errors import PrivacyBudgetExceeded
from accounting.ledger import PrivacyLedger
from mechanisms import SecureNoise, SeededNoise
from privfl.aggregation import weighted_sums
from privfl.algorithms.base import FederatedAlgorithm
from privfl.channels import check_record_level_clips
from privfl.config import FederationConfig, PrivacyConfig
from privfl.release import ReleasePipeline
from privfl.errors import ConfigurationError
from privfl.secure import SecureAggregation, calibrate_distributed, secure_weighted_sums
from secure_agg import ProtocolAbort


@dataclass
class RoundRecord:
    round: int
    aborted: bool
    participants: int
    sat_out: list[str]
    metrics: dict[str, float]
    epsilon_max: float
    epsilon_mean: float
    seconds: float


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

    @property
    def final(self) -> dict[str, float]:
        return self.history[-1].metrics if self.history else {}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["final"] = self.final
        return d


def noise_multipliers_for(algorithm: FederatedAlgorithm, privacy: PrivacyConfig, rounds: int
                          ) -> dict[str, float] | None:
    """Calibrate one noise multiplier per private channel so each client's composition over ``rounds`` meets
    (epsilon, delta) under the run's accountant, splitting the budget by the channels' shares."""
    if not privacy.private:
        return None
    channels = {c.name: c.budget_share for c in algorithm.channels() if c.private}
    if not channels:
        return {}
    cal = calibrate(privacy.epsilon, privacy.delta, rounds, sampling_rate=privacy.sampling_rate, channels=channels,
                    accountant=privacy.resolved_accountant)
    return dict(cal.noise_multipliers)


class Simulation:
    """Runs ``algorithm`` on ``data`` for ``fed.rounds`` rounds under ``privacy``, charging ``ledger``."""

    def __init__(self, algorithm: FederatedAlgorithm, data, fed: FederationConfig, privacy: PrivacyConfig, *,
                 ledger_path: str = ":memory:", run_id: str | None = None,
                 progress: Callable[[RoundRecord], None] | None = None, secure: SecureAggregation | None = None):
        self.algorithm = algorithm
        self.data = data
        self.fed = fed
        self.privacy = privacy
        self.progress = progress
        self.secure = secure
        self.run_id = run_id or f"{algorithm.name}-eps{privacy.epsilon:g}-seed{fed.seed}"
        self.ledger = PrivacyLedger(ledger_path, self.run_id, delta=privacy.delta, epsilon_budget=privacy.epsilon,
                                    accountant=privacy.resolved_accountant,
                                    meta={"algorithm": algorithm.name, "dataset": getattr(data, "name", "?")})
        self.ledger_path = ledger_path

    def _noise(self, seq: np.random.SeedSequence):
        return SecureNoise() if self.privacy.secure_noise else SeededNoise(np.random.default_rng(seq))

    def run(self) -> RunResult:
        fed, privacy, alg = self.fed, self.privacy, self.algorithm
        root = np.random.SeedSequence(fed.seed)
        setup_seq, sample_seq, server_seq, client_root, secure_seq = root.spawn(5)
        secure_rng = np.random.default_rng(secure_seq)
        n_clients = len(self.data.train_parts)
        client_seqs = client_root.spawn(n_clients)
        train_rngs = [np.random.default_rng(s.spawn(1)[0]) for s in client_seqs]
        alg.setup(self.data, np.random.default_rng(setup_seq))
        channels = alg.channels()
        check_record_level_clips(channels, privacy)
        plans, distributed_events = None, None
        if privacy.placement == "distributed" and privacy.private:
            if self.secure is None:
                raise ConfigurationError("distributed noise is added by the clients under secure aggregation; turn "
                                         "secure aggregation on (--secure-agg) or choose local/central placement")
            plans = calibrate_distributed(channels, privacy.epsilon, privacy.delta, fed.rounds, n_clients, self.secure)
            multipliers = {name: p.noise_multiplier for name, p in plans.items()}
            distributed_events = {name: p.event for name, p in plans.items()}
            placement = "distributed"
        else:
            multipliers = noise_multipliers_for(alg, privacy, fed.rounds)
            placement = "local" if privacy.placement == "local" else "central"
        pipelines = [ReleasePipeline(str(k), channels, self.ledger, multipliers, placement=placement,
                                     sampling_rate=privacy.sampling_rate, noise=self._noise(client_seqs[k]),
                                     distributed_events=distributed_events)
                     for k in range(n_clients)]
        server_noise = self._noise(server_seq)
        sampler = np.random.default_rng(sample_seq)
        result = RunResult(alg.name, getattr(self.data, "name", "?"), n_clients, fed.rounds, privacy.epsilon,
                           privacy.delta, privacy.resolved_accountant, multipliers, ledger=self.ledger_path,
                           run_id=self.run_id)
        by_name = {c.name: c for c in channels}
        exhausted: set[int] = set()  # clients whose budget is spent take no further part, charged or not
        for rnd in range(fed.rounds):
            start = time.perf_counter()
            if privacy.sampling_rate < 1:
                selected = np.flatnonzero(sampler.random(n_clients) < privacy.sampling_rate)
            else:
                selected = np.arange(n_clients)
            chosen = set(selected.tolist())
            releases, sat_out, aborted = [], [], False
            for k in range(n_clients):
                if k in exhausted:
                    sat_out.append(str(k))
                    continue
                try:
                    if k not in chosen:
                        pipelines[k].charge_only(rnd)
                        continue
                    out = alg.client_update(k, self.data.train_parts[k], rnd, train_rngs[k])
                    releases.extend(pipelines[k].release(rnd, out.values, out.weight).values())
                except PrivacyBudgetExceeded:
                    exhausted.add(k)
                    sat_out.append(str(k))
            if releases:
                try:
                    if self.secure is not None:
                        aggregates = secure_weighted_sums(releases, by_name, self.secure, secure_rng, server_noise,
                                                          distributed=plans)
                    else:
                        aggregates = weighted_sums(releases, by_name, server_noise)
                    alg.server_update(aggregates, rnd)
                except ProtocolAbort:
                    aborted = True  # too few survivors: nothing is revealed, the global state stays as it was
            metrics = alg.evaluate(self.data.test)
            audit = self.ledger.audit()
            eps = [v["epsilon"] for v in audit["clients"].values()] or [0.0]
            record = RoundRecord(rnd, aborted, len({r.client_id for r in releases}), sat_out, metrics,
                                 float(max(eps)), float(np.mean(eps)), time.perf_counter() - start)
            result.history.append(record)
            if self.progress is not None:
                self.progress(record)
        result.audit = self.ledger.audit()
        return result


