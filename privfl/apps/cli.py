"""The ``privfl`` command line: calibrate, run, audit, compare, audit-mechanism.

The flags and JSON keys documented in the README are contracts checked by automated tools; keep them.

JSON output is strict JSON: an infinite number (a non-private run's epsilon) is written as the string ``"inf"`` and a
number that is not defined (NaN, e.g. the AUROC of a test set with one class) as ``null``
(:mod:`privfl.metrics.report`). Heavy libraries (torch, the algorithms) are imported only by the commands that train,
so ``privfl calibrate`` stays quick.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sqlite3
import sys
import warnings

# argparse reads "-1e-5" as an option name; numbers in scientific notation and -inf are values here, so that
# "--delta -1e-5" reaches the validation that explains what is wrong with it.
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf(inity)?$", re.IGNORECASE)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _clip(text: str) -> float | str:
    """``--clip``: a number, or ``adaptive``."""
    if text.strip().lower() == "adaptive":
        return "adaptive"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'adaptive', got {text!r}") from None


def _names(text: str) -> list[str]:
    """Comma-separated names (``--client-names a,b,c``), stripped, none empty or repeated."""
    names = [n.strip() for n in text.split(",")]
    if not names or any(not n for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct comma-separated names such as a,b,c, got {text!r}")
    return names


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 0.96,0.04, got {text!r}") from None


def _widths(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 100,50, got {text!r}") from None


#: the registered algorithms' names, for help texts (``privfl.algorithms.ALGORITHMS`` imports torch; a test keeps
#: this tuple equal to its keys)
ALGORITHM_NAMES = ("dp_fedavg", "dp_fedsgd", "dpsgd_fedavg", "fedavg", "fedbnn", "fedbnr", "fedprox", "fola", "hbfl")

#: torch's warning when a full backward hook fires on a module whose inputs need no gradient: raised by opacus's
#: ghost-clipping backward (``dpsgd_train``'s per-client loop, taken by models the vectorised executor cannot train)
#: on every first layer, whose inputs are data and never trainable; harmless there (the hooks read gradients with
#: respect to outputs and parameters only) and not ours to avoid. Filtered by its exact text around the commands that
#: train, until ``dpsgd_train`` filters it around that backward call itself.
_BACKWARD_HOOK_WARNING = (r"Full backward hook is firing when gradients are computed with respect to module outputs "
                          r"since no inputs require gradients")

#: the built-in model and data set names, for help texts (``privfl.models`` and ``privfl.data`` import torch; a test
#: keeps these equal to ``MODELS`` and ``DATASETS``)
MODEL_NAMES = ("cnn1", "cnn2", "lenet5", "mlp")
DATASET_NAMES = ("autompg", "bike", "ccpp", "cifar10", "cifar100", "diabetes", "digits", "fair", "grunfeld",
                 "macrodata", "mnist", "mnist5k", "parkinsons", "randhie", "skillcraft", "sml2010", "star98",
                 "synthetic1d")

#: the algorithms whose ``default_unit`` is record level, for help texts only (the classes' attribute decides; a test
#: keeps this in step with it, as with ALGORITHM_NAMES)
RECORD_LEVEL_ALGORITHMS = ("dp_fedsgd", "dpsgd_fedavg", "fedbnr")
#: options that only some algorithms take, as ``privfl run`` flags: (flag, option name, the flag's default). A flag
#: is passed to ``make_algorithm`` when the algorithm declares the option (``algorithm_options``), and refused with a
#: pointer to the algorithms that do when it is given otherwise
ALGORITHM_FLAGS = (("--kernel-rounds", "kernel_rounds", 0), ("--kernel-aggregation", "kernel_aggregation", "fedavg"),
                   ("--kernel-clip", "kernel_clip", 0.05))

#: ``privfl run --runtime``: the in-process simulation (the default) or Flower's Simulation Engine
RUNTIMES = ("inprocess", "flower-sim")
#: ``privfl audit-run --canaries``: the most it takes (a canary needs a block of the model's coordinates of its own)
MAX_CANARIES = 10 ** 7
_FLOWER_INSTALL = "pip install 'privfl[flower]'"


def version() -> str:
    """privfl's installed version (the distribution's metadata, else the package's ``__version__``)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("privfl")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree that is not installed
        return str(getattr(sys.modules.get("privfl"), "__version__", "unknown"))


def _json_text(obj) -> str:
    from privfl.metrics.report import strict_json

    return json.dumps(strict_json(obj), indent=2, default=_json_default, allow_nan=False)


def _dump(obj, path: str | None) -> None:
    text = _json_text(obj)
    if path in (None, "-"):
        print(text)
    else:
        _check_out_path(path, "--json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")


def _check_out_path(path: str, flag: str, *, create_folder: bool = True) -> None:
    """Refuse an output path that is a directory, (``create_folder=False``) whose folder does not exist, or that this
    process cannot write (:func:`_check_writable`): checked before a run charges anything."""
    from privfl.errors import ConfigurationError

    if os.path.isdir(path):
        raise ConfigurationError(f"{flag} {path} is a directory; give a file name inside it")
    folder = os.path.dirname(os.path.abspath(path))
    _check_folder(folder, flag, path)
    if not create_folder and not os.path.isdir(folder):
        raise ConfigurationError(f"{flag} {path}: the folder {folder} does not exist; create it or choose another "
                                 "path")
    _check_writable(path, flag)


def _check_writable(path: str, flag: str) -> None:
    """Refuse an output path this process cannot write: an existing file is opened for appending (nothing is
    written), else a temporary file is created and removed in its folder, or in the nearest folder that exists (where
    the missing ones will be created). The real calls, not ``os.access``, which says yes to root for a read-only
    mount or an immutable (chattr +i) folder."""
    import tempfile

    from privfl.errors import ConfigurationError

    try:
        if os.path.exists(path):
            if os.path.isfile(path):
                with open(path, "ab"):
                    pass
            return  # a device (/dev/null...): written as it is
        folder = os.path.dirname(os.path.abspath(path))
        while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)
        fd, probe = tempfile.mkstemp(prefix=".privfl-write-check-", dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise ConfigurationError(f"{flag} {path}: this process cannot write there ({exc.strerror or exc}); choose a "
                                 "writable path") from None


def _dump_late(obj, path: str, flag: str = "--json") -> str | None:
    """:func:`_dump` to ``path`` once a run has finished (and been charged): when the file cannot be written after
    all (a disk full, a folder made read-only meanwhile), the JSON goes to stderr instead of being lost, and the error
    to report is returned (the command then exits 2); None when written."""
    from privfl.errors import ConfigurationError

    try:
        _dump(obj, path)
        return None
    except OSError as exc:
        problem = f"{flag} {path} could not be written ({exc.strerror or exc})"
    except ConfigurationError as exc:
        problem = str(exc)
    print(_json_text(obj), file=sys.stderr)
    return f"{problem}; the results are printed above on stderr instead (the run's charges stand in its ledger)"


def _check_folder(folder: str, flag: str, given: str) -> None:
    """Refuse a folder (to be created if missing) that has a file where a folder must be."""
    from privfl.errors import ConfigurationError

    existing = folder
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigurationError(f"{flag} {given}: {existing} is a file, not a folder; choose another path")


def _check_ledger_file(path: str, flag: str) -> list[str]:
    """The run ids an existing ledger file holds; a directory or a file that is not a privfl ledger is refused with a
    message naming ``flag``. A missing file holds none."""
    from privfl.accounting.ledger import PrivacyLedger
    from privfl.errors import ConfigurationError

    if path == ":memory:" or not os.path.exists(path):
        return []
    if os.path.isdir(path):
        raise ConfigurationError(f"{flag} {path} is a directory; pass the ledger file (the .sqlite file that "
                                 "privfl run --ledger wrote)")
    try:
        return PrivacyLedger.run_ids(path)
    except sqlite3.DatabaseError as exc:
        raise ConfigurationError(f"{flag} {path} is not a privfl ledger (SQLite: {exc}); pass the file that privfl run "
                                 "--ledger wrote, or a new path") from None


def _json_default(o):
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# -- calibrate ---------------------------------------------------------------------------------------------------

def cmd_calibrate(args) -> int:
    from privfl.accounting.calibration import calibrate

    accountant = args.accountant or ("exact" if args.sampling_rate >= 1 else "pld")
    cal = calibrate(args.epsilon, args.delta, args.rounds, sampling_rate=args.sampling_rate, accountant=accountant)
    out = {"noise_multiplier": cal.noise_multiplier, "epsilon": cal.epsilon, "delta": cal.delta,
           "accountant": cal.accountant, "rounds": args.rounds, "sampling_rate": args.sampling_rate,
           "target_epsilon": args.epsilon}
    if args.json:
        _dump(out, None)
    else:
        print(f"noise multiplier {cal.noise_multiplier:.6g} (noise std / sensitivity, one release per round) "
              f"gives epsilon {cal.epsilon:.6g} at delta {cal.delta:g} over {args.rounds} rounds "
              f"(sampling rate {args.sampling_rate:g}, {cal.accountant} accountant)")
    return 0


# -- run ---------------------------------------------------------------------------------------------------------

def _algorithm_flag_options(args) -> dict:
    """The :data:`ALGORITHM_FLAGS` options for ``args.algorithm``: those it declares, with the flags' values; a flag
    given to an algorithm that has no such option is a ConfigurationError naming the algorithms that have it."""
    from privfl.algorithms import ALGORITHMS, algorithm_options
    from privfl.errors import ConfigurationError

    declared = set(algorithm_options(args.algorithm)) if args.algorithm in ALGORITHMS else set()
    options = {}
    for flag, name, default in ALGORITHM_FLAGS:
        value = getattr(args, name, default)
        if name in declared:
            options[name] = value
        elif value != default:
            users = sorted(a for a in ALGORITHMS if name in algorithm_options(a))
            raise ConfigurationError(f"{flag} is an option of {', '.join(users)} only ({name}); use it with "
                                     f"--algorithm {users[0]} or drop it")
    return options


def _entry_model_option(args) -> dict:
    """The user's own training objects the ``--entry`` point returned (its model, an ``nn.Module`` or a factory; its
    loss, optimizer and metrics), as keyword arguments of the algorithm; a clear refusal for an algorithm that takes
    none of them (it builds its own models) or not all of them."""
    from privfl.algorithms import user_training_options

    given = dict(getattr(args, "entry_training", None) or {})
    if not given:
        return {}
    return user_training_options(given, args.algorithm, f"--entry {args.entry}",
                                 "train them with --algorithm one of {}")


def _text_options(args) -> dict:
    """The ``--option KEY=VALUE`` settings (:mod:`privfl.core.options`), each one an option ``args.algorithm`` takes as a
    value: a Python object (your own model), an option with a flag of its own and a name the algorithm does not
    take are refused, naming the option and the valid ones."""
    from privfl.algorithms import ALGORITHMS, algorithm_options
    from privfl.errors import ConfigurationError
    from privfl.core.options import OBJECT_OPTIONS, parse_options, settable_options

    given = parse_options(args.option)
    if not given or args.algorithm not in ALGORITHMS:  # an unknown algorithm is make_algorithm's to report
        return given
    declared = algorithm_options(args.algorithm)
    reserved = [name for name in declared if name in vars(args)]  # set by a flag of its own (--alignment-size...)
    valid = settable_options(declared, reserved)
    for name in given:
        if name in valid:
            continue
        if name in declared and name in OBJECT_OPTIONS:
            raise ConfigurationError(f"--option {name}: {args.algorithm}'s {name} is a Python object (your own "
                                     f"{name}), not a value: give it through --entry (a model) or the Python API "
                                     "(privfl.federate)")
        if name in reserved:
            raise ConfigurationError(f"--option {name}: {args.algorithm}'s {name} has a flag of its own: use "
                                     f"--{name.replace('_', '-')}")
        raise ConfigurationError(f"--option {name}: {args.algorithm} has no option {name!r}; its options are "
                                 f"{', '.join(valid) or 'none'}")
    weights = given.get("class_weights")
    if weights is not None and (isinstance(weights, (str, bytes, dict)) or not hasattr(weights, "__iter__") or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)):
        raise ConfigurationError(f"--option class_weights: class weights must be numbers, one per class, e.g. "
                                 f"class_weights=[1,5] (a public choice), got {weights!r}; weights such as 'balanced' "
                                 "would be computed from the clients' private label counts")
    return given


