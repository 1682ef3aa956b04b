"""Record-level privacy: the one DP-SGD engine (Abadi et al., CCS 2016) and its accounting, as every record-level
algorithm and the privacy wrapper (``privfl.privacy.wrapper``) use it.

- :class:`DPSGDSchedule`: one client's local DP-SGD per round from public facts only (sampling rate q, steps, epochs,
  the public size, the relation), and the events a round charges: ``SelfComposed(PoissonSampled(q, Gaussian(1, z)),
  steps)`` (displacement 2 under replace-one);
- :func:`check_dpsgd_privacy`: the configurations DP-SGD accounting can honour (record level, no client sampling, an
  accountant that composes sampled Gaussians);
- :func:`calibrate_dpsgd`: z for a schedule and target, by the one search (``accounting.calibration.calibrate_noise``);
- the step, written once and used by every DP-SGD path: :func:`poisson_lot` (the step's Poisson lot from the
  client's sampling generator), :func:`clip_factor` (each example's factor min(1, C / ||g||)), :func:`step_noise`
  and :func:`noised_mean` (N(0, (z C)^2) from the OS CSPRNG unless the run is seeded, added to the clipped sum, over
  the public expected batch);
- :func:`dpsgd_train`: one client's DP-SGD with the user's loss and optimizer on any layer opacus can clip (opacus's
  ghost clipping computes the clipped sum; the lot, noise and scale are the step's above); :class:`VectorisedDPSGD`:
  the same steps for many clients at once (``torch.func``), and :func:`privatise_gradient_sum` for steps whose
  per-example gradients are materialised (HBFL's meme); a class-weighted loss becomes class-weighted sampling
  (:func:`class_sampling_rates`), since clipping would undo a weight on the loss;
- :func:`check_opacus_model`: a model opacus cannot clip per example is refused by name, and a copy of a user's model
  is probed on a public batch (:func:`check_per_example_model`: no in-place parameter writes, no mixing of a batch's
  examples, opacus's per-example norms equal the true ones);
- :class:`AdaptiveClip`, :func:`clip_bits` and :func:`clip_bit_counts`: adaptive clipping's rules (Andrew et al.'s
  step from a noisy count of centred bits; the federation's quantile from noisy counts at :data:`CLIP_RATIOS` times
  the clip) and the noise split, used inside the step (the vectorised executor: the round's clip, its counts within
  the step's one event) and by DP-FedSGD (one clip, its count a channel).
"""

from __future__ import annotations

import copy
import functools
import math
import secrets
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from privfl.accounting.accountants import make_accountant
from privfl.accounting.events import GaussianEvent, NoOpEvent, PoissonSampledEvent, PrivacyEvent, SelfComposedEvent
from privfl.core.public import private_torch_generator
from privfl.errors import ConfigurationError, UsageError
from privfl.core.channels import PrivatizedValue
from privfl.models.checks import mixes_examples
from privfl.training.distill import add_flat_gradient
from privfl.training.fisher import per_example_gradients
from privfl.training.local import TaskLoss, UserTraining, flat_parameters, load_flat_parameters
from privfl.training.stacked import DEFAULT_MEMORY_BUDGET, ExtraRows, PerExampleGradients, sgd_step

#: torch's warning when a full backward hook fires on a module whose inputs need no gradient (see dpsgd_train)
_BACKWARD_HOOK_WARNING = (r"Full backward hook is firing when gradients are computed with respect to module outputs "
                          r"since no inputs require gradients")
#: accountants that can compose Poisson-sampled Gaussian steps
SAMPLED_ACCOUNTANTS = ("rdp", "pld")
_CALIBRATION_TOL = 1e-3


@dataclass(frozen=True)
class DPSGDSchedule:
    """One client's local DP-SGD per round, a function of public facts only: sampling rate q, steps per epoch
    (opacus: int(1 / q)), epochs, the public size it was derived from (the expected batch is q * size) and the
    neighbouring relation its steps are accounted under."""

    sample_rate: float
    steps_per_epoch: int
    epochs: int
    size: int = 0
    relation: str = "add_remove"

    @classmethod
    def for_client(cls, public_size: int, batch_size: int, epochs: int, relation: str = "add_remove"
                   ) -> "DPSGDSchedule":
        """The schedule for a client of public size ``public_size`` (the design size, or its declared n_k)."""
        if public_size < 1:
            raise ConfigurationError("a client needs at least one record to train with DP-SGD")
        q = min(1.0, batch_size / public_size)
        return cls(q, max(1, int(1.0 / q)), epochs, int(public_size), relation)

    @property
    def steps(self) -> int:
        """DP-SGD steps per round."""
        return self.steps_per_epoch * self.epochs

    @property
    def expected_batch(self) -> float:
        """The public expected batch size the noisy gradient sum is divided by."""
        return self.sample_rate * self.size if self.size else 1.0

    def step_event(self, noise_multiplier: float) -> PrivacyEvent:
        """One step in unit-clip form (noise std / clip = z); the Gaussian's sensitivity is the displacement of a
        clipped sum under the relation: 1 (add/remove) or 2 (replace one record by another)."""
        if self.relation == "replace_one":
            return PoissonSampledEvent(self.sample_rate, GaussianEvent(2.0, noise_multiplier),
                                       relation="replace_one")
        return PoissonSampledEvent(self.sample_rate, GaussianEvent(1.0, noise_multiplier))

    def round_event(self, noise_multiplier: float) -> PrivacyEvent:
        """One round of local training: ``steps`` sampled Gaussian steps."""
        return SelfComposedEvent(self.step_event(noise_multiplier), self.steps)


def check_dpsgd_privacy(privacy, algorithm: str) -> str:
    """Refuse configurations DP-SGD accounting cannot honour; return the accountant to calibrate with."""
    if privacy.unit != "example":
        raise ConfigurationError(f"{algorithm} gives example-level DP through DP-SGD; set unit='example' "
                                 f"(for client-level DP use dp_fedavg)")
    if privacy.sampling_rate < 1:
        raise ConfigurationError(f"{algorithm}: client sampling is not supported with DP-SGD-trained uploads (a "
                                 "client's training event is only known once it trained); set sampling_rate=1")
    accountant = privacy.resolved_accountant
    if accountant not in SAMPLED_ACCOUNTANTS:
        raise ConfigurationError(f"{algorithm}: DP-SGD steps are Poisson-sampled Gaussians, which the "
                                 f"{accountant!r} accountant cannot compose; set accountant='pld' (or 'rdp'); "
                                 f"CLI: --accountant pld")
    if privacy.adjacency == "replace_one" and accountant != "pld":
        raise ConfigurationError(f"{algorithm}: replace-one (public record counts) Poisson-sampled steps are "
                                 "composed by the pld accountant only; set accountant='pld' (CLI: --accountant pld)")
    return accountant


def dpsgd_schedule(algorithm, client: int) -> DPSGDSchedule:
    """The DP-SGD schedule of ``client`` from the algorithm's public facts and configuration (never its data)."""
    public = algorithm.public
    if public is None:
        raise ConfigurationError(f"{algorithm.name}: setup() must run before a client step")
    return DPSGDSchedule.for_client(public.size_of(client), algorithm.fed.batch_size, algorithm.fed.local_epochs,
                                    algorithm.privacy.adjacency)


def calibrate_dpsgd(epsilon: float, delta: float, rounds: int, schedule: DPSGDSchedule, accountant: str, *,
                    other_round_events: Sequence[PrivacyEvent] = ()) -> float:
    """The smallest noise multiplier z (to relative tolerance 1e-3) such that ``rounds`` rounds of ``schedule``'s
    DP-SGD, composed with ``other_round_events`` once per round (e.g. FOLA's Gaussian Fisher releases), meet
    (epsilon, delta) under ``accountant``: the composition the ledger checks, leaf by leaf.

    The returned z always meets the target (the search keeps the side that does, aiming LEDGER_MARGIN below it so the
    ledger's own composition order cannot tip it over). epsilon(z) is monotone and smooth in log-log scale, so a
    bracket is found by doubling and closed by safeguarded secant steps in (log z, log epsilon): 5 to 11 accountant
    evaluations where bisection to the same tolerance takes about 13 (each is a PLD or RDP composition, 0.03-0.3 s).
    The search is ``accounting.calibration.calibrate_noise`` over the factory z -> the run's events.
    """
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise ConfigurationError(f"DP-SGD needs a finite target epsilon > 0, got {epsilon!r}")
    return _calibrate_dpsgd(float(epsilon), delta, rounds, schedule, accountant, tuple(other_round_events))


