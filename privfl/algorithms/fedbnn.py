"""FedBNN: personalised Bayesian nets with functional priors (Makhija, Ghosh and Ho; PAPERS.md, FedBNN).

Every client keeps its own mean-field Gaussian Bayesian net, of its own architecture (a share ``small_fraction`` of
the clients run a small net, the paper's heterogeneous setting), trained by Bayes-by-Backprop. The clients never
share weights; they collaborate through a public unlabelled *alignment set* AD, disjoint from every client's data:

1. Warm-up: the first time a client takes part it trains ``warmup_epochs`` epochs under an isotropic prior
   N(0, ``init_prior_std``^2), with no collaboration (Algorithm 1, "t < lsteps").
2. Upload: the Monte-Carlo average over ``mc_samples`` weight draws of its class probabilities on AD,
   Phi_k(AD) = 1/K sum_j softmax(f(AD; W_j)), W_j ~ q_k, as the channel ``alignment_probs`` of shape (|AD|, C).
3. Server: the weighted average Phi_bar(AD) = sum_k w_k Phi_k(AD) / sum_k w_k of the releases, then clipped to
   [0, 1] and renormalised row by row (post-processing of the noisy average; a row clipped to all zeros becomes
   uniform). Weights ``weighting="uniform"`` (w_k = 1, the default and the only choice under DP: example counts would
   make the weights data-dependent) or ``"size"`` (w_k = n_k, non-private runs only).
   Under DP the server also computes the broadcast's *reliability* lambda = max(0, 1 - s^2 / v), s the noise std
   the average is known to carry per coordinate and v the mean squared deviation of its coordinates from 1/C (the
   empirical-Bayes share of its spread that is signal), and broadcasts it with Phi_bar: post-processing.
4. Prior tuning (eqs. 3-4): the client forms the target Phi_corrected = gamma Phi_bar(AD) + (1 - gamma) Phi_k(AD)
   (its own, noise-free, current output: it never leaves the client; with ``noise_aware``, the default, gamma is
   replaced by gamma * lambda, which is gamma itself without noise: a deviation from the paper, whose fixed gamma
   pulls every prior towards the uniform row when the noise swamps the release) and fits the prior parameters psi,
   a Gaussian per weight started from its current posterior q_k, by ``prior_steps`` full-batch Adam steps (``prior_lr``) on the
   soft cross-entropy -sum_c Phi_corrected log softmax(f(AD; W)), W ~ p(.; psi) (one draw per step).
5. Local training (eq. 5): ``fed.local_epochs`` epochs of Bayes-by-Backprop from the current q_k on
   E_q[mean NLL] + KL(q_k || p(.; psi*)) / n_k (the ELBO per example), Adam (``bbb_lr``), batches of
   ``fed.batch_size`` (the paper: 128); psi* fixed. Then the client uploads again (step 2).

Paper settings (Sec. 5.1): 50 warm-up epochs, 20 local epochs, |AD| = 2000, prior tuning Adam 1e-4 for 100 steps,
BBB Adam 1e-3 with batches of 128, gamma = 0.7, 30% small nets; they are this class's defaults except the local
epochs, which come from ``fed.local_epochs`` (the CLI's ``defaults`` keep a ``privfl run`` to minutes on 2 cores).

Privacy (Sec. 4, made exact). Whatever the local training does, each row of the upload is a probability vector: any
two are at most sqrt(2) apart in L2, and none has norm above 1 (|p|_2 <= |p|_1 = 1). So the channel's
``RangeBound(sqrt(2), |AD|, unit, row_norm=1)`` has sensitivity

- sqrt(2 |AD|) at record level (``unit="example"``), either adjacency: one record can move every row of its client's
  upload anywhere in the simplex, and the upload is still sent;
- sqrt(2 |AD|) at client level under replace-one: one client's upload replaced by any other;
- sqrt(|AD|) at client level under add/remove: the client's whole upload leaves the sum, and it has norm at most
  sqrt(|AD|) (attained by one-hot rows). That is a guarantee about the sum, so with local noise and no secure
  aggregation (the server then sees every upload on its own and knows which clients took part) the runtime charges
  the channel as replace-one, sqrt(2 |AD|), whatever the configured relation (``privfl.core.channels.charged_channels``,
  the same rule for every algorithm).

(The paper bounds the squared sensitivity by 2 for the whole upload, which holds per AD point only, and converts
zCDP to (epsilon, delta) loosely; privfl charges one Gaussian event per round and composes them with the run's
accountant: ``accountant="exact"`` composes unsampled Gaussians exactly.) The pipeline checks the rows are
probability vectors before anything is charged. The noisy sum is then public; the clients' prior tuning and training
use only it and their own data, so later rounds are post-processing plus fresh releases (adaptive composition over
rounds).

Noise placement: FedBNN's threat model is an honest-but-curious server, so each client's upload must be private by
itself: *local* placement (the client adds N(0, (z Delta)^2) per coordinate, Delta the sensitivity above), this
algorithm's ``defaults`` (``privfl compare`` uses them; ``privfl run`` takes ``--placement local``). ``central``
placement (a trusted aggregator adds the noise once to the sum) is accepted and gives the same epsilon against
everyone who sees only the broadcast average, with sqrt(N) less noise on it. ``distributed`` placement is refused:
its discrete-Gaussian plan is for vector channels with a norm clip. Under secure aggregation the channel's public
coordinate bound is 1 (``value_bound``). The honest sensitivity grows with sqrt(|AD|), so the noise per
coordinate is large unless AD is small; the server's clip-and-renormalise then pulls Phi_bar towards uniform, and
gamma weighs that in.

Alignment set: ``data.alignment`` (``make_federated(..., alignment_size=N)``), or a seeded random subset of it of
``alignment_size`` points when it is larger; ``privfl run --algorithm fedbnn`` builds it from ``--alignment-size``
training examples (default 300) held out before the clients' partition. Without one (``privfl compare`` builds one
data set for all its methods, without an alignment set), FedBNN carves min(``alignment_size``, |test| / 2) points
from the global test set, disjoint from every client's data, and evaluates on the rest of that test set only
(``evaluate`` recognises the test set it was given in setup).

Evaluation (``local_metrics``, computed where the clients' models and label sets live): each client's personalised
model predicts by the Bayesian model average over ``mc_samples`` draws. ``accuracy`` is the mean over clients of the accuracy on the client's own test split, the test
examples of the classes the client holds (the personalised-FL convention the paper's non-IID numbers use; with IID
clients the split is the whole test set); ``nll``, ``ece``, ``mce`` and ``brier`` pool those per-client predictions.
``accuracy_all_classes`` is the mean over clients on the whole test set; ``accuracy_small_nets`` and
``accuracy_large_nets`` split ``accuracy`` by architecture group. The server's ``evaluate`` reports only
``effective_gamma``, the gamma the next prior tuning uses. ``predict_proba`` returns None: there is no global model;
``client_predictions`` and ``calibration_predictions`` read the personalised models, so they are asked of an object
holding the clients' states (``Simulation.diagnostic_algorithm()``). The labels of AD are never read.

What leaves a client: only the channel (and its public weight, 1 under DP). The server half is set up from public
facts (``PublicFacts``: client count, shapes, classes, the alignment set); the per-client architecture choice is the
server's, from the run's seed. The personalised evaluation runs on state the clients hold (their posteriors, their own
label sets, recorded by their own steps): a simulation's diagnostic, which a deployment would compute on each client
and must not send out uncharged.

Halves: a client step reads the broadcast (``global_probs``, ``reliability``) and its own state (``client_state``:
its posterior, whether it has warmed up, its label set; ``encode_client_state`` carries them as arrays); everything
else it reads (architectures, initial seeds, the alignment set) is set up from public facts on both halves alike.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from privfl.core.aggregation import Aggregate
from privfl.algorithms.base import ClientOutput, FederatedAlgorithm, load_model_state, model_state_values
from privfl.algorithms.user_models import check_user_model, user_model_factories
from privfl.core.channels import RangeBound
from privfl.privacy.units import channel as unit_channel
from privfl.errors import ConfigurationError
from privfl.metrics import brier_score, classification_metrics, maximum_calibration_error
from privfl.models import (MODELS, BayesConv2d, BayesLinear, ModelPrior, bayes_modules, make_bayesian_model,
                           model_kl_divergence, set_generator)
from privfl.training.local import batches, torch_generator

CHANNEL = "alignment_probs"
#: any two probability vectors are at most sqrt(2) apart in L2
PER_POINT_SENSITIVITY = math.sqrt(2.0)
#: and none has L2 norm above 1 (|p|_2 <= |p|_1 = 1; a one-hot row attains it)
MAX_ROW_NORM = 1.0
WEIGHTINGS = ("uniform", "size")


@dataclass(frozen=True)
class Architecture:
    """One client's network: a name of ``privfl.models.MODELS``, its hidden widths (None: the model's default) and,
    for the MLP, the average-pooling factor of image inputs."""

    model: str = "mlp"
    hidden: tuple[int, ...] | None = None
    pool: int = 1

    def __post_init__(self):
        if not isinstance(self.model, str) or self.model.lower() not in MODELS:
            raise ConfigurationError(f"architecture model must be one of {sorted(MODELS)}, got {self.model!r}")
        object.__setattr__(self, "model", self.model.lower())
        if self.hidden is not None:
            hidden = tuple(self.hidden)
            if not all(isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in hidden):
                raise ConfigurationError(f"architecture hidden widths must be integers >= 1, got {self.hidden!r}")
            object.__setattr__(self, "hidden", hidden)
        if isinstance(self.pool, bool) or not isinstance(self.pool, int) or self.pool < 1:
            raise ConfigurationError(f"architecture pool must be an integer >= 1, got {self.pool!r}")
        if self.pool > 1 and self.model != "mlp":
            raise ConfigurationError("pool applies to the MLP only")

    def build(self, input_shape: Sequence[int], num_classes: int, init_rho: float) -> nn.Module:
        kw: dict = {"init_rho": init_rho}
        if self.hidden is not None:
            kw["hidden"] = self.hidden
        if self.pool > 1:
            kw["pool"] = self.pool
        return make_bayesian_model(self.model, tuple(input_shape), num_classes, **kw)


@dataclass(frozen=True)
class UserArchitecture:
    """A client network from the user's ``model`` argument: ``factory`` (zero-argument, returning an ``nn.Module``),
    the ``index`` of its entry in that argument; built as its Bayesian twin (:func:`bayesian_twin`)."""

    factory: Callable[[], nn.Module]
    index: int = 0

    def build(self, input_shape: Sequence[int], num_classes: int, init_rho: float) -> nn.Module:
        net = check_user_model(self.factory(), input_shape, num_classes, "fedbnn")
        return bayesian_twin(net, init_rho, "fedbnn")


def bayesian_twin(net: nn.Module, init_rho: float, algorithm: str = "fedbnn") -> nn.Module:
    """``net`` with every ``nn.Linear`` / ``nn.Conv2d`` (groups=1, zero padding) replaced, in place, by a
    ``BayesLinear`` / ``BayesConv2d`` whose means are its weights and whose stds are softplus(``init_rho``); privfl's
    Bayesian layers are kept. Parameters elsewhere (e.g. normalisation layers) or frozen ones are refused: FedBNN's
    posterior, its prior and the KL of eq. 5 are over every weight."""
    frozen = [name for name, p in net.named_parameters() if not p.requires_grad]
    if frozen:
        raise ConfigurationError(f"{algorithm}: parameters {frozen[:8]} are frozen (requires_grad=False); the "
                                 "Bayesian posterior covers every weight: unfreeze them or build the net without them")
    bayes = {id(p) for _, m in bayes_modules(net) for p in m.parameters()}

    def convertible(m: nn.Module) -> bool:
        if isinstance(m, nn.Conv2d):
            return type(m) is nn.Conv2d and m.groups == 1 and m.padding_mode == "zeros"
        return type(m) is nn.Linear

    other = [f"{name or '<model>'} ({type(m).__name__})" for name, m in net.named_modules()
             if not convertible(m) and any(id(p) not in bayes for p in m.parameters(recurse=False))]
    if other:
        raise ConfigurationError(f"{algorithm}: the net is made Bayesian layer by layer, and only nn.Linear and "
                                 f"nn.Conv2d (groups=1, zero padding) have a Bayesian twin; parameters live in "
                                 f"{', '.join(other[:8])}. Build it from those layers (parameter-free activations, "
                                 "pooling and reshapes are fine) or from privfl.models' BayesLinear / BayesConv2d")
    twins: dict[int, nn.Module] = {}

    def twin(m: nn.Module) -> nn.Module:
        if id(m) not in twins:
            has_bias = m.bias is not None
            if isinstance(m, nn.Linear):
                new = BayesLinear(m.in_features, m.out_features, bias=has_bias, init_rho=init_rho)
            else:
                new = BayesConv2d(m.in_channels, m.out_channels, m.kernel_size, stride=m.stride, padding=m.padding,
                                  dilation=m.dilation, bias=has_bias, init_rho=init_rho)
            with torch.no_grad():
                new.weight_mu.copy_(m.weight)
                if has_bias:
                    new.bias_mu.copy_(m.bias)
            twins[id(m)] = new.train(m.training)
        return twins[id(m)]

    if convertible(net):
        return twin(net)
    for parent in list(net.modules()):
        for child_name, child in list(parent.named_children()):
            if convertible(child):
                setattr(parent, child_name, twin(child))
    return net


def clip_and_renormalise(probs: np.ndarray) -> np.ndarray:
    """Rows of a noisy probability matrix clipped to [0, 1] and renormalised to sum 1 (a row clipped to all zeros
    becomes uniform): FedBNN's server-side post-processing."""
    p = np.clip(np.asarray(probs, dtype=np.float64), 0.0, 1.0)
    sums = p.sum(axis=1, keepdims=True)
    uniform = np.full_like(p, 1.0 / p.shape[1])
    return np.where(sums > 0, p / np.where(sums > 0, sums, 1.0), uniform)


