"""FOLA: federated online Laplace approximation (Liu et al.), with each upload made private.

Client (Algorithm 1): start from the global mean mu_S and train on task loss + lambda * 0.5 (theta - mu_S)^T
Lambda_S (theta - mu_S) (prior iteration, eqs. 15-16); accumulate the diagonal empirical Fisher of the *task* loss
online over all local steps from per-example squared gradients (eq. 22: F_n = sum over epochs and records of
g_i (.) g_i / (epochs n_k)); local posterior mean mu_n = theta, precision Lambda_n = F_n / r + (r - 1) / r Lambda_S
in round r (eq. 24). Server: Gaussian product of the clients' posteriors (eq. 12), :mod:`gaussian_product`, from
weighted sums only; the precision is floored at the initial prior precision gamma (eq. 25's gamma I).

How each upload is made private (PAPERS.md, "Channels, clips and sensitivities"):

- ``epsilon = inf``: the paper's algorithm. Channels ``natural_mean`` (Lambda_n mu_n) and ``precision``
  (Lambda_n), weights n_k, so the server's averages are sum_k q_k (.) with q_k = n_k / n.
- ``unit="client"``: each client's change of natural parameters, ``natural_mean_delta`` = Lambda_n mu_n -
  Lambda_S mu_S and ``precision_delta`` = Lambda_n - Lambda_S, each clipped to norm C (:class:`NormClip`) and
  noised; uniform weights (example counts would make a client's influence data-dependent).
- ``unit="example"``: local training is DP-SGD (opacus, :mod:`dpsgd_fedavg`), so the posterior mean is
  post-processing: channel ``mean`` (mu_n, :class:`TrainedPrivately`, charged with the training's event). The Fisher
  is the private statistic. It is computed on a pass of its own at the start of every DP-SGD step, over a fresh
  shuffle of the records split into one chunk per step, so each record contributes exactly once per epoch, at the
  parameters of that step (online, as eq. 22), and never through DP-SGD's hidden Poisson batches. Each example's
  gradient is clipped to C, so a record's terms sum to at most ``epochs * C^2`` in L2 norm
  (:class:`privfl.training.fisher.FisherAccumulator` also caps its visits at ``epochs``); the channel ``fisher_diag`` is that
  sum divided by ``epochs``: sensitivity C^2, :class:`PreClipped` ``(C, "squared_sum")``. A Gaussian product needs
  sum_k Lambda_k mu_k, whose Fisher part sum_k F_k (.) mu_k = F (.) mu_S + sum_k F_k (.) (mu_k - mu_S) is not
  post-processing of the two channels above, so a third channel ``fisher_natural_mean`` releases
  fisher_diag (.) clip(mu_n - mu_S, -B, B) (the round's local change, small, so B is small): each record's term has
  norm at most B C^2 (terms are not non-negative, so :class:`PreClipped` ``(B C^2, "sum")``). Weights are 1 and the
  server divides the Fisher sums by the participants' **public** record count (``PublicFacts.total_size``: declared
  sizes, or the design size per client; never the true n_k, which are private by default), and DP-SGD's schedule
  comes from the same public size (``dpsgd_fedavg``). The prior-part mean is the unweighted average of the
  clients' means.

Budget: one target epsilon per client over all rounds, split across a round's channels by ``budget_share``: the
runtime calibrates the Gaussian channels (:func:`privfl.core.plan.noise_multipliers_for`, which gives the
DP-SGD-trained ``mean`` channel a share too); that share is what DP-SGD gets: its noise multiplier is calibrated so
that DP-SGD composed with the Fisher releases meets the target under the run's accountant (``pld``, the default for
``unit="example"``, or ``rdp``, as for ``dpsgd_fedavg``).

Post-processing on the server (free, :mod:`gaussian_product`), which knows each release's noise std: the precision
is floored at gamma and the known noise is folded into it. At client level the division eta / Lambda is regularised
by the precision's noise towards the previous global mean. At record level the product is written as the clients'
average mean plus a Fisher-weighted correction, and the Fisher and the correction are replaced by empirical-Bayes
estimates given their known noise, pooled per layer (``shrink_groups``; :func:`gaussian_product.shrink_by_known_noise`):
where the released Fisher is mostly noise (a record adds at most C^2 over all d coordinates, so per coordinate it
usually is) the correction shrinks to 0 and the mean falls back to FedAvg's, and what signal a layer's releases do
carry is kept. (The earlier rule, the division regularised coordinate by coordinate, let the noise through: the
product's mean moved one to two rounds' steps away from the average every round at epsilon 3.)

Execution (``privfl.training.stacked``): every mode is the same computation on every client, so a round's clients train
together (:meth:`FOLA.client_updates`), each from its own generators in the per-client order (torch seed, Fisher
chunks, DP-SGD noise, Poisson coins); the per-client step stays for subclasses with a local step of their own and
for models the executor cannot batch.

Regression (float targets): the likelihood is Gaussian with unit noise variance in the standardised target units, so
the task loss is 0.5 (y - f(x))^2 per example (:class:`privfl.training.fisher.HalfSquaredError`, mean over the batch), and
the precision is the empirical Fisher of that loss, read off its per-example gradients exactly as for
cross-entropy; DP-SGD gets the same loss per example. Every channel's sensitivity is in terms of clipped
per-example gradients, so every bound above holds whatever the loss. Regression runs on the per-client loop (the
vectorised executor computes cross-entropy only: :attr:`FOLA.vectorisable` is False); it is evaluated by RMSE, MAE
and R^2 in the targets' own units, as the FedAvg family is.

Differences from the authors' code: per-example squared gradients (theirs square mini-batch means), a floor at gamma
(theirs adds 1e-5 to a denominator).
"""

