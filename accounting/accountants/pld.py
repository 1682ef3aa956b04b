"""The PLD accountant: privacy loss distributions (Koskela et al. 2020; Doroshenko et al. 2022) built with
dp-accounting's ``privacy_loss_distribution`` and composed here, the tightest of the backends for sampled Gaussians.

Why not dp-accounting's ``PLDAccountant``: it fixes one neighbouring relation per accountant, and a run whose record
counts are public composes unsampled Gaussians with replace-one sampled ones. So the mechanisms are walked here, in
the order and with the parameters dp-accounting's accountant would use for add/remove (so add/remove results are
dp-accounting's, up to self-compositions beyond 2^14, done in blocks), each leaf a ``PrivacyLossDistribution``:

- an unsampled Gaussian of noise multiplier z composed n times: ``from_gaussian_mechanism(z / sqrt(n))``. Its PLD
  depends only on displacement / noise, so it composes with either relation;
- a Poisson-sampled round (its channels share one coin, so they are one Gaussian with mu^2 = sum mu_c^2, Dong, Roth
  and Su 2019, Cor. 3.3) composed n times: ``from_gaussian_mechanism(z, sampling_prob=q, neighboring_relation=R)
  .self_compose(n)``. Under add/remove z = 1 / mu. Under replace-one dp-accounting's ``REPLACE_ONE`` pair puts the
  sampled component at +r or -r, i.e. displacement 2r, so z = 2 / mu (radius = displacement / 2; see
  ``PoissonSampledEvent``).

A client's history holds one relation: add/remove-sampled and replace-one-sampled events together are refused.
Each leaf is built once per (leaf, count, grid) and cached, since calibration and ledgers rebuild the same leaves.

The privacy loss is discretised on a grid of width ``value_discretization_interval`` with dp-accounting's pessimistic
estimate (losses rounded up), so the reported epsilon is an upper bound. The default, 1e-3, keeps a 100-round
composition of a Poisson-sampled Gaussian (q <= 0.5, z >= 0.6) to ~0.2 s, against ~1-2 s at dp-accounting's default
of 1e-4, and moves epsilon by at most a few 1e-3 from that finer value (below 0.1% once epsilon >= 1). Pass a finer
interval when epsilon is tiny (below ~0.1).

Bounded cost. The grid's size grows with the spread of the privacy loss: as 1/z^2 for small noise and with the number
of compositions. Before building anything, the accountant estimates the width (in nats) of every leaf and of its
self-composition (dp-accounting truncates a self-composition with a Chernoff bound; the same bound is evaluated on the
continuous loss) and coarsens the interval when more than ``PLD_MAX_LEAF_POINTS`` points per leaf or
``PLD_MAX_TOTAL_POINTS`` points in all would be needed. A coarser pessimistic grid is still an upper bound, only a
looser one; it is needed for noise multipliers below ~0.3 or for millions of compositions (where epsilon is in the
hundreds, or, for 10^7 and more compositions of tiny per-step losses, where rdp is the tighter choice; the rounding up
of every composed loss adds up). Every answer is also capped by the composition's Gaussian-DP bound without
amplification (mu^2 = sum of count * mu^2, Balle and Wang 2018): sampling never hurts privacy, so that is an upper
bound too; it is the answer alone when even an interval of ``PLD_MAX_INTERVAL`` nats would not fit, or when
dp-accounting fails numerically. So noise multipliers down to 0.01 and below, and compositions of 10^9 rounds, answer
in about a second.
"""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np
from dp_accounting import NeighboringRelation
from dp_accounting.pld import privacy_loss_distribution as dp_pld
from scipy import special

from .analytic_gaussian import gaussian_delta, gaussian_epsilon
from .base import Accountant
from ..errors import InvalidPrivacyParameter
from ..events import (ComposedEvent, GaussianEvent, NoOpEvent, NonPrivateEvent, PoissonSampledEvent,
                               PrivacyEvent, SelfComposedEvent, ZCDPEvent, flatten, split_total_variation)
from ..validation import (MAX_PLD_INTERVAL, MIN_PLD_INTERVAL, check_delta, check_non_negative_finite,
                                   check_positive_finite)

