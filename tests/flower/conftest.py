"""Bit-exact comparisons across processes, and the in-process reference run in a process of its own.

torch's CPU GEMM is MKL here, and MKL may pick different code paths by the memory alignment of its operands, so the
same float32 training step can differ in the last bits between two processes (a ClientApp process, a Ray actor that
has run other clients, a long-lived pytest process). ``MKL_CBWR=COMPATIBLE`` makes MKL's results independent of
alignment. It is given to every Flower process a test starts and to the reference run, which therefore runs in a
subprocess: setting it in this process would slow every later torch test of the session.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPRO_ENV = {"MKL_CBWR": "COMPATIBLE"}

#: the tests' SuperNodes: Flower's own, started under experiments/fast_supernode.py (a test tool, not part of privfl:
#: Flower's fixed idle waits capped at 0.05 s, so that rounds of a second stay affordable in CI)
FAST_SUPERNODE = (sys.executable, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "experiments", "fast_supernode.py"), "--poll-interval", "0.05", "--require-patch")

_REFERENCE = """
import sys
import numpy as np
import torch
from privfl.algorithms import make_algorithm
from privfl.data import ArrayDataset, federated_from_arrays
from privfl.flower.app import RunSpec
from privfl.flower.records import to_bytes
from privfl.runtime.engine import Simulation

spec_path, data_dir, out_path = sys.argv[1:4]
spec = RunSpec.from_json(open(spec_path).read())
parts = []
for k in range(spec.n_clients):
    with np.load(f"{data_dir}/org{k}.npz") as f:
        parts.append(ArrayDataset(f["x"], f["y"], spec.task, spec.num_classes, f"org{k}"))
data = federated_from_arrays(parts, parts[0], name=spec.name)
torch.set_num_threads(spec.torch_threads or 1)  # as the ClientApps train
sim = Simulation(make_algorithm(spec.algorithm, spec.fed, spec.privacy, **spec.algorithm_options()), data, spec.fed, spec.privacy,
                 executor="per_client", public=spec.public_facts())
result = sim.run()
with open(out_path, "wb") as f:
    state = dict(sim.algorithm.broadcast(spec.fed.rounds).values)
    f.write(to_bytes({**state, "state": state, "audit": result.audit,
                      "noise_multipliers": result.noise_multipliers}, "reference"))