from __future__ import annotations

import copy
import math
from typing import Mapping

import numpy as np
import torch
from torch import nn

from privfl.core.aggregation import Aggregate
from privfl.algorithms.base import ClientOutput, FederatedAlgorithm
from privfl.privacy.record_level import (DPSGD, DPSGDSchedule, calibrate_dpsgd, check_dpsgd_privacy, check_opacus_model,
                                         dpsgd_schedule, other_round_events)
from privfl.algorithms.gaussian_product import (GaussianProduct, combine, gaussian_product,
                                                 shrink_by_known_noise)
from privfl.algorithms.user_models import check_user_model, user_model_factories
from privfl.core.channels import ClippedValue, NormClip, PreClipped, PrivatizedValue, TrainedPrivately
from privfl.core.public import secret_seed
from privfl.privacy.units import at_unit, channel as unit_channel
from privfl.errors import ConfigurationError
from privfl.training.stacked import PerExampleGradients, VectorisedOnlineFisher, vectorisable
from privfl.training.fisher import HalfSquaredError, check_fisher_model, per_example_task_loss, unsupported_parameters
from privfl.training.posterior import GaussianPriorGradient, StepFisher, online_fisher_sgd
from privfl.metrics import classification_metrics, point_regression_metrics
from privfl.models import make_model
from privfl.training.local import flat_parameters, load_flat_parameters, predict_outputs, predict_proba

_SHARES = {"client": {"natural_mean_delta": 0.5, "precision_delta": 0.5},
           "example": {"mean": 0.5, "fisher_diag": 0.25, "fisher_natural_mean": 0.25}}


#: how the record-level server pools coordinates to estimate the Fisher releases' signal against their known noise
_SHRINK_GROUPS = ("layer", "tensor", "all")


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"fola: {name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_loss(loss) -> None:
    """Accept FOLA's own task loss only: None, or an ``nn.CrossEntropyLoss`` with its defaults (mean reduction, no
    class weights, no label smoothing), which is the loss whose Fisher every path computes for classification
    (regression's loss is the Gaussian likelihood's, chosen from the data: ``loss`` must then be left out)."""
    if loss is None:
        return
    plain = (type(loss) is nn.CrossEntropyLoss and loss.weight is None and loss.label_smoothing == 0
             and loss.ignore_index == -100 and loss.reduction == "mean")
    if not plain:
        raise ConfigurationError(f"fola: loss={loss!r} is refused: FOLA's posterior precision is the Fisher "
                                 "information of the task loss (eq. 22), which it reads off per-example gradients "
                                 "of plain cross-entropy on logits (regression: of 0.5 (y - f(x))^2); another loss "
                                 "(or class weights, label smoothing) would need a Fisher of its own. Leave loss out "
                                 "(cross-entropy, or the Gaussian loss for regression), or train with "
                                 "fedavg, dp_fedavg or dpsgd_fedavg, which take any loss")


