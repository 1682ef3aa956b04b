"""Privacy units and placements as wrappers around non-private algorithms (``privfl.algorithms.plain``)."""

from privfl.privacy.wrapper import PrivateAlgorithm, register_algorithm, unregister_algorithm

__all__ = ["PrivateAlgorithm", "register_algorithm", "unregister_algorithm"]
