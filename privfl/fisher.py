"""Per-example empirical Fisher diagonal: sum_i c_i^2 (grad l_i) (.) (grad l_i), with optional per-example clipping.

FOLA (eqs. 21-22) needs the coordinate-wise squares of *per-example* gradients; under example-level DP each example's
gradient is first clipped to norm C (c_i = min(1, C / ||grad l_i||)), so one record moves the sum by at most C^2.
Everything here is computed from what backpropagation already has -- each layer's input a_i and output gradient g_i --
without building a (batch x parameters) tensor where the layer allows it:

- ``nn.Linear`` with one input vector per example: the weight gradient of example i is the rank-one g_i a_i^T, so
  ``||grad_i||^2 = ||g_i||^2 ||a_i||^2`` (the ghost norm) and
  ``sum_i c_i^2 (g_i a_i^T)^2 = (c^2 (.) g^2)^T (a^2)``, one matmul the size of the layer's own weight gradient.
- ``nn.Conv2d`` (groups = 1): a weight gradient sums over positions, so it is not rank one and its square does not
  factorise; per-example gradients are built for that one layer from the unfolded input, then squared and summed.
- Any other layer with parameters: :func:`per_example_fisher` falls back to ``torch.func`` (vmap of grad), which
  builds every per-example gradient; :class:`GradientRecorder` refuses such models with a clear error.

:class:`GradientRecorder` hooks a model so a training step's own backward pass yields the Fisher term for free (the
online accumulation of eq. 22). :class:`FisherAccumulator` sums those terms over local steps and caps how often one
record may contribute, which is what bounds the sensitivity of the accumulated sum (see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from privfl.errors import ConfigurationError

#: layers whose per-example gradients the hooks can reconstruct
SUPPORTED_LAYERS = (nn.Linear, nn.Conv2d)
#: added to a norm before dividing, as opacus does, so a clipped term never exceeds the bound by rounding
_NORM_EPS = 1e-6

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _per_example_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, y, reduction="none")


def clip_factors(norms: torch.Tensor, clip: float | None) -> torch.Tensor:
    """c_i = min(1, C / (||g_i|| + 1e-6)); ones when ``clip`` is None. ||c_i g_i|| <= C always holds."""
    if clip is None:
        return torch.ones_like(norms)
    return (clip / (norms + _NORM_EPS)).clamp(max=1.0)


def _supported(module: nn.Module) -> bool:
    if isinstance(module, nn.Conv2d):
        return module.groups == 1 and module.padding_mode == "zeros" and not isinstance(module.padding, str)
    return isinstance(module, nn.Linear)


def unsupported_parameters(model: nn.Module) -> list[str]:
    """Names of parameters that the hooks cannot handle (they live in layers other than Linear / plain Conv2d)."""
    covered = set()
    for m in model.modules():
        if _supported(m):
            covered.update(id(p) for p in m.parameters(recurse=False))
    return [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in covered]


class _Layer:
    """One hooked layer: what its forward saw and what its backward sent back (the last backward wins)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.inputs: torch.Tensor | None = None
        self.grads: torch.Tensor | None = None

    def forward_hook(self, module, inputs, output):
        if not torch.is_grad_enabled():
            return
        self.inputs = inputs[0].detach()
        self.grads = None
        if output.requires_grad:
            output.register_hook(self._grad_hook)

    def _grad_hook(self, grad):
        self.grads = grad.detach()

    def ready(self) -> bool:
        return self.inputs is not None and self.grads is not None

    def _conv_per_example(self, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        m: nn.Conv2d = self.module
        cols = nn.functional.unfold(self.inputs, m.kernel_size, dilation=m.dilation, padding=m.padding,
                                    stride=m.stride)  # (B, Cin*k*k, P)
        g = self.grads.reshape(self.grads.shape[0], self.grads.shape[1], -1) * scale  # (B, Cout, P)
        weight = torch.einsum("bop,bip->boi", g, cols)
        bias = g.sum(dim=2) if m.bias is not None else None
        return weight, bias

    def squared_norms(self, scale: float) -> torch.Tensor:
        """||grad_i||^2 of this layer's parameters, per example."""
        if isinstance(self.module, nn.Linear):
            a, g = self.inputs, self.grads * scale
            if a.dim() != 2:
                raise ConfigurationError(f"{type(self.module).__name__} saw inputs of shape {tuple(a.shape)}; the "
                                         "per-example Fisher needs one input vector per example")
            g2 = g.pow(2).sum(dim=1)
            out = g2 * a.pow(2).sum(dim=1)
            return out + g2 if self.module.bias is not None else out
        weight, bias = self._conv_per_example(scale)
        out = weight.pow(2).flatten(1).sum(dim=1)
        return out if bias is None else out + bias.pow(2).sum(dim=1)

    def weighted_squares(self, weights: torch.Tensor, scale: float) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """sum_i w_i (grad_i)^2 for this layer's weight (and bias)."""
        m = self.module
        w = weights.to(self.grads.dtype)
        if isinstance(m, nn.Linear):
            g2 = (self.grads * scale).pow(2)
            wg2 = g2 * w[:, None]
            out = [(m.weight, wg2.t().mm(self.inputs.pow(2)))]
            if m.bias is not None:
                out.append((m.bias, wg2.sum(dim=0)))
            return out
        weight, bias = self._conv_per_example(scale)
        out = [(m.weight, torch.einsum("b,boi->oi", w, weight.pow(2)).reshape(m.weight.shape))]
        if bias is not None:
            out.append((m.bias, w @ bias.pow(2)))
        return out


@dataclass(frozen=True)
class BatchFisher:
    """One batch's per-example Fisher term: ``squared`` = sum_i w_i c_i^2 (grad l_i)^2 as a flat vector in
    ``model.parameters()`` order; ``norms`` = ||grad l_i|| before clipping; ``weights`` = w_i c_i^2 actually used."""

    squared: torch.Tensor
    norms: torch.Tensor
    weights: torch.Tensor


class GradientRecorder:
    """Hooks on every Linear / Conv2d of ``model`` that keep the layer's input and output gradient of the last
    backward pass, so the per-example Fisher of that pass can be computed afterwards (a context manager).

    ``scale`` in :meth:`batch_fisher` turns the recorded output gradients into per-example *loss* gradients: the batch
    size for a mean-reduced loss, 1 for a sum. The recorded tensors are references that autograd keeps anyway.
    """

    def __init__(self, model: nn.Module):
        bad = unsupported_parameters(model)
        if bad:
            raise ConfigurationError(f"the per-example Fisher hooks handle Linear and Conv2d (groups=1) layers only; "
                                     f"parameters {bad} live elsewhere (use per_example_fisher(..., method='func'))")
        self.model = model
        self.layers = [_Layer(m) for m in model.modules() if _supported(m) and any(True for _ in m.parameters())]
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._slots = {id(p): i for i, p in enumerate(self._params)}
        self._handles: list = []

    def __enter__(self) -> "GradientRecorder":
        if self._handles:
            raise ConfigurationError("this GradientRecorder is already attached")
        self._handles = [layer.module.register_forward_hook(layer.forward_hook) for layer in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for layer in self.layers:
            layer.inputs = layer.grads = None

    def _check_ready(self) -> None:
        missing = [type(layer.module).__name__ for layer in self.layers if not layer.ready()]
        if missing:
            raise ConfigurationError(f"no recorded backward pass for {missing}; run forward and backward inside the "
                                     "recorder's `with` block first")

    def per_example_norms(self, scale: float = 1.0) -> torch.Tensor:
        """||grad l_i|| over all parameters, per example, without building per-example gradients of Linear layers."""
        self._check_ready()
        return torch.stack([layer.squared_norms(scale) for layer in self.layers]).sum(dim=0).sqrt()

    def batch_fisher(self, clip: float | None = None, *, scale: float = 1.0,
                     weights: torch.Tensor | None = None) -> BatchFisher:
        """sum_i w_i c_i^2 (grad l_i)^2 of the recorded pass; ``weights`` w_i default to 1 (0 drops an example)."""
        norms = self.per_example_norms(scale)
        w = clip_factors(norms, clip).pow(2)
        if weights is not None:
            w = w * weights.to(w.dtype)
        flat = [torch.zeros_like(p).reshape(-1) for p in self._params]
        for layer in self.layers:
            for p, sq in layer.weighted_squares(w, scale):
                flat[self._slots[id(p)]] = sq.reshape(-1)
        return BatchFisher(torch.cat(flat), norms, w)


def _fisher_hooks(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float | None, loss_fn: LossFn,
                  weights: torch.Tensor | None) -> BatchFisher:
    params = [p for p in model.parameters() if p.requires_grad]
    with GradientRecorder(model) as rec, torch.enable_grad():
        loss = loss_fn(model(x), y).sum()
        torch.autograd.grad(loss, params)
        return rec.batch_fisher(clip, weights=weights)


def per_example_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                          loss_fn: LossFn = _per_example_loss) -> torch.Tensor:
    """Every example's loss gradient, (batch, parameters) in ``model.parameters()`` order, by ``torch.func`` (vmap of
    grad). It builds the full per-example gradients: the reference, and the fallback for unsupported layers."""
    from torch.func import functional_call, grad, vmap

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def loss_one(p, xi, yi):
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0)).sum()

    grads = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([grads[n].reshape(len(x), -1) for n in names], dim=1)


