"""HBFL's local training: a Bayesian *meme* model trained towards the tempered local likelihood (eq. 4.1), and a
local model of any architecture distilled from it (eq. 4.2), a step of each on the same batch, in the two forms of
privfl's executors: one client's modules (:func:`train_meme_and_local`) or a chunk of clients' stacked parameters
(:class:`VectorisedHBFL`). Seeded identically, both give the same models to float tolerance.

Which records each step sees, and what gradient the meme's task loss contributes, are not decided here: a *lot
source* decides them, one per chunk of clients (one client on the per-client path), iterated for each step's index
lots (one array per client) with

- ``reg_size``: the record count the meme's entropy term divides by;
- ``per_example``: False, the meme's gradient is the batch's mean loss's (the loss's own backward); True, the
  executor computes each example's gradient of the task loss (flat rows, the weight noise drawn independently per
  example) and ``privatise(r, rows)`` turns client r's rows into the gradient the step applies.

:class:`MiniBatches` is the plain source (shuffled mini-batches over ``epochs``, the mean loss's gradient);
``privfl.privacy.record_level.DPSGDLots`` is DP-SGD's (Poisson lots, clipped and noised sums). Nothing here decides
privacy.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from privfl.models import MLP, BayesLinear, bayes_modules, deterministic, softplus
from privfl.models.bayes import _VAR_FLOOR  # BayesLinear's variance floor, written out in VectorisedHBFL
from privfl.errors import ConfigurationError, UsageError
from privfl.training.fisher import per_example_gradients
from privfl.training.stacked import DEFAULT_MEMORY_BUDGET, ELEMENTWISE, PerExampleTerms, adam_step, sgd_step


def distillation_loss(student_logits: torch.Tensor, teacher_probs: torch.Tensor, y: torch.Tensor, *,
                      weight: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """Eq. 4.2: ``weight`` * CE(y, student) + (1 - ``weight``) * KL(teacher || student), batch means.

    ``teacher_probs`` are the teacher's class probabilities at ``temperature``; the student is softened by the same
    temperature inside the KL, which is then scaled by temperature^2 so its gradients keep their size.
    """
    ce = F.cross_entropy(student_logits, y)
    log_student = F.log_softmax(student_logits / temperature, dim=1)
    kl = F.kl_div(log_student, teacher_probs, reduction="batchmean") * temperature ** 2
    return weight * ce + (1.0 - weight) * kl


def meme_regulariser(model: nn.Module, temperature: float, n: int) -> torch.Tensor:
    """-(T / n) H(q) up to a constant: the entropy part of eq. 4.1 per example, (T / n) * -sum log std."""
    total = None
    for _, m in bayes_modules(model):
        for _, (_, rho) in m.gaussian_parameters().items():
            part = -torch.log(softplus(rho)).sum()
            total = part if total is None else total + part
    return total * (temperature / n)


def add_flat_gradient(model: nn.Module, flat: torch.Tensor) -> None:
    """Add a flat gradient to ``model``'s ``p.grad``, parameter by parameter in their order."""
    offset = 0
    for p in model.parameters():
        k = p.numel()
        g = flat[offset:offset + k].reshape(p.shape).to(p.dtype)
        p.grad = g if p.grad is None else p.grad + g
        offset += k


class MiniBatches:
    """The plain lot source (module docstring): for clients of ``size`` records each, ``epochs`` passes of shuffled
    mini-batches, each client's shuffles drawn from its own generator as ``privfl.training.local.batches`` draws them;
    the meme's gradient is its mean loss's."""

    per_example = False

    def __init__(self, epochs: int, batch_size: int, size: int, rngs: Sequence[np.random.Generator]):
        self.epochs, self.batch_size, self.size, self.rngs = int(epochs), int(batch_size), int(size), rngs
        self.reg_size = self.size

    def __iter__(self) -> Iterator[list[np.ndarray]]:
        for _ in range(self.epochs):
            perms = [rng.permutation(self.size) for rng in self.rngs]
            for s in range(0, self.size, self.batch_size):
                yield [perm[s:s + self.batch_size] for perm in perms]