@functools.lru_cache(maxsize=128)
def _calibrate_dpsgd(epsilon: float, delta: float, rounds: int, schedule: DPSGDSchedule, accountant: str,
                     other_round_events: tuple[PrivacyEvent, ...]) -> float:
    """:func:`calibrate_dpsgd`, computed once per distinct schedule and target in a process (a pure function)."""
    if schedule.sample_rate < 1 and schedule.sample_rate <= delta:
        raise ConfigurationError(f"sampling rate {schedule.sample_rate} is not above delta={delta}; choose a delta "
                                 "much smaller than batch_size / n")
    from privfl.accounting.accountants.analytic_gaussian import gaussian_mu
    from privfl.accounting.calibration import calibrate_noise, clt_noise_multiplier
    from privfl.accounting.events import flatten
    from privfl.accounting.errors import InvalidPrivacyParameter
    from privfl.accounting.events import ComposedEvent

    total_steps = rounds * schedule.steps
    target = epsilon  # calibrate_noise aims its one margin (accounting.calibration.LEDGER_MARGIN) below it
    others = tuple(SelfComposedEvent(event, rounds) for event in other_round_events)

    def run_event(z: float) -> PrivacyEvent:
        """Every round's other releases, then every DP-SGD step: the composition the ledger charges."""
        return ComposedEvent(others + (SelfComposedEvent(schedule.step_event(z), total_steps),))

    if other_round_events:
        alone = make_accountant(accountant)
        for event in other_round_events:
            alone.compose(event, rounds)
        if alone.get_epsilon(delta) >= target * (1 - 1e-3):
            raise ConfigurationError(f"no DP-SGD noise meets epsilon={epsilon}: the other releases alone spend "
                                     f"(almost) all of it; give the DP-SGD-trained channel a larger budget_share")
    # Start from the central-limit estimate for what the other releases leave (Gaussian DP: mu^2 adds), in units of
    # the step's displacement (2 under replace-one); the search then needs a few evaluations, not a dozen.
    mu_target = gaussian_mu(target, delta)
    mu_other_sq = sum(rounds * count * leaf.mu ** 2 for event in other_round_events for leaf, count in flatten(event)
                      if isinstance(leaf, GaussianEvent))
    mu_left = math.sqrt(max(mu_target ** 2 - mu_other_sq, 0.01 * mu_target ** 2))
    displacement = 2.0 if schedule.relation == "replace_one" else 1.0
    guess = displacement * clt_noise_multiplier(mu_left, schedule.sample_rate, total_steps)
    try:
        z, _ = calibrate_noise(run_event, target, delta, lambda: make_accountant(accountant),
                               guess=min(max(guess, 1e-3), 1e6), step=1.15, tol=_CALIBRATION_TOL, lower=1e-3,
                               upper=1e6)
    except InvalidPrivacyParameter as exc:
        if str(exc).startswith("no noise multiplier up to"):
            raise ConfigurationError(f"no DP-SGD noise up to 1e+06 meets epsilon={epsilon}") from None
        raise
    return z


def other_round_events(channels, privacy, rounds: int) -> tuple[PrivacyEvent, ...]:
    """The per-round events of a run's channels that are not DP-SGD-trained (a client's Gaussian releases beside its
    DP-SGD training, e.g. FOLA's Fisher), at the noise multipliers the run plan gives them
    (``privfl.core.plan.noise_multipliers_for``): what :func:`calibrate_dpsgd` composes with the training."""
    from privfl.core.channels import TrainedPrivately
    from privfl.core.plan import noise_multipliers_for

    others = [c for c in channels if c.private and not isinstance(c.clip, TrainedPrivately)]
    if not others:
        return ()
    multipliers = noise_multipliers_for(channels, privacy, rounds)
    return tuple(GaussianEvent(c.sensitivity, multipliers[c.name] * c.sensitivity) for c in others)


def clip_factor(norms2: torch.Tensor, clip: float) -> torch.Tensor:
    """The per-example clip factor min(1, C / (||g|| + 1e-6)) from squared norms (opacus's, which its ghost clipping
    applies on the per-client path): ||factor * g|| <= C always holds."""
    return (clip / (norms2.sqrt() + 1e-6)).clamp(max=1.0)


def clip_bits(norms2: torch.Tensor, clip, weight: torch.Tensor) -> torch.Tensor:
    """Adaptive clipping's per-record terms: the centred bit [||g|| <= C] - 1/2 of each example (``norms2``: squared
    norms; ``clip``: a number or a tensor broadcasting against them), times its 0/1 ``weight`` (padding out)."""
    return ((norms2 <= clip * clip).to(weight.dtype) - 0.5) * weight


#: the thresholds of DP-SGD FedAvg's round-level clip counts, as multiples of the round's clip C_t: C_t 2^(j/2),
#: j = -4..4 (a quarter of C_t to four times it, a factor sqrt(2) apart)
CLIP_RATIOS = tuple(2.0 ** (j / 2) for j in range(-4, 5))


def clip_bit_counts(norms2: torch.Tensor, clips: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each client's sums of its lot records' centred bits [||g|| <= r C_i] - 1/2 at every ratio r of
    :data:`CLIP_RATIOS` (``norms2``: (clients, width) squared norms; ``clips``: (clients,) the clients' clips;
    ``weight``: (clients, width) 0/1, padding out): a (clients, len(CLIP_RATIOS)) tensor. One record's vector of
    centred bits has L2 norm exactly sqrt(len(CLIP_RATIOS)) / 2."""
    thresholds = clips[:, None] * torch.tensor(CLIP_RATIOS, dtype=norms2.dtype)  # (clients, K)
    return clip_bits(norms2[:, :, None], thresholds[:, None, :], weight[:, :, None]).sum(1)


#: the smallest clip a client accepts from a broadcast (float32's per-record scaling stays finite above it)
SMALLEST_CLIP = 1e-30


@dataclass(frozen=True)
class AdaptiveClip:
    """Adaptive clipping (Andrew et al. 2021) at record level, its noise inside the privacy events the clipped value
    already costs. Two rules:

    - :meth:`step` (DP-FedSGD, one clip for the federation, its count a channel of the round's lot): each lot
      record's centred bit [||g|| <= C_t] - 1/2 (sensitivity 1/2) summed with noise;
      C <- C exp(-``lr`` (b - ``quantile``)), b = noisy sum / expected lot + 1/2.
    - :meth:`round_clip` (DP-SGD FedAvg: every client trains its round at the broadcast clip C_t): in each DP-SGD
      step a client also sums its lot records' centred bits at the thresholds r C_t, r in :data:`CLIP_RATIOS`
      (:func:`clip_bit_counts`; sensitivity sqrt(K) / 2 for K thresholds), with noise; it sends the round's noisy
      sums over its public count of expected terms (steps x expected batch): the fraction of its terms below each
      threshold, minus 1/2. The server averages the clients' fractions, reads the ``quantile`` off them (q_t:
      log-linear between thresholds, at most a factor 4 from C_t) and moves the clip ``lr`` of the way there in
      log space: log C_{t+1} = log C_t + ``lr`` (log q_t - log C_t) (``lr`` <= 1; the norms depend on the clip a
      round trained at, and a full jump oscillates). Counts summed over a federation's whole round are precise
      where one client's per-step count is noise (a client of 50 records at a lot of 32 has z of several: its own
      counts would move its clip by noise alone).

    Either way the step's one noise multiplier z is split by the rule every two-part release follows
    (``accounting.calibration.calibrate``): the count at z / sqrt(``share``) in units of its sensitivity, the
    gradient at z / sqrt(1 - ``share``); the per-record vector (g C_t^-1 / z_g, b / (s_b z_b)) then has norm at most
    1 / z, so a DP-SGD step is the same ``PoissonSampled(q, Gaussian(1, z))`` as a fixed clip's, the counts inside
    that event, and what a client sends of them post-processing of it."""

    quantile: float
    lr: float = 0.2
    share: float = 0.01

    @classmethod
    def of(cls, privacy) -> "AdaptiveClip | None":
        """The run's adaptive clipping (``PrivacyConfig.clip_quantile``; private runs), or None."""
        if not privacy.private or privacy.clip_quantile is None:
            return None
        return cls(privacy.clip_quantile, privacy.clip_lr, privacy.clip_share)

    def multipliers(self, z: float) -> tuple[float, float]:
        """(the gradient's noise multiplier, the count's) for the step's z."""
        return z / math.sqrt(1.0 - self.share), z / math.sqrt(self.share)

    def step(self, clip: float, noisy_count: float, expected_batch: float) -> float:
        """The next clip after a step whose noisy centred count is ``noisy_count`` (the fraction it estimates kept in
        [0, 1]: the noise cannot move the clip by more than exp(``lr``) a step)."""
        unclipped = min(1.0, max(0.0, noisy_count / expected_batch + 0.5))
        return float(clip * math.exp(-self.lr * (unclipped - self.quantile)))

    def check_broadcast(self, clip, start: float, round: int, rule: str = "step") -> float:
        """A client's check of the clip C_t the server broadcast for ``round`` (0-based), before any record is read:
        finite, at least :data:`SMALLEST_CLIP`, and within what ``round + 1`` clip updates of ``rule`` can reach from
        the public start ``start`` (``"step"``: a factor in [exp(-lr (1 - quantile)), exp(lr quantile)] an update;
        ``"round_clip"``: in [4^-lr, 4^lr]). A server that broadcast a clip no honest run reaches (2e-310, say)
        could make some clients' scaled values overflow and others' not: an error that depends on the records,
        outside every channel. Decided on the broadcast and public facts only; returns the clip as a float."""
        if isinstance(clip, bool) or not isinstance(clip, (int, float, np.integer, np.floating)):
            raise ConfigurationError(f"the server broadcast a clip that is not a number ({clip!r}); refused before "
                                     "any record was read")
        c = float(clip)
        n = max(int(round), 0) + 1
        if rule == "step":
            low, high = math.exp(-self.lr * (1.0 - self.quantile) * n), math.exp(self.lr * self.quantile * n)
        elif rule == "round_clip":
            low, high = 4.0 ** (-self.lr * n), 4.0 ** (self.lr * n)
        else:
            raise ValueError(f"rule must be 'step' or 'round_clip', got {rule!r}")
        lowest, highest = max(start * low * (1 - 1e-9), SMALLEST_CLIP), start * high * (1 + 1e-9)
        if not (math.isfinite(c) and lowest <= c <= highest):
            raise ConfigurationError(f"the server broadcast the clip {c!r} for round {round}, outside [{lowest:.6g}, "
                                     f"{highest:.6g}], what adaptive clipping can reach from {start:g} in {n} "
                                     "update(s); refused before any record was read")
        return c

    def round_clip(self, clip: float, fractions) -> float:
        """The next round's clip from the federation's noisy fractions of terms with norm at most r ``clip``, r in
        :data:`CLIP_RATIOS` (centred: minus 1/2, as the clients send them). The fractions are made non-decreasing in
        r (a running maximum, clamped to [0, 1]) and the clip is where they cross ``quantile``, log-linearly between
        the two thresholds around it; C_t / 4 if even the lowest threshold keeps more than the quantile, 4 C_t if
        the highest keeps less; then ``lr`` of the way from ``clip`` to it in log space."""
        return float(clip * (self.round_quantile(clip, fractions) / clip) ** self.lr)

    def round_quantile(self, clip: float, fractions) -> float:
        """The ``quantile`` of the norms read off the federation's fractions (see :meth:`round_clip`)."""
        raw = np.asarray(fractions, dtype=np.float64)
        if raw.shape != (len(CLIP_RATIOS),) or not np.all(np.isfinite(raw)):
            raise ValueError(f"round_clip needs {len(CLIP_RATIOS)} finite fractions, got {fractions!r}")
        f = np.clip(np.maximum.accumulate(raw + 0.5), 0.0, 1.0)
        logs = np.log(np.asarray(CLIP_RATIOS))
        q = self.quantile
        if f[0] >= q:
            return float(clip * CLIP_RATIOS[0])
        if f[-1] < q:
            return float(clip * CLIP_RATIOS[-1])
        j = int(np.argmax(f >= q))  # first threshold at or above the quantile (j >= 1)
        t = (q - f[j - 1]) / (f[j] - f[j - 1])
        return float(clip * math.exp(logs[j - 1] + t * (logs[j] - logs[j - 1])))