def _fisher_func(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float | None, loss_fn: LossFn,
                 weights: torch.Tensor | None) -> BatchFisher:
    g = per_example_gradients(model, x, y, loss_fn)
    norms = g.norm(dim=1)
    w = clip_factors(norms, clip).pow(2)
    if weights is not None:
        w = w * weights.to(w.dtype)
    return BatchFisher((w[:, None] * g.pow(2)).sum(dim=0), norms, w)


def per_example_fisher(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, clip: float | None = None,
                       loss_fn: LossFn = _per_example_loss, method: str = "auto",
                       weights: torch.Tensor | None = None) -> BatchFisher:
    """sum_i w_i c_i^2 (grad l_i)^2 over the batch (x, y), flat in ``model.parameters()`` order (w_i = 1 by default).

    ``loss_fn(logits, y)`` returns per-example losses (default: cross-entropy). ``clip``: per-example gradient norm
    bound C (None: no clipping). ``method``: ``"hooks"`` (no per-example gradients for Linear layers), ``"func"``
    (torch.func reference) or ``"auto"`` (hooks when every parameter lives in a supported layer).
    """
    if method not in ("auto", "hooks", "func"):
        raise ConfigurationError(f"method must be 'auto', 'hooks' or 'func', got {method!r}")
    if method == "auto":
        method = "func" if unsupported_parameters(model) else "hooks"
    if method == "hooks":
        return _fisher_hooks(model, x, y, clip, loss_fn, weights)
    return _fisher_func(model, x, y, clip, loss_fn, weights)


