"""HBFL: Bayesian federated learning with knowledge distillation (Yang, Yan and Ren 2023).

Each round every client forks a *meme* model, a mean-field Gaussian Bayesian net, from the global mean, trains it
by Bayes-by-Backprop towards its tempered local likelihood (eq. 4.1), and trains its own *local* model, of any
architecture, by distillation from the meme model: L = a CE + (1 - a) KL(q_meme || q_local) (eq. 4.2). It uploads
the meme posterior's natural parameters; the server multiplies the clients' Gaussians (Algorithm 1, line 5):
Lambda = sum_k q_k Lambda_k, mu = Lambda^-1 sum_k q_k Lambda_k mu_k.

How privfl reads eq. 4.1. KL(q || p(D_k|theta)^(1/T) / gamma_k) = -H(q) - E_q[log p(D_k|theta)] / T + const; times
T/n_k, the meme loss is E_q[mean NLL] - (T/n_k) H(q), with no prior. At its optimum, in the quadratic regime, the
precision is Lambda_k = H_k / T (H_k the Hessian diagonal of the summed NLL): T scales every client's precision by
the same factor, so it cancels in the aggregated mean.

Choices the paper leaves open (PAPERS.md), made here:

- Uploads are in *untempered units*, T Lambda (and T Lambda mu), as changes from the global natural parameters:
  ``natural_mean`` = T (Lambda_k mu_k - Lambda mu) and ``precision`` = T (Lambda_k - Lambda). T and the global state
  are public, so this is an invertible relabelling; it makes the numbers O(1), so a client-level clip bound C means
  what it means for DP-FedAvg (while every precision stays at ``init_precision`` = 1, the natural-mean change is
  exactly the model change).
- Initial variance: each round the meme's std is reset to sqrt(T / init_precision) (Algorithm 1, ClientUpdate line
  1: "initialize ... Sigma_k"); ``carry_precision=True`` starts it from the global precision instead.
- Optimisers: Adam (``meme_lr``, the paper's 1e-3) for the meme model; SGD (``fed.lr``, ``fed.momentum``) for the
  local model; no weight decay; fresh optimiser state each round. ``meme_optimizer="sgd"`` trains the meme by plain
  SGD at ``meme_lr`` instead (no momentum): under DP-SGD's noise, Adam's denominators are the noise's own scale
  and a fresh state's first steps move every coordinate by about ``meme_lr`` whatever its signal, so SGD, the
  optimiser of the DP-SGD FedAvg baseline, is the one to compare on equal terms (issue 16's comparison chose it on
  validation). Teacher and student take a step on the same
  mini-batch, meme first (Algorithm 1 lines 6-8). The teacher's soft labels come from the meme's means ("q_meme from
  the local mu_k"), a plain softmax by default (``distill_temperature=1``; other values soften both sides and scale
  the KL by tau^2, Hinton et al.).
- Post-processing on the server (``gaussian_product``): with noise, the aggregated precision is floored at
  ``precision_floor`` times the initial precision (default 1: the precision every meme starts from, the nearest
  thing HBFL has to a prior, which is where PAPERS.md floors noisy precisions) before mu = Lambda^-1 (Lambda mu);
  the floor is public, so it costs nothing, and it keeps a noisy precision near zero from blowing up the mean.
- No clamping in training: Adam moves each rho by about ``meme_lr`` per step, and without a prior a parameter the
  data never moves (e.g. a weight on an always-blank pixel) has no curvature, so its precision drifts towards 0
  and its weight in the product with it; nothing needs a bound.

Privacy:

- ``client`` unit: the pipeline clips each channel to its own L2 bound (``clip`` for the natural mean,
  ``precision_clip`` for the precision), splits the budget by ``budget_shares``, and the server adds noise to the
  unweighted sums (uniform weights: example counts would make the sensitivity data-dependent).
- ``example`` unit: the meme model is trained with DP-SGD (Poisson-sampled batches at rate q, each example's
  gradient clipped to ``clip``, Gaussian noise of std z * clip on the sum; Abadi et al. 2016), with dpsgd_fedavg's
  schedule (q = B / the client's public size, int(1/q) steps per epoch) and calibration of z to the target under
  the run's accountant. Both uploads
  are post-processing of that training: ``natural_mean`` carries the training's event
  SelfComposed(PoissonSampled(q, Gaussian(1, z)), steps); ``precision`` is computed from the same trained model, so
  it carries a NoOpEvent (charging the training twice would count it twice). Everything the schedule, the
  expected batch and the meme's entropy term (T / n) use is the client's *public* size (``privfl.core.public``: the design
  size, or its declared n_k), so the uploads stay post-processing of DP-SGD; the noise and the Poisson batches come
  from the OS CSPRNG unless the run asks for seeded noise. Opacus is not used: its per-sample gradients run the model
  under ``vmap`` without randomness, which the Bayesian layers' sampling needs; privfl computes them with
  ``torch.func`` instead.
- Execution: a round's clients train together (:class:`VectorisedHBFL`, ``torch.func``) when the meme is a stack of
  ``BayesLinear`` layers and the local models are built of stateless layers, in every mode; each client's batches,
  Poisson coins, DP noise and weight noise come from its own generators in the per-client order, so the uploads
  equal the per-client step's to float tolerance. A Bayesian conv meme (or a subclass's own client step) runs per
  client.
- The local models never leave their clients and are not released, and the meme model never sees them (the
  distillation is one-way), so they train on the raw data, on the meme's batches, at no privacy cost;
  ``local_metrics`` reports their mean test accuracy as a simulation diagnostic (``accuracy_local``), computed where
  the client models live, as the paper does, but never under the name ``accuracy``, which is the global model's
  (``evaluate``).

Halves: a client step reads the global posterior (``broadcast_state``) and its own local model (``client_state``,
carried between rounds as its state_dict's arrays by ``encode_client_state``); nothing else of the server.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from privfl.accounting import NoOpEvent
from privfl.core.aggregation import Aggregate
from privfl.algorithms.base import ClientOutput, FederatedAlgorithm, load_model_state, model_state_values
from privfl.privacy.record_level import (DPSGDSchedule, calibrate_dpsgd, check_dpsgd_privacy, dpsgd_schedule,
                                         poisson_lot, privatise_gradient_sum)
from privfl.algorithms.gaussian_product import gaussian_product
from privfl.algorithms.user_models import check_user_model, user_model_factories
from privfl.core.channels import NormClip, PrivatizedValue, TrainedPrivately
from privfl.privacy.units import channel as unit_channel, record_level
from privfl.errors import ConfigurationError
from privfl.metrics import classification_metrics
from privfl.training.stacked import DEFAULT_MEMORY_BUDGET, ELEMENTWISE, adam_step, sgd_step, vectorisable
from privfl.models import (MLP, MODELS, BayesLinear, bayes_modules, deterministic, get_mean_precision,
                           make_bayesian_model, make_model, set_mean_precision, softplus)
from privfl.models.bayes import _VAR_FLOOR  # BayesLinear's variance floor, written out in VectorisedHBFL
from privfl.models.errors import ModelConfigError
from privfl.core.public import private_torch_generator, release_weight
from privfl.training.local import batches, predict_proba

#: the meme model's optimisers (``meme_optimizer``): the paper's Adam, or plain SGD
MEME_OPTIMIZERS = ("adam", "sgd")
TEMPERATURE = 1e-4  # the paper's T (Sec. 5.1.1, after Ashukha et al. 2020)
_NOISELESS_FLOOR = 1e-12  # without noise the product of positive precisions is positive: the floor only guards


def distillation_loss(student_logits: torch.Tensor, teacher_probs: torch.Tensor, y: torch.Tensor, *,
                      weight: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """Eq. 4.2: ``weight`` * CE(y, student) + (1 - ``weight``) * KL(teacher || student), batch means.

    ``teacher_probs`` are the teacher's class probabilities at ``temperature``; the student is softened by the same
    temperature inside the KL, which is then scaled by temperature^2 so its gradients keep their size.
    """
    ce = F.cross_entropy(student_logits, y)
    log_student = F.log_softmax(student_logits / temperature, dim=1)
    kl = F.kl_div(log_student, teacher_probs, reduction="batchmean") * temperature ** 2
    return weight * ce + (1.0 - weight) * kl


def meme_regulariser(model: nn.Module, temperature: float, n: int) -> torch.Tensor:
    """-(T / n) H(q) up to a constant: the entropy part of eq. 4.1 per example, (T / n) * -sum log std."""
    total = None
    for _, m in bayes_modules(model):
        for _, (_, rho) in m.gaussian_parameters().items():
            part = -torch.log(softplus(rho)).sum()
            total = part if total is None else total + part
    return total * (temperature / n)


class HBFL(FederatedAlgorithm):
    """HBFL over channels ``natural_mean`` and ``precision`` (changes from the global state, untempered units).

    Args (besides the federation and privacy configurations):
        local_models: the clients' local architectures (names of ``privfl.models.MODELS``), cycled over clients;
            default: every client uses ``fed.model``. MLPs take ``fed.hidden`` and ``fed.pool``; conv nets their
            paper defaults.
        temperature: T of eq. 4.1.
        distill_weight: a of eq. 4.2. distill_temperature: softmax temperature of the distillation.
        init_precision: untempered precision T * Lambda every meme std starts from each round.
        carry_precision: start each round's meme std from the global precision instead.
        meme_lr: step size of the meme model's optimiser.
        meme_optimizer: ``"adam"`` (the paper's) or ``"sgd"`` (plain SGD, no momentum) for the meme model.
        precision_floor: noisy aggregated precisions are floored at this multiple of ``init_precision``.
        precision_clip: client-unit clip bound of the precision channel (default: ``privacy.clip``).
        budget_shares: (natural_mean, precision) shares of the client-unit budget.
        model: the user's own local model instead of ``local_models``: an ``nn.Module`` (copied per client, so yours
            is never trained) or a zero-argument factory, or a list of them, one per client and cycled over the
            clients (heterogeneous architectures, HBFL's point). Any classifier of the data's input shape with one
            logit per class; the meme stays privfl's Bayesian ``fed.model``. A client rebuilds its model from this
            argument (a factory is called on the client's seeded generator) and loads its weights from its state.
            Local models the vectorised executor cannot batch (buffers, dropout, frozen parameters, layers outside
            ``privfl.training.stacked``'s pure set) make the round run per client.
    """

    name = "hbfl"
    supports_privacy = True
    #: the global posterior a client's meme forks from and its uploads are changes from
    broadcast_state = ("global_mean", "global_precision", "global_natural_mean")
    #: each client's local model (never released)
    client_state = ("client_models",)
    defaults = {"hidden": (32,), "local_epochs": 2, "lr": 0.05, "clip": 1.0}

    def __init__(self, fed, privacy, *, local_models: Sequence[str] | None = None, temperature: float = TEMPERATURE,
                 distill_weight: float = 0.5, distill_temperature: float = 1.0, init_precision: float = 1.0,
                 carry_precision: bool = False, meme_lr: float = 1e-3, meme_optimizer: str = "adam",
                 precision_floor: float = 1.0, precision_clip: float | None = None,
                 budget_shares: tuple[float, float] = (0.7, 0.3), model=None):
        super().__init__(fed, privacy)
        self.user_models = user_model_factories(model, self.name, many=True)
        if self.user_models is not None and local_models is not None:
            raise ConfigurationError("hbfl: give either model (your own local models) or local_models (built-in "
                                     "architecture names), not both")
        self.local_models = self._check_local_models(local_models if local_models is not None else (fed.model,))
        self.temperature = _positive("temperature", temperature)
        if not (isinstance(distill_weight, (int, float)) and 0.0 <= distill_weight <= 1.0):
            raise ConfigurationError(f"distill_weight (a of eq. 4.2) must be in [0, 1], got {distill_weight!r}")
        self.distill_weight = float(distill_weight)
        self.distill_temperature = _positive("distill_temperature", distill_temperature)
        self.init_precision = _positive("init_precision", init_precision)
        self.carry_precision = bool(carry_precision)
        self.meme_lr = _positive("meme_lr", meme_lr)
        meme_optimizer = meme_optimizer.lower() if isinstance(meme_optimizer, str) else meme_optimizer
        if meme_optimizer not in MEME_OPTIMIZERS:
            raise ConfigurationError(f"meme_optimizer must be one of {', '.join(MEME_OPTIMIZERS)}, got "
                                     f"{meme_optimizer!r}")
        self.meme_optimizer = meme_optimizer
        self.precision_floor = _positive("precision_floor", precision_floor)
        self.precision_clip = privacy.clip if precision_clip is None else _positive("precision_clip", precision_clip)
        if len(budget_shares) != 2:
            raise ConfigurationError(f"budget_shares is (natural_mean, precision), got {budget_shares!r}")
        self.budget_shares = tuple(_positive("budget share", s) for s in budget_shares)
        self.accountant = check_dpsgd_privacy(privacy, self.name) if record_level(privacy) else None
        self.meme: nn.Module | None = None
        self.global_natural_mean: np.ndarray | None = None  # T Lambda mu
        self.global_precision: np.ndarray | None = None  # T Lambda
        self.global_mean: np.ndarray | None = None
        self.client_models: dict[int, nn.Module] = {}  # client-held local models (never released)
        self._input_shape: tuple[int, ...] = ()
        self._num_classes = 0
        self._dpsgd_noise: dict[DPSGDSchedule, float] = {}
        self._vectorisable: bool | None = None

    # -- configuration -------------------------------------------------------------------------------------------

    @staticmethod
    def _check_local_models(names: Sequence[str]) -> tuple[str, ...]:
        names = (names,) if isinstance(names, str) else tuple(names)
        if not names or not all(isinstance(n, str) and n.lower() in MODELS for n in names):
            raise ConfigurationError(f"local_models must name architectures among {sorted(MODELS)}, got {names!r}")
        return tuple(n.lower() for n in names)

    # -- global state --------------------------------------------------------------------------------------------

    def _model_kwargs(self, name: str) -> dict:
        return self.fed.model_kwargs() if name == "mlp" else {}

    def setup(self, data, rng):
        public = self.bind_public(data)
        if public.task != "classification":
            raise ConfigurationError("hbfl distils class probabilities; it needs a classification data set")
        torch.manual_seed(int(rng.integers(0, 2 ** 31 - 1)))
        self._input_shape, self._num_classes = tuple(public.input_shape), int(public.num_classes)
        self.meme = make_bayesian_model(self.fed.model, self._input_shape, self._num_classes,
                                        **self._model_kwargs(self.fed.model))
        for factory in self.user_models or ():  # each user architecture checked once, without moving the generator
            with torch.random.fork_rng(devices=[]):
                check_user_model(factory(), self._input_shape, self._num_classes, self.name)
        mean, _ = get_mean_precision(self.meme)
        self.global_mean = mean
        self.global_precision = np.full_like(mean, self.init_precision)
        self.global_natural_mean = self.global_precision * mean
        self.client_models = {}
        self._dpsgd_noise = {}
        self._vectorisable = None

    @property
    def dim(self) -> int:
        return int(self.global_mean.size)

    def channels(self):
        # a client's whole changes are norm-clipped; at record level both are post-processing of its DP-SGD training
        return [
            unit_channel(self.privacy, "natural_mean", (self.dim,), record=TrainedPrivately(),
                         budget_share=self.budget_shares[0],
                         description="T (Lambda_k mu_k - Lambda mu): change of the meme's natural mean"),
            unit_channel(self.privacy, "precision", (self.dim,), client=NormClip(self.precision_clip),
                         record=TrainedPrivately(), budget_share=self.budget_shares[1],
                         description="T (Lambda_k - Lambda): change of the meme's diagonal precision"),
        ]

    def set_global(self, mean: np.ndarray, precision: np.ndarray) -> None:
        """Set the global posterior from its mean and its *untempered* precision T Lambda."""
        self.global_mean = np.asarray(mean, dtype=np.float64).copy()
        self.global_precision = np.asarray(precision, dtype=np.float64).copy()
        self.global_natural_mean = self.global_precision * self.global_mean

    def global_model_precision(self) -> np.ndarray:
        """The global posterior's (tempered) precision Lambda = (T Lambda) / T."""
        return self.global_precision / self.temperature

    def global_model(self) -> nn.Module:
        """The meme model at the global posterior (tempered precision Lambda = untempered / T)."""
        model = copy.deepcopy(self.meme)
        set_mean_precision(model, self.global_mean, self.global_model_precision())
        return model

    # -- client --------------------------------------------------------------------------------------------------

    def local_model(self, client: int) -> nn.Module:
        """Client ``client``'s personalised model, built on first use and kept by the client across rounds."""
        if client not in self.client_models:
            self.client_models[client] = self._build_local_model(client)
        return self.client_models[client]

    def local_architecture(self, client: int) -> str | int:
        """Client ``client``'s local architecture (public): a name of ``local_models``, or the index of its user
        model in ``model`` (both cycled over the clients)."""
        if self.user_models is not None:
            return client % len(self.user_models)
        return self.local_models[client % len(self.local_models)]

    def _build_local_model(self, client: int) -> nn.Module:
        arch = self.local_architecture(client)
        if self.user_models is not None:
            return self.user_models[arch]()
        return make_model(arch, self._input_shape, self._num_classes, **self._model_kwargs(arch))

    def encode_client_state(self, client, state):
        """The local model as its state_dict's arrays."""
        return {name: model_state_values(value) if name == "client_models" else value
                for name, value in state.items()}

    def decode_client_state(self, client, values):
        """The local model rebuilt (its architecture is public: ``local_models``) and loaded; building it does not
        move the global torch generator, so the client's next step draws what it would have drawn."""
        state = dict(values)
        if "client_models" in state:
            with torch.random.fork_rng(devices=[]):
                state["client_models"] = load_model_state(self._build_local_model(client), state["client_models"])
        return state

    def _fork_meme(self) -> nn.Module:
        meme = copy.deepcopy(self.meme)
        start = self.global_precision if self.carry_precision else np.full_like(self.global_mean,
                                                                                 self.init_precision)
        set_mean_precision(meme, self.global_mean, start / self.temperature)
        return meme

    def release_weight(self, dataset, client: int = 0) -> float:
        return release_weight(self.privacy, self.public, client, dataset)

    def client_update(self, client, dataset, round, rng):
        torch.manual_seed(int(rng.integers(0, 2 ** 31 - 1)))
        x, y = dataset.tensors()
        n = len(x)
        meme, local = self._fork_meme(), self.local_model(client)
        meme_opt = (torch.optim.Adam(meme.parameters(), lr=self.meme_lr) if self.meme_optimizer == "adam"
                    else torch.optim.SGD(meme.parameters(), lr=self.meme_lr))
        local_opt = torch.optim.SGD(local.parameters(), lr=self.fed.lr, momentum=self.fed.momentum)
        dp = self.accountant is not None
        if dp:  # Poisson-sampled batches: each record joins each step with probability q (a secret coin)
            plan = dpsgd_schedule(self, client)
            q, z = plan.sample_rate, self.dpsgd_noise_multiplier(plan)
            secure = self.privacy.secure_noise
            noise = private_torch_generator(rng, secure)  # DP-SGD's generators, as dpsgd_train creates them
            coins = private_torch_generator(rng, secure)
            schedule = (poisson_lot(q, n, coins).numpy() for _ in range(plan.steps))
            reg_size = plan.size  # the public size: the entropy term must not read the private n_k
        else:
            schedule = (idx for _ in range(self.fed.local_epochs) for idx in batches(n, self.fed.batch_size, rng))
            reg_size = n
        meme.train()
        local.train()
        meme_loss = local_loss = 0.0
        for idx in schedule:
            xb, yb = x[torch.as_tensor(idx, dtype=torch.long)], y[torch.as_tensor(idx, dtype=torch.long)]
            meme_opt.zero_grad(set_to_none=True)
            if dp:
                dpsgd_gradients(meme, xb, yb, clip=self.privacy.clip, noise_multiplier=z,
                                expected_batch=plan.expected_batch, generator=noise, secure=secure)
                reg = meme_regulariser(meme, self.temperature, reg_size)
                reg.backward()
            else:
                loss = F.cross_entropy(meme(xb), yb) + meme_regulariser(meme, self.temperature, reg_size)
                loss.backward()
                meme_loss = float(loss.detach())
            meme_opt.step()
            if len(idx) == 0:
                continue
            with torch.no_grad(), deterministic(meme):
                teacher = torch.softmax(meme(xb) / self.distill_temperature, dim=1)
            local_opt.zero_grad(set_to_none=True)
            loss = distillation_loss(local(xb), teacher, yb, weight=self.distill_weight,
                                     temperature=self.distill_temperature)
            loss.backward()
            local_opt.step()
            local_loss = float(loss.detach())
        values: dict[str, object] = self.encode_posterior(*get_mean_precision(meme))
        if dp:
            values = {"natural_mean": PrivatizedValue(values["natural_mean"], plan.round_event(z)),
                      "precision": PrivatizedValue(values["precision"], NoOpEvent())}
        metrics = {"local_loss": local_loss}
        if not dp:
            metrics["meme_loss"] = meme_loss
        return ClientOutput(values, weight=self.release_weight(dataset, client), metrics=metrics)

    # -- many clients at once (privfl.training.stacked) --------------------------------------------------------------------

    @property
    def vectorisable(self) -> bool:
        """Whether :meth:`client_updates` trains a round's clients together (:class:`VectorisedHBFL`): this class's
        own client step, a meme that is a stack of ``BayesLinear`` layers (local reparameterisation, sampling, no
        generator of its own) and elementwise activations, and local architectures built of stateless layers. The
        meme's weight noise, drawn per client from the global torch generator after the client's own seed, is drawn
        from a generator holding that very state; in both modes (Adam, or DP-SGD then Adam) every step is the same
        computation on every client."""
        if type(self).client_update is not HBFL.client_update or self.meme is None:
            return False
        if self._vectorisable is None:
            with torch.random.fork_rng():  # building probe models must not move the global generator
                try:
                    if self.user_models is not None:
                        # the per-client step trains only parameters that require a gradient; the batched one all
                        probes = [factory() for factory in self.user_models]
                        locals_ok = all(vectorisable(m) and all(p.requires_grad for p in m.parameters())
                                        for m in probes)
                    else:
                        locals_ok = all(vectorisable(make_model(name, self._input_shape, self._num_classes,
                                                                **self._model_kwargs(name)))
                                        for name in self.local_models)
                except ModelConfigError:  # the per-client step then reports it
                    locals_ok = False
            self._vectorisable = locals_ok and bayes_linear_stack(self.meme) is not None
        return self._vectorisable

    def client_updates(self, clients, datasets, round, rngs):
        """``(k, client_update(k, ...))`` for every client of ``clients``, trained together when
        :attr:`vectorisable` (the same outputs to float tolerance; each client's batches, Poisson coins, weight
        noise and DP noise from its own generators, in the per-client order), else one after another."""
        if not self.vectorisable:
            for k, dataset, rng in zip(clients, datasets, rngs):
                yield k, self.client_update(k, dataset, round, rng)
            return
        yield from VectorisedHBFL(self).train(clients, datasets, rngs)

    def encode_posterior(self, mean: np.ndarray, precision: np.ndarray) -> dict[str, np.ndarray]:
        """The channel values of a meme posterior N(``mean``, diag(``precision``)^-1), ``precision`` the tempered
        Lambda_k: its natural parameters in untempered units (times T), as changes from the global ones."""
        untempered = np.asarray(precision, dtype=np.float64) * self.temperature
        return {"natural_mean": untempered * np.asarray(mean, dtype=np.float64) - self.global_natural_mean,
                "precision": untempered - self.global_precision}

    def planned_events(self, client: int) -> dict:
        """The per-round events of ``client``'s record-level releases (the run plan's): the natural mean carries the
        meme's DP-SGD training, the precision is its post-processing (charged nothing more); none otherwise."""
        if self.accountant is None:
            return {}
        plan = dpsgd_schedule(self, client)
        return {"natural_mean": plan.round_event(self.dpsgd_noise_multiplier(plan)), "precision": NoOpEvent()}

    def dpsgd_noise_multiplier(self, plan: DPSGDSchedule) -> float:
        """The smallest z whose ``fed.rounds`` rounds of ``plan`` meet the target (epsilon, delta) under the run's
        accountant (``dpsgd_fedavg.calibrate_dpsgd``, cached per schedule)."""
        if plan not in self._dpsgd_noise:
            self._dpsgd_noise[plan] = calibrate_dpsgd(self.privacy.epsilon, self.privacy.delta, self.fed.rounds,
                                                      plan, self.accountant)
        return self._dpsgd_noise[plan]

    # -- server --------------------------------------------------------------------------------------------------

    def server_update(self, aggregates: Mapping[str, Aggregate], round):
        """Gaussian product (Algorithm 1, line 5; ``gaussian_product``) of the clients' meme posteriors. The uploads
        are changes from the public global state x, so sum_k w_k x_k = sum_k w_k (x_k - x) + (sum_k w_k) x."""
        nat = _add_back(aggregates["natural_mean"], self.global_natural_mean)
        prec = _add_back(aggregates["precision"], self.global_precision)
        noisy = nat.noise_std > 0 or prec.noise_std > 0
        floor = self.init_precision * (self.precision_floor if noisy else _NOISELESS_FLOOR)
        post = gaussian_product(nat, prec, precision_floor=floor)
        self.global_mean, self.global_precision = post.mean, post.precision
        self.global_natural_mean = post.natural_mean

    # -- evaluation ----------------------------------------------------------------------------------------------

    def predict_proba(self, dataset):
        model = self.global_model()
        with deterministic(model):
            return predict_proba(model, dataset.tensors()[0])

    def evaluate(self, dataset):
        """The global model (meme at the global mean) under the plain names (``accuracy``, ``balanced_accuracy``,
        ``auroc``, ``nll``, ``ece``), ``accuracy_global`` repeating its accuracy. ``accuracy`` is always the global
        model's, never the better of it and the local models' (:meth:`local_metrics`)."""
        x, y = dataset.tensors()
        model = self.global_model()
        with deterministic(model):
            out = classification_metrics(predict_proba(model, x), y.numpy())
        out["accuracy_global"] = out["accuracy"]
        return out

    def local_metrics(self, dataset):
        """The clients' local models (never released; a simulation diagnostic, as in the paper), computed where they
        live: ``accuracy_local`` and ``balanced_accuracy_local``, their means over the clients that have one."""
        if not self.client_models:
            return {}
        x, y = dataset.tensors()
        labels = y.numpy()
        local = [classification_metrics(predict_proba(m, x), labels) for _, m in sorted(self.client_models.items())]
        return {"accuracy_local": float(np.mean([m["accuracy"] for m in local])),
                "balanced_accuracy_local": float(np.mean([m["balanced_accuracy"] for m in local]))}


def _add_back(changes: Aggregate, reference: np.ndarray) -> Aggregate:
    """The weighted sum of values from the weighted sum of their changes from ``reference``."""
    return dataclasses.replace(changes, total=changes.total + changes.total_weight * reference)


def dpsgd_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, clip: float, noise_multiplier: float,
                    expected_batch: float, generator: torch.Generator, secure: bool) -> None:
    """One DP-SGD gradient of the mean cross-entropy into ``p.grad``: per-example gradients (``torch.func``; the
    Bayesian layers draw their noise independently per example), privatised by
    ``privfl.privacy.record_level.privatise_gradient_sum`` (clipped, summed, noised, divided by the expected batch)."""
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach() for n, p in model.named_parameters()}
    dim = sum(p.numel() for p in params.values())
    flat = torch.zeros(0, dim)
    if len(x):
        def example_loss(p, xi, yi):
            return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

        per_example = vmap(grad(example_loss), in_dims=(None, 0, 0), randomness="different")(params, x, y)
        flat = torch.cat([per_example[n].reshape(len(x), -1) for n in names], dim=1)
    noisy = privatise_gradient_sum(flat, dim, clip=clip, noise_multiplier=noise_multiplier,
                                   expected_batch=expected_batch, generator=generator, secure=secure)
    offset = 0
    for n, p in model.named_parameters():
        k = p.numel()
        g = noisy[offset:offset + k].reshape(p.shape).to(p.dtype)
        p.grad = g if p.grad is None else p.grad + g
        offset += k


def bayes_linear_stack(model: nn.Module):
    """``(prefix, layers)`` when ``model`` is a stack of ``BayesLinear`` layers (local reparameterisation, sampling
    on, no generator of its own) and elementwise activations after a parameter-free reshaping prefix (privfl's
    Bayesian MLP), else None. ``layers``: ``("bayes", qualified name, has_bias)`` or ``("act", module, None)``."""
    if isinstance(model, MLP) and type(model).forward is MLP.forward:
        seq, base = model.net, "net."
    elif isinstance(model, nn.Sequential):
        seq, base = model, ""
    else:
        return None
    prefix, layers = [], []
    for name, module in seq.named_children():
        if type(module) is BayesLinear:
            if module.reparameterization != "local" or not module.sampling or module.generator is not None:
                return None
            layers.append(("bayes", base + name, "bias" in module.gaussian_names))
        elif not layers and isinstance(module, (nn.Flatten, nn.AvgPool2d, nn.Identity)):
            prefix.append(module)
        elif layers and isinstance(module, ELEMENTWISE):
            layers.append(("act", module, None))
        else:
            return None
    if not layers or layers[-1][0] != "bayes":
        return None
    return prefix, layers


class VectorisedHBFL:
    """HBFL's client step (:meth:`HBFL.client_update`) for a round's clients at once, with ``torch.func``.

    Clients with the same batch schedule (record count without DP; DP-SGD schedule with it, its Poisson batches
    padded with zero-weight rows) form a chunk. The meme is a Bayesian linear stack run functionally
    (:meth:`meme_forward`, ``BayesLinear``'s local reparameterisation written out) on stacked parameters, with
    each client's weight noise passed in: drawn from a generator holding the global torch state the per-client step
    would draw from (after the client's seed and its local model's first build), in the same shapes and order (one
    (batch, out) draw per layer per forward; under DP-SGD, vmap's ``randomness="different"`` draw of (batch, 1, out)).
    Adam (:func:`privfl.training.stacked.adam_step`), or plain SGD (:func:`privfl.training.stacked.sgd_step`), updates the memes;
    the local models, grouped by architecture, take masked SGD steps (``sgd_step``: a client whose Poisson batch is
    empty skips its step, as the per-client loop does) and are written back to their clients. DP-SGD's clipping,
    noise (from each client's own noise source) and scaling are those of :func:`dpsgd_gradients`.
    """

    def __init__(self, alg: "HBFL"):
        self.alg = alg
        self.prefix, self.layers = bayes_linear_stack(alg.meme)
        self.meme = alg._fork_meme()
        self.names = [n for n, _ in self.meme.named_parameters()]
        self.start = {n: p.detach().clone() for n, p in self.meme.named_parameters()}
        self.dim = sum(p.numel() for p in self.start.values())
        self.dp = alg.accountant is not None
        self._meme_grad = vmap(grad(self._meme_loss, has_aux=True), in_dims=(0, 0, 0, 0, None))
        self._example_grads = vmap(vmap(grad(self._example_loss), in_dims=(None, 0, 0, 0)))
        self._reg_grad = vmap(grad(self._regulariser), in_dims=(0, None))
        self._local_grads: dict[str | int, object] = {}

    # -- the meme, functionally ------------------------------------------------------------------------------------

    def meme_forward(self, params: dict, x: torch.Tensor, noises) -> torch.Tensor:
        """``BayesLinear.forward`` of every layer (``noises`` None: the means, as under ``deterministic``)."""
        h = x
        for module in self.prefix:
            h = module(h)
        j = 0
        for kind, item, bias in self.layers:
            if kind == "act":
                h = item(h)
                continue
            w_mu, b_mu = params[item + ".weight_mu"], params[item + ".bias_mu"] if bias else None
            if noises is None:
                h = F.linear(h, w_mu, b_mu)
                continue
            w_var = softplus(params[item + ".weight_rho"]) ** 2
            b_var = softplus(params[item + ".bias_rho"]) ** 2 if bias else None
            mean = F.linear(h, w_mu, b_mu)
            var = F.linear(h * h, w_var, b_var)
            h = mean + torch.sqrt(var.clamp_min(_VAR_FLOOR)) * noises[j]
            j += 1
        return h

    def _regulariser(self, params: dict, reg_size: int) -> torch.Tensor:
        """:func:`meme_regulariser` on functional parameters."""
        total = None
        for kind, item, bias in self.layers:
            if kind != "bayes":
                continue
            for g in ("weight", "bias") if bias else ("weight",):
                part = -torch.log(softplus(params[f"{item}.{g}_rho"])).sum()
                total = part if total is None else total + part
        return total * (self.alg.temperature / reg_size)

    def _meme_loss(self, params, x, y, noises, reg_size):
        loss = F.cross_entropy(self.meme_forward(params, x, noises), y) + self._regulariser(params, reg_size)
        return loss, loss.detach()

    def _example_loss(self, params, x, y, noises):
        return F.cross_entropy(self.meme_forward(params, x.unsqueeze(0), noises), y.unsqueeze(0))

    def _noise_shapes(self) -> list[int]:
        """The output size of every Bayesian layer, in forward order (the last dimension of its weight noise)."""
        return [self.start[item + ".weight_mu"].shape[0] for kind, item, _ in self.layers if kind == "bayes"]

    # -- the local models ------------------------------------------------------------------------------------------

    def _local_step_fn(self, arch: str | int, template: nn.Module):
        if arch not in self._local_grads:
            a, tau = self.alg.distill_weight, self.alg.distill_temperature

            def loss(params, x, y, teacher, weight, count):
                logits = functional_call(template, params, (x,))
                ce = (F.cross_entropy(logits, y, reduction="none") * weight).sum() / count
                log_student = F.log_softmax(logits / tau, dim=1)
                kl = (F.kl_div(log_student, teacher, reduction="none").sum(1) * weight).sum() / count * tau ** 2
                total = a * ce + (1.0 - a) * kl
                return total, total.detach()

            self._local_grads[arch] = vmap(grad(loss, has_aux=True))
        return self._local_grads[arch]

    # -- a round -------------------------------------------------------------------------------------------------

    def train(self, clients, datasets, rngs):
        alg = self.alg
        groups: dict[object, list[int]] = {}
        for i, k in enumerate(clients):
            key = dpsgd_schedule(alg, k) if self.dp else len(datasets[i])
            groups.setdefault(key, []).append(i)
        for key, members in groups.items():
            step = self._chunk(key)
            for lo in range(0, len(members), step):
                chunk = members[lo:lo + step]
                yield from self._train_chunk(key, [clients[i] for i in chunk], [datasets[i] for i in chunk],
                                             [rngs[i] for i in chunk])

    def _chunk(self, key) -> int:
        """Clients per chunk: the meme's parameters, gradients and Adam moments, and one batch's per-example
        gradients (DP-SGD, about 1.5 expected batches) or activations, within the budget."""
        if self.dp:
            batch = max(1.0, 1.5 * key.sample_rate * max(key.size, 1))
            per_client = 4 * self.dim * (batch + 4)
        else:
            batch = min(self.alg.fed.batch_size, max(key, 1))
            width = max(p.shape[0] + p.shape[-1] for p in self.start.values() if p.dim() == 2)
            per_client = 4 * (4 * self.dim + 4 * batch * width)
        return max(1, int(4 * DEFAULT_MEMORY_BUDGET // per_client))

    def _train_chunk(self, key, clients, datasets, rngs):
        alg, c = self.alg, len(clients)
        secure = alg.privacy.secure_noise
        generators, locals_, noise_sources, coins = [], [], [], []
        for k, rng in zip(clients, rngs):  # client_update's draws, in its order
            torch.manual_seed(int(rng.integers(0, 2 ** 31 - 1)))
            locals_.append(alg.local_model(k))  # built on first use, from the global generator, as client_update does
            g = torch.Generator()
            g.set_state(torch.get_rng_state())  # the state the client's meme noise is drawn from
            generators.append(g)
            if self.dp:
                noise_sources.append(private_torch_generator(rng, secure))  # as client_update creates them
                coins.append(private_torch_generator(rng, secure))
        data = [d.tensors() for d in datasets]
        params = {n: p.unsqueeze(0).repeat(c, *([1] * p.dim())) for n, p in self.start.items()}
        arch_of = [alg.local_architecture(k) for k in clients]
        local_groups: dict[str | int, list[int]] = {}
        for r, arch in enumerate(arch_of):
            local_groups.setdefault(arch, []).append(r)
        local_params = {arch: {n: torch.stack([dict(locals_[r].named_parameters())[n].detach() for r in rows])
                               for n, _ in locals_[rows[0]].named_parameters()}
                        for arch, rows in local_groups.items()}
        local_bufs: dict[str | int, dict | None] = {arch: None for arch in local_groups}
        adam = None
        meme_loss = [0.0] * c
        local_loss = [0.0] * c
        outs = self._noise_shapes()
        if self.dp:
            plan = key
            q, z = plan.sample_rate, alg.dpsgd_noise_multiplier(plan)
            steps = ([poisson_lot(q, len(x), coin).numpy() for coin, (x, _) in zip(coins, data)]
                     for _ in range(plan.steps))
            reg_size = plan.size
        else:
            n = key

            def shuffled():
                for _ in range(alg.fed.local_epochs):
                    perms = [rng.permutation(n) for rng in rngs]
                    for s in range(0, n, alg.fed.batch_size):
                        yield [perm[s:s + alg.fed.batch_size] for perm in perms]

            steps = shuffled()
            reg_size = n
        for idx in steps:
            width = max(len(i) for i in idx)
            counts = torch.tensor([len(i) for i in idx], dtype=torch.float32)
            x0, y0 = data[0]
            xb = torch.zeros(c, width, *x0.shape[1:], dtype=x0.dtype)
            yb = torch.zeros(c, width, dtype=y0.dtype)
            weight = torch.zeros(c, width)
            for r, ((x, y), i) in enumerate(zip(data, idx)):
                if len(i):
                    t = torch.as_tensor(i, dtype=torch.long)
                    xb[r, :len(i)], yb[r, :len(i)], weight[r, :len(i)] = x[t], y[t], 1.0
            if self.dp:
                grads = self._dpsgd_gradients(params, xb, yb, idx, generators, noise_sources, z, plan, outs)
                reg = self._reg_grad(params, reg_size)
                for name, g in reg.items():
                    grads[name] = grads[name] + g
            else:
                noises = self._batch_noises(generators, width, outs)
                grads, losses = self._meme_grad(params, xb, yb, noises, reg_size)
                meme_loss = losses.tolist()
            if alg.meme_optimizer == "adam":
                adam = adam_step(params, grads, adam, lr=alg.meme_lr)
            else:
                sgd_step(params, grads, None, lr=alg.meme_lr, momentum=0.0)
            if width == 0:
                continue
            with torch.no_grad():
                teacher = torch.softmax(vmap(self.meme_forward, in_dims=(0, 0, None))(params, xb, None)
                                        / alg.distill_temperature, dim=-1)
            active = counts > 0
            for arch, rows in local_groups.items():
                rows_t = torch.as_tensor(rows)
                step_fn = self._local_step_fn(arch, locals_[rows[0]])
                lp = local_params[arch]
                g, losses = step_fn(lp, xb[rows_t], yb[rows_t], teacher[rows_t], weight[rows_t],
                                    counts[rows_t].clamp_min(1.0))
                local_bufs[arch] = sgd_step(lp, g, local_bufs[arch], lr=alg.fed.lr, momentum=alg.fed.momentum,
                                            active=active[rows_t])
                for j, r in enumerate(rows):
                    if active[r]:
                        local_loss[r] = float(losses[j])
        with torch.no_grad():
            for arch, rows in local_groups.items():
                for j, r in enumerate(rows):
                    for name, p in locals_[r].named_parameters():
                        p.copy_(local_params[arch][name][j])
        for r, (k, dataset) in enumerate(zip(clients, datasets)):
            with torch.no_grad():
                for name, p in self.meme.named_parameters():
                    p.copy_(params[name][r])
            values: dict[str, object] = alg.encode_posterior(*get_mean_precision(self.meme))
            if self.dp:
                values = {"natural_mean": PrivatizedValue(values["natural_mean"], plan.round_event(z)),
                          "precision": PrivatizedValue(values["precision"], NoOpEvent())}
            metrics = {"local_loss": local_loss[r]}
            if not self.dp:
                metrics["meme_loss"] = meme_loss[r]
            yield k, ClientOutput(values, weight=alg.release_weight(dataset, k), metrics=metrics)

    @staticmethod
    def _batch_noises(generators, width: int, outs: list[int]) -> list[torch.Tensor]:
        """Each client's weight noise of one forward: a (batch, out) draw per layer, in layer order."""
        per_client = [[torch.randn((width, w), generator=g) for w in outs] for g in generators]
        return [torch.stack([draws[j] for draws in per_client]) for j in range(len(outs))]

    def _dpsgd_gradients(self, params, xb, yb, idx, generators, noise_sources, z, plan, outs):
        """:func:`dpsgd_gradients` for every client of the chunk: per-example gradients (each client's weight
        noise drawn as vmap's ``randomness="different"`` draws it), clipped, summed, noised, scaled."""
        alg = self.alg
        c, width = yb.shape
        clip = alg.privacy.clip
        flat = torch.zeros(c, 0, self.dim)
        if width:
            noises = [torch.zeros(c, width, 1, w) for w in outs]
            for r, (g, i) in enumerate(zip(generators, idx)):
                if len(i):  # per-client: one vmapped draw per layer, (batch, 1, out), only on a non-empty batch
                    draws = [torch.randn((len(i), 1, w), generator=g) for w in outs]
                    for e, d in zip(noises, draws):
                        e[r, :len(i)] = d
            per_example = self._example_grads(params, xb, yb, noises)
            flat = torch.cat([per_example[n].reshape(c, width, -1) for n in self.names], dim=2)
        secure = alg.privacy.secure_noise
        noisy = torch.stack([privatise_gradient_sum(flat[r, :len(i)], self.dim, clip=clip, noise_multiplier=z,
                                                    expected_batch=plan.expected_batch, generator=gen, secure=secure)
                             for r, (i, gen) in enumerate(zip(idx, noise_sources))])
        grads, offset = {}, 0
        for n in self.names:
            k = self.start[n].numel()
            grads[n] = noisy[:, offset:offset + k].reshape(c, *self.start[n].shape)
            offset += k
        return grads


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


__all__ = ["HBFL", "TEMPERATURE", "VectorisedHBFL", "bayes_linear_stack", "distillation_loss", "dpsgd_gradients",
           "meme_regulariser"]