class MiniBatchLoop:
    """The plain counterpart of ``privfl.privacy.record_level.DPSGDLoop`` (client level and non-private runs): clients
    with the same record count share a lot source (:class:`MiniBatches` over ``alg.fed``'s epochs and batch size), and
    the loop's outputs are released as they are (the pipeline clips and noises them at client level)."""

    accountant = None
    per_example = False

    def __init__(self, alg):
        self.epochs, self.batch_size = alg.fed.local_epochs, alg.fed.batch_size

    def key(self, client: int, n: int) -> int:
        return int(n)

    def batch_width(self, key: int) -> float:
        """A step's records: what a chunk's activations are sized for."""
        return min(self.batch_size, max(key, 1))

    def lots(self, key: int, rngs, sizes) -> MiniBatches:
        return MiniBatches(self.epochs, self.batch_size, key, rngs)

    def events(self, client: int, channels, trained) -> dict:
        return {}

    def released(self, client: int, values: dict, trained) -> dict:
        return values


def _optimiser(name: str, params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr) if name == "adam" else torch.optim.SGD(params, lr=lr)


def train_meme_and_local(meme: nn.Module, local: nn.Module, x: torch.Tensor, y: torch.Tensor, lots, *,
                         temperature: float, meme_lr: float, meme_optimizer: str, lr: float, momentum: float,
                         distill_weight: float, distill_temperature: float) -> tuple[float | None, float]:
    """One client's step, in place on its modules: for each lot of ``lots`` (a source of one client), a meme step
    (Adam, or SGD without momentum, at ``meme_lr``) on the task loss and the entropy term, then, on a non-empty lot, a
    local step (SGD at ``lr`` with ``momentum``) on the distillation loss towards the meme's mean predictions. The
    meme's weight noise comes from the global torch generator. Returns the meme's last loss (None when the lot
    source privatises its gradient: the loss is then not released) and the local model's last loss."""
    meme_opt = _optimiser(meme_optimizer, meme.parameters(), meme_lr)
    local_opt = torch.optim.SGD(local.parameters(), lr=lr, momentum=momentum)
    meme.train()
    local.train()
    meme_loss = local_loss = 0.0
    for lot in lots:
        idx = torch.as_tensor(lot[0], dtype=torch.long)
        xb, yb = x[idx], y[idx]
        meme_opt.zero_grad(set_to_none=True)
        if lots.per_example:
            add_flat_gradient(meme, lots.privatise(0, per_example_gradients(meme, xb, yb, randomness="different")))
            meme_regulariser(meme, temperature, lots.reg_size).backward()
        else:
            loss = F.cross_entropy(meme(xb), yb) + meme_regulariser(meme, temperature, lots.reg_size)
            loss.backward()
            meme_loss = float(loss.detach())
        meme_opt.step()
        if len(idx) == 0:
            continue
        try:
            with torch.no_grad(), deterministic(meme):
                teacher = torch.softmax(meme(xb) / distill_temperature, dim=1)
            local_opt.zero_grad(set_to_none=True)
            loss = distillation_loss(local(xb), teacher, yb, weight=distill_weight, temperature=distill_temperature)
            loss.backward()
        except UsageError:
            raise
        except Exception:  # noqa: BLE001 - a record made the local model's (or the teacher's) pass raise
            if not lots.per_example:
                raise
            # record level: the local model is never released and teaches nothing to the meme, so skipping its step
            # on this lot costs no privacy, while the whole step's failure would be decided by one record
            local_opt.zero_grad(set_to_none=True)
            continue
        local_opt.step()
        local_loss = float(loss.detach())
    return (None if lots.per_example else meme_loss), local_loss


