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
- Execution: the client step is written once (:meth:`HBFL._updates`) over the two executors of
  ``privfl.training.distill``; which records each step sees and the meme's task gradient come from the loop the
  unit picks (``privfl.privacy.units.at_unit``: shuffled mini-batches, or ``privfl.privacy.record_level.DPSGDLoop``'s
  Poisson lots and privatised gradients). A round's clients train together (:class:`VectorisedHBFL`,
  ``torch.func``) when the meme is a stack of
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
from torch import nn

from privfl.core.aggregation import Aggregate
from privfl.algorithms.base import ClientOutput, FederatedAlgorithm, load_model_state, model_state_values
from privfl.privacy.record_level import DPSGDLoop, DPSGDSchedule, dpsgd_gradients
from privfl.algorithms.gaussian_product import gaussian_product
from privfl.algorithms.user_models import check_user_model, user_model_factories
from privfl.core.channels import NormClip, TrainedPrivately
from privfl.core.public import secret_seed
from privfl.privacy.units import at_unit, channel as unit_channel
from privfl.errors import ConfigurationError
from privfl.metrics import classification_metrics
from privfl.training.distill import (MiniBatchLoop, VectorisedHBFL, bayes_linear_stack, distillation_loss,
                                    meme_regulariser, train_meme_and_local)
from privfl.training.stacked import vectorisable
from privfl.models import (MODELS, deterministic, get_mean_precision, make_bayesian_model, make_model,
                           set_mean_precision)
from privfl.models.errors import ModelConfigError
from privfl.core.public import release_weight
from privfl.training.local import predict_proba