def release_reliability(average: np.ndarray, noise_std: float) -> float:
    """lambda = max(0, 1 - s^2 / v): the share of the released average's spread around the uniform row that is not
    release noise, where s is the (public) noise std per coordinate of the average and v the mean squared deviation
    of its coordinates from 1/C. v estimates signal variance + s^2, so lambda is the usual empirical-Bayes shrinkage
    weight; it is 1 exactly when there is no noise and near 0 when the noise swamps the probabilities. A function of
    the release and public constants only: post-processing."""
    if noise_std <= 0:
        return 1.0
    a = np.asarray(average, dtype=np.float64)
    spread = float(np.mean((a - 1.0 / a.shape[1]) ** 2))
    return 0.0 if spread <= 0 else float(max(0.0, 1.0 - noise_std ** 2 / spread))


def label_shifted(probs: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Rows of ``probs`` re-weighted by the client's own class frequencies (add-one smoothed) and renormalised: the
    prior correction for label shift (Saerens, Latinne and Decaestecker 2002), p_k(y | x) proportional to
    p(y | x) pi_k(y) / pi(y), with the population's pi taken as uniform. Computed on the client from its labels."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_classes).astype(np.float64) + 1.0
    p = np.asarray(probs, dtype=np.float64) * (counts / counts.sum())[None, :]
    return p / p.sum(axis=1, keepdims=True)


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum_c target_c log softmax(logits)_c: the distance d of eq. 4 for probability targets."""
    return -(target * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


@torch.no_grad()
def mc_predict(model: nn.Module, x: torch.Tensor, samples: int, generator: torch.Generator,
               batch_size: int = 1024) -> np.ndarray:
    """Bayesian model average 1/K sum_j softmax(f(x; W_j)), W_j ~ q, as float64 rows that sum to 1."""
    set_generator(model, generator)
    try:
        model.eval()
        out = []
        for i in range(0, len(x), batch_size):
            xb = x[i:i + batch_size]
            out.append(sum(torch.softmax(model(xb), dim=1).double() for _ in range(samples)) / samples)
        probs = torch.cat(out).numpy()
    finally:
        set_generator(model, None)
    return probs / probs.sum(axis=1, keepdims=True)


class FedBNN(FederatedAlgorithm):
    """FedBNN over the channel ``alignment_probs``: Monte-Carlo class probabilities on the public alignment set.

    Args (besides the federation and privacy configurations; paper defaults):
        architectures: the clients' architectures (``Architecture`` or a model name), cycled over clients; when given,
            ``small_fraction`` must be 0. Default: ``fed.model`` with ``fed.hidden`` and ``fed.pool`` for the large
            nets, and ``small_architecture`` for a random share ``small_fraction`` of the clients.
        small_architecture: the small net (default: an MLP with one hidden layer of 32, ``fed.pool``).
        small_fraction: share of clients (rounded, chosen at random in setup) running the small net; paper 0.3.
        alignment_size: |AD| (2000).
        warmup_epochs: local epochs of a client's first participation, before collaboration (50).
        gamma: weight of the global output in the prior-tuning target, eq. 3 (0.7).
        prior_steps, prior_lr: Adam steps and step size of prior tuning, eq. 4 (100, 1e-4).
        bbb_lr: Adam step size of Bayes-by-Backprop, eq. 5 (1e-3). ``fed.lr`` is not used.
        mc_samples: weight draws of the Monte-Carlo outputs (upload and evaluation).
        init_prior_std: std of the isotropic prior of the warm-up.
        init_rho: initial rho of every posterior std (-3: std 0.049, a usual Bayes-by-Backprop start). The tuned
            prior starts from the posterior, so its precision is about 1 / std^2: BayesLinear's own -5 (std 0.0067)
            makes the KL of eq. 5 so stiff that local training barely moves a client off its tuned prior.
        weighting: ``"uniform"`` or ``"size"`` (non-private only) server weights w_k.
        label_shift: before eq. 3 the client re-weights Phi_bar by its own class frequencies (``label_shifted``):
            the average speaks for the population's label mix, a personalised model for the client's. Off by default
            (the paper has no such step); it uses only the client's own labels, so it costs no privacy.
        noise_aware: scale gamma by the broadcast's reliability (``release_reliability``), so that a release the
            noise swamps does not pull the clients' priors towards noise; no effect without noise. False: the paper's
            fixed gamma.
        model: the user's own networks instead of ``architectures``: an ``nn.Module`` (copied, so yours is never
            trained) or zero-argument factory used by every client, or a list of them cycled over the clients (the
            paper's heterogeneous setting). Each is made Bayesian (:func:`bayesian_twin`): every ``nn.Linear`` and
            ``nn.Conv2d`` (groups=1, zero padding) becomes a mean-field Gaussian layer whose means start at its
            weights, with std softplus(``init_rho``); privfl's ``BayesLinear``/``BayesConv2d`` are kept as they are.
            Parameters in any other layer, or frozen ones, are refused (the posterior covers every weight). A client
            rebuilds its net from this argument (seeded per client) and loads its posterior from its state.
    """

    name = "fedbnn"
    supports_privacy = True
    # For ``privfl run``/``privfl compare``: small local training, and local noise (see the module docstring).
    defaults = {"hidden": (100,), "local_epochs": 2, "clip": 1.0, "placement": "local", "alignment_size": 300}
    #: ``privfl run --alignment-size N`` builds the data with an alignment set of N training examples for it
    uses_alignment = True
    #: the post-processed average a client's prior tuning targets, and its reliability
    broadcast_state = ("global_probs", "reliability")
    #: each client's posterior q_k, whether it has warmed up, and its own label set (for its personalised evaluation)
    client_state = ("models", "warmed_up", "client_classes")

    def __init__(self, fed, privacy, *, architectures: Sequence[Architecture | str] | None = None,
                 small_architecture: Architecture | str | None = None, small_fraction: float | None = None,
                 alignment_size: int = 2000, warmup_epochs: int = 50, gamma: float = 0.7, prior_steps: int = 100,
                 prior_lr: float = 1e-4, bbb_lr: float = 1e-3, mc_samples: int = 10, init_prior_std: float = 1.0,
                 init_rho: float = -3.0, weighting: str = "uniform", noise_aware: bool = True,
                 label_shift: bool = False, model=None):
        super().__init__(fed, privacy)
        user = user_model_factories(model, self.name, many=True)
        if user is not None:
            if architectures is not None or small_architecture is not None or small_fraction not in (None, 0, 0.0):
                raise ConfigurationError("fedbnn: give either model (your own networks, cycled over the clients) or "
                                         "architectures / small_fraction / small_architecture, not both")
            architectures = tuple(UserArchitecture(factory, i) for i, factory in enumerate(user))
        if architectures is not None:
            archs = (architectures,) if isinstance(architectures, (str, Architecture)) else tuple(architectures)
            if not archs:
                raise ConfigurationError("architectures must name at least one architecture")
            self.architectures = tuple(_as_architecture(a) for a in archs)
            if small_fraction not in (None, 0, 0.0) or small_architecture is not None:
                raise ConfigurationError("give either architectures (cycled over clients) or small_fraction and "
                                         "small_architecture, not both")
            self.small_fraction = 0.0
        else:
            self.architectures = (Architecture(fed.model, fed.hidden, fed.pool if fed.model == "mlp" else 1),)
            self.small_fraction = 0.3 if small_fraction is None else _fraction("small_fraction", small_fraction)
        self.small_architecture = (_as_architecture(small_architecture) if small_architecture is not None
                                   else Architecture("mlp", (32,), fed.pool))
        self.alignment_size = _positive_int("alignment_size", alignment_size)
        self.warmup_epochs = _positive_int("warmup_epochs", warmup_epochs, allow_zero=True)
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 <= gamma <= 1.0:
            raise ConfigurationError(f"gamma (eq. 3) must be in [0, 1], got {gamma!r}")
        self.gamma = float(gamma)
        self.prior_steps = _positive_int("prior_steps", prior_steps, allow_zero=True)
        self.prior_lr = _positive("prior_lr", prior_lr)
        self.bbb_lr = _positive("bbb_lr", bbb_lr)
        self.mc_samples = _positive_int("mc_samples", mc_samples)
        self.init_prior_std = _positive("init_prior_std", init_prior_std)
        if isinstance(init_rho, bool) or not isinstance(init_rho, (int, float)) or not math.isfinite(init_rho):
            raise ConfigurationError(f"init_rho must be a finite number, got {init_rho!r}")
        self.init_rho = float(init_rho)
        if weighting not in WEIGHTINGS:
            raise ConfigurationError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        if weighting == "size" and privacy.private:
            raise ConfigurationError("weighting='size' makes the server weights depend on the data (n_k changes with "
                                     "one record); private runs use weighting='uniform'")
        self.weighting = weighting
        if not isinstance(noise_aware, bool):
            raise ConfigurationError(f"noise_aware must be True or False, got {noise_aware!r}")
        self.noise_aware = noise_aware
        if not isinstance(label_shift, bool):
            raise ConfigurationError(f"label_shift must be True or False, got {label_shift!r}")
        self.label_shift = label_shift
        if privacy.private and privacy.placement == "distributed":
            raise ConfigurationError("fedbnn's probability channel is a matrix bounded by its range; distributed "
                                     "noise plans vector channels with a norm clip. Use placement='local' "
                                     "(CLI: --placement local), with --secure-agg if wanted")
        self.client_architectures: list[Architecture] = []
        self.small_clients: frozenset[int] = frozenset()
        self.models: dict[int, nn.Module] = {}  # client-held posteriors q_k (never released)
        self.warmed_up: set[int] = set()
        self.global_probs: np.ndarray | None = None  # Phi_bar(AD), post-processed
        self.reliability = 1.0  # lambda in [0, 1]: the share of Phi_bar's spread that is signal, not release noise
        self.alignment_x: torch.Tensor | None = None
        #: each client's own label set, recorded by the client's own step for its personalised evaluation (client
        #: state, never released or used by the server step)
        self.client_classes: dict[int, np.ndarray] = {}
        self._input_shape: tuple[int, ...] = ()
        self._num_classes = 0
        self._init_seeds: list[int] = []
        self._eval_seed = 0
        self._test_given: object = None
        self._test_rest = None

    # -- setup ---------------------------------------------------------------------------------------------------

    def setup(self, data, rng):
        """The server half from public facts only (``privfl.core.public.PublicFacts``): the number of clients, the task,
        the input shape and classes, the public alignment set (or the public test set to carve one from). No
        client's records, labels or label set are read here."""
        public = self.bind_public(data)
        if public.task != "classification":
            raise ConfigurationError("fedbnn aligns class probabilities; it needs a classification data set")
        self._input_shape, self._num_classes = tuple(public.input_shape), int(public.num_classes)
        n = public.n_clients
        if self.small_fraction > 0:
            self.small_clients = frozenset(
                rng.choice(n, size=int(round(self.small_fraction * n)), replace=False).tolist())
            self.client_architectures = [self.small_architecture if k in self.small_clients
                                         else self.architectures[0] for k in range(n)]
        else:
            self.small_clients = frozenset()
            self.client_architectures = [self.architectures[k % len(self.architectures)] for k in range(n)]
        for arch in self.architectures:  # a user's net is checked once here, before any client trains it
            if isinstance(arch, UserArchitecture):
                with torch.random.fork_rng(devices=[]):
                    arch.build(self._input_shape, self._num_classes, self.init_rho)
        self._test_given, self._test_rest = None, None
        if public.alignment is not None and len(public.alignment):
            ad = public.alignment
            if len(ad) > self.alignment_size:
                ad = ad.subset(np.sort(rng.choice(len(ad), self.alignment_size, replace=False)))
        else:
            if getattr(data, "test_from_clients", False):  # the clients' own held-out records: never public
                raise ConfigurationError("fedbnn needs a public alignment set held by no client; this data's test "
                                         "set is the clients' own held-out records: pass a test set no client holds "
                                         "(test=, --test-data) or build the data with an alignment set")
            test = public.test
            size = min(self.alignment_size, len(test) // 2) if test is not None else 0
            if size < 1:
                raise ConfigurationError("fedbnn needs a public alignment set: build the data with "
                                         "make_federated(..., alignment_size=N)")
            order = rng.permutation(len(test))
            ad = test.subset(np.sort(order[:size]))
            self._test_given, self._test_rest = test, test.subset(np.sort(order[size:]))
        if tuple(ad.input_shape) != self._input_shape:
            raise ConfigurationError(f"the alignment set's inputs have shape {ad.input_shape}, the clients' "
                                     f"{self._input_shape}")
        self.alignment_x = torch.from_numpy(ad.x.copy())  # its labels are never read
        self.client_classes = {}
        self._init_seeds = [int(s) for s in rng.integers(0, 2 ** 63 - 1, size=n)]
        self._eval_seed = int(rng.integers(0, 2 ** 63 - 1))
        self.models, self.warmed_up, self.global_probs, self.reliability = {}, set(), None, 1.0

    @property
    def alignment_rows(self) -> int:
        return int(self.alignment_x.shape[0])

    def channels(self):
        # the rows are probability vectors whatever the unit: the range bounds a record's influence and a client's
        # whole upload alike. At client level with local noise and no secure aggregation the runtime charges the
        # channel as replace-one (``privfl.core.channels.charged_channels``, see the module docstring)
        rows = RangeBound(PER_POINT_SENSITIVITY, self.alignment_rows, row_norm=MAX_ROW_NORM)
        return [unit_channel(self.privacy, CHANNEL, (self.alignment_rows, self._num_classes), client=rows,
                             record=rows, value_bound=1.0,
                             description="Monte-Carlo class probabilities of the client's BNN on the alignment set")]

    # -- client --------------------------------------------------------------------------------------------------

    def local_model(self, client: int) -> nn.Module:
        """Client ``client``'s posterior q_k, built (seeded from setup) on first use and kept by the client."""
        if client not in self.models:
            self.models[client] = self._build_model(client)
        return self.models[client]

    def _build_model(self, client: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self._init_seeds[client])
            return self.client_architectures[client].build(self._input_shape, self._num_classes, self.init_rho)

    def encode_client_state(self, client, state):
        """The posterior as its state_dict's arrays; the warm-up flag and the label set as they are."""
        return {name: model_state_values(value) if name == "models" else value for name, value in state.items()}

    def decode_client_state(self, client, values):
        """The posterior rebuilt in the client's (public) architecture and loaded."""
        state = dict(values)
        if "models" in state:
            state["models"] = load_model_state(self._build_model(client), state["models"])
        return state

    def release_weight(self, dataset, client: int = 0) -> float:
        """1, or n_k with ``weighting="size"``, which only non-private runs accept (n_k is private)."""
        return float(len(dataset)) if self.weighting == "size" else 1.0

    def private_release_weight(self, client: int) -> float:
        return 1.0

    def check_broadcast(self, round) -> None:
        """The broadcast consensus and its reliability checked before any record is read: every honest server's
        ``global_probs`` are rows in [0, 1] summing to 1 over the alignment set's points (clip_and_renormalise) and
        its reliability lies in [0, 1]; anything else could make the distillation fail (a zero row under label shift)
        on some clients' labels and not on others'."""
        probs = self.global_probs
        if probs is not None:
            p = np.asarray(probs, dtype=np.float64)
            if (p.ndim != 2 or self.alignment_x is not None and p.shape[0] != len(self.alignment_x)
                    or np.any(p < 0) or np.any(p > 1) or np.any(np.abs(p.sum(axis=1) - 1) > 1e-6)):
                raise ConfigurationError("the server broadcast FedBNN consensus probabilities that are not rows in "
                                         "[0, 1] summing to 1, one per alignment point; refused before any record "
                                         "was read")
        if not 0.0 <= float(self.reliability) <= 1.0:
            raise ConfigurationError(f"the server broadcast a FedBNN reliability of {float(self.reliability)!r}, "
                                     "outside [0, 1]; refused before any record was read")

    def _finite_posterior(self, client: int) -> None:
        """Reset client ``client``'s posterior to its public initial state (the model built from setup's seed, not
        warmed up) when an entry of it is not finite: one far-out record could make its Bayes-by-Backprop steps
        overflow, and a NaN posterior made every later round's prior fit fail on that client. The reset decides on the
        client's own state and releases nothing: its round's upload goes through the pipeline as usual (a non-finite
        one falls back, ``privfl.core.release``)."""
        model = self.models.get(client)
        if model is None:
            return
        if all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point()):
            return
        self.models[client] = self._build_model(client)
        self.warmed_up.discard(client)

    def client_update(self, client, dataset, round, rng):
        self._finite_posterior(client)  # a posterior a past round left non-finite starts again from its public init
        model = self.local_model(client)
        x, y = dataset.tensors()
        self.client_classes[client] = np.unique(y.numpy())
        gen = torch_generator(rng)
        metrics: dict[str, float] = {}
        if client not in self.warmed_up:
            prior, epochs = ModelPrior.isotropic(self.init_prior_std), self.warmup_epochs
            self.warmed_up.add(client)
        elif self.global_probs is not None:
            local = mc_predict(model, self.alignment_x, self.mc_samples, gen)
            gamma = self.effective_gamma
            glob = label_shifted(self.global_probs, y.numpy(), self._num_classes) if self.label_shift \
                else self.global_probs
            target = gamma * glob + (1.0 - gamma) * local
            prior, metrics["prior_loss"] = self.tune_prior(model, target, gen)
            metrics["gamma"] = gamma
            epochs = self.fed.local_epochs
        else:  # no global output yet (every earlier round aborted): train on under the warm-up prior
            prior, epochs = ModelPrior.isotropic(self.init_prior_std), self.fed.local_epochs
        metrics["elbo_loss"] = self.train_posterior(model, prior, x, y, epochs, rng, gen)
        probs = mc_predict(model, self.alignment_x, self.mc_samples, gen)
        self._finite_posterior(client)  # the next round starts from a finite posterior (this one's upload falls back)
        return ClientOutput({CHANNEL: probs}, weight=self.release_weight(dataset, client), metrics=metrics)

    def tune_prior(self, model: nn.Module, target: np.ndarray, generator: torch.Generator
                   ) -> tuple[ModelPrior, float]:
        """Eq. 4: the prior p(.; psi*) of :meth:`prior_network` as a ``ModelPrior``, and the last tuning loss."""
        net, loss = self.prior_network(model, target, generator)
        return ModelPrior.from_model(net), loss

    def prior_network(self, model: nn.Module, target: np.ndarray, generator: torch.Generator
                      ) -> tuple[nn.Module, float]:
        """A copy of ``model`` whose Gaussian parameters are the prior parameters psi, started from the current
        posterior and fitted by ``prior_steps`` Adam steps so that the net with weights drawn from p(.; psi) outputs
        ``target`` on AD (one weight draw per step, full batch). ``model`` itself is not changed."""
        net = copy.deepcopy(model)
        set_generator(net, generator)
        target_t = torch.as_tensor(target, dtype=torch.float32)
        opt = torch.optim.Adam(net.parameters(), lr=self.prior_lr)
        net.train()
        loss_value = float("nan")
        try:
            for _ in range(self.prior_steps):
                opt.zero_grad(set_to_none=True)
                loss = soft_cross_entropy(net(self.alignment_x), target_t)
                loss.backward()
                opt.step()
                loss_value = float(loss.detach())
        finally:
            set_generator(net, None)
        return net, loss_value

    def train_posterior(self, model: nn.Module, prior: ModelPrior, x: torch.Tensor, y: torch.Tensor, epochs: int,
                        rng: np.random.Generator, generator: torch.Generator) -> float:
        """Eq. 5 by Bayes-by-Backprop: minimise E_q[mean NLL] + KL(q || prior) / n over q, Adam (``bbb_lr``).
        Returns the last epoch's mean loss."""
        n = len(x)
        opt = torch.optim.Adam(model.parameters(), lr=self.bbb_lr)
        set_generator(model, generator)
        model.train()
        last = float("nan")
        try:
            for _ in range(epochs):
                total, seen = 0.0, 0
                for idx in batches(n, self.fed.batch_size, rng):
                    idx_t = torch.as_tensor(idx, dtype=torch.long)
                    opt.zero_grad(set_to_none=True)
                    loss = F.cross_entropy(model(x[idx_t]), y[idx_t]) + model_kl_divergence(model, prior) / n
                    loss.backward()
                    opt.step()
                    total += float(loss.detach()) * len(idx)
                    seen += len(idx)
                last = total / max(seen, 1)
        finally:
            set_generator(model, None)
        return last

    # -- server --------------------------------------------------------------------------------------------------

    def server_update(self, aggregates: Mapping[str, Aggregate], round):
        """Phi_bar(AD) = sum_k w_k Phi_k(AD) / sum_k w_k, clipped to [0, 1] and renormalised (post-processing), and
        its reliability (:func:`release_reliability`) from the noise std the release is known to carry."""
        agg = aggregates[CHANNEL]
        average = agg.total / agg.total_weight
        self.global_probs = clip_and_renormalise(average)
        self.reliability = release_reliability(average, agg.noise_std / agg.total_weight)

    @property
    def effective_gamma(self) -> float:
        """gamma of eq. 3, times the broadcast's reliability when ``noise_aware`` (exactly gamma without noise)."""
        return self.gamma * (self.reliability if self.noise_aware else 1.0)

    # -- evaluation ----------------------------------------------------------------------------------------------

    def client_predictions(self, dataset) -> dict[int, np.ndarray]:
        """Each trained client's Bayesian model average on ``dataset`` (the held-out part of the test set when
        ``dataset`` is the test set an alignment set was carved from)."""
        x = self._eval_set(dataset).tensors()[0]
        return {k: mc_predict(m, x, self.mc_samples, torch.Generator().manual_seed(self._eval_seed + k))
                for k, m in sorted(self.models.items())}

    def _eval_set(self, dataset):
        return self._test_rest if self._test_given is not None and dataset is self._test_given else dataset

    def _own_class_predictions(self, dataset):
        """Per-client predictions on ``dataset``, and each client's own-class split of them."""
        y = self._eval_set(dataset).tensors()[1].numpy()
        preds = self.client_predictions(dataset)
        own = {k: (proba[mask], y[mask]) for k, proba in preds.items() if k in self.client_classes
               for mask in [np.isin(y, self.client_classes[k])] if mask.any()}
        return y, preds, own

    def calibration_predictions(self, dataset):
        """The clients' personalised predictions on their own classes' test examples, pooled: what ``evaluate``'s
        NLL, ECE, MCE and Brier are computed on (and ``privfl compare`` draws reliability diagrams from)."""
        _, _, own = self._own_class_predictions(dataset)
        if not own:
            return None
        return np.concatenate([p for p, _ in own.values()]), np.concatenate([t for _, t in own.values()])

    def evaluate(self, dataset):
        """What the server half holds: ``effective_gamma``, the gamma the clients' next prior tuning will use (the
        personalised metrics are :meth:`local_metrics`)."""
        return {"effective_gamma": self.effective_gamma}

    def local_metrics(self, dataset):
        """Personalised metrics of the clients' models loaded here; see the module docstring. With none loaded (no
        client has trained yet), those of the uniform predictive, so a round's metrics always carry the same names."""
        y, preds, own = self._own_class_predictions(dataset)
        if not own:
            uniform = np.full((len(y), self._num_classes), 1.0 / self._num_classes)
            out = classification_metrics(uniform, y)
            return {**out, "mce": maximum_calibration_error(uniform, y), "brier": brier_score(uniform, y)}
        all_acc = [float(np.mean(proba.argmax(axis=1) == y)) for proba in preds.values()]
        own_acc, groups = [], {"small": [], "large": []}
        for k, (p_k, y_k) in own.items():
            acc = float(np.mean(p_k.argmax(axis=1) == y_k))
            own_acc.append(acc)
            groups["small" if self.is_small(k) else "large"].append(acc)
        p, t = self.calibration_predictions(dataset)
        out = classification_metrics(p, t)
        out["accuracy"] = float(np.mean(own_acc))
        out["mce"] = maximum_calibration_error(p, t)
        out["brier"] = brier_score(p, t)
        out["accuracy_all_classes"] = float(np.mean(all_acc))
        if groups["small"] and groups["large"]:
            out["accuracy_small_nets"] = float(np.mean(groups["small"]))
            out["accuracy_large_nets"] = float(np.mean(groups["large"]))
        return out

    def is_small(self, client: int) -> bool:
        return client in self.small_clients


def _as_architecture(spec) -> "Architecture | UserArchitecture":
    if isinstance(spec, (Architecture, UserArchitecture)):
        return spec
    if isinstance(spec, str):
        return Architecture(spec)
    raise ConfigurationError(f"an architecture is an Architecture or a model name, got {spec!r}")


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _positive_int(name: str, value, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise ConfigurationError(f"{name} must be an integer >= {0 if allow_zero else 1}, got {value!r}")
    return int(value)


def _fraction(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigurationError(f"{name} must be in [0, 1), got {value!r}")
    return float(value)


__all__ = ["Architecture", "CHANNEL", "FedBNN", "MAX_ROW_NORM", "PER_POINT_SENSITIVITY", "UserArchitecture",
           "bayesian_twin", "clip_and_renormalise", "mc_predict", "label_shifted", "release_reliability",
           "soft_cross_entropy"]
