"""The Gaussian mechanism: add N(0, (noise_multiplier * sensitivity)^2) to each coordinate.

It returns the noisy value together with its privacy event and never calls an accountant itself (TF Privacy's
dp_query habit); the caller (privfl's release pipeline) charges the event in the ledger *before* calling
:meth:`GaussianMechanism.release`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..accounting.events import GaussianEvent
from .clipping import check_finite
from .errors import InvalidRelease
from .noise import NoiseSource, as_noise_source


def gaussian_noise(shape, std: float, source: NoiseSource | np.random.Generator | int | str,
                   symmetric: bool = False) -> np.ndarray:
    """N(0, std^2) noise of ``shape``. ``symmetric``: for a square matrix, draw the upper triangle and mirror it
    (Analyze Gauss, Dwork et al. 2014), so a symmetric statistic gets noise of the same std on every entry."""
    src = as_noise_source(source)
    shape = tuple(shape)
    if not symmetric:
        noise = np.asarray(src.standard_normal(shape), dtype=np.float64)  # a fresh draw (NoiseSource's contract)
        if not noise.flags.writeable:
            noise = noise.copy()
        noise *= std  # in place: an upload-sized temporary is not free
        return noise
    if len(shape) != 2 or shape[0] != shape[1]:
        raise InvalidRelease(f"symmetric noise needs a square matrix, got shape {shape}")
    iu = np.triu_indices(shape[0])
    out = np.zeros(shape)
    out[iu] = std * src.standard_normal(len(iu[0]))
    return out + np.triu(out, 1).T


@dataclass(frozen=True)
class GaussianMechanism:
    """Gaussian noise calibrated to an L2 sensitivity; ``noise_std = noise_multiplier * sensitivity``."""

    sensitivity: float
    noise_multiplier: float

    def __post_init__(self):
        for name in ("sensitivity", "noise_multiplier"):
            value = getattr(self, name)
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise InvalidRelease(f"{name} must be a number, got {value!r}") from None
            if not math.isfinite(value) or value <= 0:
                raise InvalidRelease(f"{name} must be a finite number > 0, got {value!r}")
            object.__setattr__(self, name, value)

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * self.sensitivity

    @property
    def event(self) -> GaussianEvent:
        return GaussianEvent(self.sensitivity, self.noise_std)

    def noise(self, shape, source: NoiseSource | np.random.Generator | int | str, symmetric: bool = False
              ) -> np.ndarray:
        """Draw the noise alone (for central placement); see :func:`gaussian_noise`."""
        return gaussian_noise(shape, self.noise_std, source, symmetric)

    def release(self, value, source: NoiseSource | np.random.Generator | int | str, symmetric: bool = False
                ) -> tuple[np.ndarray, GaussianEvent]:
        """Return (value + noise, event). ``value`` must be finite; its clip is the caller's responsibility."""
        arr = check_finite("value", value)
        return arr + self.noise(arr.shape, source, symmetric), self.event
