"""Calibration: the smallest noise that meets a target (epsilon, delta) over a number of rounds.

Each round, every channel c releases once with noise multiplier z_c = noise_std / sensitivity; with client sampling at
rate q < 1, the whole round (all channels) is one Poisson-sampled event, since a sampled client sends every channel.
Budget shares split one scalar s across channels, z_c = s / sqrt(share_c): under zCDP or Gaussian DP, channel c then
carries share_c of the total rho (or mu^2), and the round as a whole is a Gaussian with noise multiplier exactly s.

With ``relation="replace_one"`` (clients' record counts public) the sampled round is a replace-one Poisson-sampled
event; noise multipliers are then relative to the replace-one displacement (2C for a unit clipped to C), as every
sensitivity is (see ``PoissonSampledEvent``). Only the ``pld`` backend composes replace-one sampled events.

Calibration sees only events and accountants (a factory in, a number out). It bisects s, keeping the end that meets
the target, so the returned noise never overshoots the target and lies within ``tol`` (relative) of the smallest noise
the accountant accepts. Without sampling under ``exact`` the answer has a closed form: solve the analytic Gaussian for
mu at (epsilon, delta) (Balle and Wang 2018), then s = sqrt(rounds) / mu.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .accountants import ACCOUNTANTS, Accountant, make_accountant
from .accountants.analytic_gaussian import gaussian_mu
from .errors import InvalidPrivacyParameter, UnsupportedEventError
from .events import ComposedEvent, GaussianEvent, PoissonSampledEvent, PrivacyEvent, SelfComposedEvent
from .rounds import round_events
from .validation import (MAX_TOL, MIN_SHARE_RATIO, MIN_TOL, check_count, check_delta,
                                   check_non_negative_finite, check_positive_finite, check_probability,
                                   check_relation, check_target_epsilon)

DEFAULT_CHANNELS: Mapping[str, float] = MappingProxyType({"update": 1.0})
DEFAULT_TOL = 1e-3
_MIN_NOISE, _MAX_NOISE = 1e-6, 1e9  # bounds of the bracket search on s
_MAX_BISECTIONS = 200
#: the one margin every calibration aims below its target, relative: the ledger composes round by round (and PLD
#: discretises each composition), which can differ from the composition a search evaluates by up to ~1e-5 relative
#: (DP-SGD's Poisson-sampled steps under PLD); nothing a calibration returns may be tipped over the target by that
LEDGER_MARGIN = 1e-4

AccountantSpec = str | Callable[[], Accountant] | None


@dataclass(frozen=True)
class Calibration:
    """The result of :func:`calibrate`.

    ``noise_multipliers``: noise std / sensitivity per channel (one release per channel per round); ``epsilon``: the
    epsilon the accountant certifies for them at ``delta`` (never above ``target_epsilon``); ``accountant``: its name;
    ``relation``: the neighbouring relation the sampled rounds were accounted under.
    """

    noise_multipliers: dict[str, float]
    epsilon: float
    delta: float
    accountant: str
    rounds: int = 1
    sampling_rate: float = 1.0
    target_epsilon: float | None = None
    relation: str = "add_remove"

    def __post_init__(self):
        if not isinstance(self.noise_multipliers, Mapping):
            raise InvalidPrivacyParameter("noise_multipliers must map channel name -> noise multiplier")
        object.__setattr__(self, "noise_multipliers", _check_noise_multipliers(self.noise_multipliers))
        object.__setattr__(self, "epsilon", check_non_negative_finite("epsilon", self.epsilon))
        object.__setattr__(self, "delta", check_delta(self.delta))
        object.__setattr__(self, "rounds", check_count("rounds", self.rounds))
        object.__setattr__(self, "sampling_rate", check_probability("sampling_rate", self.sampling_rate))
        if not isinstance(self.accountant, str) or not self.accountant:
            raise InvalidPrivacyParameter("accountant must be the non-empty name of the accountant used")
        if self.target_epsilon is not None:
            object.__setattr__(self, "target_epsilon", check_positive_finite("target_epsilon", self.target_epsilon))
        check_relation(self.relation)

    @property
    def noise_multiplier(self) -> float:
        """The single channel's noise multiplier; an error when there are several channels."""
        if len(self.noise_multipliers) != 1:
            raise InvalidPrivacyParameter(
                f"this calibration has {len(self.noise_multipliers)} channels "
                f"({', '.join(self.noise_multipliers)}); read noise_multipliers[name] instead")
        return next(iter(self.noise_multipliers.values()))


