"""The ``privfl`` command line: calibrate, run, audit.

The flags and JSON keys documented in the README are contracts checked by automated tools; keep them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

# argparse reads "-1e-5" as an option name; numbers in scientific notation and -inf are values here, so that
# "--delta -1e-5" reaches the validation that explains what is wrong with it.
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf(inity)?$", re.IGNORECASE)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _widths(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 100,50, got {text!r}") from None


def _dump(obj, path: str | None) -> None:
    text = json.dumps(obj, indent=2, default=_json_default)
    if path in (None, "-"):
        print(text)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")


def _json_default(o):
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# -- calibrate ---------------------------------------------------------------------------------------------------

def cmd_calibrate(args) -> int:
    from accounting.calibration import calibrate

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

def cmd_run(args) -> int:
    from privfl.algorithms import make_algorithm
    from privfl.config import FederationConfig, PrivacyConfig
    from privfl.algorithms import ALGORITHMS
    from privfl.data import make_federated
    from privfl.errors import ConfigurationError
    from privfl.runtime import Simulation

    if args.algorithm in ALGORITHMS:
        for key, value in ALGORITHMS[args.algorithm].defaults.items():
            if getattr(args, key, None) is None:
                setattr(args, key, value)
    for key, value in {"clip": 1.0, "local_epochs": 1, "lr": 0.05, "pool": 1}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    privacy = PrivacyConfig(epsilon=args.epsilon, delta=args.delta, unit=args.unit, adjacency=args.adjacency,
                            clip=args.clip,
                            accountant=args.accountant, placement=args.placement, sampling_rate=args.sampling_rate,
                            secure_noise=not args.seeded_noise)
    fed = FederationConfig(rounds=args.rounds, local_epochs=args.local_epochs, batch_size=args.batch_size,
                           lr=args.lr, server_lr=args.server_lr, model=args.model, hidden=args.hidden, pool=args.pool,
                           seed=args.seed, client_size=args.client_size, record_cap=args.record_cap)
    two_phase = args.algorithm == "fedbnr" and args.kernel_rounds > 0
    distil = two_phase and args.kernel_aggregation == "distillation"
    if (args.kernel_rounds or args.kernel_aggregation != "fedavg") and args.algorithm != "fedbnr":
        raise ConfigurationError("--kernel-rounds and --kernel-aggregation are FedBNR's phase 1; use them with "
                                 "--algorithm fedbnr or drop them")
    if args.kernel_rounds < 0:
        raise ConfigurationError(f"--kernel-rounds must be >= 0, got {args.kernel_rounds}")
    if args.kernel_aggregation == "distillation" and not two_phase:
        raise ConfigurationError("--kernel-aggregation distillation needs phase 1: add --kernel-rounds N (N >= 1)")
    if distil and not args.alignment_size:
        raise ConfigurationError("FedBNR's kernel distillation needs a server-held labelled set: add "
                                 "--alignment-size N (the paper uses about 8% of the data)")
    if args.alignment_size is not None and not distil and not getattr(ALGORITHMS.get(args.algorithm),
                                                                       "uses_alignment", False):
        users = sorted(n for n, c in ALGORITHMS.items() if getattr(c, "uses_alignment", False))
        raise ConfigurationError(f"--alignment-size applies to algorithms with a public alignment set ({users}, "
                                 f"and fedbnr with --kernel-aggregation distillation); {args.algorithm} has none "
                                 "here: drop the flag")
    algorithm = make_algorithm(args.algorithm, fed, privacy)
    data = make_federated(args.dataset, args.clients, partition=args.partition, alpha=args.alpha, seed=args.seed,
                          alignment_size=args.alignment_size or 0, public_size=args.public_size,
                          standardize=None if args.standardize == "none" else args.standardize)
    if args.ledger and args.ledger != ":memory:":
        os.makedirs(os.path.dirname(os.path.abspath(args.ledger)), exist_ok=True)

    def show(rec):
        m = rec.metrics
        utility = (f"rmse {m['rmse']:.4g}  ece {m.get('ece', float('nan')):.4f}" if "rmse" in m  # regression
                   else f"accuracy {m.get('accuracy', float('nan')):.4f}")
        print(f"round {rec.round + 1:3d}/{fed.rounds}  {utility}  "
              f"nll {m.get('nll', float('nan')):.4f}  epsilon spent (max) {rec.epsilon_max:.4g}  "
              f"clients {rec.participants}" + (f"  sat out {len(rec.sat_out)}" if rec.sat_out else "")
              + ("  ABORTED (secure aggregation: nothing revealed)" if rec.aborted else ""),
              file=sys.stderr if args.json == "-" else sys.stdout, flush=True)

    from privfl.secure import SecureAggregation

    secure = (SecureAggregation(bits=args.secagg_bits, dropout=args.dropout, min_survivors=args.min_survivors)
              if args.secure_agg else None)
    if secure is not None:
        secure.check(args.clients)  # a threat model no degree and threshold meet is refused before any round
    if two_phase:
        return _run_fedbnr_two_phases(args, data, fed, privacy, secure, None if args.quiet else show)
    sim = Simulation(algorithm, data, fed, privacy, ledger_path=args.ledger or ":memory:", run_id=args.run_id,
                     progress=None if args.quiet else show, secure=secure)
    result = sim.run()
    out = {
        "algorithm": result.algorithm, "dataset": result.dataset, "clients": result.clients,
        "rounds": result.rounds, "epsilon_target": result.epsilon_target, "delta": result.delta,
        "accountant": result.accountant, "noise_multipliers": result.noise_multipliers,
        "accuracy": result.final.get("accuracy"), "final": result.final,
        "accuracy_per_round": [r.metrics.get("accuracy") for r in result.history],
        "epsilon_spent_per_round": [r.epsilon_max for r in result.history],
        "epsilon_spent_max": result.audit["max_epsilon"],
        "epsilon_spent": {cid: v["epsilon"] for cid, v in result.audit["clients"].items()},
        "ledger": result.ledger, "run_id": result.run_id, "noise": result.noise,
    }
    if "warning" in result.audit:
        out["warning"] = result.audit["warning"]
    aborted = _aborted_rounds(out, secure, result.history)
    if args.json:
        _dump(out, args.json)
    if "warning" in result.audit:
        print(f"warning: {result.audit['warning']}", file=sys.stderr)
    _warn_aborted(aborted, len(result.history))
    final = (f"final rmse {result.final['rmse']:.4g}" if "rmse" in result.final
             else f"final accuracy {out['accuracy']:.4f}")
    print(f"{final}; max epsilon spent {out['epsilon_spent_max']:.4g} (target {args.epsilon:g}, delta {args.delta:g})",
          file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


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


def _run_fedbnr_two_phases(args, data, fed, privacy, secure, progress) -> int:
    """FedBNR with phase 1 (``--kernel-rounds`` rounds of kernel learning, by FedAvg or distillation) and phase 2
    (``--rounds`` releases of the scatter matrices) within one (epsilon, delta) per client; the ledger holds the runs
    ``<run-id>-kernel`` and ``<run-id>-regression``. ``--hidden`` gives the kernel network a deep extractor (default
    none: phase 1 learns the random features' lengthscale, sigma and lambda). The JSON's epsilon figures are
    composed over both phases."""
    from dataclasses import replace

    from accounting.accountants import make_accountant
    from privfl.algorithms.fedbnr import run_fedbnr

    kernel_fed = replace(fed, rounds=args.kernel_rounds)
    kernel_options = {"aggregation": args.kernel_aggregation, "update_clip": args.kernel_clip,
                      "hidden": tuple(args.hidden) if args.hidden is not None else ()}
    if args.ledger and args.ledger != ":memory:":
        os.makedirs(os.path.dirname(os.path.abspath(args.ledger)), exist_ok=True)
    run = run_fedbnr(data, fed, privacy, kernel_rounds=args.kernel_rounds, kernel_fed=kernel_fed,
                     kernel_options=kernel_options, secure=secure, ledger_path=args.ledger or ":memory:",
                     run_id=args.run_id, progress=progress)
    accountant = privacy.resolved_accountant
    # each client's epsilon after every round of both phases: its charges composed in (phase, round) order
    total_rounds = args.kernel_rounds + fed.rounds
    per_round = [math.inf if not privacy.private else 0.0] * total_rounds
    if privacy.private:
        by_client: dict[str, list] = {}
        for phase, ledger in enumerate(run.ledgers):
            offset = 0 if phase == 0 else args.kernel_rounds
            for c in ledger.charges():
                by_client.setdefault(c.client_id, []).append((offset + c.round, c.event))
        for events in by_client.values():
            acct, pending = make_accountant(accountant), sorted(events, key=lambda e: e[0])
            for r in range(total_rounds):
                while pending and pending[0][0] <= r:
                    acct.compose(pending.pop(0)[1])
                per_round[r] = max(per_round[r], float(acct.get_epsilon(privacy.delta)))
    result = run.regression
    out = {
        "algorithm": "fedbnr", "dataset": result.dataset, "clients": result.clients, "rounds": result.rounds,
        "kernel_rounds": args.kernel_rounds, "kernel_aggregation": args.kernel_aggregation,
        "epsilon_target": result.epsilon_target, "delta": result.delta, "accountant": accountant,
        "phase_epsilons": list(run.phase_epsilons) if run.phase_epsilons else None,
        "noise_multipliers": {"kernel": run.kernel.noise_multipliers, "regression": result.noise_multipliers},
        "accuracy": None, "final": result.final, "kernel_final": run.kernel.final,
        "accuracy_per_round": [None] * len(per_round),
        "epsilon_spent_per_round": per_round,
        "epsilon_spent_max": run.epsilon,
        "epsilon_spent": run.epsilon_per_client,
        "ledger": result.ledger, "run_id": [run.kernel.run_id, result.run_id],
    }
    _aborted_rounds(out, secure, run.kernel.history if run.kernel is not None else [])
    aborted = _aborted_rounds(out, secure, result.history, offset=args.kernel_rounds)
    if args.json:
        _dump(out, args.json)
    _warn_aborted(aborted, total_rounds)
    print(f"final rmse {result.final['rmse']:.4g}; max epsilon spent over both phases {run.epsilon:.4g} "
          f"(target {args.epsilon:g}, delta {args.delta:g})", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


# -- audit -------------------------------------------------------------------------------------------------------

def cmd_audit(args) -> int:
    from accounting.ledger import PrivacyLedger

    ledger = PrivacyLedger.open_existing(args.ledger, args.run_id)
    report = ledger.audit(args.delta)
    meta = ledger.meta
    if meta.get("noise"):
        report["noise"] = meta["noise"]
    if meta.get("warning"):
        report["warning"] = meta["warning"]
    if args.json:
        _dump(report, None)
    else:
        print(f"ledger {args.ledger}  run {report['run_id']}  accountant {report['accountant']}  "
              f"delta {report['delta']:g}  budget {report['epsilon_budget']:g}")
        print(f"{'client':>8} {'epsilon':>12} {'rho':>12} {'releases':>9} {'charges':>8}")
        for cid, v in report["clients"].items():
            rho = "n/a" if v["rho"] is None else f"{v['rho']:.6g}"
            print(f"{cid:>8} {v['epsilon']:>12.6g} {rho:>12} {v['releases']:>9d} {v['charges']:>8d}")
        print(f"max epsilon {report['max_epsilon']:.6g}")
        if "warning" in report:
            print(f"warning: {report['warning']}")
    if args.png:
        from privfl.plots import plot_epsilon_per_client

        plot_epsilon_per_client(ledger.epsilon_by_round(args.delta), args.png, delta=report["delta"],
                                budget=report["epsilon_budget"])
        if not args.json:
            print(f"wrote {args.png}")
    return 0


def cmd_compare(args) -> int:
    from dataclasses import replace

    from privfl.compare import CompareConfig, compare, summary_table

    config = CompareConfig.from_toml(args.config) if args.config else CompareConfig()
    if args.out_dir:
        config = replace(config, out_dir=args.out_dir)
    rows = compare(config, progress=not args.quiet)
    table = summary_table(rows)
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"privfl compare: {config.dataset}, {config.clients} clients, {config.partition}"
                    f"{f' alpha={config.alpha:g}' if config.partition == 'dirichlet' else ''}, {config.rounds} rounds, "
                    f"unit={config.unit}, delta={config.delta:g}")
    for col in ("algorithm", "ε target", "seeds", "accuracy", "NLL", "ECE", "ε spent max", "ε spent mean"):
        t.add_column(col, justify="left" if col == "algorithm" else "right")
    for r in table:
        t.add_row(r["algorithm"], f"{r['epsilon_target']:g}", str(r["seeds"]),
                  f"{r['accuracy']:.4f} ± {r['accuracy_std']:.4f}", f"{r['nll']:.3f}", f"{r['ece']:.3f}",
                  f"{r['epsilon_spent_max']:.3f}", f"{r['epsilon_spent_mean']:.3f}")
    Console(width=140).print(t)
    print(f"wrote {config.out_dir}/results.json, results.csv, accuracy_vs_epsilon.png, epsilon_per_client.png, "
          f"reliability.png")
    if args.json:
        _dump({"results": rows}, args.json)
    over = [r for r in rows if r["epsilon_spent_max"] > r["epsilon_target"] * (1 + 1e-9)]
    if over:
        print(f"ERROR: {len(over)} run(s) spent more than their target", file=sys.stderr)
        return 1
    return 0


def cmd_audit_mechanism(args) -> int:
    from privfl.empirical_audit import audit_gaussian_release

    result = audit_gaussian_release(args.noise_multiplier, delta=args.delta, trials=args.trials,
                                    mutation=args.mutation, seed=args.seed)
    if args.json:
        _dump(result.to_dict(), None)
    else:
        verdict = "consistent with" if result.passed else "VIOLATES"
        print(f"empirical epsilon lower bound {result.epsilon_lower_bound:.4g} vs claimed {result.claimed_epsilon:.4g} "
              f"(delta {result.delta:g}, {result.trials} trials, mutation {result.mutation}): {verdict} the claim")
    return 0 if result.passed or args.mutation != "none" else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="privfl", description="Privacy-first federated learning.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("calibrate", help="smallest noise multiplier meeting (epsilon, delta) over R rounds")
    c.add_argument("--epsilon", type=_float, required=True)
    c.add_argument("--delta", type=_float, required=True)
    c.add_argument("--rounds", type=int, required=True)
    c.add_argument("--sampling-rate", type=_float, default=1.0)
    c.add_argument("--accountant", choices=["exact", "pld", "rdp", "zcdp"], default=None)
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=cmd_calibrate)

    r = sub.add_parser("run", help="run a federation and write its results and ledger")
    r.add_argument("--algorithm", default="dp_fedavg")
    r.add_argument("--dataset", default="mnist5k")
    r.add_argument("--clients", type=int, default=10)
    r.add_argument("--rounds", type=int, default=20)
    r.add_argument("--epsilon", type=_float, default=3.0, help="per-client target; inf for a non-private run")
    r.add_argument("--delta", type=_float, default=1e-5)
    r.add_argument("--ledger", default=None, help="SQLite ledger path (default: in memory)")
    r.add_argument("--run-id", default=None)
    r.add_argument("--json", default=None, metavar="OUT", help="write results as JSON to OUT ('-' for stdout)")
    r.add_argument("--partition", default="iid", choices=["iid", "dirichlet", "disjoint_class", "sorted_chunk"])
    r.add_argument("--alpha", type=_float, default=0.1, help="Dirichlet concentration")
    r.add_argument("--unit", default="client", choices=["client", "example"])
    r.add_argument("--adjacency", default="add_remove", choices=["add_remove", "replace_one"],
                   help="neighbouring relation; at --unit example, replace_one declares the clients' record counts "
                        "public (schedules and weights may use them; every event is accounted as replace-one)")
    r.add_argument("--clip", type=_float, default=None, help="clip bound C (default: the algorithm's)")
    r.add_argument("--accountant", choices=["exact", "pld", "rdp", "zcdp"], default=None)
    r.add_argument("--placement", choices=["local", "central", "distributed"], default="central",
                   help="who adds the noise: each client (local), a trusted aggregator (central), or each client a "
                        "discrete Gaussian share under secure aggregation (distributed)")
    r.add_argument("--min-survivors", type=int, default=None,
                   help="secure aggregation: abort a round with fewer survivors (distributed noise is charged for it)")
    r.add_argument("--sampling-rate", type=_float, default=1.0)
    r.add_argument("--secure-noise", action="store_true",
                   help="draw noise from the OS CSPRNG (the default; kept for scripts that pass it)")
    r.add_argument("--seeded-noise", action="store_true",
                   help="draw the noise from --seed (reproducible experiments only: the run is then not private "
                        "against anyone who knows the seed, and the ledger and audit say so)")
    r.add_argument("--client-size", type=int, default=None, metavar="N",
                   help="public design size of a client's data (DP-SGD's sampling rate and steps when record counts "
                        "are private; default: the data set's training size over --clients)")
    r.add_argument("--record-cap", type=int, default=None, metavar="N",
                   help="public cap on a client's records for quantisation ranges (default 4 x the design size)")
    r.add_argument("--standardize", choices=["auto", "public", "none"], default="auto",
                   help="feature/target standardisation from public statistics only: 'public' fits it on a public "
                        "reference split held by no client; 'auto' is the data set's default")
    r.add_argument("--public-size", type=int, default=None, metavar="N",
                   help="size of the public reference split used by --standardize public")
    r.add_argument("--secure-agg", action="store_true", help="aggregate through pairwise-masked secure aggregation")
    r.add_argument("--secagg-bits", type=int, default=48)
    r.add_argument("--dropout", type=_float, default=0.0, help="simulated fraction of clients dropping per round")
    r.add_argument("--model", default="mlp")
    r.add_argument("--hidden", type=_widths, default=None,
                   help="MLP hidden widths, comma-separated ('' for logistic regression); default: the model's")
    r.add_argument("--pool", type=int, default=None, help="average-pool image inputs by this factor (MLP only)")
    r.add_argument("--local-epochs", type=int, default=None)
    r.add_argument("--batch-size", type=int, default=32)
    r.add_argument("--lr", type=_float, default=None)
    r.add_argument("--server-lr", type=_float, default=1.0)
    r.add_argument("--kernel-rounds", type=int, default=0, metavar="K",
                   help="fedbnr: K rounds of phase 1 (kernel learning) before phase 2 (default 0: random features)")
    r.add_argument("--kernel-aggregation", choices=["fedavg", "distillation"], default="fedavg",
                   help="fedbnr phase 1: FedAvg of the kernel network, or kernel distillation on a server-held set "
                        "of --alignment-size examples (eq. 19)")
    r.add_argument("--kernel-clip", type=_float, default=0.05,
                   help="fedbnr phase 1 under DP: client-level clip of the weight change (fedavg aggregation)")
    r.add_argument("--alignment-size", type=int, default=None, metavar="N",
                   help="public alignment set of N training examples, held out from every client (fedbnn; default "
                        "the algorithm's)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(func=cmd_run)

    a = sub.add_parser("audit", help="per-client privacy spent, from a ledger")
    a.add_argument("ledger")
    a.add_argument("--delta", type=_float, default=None, help="delta to report at (default: the run's)")
    a.add_argument("--run-id", default=None)
    a.add_argument("--json", action="store_true")
    a.add_argument("--png", default=None, help="also plot epsilon per client over rounds to this PNG")
    a.set_defaults(func=cmd_audit)
    k = sub.add_parser("compare", help="utility under DP against baselines: algorithms x epsilons x seeds")
    k.add_argument("config", nargs="?", default=None, help="TOML file (see experiments/configs/)")
    k.add_argument("--json", default=None, metavar="OUT", help="also write {\"results\": [...]} to OUT")
    k.add_argument("--out-dir", default=None, help="where runs, ledgers, tables and figures go")
    k.add_argument("--quiet", action="store_true", help="no progress bar")
    k.set_defaults(func=cmd_compare)

    m = sub.add_parser("audit-mechanism", help="empirical (Clopper-Pearson) lower bound on epsilon of the release path")
    m.add_argument("--noise-multiplier", type=_float, default=1.0)
    m.add_argument("--delta", type=_float, default=1e-5)
    m.add_argument("--trials", type=int, default=100_000)
    m.add_argument("--mutation", choices=["none", "half_noise", "no_clip"], default="none",
                   help="inject a fault the audit must detect")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_audit_mechanism)
    return p


def main(argv: list[str] | None = None) -> int:
    from accounting.errors import PrivacyError
    from mechanisms.errors import InvalidRelease
    from privfl.errors import ConfigurationError

    parser = build_parser()
    for action in parser._subparsers._group_actions:
        for sub in {id(p): p for p in action.choices.values()}.values():
            sub._negative_number_matcher = _NEGATIVE_NUMBER
    parser._negative_number_matcher = _NEGATIVE_NUMBER
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (PrivacyError, InvalidRelease, ConfigurationError, ValueError) as exc:
        print(f"privfl {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
