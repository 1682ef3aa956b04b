"""An audit of a real federated run in that one run (``privfl audit-run``): canaries inserted into the actual training,
each included or not by a fair coin, and a lower bound on epsilon from how well the server's view tells them apart.

The method is Steinke, Nasr and Jagielski's (NeurIPS 2023, "Privacy auditing with one (1) training run"): ``m``
canaries, each included independently with probability 1/2; after training, an auditor who sees what the server saw
scores every canary, guesses "included" for the ``k`` highest scores and "excluded" for the ``k`` lowest and counts
its correct guesses ``v`` of ``r = 2k``; ``k`` is each of 2, 5, 10 and 25 % of the canaries (fixed before the run),
each tested at a quarter of the significance level (a union bound), and the best bound is reported. Under
(epsilon, delta)-DP per canary, the probability of ``v`` or more correct guesses is at most

    beta + 2 m delta max_{1 <= i <= v} (P[B >= v - i] - beta) / i,   beta = P[B >= v],  B ~ Binomial(r, e^eps / (1 + e^eps))

(their Theorem 5.2's bound for approximate DP); the reported lower bound is the largest epsilon this rejects at the
significance level (5 % by default), 0 when even epsilon = 0 is not rejected. It is a statistical lower bound on the
run's true epsilon: an honest run's bound stays below its ledger's epsilon (with probability at least 1 - significance),
and a bound above the ledger's epsilon is evidence that the run leaked more than it charged.

Canaries here are **clients** at client level (``unit="client"``): each included canary is an extra member of the
federation whose client step releases, every round, its own secret direction ``u_i`` (a random unit vector of the
channel's dimension) scaled to ``10 C``, which the release pipeline clips to ``C u_i``: the largest change one client
may make. The audited channel is the algorithm's first norm-clipped vector channel (DP-FedAvg's update, FOLA's and
HBFL's natural mean, FedBNR's cross term); a canary also releases a direction of its own on every other norm-clipped
vector channel with room for one per canary (FOLA's and HBFL's precision) and zeros on the rest (inside every clip),
charged like any member's release, and its score sums its inner products with each such channel's view weighted by the
channel's clip over its noise's claimed variance (:func:`_weight`: the likelihood ratio of its Gaussian releases, so
that the canaries read the whole budget, not one channel's share). At record level (``unit="example"``, DP-FedSGD) they
are **records**: canary i belongs to client i mod K, and an included canary is, in every round, in its client's Poisson
lot with the lot's probability q (the auditor's coin, which the server never sees) and then adds its per-record term to
the client's gradient sum: its direction at norm 10 C clipped to C by the algorithm's own per-record clip, the largest
term one record may add (a gradient canary, as white-box DP-SGD audits insert them; in units of the round's clip under
adaptive clipping; see "What the record canaries exercise" below). The server's view
is the sum over rounds of the channel's noised aggregates, ``S``; a canary's score is ``<S, u_i>``, the directions
exactly orthogonal (disjoint supports, :class:`CanaryDirections`), so no canary's score holds another's. Everything else
is the user's run as ``privfl run`` builds it (algorithm, data, noise placement, calibration, ledger), with client
canaries' own ledger rows in the same ledger.

``fault`` injects the faults the mechanism audit catches, on the whole run, leaving every charge as calibrated (so
the ledger still claims the target): ``half_noise`` scales every Gaussian draw of the run by 1/2 (the clients' and the
server's), ``no_clip`` turns the norm clip off (the release pipeline's at client level; at record level the real
per-record clip, for the canaries only: ``record_level.audit_clip_fault``, a context variable read where the canaries
are clipped, so their 10 C gradients go out whole while the records keep their clip). They exist to show what the
audit can see; they are never reachable from ``privfl run``. A fault of the code itself (a broken clip function) is
seen the same way, since the canaries pass through that function (below).

What one run can show is limited by the canaries' count: with ``r`` guesses all correct, the bound is at most about
``log(r / log(1 / significance))``; at the ledger's own epsilon, a clipped canary's per-run signal is what the
calibration allows, so an honest run's bound sits well below the claim (Steinke et al. report the same looseness).
A fault that multiplies the leak (``no_clip``: ten times the sensitivity) is caught; one that only doubles the
Gaussian's privacy parameter (``half_noise``) needs many more canaries than a CI-sized run holds (see the README).
Record canaries go into DP-FedSGD and FedBNR, whose clients release per-record sums (a canary adds its direction at
the record's bound before the noise: FedBNR's on the upper triangle of Phi^T Phi, where its noise is drawn, at
:class:`~privfl.algorithms.fedbnr.PairedScatter`'s bound, and on Phi^T y at B B_y where it has room; FedBNR's sums do
not depend on the run's earlier releases, so the auditor, who knows the non-canary records (the bound holds for any
fixed non-canary data; only the canaries' coins are random), takes the clients' own sums off the server's view before
scoring), and into DP-SGD FedAvg, FOLA and HBFL, inside each client's
DP-SGD steps (the engine's one hook, ``record_level.audit_record_rows``, which every DP-SGD executor reads at the
same point, HBFL's meme's lot source too): at every step an included canary is in the step's Poisson lot with the
schedule's rate and joins the lot as a raw gradient row at 10 C_t (the step's clip), which the engine clips with the
lot's own rows and sums with them before the step's noise;
the server sees it only through the trained models, so a canary's score is minus the inner product;
``half_noise`` halves the steps' noise there. Their noise is the clients' own (local DP-SGD: the guarantee
holds against a server that sees every client's upload), so the auditor reads each canary against its own client's
uploads summed over the rounds, not against the sum over clients, whose other clients' noise would only hide it.
FOLA's audited channel is its DP-SGD-trained ``mean``, an absolute model: each upload less the broadcast mean
(public). A canary there is a gradient only (it adds nothing to the Fisher channels, as a record whose gradient
vanishes at the Fisher passes' points would), within what the composed guarantee covers. HBFL's canaries go into its
meme's mean coordinates; the server reads the client's meme mean off its two uploads (natural mean over precision,
the broadcast's added back), less the broadcast mean. On a channel of probability rows (FedBNN's), whose bound is
its range, a client canary releases one-hot rows at secret labels, fresh every round (:class:`CanaryRows`).

What the record canaries exercise. In the DP-SGD steps (DP-SGD FedAvg, FOLA, HBFL) a canary is a raw per-example
gradient row that joins the step's rows BEFORE the engine's per-record clip and is clipped by the same call as the
records: ``record_level.clip_factor`` on its norm beside the lot's norms in the vectorised executor
(``privfl.training.stacked.PerExampleTerms.join``) and in HBFL's lot source (``clipped_gradient_sum``), and opacus's
own clipping coefficient (``get_clipping_coef``, at the canary's per-parameter norms) in opacus's loop. A fault in
that clip (factor 1, a wrong bound) reaches the canaries and the audit reports it. DP-FedSGD's and FedBNR's per-record
sums are computed inside the algorithm, so there the canary's raw term (10 times a record's bound) is added to the
finished sum, scaled by the clip function the algorithm clips its records with, looked up in the algorithm's module at
each call (DP-FedSGD's ``clip_factor`` at the round's clip; FedBNR's ``clip_rows`` on a feature row of norm 10 B, its
Phi^T Phi term quadratic in the row, and ``clip_values`` on a target of 10 B_y): a fault in that function shows. Not
exercised: the call site. An algorithm that never calls its clip, calls it on other rows, or drops or misapplies its
factor (DP-FedSGD's own sum over its rows, FedBNR's own products) still clips the auditor's canary correctly, so such a
fault is invisible here (the neighbouring-pair tests, ``tests/privfl/test_neighbouring_contract*.py``, are the check
for that). Nor are the per-example gradients themselves (a canary is a given row, never a record run through the
model: a layer that mixes examples, or a wrong ghost-form norm of a real record, is not seen), opacus's second
backward pass that applies its coefficient to the records, or the step's Poisson sampling (a canary's inclusion is
the auditor's coin)."""

