"""The seed papers' networks, parameterised by input shape, each with a Bayesian twin (``bayesian=True``).

How the papers' text is read (privfl's reading, checked against the public code of FML, whose models HBFL says it
follows):

- ``MLP``: FOLA's MNIST net is 784-500-300-10 (Sec. V-B-1), the default here. HBFL's "MLP [6]" is McMahan et al.'s
  2NN, i.e. ``hidden=(200, 200)``. ReLU between layers; any input shape is flattened.
- ``LeNet5`` (HBFL [31]): conv 5x5 -> 6, ReLU, max-pool 2; conv 5x5 -> 16, ReLU, max-pool 2; FC 120, FC 84, FC out.
  No padding (16*5*5 = 400 features on 32x32 CIFAR; 16*4*4 on 28x28 MNIST).
- ``CNN1`` (HBFL Sec. 5.1): the same two 5x5 conv layers (6, 16 channels, each followed by 2x2 max-pool and ReLU)
  and two FC layers. The hidden width is not given; privfl uses 120, LeNet5's first FC width, since HBFL says
  LeNet5 and CNN1 "have the same convolution layers".
- ``CNN2`` (HBFL Sec. 5.1): 3x3 convs with 32 (pool, ReLU), 64 (pool, ReLU), 64 (ReLU) channels, then FC 64 and
  FC out (64*4*4 = 1024 features on CIFAR).

``padding="auto"`` keeps the papers' unpadded convolutions when the input is large enough (MNIST, CIFAR) and
otherwise pads each k x k convolution by k // 2 ("same"), so the nets also run on 8x8 digits; an input too small
even for that raises ``ModelConfigError``. For regression, ``num_classes`` is the output width (1).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
from torch import nn

from privfl.models.bayes import BayesConv2d, BayesLinear, deterministic, is_bayesian
from privfl.models.errors import ModelConfigError

_BAYES_OPTIONS = ("init_rho", "reparameterization")


def _layer_kit(bayesian: bool, bayes_kw: dict):
    if not bayesian:
        if bayes_kw:
            raise ModelConfigError(f"{sorted(bayes_kw)} apply to Bayesian models only (bayesian=True or "
                                   "make_bayesian_model)")
        return nn.Linear, nn.Conv2d
    unknown = sorted(set(bayes_kw) - set(_BAYES_OPTIONS))
    if unknown:
        raise ModelConfigError(f"unknown Bayesian layer options {unknown}; accepted: {list(_BAYES_OPTIONS)}")
    return functools.partial(BayesLinear, **bayes_kw), functools.partial(BayesConv2d, **bayes_kw)


def _check_classes(num_classes: object) -> int:
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise ModelConfigError(f"num_classes must be a positive int (1 for scalar regression), got {num_classes!r}")
    return num_classes


def _check_hidden(hidden: Sequence[int]) -> tuple[int, ...]:
    hidden = tuple(hidden)
    if not all(isinstance(h, int) and h >= 1 for h in hidden):
        raise ModelConfigError(f"hidden widths must be positive ints, got {hidden!r}")
    return hidden


class PrivflNet(nn.Module):
    """Base of privfl's networks: remembers ``input_shape`` and ``num_classes`` and offers ``deterministic()``."""

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.input_shape = tuple(int(s) for s in input_shape)
        self.num_classes = _check_classes(num_classes)

    @property
    def is_bayesian(self) -> bool:
        return is_bayesian(self)

    def deterministic(self):
        """Context manager: Bayesian layers use their means inside the block (no-op for a plain net)."""
        return deterministic(self)


def _mlp_layers(in_features: int, hidden: tuple[int, ...], out: int, linear) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [linear(width, h), nn.ReLU()]
        width = h
    layers.append(linear(width, out))
    return nn.Sequential(*layers)


