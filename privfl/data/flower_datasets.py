"""Organisations' data through Flower Datasets (``flwr-datasets``; the optional extra ``privfl[flower-datasets]``).

Where a Flower ClientApp takes a data file (a SuperNode's ``data-path``, the Simulation Engine's
``data-path-template``, the ServerApp's ``test-path``), it also takes a Flower Datasets source written as::

    flwr-datasets:DATASET?y=label&x=f0,f1,f2&split=train&partitioner=iid&data_files=/data/org0.csv

``DATASET`` is what Flower's ``FederatedDataset(dataset=...)`` loads: a Hugging Face dataset the organisation has (in
its local cache, or on the hub where it may reach it), or one of the ``datasets`` library's file builders (``csv``,
``json``, ``parquet``, with ``data_files``). The options:

- ``y``: the column of labels (classification) or targets (regression); default ``label``;
- ``x``: the feature columns, comma-separated (stacked into one vector per record), or one column of arrays or
  images (PIL images become float arrays scaled to [0, 1], with a leading channel axis for a grey-scale image);
  default every column but ``y``;
- ``split``: default ``train``;
- ``partitioner``: ``none`` (default) keeps the whole split, what an organisation of a real deployment loads (its
  own data); ``iid`` or ``dirichlet:ALPHA`` (over ``y``) cut it into the run's client count and keep this node's
  ``partition-id``, what the Simulation Engine's virtual organisations do (Flower's ``IidPartitioner`` and
  ``DirichletPartitioner``, seeded by ``seed``, default Flower's 42: a public fact of the run);
- every other option is a keyword of ``datasets.load_dataset`` (``data_files``, ``name``, ``revision``, ...).

Nothing here is released or read by the server: a partition is the organisation's own data, as a data file is, and
the run's public facts (input shape, classes, design size) still come from the spec, which every loaded partition is
checked against.

A record the run cannot use (a feature or target that is not a number, not finite in float32, a class label that is
not an integer in ``[0, num_classes)``, features of another shape than the run's) is left out, one record at a time,
with a warning in the organisation's own log that shows no value (:func:`usable_records`); it never fails the load. A
failure that one record can cause would tell the server, which sees an error instead of a release, whether that
record is there (a review found exactly that on the ClientApp: one record with a feature of 1e39 or a label outside
the spec's classes turned a charged release into an uncharged error reply). Leaving records out one by one maps
neighbouring data sets to neighbouring data sets, so the run's guarantee holds for what is left. A split with no
record (an organisation whose data was removed) is an empty data set of the run's input shape.
"""

from __future__ import annotations

import logging
from urllib.parse import parse_qsl

import numpy as np

from privfl.errors import ConfigurationError

LOG = logging.getLogger("privfl.data")

PREFIX = "flwr-datasets:"
_OWN = {"x", "y", "split", "partitioner", "seed"}


def is_flower_dataset(path: str) -> bool:
    """Whether ``path`` names a Flower Datasets source rather than a file."""
    return isinstance(path, str) and path.startswith(PREFIX)


def parse(path: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """``(dataset, privfl's options, load_dataset keywords)`` of a ``flwr-datasets:`` source."""
    body = path[len(PREFIX):]
    dataset, _, query = body.partition("?")
    if not dataset:
        raise ConfigurationError(f"{path!r}: name the dataset after {PREFIX!r} (a Hugging Face dataset, or csv, json, "
                                 "parquet with data_files=...)")
    pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=False)
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ConfigurationError(f"{path!r}: option {twice[0]!r} is given twice")
    options = {k: v for k, v in pairs if k in _OWN}
    loading = {k: v for k, v in pairs if k not in _OWN}
    return dataset, options, loading


def _partitioner(spec: str, num_partitions: int, seed: int, y: str, path: str):
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    if spec == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if spec.startswith("dirichlet:"):
        try:
            alpha = float(spec.split(":", 1)[1])
        except ValueError:
            alpha = float("nan")
        if not alpha > 0 or not np.isfinite(alpha):
            raise ConfigurationError(f"{path!r}: partitioner=dirichlet:ALPHA needs a finite ALPHA > 0, got {spec!r}")
        return DirichletPartitioner(num_partitions=num_partitions, partition_by=y, alpha=alpha, seed=seed)
    raise ConfigurationError(f"{path!r}: partitioner must be none, iid or dirichlet:ALPHA, got {spec!r}")


