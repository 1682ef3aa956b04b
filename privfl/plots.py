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
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel(f"cumulative ε spent (δ = {delta:g})")
    ax.set_title("Privacy spent per client")
    ax.grid(alpha=0.3)
    if len(series) <= 12:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