DEFAULT_VALUE_DISCRETIZATION_INTERVAL = 1e-3
PLD_MAX_LEAF_POINTS = 2 ** 15
PLD_MAX_TOTAL_POINTS = 2 ** 20
PLD_MAX_INTERVAL = 1.0
# Noise multipliers above this are replaced by it: less noise can only cost more (sound), and dp-accounting's
# Gaussian overflows for noise around 1e150 and above. At z = 1e6 a release costs ~1e-6 nats, far below any grid.
_MAX_NOISE_MULTIPLIER = 1e6
# dp-accounting's defaults: a leaf's noise is truncated at log-mass -50 (|x| <= 9.67 sigma), a composition at 1e-15.
_TRUNCATION_SIGMAS = 9.674825283612355
_LOG_TWO_OVER_TAIL = math.log(2.0 / 1e-15)
_QUADRATURE_POINTS = 2001
_DIRECT_SELF_COMPOSE, _BLOCK = 2 ** 14, 64
_RELATIONS = {"add_remove": NeighboringRelation.ADD_OR_REMOVE_ONE, "replace_one": NeighboringRelation.REPLACE_ONE}

# A leaf: ("gaussian", z) for an unsampled Gaussian of noise multiplier z (noise / displacement), or
# ("sampled", q, z, relation) for a Poisson-sampled Gaussian whose dp-accounting noise multiplier is z.
Leaf = tuple