def _check_channels(channels: Mapping[str, float] | None) -> dict[str, float]:
    """Validate budget shares and normalise them to sum to 1 (the smallest at least MIN_SHARE_RATIO of the largest)."""
    if channels is None:
        channels = DEFAULT_CHANNELS
    if not isinstance(channels, Mapping) or not channels:
        raise InvalidPrivacyParameter("channels must be a non-empty mapping of channel name -> budget share, "
                                      "e.g. {'natural_mean': 0.7, 'precision': 0.3}")
    shares = {}
    for name, share in channels.items():
        if not isinstance(name, str) or not name:
            raise InvalidPrivacyParameter(f"channel names must be non-empty strings, got {name!r}")
        shares[name] = check_positive_finite(f"budget share of channel {name!r}", share)
    largest = max(shares.values())
    relative = {name: share / largest for name, share in shares.items()}  # in (0, 1]: the sum cannot overflow
    smallest = min(relative, key=relative.get)
    if relative[smallest] < MIN_SHARE_RATIO:
        raise InvalidPrivacyParameter(
            f"channel {smallest!r} has {relative[smallest]:.3g} of the largest budget share; below "
            f"{MIN_SHARE_RATIO:g} it would carry no signal under its noise: drop the channel or raise its share")
    total = math.fsum(relative.values())
    return {name: share / total for name, share in relative.items()}


def _check_noise_multipliers(noise_multipliers: Mapping[str, float] | float) -> dict[str, float]:
    if not isinstance(noise_multipliers, Mapping):
        return {"update": check_positive_finite("noise_multiplier", noise_multipliers)}
    if not noise_multipliers:
        raise InvalidPrivacyParameter("noise_multipliers must name at least one channel")
    for name in noise_multipliers:
        if not isinstance(name, str) or not name:
            raise InvalidPrivacyParameter(f"channel names must be non-empty strings, got {name!r}")
    return {name: check_positive_finite(f"noise multiplier of channel {name!r}", z)
            for name, z in noise_multipliers.items()}


def _resolve_accountant(accountant: AccountantSpec, sampling_rate: float) -> tuple[Callable[[], Accountant], str]:
    """(factory of fresh accountants, name). Default: ``exact`` without sampling, ``pld`` with it."""
    if accountant is None:
        accountant = "exact" if sampling_rate == 1.0 else "pld"
    if isinstance(accountant, str):
        make_accountant(accountant)  # a clear error for unknown names
        name = accountant
        factory = ACCOUNTANTS[name]
    elif callable(accountant):
        factory = accountant
        probe = factory()
        if not isinstance(probe, Accountant):
            raise InvalidPrivacyParameter(f"the accountant factory returned {type(probe).__name__}, not an Accountant")
        if probe.events:
            raise InvalidPrivacyParameter("the accountant factory must return a fresh, empty accountant")
        name = probe.name
    else:
        raise InvalidPrivacyParameter(
            f"accountant must be a name ({', '.join(sorted(ACCOUNTANTS))}), a factory or None, got {accountant!r}")
    if name == "exact" and sampling_rate < 1.0:
        raise InvalidPrivacyParameter(
            f"the exact accountant cannot account for client sampling (sampling_rate={sampling_rate}); "
            "use accountant='pld' (tightest) or accountant='rdp'")
    return factory, name


def round_event(noise_multipliers: Mapping[str, float] | float, sampling_rate: float = 1.0,
                relation: str = "add_remove") -> PrivacyEvent:
    """The event of one round: one unit-sensitivity Gaussian release per channel, Poisson-sampled together (under
    ``relation``) if q < 1."""
    zs = _check_noise_multipliers(noise_multipliers)
    sampling_rate = check_probability("sampling_rate", sampling_rate)
    relation = check_relation(relation)
    releases = [GaussianEvent(1.0, zs[name]) for name in zs]
    if sampling_rate < 1.0:  # every channel sampled on the round's one coin, grouped as the ledger groups them
        releases = [PoissonSampledEvent(sampling_rate, r, relation) for r in releases]
    events = round_events((0, r) for r in releases)
    return events[0] if len(events) == 1 else ComposedEvent(tuple(events))


