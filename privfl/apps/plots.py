"""Figures: epsilon per client over rounds (from a ledger)."""

from __future__ import annotations

import math


def plot_epsilon_per_client(series: dict[str, list[tuple[int, float]]], path: str, *, delta: float,
                            budget: float | None = None) -> None:
    """One line per client: cumulative epsilon (at ``delta``) after each round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for cid, points in series.items():
        rounds = [r + 1 for r, _ in points]
        ax.plot(rounds, [e for _, e in points], marker=".", linewidth=1, label=f"client {cid}")
    if budget is not None and math.isfinite(budget):
        ax.axhline(budget, color="black", linestyle="--", linewidth=1, label=f"budget ε = {budget:g}")
    _epsilon_axes(ax, delta, "Privacy spent per client")
    if len(series) <= 12:
        _legend(ax, fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _legend(ax, **kwargs) -> None:
    """A legend when something on ``ax`` is labelled (matplotlib warns about an empty one)."""
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(**kwargs)


def _epsilon_axes(ax, delta: float, title: str) -> None:
    """Rounds (integer ticks) against cumulative epsilon at ``delta``, titled, with a light grid."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel(f"cumulative ε spent (δ = {delta:g})")
    ax.set_title(title)
    ax.grid(alpha=0.3)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite_targets(rows) -> list[float]:
    return sorted({r["epsilon_target"] for r in rows if math.isfinite(r["epsilon_target"])})


def plot_accuracy_vs_epsilon(rows: list[dict], path: str, *, delta: float) -> None:
    """Test accuracy against the ε target per algorithm (mean ± std over seeds); ε = ∞ (no DP) drawn at the right."""
    import numpy as np

    plt = _pyplot()
    targets = _finite_targets(rows)
    x_of = {e: i for i, e in enumerate(targets)}
    x_inf = len(targets)
    fig, ax = plt.subplots(figsize=(6.8, 4.2), dpi=120)
    for alg in sorted({r["algorithm"] for r in rows}):
        pts = {}
        for r in rows:
            if r["algorithm"] == alg:
                pts.setdefault(r["epsilon_target"], []).append(r["accuracy"])
        es = sorted(pts, key=lambda e: (math.isinf(e), e))
        xs = [x_inf if math.isinf(e) else x_of[e] for e in es]
        means = [float(np.mean(pts[e])) for e in es]
        stds = [float(np.std(pts[e])) for e in es]
        if len(es) == 1 and math.isinf(es[0]):
            ax.axhline(means[0], linestyle=":", linewidth=1, color=ax._get_lines.get_next_color(),
                       label=f"{alg} (no DP)")
            continue
        ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=alg)
    ax.set_xticks(list(range(len(targets))) + [x_inf])
    ax.set_xticklabels([f"{e:g}" for e in targets] + ["∞ (no DP)"])
    ax.set_xlabel(f"target ε per client (δ = {delta:g})")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("Utility under differential privacy (mean ± std over seeds)" if not any(
        r.get("test_from_clients") for r in rows) else
        "Accuracy on the clients' held-out records (not covered by ε)")
    ax.grid(alpha=0.3)
    _legend(ax, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_epsilon_curves(rows: list[dict], path: str, *, delta: float) -> None:
    """Cumulative ε per client over rounds: one thin line per client, one colour per private algorithm, for the
    middle finite ε target of the grid (first seed)."""
    plt = _pyplot()
    targets = _finite_targets(rows)
    fig, ax = plt.subplots(figsize=(6.8, 4.2), dpi=120)
    if targets:
        target = targets[len(targets) // 2]
        for alg in sorted({r["algorithm"] for r in rows}):
            chosen = [r for r in rows if r["algorithm"] == alg and r["epsilon_target"] == target]
            if not chosen:
                continue
            row = min(chosen, key=lambda r: r["seed"])
            colour = ax._get_lines.get_next_color()
            for i, (cid, series) in enumerate(sorted(row["epsilon_per_client_per_round"].items())):
                ax.plot(range(1, len(series) + 1), series, color=colour, linewidth=1, alpha=0.7,
                        label=f"{alg} ({len(row['epsilon_per_client_per_round'])} clients)" if i == 0 else None)
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target ε = {target:g}")
    else:
        ax.text(0.5, 0.5, "no private run in this comparison (every ε target is ∞)", ha="center", va="center",
                transform=ax.transAxes)
    _epsilon_axes(ax, delta, "Privacy spent per client, from each run's ledger")
    _legend(ax, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_reliability(rows: list[dict], path: str) -> None:
    """Reliability diagrams (accuracy against confidence per bin) per algorithm, without DP and at the middle
    finite ε target (first seed)."""
    plt = _pyplot()
    targets = _finite_targets(rows)
    panels = [math.inf] + ([targets[len(targets) // 2]] if targets else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 4.4), dpi=120, squeeze=False)
    algorithms = sorted({r["algorithm"] for r in rows})
    colours = {alg: plt.get_cmap("tab10")(i % 10) for i, alg in enumerate(algorithms)}  # the same in every panel
    for ax, target in zip(axes[0], panels):
        ax.plot([0, 1], [0, 1], color="black", linestyle="--", linewidth=1, label="perfect calibration")
        for alg in algorithms:
            chosen = [r for r in rows if r["algorithm"] == alg and r["epsilon_target"] == target and "reliability" in r]
            if not chosen:
                continue
            rel = min(chosen, key=lambda r: r["seed"])["reliability"]
            # a bin without records has no confidence (NaN); the counts are left out of a report whose test set
            # is the clients' held-out records (privfl.apps.held_out)
            counts = rel.get("count") or [1] * len(rel["confidence"])
            pts = [(c, a) for c, a, n in zip(rel["confidence"], rel["accuracy"], counts)
                   if n > 0 and c is not None and c == c]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colours[alg],
                    label=f"{alg} (ECE {min(chosen, key=lambda r: r['seed'])['ece']:.3f})")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("confidence (max predicted probability)")
        ax.set_ylabel("accuracy in bin")
        ax.set_title("no DP" if math.isinf(target) else f"ε = {target:g}")
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=7)
    held_out = any(r.get("test_from_clients") for r in rows)
    fig.suptitle("Reliability diagrams (test set)" if not held_out else
                 "Reliability diagrams (the clients' held-out records: not covered by ε)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
