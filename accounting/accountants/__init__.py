"""Accountant backends behind one interface, and a factory that builds them by name.

- ``exact``: unsampled Gaussian compositions, converted exactly (Gaussian DP + analytic Gaussian).
- ``zcdp``: rho adds; optimal zCDP-to-DP conversion.
- ``rdp``: dp-accounting's Renyi-DP accountant (sampled Gaussians, zCDP events), plus Poisson-sampled zCDP events
  (Zhu and Wang 2019, Theorem 6; ``sampled_zcdp``).
- ``pld``: dp-accounting's privacy-loss-distribution accountant (sampled Gaussians; tightest with sampling).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping

from .base import Accountant
from .exact import ExactAccountant
from .zcdp import ZCDPAccountant
from ..errors import InvalidPrivacyParameter

#: backends built on dp-accounting, imported on first use (dp-accounting takes ~0.6 s to import; a closed-form
#: calibration or an exact-accountant audit never needs it)
_LAZY = {"PLDAccountant": "privfl.accounting.accountants.pld", "RDPAccountant": "privfl.accounting.accountants.rdp"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Backends(Mapping):
    """Accountant name -> class, importing a dp-accounting backend only when it is looked up."""

    _classes = {"exact": "ExactAccountant", "pld": "PLDAccountant", "rdp": "RDPAccountant", "zcdp": "ZCDPAccountant"}

    def __getitem__(self, name: str) -> Callable[..., Accountant]:
        cls = self._classes[name]
        return globals()[cls] if cls in globals() else __getattr__(cls)

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)

    def __repr__(self) -> str:
        return f"ACCOUNTANTS({sorted(self._classes)})"


ACCOUNTANTS: Mapping[str, Callable[..., Accountant]] = _Backends()


def make_accountant(name: str, **options) -> Accountant:
    """A fresh, empty accountant of backend ``name`` (one of ``ACCOUNTANTS``); ``options`` go to its constructor
    (``pld``: ``value_discretization_interval``; ``rdp``: ``orders``)."""
    if not isinstance(name, str) or name not in ACCOUNTANTS:
        raise InvalidPrivacyParameter(
            f"unknown accountant {name!r}; choose one of {', '.join(sorted(ACCOUNTANTS))}")
    try:
        return ACCOUNTANTS[name](**options)
    except TypeError as exc:  # an option this backend does not take
        raise InvalidPrivacyParameter(
            f"the {name!r} accountant does not take options {sorted(options)} ({exc}); pld takes "
            "value_discretization_interval, rdp takes orders, exact and zcdp take none") from None


__all__ = ["Accountant", "ExactAccountant", "ZCDPAccountant", "RDPAccountant", "PLDAccountant", "ACCOUNTANTS",
           "make_accountant"]