def _epsilon_of(factory: Callable[[], Accountant], event: PrivacyEvent, rounds: int, delta: float) -> float:
    accountant = factory()
    try:
        accountant.compose(event, count=rounds)
    except UnsupportedEventError as err:
        raise InvalidPrivacyParameter(f"the {accountant.name!r} accountant cannot account for these rounds: {err}") \
            from err
    return accountant.get_epsilon(delta)


def epsilon_for(noise_multipliers: Mapping[str, float] | float, rounds: int, sampling_rate: float = 1.0,
                delta: float = 1e-5, accountant: AccountantSpec = None, relation: str = "add_remove") -> float:
    """The epsilon at ``delta`` of ``rounds`` rounds with these noise multipliers, built from the same events as
    :func:`calibrate` (so a ledger or the CLI can recompute what a calibration promised)."""
    rounds = check_count("rounds", rounds)
    sampling_rate = check_probability("sampling_rate", sampling_rate)
    delta = check_delta(delta)
    event = round_event(noise_multipliers, sampling_rate, relation)
    factory, _ = _resolve_accountant(accountant, sampling_rate)
    return _epsilon_of(factory, event, rounds, delta)


def calibrate(target_epsilon: float, target_delta: float, rounds: int, sampling_rate: float = 1.0,
              channels: Mapping[str, float] | None = None, accountant: AccountantSpec = None,
              tol: float = DEFAULT_TOL, relation: str = "add_remove") -> Calibration:
    """The smallest noise multipliers meeting (target_epsilon, target_delta) after ``rounds`` rounds.

    ``channels`` maps channel name -> budget share (positive; normalised); channel c gets z_c = s / sqrt(share_c).
    ``accountant``: a backend name, a factory of fresh accountants, or None (``exact`` if sampling_rate == 1, else
    ``pld``). ``tol``: relative precision of s; the result meets the target and is at most (1 + tol) times the
    smallest s the accountant accepts. ``relation``: the run's neighbouring relation (``"add_remove"`` or
    ``"replace_one"``); the sampled rounds are accounted under it, and the noise multipliers are relative to the
    displacement under it. Limits on every argument: ``accounting.validation``.
    """
    target_epsilon = check_target_epsilon(target_epsilon)
    target_delta = check_delta(target_delta)
    rounds = check_count("rounds", rounds)
    sampling_rate = check_probability("sampling_rate", sampling_rate)
    shares = _check_channels(channels)
    tol = check_positive_finite("tol", tol)
    if not MIN_TOL <= tol <= MAX_TOL:
        raise InvalidPrivacyParameter(f"tol must lie in [{MIN_TOL:g}, {MAX_TOL:g}] (relative precision), got {tol}")
    relation = check_relation(relation)
    if sampling_rate < 1.0 and sampling_rate <= target_delta:
        raise InvalidPrivacyParameter(
            f"sampling_rate={sampling_rate} is not above delta={target_delta}: the target would hold with almost no "
            "noise; choose delta much smaller than the sampling rate (e.g. delta < 1/n for n clients)")
    if isinstance(accountant, str) or accountant is None:  # a pure function of its arguments: computed once
        cal = _calibrate_named(target_epsilon, target_delta, rounds, sampling_rate,
                               tuple(shares.items()), accountant, tol, relation)
        return dataclasses.replace(cal, noise_multipliers=dict(cal.noise_multipliers))
    return _calibrate(target_epsilon, target_delta, rounds, sampling_rate, shares, accountant, tol, relation)


@functools.lru_cache(maxsize=256)
def _calibrate_named(target_epsilon, target_delta, rounds, sampling_rate, shares, accountant, tol, relation):
    return _calibrate(target_epsilon, target_delta, rounds, sampling_rate, dict(shares), accountant, tol, relation)


def _calibrate(target_epsilon: float, target_delta: float, rounds: int, sampling_rate: float,
               shares: dict[str, float], accountant: AccountantSpec, tol: float, relation: str) -> Calibration:
    factory, name = _resolve_accountant(accountant, sampling_rate)

    def multipliers(s: float) -> dict[str, float]:
        return {c: s / math.sqrt(share) for c, share in shares.items()}

    def epsilon_at(s: float) -> float:
        return _epsilon_of(factory, round_event(multipliers(s), sampling_rate, relation), rounds, target_delta)

    found = None
    if name == "exact":
        found = _closed_form_exact(target_epsilon, target_delta, rounds, epsilon_at)
    if found is None:  # the one search, over the factory s -> the run's rounds (it aims LEDGER_MARGIN below)
        found = calibrate_noise(lambda s: SelfComposedEvent(round_event(multipliers(s), sampling_rate, relation),
                                                            rounds),
                                target_epsilon, target_delta, factory, tol=tol,
                                guess=_initial_guess(target_epsilon, target_delta, rounds, sampling_rate), step=1.15)
    s, epsilon = found
    return Calibration(noise_multipliers=multipliers(s), epsilon=epsilon, delta=target_delta, accountant=name,
                       rounds=rounds, sampling_rate=sampling_rate, target_epsilon=target_epsilon, relation=relation)


