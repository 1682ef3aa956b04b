"""Local optimisation and evaluation helpers shared by the algorithms (plain torch, CPU or GPU)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn


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


def train_epochs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, batch_size: int, lr: float,
                 momentum: float, rng: np.random.Generator,
                 extra_loss: Callable[[nn.Module], torch.Tensor] | None = None) -> float:
    """Plain mini-batch SGD on cross-entropy (+ ``extra_loss``, e.g. FedProx's proximal term). Returns the last
    epoch's mean loss."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    model.train()
    last = torch.zeros(())
    for _ in range(epochs):
        total, seen = torch.zeros(()), 0
        for idx in batches(len(x), batch_size, rng):
            idx_t = torch.as_tensor(idx)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x[idx_t]), y[idx_t])
            if extra_loss is not None:
                loss = loss + extra_loss(model)
            loss.backward()
            opt.step()
            total += loss.detach() * len(idx)  # a tensor: no host sync per batch
            seen += len(idx)
        last = total / max(seen, 1)
    return float(last)


@torch.no_grad()
def predict_proba(model: nn.Module, x: torch.Tensor, batch_size: int = 1024) -> np.ndarray:
    model.eval()
    out = [torch.softmax(model(x[i:i + batch_size]), dim=1) for i in range(0, len(x), batch_size)]
    return torch.cat(out).double().numpy()


def flat_parameters(model: nn.Module) -> np.ndarray:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().double().numpy()


def load_flat_parameters(model: nn.Module, vector: np.ndarray) -> None:
    torch.nn.utils.vector_to_parameters(torch.as_tensor(vector, dtype=torch.float32), model.parameters())
