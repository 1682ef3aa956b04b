"""The vectorised client executor: many clients' local SGD trained at once with ``torch.func``.

FedAvg-style local training is the same computation on every client: from the broadcast model, ``epochs`` passes of
shuffled mini-batch SGD (with momentum, and FedProx's proximal term mu/2 ||w - w_global||^2) over the client's own
records. Clients whose record counts are equal have identical batch schedules, so a chunk of them is trained as one
batched computation: their parameters are stacked along a leading client axis and ``vmap(grad(loss))`` over
``functional_call`` gives each client its own gradient on its own batch.

Each client keeps its own generator: its shuffles are drawn from the same ``numpy.random.Generator`` in the same order
as the per-client loop (``privfl.training.local.train_epochs``), and the optimiser step is torch's SGD update written out
(``buf = momentum * buf + grad``, first step ``buf = grad``; ``p -= lr * buf``), so the result equals the per-client
loop to float tolerance. Nothing here touches privacy: every client's output still goes through its own release
pipeline (``privfl.runtime.engine``).

The same machinery serves the weight-space Bayesian algorithms: :class:`PerExampleGradients` gives a chunk's
per-example gradients (ghost form on a linear stack, vmap of grad otherwise) whose clipped sums drive DP-SGD
(``privfl.privacy.record_level.VectorisedDPSGD``: the privacy layer clips, samples and adds noise; nothing here does)
and whose squared sums are the per-example Fisher of ``privfl.training.fisher``
(:class:`VectorisedOnlineFisher`, FOLA's online step); :func:`adam_step` and the masked :func:`sgd_step` are torch's
optimisers on stacked parameters for HBFL's memes and local models (``privfl.training.distill.VectorisedHBFL``).

Chunk size: stacked parameters, gradients, momentum buffers and a chunk's activations must fit in memory (and, on a
CPU, in cache: stacking 1,000 copies of a 79,510-weight MLP at once is memory-bound). The default chunk holds about
``memory_budget`` bytes of per-client state.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from privfl.errors import UsageError

#: bytes of per-client training state (parameters, gradients, momentum, batch activations) one chunk may hold
DEFAULT_MEMORY_BUDGET = 64 * 2 ** 20

#: module types whose computation is the same pure function on every client (no buffers, no randomness)
_PURE = (nn.Linear, nn.ReLU, nn.Sequential, nn.AvgPool2d, nn.MaxPool2d, nn.Flatten, nn.Conv2d, nn.Tanh, nn.Sigmoid,
         nn.Identity, nn.Softplus, nn.GELU, nn.LeakyReLU)


def vectorisable(model: nn.Module) -> bool:
    """Whether ``model`` can be trained by the vectorised executor: built only of stateless layers (no buffers such as
    batch-norm statistics, no dropout), every parameter a float32 tensor. Anything else runs on the per-client loop."""
    if any(True for _ in model.buffers()):
        return False
    for m in model.modules():
        if type(m).__module__.startswith("torch.nn") and not isinstance(m, _PURE):
            return False
        if isinstance(m, (nn.Dropout, nn.BatchNorm1d, nn.BatchNorm2d)):
            return False
    return all(p.dtype == torch.float32 for p in model.parameters())


def sgd_step(params: dict, grads: dict, buf: dict | None, *, lr: float, momentum: float,
             active: torch.Tensor | None = None) -> dict | None:
    """torch.optim.SGD's update on stacked parameters, in place: with momentum, ``buf = grad`` on the first step and
    ``momentum * buf + grad`` after, then ``p -= lr * buf``. Returns the momentum buffer (None without momentum).

    ``active`` (a bool per client): only those clients step; the others keep their parameters and momentum, as a
    client that skips ``optimizer.step()`` does. The buffer then carries a ``"_started"`` flag per client, so each
    client's first step sets ``buf = grad`` as torch does."""
    if active is not None:
        return _masked_sgd_step(params, grads, buf, lr=lr, momentum=momentum, active=active)
    if momentum != 0:
        if buf is None:
            buf = {k: g.clone() for k, g in grads.items()}
        else:
            for k, g in grads.items():
                buf[k].mul_(momentum).add_(g)
        grads = buf
    for k, g in grads.items():
        params[k].add_(g, alpha=-lr)
    return buf