from __future__ import annotations

import dataclasses
import math
import secrets
import sys
from dataclasses import asdict, dataclass

import numpy as np
import scipy.optimize
import scipy.stats
import torch

from privfl.core.channels import NormClip, RangeBound
from privfl.mechanisms import NoiseSource
from privfl.errors import ConfigurationError

FAULTS = ("none", "half_noise", "no_clip")
#: the algorithms record canaries go into (``unit="example"``): DP-FedSGD's and FedBNR's per-record sums, DP-SGD
#: FedAvg's, FOLA's and HBFL's DP-SGD steps
RECORD_CANARIES = ("dp_fedsgd", "dpsgd_fedavg", "fola", "hbfl", "fedbnr")
#: the record-level algorithms whose canaries go into their DP-SGD steps (the engine's one hook,
#: ``record_level.audit_record_rows``)
STEP_CANARIES = ("dpsgd_fedavg", "fola", "hbfl")
#: the audited channel of the record-level algorithms other than DP-FedSGD (FedBNR's Phi^T Phi, its widest sum of
#: records' clipped terms, with Phi^T y beside it when it has room; the others' DP-SGD-trained uploads)
RECORD_CHANNEL = {"dpsgd_fedavg": "update", "fola": "mean", "hbfl": "natural_mean", "fedbnr": "scatter"}
#: a canary's raw norm, in clips: the pipeline's clip scales it to exactly C (``no_clip`` lets it out whole)
CANARY_NORM = 10.0
#: the auditor guesses "included" for the top and "excluded" for the bottom k = f m scores, for each f here, each test
#: at significance / len(GUESS_FRACTIONS) (a union bound), and reports the best bound
GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.25)
#: the spawn key of the auditor's seeded stream (coins, directions), apart from the run plan's streams
AUDIT_STREAM = 0x61756469


