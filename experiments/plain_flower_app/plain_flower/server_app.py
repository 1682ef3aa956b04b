"""The ServerApp: Flower's FedAvg (every client every round, no client-side evaluation), wrapped in Flower's
DifferentialPrivacyServerSideFixedClipping when the run config says ``dp = true`` (each client's update is clipped to
``clipping-norm`` in L2, Gaussian noise of std noise-multiplier x clipping-norm / num-clients is added to the
average; Flower's RDP accountant tracks epsilon when dp-accounting is installed). It writes, to ``result-path``, the
time of every round (taken by the strategy's ``evaluate_fn`` hook, which Flower calls before the first round and after
each one) and a summary of the final model."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

from plain_flower.task import build_model, widths

app = ServerApp()


def _accountant(n_clients: int, delta: float):
    """Flower's RDP accountant for unsampled client-level releases, or None without dp-accounting."""
    try:
        from flwr.serverapp import (NeighboringRelation, PrivacyConfig, RdpAccountant,  # noqa: PLC0415
                                    SamplingMethod)

        return RdpAccountant(PrivacyConfig(target_delta=delta, population_size=n_clients,
                                           neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                           sampling_method=SamplingMethod.NO_AMPLIFICATION))
    except ImportError:  # dp-accounting absent: the noise is the same, only the epsilon report is missing
        return None


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    rounds, n = int(cfg["num-server-rounds"]), int(cfg["num-clients"])
    torch.manual_seed(int(cfg["seed"]))
    net = build_model(int(cfg["in-features"]), widths(cfg["hidden"]), int(cfg["num-classes"]))
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n,
                      weighted_by_key="weight")
    accountant = None
    if bool(cfg["dp"]):
        accountant = _accountant(n, float(cfg["target-delta"]))
        strategy = DifferentialPrivacyServerSideFixedClipping(
            strategy, noise_multiplier=float(cfg["noise-multiplier"]), clipping_norm=float(cfg["clipping-norm"]),
            num_sampled_clients=n, accountant=accountant)
    stamps: list[float] = []

    def mark(server_round: int, arrays: ArrayRecord):
        stamps.append(time.perf_counter())
        return None

    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=rounds,
                            evaluate_fn=mark)
    path = str(cfg["result-path"] or "")
    if path:
        final = np.concatenate([a.ravel() for a in result.arrays.to_numpy_ndarrays()])
        spent = strategy.privacy_spent() if accountant is not None else None
        summary = {"rounds": rounds, "round_seconds": [b - a for a, b in zip(stamps, stamps[1:])],
                   "parameters": int(final.size), "final_norm": float(np.linalg.norm(final)),
                   "finite": bool(np.all(np.isfinite(final))),
                   "epsilon": None if spent is None else float(spent.epsilon)}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f)
        os.replace(tmp, path)