def _check_flower_sim(args) -> None:
    """``--runtime flower-sim`` before any data is loaded: Flower installed, an algorithm that runs on it, and no
    flag it cannot honour."""
    from privfl.algorithms import ALGORITHMS
    from privfl.errors import ConfigurationError
    from privfl.flower.sim import require_flower, require_runs_on_flower

    require_flower()
    if args.algorithm in ALGORITHMS:  # an unknown name is make_algorithm's to report
        require_runs_on_flower(args.algorithm)
    if args.secure_agg:
        raise ConfigurationError("--secure-agg with --runtime flower-sim: privfl run's secure aggregation holds "
                                 "against an active (malicious) server, and on Flower only the semi-honest variant "
                                 "runs so far (the other needs each SuperNode's identity key registered out of "
                                 "band): drop --secure-agg, or use --runtime inprocess")
    if args.placement == "distributed":
        raise ConfigurationError("--placement distributed needs secure aggregation, which --runtime flower-sim does "
                                 "not run from the command line yet: choose --placement local or central, or use "
                                 "--runtime inprocess")


def _check_flower_sim_run(args, algorithm) -> None:
    """``--runtime flower-sim`` once the algorithm is built: what cannot be shipped to the ClientApps or read back
    from them is refused before the engine starts."""
    from privfl.errors import ConfigurationError
    from privfl.flower.sim import require_one_phase

    require_one_phase(algorithm)
    if getattr(args, "entry_training", None):
        what = " and ".join(sorted(args.entry_training))
        raise ConfigurationError(f"--entry {args.entry} returned your own {what}, Python objects that "
                                 "--runtime flower-sim cannot ship to the ClientApps (they build the model from the "
                                 "run's public spec): use --runtime inprocess, or have the entry return a built-in "
                                 "model's name or settings and no loss or optimizer")
    if args.save_model and getattr(algorithm, "client_state", ()):
        raise ConfigurationError(f"--save-model with --runtime flower-sim: {args.algorithm}'s trained models are "
                                 "the clients' own and stay on their SuperNodes; drop --save-model or use "
                                 "--runtime inprocess")


def _flower_sim_paths(args, n_clients: int) -> tuple[str, str]:
    """(the run's folder, the clients' ledger folder) of a ``--runtime flower-sim`` run; a ledger folder whose
    client ledgers already hold the run id is refused, as a ledger file is in process."""
    from privfl.errors import ConfigurationError
    from privfl.flower.sim import ledger_paths

    flower_dir = args.flower_dir or os.path.join("runs", "flower-sim", args.run_id)
    _check_folder(os.path.abspath(flower_dir), "--flower-dir", flower_dir)
    if os.path.exists(flower_dir) and not os.path.isdir(flower_dir):
        raise ConfigurationError(f"--flower-dir {flower_dir} is a file; give a folder")
    if args.ledger == ":memory:":
        raise ConfigurationError("--ledger :memory: with --runtime flower-sim: each client keeps its own ledger file "
                                 "on its SuperNode; give a folder, or drop --ledger (default: --flower-dir's "
                                 "ledgers)")
    ledger_dir = args.ledger or os.path.join(flower_dir, "ledgers")
    if os.path.isfile(ledger_dir):
        raise ConfigurationError(f"--ledger {ledger_dir} is a file; with --runtime flower-sim --ledger is a folder "
                                 "(client k's own ledger is client<k>.sqlite in it)")
    _check_folder(os.path.abspath(ledger_dir), "--ledger", ledger_dir)
    for path in ledger_paths(ledger_dir, n_clients):
        _check_ledger_file(path, "--ledger")
        from privfl.accounting.ledger import PrivacyLedger

        if args.run_id in PrivacyLedger.charged_run_ids(path):
            raise ConfigurationError(f"--ledger {ledger_dir}: {path} already holds run {args.run_id!r} (the default "
                                     "run id encodes every setting, so this is the same run again): pass a new "
                                     f"--run-id (or another --ledger) to start a new run; privfl audit {ledger_dir} "
                                     f"--run-id {args.run_id} reads the old one")
    return flower_dir, ledger_dir


def _image_input(args, data) -> bool:
    """Whether the run's inputs are images (C, H, W): the own data's shape, or the built-in data set's kind."""
    if data is not None:
        return len(data.input_shape) == 3
    from privfl.data.federated import is_image_dataset

    return is_image_dataset(args.dataset or "mnist5k")


