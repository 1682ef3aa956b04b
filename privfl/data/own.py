"""The user's own data: tables on disk (CSV or Parquet), a Python entry point, or in-memory per-client data.

``privfl run --data 'clients/*.csv' --target y`` and a compare TOML's ``data``/``target`` keys come here:

- **one file per client** (a glob or a list; each file's name is its client's name), or **one file with a client
  column** (``client_column``); every client must have the same feature columns (the schema is a public fact);
- the **target** column; features are every other column (except the client column), numeric, with no missing value;
- the **test set**: ``test`` (a file the evaluator holds, no client's data) or, without one, the documented split rule
  below;
- the **label set** (classification) is a public fact, never read from the clients' labels: ``classes`` as given, or
  else the labels of the test file (the evaluator's data, not a client's); without either it is refused; each label
  is matched to it by value (``1.0`` is the class ``1``), and a refusal names neither the labels nor their count;
- **standardisation** uses public statistics only: ``"public"`` fits :class:`Standardizer` on ``public`` (a file no
  client holds), a :class:`Standardizer` (e.g. ``Standardizer.from_bounds``) is used as given, and ``None`` leaves the
  features as they are. Nothing is ever fitted on the clients' pooled data.

Split rule without a test file (``test_fraction``): each record is held out on a coin of its own, a keyed hash
(BLAKE2b, keyed by the run's seed) of that record's bytes (features as float32, and the label by its own value:
:func:`canonical_value`, never the column's dtype, which follows every record of the column) read as a uniform in
[0, 1) and compared to ``test_fraction`` (:func:`holdout_mask`). A record's membership is a function of that record
and the seed alone: adding, removing or replacing one record changes no other record's side of the split, so
neighbouring data sets' training sets differ in that one record at most (a permutation of record positions would
have reshuffled the split). A client holds out ``test_fraction * n_k`` records in expectation (a binomial count, not
a fixed one), and identical rows get the same coin (duplicates are held out together). The held-out records of all
clients, pooled, are the test set (evaluation is a simulation diagnostic: nothing of the test set is released; the
front ends' reports mark its metrics as not covered by epsilon, :mod:`privfl.apps.held_out`).

An entry point ``module:function`` is called with no arguments and returns ``(model, clients)``,
``(model, clients, test)``, or a mapping with the keys ``"clients"`` (required), ``"model"``, ``"test"``, ``"loss"``,
``"optimizer"`` and ``"metrics"``: ``model`` is a built-in model name (``"mlp"``), a mapping of ``FederationConfig``
model settings (``{"model": "mlp", "hidden": [16]}``), None, or the user's own model: a ``torch.nn.Module`` or a
zero-argument factory of one (``EntryPoint.module``, for the algorithms that train a user's model); ``clients`` maps
client names to ``(x, y)`` arrays or tensors, or to a pandas DataFrame with the ``target`` column; ``test`` is one
such value; ``loss``, ``optimizer`` and ``metrics`` are what ``privfl.federate`` takes under those names (a loss
``criterion(outputs, targets)``, a factory of parameters such as ``lambda p: torch.optim.Adam(p, lr=1e-3)``, and
name -> ``fn(y_true, scores)``), for the algorithms that train a user's model with them.
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from privfl.data.dataset import FederatedData
from privfl.data.errors import DatasetError
from privfl.data.federated import federated_from_arrays
from privfl.data.split import Standardizer

TABLE_SUFFIXES = (".csv", ".parquet", ".pq")


def read_table(path: str, flag: str = "--data"):
    """A pandas DataFrame from a CSV or Parquet file; a clear :class:`DatasetError` naming ``flag`` otherwise."""
    import pandas as pd

    if os.path.isdir(path):
        raise DatasetError(f"{flag} {path} is a directory; give a CSV or Parquet file (or a glob such as "
                           f"'{os.path.join(path, '*.csv')}')")
    if not os.path.isfile(path):
        raise DatasetError(f"{flag} {path}: no such file")
    suffix = os.path.splitext(path)[1].lower()
    try:
        if suffix == ".csv":
            return pd.read_csv(path)
        if suffix in (".parquet", ".pq"):
            return pd.read_parquet(path)
    except ImportError as exc:
        raise DatasetError(f"{flag} {path}: reading Parquet needs pyarrow or fastparquet ({exc}); install one or "
                           "convert the file to CSV") from None
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError, OSError) as exc:
        raise DatasetError(f"{flag} {path} could not be read as {suffix[1:]}: {exc}") from None
    raise DatasetError(f"{flag} {path}: unknown file type {suffix!r}; use CSV (.csv) or Parquet (.parquet)")


def client_tables(data: str | Sequence[str], client_column: str | None = None, flag: str = "--data",
                  names: Sequence[str] | None = None, names_flag: str = "--client-names") -> dict:
    """Client name -> DataFrame: one file per client (``data`` a glob or a list of paths; the name is the file's
    stem), or one file split by ``client_column``.

    With ``client_column``, ``names`` declares the roster (``--client-names``): the clients are exactly these, in
    this order, each with the rows whose client value is its name (a declared client without rows gets an empty
    table), and a row naming an undeclared client is an error that names ``names_flag`` but not the value. Without
    ``names`` the roster is the distinct values found, sorted (the client count, order and run id then follow the
    data: for non-private runs only). A row with no client value is an error either way, never dropped."""
    patterns = [data] if isinstance(data, str) else list(data)
    paths: list[str] = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not found:
            raise DatasetError(f"{flag} {pattern}: no file matches")
        paths += found
    if client_column is not None:
        if len(paths) != 1:
            raise DatasetError(f"--client-column splits one file into clients, but {flag} names {len(paths)} files; "
                               "give one file, or drop --client-column to use one file per client")
        table = read_table(paths[0], flag)
        if client_column not in table.columns:
            raise DatasetError(f"--client-column {client_column!r} is not a column of {paths[0]} (columns: "
                               f"{_columns(table)})")
        column = table[client_column]
        if column.isna().any():  # such rows would silently leave the federation (groupby drops them)
            raise DatasetError(f"--client-column {client_column!r} of {paths[0]} is empty in some rows: every row "
                               "must say whose record it is; fill those rows' client or remove them")
        owner = column.map(_client_key)
        rows = table.drop(columns=[client_column])
        if names is None:
            return {name: rows[owner == name].reset_index(drop=True) for name in sorted(set(owner))}
        roster = [str(n) for n in names]
        if not roster or len(set(roster)) != len(roster):
            raise DatasetError(f"{names_flag} must list distinct client names, e.g. {names_flag} a,b,c")
        if not owner.isin(roster).all():
            raise DatasetError(f"--client-column {client_column!r} of {paths[0]} has rows whose client is not "
                               f"declared in {names_flag} (the values are not shown: they are the rows' data); "
                               f"declare every client in {names_flag}, or remove those rows")
        return {name: rows[owner == name].reset_index(drop=True) for name in roster}
    if len(paths) < 2:
        raise DatasetError(f"{flag} names one file, which is one client; a federation needs one file per client (a "
                           "glob such as 'clients/*.csv') or --client-column naming the column that says whose "
                           "record each row is")
    names = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    if len(set(names)) != len(names):
        names = paths  # two folders with the same file names: the paths tell the clients apart
    return {name: read_table(p, flag) for name, p in zip(names, paths)}


def _client_key(value) -> str:
    """A client column's value as a client name: integers as integers (a column read as floats, 1.0, is client '1')."""
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _columns(table) -> str:
    cols = [str(c) for c in table.columns]
    return ", ".join(cols[:12]) + (f", ... ({len(cols)} in all)" if len(cols) > 12 else "")


