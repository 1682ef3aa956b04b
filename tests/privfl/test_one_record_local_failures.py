"""The review's one-record failures of the Bayesian algorithms' local steps (D1), from ``privfl.federate`` and the
Simulation API: the sources are made robust, so the generic fallback (``privfl.runtime.local_step``,
``tests/contracts/test_local_step_failures.py``) stays rare.

- FedBNR's kernel phase: one record with a finite target of 1e20 (or 1e38) overflowed the float32 network's
  gradients, Adam made the parameters NaN and the next step's Cholesky factor raised, uncharged, on D and not on D'.
  The phase now trains in float64, network and loss.
- FedBNR's kernel phase with a client without records raised ``cannot reshape tensor of 0 elements`` (at record level
  too: its features of no rows); its change is now zero.
- FedBNN: one record with features of 1e38 made a client's posterior NaN; the next round's prior fit raised
  ``ModelConfigError`` in that client's step, uncharged. A non-finite posterior now starts again from its public
  initial state.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from torch import nn

import privfl
from privfl.algorithms import make_algorithm
from privfl.core import release as rel
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.core.release import LocalStepFailed
from privfl.data import federated_from_arrays
from privfl.runtime.engine import Simulation

D = 4


@pytest.fixture
def released(monkeypatch):
    """(client id, round, channel, value) of every release, in order."""
    seen = []
    original = rel.ReleasePipeline.release

    def spy(self, round, values, weight=1.0, *, mark=True):
        out = original(self, round, values, weight, mark=mark)
        seen.extend((r.client_id, r.round, name, np.array(r.value, dtype=np.float64)) for name, r in out.items())
        return out

    monkeypatch.setattr(rel.ReleasePipeline, "release", spy)
    return seen


def _regression(rng, n):
    x = rng.normal(size=(n, D)).astype(np.float32)
    return x, (np.sin(x[:, 0]) + 0.3 * x[:, 1] + 0.1 * rng.normal(size=n)).astype(np.float32)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", [1e20, 1e38])
def test_fedbnr_kernel_phase_one_far_target_is_released_as_on_the_neighbour(target, released):
    rng = np.random.default_rng(0)
    a, b, c, test = (_regression(rng, 40) for _ in range(4))
    worlds = {"D'": {"a": a, "b": b, "c": c},
              "D": {"a": (np.concatenate([a[0], np.zeros((1, D), np.float32)]),
                          np.concatenate([a[1], np.float32([target])])), "b": b, "c": c}}
    seen = {}
    for world, clients in worlds.items():
        released.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = privfl.federate(None, clients, algorithm="fedbnr", epsilon=3.0, unit="example", test=test,
                                     rounds=1, local_epochs=3, lr=0.05, client_size=40, secure_noise=False, seed=0,
                                     kernel_rounds=2)
        assert not [w for w in caught if issubclass(w.category, LocalStepFailed)]  # the source is fixed
        mine = [r for r in released if r[0] == "0"]
        assert all(np.isfinite(r[3]).all() for r in mine)
        seen[world] = ([r[1:3] for r in mine], result.audit["a"]["epsilon"], result.audit["a"]["releases"])
    assert seen["D"] == seen["D'"] and seen["D"][0] == [(0, "update"), (1, "update"), (0, "scatter"), (0, "cross")]


@pytest.mark.timeout(300)
def test_fedbnr_a_client_without_records_changes_nothing_at_record_level(released):
    rng = np.random.default_rng(0)
    parts = [(np.zeros((0, D), np.float32), np.zeros(0, np.float32)), _regression(rng, 40), _regression(rng, 40)]
    data = federated_from_arrays(parts, _regression(rng, 40), task="regression")
    fed = FederationConfig(rounds=1, local_epochs=3, lr=0.05, seed=0, client_size=40)
    privacy = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=1.0, secure_noise=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LocalStepFailed)
        Simulation(make_algorithm("fedbnr", fed, privacy, kernel_rounds=2), data, fed, privacy).run()
    mine = [r for r in released if r[0] == "0"]
    assert [r[1:3] for r in mine] == [(0, "update"), (1, "update"), (0, "scatter"), (0, "cross")]
    assert not any(r[3].any() for r in mine)


@pytest.mark.timeout(300)
def test_fedbnn_a_far_feature_does_not_stop_its_client_from_releasing(released):
    rng = np.random.default_rng(0)

    def cls(n):
        x = rng.normal(size=(n, D)).astype(np.float32)
        return x, (x[:, 0] > 0).astype(np.int64)

    a, b, c, test = cls(40), cls(40), cls(40), cls(60)
    worlds = {"D'": {"a": a, "b": b, "c": c},
              "D": {"a": (np.concatenate([a[0], np.full((1, D), 1e38, np.float32)]), np.concatenate([a[1], [1]])),
                    "b": b, "c": c}}
    seen = {}
    for world, clients in worlds.items():
        released.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = privfl.federate(lambda: nn.Linear(D, 2), clients, algorithm="fedbnn", epsilon=3.0,
                                     unit="example", test=test, classes=[0, 1], rounds=3, local_epochs=2,
                                     client_size=40, secure_noise=False, seed=0, warmup_epochs=2, alignment_size=10)
        assert not [w for w in caught if issubclass(w.category, LocalStepFailed)]  # the source is fixed
        assert len(result.history) == 3
        seen[world] = ([r[1:3] for r in released if r[0] == "0"], result.audit["a"]["epsilon"])
    assert seen["D"] == seen["D'"] and [r for r, _ in seen["D"][0]] == [0, 1, 2]

