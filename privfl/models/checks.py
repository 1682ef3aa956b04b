"""Probes of a user's model that privacy analyses rely on, run on public inputs only (never a client's records), so
what they decide is a public fact about the model's structure.

- :func:`mixes_examples`: whether one example's output depends on the other examples of its batch (batch statistics,
  ``x - x.mean(0)``, ...). FedBNR's extractor check (``privfl.models.features.check_extractor``, eval mode) and the
  DP-SGD model check (``privfl.privacy.record_level.check_opacus_model``, train mode) both use it: a sum of
  per-record terms, clipped one record at a time, bounds one record's influence only when each term is a function of
  that record alone.
"""

from __future__ import annotations

import torch
from torch import nn


def module_dtype(module: nn.Module, default: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype a module computes in: its first floating parameter's or buffer's (``default`` without any)."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return default


def output_tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance of the probes' comparisons of outputs computed in ``dtype``."""
    return 1e-9 if dtype == torch.float64 else 1e-4


def mixes_examples(module: nn.Module, batch: torch.Tensor, other: torch.Tensor, *, seed: int = 0) -> bool:
    """Whether ``module`` mixes the examples of a batch: True when its output for a row moved although that row's
    input did not.

    ``module`` runs (in its current mode: eval for a feature map, train for DP-SGD's forward) on ``batch`` and on
    ``other``, a batch with some rows changed or left out; the rows ``i < min(len(batch), len(other))`` whose inputs
    agree in both are compared, to :func:`output_tolerance` of the output's dtype relative to the largest output.
    Both calls run without gradients under a forked torch random state seeded with ``seed`` alike, so a layer that
    samples (dropout) draws the same for both batches of one shape. Exceptions of the module's forward propagate (the
    caller says what it was fed)."""
    rows = min(len(batch), len(other))
    same = (batch[:rows] == other[:rows]).reshape(rows, -1).all(1)
    outs = []
    for x in (batch, other):
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            outs.append(module(x))
    first, again = (o[:rows][same].reshape(int(same.sum()), -1) for o in outs)
    if not first.numel():
        return False
    finite = first[torch.isfinite(first)]
    scale = output_tolerance(first.dtype) * (1.0 + (float(finite.abs().max()) if finite.numel() else 0.0))
    kept = ((first - again).abs() <= scale) | (first == again) | (first.isnan() & again.isnan())
    return not bool(kept.all())


__all__ = ["mixes_examples", "module_dtype", "output_tolerance"]