def _features_and_target(table, target: str, features: list[str] | None, what: str):
    if target not in table.columns:
        raise DatasetError(f"--target {target!r} is not a column of {what} (columns: {_columns(table)})")
    names = features if features is not None else [c for c in table.columns if c != target]
    missing = [c for c in names if c not in table.columns]
    extra = [c for c in table.columns if c != target and c not in names]
    if missing or extra:
        raise DatasetError(f"{what} does not have the feature columns of the first client (missing {missing}, extra "
                           f"{extra}); every client's table must have the same columns")
    x = table[names]
    from pandas.api.types import is_numeric_dtype

    # a table without rows (a header-only file: a client whose data is removed) has untyped columns; it holds no
    # value that could fail to be a number, and is typed as the others are (float32 features)
    bad = [str(c) for c in names if len(table) and not is_numeric_dtype(x[c].dtype)]
    if bad:
        raise DatasetError(f"{what}: feature columns {bad} are not numeric; encode them as numbers (or drop them)")
    if x.isna().any().any() or table[target].isna().any():
        raise DatasetError(f"{what} has missing values; fill or drop them before the run")
    return list(names), x.to_numpy(dtype=np.float32), table[target].to_numpy()


def _label_index(classes: Sequence) -> dict[str, int]:
    return {str(c): i for i, c in enumerate(classes)}