class PLDAccountant(Accountant):
    """Privacy-loss-distribution accountant: unsampled Gaussians and Poisson-sampled Gaussians under add/remove or
    replace-one adjacency (one relation per history)."""

    name = "pld"
    handles_total_variation = True

    def __init__(self, value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL) -> None:
        interval = check_positive_finite("value_discretization_interval", value_discretization_interval)
        if not MIN_PLD_INTERVAL <= interval <= MAX_PLD_INTERVAL:
            raise InvalidPrivacyParameter(
                f"value_discretization_interval must lie in [{MIN_PLD_INTERVAL:g}, {MAX_PLD_INTERVAL:g}], got "
                f"{interval!r}; the default {DEFAULT_VALUE_DISCRETIZATION_INTERVAL:g} suits epsilon >= 0.1")
        super().__init__()
        self.value_discretization_interval = interval
        self._blocks: list[tuple[tuple[Leaf, int], ...]] = []  # one per compose() call, in order
        self._totals: dict[Leaf, int] = {}  # every leaf's total count (the grid is sized for the whole composition)
        self._mu_squared = 0.0  # Gaussian-DP parameter of the composition without amplification (an upper bound)
        self._non_private = False
        self._relation: str | None = None  # of the sampled (q < 1) events composed so far
        # (PLD or None, grid interval or None, number of blocks in it): the fold of the first blocks, extended in
        # place by later compositions as long as the grid they need stays the same
        self._built: tuple[object, float | None, int] | None = None

    def copy(self) -> "PLDAccountant":
        """An independent accountant in the same state (the built distribution is shared: PLDs are immutable)."""
        other = PLDAccountant.__new__(PLDAccountant)
        other.value_discretization_interval = self.value_discretization_interval
        other._events = list(self._events)
        other._blocks = list(self._blocks)
        other._totals = dict(self._totals)
        other._mu_squared = self._mu_squared
        other._non_private = self._non_private
        other._relation = self._relation
        other._total_variation = self._total_variation
        other._built = self._built
        return other

    # -- composing ---------------------------------------------------------------------------------------------

    def supports(self, event: PrivacyEvent) -> bool:
        if isinstance(event, PrivacyEvent):
            event = split_total_variation(event)[0]  # compose() hands _refusal the idealised event
        return self._refusal(event) is None

    def _refusal(self, event: PrivacyEvent) -> str | None:
        if not isinstance(event, PrivacyEvent):
            return f"expected a PrivacyEvent, got {type(event).__name__}"
        plan = _plan(event)
        if isinstance(plan, str):
            return plan
        relations = {leaf[3] for leaf, _ in plan.leaves if leaf[0] == "sampled"}
        if self._relation is not None:
            relations.add(self._relation)
        if len(relations) > 1:
            return ("the pld accountant was given Poisson-sampled events under both add_remove and replace_one "
                    "adjacency; a run has one neighbouring relation (replace_one when clients' record counts are "
                    "public), so every sampled event of a client must declare the same relation")
        return None

    def _compose(self, event: PrivacyEvent, count: int) -> None:
        plan = _plan(event)
        block = tuple((leaf, n * count) for leaf, n in plan.leaves)
        if block:
            self._blocks.append(block)
        for leaf, n in block:
            self._totals[leaf] = self._totals.get(leaf, 0) + n
        self._mu_squared += count * plan.mu_squared
        self._non_private = self._non_private or plan.non_private
        for leaf, _ in plan.leaves:
            if leaf[0] == "sampled":
                self._relation = leaf[3]

    @property
    def relation(self) -> str | None:
        """The neighbouring relation of the sampled events composed so far (None if there are none)."""
        return self._relation

    @property
    def mu(self) -> float:
        """The Gaussian-DP parameter of the composition ignoring sampling (an upper bound; inf if non-private)."""
        return math.inf if self._non_private else math.sqrt(self._mu_squared)

    # -- answering ---------------------------------------------------------------------------------------------

    @property
    def effective_value_discretization_interval(self) -> float | None:
        """The grid the composition is (or will be) built on: the requested interval unless it had to be coarsened;
        None when the composition is too spread for any grid and only the Gaussian-DP bound is used."""
        return self._build()[1]

    def _build(self) -> tuple[object, float | None]:
        """(PLD of the composition or None, its grid): the blocks folded in order, each block's PLD composed into the
        fold of those before it. Incremental: blocks composed since the last answer are folded into the distribution
        built then, unless the whole composition now needs a coarser grid (then it is rebuilt). Either way the
        result is the same fold a fresh accountant given the same compositions would build."""
        n_blocks = len(self._blocks)
        built = self._built
        if built is not None and built[2] == n_blocks:
            return built[0], built[1]
        grid = _grid_for(self._totals.items(), self.value_discretization_interval) if self._blocks else \
            self.value_discretization_interval
        if built is not None and built[1] == grid and built[0] is not None:
            pld, start = built[0], built[2]
        else:
            pld, start = None, 0
        if grid is None or not self._blocks:
            self._built = (None, grid, n_blocks)
        else:
            self._built = _fold(pld, tuple(self._blocks[start:]), grid) + (n_blocks,)
        return self._built[0], self._built[1]

    def get_epsilon(self, delta: float) -> float:
        delta = check_delta(delta)
        if self._non_private:
            return math.inf
        return self._slack_epsilon(self._ideal_epsilon, delta)

    def _ideal_epsilon(self, delta: float) -> float:
        bound = gaussian_epsilon(self.mu, delta)
        pld, _ = self._build()
        if pld is None or bound == 0.0:
            return bound
        value = _call_pld(lambda: pld.get_epsilon_for_delta(delta))
        return bound if value is None else min(bound, max(0.0, value))

    def get_delta(self, epsilon: float) -> float:
        epsilon = check_non_negative_finite("epsilon", epsilon)
        if self._non_private:
            return 1.0
        bound = gaussian_delta(self.mu, epsilon)
        pld, _ = self._build()
        if pld is None or bound == 0.0:
            return self._slack_delta(bound, epsilon)
        value = _call_pld(lambda: pld.get_delta_for_epsilon(epsilon))
        return self._slack_delta(bound if value is None else min(bound, 1.0, max(0.0, float(value))), epsilon)


class _Plan:
    """What one event adds: leaves in dp-accounting's walking order, its mu^2 without sampling, non-privacy."""

    def __init__(self) -> None:
        self.leaves: list[tuple[Leaf, int]] = []
        self.mu_squared = 0.0
        self.non_private = False