def _record_array(value) -> np.ndarray | None:
    """One record's value as a float32 array (a PIL image scaled to [0, 1], channels first), or None when it is no
    number, array or image. A value beyond float32's range becomes inf (left out later), never an error."""
    if value is None:
        return None
    if hasattr(value, "convert") and hasattr(value, "size"):  # a PIL image
        out = np.asarray(value, dtype=np.float32) / 255.0
        return out[None] if out.ndim == 2 else np.moveaxis(out, -1, 0)
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError, OverflowError):
        return None


def _scalars(values, dtype=np.float64) -> np.ndarray:
    """A column of one number per record, NaN where a record holds anything else."""
    out = np.full(len(values), np.nan, dtype=dtype)
    for i, value in enumerate(values):
        if value is None or hasattr(value, "convert"):
            continue
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                a = np.asarray(value, dtype=dtype)
        except (TypeError, ValueError, OverflowError):
            continue
        if a.ndim == 0:
            out[i] = a
    return out


def _column(records, name: str, expected: tuple[int, ...] | None) -> np.ndarray:
    """One column of records as a float32 array of shape ``(n, *expected)``; a record whose value is no number, array
    or image, or has another shape than ``expected``, is a row of NaN (left out by :func:`usable_records`).
    ``expected`` None: the first usable record's shape."""
    arrays = [_record_array(v) for v in records[name]]
    arrays = [None if a is None else (a.reshape(1) if a.ndim == 0 else a) for a in arrays]
    if expected is None:
        expected = next((a.shape for a in arrays if a is not None), (1,))
    out = np.full((len(arrays), *expected), np.nan, dtype=np.float32)
    for i, a in enumerate(arrays):
        if a is not None and a.shape == tuple(expected):
            out[i] = a
    return out


def _as_numbers(values: np.ndarray, dtype) -> np.ndarray:
    """``values`` as ``dtype``, entry by entry: NaN where an entry is not a number (a string, a complex number with an
    imaginary part), inf where it is beyond the type's range."""
    values = np.asarray(values)
    if values.dtype.kind in "biuf":
        with np.errstate(over="ignore", invalid="ignore"):
            return values.astype(dtype)
    if values.dtype.kind == "c":
        with np.errstate(over="ignore", invalid="ignore"):
            return np.where(values.imag == 0, values.real, np.nan).astype(dtype)
    flat = values.reshape(-1)
    return _scalars(list(flat), dtype).reshape(values.shape)


def usable_records(x, y, task: str, num_classes: int, name: str = "data") -> tuple[np.ndarray, np.ndarray, int]:
    """``(x, y, left_out)``: the records of ``x`` and ``y`` a run can use, as float32 features and int64 class labels
    (classification) or float32 targets, and how many were left out: those with a feature that is not a number or not
    finite in float32 (1e39 is inf there), a target not finite in float32, or a class label that is not an integer in
    ``[0, num_classes)``. A per-record filter: it maps neighbouring data sets to neighbouring data sets (see the module
    docstring), so nothing about one record can fail the load. What the organisation sees is a warning in its own log
    (logger ``privfl.data``) that shows no value. The arrays' layout (``x`` at least 2-D, as many targets as records,
    targets of one or two axes) is the file's structure, not a record's: a wrong one raises
    :class:`privfl.data.errors.DatasetError`."""
    from privfl.data.errors import DatasetError

    x, y = np.asarray(x), np.asarray(y)
    if x.ndim < 2:
        raise DatasetError(f"{name}: x must have shape (n, *input_shape), got {x.shape}; reshape a 1-D feature to "
                           "(n, 1)")
    if len(x) != len(y):
        raise DatasetError(f"{name}: x and y hold different numbers of records")
    if task == "classification" and y.ndim != 1:
        raise DatasetError(f"{name}: classification labels must have shape (n,), got {y.shape[1:]} per record")
    if task != "classification" and y.ndim not in (1, 2):
        raise DatasetError(f"{name}: regression targets must have shape (n,) or (n, k)")
    n = len(x)
    features = _as_numbers(x, np.float32)
    keep = np.isfinite(features).all(axis=tuple(range(1, features.ndim)))
    if task == "classification":
        if y.dtype.kind in "biu":  # exact: no float rounding of large integers
            keep &= (y >= 0) & (y < num_classes)
            labels = np.where(keep, y, 0).astype(np.int64)
        else:
            values = _as_numbers(y, np.float64)
            with np.errstate(invalid="ignore"):
                keep &= np.isfinite(values) & (np.mod(values, 1) == 0) & (values >= 0) & (values < num_classes)
            labels = np.where(keep, values, 0).astype(np.int64)
    else:
        labels = _as_numbers(y, np.float32)
        keep &= np.isfinite(labels).all(axis=tuple(range(1, labels.ndim)))
    left_out = int(n - np.count_nonzero(keep))
    if left_out:
        LOG.warning("%s: %d record(s) left out: a feature or target that is not a finite number in float32, or a "
                    "class label that is not an integer in [0, %d) (the values are not shown; nothing of this "
                    "reaches the server)", name, left_out, num_classes)
    return np.ascontiguousarray(features[keep]), np.ascontiguousarray(labels[keep]), left_out


