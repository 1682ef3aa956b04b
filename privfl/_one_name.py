"""One import name per module: the repository keeps the layout's top-level folders (``accounting/``,
``mechanisms/``, ``secure_agg/``), which install as ``privfl.accounting`` and the like. Python started in the checkout
finds the folders themselves as top-level packages; each folder's ``__init__`` then calls :func:`hand_over`, so that
``import accounting`` gives privfl's very module objects instead of a second copy whose exception classes would not be
privfl's."""

from __future__ import annotations

import importlib
import pkgutil
import sys


def hand_over(alias: str, real: str) -> None:
    """Make ``alias`` and every ``alias.<sub>`` name the modules of the installed package ``real``."""
    package = importlib.import_module(real)
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{real}."):
        importlib.import_module(info.name)
    for name, module in list(sys.modules.items()):
        if name.startswith(f"{real}."):
            sys.modules[alias + name[len(real):]] = module
    sys.modules[alias] = package  # the import statement returns what sys.modules holds once the __init__ has run
