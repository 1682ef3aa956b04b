"""Figures of a comparison without private runs draw without matplotlib's empty-legend warning."""

import math
import warnings

from privfl.apps.plots import plot_accuracy_vs_epsilon, plot_epsilon_curves, plot_reliability


def test_a_grid_of_baselines_only_plots_without_warnings(tmp_path):
    rows = [{"algorithm": "fedavg", "epsilon_target": math.inf, "seed": 0, "accuracy": 0.8, "ece": 0.1,
             "epsilon_per_client_per_round": {}}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        plot_epsilon_curves(rows, str(tmp_path / "eps.png"), delta=1e-5)
        plot_accuracy_vs_epsilon(rows, str(tmp_path / "acc.png"), delta=1e-5)
        plot_reliability(rows, str(tmp_path / "rel.png"))
    assert all((tmp_path / f).stat().st_size > 1000 for f in ("eps.png", "acc.png", "rel.png"))
