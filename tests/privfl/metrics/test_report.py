"""Strict JSON and the noise a ledger shows applied."""

import json
import math

import numpy as np

from privfl.accounting import GaussianEvent, NoOpEvent, SelfComposedEvent
from privfl.accounting.events import PoissonSampledEvent
from privfl.accounting.ledger import PrivacyLedger
from privfl.metrics import applied_noise, from_strict_number, strict_json


def test_strict_json_has_no_infinity_or_nan_and_reads_back():
    obj = {"eps": math.inf, "neg": -math.inf, "auroc": math.nan, "xs": (1.0, np.float64(math.inf)),
           "arr": np.array([1, 2]), "n": np.int64(3), "s": "inf"}
    text = json.dumps(strict_json(obj), allow_nan=False)
    back = json.loads(text)
    assert back == {"eps": "inf", "neg": "-inf", "auroc": None, "xs": [1.0, "inf"], "arr": [1, 2], "n": 3, "s": "inf"}
    assert from_strict_number(back["eps"]) == math.inf and math.isnan(from_strict_number(back["auroc"]))
    assert from_strict_number(2.5) == 2.5


def test_applied_noise_opens_composed_and_sampled_events():
    ledger = PrivacyLedger(":memory:", "r", delta=1e-5, epsilon_budget=100.0, accountant="pld")
    step = PoissonSampledEvent(0.1, GaussianEvent(sensitivity=0.5, noise_std=0.75))
    with ledger.transaction():
        ledger.charge("0", 0, "update", SelfComposedEvent(step, 20), unit="example")
        ledger.charge("1", 0, "update", SelfComposedEvent(step, 20), unit="example")
        ledger.charge("0", 0, "mean", GaussianEvent(sensitivity=1.0, noise_std=3.0), unit="client")
        ledger.charge("0", 0, "free", NoOpEvent(), unit="client")
    out = applied_noise(ledger.charges())
    assert out["update"] == [{"noise_multiplier": 1.5, "noise_std": 0.75, "sensitivity": 0.5, "steps": 20,
                              "sampling_rate": 0.1}]
    assert out["mean"][0]["noise_multiplier"] == 3.0 and out["mean"][0]["steps"] == 1
    assert out["free"] == []
