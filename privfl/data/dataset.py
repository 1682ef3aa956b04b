"""In-memory data sets: ``ArrayDataset`` (one array pair) and ``FederatedData`` (client parts and a global test set)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import TensorDataset

from privfl.data.errors import DatasetError

TASKS = ("classification", "regression")


def _numbers(values: np.ndarray, dtype, what: str) -> np.ndarray:
    """``values`` as a contiguous array of ``dtype``; a :class:`DatasetError` counting the entries that are not numbers
    otherwise (numpy's own text would quote one of them: a record's value)."""
    try:
        return np.ascontiguousarray(values, dtype=dtype)
    except (ValueError, TypeError):
        bad = count_not_numbers(values)
        raise DatasetError(f"{what} has {bad} entr{'ies' if bad != 1 else 'y'} that are not numbers (the values are "
                           "not shown: they are the records' data); encode them as numbers") from None


def count_not_numbers(values) -> int:
    """How many entries of ``values`` cannot be read as a number."""
    bad = 0
    for v in np.asarray(values, dtype=object).reshape(-1):
        try:
            float(v)
        except (ValueError, TypeError):
            bad += 1
    return bad


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """Features ``x`` (float32, shape ``(n, *input_shape)``) and targets ``y``.

    Classification: ``y`` is int64 of shape ``(n,)`` with labels in ``[0, num_classes)``.
    Regression: ``y`` is float32 of shape ``(n,)`` or ``(n, k)``; ``num_classes`` is the output width (1 for a scalar
    target). ``target_offset`` and ``target_scale`` undo a standardisation of the targets: original units are
    ``y * target_scale + target_offset``, so an RMSE computed on ``y`` times ``target_scale`` is the RMSE in the
    data set's own units.
    """

    x: np.ndarray
    y: np.ndarray
    task: str
    num_classes: int
    name: str = "data"
    target_offset: float = 0.0
    target_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise DatasetError(f"task must be one of {TASKS}, got {self.task!r}")
        if not isinstance(self.x, np.ndarray) or not isinstance(self.y, np.ndarray):
            raise DatasetError("x and y must be numpy arrays")
        if self.x.ndim < 2:
            raise DatasetError(f"x must have shape (n, *input_shape), got {self.x.shape}; reshape a 1-D feature to "
                               "(n, 1)")
        if len(self.x) != len(self.y):
            raise DatasetError(f"x and y have different lengths ({len(self.x)} and {len(self.y)})")
        # the texts below name counts, never a record's value (the holder's data)
        x = _numbers(self.x, np.float32, f"{self.name}: x")
        if not np.all(np.isfinite(x)):
            raise DatasetError(f"{self.name}: x has non-finite values; clean or impute them before building a data set")
        if not isinstance(self.num_classes, (int, np.integer)) or self.num_classes < 1:
            raise DatasetError(f"num_classes must be a positive int, got {self.num_classes!r}")
        if self.task == "classification":
            if self.y.ndim != 1:
                raise DatasetError(f"classification labels must have shape (n,), got {self.y.shape}")
            if len(self.y) and not np.issubdtype(self.y.dtype, np.integer):
                labels = _numbers(self.y, np.float64, f"{self.name}: the classification labels")
                if not np.all(np.equal(np.mod(labels, 1), 0)):
                    raise DatasetError("classification labels must be integers")
            y = np.ascontiguousarray(self.y, dtype=np.int64)
            outside = int(np.count_nonzero((y < 0) | (y >= self.num_classes)))
            if outside:
                raise DatasetError(f"{self.name}: {outside} label{'s' if outside != 1 else ''} outside [0, "
                                   f"{self.num_classes}) (the values are not shown: they are the records' data); "
                                   f"labels are class indices 0..{self.num_classes - 1}: map them, or raise "
                                   "num_classes")
        else:
            if self.y.ndim not in (1, 2):
                raise DatasetError(f"regression targets must have shape (n,) or (n, k), got {self.y.shape}")
            y = _numbers(self.y, np.float32, f"{self.name}: the regression targets")
            if not np.all(np.isfinite(y)):
                raise DatasetError(f"{self.name}: y has non-finite values")
            if not (np.isfinite(self.target_scale) and self.target_scale > 0):
                raise DatasetError(f"target_scale must be positive and finite, got {self.target_scale}")
        object.__setattr__(self, "x", x)
        object.__setattr__(self, "y", y)
        object.__setattr__(self, "num_classes", int(self.num_classes))

    def __len__(self) -> int:
        return len(self.y)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def subset(self, indices: Sequence[int] | np.ndarray, name: str | None = None) -> "ArrayDataset":
        """The examples at ``indices`` (a copy), keeping task, classes and target scaling."""
        idx = np.asarray(indices)
        if idx.dtype == bool:
            raise DatasetError("subset takes integer indices, not a boolean mask; use np.flatnonzero(mask)")
        idx = idx.astype(np.int64, copy=False).reshape(-1)
        if len(idx) and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise DatasetError(f"subset indices out of range for a data set of {len(self)} examples")
        return ArrayDataset(self.x[idx], self.y[idx], self.task, self.num_classes, name or self.name,
                            self.target_offset, self.target_scale)

    def to_torch(self) -> TensorDataset:
        """A ``TensorDataset`` of (float32 features, int64 labels or float32 targets); shares memory with the arrays."""
        return TensorDataset(torch.from_numpy(self.x), torch.from_numpy(self.y))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) as torch tensors sharing memory with the arrays."""
        return torch.from_numpy(self.x), torch.from_numpy(self.y)

    def to_original_units(self, y: np.ndarray | float) -> np.ndarray:
        """Targets (or predictions) in the data set's own units: ``y * target_scale + target_offset``."""
        return np.asarray(y, dtype=np.float64) * self.target_scale + self.target_offset

    def label_counts(self) -> np.ndarray:
        """Examples per class, shape ``(num_classes,)`` (classification only)."""
        if self.task != "classification":
            raise DatasetError("label_counts is defined for classification data sets only")
        return np.bincount(self.y, minlength=self.num_classes)