def secure_gaussian(shape, std: float, dtype=torch.float32) -> torch.Tensor:
    """N(0, std^2) noise of ``shape`` drawn by ``mechanisms.SecureNoise`` (OS CSPRNG, full-resolution Box-Muller:
    no tail cut, unlike torch's float32 ``normal``, whose single draws stop at 5.77 sigma), then cast to ``dtype``
    (float32 holds any such draw)."""
    from privfl.mechanisms import SecureNoise

    draws = SecureNoise().standard_normal(tuple(int(s) for s in shape))
    return torch.from_numpy(np.asarray(draws, dtype=np.float64) * float(std)).to(dtype)


#: the ``half_noise`` fault of ``privfl audit-run`` (:func:`audit_noise_fault`): a factor on every DP-SGD step's noise
#: in the current context (thread or task) only, 1 everywhere else
_STEP_NOISE_FAULT: ContextVar[float] = ContextVar("privfl_step_noise_fault", default=1.0)


@contextmanager
def audit_noise_fault(factor: float):
    """Scale every DP-SGD step's noise (:func:`step_noise`) by ``factor`` inside the ``with`` block, in the current
    context only: the injected fault of ``privfl audit-run --fault half_noise``, which shows that the run audit sees
    a step whose noise is smaller than its ledger charges. Nothing else uses it; other threads and tasks (another run
    in the same process) keep their noise, and it ends with the block."""
    token = _STEP_NOISE_FAULT.set(float(factor))
    try:
        yield
    finally:
        _STEP_NOISE_FAULT.reset(token)


#: ``privfl audit-run``'s record canaries in DP-SGD steps (:func:`audit_record_rows`), in the current context only
_AUDIT_ROWS: ContextVar[Callable | None] = ContextVar("privfl_audit_rows", default=None)
#: ``privfl audit-run --fault no_clip`` at record level (:func:`audit_clip_fault`): the per-record clip turned off for
#: the canaries' rows only, in the current context only
_CANARY_CLIP_OFF: ContextVar[bool] = ContextVar("privfl_canary_clip_off", default=False)


@contextmanager
def audit_record_rows(rows: Callable[[int, float], "ExtraRows | torch.Tensor | None"]):
    """Inside the ``with`` block, in the current context only, every DP-SGD step of the one client being trained asks
    ``rows(step, clip)`` (``step`` counts the training's steps from 0; ``clip``: the clip the step applies, the
    round's under adaptive clipping) for raw per-example gradient rows of records of the auditor's own that the
    step's lot drew (``privfl audit-run``'s record canaries: :class:`~privfl.training.stacked.ExtraRows`, or a
    tensor of full rows, in the flat layout of the trained model's parameters; None for none). They join the lot's
    own rows BEFORE the step's per-record clip and are clipped by the same call as the records: :func:`clip_factor`
    on their norms beside the records' (:class:`VectorisedDPSGD`, :class:`DPSGDLots` through
    :func:`clipped_gradient_sum`), or opacus's own clipping coefficient in :func:`dpsgd_train`; then summed with them
    before the noise. It is given nothing of the client's records. Every DP-SGD engine reads it at the same point,
    and refuses it while training several clients at once. :func:`audit_clip_fault` turns that clip off for these
    rows only."""
    token = _AUDIT_ROWS.set(rows)
    try:
        yield
    finally:
        _AUDIT_ROWS.reset(token)


@contextmanager
def audit_clip_fault(off: bool = True):
    """Inside the ``with`` block, in the current context only, the per-record clip leaves ``privfl audit-run``'s
    record canaries whole (factor 1; the records' own rows keep theirs): the injected fault of ``--fault no_clip``
    at record level, read where the canaries are clipped (:func:`audit_record_rows`'s executors; the auditor's
    canaries of DP-FedSGD and FedBNR through :func:`canary_clip_off`). Nothing else uses it."""
    token = _CANARY_CLIP_OFF.set(bool(off))
    try:
        yield
    finally:
        _CANARY_CLIP_OFF.reset(token)


def canary_clip_off() -> bool:
    """Whether :func:`audit_clip_fault` is on in the current context."""
    return _CANARY_CLIP_OFF.get()


def _audit_rows(step: int, clients: int, dim: int, clip: float, dtype=torch.float32) -> "ExtraRows | None":
    """Inside :func:`audit_record_rows`, the step's canary rows (an :class:`ExtraRows` of ``dim`` coordinates, in
    ``dtype``), or None; outside it, one ContextVar read and nothing else (the step's hot path)."""
    rows_of = _AUDIT_ROWS.get()
    if rows_of is None:
        return None
    if clients != 1:
        raise ConfigurationError("audit-run's record canaries go into one client's DP-SGD training at a time")
    rows = rows_of(step, float(clip))
    if rows is None:
        return None
    if isinstance(rows, torch.Tensor):
        rows = ExtraRows.dense(rows.reshape(-1, rows.shape[-1]) if rows.dim() == 1 else rows)
    if rows.dim != dim or rows.index.dim() != 2:
        raise ConfigurationError(f"audit-run's record canaries are rows of the trained model's {dim} parameters, "
                                 f"got {rows.dim} coordinates of shape {tuple(rows.index.shape)}")
    return rows.to(dtype) if rows.count else None


def _canary_factor(factor: torch.Tensor, canaries: int) -> torch.Tensor:
    """``factor`` (the clip factors of a lot's rows, the ``canaries`` canary rows last), with the canaries' set to 1
    under :func:`audit_clip_fault`."""
    if not _CANARY_CLIP_OFF.get():
        return factor
    factor = factor.clone()
    factor[..., factor.shape[-1] - canaries:] = 1.0
    return factor


def _opacus_canary_coefficient(gsm, rows: "ExtraRows", offsets: dict[int, tuple[int, int]]) -> torch.Tensor:
    """Opacus's own per-example clipping coefficient (``get_clipping_coef``, the one its ghost clipping applied to
    the lot's records) evaluated at the canary ``rows``: each trainable parameter's per-row norm set where opacus
    keeps it (``_norm_sample``) for the call, then restored. ``offsets``: each parameter's (id -> [lo, hi)) block
    of the flat layout."""
    params = gsm.trainable_parameters
    saved = [getattr(p, "_norm_sample", None) for p in params]
    saved_norms = getattr(gsm, "_per_sample_gradient_norms", None)
    try:
        for p in params:
            lo, hi = offsets[id(p)]
            p._norm_sample = rows.norms2(lo, hi).sqrt().to(p.dtype)
        return gsm.get_clipping_coef().to(rows.values.dtype)
    finally:
        for p, old in zip(params, saved):
            if old is None:
                if hasattr(p, "_norm_sample"):
                    del p._norm_sample
            else:
                p._norm_sample = old
        gsm._per_sample_gradient_norms = saved_norms


def step_noise(shape, std: float, generator: torch.Generator, secure: bool, dtype=torch.float32) -> torch.Tensor:
    """The Gaussian noise of one DP-SGD step, N(0, std^2) per coordinate (std = z C): from the OS CSPRNG
    (:func:`secure_gaussian`) unless the run is seeded, then from the client's torch ``generator`` as opacus draws
    it. Every DP-SGD path in privfl draws its noise here (:func:`dpsgd_train`, :class:`VectorisedDPSGD`,
    :func:`privatise_gradient_sum`)."""
    std = std * _STEP_NOISE_FAULT.get()
    if std == 0:
        return torch.zeros(shape, dtype=dtype)
    if secure:
        return secure_gaussian(shape, std, dtype)
    return torch.normal(0.0, float(std), size=tuple(shape), generator=generator).to(dtype)


def noised_mean(clipped_sum: torch.Tensor, *, std: float, expected_batch: float, generator: torch.Generator,
                secure: bool) -> torch.Tensor:
    """A DP-SGD step's gradient from its clipped sum: plus :func:`step_noise`, over the public expected batch."""
    return (clipped_sum + step_noise(clipped_sum.shape, std, generator, secure, clipped_sum.dtype)) / expected_batch


def clipped_gradient_sum(per_example: torch.Tensor, dim: int, clip: float, *, extra: "ExtraRows | None" = None
                         ) -> torch.Tensor:
    """The sum of a lot's per-example gradient rows, each clipped by :func:`clip_factor` (zeros of ``dim`` for an
    empty lot). A row that is not finite, or whose norm is not (an overflow on an extreme record), adds the zero term,
    decided on that row alone (as ``privfl.training.stacked.PerExampleTerms`` does). ``extra`` (``privfl
    audit-run``'s canary rows, :func:`audit_record_rows`): rows joined after the lot's, clipped by the same
    :func:`clip_factor` call and summed with them."""
    n = len(per_example)
    if not n and extra is None:
        return torch.zeros(dim)
    norms2 = per_example.pow(2).sum(1)
    bad = ~torch.isfinite(norms2)
    if bool(bad.any()):
        per_example = torch.where(bad[:, None], torch.zeros((), dtype=per_example.dtype), per_example)
        norms2 = torch.where(bad, torch.zeros((), dtype=norms2.dtype), norms2)
    if extra is None:
        return (per_example * clip_factor(norms2, clip)[:, None]).sum(dim=0)
    extra = extra.to(per_example.dtype)
    factor = _canary_factor(clip_factor(torch.cat([norms2.to(extra.values.dtype), extra.norms2()]), clip),
                            extra.count)
    total = extra.sums(factor[n:])
    return total + (per_example * factor[:n, None]).sum(dim=0) if n else total


