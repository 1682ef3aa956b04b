"""A client half's checks of the broadcast it loads (privfl.algorithms.base.check_broadcast_value, ClientHalf.load):
on the broadcast alone, before any record is read. The adversarial runs through the Flower ClientApp are in
tests/flower/test_malicious_server_messages.py."""

import numpy as np
import pytest

from privfl.algorithms.base import BROADCAST_BOUND, Broadcast, check_broadcast_value
from privfl.errors import ConfigurationError


@pytest.mark.parametrize("value", [np.array([0.0, np.nan]), np.array([np.inf]), np.array([1e39]), float("nan"),
                                   -1e39, {"state": {"w": np.array([1.0, -np.inf])}}, [0.0, (1.0, float("inf"))],
                                   np.array([1j])])
def test_non_finite_or_out_of_range_or_non_real_numbers_are_refused_wherever_they_sit(value):
    with pytest.raises(ConfigurationError, match="refused before any record was read"):
        check_broadcast_value("x", value)


def test_honest_values_pass_and_only_a_top_level_array_must_keep_its_shape():
    check_broadcast_value("x", {"a": np.zeros(3), "b": [1, 2.5, "text", None, True]}, {"a": np.zeros(2)})
    check_broadcast_value("x", np.array([BROADCAST_BOUND, -BROADCAST_BOUND]), np.zeros(2))
    check_broadcast_value("x", np.array([1, 2], dtype=np.int64))
    check_broadcast_value("x", np.zeros(2), None)
    with pytest.raises(ConfigurationError, match="shape"):
        check_broadcast_value("x", np.zeros(3), np.zeros(2))
    with pytest.raises(ConfigurationError, match="array of shape"):
        check_broadcast_value("x", 1.0, np.zeros(2))


def test_a_refused_broadcast_leaves_the_client_half_as_it_was():
    from privfl.algorithms import make_algorithm
    from privfl.core.config import FederationConfig, PrivacyConfig
    from privfl.data import federated_from_arrays, load_digits

    digits = load_digits(flatten=True)
    parts = [digits.subset(np.arange(k * 60, (k + 1) * 60)) for k in range(2)]
    data = federated_from_arrays(parts, digits.subset(np.arange(200, 260)))
    fed = FederationConfig(rounds=2, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=4, client_size=60)
    alg = make_algorithm("fola", fed, PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5))
    alg.setup(data, np.random.default_rng(0))
    half = alg.client_half()
    mean, precision = half.algorithm.mean.copy(), half.algorithm.precision.copy()
    bad = precision.copy()
    bad[3] = 0.0  # every honest FOLA precision is > 0
    with pytest.raises(ConfigurationError, match="precision"):
        half.load(Broadcast(0, {"mean": mean + 1.0, "precision": bad}))
    np.testing.assert_array_equal(half.algorithm.mean, mean)
    np.testing.assert_array_equal(half.algorithm.precision, precision)
    half.load(Broadcast(0, {"mean": mean + 1.0, "precision": precision}))
    np.testing.assert_array_equal(half.algorithm.mean, mean + 1.0)


def _half(name, **options):
    from privfl.algorithms import make_algorithm
    from privfl.core.config import FederationConfig, PrivacyConfig
    from privfl.data import federated_from_arrays, load_digits

    digits = load_digits(flatten=True)
    parts = [digits.subset(np.arange(k * 60, (k + 1) * 60)) for k in range(2)]
    data = federated_from_arrays(parts, digits.subset(np.arange(200, 260)),
                                 alignment=digits.subset(np.arange(300, 320)))
    fed = FederationConfig(rounds=2, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=4, client_size=60)
    alg = make_algorithm(name, fed, PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5), **options)
    alg.setup(data, np.random.default_rng(0))
    return alg.client_half()


def test_hbfl_refuses_a_precision_no_honest_server_sends():
    half = _half("hbfl")
    held = {k: np.asarray(getattr(half.algorithm, k)).copy() for k in ("global_mean", "global_precision",
                                                                       "global_natural_mean")}
    bad = dict(held, global_precision=held["global_precision"].copy())
    bad["global_precision"][0] = -1.0
    with pytest.raises(ConfigurationError, match="HBFL precision"):
        half.load(Broadcast(0, bad))
    half.load(Broadcast(0, held))


@pytest.mark.parametrize("field, value", [("global_probs", "zero_row"), ("global_probs", "negative"),
                                          ("reliability", 1.5), ("reliability", -0.1)])
def test_fedbnn_refuses_consensus_probabilities_or_a_reliability_no_honest_server_sends(field, value):
    half = _half("fedbnn", alignment_size=20)
    rows = len(half.algorithm.alignment_x)
    probs = np.full((rows, 10), 0.1)
    if value == "zero_row":
        probs[0] = 0.0
    elif value == "negative":
        probs[0, :2] = (-0.1, 0.3)
    broadcast = {"global_probs": probs if field == "global_probs" else np.full((rows, 10), 0.1),
                 "reliability": value if field == "reliability" else 0.5}
    with pytest.raises(ConfigurationError, match="FedBNN"):
        half.load(Broadcast(0, broadcast))
    half.load(Broadcast(0, {"global_probs": np.full((rows, 10), 0.1), "reliability": 0.5}))
