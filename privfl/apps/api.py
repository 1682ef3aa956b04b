"""``privfl.federate``: train your own model on your own clients' data under a privacy guarantee, in one call.

What Opacus's ``make_private(module, optimizer, data_loader)`` is to one data set, ``federate`` is to a federation::

    result = privfl.federate(model, {"hospital_a": (X_a, y_a), "hospital_b": df_b, ...}, target="label",
                             epsilon=3.0, loss=nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.Adam(p, 1e-3))
    result.model          # the trained global nn.Module
    result.history        # one dict of test metrics per round
    result.audit          # client name -> its (epsilon, delta) spend, from the ledger

It only assembles what ``privfl run`` assembles (``FederatedData`` from the clients' arrays, the configurations,
``make_algorithm``, ``Simulation``); every value still leaves a client through the release pipeline and is charged in
the ledger. Public facts stay public: the label set is ``classes`` or the model's output width (an agreed
architecture), never read from the clients' labels; the task follows the targets' dtype (a schema fact) unless given
(declared ``classes`` make it a classification).
"""

from __future__ import annotations

import copy
import math
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from privfl.errors import ConfigurationError

#: the FedAvg family, whose local step trains the user's own model, loss and optimizer (any algorithm whose constructor
#: takes ``model`` is accepted too: :func:`own_model_algorithms`)
OWN_MODEL_ALGORITHMS = ("fedavg", "fedprox", "dp_fedavg", "dpsgd_fedavg")
#: torch's harmless warning when opacus's per-example hooks fire on a first layer (its inputs need no gradient)
_BACKWARD_HOOK_WARNING = (r"Full backward hook is firing when gradients are computed with respect to module outputs "
                          r"since no inputs require gradients")


@dataclass
class FederatedResult:
    """What :func:`federate` returns.

    ``model``: the trained global model (a copy; the module you passed is left untouched): an ``nn.Module`` for the
    FedAvg family, FOLA and HBFL; for FedBNR its posterior predictive, a
    :class:`privfl.algorithms.fedbnr.BLRPredictor` (``model(x)``: the predictive mean, shape ``(n, 1)``;
    ``model.predict(x)``: mean and predictive variance as arrays, in the targets' units); None where there is no
    one global model (FedBNN's models are the clients' own). ``history``: per round,
    the test metrics (balanced accuracy, AUROC, accuracy, NLL, ECE for classification; RMSE, MAE, R^2 in the
    targets' units for regression; and your ``metrics``), the participants and the largest epsilon so far.
    ``audit``: client name -> ``{"epsilon", "releases", ...}`` from the ledger. ``audit_rows``: one row per client per
    round it was charged in, ``{"client", "round", "epsilon"}`` (cumulative). ``run``: the underlying
    :class:`privfl.runtime.engine.RunResult`. Without ``test=`` the test set is the clients' own held-out records,
    never charged: ``test_from_clients`` is True, ``test_metrics_privacy`` says the test metrics are not covered by
    ``epsilon``, and a private run warns so once. With ``class_prior``: ``decision``, the prior-corrected decision rule
    (:class:`privfl.metrics.decision.PriorCorrection`), and ``prior_corrected``, the rule and its decision metrics on
    the test data (balanced accuracy, accuracy, recall, positive rate); :meth:`predict` decides with it.
    """

    model: Any
    history: list[dict]
    audit: dict[str, dict]
    audit_rows: list[dict]
    epsilon: float
    delta: float
    algorithm: str
    clients: list[str]
    run: Any = field(repr=False, default=None)
    decision: Any = None
    prior_corrected: dict | None = None
    #: True when the test set is the clients' own held-out records (no ``test=``): never charged, so ``history``'s
    #: test metrics are not covered by ``epsilon`` (``test_metrics_privacy`` says so; :mod:`privfl.apps.held_out`)
    test_from_clients: bool = False
    test_metrics_privacy: str | None = None

    @property
    def final(self) -> dict:
        """The last round's test metrics."""
        return self.history[-1]["metrics"] if self.history else {}

    def predict(self, x) -> np.ndarray:
        """The predicted class (its position in the model's outputs) of each record of ``x`` (an array or tensor of
        records): the argmax of the trained model's class probabilities, times the prior correction's factors when
        the run declared ``class_prior`` (pure post-processing of the model: no privacy cost)."""
        import torch

        from privfl.training.local import predict_proba

        if not isinstance(self.model, torch.nn.Module):
            raise ConfigurationError(f"{self.algorithm}: predict decides between classes with one global classifier; "
                                     "this run has none")
        proba = predict_proba(self.model, torch.as_tensor(np.asarray(x, dtype=np.float32)))
        return proba.argmax(axis=1) if self.decision is None else self.decision.decide(proba)


