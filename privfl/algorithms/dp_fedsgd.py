"""DP-FedSGD: record-level DP at the noise of centralised DP-SGD (Abadi et al., CCS 2016), the noise paid once for
the whole federation rather than once per client (McMahan et al., ICLR 2018, with the record as the unit).

One round is one DP-SGD step on the pooled data, computed where the data lives:

1. the server broadcasts its model (``global_params``, the only thing broadcast);
2. every client Poisson-samples its records at a public rate q (each record in with probability q);
3. it sums the sampled records' loss gradients, each clipped to L2 norm C (``privfl.training.stacked.PerExampleGradients``:
   ghost form on a linear stack, ``vmap`` of ``grad`` otherwise), and clips the sum to the public box [-B, B] per
   coordinate (1-Lipschitz, so a record still moves it by at most C; the box gives secure aggregation a range);
4. it releases that sum on one record-level channel of sensitivity C, sampled at q
   (``Channel.record_sampling_rate``): each round is charged ``PoissonSampled(q, Gaussian(C, zC))``;
5. the server divides the (noisy) sum by the public expected lot L = q N and takes one optimiser step (SGD with
   momentum, or Adam): post-processing.

``class_weights`` (public, one per class; add/remove adjacency): a record is sampled at q * w[y] / max(w) instead of
q, so a rare class keeps its weight through the clipping (``privfl.privacy.record_level.class_sampling_rates``: every
rate is at most q, so the round's event still bounds every record's loss).

Public facts only (``privfl.core.public``): with N the public record total (the design size times the number of clients,
or the declared sizes), q = min(1, lot_size / N) and L = q N, as DP-SGD FedAvg derives its rate from the design
size; a client's true count changes how many of its records a step sees on average, never q, L, B or the noise.
Poisson sampling at a fixed q is add/remove-DP whatever the true counts; with declared sizes (replace-one) the same
sampled event is charged under the replace-one relation (displacement 2C).

Placements (``PrivacyConfig.placement``), the noise z C added once to the sum of all clients' sums:

- ``central``: a trusted aggregator adds N(0, (zC)^2) to the sum (the federation's noise is centralised DP-SGD's);
- ``distributed``: each client adds a discrete-Gaussian share under secure aggregation, so the unmasked sum carries
  the noise once; trusted: at least ``min_survivors`` clients survive a round and the server is honest but curious
  (``privfl.privacy.secure``; the sampled plan comes from ``privfl.privacy.secure.calibrate_distributed_sampled``:
  the honest shares' sum charged as the Poisson-sampled Gaussian it nearly is, at the central noise multiplier,
  under the pld accountant);
- ``local``: each client adds the full noise zC (it trusts no aggregation); the average then carries sqrt(K) times
  more noise.

``posterior="laplace"`` (FOLA's Laplace posterior, its statistics paid for once): on the same lot each client also
releases ``fisher_trace``, per parameter tensor t the sum of its sampled records' squared clipped gradient norms
||f_i g_i,t||^2 (a record's vector has L2 norm at most ||f_i g_i||^2 <= C^2, the channel's sensitivity), boxed to
[-B C, B C]; the budget is split ``1 - fisher_share`` / ``fisher_share`` between the two, and a round's two sampled
events are one (``accounting.rounds.round_events`` groups a lot's channels). The server keeps the mean of the noisy
per-record traces over the posterior rounds and predicts with N(w, s / (lambda0 + N F_t / d_t)) per tensor
(:meth:`DPFedSGD.posterior_moments`). Distributed noise plans one sampled channel: refused up front.

``posterior="variational"`` (HBFL's Bayesian meme, its noise paid once): the model is the mean-field Gaussian twin
of the architecture, built-in or the user's own (``BayesLinear`` / ``BayesConv2d`` layers, local
reparameterisation; ``models.bayesian_twin``), and the released gradient is that of the
ELBO's data term, a sum over records: each sampled record's cross-entropy gradient with respect to the variational
parameters (mu and rho), at weight noise drawn for that record alone, clipped to C, summed and boxed as above (the
same channel, sensitivity and event). The server adds the gradient of the ELBO's other term, ``temperature`` times
KL(q || N(0, 1 / ``prior_precision``)) per record (over the public total N: data-independent), and steps. It
predicts by averaging ``posterior_samples`` weight draws from q (variances times ``posterior_scale``); q starts at
standard deviation ``init_std``. HBFL's
product of the clients' meme posteriors is a product of tempered likelihoods; here the same target is fitted
directly, the likelihood's gradient summed over the federation under one noise.

``bands`` b > 1 (correlated noise, banded matrix-factorisation DP-FTRL: Denisov et al. 2022, Choquette-Choo et al.
2023): each client splits its records at random into b groups once (its own state, never sent), and in round t
Poisson-samples only group ``t mod b``, each of its records at rate b q (so the expected lot stays L); it releases
``sum_{k < b} c_k x_{t-k}``, its last b sums mixed by the strategy's unit-norm coefficients
(``privfl.mechanisms.matrix_factorization.banded_toeplitz``: the b-banded Toeplitz C minimising the noise in the
models, SGD with the run's momentum, over the run's rounds; public, computed from the configuration). The noise is
fresh every round, placed as below; the server decodes ``x_hat = C^{-1} y`` (post-processing), so its model sees
noise C^{-1} z, correlated across rounds. A record's participations are b rounds apart and touch disjoint blocks of
b rows, each one Poisson-sampled Gaussian at rate b q: ceil(rounds / b) such events meet the target
(``Channel.record_bands``; a client is charged at its first release in each block of b rounds, whatever rounds it
missed). b q must be at most 1. Refused with adaptive clipping and the Laplace posterior. Clients and server mix
and decode by absolute round (a missed or aborted round is a zero sum). A client whose round sum the server never
decodes (it dropped out under secure aggregation after computing it) still mixes it into its next b - 1 values: a
bias in those rounds' decoded sums (utility); privacy is unaffected (the sum touches only its own b rounds, and its
block is charged).

z is the smallest noise multiplier for which ``rounds`` such events meet (epsilon, delta) under the run's accountant
(``privfl.core.plan.noise_multipliers_for``: one search). Nothing private leaves a client outside its channel: the
release weight is the constant 1, and a client reports no metrics (no sampled count, no norm, no loss).
Non-private (``epsilon = inf``) it is plain minibatch SGD on the same Poisson lots, without clipping.
"""

