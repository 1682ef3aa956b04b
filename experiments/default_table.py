"""The README's default-comparison table from ``privfl compare``'s JSON (``make demo`` writes
``runs/compare/results.json``): one row per algorithm and epsilon, the reference rows first, then the algorithms in
alphabetical order, epsilon ascending. The privacy SNR column is the median over the rounds of each round's privacy
signal-to-noise ratio (``snr_median``: the mean over the noised channels of the sums' norm over the noise's,
``privfl.runtime.rounds.privacy_snr``; "–" where the server knows no noise in its sums: noise inside the clients'
DP-SGD steps, or no DP).

Usage: python experiments/default_table.py RESULTS_JSON [OUT_MD]   (prints the table; writes it to OUT_MD if given)
"""

from __future__ import annotations

import json
import math
import sys

REFERENCES = {"centralised": "∞ (data pooled)", "local_only": "0 (nothing leaves a client)"}
HEADER = ("| algorithm | ε target | rounds | accuracy | validation accuracy | balanced accuracy | AUROC | NLL | ECE | "
          "selective accuracy | privacy SNR (median over rounds) | ε spent (max / mean over clients) | seconds |")


def _eps(value) -> float:
    return math.inf if value in ("inf", None) else float(value)


def _cell(value) -> str:
    return "∞" if math.isinf(value) else f"{value:g}"


def table(results: list[dict]) -> str:
    order = sorted(results, key=lambda r: (r["algorithm"] not in REFERENCES, r["algorithm"], _eps(r["epsilon_target"])))
    lines = [HEADER, "|" + "---|" * 13]
    for r in order:
        target = _eps(r["epsilon_target"])
        if r["algorithm"] in REFERENCES:
            spent = REFERENCES[r["algorithm"]]
        elif math.isinf(target):
            spent = "∞"
        else:
            spent = f"{float(r['epsilon_spent_max']):.3f} / {float(r['epsilon_spent_mean']):.3f}"
        cells = [r["algorithm"], _cell(target), str(r["rounds"])]
        cells += [f"{float(r[k]):.3f}" for k in ("accuracy", "val_accuracy", "balanced_accuracy", "auroc", "nll", "ece",
                                                   "selective_accuracy")]
        snr = r.get("snr_median")  # None: no noise the server knows of (inside DP-SGD steps, or no DP)
        cells += ["–" if snr is None else f"{float(snr):.3g}", spent, f"{float(r['seconds']):.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        text = table(json.load(f)["results"])
    if len(argv) > 1:
        with open(argv[1], "w") as f:
            f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