"""


@pytest.fixture(scope="session")
def in_process_reference(tmp_path_factory):
    """``run(spec, data_dir) -> dict``: the in-process runtime (``executor="per_client"``) on the organisations'
    files ``data_dir/org{k}.npz``, in a fresh process with ``REPRO_ENV``; global_params, audit, noise_multipliers."""
    from privfl.flower.records import from_bytes

    work = tmp_path_factory.mktemp("reference")
    count = [0]

    def run(spec, data_dir):
        count[0] += 1
        spec_path, out_path = work / f"spec{count[0]}.json", work / f"out{count[0]}.bin"
        spec_path.write_text(spec.to_json())
        subprocess.run([sys.executable, "-c", _REFERENCE, str(spec_path), str(data_dir), str(out_path)],
                       check=True, timeout=300, env=dict(os.environ, **REPRO_ENV))
        return from_bytes(out_path.read_bytes(), "reference")

    return run


#: what the tests' deployments set beyond LocalDeployment's defaults, so that a run costs seconds, not minutes, on 2
#: cores: warm workers, SuperNodes under :data:`FAST_SUPERNODE`, the SuperLink's state in memory (Flower's own
#: default; LocalDeployment's SQLite file made a 3-round run here 30 s instead of 17 and cost 40% more CPU), Flower's
#: SuperExec poll at 0.1 s (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``) and privfl's ServerApp pulling replies every 0.1 s
#: (``PRIVFL_REPLY_POLL``). Only waits and where the SuperLink keeps its state change: every message, stage and check
#: is as a real deployment's.
QUICK = {"warm": True, "supernode_command": FAST_SUPERNODE, "superlink_database": ":flwr-in-memory:",
         "superexec_poll": 0.1}
QUICK_ENV = {"PRIVFL_REPLY_POLL": "0.1"}


@pytest.fixture(scope="session")
def quick_deployment():
    """``quick_deployment(workdir, node_configs, **kw) -> LocalDeployment``: a deployment with :data:`QUICK`'s
    settings and every process under ``REPRO_ENV`` and :data:`QUICK_ENV` (``kw`` adds to or overrides them; its
    ``env`` adds to the environment)."""
    from privfl.flower.local import LocalDeployment

    def make(workdir, node_configs, **kw):
        env = {**REPRO_ENV, **QUICK_ENV, **kw.pop("env", {})}
        return LocalDeployment(str(workdir), node_configs, **{**QUICK, **kw, "env": env})

    return make


@pytest.fixture(scope="session")
def repro_env():
    """The environment every Flower process of a bit-exact comparison gets (``LocalDeployment(env=...)``)."""
    return dict(REPRO_ENV)


@pytest.fixture(scope="session")
def write_orgs():
    """``write_orgs(federation, work)``: each organisation's records as ``work/org<k>.npz`` and its SuperNode's node config (partition id, data path,
    ledger path ``work/org<k>-ledger.sqlite``), in partition order."""
    import numpy as np

    def write(federation, work) -> list[dict]:
        configs = []
        for k, part in enumerate(federation.train_parts):
            data = str(work / f"org{k}.npz")
            np.savez(data, x=part.x, y=part.y)
            configs.append({"partition-id": k, "data-path": data,
                            "ledger-path": str(work / f"org{k}-ledger.sqlite")})
        return configs

    return write


@pytest.fixture(scope="session")
def federation():
    """Three organisations of 120 scikit-learn digits each and 200 test digits (``digits3``): the federation of the
    deployment tests (a module may define its own ``federation`` instead)."""
    import numpy as np

    from privfl.data import federated_from_arrays, load_digits

    digits = load_digits(flatten=True)
    idx = np.random.default_rng(0).permutation(len(digits))
    parts = [digits.subset(idx[k * 120:(k + 1) * 120]) for k in range(3)]
    return federated_from_arrays(parts, digits.subset(idx[1500:1700]), name="digits3",
                                 design_size=round(sum(map(len, parts)) / len(parts)))


@pytest.fixture(scope="session")
def deploy():
    """``deploy(deployment, spec, tag, timeout, **write_app_kw)``: write the run's Flower app under the deployment's
    folder, ``flwr run`` it, and return the result the ServerApp wrote (the test fails with the run's log if none)."""
    from privfl.flower.app import read_result, write_app

    def run(deployment, spec, tag, timeout, **write_app_kw):
        result_path = os.path.join(deployment.workdir, f"{tag}-result.bin")
        app = write_app(os.path.join(deployment.workdir, f"app-{tag}"), spec, result_path=result_path,
                        **write_app_kw)
        deployment.run(app, timeout=timeout)
        if not os.path.exists(result_path):
            logs = open(os.path.join(deployment.workdir, "flwr-run.log"), errors="replace").read()[-4000:]
            pytest.fail(f"the ServerApp wrote no result; flwr run log:\n{logs}")
        return read_result(result_path)

    return run


@pytest.fixture(scope="session")
def run_killing_after_share_keys():
    """``run(deployment, spec, work, victim, timeout) -> result path``: ``flwr run`` the spec's app and kill SuperNode
    ``victim`` as soon as its log shows its share-keys answer sent (it is then charged, not released); the run goes
    on with the survivors. Fails the test if the victim never gets there."""
    import subprocess
    import time

    from privfl.flower.app import write_app

    def shared_keys(log) -> bool:
        try:
            text = log.read_text(errors="replace")
        except OSError:
            return False
        at = text.find("ROUND 0.share_keys]")
        sending = text.find("Sending: train.secagg", at) if at >= 0 else -1
        return sending >= 0 and "Sent successfully" in text[sending:]

    def run(deployment, spec, work, victim, timeout):
        result_path = str(work / "result.bin")
        app = write_app(str(work / "app"), spec, result_path=result_path)
        with open(work / "flwr-run.log", "wb") as log:
            proc = subprocess.Popen([os.path.join(deployment.bin_dir, "flwr"), "run", app, "privfl-local", "--stream"],
                                    stdout=log, stderr=subprocess.STDOUT, env=deployment.env, cwd=deployment.workdir,
                                    start_new_session=True)
        deployment.procs.append(proc)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and not shared_keys(work / f"supernode{victim}.log"):
            time.sleep(0.05)
        if not shared_keys(work / f"supernode{victim}.log"):
            pytest.fail(f"SuperNode {victim} never answered the share-keys stage")
        deployment.kill_node(victim)
        proc.wait(timeout=timeout)
        if not os.path.exists(result_path):
            pytest.fail("the ServerApp wrote no result; flwr run log:\n"
                        + open(work / "flwr-run.log", errors="replace").read()[-4000:])
        return result_path

    return run