def own_model_algorithms() -> list[str]:
    """The registered algorithms that train a user's model (their constructor takes ``model``)."""
    from privfl.algorithms import ALGORITHMS, algorithm_options

    return [name for name in ALGORITHMS if "model" in algorithm_options(name)]


def _check_clients(clients) -> list[str]:
    if not isinstance(clients, Mapping):
        raise ConfigurationError(f"clients must be a mapping of client name to that client's data, e.g. "
                                 f"{{'hospital_a': (X_a, y_a), 'hospital_b': (X_b, y_b)}}; got a "
                                 f"{type(clients).__name__}"
                                 + (f" of {len(clients)} items" if isinstance(clients, (list, tuple)) else ""))
    if len(clients) < 2:
        raise ConfigurationError(f"a federation needs at least 2 clients; got {len(clients)}")
    names = [str(k) for k in clients]
    if len(set(names)) != len(names):
        raise ConfigurationError("client names must be distinct as strings")
    return names


def _type_empty_clients(pairs: list) -> list:
    """Clients without records (accepted at client level) typed like the others: features of the other clients'
    shape, targets of their dtype (an empty table or data set carries neither)."""
    full = [(x, y) for x, y in pairs if len(x)]
    if not full or len(full) == len(pairs):
        return pairs
    x0, y0 = full[0]
    return [(x, y) if len(x) else (np.zeros((0, *x0.shape[1:]), dtype=np.float32),
                                   np.zeros((0, *y0.shape[1:]), dtype=y0.dtype))
            for x, y in pairs]


def _infer_task(ys: Sequence[np.ndarray]) -> str:
    kinds = {y.dtype.kind for y in ys}
    if kinds <= {"f"}:
        return "regression"
    if kinds & {"f"}:
        raise ConfigurationError("some clients' targets are floats and others are not; give every client the same "
                                 "target dtype, or pass task='classification' or task='regression'")
    return "classification"


def _output_width(factory: Callable, input_shape: tuple[int, ...]) -> int:
    import torch

    net = factory()
    net.eval()
    try:
        with torch.no_grad():
            out = net(torch.zeros((1, *input_shape)))
    except Exception as exc:  # the user's forward on the clients' input shape: say what it was fed
        raise ConfigurationError(f"the model failed on an input of shape {(1, *input_shape)} (one record of the "
                                 f"clients' data): {type(exc).__name__}: {exc}") from None
    if not isinstance(out, torch.Tensor):
        raise ConfigurationError(f"the model must return a tensor, got {type(out).__name__}")
    return int(out.reshape(1, -1).shape[1])


def _labels(y: np.ndarray, what: str, classes: Sequence | None, width: int) -> np.ndarray:
    """Class indices of ``y``: positions in ``classes`` when given, else integer labels in [0, width)."""
    if classes is not None:
        from privfl.data.errors import DatasetError
        from privfl.data.own import class_index, label_positions

        try:  # by value, one label at a time (a label 1.0 is the class 1), whatever the column's dtype
            labels = label_positions(y.reshape(-1), class_index(list(classes), "classes="))
        except DatasetError as exc:
            raise ConfigurationError(str(exc)) from None
        if labels is None:  # neither how many nor which: they are the client's records
            raise ConfigurationError(f"{what} has labels outside classes={list(classes)[:10]} (neither their count "
                                     "nor their values are shown: they are the records' data); list every class")
        return labels
    if y.dtype.kind not in "biu":
        raise ConfigurationError(f"{what}: labels of dtype {y.dtype} need classes=[...], the public label set in the "
                                 "order of the model's outputs")
    if len(y) and (y.min() < 0 or y.max() >= width):
        raise ConfigurationError(f"{what} has labels outside 0..{width - 1} (the model's {width} outputs): make "
                                 f"the model output one value per class, or pass classes=[...] in output order")
    return y.astype(np.int64)


