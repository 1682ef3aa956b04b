"""Accountant backends behind one interface, and a factory that builds them by name.

- ``exact``: unsampled Gaussian compositions, converted exactly (Gaussian DP + analytic Gaussian).
- ``zcdp``: rho adds; optimal zCDP-to-DP conversion.
- ``rdp``: dp-accounting's Renyi-DP accountant (sampled Gaussians, zCDP events).
- ``pld``: dp-accounting's privacy-loss-distribution accountant (sampled Gaussians; tightest with sampling).
"""

from __future__ import annotations

from collections.abc import Callable

from privfl.accounting.accountants.base import Accountant
from privfl.accounting.accountants.exact import ExactAccountant
from privfl.accounting.accountants.pld import PLDAccountant
from privfl.accounting.accountants.rdp import RDPAccountant
from privfl.accounting.accountants.zcdp import ZCDPAccountant
from privfl.accounting.errors import InvalidPrivacyParameter

ACCOUNTANTS: dict[str, Callable[..., Accountant]] = {
    "exact": ExactAccountant,
    "pld": PLDAccountant,
    "rdp": RDPAccountant,
    "zcdp": ZCDPAccountant,
}


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