@dataclass
class RunAudit:
    """The result of :func:`audit_run` (``privfl audit-run --json`` writes :meth:`to_dict`)."""

    epsilon_lower_bound: float
    epsilon_ledger: float
    canaries: int
    fault: str
    included: int
    guesses: int
    correct: int
    significance: float
    delta: float
    rounds: int
    algorithm: str
    channel: str
    #: the bound is above the ledger's epsilon: the run leaked more than it charged (expected only with a fault)
    violated: bool

    def to_dict(self) -> dict:
        return asdict(self)


def one_run_p_value(m: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """The probability, under (epsilon, delta)-DP per canary, of at least ``correct`` right guesses out of ``guesses``
    among ``m`` canaries (the bound of the module docstring)."""
    if guesses <= 0 or correct <= 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = scipy.stats.binom.sf(correct - 1, guesses, q)  # P[B >= correct]
    if delta == 0:
        return float(min(tail, 1.0))
    i = np.arange(1, correct + 1)
    slack = np.max((scipy.stats.binom.sf(correct - i - 1, guesses, q) - tail) / i)
    return float(min(tail + 2 * m * delta * max(slack, 0.0), 1.0))


def one_run_lower_bound(m: int, guesses: int, correct: int, delta: float, significance: float = 0.05) -> float:
    """The largest epsilon whose (epsilon, delta) claim ``correct`` of ``guesses`` right guesses rejects at
    ``significance`` (0 when epsilon = 0 is not rejected)."""
    def rejects(eps: float) -> float:  # > 0 while the claim is rejected
        return significance - one_run_p_value(m, guesses, correct, eps, delta)

    if rejects(0.0) <= 0:
        return 0.0
    hi = 1.0
    while rejects(hi) > 0:
        hi *= 2
        if hi > 1e3:
            return math.inf
    return float(scipy.optimize.brentq(rejects, hi / 2 if hi > 1 else 0.0, hi, xtol=1e-6))


@dataclass(frozen=True)
class CanaryDirections:
    """``m`` orthonormal directions in ``d`` coordinates (m <= d), each a random unit vector on a block of its own:
    the coordinates in a random order, cut into m blocks of d // m (the rest unused). Disjoint supports make them
    exactly orthogonal, so a canary's score (its inner product with the server's view) holds nothing of another
    canary, and m can reach d; they are stored by block (``index``, ``weight``: m x d // m), never as an m x d matrix
    (20,000 canaries in 20,000 coordinates)."""

    index: np.ndarray
    weight: np.ndarray
    dimension: int

    @classmethod
    def draw(cls, m: int, d: int, rng: np.random.Generator) -> "CanaryDirections":
        if not 1 <= m <= d:
            raise ValueError(f"need 1 <= canaries <= coordinates, got {m} and {d}")
        size = d // m
        index = rng.permutation(d)[:m * size].reshape(m, size)
        weight = rng.standard_normal((m, size))
        return cls(index, weight / np.linalg.norm(weight, axis=1, keepdims=True), int(d))

    def sum(self, canaries) -> np.ndarray:
        """The sum of the directions of ``canaries`` (indices), as a dense vector."""
        out = np.zeros(self.dimension)
        rows = np.asarray(canaries, dtype=np.int64)
        np.add.at(out, self.index[rows].ravel(), self.weight[rows].ravel())
        return out

    def scores(self, seen: np.ndarray) -> np.ndarray:
        """Each canary's score from the server's view ``seen`` (the sum over rounds of the audited channel's noised
        aggregates): ``<seen, u_i>``, fixed before the run, as the bound requires."""
        return (np.asarray(seen, dtype=np.float64)[self.index] * self.weight).sum(axis=1)


class CanaryRows:
    """Canaries on a channel of probability rows (FedBNN's class probabilities on the public alignment set), whose
    bound is its range, not a clip: in each round canary i releases one-hot rows at secret labels, the largest change
    a client can make there, fresh labels every round (:meth:`start`, from the auditor's stream, before the round's
    releases), so that what the other included canaries add to a canary's score is independent across rounds
    instead of adding up coherently (one-hot rows cannot be orthogonal: with the same labels every round, 20,000
    canaries on 1,000 rows interfere as much as half the noise). A round's score (:meth:`scores`) is the round's view
    at the canary's labels, less the view's mean over the classes (what a canary with other labels would read); the
    audit sums them over the rounds."""

    def __init__(self, m: int, rows: int, classes: int):
        self.m, self.rows, self.classes = int(m), int(rows), int(classes)
        self.labels: np.ndarray | None = None  # canaries x rows, this round's
        self.round = None

    def start(self, rnd, rng: np.random.Generator) -> None:
        """Draw round ``rnd``'s labels, once per round (every canary of the round releases and is scored by them)."""
        if self.round != rnd:
            dtype = np.uint8 if self.classes <= 256 else np.int64
            self.labels, self.round = rng.integers(0, self.classes, size=(self.m, self.rows), dtype=dtype), rnd

    def release(self, i: int) -> np.ndarray:
        out = np.zeros((self.rows, self.classes))
        out[np.arange(self.rows), self.labels[i]] = 1.0
        return out

    def scores(self, seen: np.ndarray) -> np.ndarray:
        seen = np.asarray(seen, dtype=np.float64).reshape(self.rows, self.classes)
        return seen[np.arange(self.rows), self.labels].sum(axis=1) - seen.sum() / self.classes


class _Scaled(NoiseSource):
    """A noise source whose standard normals are ``factor`` times its inner source's (the ``half_noise`` fault)."""

    def __init__(self, inner, factor: float):
        self.inner, self.factor = inner, float(factor)

    def standard_normal(self, shape):
        return np.asarray(self.inner.standard_normal(shape), dtype=np.float64) * self.factor


def _norm(channel) -> float:
    """How far one canary moves ``channel``'s released coordinates (:func:`_coordinates`): the channel's add/remove
    sensitivity (a client's clip at client level; a record's term's bound at record level, for FedBNR's scatter the
    norm of the upper triangle of a record's phi phi^T, :class:`~privfl.algorithms.fedbnr.PairedScatter`)."""
    return float(channel.clip.sensitivity("add_remove"))


def _records_clip(algorithm, name: str):
    """The per-record clip function ``name`` as the algorithm's own code calls it (DP-FedSGD's ``clip_factor``,
    FedBNR's ``clip_rows`` and ``clip_values``): the attribute of the module of the first class in the algorithm's MRO
    whose module holds one, looked up at each call, so that a fault in the function the algorithm clips its records
    with (or in its module's name for it) reaches the canaries too."""
    for cls in type(algorithm).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), name, None)
        if callable(fn):
            return fn
    raise ConfigurationError(f"audit-run: {algorithm.name}'s module has no per-record clip {name!r} to clip its "
                             "record canaries with")