class FisherAccumulator:
    """The online sum of eq. 22 over local steps: sum over steps t and examples i in batch t of c_i^2 (grad l_i)^2.

    Sensitivity. Each term has L2 norm <= ||c_i grad l_i||^2 <= C^2 (since ||v (.) v||_2 <= ||v||_2^2). A record that
    contributes k times moves the sum by at most k C^2 under add/remove: removing it removes its own terms, and (given
    the trajectory, which DP-SGD makes private) changes no other record's terms. With shuffled batches a record is
    seen once per epoch, so k = epochs; with Poisson sampling (DP-SGD) k is random and unbounded, so each record is
    *capped* at ``max_visits`` contributions (later ones get weight 0). :meth:`per_visit` divides by ``max_visits``,
    so one record moves it by at most C^2: that is the value a ``PreClipped(C, "squared_sum")`` channel may carry.
    """

    def __init__(self, num_parameters: int, num_records: int, *, clip: float | None = None,
                 max_visits: int | None = None, dtype: torch.dtype = torch.float32):
        if clip is not None and not (np.isfinite(clip) and clip > 0):
            raise ConfigurationError(f"clip must be a finite number > 0 or None, got {clip!r}")
        if max_visits is not None and (isinstance(max_visits, bool) or not isinstance(max_visits, int)
                                       or max_visits < 1):
            raise ConfigurationError(f"max_visits must be an integer >= 1 or None, got {max_visits!r}")
        self.clip = clip
        self.max_visits = max_visits
        self.total = torch.zeros(int(num_parameters), dtype=dtype)
        self.visits = np.zeros(int(num_records), dtype=np.int64)
        self.steps = 0

    def admit(self, record_ids: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Weights (1 or 0) of a batch's records under the visit cap, and count the admitted visits."""
        ids = np.asarray(record_ids, dtype=np.int64).reshape(-1)
        keep = np.ones(len(ids), dtype=bool)
        if self.max_visits is not None:
            seen: dict[int, int] = {}
            for j, rid in enumerate(ids.tolist()):
                k = seen.get(rid, 0)
                keep[j] = self.visits[rid] + k < self.max_visits
                seen[rid] = k + 1
        np.add.at(self.visits, ids[keep], 1)
        return torch.from_numpy(keep.astype(np.float32))

    def add_recorded(self, recorder: GradientRecorder, record_ids, *, scale: float = 1.0) -> BatchFisher:
        """Add the recorder's last backward pass (examples ``record_ids``, in batch order)."""
        batch = recorder.batch_fisher(self.clip, scale=scale, weights=self.admit(record_ids))
        self.total += batch.squared.to(self.total.dtype)
        self.steps += 1
        return batch

    def add(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, record_ids, *,
            loss_fn: LossFn = _per_example_loss) -> BatchFisher:
        """Run a Fisher pass on (x, y) at the model's current parameters and add it (without training)."""
        batch = per_example_fisher(model, x, y, clip=self.clip, loss_fn=loss_fn, weights=self.admit(record_ids))
        self.total += batch.squared.to(self.total.dtype)
        self.steps += 1
        return batch

    def per_visit(self) -> torch.Tensor:
        """``total / max_visits``: one record moves it by at most C^2 (with a clip and a cap)."""
        return self.total / (self.max_visits or 1)

    def record_bound(self) -> float:
        """The L2 bound on one record's contribution to :meth:`per_visit` (C^2), inf without clip or cap."""
        if self.clip is None or self.max_visits is None:
            return float("inf")
        return self.clip ** 2


__all__ = ["BatchFisher", "FisherAccumulator", "GradientRecorder", "SUPPORTED_LAYERS", "clip_factors",
           "per_example_fisher", "per_example_gradients", "unsupported_parameters"]
