"""Local training that also reads a diagonal Fisher, in the two forms of privfl's executors (one client's model, or
a chunk of clients' stacked parameters): what a Laplace-style posterior (FOLA) needs from a client's training.

- :func:`online_fisher_sgd`: mini-batch SGD on the task loss plus a diagonal Gaussian prior term, with the Fisher of
  the task loss read off each step's own per-example gradients (unclipped). Its vectorised form is
  :class:`privfl.training.stacked.VectorisedOnlineFisher`; both draw a client's shuffles from its own generator in the
  same order, so they give the same result to float tolerance.
- :class:`StepFisher`: a Fisher pass at the start of every step of another training loop (a DP-SGD run, whose lots
  it never sees), per-example gradients clipped to C and squared, each record visited once per epoch at a step of
  the epoch it picks from the client's own generator, visits capped (:class:`~privfl.training.fisher.FisherAccumulator`).
  ``on_model`` is the pass on one client's model (the per-client executor); ``on_stack`` on a chunk's stacked
  parameters (the vectorised one); both give the same sums to float tolerance.
- :class:`GaussianPriorGradient`: the gradient of ``weight`` / 2 sum_j precision_j (theta_j - mean_j)^2, added to a
  step's gradients in either form.

Nothing here decides privacy: which loop these hooks run inside (DP-SGD or not) and what a client releases of their
sums are the caller's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from privfl.training.fisher import FisherAccumulator, GradientRecorder, LossFn, clip_factors
from privfl.training.local import batches
from privfl.training.stacked import PerExampleGradients, unflatten


def parameter_views(vector: np.ndarray, model: nn.Module) -> list[torch.Tensor]:
    """A flat vector as tensors shaped like ``model``'s parameters, in their order."""
    out, offset = [], 0
    for p in model.parameters():
        n = p.numel()
        out.append(torch.as_tensor(vector[offset:offset + n], dtype=p.dtype).reshape(p.shape))
        offset += n
    return out


def named_views(vector: np.ndarray, model: nn.Module) -> dict[str, torch.Tensor]:
    """A flat vector as float32 views named and shaped like ``model``'s parameters (the stacked executors' form)."""
    named = list(model.named_parameters())
    return unflatten(torch.as_tensor(vector, dtype=torch.float32), [n for n, _ in named], [p.shape for _, p in named])


def online_fisher_sgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, prior_mean: np.ndarray,
                      prior_precision: np.ndarray, prior_weight: float, epochs: int, batch_size: int, lr: float,
                      momentum: float, rng: np.random.Generator, loss_fn: LossFn) -> tuple[float, torch.Tensor]:
    """Train ``model`` in place: ``epochs`` passes of shuffled mini-batch SGD on the mean per-example loss plus
    ``prior_weight`` / 2 sum_j ``prior_precision``_j (theta_j - ``prior_mean``_j)^2. Returns the mean task loss and
    the Fisher of the task loss summed over the steps' per-example gradients, divided by ``epochs`` (each record is
    visited once per epoch)."""
    dim = sum(p.numel() for p in model.parameters())
    anchor = parameter_views(prior_mean, model)
    prior = parameter_views(prior_precision, model)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
    fisher = FisherAccumulator(dim, len(x))
    model.train()
    total, seen = 0.0, 0
    with GradientRecorder(model) as rec:
        for _ in range(epochs):
            for idx in batches(len(x), batch_size, rng):
                idx_t = torch.as_tensor(idx)
                opt.zero_grad(set_to_none=True)
                task = loss_fn(model(x[idx_t]), y[idx_t]).mean()
                penalty = sum((lam * (p - m).pow(2)).sum() for p, m, lam in zip(params, anchor, prior))
                (task + prior_weight * 0.5 * penalty).backward()
                fisher.add_recorded(rec, idx, scale=float(len(idx)))  # mean loss: x batch size per example
                opt.step()
                total += float(task.detach()) * len(idx)
                seen += len(idx)
    return total / max(seen, 1), fisher.total / epochs