def _build_run(args):
    """What ``privfl run``'s flags describe, resolved and checked before anything is charged: (data, fed, privacy,
    algorithm, whether it runs on Flower's Simulation Engine, whether it is multi-phase, the prior-corrected decision
    rule or None). ``privfl audit-run`` builds its run with it too."""
    from privfl.algorithms import ALGORITHMS, make_algorithm
    from privfl.algorithms.base import is_phased
    from privfl.apps.settings import resolve_settings, resolve_unit
    from privfl.core.config import FederationConfig, PrivacyConfig
    from privfl.data import make_federated
    from privfl.errors import ConfigurationError

    data = _own_data(args)  # None for a built-in data set
    _refuse_ignored_input(args)
    flower = args.runtime == "flower-sim"
    if flower:
        _check_flower_sim(args)
    args.text_options = _text_options(args)
    if args.unit is None:
        args.unit = resolve_unit(args.algorithm, None)
        if math.isfinite(args.epsilon) and args.algorithm in ALGORITHMS:
            print(f"privfl run: privacy unit {args.unit!r} (the default for {args.algorithm}; pass --unit to choose)",
                  file=sys.stderr)
    for key, value in resolve_settings(args.algorithm, vars(args), image=_image_input(args, data)).items():
        setattr(args, key, value)
    built_in = {"dataset": "mnist5k", "clients": 10, "partition": "iid", "alpha": 0.1} if data is None else {}
    for key, value in {"secagg_bits": 48, "dropout": 0.0, "corruption": 0.0, **built_in}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    privacy = PrivacyConfig(epsilon=args.epsilon, delta=args.delta, unit=args.unit, adjacency=args.adjacency,
                            clip=args.clip, clip_quantile=args.clip_quantile,
                            accountant=args.accountant, placement=args.placement, sampling_rate=args.sampling_rate,
                            secure_noise=not args.seeded_noise)
    fed = FederationConfig(rounds=args.rounds, local_epochs=args.local_epochs, batch_size=args.batch_size,
                           lr=args.lr, server_lr=args.server_lr, model=args.model, hidden=args.hidden, pool=args.pool,
                           seed=args.seed, client_size=args.client_size, record_cap=args.record_cap)
    try:
        algorithm = make_algorithm(args.algorithm, fed, privacy, **_algorithm_flag_options(args),
                                   **_entry_model_option(args), **args.text_options)
    except TypeError as exc:  # an --option value of the wrong kind (a string where a number belongs, ...)
        if not args.text_options:
            raise
        raise ConfigurationError(f"--option: {args.algorithm} cannot take "
                                 f"{', '.join(f'{k}={v!r}' for k, v in args.text_options.items())} ({exc})") from None
    if data is not None:
        from privfl.core.public import check_declared_sizes

        check_declared_sizes(data, privacy)  # declared counts with a held-out split: refused before anything
    if flower:
        _check_flower_sim_run(args, algorithm)
    phased = is_phased(algorithm)
    uses_alignment = bool(getattr(algorithm, "uses_alignment", False))
    if uses_alignment and not args.alignment_size:
        raise ConfigurationError(f"{args.algorithm} with these options needs a server-held labelled set held out from "
                                 "every client: add --alignment-size N (FedBNR's kernel distillation: the paper uses "
                                 "about 8% of the data)")
    if args.alignment_size is not None and not uses_alignment:
        users = sorted(n for n, c in ALGORITHMS.items() if getattr(c, "uses_alignment", False))
        raise ConfigurationError(f"--alignment-size applies to algorithms with a public alignment set ({users}, "
                                 f"and fedbnr with --kernel-aggregation distillation); {args.algorithm} has none "
                                 "here: drop the flag")
    if data is None:
        data = make_federated(args.dataset, args.clients, partition=args.partition, alpha=args.alpha, seed=args.seed,
                              alignment_size=args.alignment_size or 0, public_size=args.public_size,
                              standardize=None if args.standardize == "none" else args.standardize)
    elif args.alignment_size is not None or uses_alignment:
        raise ConfigurationError(f"{args.algorithm} needs a public alignment set carved from a built-in data set "
                                 "(--alignment-size); with --data or --entry choose another algorithm")
    from privfl.apps.settings import resolve_prior_correction

    rule = resolve_prior_correction(args.class_prior, algorithm, task=data.test.task, num_classes=data.num_classes,
                                    loss=(getattr(args, "entry_training", None) or {}).get("loss"),
                                    what="--class-prior")
    return data, fed, privacy, algorithm, flower, phased, rule


def cmd_run(args) -> int:
    from privfl.errors import ConfigurationError
    from privfl.runtime.engine import Simulation
    from privfl.apps.trained_model import save_model, trained_model_description

    data, fed, privacy, algorithm, flower, phased, rule = _build_run(args)
    if args.run_id is None:
        args.run_id = default_run_id(args, fed, privacy)
    if flower:
        flower_dir, ledger_dir = _flower_sim_paths(args, len(data.train_parts))
    elif args.ledger and args.ledger != ":memory:":
        _check_folder(os.path.dirname(os.path.abspath(args.ledger)), "--ledger", args.ledger)
        _check_ledger_file(args.ledger, "--ledger")
        from privfl.accounting.ledger import PrivacyLedger

        held = PrivacyLedger.charged_run_ids(args.ledger)  # a run refused before its first charge binds nothing
        ids = [f"{args.run_id}-{name}" for name, _ in algorithm.phase_plan] if phased else [args.run_id]
        taken = [i for i in ids if i in held]
        if taken:
            raise ConfigurationError(f"--ledger {args.ledger} already holds run {taken[0]!r} (the default run id "
                                     "encodes every setting, so this is the same run again): pass a new --run-id (or "
                                     f"another --ledger) to start a new run; privfl audit {args.ledger} --run-id "
                                     f"{taken[0]} reads the old one")
        os.makedirs(os.path.dirname(os.path.abspath(args.ledger)), exist_ok=True)
    if args.save_model:
        _check_out_path(args.save_model, "--save-model")
    if args.json and args.json != "-":
        _check_out_path(args.json, "--json")
    if getattr(algorithm, "clips_to_record_cap", False) and privacy.private and privacy.unit == "client":
        from privfl.core.public import PublicFacts

        cap = PublicFacts.of(data, privacy, fed).record_cap
        print(f"privfl run: {args.algorithm} at --unit client clips each client's sums as if it held at most {cap} "
              f"records (--record-cap{'' if args.record_cap else '; default 4 x the design size'}); the noise grows "
              "with this cap, and a client holding more records is clipped into it (warned)", file=sys.stderr)

    total_rounds = sum(rounds for _, rounds in algorithm.phase_plan) if phased else fed.rounds

    def show(rec):
        m = rec.metrics
        utility = (f"rmse {m['rmse']:.4g}  ece {m.get('ece', float('nan')):.4f}" if "rmse" in m  # regression
                   else f"accuracy {m.get('accuracy', float('nan')):.4f}  "
                        f"balanced accuracy {m.get('balanced_accuracy', float('nan')):.4f}")
        phase = f" [{rec.phase}]" if rec.phase else ""
        print(f"round {rec.round + 1:3d}/{total_rounds}{phase}  {utility}  "
              f"nll {m.get('nll', float('nan')):.4f}  epsilon spent (max) {rec.epsilon_max:.4g}  "
              f"clients {rec.participants}" + (f"  sat out {len(rec.sat_out)}" if rec.sat_out else "")
              + ("  snr " + " ".join(f"{k} {v:.3g}" for k, v in sorted(rec.snr.items())) if rec.snr else "")
              + ("  ABORTED (secure aggregation: nothing revealed)" if rec.aborted else ""),
              file=sys.stderr if args.json == "-" else sys.stdout, flush=True)

    from privfl.privacy.secure import SecureAggregation

    secure = (SecureAggregation(bits=args.secagg_bits, dropout=args.dropout, min_survivors=args.min_survivors,
                                corruption=args.corruption)
              if args.secure_agg else None)
    if secure is not None:
        secure.check(args.clients)  # a threat model no degree and threshold meet is refused before any round
    from privfl.metrics.report import applied_noise

    if flower:
        from privfl.flower.sim import run_simulation_engine

        print(f"privfl run: running on Flower's Simulation Engine ({len(data.train_parts)} virtual SuperNodes on "
              f"Ray, about a minute to start) in {flower_dir}; the clients' own ledgers go to "
              f"{os.path.join(ledger_dir, 'client<k>.sqlite')}", file=sys.stderr, flush=True)
        run = run_simulation_engine(args.algorithm, data, fed, privacy,
                                    {**_algorithm_flag_options(args), **args.text_options}, flower_dir,
                                    run_id=args.run_id, ledger_dir=ledger_dir, secure=secure)
        result, charges, diagnostic, phase_runs = run.result, run.charges(), run.diagnostic_algorithm, []
        for record in [] if args.quiet else result.history:
            show(record)
    else:
        sim = Simulation(algorithm, data, fed, privacy, ledger_path=args.ledger or ":memory:", run_id=args.run_id,
                         progress=None if args.quiet else show, secure=secure)
        result = sim.run()
        charges, diagnostic = sim.ledger.charges(), sim.diagnostic_algorithm
        phase_runs = sim.phase_runs if phased else []
    out = {
        "algorithm": result.algorithm, "dataset": result.dataset, "clients": result.clients,
        "rounds": result.rounds, "epsilon_target": result.epsilon_target, "delta": result.delta,
        "accountant": result.accountant, "noise_multipliers": result.noise_multipliers,
        "accuracy": result.final.get("accuracy"), "final": result.final,
        "accuracy_per_round": [r.metrics.get("accuracy") for r in result.history],
        "epsilon_spent_per_round": [r.epsilon_max for r in result.history],
        "snr_per_round": [dict(r.snr) for r in result.history],
        "clip_per_round": [r.clip for r in result.history] if any(r.clip is not None for r in result.history)
        else None,
        "epsilon_spent_max": result.audit["max_epsilon"],
        "epsilon_spent": {cid: v["epsilon"] for cid, v in result.audit["clients"].items()},
        "ledger": result.ledger, "run_id": result.run_id, "noise": result.noise,
        "balanced_accuracy": result.final.get("balanced_accuracy"), "auroc": result.final.get("auroc"),
        "noise_applied": applied_noise(charges), "privfl_version": version(),
        "settings": _settings(args, fed, privacy, secure), "runtime": args.runtime,
        "model": trained_model_description(diagnostic(), fed, getattr(args, "entry_model", None)),
    }
    if flower:  # each client's own ledger (``privfl audit`` reads the folder, result.ledger, as one run)
        out.update(ledgers=run.ledger_paths, flower_dir=flower_dir)
    if phased:  # every phase's ledger run, noise and final metrics; the epsilon figures are composed over them
        runs = phase_runs
        out.update(algorithm.describe_phases() if callable(getattr(algorithm, "describe_phases", None)) else {})
        out["run_id"] = [p.result.run_id for p in runs]
        out["noise_applied"] = {p.name: applied_noise(p.ledger.charges()) for p in runs}
        out.update({f"{p.name}_final": p.result.final for p in runs[:-1]})
    if args.save_model:  # saved once the JSON is written (below): a model that cannot be saved loses no results
        out["model_path"] = args.save_model
    if rule is not None and len(data.test):  # the declared prior's decisions on the test set (post-processing)
        from privfl.metrics.report import prior_corrected

        out["prior_corrected"] = prior_corrected(rule, diagnostic().predict_proba(data.test), data.test.y)
    if "warning" in result.audit:
        out["warning"] = result.audit["warning"]
    held_out = bool(getattr(data, "test_from_clients", False))
    if held_out:  # the test set is the clients' own records, never charged: the metrics say so (privfl.apps.held_out)
        from privfl.apps.held_out import MARK

        out.update(MARK)
    aborted = _aborted_rounds(out, secure, result.history)
    late = []  # outputs that could not be written after the run was charged: reported, and the command exits 2
    if args.json:
        late.append(_dump_late(out, args.json))
    if args.save_model:
        try:
            save_model(diagnostic(), args.save_model)
        except (OSError, RuntimeError) as exc:  # torch.save reports an unwritable path as a RuntimeError
            late.append(f"--save-model {args.save_model}: the trained model could not be saved ({exc}); the run's "
                        "charges stand in its ledger")
            out["model_path"] = None
            if args.json and late[0] is None:  # the JSON written above named the model's path: corrected
                late[0] = _dump_late(out, args.json)
    if "warning" in result.audit:
        print(f"warning: {result.audit['warning']}", file=sys.stderr)
    if held_out and privacy.private:
        from privfl.apps.held_out import WARNING

        print(f"warning: {WARNING}", file=sys.stderr)
    _warn_aborted(aborted, len(result.history))
    from privfl.metrics.report import one_class_warning

    one_class = one_class_warning(result.final)
    if one_class and rule is None:  # with --class-prior the corrected decisions are reported below
        print(f"warning: {one_class}", file=sys.stderr)
    final = (f"final rmse {result.final['rmse']:.4g}" if "rmse" in result.final
             else f"final accuracy {out['accuracy']:.4f}" if out["accuracy"] is not None
             else "no test records to evaluate")
    if out.get("prior_corrected"):
        corrected = out["prior_corrected"]["metrics"]
        print(f"prior-corrected (--class-prior): balanced accuracy {corrected['balanced_accuracy']:.4f}"
              + (f", recall {corrected['recall']:.4f}, positive rate {corrected['positive_rate']:.4f}"
                 if "recall" in corrected else ""), file=sys.stderr if args.json == "-" else sys.stdout)
    spent = f"max epsilon spent over its {len(phase_runs)} phases" if phased else "max epsilon spent"
    print(f"{final}; {spent} {out['epsilon_spent_max']:.4g} (target {args.epsilon:g}, delta {args.delta:g})",
          file=sys.stderr if args.json == "-" else sys.stdout)
    for problem in filter(None, late):
        print(f"privfl run: error: {problem}", file=sys.stderr)
    if any(late):
        return 2
    if result.history and len(aborted) >= len(result.history):  # a run that trained nothing failed: say so
        print(f"privfl run: error: every round ({len(result.history)}) was aborted by secure aggregation: the model "
              "is the initial one; lower --min-survivors or --dropout, or add clients", file=sys.stderr)
        return 1
    return 0