def privatise_gradient_sum(per_example: torch.Tensor, dim: int, *, clip: float, noise_multiplier: float,
                           expected_batch: float, generator: torch.Generator, secure: bool) -> torch.Tensor:
    """One DP-SGD step's gradient from a Poisson lot's per-example gradients (Abadi et al. 2016): each row of
    ``per_example`` (one example's flattened gradient; none for an empty lot) clipped by :func:`clip_factor`,
    summed (:func:`clipped_gradient_sum`), then :func:`noised_mean` (noise of std ``noise_multiplier * clip``, over
    the public expected lot); a vector of ``dim``. For steps whose per-example gradients are materialised (HBFL's
    meme)."""
    return noised_mean(clipped_gradient_sum(per_example, dim, clip), std=noise_multiplier * clip,
                       expected_batch=expected_batch, generator=generator, secure=secure)


def check_opacus_model(model: nn.Module, algorithm: str, input_shape: Sequence[int]) -> None:
    """Refuse a model whose DP-SGD training would not clip each record's own gradient, saying what to change.

    DP-SGD's sensitivity (one record moves the clipped sum by at most C) holds when each example's gradient is a
    function of that example alone, opacus's per-example norm is that gradient's norm, and nothing but the clipped,
    noised sum changes the parameters. Refused, on the model's structure alone:

    - the problems of ``opacus.validators.ModuleValidator.validate`` (BatchNorm with parameters, ...), with its fix;
    - a norm layer with batch statistics (every ``torch.nn`` BatchNorm, affine or not: opacus's validator sees only
      layers with parameters): it normalises an example by the other examples of its lot;
    - a registered buffer anywhere in the model: state a forward pass may write from the records outside the clip (as
      running statistics are), which opacus refuses in layers with parameters only;
    - ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``max_norm``: its forward renormalises the rows it looks up, in
      place and outside autograd, so the trained weights record which rows the records hold, unclipped and unnoised.

    Then :func:`check_per_example_model` probes a copy of the model on a public batch of ``input_shape`` (the public
    shape of one example; nothing of any client's data): no in-place write to a parameter, no mixing of the
    examples of a batch in train mode, and opacus's per-example gradient norms equal to the true ones (a weight used
    outside the layer that owns it escapes opacus's hooks)."""
    from opacus.validators import ModuleValidator

    problems = ModuleValidator.validate(model, strict=False)
    if problems:
        offending = []
        for name, module in model.named_modules():
            check = ModuleValidator.VALIDATORS.get(type(module))
            if check is not None and check(module):
                offending.append(f"{name or '<model>'} ({type(module).__name__})")
        first = str(problems[0]).split(". ")[0].strip()
        raise ConfigurationError(f"{algorithm}: opacus cannot train this model with per-example clipping: layers "
                                 f"{_names(offending) or '(see opacus ModuleValidator.validate)'}: {first}. Replace "
                                 "them (e.g. BatchNorm by GroupNorm), or let opacus do it: "
                                 "model = opacus.validators.ModuleValidator.fix(model)")
    modules = list(model.named_modules())
    batch_norms = [f"{name or '<model>'} ({type(m).__name__})" for name, m in modules
                   if isinstance(m, nn.modules.batchnorm._NormBase)
                   and not isinstance(m, nn.modules.instancenorm._InstanceNorm)]
    if batch_norms:
        raise ConfigurationError(f"{algorithm}: batch normalisation (layers {_names(batch_norms)}) mixes the examples "
                                 "of a batch, affine or not: in training it normalises each example by the statistics "
                                 "of its whole lot, so one record moves the other records' gradients and the "
                                 "per-example clip bounds nothing. Replace it by a per-example norm (nn.GroupNorm, "
                                 "nn.LayerNorm, nn.InstanceNorm without running statistics), or let opacus do it: "
                                 "model = opacus.validators.ModuleValidator.fix(model)")
    buffered = [f"{name or '<model>'} ({type(m).__name__}: {', '.join(b for b, _ in m.named_buffers(recurse=False))})"
                for name, m in modules if any(True for _ in m.named_buffers(recurse=False))]
    if buffered:
        raise ConfigurationError(f"{algorithm}: layers {_names(buffered)} hold buffers: state that a forward pass may "
                                 "write from the records (as running statistics are), outside the per-example clip "
                                 "and the noise, which DP-SGD's accounting cannot cover. Remove them (for a layer's "
                                 "running statistics, use it without: e.g. track_running_stats=False), or keep a "
                                 "constant as a plain tensor attribute instead of register_buffer")
    renormed = [f"{name or '<model>'} ({type(m).__name__}, max_norm={m.max_norm})" for name, m in modules
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None]
    if renormed:
        raise ConfigurationError(f"{algorithm}: layers {_names(renormed)} renormalise the rows a forward pass looks "
                                 "up, in place and outside autograd, so the trained weights would record which "
                                 "tokens the records hold, with no clip or noise; leave max_norm out (the "
                                 "per-example clip already bounds each record's step)")
    check_per_example_model(model, algorithm, input_shape)


def _names(items: Sequence[str]) -> str:
    return ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")


#: the public probe batch of :func:`check_per_example_model`: its size, and the seed of its inputs and directions
_PROBE_BATCH, _PROBE_SEED = 4, 0


def check_user_loss(model: nn.Module, loss, algorithm: str, public) -> None:
    """Refuse, before anything is charged, a user's loss that fails on a public probe batch of the data's input shape
    (:func:`_probe_batches`) with labels of the run's task (class 0, or zero targets). Under DP-SGD a record whose
    loss raises adds the zero term, decided on that record alone; a loss that raises on every example would leave
    DP-SGD training on noise alone, silently (a review, session 26: a shape mistake in a user's MSE loss trained a
    whole private run on noise, exit 0). The loss is the program's: a failure on public data is the same on every
    neighbour."""
    if loss is None:
        return
    net = copy.deepcopy(model).train()
    dtype = next((p.dtype for p in net.parameters() if p.is_floating_point()), torch.float32)
    with torch.random.fork_rng(devices=[]):
        batch, _ = _probe_batches(net, tuple(int(s) for s in public.input_shape), dtype, algorithm)
        n = len(batch)
        if public.task == "classification":
            y = torch.zeros(n, dtype=torch.long)
        else:
            width = int(public.num_classes or 1)
            y = torch.zeros(n, dtype=dtype) if width == 1 else torch.zeros(n, width, dtype=dtype)
        try:
            TaskLoss(loss)(net(batch), y)
        except UsageError:
            raise
        except Exception as exc:  # noqa: BLE001 - the program's loss on public data
            raise UsageError(f"{algorithm}: your loss fails on a public probe batch of the data's shape (outputs "
                             f"{tuple(net(batch).shape)}, targets {tuple(y.shape)} {y.dtype}): {type(exc).__name__}: "
                             f"{exc}. Fix the loss (under DP-SGD a record whose loss fails adds nothing, so a loss "
                             f"that always fails would train on noise alone)") from None


