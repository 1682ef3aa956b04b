"""Mechanisms: Gaussian noise (continuous; discrete for secure aggregation), clipping and the sensitivity it buys.

Works on numpy arrays and privacy events only; knows nothing of models or federations.
"""

if __name__ != "privfl.mechanisms":  # the checkout on sys.path: hand out privfl.mechanisms itself, never a copy
    __import__("importlib").import_module("privfl._one_name").hand_over(__name__, "privfl.mechanisms")
else:
    from .clipping import (ADJACENCIES, ClipResult, clip_per_client, clip_per_example, clip_rows, clip_values,
                                     cross_sensitivity, squared_sum_sensitivity, sum_sensitivity)
    from .errors import InvalidRelease, ReleaseMisuse
    from .gaussian import GaussianMechanism, gaussian_noise
    from .noise import NoiseSource, SecureNoise, SeededNoise, as_noise_source

    __all__ = [
        "ADJACENCIES", "ClipResult", "clip_per_client", "clip_per_example", "clip_rows", "clip_values",
        "cross_sensitivity", "squared_sum_sensitivity", "sum_sensitivity", "InvalidRelease", "ReleaseMisuse",
        "GaussianMechanism", "gaussian_noise", "NoiseSource", "SecureNoise", "SeededNoise", "as_noise_source",
    ]