def _closed_form_exact(target_epsilon: float, target_delta: float, rounds: int,
                       epsilon_at: Callable[[float], float]) -> tuple[float, float] | None:
    """s = sqrt(rounds) / mu*, with mu* the largest Gaussian-DP parameter meeting the target (Balle and Wang 2018);
    nudged up by a few ulps if rounding put the check a hair above the target. None if that fails (then bisect)."""
    mu = gaussian_mu(target_epsilon, target_delta)
    if not (math.isfinite(mu) and mu > 0):
        return None
    s = math.sqrt(rounds) / mu
    for _ in range(20):
        if not _MIN_NOISE <= s <= _MAX_NOISE:
            return None
        epsilon = epsilon_at(s)
        if epsilon <= target_epsilon:
            return s, epsilon
        s *= 1.0 + 1e-12
    return None


def _initial_guess(target_epsilon: float, target_delta: float, rounds: int, sampling_rate: float) -> float:
    """A starting point for the bracket: the central-limit estimate (``clt_noise_multiplier``) of the noise that
    ``rounds`` releases sampled at ``sampling_rate`` need for the target."""
    guess = clt_noise_multiplier(gaussian_mu(target_epsilon, target_delta), sampling_rate, rounds)
    return min(max(guess, 1e-3), _MAX_NOISE / 10)


def clt_noise_multiplier(mu: float, sampling_rate: float, steps: int) -> float:
    """The noise multiplier z at which ``steps`` Poisson-sampled Gaussian releases (rate q, unit displacement) have
    Gaussian-DP parameter ``mu`` by the central limit theorem of Bu, Dong, Long and Su (2020),
    mu = q sqrt(steps (e^{1/z^2} - 1)); for q = 1 it is exact (z = sqrt(steps) / mu).

    Only a starting point for a search: the CLT under-states the privacy loss of few or strongly amplified steps
    (on MNIST-sized DP-SGD schedules the calibrated z is 0-15% above it)."""
    if not (mu > 0 and math.isfinite(mu)):
        return 1.0
    if sampling_rate >= 1.0:
        return math.sqrt(steps) / mu
    x = mu * mu / (sampling_rate * sampling_rate * steps)
    return 1.0 / math.sqrt(math.log1p(x)) if x > 0 else 1.0


def calibrate_noise(make_event: Callable[[float], PrivacyEvent], target_epsilon: float, target_delta: float,
                    accountant: AccountantSpec = "pld", *, guess: float = 1.0, tol: float = DEFAULT_TOL,
                    lower: float = _MIN_NOISE, upper: float = _MAX_NOISE, step: float = 2.0) -> tuple[float, float]:
    """The one search behind every calibration (dp-accounting's ``calibrate_dp_mechanism``, over privfl's events):
    the smallest noise parameter s, to relative precision ``tol``, such that ``make_event(s)`` composed by a fresh
    ``accountant`` meets (target_epsilon, target_delta), aiming :data:`LEDGER_MARGIN` below the target (the one margin
    of every calibration). Returns (s, its epsilon).

    epsilon must not increase with s (more noise never costs more). The search keeps the end that meets the target, so
    the answer never overshoots it. Below ``lower`` it stops (even that little noise meets the target); above ``upper``
    it raises :class:`InvalidPrivacyParameter`. ``step``: the first bracketing factor from ``guess`` (the factor then
    squares at every step outward); a good guess (e.g. ``clt_noise_multiplier``) with a small step saves evaluations.
    """
    target_epsilon = check_target_epsilon(target_epsilon)
    target_delta = check_delta(target_delta)
    tol = check_positive_finite("tol", tol)
    if not callable(make_event):
        raise InvalidPrivacyParameter("make_event must be a function noise -> PrivacyEvent")
    factory, _ = _resolve_accountant(accountant, 0.5 if accountant is None else 1.0)

    def epsilon_at(s: float) -> float:
        event = make_event(s)
        if not isinstance(event, PrivacyEvent):
            raise InvalidPrivacyParameter(f"make_event({s:g}) returned {type(event).__name__}, not a PrivacyEvent")
        return _epsilon_of(factory, event, 1, target_delta)

    guess = min(max(check_positive_finite("guess", guess), lower), upper)
    step = check_positive_finite("step", step)
    if step <= 1.0 + tol:
        raise InvalidPrivacyParameter(f"step must exceed 1 + tol, got {step}")
    return _search(target_epsilon * (1.0 - LEDGER_MARGIN), epsilon_at, tol, guess, lower, upper, step)