def _coordinates(channel) -> int:
    """The number of coordinates ``channel`` releases: a symmetric matrix's upper triangle (its noise is drawn there
    and mirrored), else its entries."""
    if channel.symmetric:
        return channel.shape[0] * (channel.shape[0] + 1) // 2
    return int(np.prod(channel.shape))


def _flat(channel, value) -> np.ndarray:
    """``value`` of ``channel`` as the vector of its released coordinates (a symmetric matrix's upper triangle)."""
    value = np.asarray(value, dtype=np.float64)
    return value[np.triu_indices(channel.shape[0])] if channel.symmetric else value.reshape(-1)


def _embed(channel, vector) -> np.ndarray:
    """The value of ``channel`` whose released coordinates are ``vector`` (:func:`_flat`'s inverse)."""
    if not channel.symmetric:
        return np.asarray(vector, dtype=np.float64).reshape(channel.shape)
    out = np.zeros(channel.shape)
    out[np.triu_indices(channel.shape[0])] = vector
    return out + np.triu(out, 1).T


def _weight(aggregate, channel) -> float:
    """A channel's weight in a canary's score: the canary's norm there over the variance of the noise its sum carries
    (as claimed), so that the sum over channels of the canary's inner products is the likelihood-ratio statistic of
    its releases on all of them (a Gaussian per coordinate); 1 for a channel without noise."""
    std = float(aggregate.noise_std)
    return _norm(channel) / std ** 2 if std > 0 else 1.0