def _probe_batches(net: nn.Module, input_shape: tuple[int, ...], dtype: torch.dtype, algorithm: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A public probe batch the model runs on and the same batch with its first example changed: standard normal
    inputs, or (for a model whose inputs are indices, e.g. token ids read by an nn.Embedding) inputs of 0s and 1s;
    refuses a model that fails on both."""
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    shape = (_PROBE_BATCH, *input_shape)
    normal = torch.randn(shape, generator=gen, dtype=torch.float64)
    moved_normal = normal.clone()
    moved_normal[0] = 4.0 * torch.randn(input_shape, generator=gen, dtype=torch.float64) + 1.0
    bits = torch.randint(0, 2, shape, generator=gen).to(torch.float64)
    moved_bits = bits.clone()
    moved_bits[0] = 1.0 - bits[0]
    failures = []
    for batch, moved in ((normal, moved_normal), (bits, moved_bits)):
        batch, moved = batch.to(dtype), moved.to(dtype)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(_PROBE_SEED)
                out = net(batch)
        except Exception as exc:  # noqa: BLE001 - the user's forward on a public probe: said below
            failures.append(f"{type(exc).__name__}: {exc}")
            continue
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.ndim < 1 \
                or out.shape[0] != _PROBE_BATCH:
            raise ConfigurationError(f"{algorithm}: the model must return a floating tensor with one row per example; "
                                     f"on a probe batch of shape {shape} it returned "
                                     f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
        return batch, moved
    raise ConfigurationError(f"{algorithm}: the DP-SGD model check runs the model in training mode on a public probe "
                             f"batch of shape {shape} (standard normal values, then 0s and 1s) and it failed on both: "
                             f"{'; '.join(failures)}")


def check_per_example_model(model: nn.Module, algorithm: str, input_shape: Sequence[int]) -> None:
    """The probes of :func:`check_opacus_model`, on a deep copy of ``model`` in training mode and a public probe batch
    of ``input_shape`` (:func:`_probe_batches`; nothing of any client's data), under a forked torch random state:

    1. one forward and backward pass leaves every parameter as it was (a layer writing its weights in place, outside
       autograd, would change them by the records with no clip or noise);
    2. changing the first example leaves the other examples' outputs as they were
       (:func:`privfl.models.checks.mixes_examples`; FedBNR's extractor check uses the same probe);
    3. opacus's per-example gradient norms, from the gradient sample module DP-SGD clips with
       (``GradSampleModuleFastGradientClipping``, ghost clipping), equal the true per-example gradients' norms
       (``torch.autograd.grad`` of each example's loss, a fixed random linear function of its output) parameter by
       parameter: a weight used outside the layer that owns it (``F.linear(h, self.emb.weight)``) adds a gradient
       opacus's hooks do not see, so its clip would not bound one record's influence.

    Each refusal names what to change. Its cost: a few passes over the probe batch."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    input_shape = tuple(int(s) for s in input_shape)
    net = copy.deepcopy(model).train()
    dtype = next((p.dtype for p in net.parameters() if p.is_floating_point()), torch.float32)
    names = {id(p): n for n, p in net.named_parameters()}
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    with torch.random.fork_rng(devices=[]):
        batch, moved = _probe_batches(net, input_shape, dtype, algorithm)
        try:
            gsm = GradSampleModuleFastGradientClipping(net, max_grad_norm=1.0, use_ghost_clipping=True,
                                                       loss_reduction="mean")
        except NotImplementedError as exc:
            raise _unsupported_layer(exc, algorithm) from None
        params = list(gsm.trainable_parameters)
        gen = torch.Generator().manual_seed(_PROBE_SEED + 1)
        try:
            torch.manual_seed(_PROBE_SEED)
            out = gsm(batch)
            direction = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
            losses = (out * direction).reshape(len(batch), -1).sum(1)
            with warnings.catch_warnings():  # as in dpsgd_train: the first layer's inputs need no gradient
                warnings.filterwarnings("ignore", message=_BACKWARD_HOOK_WARNING, category=UserWarning)
                losses.mean().backward(retain_graph=True)  # opacus's first pass: the per-example norms
                gsm.disable_hooks()
                true = [torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
                        for i in range(len(batch))]
        except NotImplementedError as exc:
            raise _unsupported_layer(exc, algorithm) from None
        except Exception as exc:  # noqa: BLE001 - the user's model on a public probe batch: its structure, no record
            raise ConfigurationError(f"{algorithm}: the DP-SGD model check's forward and backward pass on a public "
                                     f"probe batch of shape {tuple(batch.shape)} failed: {type(exc).__name__}: "
                                     f"{exc}") from None
        changed = [n for n, p in net.named_parameters() if not torch.equal(p.detach(), before[n])]
        if changed:
            raise ConfigurationError(f"{algorithm}: a forward and backward pass changed parameters "
                                     f"{_names(changed)} in place (e.g. nn.Embedding's max_norm renormalising the "
                                     "rows it looks up): a change made by the records themselves, outside the "
                                     "per-example clip and the noise; remove the in-place write")
        if mixes_examples(net, batch, moved, seed=_PROBE_SEED):
            raise ConfigurationError(f"{algorithm}: the model mixes the examples of a batch in training mode: on a "
                                     "public probe batch, changing one example changed the other examples' outputs "
                                     "(e.g. x - x.mean(0), batch statistics), so one record would move the other "
                                     "records' gradients and the per-example clip would bound nothing; use layers "
                                     "that act on each example alone")
        wrong = []
        tol = 1e-6 if dtype == torch.float64 else 1e-3
        for j, p in enumerate(params):
            norms = getattr(p, "_norm_sample", None)
            if norms is None and all(g[j] is None for g in true):
                continue  # a parameter the forward pass does not use: no gradient, no norm
            exact = torch.stack([(torch.zeros_like(p) if g[j] is None else g[j]).reshape(-1).norm()
                                 for g in true]).double()
            if norms is None or norms.shape != exact.shape \
                    or float((norms.double() - exact).abs().max()) > tol * (1e-12 + float(exact.max())):
                wrong.append(names.get(id(p), "?"))
    if wrong:
        raise ConfigurationError(f"{algorithm}: opacus's per-example gradient norms of parameters {_names(wrong)} "
                                 "differ from the true per-example gradients on a public probe batch, so its clip "
                                 "would not bound one record's influence: a parameter used outside the layer that "
                                 "owns it (weight tying such as F.linear(h, self.emb.weight), a layer's weight read "
                                 "in another module's forward) adds a gradient opacus's hooks do not see. Use each "
                                 "parameter through its own layer only (give the output layer weights of its own)")


def _unsupported_layer(exc: Exception, algorithm: str) -> ConfigurationError:
    from privfl.errors import UsageError  # the model's structure, not its records: an error even in a private step

    return UsageError(f"{algorithm}: opacus cannot compute per-example gradients for this model ({exc}). Use "
                              "each layer once per forward pass, and build the model from layers opacus supports "
                              "(nn.Linear, nn.Conv1d/2d/3d, "
                              "nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RNN/LSTM/GRU from opacus.layers, ...) or "
                              "register a grad sampler for it (opacus.grad_sample.register_grad_sampler)")


def loss_class_weight(loss) -> torch.Tensor | None:
    """The per-class weight of a torch classification loss (``nn.CrossEntropyLoss(weight=...)``, ``nn.NLLLoss``), or
    None."""
    if isinstance(loss, (nn.CrossEntropyLoss, nn.NLLLoss)) and getattr(loss, "weight", None) is not None:
        return loss.weight
    return None


def class_sampling_rates(weight, y: torch.Tensor, sample_rate: float, relation: str, algorithm: str) -> torch.Tensor:
    """Each record's Poisson sampling rate under class weights: ``q * w[y_i] / max(w)``.

    Why: DP-SGD clips each example's gradient to C, so a weight on the loss is undone whenever a gradient is larger
    than C (under DP noise, most are): a class-weighted loss trains as if unweighted. Sampling a record with a rate
    proportional to its class weight gives the same expected step as weighting its clipped gradient (E[sum over the
    batch of clip(g_i)] = sum_i q_i clip(g_i)), and costs no privacy beyond the schedule's: every record's rate is at
    most q, and a Poisson-subsampled mechanism's privacy loss only shrinks with a smaller rate (the hockey-stick
    divergence is jointly convex, and a rate q' < q mixes the rate-q mechanism with the one that leaves the record
    out), so the events at rate q bound every record's loss, under add/remove. A record's rate follows its own label,
    which its neighbour may not share: under replace-one the two rates differ and that argument does not hold, so the
    combination is refused. The weights themselves must be public (chosen before the run, never from the clients'
    labels: a base rate computed from private counts would be a release of its own).
    """
    w = check_class_weights(weight, None, relation, algorithm)
    labels = y.long().reshape(-1)
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= w.numel()):
        raise ConfigurationError(f"{algorithm}: the loss has {w.numel()} class weights but a label is outside "
                                 f"0..{w.numel() - 1}")
    return (float(sample_rate) * w / w.max())[labels]


def check_class_weights(weight, num_classes: int | None, relation: str, algorithm: str) -> torch.Tensor:
    """The class weights as a float64 vector, after the checks :func:`class_sampling_rates` relies on: one finite
    weight > 0 per class (``num_classes``, when known: the public label set), and add/remove adjacency. An algorithm
    calls it at setup, so that a configuration it cannot account is refused before anything is charged."""
    w = torch.as_tensor(weight, dtype=torch.float64).detach().reshape(-1)
    if w.numel() < 2 or not bool(torch.isfinite(w).all()) or bool((w <= 0).any()):
        raise ConfigurationError(f"{algorithm}: class weights must be one finite number > 0 per class, got "
                                 f"{w.tolist()}")
    if num_classes is not None and w.numel() != num_classes:
        raise ConfigurationError(f"{algorithm}: {w.numel()} class weights for {num_classes} classes; give one weight "
                                 "per class")
    if relation == "replace_one":
        raise ConfigurationError(f"{algorithm}: class weights under DP-SGD sample each record at a rate set by its own "
                                 "label, which is sound under add/remove adjacency only; use adjacency='add_remove' "
                                 "(and no declared client sizes) or drop the class weights")
    return w


def poisson_lot(rates, n: int, generator) -> torch.Tensor:
    """One Poisson lot: the indices of ``n`` records, each in with its own probability (``rates``: a number, or one
    per record), coins from ``generator``; drawn as opacus's ``UniformWithReplacementSampler`` draws them."""
    coins = torch.rand(n, generator=generator)
    mask = coins < rates if isinstance(rates, float) else coins.double() < rates
    return mask.nonzero(as_tuple=False).reshape(-1)


class _PoissonSampler:
    """A step's Poisson lot, ``steps`` times: record i in with probability ``rates`` (one rate for all, or one per
    record), independently (:func:`poisson_lot`)."""

    def __init__(self, rates, n: int, steps: int, generator):
        self.rates, self.n, self.steps, self.generator = rates, int(n), int(steps), generator

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            yield poisson_lot(self.rates, self.n, self.generator).tolist()


def _reset_opacus_pass(gsm) -> None:
    """Forget what opacus's hooks kept of a forward or backward pass that raised part-way (the activations its
    forward hooks stacked, the parameters' use counts, partial per-sample norms), so the next pass starts clean."""
    for module in gsm.modules():
        if hasattr(module, "activations"):
            module.activations = []
    for p in gsm.parameters():
        if hasattr(p, "_forward_counter"):
            p._forward_counter = 0
        for attr in ("_norm_sample", "grad_sample"):
            if getattr(p, attr, None) is not None:
                setattr(p, attr, None)


def dpsgd_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, schedule: DPSGDSchedule, *,
                noise_multiplier: float, clip: float, lr: float, momentum: float, rng: np.random.Generator,
                secure_noise: bool = False, before_step: Callable[[int, int], None] | None = None,
                extra_gradient: Callable[[], None] | None = None, loss: Callable | None = None,
                optimizer: Callable | None = None, algorithm: str = "dpsgd_fedavg") -> dict[str, float]:
    """Train ``model`` in place with opacus DP-SGD (ghost clipping, Poisson sampling) for ``schedule.steps`` steps.

    ``before_step(epoch, step)`` runs at the parameters each step starts from, with opacus's hooks off, so it may
    run a forward/backward pass of its own (FOLA's Fisher pass). It must draw any randomness of its own and never
    reuse the Poisson batches: which records a step sampled is DP-SGD's hidden randomness, and a release that reveals
    it would void the amplification by sampling that the accounting assumes. ``extra_gradient()`` runs after
    clipping and noise, before the update, and may add a data-independent term to each ``p.grad`` (FOLA's prior:
    post-processing). Returns the mean training loss and the number of steps. An empty Poisson batch is still a
    step: its update is noise only, as the accounting assumes.

    ``loss``: the criterion (default cross-entropy for integer labels, mean squared error for float targets), used
    per example through :class:`privfl.training.local.TaskLoss` (reduction ``"none"``, then opacus's mean over the
    expected batch): each example's gradient is clipped whatever the loss. A class weight on the loss
    (``nn.CrossEntropyLoss(weight=w)``, ``nn.NLLLoss(weight=w)``; public) becomes the records' sampling rates
    (:func:`class_sampling_rates`) and the loss is applied unweighted, so the weight survives the clipping. ``optimizer``: a factory of parameters
    (default SGD with ``lr`` and ``momentum``) that opacus wraps; it only sees clipped, noised gradients, so it is
    post-processing.
    """
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    n = len(x)
    class_weight = loss_class_weight(loss)
    rates = None
    if class_weight is not None:
        rates = class_sampling_rates(class_weight, y, schedule.sample_rate, schedule.relation, algorithm)
        loss = copy.deepcopy(loss)
        loss.weight = None  # the weight is in the sampling now: weighting the loss too would count it twice
    criterion_fn = TaskLoss(loss if loss is not None else (nn.MSELoss() if y.is_floating_point()
                                                           else nn.CrossEntropyLoss()))
    criterion_fn.require_per_example(algorithm)
    try:
        gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=clip, use_ghost_clipping=True,
                                                   loss_reduction="mean")
    except NotImplementedError as exc:
        raise _unsupported_layer(exc, algorithm) from None
    params = [p for p in gsm.parameters() if p.requires_grad]
    inner = UserTraining(optimizer=optimizer).make_optimizer(params, lr, momentum)
    # opacus clips (ghost clipping), sums and divides by the expected batch B; it adds no noise: the step hook adds
    # N(0, (z C)^2) / B from step_noise, the draw every DP-SGD path shares (the OS CSPRNG with an exact tail unless
    # seeded; opacus's secure_mode draws torch float32 normals, whose tails are cut).
    expected_batch = schedule.expected_batch if schedule.size else schedule.sample_rate * n
    noise_generator = private_torch_generator(rng, secure_noise)
    optimizer = DPOptimizerFastGradientClipping(inner, noise_multiplier=0.0, max_grad_norm=clip,
                                                expected_batch_size=expected_batch, loss_reduction="mean")

    lot: dict = {"ids": None, "failed": False}

    def finite_sum(batch: float) -> None:
        """The step's clipped sum over B recomputed from the lot's per-example gradients, one example at a time, when
        opacus's is not finite or its batched pass raised: :func:`clipped_gradient_sum` drops an example whose
        gradient or norm is not finite on its own, as the vectorised executor does, and an example whose own
        forward or backward raises (a user's model failing on one record: a category code outside its embedding)
        adds the zero term too, decided on that example alone (opacus offers no per-sample hook for it)."""
        rows = []
        dim = sum(p.numel() for p in params)
        reduction = criterion_fn.reduction
        gsm.disable_hooks()
        try:
            criterion_fn.reduction = "none"
            for i in lot["ids"].tolist():
                try:
                    loss = criterion_fn(gsm(x[i:i + 1]), y[i:i + 1]).sum()
                    with warnings.catch_warnings():  # the hooks are off; torch still names the first layer's
                        warnings.filterwarnings("ignore", message=_BACKWARD_HOOK_WARNING, category=UserWarning)
                        grads = torch.autograd.grad(loss, params, allow_unused=True)
                except UsageError:
                    raise
                except Exception:  # noqa: BLE001 - this example's own failure: its term is zero
                    _reset_opacus_pass(gsm)
                    rows.append(torch.full((dim,), float("nan")))
                    continue
                rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                                       for p, g in zip(params, grads)]))
        finally:
            criterion_fn.reduction = reduction
            gsm.enable_hooks()
        total = clipped_gradient_sum(torch.stack(rows), dim, clip)
        offset = 0
        for p in params:
            p.grad = total[offset:offset + p.numel()].reshape(p.shape).to(p.dtype) / batch
            offset += p.numel()

    def step_hook(opt) -> None:  # runs after opacus's clip and 1/B scaling, before the inner step
        batch = opt.expected_batch_size * getattr(opt, "accumulated_iterations", 1)
        if lot["ids"] is not None and not all(bool(torch.isfinite(p.grad).all()) for p in opt.params):
            finite_sum(batch)
        if lot["failed"]:
            finite_sum(batch)
        # audit-run's canary rows (steps: this step, from 0), clipped by opacus's own coefficient, the one its ghost
        # clipping gave the lot's records, and summed into theirs (here already over B)
        canaries = _audit_rows(steps, 1, offsets["dim"], clip)
        if canaries is not None:
            total = canaries.sums(_canary_factor(_opacus_canary_coefficient(gsm, canaries, offsets), canaries.count))
            for p in model.parameters():
                if p.grad is not None:
                    lo, hi = offsets[id(p)]
                    p.grad.add_(total[lo:hi].reshape(p.shape).to(p.grad.dtype), alpha=1.0 / batch)
        for p in opt.params:  # the step's noise, parameter by parameter, over the same expected batch
            p.grad.add_(step_noise(p.grad.shape, noise_multiplier * clip, noise_generator, secure_noise,
                                   p.grad.dtype) / batch)
        if extra_gradient is not None:
            extra_gradient()

    offsets, dim = {}, 0  # each parameter's block of the flat layout (audit-run's canary rows)
    for p in model.parameters():
        offsets[id(p)] = (dim, dim + p.numel())
        dim += p.numel()
    offsets["dim"] = dim
    optimizer.attach_step_hook(step_hook)
    criterion = DPLossFastGradientClipping(gsm, optimizer, criterion_fn, "mean")
    sampler = _PoissonSampler(schedule.sample_rate if rates is None else rates, n, schedule.steps_per_epoch,
                              private_torch_generator(rng, secure_noise))
    gsm.train()
    loss_total, seen, steps = 0.0, 0, 0
    try:
        for epoch in range(schedule.epochs):
            for step, batch in enumerate(sampler):
                if before_step is not None:
                    gsm.disable_hooks()
                    try:
                        before_step(epoch, step)
                    finally:
                        gsm.enable_hooks()
                ids = np.asarray(batch, dtype=np.int64)
                optimizer.zero_grad(set_to_none=True)
                lot["ids"] = torch.from_numpy(ids) if len(ids) else None
                lot["failed"] = False
                if len(ids):
                    idx = torch.from_numpy(ids)
                    try:
                        value = criterion(gsm(x[idx]), y[idx])
                        with warnings.catch_warnings():
                            # opacus's ghost clipping hooks every layer; torch warns when a full backward hook fires
                            # on a module whose inputs need no gradient: the first layer, whose inputs are data. The
                            # hooks read gradients with respect to outputs and parameters only, so it is harmless.
                            warnings.filterwarnings("ignore", message=_BACKWARD_HOOK_WARNING, category=UserWarning)
                            value.backward()
                    except NotImplementedError as exc:
                        raise _unsupported_layer(exc, algorithm) from None
                    except UsageError:
                        raise
                    except Exception:  # noqa: BLE001 - one of the lot's records made the batched pass raise
                        # the lot is recomputed one example at a time in the step hook (finite_sum), each raising
                        # example adding zero: the step's sensitivity stays C, whatever one record does
                        lot["failed"] = True
                        _reset_opacus_pass(gsm)
                        for p in params:
                            p.grad = torch.zeros_like(p)
                        step_hook(optimizer)  # opacus's clip has nothing to read: the hook's steps, then the update
                        inner.step()
                        steps += 1
                        continue
                    else:
                        loss_total += float(value.detach()) * len(ids)
                        seen += len(ids)
                else:
                    for p in params:
                        p.grad = torch.zeros_like(p)
                optimizer.step()
                steps += 1
    finally:
        optimizer.zero_grad(set_to_none=True)
        gsm.remove_hooks()
    if steps != schedule.steps:
        raise RuntimeError(f"DP-SGD ran {steps} steps but its accounting assumes {schedule.steps}")
    return {"train_loss": loss_total / max(seen, 1), "dpsgd_steps": float(steps)}


