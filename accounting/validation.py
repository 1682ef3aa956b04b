"""Checks shared by events, accountants, calibration and the ledger, and the one place the accounting layer's limits
are set and justified.

Every public entry point of ``accounting`` either answers within seconds or raises an exception of the package's own
types (``accounting.errors``), whatever it is given. Non-numbers, NaN, booleans and out-of-domain values are refused;
the limits below keep the numerics (root finding, privacy-loss grids, compositions) in the range where they are
both fast and correct.

=========================  =======================  ===================================================================
input                      accepted                 why
=========================  =======================  ===================================================================
delta (targets, queries,   [1e-100, 1)              No data set has 1e100 records, so a smaller delta protects nobody
ledger)                                             more; log(1/delta) <= 231 keeps the analytic Gaussian's and zCDP's
                                                    root finding well inside double precision (at 1e-320, a subnormal,
                                                    brentq's tolerances break down).
target epsilon             [1e-6, 1000]             Above 1000 the guarantee bounds likelihood ratios by e^1000: it
(``calibrate``)                                     protects nothing; run without privacy (epsilon = inf) instead.
                                                    Below 1e-6 the noise needed exceeds 1e6 sqrt(rounds) multipliers.
epsilon at which delta is  finite, >= 0             delta(epsilon) is decreasing and tends to 0; any finite value is
asked (``get_delta``)                               answered (huge ones give delta ~ 0).
ledger epsilon budget      (0, inf]                 inf means no budget; the budget is only compared, never computed.
counts, rounds             integers in [1, 1e9]     1e9 releases of one client is beyond any federated run; it keeps
                                                    count * rho and count * mu^2 exact enough in doubles. The pld
                                                    backend composes any count in bounded time (adaptive grid below).
ledger round index         integers in [0, 1e9]     the same bound; SQLite's INTEGER is 64-bit.
sampling rate q            (0, 1]                   a probability; q = 1 samples everyone and is the event itself.
sensitivity, noise std,    finite, > 0              Their ratio may still overflow or underflow: mu = sensitivity /
rho                                                 noise_std = inf is reported as epsilon = inf (the honest answer),
                                                    mu = 0 as a release that costs nothing.
pld grid interval          [1e-6, 1]                The requested interval; the accountant coarsens it itself when the
                                                    privacy-loss grid would exceed ``PLD_MAX_LEAF_POINTS`` points for
                                                    one mechanism or ``PLD_MAX_TOTAL_POINTS`` for the composition (a
                                                    coarser pessimistic grid is still an upper bound), and falls back to
                                                    the Gaussian-DP bound without amplification (also an upper bound)
                                                    when even an interval of ``PLD_MAX_INTERVAL`` would not do. So tiny
                                                    noise multipliers (0.01 and below) and huge counts answer in
                                                    about a second instead of minutes.
rdp orders                 1 to 1000 orders in      dp-accounting's sampled-Gaussian RDP costs O(alpha) per integer
                           (1, 1e5], summing to     order (~0.6 s at alpha = 1e5); the default orders (up to ~2.3e3)
                           at most 1e5              sum to ~2e4.
calibration ``tol``        [1e-6, 0.01]             relative precision of the bisection; below 1e-6 it would only add
                                                    iterations (1 + tol must differ from 1 by far more than an ulp).
budget shares              finite, > 0, smallest    Shares are normalised; a channel with less than 1e-12 of the largest
                           >= 1e-12 x largest       share carries no signal, and the ratio keeps s / sqrt(share) finite.
noise multipliers          finite, > 0              (calibration searches s in [1e-6, 1e9]; beyond 1e9 no answer).
neighbouring relation      "add_remove" or          ``RELATIONS``; see ``PoissonSampledEvent``.
                           "replace_one"
privacy unit               "example" or "client"    ``UNITS``; stored in the ledger.
client id                  non-empty str, or an     converted with ``str``; None, booleans, floats are refused so two
                           int (not bool)           spellings of one client never split its budget.
channel, run id            non-empty str            ledger keys.
ledger meta                a dict of JSON values    stored as JSON with the run (NaN and objects are refused).
=========================  =======================  ===================================================================
"""

from __future__ import annotations

import math
import numbers

from .errors import InvalidLedgerArgument, InvalidPrivacyParameter

MIN_DELTA = 1e-100
MIN_TARGET_EPSILON = 1e-6
MAX_TARGET_EPSILON = 1000.0
MAX_COUNT = 10 ** 9
MAX_ROUND = 10 ** 9
MIN_PLD_INTERVAL, MAX_PLD_INTERVAL = 1e-6, 1.0
MAX_RDP_ORDERS, MAX_RDP_ORDER, MAX_RDP_ORDER_SUM = 1000, 1e5, 1e5
MIN_TOL, MAX_TOL = 1e-6, 0.01
MIN_SHARE_RATIO = 1e-12
RELATIONS = ("add_remove", "replace_one")
UNITS = ("example", "client")