class FOLA(FederatedAlgorithm):
    """FOLA with privacy per channel (module docstring).

    ``prior_weight``: lambda of eq. 16. ``prior_precision``: gamma, the initial prior precision and the floor of the
    aggregated precision. ``update_bound``: B, the range [-B, B] each coordinate of the round's local change
    mu_n - mu_S is clipped to in ``fisher_natural_mean`` (example unit; the noise of that channel scales with B).
    ``precision_clip``: the norm bound of ``precision_delta`` at client level (default: the privacy clip C; the
    precision changes far less than the natural mean, so a smaller bound there means less noise).
    ``budget_shares``: channel name -> share (private runs).
    ``shrink_groups``: at record level, the coordinates pooled by the server's empirical-Bayes estimates of the
    Fisher and of the Fisher-weighted correction (:meth:`_record_level_posterior`): ``"layer"`` (the parameters of
    one module together: a layer's weight and bias), ``"tensor"`` (each parameter tensor) or ``"all"``.
    ``shrink_margin``: how many standard errors of pure noise a group's spread must clear before those estimates
    count it as signal (``margin`` of :func:`privfl.algorithms.gaussian_product.shrink_by_known_noise`): 0, the plain
    empirical-Bayes estimate, validated best (experiments/results/bayesian_vs_dpsgd.md); 2 guards layers that may
    carry no signal at all.

    ``model``: the user's network whose posterior FOLA learns (an ``nn.Module``, copied so yours is never trained, or
    a zero-argument factory; default the built-in ``fed.model``): mean and precision over its flat parameters. Its
    per-example Fisher is read off hooks, so every trainable parameter must live in an ``nn.Linear`` or
    ``nn.Conv2d`` (groups=1) used once per forward pass, with no batch normalisation and no frozen parameters
    (:func:`privfl.training.fisher.check_fisher_model`, checked in setup with a message naming the layers); at record level
    it must also pass opacus's validation. ``loss``: only cross-entropy (``None`` or a plain
    ``nn.CrossEntropyLoss()``): the precision is the Fisher of the task loss, eq. 22, and another loss would need
    its own Fisher, so it is refused with that reason. Regression (float targets) uses the Gaussian likelihood's
    0.5 (y - f(x))^2 instead (module docstring), with ``loss`` left out.
    """

    name = "fola"
    supports_privacy = True
    #: a client step reads the global posterior only (privfl.algorithms.base: the two halves)
    broadcast_state = ("mean", "precision")

    def __init__(self, fed, privacy, *, prior_weight: float = 1.0, prior_precision: float = 1e-3,
                 update_bound: float = 0.1, precision_clip: float | None = None,
                 budget_shares: Mapping[str, float] | None = None, shrink_groups: str = "layer",
                 shrink_margin: float = 0.0, model=None, loss=None):
        super().__init__(fed, privacy)
        self.user_model = user_model_factories(model, self.name, many=False)
        _check_loss(loss)
        self.loss_given = loss is not None
        self.prior_weight = _positive("prior_weight", prior_weight)
        self.prior_precision = _positive("prior_precision", prior_precision)
        self.update_bound = _positive("update_bound", update_bound)
        self.precision_clip = None if precision_clip is None else _positive("precision_clip", precision_clip)
        if shrink_groups not in _SHRINK_GROUPS:
            raise ConfigurationError(f"fola: shrink_groups must be one of {sorted(_SHRINK_GROUPS)}, got "
                                     f"{shrink_groups!r}")
        self.shrink_groups = shrink_groups
        if (isinstance(shrink_margin, bool) or not isinstance(shrink_margin, (int, float))
                or not 0 <= shrink_margin < math.inf):
            raise ConfigurationError(f"fola: shrink_margin must be a finite number >= 0, got {shrink_margin!r}")
        self.shrink_margin = float(shrink_margin)
        #: the client step's form for the run's unit (privfl.privacy.units.at_unit): the paper's online posterior, or
        #: the DP-SGD-trained one with its clipped Fisher at record level
        self.form = at_unit(privacy, client=OnlinePosterior, record=RecordPosterior)(self)
        self.accountant = self.form.accountant
        shares = dict(self.form.shares)
        if budget_shares is not None:
            if set(budget_shares) != set(shares):
                raise ConfigurationError(f"fola ({self.form.label}): budget_shares must name exactly "
                                         f"{sorted(shares)}")
            shares = {k: _positive(f"budget share of {k}", v) for k, v in budget_shares.items()}
        self.budget_shares = shares
        self.model: nn.Module | None = None
        self.mean: np.ndarray | None = None
        self.precision: np.ndarray | None = None
        self._dpsgd: dict[DPSGDSchedule, float] = {}
        self._fisher_events: list | None = None

    # -- state ---------------------------------------------------------------------------------------------------

    def setup(self, data, rng):
        public = self.bind_public(data)
        if public.task == "regression" and self.loss_given:
            raise ConfigurationError("fola: on regression data the task loss is the Gaussian likelihood's "
                                     "0.5 (y - f(x))^2, whose Fisher is the precision; leave loss out")
        torch.manual_seed(int(rng.integers(0, 2 ** 31 - 1)))
        if self.user_model is None:
            self.model = make_model(self.fed.model, public.input_shape, public.num_classes, **self.fed.model_kwargs())
        else:
            self.model = check_user_model(self.user_model[0](), public.input_shape, public.num_classes, self.name)
            check_fisher_model(self.model, public.input_shape, self.name)
            self.form.check_model(self.model)
        self.mean = flat_parameters(self.model)
        self.precision = np.full_like(self.mean, self.prior_precision)

    @property
    def dim(self) -> int:
        return int(self.mean.size)

    def channels(self):
        return self.form.channels()

    # -- client ----------------------------------------------------------------------------------------------------

    def _train_online(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, rng) -> tuple[float, torch.Tensor]:
        """Plain SGD on task + prior loss; the Fisher of the task loss is read off each step's own backward pass
        (``privfl.training.posterior.online_fisher_sgd``)."""
        return online_fisher_sgd(model, x, y, prior_mean=self.mean, prior_precision=self.precision,
                                 prior_weight=self.prior_weight, epochs=self.fed.local_epochs,
                                 batch_size=self.fed.batch_size, lr=self.fed.lr, momentum=self.fed.momentum, rng=rng,
                                 loss_fn=self._per_example_loss)

    @property
    def regression(self) -> bool:
        return self.public is not None and self.public.task == "regression"

    @property
    def _per_example_loss(self):
        """The task's per-example loss (cross-entropy on logits, or the Gaussian 0.5 ||y - f(x)||^2)."""
        return per_example_task_loss("regression" if self.regression else "classification")

    def _dpsgd_loss(self) -> nn.Module:
        """DP-SGD's criterion, with a ``reduction`` switch for opacus's per-example losses (the task loss)."""
        return HalfSquaredError() if self.regression else nn.CrossEntropyLoss()

    def _dpsgd_noise_multiplier(self, schedule: DPSGDSchedule) -> float:
        """DP-SGD's z: what the target leaves after the runtime's calibrated Fisher releases (module docstring)."""
        if schedule not in self._dpsgd:
            if self._fisher_events is None:  # the Fisher releases' events, at the run plan's own multipliers
                self._fisher_events = list(other_round_events(self.channels(), self.privacy, self.fed.rounds))
            self._dpsgd[schedule] = calibrate_dpsgd(self.privacy.epsilon, self.privacy.delta, self.fed.rounds,
                                                    schedule, self.accountant, other_round_events=self._fisher_events)
        return self._dpsgd[schedule]

    def planned_events(self, client: int) -> dict:
        """The per-round event of each DP-SGD-trained channel of ``client`` (the run plan's; record level only)."""
        return self.form.planned_events(client)

    def private_release_weight(self, client: int) -> float:
        return 1.0

    def client_update(self, client, dataset, round, rng):
        [(_, out)] = self.form.updates([client], [dataset], round, [rng], vectorised=False)
        return out

    def check_broadcast(self, round) -> None:
        """The broadcast precision checked before any record is read (the client half calls this after its generic
        checks: finite, within float32's range, the model's shape): every entry > 0, as every honest server's is
        (gamma to start with, floored at gamma or folded from a floored value after). A review's server sent 1e300
        on the weights of a pixel that is 0 in every record of D: the prior term then overflowed only for a data
        set whose record moved such a weight."""
        precision = np.asarray(self.precision)
        if precision.size and not float(precision.min()) > 0:
            raise ConfigurationError(f"the server broadcast a FOLA precision with entries <= 0 (smallest "
                                     f"{float(precision.min())!r}); every honest precision is > 0; refused before any "
                                     "record was read")

    def _record_output(self, mu: np.ndarray, fisher_sum: torch.Tensor, stats: dict, event) -> ClientOutput:
        """The record-level channels from the DP-SGD-trained mean and the clipped Fisher (module docstring)."""
        fisher = fisher_sum.double().numpy()
        c = self.privacy.clip
        values = {"mean": PrivatizedValue(mu, event),
                  "fisher_diag": ClippedValue(fisher, c, "squared_sum"),
                  "fisher_natural_mean": ClippedValue(
                      fisher * np.clip(mu - self.mean, -self.update_bound, self.update_bound),
                      self.update_bound * c ** 2, "sum")}
        return ClientOutput(values, weight=1.0, metrics=stats)

    def _online_output(self, mu: np.ndarray, fisher_sum: torch.Tensor, n: int, round: int, loss: float
                       ) -> ClientOutput:
        """The local posterior of eq. 24 as the non-private or client-level channels."""
        r = round + 1
        precision = fisher_sum.double().numpy() / n / r + (r - 1) / r * self.precision  # eq. 24
        metrics = {"train_loss": loss, "fisher_mean": float(fisher_sum.mean()) / n}
        if not self.privacy.private:
            return ClientOutput({"natural_mean": precision * mu, "precision": precision}, weight=float(n),
                                metrics=metrics)
        return ClientOutput({"natural_mean_delta": precision * mu - self.precision * self.mean,
                             "precision_delta": precision - self.precision}, weight=1.0, metrics=metrics)

    # -- many clients at once (privfl.training.stacked) --------------------------------------------------------------------

    @property
    def vectorisable(self) -> bool:
        """Whether :meth:`client_updates` trains a round's clients together: this class's own local steps over a
        model built of stateless layers. Either form's client step is written once over the two executors: the
        online step is SGD with the prior term and the Fisher read off its per-example gradients
        (``privfl.training.stacked.VectorisedOnlineFisher``, or ``privfl.training.posterior.online_fisher_sgd`` per
        client); the record-level step is the DP-SGD engine (``privfl.privacy.record_level.DPSGD``) with the clipped
        Fisher pass before each step and the prior gradient added after the noise (``privfl.training.posterior``
        hooks, in both executors' forms), every client's Poisson coins, noise and Fisher steps drawn from its own
        generators in one order. The batched executors compute cross-entropy, so regression runs per client."""
        cls = type(self)
        own = cls.client_update is FOLA.client_update and cls._train_online is FOLA._train_online
        # the per-client step reads its Fisher off hooks that refuse other layers; the batched one must not accept more
        return (own and self.model is not None and not self.regression and vectorisable(self.model)
                and not unsupported_parameters(self.model))

    def client_updates(self, clients, datasets, round, rngs):
        """``(k, client_update(k, ...))`` for every client of ``clients``, trained together when
        :attr:`vectorisable` (the same outputs to float tolerance), else one after another."""
        if not self.vectorisable:
            for k, dataset, rng in zip(clients, datasets, rngs):
                yield k, self.client_update(k, dataset, round, rng)
            return
        yield from self.form.updates(clients, datasets, round, rngs, vectorised=True)

    # -- server ----------------------------------------------------------------------------------------------------

    def server_update(self, aggregates: Mapping[str, Aggregate], round):
        post = self.form.server(aggregates, round)
        self.mean, self.precision = post.mean, post.precision

    def _record_level_posterior(self, aggregates: Mapping[str, Aggregate], r: int) -> GaussianProduct:
        """The record-level Gaussian product, with the Fisher releases' known noise (module docstring).

        Without noise: mean = m0 + (u / r) / Lambda, where m0 is the unweighted average of the clients' DP-SGD
        means, u = sum_k q_k F_k (.) (clip(mu_k - mu_S) - (m0 - mu_S)) (the Fisher-weighted correction, released by
        ``fisher_natural_mean`` less ``fisher_diag`` times the average change) and Lambda = F / r + (r - 1) / r
        Lambda_S: algebraically the product of eq. 12. With noise, F and u are replaced by their empirical-Bayes
        estimates over each group of ``shrink_groups`` (:func:`shrink_by_known_noise`: F towards the group's mean
        Fisher, u towards 0), so a correction that is mostly noise shrinks away and the mean falls back to the
        clients' average, and a group whose Fisher varies mostly by noise gets one pooled precision; the estimates'
        remaining variance is folded into the precision (delta method), as :func:`combine` does, and the mean's step
        is projected onto the range the exact step lies in (public: B and the average change). Groups are layers
        by default: before the projection existed, estimating a bias's spread from its 10 or 32 coordinates alone
        let noise through (validation, 6 seeds: per tensor 0.716, per layer 0.733); with it the two validate alike
        (experiments/results/bayesian_vs_dpsgd.md compares the groupings and ``shrink_margin`` on validation). On a
        layer whose releases carry no signal at all the plain estimate (margin 0) still passes a fluctuation of the
        noise about half the time; the projection bounds it, ``shrink_margin=2`` removes it in ~98% of rounds.
        """
        means, f, fd = aggregates["mean"], aggregates["fisher_diag"], aggregates["fisher_natural_mean"]
        # the participants' public record count (declared sizes, or the design size per client)
        records = self._public_records(means)
        m0 = means.total / means.total_weight  # unweighted average of the clients' means (no added noise)
        change = m0 - self.mean
        fisher = f.total / records  # sum_k q_k F_k, noisy
        correction = fd.total / records - fisher * change
        fisher_std = f.noise_std / records
        correction_std = np.hypot(fd.noise_std / records, fisher_std * change)
        noisy = f.noise_std > 0 or fd.noise_std > 0
        fisher_var = correction_var = 0.0  # the estimates' posterior variances (none without noise)
        if noisy:
            groups = self._parameter_groups()
            fisher, fisher_var = shrink_by_known_noise(fisher, fisher_std, groups, centre="group_mean",
                                                       margin=self.shrink_margin)
            fisher = np.maximum(fisher, 0.0)
            correction, correction_var = shrink_by_known_noise(correction, correction_std, groups, centre="zero",
                                                               margin=self.shrink_margin)
        lam = np.maximum(fisher / r + (r - 1) / r * self.precision, self.prior_precision)
        # the exact step, u / (F + r prior part), is a Fisher-weighted mean of clip(mu_k - mu_S, -B, B) - change
        # scaled by a factor in [0, 1]: it lies between 0 and [-B - change, B - change], public bounds, so an estimate
        # outside them (noise divided by a small precision) is projected back
        step = np.clip(correction / r / lam, np.minimum(0.0, -self.update_bound - change),
                       np.maximum(0.0, self.update_bound - change))
        mean = m0 + step
        if noisy:  # delta method: var(step) from the estimates' posterior variances
            var = (correction_var / r ** 2 + step ** 2 * fisher_var / r ** 2) / lam ** 2
            lam = 1.0 / (1.0 / lam + var)
        return GaussianProduct(mean, lam)

    def _parameter_groups(self) -> list[tuple[int, int]]:
        """The flat vector's slices that :meth:`_record_level_posterior` pools (``shrink_groups``; public: the
        architecture): one per module (``"layer"``: the parameters whose names share everything but the last
        component, e.g. ``0.weight`` and ``0.bias``), one per tensor, or one in all (also when there is no model:
        a server built from its state alone)."""
        if self.model is None or self.shrink_groups == "all":
            return [(0, int(self.mean.size))]
        groups, keys, start = [], [], 0
        for name, p in self.model.named_parameters():
            key = name.rpartition(".")[0] if self.shrink_groups == "layer" else name
            if keys and keys[-1] == key:
                groups[-1] = (groups[-1][0], start + p.numel())
            else:
                groups.append((start, start + p.numel()))
                keys.append(key)
            start += p.numel()
        return groups

    def _public_records(self, aggregate: Aggregate) -> float:
        """The public record count behind an aggregate: the design size per participant, or, with declared sizes,
        the participants' declared sizes (all clients when everyone took part, else their mean per participant)."""
        public = self.public
        if not public.sizes_public:
            return float(public.client_size * aggregate.participants)
        total = public.total_size(range(public.n_clients))
        return total * aggregate.participants / public.n_clients

    def global_model(self) -> nn.Module:
        """The network (the user's, or the built-in one) at the global posterior mean (the algorithm's own module:
        copy it to keep it)."""
        load_flat_parameters(self.model, self.mean)
        return self.model

    def predict_proba(self, dataset):
        if dataset.task == "regression":
            return None
        load_flat_parameters(self.model, self.mean)
        return predict_proba(self.model, dataset.tensors()[0])

    def evaluate(self, dataset):
        """Classification metrics, or for regression RMSE, MAE and R^2 of the posterior mean's predictions in the
        targets' own units."""
        if dataset.task == "regression":
            load_flat_parameters(self.model, self.mean)
            pred = predict_outputs(self.model, dataset.tensors()[0]).reshape(dataset.y.shape)
            return point_regression_metrics(dataset.to_original_units(pred), dataset.to_original_units(dataset.y))
        return classification_metrics(self.predict_proba(dataset), dataset.tensors()[1].numpy())


