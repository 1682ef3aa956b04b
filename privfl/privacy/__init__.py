"""Privacy units and placements around non-private algorithms: the privacy wrapper (``wrapper``:
:func:`register_algorithm`), the one DP-SGD engine (``record_level``), distributed noise and secure aggregation's
encodings (``secure``). Names load on first use, so ``privfl.privacy.record_level`` does not pull in the algorithms."""

import importlib

_EXPORTS = {"PrivateAlgorithm": "privfl.privacy.wrapper", "register_algorithm": "privfl.privacy.wrapper",
            "unregister_algorithm": "privfl.privacy.wrapper"}

__all__ = ["PrivateAlgorithm", "register_algorithm", "unregister_algorithm"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'privfl.privacy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