class MLP(PrivflNet):
    """Fully connected ReLU net: in_features -> hidden... -> num_classes (FOLA: 784-500-300-10)."""

    def __init__(self, in_features: int | Sequence[int], hidden: Sequence[int] = (500, 300), num_classes: int = 10,
                 *, pool: int = 1, bayesian: bool = False, **bayes_kw) -> None:
        shape = (in_features,) if isinstance(in_features, int) else tuple(in_features)
        if not shape or not all(isinstance(s, int) and s >= 1 for s in shape):
            raise ModelConfigError(f"in_features must be a positive int or an input shape, got {in_features!r}")
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1:
            raise ModelConfigError(f"pool must be an integer >= 1, got {pool!r}")
        if pool > 1 and (len(shape) != 3 or shape[1] < pool or shape[2] < pool):
            raise ModelConfigError(f"pool={pool} needs an image input (C, H, W) at least {pool}x{pool}, got {shape}")
        super().__init__(shape, num_classes)
        linear, _ = _layer_kit(bayesian, bayes_kw)
        pooled = shape if pool == 1 else (shape[0], shape[1] // pool, shape[2] // pool)
        self.pool = pool
        self.in_features = math.prod(pooled)
        self.hidden = _check_hidden(hidden)
        self.net = _mlp_layers(self.in_features, self.hidden, self.num_classes, linear)
        if pool > 1:
            # A fixed, data-independent average pooling: fewer weights, so less DP noise in total (client-level DP
            # noise grows with the square root of the number of parameters).
            self.net = nn.Sequential(nn.AvgPool2d(pool), *self.net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BayesianMLP(MLP):
    """``MLP`` with mean-field Gaussian weights (Bayes-by-Backprop); ``init_rho``, ``reparameterization`` as in
    ``BayesLinear``."""

    def __init__(self, in_features: int | Sequence[int], hidden: Sequence[int] = (500, 300), num_classes: int = 10,
                 **bayes_kw) -> None:
        super().__init__(in_features, hidden, num_classes, bayesian=True, **bayes_kw)


# A conv trunk is a sequence of stages: ("conv", out_channels, kernel), ("pool",), ("relu",).
_Stage = tuple


def _trunk_output(hw: tuple[int, int], stages: Sequence[_Stage], padding: int | None) -> tuple[int, int] | None:
    """Spatial size after the trunk, or None if some stage would see an empty map. ``padding=None`` = k // 2."""
    h, w = hw
    for stage in stages:
        if stage[0] == "conv":
            k = stage[2]
            p = k // 2 if padding is None else padding
            h, w = h + 2 * p - k + 1, w + 2 * p - k + 1
        elif stage[0] == "pool":
            h, w = h // 2, w // 2
        if h < 1 or w < 1:
            return None
    return h, w


class _ConvNet(PrivflNet):
    stages: tuple[_Stage, ...] = ()
    default_hidden: tuple[int, ...] = ()

    def __init__(self, input_shape: Sequence[int], num_classes: int = 10, *, hidden: Sequence[int] | None = None,
                 padding: int | str = "auto", bayesian: bool = False, **bayes_kw) -> None:
        shape = tuple(input_shape)
        if len(shape) != 3 or not all(isinstance(s, int) and s >= 1 for s in shape):
            raise ModelConfigError(f"{type(self).__name__} needs an image input shape (C, H, W), got {input_shape!r}; "
                                   "load image data without flatten")
        super().__init__(shape, num_classes)
        linear, conv = _layer_kit(bayesian, bayes_kw)
        c, h, w = shape
        self.padding = self._resolve_padding(padding, (h, w))
        out_hw = _trunk_output((h, w), self.stages, None if self.padding == "same" else self.padding)
        trunk: list[nn.Module] = []
        channels = c
        for stage in self.stages:
            if stage[0] == "conv":
                k = stage[2]
                p = k // 2 if self.padding == "same" else self.padding
                trunk.append(conv(channels, stage[1], k, padding=p))
                channels = stage[1]
            elif stage[0] == "pool":
                trunk.append(nn.MaxPool2d(2))
            else:
                trunk.append(nn.ReLU())
        self.features = nn.Sequential(*trunk)
        self.hidden = _check_hidden(self.default_hidden if hidden is None else hidden)
        self.flat_features = channels * out_hw[0] * out_hw[1]
        self.classifier = _mlp_layers(self.flat_features, self.hidden, self.num_classes, linear)

    def _resolve_padding(self, padding: int | str, hw: tuple[int, int]) -> int | str:
        name = type(self).__name__
        if padding == "auto":
            if _trunk_output(hw, self.stages, 0) is not None:
                return 0
            padding = "same"
        if padding == "valid":
            padding = 0
        if padding != "same" and not (isinstance(padding, int) and padding >= 0):
            raise ModelConfigError(f"padding must be 'auto', 'valid', 'same' or a non-negative int, got {padding!r}")
        if _trunk_output(hw, self.stages, None if padding == "same" else padding) is None:
            raise ModelConfigError(f"{name} cannot run on {hw[0]}x{hw[1]} inputs with padding={padding!r}: a feature "
                                   "map would become empty; use a larger input, padding='same', or the MLP")
        return padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class LeNet5(_ConvNet):
    """LeNet-5 as in HBFL/FML: conv5-6, ReLU, pool, conv5-16, ReLU, pool, FC 120, FC 84, FC out."""

    stages = (("conv", 6, 5), ("relu",), ("pool",), ("conv", 16, 5), ("relu",), ("pool",))
    default_hidden = (120, 84)


class CNN1(_ConvNet):
    """HBFL's CNN1: conv5-6, pool, ReLU, conv5-16, pool, ReLU, FC 120 (privfl's choice), FC out."""

    stages = (("conv", 6, 5), ("pool",), ("relu",), ("conv", 16, 5), ("pool",), ("relu",))
    default_hidden = (120,)


class CNN2(_ConvNet):
    """HBFL's CNN2: conv3-32, pool, ReLU, conv3-64, pool, ReLU, conv3-64, ReLU, FC 64, FC out."""

    stages = (("conv", 32, 3), ("pool",), ("relu",), ("conv", 64, 3), ("pool",), ("relu",), ("conv", 64, 3),
              ("relu",))
    default_hidden = (64,)


MODELS = {"mlp": MLP, "lenet5": LeNet5, "cnn1": CNN1, "cnn2": CNN2}


def make_model(name: str, input_shape: Sequence[int], num_classes: int, *, bayesian: bool = False,
               **kw) -> PrivflNet:
    """Build ``name`` (``"mlp"``, ``"lenet5"``, ``"cnn1"``, ``"cnn2"``) for ``input_shape`` and ``num_classes``.

    ``kw``: ``hidden`` (all), ``pool`` (MLP: average-pool image inputs by this factor first), ``padding`` (conv
    nets), and with ``bayesian=True`` ``init_rho`` and
    ``reparameterization``.
    """
    key = str(name).lower()
    if key not in MODELS:
        raise ModelConfigError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    shape = (input_shape,) if isinstance(input_shape, int) else tuple(input_shape)
    if key == "mlp":
        if "padding" in kw:
            raise ModelConfigError("padding applies to the conv nets, not the MLP")
        if bayesian:
            return BayesianMLP(shape, num_classes=num_classes, **kw)
        return MLP(shape, num_classes=num_classes, **kw)
    return MODELS[key](shape, num_classes, bayesian=bayesian, **kw)


def make_bayesian_model(name: str, input_shape: Sequence[int], num_classes: int, **kw) -> PrivflNet:
    """``make_model`` with every Linear/Conv2d replaced by ``BayesLinear``/``BayesConv2d``."""
    return make_model(name, input_shape, num_classes, bayesian=True, **kw)


__all__ = ["BayesianMLP", "CNN1", "CNN2", "LeNet5", "MLP", "MODELS", "PrivflNet", "make_bayesian_model",
           "make_model"]