def _trained_model(sim, alg, test):
    """What ``FederatedResult.model`` holds: a copy of the global ``nn.Module`` (the FedAvg family, ...), FedBNR's
    posterior predictive (:class:`privfl.algorithms.fedbnr.BLRPredictor`, in the targets' units), else None."""
    if hasattr(alg, "global_model"):
        return copy.deepcopy(alg.global_model())
    phases = getattr(sim, "phase_runs", None)
    final = phases[-1].algorithm if phases else alg  # a multi-phase run's model is its last phase's
    if callable(getattr(final, "predictor", None)):
        return final.predictor(float(test.target_offset), float(test.target_scale))
    return None


#: a private classification run without a declared label set: refused before anything is read of the labels
PRIVATE_LABEL_SET = ("a private run's label set is a public fact, never read from the clients' labels: pass "
                     "classes=[...] (every class, in the order of the model's outputs), or test= (data no client "
                     "holds, whose labels fix the classes with the model's output width)")


def _check_width_fits_labels(width: int, ys: Sequence[np.ndarray], whose: str) -> None:
    """Refuse a model with more outputs than the integer labels ``ys`` use: a 3-output model for 0/1 labels trains a
    class that no record has. A private run passes the test set's labels only (data no client holds: the check must
    not turn on one client's record); a non-private run, which claims nothing, may pass every client's too."""
    values = [y.reshape(-1) for y in ys if y.size and y.dtype.kind in "biu"]
    if not values or len(values) != sum(1 for y in ys if y.size):
        return  # non-integer labels are refused by _labels with the pointer to classes=
    top = int(max(v.max() for v in values))
    if top + 1 < width:
        raise ConfigurationError(f"the model outputs {width} values per example (one per class), but the labels of "
                                 f"{whose} lie in 0..{top} ({top + 1} classes): make its last layer output "
                                 f"{top + 1} values, or, if the other classes exist but {whose} holds none of them, "
                                 f"pass classes=[...] listing all {width} in the order of the model's outputs")


def _regression_targets(y: np.ndarray, what: str) -> np.ndarray:
    if y.dtype.kind not in "biuf":
        raise ConfigurationError(f"{what}: regression targets of dtype {y.dtype} must be numbers")
    return y.astype(np.float32)


