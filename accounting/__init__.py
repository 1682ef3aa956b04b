"""privfl's accounting: privacy events, accountants (exact Gaussian, zCDP, RDP, PLD) and noise calibration.

Imports nothing of the rest of the project; see ``accounting.events``, ``accounting.accountants`` and
``accounting.calibration``. The limits every entry point enforces are listed in ``accounting.validation``.
"""

if __name__ != "privfl.accounting":  # the checkout on sys.path: hand out privfl.accounting itself, never a copy
    __import__("importlib").import_module("privfl._one_name").hand_over(__name__, "privfl.accounting")
else:
    from .errors import (InvalidLedgerArgument, InvalidPrivacyParameter, LedgerError, PrivacyBudgetExceeded,
                                   PrivacyError, UnsupportedEventError)
    from .events import (RELATIONS, ComposedEvent, GaussianEvent, NoOpEvent, NonPrivateEvent,
                                   PoissonSampledEvent, PrivacyEvent, SelfComposedEvent, UnsupportedEvent, ZCDPEvent,
                                   ApproximatedEvent, event_from_dict, flatten, rho_of)
    from .accountants import ACCOUNTANTS, Accountant, ExactAccountant, ZCDPAccountant, make_accountant
    from .calibration import Calibration, calibrate, epsilon_for, round_event

    def __getattr__(name: str):  # the dp-accounting backends load on first use (privfl.accounting.accountants)
        if name in ("PLDAccountant", "RDPAccountant"):
            from . import accountants

            return getattr(accountants, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    __all__ = [
        "PrivacyError", "InvalidPrivacyParameter", "UnsupportedEventError", "PrivacyBudgetExceeded", "LedgerError",
        "InvalidLedgerArgument", "RELATIONS", "PrivacyEvent", "GaussianEvent", "ZCDPEvent", "PoissonSampledEvent",
        "SelfComposedEvent", "ComposedEvent",
        "NoOpEvent", "NonPrivateEvent", "UnsupportedEvent", "ApproximatedEvent", "event_from_dict", "flatten",
        "rho_of", "Accountant", "ExactAccountant", "ZCDPAccountant", "RDPAccountant", "PLDAccountant", "ACCOUNTANTS",
        "make_accountant", "Calibration", "calibrate", "epsilon_for", "round_event",
    ]
