"""Issue 4's comparison: FOLA and HBFL against FedAvg, FedProx, DP-FedAvg and DP-SGD FedAvg on MNIST-5k.

Runs (or resumes) ``experiments/configs/weight_space.toml`` through ``privfl compare`` and writes the summary table
``experiments/results/weight_space.md`` next to the comparison's JSON, CSV, figures and per-run ledgers.

Usage: python experiments/run_weight_space.py [CONFIG.toml]
"""

from __future__ import annotations

import math
import os
import sys

from privfl.apps.compare import CompareConfig, compare, summary_table


def main(path: str = "experiments/configs/weight_space.toml") -> None:
    config = CompareConfig.from_toml(path)
    rows = compare(config, progress=sys.stderr.isatty())
    lines = [f"# {config.dataset}, {config.clients} clients, Dirichlet({config.alpha:g}), {config.rounds} rounds, "
             f"seeds {list(config.seeds)}, delta {config.delta:g}", "",
             "| algorithm | ε target | accuracy (mean ± std) | NLL | ECE | ε spent (max over clients) |",
             "|---|---|---|---|---|---|"]
    for r in summary_table(rows):
        eps = "∞" if math.isinf(r["epsilon_target"]) else f"{r['epsilon_target']:g}"
        spent = "∞" if math.isinf(r["epsilon_spent_max"]) else f"{r['epsilon_spent_max']:.3f}"
        lines.append(f"| {r['algorithm']} | {eps} | {r['accuracy']:.4f} ± {r['accuracy_std']:.4f} | {r['nll']:.3f} | "
                     f"{r['ece']:.3f} | {spent} |")
    out = os.path.join(os.path.dirname(config.out_dir.rstrip("/")), "weight_space.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:])