_BOOL_TEXT = {"true": 1.0, "false": 0.0}  # pandas reads True/TRUE/true (False/...) as booleans in a boolean column


def canonical_value(v) -> float | str:
    """One target value (a label or a regression target) as a number when it is one or a text that reads as one
    (``1``, ``1.0``, ``"1"``, ``"1.0"``, ``True``/``"True"`` are all 1.0), else its text; decided per value, never
    by the column's dtype. pandas types a whole column by all its values (one record's ``"unknown"`` makes a column of
    0/1 text, one record's ``1.0`` makes it floats), so anything keyed by the column's dtype would follow one record:
    the held-out coin (:func:`holdout_mask`) and the label set's matching key each value by this function alone."""
    v = v.item() if isinstance(v, np.generic) else v
    if isinstance(v, (bool, int, float)):
        try:
            return float(v)
        except OverflowError:  # an integer beyond float64: its text
            return str(v)
    text = v.decode() if isinstance(v, bytes) else str(v)
    try:
        return float(text)
    except (ValueError, OverflowError):
        return _BOOL_TEXT.get(text.strip().lower(), text)


def class_index(classes: Sequence, flag: str = "--classes") -> dict:
    """The declared classes by value (:func:`canonical_value` -> position): a record's label ``1.0`` is the declared
    class ``1``. Two declared classes of the same value are refused (the declaration is public)."""
    index: dict = {}
    for i, c in enumerate(classes):
        key = canonical_value(c)
        if key in index:
            raise DatasetError(f"{flag}: the declared classes {classes[index[key]]!r} and {c!r} are the same value; "
                               "declare each class once")
        index[key] = i
    return index


def label_positions(y, index: dict) -> np.ndarray | None:
    """Each label's position in the declared classes (``index`` from :func:`class_index`), matched by value; None
    when some label is none of them (the caller refuses without counting or naming those records)."""
    values = np.asarray(y, dtype=object)
    if values.ndim == 2 and values.shape[1] == 1:
        values = values[:, 0]
    if values.ndim != 1:  # one label per record
        return None
    out = np.empty(len(values), dtype=np.int64)
    for i, v in enumerate(values):
        key = canonical_value(v)
        if key not in index:
            return None
        out[i] = index[key]
    return out


def _encode(y: np.ndarray, classes: Sequence | None, what: str) -> np.ndarray:
    if classes is None:
        try:
            return np.asarray(y).astype(np.float32)
        except (ValueError, TypeError):  # numpy's text would quote the first bad value: the holder's data
            raise DatasetError(f"{what} has records whose regression target is not a number (neither their count "
                               "nor their values are shown: they are the records' data); encode the target column "
                               "as numbers, or remove those records") from None
    labels = label_positions(y, class_index(classes))
    if labels is None:  # the values and their count are the holder's data: the text says what to change, never which
        raise DatasetError(f"{what} has records whose label is outside the declared label set "
                           f"{[str(c) for c in classes]}; declare every class with "
                           "--classes (classes = in a TOML), or remove those records (neither their count nor their "
                           "values are shown: they are the records' data)")
    return labels


