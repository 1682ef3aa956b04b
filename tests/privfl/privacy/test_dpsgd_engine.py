"""One DP-SGD step for every record-level path (issue 30): the Poisson lot, the noise and its scale are drawn in
``privfl.privacy.record_level`` and nowhere else, whichever algorithm and executor trains."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from privfl.accounting.events import SelfComposedEvent
from privfl.algorithms import ALGORITHMS
from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.data import federated_from_arrays
from privfl.errors import ConfigurationError
from privfl.privacy import record_level as R
from privfl.runtime.engine import Simulation

ROOT = Path(__file__).resolve().parents[3]
FED = FederationConfig(rounds=1, local_epochs=1, batch_size=4, lr=0.1, momentum=0.5, hidden=(5,), seed=2)
EXAMPLE = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=0.7, secure_noise=False)


def _federation():
    rng = np.random.default_rng(0)
    parts = [(rng.normal(size=(10, 6)).astype(np.float32), rng.integers(0, 3, size=10).astype(np.int64))
             for _ in range(3)]
    test = (rng.normal(size=(12, 6)).astype(np.float32), rng.integers(0, 3, size=12).astype(np.int64))
    return federated_from_arrays(parts, test, task="classification", num_classes=3, name="toy", design_size=10)


@pytest.mark.parametrize("executor", ["per_client", "vectorised"])
@pytest.mark.parametrize("name, kwargs", [("dpsgd_fedavg", {}), ("fola", {}), ("hbfl", {"meme_lr": 0.01})])
def test_every_record_level_path_draws_its_lots_and_noise_in_the_one_step(monkeypatch, name, kwargs, executor):
    """Each DP-SGD step of a run takes its lot from ``poisson_lot`` and its noise from ``step_noise`` at std z C, one
    draw per parameter tensor (or flattened gradient) and step; nothing else in the run samples or noises."""
    lots, stds = [], []
    real_lot, real_noise = R.poisson_lot, R.step_noise

    def lot(rates, n, generator):
        lots.append(n)
        return real_lot(rates, n, generator)

    def noise(shape, std, generator, secure, dtype=torch.float32):
        stds.append(std)
        return real_noise(shape, std, generator, secure, dtype)

    monkeypatch.setattr(R, "poisson_lot", lot)
    monkeypatch.setattr(R, "step_noise", noise)
    monkeypatch.setattr("privfl.algorithms.dp_fedsgd.poisson_lot", lot)  # it imports the lot by name
    sim = Simulation(ALGORITHMS[name](FED, EXAMPLE, **kwargs), _federation(), FED, EXAMPLE, executor=executor)
    sim.prepare()
    assert sim.vectorised == (executor == "vectorised")
    sim.run()
    schedule = R.dpsgd_schedule(sim.algorithm, 0)
    planned = sim.algorithm.planned_events(0)
    assert planned, "a record-level run plans its DP-SGD events"
    (event,) = [e for e in planned.values() if isinstance(e, SelfComposedEvent)]  # HBFL's precision: a NoOpEvent
    z = event.event.event.noise_multiplier  # SelfComposed(PoissonSampled(q, Gaussian(1, z)), steps): the plan's z
    steps = schedule.steps * 3  # every client of the one round
    assert len(lots) == steps
    assert len(stds) >= steps and len({round(s, 12) for s in stds}) == 1 and stds[0] > 0
    assert math.isclose(stds[0] / EXAMPLE.clip, z, rel_tol=1e-12)


def test_opacus_clips_but_never_samples_or_noises():
    """opacus is imported by the record-level module only, and its optimizer is built with no noise of its own."""
    def imports_opacus(path: Path) -> bool:
        for n in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in n.names] if isinstance(n, ast.Import)
                     else [n.module or ""] if isinstance(n, ast.ImportFrom) else [])
            if any(name.split(".")[0] == "opacus" for name in names):
                return True
        return False

    importers = [p.relative_to(ROOT).as_posix() for p in (ROOT / "privfl").rglob("*.py") if imports_opacus(p)]
    assert importers == ["privfl/privacy/record_level.py"]
    tree = ast.parse((ROOT / "privfl" / "privacy" / "record_level.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func).startswith("DPOptimizer")]
    assert calls and all(any(k.arg == "noise_multiplier" and ast.unparse(k.value) == "0.0" for k in c.keywords)
                         and not any(k.arg in ("generator", "secure_mode") for k in c.keywords) for c in calls)
    assert "UniformWithReplacementSampler(" not in (ROOT / "privfl" / "privacy" / "record_level.py").read_text()


def _trained(vectorised, rows=None, clients=1):
    """The DP-SGD engine's models for ``clients`` seeded clients of a linear model, inside
    ``audit_record_rows(rows)`` when rows are given (``rows(step, clip)``: the step's raw canary rows)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 3))
    schedule = R.DPSGDSchedule.for_client(10, 4, 2)
    engine = R.DPSGD(model, schedule, noise_multiplier=1.1, clip=0.7, lr=0.1, momentum=0.5, secure_noise=False)
    data = _federation().train_parts[:clients]
    start = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    rngs = [np.random.default_rng(7 + k) for k in range(clients)]

    def run():
        return [final for _, final, _ in engine.train(start, [d.tensors() for d in data], rngs,
                                                      vectorised=vectorised)]

    if rows is None:
        return run(), schedule
    with R.audit_record_rows(rows):
        return run(), schedule


DIM = 6 * 3 + 3  # the linear model's parameters
DIRECTION = torch.linspace(-1, 1, DIM) / torch.linspace(-1, 1, DIM).norm()


def _canary(norm):
    """A canary of one raw row in DIRECTION at ``norm`` times the step's clip, at every step."""
    return lambda step, clip: (norm * clip * DIRECTION).unsqueeze(0)


@pytest.mark.parametrize("vectorised", [False, True])
def test_audit_record_rows_join_the_lot_before_the_clip_at_every_step_of_either_executor(vectorised):
    """``audit_record_rows`` (audit-run's record canaries) is read by both executors at the same point: once per
    step, with the step's index and clip; a zero row leaves the model exactly as without one; a row is clipped with
    the lot's (a row at 10 C trains the model a row at C does), and the opacus loop and the vectorised executor
    give the same model with the same rows (to float tolerance)."""
    plain, schedule = _trained(vectorised)
    calls = []

    def zero(step, clip):
        calls.append((step, clip))
        return torch.zeros(1, DIM)

    same, _ = _trained(vectorised, zero)
    assert calls == [(step, pytest.approx(0.7)) for step in range(schedule.steps)]
    np.testing.assert_array_equal(same[0], plain[0])
    at_clip, _ = _trained(vectorised, _canary(1.0))
    beyond, _ = _trained(vectorised, _canary(10.0))
    other, _ = _trained(not vectorised, _canary(10.0))
    assert np.abs(beyond[0] - plain[0]).max() > 1e-3
    np.testing.assert_allclose(beyond[0], at_clip[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(beyond[0], other[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", ["opacus", "vectorised", "lots"])
def test_a_fault_in_the_engines_own_clip_reaches_the_canary_rows(monkeypatch, path):
    """The canary rows are clipped by the engine's own per-record clip, not the auditor's: with that clip broken
    (``clip_factor`` returning ones for the vectorised executor and HBFL's lot source, opacus's clipping
    coefficient for the opacus loop) a row at 10 C moves the model as a row at 10 C, where the working clip keeps
    it at C; ``audit_clip_fault`` (``--fault no_clip``) does the same to the canaries alone."""
    def trained(norm):
        if path != "lots":
            return _trained(path == "vectorised", _canary(norm))[0][0]
        schedule = R.DPSGDSchedule.for_client(10, 4, 1)
        lots = R.DPSGDLots(schedule, noise_multiplier=1.1, clip=0.7, secure_noise=False,
                           rngs=[np.random.default_rng(7)], sizes=[10])
        rows = torch.as_tensor(np.random.default_rng(1).normal(size=(3, DIM)), dtype=torch.float32)
        with R.audit_record_rows(_canary(norm)):
            return np.stack([lots.privatise(0, rows).numpy() for _ in lots])

    honest_at, honest_beyond, inside = trained(1.0), trained(10.0), trained(0.5)
    np.testing.assert_allclose(honest_beyond, honest_at, rtol=1e-4, atol=1e-5)
    with R.audit_clip_fault():
        assert R.canary_clip_off()
        assert np.abs(trained(10.0) - honest_at).max() > 1e-2
        np.testing.assert_allclose(trained(0.5), inside, rtol=1e-6, atol=1e-7)  # within the clip: nothing to undo
    assert not R.canary_clip_off()
    if path == "opacus":
        from opacus.grad_sample import GradSampleModuleFastGradientClipping as GSM
        monkeypatch.setattr(GSM, "get_clipping_coef", lambda self: torch.ones_like(self.get_norm_sample()))
    else:
        monkeypatch.setattr(R, "clip_factor", lambda norms2, clip: torch.ones_like(norms2))
    assert np.abs(trained(10.0) - trained(1.0)).max() > 1e-2


def test_audit_record_rows_are_refused_for_several_clients_at_once():
    with pytest.raises(ConfigurationError, match="one client's DP-SGD training at a time"):
        _trained(True, lambda step, clip: None, clients=2)


def test_audit_noise_fault_is_scoped_to_its_context():
    """The half_noise fault scales the step noise inside its block and context only: another thread's steps keep
    their noise, and the factor ends with the block."""
    import threading

    def std_of_draws():
        g = torch.Generator().manual_seed(0)
        return float(R.step_noise((20_000,), 2.0, g, False).std())

    seen = {}
    with R.audit_noise_fault(0.5):
        seen["inside"] = std_of_draws()
        worker = threading.Thread(target=lambda: seen.setdefault("thread", std_of_draws()))
        worker.start()
        worker.join()
    seen["after"] = std_of_draws()
    assert seen["inside"] == pytest.approx(1.0, rel=0.03)
    assert seen["thread"] == pytest.approx(2.0, rel=0.03) and seen["after"] == pytest.approx(2.0, rel=0.03)


def test_a_lot_row_that_is_not_finite_adds_the_zero_term():
    """HBFL's materialised per-example steps: a row with NaN or Inf (or a norm that overflows) adds the zero term,
    decided on that row alone, so the clipped sum stays the other rows' (it was NaN, and the release fell back as a
    whole, far beyond one record's bound)."""
    from privfl.privacy.record_level import clipped_gradient_sum

    rows = torch.randn(5, 7)
    bad = torch.cat([rows[:2], torch.full((1, 7), float("nan")), rows[2:4], torch.full((1, 7), 3e38),
                     torch.tensor([[float("inf")] + [0.0] * 6]), rows[4:]])
    torch.testing.assert_close(clipped_gradient_sum(bad, 7, 0.5), clipped_gradient_sum(rows, 7, 0.5))