_OWN_DATA_FLAGS = (("--target", "target"), ("--client-column", "client_column"), ("--client-names", "client_names"),
                   ("--test-data", "test_data"),
                   ("--test-fraction", "test_fraction"), ("--classes", "classes"), ("--task", "task"),
                   ("--public-data", "public_data"))


def _own_data(args):
    """The federation of ``--data`` files or an ``--entry`` point (None without either): sets ``args.clients`` to
    the clients found and the model settings an entry point returned (unless given on the command line)."""
    from privfl.data.own import client_tables, federated_from_tables, load_entry, read_table
    from privfl.errors import ConfigurationError

    if isinstance(args.data, list):  # the shell's expansion of clients/*.csv, or one path or quoted glob
        args.data = args.data[0] if len(args.data) == 1 else list(args.data)
    if args.data is None and args.entry is None:
        given = [flag for flag, key in _OWN_DATA_FLAGS if getattr(args, key) is not None]
        if given:
            raise ConfigurationError(f"{', '.join(given)} describe your own data: add --data FILES (or --entry "
                                     "module:function), or drop them")
        return None
    if args.data is not None and args.entry is not None:
        raise ConfigurationError("--data and --entry both give the clients' data; choose one")
    if args.dataset is not None:
        raise ConfigurationError(f"--dataset {args.dataset} and {'--data' if args.data else '--entry'} both give "
                                 "the data; choose one")
    if args.partition is not None:
        raise ConfigurationError("--partition splits a built-in data set; your own data comes split by client "
                                 "(one file per client, --client-column, or the entry point's mapping): drop it")
    if args.data is not None and args.target is None:
        raise ConfigurationError("--data needs --target, the name of the label (or regression target) column")
    if args.standardize == "public" and args.public_data is None:
        raise ConfigurationError("--standardize public with your own data needs --public-data FILE: data no client "
                                 "holds, whose statistics are public (nothing is fitted on the clients' data)")
    if args.public_size is not None:
        raise ConfigurationError("--public-size carves a public split from a built-in data set; with your own data "
                                 "pass --public-data FILE")
    if args.test_data is not None and args.test_fraction is not None:
        raise ConfigurationError("--test-fraction holds out part of each client's records when there is no "
                                 "--test-data; give one of them")
    standardize = "public" if args.public_data is not None and args.standardize != "none" else None
    if standardize is None and args.standardize == "auto":
        print("privfl run: features are used as given (no standardisation): pass --public-data FILE (data no client "
              "holds) to standardise them with public statistics, or --standardize none to silence this",
              file=sys.stderr)
    if args.client_names is not None and args.client_column is None:
        raise ConfigurationError("--client-names declares the clients of one file split by --client-column; with one "
                                 "file per client the files name the clients: drop it, or add --client-column")
    if args.client_column is not None and args.client_names is None and math.isfinite(args.epsilon):
        # the roster found in the data would make the client count, order and run id a function of the records
        raise ConfigurationError(f"--client-column {args.client_column!r} in a private run needs the clients "
                                 "declared: add --client-names a,b,c (every client, in the run's order); the "
                                 "clients are never taken from the values found in the rows")
    if args.data is not None:
        clients = client_tables(args.data, args.client_column, names=args.client_names)
        test = None if args.test_data is None else read_table(args.test_data, "--test-data")
        name = "own"
    else:
        if args.client_column is not None:
            raise ConfigurationError("--client-column applies to --data files; an --entry point returns a mapping of "
                                     "clients already")
        entry = load_entry(args.entry)
        args.entry_model = entry.module
        args.entry_training = entry.training
        for key, value in entry.model.items():
            if getattr(args, key) is None:
                setattr(args, key, tuple(value) if key == "hidden" else value)
        clients = entry.clients
        test = read_table(args.test_data, "--test-data") if args.test_data is not None else entry.test
        name = args.entry
    public = None if args.public_data is None else read_table(args.public_data, "--public-data")
    classes = None if args.classes is None else [c.strip() for c in args.classes.split(",") if c.strip()]
    data = federated_from_tables(clients, args.target, task=args.task or "classification", classes=classes,
                                 test=test, test_fraction=0.2 if args.test_fraction is None else args.test_fraction,
                                 seed=args.seed, standardize=standardize, public=public, name=name)
    if args.clients is not None and args.clients != len(data.train_parts):
        raise ConfigurationError(f"--clients {args.clients} but the data has {len(data.train_parts)} clients "
                                 f"({', '.join(data.info['clients'][:8])}); drop --clients")
    args.clients = len(data.train_parts)
    return data


def _refuse_ignored_input(args) -> None:
    """Flags that would be silently ignored are refused, with the flag to drop or the one to add."""
    from privfl.errors import ConfigurationError

    if args.clients is not None and args.clients < 2:
        raise ConfigurationError(f"--clients {args.clients}: a federation needs at least 2 clients (one client is "
                                 "centralised training, with nothing to aggregate); set --clients 2 or more")
    if not args.secure_agg:
        given = [flag for flag, value in (("--dropout", args.dropout), ("--min-survivors", args.min_survivors),
                                          ("--secagg-bits", args.secagg_bits), ("--corruption", args.corruption))
                 if value is not None]
        if given:
            raise ConfigurationError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only under "
                                     "secure aggregation; add --secure-agg or drop "
                                     f"{'it' if len(given) == 1 else 'them'}")
    if args.flower_dir is not None and args.runtime != "flower-sim":
        raise ConfigurationError("--flower-dir applies with --runtime flower-sim only; add it or drop --flower-dir")
    if args.alpha is not None and args.partition != "dirichlet":
        raise ConfigurationError(f"--alpha is the Dirichlet concentration; it applies with --partition dirichlet "
                                 f"only (got --partition {args.partition}): drop it or change the partition")


def default_run_id(args, fed, privacy) -> str:
    """``<algorithm>-<unit>-eps<epsilon>-seed<seed>-<hash>``: readable where runs usually differ, and a hash of every
    other setting (data, partition, rounds, model, clip, lr, options, secure aggregation; not privfl's version), so
    that two runs differing in anything get different ids and the same run twice gets the same one."""
    import hashlib

    settings = _settings(args, fed, privacy, True if args.secure_agg else None)
    settings.pop("privfl_version", None)
    settings["federation"].pop("seed", None)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:8]
    unit = privacy.unit if privacy.private else "nonprivate"
    return f"{args.algorithm}-{unit}-eps{privacy.epsilon:g}-seed{fed.seed}-{digest}"


