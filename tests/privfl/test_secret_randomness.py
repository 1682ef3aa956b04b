"""Every randomness a record-level client step's release depends on is secret under secure noise.

Per-record draws (weight noise, dropout masks, the step of a record's Fisher pass) go to records by position, so a
draw an adversary could compute from the public run seed lets one record added or removed move every later record's
term beyond the clip (a review found four such paths on 2026-11-29, each fixed with ``privfl.core.public.secret_seed``
and tested where it lives). This test looks for any that is left, whatever its form: with the OS CSPRNG pinned to one
value and DP-SGD's Gaussian draws at zero, a client step run on the same data from two different public streams must
release the same values. A difference means some draw that reached the release followed the public seed.

FedBNN is left out on purpose: its release (class probabilities on the public alignment set) is bounded by its range
whatever the randomness that produced it. FedBNR draws nothing.
"""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

import numpy as np
import pytest

from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.mechanisms import SecureNoise
from privfl.runtime.engine import Simulation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_neighbouring_contract import _digits, federation, make  # noqa: E402

RECORD_LEVEL = ["dpsgd_fedavg", "dpsgd_fedavg_adaptive", "dp_fedsgd_sampled", "dp_fedsgd_laplace_sampled",
                "dp_fedsgd_variational", "dp_fedsgd_adaptive_sampled", "dp_fedsgd_banded", "fola", "hbfl", "hbfl_sgd"]


def _values(out) -> dict[str, np.ndarray]:
    return {name: np.asarray(getattr(v, "value", v), dtype=np.float64) for name, v in out.values.items()}


@pytest.mark.parametrize("name", RECORD_LEVEL)
def test_a_record_level_release_follows_no_public_randomness(monkeypatch, name):
    monkeypatch.setattr(secrets, "randbits", lambda k: 0x5EC12E7 % (1 << k))
    monkeypatch.setattr(SecureNoise, "standard_normal", lambda self, shape: np.zeros(shape))
    privacy = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=1.0, placement="central",
                            accountant="pld", secure_noise=True,
                            clip_quantile=0.5 if "adaptive" in name else None)
    fed = FederationConfig(rounds=2, local_epochs=1, batch_size=16, lr=0.5, hidden=(8,), seed=0)
    parts, test, public_set = _digits()
    data = federation(parts, test, public_set, "classification")
    released = []
    for stream in (1, 2):  # the same data, the same public facts and model; two public client streams
        sim = Simulation(make(name, fed, privacy), data, fed, privacy)
        sim.prepare()
        out = sim.algorithm.client_update(0, data.train_parts[0], 0, np.random.default_rng(stream))
        released.append(_values(out))
    assert released[0].keys() == released[1].keys()
    for channel in released[0]:
        np.testing.assert_array_equal(released[0][channel], released[1][channel], err_msg=channel)
    assert any(np.any(v != 0) for v in released[0].values())  # something was released: not vacuous
