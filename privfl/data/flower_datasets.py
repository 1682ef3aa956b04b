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
"""

from __future__ import annotations

from urllib.parse import parse_qsl

import numpy as np

from privfl.errors import ConfigurationError

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


def _column(records, name: str, path: str) -> np.ndarray:
    values = records[name]
    first = values[0] if len(values) else None
    if first is not None and hasattr(first, "convert") and hasattr(first, "size"):  # a PIL image
        arrays = [np.asarray(v, dtype=np.float32) / 255.0 for v in values]
        out = np.stack(arrays)
        return out[:, None] if out.ndim == 3 else np.moveaxis(out, -1, 1)
    try:
        return np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{path!r}: column {name!r} holds values that are not numbers, arrays or images; "
                                 "choose feature columns with x=") from None


def load_partition(path: str, *, partition_id: int | None, num_partitions: int, task: str,
                   num_classes: int | None, name: str = "flower-datasets"):
    """The records a ``flwr-datasets:`` source gives this organisation, as a :class:`privfl.data.ArrayDataset`
    (module docstring); ``partition_id`` (this node's) and ``num_partitions`` (the run's clients) serve a
    partitioner other than ``none``."""
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
    try:
        # the whole split as it is (an organisation's own data), or Flower's shuffled partitions of it
        fds = FederatedDataset(dataset=dataset, partitioners=partitioners or {split: 1}, shuffle=bool(partitioners),
                               seed=seed, **loading)
        records = fds.load_partition(int(partition_id), split) if partitioners else fds.load_split(split)
    except ConfigurationError:
        raise
    except Exception as exc:  # noqa: BLE001 - Flower's and the datasets library's errors are many; name the source
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
        raise ConfigurationError(f"{path!r}: the {split!r} split (partition {partition_id}) holds no record")
    table = records.to_dict()
    if len(x_names) == 1:
        x = _column(table, x_names[0], path)
        x = x[:, None] if x.ndim == 1 else x  # one scalar feature: a vector of length 1 per record
    else:
        x = np.stack([_column(table, c, path) for c in x_names], axis=1)
    labels = np.asarray(table[y])
    if task == "classification":
        if not np.issubdtype(labels.dtype, np.integer):
            raise ConfigurationError(f"{path!r}: column {y!r} must hold integer class labels for a classification "
                                     f"run, got {labels.dtype}")
        labels = labels.astype(np.int64)
    else:
        labels = labels.astype(np.float32)
    return ArrayDataset(x, labels, task, num_classes, name)


__all__ = ["PREFIX", "is_flower_dataset", "load_partition", "parse"]