def _as_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidPrivacyParameter(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    try:
        value = float(value)
    except OverflowError:  # an int beyond the double range
        raise InvalidPrivacyParameter(f"{name} is too large to be a floating-point number: {value!r}") from None
    if math.isnan(value):
        raise InvalidPrivacyParameter(f"{name} is NaN; pass a finite number")
    return value


def check_positive_finite(name: str, value) -> float:
    value = _as_float(name, value)
    if not math.isfinite(value) or value <= 0:
        raise InvalidPrivacyParameter(f"{name} must be a finite number > 0, got {value!r}")
    return value


def check_non_negative_finite(name: str, value) -> float:
    value = _as_float(name, value)
    if not math.isfinite(value) or value < 0:
        raise InvalidPrivacyParameter(f"{name} must be a finite number >= 0, got {value!r}")
    return value


def check_epsilon(value, *, allow_inf: bool = False) -> float:
    """An epsilon budget: > 0, finite unless ``allow_inf`` (epsilon = inf means 'no privacy')."""
    value = _as_float("epsilon", value)
    if value <= 0:
        raise InvalidPrivacyParameter(f"epsilon must be > 0, got {value!r}; use a positive target such as 1 or 3")
    if math.isinf(value) and not allow_inf:
        raise InvalidPrivacyParameter("epsilon must be finite here; epsilon = inf means no privacy guarantee")
    return value


def check_target_epsilon(value) -> float:
    """A calibration target: finite, in [MIN_TARGET_EPSILON, MAX_TARGET_EPSILON] (see the table above)."""
    value = check_epsilon(value)
    if value > MAX_TARGET_EPSILON:
        raise InvalidPrivacyParameter(
            f"target epsilon {value:g} is above {MAX_TARGET_EPSILON:g}: such a guarantee bounds likelihood ratios by "
            f"e^{value:g} and protects nothing; run without privacy (epsilon = inf) or choose a target <= "
            f"{MAX_TARGET_EPSILON:g}")
    if value < MIN_TARGET_EPSILON:
        raise InvalidPrivacyParameter(
            f"target epsilon {value:g} is below {MIN_TARGET_EPSILON:g}: the noise it needs (over "
            f"{1 / MIN_TARGET_EPSILON:g} times the sensitivity per round) would leave nothing of the signal; "
            "choose a target >= 1e-6")
    return value


def check_delta(value) -> float:
    value = _as_float("delta", value)
    if not 0 < value < 1:
        raise InvalidPrivacyParameter(
            f"delta must lie strictly between 0 and 1, got {value!r}; a common choice is 1e-5 or 1/(10 n)")
    if value < MIN_DELTA:
        raise InvalidPrivacyParameter(
            f"delta={value!r} is below {MIN_DELTA:g}, which protects no data set more than 1e-100 does; "
            "a common choice is 1e-5 or 1/(10 n)")
    return value


def check_probability(name: str, value) -> float:
    """A sampling rate q in (0, 1]."""
    value = _as_float(name, value)
    if not 0 < value <= 1:
        raise InvalidPrivacyParameter(f"{name} must lie in (0, 1], got {value!r}")
    return value


def check_count(name: str, value) -> int:
    """A number of compositions (or rounds): an integer in [1, MAX_COUNT]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidPrivacyParameter(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise InvalidPrivacyParameter(f"{name} must be >= 1, got {value}")
    if value > MAX_COUNT:
        raise InvalidPrivacyParameter(
            f"{name}={value} is above the supported maximum of {MAX_COUNT:g} compositions; split the run or "
            "account for it in parts")
    return int(value)


def check_relation(value) -> str:
    """A neighbouring relation: one of ``RELATIONS``."""
    if not isinstance(value, str) or value not in RELATIONS:
        raise InvalidPrivacyParameter(
            f"relation must be one of {', '.join(repr(r) for r in RELATIONS)}, got {value!r} "
            "(replace_one when clients' record counts are public, add_remove otherwise)")
    return value


def check_unit(value) -> str:
    """A privacy unit: one of ``UNITS``."""
    if not isinstance(value, str) or value not in UNITS:
        raise InvalidLedgerArgument(
            f"unit must be one of {', '.join(repr(u) for u in UNITS)}, got {value!r}")
    return value


def check_client_id(value) -> str:
    """A client id: a non-empty string, or an integer (converted to its decimal string)."""
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Integral)):
        raise InvalidLedgerArgument(
            f"client_id must be a non-empty string or an integer, got {value!r} ({type(value).__name__})")
    value = str(int(value)) if isinstance(value, numbers.Integral) else value
    if not value:
        raise InvalidLedgerArgument("client_id must be a non-empty string")
    return value


def check_round(value) -> int:
    """A round index: an integer in [0, MAX_ROUND]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= MAX_ROUND:
        raise InvalidLedgerArgument(f"round must be an integer in [0, {MAX_ROUND:g}], got {value!r}")
    return int(value)


def check_name(what: str, value) -> str:
    """A ledger key (channel name, run id): a non-empty string."""
    if not isinstance(value, str) or not value:
        raise InvalidLedgerArgument(f"{what} must be a non-empty string, got {value!r}")
    return value
