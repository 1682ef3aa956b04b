"""experiments/fast_supernode.py, the tests' SuperNode launcher (a test tool, not part of privfl): Flower's own
``flower-supernode`` with its fixed idle waits shortened.

The launcher's command line: its options are taken out wherever they are and everything else reaches Flower in its
order; a malformed option exits with status 2 and a one-line reason, no traceback. The shim: only the sleeps of
``flwr.supernode.start_client_internal`` are capped (no other module's, not ``time.sleep`` itself), the module's
per-message wait for a reply goes through it, and an object the SuperLink does not hold yet is asked for again
after the launcher's backoff. A flwr whose SuperNode module is not the expected one is refused, and then the
SuperNode runs unpatched unless ``--require-patch``. Last, FedAvg on three warm SuperNodes started with the
launcher equals the in-process run bit for bit (test_deployment.py's pattern).
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

FAST_SUPERNODE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "experiments", "fast_supernode.py")
_spec = importlib.util.spec_from_file_location("fast_supernode", FAST_SUPERNODE)
supernode = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(supernode)
CappedSleep, backing_off_from, split_argv = supernode.CappedSleep, supernode.backing_off_from, supernode.split_argv

FLOWER_ARGS = ["--insecure", "--superlink", "127.0.0.1:9092", "--isolation", "process", "--port", "9094",
               "--node-config", "partition-id=0 data-path='/data/org0.npz'"]


# -- the command line ----------------------------------------------------------------------------------------------

def test_launcher_options_are_taken_out_and_flowers_kept_in_order():
    options, rest = split_argv(["--insecure", "--poll-interval", "0.1", "--superlink", "127.0.0.1:9092",
                                "--object-backoff=0.2", "--require-patch", "--node-config", "partition-id=0",
                                "--log-timestamps"])
    assert rest == ["--insecure", "--superlink", "127.0.0.1:9092", "--node-config", "partition-id=0"]
    assert options == {"poll_interval": 0.1, "object_backoff": 0.2, "require_patch": True, "log_timestamps": True}
    assert split_argv(FLOWER_ARGS) == ({"poll_interval": supernode.DEFAULT_POLL_INTERVAL,
                                        "object_backoff": supernode.DEFAULT_OBJECT_BACKOFF,
                                        "require_patch": False, "log_timestamps": False}, FLOWER_ARGS)
    # after "--" nothing is the launcher's
    assert split_argv(["--poll-interval", "1", "--", "--poll-interval", "2"]) == (
        {**split_argv([])[0], "poll_interval": 1.0}, ["--", "--poll-interval", "2"])


@pytest.mark.parametrize("args, says", [
    (["--poll-interval", "0"], "--poll-interval must be a number of seconds from 0.01 to 3, got '0'"),
    (["--poll-interval=abc"], "got 'abc'"),
    (["--poll-interval", "nan"], "got 'nan'"),
    (["--poll-interval", "5"], "from 0.01 to 3"),
    (["--object-backoff", "-1"], "--object-backoff must be a number of seconds from 0.01 to 10, got '-1'"),
    (["--poll-interval"], "--poll-interval needs a number of seconds"),
])
def test_a_bad_launcher_option_exits_2_with_its_reason_and_no_traceback(args, says, capsys, monkeypatch):
    monkeypatch.setattr(supernode, "_flower_main", lambda: pytest.fail("Flower must not start"))
    monkeypatch.setattr(supernode, "install", lambda *a, **k: pytest.fail("nothing may be patched"))
    assert supernode.main([*FLOWER_ARGS, *args]) == 2
    err = capsys.readouterr().err
    assert "fast_supernode: error: --" in err and says in err
    assert "Traceback" not in err


def test_the_script_exits_2_on_a_bad_poll_interval():
    proc = subprocess.run([sys.executable, FAST_SUPERNODE, "--poll-interval", "-0.5", *FLOWER_ARGS],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "fast_supernode: error: --poll-interval must be a number of seconds" in proc.stderr
    assert "Traceback" not in proc.stderr and "Starting Flower SuperNode" not in proc.stderr + proc.stdout


def test_privfl_ships_no_patched_flower():
    """What users install runs Flower's binaries as they are: no privfl module patches flwr, and no console script
    wraps a SuperNode."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    scripts = open(os.path.join(root, "pyproject.toml")).read().split("[project.scripts]")[1].split("\n[")[0]
    assert "supernode" not in scripts
    for folder, _, files in os.walk(os.path.join(root, "privfl")):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(folder, name)).read()
                assert "start_client_internal" not in text and "CappedSleep" not in text, name