def _masked_sgd_step(params: dict, grads: dict, buf: dict | None, *, lr: float, momentum: float,
                     active: torch.Tensor) -> dict | None:
    def rows(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return mask.reshape(-1, *([1] * (t.dim() - 1)))

    if momentum != 0:
        if buf is None:
            buf = {k: torch.zeros_like(g) for k, g in grads.items()}
            buf["_started"] = torch.zeros(len(active), dtype=torch.bool)
        started = buf["_started"]
        for k, g in grads.items():
            b = buf[k]
            # torch's update (first step: a copy of the gradient) where a client steps; unchanged elsewhere
            b.copy_(torch.where(rows(b, active), torch.where(rows(b, started), b * momentum + g, g), b))
        buf["_started"] = started | active
        grads = {k: buf[k] for k in grads}
    for k, g in grads.items():
        p = params[k]
        p.copy_(torch.where(rows(p, active), p.add(g, alpha=-lr), p))
    return buf


def adam_step(params: dict, grads: dict, state: dict | None, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
              eps: float = 1e-8) -> dict:
    """torch.optim.Adam's update (its CPU single-tensor form; no weight decay, no amsgrad) on stacked parameters, in
    place: ``m = lerp(m, g, 1 - b1)``, ``v = b2 v + (1 - b2) g^2``, ``p -= lr / (1 - b1^t) * m / (sqrt(v) /
    sqrt(1 - b2^t) + eps)``. Returns the optimiser state (pass it back next step; None on the first)."""
    beta1, beta2 = betas
    if state is None:
        state = {"step": 0, "exp_avg": {k: torch.zeros_like(g) for k, g in grads.items()},
                 "exp_avg_sq": {k: torch.zeros_like(g) for k, g in grads.items()}}
    state["step"] += 1
    step = float(state["step"])
    step_size = lr / (1 - beta1 ** step)
    correction2_sqrt = (1 - beta2 ** step) ** 0.5
    for k, g in grads.items():
        exp_avg, exp_avg_sq = state["exp_avg"][k], state["exp_avg_sq"][k]
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / correction2_sqrt).add_(eps)
        params[k].addcdiv_(exp_avg, denom, value=-step_size)
    return state


def unflatten(flat: torch.Tensor, names, shapes) -> dict[str, torch.Tensor]:
    """Views of ``flat`` (``(..., total)``: one flat row per client, or one vector) shaped ``(..., *shape)`` per
    parameter name, in the model's parameter order."""
    out, start = {}, 0
    for name, shape in zip(names, shapes):
        size = shape.numel()
        out[name] = flat[..., start:start + size].reshape(*flat.shape[:-1], *shape)
        start += size
    return out


