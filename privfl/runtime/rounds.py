"""The one round loop of every runtime: sample -> charge-only -> client steps -> sums -> server step -> record.

:func:`run_rounds` is the loop the in-process runtime (:class:`privfl.runtime.engine.Simulation`) and Flower's
ServerApp (``privfl.flower.app``, the Deployment Engine and the Simulation Engine alike) both run, as Flower's own
``Strategy`` drives a round whatever carries its messages. What differs between runtimes is how a round reaches the
clients and how its sums come back: that is a :class:`Transport`. A transport's :meth:`Transport.round` gets the
round's sampled clients (they train, charge and release) and the members left out (under amplification by sampling
they charge their round without releasing), and returns the round's aggregates, or none when nothing was released or
secure aggregation aborted the round (then nothing of it is revealed and the global state stays). Secure
aggregation is the transport's business (its stages are message rounds on Flower, a function call in process); the
loop sees only sums.

Decided here, once for every runtime:

- **Client sampling.** Poisson sampling draws every member of the population each round from the run's sampler
  (the OS CSPRNG unless the run is seeded on purpose: ``privfl.core.public.client_sampler``), whether or not the
  member can still take part; a resumed run draws the earlier rounds' samples first, so a seeded run's samples stay
  those of an uninterrupted run.
- **Exhausted budgets.** A client whose budget refused a charge (sampled or left out) sits out every later round:
  it is asked nothing more, charged nothing more, and is listed as sat out in each round's record.
- **Divergence.** After each server step the global model is evaluated and a diverged run (non-finite parameters or
  predictions, an exploded regression RMSE) raises :class:`privfl.errors.TrainingDiverged`: it says so and stops,
  on every runtime. When the test set is the clients' own held-out records in a private run, only the global state
  the server broadcasts decides it (those records are never charged, so their metrics may not decide how many rounds
  are released); an empty test set is not evaluated; the clients' own models' metrics never decide it.
- **The record.** One :class:`RoundRecord` per round, with the largest and mean epsilon the clients' ledgers report
  (:meth:`Transport.epsilons`) and each noised channel's privacy signal-to-noise ratio (:func:`privacy_snr`), handed
  to ``on_round`` as soon as the round ends.
"""

from __future__ import annotations

import dataclasses

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from privfl.errors import DIVERGENCE_CAUSES, TrainingDiverged

#: a regression run whose test RMSE exceeds this many standard deviations of the test targets has diverged (its
#: predictions are worse than predicting the test mean by a factor of this squared in mean squared error)
EXPLODED_RMSE = 100.0


@dataclass
class RoundRecord:
    round: int
    aborted: bool
    participants: int
    sat_out: list[str]
    metrics: dict[str, float]
    epsilon_max: float
    epsilon_mean: float
    seconds: float
    #: the phase of a multi-phase run (``privfl.runtime.phases``) this round belongs to; None in a one-phase run
    phase: str | None = None
    #: each noised channel's privacy signal-to-noise ratio this round (:func:`privacy_snr`); empty when the round's
    #: sums carry no noise the server knows of (non-private, DP-SGD-trained, aborted, nobody released)
    snr: dict[str, float] = field(default_factory=dict)
    #: adaptive clipping: the clip the round's releases were clipped to (public: set by earlier releases); else None
    clip: float | None = None


@dataclass(frozen=True)
class RoundOutcome:
    """What a transport brings back from one round.

    ``aggregates``: the round's sums (channel name -> :class:`privfl.core.aggregation.Aggregate`), or None when no
    client released anything or the round aborted; ``participants``: the clients whose releases the sums hold (as the
    transport counts them); ``sat_out``: the clients whose budget refused this round's charge; ``aborted``: secure
    aggregation could not finish the round safely (nothing of it is revealed)."""

    aggregates: Mapping | None
    participants: int
    sat_out: tuple[int, ...] = ()
    aborted: bool = False


class Transport(Protocol):
    """How a round reaches the clients and how its sums come back (in process, Flower's Deployment Engine, Flower's
    Simulation Engine)."""

    def round(self, rnd: int, chosen: Sequence[int], left_out: Sequence[int]) -> RoundOutcome:
        """Run round ``rnd``: the clients of ``chosen`` train, charge and release (their releases summed, under secure
        aggregation where the run uses it); the members of ``left_out`` (not sampled this round) charge the round
        where amplification by sampling says they must. Nothing of the round may reach the server before its
        charges are durable."""

    def epsilons(self) -> list[float]:
        """The epsilon each client's ledger reports spent so far (empty when none is known yet)."""