def test_flower_gets_the_command_line_without_the_launchers_options(monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(sys, "argv", ["fast_supernode"])
    monkeypatch.setattr(supernode, "install", lambda poll, backoff: seen.setdefault("install", (poll, backoff)))
    monkeypatch.setattr(supernode, "_flower_main", lambda: seen.setdefault("argv", list(sys.argv)) and 0)
    monkeypatch.setattr(supernode, "_flwr_version", lambda: "1.41.0")
    assert supernode.main(["--poll-interval", "0.2", *FLOWER_ARGS, "--object-backoff", "0.3"]) == 0
    assert seen == {"install": (0.2, 0.3), "argv": ["fast_supernode", *FLOWER_ARGS]}
    assert "waits capped at 0.2 s" in capsys.readouterr().err


def test_an_unpatchable_flwr_runs_unpatched_with_a_warning_or_is_refused(monkeypatch, capsys):
    def refuse(*_a, **_k):
        raise RuntimeError("flwr 9.0.0 is installed; the patch is written for flwr 1.41.x")

    calls = []
    monkeypatch.setattr(sys, "argv", ["fast_supernode"])
    monkeypatch.setattr(supernode, "install", refuse)
    monkeypatch.setattr(supernode, "_flower_main", lambda: calls.append(list(sys.argv)) or 0)
    assert supernode.main(FLOWER_ARGS) == 0
    assert calls == [["fast_supernode", *FLOWER_ARGS]]
    err = capsys.readouterr().err
    assert "WARNING: running flower-supernode unpatched" in err and "flwr 9.0.0" in err
    assert supernode.main(["--require-patch", *FLOWER_ARGS]) == 2
    assert len(calls) == 1, "--require-patch: Flower is not started"
    err = capsys.readouterr().err
    assert "error: cannot shorten the SuperNode's waits: flwr 9.0.0" in err and "Traceback" not in err


# -- the shim ------------------------------------------------------------------------------------------------------

def test_capped_sleep_caps_sleep_and_is_the_time_module_otherwise():
    slept = []
    shim = CappedSleep(0.05, slept.append)
    for seconds in (3, 0.5, 0.01, 0.05):
        shim.sleep(seconds)
    assert slept == [0.05, 0.05, 0.01, 0.05]
    assert shim.monotonic is time.monotonic and shim.time is time.time and shim.perf_counter is time.perf_counter
    start = time.perf_counter()
    CappedSleep(0.02).sleep(3)  # the real sleep, capped
    assert time.perf_counter() - start < 1.0


def test_backing_off_from_sets_only_the_first_retry():
    calls = []

    def pull_objects(object_ids, pull_object_fn, **kwargs):
        calls.append((object_ids, pull_object_fn, kwargs))
        return {}

    sooner = backing_off_from(0.05, pull_objects)
    sooner(["a"], pull_object_fn=len)
    sooner(["b"], len, initial_backoff=2.0, max_time=9)
    assert calls == [(["a"], len, {"initial_backoff": 0.05}), (["b"], len, {"initial_backoff": 2.0, "max_time": 9})]
    assert sooner.__wrapped__ is pull_objects


@pytest.fixture
def patched():
    """The installed flwr's SuperNode module, patched (cap 0.05 s, recorded sleeps) for the test, then restored."""
    pytest.importorskip("flwr")
    import flwr.supernode.start_client_internal as sci

    slept: list[float] = []
    undo = supernode.install(0.05, 0.05, sleep_fn=slept.append)
    try:
        yield sci, slept
    finally:
        undo()
    assert sci.time is time


def test_the_installed_flwr_is_the_expected_layout():
    pytest.importorskip("flwr")
    assert supernode.check_layout() is None


def test_install_patches_only_the_supernode_module(patched):
    import flwr.supercore.superexec.run_superexec as superexec
    from flwr.supercore.inflatable import inflatable_utils

    cli = importlib.import_module("flwr.supernode.cli.flower_supernode")  # (its package exports a function so named)

    sci, _ = patched
    assert isinstance(sci.time, CappedSleep) and sci.time.cap == 0.05
    assert sci.pull_objects.__wrapped__ is inflatable_utils.pull_objects
    # nothing else: the time module itself, the CLI's sleep, the SuperExec's poll, flwr's pull_objects
    assert time.sleep.__module__ == "time" and cli.sleep is time.sleep and superexec.time is time
    assert inflatable_utils.pull_objects.__module__ == "flwr.supercore.inflatable.inflatable_utils"
    assert supernode.check_layout() and "already patched" in supernode.check_layout()
    with pytest.raises(RuntimeError, match="already patched"):
        supernode.install(0.05, 0.05)  # twice is refused (check_layout), the first patch stays


def test_the_wait_for_a_reply_polls_at_the_cap(patched):
    """``_push_messages`` waits for the ClientApp's reply with ``time.sleep(0.5)`` between looks (flwr 1.41.0
    start_client_internal.py:470): patched, each of those sleeps is the cap."""
    sci, slept = patched

    class Stop(Exception):
        pass

    class State:
        looks = 0

        def get_messages_legacy(self, is_reply):
            assert is_reply
            self.looks += 1
            if self.looks == 4:
                raise Stop
            return []

    with pytest.raises(Stop):
        sci._push_messages(state=State(), object_store=None, send=None, push_object=None)
    assert slept == [0.05, 0.05, 0.05]


def test_a_missing_object_is_asked_for_again_after_the_backoff(patched):
    """flwr's ``pull_objects`` with the SuperNode's arguments, through the patched global: an object the SuperLink
    does not hold yet is retried after ~0.05 s (flwr's own first retry comes after 0.8 to 1.2 s)."""
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

    sci, _ = patched
    asked = []

    def pull_object(object_id):
        asked.append(time.perf_counter())
        if len(asked) < 3:
            raise ObjectUnavailableError(object_id)
        return b"content"

    start = time.perf_counter()
    assert sci.pull_objects(["obj"], pull_object_fn=pull_object) == {"obj": b"content"}
    assert len(asked) == 3
    assert time.perf_counter() - start < 0.7  # 0.05 + 0.1 (+-20%), not 1 + 2 s


def test_check_layout_refuses_another_flwr_or_another_module(monkeypatch, tmp_path):
    pytest.importorskip("flwr")
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.42.0")
    assert supernode.check_layout() == "flwr 1.42.0 is installed; the patch is written for flwr 1.41.x"
    monkeypatch.undo()

    module_path = tmp_path / "changed_supernode_loop.py"
    module_path.write_text("import time\n"
                           "from flwr.supercore.inflatable.inflatable_utils import pull_objects\n\n"
                           "def loop():\n    time.sleep(3)\n    pull_objects([], None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import changed_supernode_loop

    assert "sleeps ['time.sleep(3)'], not" in supernode.check_layout(changed_supernode_loop)
    with pytest.raises(RuntimeError, match="sleeps"):
        supernode.install(0.05, 0.05, module=changed_supernode_loop)
    assert changed_supernode_loop.time is time


# -- a deployment --------------------------------------------------------------------------------------------------

@pytest.mark.slow  # make test-all: test_deployment.py keeps FedAvg deployed on stock SuperNodes in make test
def test_fedavg_on_launched_supernodes_equals_in_process(federation, tmp_path, repro_env, write_orgs, deploy,
                                                         in_process_reference):
    """Three warm SuperNodes under ``fast_supernode.py --poll-interval 0.05``: FedAvg, 3 rounds, bit-identical
    to the in-process run; every SuperNode says it was patched; ``close`` stops every process."""
    pytest.importorskip("flwr")
    from privfl.core.config import FederationConfig, PrivacyConfig
    from privfl.flower.app import RunSpec
    from privfl.flower.local import LocalDeployment

    rounds = 3
    configs = write_orgs(federation, tmp_path)
    fed = FederationConfig(rounds=rounds, local_epochs=1, batch_size=32, lr=0.1, hidden=(16,), seed=7)
    spec = RunSpec.of("fedavg", federation, fed, PrivacyConfig(), run_id="fedavg-launcher", node_wait=60,
                      round_timeout=120)
    expected = in_process_reference(spec, tmp_path)["global_params"]
    dep = LocalDeployment(str(tmp_path), configs, env={**repro_env, "PRIVFL_REPLY_POLL": "0.05"}, warm=True,
                          worker_poll_interval=0.05,
                          supernode_command=(sys.executable, FAST_SUPERNODE, "--poll-interval", "0.05",
                                             "--require-patch", "--log-timestamps"), superexec_poll=0.1)
    try:
        dep.start()
        args = dep._node_args[0]
        assert args[:2] == [sys.executable, FAST_SUPERNODE]
        assert args[args.index("--poll-interval") + 1] == "0.05" and "--require-patch" in args
        start = time.perf_counter()
        result = deploy(dep, spec, "fedavg", 180)
        seconds = time.perf_counter() - start
    finally:
        dep.close()
    assert all(p.poll() is not None for p in dep.procs + dep.workers)
    got = result["state"]["global_params"]
    assert np.array_equal(got, expected), f"max abs difference {np.max(np.abs(got - expected))}"
    assert [h["participants"] for h in result["history"]] == [len(configs)] * rounds
    for k in range(len(configs)):
        assert result["audits"][str(k)]["releases"] == rounds and result["audits"][str(k)]["epsilon"] == math.inf
        log = open(tmp_path / f"supernode{k}.log", errors="replace").read()
        assert "waits capped at 0.05 s" in log and "(flwr.supernode.start_client_internal patched)" in log
        assert "unpatched" not in log
    print(f"flwr run with the launcher: {seconds:.1f} s for {rounds} rounds")
