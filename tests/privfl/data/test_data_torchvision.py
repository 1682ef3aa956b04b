"""torchvision-backed loaders, run offline on files written here in torchvision's exact on-disk layouts."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest

from privfl.data import DatasetNotFoundError, load_mnist5k, load_torchvision, make_federated


def _write_idx(path, array: np.ndarray) -> None:
    """IDX format (LeCun): magic 0x0000 08 <ndim> (uint8 data), big-endian int32 dims, then the raw bytes."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(struct.pack(">I", 0x0800 + array.ndim))
        f.write(struct.pack(f">{array.ndim}I", *array.shape))
        f.write(array.tobytes())


@pytest.fixture
def mnist_root(tmp_path):
    src = load_mnist5k()
    images = np.rint(src.x[:, 0] * 255).astype(np.uint8)
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    _write_idx(raw / "train-images-idx3-ubyte", images[:300])
    _write_idx(raw / "train-labels-idx1-ubyte", src.y[:300])
    _write_idx(raw / "t10k-images-idx3-ubyte", images[300:400])
    _write_idx(raw / "t10k-labels-idx1-ubyte", src.y[300:400])
    return tmp_path, src


def test_mnist_reads_torchvision_raw_layout(mnist_root):
    root, src = mnist_root
    train, test = load_torchvision("mnist", root, download=False)
    assert train.x.shape == (300, 1, 28, 28) and test.x.shape == (100, 1, 28, 28)
    assert np.array_equal(train.x, src.x[:300]) and np.array_equal(test.y, src.y[300:400])
    assert load_torchvision("mnist", root, download=False, flatten=True)[0].input_shape == (784,)


def test_make_federated_uses_official_split(mnist_root):
    root, _ = mnist_root
    fd = make_federated("mnist", 3, "iid", root=root)
    assert len(fd.test) == 100 and fd.client_sizes.sum() == 300 and fd.input_shape == (1, 28, 28)
    with pytest.raises(ValueError, match="official test split"):
        make_federated("mnist", 3, "iid", root=root, test_fraction=0.2)


def _cifar_batch(rng, n, labels_key, k):
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    labels = [int(v) for v in rng.integers(0, k, size=n)]
    return {"batch_label": "test batch", labels_key: labels, "data": data,
            "filenames": [f"img_{i}.png" for i in range(n)]}


def _pickle(path, obj):
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


@pytest.fixture
def md5_free(monkeypatch):
    """torchvision checks each CIFAR file's MD5 against the official archive, which a file written by a test cannot
    match; accept any existing file instead (the layout and pickle format are still torchvision's own)."""
    import torchvision.datasets.cifar as cifar

    monkeypatch.setattr(cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))


def test_cifar10_reads_python_batches(tmp_path, md5_free):
    rng = np.random.default_rng(0)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    batches = [_cifar_batch(rng, 20, "labels", 10) for _ in range(5)]
    for i, b in enumerate(batches, start=1):
        _pickle(folder / f"data_batch_{i}", b)
    test_batch = _cifar_batch(rng, 10, "labels", 10)
    _pickle(folder / "test_batch", test_batch)
    _pickle(folder / "batches.meta", {"label_names": [f"c{i}" for i in range(10)], "num_cases_per_batch": 20,
                                      "num_vis": 3072})
    train, test = load_torchvision("cifar10", tmp_path, download=False)
    assert train.x.shape == (100, 3, 32, 32) and test.x.shape == (10, 3, 32, 32)
    first = batches[0]["data"][0].reshape(3, 32, 32).astype(np.float32) / 255
    assert np.array_equal(train.x[0], first)  # channel-first, scaled to [0, 1]
    assert list(test.y) == test_batch["labels"]


def test_cifar100_reads_fine_labels(tmp_path, md5_free):
    rng = np.random.default_rng(1)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    train_obj = _cifar_batch(rng, 30, "fine_labels", 100)
    train_obj["coarse_labels"] = [v // 5 for v in train_obj["fine_labels"]]
    test_obj = _cifar_batch(rng, 10, "fine_labels", 100)
    test_obj["coarse_labels"] = [v // 5 for v in test_obj["fine_labels"]]
    _pickle(folder / "train", train_obj)
    _pickle(folder / "test", test_obj)
    _pickle(folder / "meta", {"fine_label_names": [f"f{i}" for i in range(100)],
                              "coarse_label_names": [f"g{i}" for i in range(20)]})
    train, test = load_torchvision("cifar100", tmp_path, download=False)
    assert train.num_classes == 100 and list(train.y) == train_obj["fine_labels"] and len(test) == 10


@pytest.mark.parametrize("name, folder", [("mnist", "MNIST"), ("cifar10", "cifar-10-batches-py"),
                                          ("cifar100", "cifar-100-python")])
def test_missing_files_without_download_say_where_to_put_them(tmp_path, name, folder):
    with pytest.raises(DatasetNotFoundError) as info:
        load_torchvision(name, tmp_path, download=False)
    msg = str(info.value)
    assert folder in msg and "download=True" in msg


def test_make_federated_never_downloads_by_default(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="download=True"):
        make_federated("cifar10", 2, root=tmp_path)


def test_unknown_torchvision_name(tmp_path):
    with pytest.raises(ValueError, match="cifar10"):
        load_torchvision("svhn", tmp_path, download=False)