def _audited_channel(algorithm):
    """The one channel canaries go into: at client level a private vector channel with a norm clip; at record level
    DP-FedSGD's gradient sum (a Poisson-sampled sum of per-record clipped terms)."""
    if algorithm.privacy.unit == "example" and algorithm.name in RECORD_CHANNEL:
        return {c.name: c for c in algorithm.channels()}[RECORD_CHANNEL[algorithm.name]]
    if algorithm.privacy.unit == "example":
        channel = {c.name: c for c in algorithm.channels()}.get("gradient_sum")
        if algorithm.name != "dp_fedsgd" or channel is None or channel.record_bands > 1:
            raise ConfigurationError(
                f"audit-run inserts record canaries into DP-FedSGD (--algorithm dp_fedsgd, whose clients release "
                f"per-record sums on Poisson lots, bands 1), DP-SGD FedAvg, FOLA, HBFL and FedBNR; {algorithm.name} at "
                f"unit='example' is not built; audit it at client level")
        return channel
    private = [c for c in algorithm.channels() if c.private]
    clipped = [c for c in private if isinstance(c.clip, NormClip) and len(c.shape) == 1]
    ranged = [c for c in private if isinstance(c.clip, RangeBound)]
    if algorithm.privacy.unit != "client" or not (clipped or ranged):
        raise ConfigurationError(
            f"audit-run inserts client canaries into a client-level run with a norm-clipped vector channel or a "
            f"channel of probability rows (dp_fedavg, fola, hbfl, fedbnr, fedbnn, or an algorithm of yours registered "
            f"with privfl.register_algorithm, at --unit client); {algorithm.name} at "
            f"unit={algorithm.privacy.unit!r} releases {[c.name for c in private]}")
    return (clipped or ranged)[0]  # the first: its canaries send zeros on the others (inside every clip)


