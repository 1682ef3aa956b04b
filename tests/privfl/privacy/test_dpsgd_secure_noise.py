"""DP-SGD's noise under secure noise comes from ``mechanisms.SecureNoise`` (issue 25: no tail cut). torch's float32
``normal`` stops at 5.77 sigma (and opacus's secure_mode sums four such draws): the privacy loss of a coordinate that
an extra record shifts past the cut is unbounded, which can exceed delta over a long schedule. Every DP-SGD path
(opacus's clipping on the per-client loop, the vectorised executor, HBFL's materialised per-example steps) adds
N(0, (z C)^2) / B drawn by record_level.step_noise, which under secure noise is SecureNoise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from privfl.privacy.record_level import DPSGDSchedule, dpsgd_train
from privfl.privacy.record_level import VectorisedDPSGD, privatise_gradient_sum, secure_gaussian
from privfl.mechanisms import SecureNoise


def _Constant(value):
    """SecureNoise.standard_normal's stand-in: every draw the same value (far in a tail torch's float32 normal never
    reaches, for 9)."""

    def standard_normal(_self, shape):
        return np.full(shape, value)

    return standard_normal


def test_secure_gaussian_passes_any_draw_through_and_has_the_right_scale(monkeypatch):
    monkeypatch.setattr(SecureNoise, "standard_normal", _Constant(9.0))
    got = secure_gaussian((3, 2), 0.5)
    assert got.dtype == torch.float32 and torch.all(got == 4.5)  # 9 sigma: torch's float32 normal stops at 5.77
    monkeypatch.undo()
    draws = secure_gaussian((200_000,), 2.0, torch.float64)
    assert abs(float(draws.std()) - 2.0) < 0.02 and abs(float(draws.mean())) < 0.02


@pytest.mark.parametrize("value", [0.0, 9.0])
def test_opacus_path_adds_secure_noise_of_std_zC_over_B(monkeypatch, value):
    """q = 1 (the batch is every record), one step of SGD at lr 1: the update is -(sum of clipped gradients + z C
    times the draw) / B, so two runs whose draws differ by 9 differ by exactly 9 z C / B in every parameter."""
    monkeypatch.setattr(SecureNoise, "standard_normal", _Constant(value))
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    start = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    schedule = DPSGDSchedule(sample_rate=1.0, steps_per_epoch=1, epochs=1, size=8)
    dpsgd_train(model, x, y, schedule, noise_multiplier=1.5, clip=0.4, lr=1.0, momentum=0.0,
                rng=np.random.default_rng(0), secure_noise=True)
    moved = torch.cat([(p.detach() - s).flatten() for p, s in zip(model.parameters(), start)])
    _RESULTS[value] = moved
    if len(_RESULTS) == 2:
        shift = (_RESULTS[0.0] - _RESULTS[9.0]).numpy()
        np.testing.assert_allclose(shift, 9.0 * 1.5 * 0.4 / schedule.expected_batch, rtol=1e-5)


_RESULTS: dict = {}


def _vectorised_update(monkeypatch, value):
    monkeypatch.setattr(SecureNoise, "standard_normal", _Constant(value))
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    start = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    schedule = DPSGDSchedule(sample_rate=1.0, steps_per_epoch=1, epochs=1, size=8)
    executor = VectorisedDPSGD(model, schedule=schedule, noise_multiplier=1.5, clip=0.4, lr=1.0, momentum=0.0,
                               secure_noise=True)
    [(_, update, _)] = executor.train(start, [(x, y)], [(torch.Generator(), torch.Generator())])
    return update, schedule


def test_vectorised_executor_adds_secure_noise_of_std_zC_over_B(monkeypatch):
    """The same check for the vectorised executor (its noise is record_level.step_noise, as the opacus path's)."""
    quiet, schedule = _vectorised_update(monkeypatch, 0.0)
    loud, _ = _vectorised_update(monkeypatch, 9.0)
    np.testing.assert_allclose(quiet - loud, 9.0 * 1.5 * 0.4 / schedule.expected_batch, rtol=1e-5)


def test_materialised_per_example_steps_draw_secure_noise(monkeypatch):
    """HBFL's meme steps (privatise_gradient_sum): clipped sum plus z C times the secure draw, over B."""
    monkeypatch.setattr(SecureNoise, "standard_normal", _Constant(9.0))
    per_example = torch.tensor([[3.0, 4.0], [0.3, 0.4]])  # norms 5 and 0.5: clipped to 1 and kept
    got = privatise_gradient_sum(per_example, 2, clip=1.0, noise_multiplier=2.0, expected_batch=4.0,
                                 generator=torch.Generator(), secure=True)
    expected = (torch.tensor([0.6, 0.8]) * (1 / (1 + 1e-6)) + torch.tensor([0.3, 0.4]) + 2.0 * 9.0) / 4.0
    assert torch.allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("secure", [True, False])
def test_a_layers_own_draws_are_secret_under_secure_noise(monkeypatch, secure):
    """Dropout's masks (any layer's own randomness) go to the batch's records by position: draws an adversary could
    compute from the run seed would let one record added or removed change every later record's term beyond the
    clip. With secure noise the per-client loop seeds torch from the OS CSPRNG before a client trains, so the same
    seeds give other masks (DP-SGD's noise fixed at 0 here, q = 1: the masks are the only randomness left); a seeded
    run (secure_noise=False) trains the same twice."""
    from privfl.privacy.record_level import DPSGD

    monkeypatch.setattr(SecureNoise, "standard_normal", _Constant(0.0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 2))
    start = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    x, y = torch.randn(12, 6), torch.randint(0, 2, (12,))
    schedule = DPSGDSchedule(sample_rate=1.0, steps_per_epoch=1, epochs=2, size=12)
    engine = DPSGD(model, schedule, noise_multiplier=1.0, clip=10.0, lr=1.0, momentum=0.0, secure_noise=secure)
    runs = []
    for _ in range(2):
        [(_, params, _)] = engine.train(start.astype(np.float64), [(x, y)], [np.random.default_rng(3)], vectorised=False,
                                        torch_seeds=[11])
        runs.append(params)
    assert (not np.array_equal(runs[0], runs[1])) if secure else np.array_equal(runs[0], runs[1])