def chunk_size(model: nn.Module, n_records: int, batch_size: int, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> int:
    """Clients per chunk: about ``memory_budget`` bytes of parameters, gradients, momentum and one batch's
    activations per chunk (at least one client)."""
    dim = sum(p.numel() for p in model.parameters())
    width = max((p.shape[0] for p in model.parameters() if p.dim() >= 1), default=1)
    per_client = 4 * (4 * dim + 4 * min(batch_size, n_records) * width)
    return max(1, int(memory_budget // per_client))


class VectorisedSGD:
    """Trains chunks of clients of one model architecture at once (see the module docstring).

    Args:
        model: a module of the architecture every client trains (its parameters are not changed; only its structure
            is used through ``functional_call``).
        epochs, batch_size, lr, momentum: the local optimiser, as in :func:`privfl.training.local.train_epochs`.
        prox_mu: FedProx's proximal coefficient (0 for FedAvg).
        memory_budget: bytes of per-client state one chunk may hold.
    """

    def __init__(self, model: nn.Module, *, epochs: int, batch_size: int, lr: float, momentum: float,
                 prox_mu: float = 0.0, memory_budget: int = DEFAULT_MEMORY_BUDGET):
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [p.shape for _, p in model.named_parameters()]
        self.epochs, self.batch_size, self.lr, self.momentum = int(epochs), int(batch_size), float(lr), float(momentum)
        self.prox_mu = float(prox_mu)
        self.memory_budget = int(memory_budget)
        self._buffer: torch.Tensor | None = None
        self._grad = vmap(grad(self._loss), in_dims=(0, 0, 0, None))

    def _loss(self, params: dict, x: torch.Tensor, y: torch.Tensor, anchor: dict) -> torch.Tensor:
        loss = nn.functional.cross_entropy(functional_call(self.model, params, (x,)), y)
        if self.prox_mu > 0:
            loss = loss + 0.5 * self.prox_mu * sum((params[n] - anchor[n]).pow(2).sum() for n in self.names)
        return loss

    def _unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return unflatten(flat, self.names, self.shapes)

    def train(self, global_params: np.ndarray, datasets: Sequence[tuple[torch.Tensor, torch.Tensor]],
              rngs: Sequence[np.random.Generator]) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(i, update_i)`` for every client ``i`` of ``datasets``: its local model after training minus the
        broadcast model (float32, as the per-client loop of ``FedAvg.client_update`` computes it), chunk by chunk. Clients are
        grouped by record count; ``rngs[i]`` is consumed exactly as the per-client loop would consume it."""
        by_size: dict[int, list[int]] = {}
        for i, (x, _) in enumerate(datasets):
            by_size.setdefault(len(x), []).append(i)
        start32 = torch.as_tensor(global_params, dtype=torch.float32)
        for n, members in by_size.items():
            step = chunk_size(self.model, n, self.batch_size, self.memory_budget)
            for lo in range(0, len(members), step):
                chunk = members[lo:lo + step]
                final = self._train_chunk(start32, [datasets[i] for i in chunk], [rngs[i] for i in chunk], n)
                # float32 end to end, as the per-client loop computes it (trained model minus the broadcast model);
                # a fresh array per chunk (the training buffer is reused by the next chunk)
                updates = np.subtract(final.numpy(), start32.numpy())
                for row, i in enumerate(chunk):
                    yield i, updates[row]

    def _train_chunk(self, start32: torch.Tensor, datasets, rngs, n: int) -> torch.Tensor:
        """The chunk's final parameters, one flat float32 row per client."""
        c = len(datasets)
        anchor = self._unflatten(start32)
        if self._buffer is None or self._buffer.shape[0] < c or self._buffer.shape[1] != start32.numel():
            self._buffer = torch.empty(c, start32.numel())  # reused by every chunk: its pages are already mapped
        flat = self._buffer[:c]
        flat.copy_(start32.unsqueeze(0).expand(c, -1))  # every client starts from the broadcast model
        params = self._unflatten(flat)  # views of ``flat``, updated in place
        if n == 0:
            return flat
        x = torch.stack([d[0] for d in datasets])  # (c, n, ...)
        y = torch.stack([d[1] for d in datasets])  # (c, n)
        rows = torch.arange(c).unsqueeze(1)
        buf: dict[str, torch.Tensor] | None = None
        for _ in range(self.epochs):
            order = torch.as_tensor(np.stack([rng.permutation(n) for rng in rngs]))  # each client's own shuffle
            for s in range(0, n, self.batch_size):
                idx = order[:, s:s + self.batch_size]
                grads = self._grad(params, x[rows, idx], y[rows, idx], anchor)
                buf = sgd_step(params, grads, buf, lr=self.lr, momentum=self.momentum)
        return flat


#: parameter-free layers applied elementwise (what may sit between the linear layers of a linear stack)
ELEMENTWISE = (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.LeakyReLU, nn.Softplus, nn.Identity)


def linear_stack(model: nn.Module):
    """``(prefix, layers)`` when ``model`` computes ``Sequential(parameter-free reshaping prefix, then linear layers
    and elementwise activations)`` (an ``nn.Sequential``, or privfl's MLP), else None. ``prefix``: the modules before
    the first linear layer (flatten, average pooling); ``layers``: ``("linear", qualified name)`` or
    ``("act", module)`` in order."""
    from privfl.models.nets import MLP

    if isinstance(model, nn.Sequential):
        seq, base = model, ""
    elif type(model) is MLP and type(model).forward is MLP.forward:
        seq, base = model.net, "net."
    else:
        return None
    prefix, layers = [], []
    for name, module in seq.named_children():
        if type(module) is nn.Linear:
            layers.append(("linear", base + name))
        elif not layers and type(module) in (nn.Flatten, nn.AvgPool2d, nn.Identity):
            prefix.append(module)
        elif layers and type(module) in ELEMENTWISE:
            # by exact type: a subclass has a forward of its own, which the stack would run on the whole batch at
            # once (a user's layer that mixes examples, or raises on one record, would then decide for all of them)
            layers.append(("act", module))
        else:
            return None
    if not layers or layers[-1][0] != "linear":
        return None
    return prefix, layers


class ExtraRows:
    """Flat gradient rows from outside a batch's own examples (``privfl audit-run``'s canary records), in the model's
    flat parameter order, stored by their support: row j is ``values[..., j, :]`` at the flat coordinates
    ``index[..., j, :]`` (leading axes: none, or the chunk's clients). Canary directions have disjoint supports, so
    20,000 rows of a 20,010-coordinate model stay one coordinate each; :meth:`dense` wraps full rows."""

    def __init__(self, index: torch.Tensor, values: torch.Tensor, dim: int):
        if index.shape != values.shape or index.dim() < 2:
            raise ValueError(f"ExtraRows needs index and values of one shape (..., rows, support), got "
                             f"{tuple(index.shape)} and {tuple(values.shape)}")
        self.index, self.values, self.dim = index.long(), values, int(dim)

    @classmethod
    def dense(cls, rows: torch.Tensor) -> "ExtraRows":
        """Full rows (``(..., rows, dim)``)."""
        dim = rows.shape[-1]
        return cls(torch.arange(dim).expand(rows.shape), rows, dim)

    @property
    def count(self) -> int:
        """The number of rows (per leading index)."""
        return self.index.shape[-2]

    def to(self, dtype: torch.dtype) -> "ExtraRows":
        return ExtraRows(self.index, self.values.to(dtype), self.dim)

    def unsqueeze(self) -> "ExtraRows":
        """The rows with a leading client axis of one."""
        return ExtraRows(self.index.unsqueeze(0), self.values.unsqueeze(0), self.dim)

    def norms2(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Each row's squared norm, ``(..., rows)``; with ``lo``/``hi``, over the flat coordinates [lo, hi) only (one
        parameter's block)."""
        squares = self.values.pow(2)
        if lo or hi is not None:
            squares = squares * ((self.index >= lo) & (self.index < (self.dim if hi is None else hi)))
        return squares.sum(-1)

    def sums(self, factor: torch.Tensor, power: int = 1) -> torch.Tensor:
        """sum_j f_j row_j (``power`` 2: of the rows' squares), ``(..., dim)``; ``factor``: ``(..., rows)``."""
        lead = self.index.shape[:-2]
        flat_lead = math.prod(lead)
        weighted = (self.values.pow(power) if power != 1 else self.values) * factor.unsqueeze(-1)
        out = torch.zeros(flat_lead, self.dim, dtype=weighted.dtype)
        out.scatter_add_(1, self.index.reshape(flat_lead, -1), weighted.reshape(flat_lead, -1))
        return out.reshape(*lead, self.dim)


class PerExampleTerms:
    """A chunk's per-example loss gradients at stacked parameters, kept in the cheapest form that gives their norms,
    their weighted sums and the weighted sums of their squares (per client, per parameter).

    On a linear stack (ghost form) a linear layer's per-example gradient is the outer product of its output gradient
    b_i and its input a_i: its squared norm is |a_i|^2 |b_i|^2, the weighted sum is B^T diag(f) A and the weighted sum
    of squares (the Fisher diagonal of ``privfl.training.fisher``) is (B^2)^T diag(f) A^2. Otherwise ``per_example`` holds every
    example's gradient (vmap of grad).

    :meth:`join` appends rows from outside the batch (:class:`ExtraRows`: ``privfl audit-run``'s canary records)
    after the examples: :meth:`norms2` then has ``width + extra`` columns, and :meth:`sums` and :meth:`square_sums`
    take a factor per column, so that one clip factor computed from those norms scales the examples and the extra
    rows alike."""

    def __init__(self, names, losses, *, layers=None, per_example=None):
        self.names, self.losses = names, losses
        self.layers = layers  # [(weight name, bias name or None, inputs a (c, w, in), backprops b (c, w, out))]
        self.per_example = per_example
        self.extra: ExtraRows | None = None
        self._drop_non_finite()

    def join(self, extra: ExtraRows) -> "PerExampleTerms":
        """Append ``extra`` (leading axis: the chunk's clients) after the examples (see the class docstring)."""
        c = self.losses.shape[0]
        if extra.index.dim() != 3 or extra.index.shape[0] != c:
            raise ValueError(f"extra rows for {c} clients need shape ({c}, rows, support), got "
                             f"{tuple(extra.index.shape)}")
        self.extra = extra.to(self._norms2.dtype)
        self._norms2 = torch.cat([self._norms2, self.extra.norms2()], dim=1)
        return self

    def _add_extra(self, out: dict[str, torch.Tensor], factor: torch.Tensor, power: int) -> dict[str, torch.Tensor]:
        """``out`` (the examples' per-parameter sums) plus the extra rows' sums at their columns of ``factor``."""
        flat = self.extra.sums(factor[:, self.losses.shape[1]:], power)
        offset = 0
        for k in self.names:
            shape = out[k].shape
            size = math.prod(shape[1:])
            out[k] = out[k] + flat[:, offset:offset + size].reshape(shape)
            offset += size
        return out

    def _drop_non_finite(self) -> None:
        """An example whose gradient, or its norm, is not finite (an overflow on an extreme record) contributes the
        zero term: decided on that example alone, it stays within one record's bound, where a NaN in the sum would
        make the whole release non-finite (and the pipeline's fallback move it by far more than one record). Its
        squared norm alone tells (a NaN or infinite entry makes it NaN or infinite, 0 x inf included), so the check
        costs no pass beyond the norms, computed here once. ``dropped`` counts them."""
        c, width = self.losses.shape
        norms2 = self._raw_norms2()
        bad = ~torch.isfinite(norms2)
        self.dropped = int(bad.sum())
        self._norms2 = norms2
        if not self.dropped:
            return
        zero = torch.zeros((), dtype=norms2.dtype)
        self._norms2 = torch.where(bad, zero, norms2)
        if self.layers is None:
            self.per_example = {k: torch.where(bad.reshape(c, width, *([1] * (g.dim() - 2))),
                                               torch.zeros((), dtype=g.dtype), g)
                                for k, g in self.per_example.items()}
        else:
            self.layers = [(w, bias, torch.where(bad.unsqueeze(-1), torch.zeros((), dtype=a.dtype), a),
                            torch.where(bad.unsqueeze(-1), torch.zeros((), dtype=b.dtype), b))
                           for w, bias, a, b in self.layers]

    def norms2(self) -> torch.Tensor:
        """||grad l_i||^2 per client and example, (c, w) (0 for an example whose term was dropped; after :meth:`join`,
        (c, w + extra rows), the extra rows' last)."""
        return self._norms2

    def _raw_norms2(self) -> torch.Tensor:
        c, width = self.losses.shape
        if self.layers is None:
            return sum(g.reshape(c, width, -1).pow(2).sum(-1) for g in self.per_example.values())
        total = torch.zeros(c, width)
        for _, bias, a, b in self.layers:
            b2 = b.pow(2).sum(-1)
            total += a.pow(2).sum(-1) * b2
            if bias is not None:
                total += b2
        return total

    def sums(self, factor: torch.Tensor) -> dict[str, torch.Tensor]:
        """sum_i f_i grad l_i per client, by parameter name (and the joined extra rows', at their columns)."""
        if self.extra is not None:
            return self._add_extra(self._sums(factor[:, :self.losses.shape[1]]), factor, 1)
        return self._sums(factor)

    def _sums(self, factor: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.layers is None:
            return {k: torch.einsum("cb,cb...->c...", factor, g) for k, g in self.per_example.items()}
        out = {}
        for weight, bias, a, b in self.layers:
            scaled = b * factor.unsqueeze(-1)
            out[weight] = torch.bmm(scaled.transpose(1, 2), a)
            if bias is not None:
                out[bias] = scaled.sum(1)
        return out

    def square_sums(self, factor: torch.Tensor) -> dict[str, torch.Tensor]:
        """sum_i f_i (grad l_i)^2 per client, by parameter name (the per-example Fisher diagonal; and the joined extra
        rows', at their columns)."""
        if self.extra is not None:
            return self._add_extra(self._square_sums(factor[:, :self.losses.shape[1]]), factor, 2)
        return self._square_sums(factor)

    def _square_sums(self, factor: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.layers is None:
            return {k: torch.einsum("cb,cb...->c...", factor, g.pow(2)) for k, g in self.per_example.items()}
        out = {}
        for weight, bias, a, b in self.layers:
            scaled = b.pow(2) * factor.unsqueeze(-1)
            out[weight] = torch.bmm(scaled.transpose(1, 2), a.pow(2))
            if bias is not None:
                out[bias] = scaled.sum(1)
        return out

    def flat(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """``parts`` as one (c, parameters) tensor in the model's parameter order."""
        c = self.losses.shape[0]
        return torch.cat([parts[k].reshape(c, -1) for k in self.names], dim=1)


class PerExampleGradients:
    """Per-example cross-entropy gradients of chunks of clients (:class:`PerExampleTerms`): ghost form on a linear
    stack, vmap of grad otherwise. ``weight`` (c, w) marks the real rows of padded batches (0 for padding)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]
        self.stack = linear_stack(model)
        self._one = grad(self._loss, has_aux=True)
        self._per_example = vmap(vmap(self._one, in_dims=(None, 0, 0)), in_dims=(0, 0, 0))

    def _loss(self, params: dict, x: torch.Tensor, y: torch.Tensor):
        loss = nn.functional.cross_entropy(functional_call(self.model, params, (x.unsqueeze(0),)), y.unsqueeze(0))
        return loss, loss.detach()

    def _one_at_a_time(self, params: dict, xb: torch.Tensor, yb: torch.Tensor):
        """The batched pass's output computed example by example: an example whose own pass raises gets gradients
        of NaN (:class:`PerExampleTerms` turns them into the zero term, decided on that example alone) and loss 0."""
        c, width = yb.shape[:2]
        grads = {k: torch.zeros(c, width, *v.shape[1:], dtype=v.dtype) for k, v in params.items()}
        losses = torch.zeros(c, width)
        for r in range(c):
            mine = {k: v[r] for k, v in params.items()}
            for i in range(width):
                try:
                    g, loss = self._one(mine, xb[r, i], yb[r, i])
                except UsageError:
                    raise
                except Exception:  # noqa: BLE001
                    for k in grads:
                        grads[k][r, i] = float("nan")
                    continue
                for k in grads:
                    grads[k][r, i] = g[k]
                losses[r, i] = loss
        return grads, losses

    def __call__(self, params: dict, xb: torch.Tensor, yb: torch.Tensor, weight: torch.Tensor) -> PerExampleTerms:
        try:
            if self.stack is None:
                per_example, losses = self._per_example(params, xb, yb)
                return PerExampleTerms(self.names, losses, per_example=per_example)
            return self._ghost(params, xb, yb, weight)
        except UsageError:
            raise
        except Exception:  # noqa: BLE001 - one record made the batched pass raise (a user's model failing on it)
            per_example, losses = self._one_at_a_time(params, xb, yb)
            return PerExampleTerms(self.names, losses, per_example=per_example)

    def _ghost(self, params: dict, xb: torch.Tensor, yb: torch.Tensor, weight: torch.Tensor) -> PerExampleTerms:
        """The linear stack's terms without materialising per-example gradients (ghost form)."""
        prefix, layers = self.stack
        c, width = weight.shape
        h = xb.reshape(c * width, *xb.shape[2:])
        for module in prefix:
            h = module(h)
        h = h.reshape(c, width, -1).requires_grad_()
        inputs, outputs, linear = [], [], []
        for kind, module in layers:
            if kind == "linear":
                w = params[module + ".weight"]
                bias = params.get(module + ".bias")
                inputs.append(h)
                h = torch.bmm(h, w.transpose(1, 2)) if bias is None else torch.baddbmm(bias.unsqueeze(1), h,
                                                                                        w.transpose(1, 2))
                outputs.append(h)
                linear.append((module + ".weight", module + ".bias" if bias is not None else None))
            else:
                h = module(h)
        losses = nn.functional.cross_entropy(h.reshape(c * width, -1), yb.reshape(-1), reduction="none")
        losses = losses.reshape(c, width)
        backprops = torch.autograd.grad((losses * weight).sum(), outputs)
        return PerExampleTerms(self.names, losses.detach(), layers=[
            (wn, bn, a.detach(), b) for (wn, bn), a, b in zip(linear, inputs, backprops)])


class VectorisedOnlineFisher:
    """Mini-batch SGD on mean cross-entropy plus a diagonal Gaussian prior term, for chunks of clients at once, that
    reads the per-example Fisher diagonal of the task loss off each step's own per-example gradients (FOLA's online
    local step, ``FOLA._train_online``: eq. 16's prior term, eq. 22's Fisher).

    The loss of a batch is mean CE + ``prior_weight`` / 2 sum_j ``prior_precision``_j (theta_j - ``prior_mean``_j)^2;
    its task gradient is the mean of the batch's per-example gradients (:class:`PerExampleGradients`), whose squares
    are added to the client's Fisher sum (no clip: the non-private and client-level modes). Clients are grouped by
    record count; each draws its shuffles from its own generator exactly as :func:`privfl.training.local.batches` does, and
    the update is torch's SGD (:func:`sgd_step`), so each client's result equals the per-client loop to float
    tolerance.
    """

    def __init__(self, model: nn.Module, *, epochs: int, batch_size: int, lr: float, momentum: float,
                 prior_weight: float, memory_budget: int = DEFAULT_MEMORY_BUDGET):
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [p.shape for _, p in model.named_parameters()]
        self.epochs, self.batch_size, self.lr, self.momentum = int(epochs), int(batch_size), float(lr), float(momentum)
        self.prior_weight = float(prior_weight)
        self.memory_budget = int(memory_budget)
        self.per_example = PerExampleGradients(model)

    def _unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return unflatten(flat, self.names, self.shapes)

    def chunk(self, n: int) -> int:
        """Clients per chunk: parameters, momentum, Fisher, gradients and one batch's per-example terms."""
        dim = sum(p.numel() for p in self.model.parameters())
        batch = min(self.batch_size, max(n, 1))
        if self.per_example.stack is not None:
            width = max((p.shape[0] + p.shape[-1] for p in self.model.parameters() if p.dim() == 2), default=1)
            per_client = 4 * (5 * dim + 4 * batch * width)
        else:
            per_client = 4 * dim * (batch + 5)
        return max(1, int(self.memory_budget // per_client))

    def train(self, prior_mean: np.ndarray, prior_precision: np.ndarray,
              datasets: Sequence[tuple[torch.Tensor, torch.Tensor]], rngs: Sequence[np.random.Generator]
              ) -> Iterator[tuple[int, np.ndarray, np.ndarray, float]]:
        """Yield ``(i, model_i, fisher_i, loss_i)`` for every client: its trained parameters (float32, starting from
        ``prior_mean``), the sum over its steps of its per-example squared task gradients (float32) and its mean
        task loss over all steps."""
        start32 = torch.as_tensor(prior_mean, dtype=torch.float32)
        anchor = self._unflatten(start32)
        precision = self._unflatten(torch.as_tensor(prior_precision, dtype=torch.float32))
        by_size: dict[int, list[int]] = {}
        for i, (x, _) in enumerate(datasets):
            by_size.setdefault(len(x), []).append(i)
        for n, members in by_size.items():
            step = self.chunk(n)
            for lo in range(0, len(members), step):
                chunk = members[lo:lo + step]
                final, fisher, losses = self._train_chunk(start32, anchor, precision, [datasets[i] for i in chunk],
                                                          [rngs[i] for i in chunk], n)
                for row, i in enumerate(chunk):
                    yield i, final[row].numpy(), fisher[row].numpy(), losses[row]

    def _train_chunk(self, start32, anchor, precision, datasets, rngs, n: int):
        c = len(datasets)
        flat = start32.unsqueeze(0).repeat(c, 1)
        params = self._unflatten(flat)
        fisher = torch.zeros_like(flat)
        total = torch.zeros(c, dtype=torch.float64)
        seen = 0
        if n == 0:
            return flat, fisher, [0.0] * c
        x = torch.stack([d[0] for d in datasets])
        y = torch.stack([d[1] for d in datasets])
        rows = torch.arange(c).unsqueeze(1)
        buf = None
        half = 0.5 * self.prior_weight
        for _ in range(self.epochs):
            order = torch.as_tensor(np.stack([rng.permutation(n) for rng in rngs]))
            for s in range(0, n, self.batch_size):
                idx = order[:, s:s + self.batch_size]
                width = idx.shape[1]
                ones = torch.ones(c, width)
                terms = self.per_example(params, x[rows, idx], y[rows, idx], ones)
                grads = terms.sums(ones / width)  # the mean loss's gradient
                for k in self.names:  # the prior term's gradient, as autograd forms it: (lambda/2 prec) * 2 (p - m)
                    grads[k] = grads[k] + (half * precision[k]) * (2 * (params[k] - anchor[k]))
                fisher += terms.flat(terms.square_sums(ones))
                buf = sgd_step(params, grads, buf, lr=self.lr, momentum=self.momentum)
                total += terms.losses.double().mean(1) * width
                seen += width
        return flat, fisher, (total / seen).tolist()


__all__ = ["DEFAULT_MEMORY_BUDGET", "ELEMENTWISE", "ExtraRows", "PerExampleGradients", "PerExampleTerms",
           "VectorisedOnlineFisher", "VectorisedSGD", "adam_step", "chunk_size", "linear_stack",
           "sgd_step", "unflatten", "vectorisable"]