def load_partition(path: str, *, partition_id: int | None, num_partitions: int, task: str,
                   num_classes: int | None, name: str = "flower-datasets",
                   input_shape: tuple[int, ...] | None = None):
    """The records a ``flwr-datasets:`` source gives this organisation, as a :class:`privfl.data.ArrayDataset`
    (module docstring); ``partition_id`` (this node's) and ``num_partitions`` (the run's clients) serve a
    partitioner other than ``none``. ``input_shape``: the run's (public) input shape, which every record's features
    must have (a record of another shape is left out) and an empty split takes; None: the first record's."""
    from privfl.data import ArrayDataset

    try:
        from flwr_datasets import FederatedDataset
    except ImportError:
        raise ConfigurationError(f"{path!r} needs Flower Datasets: pip install 'privfl[flower-datasets]'") from None
    dataset, options, loading = parse(path)
    y = options.get("y", "label")
    split = options.get("split", "train")
    mode = options.get("partitioner", "none")
    try:
        seed = int(options.get("seed", "42"))
    except ValueError:
        raise ConfigurationError(f"{path!r}: seed must be an integer, got {options['seed']!r}") from None
    partitioners = {}
    if mode != "none":
        if partition_id is None:
            raise ConfigurationError(f"{path!r}: partitioner={mode} keeps one partition, and this load has no "
                                     "partition id (the server's test set takes partitioner=none)")
        partitioners[split] = _partitioner(mode, num_partitions, seed, y, path)
    shape = None if input_shape is None else tuple(int(d) for d in input_shape)
    try:
        # the whole split as it is (an organisation's own data), or Flower's shuffled partitions of it
        fds = FederatedDataset(dataset=dataset, partitioners=partitioners or {split: 1}, shuffle=bool(partitioners),
                               seed=seed, **loading)
        records = fds.load_partition(int(partition_id), split) if partitioners else fds.load_split(split)
    except ConfigurationError:
        raise
    except Exception as exc:  # noqa: BLE001 - Flower's and the datasets library's errors are many; name the source
        if shape is not None and isinstance(exc, ValueError) and "corresponds to no data" in str(exc):
            # the datasets library's answer to a split without a record (a header-only CSV: the organisation's
            # data removed), which is an empty data set, as an empty .npz is
            return _empty(task, num_classes, shape, name)
        raise ConfigurationError(f"cannot load {path!r} through Flower Datasets ({type(exc).__name__}: {exc})"
                                 ) from None
    columns = list(records.column_names)
    if y not in columns:
        raise ConfigurationError(f"{path!r}: no column {y!r} for the labels (columns: {columns}); set y=")
    x_names = options["x"].split(",") if options.get("x") else [c for c in columns if c != y]
    missing = [c for c in x_names if c not in columns]
    if missing or not x_names:
        raise ConfigurationError(f"{path!r}: feature columns {missing or x_names} are not in {columns}; set x=")
    if len(records) == 0:
        if shape is None:
            raise ConfigurationError(f"{path!r}: the {split!r} split (partition {partition_id}) holds no record")
        return _empty(task, num_classes, shape, name)
    table = records.to_dict()
    if len(x_names) == 1:  # one column of numbers (a vector of length 1 per record), arrays or images
        x = _column(table, x_names[0], shape)
    else:  # one number per column and record
        x = np.stack([_scalars(table[c], np.float32) for c in x_names], axis=1)
    if task == "classification":
        labels = _scalars(table[y])
    else:  # a number per record, or a vector of the run's output width
        labels = _column(table, y, (int(num_classes),) if num_classes else None)
        labels = labels[:, 0] if labels.shape[1:] == (1,) else labels
    if task == "classification" and not num_classes:
        raise ConfigurationError(f"{path!r}: a classification run's source needs the run's num_classes")
    x, labels, _ = usable_records(x, labels, task, int(num_classes or 1), name)
    return ArrayDataset(x, labels, task, num_classes, name)


def _empty(task: str, num_classes, shape: tuple[int, ...], name: str):
    from privfl.data import ArrayDataset

    labels = np.zeros(0, dtype=np.int64 if task == "classification" else np.float32)
    return ArrayDataset(np.zeros((0, *shape), dtype=np.float32), labels, task, num_classes, name)


__all__ = ["PREFIX", "is_flower_dataset", "load_partition", "parse", "usable_records"]