class OnlinePosterior:
    """FOLA's client step as the paper writes it, for non-private runs and client level: SGD on task + prior loss
    with the Fisher read off its own per-example gradients (eq. 22), the local posterior of eq. 24 released as
    natural parameters (non-private, weights n_k) or as their changes from the global ones (each clipped as a whole
    by the pipeline, weights 1); the server's Gaussian product with the known noise folded in."""

    label = "online"
    accountant = None

    def __init__(self, alg: FOLA):
        self.alg = alg
        self.shares = dict(_SHARES["client"]) if alg.privacy.private else {}

    def check_model(self, model: nn.Module) -> None:
        """Nothing beyond the Fisher's own check (setup's)."""

    def planned_events(self, client: int) -> dict:
        return {}

    def channels(self):
        alg = self.alg
        d, p, c, s = (alg.dim,), alg.privacy, alg.privacy.clip, alg.budget_shares
        if not p.private:
            return [unit_channel(p, "natural_mean", d, description="Lambda_n * mu_n"),
                    unit_channel(p, "precision", d, description="Lambda_n (eq. 24)")]
        return [unit_channel(p, "natural_mean_delta", d, budget_share=s["natural_mean_delta"],
                             description="Lambda_n mu_n - Lambda_S mu_S, clipped to C"),
                unit_channel(p, "precision_delta", d, client=NormClip(alg.precision_clip or c),
                             budget_share=s["precision_delta"],
                             description="Lambda_n - Lambda_S, clipped to precision_clip (default C)")]

    def updates(self, clients, datasets, round, rngs, *, vectorised: bool):
        """The client step of ``clients``, written once over the two executors (the vectorised one, or the
        per-client loop of ``FOLA._train_online``); each client's draws in one order: its torch seed, then its
        shuffles."""
        alg = self.alg
        seeds = [int(rng.integers(0, 2 ** 31 - 1)) for rng in rngs]
        if vectorised:
            sgd = VectorisedOnlineFisher(alg.model, epochs=alg.fed.local_epochs, batch_size=alg.fed.batch_size,
                                         lr=alg.fed.lr, momentum=alg.fed.momentum, prior_weight=alg.prior_weight)
            rows = ((i, final.astype(np.float64), torch.from_numpy(fisher) / alg.fed.local_epochs, loss)
                    for i, final, fisher, loss in sgd.train(alg.mean, alg.precision, [d.tensors() for d in datasets],
                                                            rngs))
        else:
            rows = (self._one(i, datasets[i], seeds[i], rngs[i]) for i in range(len(clients)))
        for i, mu, fisher_sum, loss in rows:
            yield clients[i], alg._online_output(mu, fisher_sum, len(datasets[i]), round, loss)

    def _one(self, i: int, dataset, seed: int, rng):
        local = copy.deepcopy(self.alg.model)
        load_flat_parameters(local, self.alg.mean)
        torch.manual_seed(seed)  # the layers' own randomness, if any
        x, y = dataset.tensors()
        loss, fisher_sum = self.alg._train_online(local, x, y, rng)
        return i, flat_parameters(local), fisher_sum, loss

    def server(self, aggregates: Mapping[str, Aggregate], round) -> GaussianProduct:
        alg = self.alg
        floor = alg.prior_precision
        if not alg.privacy.private:
            return gaussian_product(aggregates["natural_mean"], aggregates["precision"], precision_floor=floor)
        eta, lam = aggregates["natural_mean_delta"], aggregates["precision_delta"]
        k = lam.total_weight
        return combine(alg.precision * alg.mean + eta.total / k, alg.precision + lam.total / k,
                       precision_floor=floor, natural_noise_std=eta.noise_std / k,
                       precision_noise_std=lam.noise_std / k, fold_noise=True, reference_mean=alg.mean)