def _plan(event: PrivacyEvent) -> _Plan | str:
    """The leaves of ``event`` (as dp-accounting's ``PLDAccountant`` would walk its translation), or why not."""
    plan = _Plan()

    def walk(e: PrivacyEvent, count: int) -> str | None:
        if isinstance(e, NoOpEvent):
            return None
        if isinstance(e, NonPrivateEvent):
            plan.non_private = True
            return None
        if isinstance(e, GaussianEvent):
            mu = e.mu
            if math.isinf(mu):
                plan.non_private = True
            elif mu > 0.0:
                plan.mu_squared += count * mu * mu
                plan.leaves.append((("gaussian", e.noise_multiplier), count))
            return None
        if isinstance(e, SelfComposedEvent):
            return walk(e.event, count * e.count)
        if isinstance(e, ComposedEvent):
            for sub in e.events:
                reason = walk(sub, count)
                if reason is not None:
                    return reason
            return None
        if isinstance(e, PoissonSampledEvent):
            if e.sampling_rate == 1.0:  # everyone is sampled: the event itself, whatever the relation
                return walk(e.event, count)
            return sampled(e, count)
        return f"the pld accountant cannot compose a {e.mechanism!r} event (it needs Gaussian releases)"

    def sampled(e: PoissonSampledEvent, count: int) -> str | None:
        leaves = flatten(e.event)
        if any(isinstance(leaf, ZCDPEvent) for leaf, _ in leaves):
            return (f"the pld accountant cannot compose {e.mechanism!r}: a Poisson-sampled mechanism known only to be "
                    "zCDP (e.g. distributed discrete Gaussian noise on a record sample) has no privacy loss "
                    "distribution; use the rdp accountant (accountant='rdp'), which bounds it with Zhu and Wang's "
                    "Poisson-subsampled RDP bound")
        if not all(isinstance(leaf, (GaussianEvent, NonPrivateEvent)) for leaf, _ in leaves):
            return (f"the pld accountant composes Poisson-sampled Gaussian releases only, not {e.mechanism!r} "
                    "(zCDP-only, nested sampling or unsupported mechanisms inside a sample have no exact treatment)")
        if any(isinstance(leaf, NonPrivateEvent) for leaf, _ in leaves):
            plan.non_private = True  # sound: a sampled non-private release is charged as non-private
            return None
        mu_squared = sum(n * leaf.mu * leaf.mu for leaf, n in leaves)
        if mu_squared == 0.0:
            return None
        if math.isinf(mu_squared):
            plan.non_private = True
            return None
        plan.mu_squared += count * mu_squared
        # dp-accounting's noise multiplier is relative to its sensitivity: the displacement under add/remove, the
        # radius (half the displacement) under replace-one.
        z = (1.0 if e.relation == "add_remove" else 2.0) / math.sqrt(mu_squared)
        plan.leaves.append((("sampled", e.sampling_rate, z, e.relation), count))
        return None

    reason = walk(event, 1)
    return plan if reason is None else reason


# -- building and composing privacy loss distributions -------------------------------------------------------------

def _call_pld(fn):
    """``fn()`` with dp-accounting's numerical failures turned into None (the caller then keeps its sound bound)."""
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = fn()
    except (ValueError, ArithmeticError, MemoryError, IndexError):
        return None
    value = float(value)
    return None if math.isnan(value) else value


@functools.lru_cache(maxsize=256)
def _single_pld(leaf: Leaf, interval: float):
    """The PLD of one sampled-Gaussian ``leaf`` on a grid of ``interval`` (cached: building it is most of the cost)."""
    _, q, z, relation = leaf
    return dp_pld.from_gaussian_mechanism(
        standard_deviation=min(z, _MAX_NOISE_MULTIPLIER), sampling_prob=q,
        neighboring_relation=_RELATIONS[relation], value_discretization_interval=interval,
        pessimistic_estimate=True)


@functools.lru_cache(maxsize=256)
def _leaf_pld(leaf: Leaf, count: int, interval: float):
    """The PLD of ``leaf`` composed ``count`` times on a grid of ``interval`` (cached: leaves recur across calls)."""
    if leaf[0] == "gaussian":
        return dp_pld.from_gaussian_mechanism(
            standard_deviation=min(leaf[1] / math.sqrt(count), _MAX_NOISE_MULTIPLIER),
            value_discretization_interval=interval, pessimistic_estimate=True)
    return _self_compose(_single_pld(leaf, interval), count)


