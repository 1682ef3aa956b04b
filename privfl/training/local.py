"""Local optimisation and evaluation helpers shared by the algorithms (plain torch, CPU or GPU), and the user's own
training objects: a model (or a zero-argument factory), a loss and an optimizer factory (:class:`UserTraining`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
import torch
from torch import nn

from privfl.errors import ConfigurationError, UsageError


def torch_generator(rng: np.random.Generator) -> torch.Generator:
    """A torch generator seeded from a numpy generator, so a run is reproducible from one seed."""
    g = torch.Generator()
    g.manual_seed(int(rng.integers(0, 2 ** 63 - 1)))
    return g


def batches(n: int, batch_size: int, rng: np.random.Generator):
    """Shuffled index batches covering range(n) once."""
    order = rng.permutation(n)
    for start in range(0, n, batch_size):
        yield order[start:start + batch_size]


class TaskLoss(nn.Module):
    """A criterion applied to (outputs, targets) with regression targets shaped like the outputs (a scalar target of
    shape (n,) meets a model output of shape (n, 1)).

    ``reduction`` is opacus's switch: ``"mean"`` (the default) returns the criterion's batch loss; ``"none"``, which
    opacus's ``DPLossFastGradientClipping`` sets, returns one loss per example, shape (batch,), by calling the
    criterion with its own ``reduction="none"`` and averaging any further dimensions of an example. DP-SGD clips each
    example's gradient of that per-example loss, so a criterion without a ``reduction`` switch is refused there.
    """

    def __init__(self, criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.criterion = criterion
        self.reduction = "mean"

    @property
    def per_example(self) -> bool:
        """Whether the criterion can give one loss per example (a torch loss module, or anything with ``reduction``)."""
        return hasattr(self.criterion, "reduction")

    def require_per_example(self, algorithm: str) -> None:
        """Refuse a criterion that cannot give per-example losses (DP-SGD needs them), saying what to pass."""
        if not self.per_example:
            raise UsageError(f"{algorithm} clips each example's gradient, so the loss must give one loss per "
                                     "example: pass a torch loss module (e.g. nn.CrossEntropyLoss(), nn.MSELoss()) or "
                                     "an object with a `reduction` attribute that honours 'none'")

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if y.is_floating_point() and y.shape != out.shape and y.numel() == out.numel():
            y = y.reshape(out.shape)
        if self.reduction == "mean":
            return self.criterion(out, y)
        if self.reduction != "none":
            raise UsageError(f"loss reduction must be 'mean' or 'none', got {self.reduction!r}")
        self.require_per_example("DP-SGD")
        old = self.criterion.reduction
        self.criterion.reduction = "none"
        try:
            per = self.criterion(out, y)
        finally:
            self.criterion.reduction = old
        if per.ndim == 0 or per.shape[0] != out.shape[0]:
            raise UsageError(f"the loss with reduction='none' returned shape {tuple(per.shape)}; DP-SGD needs "
                                     f"one loss per example (a first dimension of {out.shape[0]})")
        return per.reshape(per.shape[0], -1).mean(dim=1)


def default_loss(task: str) -> nn.Module:
    """Cross-entropy on logits for classification, mean squared error for regression."""
    return nn.MSELoss() if task == "regression" else nn.CrossEntropyLoss()


def _zero_arg_factory(model, what: str) -> Callable[[], nn.Module]:
    if isinstance(model, nn.Module):
        return lambda: copy.deepcopy(model)
    if callable(model):
        def build() -> nn.Module:
            try:
                net = model()
            except TypeError as exc:
                raise ConfigurationError(f"{what}: the model factory must take no arguments ({exc}); pass an "
                                         "nn.Module or e.g. lambda: MyNet(30, 2)") from None
            if not isinstance(net, nn.Module):
                raise ConfigurationError(f"{what}: the model factory returned a {type(net).__name__}, not a "
                                         "torch.nn.Module")
            return net
        return build
    raise ConfigurationError(f"{what}: model must be a torch.nn.Module or a zero-argument function returning one, "
                             f"got {type(model).__name__}")


@dataclass(frozen=True, eq=False)
class UserTraining:
    """The user's own training objects, for an algorithm that trains a model locally (FedAvg and its family).

    - ``model``: an ``nn.Module`` (copied: the user's module is never trained in place) or a zero-argument factory;
      None uses the built-in architecture of ``FederationConfig.model``.
    - ``loss``: ``criterion(outputs, targets)`` returning the batch's mean loss; None is cross-entropy on logits for
      classification and mean squared error for regression. Under DP-SGD it must also give per-example losses
      (a torch loss module does; :class:`TaskLoss`).
    - ``optimizer``: ``factory(parameters) -> torch.optim.Optimizer``, e.g. ``lambda p: torch.optim.Adam(p, 1e-3)``
      (a fresh optimizer per client and round: optimizer state is local); None is SGD with the configured lr and
      momentum.
    - ``metrics``: extra test metrics, name -> ``fn(y_true, scores)`` where scores are class probabilities (n, C) for
      classification and predictions for regression.
    """

    model: Callable[[], nn.Module] | None = None
    loss: Callable | None = None
    optimizer: Callable | None = None
    metrics: Mapping[str, Callable] = field(default_factory=dict)

    @classmethod
    def of(cls, algorithm: str, model=None, loss=None, optimizer=None, metrics=None) -> "UserTraining":
        """Validate what the user passed to ``algorithm`` (clear errors that name the argument)."""
        factory = None if model is None else _zero_arg_factory(model, algorithm)
        if loss is not None and not callable(loss):
            raise ConfigurationError(f"{algorithm}: loss must be callable as loss(outputs, targets), e.g. "
                                     f"nn.CrossEntropyLoss(); got {type(loss).__name__}")
        if isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigurationError(f"{algorithm}: optimizer must be a factory of parameters, not an optimizer "
                                     "bound to one model's parameters (each client trains its own copy): pass e.g. "
                                     "lambda params: torch.optim.Adam(params, lr=1e-3)")
        if optimizer is not None and not callable(optimizer):
            raise ConfigurationError(f"{algorithm}: optimizer must be a factory, e.g. lambda params: "
                                     f"torch.optim.Adam(params, lr=1e-3); got {type(optimizer).__name__}")
        metrics = dict(metrics or {})
        bad = [str(k) for k, fn in metrics.items() if not isinstance(k, str) or not callable(fn)]
        if bad:
            raise ConfigurationError(f"{algorithm}: metrics must map names to functions fn(y_true, scores); check "
                                     f"{bad}")
        return cls(factory, loss, optimizer, metrics)

    @property
    def custom_step(self) -> bool:
        """Whether the local step differs from the default (SGD on the task's default loss)."""
        return self.loss is not None or self.optimizer is not None

    def criterion(self, task: str) -> TaskLoss:
        return TaskLoss(default_loss(task) if self.loss is None else self.loss)

    def make_optimizer(self, params, lr: float, momentum: float) -> torch.optim.Optimizer:
        params = list(params)
        if self.optimizer is None:
            return torch.optim.SGD(params, lr=lr, momentum=momentum)
        opt = self.optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigurationError(f"the optimizer factory returned a {type(opt).__name__}, not a "
                                     "torch.optim.Optimizer")
        return opt


def train_epochs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, batch_size: int, lr: float,
                 momentum: float, rng: np.random.Generator,
                 extra_loss: Callable[[nn.Module], torch.Tensor] | None = None,
                 loss: Callable | None = None, optimizer: Callable | None = None) -> float:
    """Mini-batch training (+ ``extra_loss``, e.g. FedProx's proximal term). Returns the last epoch's mean loss.

    ``loss``: the criterion (default: cross-entropy for integer labels, mean squared error for float targets);
    ``optimizer``: a factory of parameters (default: SGD with ``lr`` and ``momentum``)."""
    criterion = TaskLoss(loss if loss is not None else default_loss(
        "regression" if y.is_floating_point() else "classification"))
    opt = UserTraining(optimizer=optimizer).make_optimizer(model.parameters(), lr, momentum)
    model.train()
    last = torch.zeros(())
    for _ in range(epochs):
        total, seen = torch.zeros(()), 0
        for idx in batches(len(x), batch_size, rng):
            idx_t = torch.as_tensor(idx)
            opt.zero_grad(set_to_none=True)
            value = criterion(model(x[idx_t]), y[idx_t])
            if extra_loss is not None:
                value = value + extra_loss(model)
            value.backward()
            opt.step()
            total += value.detach() * len(idx)  # a tensor: no host sync per batch
            seen += len(idx)
        last = total / max(seen, 1)
    return float(last)


@torch.no_grad()
def predict_outputs(model: nn.Module, x: torch.Tensor, batch_size: int = 1024) -> np.ndarray:
    """The model's raw outputs (predictions of a regression model), in evaluation mode."""
    model.eval()
    out = [model(x[i:i + batch_size]) for i in range(0, len(x), batch_size)]
    return torch.cat(out).double().numpy()


@torch.no_grad()
def predict_proba(model: nn.Module, x: torch.Tensor, batch_size: int = 1024) -> np.ndarray:
    model.eval()
    out = [torch.softmax(model(x[i:i + batch_size]), dim=1) for i in range(0, len(x), batch_size)]
    return torch.cat(out).double().numpy()


def flat_parameters(model: nn.Module) -> np.ndarray:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().double().numpy()


def load_flat_parameters(model: nn.Module, vector: np.ndarray) -> None:
    """Set ``model``'s parameters from a flat vector, copied: training the model never writes into the caller's
    array (a float32 array would otherwise share its memory with the parameters)."""
    torch.nn.utils.vector_to_parameters(torch.tensor(vector, dtype=torch.float32), model.parameters())