class VectorisedDPSGD:
    """DP-SGD (per-example clipping, Poisson sampling, Gaussian noise) for chunks of clients at once: the computation
    of :func:`dpsgd_train` (opacus's ghost clipping) written with ``torch.func``.

    Per step, each client draws its Poisson batch from its own sampling generator (:func:`poisson_lot`, as
    :func:`dpsgd_train` draws it); the chunk's batches are padded to the longest with
    zero-weight rows; ``vmap`` over clients of ``vmap`` over examples gives every example's gradient; each is clipped
    by :func:`clip_factor`; the clipped sum gets the client's noise and is divided by the public expected batch
    (:func:`noised_mean`, parameter by parameter from the client's noise generator, as :func:`dpsgd_train` draws it);
    then torch's SGD step (with momentum). An empty batch is still a step (noise only). Seeded identically, it gives the
    per-client loop's model to float tolerance.

    Args:
        model: the architecture (only its structure is used, through ``functional_call``).
        schedule: the clients' common :class:`DPSGDSchedule`.
        noise_multiplier, clip, lr, momentum: as in ``dpsgd_train``.
        secure_noise: the noise from ``mechanisms.SecureNoise`` (and Poisson generators seeded from OS entropy by the
            caller); False: torch's generator, reproducible from the seed.
        memory_budget: bytes of per-client state (per-example gradients of one batch) one chunk may hold.
    """

    def __init__(self, model: nn.Module, *, schedule, noise_multiplier: float, clip: float, lr: float,
                 momentum: float, secure_noise: bool, memory_budget: int = 4 * DEFAULT_MEMORY_BUDGET,
                 adaptive: AdaptiveClip | None = None):
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]
        self.schedule = schedule
        self.z, self.clip, self.lr, self.momentum = float(noise_multiplier), float(clip), float(lr), float(momentum)
        self.secure_noise = bool(secure_noise)
        self.memory_budget = int(memory_budget)
        self.adaptive = adaptive
        self.per_example = PerExampleGradients(model)
        self._stack = self.per_example.stack

    def _clipped_sums(self, params: dict, xb: torch.Tensor, yb: torch.Tensor, weight: torch.Tensor,
                      clips: torch.Tensor | None = None, canaries: ExtraRows | None = None):
        """(each client's sum of clipped per-example gradients, per parameter; the per-example losses; with
        ``clips``, each client's own clip, also each client's sums of centred clip bits at the :data:`CLIP_RATIOS`
        (:func:`clip_bit_counts`), else None). On a linear stack without materialising per-example gradients (ghost
        clipping, as opacus does it). ``canaries`` (one client's; :func:`audit_record_rows`): rows joined after the
        lot's, clipped by the same :func:`clip_factor` call and summed with them (not in the clip bits)."""
        terms = self.per_example(params, xb, yb, weight)
        if canaries is not None:
            terms.join(canaries.unsqueeze())
            weight = torch.cat([weight, torch.ones(weight.shape[0], canaries.count, dtype=weight.dtype)], dim=1)
        norms2 = terms.norms2()
        factor = clip_factor(norms2, self.clip if clips is None else clips[:, None]) * weight
        if canaries is not None:
            factor = _canary_factor(factor, canaries.count)
        if clips is None:
            return terms.sums(factor), terms.losses, None
        width = xb.shape[1]
        return terms.sums(factor), terms.losses, clip_bit_counts(norms2[:, :width], clips, weight[:, :width])

    def chunk(self) -> int:
        """Clients per chunk: one batch's per-example gradients (about 1.5 expected batches; for a linear stack,
        only its activations) and four copies of the parameters within the budget."""
        dim = sum(p.numel() for p in self.model.parameters())
        batch = max(1.0, 1.5 * self.schedule.sample_rate * max(self.schedule.size, 1))
        if self._stack is not None:
            width = max((p.shape[0] + p.shape[-1] for p in self.model.parameters() if p.dim() == 2), default=1)
            return max(1, int(self.memory_budget // (4 * (4 * dim + 4 * batch * width))))
        return max(1, int(self.memory_budget // (4 * dim * (batch + 4))))

    def train(self, global_params: np.ndarray, datasets: Sequence[tuple[torch.Tensor, torch.Tensor]],
              generators: Sequence[tuple[torch.Generator, torch.Generator]]) -> Iterator[tuple[int, np.ndarray, dict]]:
        """Yield ``(i, update_i, stats_i)`` for every client: its model after ``schedule.steps`` DP-SGD steps minus
        ``global_params`` (float64, as ``dpsgd_fedavg`` computes it) and ``{"train_loss", "dpsgd_steps"}``.
        ``generators[i]`` is client i's (noise, sampling) generator pair, created in that order."""
        for i, final, stats in self.train_models(global_params, datasets, generators):
            yield i, np.subtract(final, global_params, dtype=np.float64), stats

    def train_models(self, global_params: np.ndarray, datasets: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     generators: Sequence[tuple[torch.Generator, torch.Generator]], *,
                     before_step: Callable | None = None, extra_gradient: Callable | None = None,
                     clips: Sequence[float] | None = None) -> Iterator[tuple[int, np.ndarray, dict]]:
        """Yield ``(i, model_i, stats_i)``: client i's trained parameters (a float32 row) and its statistics.

        With ``adaptive`` clipping client i trains at ``clips[i]`` (default the run's clip; the round's broadcast
        clip) and each step also draws the noisy sums of its lot's centred clip bits at the :data:`CLIP_RATIOS`
        (:class:`AdaptiveClip`: noise std s_b z / sqrt(share), s_b = sqrt(K) / 2, inside the step's event); its stats
        carry their round's totals over its public count of expected terms (steps x expected batch),
        ``"clip_fractions"``: a float64 vector, what :meth:`AdaptiveClip.round_clip` reads.

        The hooks are ``dpsgd_train``'s, for a chunk at once: ``before_step(members, epoch, step, params)`` runs after
        the step's Poisson batches are drawn and before its gradients, at the stacked parameters (``members``: the
        chunk's indices into ``datasets``); it draws any randomness of its own and never sees the batches.
        ``extra_gradient(members, params, grads)`` adds a data-independent term to the noised, scaled gradients in
        place before the update. Inside :func:`audit_record_rows` (one client) its canary rows join the lot's rows
        before the clip."""
        start32 = torch.as_tensor(global_params, dtype=torch.float32)
        step = self.chunk()
        for lo in range(0, len(datasets), step):
            members = list(range(lo, min(lo + step, len(datasets))))
            final, stats = self._train_chunk(start32, [datasets[i] for i in members], [generators[i] for i in members],
                                             members, before_step, extra_gradient,
                                             None if clips is None else [clips[i] for i in members])
            rows = final.numpy()
            for row, i in enumerate(members):
                yield i, rows[row], stats[row]

    def _train_chunk(self, start32, datasets, generators, members=None, before_step=None, extra_gradient=None,
                     clips=None):
        c = len(datasets)
        adaptive = self.adaptive
        if adaptive is not None:  # the round's clip; the counts at its thresholds summed over the round, with noise
            clip_now = torch.tensor([self.clip] * c if clips is None else list(clips), dtype=torch.float32)
            z_grad, z_count = adaptive.multipliers(self.z)
            count_std = 0.5 * math.sqrt(len(CLIP_RATIOS)) * z_count
            counted = np.zeros((c, len(CLIP_RATIOS)))
            terms = [0.0] * c
        shapes = [p.shape for _, p in self.model.named_parameters()]
        dim = sum(shape.numel() for shape in shapes)
        flat = start32.unsqueeze(0).repeat(c, 1)
        params, offset = {}, 0
        for name, shape in zip(self.names, shapes):
            params[name] = flat[:, offset:offset + shape.numel()].view(c, *shape)
            offset += shape.numel()
        sched = self.schedule
        expected = sched.expected_batch if sched.size else None
        q = sched.sample_rate
        buf: dict[str, torch.Tensor] | None = None
        loss_total, seen = [0.0] * c, [0] * c
        steps = 0
        for epoch in range(sched.epochs):
            for step in range(sched.steps_per_epoch):
                idx = [poisson_lot(q, len(x), gen[1]) for (x, _), gen in zip(datasets, generators)]
                if before_step is not None:
                    before_step(members, epoch, step, params)
                width = max(len(i) for i in idx)
                grads = {k: torch.zeros_like(v) for k, v in params.items()}
                counts = torch.zeros(c, len(CLIP_RATIOS))
                # audit-run's canary rows, clipped with the lot's rows (at the step's clip) before the noise
                canaries = _audit_rows(steps, c, dim, self.clip if adaptive is None else float(clip_now[0]))
                if width or canaries is not None:
                    feats = datasets[0][0].shape[1:]
                    padded = max(width, 1)  # an empty lot with canaries: one zero-weight row
                    xb = torch.zeros(c, padded, *feats, dtype=datasets[0][0].dtype)
                    yb = torch.zeros(c, padded, dtype=datasets[0][1].dtype)
                    weight = torch.zeros(c, padded)
                    for r, ((x, y), i) in enumerate(zip(datasets, idx)):
                        xb[r, :len(i)], yb[r, :len(i)], weight[r, :len(i)] = x[i], y[i], 1.0
                    sums, losses, bits = self._clipped_sums(params, xb, yb, weight,
                                                            None if adaptive is None else clip_now, canaries)
                    for k, g in sums.items():
                        grads[k] = g
                    if bits is not None:
                        counts = bits
                    for r, i in enumerate(idx):
                        loss_total[r] += float((losses[r] * weight[r]).sum())
                        seen[r] += len(i)
                for r, (x, _) in enumerate(datasets):  # each client's noise, parameter by parameter, as opacus draws
                    batch = expected if expected is not None else q * len(x)
                    if adaptive is None:
                        for k in self.names:
                            grads[k][r] = noised_mean(grads[k][r], std=self.z * self.clip, expected_batch=batch,
                                                      generator=generators[r][0], secure=self.secure_noise)
                        continue
                    clip_r = float(clip_now[r])
                    for k in self.names:
                        grads[k][r] = noised_mean(grads[k][r], std=z_grad * clip_r, expected_batch=batch,
                                                  generator=generators[r][0], secure=self.secure_noise)
                    counted[r] += counts[r].double().numpy() + step_noise(
                        (len(CLIP_RATIOS),), count_std, generators[r][0], self.secure_noise, torch.float64).numpy()
                    terms[r] += batch
                if extra_gradient is not None:
                    extra_gradient(members, params, grads)
                buf = sgd_step(params, grads, buf, lr=self.lr, momentum=self.momentum)
                steps += 1
        stats = [{"train_loss": loss_total[r] / max(seen[r], 1), "dpsgd_steps": float(steps)} for r in range(c)]
        if adaptive is not None:
            for r in range(c):
                stats[r]["clip_fractions"] = counted[r] / max(terms[r], 1e-12)
        return flat, stats


class DPSGD:
    """The DP-SGD engine of a round's clients that share one schedule: each trains ``schedule.steps`` steps from the
    broadcast parameters, every step :func:`poisson_lot`, clipping, :func:`noised_mean` and the optimizer's update.

    ``vectorised``: the clients train together (:class:`VectorisedDPSGD`: a model of stateless layers, the default
    loss and SGD); otherwise one after another (:func:`dpsgd_train`: any layer opacus can clip, the user's loss and
    optimizer). Either way client i's draws come from ``rngs[i]`` in one order (the noise generator, then the
    sampling generator), so both give the same models to float tolerance.
    """

    def __init__(self, model: nn.Module, schedule: DPSGDSchedule, *, noise_multiplier: float, clip: float, lr: float,
                 momentum: float, secure_noise: bool, loss=None, optimizer=None, algorithm: str = "dpsgd_fedavg",
                 adaptive: AdaptiveClip | None = None):
        self.model, self.schedule = model, schedule
        self.z, self.clip, self.lr, self.momentum = float(noise_multiplier), float(clip), float(lr), float(momentum)
        self.secure_noise = bool(secure_noise)
        self.loss, self.optimizer, self.algorithm = loss, optimizer, algorithm
        self.adaptive = adaptive

    def train(self, start: np.ndarray, datasets: Sequence[tuple[torch.Tensor, torch.Tensor]],
              rngs: Sequence[np.random.Generator], *, vectorised: bool, torch_seeds: Sequence[int] | None = None,
              before_step=None, extra_gradient=None, clips: Sequence[float] | None = None
              ) -> Iterator[tuple[int, np.ndarray, dict]]:
        """Yield ``(i, params_i, stats_i)`` for every client: its parameters after training (a float32 row) and
        ``{"train_loss", "dpsgd_steps"}``.

        ``before_step`` and ``extra_gradient``: hooks with the executors' two forms (e.g.
        ``privfl.training.posterior.StepFisher`` and ``GaussianPriorGradient``). ``before_step.on_model(i, model,
        epoch, step)`` or ``.on_stack(members, epoch, step, params)`` runs at the parameters each step starts from
        and never sees the step's lot (:func:`dpsgd_train`); ``extra_gradient.on_model(i, model)`` or
        ``.on_stack(members, params, grads)`` adds a data-independent term after the noise (post-processing).
        ``torch_seeds[i]``: torch's global seed as client i's training starts one after another (its layers' own
        randomness; a vectorised model has none), in a seeded run; with secure noise that seed is the OS CSPRNG's
        (a layer's draws go to records by position, so they must be secret: ``privfl.core.public.secret_seed``). ``clips[i]``: with ``adaptive`` clipping, client i's clip as its
        training starts (default the run's); its stats then carry the clip it ended at (``"clip"``). Adaptive
        clipping runs on the vectorised executor only (the per-client one clips inside opacus at one bound)."""
        if self.adaptive is not None and not vectorised:
            raise ConfigurationError(f"{self.algorithm}: adaptive clipping needs the vectorised DP-SGD executor (a "
                                     "model of stateless layers, the default loss and SGD); give a number for clip")
        if vectorised:
            secure = self.secure_noise
            generators = [(private_torch_generator(r, secure), private_torch_generator(r, secure)) for r in rngs]
            executor = VectorisedDPSGD(self.model, schedule=self.schedule, noise_multiplier=self.z, clip=self.clip,
                                       lr=self.lr, momentum=self.momentum, secure_noise=secure, adaptive=self.adaptive)
            yield from executor.train_models(
                start, datasets, generators, before_step=None if before_step is None else before_step.on_stack,
                extra_gradient=None if extra_gradient is None else extra_gradient.on_stack, clips=clips)
            return
        for i, ((x, y), rng) in enumerate(zip(datasets, rngs)):
            local = copy.deepcopy(self.model)
            load_flat_parameters(local, np.asarray(start, dtype=np.float32))
            if self.secure_noise:  # the layers' own draws (dropout, ...) go to records by position: secret
                torch.manual_seed(secrets.randbits(63))
            elif torch_seeds is not None:
                torch.manual_seed(torch_seeds[i])
            before = None if before_step is None else functools.partial(before_step.on_model, i, local)
            extra = None if extra_gradient is None else functools.partial(extra_gradient.on_model, i, local)
            stats = dpsgd_train(local, x, y, self.schedule, noise_multiplier=self.z, clip=self.clip, lr=self.lr,
                                momentum=self.momentum, rng=rng, secure_noise=self.secure_noise, loss=self.loss,
                                optimizer=self.optimizer, algorithm=self.algorithm, before_step=before,
                                extra_gradient=extra)
            yield i, flat_parameters(local), stats


class DPSGDLots:
    """DP-SGD's lot source for a training loop of an algorithm's own (``privfl.training.distill``: HBFL's meme), for
    clients of ``sizes`` records sharing ``schedule``: each step's Poisson lots (:func:`poisson_lot`, from each
    client's sampling generator) and ``privatise(r, rows)``, client r's per-example gradient rows clipped, summed,
    noised and divided by the public expected batch (:func:`privatise_gradient_sum`, from its noise generator). Each
    client's generators come from ``rngs[r]`` in :func:`dpsgd_train`'s order (noise, then sampling); the entropy-like
    terms of the loop divide by the public size (``reg_size``), never the private n_k. Inside
    :func:`audit_record_rows` (one client) its canary rows join the lot's rows before the clip."""

    per_example = True

    def __init__(self, schedule: DPSGDSchedule, *, noise_multiplier: float, clip: float, secure_noise: bool,
                 rngs: Sequence[np.random.Generator], sizes: Sequence[int]):
        self.schedule, self.z, self.clip, self.secure = schedule, float(noise_multiplier), float(clip), secure_noise
        self.sizes = [int(n) for n in sizes]
        self.noise, self.coins = [], []
        for rng in rngs:
            self.noise.append(private_torch_generator(rng, secure_noise))
            self.coins.append(private_torch_generator(rng, secure_noise))
        self.reg_size = schedule.size
        self.step = -1

    def __iter__(self) -> Iterator[list[np.ndarray]]:
        q = self.schedule.sample_rate
        for self.step in range(self.schedule.steps):
            yield [poisson_lot(q, n, coin).numpy() for coin, n in zip(self.coins, self.sizes)]

    def privatise(self, r: int, rows: torch.Tensor) -> torch.Tensor:
        # audit-run's canary rows, clipped with the lot's
        canaries = _audit_rows(self.step, len(self.sizes), rows.shape[1], self.clip, rows.dtype)
        summed = clipped_gradient_sum(rows, rows.shape[1], self.clip, extra=canaries)
        return noised_mean(summed, std=self.z * self.clip, expected_batch=self.schedule.expected_batch,
                           generator=self.noise[r], secure=self.secure)


class DPSGDLoop:
    """DP-SGD around an algorithm's own training loop, at record level: each client's schedule
    (:func:`dpsgd_schedule`), its noise multiplier calibrated to the run's target (:func:`calibrate_dpsgd`, cached
    per schedule), the lot source of clients that share a schedule (:class:`DPSGDLots`), and the events the loop's
    outputs carry: the channels ``trained`` charge the training's per-round event, the others (computed from the same
    trained model) nothing more. Its client-level and non-private counterpart is
    ``privfl.training.distill.MiniBatchLoop``; an algorithm declares both and ``privfl.privacy.units.at_unit``
    picks."""

    per_example = True

    def __init__(self, alg):
        self.alg = alg
        self.accountant = check_dpsgd_privacy(alg.privacy, alg.name)
        self._z: dict[DPSGDSchedule, float] = {}

    def key(self, client: int, n: int) -> DPSGDSchedule:
        """What clients must share to train together: the schedule."""
        return dpsgd_schedule(self.alg, client)

    def batch_width(self, key: DPSGDSchedule) -> float:
        """About 1.5 expected lots: what a chunk's per-example gradients are sized for."""
        return max(1.0, 1.5 * key.sample_rate * max(key.size, 1))

    def noise_multiplier(self, schedule: DPSGDSchedule) -> float:
        if schedule not in self._z:
            p = self.alg.privacy
            self._z[schedule] = calibrate_dpsgd(p.epsilon, p.delta, self.alg.fed.rounds, schedule, self.accountant)
        return self._z[schedule]

    def lots(self, key: DPSGDSchedule, rngs, sizes) -> DPSGDLots:
        p = self.alg.privacy
        return DPSGDLots(key, noise_multiplier=self.noise_multiplier(key), clip=p.clip, secure_noise=p.secure_noise,
                         rngs=rngs, sizes=sizes)

    def events(self, client: int, channels: Sequence[str], trained: Sequence[str]) -> dict:
        schedule = dpsgd_schedule(self.alg, client)
        event = schedule.round_event(self.noise_multiplier(schedule))
        return {name: event if name in trained else NoOpEvent() for name in channels}

    def released(self, client: int, values: dict, trained: Sequence[str]) -> dict:
        """``values`` as post-processing of the client's DP-SGD training (:class:`PrivatizedValue` with its event)."""
        events = self.events(client, list(values), trained)
        return {name: PrivatizedValue(v, events[name]) for name, v in values.items()}


def dpsgd_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, clip: float, noise_multiplier: float,
                    expected_batch: float, generator: torch.Generator, secure: bool) -> None:
    """One DP-SGD gradient of the mean cross-entropy into ``p.grad``: per-example gradients
    (``privfl.training.fisher.per_example_gradients``; a Bayesian layer draws its noise per example) privatised by
    :func:`privatise_gradient_sum`."""
    rows = per_example_gradients(model, x, y, randomness="different")
    add_flat_gradient(model, privatise_gradient_sum(rows, rows.shape[1], clip=clip, noise_multiplier=noise_multiplier,
                                                    expected_batch=expected_batch, generator=generator,
                                                    secure=secure))


__all__ = ["AdaptiveClip", "CLIP_RATIOS", "DPSGD", "DPSGDLoop", "DPSGDLots", "DPSGDSchedule", "SAMPLED_ACCOUNTANTS",
           "VectorisedDPSGD", "audit_clip_fault", "audit_noise_fault", "audit_record_rows", "calibrate_dpsgd",
           "canary_clip_off", "check_class_weights", "check_dpsgd_privacy", "check_opacus_model", "check_user_loss",
           "check_per_example_model",
           "class_sampling_rates", "clip_bit_counts", "clip_bits", "clip_factor", "clipped_gradient_sum",
           "dpsgd_gradients", "dpsgd_schedule", "dpsgd_train", "loss_class_weight", "noised_mean",
           "other_round_events", "poisson_lot", "privatise_gradient_sum", "secure_gaussian", "step_noise"]