@functools.lru_cache(maxsize=256)
def _block_pld(block: tuple[tuple[Leaf, int], ...], interval: float):
    """The PLD of one composition's leaves, folded in order (cached: every round of a run is the same block)."""
    pld = _leaf_pld(block[0][0], block[0][1], interval)
    for leaf, count in block[1:]:
        pld = pld.compose(_leaf_pld(leaf, count, interval))
    return pld


def _self_compose(pld, count: int):
    """``pld.self_compose(count)``, in blocks when ``count`` is large.

    dp-accounting keeps PLDs of at most 1000 points sparse, and before self-composing a sparse one it computes
    size ** count as a Python integer, which takes minutes at count = 10^7. A block of 64 compositions is dense
    (any PLD of two or more points), and dense self-composition costs the same at any count. Each stage truncates
    at most 1e-15 of mass, pessimistically (to infinite loss), so the result stays an upper bound.
    """
    if count <= _DIRECT_SELF_COMPOSE:
        return pld if count == 1 else pld.self_compose(count)
    blocks, rest = divmod(count, _BLOCK)
    out = pld.self_compose(_BLOCK).self_compose(blocks)
    return out if rest == 0 else out.compose(pld.self_compose(rest) if rest > 1 else pld)


def _fold(pld, blocks: tuple[tuple[tuple[Leaf, int], ...], ...], grid: float) -> tuple[object, float | None]:
    """(``pld`` composed with each block's PLD in order (``pld`` None: from the identity), grid); (None, None)
    when dp-accounting fails numerically: the accountant then answers with its Gaussian-DP bound alone."""
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if pld is None:  # dp-accounting's accountant starts from the identity too (so its results are ours)
                pld = dp_pld.identity(value_discretization_interval=grid)
            for block in blocks:
                pld = pld.compose(_block_pld(block, grid))
    except (ValueError, ArithmeticError, MemoryError, IndexError):
        return None, None
    return pld, grid


def _grid_for(totals, interval: float) -> float | None:
    """The requested interval, coarsened so that no leaf exceeds PLD_MAX_LEAF_POINTS grid points and the whole
    composition (``totals``: each distinct leaf with its total count) PLD_MAX_TOTAL_POINTS; None if that would need
    more than PLD_MAX_INTERVAL."""
    widest_leaf = total = 0.0
    for leaf, count in totals:
        leaf_width, composed_width, directions = _widths(leaf, count)
        widest_leaf = max(widest_leaf, leaf_width)
        total += directions * (leaf_width + 2.0 * composed_width)
    grid = max(interval, widest_leaf / PLD_MAX_LEAF_POINTS, total / PLD_MAX_TOTAL_POINTS)
    if not math.isfinite(grid) or grid > PLD_MAX_INTERVAL:
        return None
    if grid > interval:  # a round number of requested intervals, so that nearby compositions share cached leaves
        grid = interval * 2.0 ** math.ceil(math.log2(grid / interval))
        if grid > PLD_MAX_INTERVAL:
            return None
    return grid


@functools.lru_cache(maxsize=1024)
def _widths(leaf: Leaf, count: int) -> tuple[float, float, int]:
    """(width in nats of the leaf's privacy loss, width of its ``count``-fold self-composition, number of PLD
    directions built): the grid cost of a leaf, estimated without building it.

    The loss is evaluated on a fine grid of noise values over dp-accounting's truncation range; the self-composition
    is truncated as dp-accounting does, with a Chernoff bound at orders k / width, k = 1..20. The per-leaf part (the
    losses and their moment generating functions) is computed once per leaf, so a new count costs a few flops.
    """
    if leaf[0] == "gaussian":  # one Gaussian of mu = sqrt(count) / z: loss mu x + mu^2/2, x within truncation
        with np.errstate(all="ignore"):
            mu = math.sqrt(count) / min(leaf[1], _MAX_NOISE_MULTIPLIER)
            return mu * (2.0 * _TRUNCATION_SIGMAS + mu), 0.0, 1
    directions = _leaf_moments(leaf)
    if directions is None:
        return math.inf, math.inf, 2
    leaf_width = composed = 0.0
    for width, log_mgf_up, log_mgf_down in directions:
        leaf_width = max(leaf_width, width)
        composed = max(composed, _self_composed_width(width, log_mgf_up, log_mgf_down, count))
    return leaf_width, composed, len(directions)


