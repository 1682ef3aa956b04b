"""The user's own networks for the algorithms that train one per client or learn a posterior over one (FOLA, HBFL,
FedBNN): one ``nn.Module`` (copied, never trained in place) or zero-argument factory, or a sequence of them cycled
over the clients, each checked against the task's public input shape and class count before anything trains."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from privfl.errors import ConfigurationError
from privfl.training.local import UserTraining


def user_model_factories(model, algorithm: str, *, many: bool) -> tuple[Callable[[], nn.Module], ...] | None:
    """``model`` (a module or factory, or with ``many`` a list or tuple of them) as zero-argument factories; None
    when ``model`` is None. A module is deep-copied by its factory, so the user's module is never changed."""
    if model is None:
        return None
    items = list(model) if many and isinstance(model, (list, tuple)) else [model]
    if not items:
        raise ConfigurationError(f"{algorithm}: model is an empty list; give one module (or factory) per client, "
                                 "cycled over the clients, or one for all")
    if not many and isinstance(model, (list, tuple)):
        raise ConfigurationError(f"{algorithm}: model must be one torch.nn.Module or factory (every client trains a "
                                 f"copy of it), got a {type(model).__name__}")
    return tuple(UserTraining.of(algorithm, m).model for m in items)


def check_user_model(net: nn.Module, input_shape: Sequence[int], num_classes: int, algorithm: str) -> nn.Module:
    """``net`` if it has trainable parameters and maps one example of ``input_shape`` to ``num_classes`` logits;
    else a :class:`ConfigurationError` that says what to change."""
    if not any(p.requires_grad for p in net.parameters()):
        raise ConfigurationError(f"{algorithm}: the model has no trainable parameters")
    shape = (1, *input_shape)
    was_training = net.training
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # a probe: the run's generator must not move
            net.eval()
            out = net(torch.zeros(shape))
    except Exception as exc:  # the user's forward on the data's input shape: say what it was fed
        raise ConfigurationError(f"{algorithm}: the model failed on an input of shape {shape} (one example of the "
                                 f"clients' data): {type(exc).__name__}: {exc}") from None
    finally:
        net.train(was_training)
    width = int(out.reshape(1, -1).shape[1]) if isinstance(out, torch.Tensor) else -1
    if width != num_classes:
        raise ConfigurationError(f"{algorithm}: the model outputs {width} values per example but the data has "
                                 f"{num_classes} classes; make its last layer output {num_classes} logits")
    return net


__all__ = ["check_user_model", "user_model_factories"]
