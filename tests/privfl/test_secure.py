"""Secure aggregation as an option of the release path: same aggregates and models as without, up to quantisation."""

import numpy as np
import pytest

from accounting.ledger import PrivacyLedger
from privfl.aggregation import weighted_sums
from privfl.algorithms import make_algorithm
from privfl.channels import Channel, NormClip, Unclipped
from privfl.config import FederationConfig, PrivacyConfig
from privfl.data import make_federated
from privfl.release import ReleasePipeline
from privfl.runtime import Simulation
from privfl.secure import SecureAggregation, secure_weighted_sums
from secure_agg import ProtocolAbort


def releases(channel, n=6, d=50, multipliers=None, placement="local", weights=None, seed=0):
    led = PrivacyLedger(":memory:", "r")
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        pipe = ReleasePipeline(str(k), [channel], led, multipliers, placement=placement, noise=k)
        w = 1.0 if weights is None else weights[k]
        out += pipe.release(0, {channel.name: rng.normal(size=d)}, weight=w).values()
    return out


@pytest.mark.parametrize("bits", [32, 48])
def test_secure_sum_equals_plain_sum_up_to_quantisation(bits):
    ch = Channel("update", (50,), unit="client", clip=Unclipped())
    rels = releases(ch, weights=[3, 1, 4, 1, 5, 9])
    plain = weighted_sums(rels, {"update": ch})["update"]
    secure = secure_weighted_sums(rels, {"update": ch}, SecureAggregation(bits=bits), np.random.default_rng(1))
    got = secure["update"]
    q_step = 2.0 ** np.ceil(np.log2(max(abs(r.weight * r.value).max() for r in rels))) / (2 ** (bits - 1) // 6)
    assert np.max(np.abs(got.total - plain.total)) <= 6 * q_step + 1e-12
    assert got.total_weight == plain.total_weight and got.participants == 6


def test_clipped_noisy_releases_and_dropouts():
    ch = Channel("update", (50,), unit="client", clip=NormClip(1.0))
    rels = releases(ch, n=10, multipliers={"update": 0.5})
    cfg = SecureAggregation(bits=48, dropout=0.2)
    agg = secure_weighted_sums(rels, {"update": ch}, cfg, np.random.default_rng(2))["update"]
    assert agg.participants == 8 and agg.total_weight == 8
    included = [r for r in rels if r.client_id in _included(rels, agg, ch)]
    np.testing.assert_allclose(agg.total, sum(r.value for r in included), atol=1e-6)


def _included(rels, agg, ch):
    # the dropped clients are those whose removal reproduces the sum
    from itertools import combinations

    ids = [r.client_id for r in rels]
    for gone in combinations(ids, len(ids) - agg.participants):
        total = sum(r.value for r in rels if r.client_id not in gone)
        if np.allclose(total, agg.total, atol=1e-6):
            return set(ids) - set(gone)
    raise AssertionError("no subset of clients explains the secure sum")


def test_too_few_survivors_abort_and_reveal_nothing():
    ch = Channel("update", (5,), unit="client", clip=NormClip(1.0))
    rels = releases(ch, n=5, d=5, multipliers={"update": 0.5})
    with pytest.raises(ProtocolAbort):
        secure_weighted_sums(rels, {"update": ch}, SecureAggregation(dropout=0.4, min_survivors=4),
                             np.random.default_rng(0))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm, epsilon", [("fedavg", float("inf")), ("dp_fedavg", 4.0)])
def test_runs_with_and_without_secure_aggregation_agree(algorithm, epsilon):
    data = make_federated("digits", 4, partition="iid", seed=0)
    fed = FederationConfig(rounds=2, hidden=(8,), local_epochs=1, lr=0.05)
    privacy = PrivacyConfig(epsilon=epsilon, delta=1e-5, clip=1.0)
    models = []
    for secure in (None, SecureAggregation(bits=48)):
        alg = make_algorithm(algorithm, fed, privacy)
        Simulation(alg, data, fed, privacy, secure=secure).run()
        models.append(alg.global_params)
    # same seeds, same noise: only the stochastic rounding differs (steps of ~1e-12 at 48 bits)
    np.testing.assert_allclose(models[0], models[1], atol=1e-6)