def _as_table(value, target: str | None, what: str):
    """A DataFrame from a DataFrame, or from an (x, y) pair of arrays or tensors (columns x0, x1, ..., and target)."""
    import pandas as pd

    if isinstance(value, pd.DataFrame):
        if target is None:
            raise DatasetError(f"{what} is a DataFrame: name its target column (--target, or target= in the TOML)")
        return value, target
    if isinstance(value, (tuple, list)) and len(value) == 2:
        x = np.asarray(value[0].detach().cpu() if hasattr(value[0], "detach") else value[0])
        y = np.asarray(value[1].detach().cpu() if hasattr(value[1], "detach") else value[1])
        if x.ndim == 1:
            x = x[:, None]
        if x.ndim != 2 or len(x) != len(y) or y.ndim != 1:
            raise DatasetError(f"{what}: expected x of shape (n, features) and y of shape (n,), got {x.shape} and "
                               f"{y.shape}")
        table = pd.DataFrame(x, columns=[f"x{i}" for i in range(x.shape[1])])
        table["__target__"] = y
        return table, "__target__"
    raise DatasetError(f"{what} must be a pandas DataFrame or an (x, y) pair of arrays or tensors, got "
                       f"{type(value).__name__}")


def _value_bytes(value: float | str) -> bytes:
    return np.float64(value).tobytes() if isinstance(value, float) else value.encode("utf-8", "surrogatepass")


def _label_bytes(y) -> list[bytes]:
    """One canonical byte string per record's target, made from that value alone (:func:`canonical_value`), never
    from the column's dtype: a number, or a text that reads as one, as float64 bytes (so 1, 1.0, an int32 1 and the
    text "1" agree), another value as its text. An all-numeric column's bytes are those of the column cast to
    float64, as before this was per value (the coins of committed runs are unchanged)."""
    y = np.asarray(y, dtype=object)
    out = []
    for row in y.reshape(len(y), -1):
        values = [canonical_value(v) for v in row]
        if all(isinstance(v, float) for v in values):
            out.append(b"".join(np.float64(v).tobytes() for v in values))
        else:
            out.append(b"\x1f".join(_value_bytes(v) for v in values))
    return out


def holdout_mask(x, y, test_fraction: float, seed: int) -> np.ndarray:
    """Whether each record of ``(x, y)`` is held out (the module's split rule): BLAKE2b keyed by ``seed`` over the
    record's features (as float32) and label, read as a uniform in [0, 1), below ``test_fraction``. A function of
    each record and the seed alone: no other record, no position, no client index."""
    if not 0 < test_fraction < 1:
        raise DatasetError(f"--test-fraction must lie in (0, 1), got {test_fraction}")
    x = np.asarray(x, dtype=np.float32)
    n = len(x)
    if len(y) != n:
        raise DatasetError(f"x has {n} records but y has {len(y)}")
    if n == 0:  # a client without records (its data removed) holds nothing out
        return np.zeros(0, dtype=bool)
    rows = np.ascontiguousarray(x.reshape(n, -1))
    labels = _label_bytes(y)
    key = hashlib.blake2b(f"privfl-holdout-split:{int(seed)}".encode(), digest_size=32).digest()
    threshold = float(test_fraction)
    out = np.empty(n, dtype=bool)
    for i in range(n):
        digest = hashlib.blake2b(rows[i].tobytes(), key=key, digest_size=8)
        digest.update(b"\x00label\x00" + labels[i])
        u = (int.from_bytes(digest.digest(), "big") >> 11) * 2.0 ** -53  # uniform in [0, 1), 53 bits
        out[i] = u < threshold
    return out


