"""Partition ids bound to authenticated SuperNode identities (issue 31), checked on privfl's functions: the spec's
``node_keys``, the key digest, and how the ServerApp binds node ids to partitions from what the SuperLink
authenticated (``Grid.get_nodes()``). The same on a real TLS + authenticated deployment, with the node configs' lie
refused before anything is charged, is in tests/flower/test_tls_auth.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("flwr")

from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402

from privfl.core.config import FederationConfig, PrivacyConfig  # noqa: E402
from privfl.data import federated_from_arrays, load_digits  # noqa: E402
from privfl.errors import ConfigurationError  # noqa: E402
from privfl.flower import app as flower_app  # noqa: E402
from privfl.flower.app import DeploymentError, RunSpec  # noqa: E402
from privfl.flower.identity import node_key_digest  # noqa: E402


def _key():
    public = ec.generate_private_key(ec.SECP384R1()).public_key()
    ssh = public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    pem = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return ssh, pem


@pytest.fixture(scope="module")
def spec():
    digits = load_digits(flatten=True)
    parts = [digits.subset(np.arange(k * 50, (k + 1) * 50)) for k in range(2)]
    data = federated_from_arrays(parts, digits.subset(np.arange(200, 240)), name="digits2", design_size=50)
    return RunSpec.of("fedavg", data, FederationConfig(rounds=1, hidden=()), PrivacyConfig(), run_id="keys",
                      node_wait=1.0)


def test_a_key_has_one_digest_in_either_file_format(tmp_path):
    ssh, pem = _key()
    path = tmp_path / "org0.key.pub"
    path.write_bytes(ssh + b"\n")
    assert node_key_digest(str(path)) == node_key_digest(ssh) == node_key_digest(pem) == node_key_digest(
        pem.decode())
    assert node_key_digest(ssh) != node_key_digest(_key()[0])
    with pytest.raises(ConfigurationError, match="not a SuperNode public key"):
        node_key_digest(b"ecdsa-sha2-nistp384 garbage")


def test_the_spec_names_every_partition_once_with_its_own_key(spec):
    keys = [(p, node_key_digest(_key()[0])) for p in range(2)]
    bound = dataclasses.replace(spec, node_keys=keys)
    assert RunSpec.from_json(bound.to_json()).node_keys == tuple(keys)
    for bad in ([keys[0]], [keys[0], (1, keys[0][1])], [(0, keys[0][1]), (2, keys[1][1])], [(0, "ab"), (1, "cd")],
                "not pairs"):
        with pytest.raises(ConfigurationError, match="node_keys"):
            dataclasses.replace(spec, node_keys=bad)


class _Info:
    def __init__(self, node_id, key):
        self.node_id, self.public_key = node_id, key


class _Grid:
    def __init__(self, *views):
        self.views = list(views)

    def get_nodes(self):
        return self.views.pop(0) if len(self.views) > 1 else self.views[0]


def test_the_server_binds_node_ids_to_partitions_by_authenticated_key_only(spec):
    (ssh0, pem0), (ssh1, pem1), (_, stranger) = _key(), _key(), _key()
    bound = dataclasses.replace(spec, node_keys=[(0, node_key_digest(ssh0)), (1, node_key_digest(ssh1))])
    assert flower_app._bind_nodes(_Grid([]), spec) is None  # no node_keys: the node configs' partition ids
    # a node of another key is left out; the binding waits for partition 1's key to connect
    grid = _Grid([_Info(7, pem1), _Info(9, stranger)], [_Info(7, pem1), _Info(9, stranger), _Info(4, pem0)])
    assert flower_app._bind_nodes(grid, bound) == {7: 1, 4: 0}
    with pytest.raises(DeploymentError, match=r"partition\(s\) \[0\] connected within"):
        flower_app._bind_nodes(_Grid([_Info(7, pem1), _Info(9, stranger)]), bound)
    with pytest.raises(DeploymentError, match="--enable-supernode-auth"):  # keys nobody authenticated prove nothing
        flower_app._bind_nodes(_Grid([_Info(7, b""), _Info(4, pem0)]), bound)