def federate(model, clients: Mapping[str, Any], *, algorithm: str = "dpsgd_fedavg", epsilon: float | None = None,
             delta: float = 1e-5, unit: str | None = None, loss=None, optimizer=None,
             metrics: Mapping[str, Callable] | None = None, test=None, target: str | None = None,
             task: str | None = None, classes: Sequence | None = None, rounds: int = 10,
             local_epochs: int | None = None, batch_size: int = 32, lr: float | None = None, momentum: float = 0.0,
             clip: float | str | None = None, clip_quantile: float | None = None, client_size: int | None = None, test_fraction: float = 0.2, seed: int = 0,
             secure_noise: bool = True, ledger: str = ":memory:", run_id: str | None = None,
             sampling_rate: float = 1.0, placement: str = "central", secure_agg=False,
             class_prior: Sequence[float] | None = None, **options) -> FederatedResult:
    """Train ``model`` over ``clients`` with ``algorithm`` under (``epsilon``, ``delta``) per client.

    - ``model``: a ``torch.nn.Module`` (copied; yours is not modified) or a zero-argument factory of one (for hbfl
      and fedbnn also a list of them, one per client, cycled). Its output width is the number of classes (or of
      regression targets): a classifier with more outputs than its integer labels use (e.g. 3 outputs for 0/1
      labels) is refused, unless ``classes`` lists every class in output order. A private classification run
      (finite ``epsilon``) takes its classes from ``classes``, or else from ``test``'s labels (the model's output
      width checked against them), never from the clients' labels: with neither it is refused up front.
    - ``clients``: client name -> its data: a torch ``Dataset`` or ``DataLoader`` of (x, y) pairs (privfl draws its
      own batches: DP-SGD samples them), an ``(X, y)`` pair of numpy arrays or tensors, or a pandas DataFrame with
      its ``target`` column. ``test``: held-out data in the same form; without it each client holds out
      ``test_fraction`` of its records in expectation, each record on a coin of its own (a keyed hash of the record
      and ``seed``: :func:`privfl.data.own.holdout_mask`), so adding or removing one record moves no other.
    - ``algorithm``: one that trains a user's model (:func:`own_model_algorithms`: the FedAvg family
      ``OWN_MODEL_ALGORITHMS``, dp_fedsgd, fola, hbfl, fedbnn and fedbnr); the others build their own models and
      are refused with the reason. ``fedbnr`` (regression) takes ``model`` as its feature extractor (None: random
      Fourier features of the inputs) and returns as ``result.model`` its posterior predictive: ``result.model(x)``
      is the predictive mean (a tensor of shape ``(n, 1)``) and ``result.model.predict(x)`` gives ``(mean,
      variance)`` numpy arrays, the variance being the posterior predictive's (noise plus weight uncertainty), both
      in the targets' units.
      ``epsilon``: the per-client budget (required by private algorithms; ``math.inf`` or None for
      fedavg/fedprox). ``unit``: ``"example"`` (record-level) or ``"client"``; default the algorithm's.
    - ``loss``: ``criterion(outputs, targets)``; default cross-entropy (classification) or MSE (regression). Under
      DP-SGD it must give per-example losses (any torch loss module does). ``optimizer``: a factory of parameters,
      e.g. ``lambda p: torch.optim.Adam(p, lr=1e-3)``; default SGD with ``lr`` and ``momentum``. Either one runs
      clients one after another instead of on the vectorised executor.
    - ``metrics``: extra test metrics, name -> ``fn(y_true, scores)`` (class probabilities, or predictions).
    - ``task``: ``"classification"`` or ``"regression"``; default: float targets are regression. ``classes``: the
      public label set in the order of the model's outputs (needed for non-integer labels).
    - ``rounds``, ``local_epochs``, ``batch_size``, ``lr``, ``momentum``, ``clip``: as in ``FederationConfig`` and
      ``PrivacyConfig`` (left out: the algorithm's defaults). ``client_size``: the public design size of a client's
      data (DP-SGD's sampling rate and steps), required for a private run: the clients' record counts are private
      and never set it. ``clip="adaptive"``: adaptive clipping from the algorithm's default clip towards the
      ``clip_quantile`` (default 0.5) of the norms it clips, the quantile's release charged in every ledger
      (``PrivacyConfig.clip_quantile``; algorithms that take it: dp_fedavg, dp_fedsgd, dpsgd_fedavg). ``secure_noise``: draw the noise and the client sample from the OS CSPRNG (False:
      reproducible from ``seed``, and the audit says so). ``sampling_rate``: Poisson client sampling per round
      (amplified at client level with central noise). ``ledger``: a SQLite path to keep the ledger. ``options``:
      the algorithm's own options (e.g. FedProx's ``mu``). ``placement``: where client-level noise is added,
      ``"central"`` (the aggregator), ``"local"`` (each client) or ``"distributed"`` (each client a share, under secure
      aggregation); ``secure_agg``: True (or a :class:`privfl.SecureAggregation`) to hide every upload from the
      server under secure aggregation.
    - ``class_prior``: the classes' base rates in the clients' data as a public fact you declare (a published
      prevalence, a public reference sample, a design share; never counted from the clients' labels or the test
      set), e.g. ``[0.96, 0.04]``: the result then decides with the balanced, prior-corrected rule ``argmax_y
      p(y|x) * r_y`` that accounts for the class weights the run trained with
      (:class:`privfl.metrics.decision.PriorCorrection`; post-processing, free of privacy cost):
      ``result.predict(x)``, and ``result.prior_corrected`` with its test metrics.

    Refused before anything is charged (:class:`ConfigurationError`): besides bad arguments, a client too small for
    its DP-SGD schedule (fewer than ``ceil(client_size / batch_size)`` training records: less than one record per
    step on average; :func:`privfl.runtime.engine.check_schedules_fit`). A run whose training diverges stops with an error
    naming the likely causes (features not standardised, too large a learning rate): a non-finite upload is refused
    before release (:class:`privfl.errors.InvalidRelease`); non-finite global parameters or predictions, or a
    regression whose test RMSE exceeds 100 standard deviations of the test targets, raise
    :class:`privfl.errors.TrainingDiverged` naming the round (in a private run without ``test=`` only non-finite
    global parameters: the held-out records are the clients' own, never charged, and their metrics decide nothing).
    The rounds run before stay charged. At client level a client without records (its data removed) takes part,
    contributing zero.
    """
    from privfl.algorithms import ALGORITHMS, algorithm_options, make_algorithm
    from privfl.apps.settings import resolve_prior_correction, resolve_settings, resolve_unit
    from privfl.core.config import FederationConfig, PrivacyConfig
    from privfl.data.federated import federated_from_arrays
    from privfl.data.inputs import as_arrays
    from privfl.data.own import holdout_split
    from privfl.runtime.engine import Simulation
    from privfl.training.local import UserTraining

    able = own_model_algorithms()
    if algorithm not in ALGORITHMS:
        raise ConfigurationError(f"unknown algorithm {algorithm!r}; privfl.federate trains your model with one of "
                                 f"{able}")
    takes = set(algorithm_options(algorithm))
    if "model" not in takes:
        raise ConfigurationError(f"privfl.federate does not yet train your own model with {algorithm}: it builds "
                                 f"its own models from a built-in architecture; use one of {able}, or "
                                 f"`privfl run --algorithm {algorithm}` with a built-in model")
    given = {"loss": loss, "optimizer": optimizer, "metrics": metrics}
    refused = sorted(k for k, v in given.items() if v is not None and k not in takes)
    if refused:
        raise ConfigurationError(f"{algorithm} does not take {refused} yet; leave them out or use one of "
                                 f"{[n for n in able if set(given) <= set(algorithm_options(n))]}")
    bad = sorted(set(options) - takes)
    if bad:
        raise ConfigurationError(f"{algorithm} takes no option {bad}; its options are {sorted(takes)}")
    cls = ALGORITHMS[algorithm]
    if epsilon is None:
        if cls.supports_privacy:
            raise ConfigurationError(f"{algorithm} is private: pass epsilon= (e.g. epsilon=3.0; math.inf for a "
                                     "non-private run)")
        epsilon = math.inf
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real):
        raise ConfigurationError(f"epsilon must be a number (e.g. epsilon=3.0; math.inf for a non-private run), got "
                                 f"{epsilon!r} ({type(epsilon).__name__})")
    if task is not None and task not in ("classification", "regression"):
        raise ConfigurationError(f"task must be 'classification' or 'regression', got {task!r}")

    names = _check_clients(clients)
    # at client level a client whose data is removed is a neighbour: it takes part and contributes zero
    client_level = math.isfinite(epsilon) and resolve_unit(algorithm, unit) == "client"
    pairs = [as_arrays(v, target=target, what=f"client {n!r}", allow_empty=client_level)
             for n, v in zip(names, clients.values())]
    pairs = _type_empty_clients(pairs)
    shapes = {x.shape[1:] for x, _ in pairs}
    if len(shapes) != 1:
        raise ConfigurationError(f"the clients' records have different shapes {sorted(shapes)}; every client needs "
                                 "the same features")
    if test is not None:
        test_pair, rule = as_arrays(test, target=target, what="the test data"), "test data"
    else:
        held = [holdout_split(x, y, test_fraction, seed) for x, y in pairs]  # each record's own coin
        test_pair = (np.concatenate([x[o] for (x, _), (_, o) in zip(pairs, held)]),
                     np.concatenate([y[o] for (_, y), (_, o) in zip(pairs, held)]))
        pairs = [(x[t], y[t]) for (x, y), (t, _) in zip(pairs, held)]
        rule = f"each client's held-out {test_fraction:g} (seed {seed})"
    # declared classes make it a classification (the targets' dtypes follow the records: one label 1.0 or "unknown"
    # retypes a client's whole column)
    task = task or ("classification" if classes is not None else _infer_task([y for _, y in pairs]))
    # a list of per-client models (HBFL, FedBNN) is checked by the algorithm; the first fixes the output width
    first = model[0] if isinstance(model, (list, tuple)) and len(model) else model
    user = UserTraining.of(algorithm, first, loss, optimizer, metrics)
    input_shape = tuple(test_pair[0].shape[1:])
    if task == "classification":
        if classes is None and user.model is None:
            raise ConfigurationError("model is None: privfl.federate trains your model, whose output width gives the "
                                     "number of classes; pass model= a torch.nn.Module (or a zero-argument factory of "
                                     "one), or classes=[...]")
        width = len(classes) if classes is not None else _output_width(user.model, input_shape)
        if classes is None and math.isfinite(epsilon):
            # private: the classes come from the declaration or the user's test set, never the clients' labels
            if test is None:
                raise ConfigurationError(PRIVATE_LABEL_SET)
            _check_width_fits_labels(width, [test_pair[1]], "the test data")
        elif classes is None:
            _check_width_fits_labels(width, [y for _, y in pairs] + [test_pair[1]], "every client and the test data")
        pairs = [(x, _labels(y, f"client {n!r}", classes, width)) for n, (x, y) in zip(names, pairs)]
        test_pair = (test_pair[0], _labels(test_pair[1], "the test data", classes, width))
        num_classes = width
    else:
        pairs = [(x, _regression_targets(y, f"client {n!r}")) for n, (x, y) in zip(names, pairs)]
        test_pair = (test_pair[0], _regression_targets(test_pair[1], "the test data"))
        num_classes = None
    data = federated_from_arrays(pairs, test_pair, task=task, num_classes=num_classes, name="federate",
                                 partition="given", seed=seed, info={"clients": names, "test": rule},
                                 test_from_clients=test is None)

    settings = resolve_settings(algorithm, {"local_epochs": local_epochs, "lr": lr, "clip": clip,
                                            "clip_quantile": clip_quantile}, image=len(input_shape) == 3)
    fed = FederationConfig(rounds=rounds, local_epochs=settings["local_epochs"], batch_size=batch_size,
                           lr=settings["lr"], momentum=momentum, seed=seed, client_size=client_size)
    privacy = PrivacyConfig(epsilon=epsilon, delta=delta, unit=resolve_unit(algorithm, unit),
                            clip=settings["clip"], clip_quantile=settings.get("clip_quantile"),
                            secure_noise=secure_noise,
                            sampling_rate=sampling_rate, placement=placement)
    from privfl.privacy.secure import SecureAggregation

    if secure_agg is True:
        secure_agg = SecureAggregation()
    elif secure_agg is False or secure_agg is None:
        secure_agg = None
    elif not isinstance(secure_agg, SecureAggregation):
        raise ConfigurationError(f"secure_agg must be True, False or a privfl.SecureAggregation, got "
                                 f"{type(secure_agg).__name__}")
    extra = {k: v for k, v in given.items() if v is not None}
    alg = make_algorithm(algorithm, fed, privacy, model=model, **extra, **options)
    if getattr(alg, "uses_alignment", False) and test is None:
        # without test= the only held-out data is the clients' own records, which no algorithm may treat as public
        raise ConfigurationError(f"{algorithm} collaborates through a public alignment set that no client holds; "
                                 "without test= the held-out data is the clients' own records, which must not serve "
                                 "as one: pass test=(X, y), data no client holds (the evaluator's), from which "
                                 f"{algorithm} carves its alignment set (alignment_size points)")
    rule = resolve_prior_correction(class_prior, alg, task=task, num_classes=num_classes, loss=loss)
    sim = Simulation(alg, data, fed, privacy, ledger_path=ledger, run_id=run_id, secure=secure_agg)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_BACKWARD_HOOK_WARNING, category=UserWarning)
        run = sim.run()

    def name_of(cid) -> str:
        return names[int(cid)]

    audit = {name_of(cid): dict(row) for cid, row in run.audit.get("clients", {}).items()}
    rows = [{"client": name_of(cid), "round": int(rnd), "epsilon": float(eps)}
            for cid, series in sim.ledger.epsilon_by_round().items() for rnd, eps in series]
    history = [{"round": r.round, "metrics": dict(r.metrics), "participants": r.participants,
                "sat_out": [name_of(c) for c in r.sat_out], "epsilon_max": r.epsilon_max, "seconds": r.seconds,
                "snr": dict(r.snr), **({"clip": r.clip} if r.clip is not None else {})}
               for r in run.history]
    from privfl.metrics.report import one_class_warning

    one_class = one_class_warning(run.final)
    if one_class and rule is None:  # with a declared prior the result already decides by the corrected rule
        warnings.warn(one_class, RuntimeWarning, stacklevel=2)
    trained = _trained_model(sim, alg, data.test)
    from privfl.metrics.report import prior_corrected

    corrected = (prior_corrected(rule, sim.diagnostic_algorithm().predict_proba(data.test), data.test.y)
                 if rule is not None and len(data.test) else None)
    from privfl.apps.held_out import NOTE, WARNING

    if test is None and privacy.private:  # the held-out records are the clients' own, never charged
        warnings.warn(WARNING, UserWarning, stacklevel=2)
    return FederatedResult(model=trained, history=history, audit=audit, audit_rows=rows,
                           epsilon=float(run.audit.get("max_epsilon", math.inf if not privacy.private else 0.0)),
                           delta=delta, algorithm=algorithm, clients=names, run=run, decision=rule,
                           prior_corrected=corrected, test_from_clients=test is None,
                           test_metrics_privacy=NOTE if test is None else None)


__all__ = ["FederatedResult", "OWN_MODEL_ALGORITHMS", "federate", "own_model_algorithms"]