def bayes_linear_stack(model: nn.Module):
    """``(prefix, layers)`` when ``model`` is a stack of ``BayesLinear`` layers (local reparameterisation, sampling
    on, no generator of its own) and elementwise activations after a parameter-free reshaping prefix (privfl's
    Bayesian MLP), else None. ``layers``: ``("bayes", qualified name, has_bias)`` or ``("act", module, None)``."""
    if isinstance(model, MLP) and type(model).forward is MLP.forward:
        seq, base = model.net, "net."
    elif isinstance(model, nn.Sequential):
        seq, base = model, ""
    else:
        return None
    prefix, layers = [], []
    for name, module in seq.named_children():
        if type(module) is BayesLinear:
            if module.reparameterization != "local" or not module.sampling or module.generator is not None:
                return None
            layers.append(("bayes", base + name, "bias" in module.gaussian_names))
        elif not layers and type(module) in (nn.Flatten, nn.AvgPool2d, nn.Identity):
            prefix.append(module)
        elif layers and type(module) in ELEMENTWISE:  # exact types, as privfl.training.stacked.linear_stack
            layers.append(("act", module, None))
        else:
            return None
    if not layers or layers[-1][0] != "bayes":
        return None
    return prefix, layers


def bayes_stack_forward(prefix, layers, params: dict, x: torch.Tensor, noises) -> torch.Tensor:
    """The forward pass of a Bayesian linear stack (:func:`bayes_linear_stack`) on functional parameters:
    ``BayesLinear``'s local reparameterisation written out, with each Bayesian layer's standard-normal noise
    ``noises[j]`` given (shaped like its output; ``noises`` None: the means, as under ``deterministic``)."""
    h = x
    for module in prefix:
        h = module(h)
    j = 0
    for kind, item, bias in layers:
        if kind == "act":
            h = item(h)
            continue
        w_mu, b_mu = params[item + ".weight_mu"], params[item + ".bias_mu"] if bias else None
        if noises is None:
            h = F.linear(h, w_mu, b_mu)
            continue
        w_var = softplus(params[item + ".weight_rho"]) ** 2
        b_var = softplus(params[item + ".bias_rho"]) ** 2 if bias else None
        mean = F.linear(h, w_mu, b_mu)
        var = F.linear(h * h, w_var, b_var)
        h = mean + torch.sqrt(var.clamp_min(_VAR_FLOOR)) * noises[j]
        j += 1
    return h


class BayesPerExampleGradients:
    """Per-example cross-entropy gradients of a Bayesian linear stack's variational parameters (mu and rho), for
    chunks of clients: :class:`privfl.training.stacked.PerExampleGradients`' interface, with each example's weight
    noise given (:meth:`noise`: independent per example, as vmap's ``randomness="different"`` draws it)."""

    #: every example's gradient is materialised (no ghost form)
    stack = None

    def __init__(self, model: nn.Module):
        stack = bayes_linear_stack(model)
        if stack is None:
            raise ConfigurationError("a Bayesian model's per-example gradients need a stack of BayesLinear layers "
                                     "(local reparameterisation) and elementwise activations: the built-in mlp, or "
                                     "your model written as an nn.Sequential of nn.Linear layers and elementwise "
                                     "activations (after an optional nn.Flatten or nn.AvgPool2d)")
        self.prefix, self.layers = stack
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]
        shapes = dict(model.named_parameters())
        self.outs = [shapes[item + ".weight_mu"].shape[0] for kind, item, _ in self.layers if kind == "bayes"]
        self._grads = vmap(vmap(grad(self._loss, has_aux=True), in_dims=(None, 0, 0, 0)), in_dims=(0, 0, 0, 0))

    def _loss(self, params, x, y, noises):
        loss = F.cross_entropy(bayes_stack_forward(self.prefix, self.layers, params, x.unsqueeze(0), noises),
                               y.unsqueeze(0))
        return loss, loss.detach()

    def noise(self, generators: Sequence[torch.Generator], width: int) -> list[torch.Tensor]:
        """Each client's weight noise for a lot of ``width`` (padded) examples: per Bayesian layer, (width, 1, out)
        from its generator, in layer order; stacked over the clients."""
        draws = [[torch.randn((width, 1, w), generator=g) for w in self.outs] for g in generators]
        return [torch.stack([d[j] for d in draws]) for j in range(len(self.outs))]

    def __call__(self, params: dict, xb: torch.Tensor, yb: torch.Tensor, weight: torch.Tensor, noises
                 ) -> PerExampleTerms:
        per_example, losses = self._grads(params, xb, yb, noises)
        return PerExampleTerms(self.names, losses, per_example=per_example)