@dataclass(frozen=True, eq=False)
class FederatedData:
    """A federation's data: one training ``ArrayDataset`` per client, a global test set, and optional validation and
    public alignment sets (FedBNN's unlabelled AD; its labels are kept for evaluation only).

    ``public`` is the public reference split: examples held by no client, on which public preprocessing statistics
    (the standardiser in ``info["standardizer"]``) are fitted, so that no client's data can change them. Every part
    here has been through the same per-record preprocessing.
    """

    train_parts: list[ArrayDataset]
    test: ArrayDataset
    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    val: ArrayDataset | None = None
    alignment: ArrayDataset | None = None
    public: ArrayDataset | None = None
    partition: str = ""
    seed: int | None = None
    info: dict = field(default_factory=dict)
    #: the public design size of a client's data set when the data declares one: a built-in benchmark's published
    #: training size over its number of clients (``make_federated``), or the user's own declaration. None: nothing
    #: declared it, and a private run must be given ``client_size`` (``privfl.core.public.PublicFacts.of``); it is never
    #: computed from the clients' record counts.
    design_size: int | None = None
    #: True when ``test`` is the clients' own held-out records (the split rule of ``privfl.data.own`` without a test
    #: set): client data kept for the simulation's evaluation only, never a public set. An algorithm that carves a
    #: public alignment or distillation set from the test set (FedBNN without ``alignment``) must refuse such data.
    test_from_clients: bool = False

    def __post_init__(self) -> None:
        if not self.train_parts:
            raise DatasetError("a federation needs at least one client part")
        extra = [d for d in (self.val, self.alignment, self.public) if d is not None]
        tasks = {p.task for p in self.train_parts} | {self.test.task} | {d.task for d in extra}
        if len(tasks) != 1:
            raise DatasetError(f"client parts and test, validation, alignment or public sets mix tasks "
                               f"{sorted(tasks)}")
        object.__setattr__(self, "input_shape", tuple(int(s) for s in self.input_shape))
        if self.design_size is not None:
            size = self.design_size
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
                raise DatasetError(f"design_size must be an integer >= 1, got {size!r}")
            object.__setattr__(self, "design_size", int(size))
        for part in [*self.train_parts, self.test, *extra]:
            if part.input_shape != self.input_shape:
                raise DatasetError(f"part {part.name!r} has input shape {part.input_shape}, expected "
                                   f"{self.input_shape}")

    @property
    def n_clients(self) -> int:
        return len(self.train_parts)

    @property
    def task(self) -> str:
        return self.test.task

    @property
    def client_sizes(self) -> np.ndarray:
        """n_k for each client (the weights q_k = n_k / n of HBFL and FOLA)."""
        return np.array([len(p) for p in self.train_parts], dtype=np.int64)

    @property
    def target_scale(self) -> float:
        """Multiply an RMSE on standardised targets by this to report it in original units."""
        return self.test.target_scale

    def label_histogram(self) -> np.ndarray:
        """Examples per (client, class), shape ``(n_clients, num_classes)`` (classification only)."""
        return np.stack([p.label_counts() for p in self.train_parts])

    def pooled_train(self) -> ArrayDataset:
        """All clients' training data in one set (for a centralised reference run)."""
        first = self.train_parts[0]
        return ArrayDataset(np.concatenate([p.x for p in self.train_parts]),
                            np.concatenate([p.y for p in self.train_parts]), first.task, first.num_classes,
                            f"{self.name}-pooled", first.target_offset, first.target_scale)


__all__ = ["ArrayDataset", "FederatedData", "TASKS"]