#: the meme model's optimisers (``meme_optimizer``): the paper's Adam, or plain SGD
MEME_OPTIMIZERS = ("adam", "sgd")
TEMPERATURE = 1e-4  # the paper's T (Sec. 5.1.1, after Ashukha et al. 2020)
_NOISELESS_FLOOR = 1e-12  # without noise the product of positive precisions is positive: the floor only guards


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
        #: how the meme's training sees a client's records (privfl.privacy.units.at_unit picks): shuffled mini-batches,
        #: or DP-SGD's Poisson lots and privatised gradients at record level
        self.loop = at_unit(privacy, client=MiniBatchLoop, record=DPSGDLoop)(self)
        self.accountant = self.loop.accountant
        self.meme: nn.Module | None = None
        self.global_natural_mean: np.ndarray | None = None  # T Lambda mu
        self.global_precision: np.ndarray | None = None  # T Lambda
        self.global_mean: np.ndarray | None = None
        self.client_models: dict[int, nn.Module] = {}  # client-held local models (never released)
        self._input_shape: tuple[int, ...] = ()
        self._num_classes = 0
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

    def check_broadcast(self, round) -> None:
        """The broadcast global posterior checked before any record is read: every honest server's precision is
        > 0 (the Gaussian product of positive precisions, from init_precision); a precision <= 0 could make the meme's
        prior fail on some clients' records and not on others'."""
        precision = self.global_precision
        if precision is not None and np.asarray(precision).size and not float(np.min(precision)) > 0:
            raise ConfigurationError(f"the server broadcast an HBFL precision with entries <= 0 (smallest "
                                     f"{float(np.min(precision))!r}); every honest precision is > 0; refused before "
                                     "any record was read")

    def client_update(self, client, dataset, round, rng):
        [(_, out)] = self._updates([client], [dataset], [rng], vectorised=False)
        return out

    def _prepare(self, client: int, rng) -> tuple[nn.Module, torch.Generator]:
        """A client's draws before its training: its torch seed, then its local model (built on first use, from the
        global generator); returns the model and a generator holding the global state its meme's noise comes from."""
        torch.manual_seed(int(rng.integers(0, 2 ** 31 - 1)))
        local = self.local_model(client)
        if self.privacy.private and self.privacy.secure_noise:
            # the meme's weight noise goes to the lot's records by position: secret, or one record added or removed
            # would move every later record's term beyond the clip (privfl.core.public.secret_seed)
            torch.manual_seed(secret_seed(rng, True))
        g = torch.Generator()
        g.set_state(torch.get_rng_state())
        return local, g

    def _updates(self, clients, datasets, rngs, *, vectorised: bool):
        """The client step, written once over the two executors (``privfl.training.distill``): the clients that share
        a lot source (``self.loop.key``: record count, or DP-SGD schedule) train together (:class:`VectorisedHBFL`)
        or one after another (``train_meme_and_local``); each client's meme posterior is released as the changes of
        its natural parameters (:meth:`encode_posterior`), through the loop's release (post-processing of DP-SGD at
        record level)."""
        groups: dict[object, list[int]] = {}
        for i, k in enumerate(clients):
            groups.setdefault(self.loop.key(k, len(datasets[i])), []).append(i)
        hyper = dict(temperature=self.temperature, meme_lr=self.meme_lr, meme_optimizer=self.meme_optimizer,
                     lr=self.fed.lr, momentum=self.fed.momentum, distill_weight=self.distill_weight,
                     distill_temperature=self.distill_temperature)
        executor = VectorisedHBFL(self._fork_meme(), **hyper) if vectorised else None
        for key, members in groups.items():
            sizes = [len(datasets[i]) for i in members]
            step = executor._chunk(self.loop.per_example, self.loop.batch_width(key)) if vectorised else 1
            for lo in range(0, len(members), step):
                chunk = members[lo:lo + step]
                if vectorised:
                    prepared = [self._prepare(clients[i], rngs[i]) for i in chunk]
                    lots = self.loop.lots(key, [rngs[i] for i in chunk], sizes[lo:lo + step])
                    rows = executor.train([datasets[i].tensors() for i in chunk], lots, [m for m, _ in prepared],
                                          [self.local_architecture(clients[i]) for i in chunk],
                                          [g for _, g in prepared])
                else:
                    rows = [self._train_one(clients[chunk[0]], datasets[chunk[0]], rngs[chunk[0]], key, hyper)]
                for r, meme, meme_loss, local_loss in rows:
                    i = chunk[r]
                    yield clients[i], self._output(clients[i], datasets[i], meme, meme_loss, local_loss)

    def _train_one(self, client: int, dataset, rng, key, hyper):
        local, _ = self._prepare(client, rng)  # the global generator now holds the state the meme's noise is drawn from
        meme = self._fork_meme()
        x, y = dataset.tensors()
        meme_loss, local_loss = train_meme_and_local(meme, local, x, y, self.loop.lots(key, [rng], [len(x)]),
                                                     **hyper)
        return 0, meme, meme_loss, local_loss

    def _output(self, client: int, dataset, meme: nn.Module, meme_loss, local_loss: float) -> ClientOutput:
        values = self.loop.released(client, self.encode_posterior(*get_mean_precision(meme)), ("natural_mean",))
        metrics = {"local_loss": local_loss}
        if meme_loss is not None:
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
        yield from self._updates(clients, datasets, rngs, vectorised=True)

    def encode_posterior(self, mean: np.ndarray, precision: np.ndarray) -> dict[str, np.ndarray]:
        """The channel values of a meme posterior N(``mean``, diag(``precision``)^-1), ``precision`` the tempered
        Lambda_k: its natural parameters in untempered units (times T), as changes from the global ones."""
        untempered = np.asarray(precision, dtype=np.float64) * self.temperature
        return {"natural_mean": untempered * np.asarray(mean, dtype=np.float64) - self.global_natural_mean,
                "precision": untempered - self.global_precision}

    def planned_events(self, client: int) -> dict:
        """The per-round events of ``client``'s record-level releases (the run plan's): the natural mean carries the
        meme's DP-SGD training, the precision is its post-processing (charged nothing more); none otherwise."""
        return self.loop.events(client, ("natural_mean", "precision"), ("natural_mean",))

    def dpsgd_noise_multiplier(self, plan: DPSGDSchedule) -> float:
        """The smallest z whose ``fed.rounds`` rounds of ``plan`` meet the target (epsilon, delta) under the run's
        accountant (``privfl.privacy.record_level.DPSGDLoop``, cached per schedule; record level only)."""
        return self.loop.noise_multiplier(plan)

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


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


__all__ = ["HBFL", "TEMPERATURE", "VectorisedHBFL", "bayes_linear_stack", "distillation_loss", "dpsgd_gradients",
           "meme_regulariser"]
