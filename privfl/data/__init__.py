"""Data for federated experiments: in-memory data sets, offline and download-and-cache loaders, seeded splits and
client partitions, ``make_federated``, the single entry point, and ``federated_from_arrays`` for the user's own
per-client arrays. Preprocessing statistics are public inputs (a public reference split no client holds, or the
user's own), never fitted on clients' data. Nothing here touches the network unless a caller passes
``download=True``."""

from privfl.data.cache import CACHE_ENV, default_cache_dir
from privfl.data.dataset import ArrayDataset, FederatedData
from privfl.data.errors import DatasetError, DatasetNotFoundError, PartitionError
from privfl.data.federated import DATASETS, MIN_PUBLIC_SIZE, PUBLIC_FRACTION, federated_from_arrays, make_federated
from privfl.data.inputs import as_arrays
from privfl.data.own import EntryPoint, client_tables, federated_from_tables, load_entry, read_table
from privfl.data.offline import load_diabetes, load_digits, load_mnist5k, synthetic1d, synthetic1d_function
from privfl.data.partition import (EXAMPLES_PER_CLASS_PRESETS, PARTITIONS, PartitionWarning, dirichlet_partition,
                                   disjoint_class_partition, iid_partition, most_correlated_feature,
                                   sorted_chunk_partition)
from privfl.data.split import Standardizer, standardize, train_test_split_indices
from privfl.data.torchvision_sets import TORCHVISION_DATASETS, load_torchvision
from privfl.data.uci import UCI_DATASETS, load_uci

__all__ = [
    "ArrayDataset", "CACHE_ENV", "as_arrays", "DATASETS", "DatasetError", "DatasetNotFoundError", "EXAMPLES_PER_CLASS_PRESETS",
    "EntryPoint", "client_tables", "federated_from_tables", "load_entry", "read_table",
    "FederatedData", "MIN_PUBLIC_SIZE", "PARTITIONS", "PUBLIC_FRACTION", "PartitionError", "PartitionWarning",
    "Standardizer", "TORCHVISION_DATASETS", "UCI_DATASETS", "default_cache_dir", "dirichlet_partition",
    "disjoint_class_partition", "federated_from_arrays", "iid_partition",
    "load_diabetes", "load_digits", "load_mnist5k", "load_torchvision", "load_uci", "make_federated",
    "most_correlated_feature", "sorted_chunk_partition", "standardize", "synthetic1d", "synthetic1d_function",
    "train_test_split_indices",
]