def audit_run(algorithm, data, fed, privacy, *, canaries: int = 200, fault: str = "none",
              significance: float = 0.05, ledger_path: str = ":memory:", run_id: str | None = None,
              progress=None) -> RunAudit:
    """Run ``algorithm`` on ``data`` with ``canaries`` client canaries (each included by a fair coin) and return the
    one-run lower bound on epsilon beside the ledger's (module docstring). The coins and directions come from the
    OS CSPRNG, or from the run's seed when the run is seeded on purpose (``secure_noise=False``). ``algorithm`` is
    used up by the audit (its client and server steps are wrapped to play the canaries and record the server's
    view): give a fresh one, as ``privfl audit-run`` does."""
    from privfl.algorithms.base import ClientOutput
    from privfl.core.public import release_weight
    from privfl.models.vectors import mean_parameters
    from privfl.privacy.record_level import (audit_clip_fault, audit_noise_fault, audit_record_rows, canary_clip_off,
                                             dpsgd_schedule)
    from privfl.training.stacked import ExtraRows
    from privfl.runtime.engine import Simulation

    if fault not in FAULTS:
        raise ConfigurationError(f"--fault must be one of {FAULTS}, got {fault!r}")
    if isinstance(canaries, bool) or not isinstance(canaries, int) or canaries < 8:
        raise ConfigurationError(f"--canaries must be an integer >= 8 (a quarter of them are guessed each way), got "
                                 f"{canaries!r}")
    if not 0 < significance < 1:
        raise ConfigurationError(f"--significance must lie in (0, 1), got {significance!r}")
    if not privacy.private:
        raise ConfigurationError("audit-run audits a private run: give a finite --epsilon")
    if privacy.sampling_rate < 1:
        raise ConfigurationError("audit-run needs every canary in every round (--sampling-rate 1): the one-run bound "
                                 "is for canaries the run always includes or always leaves out")
    if privacy.placement == "distributed" and fault == "half_noise":
        raise ConfigurationError("--fault half_noise scales Gaussian draws; distributed noise is discrete shares: "
                                 "audit a central or local run")
    records = privacy.unit == "example"
    if records and algorithm.name not in RECORD_CANARIES:
        raise ConfigurationError(f"audit-run at --unit example inserts record canaries into {list(RECORD_CANARIES)}; "
                                 f"{algorithm.name}'s records act inside training where canaries are not built: audit "
                                 f"one of those, or client level (--unit client)")
    # the auditor's own stream, apart from every stream of the run plan (privfl.core.plan.seed_stream)
    rng = (np.random.default_rng(np.random.SeedSequence(fed.seed, spawn_key=(AUDIT_STREAM,)))
           if not privacy.secure_noise else np.random.default_rng(secrets.randbits(128)))
    included = np.flatnonzero(rng.random(canaries) < 0.5)
    # record level: the included canaries each client holds (canary i of client i mod K)
    owned = {k: [int(i) for i in included if i % len(data.train_parts) == k] for k in range(len(data.train_parts))}

    def record_clip(ch) -> float:
        """How much of a canary record's raw term (at :data:`CANARY_NORM` times a record's bound) DP-FedSGD's or
        FedBNR's own per-record clip keeps on channel ``ch`` (about 1 / CANARY_NORM): the clip function the
        algorithm clips its records with (:func:`_records_clip`, looked up at call time, so that a fault in it
        shows), or 1 under ``no_clip`` (:func:`~privfl.privacy.record_level.audit_clip_fault`, read here as the
        engines read it)."""
        if canary_clip_off():
            return 1.0 if algorithm.name != "fedbnr" else float(CANARY_NORM)  # FedBNR: raw terms, scaled below
        if algorithm.name == "fedbnr":  # a feature row of norm CANARY_NORM B and a target CANARY_NORM B_y
            b, by = float(algorithm.feature_clip), float(algorithm.target_clip)
            row = np.zeros((1, view["channel"].shape[0]))
            row[0, 0] = CANARY_NORM * b
            kept_row = float(np.linalg.norm(_records_clip(algorithm, "clip_rows")(row, b).value)) / b
            if ch.name == view["channel"].name:  # Phi^T Phi: the row's term phi phi^T, quadratic in the row
                return kept_row * kept_row / CANARY_NORM
            kept_target = float(np.abs(_records_clip(algorithm, "clip_values")(
                np.array([CANARY_NORM * by]), by).value[0])) / by
            return kept_row * kept_target / CANARY_NORM  # Phi^T y: row times target
        # DP-FedSGD: each record's factor clip_factor(||g||^2, C_t) at the round's clip (its sums are in units of
        # C_t under adaptive clipping)
        clip_now = float(algorithm.current_clip if getattr(algorithm, "adaptive", None) else clip)
        norms2 = torch.tensor([(CANARY_NORM * clip_now) ** 2], dtype=torch.float32)
        return float(_records_clip(algorithm, "clip_factor")(norms2, clip_now)[0])

    # the federation: the user's clients, then (client level) one client per included canary (its records are a copy
    # of the first client's, which public facts need; the canary's step never reads them); at record level the
    # included canaries are records of the user's clients (canary i of client i mod K), added to their sums
    parts = list(data.train_parts)
    canary_of = {}
    if not records:
        for i in included:
            canary_of[len(parts)] = int(i)
            parts.append(data.train_parts[0])
    audited = dataclasses.replace(data, train_parts=parts, name=f"{data.name}+canaries")
    clip = float(privacy.clip)
    # the audited channel, the canaries' directions and the server's sum over rounds (set after setup); with step
    # canaries also each client's uploads summed over rounds
    view = {"uploads": {}, "extra": [], "known": {}}
    real_update, real_server = algorithm.client_update, algorithm.server_update

    def record_canaries(k, out):
        """Client k's output with its included canary records that this round's Poisson coins drew: each adds its
        direction at 10 times a record's bound scaled by the algorithm's own per-record clip function
        (:func:`record_clip`: to the bound when that clip works; not clipped under ``no_clip``), in the units the
        channel is released in (the round's clip under adaptive clipping); on the audited channel and on each extra
        one (FedBNR: its direction on Phi^T Phi's upper triangle and on Phi^T y). These sums are computed inside the
        algorithm, so the canary is added to the finished sum: the clip function is the algorithm's, the call is
        the auditor's."""
        channel = view["channel"]
        if algorithm.name == "fedbnr":  # the clients' own sums, which the auditor may know (module docstring)
            for ch in [channel] + [c for c, _ in view["extra"]]:
                view["known"][ch.name] = view["known"].get(ch.name, 0.0) + _flat(ch, out.values[ch.name].value)
        drawn = [i for i in owned[k] if rng.random() < channel.record_sampling_rate]
        if not drawn:
            return out
        values = dict(out.values)
        for ch, directions in [(channel, view["directions"])] + view["extra"]:
            # a record's term's bound (DP-FedSGD: C, or 1 in units of the round's clip; FedBNR's scatter: the upper
            # triangle's)
            released = values[ch.name]
            raw = CANARY_NORM * _norm(ch)  # the canary's raw term, which the algorithm's record clip scales
            value = released.value + record_clip(ch) * raw * _embed(ch, directions.sum(drawn))
            if ch.value_bound is not None:  # the client's box on its whole sum, as it boxes its records' own
                value = np.clip(value, -ch.value_bound, ch.value_bound)
            values[ch.name] = dataclasses.replace(released, value=value)
        return dataclasses.replace(out, values=values)

    def dpsgd_update(k, dataset, rnd, rng_k):
        """DP-SGD FedAvg's (FOLA's, HBFL's) client step with client k's included canary records in its training:
        at every DP-SGD step each is in the step's Poisson lot with the schedule's rate (the auditor's coin) and
        joins the lot's per-example rows as a raw gradient row, its direction at 10 C_t (C_t: the clip the step
        applies, the round's under adaptive clipping), which the engine clips with the lot's own rows by the same
        call, before the step's noise (the engine's one hook, ``record_level.audit_record_rows``; under
        ``no_clip`` that clip leaves the canaries whole; for HBFL on its meme's mean coordinates). Then the server's
        view of the
        client: its upload (FOLA's absolute mean less the broadcast mean; HBFL's meme mean, natural mean over
        precision with the broadcast's added back, less the broadcast mean)."""
        q = dpsgd_schedule(algorithm, k).sample_rate
        if algorithm.name == "hbfl" and "layout" not in view:
            # where the meme's means sit in its flat parameter vector (fixed by its layout)
            meme = algorithm._fork_meme()
            means = {id(mu) for mu in mean_parameters(meme)}
            is_mean = np.concatenate([np.full(p.numel(), id(p) in means) for p in meme.parameters()])
            view["layout"] = (is_mean.size, np.flatnonzero(is_mean))

        def rows(step, clip_now):
            """The step's drawn canaries as raw gradient rows, each its direction at CANARY_NORM times the step's
            clip, for the engine to clip with the lot's rows (by their disjoint supports)."""
            drawn = [i for i in owned[k] if rng.random() < q]
            if not drawn:
                return None
            directions = view["directions"]
            index, dim = directions.index[drawn], directions.dimension
            if algorithm.name == "hbfl":  # the meme's mean coordinates
                dim, index = view["layout"][0], view["layout"][1][index]
            return ExtraRows(torch.as_tensor(index), torch.as_tensor(CANARY_NORM * clip_now * directions.weight[drawn],
                                                                     dtype=torch.float32), dim)

        with audit_record_rows(rows):
            out = real_update(k, dataset, rnd, rng_k)
        if algorithm.name == "hbfl":
            precision = np.asarray(out.values["precision"].value, dtype=np.float64) + algorithm.global_precision
            natural = np.asarray(out.values["natural_mean"].value, dtype=np.float64) + algorithm.global_natural_mean
            upload = natural / precision - np.asarray(algorithm.global_mean, dtype=np.float64)
        else:
            upload = np.asarray(out.values[view["channel"].name].value, dtype=np.float64)  # what the server receives
            if algorithm.name == "fola":  # an absolute mean: less the broadcast mean (public)
                upload = upload - np.asarray(algorithm.mean, dtype=np.float64)
        view["uploads"][k] = view["uploads"].get(k, 0.0) + upload
        return out

    def client_update(k, dataset, rnd, rng_k):
        if records and algorithm.name in STEP_CANARIES:
            return dpsgd_update(k, dataset, rnd, rng_k)
        if records:
            return record_canaries(k, real_update(k, dataset, rnd, rng_k))
        if k not in canary_of:
            return real_update(k, dataset, rnd, rng_k)
        if isinstance(view["directions"], CanaryRows):  # probability rows: the canary's one-hot rows, this round's
            view["directions"].start(rnd, rng)
            value = view["directions"].release(canary_of[k])
        else:
            bound = view["channel"].clip.bound  # the channel's own clip (FedBNR's cross term: its own bound)
            value = (CANARY_NORM * bound * view["directions"].sum([canary_of[k]])).astype(np.float32)
        values = {c.name: np.zeros(c.shape, dtype=np.float32) for c in view["channels"]}  # inside every clip
        values[view["channel"].name] = value
        for extra, directions in view["extra"]:  # its own direction on every other norm-clipped vector channel
            values[extra.name] = (CANARY_NORM * extra.clip.bound * directions.sum([canary_of[k]])).astype(np.float32)
        weight = (algorithm.release_weight(dataset, k) if hasattr(algorithm, "release_weight")
                  else release_weight(algorithm.privacy, algorithm.public, k, dataset))  # the public constant
        return ClientOutput(values, weight=weight)

    def server_update(aggregates, rnd):
        agg = aggregates[view["channel"].name]
        # what the server saw, as the coordinates the noise is drawn on, less what the auditor knows of it (FedBNR)
        seen = _flat(view["channel"], agg.total) - view["known"].pop(view["channel"].name, 0.0)
        if records and algorithm.name == "fola":  # absolute means: less the broadcast mean's public share
            seen = seen - agg.total_weight * np.asarray(algorithm.mean, dtype=np.float64)
        if view["extra"]:  # each channel's view weighted by its clip over its noise's variance (the claimed one)
            seen = seen * _weight(agg, view["channel"])
            for extra, _ in view["extra"]:
                other = aggregates[extra.name]
                known = view["known"].pop(extra.name, 0.0)
                view["extra_seen"][extra.name] += (_flat(extra, other.total) - known) * _weight(other, extra)
        if isinstance(view["directions"], CanaryRows):  # scored round by round, by the round's labels
            view["directions"].start(rnd, rng)
            view["row_scores"] += view["directions"].scores(seen)
        else:
            view["seen"] += seen
        real_server(aggregates, rnd)

    algorithm.client_update, algorithm.server_update = client_update, server_update
    algorithm.splittable = False  # one object plays both halves: the canaries' steps are this object's
    class Audited(Simulation):
        def prepare(self) -> None:
            """The run's own preparation (set-up, plan, pipelines), then the audit's: the canaries' directions in
            the audited channel, and the injected fault, if any."""
            super().prepare()
            channel = view["channel"] = _audited_channel(algorithm)
            view["channels"] = list(self.channels)
            if isinstance(channel.clip, RangeBound):
                if fault == "no_clip":
                    raise ConfigurationError(f"--fault no_clip: {algorithm.name}'s channel {channel.name!r} is "
                                             "bounded by its range (probability rows), not by a clip; audit "
                                             "--fault none or half_noise (nothing was charged)")
                view["directions"] = CanaryRows(canaries, channel.shape[0], channel.shape[1])
                view["row_scores"] = np.zeros(canaries)
                view["seen"] = np.zeros(_coordinates(channel))
            else:
                width = _coordinates(channel)
                if canaries > width:
                    raise ConfigurationError(f"--canaries {canaries}: the audited channel {channel.name!r} has "
                                             f"{width} coordinates, too few for that many orthogonal canary "
                                             f"directions; give at most {width} canaries or a larger model "
                                             f"(nothing was charged)")
                view["directions"] = CanaryDirections.draw(canaries, width, rng)
                view["seen"] = np.zeros(width)
                if not records:  # client canaries also on every other norm-clipped vector channel wide enough
                    extra = [c for c in self.channels if c.name != channel.name and c.private
                             and isinstance(c.clip, NormClip) and len(c.shape) == 1 and c.shape[0] >= canaries]
                elif algorithm.name not in STEP_CANARIES:  # record canaries on the other per-record sums too,
                    # where they have room (FedBNR's Phi^T y)
                    extra = [c for c in self.channels if c.name != channel.name and c.private
                             and _coordinates(c) >= canaries]
                else:
                    extra = []
                view["extra"] = [(c, CanaryDirections.draw(canaries, _coordinates(c), rng)) for c in extra]
                view["extra_seen"] = {c.name: np.zeros(_coordinates(c)) for c in extra}
            if fault == "half_noise":
                for pipeline in self.pipelines:
                    pipeline.noise = _Scaled(pipeline.noise, 0.5)
                self.server_noise = _Scaled(self.server_noise, 0.5)
            elif fault == "no_clip" and not records:  # record canaries: the per-record clip, audit_clip_fault
                for pipeline in self.pipelines:
                    pipeline._clip = lambda ch, validated, raw: getattr(validated, "value", validated)  # noqa: E731

    sim = Audited(algorithm, audited, fed, privacy, ledger_path=ledger_path, run_id=run_id, progress=progress,
                  executor="per_client")
    # the DP-SGD steps' own noise (the pipelines' and the server's are scaled in prepare), and the per-record clip
    # of the record canaries: this run's context only
    with audit_noise_fault(0.5 if fault == "half_noise" else 1.0), audit_clip_fault(records and fault == "no_clip"):
        result = sim.run()
    scores = (view["row_scores"] if isinstance(view["directions"], CanaryRows)
              else view["directions"].scores(view["seen"]))
    for extra, directions in view["extra"]:  # the likelihood-ratio score of the canary's releases on all of them
        scores = scores + directions.scores(view["extra_seen"][extra.name])
    if records and algorithm.name in STEP_CANARIES:  # each canary against its own client's uploads
        owners = np.arange(canaries) % len(data.train_parts)
        for k, uploads in view["uploads"].items():
            mine = owners == k
            scores[mine] = view["directions"].scores(uploads)[mine]
        scores = -scores  # a canary's step moves the model against its gradient
    order = np.argsort(scores)
    truth = np.zeros(canaries, dtype=bool)
    truth[included] = True
    # each guess count of GUESS_FRACTIONS at significance / their number (a union bound: the best of them is valid)
    best = (0.0, 0, 0)
    for k in sorted({max(1, int(canaries * f)) for f in GUESS_FRACTIONS}):
        correct = int(truth[order[-k:]].sum() + (~truth[order[:k]]).sum())
        bound = one_run_lower_bound(canaries, 2 * k, correct, privacy.delta, significance / len(GUESS_FRACTIONS))
        if bound >= best[0]:
            best = (bound, 2 * k, correct)
    bound, guesses, correct = best
    ledger_eps = float(result.audit.get("max_epsilon", 0.0))
    return RunAudit(bound, ledger_eps, canaries, fault, int(len(included)), guesses, correct, float(significance),
                    float(privacy.delta), fed.rounds, algorithm.name, view["channel"].name,
                    violated=bool(bound > ledger_eps * (1 + 1e-9)))


__all__ = ["CANARY_NORM", "CanaryDirections", "CanaryRows", "FAULTS", "RECORD_CANARIES", "RunAudit", "audit_run",
           "one_run_lower_bound", "one_run_p_value"]