class StepFisher:
    """The clipped Fisher pass run at the start of every step of a client's training (module docstring), for the
    clients ``data`` (``(x, y)`` each), ``rngs[j]`` client j's generator for the steps its records pick.

    ``dim``: the parameters' count; ``clip``: C; ``epochs`` and ``steps_per_epoch``: the training's schedule;
    ``loss_fn``: the per-example task loss of the model form (the stacked form computes cross-entropy);
    ``per_example``: the stacked form's :class:`~privfl.training.stacked.PerExampleGradients` (None: model form only).
    :meth:`per_visit` gives client j's sum divided by its visit cap, so one record moves it by at most C^2.
    """

    def __init__(self, data: Sequence[tuple[torch.Tensor, torch.Tensor]], rngs: Sequence[np.random.Generator], *,
                 dim: int, clip: float, epochs: int, steps_per_epoch: int, loss_fn: LossFn,
                 per_example: PerExampleGradients | None = None):
        self.data, self.rngs, self.dim, self.clip = data, rngs, int(dim), float(clip)
        self.epochs, self.steps_per_epoch, self.loss_fn = int(epochs), int(steps_per_epoch), loss_fn
        self.per_example = per_example
        self.caps = [FisherAccumulator(0, len(x), clip=clip, max_visits=epochs) for x, _ in data]
        self.sums: dict[int, torch.Tensor] = {}
        self.step_of: list[np.ndarray | None] = [None] * len(data)

    def _records(self, j: int, step: int) -> np.ndarray:
        """The records of client j whose pass is at this step (each picks its step of an epoch at the epoch's start
        on its own: no record moves another)."""
        if step == 0:
            self.step_of[j] = self.rngs[j].integers(0, self.steps_per_epoch, size=len(self.data[j][0]))
        return np.flatnonzero(self.step_of[j] == step)

    def on_model(self, j: int, model: nn.Module, epoch: int, step: int) -> None:
        """The pass on client j's own model, at its current parameters (no training)."""
        ids = self._records(j, step)
        if len(ids) == 0:
            return
        x, y = self.data[j]
        cap = self.caps[j]
        if cap.total.numel() != self.dim:  # the model form sums into the client's own accumulator
            cap.total = torch.zeros(self.dim)
        cap.add(model, x[torch.from_numpy(ids)], y[torch.from_numpy(ids)], ids, loss_fn=self.loss_fn)

    def on_stack(self, members: Sequence[int], epoch: int, step: int, params: dict) -> None:
        """The pass on a chunk's stacked parameters (``members``: the clients of its rows)."""
        ids = [self._records(j, step) for j in members]
        width = max(len(i) for i in ids)
        if width == 0:
            return
        x0, y0 = self.data[members[0]]
        xb = torch.zeros(len(members), width, *x0.shape[1:], dtype=x0.dtype)
        yb = torch.zeros(len(members), width, dtype=y0.dtype)
        weight = torch.zeros(len(members), width)
        for r, (j, i) in enumerate(zip(members, ids)):
            if len(i):
                x, y = self.data[j]
                idx = torch.from_numpy(i)
                xb[r, :len(i)], yb[r, :len(i)] = x[idx], y[idx]
                weight[r, :len(i)] = self.caps[j].admit(i)
        with torch.enable_grad():
            terms = self.per_example(params, xb, yb, weight)
        factor = clip_factors(terms.norms2().sqrt(), self.clip).pow(2) * weight
        rows = terms.flat(terms.square_sums(factor))
        for r, j in enumerate(members):
            self.sums[j] = rows[r] if j not in self.sums else self.sums[j] + rows[r]

    def per_visit(self, j: int) -> torch.Tensor:
        """Client j's Fisher sum divided by its visit cap (forgotten here once read)."""
        total = self.sums.pop(j, None)
        if total is None:
            total = self.caps[j].total if self.caps[j].total.numel() == self.dim else torch.zeros(self.dim)
        return total / self.epochs


class GaussianPriorGradient:
    """Adds the gradient of ``weight`` / 2 sum_j ``precision``_j (theta_j - ``mean``_j)^2 to a step's gradients: on a
    client's model (:meth:`on_model`, to each ``p.grad``) or on a chunk's stacked gradients (:meth:`on_stack`)."""

    def __init__(self, model: nn.Module, mean: np.ndarray, precision: np.ndarray, weight: float):
        self.weight = float(weight)
        self.anchor, self.prior = parameter_views(mean, model), parameter_views(precision, model)
        self.named_anchor, self.named_prior = named_views(mean, model), named_views(precision, model)

    @torch.no_grad()
    def on_model(self, j: int, model: nn.Module) -> None:
        for p, m, lam in zip(model.parameters(), self.anchor, self.prior):
            p.grad.add_(self.weight * lam * (p - m))

    @torch.no_grad()
    def on_stack(self, members: Sequence[int], params: dict, grads: dict) -> None:
        for name in grads:
            grads[name].add_(self.weight * self.named_prior[name] * (params[name] - self.named_anchor[name]))


__all__ = ["GaussianPriorGradient", "StepFisher", "named_views", "online_fisher_sgd", "parameter_views"]
