"""One client's data in the forms a user has it, as ``(x, y)`` numpy arrays: a torch ``Dataset`` or ``DataLoader``,
an ``(x, y)`` pair of numpy arrays or tensors, a pandas DataFrame with a target column, or an ``ArrayDataset``.

Errors name the client and the form it was given in, never its values (an error message must not echo data).
pandas is duck-typed (a DataFrame is anything with ``columns``, ``drop`` and ``to_numpy``), so this module does not
need it installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from privfl.data.dataset import ArrayDataset
from privfl.data.errors import DatasetError

#: the forms :func:`as_arrays` accepts, for error messages
FORMS = ("a torch Dataset or DataLoader of (x, y) pairs", "an (x, y) pair of numpy arrays or tensors",
         "a pandas DataFrame with target='<column>'")


def _describe(value: Any) -> str:
    """The type and size of ``value``, never its contents."""
    kind = type(value).__name__
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"a {kind} of shape {tuple(shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {kind} of {len(value)} items"
    return f"a {kind}"


def _to_numpy(value: Any, what: str, part: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    elif hasattr(value, "to_numpy"):  # a pandas Series or DataFrame
        value = value.to_numpy()
    try:
        out = np.asarray(value)
    except (ValueError, TypeError):
        raise DatasetError(f"{what}: its {part} is {_describe(value)} that does not convert to one array") from None
    if out.dtype == object and part == "x":
        raise DatasetError(f"{what}: its {part} is {_describe(value)} of mixed or non-numeric values; give numbers "
                           "(one row per record)")
    return out


def _is_dataframe(value: Any) -> bool:
    return all(hasattr(value, a) for a in ("columns", "drop", "to_numpy", "dtypes"))


def _from_dataframe(table: Any, target: str | None, what: str) -> tuple[np.ndarray, np.ndarray]:
    if target is None:
        raise DatasetError(f"{what} is a DataFrame: name its target column with target='<column>'")
    if target not in table.columns:
        cols = [str(c) for c in table.columns]
        shown = ", ".join(cols[:12]) + (f", ... ({len(cols)} in all)" if len(cols) > 12 else "")
        raise DatasetError(f"target {target!r} is not a column of {what} (columns: {shown})")
    features = table.drop(columns=[target])
    # a table without rows has untyped columns but no value that could fail to be a number
    bad = [str(c) for c, dtype in zip(features.columns, features.dtypes)
           if len(table) and getattr(dtype, "kind", "O") not in "biuf"]
    if bad:
        raise DatasetError(f"{what}: feature columns {bad[:10]} are not numeric; encode them as numbers (or drop "
                           "them)")
    x = features.to_numpy(dtype=np.float32)
    y = table[target].to_numpy()
    if np.isnan(x).any() or (y.dtype.kind == "f" and np.isnan(y).any()):
        raise DatasetError(f"{what} has missing values; fill or drop them first")
    return x, y


def _from_torch_dataset(dataset: Any, what: str, allow_empty: bool = False) -> tuple[np.ndarray, np.ndarray]:
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) == 2:  # a TensorDataset: no per-item loop
        return _to_numpy(tensors[0], what, "x"), _to_numpy(tensors[1], what, "y")
    try:
        n = len(dataset)
    except TypeError:
        raise DatasetError(f"{what} is {_describe(dataset)} without a length; privfl needs a map-style Dataset "
                           "(with __len__ and __getitem__)") from None
    xs, ys = [], []
    for i in range(n):
        item = dataset[i]
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise DatasetError(f"{what}: item {i} is {_describe(item)}; each item must be an (x, y) pair")
        xs.append(_to_numpy(item[0], what, "x"))
        ys.append(_to_numpy(item[1], what, "y"))
    if not xs:
        if allow_empty:  # no item to read a shape from: the caller types it like the other clients' data
            return np.zeros((0,), dtype=np.float32), np.zeros((0,))
        raise DatasetError(f"{what} is empty")
    try:
        return np.stack(xs), np.stack(ys)
    except ValueError:
        raise DatasetError(f"{what}: its items have different shapes; every x must have one shape") from None


def as_arrays(value: Any, *, target: str | None = None, what: str = "the data",
              allow_empty: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` arrays from one client's data (see the module docstring); x has shape ``(n, *input_shape)`` (a
    1-D x becomes one feature per record). Data without records is refused unless ``allow_empty`` (a client whose
    data is removed under client-level neighbours: the caller gives it the other clients' shapes and types)."""
    from torch.utils.data import DataLoader, Dataset

    if isinstance(value, ArrayDataset):
        x, y = value.x, value.y
    elif isinstance(value, DataLoader):  # privfl draws its own batches (DP-SGD samples them): only the data is used
        x, y = _from_torch_dataset(value.dataset, what, allow_empty)
    elif isinstance(value, Dataset):
        x, y = _from_torch_dataset(value, what, allow_empty)
    elif _is_dataframe(value):
        x, y = _from_dataframe(value, target, what)
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        x, y = _to_numpy(value[0], what, "x"), _to_numpy(value[1], what, "y")
    else:
        raise DatasetError(f"{what} is {_describe(value)}; give {', '.join(FORMS[:-1])} or {FORMS[-1]}")
    if x.ndim == 1:
        x = x[:, None]
    if y.ndim == 2 and y.shape[1] == 1 and not np.issubdtype(y.dtype, np.floating):
        y = y[:, 0]
    if len(x) != len(y):
        raise DatasetError(f"{what}: x has {len(x)} records but y has {len(y)}")
    if not len(x) and not allow_empty:
        raise DatasetError(f"{what} is empty")
    if not len(x):
        return np.zeros(x.shape, dtype=np.float32), y
    if x.dtype.kind not in "biuf":
        raise DatasetError(f"{what}: x has dtype {x.dtype}; give numbers")
    return x.astype(np.float32, copy=False), y


__all__ = ["FORMS", "as_arrays"]