class RecordPosterior:
    """FOLA's client step at record level (module docstring): DP-SGD on the task loss (the engine,
    ``privfl.privacy.record_level.DPSGD``) with the prior's gradient added after the noise, a clipped Fisher pass at
    the start of every step on records of its own choosing, and the channels ``mean`` (post-processing of the
    training), ``fisher_diag`` and ``fisher_natural_mean`` (sums of clipped per-record terms); the server's
    record-level Gaussian product (``FOLA._record_level_posterior``)."""

    label = "example"

    def __init__(self, alg: FOLA):
        self.alg = alg
        self.accountant = check_dpsgd_privacy(alg.privacy, alg.name)
        if alg.privacy.placement == "distributed":
            raise ConfigurationError("fola (unit='example'): DP-SGD is calibrated against the Fisher channels' "
                                     "Gaussian events; use local or central placement")
        self.shares = dict(_SHARES["example"])

    def check_model(self, model: nn.Module) -> None:
        check_opacus_model(model, self.alg.name, self.alg.public.input_shape)

    def planned_events(self, client: int) -> dict:
        schedule = dpsgd_schedule(self.alg, client)
        return {"mean": schedule.round_event(self.alg._dpsgd_noise_multiplier(schedule))}

    def channels(self):
        alg = self.alg
        d, p, c, s = (alg.dim,), alg.privacy, alg.privacy.clip, alg.budget_shares
        # coordinate bounds (for secure aggregation's quantisation range): every record adds at most C^2 per
        # coordinate to fisher_diag, and a client holds at most the public record cap (beyond it the sum is clipped
        # into the range, a contraction)
        fisher_bound = alg.public.record_cap * c ** 2
        return [unit_channel(p, "mean", d, client=None, record=TrainedPrivately(), budget_share=s["mean"],
                             description="mu_n after DP-SGD local training (post-processing)"),
                unit_channel(p, "fisher_diag", d, client=None, record=PreClipped(c, "squared_sum"),
                             budget_share=s["fisher_diag"], value_bound=fisher_bound,
                             description="per-epoch sum of per-example squared gradients clipped to C"),
                unit_channel(p, "fisher_natural_mean", d, client=None,
                             record=PreClipped(alg.update_bound * c ** 2, "sum"),
                             budget_share=s["fisher_natural_mean"], value_bound=fisher_bound * alg.update_bound,
                             description="fisher_diag (.) clip(mu_n - mu_S, -B, B)")]

    def updates(self, clients, datasets, round, rngs, *, vectorised: bool):
        """The client step of ``clients``, one DP-SGD schedule at a time, written once over the engine's two
        executors; each client's draws in one order: its torch seed, its Fisher steps' generator, then DP-SGD's
        noise and Poisson coins (the engine's)."""
        alg = self.alg
        groups: dict[DPSGDSchedule, list[int]] = {}
        for i, k in enumerate(clients):
            groups.setdefault(dpsgd_schedule(alg, k), []).append(i)
        clip, epochs = alg.privacy.clip, alg.fed.local_epochs
        prior = GaussianPriorGradient(alg.model, alg.mean, alg.precision, alg.prior_weight)
        for schedule, members in groups.items():
            z = alg._dpsgd_noise_multiplier(schedule)
            seeds, fisher_rngs = [], []
            secure = alg.privacy.private and alg.privacy.secure_noise
            for i in members:
                seeds.append(int(rngs[i].integers(0, 2 ** 31 - 1)))
                # each record's Fisher step is drawn by its position in the client's data: secret, or one record
                # removed would move every later record's term to another step (privfl.core.public.secret_seed)
                fisher_rngs.append(np.random.default_rng(secret_seed(rngs[i], secure)))
            data = [datasets[i].tensors() for i in members]
            engine = DPSGD(alg.model, schedule, noise_multiplier=z, clip=clip, lr=alg.fed.lr,
                           momentum=alg.fed.momentum, secure_noise=alg.privacy.secure_noise, loss=alg._dpsgd_loss(),
                           algorithm=alg.name)
            fisher = StepFisher(data, fisher_rngs, dim=alg.dim, clip=clip, epochs=epochs,
                                steps_per_epoch=schedule.steps_per_epoch, loss_fn=alg._per_example_loss,
                                per_example=PerExampleGradients(alg.model) if vectorised else None)
            for j, final, stats in engine.train(alg.mean, data, [rngs[i] for i in members], vectorised=vectorised,
                                                torch_seeds=seeds, before_step=fisher, extra_gradient=prior):
                i = members[j]
                yield clients[i], alg._record_output(np.asarray(final, dtype=np.float64), fisher.per_visit(j),
                                                     {**stats, "noise_multiplier": z}, schedule.round_event(z))

    def server(self, aggregates: Mapping[str, Aggregate], round) -> GaussianProduct:
        return self.alg._record_level_posterior(aggregates, round + 1)


__all__ = ["FOLA", "OnlinePosterior", "RecordPosterior"]
