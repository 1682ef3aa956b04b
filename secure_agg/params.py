"""Parameters that carry their guarantee: the neighbour-graph degree k and the threshold t derived from the declared
number of clients n, dropout fraction delta, corruption fraction gamma and threat model, in the manner of Bell et al.
(CCS 2020, Sec. 4: a random k-regular graph, union bounds over clients of hypergeometric tails, statistical security
sigma and correctness eta), with the consistency condition of Bonawitz et al. (CCS 2017, Thm. 6.4) for an active
server.

The graph is a Harary ring over a uniformly random relabelling (``graph``), so a client's k neighbours are a uniformly
random k-subset of the others: the number of corrupt (or dropped) ones among them is hypergeometric, provided the
corrupt clients, and random dropouts, do not depend on the public graph seed (it is drawn fresh each session). With
at most C = floor(gamma n) corrupt and D = floor(delta n) dropped clients, and k + 1 share holders per client (itself
and its neighbours), we require, each failure bounded by n times a hypergeometric tail:

- privacy (probability >= 1 - 2^-sigma): the corrupt holders of an honest client are fewer than t (they alone learn
  nothing of its secrets); against an active server also fewer than 2t - (k + 1), so two different survivor sets can
  never both be signed by t holders of one client (the consistency round); and, for a semi-honest server with corrupt
  clients, no k/2 consecutive ring positions are all corrupt or dropped (the graph stays connected once the server
  removes the corrupt clients' masks, so it learns only the total);
- correctness (probability >= 1 - 2^-eta): every client keeps at least t live holders after the dropouts (and after
  corrupt ones refuse to help, against an active server), and no k/2 consecutive positions all drop (which would cut
  the graph; the round would abort).

Against an active server with corrupt clients the sparse graph is refused: the server can drop clients on purpose,
next to two corrupt ones, and cut a sub-sum out of the graph that no client can see (issue 14); the complete graph
(k = n - 1) is then used. For the complete graph the conditions are deterministic (worst case C corrupt, D dropped):
t > C (semi-honest, Bonawitz Thm. 6.3), 2t - n > C (active, Thm. 6.4), and n - D (- C) >= t.

What it buys (``Parameters.min_honest``): no set of messages the server can collect reveals a sum over fewer than
``required_inputs - C`` honest clients; the clients enforce ``required_inputs`` on the survivor set and on their part
of the graph themselves (``protocol.survivor_set_problem``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["Parameters", "ThreatModel", "derive_parameters", "check_parameters", "threshold_for",
           "default_min_inputs", "ParameterError"]

DEFAULT_SIGMA = 40
DEFAULT_ETA = 30


class ParameterError(ValueError):
    """Secure-aggregation parameters that do not carry the declared guarantee; the message says what to change."""


@dataclass(frozen=True)
class Parameters:
    """A degree and threshold that meet the declared threat model, and the guarantee they give."""

    n_clients: int
    degree: int
    threshold: int
    min_inputs: int
    max_corrupt: int
    max_dropped: int
    malicious: bool

    @property
    def required_inputs(self) -> int:
        return max(self.threshold, self.min_inputs)

    @property
    def min_honest(self) -> int:
        """The fewest honest clients any sum the server can unmask contains (0: no guarantee; raise min_inputs)."""
        return max(0, self.required_inputs - self.max_corrupt)


@dataclass(frozen=True)
class ThreatModel:
    """What a client declares for itself, from facts fixed before the run (never from the server's messages): the
    fraction of the roster that may drop (``dropout``) or collude with the server (``corruption``), the floor of
    inputs its noise was charged for (``min_inputs``), the variant it runs (``malicious``: an active server) and,
    optionally, the roster size it expects (``n_clients``; otherwise the size of the roster the server sends, which
    then bounds the corrupt clients by ``floor(corruption * roster)``).

    ``ClientSession(..., threat_model=...)`` derives the degree, threshold and survivor floor from it with
    ``derive_parameters`` and refuses a ``SessionConfig`` that differs (``protocol.threat_model_problem``), so a server
    cannot hand clients a weaker configuration than the one their guarantee was computed for.
    """

    dropout: float = 0.0
    corruption: float = 0.0
    min_inputs: int | None = None
    malicious: bool = True
    n_clients: int | None = None
    sigma: int = DEFAULT_SIGMA
    eta: int = DEFAULT_ETA

    def __post_init__(self):
        _counts(2, self.dropout, self.corruption)  # validates both fractions
        for name in ("min_inputs", "n_clients"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ParameterError(f"{name} must be a positive integer or None, got {value!r}")
        if not isinstance(self.malicious, bool):
            raise ParameterError(f"malicious must be True or False, got {self.malicious!r}")

    def parameters(self, n: int) -> Parameters:
        """The parameters every party derives for a roster of ``n`` clients (``ParameterError`` if none exist)."""
        return derive_parameters(n, dropout=self.dropout, corruption=self.corruption, malicious=self.malicious,
                                 min_inputs=self.min_inputs, sigma=self.sigma, eta=self.eta)


def _hyper_tail(population: int, marked: int, draws: int, at_least: int) -> Fraction:
    """P[X >= at_least] for X hypergeometric: ``draws`` of ``population`` without replacement, ``marked`` marked."""
    if at_least <= 0:
        return Fraction(1)
    total = math.comb(population, draws)
    hits = sum(math.comb(marked, i) * math.comb(population - marked, draws - i)
               for i in range(at_least, min(marked, draws) + 1))
    return Fraction(hits, total)


def _run_probability(n: int, bad: int, length: int) -> Fraction:
    """Union bound on some ``length`` consecutive ring positions all being among ``bad`` random clients."""
    if length > bad:
        return Fraction(0)
    p = Fraction(1)
    for i in range(length):
        p *= Fraction(bad - i, n - i)
    return n * p


def fraction_count(fraction: float, n: int) -> int:
    """floor(fraction * n), with the product's floating-point error forgiven upwards (0.29 * 100 is
    28.999999999999996 in binary, and a user who says 29 % of 100 means 29): the one rounding rule for how many of n
    clients a declared dropout or corruption fraction allows, used by the protocol's parameters and by the
    distributed noise plan alike (``privfl.privacy.secure.honest_shares``), so that the noise is never sized for
    more honest shares than the protocol guarantees."""
    return math.floor(fraction * n + 1e-9)


def _counts(n: int, dropout: float, corruption: float) -> tuple[int, int]:
    for name, value in (("dropout", dropout), ("corruption", corruption)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ParameterError(f"{name} must be a fraction in [0, 1), got {value!r}")
    return fraction_count(dropout, n), fraction_count(corruption, n)


def _problem(n: int, k: int, t: int, dropped: int, corrupt: int, malicious: bool, sigma: int, eta: int) -> str | None:
    """Why (n, k, t) does not carry the guarantee for ``dropped``/``corrupt`` clients, or None."""
    holders = k + 1
    if not (2 * t > holders and t <= holders):
        return f"threshold {t} must be a strict majority of the {holders} share holders"
    complete = k >= n - 1
    if complete:
        if t <= corrupt:
            return f"threshold {t} <= {corrupt} corrupt clients: they could reconstruct an honest client's secrets"
        if malicious and 2 * t - holders <= corrupt:
            return (f"against an active server the threshold must exceed (n + corrupt) / 2 = "
                    f"{(holders + corrupt) / 2:g} (Bonawitz Thm. 6.4), got {t}")
        lost = dropped + (corrupt if malicious else 0)
        if holders - lost < t:
            who = "dropped or corrupt" if malicious else "dropped"
            return f"after {lost} {who} clients only {holders - lost} remain, fewer than the threshold {t}"
        return None
    if k % 2:
        return f"a sparse neighbour graph needs an even degree, got {k}"
    if malicious and corrupt:
        return ("an active server with corrupt clients can cut a sub-sum out of a sparse graph unseen; use the "
                "complete graph (degree n - 1) or declare no corruption")
    privacy_budget, correct_budget = Fraction(1, 2 ** sigma), Fraction(1, 2 ** eta)
    others = n - 1
    if corrupt:
        # (an active server with corrupt clients was refused above, so only the semi-honest bound t remains)
        if n * _hyper_tail(others, corrupt, k, t) > privacy_budget / 2:
            return (f"with {corrupt} corrupt clients some client's {k} neighbours hold {t} (the threshold) or more of "
                    f"them with probability above 2^-{sigma}")
        if not malicious and _run_probability(n, corrupt + dropped, k // 2) > privacy_budget / 2:
            return (f"{corrupt} corrupt and {dropped} dropped clients may cut the graph (k/2 = {k // 2} in a row) "
                    f"with probability above 2^-{sigma}")
    lost = dropped + (corrupt if malicious else 0)
    if n * _hyper_tail(others, min(lost, others), k, holders - t + 1) > correct_budget / 2:
        return f"with {lost} clients lost some client keeps fewer than {t} live holders with probability above 2^-{eta}"
    if _run_probability(n, lost, k // 2) > correct_budget / 2:
        return f"{lost} lost clients cut the graph with probability above 2^-{eta}"
    return None


def check_parameters(n: int, degree: int, threshold: int, *, dropout: float = 0.0, corruption: float = 0.0,
                     malicious: bool = False, sigma: int = DEFAULT_SIGMA, eta: int = DEFAULT_ETA) -> None:
    """Raise ``ParameterError`` (saying what to change) unless (degree, threshold) carry the guarantee for n clients."""
    dropped, corrupt = _counts(n, dropout, corruption)
    k = min(degree, n - 1)
    problem = _problem(n, k, threshold, dropped, corrupt, malicious, sigma, eta)
    if problem is not None:
        hint = ""
        try:
            good = derive_parameters(n, dropout=dropout, corruption=corruption, malicious=malicious, sigma=sigma,
                                     eta=eta)
            hint = f"; degree={good.degree}, threshold={good.threshold} would"
        except ParameterError:
            hint = "; no degree and threshold meet it for this many clients"
        raise ParameterError(f"secure aggregation with n={n}, degree={k}, threshold={threshold}, dropout={dropout:g}, "
                             f"corruption={corruption:g}{' (active server)' if malicious else ''}: {problem}{hint} "
                             f"(or pass check=False, for tests only)")


@functools.lru_cache(maxsize=256)  # pure; every client of an in-process round derives the same parameters
def derive_parameters(n: int, *, dropout: float = 0.0, corruption: float = 0.0, malicious: bool = False,
                      min_inputs: int | None = None, sigma: int = DEFAULT_SIGMA, eta: int = DEFAULT_ETA) -> Parameters:
    """The smallest degree (then threshold) that carries the guarantee for the declared threat model."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ParameterError(f"secure aggregation needs at least 2 clients, got {n!r}")
    dropped, corrupt = _counts(n, dropout, corruption)
    candidates = [k for k in range(2, n - 1, 2)] + [n - 1]
    for k in candidates:
        t = threshold_for(n, k, dropout=dropout, corruption=corruption, malicious=malicious, sigma=sigma, eta=eta)
        if t is not None:
            floor = default_min_inputs(n, t, dropout=dropout, corruption=corruption, malicious=malicious)
            return Parameters(n, k, t, floor if min_inputs is None else max(t, min_inputs), corrupt, dropped,
                              malicious)
    raise ParameterError(f"no degree and threshold protect {n} clients against {dropped} dropped and {corrupt} corrupt "
                         f"clients{' and an active server' if malicious else ''}: lower the declared dropout or "
                         f"corruption, or add clients")


@functools.lru_cache(maxsize=1024)
def threshold_for(n: int, degree: int, *, dropout: float = 0.0, corruption: float = 0.0, malicious: bool = False,
                  sigma: int = DEFAULT_SIGMA, eta: int = DEFAULT_ETA) -> int | None:
    """The smallest threshold that carries the guarantee with this degree, or None if none does."""
    dropped, corrupt = _counts(n, dropout, corruption)
    k = min(degree, n - 1)
    for t in range((k + 1) // 2 + 1, k + 2):
        if _problem(n, k, t, dropped, corrupt, malicious, sigma, eta) is None:
            return t
    return None


def default_min_inputs(n: int, threshold: int, *, dropout: float = 0.0, corruption: float = 0.0,
                       malicious: bool = False) -> int:
    """The survivor floor used when none is given: the threshold, raised so that every sum the server can unmask holds
    at least two honest clients when corrupt clients are declared (as far as the survivors allow)."""
    dropped, corrupt = _counts(n, dropout, corruption)
    if not corrupt:
        return threshold
    return max(threshold, min(corrupt + 2, n - dropped - (corrupt if malicious else 0)))