class VectorisedHBFL:
    """:func:`train_meme_and_local` for a chunk of clients at once, with ``torch.func``.

    The clients of one chunk share a lot source (record count without DP; DP-SGD's schedule with it, its Poisson
    lots padded with zero-weight rows). The meme is a Bayesian linear stack run functionally (:meth:`meme_forward`,
    ``BayesLinear``'s local reparameterisation written out) on stacked parameters, with each client's weight noise
    passed in: drawn from a generator holding the global torch state the per-client step would draw from (after the
    client's seed and its local model's first build), in the same shapes and order (one (batch, out) draw per layer
    per forward; for per-example gradients, vmap's ``randomness="different"`` draw of (batch, 1, out)). Adam
    (:func:`privfl.training.stacked.adam_step`), or plain SGD (:func:`privfl.training.stacked.sgd_step`), updates the
    memes; the local models, grouped by architecture, take masked SGD steps (``sgd_step``: a client whose lot is empty
    skips its step, as the per-client loop does) and are written back to their modules.

    ``meme``: the meme forked from the global posterior (every client's start); the other arguments are
    :func:`train_meme_and_local`'s.
    """

    def __init__(self, meme: nn.Module, *, temperature: float, meme_lr: float, meme_optimizer: str, lr: float,
                 momentum: float, distill_weight: float, distill_temperature: float):
        self.prefix, self.layers = bayes_linear_stack(meme)
        self.meme = meme
        self.temperature, self.meme_lr, self.meme_optimizer = float(temperature), float(meme_lr), meme_optimizer
        self.lr, self.momentum = float(lr), float(momentum)
        self.distill_weight, self.distill_temperature = float(distill_weight), float(distill_temperature)
        self.names = [n for n, _ in self.meme.named_parameters()]
        self.start = {n: p.detach().clone() for n, p in self.meme.named_parameters()}
        self.dim = sum(p.numel() for p in self.start.values())
        self._meme_grad = vmap(grad(self._meme_loss, has_aux=True), in_dims=(0, 0, 0, 0, None))
        self._example_grads = vmap(vmap(grad(self._example_loss), in_dims=(None, 0, 0, 0)))
        self._reg_grad = vmap(grad(self._regulariser), in_dims=(0, None))
        self._local_grads: dict[str | int, object] = {}

    # -- the meme, functionally ------------------------------------------------------------------------------------

    def meme_forward(self, params: dict, x: torch.Tensor, noises) -> torch.Tensor:
        """``BayesLinear.forward`` of every layer (``noises`` None: the means, as under ``deterministic``)."""
        return bayes_stack_forward(self.prefix, self.layers, params, x, noises)

    def _regulariser(self, params: dict, reg_size: int) -> torch.Tensor:
        """:func:`meme_regulariser` on functional parameters."""
        total = None
        for kind, item, bias in self.layers:
            if kind != "bayes":
                continue
            for g in ("weight", "bias") if bias else ("weight",):
                part = -torch.log(softplus(params[f"{item}.{g}_rho"])).sum()
                total = part if total is None else total + part
        return total * (self.temperature / reg_size)

    def _meme_loss(self, params, x, y, noises, reg_size):
        loss = F.cross_entropy(self.meme_forward(params, x, noises), y) + self._regulariser(params, reg_size)
        return loss, loss.detach()

    def _example_loss(self, params, x, y, noises):
        return F.cross_entropy(self.meme_forward(params, x.unsqueeze(0), noises), y.unsqueeze(0))

    def _noise_shapes(self) -> list[int]:
        """The output size of every Bayesian layer, in forward order (the last dimension of its weight noise)."""
        return [self.start[item + ".weight_mu"].shape[0] for kind, item, _ in self.layers if kind == "bayes"]

    # -- the local models ------------------------------------------------------------------------------------------

    def _local_step_fn(self, arch: str | int, template: nn.Module):
        if arch not in self._local_grads:
            a, tau = self.distill_weight, self.distill_temperature

            def loss(params, x, y, teacher, weight, count):
                logits = functional_call(template, params, (x,))
                ce = (F.cross_entropy(logits, y, reduction="none") * weight).sum() / count
                log_student = F.log_softmax(logits / tau, dim=1)
                kl = (F.kl_div(log_student, teacher, reduction="none").sum(1) * weight).sum() / count * tau ** 2
                total = a * ce + (1.0 - a) * kl
                return total, total.detach()

            self._local_grads[arch] = vmap(grad(loss, has_aux=True))
        return self._local_grads[arch]

    # -- a chunk -------------------------------------------------------------------------------------------------

    def _chunk(self, per_example: bool, batch: float) -> int:
        """Clients per chunk: the meme's parameters, gradients and Adam moments, and one lot's (of about ``batch``
        records) per-example gradients or activations, within the budget."""
        if per_example:
            per_client = 4 * self.dim * (batch + 4)
        else:
            width = max(p.shape[0] + p.shape[-1] for p in self.start.values() if p.dim() == 2)
            per_client = 4 * (4 * self.dim + 4 * batch * width)
        return max(1, int(4 * DEFAULT_MEMORY_BUDGET // per_client))

    def train(self, data: Sequence[tuple[torch.Tensor, torch.Tensor]], lots, locals_: Sequence[nn.Module],
              arch_of: Sequence[str | int], generators: Sequence[torch.Generator]
              ) -> Iterator[tuple[int, nn.Module, float | None, float]]:
        """Train a chunk: client r's records ``data[r]``, its local model ``locals_[r]`` (architecture
        ``arch_of[r]``; trained in place), its weight-noise generator ``generators[r]``; ``lots`` their lot source.
        Yields ``(r, meme, meme_loss, local_loss)``: the meme module holding client r's trained parameters (one
        module, reloaded for each client: read it before the next), and the losses :func:`train_meme_and_local`
        returns."""
        c = len(data)
        params = {n: p.unsqueeze(0).repeat(c, *([1] * p.dim())) for n, p in self.start.items()}
        local_groups: dict[str | int, list[int]] = {}
        for r, arch in enumerate(arch_of):
            local_groups.setdefault(arch, []).append(r)
        local_params = {arch: {n: torch.stack([dict(locals_[r].named_parameters())[n].detach() for r in rows])
                               for n, _ in locals_[rows[0]].named_parameters()}
                        for arch, rows in local_groups.items()}
        local_bufs: dict[str | int, dict | None] = {arch: None for arch in local_groups}
        adam = None
        meme_loss = [0.0] * c
        local_loss = [0.0] * c
        outs = self._noise_shapes()
        for idx in lots:
            width = max(len(i) for i in idx)
            counts = torch.tensor([len(i) for i in idx], dtype=torch.float32)
            x0, y0 = data[0]
            xb = torch.zeros(c, width, *x0.shape[1:], dtype=x0.dtype)
            yb = torch.zeros(c, width, dtype=y0.dtype)
            weight = torch.zeros(c, width)
            for r, ((x, y), i) in enumerate(zip(data, idx)):
                if len(i):
                    t = torch.as_tensor(i, dtype=torch.long)
                    xb[r, :len(i)], yb[r, :len(i)], weight[r, :len(i)] = x[t], y[t], 1.0
            if lots.per_example:
                grads = self._privatised_gradients(params, xb, yb, idx, generators, lots, outs)
                reg = self._reg_grad(params, lots.reg_size)
                for name, g in reg.items():
                    grads[name] = grads[name] + g
            else:
                noises = self._batch_noises(generators, width, outs)
                grads, losses = self._meme_grad(params, xb, yb, noises, lots.reg_size)
                meme_loss = losses.tolist()
            if self.meme_optimizer == "adam":
                adam = adam_step(params, grads, adam, lr=self.meme_lr)
            else:
                sgd_step(params, grads, None, lr=self.meme_lr, momentum=0.0)
            if width == 0:
                continue
            with torch.no_grad():
                teacher = torch.softmax(vmap(self.meme_forward, in_dims=(0, 0, None))(params, xb, None)
                                        / self.distill_temperature, dim=-1)
            active = counts > 0
            for arch, rows in local_groups.items():
                rows_t = torch.as_tensor(rows)
                step_fn = self._local_step_fn(arch, locals_[rows[0]])
                lp = local_params[arch]
                g, losses = step_fn(lp, xb[rows_t], yb[rows_t], teacher[rows_t], weight[rows_t],
                                    counts[rows_t].clamp_min(1.0))
                local_bufs[arch] = sgd_step(lp, g, local_bufs[arch], lr=self.lr, momentum=self.momentum,
                                            active=active[rows_t])
                for j, r in enumerate(rows):
                    if active[r]:
                        local_loss[r] = float(losses[j])
        with torch.no_grad():
            for arch, rows in local_groups.items():
                for j, r in enumerate(rows):
                    for name, p in locals_[r].named_parameters():
                        p.copy_(local_params[arch][name][j])
        for r in range(c):
            with torch.no_grad():
                for name, p in self.meme.named_parameters():
                    p.copy_(params[name][r])
            yield r, self.meme, (None if lots.per_example else meme_loss[r]), local_loss[r]

    @staticmethod
    def _batch_noises(generators, width: int, outs: list[int]) -> list[torch.Tensor]:
        """Each client's weight noise of one forward: a (batch, out) draw per layer, in layer order."""
        per_client = [[torch.randn((width, w), generator=g) for w in outs] for g in generators]
        return [torch.stack([draws[j] for draws in per_client]) for j in range(len(outs))]

    def _privatised_gradients(self, params, xb, yb, idx, generators, lots, outs):
        """Per-example gradients for every client of the chunk (each client's weight noise drawn as vmap's
        ``randomness="different"`` draws it), each client's rows privatised by the lot source."""
        c, width = yb.shape
        flat = torch.zeros(c, 0, self.dim)
        if width:
            noises = [torch.zeros(c, width, 1, w) for w in outs]
            for r, (g, i) in enumerate(zip(generators, idx)):
                if len(i):  # per-client: one vmapped draw per layer, (batch, 1, out), only on a non-empty batch
                    draws = [torch.randn((len(i), 1, w), generator=g) for w in outs]
                    for e, d in zip(noises, draws):
                        e[r, :len(i)] = d
            per_example = self._example_grads(params, xb, yb, noises)
            flat = torch.cat([per_example[n].reshape(c, width, -1) for n in self.names], dim=2)
        noisy = torch.stack([lots.privatise(r, flat[r, :len(i)]) for r, i in enumerate(idx)])
        grads, offset = {}, 0
        for n in self.names:
            k = self.start[n].numel()
            grads[n] = noisy[:, offset:offset + k].reshape(c, *self.start[n].shape)
            offset += k
        return grads


__all__ = ["BayesPerExampleGradients", "MiniBatchLoop", "MiniBatches", "VectorisedHBFL", "add_flat_gradient",
           "bayes_linear_stack", "bayes_stack_forward", "distillation_loss",
           "meme_regulariser", "train_meme_and_local"]
