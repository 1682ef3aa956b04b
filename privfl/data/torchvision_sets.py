"""MNIST, CIFAR-10 and CIFAR-100 through ``torchvision.datasets`` (download and cache, or read files already there).

torchvision's own layouts are used unchanged, so a folder prepared by any torchvision user works:
``ROOT/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``, ``ROOT/cifar-10-batches-py/`` and
``ROOT/cifar-100-python/``. torchvision checks the MD5 of each CIFAR file, so only the official files load.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from privfl.data.cache import resolve_root
from privfl.data.dataset import ArrayDataset
from privfl.data.errors import DatasetError, DatasetNotFoundError

_MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                "t10k-labels-idx1-ubyte")

TORCHVISION_DATASETS = {
    # name: (torchvision class name, sub-folder, files that must exist, classes, official archive)
    "mnist": ("MNIST", os.path.join("MNIST", "raw"), _MNIST_FILES, 10,
              "the four uncompressed idx files of MNIST"),
    "cifar10": ("CIFAR10", "cifar-10-batches-py",
                ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch",
                 "batches.meta"), 10, "cifar-10-python.tar.gz, extracted"),
    "cifar100": ("CIFAR100", "cifar-100-python", ("train", "test", "meta"), 100,
                 "cifar-100-python.tar.gz, extracted"),
}


def torchvision_root(root: str | os.PathLike | None) -> Path:
    """The folder torchvision reads: ``root``, or ``<cache>/torchvision`` when ``None``."""
    return Path(root).expanduser() if root is not None else resolve_root(None) / "torchvision"


def load_torchvision(name: str, root: str | os.PathLike | None = None, download: bool = True, *,
                     flatten: bool = False) -> tuple[ArrayDataset, ArrayDataset]:
    """(train, test) of ``"mnist"``, ``"cifar10"`` or ``"cifar100"`` with pixels scaled to [0, 1], channels first:
    MNIST ``(1, 28, 28)`` (60,000 / 10,000), CIFAR ``(3, 32, 32)`` (50,000 / 10,000; CIFAR-100 fine labels).

    ``download=True`` fetches what is missing into ``root`` (default ``$PRIVFL_DATA/torchvision`` or
    ``~/.cache/privfl/torchvision``); with ``download=False`` missing files raise ``DatasetNotFoundError`` naming
    the folder to fill.
    """
    key = str(name).lower()
    if key not in TORCHVISION_DATASETS:
        raise DatasetError(f"unknown torchvision data set {name!r}; choose one of {sorted(TORCHVISION_DATASETS)}")
    cls_name, sub, files, num_classes, archive = TORCHVISION_DATASETS[key]
    base = torchvision_root(root)
    folder = base / sub
    missing = [f for f in files if not (folder / f).is_file()]
    if missing and not download:
        raise DatasetNotFoundError(f"{key} is not in {folder} (missing {', '.join(missing)}); put {archive} there, "
                                   f"or pass download=True to fetch it into {base}")
    import torchvision.datasets as tvd

    cls = getattr(tvd, cls_name)
    try:
        train = cls(str(base), train=True, download=download)
        test = cls(str(base), train=False, download=False)
    except RuntimeError as err:  # torchvision's "not found or corrupted"
        raise DatasetError(f"torchvision could not read {key} from {folder}: {err}. Delete the folder and pass "
                           "download=True to fetch fresh copies") from err
    return _to_array(train, key, "train", num_classes, flatten), _to_array(test, key, "test", num_classes, flatten)


def _to_array(ds, key: str, split: str, num_classes: int, flatten: bool) -> ArrayDataset:
    data = ds.data.numpy() if hasattr(ds.data, "numpy") else np.asarray(ds.data)
    if data.ndim == 3:  # MNIST: (n, 28, 28)
        x = data[:, None, :, :]
    else:  # CIFAR: (n, 32, 32, 3) -> channels first
        x = np.transpose(data, (0, 3, 1, 2))
    x = x.astype(np.float32) / np.float32(255.0)
    if flatten:
        x = x.reshape(len(x), -1)
    targets = ds.targets.numpy() if hasattr(ds.targets, "numpy") else np.asarray(ds.targets)
    return ArrayDataset(x, targets.astype(np.int64), "classification", num_classes, f"{key}-{split}")


__all__ = ["TORCHVISION_DATASETS", "load_torchvision", "torchvision_root"]