def _search(target_epsilon: float, epsilon_at: Callable[[float], float], tol: float, guess: float,
            lower: float, upper: float, step: float = 2.0) -> tuple[float, float]:
    """Bracket s by stepping out from ``guess`` (by ``step``, the factor squaring at every step), then close the
    bracket; invariant: epsilon_at(hi) <= target < epsilon_at(lo). Returns (hi, epsilon_at(hi)).

    epsilon(s) is smooth in log-log scale, so the bracket is closed by secant steps in (log s, log epsilon), each
    kept inside the inner 90% of the bracket, and by a bisection whenever the same end moved twice; a step that lands
    within ``tol`` of an end is pushed to ``tol`` beyond the secant's estimate, so that a good estimate closes the
    bracket in one more evaluation. From a central-limit guess, 3 to 6 evaluations."""
    eps_guess = epsilon_at(guess)
    factor = step
    if eps_guess <= target_epsilon:
        hi, eps_hi = guess, eps_guess
        while True:
            lo = hi / factor
            eps_lo = epsilon_at(lo)
            if eps_lo > target_epsilon:
                break
            hi, eps_hi = lo, eps_lo
            factor = min(factor * factor, 1e6)
            if hi < lower:
                return hi, eps_hi  # even vanishing noise meets the target (only for degenerate accountants)
    else:
        lo, eps_lo = guess, eps_guess
        hi = factor * lo
        while True:
            if hi > upper:
                raise InvalidPrivacyParameter(
                    f"no noise multiplier up to {upper:g} meets epsilon={target_epsilon}; the accountant cannot "
                    "certify so small an epsilon (with pld, try a finer value_discretization_interval)")
            eps_hi = epsilon_at(hi)
            if eps_hi <= target_epsilon:
                break
            factor = min(factor * factor, 1e6)
            lo, eps_lo, hi = hi, eps_hi, factor * hi
    moved: tuple[str | None, str | None] = (None, None)
    recent = [(lo, eps_lo), (hi, eps_hi)]  # the last two evaluations, for the secant
    for _ in range(_MAX_BISECTIONS):
        if hi <= lo * (1.0 + tol):
            break
        a, b = math.log(lo), math.log(hi)
        (s1, e1), (s2, e2) = recent
        usable = min(e1, e2) > 0.0 and math.isfinite(max(e1, e2)) and e1 != e2 and s1 != s2
        if moved[0] is not None and moved[0] == moved[1] or not usable:
            mid = math.sqrt(lo * hi)
        else:
            # The secant through the last two evaluations in (log s, log epsilon), aimed 0.4 tolerance past its
            # root, away from the end that moved last: an accurate estimate then moves the other end and closes the
            # bracket. Kept inside the inner 98% of the bracket.
            slope = (math.log(e2) - math.log(e1)) / (math.log(s2) - math.log(s1))
            root = math.log(s2) + (math.log(target_epsilon) - math.log(e2)) / slope
            root += math.log1p(-0.4 * tol if moved[0] == "hi" else 0.4 * tol)
            mid = math.exp(min(max(root, a + 0.01 * (b - a)), b - 0.01 * (b - a)))
        eps_mid = epsilon_at(mid)
        if eps_mid <= target_epsilon:
            hi, eps_hi, side = mid, eps_mid, "hi"
        else:
            lo, eps_lo, side = mid, eps_mid, "lo"
        recent = [recent[1], (mid, eps_mid)]
        moved = (side, moved[0])
    return hi, eps_hi


__all__ = ["Calibration", "calibrate", "calibrate_noise", "clt_noise_multiplier", "epsilon_for", "round_event",
           "DEFAULT_TOL"]