def privacy_snr(aggregates: Mapping | None) -> dict[str, float]:
    """Each noised channel's privacy signal-to-noise ratio in one round: the norm of the sum the clients sent over
    the norm of the noise it carries, ``||S|| / (sigma sqrt(d))`` (pfl-research's SNR metric), for a sum of ``d``
    coordinates whose noise has std ``sigma`` per coordinate (local, central or distributed alike:
    ``Aggregate.noise_std``). The server knows only the noisy sum ``S + N``, so ``||S||^2`` is estimated without
    bias by ``||S + N||^2 - d sigma^2`` (0 when that is negative): computed from what was released and public noise
    levels, it is post-processing and costs no privacy. Near 0 the noise drowns the clients' signal (more clients,
    a smaller model, a looser epsilon or a tighter clip help); far above 1 the noise costs little utility."""
    out = {}
    for name, agg in (aggregates or {}).items():
        sigma = float(getattr(agg, "noise_std", 0.0) or 0.0)
        total = np.asarray(getattr(agg, "total", ()), dtype=np.float64)
        if sigma <= 0 or not total.size or not np.all(np.isfinite(total)):
            continue
        d = total.size
        signal2 = max(float(np.dot(total.ravel(), total.ravel())) - d * sigma ** 2, 0.0)
        out[name] = math.sqrt(signal2) / (sigma * math.sqrt(d))
    return out


def divergence(algorithm, metrics: dict, test, spread: float | None = None, *,
               test_private: bool = False) -> str | None:
    """What shows that a run diverged after a round, or None: the global model's parameters are not finite; a
    classifier's test predictions are not finite (its NLL is NaN); or a regression's test RMSE is not finite or
    exceeds :data:`EXPLODED_RMSE` standard deviations of the test targets (``spread``, in the targets' own units;
    computed from ``test`` when None). ``metrics`` are the global model's (``evaluate``), never the clients' own
    models' (``local_metrics``: their state is never released).

    ``test_private``: the test set holds the clients' own held-out records in a private run
    (``FederatedData.test_from_clients``). Those records are never charged, so nothing computed on them may decide
    what is released (how many rounds run and are charged): the decision then reads only what the server holds,
    the global state it broadcasts (post-processing of the releases), and its text shows no statistic of the test
    set."""
    params = getattr(algorithm, "global_params", None)
    if isinstance(params, np.ndarray) and params.size and not np.all(np.isfinite(params)):
        return "the global model's parameters are not finite (NaN or Inf)"
    if test_private:
        if not _broadcast_finite(algorithm):
            return "the global model's parameters are not finite (NaN or Inf)"
        return None
    if test is None or not len(test):
        return None
    if "rmse" in metrics:
        rmse = float(metrics["rmse"])
        if not math.isfinite(rmse):
            return f"the global model's test RMSE is {rmse} (its predictions are not finite)"
        if spread is None:
            spread = target_spread(test)
        if spread > 0 and rmse > EXPLODED_RMSE * spread:
            return (f"the global model's test RMSE {rmse:.3g} is {rmse / spread:.3g} times the standard deviation "
                    f"of the test targets ({spread:.3g}): its predictions exploded")
    elif "nll" in metrics and math.isnan(float(metrics["nll"])):
        return "the global model's test predictions are not finite (NaN)"
    return None


