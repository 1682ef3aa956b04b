"""What is public about a federation, and the randomness that must not be.

The rule every algorithm obeys (ARCHITECTURE.md, "What a client may reveal"): everything a client sends is either a
**public fact**, fixed before the run and identical for every pair of neighbouring datasets, or a **channel** charged
in the ledger. :class:`PublicFacts` is the whole of the first kind: an algorithm's server half is set up from it alone
(``setup(public, rng)``), and a client's schedule (DP-SGD's sampling rate, step count and noise), its release weight
and every normaliser on the server come from it, never from ``len(dataset)``.

Record counts. By default a client's record count n_k is private: neighbouring datasets differ by one record added or
removed, so n_k changes with them. Then

- DP-SGD's schedule comes from a public **design size** ``client_size`` (q = B / client_size, steps per epoch
  client_size // B, opacus's expected batch q * client_size): Poisson sampling at a fixed rate is add/remove-DP
  whatever the true n_k, which only changes how many records a step sees on average;
- release weights are public constants (1), and no server step reads a true size.

A user may instead declare the sizes public (``PrivacyConfig(adjacency="replace_one")`` at record level): the true
n_k are then public facts (``client_sizes``), neighbours keep n_k fixed (replace one record), schedules and weights
may use n_k, and every event, sampled ones included, is accounted under the replace-one relation. The counts are
those of the clients' training sets, so a test set held out of the clients' own records (a coin per record) is refused
with declared sizes (:func:`check_declared_sizes`): one replaced record could move a count.

``record_cap``: a public bound on a client's record count used only to size quantisation ranges of sums over
records (FOLA's Fisher sums); a client holding more records has its sums clipped into that range, a per-coordinate
contraction that keeps the declared sensitivity and only costs utility.

Randomness. Noise that guards a privacy claim (Gaussian noise, DP-SGD's noise and Poisson batches, secure
aggregation's stochastic rounding and discrete Gaussian shares) is drawn from an unpredictable source by default
(:func:`private_rng`, :func:`private_torch_generator`: fresh 128-bit / 63-bit seeds from the operating system's
CSPRNG, or ``mechanisms.SecureNoise`` itself). A run seed makes it reproducible only when the user asks for seeded
noise (``PrivacyConfig(secure_noise=False)``, ``privfl run --seeded-noise``); the ledger and the audit then say that
the run is not private against anyone who knows the seed, who could regenerate the noise and subtract it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from privfl.errors import ConfigurationError

#: What the ledger and the audit say of a run whose noise was drawn from a seed.
SEEDED_NOISE_WARNING = ("noise was drawn from a seeded generator (--seeded-noise): the epsilon above holds only "
                        "against parties who do not know the seed; anyone who knows it can regenerate the noise "
                        "and the client sample")


#: The error of a private run on data that declares no design size (the user's own data).
UNDECLARED_SIZE = (
    "the public design size of a client's data set is not declared. The clients' record counts are private, so "
    "DP-SGD's sampling rate and steps, quantisation ranges and clips cannot be computed from them (one record more "
    "would change every noise level the server sees). Declare a size fixed before looking at the data, e.g. the "
    "size your organisations agreed on: client_size= (privfl.federate, FederationConfig, RunSpec), --client-size N "
    "(privfl run), client_size = N (a compare TOML); or declare the sizes public at record level "
    "(adjacency='replace_one', --adjacency replace_one), which needs a test set no client holds (test=, "
    "--test-data, test_data =)")

#: The error of a run that declares record counts public (record level, replace-one) while its test set is held out
#: of the clients' own records: the per-record coin decides which records train, so the declared counts would move.
DECLARED_SIZES_HELD_OUT = (
    "replace-one adjacency at record level declares each client's training record count public, but this run's test "
    "set is held out of the clients' own records, each record on a coin of its own: replacing one record by one "
    "that the coin holds out changes that client's declared count (its sampling rate, noise and release weight), so "
    "the count is not a public fact. Give a test set no client holds (--test-data FILE for privfl run, test= for "
    "privfl.federate, test_data = in a compare TOML), or keep the counts private (adjacency 'add_remove', the "
    "default: --adjacency add_remove, adjacency=, adjacency = in a compare TOML's [overrides]) and declare the "
    "design size (--client-size N, client_size=)")


def check_declared_sizes(data, privacy) -> None:
    """Refuse (:data:`DECLARED_SIZES_HELD_OUT`) a run that declares its clients' record counts public
    (:func:`sizes_are_public`) on data whose test set is the clients' own held-out records
    (``FederatedData.test_from_clients``): the held-out coin runs before the counts are read, so they are not fixed
    under replace-one neighbours."""
    if privacy is not None and sizes_are_public(privacy) and bool(getattr(data, "test_from_clients", False)):
        raise ConfigurationError(DECLARED_SIZES_HELD_OUT)


@dataclass(frozen=True, eq=False)
class PublicFacts:
    """The public facts of a federation (see the module docstring); nothing here may depend on a client's records.

    ``client_size``: the public design size of a client's data set. ``client_sizes``: the clients' record counts when
    they are declared public (replace-one neighbours), else None. ``alignment``: a public data set the server holds
    (FedBNN's alignment set, FedBNR-KD's distillation set). ``test``: the evaluation data (simulation only).
    """

    n_clients: int
    task: str
    num_classes: int
    input_shape: tuple[int, ...]
    client_size: int
    client_sizes: tuple[int, ...] | None = None
    record_cap: int | None = None
    name: str = "data"
    alignment: Any = None
    test: Any = None

    def __post_init__(self):
        for field_name in ("n_clients", "client_size"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ConfigurationError(f"public facts: {field_name} must be an integer >= 1, got {value!r}")
            object.__setattr__(self, field_name, int(value))
        object.__setattr__(self, "input_shape", tuple(int(s) for s in self.input_shape))
        if self.client_sizes is not None:
            sizes = tuple(int(s) for s in self.client_sizes)
            if len(sizes) != self.n_clients or min(sizes) < 1:
                raise ConfigurationError(f"public facts: client_sizes must give a size >= 1 for each of the "
                                         f"{self.n_clients} clients, got {self.client_sizes!r}")
            object.__setattr__(self, "client_sizes", sizes)
        cap = self.record_cap
        if cap is None:
            cap = max(self.client_sizes) if self.client_sizes is not None else 4 * self.client_size
        if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 1:
            raise ConfigurationError(f"public facts: record_cap must be an integer >= 1, got {cap!r}")
        object.__setattr__(self, "record_cap", int(cap))

    @property
    def sizes_public(self) -> bool:
        return self.client_sizes is not None

    def size_of(self, client: int) -> int:
        """The public size that schedules and weights of ``client`` use: its declared size, or the design size."""
        return self.client_sizes[client] if self.client_sizes is not None else self.client_size

    def total_size(self, clients) -> int:
        """The public record count of a set of participating clients (declared sizes, or design sizes)."""
        return int(sum(self.size_of(int(k)) for k in clients))

    @classmethod
    def of(cls, data, privacy=None, fed=None) -> "PublicFacts":
        """The public facts of a simulated federation ``data`` (a :class:`privfl.data.FederatedData`).

        Declared sizes: the true n_k when the run declares them public (record level, replace-one), else None;
        refused when the test set is held out of the clients' own records (:func:`check_declared_sizes`).
        Design size, in this order: ``fed.client_size``; the data's declared ``design_size`` (a built-in
        benchmark's published training size over the number of clients); the mean of the declared sizes (when the
        sizes are public). A private run with none of these is refused (:data:`UNDECLARED_SIZE`, naming the
        argument of every entry point): the design size is never computed from private record counts, which would
        make DP-SGD's sampling rate, step count and noise, every quantiser range and every clip a function of them.
        A non-private run (epsilon = inf) may take the clients' mean size.
        """
        if isinstance(data, PublicFacts):
            return data
        check_declared_sizes(data, privacy)
        parts = data.train_parts
        declared = privacy is not None and sizes_are_public(privacy)
        sizes = tuple(len(p) for p in parts) if declared else None
        size = getattr(fed, "client_size", None) if fed is not None else None
        if size is None:
            size = getattr(data, "design_size", None)
        if size is None and sizes is not None:  # declared public: the mean of the declared sizes is public too
            size = max(1, int(round(sum(sizes) / len(sizes))))
        if size is None:
            if privacy is not None and privacy.private:
                raise ConfigurationError(UNDECLARED_SIZE)
            # nothing is private (epsilon = inf): no release is charged, so the data may set the schedule
            size = max(1, int(round(sum(len(p) for p in parts) / len(parts))))
        cap = getattr(fed, "record_cap", None) if fed is not None else None
        return cls(n_clients=len(parts), task=data.task, num_classes=int(data.num_classes),
                   input_shape=tuple(data.input_shape), client_size=size, client_sizes=sizes, record_cap=cap,
                   name=getattr(data, "name", "data"), alignment=getattr(data, "alignment", None),
                   test=getattr(data, "test", None))


def sizes_are_public(privacy) -> bool:
    """Whether a run declares its clients' record counts public: a private record-level run under replace-one."""
    return bool(privacy.private and privacy.unit == "example" and privacy.adjacency == "replace_one")


