"""Exceptions of privfl.data. Each subclasses ``ConfigurationError`` (a ``ValueError``), so ``except ValueError``
still works, and each message says what to change."""

from __future__ import annotations

from privfl.errors import ConfigurationError


class DatasetError(ConfigurationError):
    """A data set, split or loader argument is invalid."""


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """The files of a data set are not on disk and downloading was not allowed."""


class PartitionError(DatasetError):
    """A partition of the data over clients cannot be made with the given arguments."""


__all__ = ["DatasetError", "DatasetNotFoundError", "PartitionError"]
