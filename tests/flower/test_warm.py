"""Warm ClientApp workers (privfl.flower.warm): SuperNodes started with ``--isolation process``, each served by one
long-lived worker process instead of a fresh ``flwr-clientapp`` process per message.

FedAvg on three warm SuperNodes equals the in-process run bit for bit (the pattern of test_deployment.py's FedAvg
test: the reference in its own process, ``MKL_CBWR=COMPATIBLE`` everywhere), and each worker served every message
of its SuperNode in one process. A small Flower app of this file checks what privfl's app cannot show without
changing it: a ClientApp that raises gets Flower's error reply and the worker goes on serving, in the same process,
with ``Context.state`` carried from message to message by the SuperNode.
"""

from __future__ import annotations

import json
import math
import os
import re
import textwrap

import numpy as np
import pytest

pytest.importorskip("flwr")

from privfl.core.config import FederationConfig, PrivacyConfig  # noqa: E402
from privfl.flower.app import RunSpec, read_result, write_app  # noqa: E402
from privfl.flower.local import LocalDeployment  # noqa: E402

N_CLIENTS, ROUNDS = 3, 3
RUN_TIMEOUT = 180


@pytest.fixture(scope="module")
def warm(federation, tmp_path_factory, repro_env, write_orgs):
    work = tmp_path_factory.mktemp("flower-warm")
    configs = write_orgs(federation, work)
    dep = LocalDeployment(str(work), configs, env=repro_env, warm=True)
    try:
        dep.start()
        yield dep
    finally:
        dep.close()
    assert all(p.poll() is not None for p in dep.procs + dep.workers)


def _served(dep, k) -> list[tuple[int, str, str]]:
    """(pid, message type, outcome) of every task worker ``k``'s log reports."""
    text = open(os.path.join(dep.workdir, f"worker{k}.log"), errors="replace").read()
    return [(int(pid), kind, outcome) for pid, kind, outcome in
            re.findall(r"\[privfl-flower-worker pid=(\d+)\] INFO task \d+ \((\S+)\) (done|FAILED)", text)]


@pytest.mark.slow  # make test-all (CI time): test_deployment.py's shared deployment runs on warm workers too
def test_fedavg_on_warm_workers_equals_in_process(warm, federation, in_process_reference):
    fed = FederationConfig(rounds=ROUNDS, local_epochs=1, batch_size=32, lr=0.1, hidden=(16,), seed=7)
    spec = RunSpec.of("fedavg", federation, fed, PrivacyConfig(), run_id="fedavg-warm", node_wait=60,
                      round_timeout=120)
    expected = in_process_reference(spec, warm.workdir)["global_params"]
    result_path = os.path.join(warm.workdir, "fedavg-result.bin")
    app = write_app(os.path.join(warm.workdir, "app-fedavg"), spec, result_path=result_path)
    warm.run(app, timeout=RUN_TIMEOUT)
    if not os.path.exists(result_path):
        log = open(os.path.join(warm.workdir, "flwr-run.log"), errors="replace").read()[-4000:]
        pytest.fail(f"the ServerApp wrote no result; flwr run log:\n{log}")
    result = read_result(result_path)
    got = result["state"]["global_params"]
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert np.array_equal(got, expected), f"max abs difference {np.max(np.abs(got - expected))}"
    assert [h["participants"] for h in result["history"]] == [N_CLIENTS] * ROUNDS
    for k in range(N_CLIENTS):
        assert result["audits"][str(k)]["releases"] == ROUNDS and result["audits"][str(k)]["epsilon"] == math.inf
        served = _served(warm, k)
        # the run's identify query and its ROUNDS train messages, all in the one worker process of this SuperNode
        assert [kind for _, kind, _ in served] == ["query"] + ["train"] * ROUNDS
        assert {pid for pid, _, _ in served} == {warm.workers[k].pid}
        assert all(outcome == "done" for _, _, outcome in served)
    assert not any("flwr-clientapp" in open(os.path.join(warm.workdir, f"supernode{k}.log"), errors="replace").read()
                   for k in range(N_CLIENTS))