def release_weight(privacy, public: PublicFacts | None, client: int, dataset) -> float:
    """The weight of a client's release: a public constant. Record counts may weight a release only when they are
    public (declared sizes) or when nothing is private (``epsilon = inf``)."""
    if not privacy.private:
        return float(len(dataset))
    if public is not None and public.sizes_public and privacy.unit == "example":
        return float(public.size_of(client))
    return 1.0


def private_rng(rng: np.random.Generator, secure: bool) -> np.random.Generator:
    """A generator for randomness that guards privacy: seeded from the OS CSPRNG when ``secure`` (the default of
    every private run), else a child stream of ``rng`` (reproducible; the run is then marked as seeded)."""
    if secure:
        return np.random.default_rng(secrets.randbits(128))
    return np.random.default_rng(rng.integers(0, 2 ** 63 - 1))


def secret_seed(rng: np.random.Generator, secure: bool) -> int:
    """A seed for randomness inside a client's private computation that is not noise or sampling but that the
    released value depends on record by record: per-record weight noise (a Bayesian twin's local reparameterisation),
    dropout masks, other layers' own randomness. Such draws are handed out by position in the lot, so a record added
    or removed moves every later record's draw: the clipping bounds one record's term only when the draws are
    unknown to the adversary (then they are exchangeable and the mechanism is a mixture of Gaussian mechanisms of
    sensitivity C). Hence from the OS CSPRNG when ``secure``; ``rng`` is stepped either way, so that a seeded run
    (``secure=False``, marked as such in the ledger) draws exactly what it drew before."""
    seed = int(rng.integers(0, 2 ** 63 - 1))
    return secrets.randbits(63) if secure else seed


def client_sampler(seq: np.random.SeedSequence, secure: bool) -> np.random.Generator:
    """The generator that draws which clients take part in each round (Poisson client sampling).

    Amplification by sampling holds only against an adversary who cannot predict the sample, so with secure noise
    (the default of every private run) it is the OS CSPRNG, never the run seed: a seed is a public fact (it names
    the run, it is in the spec a Flower ServerApp reads). ``seq``, the run plan's ``sample`` stream, is used only
    when the run is seeded on purpose (``secure=False``), which the ledger and the audit then say."""
    if secure:
        return np.random.default_rng(secrets.randbits(128))
    return np.random.default_rng(seq)


def private_torch_generator(rng: np.random.Generator, secure: bool):
    """A ``torch.Generator`` for DP-SGD's noise and Poisson sampling; see :func:`private_rng`."""
    import torch

    g = torch.Generator()
    g.manual_seed(secrets.randbits(63) if secure else int(rng.integers(0, 2 ** 63 - 1)))
    return g


__all__ = ["PublicFacts", "SEEDED_NOISE_WARNING", "UNDECLARED_SIZE", "client_sampler", "private_rng", "private_torch_generator", "release_weight",
           "secret_seed",
           "sizes_are_public"]