from __future__ import annotations

import copy
import math
from typing import Mapping

import numpy as np
import torch

from privfl.core.aggregation import Aggregate
from privfl.algorithms.base import ClientOutput
from privfl.privacy.record_level import (SAMPLED_ACCOUNTANTS, AdaptiveClip, check_class_weights, class_sampling_rates,
                                         clip_bits, clip_factor, poisson_lot)
from privfl.algorithms.fedavg import FedAvg
from privfl.core.channels import ClippedValue, PreClipped
from privfl.privacy.units import channel as unit_channel
from privfl.errors import ConfigurationError, UsageError
from privfl.mechanisms.matrix_factorization import BandedDecoder, BandedEncoder, banded_toeplitz
from privfl.models import (BayesModule, ModelConfigError, bayesian_twin, get_mean_precision, inverse_softplus,
                           make_bayesian_model, make_model)
from privfl.training.distill import BayesPerExampleGradients
from privfl.training.local import load_flat_parameters
from privfl.training.stacked import PerExampleGradients, unflatten
from privfl.core.public import private_torch_generator, secret_seed

OPTIMIZERS = ("sgd", "adam")
#: bytes of per-client state (a lot's per-example terms, the stacked parameters) one vectorised chunk may hold
_MEMORY_BUDGET = 256 * 2 ** 20


def _positive(name: str, value, *, allow_none: bool = True):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"dp_fedsgd: {name} must be a finite number > 0{' or None' if allow_none else ''}, "
                                 f"got {value!r}")
    return value