def _settings(args, fed, privacy, secure) -> dict:
    """Everything that defines a run, for its JSON: the algorithm and its options, the federation (model, clip, lr,
    batch, rounds, seed...), the privacy configuration, the data and partition, secure aggregation, privfl's
    version."""
    from dataclasses import asdict

    from privfl.algorithms import ALGORITHMS
    from privfl.apps.trained_model import USER_MODEL_ROLES, user_model_description
    from privfl.core.config import privacy_settings

    options = {k: getattr(args, k, None) for k in getattr(ALGORITHMS.get(args.algorithm), "defaults", {})}
    data = {"dataset": args.dataset, "clients": args.clients, "partition": args.partition or "given",
            "alpha": args.alpha if args.partition == "dirichlet" else None, "standardize": args.standardize,
            "public_size": args.public_size, "alignment_size": args.alignment_size}
    for key in ("data", "target", "client_column", "client_names", "test_data", "test_fraction", "classes", "task",
                "public_data", "entry"):
        if getattr(args, key, None) is not None:
            data[key] = getattr(args, key)
    out = {"algorithm": args.algorithm, "algorithm_options": options, "federation": asdict(fed),
           "privacy": privacy_settings(privacy), "data": data, "privfl_version": version(),
           "secure_aggregation": None if secure is None else {"bits": args.secagg_bits, "dropout": args.dropout,
                                                               "min_survivors": args.min_survivors,
                                                               "corruption": args.corruption}}
    out["algorithm_options"].update(_algorithm_flag_options(args))
    out["algorithm_options"].update(getattr(args, "text_options", None) or {})
    user = getattr(args, "entry_model", None)
    if user is not None:  # the user's own module ran, not the built-in architecture the federation names
        role = USER_MODEL_ROLES.get(args.algorithm, "the trained model")
        out["user_model"] = {**user_model_description(user), "source": f"--entry {args.entry}", "role": role}
        if args.algorithm not in USER_MODEL_ROLES:
            out["federation"].update(model="own (see user_model)", hidden=None, pool=None)
    for key in ("loss", "optimizer", "metrics"):
        given = (getattr(args, "entry_training", None) or {}).get(key)
        if given is not None:  # the entry's own loss, optimizer or metrics: named, as a run's settings
            out.setdefault("user_training", {})[key] = (sorted(given) if key == "metrics"
                                                        else getattr(given, "__qualname__", type(given).__name__))
    if getattr(args, "runtime", "inprocess") != "inprocess":  # its own ledgers: a run of its own
        out["runtime"] = args.runtime
    return out


def _aborted_rounds(out: dict, secure, history, offset: int = 0) -> list[int]:
    """The rounds (0-based, shifted by ``offset``) secure aggregation aborted; under ``--secure-agg`` also the JSON key
    ``aborted_rounds``."""
    aborted = sorted(set(out.get("aborted_rounds", [])) | {offset + r.round for r in history if r.aborted})
    if secure is not None:
        out["aborted_rounds"] = aborted
    return aborted


def _warn_aborted(aborted: list[int], rounds: int) -> None:
    if aborted:
        print(f"warning: {len(aborted)} of {rounds} rounds were aborted by secure aggregation (too few clients or "
              f"survivors: nothing was revealed and the model did not change in them; their privacy charges stand in "
              f"the ledger)", file=sys.stderr)


# -- audit -------------------------------------------------------------------------------------------------------

#: what the audit's rho means when clients were sampled (the epsilon column counts the amplification, rho does not)
RHO_SAMPLED_NOTE = ("clients were sampled (Poisson), and rho is the zCDP of each client's releases as if every one "
                    "had happened, without amplification by sampling: a valid but loose upper bound, whose zCDP "
                    "conversion can exceed the epsilon column. Epsilon (the run's accountant, with amplification) is "
                    "the guarantee; rho is only comparable between unsampled runs")


def _sampled(event: dict) -> bool:
    """Whether a privacy event (as ``to_dict()``) contains a Poisson-sampled release, at any depth."""
    if isinstance(event, dict):
        rate = event.get("sampling_rate")
        if isinstance(rate, (int, float)) and rate < 1:
            return True
        return any(_sampled(v) for v in event.values())
    if isinstance(event, (list, tuple)):
        return any(_sampled(v) for v in event)
    return False


def cmd_audit(args) -> int:
    from privfl.accounting.ledger import PrivacyLedger

    if os.path.isdir(args.ledger):
        return _audit_folder(args)
    held = _check_ledger_file(args.ledger, "ledger")
    if args.run_id is not None and args.run_id not in held and os.path.isfile(args.ledger):
        from privfl.runtime.phases import phase_runs_of

        phases = phase_runs_of(args.ledger, args.run_id, held)
        if phases:  # a multi-phase run: its phases' ledger runs, composed per client
            return _audit_phases(args, phases)
    if os.path.isfile(args.ledger) and (args.run_id is not None and args.run_id not in held
                                        or args.run_id is None and len(held) > 1):
        from privfl.errors import ConfigurationError

        runs = ", ".join(held) if held else "none"
        raise ConfigurationError(f"{args.ledger} holds the runs [{runs}]" + (
            f", not {args.run_id!r}" if args.run_id is not None else "") + "; pass --run-id with one of them")
    if args.png:
        _check_out_path(args.png, "--png", create_folder=False)
    try:
        ledger = PrivacyLedger.open_existing(args.ledger, args.run_id)
    except sqlite3.DatabaseError as exc:
        from privfl.errors import ConfigurationError

        raise ConfigurationError(f"{args.ledger} is not a readable privfl ledger (SQLite: {exc})") from None
    report = ledger.audit(args.delta)
    sampled = any(_sampled(charge.event.to_dict()) for charge in ledger.charges())
    return _show_audit(args, report, sampled, ledger.meta, ledger.epsilon_by_round)


def _audit_folder(args) -> int:
    """``privfl audit DIR``: the per-client ledgers (``client<k>.sqlite``) of a ``--runtime flower-sim`` run, each
    client's own, composed into one report (each client's epsilon is its own ledger's)."""
    from privfl.errors import ConfigurationError
    from privfl.flower.sim import client_ledgers, ledger_meta, merged_audit, merged_charges, merged_epsilon_by_round

    paths = client_ledgers(args.ledger)
    if not paths:
        raise ConfigurationError(f"{args.ledger} is a directory holding no per-client ledger (client<k>.sqlite); "
                                 "pass the ledger file privfl run --ledger wrote, or the ledger folder of a "
                                 "--runtime flower-sim run")
    held: list[str] = []
    for path in paths:
        held += [run for run in _check_ledger_file(path, "ledger") if run not in held]
    if args.run_id is not None and args.run_id not in held or args.run_id is None and len(held) != 1:
        raise ConfigurationError(f"the ledgers in {args.ledger} hold the runs [{', '.join(held) or 'none'}]" + (
            f", not {args.run_id!r}" if args.run_id is not None else "") + "; pass --run-id with one of them")
    run_id = args.run_id or held[0]
    if args.png:
        _check_out_path(args.png, "--png", create_folder=False)
    report = merged_audit(paths, run_id, args.delta)
    sampled = any(_sampled(charge.event.to_dict()) for charge in merged_charges(paths, run_id))
    return _show_audit(args, report, sampled, ledger_meta(paths, run_id),
                       lambda delta: merged_epsilon_by_round(paths, run_id, delta))


def _show_audit(args, report: dict, sampled: bool, meta: dict, epsilon_by_round) -> int:
    """Print (or dump as JSON) one run's audit, and plot it with ``--png``."""
    if sampled:
        report["rho_note"] = RHO_SAMPLED_NOTE
    if meta.get("noise"):
        report["noise"] = meta["noise"]
    # the trust assumption every charge of the run holds under (recorded by the runtime before the first charge);
    # a ledger written before it was recorded says so
    report["trust"] = meta.get("trust", "not recorded (a ledger written before privfl recorded trust assumptions)")
    if meta.get("warning"):
        report["warning"] = meta["warning"]
    if args.json:
        _dump(report, None)
    else:
        print(f"ledger {args.ledger}  run {report['run_id']}  accountant {report['accountant']}  "
              f"delta {report['delta']:g}  budget {report['epsilon_budget']:g}")
        rho_header = "rho*" if sampled else "rho"
        print(f"{'client':>8} {'epsilon':>12} {rho_header:>12} {'releases':>9} {'charges':>8}")
        for cid, v in report["clients"].items():
            rho = "n/a" if v["rho"] is None else f"{v['rho']:.6g}"
            print(f"{cid:>8} {v['epsilon']:>12.6g} {rho:>12} {v['releases']:>9d} {v['charges']:>8d}")
        print(f"max epsilon {report['max_epsilon']:.6g}")
        print(f"trust: {report['trust']}")
        if sampled:
            print(f"rho*: {report['rho_note']}")
        if "warning" in report:
            print(f"warning: {report['warning']}")
    if args.png:
        from privfl.apps.plots import plot_epsilon_per_client

        plot_epsilon_per_client(epsilon_by_round(args.delta), args.png, delta=report["delta"],
                                budget=report["epsilon_budget"])
        if not args.json:
            print(f"wrote {args.png}")
    return 0