def _broadcast_finite(algorithm) -> bool:
    """Whether every number of the server's broadcast state (``broadcast_state``: what it sends the clients, computed
    from releases alone) is finite."""
    def finite(value) -> bool:
        if isinstance(value, Mapping):
            return all(finite(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return all(finite(v) for v in value)
        if hasattr(value, "detach"):  # a torch tensor
            value = value.detach().cpu().numpy()
        if isinstance(value, np.ndarray) and value.dtype.kind in "fc":
            return bool(np.all(np.isfinite(value)))
        if isinstance(value, float):
            return math.isfinite(value)
        return True

    return all(finite(getattr(algorithm, name, None)) for name in getattr(algorithm, "broadcast_state", ()) or ())


def target_spread(test) -> float:
    """The standard deviation of a regression test set's targets in their own units (0 for classification)."""
    if test is None or getattr(test, "task", None) != "regression" or not len(test):
        return 0.0
    return float(np.std(test.to_original_units(test.y)))


def run_rounds(algorithm, transport: Transport, *, n_clients: int, rounds: int, first_round: int = 0,
               sampling_rate: float = 1.0, sampler: np.random.Generator | None = None,
               evaluate: Callable[[], dict] | None = None, test=None,
               on_round: Callable[[RoundRecord], None] | None = None,
               last_round: int | None = None, fixed_denominator: bool = False,
               local_evaluate: Callable[[], dict] | None = None, test_private: bool = False) -> list[RoundRecord]:
    """Rounds ``first_round .. rounds - 1`` of ``algorithm`` (its server half) over ``transport``; returns their
    records. ``sampler`` draws the Poisson client sample when ``sampling_rate < 1``; ``evaluate`` gives the round's
    metrics after the server step (none when omitted); ``test`` (the data ``evaluate`` reads, if any) is what the
    divergence check compares a regression's RMSE against (an empty ``test`` is not evaluated: the round's metrics
    are empty); ``local_evaluate`` gives the clients' own models' metrics (``local_metrics``), recorded with the
    round's but never read by the divergence check; ``test_private``: ``test`` is the clients' own held-out records in
    a private run, so no metric on it decides whether the run stops (:func:`divergence`); ``last_round``: stop before this round (a launch that
    pauses the run, to be resumed; the plan stays that of all ``rounds``). ``fixed_denominator`` (a run amplified by
    client sampling, ``RunPlan.amplified``): the server step divides the sums by the *expected* total weight,
    ``sampling_rate * n_clients`` (every client-level release weighs 1; the aggregates' ``participants`` is that
    expected count too), never by the realised one, as McMahan et
    al. (ICLR 2018) do: a mean over the realised sample would publish its size in the model's noise scale, and
    amplification holds only while the sample stays secret. See the module docstring for what is decided here."""
    if not 0.0 < sampling_rate <= 1.0:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
    sampled = sampling_rate < 1.0
    if sampled and sampler is None:
        raise ValueError("a sampled run needs its client sampler")
    if sampled:
        for _ in range(first_round):  # a resumed run draws its rounds' samples where the first left off
            sampler.random(n_clients)
    spread = target_spread(test)
    exhausted: set[int] = set()  # clients whose budget is spent take no further part, charged or not
    records: list[RoundRecord] = []
    for rnd in range(first_round, rounds if last_round is None else min(rounds, last_round)):
        start = time.perf_counter()
        live = [k for k in range(n_clients) if k not in exhausted]
        if sampled:
            drawn = sampler.random(n_clients) < sampling_rate  # the whole population, every round
            chosen = [k for k in live if drawn[k]]
            left_out = [k for k in live if not drawn[k]]
        else:
            chosen, left_out = live, []
        round_clip = getattr(algorithm, "round_clip", None)  # adaptive clipping's clip, before the server step
        clip = round_clip() if round_clip is not None else None
        outcome = transport.round(rnd, chosen, left_out)
        exhausted.update(int(k) for k in outcome.sat_out)
        snr = {}
        if outcome.aggregates is not None and not outcome.aborted:
            aggregates = outcome.aggregates
            if fixed_denominator:
                expected = sampling_rate * n_clients
                aggregates = {name: dataclasses.replace(agg, total_weight=expected, participants=expected)
                              for name, agg in aggregates.items()}
            snr = privacy_snr(aggregates)  # before the server step, which may consume the sums
            algorithm.server_update(aggregates, rnd)
        evaluated = test is None or len(test) > 0  # an empty test set: nothing to evaluate
        metrics = dict(evaluate()) if evaluate is not None and evaluated else {}
        diverged = divergence(algorithm, metrics, test, spread, test_private=test_private)
        if local_evaluate is not None and evaluated:
            metrics = {**metrics, **local_evaluate()}
        if diverged is not None:
            raise TrainingDiverged(f"{algorithm.name} diverged in round {rnd + 1} of {rounds}: {diverged}; "
                                   f"{DIVERGENCE_CAUSES}. The run stopped there: the rounds it ran, this one "
                                   "included, stay charged in the ledger")
        eps = transport.epsilons() or [0.0]
        record = RoundRecord(rnd, bool(outcome.aborted), int(outcome.participants),
                             [str(k) for k in sorted(exhausted)], metrics, float(max(eps)), float(np.mean(eps)),
                             time.perf_counter() - start, snr=snr, clip=clip)
        records.append(record)
        if on_round is not None:
            on_round(record)
    return records


__all__ = ["EXPLODED_RMSE", "RoundOutcome", "RoundRecord", "Transport", "divergence", "privacy_snr", "run_rounds", "target_spread"]