class DPFedSGD(FedAvg):
    name = "dp_fedsgd"
    supports_privacy = True
    units = ("example",)
    unit_hint = "each example's gradient is clipped; for client-level DP use dp_fedavg"
    default_unit = "example"  # record-level by construction: every example's gradient is clipped
    broadcast_state = ("global_params",)
    # the optimiser's moments, the posterior's moments, the banded decoder's last rounds
    server_only_state = ("_optimizer_state", "_trajectory", "_decoded", "_decoded_round")
    # logistic regression on 2x2-pooled images (fewer weights, less total noise); lr is the server's step size
    defaults = {"hidden": (), "pool": 2, "lr": 0.5, "clip": 1.0}
    adaptive_clipping = True  # PrivacyConfig.clip_quantile: the clip follows a quantile of the record norms

    def __init__(self, fed, privacy, model=None, metrics=None, lot_size: int | None = None,
                 coordinate_bound: float | None = None, server_optimizer: str = "sgd",
                 betas: tuple[float, float] = (0.9, 0.999), class_weights=None, posterior: str = "none",
                 posterior_rounds: int | None = None, posterior_samples: int = 30, posterior_scale: float = 1.0,
                 fisher_share: float = 0.05, prior_precision: float = 1.0, temperature: float = 1.0,
                 init_std: float | None = None, bands: int = 1):
        super().__init__(fed, privacy, model=model, metrics=metrics)
        if posterior not in POSTERIORS:
            raise ConfigurationError(f"dp_fedsgd: posterior must be one of {POSTERIORS}, got {posterior!r}")
        #: ``"trajectory"``: predict with a Gaussian posterior read off the last rounds' global parameters (below)
        self.posterior = posterior
        for name, value in (("posterior_rounds", posterior_rounds), ("posterior_samples", posterior_samples)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
                raise ConfigurationError(f"dp_fedsgd: {name} must be an integer >= 2, got {value!r}")
        if posterior_rounds is not None and posterior_rounds > fed.rounds:
            raise ConfigurationError(f"dp_fedsgd: posterior_rounds={posterior_rounds} exceeds the run's "
                                     f"{fed.rounds} rounds")
        #: the rounds the posterior is read from (the last ones): default a tenth of the run, at least 2 (chosen on
        #: the record-level table's validation split at epsilon = 3 among a quarter, a tenth and a twentieth: a quarter
        #: averages iterates that are still improving and loses accuracy)
        self.posterior_rounds = int(posterior_rounds if posterior_rounds is not None
                                    else max(2, min(fed.rounds, fed.rounds // 10)))
        self.posterior_samples = int(posterior_samples)
        self.posterior_scale = float(_positive("posterior_scale", posterior_scale, allow_none=False))
        if (isinstance(fisher_share, bool) or not isinstance(fisher_share, (int, float))
                or not 0 < fisher_share < 1):
            raise ConfigurationError(f"dp_fedsgd: fisher_share must be a number in (0, 1), got {fisher_share!r}")
        #: ``posterior="laplace"``: the share of each round's budget the Fisher channel gets (the gradient the rest)
        self.fisher_share = float(fisher_share)
        #: ``posterior="laplace"`` and ``"variational"``: the Gaussian prior's precision (per parameter)
        self.prior_precision = float(_positive("prior_precision", prior_precision, allow_none=False))
        #: ``posterior="variational"``: the weight of the KL term per record (1: the ELBO; < 1: a tempered posterior)
        self.temperature = float(_positive("temperature", temperature, allow_none=False))
        #: ``posterior="variational"``: q's initial standard deviation (None: ``BayesLinear``'s, softplus(-5))
        self.init_std = _positive("init_std", init_std)
        #: adaptive clipping (``PrivacyConfig.clip_quantile``, private runs; its rule ``record_level.AdaptiveClip``,
        #: the count a channel of its own): the clip of the round, broadcast
        self.adaptive = AdaptiveClip.of(privacy)
        self.current_clip = float(privacy.clip)
        if self.adaptive:
            self.broadcast_state = ("global_params", "current_clip")
            if posterior == "laplace":
                raise ConfigurationError("dp_fedsgd: posterior='laplace' releases squared norms at a fixed clip; "
                                         "give a number for clip with it (or another posterior)")
            if coordinate_bound is not None:
                raise ConfigurationError("dp_fedsgd: coordinate_bound is in the units of a fixed clip; leave it out "
                                         "with clip='adaptive' (the box is then max(1, q cap) clips)")
        #: public per-class weights, as sampling rates q * w[y] / max(w) (``record_level.class_sampling_rates``)
        self.class_weights = None if class_weights is None else tuple(float(w) for w in class_weights)
        if lot_size is not None and (isinstance(lot_size, bool) or not isinstance(lot_size, int) or lot_size < 1):
            raise ConfigurationError(f"dp_fedsgd: lot_size must be an integer >= 1 or None (the run's batch_size), "
                                     f"got {lot_size!r}")
        #: the public expected lot size L asked for (records per step over the whole federation)
        self.lot_size = int(lot_size if lot_size is not None else fed.batch_size)
        #: public per-coordinate bound B of a client's gradient sum (None: C times the expected lot at the cap)
        self.coordinate_bound = _positive("coordinate_bound", coordinate_bound)
        if server_optimizer not in OPTIMIZERS:
            raise ConfigurationError(f"dp_fedsgd: server_optimizer must be one of {OPTIMIZERS}, got "
                                     f"{server_optimizer!r}")
        self.server_optimizer = server_optimizer
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
            raise ConfigurationError(f"dp_fedsgd: betas must be two numbers in [0, 1), got {betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))
        if privacy.private:
            check_fedsgd_privacy(privacy)
        if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
            raise ConfigurationError(f"dp_fedsgd: bands must be an integer >= 1 (1: independent noise every round), "
                                     f"got {bands!r}")
        #: correlated noise: the strategy's band count b (1: independent noise; non-private runs add none)
        self.bands = int(bands) if privacy.private else 1
        if self.bands > 1:
            if self.adaptive:
                raise ConfigurationError("dp_fedsgd: bands > 1 mixes rounds released at one fixed clip; give a "
                                         "number for clip with it (or bands=1)")
            if posterior == "laplace":
                raise ConfigurationError("dp_fedsgd: bands > 1 is planned for the gradient alone; use "
                                         "posterior='none', 'trajectory' or 'variational' with it (or bands=1)")
            self.client_state = ("_banded",)
        #: client -> {"groups": each record's group, "history": its last b - 1 boxed sums, newest first}
        self._banded: dict[int, dict] = {}
        self._decoded: np.ndarray | None = None  # the server's last b - 1 decoded sums, newest first
        self._decoded_round = -1  # the round of the newest
        self.band_coefficients = np.ones(1)
        self.sample_rate = 1.0
        self.expected_lot = 1.0
        self.bound = math.inf
        self._optimizer_state: dict | None = None  # the server's: never broadcast
        #: the trajectory's running moments {"n", "mean", "sq"} over the posterior rounds (the server's); with the
        #: Laplace posterior, {"n", "fisher"}: the running mean of the per-record Fisher traces (one per tensor)
        self._trajectory: dict | None = None

    # -- public schedule -----------------------------------------------------------------------------------------

    def setup(self, data, rng):
        super().setup(data, rng)
        public = self.public
        if public.task != "classification":
            raise ConfigurationError("dp_fedsgd trains classifiers (per-example cross-entropy gradients); for "
                                     "regression use dpsgd_fedavg")
        total = public.total_size(range(public.n_clients))
        self.sample_rate = min(1.0, self.lot_size / total)
        self.expected_lot = self.sample_rate * total
        if self.privacy.private and self.sample_rate < 1 and self.sample_rate <= self.privacy.delta:
            raise ConfigurationError(f"dp_fedsgd: the record sampling rate {self.sample_rate:.3g} is not above "
                                     f"delta={self.privacy.delta}; raise lot_size or lower delta")
        if self.bands > 1:
            if self.bands * self.sample_rate > 1 + 1e-12:
                raise ConfigurationError(f"dp_fedsgd: bands={self.bands} samples each round's group at bands x q = "
                                         f"{self.bands * self.sample_rate:.3g} > 1; set bands to at most "
                                         f"{max(1, int(1 / self.sample_rate))} (or lower lot_size)")
            if self.bands > self.fed.rounds:
                raise ConfigurationError(f"dp_fedsgd: bands={self.bands} exceeds the run's {self.fed.rounds} rounds")
            momentum = float(self.fed.momentum) if self.server_optimizer == "sgd" else 0.0
            self.band_coefficients = banded_toeplitz(int(self.fed.rounds), self.bands, momentum)
        if self.coordinate_bound is not None:
            self.bound = float(self.coordinate_bound)
        else:  # the expected lot of a client at the public record cap: a box only outsized clients ever reach
            # (adaptive clipping releases each record's clipped gradient over the round's clip: the box in clips)
            unit = 1.0 if self.adaptive else self.privacy.clip
            self.bound = float(unit * max(1.0, self.sample_rate * public.record_cap))
        #: the box of a released value: a banded mixture of boxed sums lies within sum_k |c_k| B
        self.release_bound = float(self.bound * np.abs(self.band_coefficients).sum())
        if self.posterior == "variational":
            self._per_example = BayesPerExampleGradients(self.model)
            self._plain = (copy.deepcopy(self._plain_template) if self._plain_template is not None else
                           make_model(self.fed.model, public.input_shape, public.num_classes,
                                      **self.fed.model_kwargs()))
            names = [n for n, _ in self.model.named_parameters()]
            self._is_rho = np.concatenate([np.full(p.numel(), n.endswith("_rho"))
                                           for n, p in self.model.named_parameters()])
            if not all(n.endswith(("_mu", "_rho")) for n in names):
                raise ConfigurationError("dp_fedsgd: posterior='variational' needs every parameter Gaussian")
        else:
            self._per_example = PerExampleGradients(self.model)
        self._optimizer_state = None
        self._trajectory = None
        self._banded = {}
        self._decoded = None
        self._decoded_round = -1
        #: the accounting's relation (class-weighted sampling is sound under add/remove only)
        self._relation = self.privacy.adjacency if self.privacy.private else "add_remove"
        if self.class_weights is not None:  # refused here, before anything is charged
            check_class_weights(self.class_weights, public.num_classes, self._relation, "dp_fedsgd")

    def build_model(self, public):
        """The built-in or user's model; with ``posterior="variational"`` its Bayesian twin (``make_bayesian_model``'s
        for a built-in architecture, ``models.bayesian_twin`` of the user's module)."""
        if self.posterior != "variational":
            return super().build_model(public)
        self._plain_template = None
        if self.user.model is None:
            meme = make_bayesian_model(self.fed.model, public.input_shape, public.num_classes,
                                       **self.fed.model_kwargs())
        else:
            self._plain_template = super().build_model(public)  # the user's module, checked against the task
            try:
                meme = bayesian_twin(self._plain_template)
            except ModelConfigError as exc:
                raise ConfigurationError(f"dp_fedsgd: posterior='variational' needs a Bayesian twin of the model: "
                                         f"{exc}") from None
            if isinstance(meme, BayesModule):  # a bare layer: the one-layer stack the per-record gradients take
                meme = torch.nn.Sequential(meme)
        if self.init_std is not None:
            with torch.no_grad():
                for name, p in meme.named_parameters():
                    if name.endswith("_rho"):
                        p.fill_(float(inverse_softplus(torch.tensor(self.init_std, dtype=torch.float64))))
        return meme

    def channels(self):
        laplace = self.posterior == "laplace"
        if not self.privacy.private:
            out = [unit_channel(self.privacy, "gradient_sum", (self.dim,),
                                description="sum of the sampled records' loss gradients")]
            if laplace:
                out.append(unit_channel(self.privacy, "fisher_trace", (len(self._tensor_sizes),),
                                        description="per tensor, sum of the sampled records' squared gradient "
                                                    "norms"))
            return out
        if self.adaptive:  # the same lot: a round stays one sampled event (accounting.rounds.round_events)
            share = self.adaptive.share
            return [unit_channel(self.privacy, "gradient_sum", (self.dim,), client=None,
                                 record=PreClipped(1.0, "sum"), value_bound=self.bound,
                                 record_sampling_rate=self.sample_rate, budget_share=1.0 - share,
                                 description="sum of the Poisson-sampled records' gradients, each clipped to the "
                                             "round's clip C_t and divided by it (norm <= 1), boxed to [-B, B]"),
                    unit_channel(self.privacy, "clip_count", (1,), client=None, record=PreClipped(0.5, "sum"),
                                 value_bound=0.5 * self.bound, record_sampling_rate=self.sample_rate,
                                 budget_share=share,
                                 description="adaptive clipping: sum over the Poisson-sampled records of "
                                             "[gradient norm <= C_t] - 1/2, boxed to [-B/2, B/2]")]
        c = self.privacy.clip
        if self.bands > 1:
            return [unit_channel(self.privacy, "gradient_sum", (self.dim,), client=None, record=PreClipped(c, "sum"),
                                 value_bound=self.release_bound,
                                 record_sampling_rate=min(1.0, self.bands * self.sample_rate),
                                 record_bands=self.bands,
                                 description=f"the banded mixture sum_k c_k x_(t-k) of the client's last {self.bands} "
                                             "sums x of its round's group's Poisson-sampled records' gradients, "
                                             "each clipped to C, boxed to [-B, B] (||c|| = 1)")]
        out = [unit_channel(self.privacy, "gradient_sum", (self.dim,), client=None, record=PreClipped(c, "sum"),
                            value_bound=self.bound, record_sampling_rate=self.sample_rate,
                            budget_share=1.0 - self.fisher_share if laplace else 1.0,
                            description="sum of the Poisson-sampled records' gradients, each clipped to C, boxed "
                                        "to [-B, B]")]
        if laplace:  # the same lot: a round stays one sampled event (accounting.rounds.round_events)
            out.append(unit_channel(self.privacy, "fisher_trace", (len(self._tensor_sizes),), client=None,
                                    record=PreClipped(c, "squared_sum"), value_bound=self.bound * c,
                                    record_sampling_rate=self.sample_rate, budget_share=self.fisher_share,
                                    description="per parameter tensor, sum of the Poisson-sampled records' squared "
                                                "clipped gradient norms (each record's vector has L2 norm <= C^2), "
                                                "boxed to [-B C, B C]"))
        return out

    @property
    def _tensor_sizes(self) -> list[int]:
        return [p.numel() for p in self.model.parameters()]

    def release_weight(self, dataset, client: int = 0) -> float:
        return 1.0  # a sum: the server divides by the public expected lot, never by a count

    def private_release_weight(self, client: int) -> float:
        return 1.0

    # -- the client step -----------------------------------------------------------------------------------------

    @property
    def vectorisable(self) -> bool:
        """Clients' lots are computed together (one batched per-example pass) when the model is built of stateless
        layers; per client otherwise. The same function either way (:meth:`_gradient_sums`)."""
        from privfl.training.stacked import vectorisable

        return self.model is not None and (self.posterior == "variational" or vectorisable(self.model))

    def _sample(self, dataset, rng, client: int | None = None, round: int = 0) -> torch.Tensor:
        """The indices of the client's Poisson lot: each record in with probability q, coins from a generator of its
        own (the OS CSPRNG unless the run asks for seeded noise, or is not private). Which records were drawn never
        leaves the client. With ``bands`` b > 1, only the records of group ``round mod b`` are candidates, each at
        rate b q (the groups drawn from the same generator at the client's first round, kept in its state)."""
        generator = private_torch_generator(rng, self.privacy.secure_noise and self.privacy.private)
        n = len(dataset)
        rate = self.sample_rate
        candidates = None
        if self.bands > 1:
            state = self._banded.get(client)
            if state is None:  # each record's group, uniform and independent: the same for every neighbour
                state = self._banded[client] = {
                    "groups": torch.randint(self.bands, (n,), generator=generator, dtype=torch.int16).numpy(),
                    "history": np.zeros((0, self.dim)), "round": -1}
            if len(state["groups"]) != n:
                raise ConfigurationError("dp_fedsgd: a client's records changed during a banded run (its groups "
                                         "were drawn at its first round); keep each client's records for the run")
            if round <= int(state["round"]):  # before any record is drawn: the mixture is by increasing round
                raise UsageError(f"dp_fedsgd: banded noise mixes a client's rounds in increasing order; "
                                         f"round {round} comes after its round {int(state['round'])}: refused (a "
                                         "round asked out of order, or again, would put one record's participations "
                                         "closer than the bands the ledger charges)")
            candidates = torch.from_numpy(np.flatnonzero(state["groups"] == round % self.bands))
            rate = min(1.0, self.bands * self.sample_rate)
        if self.class_weights is not None:  # each record at q * w[y] / max(w): at most q, so the events still hold
            y = dataset.tensors()[1]
            rates = class_sampling_rates(self.class_weights, y if candidates is None else y[candidates], rate,
                                         self._relation, "dp_fedsgd")
            lot = poisson_lot(rates, len(rates), generator)
        elif rate >= 1.0:
            lot = torch.arange(n if candidates is None else len(candidates))
        else:
            lot = poisson_lot(float(rate), n if candidates is None else len(candidates), generator)
        return lot if candidates is None else candidates[lot]

    def _gradient_sums(self, lots, generators=None) -> tuple[np.ndarray, np.ndarray | None]:
        """One row per client: the sum of its lot's per-example gradients at the broadcast model, each clipped to C
        (private runs), then boxed to [-B, B]; with the Laplace posterior also, per parameter tensor, the sum of the
        clipped gradients' squared norms, boxed to [-B C, B C] (else None). ``lots``: ``(x, y)`` of each client's
        sampled records; ``generators``: each client's weight-noise generator (``posterior="variational"``)."""
        c = len(lots)
        dim = self.dim
        out = np.zeros((c, dim), dtype=np.float64)
        traces = np.zeros((c, len(self._tensor_sizes)), dtype=np.float64) if self.posterior == "laplace" else None
        if self.adaptive:  # the clip-count "statistic" rides in the traces' slot: one number per client
            traces = np.zeros((c, 1), dtype=np.float64)
        width = max((len(x) for x, _ in lots), default=0)
        if width == 0:
            return out, traces
        names = [n for n, _ in self.model.named_parameters()]
        shapes = [p.shape for _, p in self.model.named_parameters()]
        start = torch.as_tensor(self.global_params, dtype=torch.float32)
        feats = lots[0][0].shape[1:]
        if self._per_example.stack is not None:  # ghost form: a lot's inputs and activations, the parameters
            per_client = 4 * (4 * dim + 4 * width * (int(np.prod(feats)) + 64))
        else:  # every example's gradient
            per_client = 4 * dim * (width + 4)
        step = max(1, int(_MEMORY_BUDGET // per_client))
        for lo in range(0, c, step):
            chunk = lots[lo:lo + step]
            k = len(chunk)
            params = unflatten(start.unsqueeze(0).repeat(k, 1), names, shapes)
            xb = torch.zeros(k, width, *feats, dtype=chunk[0][0].dtype)
            yb = torch.zeros(k, width, dtype=chunk[0][1].dtype)
            weight = torch.zeros(k, width)
            for r, (x, y) in enumerate(chunk):
                xb[r, :len(x)], yb[r, :len(x)], weight[r, :len(x)] = x, y, 1.0
            if generators is None:
                terms = self._per_example(params, xb, yb, weight)
            else:  # each sampled record's own weight noise (the variational posterior's reparameterisation)
                noises = self._per_example.noise(generators[lo:lo + step], width)
                terms = self._per_example(params, xb, yb, weight, noises)
            if self.adaptive:  # clipped to C_t, then over C_t (norm <= 1); each record's bit [norm <= C_t] - 1/2
                norms2 = terms.norms2()
                clip = self.current_clip
                factor = clip_factor(norms2, clip) * weight / clip
                out[lo:lo + k] = terms.flat(terms.sums(factor)).detach().numpy()
                traces[lo:lo + k, 0] = clip_bits(norms2, clip, weight).sum(1).detach().numpy()
                continue
            factor = clip_factor(terms.norms2(), self.privacy.clip) * weight if self.privacy.private else weight
            out[lo:lo + k] = terms.flat(terms.sums(factor)).detach().numpy()
            if traces is not None:  # sum_i ||f_i g_i||^2 per tensor (weight is 0 or 1, so f^2 keeps the padding out)
                squares = terms.square_sums(factor * factor)
                traces[lo:lo + k] = torch.stack([squares[n].reshape(k, -1).sum(1) for n in names],
                                                dim=1).detach().numpy()
        if self.privacy.private:
            np.clip(out, -self.bound, self.bound, out=out)
            if self.adaptive:
                np.clip(traces, -0.5 * self.bound, 0.5 * self.bound, out=traces)
            elif traces is not None:
                np.clip(traces, -self.bound * self.privacy.clip, self.bound * self.privacy.clip, out=traces)
        return out, traces

    def _output(self, value: np.ndarray, trace: np.ndarray | None, client: int | None = None,
                round: int = 0) -> ClientOutput:
        if self.bands > 1:  # the banded mixture of the client's boxed sums by absolute round (its own state)
            state = self._banded[client]
            encoder = BandedEncoder(self.band_coefficients, state["history"] if len(state["history"]) else None)
            encoder.skip(round - int(state["round"]) - 1)  # rounds it missed count as zero sums
            mixed = encoder.encode(value)
            state["history"], state["round"] = encoder.history, int(round)
            return ClientOutput({"gradient_sum": ClippedValue(mixed, self.privacy.clip, "sum")}, weight=1.0)
        if self.adaptive:
            return ClientOutput({"gradient_sum": ClippedValue(value, 1.0, "sum"),
                                 "clip_count": ClippedValue(trace, 0.5, "sum")}, weight=1.0)
        values = {"gradient_sum": (value, "sum"), "fisher_trace": (trace, "squared_sum")}
        return ClientOutput({name: ClippedValue(v, self.privacy.clip, statistic) if self.privacy.private else v
                             for name, (v, statistic) in values.items() if v is not None}, weight=1.0)

    def _weight_noise(self, rng) -> torch.Generator | None:
        """With ``posterior="variational"``, the generator of the client's per-record weight noise (drawn after its
        lot's coins), else None. Secret in a private run (:func:`privfl.core.public.secret_seed`): the draws go to
        the lot's records by position, so with draws an adversary could compute from the run seed one record added
        or removed would move every later record's term, far beyond the clip the release is charged for."""
        if self.posterior != "variational":
            return None
        secure = self.privacy.private and self.privacy.secure_noise
        return torch.Generator().manual_seed(secret_seed(rng, secure))

    @property
    def needs_kept_state(self) -> bool:
        """Whether the guarantee rests on state the client keeps between rounds (banded noise: each record's group,
        drawn at the client's first round): a client that has charges in the run but lost that state is refused
        (``privfl.algorithms.base.check_kept_state``), since fresh groups could put one record in two rounds of a
        block."""
        return self.bands > 1

    def client_update(self, client, dataset, round, rng):
        [(_, out)] = self.client_updates([client], [dataset], round, [rng])
        return out

    def client_updates(self, clients, datasets, round, rngs):
        """``(k, client_update(k, ...))`` for every client, their lots' per-example gradients computed together
        (each client's coins drawn from its own generator, as :meth:`client_update` draws them). With adaptive
        clipping the broadcast C_t is checked first (``AdaptiveClip.check_broadcast``), before any record is read."""
        self.check_broadcast(round)
        lots, generators = [], []
        for k, dataset, rng in zip(clients, datasets, rngs):
            x, y = dataset.tensors()
            idx = self._sample(dataset, rng, k, round)
            lots.append((x[idx], y[idx]))
            generators.append(self._weight_noise(rng))
        generators = None if self.posterior != "variational" else generators
        step = len(lots) if self.vectorisable else 1  # the per-example pass of every lot together, or one by one
        for lo in range(0, len(lots), step):
            sums, traces = self._gradient_sums(lots[lo:lo + step],
                                               None if generators is None else generators[lo:lo + step])
            for row, k in enumerate(clients[lo:lo + step]):
                yield k, self._output(sums[row], None if traces is None else traces[row], k, round)

    # -- the server step -----------------------------------------------------------------------------------------

    def server_update(self, aggregates: Mapping[str, Aggregate], round):
        """One optimiser step on the noisy gradient sum over the public expected lot L (post-processing)."""
        agg = aggregates["gradient_sum"]
        total = np.asarray(agg.total, dtype=np.float64)
        if self.bands > 1:  # x_hat = C^{-1} y, row by row (post-processing of the released stream)
            decoder = BandedDecoder(self.band_coefficients, self._decoded)
            decoder.skip(round - self._decoded_round - 1)  # aborted rounds: nothing released, decoded as zeros
            total = decoder.decode(total)
            self._decoded, self._decoded_round = decoder.history, int(round)
        gradient = total / self.expected_lot
        if self.adaptive:  # the sum was released in units of the round's clip
            gradient = gradient * self.current_clip
            count = float(np.asarray(aggregates["clip_count"].total, dtype=np.float64)[0])
            self.current_clip = self.adaptive.step(self.current_clip, count, self.expected_lot)
        params = np.asarray(self.global_params, dtype=np.float64)
        if self.posterior == "variational":
            gradient = gradient + self._kl_gradient(params)
        lr, state = float(self.fed.lr), self._optimizer_state
        if self.server_optimizer == "sgd":
            momentum = float(self.fed.momentum)
            if momentum:
                state = {"buf": gradient.copy()} if state is None else {"buf": momentum * state["buf"] + gradient}
                gradient = state["buf"]
            params = params - lr * gradient
        else:  # Adam (Kingma and Ba 2015), bias-corrected
            b1, b2 = self.betas
            if state is None:
                state = {"step": 0, "m": np.zeros_like(params), "v": np.zeros_like(params)}
            step = state["step"] + 1
            m = b1 * state["m"] + (1 - b1) * gradient
            v = b2 * state["v"] + (1 - b2) * gradient ** 2
            state = {"step": step, "m": m, "v": v}
            params = params - lr * (m / (1 - b1 ** step)) / (np.sqrt(v / (1 - b2 ** step)) + 1e-8)
        self._optimizer_state = state
        self.global_params = params.astype(self.global_params.dtype)
        if round >= self.fed.rounds - self.posterior_rounds:
            if self.posterior == "trajectory":
                self._record_trajectory(np.asarray(self.global_params, dtype=np.float64))
            elif self.posterior == "laplace":  # the Fisher at the iterate this round's sums were taken at
                self._record_fisher(np.asarray(aggregates["fisher_trace"].total, dtype=np.float64)
                                    / self.expected_lot)

    def round_clip(self) -> float | None:
        return self.current_clip if self.adaptive else None

    # -- a posterior read off the trajectory (post-processing of released sums: no privacy cost) ---------------------

    def _record_trajectory(self, params: np.ndarray) -> None:
        t = self._trajectory
        if t is None:
            self._trajectory = {"n": 1, "mean": params.copy(), "sq": params ** 2}
            return
        n = t["n"] + 1
        self._trajectory = {"n": n, "mean": t["mean"] + (params - t["mean"]) / n,
                            "sq": t["sq"] + (params ** 2 - t["sq"]) / n}

    def _kl_gradient(self, params: np.ndarray) -> np.ndarray:
        """The gradient of ``temperature`` KL(q || N(0, 1 / lambda0)) / N with respect to (mu, rho), sigma =
        softplus(rho), N the public record total: per coordinate lambda0 mu for a mean, (lambda0 sigma - 1 / sigma)
        sigmoid(rho) for a rho. Data-independent (the ELBO's term that is not a sum over records)."""
        lam = self.prior_precision
        coefficient = self.temperature * self.sample_rate / self.expected_lot
        out = lam * params
        rho = params[self._is_rho]
        sigma = np.logaddexp(0.0, rho)
        out[self._is_rho] = (lam * sigma - 1.0 / sigma) / (1.0 + np.exp(-rho))
        return coefficient * out

    def _variational_moments(self) -> tuple[np.ndarray, np.ndarray]:
        """q's mean and variance (times ``posterior_scale``) in the plain twin's parameter order."""
        load_flat_parameters(self.model, self.global_params)
        mean, precision = get_mean_precision(self.model)
        return mean, self.posterior_scale / precision

    def _record_fisher(self, trace: np.ndarray) -> None:
        t = self._trajectory
        n = 1 if t is None else t["n"] + 1
        self._trajectory = {"n": n, "fisher": trace.copy() if t is None else t["fisher"] + (trace - t["fisher"]) / n}

    def _laplace_moments(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The Laplace posterior N(w, diag(s / (lambda0 + N F_t / d_t))) at the global parameters w: per parameter
        tensor t of d_t entries, F_t the noisy per-record Fisher trace averaged over the posterior rounds (floored at
        0), N the public record total, lambda0 the prior precision, s the posterior scale. Post-processing of the
        released traces."""
        t = self._trajectory
        if t is None:
            return None
        total = self.expected_lot / self.sample_rate
        sizes = np.asarray(self._tensor_sizes, dtype=np.float64)
        per_tensor = self.posterior_scale / (self.prior_precision + total * np.maximum(t["fisher"], 0.0) / sizes)
        return (np.asarray(self.global_params, dtype=np.float64),
                np.repeat(per_tensor, np.asarray(self._tensor_sizes)))

    def posterior_moments(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The trajectory posterior N(mean, diag(var)): the mean and variance of the global parameters over the last
        ``posterior_rounds`` rounds (a diagonal SWAG, Maddox et al. 2019, on DP-FedSGD's server iterates), the
        variance times ``posterior_scale``; None before two such rounds or without ``posterior="trajectory"``. Every
        iterate is post-processing of noised sums (the noise paid once, by the aggregator or under secure
        aggregation), so the posterior costs no privacy."""
        if self.posterior == "laplace":
            return self._laplace_moments()
        if self.posterior == "variational":
            return self._variational_moments()
        t = self._trajectory
        if self.posterior != "trajectory" or t is None or t["n"] < 2:
            return None
        var = np.maximum(t["sq"] - t["mean"] ** 2, 0.0) * t["n"] / (t["n"] - 1) * self.posterior_scale
        return t["mean"], var

    def predict_proba(self, dataset):
        """With the trajectory posterior: the class probabilities averaged over ``posterior_samples`` parameter
        draws from it (Bayesian model averaging; the draws from a generator fixed by the run's seed: public
        randomness); otherwise the global model's."""
        moments = self.posterior_moments()
        if moments is None or dataset.task == "regression":
            return super().predict_proba(dataset)
        from privfl.training.local import predict_proba

        mean, var = moments
        rng = np.random.default_rng(np.random.SeedSequence(self.fed.seed, spawn_key=(POSTERIOR_STREAM,)))
        x = dataset.tensors()[0]
        model = self._plain if self.posterior == "variational" else self.model
        total = None
        for _ in range(self.posterior_samples):
            draw = mean + np.sqrt(var) * rng.standard_normal(mean.shape)
            load_flat_parameters(model, draw.astype(np.float32))
            p = predict_proba(model, x)
            total = p if total is None else total + p
        if model is self.model:
            load_flat_parameters(self.model, self.global_params)
        return total / self.posterior_samples

    def global_model(self):
        """The global model; with the trajectory posterior, at the posterior mean (the iterates' average)."""
        moments = self.posterior_moments()
        if moments is None:
            return super().global_model()
        model = self._plain if self.posterior == "variational" else self.model
        load_flat_parameters(model, moments[0].astype(np.float32))
        return model


#: the posteriors DP-FedSGD can predict with: its global model, one read off its last rounds' iterates, or the
#: Laplace posterior at its global model from noise-once Fisher traces (FOLA's posterior, its statistics released as
#: sums of clipped per-example terms on DP-FedSGD's lots), or a mean-field Gaussian learned by variational inference
#: on the same lots (HBFL's meme, the ELBO's data term released as clipped per-example sums)
POSTERIORS = ("none", "trajectory", "laplace", "variational")
#: the spawn key of the posterior's draws (public randomness of the prediction, apart from the run plan's streams)
POSTERIOR_STREAM = 0x706F7374


def check_fedsgd_privacy(privacy) -> str:
    """Refuse configurations DP-FedSGD's accounting cannot honour; return the run's accountant."""
    if privacy.sampling_rate < 1:
        raise ConfigurationError("dp_fedsgd samples records, not clients: every client takes part in every round "
                                 "(record-level client sampling buys no amplification); set sampling_rate=1")
    accountant = privacy.resolved_accountant
    if accountant not in SAMPLED_ACCOUNTANTS:
        raise ConfigurationError(f"dp_fedsgd's rounds are Poisson-sampled Gaussians, which the {accountant!r} "
                                 "accountant cannot compose; set accountant='pld' (or 'rdp'); CLI: --accountant pld")
    if privacy.adjacency == "replace_one" and accountant != "pld":
        raise ConfigurationError("dp_fedsgd: replace-one (public record counts) sampled rounds are composed by the "
                                 "pld accountant only; set accountant='pld' (CLI: --accountant pld)")
    return accountant


__all__ = ["DPFedSGD", "OPTIMIZERS", "POSTERIORS", "check_fedsgd_privacy"]