def _audit_phases(args, phases) -> int:
    """``privfl audit`` of a multi-phase run (``privfl.runtime.phases``): each client's epsilon composed over every phase's
    ledger run, with each phase's own beside it."""
    from privfl.errors import ConfigurationError
    from privfl.runtime.phases import composed_audit

    try:
        if args.png:
            raise ConfigurationError(f"--png plots one ledger run; {args.run_id} is a multi-phase run: pass --run-id "
                                     f"with one of its phases ({', '.join(p.run_id for p in phases.values())})")
        first = next(iter(phases.values()))
        meta = first.meta
        report = composed_audit(phases, args.run_id, first.delta if args.delta is None else args.delta,
                                first.accountant, meta.get("epsilon_target", math.nan))
        if any(_sampled(c.event.to_dict()) for ledger in phases.values() for c in ledger.charges()):
            report["rho_note"] = RHO_SAMPLED_NOTE
    finally:
        for ledger in phases.values():
            ledger.close()
    for key in ("noise", "warning"):
        if meta.get(key):
            report[key] = meta[key]
    if args.json:
        _dump(report, None)
        return 0
    print(f"ledger {args.ledger}  run {args.run_id} (phases {', '.join(report['runs'])})  accountant "
          f"{report['accountant']}  delta {report['delta']:g}  budget {report['epsilon_budget']:g}")
    names = list(phases)
    print(f"{'client':>8} {'epsilon':>12} " + " ".join(f"{n:>12}" for n in names) + f" {'releases':>9} {'charges':>8}")
    for cid, v in report["clients"].items():
        print(f"{cid:>8} {v['epsilon']:>12.6g} " + " ".join(f"{v['phase_epsilons'].get(n, 0.0):>12.6g}" for n in names)
              + f" {v['releases']:>9d} {v['charges']:>8d}")
    print(f"max epsilon {report['max_epsilon']:.6g} (composed over the phases)")
    if "warning" in report:
        print(f"warning: {report['warning']}")
    return 0


def cmd_compare(args) -> int:
    from dataclasses import replace

    from privfl.apps.compare import CompareConfig, compare, summary_table

    config = CompareConfig.from_toml(args.config) if args.config else CompareConfig()
    if args.out_dir:
        config = replace(config, out_dir=args.out_dir)
    _check_folder(os.path.abspath(config.out_dir), "--out-dir" if args.out_dir else "out_dir", config.out_dir)
    if args.json and args.json != "-":
        _check_out_path(args.json, "--json")
    rows = compare(config, progress=not args.quiet, toml_path=args.config)
    table = summary_table(rows)
    from rich.console import Console
    from rich.table import Table

    source = (f"{config.data or config.entry}, {config.clients} clients" if config.own_data else
              f"{config.dataset}, {config.clients} clients, {config.partition}"
              f"{f' alpha={config.alpha:g}' if config.partition == 'dirichlet' else ''}")
    # a row's own unit where it is not the grid's (dp_fedavg is client-level by construction)
    other_units = sorted({(r["algorithm"], r["unit"]) for r in rows if r.get("unit") not in (None, config.unit)})
    units = f"unit={config.unit}" + (f" ({', '.join(f'{a}: {u}' for a, u in other_units)})" if other_units else "")
    # the rounds each row ran ([overrides.<algorithm>] rounds may differ from the grid's): in the title only when
    # every row ran the same number, else in a column of their own
    ran = {str(r["rounds"]) for r in table}
    rounds = f"{ran.pop()} rounds, " if len(ran) == 1 else ""
    t = Table(title=f"privfl compare: {source}, {rounds}{units}, delta={config.delta:g}")
    columns = ("algorithm", "ε target", "seeds", *(("rounds",) if not rounds else ()), "accuracy", "balanced acc.",
               "AUROC", "NLL", "ECE", "sel. acc.", "SNR", "ε spent max", "ε spent mean")
    for col in columns:
        t.add_column(col, justify="left" if col == "algorithm" else "right")
    for r in table:
        t.add_row(r["algorithm"], f"{r['epsilon_target']:g}", str(r["seeds"]),
                  *((str(r["rounds"]),) if not rounds else ()),
                  f"{r['accuracy']:.4f} ± {r['accuracy_std']:.4f}", f"{r['balanced_accuracy']:.4f}",
                  f"{r['auroc']:.4f}", f"{r['nll']:.3f}", f"{r['ece']:.3f}",
                  "-" if math.isnan(r.get("selective_accuracy", math.nan)) else f"{r['selective_accuracy']:.4f}",
                  "-" if math.isnan(r.get("snr_median", math.nan)) else f"{r['snr_median']:.3g}",
                  f"{r['epsilon_spent_max']:.3f}", f"{r['epsilon_spent_mean']:.3f}")
    Console(width=160).print(t)
    print(f"wrote {config.out_dir}/results.json, results.csv, accuracy_vs_epsilon.png, epsilon_per_client.png, "
          f"reliability.png, config.toml, models/")
    if args.json:
        _dump({"results": rows}, args.json)
    over = [r for r in rows if r["epsilon_spent_max"] > r["epsilon_target"] * (1 + 1e-9)]
    if over:
        print(f"ERROR: {len(over)} run(s) spent more than their target", file=sys.stderr)
        return 1
    return 0


def cmd_audit_mechanism(args) -> int:
    from privfl.apps.empirical_audit import audit_gaussian_release

    result = audit_gaussian_release(args.noise_multiplier, delta=args.delta, trials=args.trials,
                                    mutation=args.mutation, seed=args.seed)
    if args.json:
        _dump(result.to_dict(), None)
    else:
        verdict = "consistent with" if result.passed else "VIOLATES"
        print(f"empirical epsilon lower bound {result.epsilon_lower_bound:.4g} vs claimed {result.claimed_epsilon:.4g} "
              f"(delta {result.delta:g}, {result.trials} trials, mutation {result.mutation}): {verdict} the claim")
    # without a mutation the claim must hold; with one, the audit must catch it (a CI step that runs a mutation
    # fails when the audit missed it)
    return (0 if result.passed else 1) if args.mutation == "none" else (1 if result.passed else 0)