PROBE_APP = '''
"""A probe of the ClientApp executor: answers its pid and a message count kept in Context.state; fails on demand."""

import json
import os
import time

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

server_app = ServerApp()
client_app = ClientApp()


@client_app.query()
def answer(msg, context):
    count = int(context.state["probe"]["count"]) + 1 if "probe" in context.state else 1
    context.state["probe"] = ConfigRecord({"count": count})
    return Message(RecordDict({"probe": ConfigRecord({"pid": os.getpid(), "count": count})}), reply_to=msg)


@client_app.query("fail")
def fail(msg, context):
    raise ValueError("a deliberate failure of this task")


@server_app.main()
def main(grid, context):
    n = int(context.run_config["nodes"])
    deadline = time.monotonic() + 60
    while len(list(grid.get_node_ids())) < n and time.monotonic() < deadline:
        time.sleep(0.5)
    nodes = sorted(grid.get_node_ids())
    rounds = []
    for kind in ("query", "query.fail", "query", "query"):
        messages = [Message(RecordDict(), dst_node_id=node, message_type=kind, group_id=kind) for node in nodes]
        answers = []
        for reply in grid.send_and_receive(messages, timeout=60):
            entry = {"node": reply.metadata.src_node_id}
            if reply.has_error():
                entry.update(code=reply.error.code, reason=reply.error.reason)
            else:
                entry.update(pid=int(reply.content["probe"]["pid"]), count=int(reply.content["probe"]["count"]))
            answers.append(entry)
        rounds.append(answers)
    with open(context.run_config["result-path"], "w") as f:
        json.dump({"nodes": nodes, "rounds": rounds}, f)
'''


def _probe_app(directory: str, result_path: str, nodes: int) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "probe_app.py"), "w") as f:
        f.write(PROBE_APP)
    with open(os.path.join(directory, "pyproject.toml"), "w") as f:
        f.write(textwrap.dedent(f"""\
            [build-system]
            requires = ["hatchling"]
            build-backend = "hatchling.build"

            [project]
            name = "privfl-probe"
            version = "1.0.0"
            description = "A probe of the ClientApp executor"
            license = "Apache-2.0"
            dependencies = []

            [tool.hatch.build.targets.wheel]
            packages = ["."]

            [tool.flwr.app]
            publisher = "privfl"

            [tool.flwr.app.components]
            serverapp = "probe_app:server_app"
            clientapp = "probe_app:client_app"

            [tool.flwr.app.config]
            nodes = {nodes}
            result-path = {json.dumps(result_path)}
            """))
    return directory


@pytest.mark.slow  # make test-all (about 22 s); the warm workers serve the runs of make test
def test_a_failing_task_gets_an_error_reply_and_the_worker_keeps_serving(warm):
    from flwr.common.constant import ErrorCode

    result_path = os.path.join(warm.workdir, "probe-result.json")
    before = {k: len(_served(warm, k)) for k in range(N_CLIENTS)}
    warm.run(_probe_app(os.path.join(warm.workdir, "app-probe"), result_path, N_CLIENTS), timeout=RUN_TIMEOUT)
    if not os.path.exists(result_path):
        log = open(os.path.join(warm.workdir, "flwr-run.log"), errors="replace").read()[-4000:]
        pytest.fail(f"the probe's ServerApp wrote no result; flwr run log:\n{log}")
    result = json.load(open(result_path))
    assert [len(r) for r in result["rounds"]] == [N_CLIENTS] * 4
    first, failed, second, third = ({e["node"]: e for e in r} for r in result["rounds"])
    for node in result["nodes"]:
        assert failed[node]["code"] == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
        assert failed[node]["reason"] == "<class 'ValueError'>:<'a deliberate failure of this task'>"
        # the same worker process answered before and after the failure, and the SuperNode carried the context
        assert first[node]["pid"] == second[node]["pid"] == third[node]["pid"]
        assert (first[node]["count"], second[node]["count"], third[node]["count"]) == (1, 2, 3)
    assert {first[n]["pid"] for n in result["nodes"]} == {w.pid for w in warm.workers}
    for k in range(N_CLIENTS):
        served = _served(warm, k)[before[k]:]
        assert [(kind, outcome) for _, kind, outcome in served] == [
            ("query", "done"), ("query.fail", "FAILED"), ("query", "done"), ("query", "done")]
        assert warm.workers[k].poll() is None


@pytest.mark.slow  # make test-all (CI time): the warm workers serve every deployment of make test
def test_kill_and_restart_a_warm_node_stop_and_start_its_worker(warm):
    """Runs last in this module: it leaves a restarted SuperNode whose old node id the SuperLink still lists."""
    old_node, old_worker = warm.procs[1], warm.workers[0]
    warm.kill_node(0)
    assert old_node.poll() is not None and old_worker.poll() is not None
    node = warm.restart_node(0)
    assert warm.procs[1] is node and node.poll() is None
    worker = warm.workers[0]
    assert worker is not old_worker and worker.poll() is None
    assert str(node.pid) in worker.args  # --parent-pid: the worker ends with its SuperNode
    warm.wait_workers(timeout=60)  # the restarted worker connects to the restarted SuperNode and serves
    # the worker follows its SuperNode when that dies on its own (not stopped through the deployment)
    os.kill(node.pid, 9)
    node.wait(timeout=10)  # reaped, as a supervisor would: a zombie still counts as alive
    worker.wait(timeout=30)
