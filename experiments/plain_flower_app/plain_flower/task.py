"""The model, the data and the local training, shared by the ServerApp and the ClientApp."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def widths(text: str) -> list[int]:
    """Hidden-layer widths from the run config's comma-separated string."""
    return [int(w) for w in str(text).replace(" ", "").split(",") if w]


def build_model(in_features: int, hidden: list[int], num_classes: int) -> nn.Module:
    """Flatten, then Linear + ReLU per hidden width, then a Linear to the classes."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def load_partition(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This SuperNode's training data: an .npz holding ``x`` (features) and ``y`` (integer labels)."""
    with np.load(path, allow_pickle=False) as f:
        x = np.asarray(f["x"], dtype=np.float32)
        y = np.asarray(f["y"], dtype=np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def train(net: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, batch_size: int, lr: float,
          momentum: float, generator: torch.Generator) -> float:
    """Mini-batch SGD on cross-entropy, a fresh shuffle per epoch; returns the last epoch's mean loss."""
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    net.train()
    mean = torch.zeros(())
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        total = torch.zeros(())
        for start in range(0, len(x), batch_size):
            idx = order[start:start + batch_size]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += loss.detach() * len(idx)
        mean = total / max(len(x), 1)
    return float(mean)