def cmd_audit_run(args) -> int:
    """``privfl audit-run``: the run ``privfl run`` would make with these flags, with client canaries in it, and the
    one-run lower bound on epsilon beside the ledger's (``privfl.apps.run_audit``)."""
    from privfl.apps.run_audit import audit_run
    from privfl.errors import ConfigurationError

    if args.runtime != "inprocess":
        raise ConfigurationError("audit-run runs in process: drop --runtime (or give --runtime inprocess)")
    secure_flags = ["--secure-agg"] if args.secure_agg else []
    secure_flags += [flag for flag, value in (("--dropout", args.dropout), ("--min-survivors", args.min_survivors),
                                              ("--secagg-bits", args.secagg_bits), ("--corruption", args.corruption))
                     if value is not None]
    if secure_flags:  # audited silently without them until now: another run than `privfl run` would make
        raise ConfigurationError(f"audit-run audits runs without secure aggregation (its canaries are read from the "
                                 f"sums in the clear): drop {', '.join(secure_flags)}, or audit the run with central "
                                 "placement (--placement central)")
    if args.canaries > MAX_CANARIES:  # each canary has a coordinate of the model's own: far fewer fit any model
        raise ConfigurationError(f"--canaries {args.canaries} is above {MAX_CANARIES}: each canary takes a block of "
                                 "the model's coordinates of its own; lower --canaries (the default is 200)")
    if args.json and args.json != "-":
        _check_out_path(args.json, "--json")
    data, fed, privacy, algorithm, _, phased, _ = _build_run(args)
    if phased:
        raise ConfigurationError(f"audit-run audits a one-phase run; {args.algorithm} with these options has phases")
    result = audit_run(algorithm, data, fed, privacy, canaries=args.canaries, fault=args.fault,
                       significance=args.significance, ledger_path=args.ledger or ":memory:", run_id=args.run_id)
    out = result.to_dict()
    late = _dump_late(out, None if args.json == "-" else args.json) if args.json else None
    if late is not None:  # the results went to stderr instead
        print(f"privfl audit-run: error: {late}", file=sys.stderr)
        return 2
    if args.json != "-":
        verdict = ("ABOVE the ledger's: the run leaked more than it charged" if result.violated
                   else "below the ledger's, as it must be")
        print(f"one-run epsilon lower bound {result.epsilon_lower_bound:.4g} ({result.correct} of {result.guesses} "
              f"guesses right, {result.canaries} canaries, {result.included} included, fault {result.fault}) vs the "
              f"ledger's epsilon {result.epsilon_ledger:.4g}: {verdict}")
    return 1 if result.violated and args.fault == "none" else 0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none to show (``None``, a switch's ``False``)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _parser(sub, name: str, **kw) -> argparse.ArgumentParser:
    return sub.add_parser(name, formatter_class=_HelpFormatter, **kw)


def _add_run_flags(r: argparse.ArgumentParser) -> None:
    """``privfl run``'s flags (``privfl audit-run`` takes the same)."""
    r.add_argument("--algorithm", default="dp_fedavg", metavar="NAME",
                   help=f"the algorithm, one of {', '.join(ALGORITHM_NAMES)}")
    r.add_argument("--dataset", default=None,
                   help=f"built-in data set: one of {', '.join(DATASET_NAMES)} (see the README's data sets; "
                        "default mnist5k)")
    r.add_argument("--clients", type=int, default=None,
                   help="number of clients, at least 2 (default 10; with --data or --entry: the clients found)")
    r.add_argument("--data", default=None, nargs="+", metavar="FILE",
                   help="your own data instead of --dataset: CSV or Parquet files, one per client (clients/*.csv as "
                        "the shell expands it, a list of files, or a quoted glob such as 'clients/*.csv'; a file's "
                        "name is its client's), or one file with --client-column (default: none, a built-in "
                        "--dataset)")
    r.add_argument("--target", default=None, metavar="COLUMN",
                   help="with --data: the label (or target) column (no default: required with --data)")
    r.add_argument("--client-column", default=None, metavar="COLUMN",
                   help="with --data FILE: the column saying whose record each row is; every row must have one "
                        "(default: none, one file per client)")
    r.add_argument("--client-names", type=_names, default=None, metavar="A,B,...",
                   help="with --client-column: the clients, comma-separated, in the run's order (a public fact: "
                        "required for a private run, whose clients are never taken from the values in the rows; a "
                        "row naming another client is an error) (default: none, the values found, sorted, for a "
                        "non-private run only)")
    r.add_argument("--entry", default=None, metavar="MODULE:FUNCTION",
                   help="your own data from Python: a function returning (model, clients), (model, clients, "
                        "test) or a dict with the keys clients (required), model, test, loss, optimizer, metrics; "
                        "model: a built-in model name, {'model', 'hidden', 'pool'} settings, None, or your own "
                        "torch.nn.Module (or a factory of one); clients: name -> (x, y) arrays/tensors or a DataFrame "
                        "with the --target column; loss, optimizer, metrics: as privfl.federate takes them (e.g. "
                        "'optimizer': lambda p: torch.optim.Adam(p, lr=1e-3)) (default: none)")
    r.add_argument("--test-data", default=None, metavar="FILE",
                   help="with --data/--entry: held-out test set (CSV/Parquet, no client's data); its labels are the "
                        "label set unless --classes is given (default: none, see --test-fraction)")
    r.add_argument("--test-fraction", type=_float, default=None,
                   help="with --data/--entry and no --test-data: each client holds out this share of its own records "
                        "in expectation, each record on a coin of its own (a hash of the record keyed by --seed: "
                        "adding or removing a record moves no other), as the pooled test set (default 0.2)")
    r.add_argument("--classes", default=None, metavar="A,B,...",
                   help="with --data/--entry: the public label set, comma-separated (never read from the clients' "
                        "labels; default: the labels of --test-data)")
    r.add_argument("--class-prior", type=_floats, default=None, metavar="P0,P1,...",
                   help="the classes' base rates in the clients' data, a public fact you declare (a published "
                        "prevalence, a public reference sample), comma-separated in label order, e.g. 0.96,0.04: the "
                        "run also reports the balanced, prior-corrected decisions of its final model (argmax of "
                        "p(y|x) / the training prior, class weights included; post-processing, no privacy cost) "
                        "under prior_corrected (default: none, the argmax)")
    r.add_argument("--task", choices=["classification", "regression"], default=None,
                   help="with --data/--entry: the task (default classification)")
    r.add_argument("--public-data", default=None, metavar="FILE",
                   help="with --data/--entry: public data no client holds (same columns); features are standardised "
                        "with its statistics (--standardize public; the default when given)")
    r.add_argument("--rounds", type=int, default=20, help="federated rounds")
    r.add_argument("--epsilon", type=_float, default=3.0, help="per-client target; inf for a non-private run")
    r.add_argument("--delta", type=_float, default=1e-5, help="per-client target delta")
    r.add_argument("--ledger", default=None, help="SQLite ledger path (default: in memory); a ledger that already "
                                                 "holds the run id is refused. With --runtime flower-sim a folder: "
                                                 "client k's own ledger is DIR/client<k>.sqlite (default: "
                                                 "--flower-dir's ledgers)")
    r.add_argument("--run-id", default=None,
                   help="run id in the ledger (default: <algorithm>-<unit>-eps<epsilon>-seed<seed>-<hash of every "
                        "other setting>: runs that differ in anything get different ids)")
    r.add_argument("--json", default=None, metavar="OUT",
                   help="write results as strict JSON to OUT ('-' for stdout): infinite numbers (a non-private "
                        "run's epsilon) are the string \"inf\", undefined ones (NaN) null (default: not written)")
    r.add_argument("--save-model", default=None, metavar="PATH",
                   help="save the trained model with torch.save: the global model's state_dict (FedBNN: one per "
                        "client, {'client_<k>': state_dict}) (default: not saved)")
    r.add_argument("--partition", default=None, choices=["iid", "dirichlet", "disjoint_class", "sorted_chunk"],
                   help="how a built-in data set is split over clients (default iid)")
    r.add_argument("--alpha", type=_float, default=None,
                   help="Dirichlet concentration, with --partition dirichlet only (default 0.1)")
    r.add_argument("--unit", default=None, choices=["client", "example"],
                   help=f"privacy unit (default: the algorithm's: example for {' and '.join(RECORD_LEVEL_ALGORITHMS)}, "
                        "client otherwise; the choice is printed)")
    r.add_argument("--adjacency", default="add_remove", choices=["add_remove", "replace_one"],
                   help="neighbouring relation; at --unit example, replace_one declares the clients' record counts "
                        "public (schedules and weights may use them; every event is accounted as replace-one)")
    r.add_argument("--clip", type=_clip, default=None,
                   help="clip bound C (default: the algorithm's), or 'adaptive': the clip starts at the algorithm's "
                        "default and tracks a quantile of the norms it clips, released with noise and charged in "
                        "every ledger (Andrew et al. 2021; algorithms that take it: dp_fedavg, dp_fedsgd, dpsgd_fedavg)")
    r.add_argument("--clip-quantile", type=_float, default=None,
                   help="with --clip adaptive: the quantile of the norms the clip tracks, in (0, 1) (default 0.5)")
    r.add_argument("--accountant", choices=["exact", "pld", "rdp", "zcdp"], default=None,
                   help="accountant (default: the privacy configuration's choice for the unit and sampling)")
    r.add_argument("--placement", choices=["local", "central", "distributed"], default="central",
                   help="who adds the noise: each client (local), a trusted aggregator (central), or each client a "
                        "discrete Gaussian share under secure aggregation (distributed)")
    r.add_argument("--min-survivors", type=int, default=None,
                   help="secure aggregation: abort a round with fewer survivors (distributed noise is charged for it) "
                        "(default: the protocol's Shamir threshold)")
    r.add_argument("--sampling-rate", type=_float, default=1.0, help="Poisson client sampling rate per round")
    r.add_argument("--secure-noise", action="store_true",
                   help="draw noise from the OS CSPRNG (the default; kept for scripts that pass it)")
    r.add_argument("--seeded-noise", action="store_true",
                   help="draw the noise from --seed (reproducible experiments only: the run is then not private "
                        "against anyone who knows the seed, and the ledger and audit say so)")
    r.add_argument("--client-size", type=int, default=None, metavar="N",
                   help="public design size of a client's data (DP-SGD's sampling rate and steps when record counts "
                        "are private): required for a private run on your own data (--data, --entry), never computed "
                        "from the clients' records; a built-in data set's default is its training size over --clients")
    r.add_argument("--record-cap", type=int, default=None, metavar="N",
                   help="public cap on a client's records for quantisation ranges, and fedbnr's client-level clip "
                        "(--unit client: each client's sums are clipped as if it held N records) (default 4 x the "
                        "design size)")
    r.add_argument("--standardize", choices=["auto", "public", "none"], default="auto",
                   help="feature/target standardisation from public statistics only: 'public' fits it on a public "
                        "reference split held by no client; 'auto' is the data set's default")
    r.add_argument("--public-size", type=int, default=None, metavar="N",
                   help="size of the public reference split used by --standardize public (default: 5%% of the data "
                        "set, at least 20)")
    r.add_argument("--secure-agg", action="store_true", help="aggregate through pairwise-masked secure aggregation")
    r.add_argument("--secagg-bits", type=int, default=None,
                   help="secure aggregation: bits of the integer ring 2^k (default 48)")
    r.add_argument("--dropout", type=_float, default=None,
                   help="secure aggregation: simulated fraction of clients dropping per round (default 0)")
    r.add_argument("--corruption", type=_float, default=None,
                   help="secure aggregation: declared fraction of clients that may collude with the server; sets the "
                        "graph's degree and threshold, and distributed noise is planned for the honest shares only "
                        "(default 0)")
    r.add_argument("--model", default=None,
                   help=f"model architecture: one of {', '.join(MODEL_NAMES)} (default mlp, or the --entry "
                        "point's)")
    r.add_argument("--hidden", type=_widths, default=None,
                   help="MLP hidden widths, comma-separated ('' for logistic regression); default: the model's")
    r.add_argument("--pool", type=int, default=None,
                   help="average-pool image inputs by this factor (MLP only) (default: the algorithm's on image "
                        "inputs, 2 for dp_fedavg and dp_fedsgd; 1, none, otherwise and on tabular data)")
    r.add_argument("--local-epochs", type=int, default=None, help="local epochs per round (default: the algorithm's)")
    r.add_argument("--batch-size", type=int, default=32, help="local batch size")
    r.add_argument("--lr", type=_float, default=None, help="client learning rate (default: the algorithm's)")
    r.add_argument("--server-lr", type=_float, default=1.0, help="server learning rate on the aggregated update")
    r.add_argument("--kernel-rounds", type=int, default=0, metavar="K",
                   help="fedbnr: K rounds of phase 1 (kernel learning) before phase 2 (0: fixed features, a linear "
                        "block beside random Fourier features; --option linear_share=0 for the paper's pure random "
                        "features)")
    r.add_argument("--kernel-aggregation", choices=["fedavg", "distillation"], default="fedavg",
                   help="fedbnr phase 1: FedAvg of the kernel network, or kernel distillation on a server-held set "
                        "of --alignment-size examples (eq. 19)")
    r.add_argument("--kernel-clip", type=_float, default=0.05,
                   help="fedbnr phase 1 under DP: client-level clip of the weight change (fedavg aggregation)")
    r.add_argument("--alignment-size", type=int, default=None, metavar="N",
                   help="public alignment set of N training examples, held out from every client (fedbnn; default "
                        "the algorithm's)")
    r.add_argument("--option", action="append", default=None, metavar="KEY=VALUE",
                   help="an option of the algorithm (repeatable), e.g. --option meme_lr=0.01 --option "
                        "budget_shares=[0.6,0.4] (hbfl): VALUE is read as JSON where it is JSON (numbers, "
                        "true/false, lists, objects), else as a string; the options enter the run id (default: the "
                        "algorithm's own)")
    r.add_argument("--runtime", choices=RUNTIMES, default="inprocess",
                   help="inprocess: the clients run one after another in this process; flower-sim: the same "
                        "federation on Flower's Simulation Engine (one virtual SuperNode per client on Ray; needs "
                        f"{_FLOWER_INSTALL}), each client charging its own ledger, --ledger DIR/client<k>.sqlite "
                        "(privfl audit DIR reads them together)")
    r.add_argument("--flower-dir", default=None, metavar="DIR",
                   help="with --runtime flower-sim: where the run's files go (each client's data file, the Flower "
                        "app, Flower's logs and, without --ledger, the clients' ledgers in DIR/ledgers) (default "
                        "runs/flower-sim/<run id>)")
    r.add_argument("--seed", type=int, default=0, help="seed of the data split, initialisation and sampling")
    r.add_argument("--quiet", action="store_true", help="no per-round progress")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="privfl", description="Privacy-first federated learning.",
                                formatter_class=_HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}", help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True)

    c = _parser(sub, "calibrate", help="smallest noise multiplier meeting (epsilon, delta) over R rounds")
    c.add_argument("--epsilon", type=_float, required=True, help="target epsilon per client (> 0)")
    c.add_argument("--delta", type=_float, default=1e-5, help="target delta, in (0, 1)")
    c.add_argument("--rounds", type=int, required=True, help="number of releases composed (one per round)")
    c.add_argument("--sampling-rate", type=_float, default=1.0,
                   help="Poisson client sampling rate q in (0, 1]; q < 1 amplifies privacy")
    c.add_argument("--accountant", choices=["exact", "pld", "rdp", "zcdp"], default=None,
                   help="accountant (default: exact without sampling, pld with sampling)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=cmd_calibrate)

    r = _parser(sub, "run", help="run a federation and write its results and ledger")
    _add_run_flags(r)
    r.set_defaults(func=cmd_run)

    u = _parser(sub, "audit-run", help="audit a real run in that one run: canaries in the training, a lower bound "
                                       "on epsilon beside the ledger's")
    _add_run_flags(u)
    u.add_argument("--canaries", type=int, default=200,
                   help="client canaries, each included in the run by a fair coin (>= 8)")
    u.add_argument("--fault", choices=["none", "half_noise", "no_clip"], default="none",
                   help="inject a fault to see the audit catch it (the ledger still charges the target)")
    u.add_argument("--significance", type=_float, default=0.05, help="the bound holds with probability 1 - this")
    u.set_defaults(func=cmd_audit_run)

    a = _parser(sub, "audit", help="per-client privacy spent, from a ledger",
                description="Per-client privacy spent, from a ledger. Columns: epsilon, at --delta, from the run's "
                            "accountant (the guarantee); rho, the zCDP parameter of the client's releases composed "
                            "(with client sampling shown as rho*: without amplification by sampling, a loose upper "
                            "bound whose conversion can exceed epsilon; n/a where a release has no zCDP form); "
                            "releases, values revealed; charges, ledger rows (a charged value that was never "
                            "revealed, e.g. an aborted secure-aggregation round, still counts).")
    a.add_argument("ledger", help="the SQLite ledger file privfl run --ledger wrote, or the folder of per-client "
                                  "ledgers (client<k>.sqlite) of a --runtime flower-sim run, composed into one report")
    a.add_argument("--delta", type=_float, default=None, help="delta to report at (default: the run's)")
    a.add_argument("--run-id", default=None, help="the run to audit (default: the ledger's only run)")
    a.add_argument("--json", action="store_true", help="print one strict JSON object")
    a.add_argument("--png", default=None, help="also plot epsilon per client over rounds to this PNG (its folder "
                                               "must exist) (default: no plot)")
    a.set_defaults(func=cmd_audit)
    k = _parser(sub, "compare", help="utility under DP against baselines: algorithms x epsilons x seeds")
    k.add_argument("config", nargs="?", default=None,
                   help="TOML file (see experiments/configs/; default: the built-in grid)")
    k.add_argument("--json", default=None, metavar="OUT",
                   help="also write {\"results\": [...]} to OUT (strict JSON) (default: not written)")
    k.add_argument("--out-dir", default=None, help="where runs, ledgers, tables, figures, models and a copy of the "
                                                   "TOML go (default: the TOML's out_dir)")
    k.add_argument("--quiet", action="store_true", help="no progress bar")
    k.set_defaults(func=cmd_compare)

    m = _parser(sub, "audit-mechanism",
                help="empirical (Clopper-Pearson) lower bound on epsilon of the release path")
    m.add_argument("--noise-multiplier", type=_float, default=1.0, help="noise std / sensitivity under test")
    m.add_argument("--delta", type=_float, default=1e-5, help="delta at which epsilon is bounded")
    m.add_argument("--trials", type=int, default=100_000, help="releases per neighbouring data set")
    m.add_argument("--mutation", choices=["none", "half_noise", "no_clip"], default="none",
                   help="inject a fault the audit must detect (exit 1 if it does not)")
    m.add_argument("--seed", type=int, default=0, help="seed of the trials")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    m.set_defaults(func=cmd_audit_mechanism)
    return p


def main(argv: list[str] | None = None) -> int:
    from privfl.accounting.errors import PrivacyError
    from privfl.mechanisms.errors import InvalidRelease
    from privfl.errors import ConfigurationError

    parser = build_parser()
    for action in parser._subparsers._group_actions:
        for sub in {id(p): p for p in action.choices.values()}.values():
            sub._negative_number_matcher = _NEGATIVE_NUMBER
    parser._negative_number_matcher = _NEGATIVE_NUMBER
    args = parser.parse_args(argv)
    format_warning = warnings.formatwarning
    warnings.formatwarning = _privfl_warning_format(args.command, format_warning)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_BACKWARD_HOOK_WARNING, category=UserWarning)
            return args.func(args)
    except (PrivacyError, InvalidRelease, ConfigurationError, ValueError) as exc:
        print(f"privfl {args.command}: error: "
              f"{_name_the_flag(str(exc), parser, args.command, getattr(args, 'text_options', None))}",
              file=sys.stderr)
        return 2
    except OSError as exc:  # a file the command was given could not be read or written
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"privfl {args.command}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except sqlite3.DatabaseError as exc:
        print(f"privfl {args.command}: error: a ledger could not be read (SQLite: {exc})", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and not _out_of_memory(exc):
            raise
        print(f"privfl {args.command}: error: out of memory: the sizes given need more memory than this machine "
              f"has; lower {_MEMORY_FLAGS.get(args.command, 'them')}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = format_warning


#: what to lower when a command runs out of memory (the sizes a user gives that its memory grows with)
_MEMORY_FLAGS = {"run": "the model's size (--hidden, --model) or --batch-size, --clients, --client-size",
                 "audit-run": "--canaries, the model's size (--hidden, --model) or --batch-size, --clients",
                 "audit-mechanism": "--trials",
                 "compare": "the TOML's sizes (hidden, clients, batch_size)"}


def _out_of_memory(exc: RuntimeError) -> bool:
    """Whether ``exc`` is torch's allocator failing (a RuntimeError, not a MemoryError, on CPU)."""
    text = str(exc).lower()
    return "can't allocate memory" in text or "out of memory" in text


def _name_the_flag(message: str, parser: argparse.ArgumentParser, command: str, options: dict | None = None) -> str:
    """A configuration error that names a setting (``rounds must be ...``, raised by the configuration classes) names
    the command's flag for it too (``--rounds: rounds must be ...``), or the ``--option`` that gave it."""
    match = re.match(r"(\w+) must ", message)
    if match is None:
        return message
    if options and match.group(1) in options:
        return f"--option {match.group(1)}: {message}"
    flag = "--" + match.group(1).replace("_", "-")
    (action,) = parser._subparsers._group_actions
    if any(flag in a.option_strings for a in action.choices[command]._actions):
        return f"{flag}: {message}"
    return message


def _privfl_warning_format(command: str, fallback):
    """privfl's own warnings (e.g. FedBNR's clipping warning) as ``privfl <command>: warning: ...``, each text once
    per command (not a file name, line and source line, repeated per client); any other warning as Python shows it."""
    seen: set[str] = set()

    def format_warning(message, category, filename, lineno, line=None):
        if not getattr(category, "__module__", "").startswith("privfl"):
            return fallback(message, category, filename, lineno, line)
        text = str(message)
        if text in seen:
            return ""
        seen.add(text)
        return f"privfl {command}: warning: {text}\n"

    return format_warning


if __name__ == "__main__":
    sys.exit(main())