@functools.lru_cache(maxsize=256)
def _leaf_moments(leaf: Leaf) -> tuple[tuple[float, tuple[float, ...], tuple[float, ...]], ...] | None:
    """Per PLD direction of a sampled leaf: (loss width, log-MGFs of the shifted loss at orders k / width and
    -k / width, k = 1..20); None if the leaf's loss is unbounded."""
    _, q, z, relation = leaf
    with np.errstate(all="ignore"):
        s = 1.0 / min(z, _MAX_NOISE_MULTIPLIER)
        if not math.isfinite(s * s):
            return None
        samples = [_loss_samples(q, s, relation, remove=True)]
        if relation == "add_remove":
            samples.append(_loss_samples(q, s, relation, remove=False))
        out = []
        for losses, weights in samples:
            width = float(np.max(losses) - np.min(losses))
            shifted = losses - np.min(losses)
            up: tuple[float, ...] = ()
            down: tuple[float, ...] = ()
            if width != 0.0:  # orders k / width, k = 1..20, all at once
                t = np.arange(1, 21)[:, None] / width
                up = tuple(special.logsumexp(t * shifted, b=weights, axis=1).tolist())
                down = tuple(special.logsumexp(-t * shifted, b=weights, axis=1).tolist())
            out.append((width, up, down))
        return tuple(out)


def _log_mixture(q: float, a):
    """log(1 - q + q e^a), without overflow."""
    return np.logaddexp(math.log1p(-q), math.log(q) + a)


def _loss_samples(q: float, s: float, relation: str, *, remove: bool):
    """Privacy losses on a grid of noise values x (unit noise, sampled component at distance s) and their masses
    under the upper distribution, following dp-accounting's definitions of the REMOVE / ADD / REPLACE pairs."""
    t = _TRUNCATION_SIGMAS
    if relation == "replace_one":
        x = np.linspace(-t - s, t + s, _QUADRATURE_POINTS)
        losses = _log_mixture(q, -s * x - s * s / 2) - _log_mixture(q, s * x - s * s / 2)
        log_mass = np.logaddexp(math.log1p(-q) - x * x / 2, math.log(q) - (x + s) ** 2 / 2)
    elif remove:
        x = np.linspace(-t - s, t, _QUADRATURE_POINTS)
        losses = _log_mixture(q, -s * x - s * s / 2)
        log_mass = np.logaddexp(math.log1p(-q) - x * x / 2, math.log(q) - (x + s) ** 2 / 2)
    else:
        x = np.linspace(-t, t, _QUADRATURE_POINTS)
        losses = -_log_mixture(q, s * x - s * s / 2)
        log_mass = -x * x / 2
    weights = np.exp(log_mass - special.logsumexp(log_mass))
    return losses, weights


def _self_composed_width(width: float, log_mgf_up: tuple[float, ...], log_mgf_down: tuple[float, ...],
                         count: int) -> float:
    """Width in nats of the ``count``-fold self-convolution after dp-accounting's Chernoff truncation."""
    if count == 1 or width == 0.0:
        return width
    upper, lower = count * width, 0.0
    for k in range(1, 21):
        t = k / width
        upper = min(upper, (count * log_mgf_up[k - 1] + _LOG_TWO_OVER_TAIL) / t)
        lower = max(lower, -(count * log_mgf_down[k - 1] + _LOG_TWO_OVER_TAIL) / t)
    return max(upper - lower, width)


__all__ = ["PLDAccountant", "DEFAULT_VALUE_DISCRETIZATION_INTERVAL", "PLD_MAX_LEAF_POINTS", "PLD_MAX_TOTAL_POINTS",
           "PLD_MAX_INTERVAL"]
