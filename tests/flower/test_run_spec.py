"""The Flower run spec's algorithm options and public alignment set: carried as JSON, validated when the spec is
built on either side, and the same facts on the server and every client (no Flower process is started here)."""

from __future__ import annotations

import numpy as np
import pytest

from privfl.core.config import FederationConfig, PrivacyConfig
from privfl.errors import ConfigurationError
from privfl.flower.app import RunSpec, _setup

FACTS = dict(n_clients=3, task="classification", num_classes=10, input_shape=(8,), client_size=50)
FED = FederationConfig(rounds=2, hidden=(4,), seed=1)
PRIVACY = PrivacyConfig(epsilon=8.0, delta=1e-5, unit="client", placement="local", secure_noise=False)


@pytest.fixture
def alignment(tmp_path):
    path = tmp_path / "alignment.npz"
    np.savez(path, x=np.random.default_rng(0).random((12, 8), dtype=np.float32), y=np.arange(12) % 10)
    return str(path)


def test_fedbnn_needs_an_alignment_file(alignment):
    with pytest.raises(ConfigurationError, match="alignment_path"):
        RunSpec("fedbnn", FED, PRIVACY, **FACTS)
    spec = RunSpec("fedbnn", FED, PRIVACY, **FACTS, alignment_path=alignment)
    ad = spec.public_facts().alignment
    with np.load(alignment) as f:
        assert np.array_equal(ad.x, f["x"])
    assert not ad.y.any(), "the file's labels are never read"


def test_options_and_alignment_survive_json_and_reach_the_algorithm(alignment):
    spec = RunSpec("fedbnn", FED, PRIVACY, **FACTS, alignment_path=alignment,
                   options={"warmup_epochs": 2, "prior_steps": 3, "small_fraction": 0.0})
    again = RunSpec.from_json(spec.to_json())
    assert again == spec and again.options == (("prior_steps", 3), ("small_fraction", 0.0),
                                                ("warmup_epochs", 2))
    assert len(spec.alignment_digest) == 64
    alg = _setup(again)
    assert (alg.warmup_epochs, alg.prior_steps, alg.alignment_rows) == (2, 3, 12)


@pytest.mark.parametrize("options, match", [
    ({"no_such_option": 1}, "takes no option"),
    ({"warmup_epochs": object()}, "warmup_epochs"),
    ({"gamma": float("nan")}, "gamma"),
])
def test_bad_options_are_refused(alignment, options, match):
    with pytest.raises(ConfigurationError, match=match):
        RunSpec("fedbnn", FED, PRIVACY, **FACTS, alignment_path=alignment, options=options)


def test_another_alignment_file_is_refused(alignment):
    text = RunSpec("fedbnn", FED, PRIVACY, **FACTS, alignment_path=alignment).to_json()
    np.savez(alignment, x=np.zeros((12, 8), dtype=np.float32))  # a party holding a different file
    spec = RunSpec.from_json(text)  # a spec read from the run config reads no file (its digest is checked on load)
    with pytest.raises(ConfigurationError, match="not the one this run was planned with"):
        spec.public_facts()


def test_a_run_config_naming_an_alignment_set_without_its_digest_is_refused(alignment):
    import json

    d = json.loads(RunSpec("fedbnn", FED, PRIVACY, **FACTS, alignment_path=alignment).to_json())
    d["alignment_digest"] = ""
    with pytest.raises(ConfigurationError, match="without its SHA-256"):
        RunSpec.from_json(json.dumps(d))


def test_an_alignment_set_of_the_wrong_shape_is_refused(tmp_path):
    path = tmp_path / "ad.npz"
    np.savez(path, x=np.zeros((5, 7), dtype=np.float32))
    with pytest.raises(ConfigurationError, match="shape"):
        RunSpec("fedbnn", FED, PRIVACY, **FACTS, alignment_path=str(path))
