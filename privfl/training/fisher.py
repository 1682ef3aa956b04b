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

The loss is the task's per-example loss (:func:`per_example_task_loss`: cross-entropy on logits for classification,
the Gaussian likelihood's 0.5 ||y - f(x)||^2 for regression). Nothing above depends on which: the clip acts on each
example's gradient whatever the loss, so the bounds are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from privfl.errors import ConfigurationError, UsageError

#: layers whose per-example gradients the hooks can reconstruct
SUPPORTED_LAYERS = (nn.Linear, nn.Conv2d)
#: added to a norm before dividing, as opacus does, so a clipped term never exceeds the bound by rounding
_NORM_EPS = 1e-6

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _per_example_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, y, reduction="none")


def half_squared_error(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-example Gaussian negative log-likelihood with unit noise variance, up to a constant:
    0.5 ||y_i - f(x_i)||^2 (a scalar target of shape (n,) meets an output of shape (n, 1)). Its per-example gradients
    give the regression Fisher exactly as cross-entropy's give the classification one."""
    if y.shape != outputs.shape and y.numel() == outputs.numel():
        y = y.reshape(outputs.shape)
    return 0.5 * (outputs - y.to(outputs.dtype)).pow(2).reshape(outputs.shape[0], -1).sum(dim=1)


class HalfSquaredError(nn.Module):
    """:func:`half_squared_error` as a criterion with torch's ``reduction`` switch (``"mean"`` over the batch, or
    ``"none"``: one loss per example), so opacus's DP-SGD loss wrapper can ask it for per-example losses."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per = half_squared_error(outputs, y)
        if self.reduction == "none":
            return per
        if self.reduction == "mean":
            return per.mean()
        if self.reduction == "sum":
            return per.sum()
        raise ConfigurationError(f"reduction must be 'mean', 'sum' or 'none', got {self.reduction!r}")


def per_example_task_loss(task: str) -> LossFn:
    """The per-example loss whose gradients make the empirical Fisher: cross-entropy on logits for classification,
    :func:`half_squared_error` (a Gaussian likelihood) for regression."""
    if task == "classification":
        return _per_example_loss
    if task == "regression":
        return half_squared_error
    raise ConfigurationError(f"task must be 'classification' or 'regression', got {task!r}")


def clip_factors(norms: torch.Tensor, clip: float | None) -> torch.Tensor:
    """c_i = min(1, C / (||g_i|| + 1e-6)); ones when ``clip`` is None. ||c_i g_i|| <= C always holds."""
    if clip is None:
        return torch.ones_like(norms)
    return (clip / (norms + _NORM_EPS)).clamp(max=1.0)


def _clipped_weights(norms: torch.Tensor, clip: float | None, weights: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(w_i c_i^2, the examples to drop or None): with a clip, an example whose norm is not finite gets weight 0 and
    is marked, so that its (possibly infinite) squares are zeroed rather than multiplied by 0."""
    w = clip_factors(norms, clip).pow(2)
    drop = None
    if clip is not None:
        bad = ~torch.isfinite(norms)
        if bool(bad.any()):
            drop = bad
            w = torch.where(bad, torch.zeros((), dtype=w.dtype), w)
    if weights is not None:
        w = w * weights.to(w.dtype)
    return w, drop


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


def _layer_names(model: nn.Module, modules) -> str:
    names = [f"{name or '<model>'} ({type(m).__name__})" for name, m in model.named_modules() if m in modules]
    return ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")


def check_fisher_model(model: nn.Module, input_shape: Sequence[int], algorithm: str) -> None:
    """Refuse, before anything trains, a model whose per-example Fisher the hooks (and the vectorised executor's
    per-example terms) cannot compute exactly, naming the offending layers and what is supported: every trainable
    parameter in an ``nn.Linear`` or ``nn.Conv2d`` (groups=1, zero padding given as numbers), no frozen parameters
    (the posterior covers every parameter), no batch normalisation (it mixes the examples of a batch, so one
    example's gradient is not its own), and, on a probe forward pass of two zero examples, every such layer run
    exactly once (no weight sharing) with one input vector per example for ``nn.Linear``."""
    supported = "nn.Linear and nn.Conv2d (groups=1, zero padding given as numbers) layers"
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        raise ConfigurationError(f"{algorithm}: parameters {frozen[:8]} are frozen (requires_grad=False), but the "
                                 "posterior covers every parameter of the model; unfreeze them, or build the model "
                                 "without them")
    unsupported = {m for m in model.modules()
                   if not _supported(m) and any(p.requires_grad for p in m.parameters(recurse=False))}
    if unsupported:
        raise ConfigurationError(f"{algorithm}: the per-example Fisher is computed for {supported} only; the model "
                                 f"has parameters in layers {_layer_names(model, unsupported)}. Build "
                                 "it from supported layers (parameter-free activations, pooling and reshapes are "
                                 "fine), or use an algorithm that trains any model (fedavg, dp_fedavg, dpsgd_fedavg)")
    mixing = {m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    if mixing:
        raise ConfigurationError(f"{algorithm}: batch normalisation ({_layer_names(model, mixing)}) mixes the "
                                 "examples of a batch, so an example's gradient is not its own and the per-example "
                                 "Fisher is undefined; remove it (standardise the inputs instead)")
    layers = [m for m in model.modules() if _supported(m)]
    calls: dict[nn.Module, list[tuple[int, ...]]] = {m: [] for m in layers}
    handles = [m.register_forward_hook(lambda m, inputs, _out: calls[m].append(tuple(inputs[0].shape)))
               for m in layers]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(torch.zeros((2, *input_shape)))
    except Exception as exc:
        raise ConfigurationError(f"{algorithm}: the model failed on an input of shape {(2, *input_shape)}: "
                                 f"{type(exc).__name__}: {exc}") from None
    finally:
        for h in handles:
            h.remove()
    unused = {m for m in layers if not calls[m]}
    if unused:
        raise ConfigurationError(f"{algorithm}: layers {_layer_names(model, unused)} do not take part in the forward "
                                 "pass, so their parameters have no Fisher; remove them from the model")
    shared = {m for m in layers if len(calls[m]) > 1}
    if shared:
        raise ConfigurationError(f"{algorithm}: layers {_layer_names(model, shared)} run more than once per forward "
                                 "pass (shared weights); the per-example Fisher hooks need each layer once: give "
                                 "each use a layer of its own")
    flat = {m for m in layers if isinstance(m, nn.Linear) and len(calls[m][0]) != 2}
    if flat:
        raise ConfigurationError(f"{algorithm}: linear layers {_layer_names(model, flat)} see more than one input "
                                 "vector per example (e.g. a sequence); the per-example Fisher needs one: flatten "
                                 "or pool before them")


class _Layer:
    """One hooked layer: what its forward saw and what its backward sent back (the last backward wins)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.inputs: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.grads: torch.Tensor | None = None
        self._squares: tuple | None = None  # cached per recorded pass and scale

    def forward_hook(self, module, inputs, output):
        if not torch.is_grad_enabled():
            return
        self.inputs = inputs[0].detach()
        self.output = output
        self.grads = None
        self._squares = None
        if output.requires_grad:
            output.register_hook(self._grad_hook)

    def _grad_hook(self, grad):
        self.grads = grad.detach()
        self._squares = None

    def ready(self) -> bool:
        return self.inputs is not None and self.grads is not None

    def squares(self, scale: float) -> tuple:
        """What both the norms and the Fisher need, computed once per pass.

        Linear: (g_i^2, a_i^2, ||g_i||^2 (||a_i||^2 [+ 1 with a bias])). Conv2d: per-example gradients of weight and
        bias, squared, and their squared norms.
        """
        if self._squares is not None and self._squares[0] == scale:
            return self._squares[1]
        m = self.module
        if isinstance(m, nn.Linear):
            if self.inputs.dim() != 2:
                raise ConfigurationError(f"Linear saw inputs of shape {tuple(self.inputs.shape)}; the per-example "
                                         "Fisher needs one input vector per example")
            g2 = (self.grads * scale).pow_(2) if scale != 1.0 else self.grads.pow(2)
            a2 = self.inputs.pow(2)
            g2_sum = g2.sum(dim=1)
            norms = g2_sum * (a2.sum(dim=1) + 1.0) if m.bias is not None else g2_sum * a2.sum(dim=1)
            out = (g2, a2, norms)
        else:
            cols = nn.functional.unfold(self.inputs, m.kernel_size, dilation=m.dilation, padding=m.padding,
                                        stride=m.stride)  # (B, Cin*k*k, P)
            g = self.grads.reshape(self.grads.shape[0], self.grads.shape[1], -1) * scale  # (B, Cout, P)
            w2 = torch.einsum("bop,bip->boi", g, cols).pow_(2)
            b2 = g.sum(dim=2).pow_(2) if m.bias is not None else None
            norms = w2.flatten(1).sum(dim=1) + (b2.sum(dim=1) if b2 is not None else 0.0)
            out = (w2, b2, norms)
        self._squares = (scale, out)
        return out

    def squared_norms(self, scale: float) -> torch.Tensor:
        """||grad_i||^2 of this layer's parameters, per example."""
        return self.squares(scale)[2]

    def accumulate(self, weights: torch.Tensor, scale: float, into: dict[int, torch.Tensor],
                   drop: torch.Tensor | None = None) -> None:
        """Add sum_i w_i (grad_i)^2 of this layer's weight (and bias) into ``into[id(param)]`` in place; the examples
        marked in ``drop`` add exactly zero (their squares may be infinite, and 0 x inf is not 0)."""
        m = self.module
        first, second, _ = self.squares(scale)
        if drop is not None:
            zero = torch.zeros((), dtype=first.dtype)
            first = torch.where(drop.reshape(-1, *([1] * (first.dim() - 1))), zero, first)
            if second is not None:
                second = torch.where(drop.reshape(-1, *([1] * (second.dim() - 1))), zero, second)
        w = weights.to(first.dtype)
        if isinstance(m, nn.Linear):
            wg2 = first * w[:, None]
            into[id(m.weight)].addmm_(wg2.t(), second)  # (c^2 g^2)^T a^2, summed straight into the accumulator
            if m.bias is not None:
                into[id(m.bias)].add_(wg2.sum(dim=0))
            return
        into[id(m.weight)].add_(torch.einsum("b,boi->oi", w, first).reshape(m.weight.shape))
        if second is not None:
            into[id(m.bias)].add_(w @ second)


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
    size for a mean-reduced loss, 1 for a sum. The recorded tensors are references that autograd keeps anyway. Each
    hooked layer must run once per forward pass (no weight sharing), as in privfl's networks.
    """

    def __init__(self, model: nn.Module):
        bad = unsupported_parameters(model)
        if bad:
            raise ConfigurationError(f"the per-example Fisher hooks handle Linear and Conv2d (groups=1) layers only; "
                                     f"parameters {bad} live elsewhere (use per_example_fisher(..., method='func'))")
        self.model = model
        self.layers = [_Layer(m) for m in model.modules() if _supported(m) and any(True for _ in m.parameters())]
        self._params = [p for p in model.parameters() if p.requires_grad]
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
            layer.inputs = layer.output = layer.grads = layer._squares = None

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype (that of every Fisher term)."""
        return self._params[0].dtype if self._params else torch.float32

    def _check_ready(self) -> None:
        missing = [type(layer.module).__name__ for layer in self.layers if not layer.ready()]
        if missing:
            raise ConfigurationError(f"no recorded backward pass for {missing}; run forward and backward inside the "
                                     "recorder's `with` block first")

    def per_example_norms(self, scale: float = 1.0) -> torch.Tensor:
        """||grad l_i|| over all parameters, per example, without building per-example gradients of Linear layers."""
        self._check_ready()
        return torch.stack([layer.squared_norms(scale) for layer in self.layers]).sum(dim=0).sqrt()

    def accumulate(self, into: torch.Tensor, clip: float | None = None, *, scale: float = 1.0,
                   weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add sum_i w_i c_i^2 (grad l_i)^2 of the recorded pass into the flat vector ``into`` (``model.parameters()``
        order, the parameters' dtype) in place; returns (norms before clipping, w_i c_i^2).

        With a clip, an example whose gradient norm is not finite (an overflow on an extreme record) adds the zero
        term, decided on that example alone: one record's term stays within C^2 of nothing, and the other records'
        terms are kept (as the DP-SGD executors do, ``privfl.privacy.record_level.clipped_gradient_sum``)."""
        norms = self.per_example_norms(scale)
        w, drop = _clipped_weights(norms, clip, weights)
        views, offset = {}, 0
        for p in self._params:
            views[id(p)] = into[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        if offset != into.numel():
            raise ConfigurationError(f"the accumulator has {into.numel()} entries, the model {offset} parameters")
        for layer in self.layers:
            layer.accumulate(w, scale, views, drop)
        return norms, w

    def batch_fisher(self, clip: float | None = None, *, scale: float = 1.0,
                     weights: torch.Tensor | None = None) -> BatchFisher:
        """sum_i w_i c_i^2 (grad l_i)^2 of the recorded pass; ``weights`` w_i default to 1 (0 drops an example)."""
        flat = torch.zeros(sum(p.numel() for p in self._params), dtype=self.dtype)
        norms, w = self.accumulate(flat, clip, scale=scale, weights=weights)
        return BatchFisher(flat, norms, w)


def _record_pass(recorder: GradientRecorder, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 loss_fn: LossFn) -> None:
    """Forward and backward of the summed per-example loss, down to the layers' outputs only: the Fisher needs
    each layer's output gradient and input, not the parameters' gradients (which are neither computed nor stored)."""
    with torch.enable_grad():
        # inputs that require grad: the layers' full backward hooks then have a gradient to fire on (no torch warning)
        loss = loss_fn(model(x.detach().requires_grad_(x.is_floating_point())), y).sum()
        outputs = [layer.output for layer in recorder.layers]
        torch.autograd.grad(loss, outputs, allow_unused=True)


def _fisher_hooks(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float | None, loss_fn: LossFn,
                  weights: torch.Tensor | None, into: torch.Tensor | None = None) -> BatchFisher | None:
    with GradientRecorder(model) as rec:
        _record_pass(rec, model, x, y, loss_fn)
        if into is None:
            return rec.batch_fisher(clip, weights=weights)
        rec.accumulate(into, clip, weights=weights)
        return None


def per_example_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                          loss_fn: LossFn = _per_example_loss, *, randomness: str = "error") -> torch.Tensor:
    """Every example's loss gradient, (batch, parameters) in ``model.parameters()`` order, by ``torch.func`` (vmap of
    grad). It builds the full per-example gradients: the reference, and the fallback for unsupported layers.
    ``randomness``: vmap's, ``"different"`` for a model that samples (a Bayesian layer's weight noise, then drawn
    independently per example from torch's global generator)."""
    from torch.func import functional_call, grad, vmap

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    if not len(x):
        return torch.zeros(0, sum(p.numel() for p in params.values()))

    def loss_one(p, xi, yi):
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0)).sum()

    per_example = vmap(grad(loss_one), in_dims=(None, 0, 0), randomness=randomness)
    try:
        grads = per_example(params, x, y)
    except UsageError:
        raise
    except Exception:  # noqa: BLE001 - one record made the batched pass raise (a user's model failing on it)
        # one example at a time: an example whose own pass raises gets a row of NaN, which every consumer (the
        # clipped sums, the Fisher's clipped weights) turns into the zero term, decided on that example alone
        dim = sum(p.numel() for p in params.values())
        rows = []
        for i in range(len(x)):
            try:
                one = per_example(params, x[i:i + 1], y[i:i + 1])
            except UsageError:
                raise
            except Exception:  # noqa: BLE001
                rows.append(torch.full((1, dim), float("nan")))
                continue
            rows.append(torch.cat([one[n].reshape(1, -1) for n in names], dim=1))
        return torch.cat(rows, dim=0)
    return torch.cat([grads[n].reshape(len(x), -1) for n in names], dim=1)


def _fisher_func(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float | None, loss_fn: LossFn,
                 weights: torch.Tensor | None) -> BatchFisher:
    g = per_example_gradients(model, x, y, loss_fn)
    norms = g.norm(dim=1)
    w, drop = _clipped_weights(norms, clip, weights)
    if drop is not None:
        g = torch.where(drop[:, None], torch.zeros((), dtype=g.dtype), g)
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
    contributes k times moves the sum by at most k C^2 under add/remove: removing it removes its own terms and, given
    the parameter trajectory (which DP-SGD makes private) and batches drawn independently of the data, changes no
    other record's terms. With shuffled batches or disjoint chunks a record is seen once per epoch, so k = epochs;
    with sampled batches k is random and unbounded. Either way each record is *capped* at ``max_visits``
    contributions (later ones get weight 0), and :meth:`per_visit` divides by ``max_visits``, so one record moves it
    by at most C^2: the value a ``PreClipped(C, "squared_sum")`` channel may carry. (FOLA never reuses DP-SGD's
    Poisson batches here: which records a DP-SGD step sampled is that mechanism's hidden randomness.)
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

    def add_recorded(self, recorder: GradientRecorder, record_ids, *, scale: float = 1.0) -> None:
        """Add the recorder's last backward pass (examples ``record_ids``, in batch order), in place."""
        weights = self.admit(record_ids)
        if recorder.dtype == self.total.dtype:
            recorder.accumulate(self.total, self.clip, scale=scale, weights=weights)
        else:
            self.total += recorder.batch_fisher(self.clip, scale=scale, weights=weights).squared.to(self.total.dtype)
        self.steps += 1

    def add(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, record_ids, *,
            loss_fn: LossFn = _per_example_loss) -> None:
        """Run a Fisher pass on (x, y) at the model's current parameters and add it, in place (no training)."""
        weights = self.admit(record_ids)
        params = [p for p in model.parameters() if p.requires_grad]
        if not unsupported_parameters(model) and params and params[0].dtype == self.total.dtype:
            before = self.total.clone()
            try:
                _fisher_hooks(model, x, y, self.clip, loss_fn, weights, into=self.total)
            except UsageError:
                raise
            except Exception:  # noqa: BLE001 - one record made the batched pass raise (a user's model failing on it)
                if self.clip is None:  # nothing private: a clear error
                    raise
                # the per-example torch.func pass, where a record whose own pass raises adds the zero term
                self.total.copy_(before)
                batch = per_example_fisher(model, x, y, clip=self.clip, loss_fn=loss_fn, weights=weights,
                                           method="func")
                self.total += batch.squared.to(self.total.dtype)
        else:
            batch = per_example_fisher(model, x, y, clip=self.clip, loss_fn=loss_fn, weights=weights)
            self.total += batch.squared.to(self.total.dtype)
        self.steps += 1

    def per_visit(self) -> torch.Tensor:
        """``total / max_visits``: one record moves it by at most C^2 (with a clip and a cap)."""
        return self.total / (self.max_visits or 1)

    def record_bound(self) -> float:
        """The L2 bound on one record's contribution to :meth:`per_visit` (C^2), inf without clip or cap."""
        if self.clip is None or self.max_visits is None:
            return float("inf")
        return self.clip ** 2


__all__ = ["BatchFisher", "FisherAccumulator", "GradientRecorder", "HalfSquaredError", "SUPPORTED_LAYERS",
           "check_fisher_model", "clip_factors", "half_squared_error", "per_example_fisher", "per_example_gradients",
           "per_example_task_loss", "unsupported_parameters"]
