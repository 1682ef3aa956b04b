"""What the front ends' reports say when the test set is the clients' own held-out records.

Without a test set no client holds (``--test-data``, ``test_data =``, ``test=``), the test set is each client's
held-out records (:func:`privfl.data.own.holdout_mask`). Those records are never charged: every test metric computed
on them (accuracy, NLL, ECE, ``majority_prediction_share``, the reliability diagram, per round or final) is a
statistic of the clients' data that the ledger's epsilon does not cover. The reports made for sharing (``privfl run
--json``, compare's ``results.json``/``results.csv`` and figures, ``privfl.federate``'s result) keep their metric
keys, say so in :data:`MARK` fields, leave out the reliability diagram's per-bin counts (they sum to the held-out
set's size: one added held-out record showed as a +1), and a private run warns once (:data:`WARNING`).
"""

from __future__ import annotations

#: the value of the ``test_metrics_privacy`` field
NOTE = ("not covered: the test metrics are computed on the clients' own held-out records, which are never charged, "
        "so the ledger's epsilon does not cover them; evaluate on data no client holds (--test-data, test_data =, "
        "test=) to report metrics you may share")

#: the fields a report carries when its test set is the clients' held-out records (added; no metric key renamed)
MARK = {"test_from_clients": True, "test_metrics_privacy": NOTE}

#: the warning a private run with such a test set prints (or warns) once
WARNING = ("the test set is the clients' own held-out records (no test data given): its metrics are not covered by "
           "the ledger's epsilon, and the reports mark them so (test_metrics_privacy); pass data no client holds as "
           "the test set (--test-data, test_data =, test=) to report metrics you may share")


def without_counts(reliability: dict) -> dict:
    """A reliability diagram without its per-bin counts (exact counts of the held-out records)."""
    return {k: v for k, v in reliability.items() if k != "count"}


__all__ = ["MARK", "NOTE", "WARNING", "without_counts"]
