"""The ServerApp's line per round in Flower's log stream (what ``flwr run --stream`` shows the coordinator, issue
31): round, participants, who sat out, epsilon spent, and each noised channel's privacy SNR (issue 29)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("flwr")

from privfl.core.config import FederationConfig, PrivacyConfig  # noqa: E402
from privfl.data import federated_from_arrays, load_digits  # noqa: E402
from privfl.flower import app as flower_app  # noqa: E402
from privfl.flower.app import RunSpec  # noqa: E402


def test_each_round_logs_participants_epsilon_and_snr():
    digits = load_digits(flatten=True)
    parts = [digits.subset(np.arange(k * 50, (k + 1) * 50)) for k in range(2)]
    data = federated_from_arrays(parts, digits.subset(np.arange(200, 240)), name="digits2", design_size=50)
    spec = RunSpec.of("dp_fedavg", data, FederationConfig(rounds=4, hidden=()),
                      PrivacyConfig(epsilon=3.0, unit="client", clip=0.5), run_id="logged")
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    try:
        flower_app._log_round(spec, {"round": 1, "participants": 2, "aborted": False, "sat_out": ["1"],
                                     "seconds": 0.5, "snr": {"update": 0.4321}},
                              {"0": {"epsilon": 1.25}, "1": {"epsilon": 2.5}})
    finally:
        logger.removeHandler(handler)
    line = next(m for m in seen if "privfl logged" in m)
    assert "round 2/4: 2 participants, sat out ['1']" in line
    assert "epsilon spent max 2.5 (target 3)" in line and "SNR update 0.432" in line
