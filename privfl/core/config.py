"""Frozen, validated configuration of a federated run and of its privacy guarantee (Flower's habit)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from privfl.accounting.validation import check_delta, check_epsilon, check_probability
from privfl.mechanisms.clipping import ADJACENCIES
from privfl.core.channels import UNITS
from privfl.errors import ConfigurationError


#: the largest clip bound (:class:`PrivacyConfig`): the noise's scale, the clip times a noise multiplier (below 1e13 for
#: any supported target), and its square stay finite
MAX_CLIP = 1e100


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _positive_float(name: str, value, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            value < 0 if allow_zero else value <= 0):
        raise ConfigurationError(f"{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class PrivacyConfig:
    """The guarantee a run must meet, per client, and how it is met.

    ``epsilon = inf`` is a non-private run: nothing is clipped or noised and every release is charged as non-private,
    so the audit reports epsilon = inf honestly.

    ``adjacency``: the neighbouring relation. At record level (``unit="example"``) ``add_remove`` keeps every client's
    record count private; ``replace_one`` declares the counts public (schedules and weights may then use them, and
    every event is accounted as replace-one; ``privfl.core.public``).

    ``secure_noise``: draw every noise and sampling coin that guards privacy from the OS CSPRNG (the default). Set it
    to False only for reproducible experiments: the noise then follows the run seed, and the ledger and the audit say
    the run is not private against anyone who knows that seed.

    ``clip_quantile``: adaptive clipping (Andrew et al., NeurIPS 2021; the front ends' ``clip="adaptive"``). None:
    the clip is ``clip`` throughout. A number Q in (0, 1): the clip starts at ``clip`` and tracks the Q-quantile of
    the norms it clips, C <- C exp(-``clip_lr`` (b - Q)), b the fraction of the round's terms with norm <= C, released
    on a channel of its own with noise and charged in every ledger beside the value it clips. The budget split is
    privfl's one rule for channels of one release (``accounting.calibration.calibrate``: the count gets
    ``clip_share`` of 1 / z^2, the clipped value the rest). Only algorithms that declare it take it
    (``adaptive_clipping``); a non-private run clips nothing and ignores it.
    """

    epsilon: float = math.inf
    delta: float = 1e-5
    unit: str = "client"
    adjacency: str = "add_remove"
    clip: float = 1.0
    accountant: str | None = None
    placement: str = "central"
    sampling_rate: float = 1.0
    secure_noise: bool = True
    clip_quantile: float | None = None
    clip_lr: float = 0.2
    clip_share: float = 0.01

    def __post_init__(self):
        object.__setattr__(self, "epsilon", check_epsilon(self.epsilon, allow_inf=True))
        object.__setattr__(self, "delta", check_delta(self.delta))
        object.__setattr__(self, "sampling_rate", check_probability("sampling_rate", self.sampling_rate))
        if self.unit not in UNITS:
            raise ConfigurationError(f"unit must be one of {UNITS}, got {self.unit!r}")
        if self.adjacency not in ADJACENCIES:
            raise ConfigurationError(f"adjacency must be one of {ADJACENCIES}, got {self.adjacency!r}")
        if _positive_float("clip", self.clip) > MAX_CLIP:
            raise ConfigurationError(f"clip must be at most {MAX_CLIP:g}, got {self.clip!r}: it bounds the norm of what "
                                     "is clipped (e.g. 0.1 to 10), and the noise, a multiple of it, would overflow")
        if self.clip_quantile is not None:
            q = self.clip_quantile
            if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q < 1:
                raise ConfigurationError(f"clip_quantile (adaptive clipping's target quantile of the norms) must be a "
                                         f"number in (0, 1), got {q!r}")
            object.__setattr__(self, "clip_quantile", float(q))
        object.__setattr__(self, "clip_lr", _positive_float("clip_lr", self.clip_lr))
        share = self.clip_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
            raise ConfigurationError(f"clip_share (the adaptive clip count's share of the budget) must be a number in "
                                     f"(0, 1), got {share!r}")
        object.__setattr__(self, "clip_share", float(share))
        if self.placement not in ("local", "central", "distributed"):
            raise ConfigurationError(f"placement must be local, central or distributed, got {self.placement!r}")
        if self.accountant is not None and self.accountant not in ("exact", "pld", "rdp", "zcdp"):
            raise ConfigurationError(f"accountant must be exact, pld, rdp or zcdp, got {self.accountant!r}")
        if self.placement == "distributed" and self.accountant == "exact":
            raise ConfigurationError("distributed discrete Gaussian noise is charged as the Gaussian its honest "
                                     "shares' sum nearly is, with a total-variation term the exact accountant does "
                                     "not take; use the pld (default), rdp or zcdp accountant")
        if not isinstance(self.secure_noise, bool):
            raise ConfigurationError(f"secure_noise must be True or False, got {self.secure_noise!r}")
        if self.placement == "distributed" and self.sampling_rate < 1:
            raise ConfigurationError("distributed noise is planned for a fixed set of survivors; client sampling is "
                                     "not supported with it: set --sampling-rate 1 or choose local/central placement")
        if self.accountant == "exact" and self.sampling_rate < 1:
            raise ConfigurationError("the exact accountant composes unsampled Gaussians only; with --sampling-rate < 1 "
                                     "use the pld or rdp accountant")

    @property
    def private(self) -> bool:
        return math.isfinite(self.epsilon)

    @property
    def resolved_accountant(self) -> str:
        if self.accountant is not None:
            return self.accountant
        if self.placement == "distributed":
            return "pld"  # the honest shares' sum is charged as the Gaussian it nearly is (discrete_gaussian)
        if self.unit == "example":
            return "pld"  # record-level privacy comes from DP-SGD: Poisson-sampled Gaussian steps
        return "exact" if self.sampling_rate >= 1 else "pld"


#: the adaptive-clipping fields of :class:`PrivacyConfig`, left out of a run's settings when it clips at a fixed bound
ADAPTIVE_CLIP_FIELDS = ("clip_quantile", "clip_lr", "clip_share")


def privacy_settings(privacy: PrivacyConfig) -> dict:
    """``privacy`` as a run's settings (its JSON, its id's hash, a comparison's resume hash): every field, but the
    adaptive-clipping ones only when the run clips adaptively, so runs made before they existed keep their ids."""
    out = asdict(privacy)
    if privacy.clip_quantile is None:
        for key in ADAPTIVE_CLIP_FIELDS:
            out.pop(key)
    return out


@dataclass(frozen=True)
class FederationConfig:
    """How the federation trains: rounds, local optimisation, model and seed.

    ``hidden``: hidden-layer widths of an MLP (``()`` is multinomial logistic regression; None: the model's default).
    ``pool``: average-pool image inputs by this factor before the MLP (fewer weights, less total DP noise).
    ``client_size``: the public design size of a client's data (DP-SGD's sampling rate and step count when record
    counts are private; default: a built-in benchmark's training size over the number of clients; required for a
    private run on the user's own data, never computed from the clients' records). ``record_cap``: a public
    bound on a client's records that sizes quantisation ranges of sums over records (default 4 x client_size, or
    the largest declared size). See ``privfl.core.public``.
    """

    rounds: int = 20
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    server_lr: float = 1.0
    model: str = "mlp"
    hidden: tuple[int, ...] | None = None
    pool: int = 1
    seed: int = 0
    client_size: int | None = None
    record_cap: int | None = None

    def __post_init__(self):
        if not isinstance(self.model, str):
            raise ConfigurationError(
                f"FederationConfig.model names a built-in architecture ('mlp', 'lenet5', 'cnn1', 'cnn2'), got a "
                f"{type(self.model).__name__}; to train your own torch.nn.Module use privfl.federate(model, clients, "
                "...) or make_algorithm(name, fed, privacy, model=your_module)")
        _positive_int("rounds", self.rounds)
        _positive_int("local_epochs", self.local_epochs)
        _positive_int("batch_size", self.batch_size)
        _positive_float("lr", self.lr)
        _positive_float("momentum", self.momentum, allow_zero=True)
        _positive_float("server_lr", self.server_lr)
        if self.hidden is not None:
            if not all(isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in self.hidden):
                raise ConfigurationError(f"hidden must be a tuple of layer widths >= 1, got {self.hidden!r}")
            object.__setattr__(self, "hidden", tuple(self.hidden))
        _positive_int("pool", self.pool)
        if self.client_size is not None:
            _positive_int("client_size", self.client_size)
        if self.record_cap is not None:
            _positive_int("record_cap", self.record_cap)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigurationError(f"seed must be an integer >= 0, got {self.seed!r}")

    def model_kwargs(self) -> dict:
        """Keyword arguments for ``privfl.models.make_model`` from ``hidden`` and ``pool`` (MLP settings)."""
        kw: dict = {} if self.hidden is None else {"hidden": self.hidden}
        if self.pool > 1:
            kw["pool"] = self.pool
        return kw
