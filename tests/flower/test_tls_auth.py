"""A loopback Flower deployment with TLS and SuperNode authentication (issue 31), its certificates and keys generated
in the test (``privfl.flower.local.make_credentials``: a fresh CA, the SuperLink's certificate for 127.0.0.1, ::1
and localhost, one NIST P-384 key per SuperNode; nothing downloaded).

The SuperLink runs with ``--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile --enable-supernode-auth``; each
organisation's public key is registered with ``flwr supernode register`` before its SuperNode starts with
``--root-certificates CA --auth-supernode-private-key KEY``; ``flwr run`` reaches the SuperLink through a config.toml
connection with ``root-certificates`` and ``insecure = false``.

- DP-FedAvg (local, seeded noise) over two organisations and two rounds equals the in-process run bit for bit, each
  organisation runs under the node id its registered key was given, and its ledger audits as in process.
- The ServerApp learns which registered key (and name) each node id belongs to through ``Grid.get_nodes()`` (a probe
  ServerApp, not privfl's: the evidence for binding partition ids to authenticated identities).
- The adversary's cases, each bounded in time (``--max-retries``, a wait with a timeout) and stopped by pid: a
  SuperNode with an unregistered key, or with none, is refused (Flower's codes 2004 and 2001) and never listed;
  a client that claims a registered node id but signs with another key gets HTTP 401 and no message; a plaintext
  client, and a client that verifies the SuperLink with another CA, never connect.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
import tomllib

import numpy as np
import pytest

pytest.importorskip("flwr")

from privfl.accounting.ledger import PrivacyLedger  # noqa: E402
from privfl.core.config import FederationConfig, PrivacyConfig  # noqa: E402
from privfl.flower.app import RunSpec  # noqa: E402
from privfl.flower.identity import node_key_digest  # noqa: E402
from privfl.flower.local import (  # noqa: E402
    LocalDeployment,
    free_ports,
    make_credentials,
    write_ca,
    write_supernode_key,
)

N_CLIENTS, ROUNDS = 2, 2
RUN_TIMEOUT = 180  # seconds for one flwr run
REFUSAL_TIMEOUT = 40  # seconds a refused SuperNode may take to give up (it retries at most twice, for 10 s at most)


@pytest.fixture(scope="module")
def federation():
    """Two organisations of 120 scikit-learn digits each and 200 test digits."""
    from privfl.data import federated_from_arrays, load_digits

    digits = load_digits(flatten=True)
    idx = np.random.default_rng(0).permutation(len(digits))
    parts = [digits.subset(idx[k * 120:(k + 1) * 120]) for k in range(N_CLIENTS)]
    return federated_from_arrays(parts, digits.subset(idx[1500:1700]), name="digits2",
                                 design_size=round(sum(map(len, parts)) / len(parts)))


#: the tests on the module's TLS deployment: make test-all (CI time: the deployment and its keys' registration, about
#: two minutes on 2 cores); test_node_keys.py checks the key-to-partition binding in process in make test
TLS_DEPLOYMENT = pytest.mark.slow


@pytest.fixture(scope="module")
def deployment(federation, tmp_path_factory, write_orgs, quick_deployment):
    work = tmp_path_factory.mktemp("tls-auth")
    configs = write_orgs(federation, work)
    credentials = make_credentials(str(work / "credentials"), N_CLIENTS)
    with quick_deployment(work, configs, tls=True, auth=True, credentials=credentials) as dep:
        _wait_online(dep, set(dep.node_ids))
        yield dep
    assert all(p.poll() is not None for p in dep.procs) and all(w.poll() is not None for w in dep.workers)


def test_credentials_are_fresh_private_and_never_overwritten(tmp_path):
    """make_credentials: the SuperLink's certificate names the loopback addresses and is signed by the CA; private
    keys are the owner's only; SuperNode keys are P-384 in OpenSSH format (what Flower 1.41 loads); a second call on
    the same folder refuses to overwrite anything. Options that Flower would reject are refused up front."""
    import ipaddress
    import stat

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    c = make_credentials(str(tmp_path / "c"), 2)
    with open(c.server_cert, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    with open(c.ca_cert, "rb") as f:
        ca = x509.load_pem_x509_certificate(f.read())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.IPAddress)) == {ipaddress.ip_address("127.0.0.1"),
                                                            ipaddress.ip_address("::1")}
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    for path in (c.server_key, *c.node_keys):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not any(name.endswith("ca.key") for name in os.listdir(c.folder)), "the CA's key is never written"
    for key_path, public_path in zip(c.node_keys, c.node_public_keys):
        with open(key_path, "rb") as f:
            key = serialization.load_ssh_private_key(f.read(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
        with open(public_path, "rb") as f:
            assert serialization.load_ssh_public_key(f.read()).public_numbers() == key.public_key().public_numbers()
    with pytest.raises(FileExistsError):
        make_credentials(str(tmp_path / "c"), 2)
    with pytest.raises(ValueError, match="needs TLS"):
        LocalDeployment(str(tmp_path / "d"), [], auth=True)
    with pytest.raises(ValueError, match="2 SuperNode keys for 3"):
        LocalDeployment(str(tmp_path / "d"), [{}, {}, {}], tls=True, auth=True, credentials=c)


def _wait_online(dep, expected: set[int], timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        nodes = dep.list_supernodes()
        if {int(n["node-id"]) for n in nodes if n["status"] == "online"} == expected:
            return nodes
        assert time.monotonic() < deadline, f"the registered SuperNodes are not online: {nodes}"
        time.sleep(0.5)


def _log(dep, name: str) -> str:
    with open(os.path.join(dep.workdir, f"{name}.log"), errors="replace") as f:
        return f.read()


@TLS_DEPLOYMENT
def test_the_deployment_runs_over_tls_with_registered_keys_only(deployment):
    """What the fixture started is what it claims: the SuperLink serves HTTPS with SuperNode authentication on, the
    coordinator's connection verifies it with the CA, and only the registered keys' node ids are known."""
    dep = deployment
    link = _log(dep, "superlink")
    assert f"https://127.0.0.1:{dep.port}" in link and "SuperNode authentication is disabled" not in link
    assert "--insecure" not in " ".join(dep.procs[0].args)
    with open(os.path.join(dep.home, "config.toml"), "rb") as f:
        connection = tomllib.load(f)["superlink"]["privfl-local"]
    assert connection == {"address": dep.address, "root-certificates": dep.credentials.ca_cert, "insecure": False}
    assert sorted(int(n["node-id"]) for n in dep.list_supernodes()) == sorted(dep.node_ids)
    assert len(set(dep.node_ids)) == N_CLIENTS
    for k, node_id in enumerate(dep.node_ids):  # organisation k runs under the node id its key was registered as
        assert f"SuperNode ID: {node_id}" in _log(dep, f"supernode{k}")


@TLS_DEPLOYMENT
def test_dp_fedavg_over_tls_and_auth_equals_in_process(deployment, federation, in_process_reference, deploy):
    fed = FederationConfig(rounds=ROUNDS, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=11)
    privacy = PrivacyConfig(epsilon=8.0, delta=1e-5, unit="client", clip=0.5, placement="local", secure_noise=False)
    # each partition bound to its organisation's registered key (node_keys): the ServerApp asks only those nodes
    keys = [(k, node_key_digest(path)) for k, path in enumerate(deployment.credentials.node_public_keys)]
    spec = RunSpec.of("dp_fedavg", federation, fed, privacy, run_id="dp_fedavg-tls", node_wait=60,
                      round_timeout=120, node_keys=keys)
    reference = in_process_reference(spec, deployment.workdir)
    result = deploy(deployment, spec, "tls", RUN_TIMEOUT)
    got, expected = result["state"]["global_params"], reference["global_params"]
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert np.array_equal(got, expected), f"max abs difference {np.max(np.abs(got - expected))}"
    assert result["noise_multipliers"] == reference["noise_multipliers"]
    assert [h["participants"] for h in result["history"]] == [N_CLIENTS] * ROUNDS
    sim_clients = reference["audit"]["clients"]
    for k, config in enumerate(deployment.node_configs):
        ledger = PrivacyLedger.open_existing(config["ledger-path"], spec.run_id)
        try:
            audit = ledger.audit()
        finally:
            ledger.close()
        assert set(audit["clients"]) == {str(k)}
        assert audit["clients"][str(k)]["releases"] == ROUNDS
        assert audit["clients"][str(k)]["epsilon"] <= privacy.epsilon * (1 + 1e-9)
        assert math.isclose(audit["clients"][str(k)]["epsilon"], sim_clients[str(k)]["epsilon"], rel_tol=1e-12)


@TLS_DEPLOYMENT
def test_a_supernode_claiming_another_partition_than_its_key_is_refused_before_any_charge(deployment, federation):
    """Partition ids bound to authenticated identities: the spec declares organisation 0's registered key as
    partition 1's and the other way round, so each SuperNode's node config (partition-id k, its own data and ledger)
    now claims a partition its authenticated key does not hold, as a SuperNode lying about its partition would. The
    ServerApp refuses at the start of the run, before any round: no ledger holds a row of the run."""
    from privfl.flower.app import write_app

    keys = [(1 - k, node_key_digest(path)) for k, path in enumerate(deployment.credentials.node_public_keys)]
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=3)
    privacy = PrivacyConfig(epsilon=8.0, delta=1e-5, unit="client", clip=0.5, placement="local")
    spec = RunSpec.of("dp_fedavg", federation, fed, privacy, run_id="swapped-keys", node_wait=30,
                      round_timeout=60, node_keys=keys)
    result = os.path.join(deployment.workdir, "swapped-result.bin")
    deployment.run(write_app(os.path.join(deployment.workdir, "app-swapped"), spec, result_path=result),
                   timeout=RUN_TIMEOUT)
    assert not os.path.exists(result)
    log = _log(deployment, "flwr-run")
    assert "authenticated with the registered key of partition" in log and "claims partition-id" in log, log[-3000:]
    for config in deployment.node_configs:
        assert "swapped-keys" not in PrivacyLedger.run_ids(config["ledger-path"])


_PROBE = '''"""A ServerApp that writes what Grid.get_nodes() says about each node (no ClientApp work)."""
import json
import time

from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

server_app = ServerApp()
client_app = ClientApp()


@server_app.main()
def main(grid, context):
    want, out = int(context.run_config["nodes"]), str(context.run_config["out"])
    deadline = time.monotonic() + 30
    nodes = list(grid.get_nodes())
    while len(nodes) < want and time.monotonic() < deadline:
        time.sleep(0.2)
        nodes = list(grid.get_nodes())
    with open(out, "w") as f:
        json.dump([{"node_id": n.node_id, "public_key": n.public_key.decode("ascii"), "name": n.name}
                   for n in nodes], f)
'''


def _write_probe(directory, out: str, nodes: int) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "pyproject.toml"), "w") as f:
        f.write("\n".join([
            "[build-system]", 'requires = ["hatchling"]', 'build-backend = "hatchling.build"', "",
            "[project]", 'name = "privfl-probe"', 'version = "1.0.0"', 'license = "Apache-2.0"', "dependencies = []",
            "", "[tool.hatch.build.targets.wheel]", 'packages = ["."]', "",
            "[tool.flwr.app]", 'publisher = "privfl"', "",
            "[tool.flwr.app.components]", 'serverapp = "probe_app:server_app"', 'clientapp = "probe_app:client_app"',
            "", "[tool.flwr.app.config]", f"out = {json.dumps(out)}", f"nodes = {nodes}", ""]))
    with open(os.path.join(directory, "probe_app.py"), "w") as f:
        f.write(_PROBE)
    return str(directory)


@pytest.mark.slow  # make test-all (CI time): Flower's own TLS and Grid behaviour, pinned for 1.41
def test_the_server_app_learns_each_node_ids_registered_key(deployment):
    """Flower 1.41's ``Grid.get_nodes()`` gives a ServerApp each node's ``NodeInfo``: under SuperNode
    authentication its ``public_key`` is the key the coordinator registered (PEM) and ``name`` the name it was
    registered under, so a ServerApp can bind a node id to an authenticated identity, not to what the node says."""
    from cryptography.hazmat.primitives import serialization

    dep = deployment
    out = os.path.join(dep.workdir, "probe.json")
    app = _write_probe(os.path.join(dep.workdir, "app-probe"), out, N_CLIENTS)
    dep.run(app, timeout=RUN_TIMEOUT)
    assert os.path.exists(out), _log(dep, "flwr-run")[-3000:]
    with open(out) as f:
        seen = {n["node_id"]: n for n in json.load(f)}
    assert set(seen) == set(dep.node_ids)
    for k, node_id in enumerate(dep.node_ids):
        with open(dep.credentials.node_keys[k], "rb") as f:
            key = serialization.load_ssh_private_key(f.read(), None)
        pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo).decode("ascii")
        assert seen[node_id]["public_key"] == pem, f"node {node_id} is not organisation {k}'s registered key"
        assert seen[node_id]["name"] == f"partition-{k}"


def _refused_supernodes(dep, transports: dict[str, list[str]]) -> dict[str, str]:
    """Start one SuperNode per entry (its name, its transport flags) against the deployment's SuperLink, all at once,
    each retrying at most twice for at most 10 s; wait (bounded) until each gives up, stop each by pid whatever
    happens, and return their logs. Each must have exited non-zero by itself, without a node id."""
    procs = {name: dep.start_process(name, ["flower-supernode", *transport, "--superlink", dep.address,
                                            "--port", str(free_ports(1)[0]), "--max-retries", "2",
                                            "--max-wait-time", "10", "--node-config", "partition-id=0"])
             for name, transport in transports.items()}
    codes = {}
    deadline = time.monotonic() + REFUSAL_TIMEOUT
    try:
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
    finally:
        for proc in procs.values():
            dep.stop_process(proc)
    logs = {name: _log(dep, name) for name in procs}
    for name, log in logs.items():
        assert codes[name] not in (None, 0), f"{name}: the SuperNode did not give up by itself ({codes[name]}):\n" \
                                             f"{log[-2000:]}"
        assert "SuperNode ID:" not in log, f"{name} got a node id:\n{log[-2000:]}"
    return logs


@TLS_DEPLOYMENT
def test_a_supernode_whose_key_is_not_registered_cannot_join(deployment, tmp_path):
    dep = deployment
    rogue = str(tmp_path / "rogue.key")
    write_supernode_key(rogue)
    logs = _refused_supernodes(dep, {
        "rogue": ["--root-certificates", dep.credentials.ca_cert, "--auth-supernode-private-key", rogue],
        # without a key, a SuperNode registers itself through the Fleet API: refused under authentication
        "keyless": ["--root-certificates", dep.credentials.ca_cert]})
    assert "[code: 2004] Failed to activate SuperNode" in logs["rogue"], logs["rogue"][-2000:]
    assert "[code: 2001]" in logs["keyless"] and "must be registered via the CLI" in logs["keyless"], \
        logs["keyless"][-2000:]
    # the SuperLink knows the registered nodes only, and they are still online
    _wait_online(dep, set(dep.node_ids))
    assert sorted(int(n["node-id"]) for n in dep.list_supernodes()) == sorted(dep.node_ids)


@TLS_DEPLOYMENT
def test_a_client_claiming_a_registered_node_id_with_another_key_gets_nothing(deployment, tmp_path):
    """Flower's own Fleet client, as a modified SuperNode would use it: a pull of organisation 0's messages signed
    with an unregistered key is refused with 401 (and the same request signed with the registered key is answered,
    so the refusal is the key's, not a malformed request)."""
    import httpx
    from cryptography.hazmat.primitives import serialization
    from flwr.proto.fleet_pb2 import PullMessagesRequest  # pylint: disable=no-name-in-module
    from flwr.proto.node_pb2 import Node  # pylint: disable=no-name-in-module
    from flwr.supernode.fleet_http_client import FleetHttpClient
    from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

    dep = deployment
    rogue = str(tmp_path / "rogue.key")
    write_supernode_key(rogue)

    with open(dep.credentials.ca_cert, "rb") as f:
        ca = f.read()

    def pull(key_path: str):
        with open(key_path, "rb") as f:
            key = serialization.load_ssh_private_key(f.read(), None)
        with FleetHttpClient.from_server_address(dep.address, False, ca,
                                                 interceptors=[NodeAuthHttpInterceptor(key, key.public_key())]) as c:
            return c.PullMessages(PullMessagesRequest(node=Node(node_id=dep.node_ids[0])))

    with pytest.raises(httpx.HTTPStatusError) as refused:
        pull(rogue)
    assert refused.value.response.status_code == 401
    assert list(pull(dep.credentials.node_keys[0]).messages_list) == []  # no run in flight: nothing to take


@pytest.mark.slow  # make test-all (CI time): Flower's own TLS and Grid behaviour, pinned for 1.41
def test_a_client_without_tls_or_trusting_another_ca_is_refused(deployment, tmp_path):
    import ssl

    import httpx

    dep = deployment
    # plaintext: the SuperLink speaks TLS only
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://{dep.address}/health", timeout=10)
    # a client that verifies the SuperLink with another CA refuses the handshake, even with a registered key
    other_ca, _, _ = write_ca(str(tmp_path), "another CA")
    logs = _refused_supernodes(dep, {
        "plaintext": ["--insecure"],
        "another-ca": ["--root-certificates", other_ca, "--auth-supernode-private-key", dep.credentials.node_keys[1]]})
    assert "Server disconnected" in logs["plaintext"] or "Connection reset" in logs["plaintext"], \
        logs["plaintext"][-2000:]
    assert "CERTIFICATE_VERIFY_FAILED" in logs["another-ca"], logs["another-ca"][-2000:]
    # the handshake is the CA's to decide: a request verified with another CA fails, with the deployment's CA it is
    # answered
    for ca, answered in ((other_ca, False), (dep.credentials.ca_cert, True)):
        try:
            httpx.get(f"https://{dep.address}/health", verify=ssl.create_default_context(cafile=ca), timeout=10)
            ok = True
        except httpx.ConnectError as exc:
            assert "CERTIFICATE_VERIFY_FAILED" in str(exc)
            ok = False
        assert ok == answered
    _wait_online(dep, set(dep.node_ids))