def holdout_split(x, y, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices of one client's records ``(x, y)`` by :func:`holdout_mask` (the module's split rule)."""
    held = holdout_mask(x, y, test_fraction, seed)
    return np.flatnonzero(~held), np.flatnonzero(held)


def federated_from_tables(clients: Mapping[str, Any], target: str | None, *, task: str = "classification",
                          classes: Sequence | None = None, test: Any = None, test_fraction: float = 0.2,
                          seed: int = 0, standardize: str | Standardizer | None = None, public: Any = None,
                          name: str = "own") -> FederatedData:
    """A ``FederatedData`` from per-client tables (DataFrames, or (x, y) pairs); see the module docstring for the
    label set, the test split and standardisation. ``info`` records the clients' names and how the test set was
    made."""
    if task not in ("classification", "regression"):
        raise DatasetError(f"--task must be classification or regression, got {task!r}")
    if not isinstance(clients, Mapping) or len(clients) < 2:
        raise DatasetError(f"a federation needs at least 2 clients' data, got {len(clients) if clients else 0}")
    names = [str(k) for k in clients]
    tables = [_as_table(v, target, f"client {k!r}") for k, v in clients.items()]
    test_table = None if test is None else _as_table(test, target, "the test data")
    index = None
    if task == "classification":
        if classes is None:
            if test_table is None:
                raise DatasetError("classification needs the public label set: pass --classes (e.g. --classes 0,1) "
                                   "or --test-data (its labels are taken as the label set); it is never read from "
                                   "the clients' labels")
            tt, tcol = test_table
            if tcol not in tt.columns:
                raise DatasetError(f"--target {tcol!r} is not a column of the test data (columns: {_columns(tt)})")
            classes = sorted({v.item() if hasattr(v, "item") else v for v in tt[tcol].to_numpy()}, key=_sort_key)
        if len(classes) < 2:
            raise DatasetError(f"a classification task needs at least 2 classes, got {list(classes)}")
        class_index(classes)  # matched by value: two declared classes of one value are refused here
        index = _label_index(classes)
        classes = list(classes)
    features = None
    pairs, raw = [], []
    for (table, col), client in zip(tables, names):
        features, x, y = _features_and_target(table, col, features, f"client {client!r}")
        pairs.append((x, _encode(y, classes if index else None, f"client {client!r}")))
        raw.append(y)
    if test_table is not None:
        _, tx, ty = _features_and_target(test_table[0], test_table[1], features, "the test data")
        test_pair, rule = (tx, _encode(ty, classes if index else None, "the test data")), "test data"
    else:
        parts, held = [], []
        for (x, y), y_raw in zip(pairs, raw):
            train, out = holdout_split(x, y_raw, test_fraction, seed)
            parts.append((x[train], y[train]))
            held.append((x[out], y[out]))
        pairs = parts
        test_pair = (np.concatenate([h[0] for h in held]), np.concatenate([h[1] for h in held]))
        rule = f"each client's held-out {test_fraction:g} (seed {seed})"
    public_pair = None
    if public is not None:
        ptable, pcol = _as_table(public, target, "the public data")
        _, px, py = _features_and_target(ptable, pcol, features, "the public data")
        public_pair = (px, _encode(py, classes, "the public data") if task == "classification" else py)
    if standardize == "public" and public_pair is None:
        raise DatasetError("--standardize public fits on public data no client holds: pass --public-data FILE (or "
                           "use --standardize none)")
    info = {"clients": names, "features": features, "target": target, "test": rule,
            "classes": None if index is None else list(index)}
    return federated_from_arrays(pairs, test_pair, task=task, num_classes=len(index) if index else None, name=name,
                                 standardize=standardize, public=public_pair, partition="given", seed=seed, info=info,
                                 test_from_clients=test_table is None)


def _sort_key(v):
    return (0, v, "") if isinstance(v, (int, float, np.number)) else (1, 0, str(v))


#: the keys of a mapping an entry point may return
ENTRY_KEYS = ("model", "clients", "test", "loss", "optimizer", "metrics")


@dataclass(frozen=True)
class EntryPoint:
    """What a ``module:function`` entry point returned: model settings (``FederationConfig`` fields) and data."""

    model: dict
    clients: Mapping[str, Any]
    test: Any = None
    #: the user's own model the entry returned (an ``nn.Module`` or a zero-argument factory of one), else None
    module: Any = None
    #: the user's loss, optimizer factory and extra test metrics (a mapping entry's ``loss``, ``optimizer`` and
    #: ``metrics``), else None
    loss: Any = None
    optimizer: Any = None
    metrics: Any = None

    @property
    def training(self) -> dict:
        """The user's own training objects the entry returned: ``model`` (its module), ``loss``, ``optimizer``,
        ``metrics``, those that are not None (keyword arguments of the algorithms that take them)."""
        given = {"model": self.module, "loss": self.loss, "optimizer": self.optimizer, "metrics": self.metrics}
        return {k: v for k, v in given.items() if v is not None}


def load_entry(spec: str, flag: str = "--entry") -> EntryPoint:
    """Import ``module:function``, call it with no arguments and check what it returns (see the module docstring).
    The current directory is importable, as for ``python -m``."""
    import sys

    module_name, sep, function = spec.partition(":")
    if not sep or not module_name or not function:
        raise DatasetError(f"{flag} {spec!r}: expected module:function, e.g. mydata:federation")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise DatasetError(f"{flag} {spec!r}: cannot import {module_name!r} ({exc})") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise DatasetError(f"{flag} {spec!r}: {module_name} has no function {function!r}")
    out = fn()
    training: dict = {}
    if isinstance(out, Mapping):
        unknown = sorted(str(k) for k in set(out) - set(ENTRY_KEYS))
        if unknown or "clients" not in out:
            raise DatasetError(f"{flag} {spec!r} returned a mapping with "
                               + (f"unknown keys {unknown}" if unknown else "no 'clients'")
                               + f"; its keys are {', '.join(ENTRY_KEYS)} ('clients' required)")
        model, clients, test = out.get("model"), out["clients"], out.get("test")
        training = {k: out[k] for k in ("loss", "optimizer", "metrics") if out.get(k) is not None}
    elif not isinstance(out, tuple) or len(out) not in (2, 3):
        raise DatasetError(f"{flag} {spec!r} must return (model, clients), (model, clients, test) or a mapping with "
                           f"the keys {', '.join(ENTRY_KEYS)}, got {type(out).__name__}")
    else:
        model, clients = out[0], out[1]
        test = out[2] if len(out) == 3 else None
    if "loss" in training and not callable(training["loss"]):
        raise DatasetError(f"{flag} {spec!r}: loss must be callable as loss(outputs, targets), e.g. "
                           f"torch.nn.CrossEntropyLoss(); got {type(training['loss']).__name__}")
    if "optimizer" in training and not callable(training["optimizer"]):
        raise DatasetError(f"{flag} {spec!r}: optimizer must be a factory of parameters, e.g. lambda p: "
                           f"torch.optim.Adam(p, lr=1e-3); got {type(training['optimizer']).__name__}")
    if "metrics" in training and not isinstance(training["metrics"], Mapping):
        raise DatasetError(f"{flag} {spec!r}: metrics must map names to functions fn(y_true, scores); got "
                           f"{type(training['metrics']).__name__}")
    module = None
    if model is None:
        settings: dict = {}
    elif isinstance(model, str):
        settings = {"model": model}
    elif isinstance(model, Mapping):
        unknown = set(model) - {"model", "hidden", "pool"}
        if unknown:
            raise DatasetError(f"{flag} {spec!r}: model settings may be model, hidden and pool, got {sorted(unknown)}")
        settings = dict(model)
    elif callable(model):  # an nn.Module (modules are callable) or a zero-argument factory of one
        settings, module = {}, model
    else:
        raise DatasetError(f"{flag} {spec!r} returned a {type(model).__name__} as the model: return a built-in "
                           "architecture's name ('mlp') or settings ({'model': 'mlp', 'hidden': [16]}), None for "
                           "--model, or your own torch.nn.Module (or a zero-argument factory of one)")
    if not isinstance(clients, Mapping):
        raise DatasetError(f"{flag} {spec!r}: clients must be a mapping of client name to data, got "
                           f"{type(clients).__name__}")
    return EntryPoint(settings, clients, test, module, **training)


__all__ = ["ENTRY_KEYS", "EntryPoint", "TABLE_SUFFIXES", "canonical_value", "class_index", "client_tables",
           "federated_from_tables", "holdout_mask", "holdout_split", "label_positions", "load_entry", "read_table"]
