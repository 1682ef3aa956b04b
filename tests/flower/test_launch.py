"""``privfl-flower-run`` exits non-zero when a Flower run fails (issue 31: ``flwr run`` exits 0 although the
ServerApp raised)."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys

import pytest

from privfl.flower import launch


def _fake_flwr(tmp_path, text: str, status: int = 0) -> str:
    path = tmp_path / "flwr"
    path.write_text(f"#!/bin/sh\nprintf '%s\\n' {text!r}\nexit {status}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.parametrize("text, status, expected", [
    ("INFO : round 1/2\nExit Code: 201\nAn unhandled exception occurred in the ServerApp.", 0, 201),
    ("INFO : round 1/2\nINFO : round 2/2", 0, 0),
    ("Exit Code: 0", 0, 0),  # Flower's success codes are below 100
    ("usage error", 2, 2),
])
def test_the_launcher_turns_a_failure_in_the_stream_into_its_exit_status(tmp_path, monkeypatch, text, status,
                                                                         expected):
    fake = _fake_flwr(tmp_path, text, status)
    monkeypatch.setattr(launch.shutil, "which", lambda name, path=None: fake)
    out = io.StringIO()
    assert launch.run(["app", "my-federation"], out=out) == expected
    assert text.splitlines()[0] in out.getvalue()  # the stream is echoed


def test_a_missing_result_is_a_failure(tmp_path, monkeypatch):
    fake = _fake_flwr(tmp_path, "INFO : done")
    monkeypatch.setattr(launch.shutil, "which", lambda name, path=None: fake)
    assert launch.run(["app", "--expect-result", str(tmp_path / "absent.bin")], out=io.StringIO()) == 1
    (tmp_path / "there.bin").write_bytes(b"x")
    assert launch.run(["app", "--expect-result", str(tmp_path / "there.bin")], out=io.StringIO()) == 0
    assert launch.run([], out=io.StringIO()) == 2


@pytest.mark.slow  # make test-all (CI time): the launcher's exit codes are tested on a fake flwr above
@pytest.mark.timeout(300)
def test_a_failed_deployment_exits_non_zero(federation, tmp_path, quick_deployment, write_orgs):
    """A real loopback run whose organisation 1 has no data file: its ClientApp fails, the ServerApp raises, and
    the launcher exits with Flower's code 201 where flwr run exits 0."""
    pytest.importorskip("flwr")
    from privfl.core.config import FederationConfig, PrivacyConfig
    from privfl.flower.app import RunSpec, write_app

    configs = write_orgs(federation, tmp_path)
    configs[1]["data-path"] = str(tmp_path / "missing.npz")
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=1)
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="local")
    spec = RunSpec.of("dp_fedavg", federation, fed, privacy, run_id="fails", node_wait=60, round_timeout=60)
    with quick_deployment(tmp_path, configs) as dep:
        app = write_app(str(tmp_path / "app"), spec, result_path=str(tmp_path / "result.bin"))
        proc = subprocess.run([sys.executable, "-m", "privfl.flower.launch", app, "privfl-local",
                               "--expect-result", str(tmp_path / "result.bin")], capture_output=True, text=True,
                              env=dep.env, cwd=dep.workdir, timeout=240)
    assert proc.returncode == 201, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "partition 1" in proc.stdout and "the run failed" in proc.stderr
    assert not os.path.exists(tmp_path / "result.bin")


def test_a_result_crosses_the_log_stream_whole_and_checked():
    data = bytes(range(256)) * 300  # 76,800 bytes: several lines
    lines = launch.result_lines(data)
    assert len(lines) > 3 and all(launch.RESULT_MARK in line for line in lines)
    reader = launch.ResultReader()
    for line in ["INFO : round 1/1", *(f"INFO :      {line}" for line in lines), "INFO : done"]:
        reader.feed(line)
    assert reader.data == data
    # a line lost, or one altered, gives no result (never a wrong one)
    for broken in (lines[:-1], [*lines[:2], lines[2][:-4] + "AAAA", *lines[3:]]):
        reader = launch.ResultReader()
        for line in broken:
            reader.feed(line)
        assert reader.data is None
    assert launch.ResultReader().write("/nonexistent/never-written") is False


def test_the_launcher_writes_the_result_the_stream_carried_and_asks_the_run_for_it(tmp_path, monkeypatch):
    data = b"privfl result" * 1000
    stream = "\\n".join(["INFO : round 1/1", *launch.result_lines(data)])
    argv_file = tmp_path / "argv"
    fake = tmp_path / "flwr"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {argv_file}\nprintf '{stream}\\n'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(launch.shutil, "which", lambda name, path=None: str(fake))
    out = io.StringIO()
    assert launch.run(["app", "conn", "--result", str(tmp_path / "r.bin")], out=out) == 0
    assert (tmp_path / "r.bin").read_bytes() == data
    assert "result-in-log=true" in argv_file.read_text()
    assert launch.RESULT_MARK + " 1/" not in out.getvalue()  # the base64 goes to the file, not the terminal
    # later, from the run's stored log
    (tmp_path / "r.bin").unlink()
    assert launch.run(["--from-log", "7", "conn", "--result", str(tmp_path / "r.bin")], out=out) == 0
    assert argv_file.read_text().split()[:3] == ["log", "7", "conn"] and (tmp_path / "r.bin").read_bytes() == data
    assert launch.run(["--from-log", "7", "conn"], out=out) == 2  # where to write it is required


def test_the_launcher_fails_when_the_stream_carried_no_result(tmp_path, monkeypatch):
    fake = _fake_flwr(tmp_path, "INFO : done")
    monkeypatch.setattr(launch.shutil, "which", lambda name, path=None: fake)
    assert launch.run(["app", "--result", str(tmp_path / "r.bin")], out=io.StringIO()) == 1
    assert not (tmp_path / "r.bin").exists()
    assert launch.run(["--from-log", "3", "--result", str(tmp_path / "r.bin")], out=io.StringIO()) == 1


@pytest.mark.slow  # make test-all (CI time): the launcher's stream parsing is tested above
@pytest.mark.timeout(300)
def test_the_coordinator_gets_the_result_through_flower(federation, tmp_path, quick_deployment, write_orgs):
    """A real loopback run: the coordinator's ``--result`` copy, carried by Flower's log stream, is the result the
    ServerApp wrote on the SuperLink's host, byte for byte; so is the one ``--from-log`` reads from the run's stored
    log afterwards."""
    pytest.importorskip("flwr")
    import re

    from privfl.core.config import FederationConfig, PrivacyConfig
    from privfl.flower.app import RunSpec, read_result, write_app

    configs = write_orgs(federation, tmp_path)
    fed = FederationConfig(rounds=1, local_epochs=1, batch_size=32, lr=0.1, hidden=(), seed=1)
    privacy = PrivacyConfig(epsilon=4.0, delta=1e-5, unit="client", clip=0.5, placement="local")
    spec = RunSpec.of("dp_fedavg", federation, fed, privacy, run_id="fetched", node_wait=60, round_timeout=60)
    on_host, here, later = (str(tmp_path / name) for name in ("host.bin", "coordinator.bin", "later.bin"))
    with quick_deployment(tmp_path, configs) as dep:
        app = write_app(str(tmp_path / "app"), spec, result_path=on_host)
        proc = subprocess.run([sys.executable, "-m", "privfl.flower.launch", app, "privfl-local", "--result", here],
                              capture_output=True, text=True, env=dep.env, cwd=dep.workdir, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        run_id = re.search(r"run (\d+)", proc.stdout).group(1)
        again = subprocess.run([sys.executable, "-m", "privfl.flower.launch", "--from-log", run_id, "privfl-local",
                                "--result", later], capture_output=True, text=True, env=dep.env, cwd=dep.workdir,
                               timeout=120)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    host = open(on_host, "rb").read()
    assert open(here, "rb").read() == host and open(later, "rb").read() == host
    assert read_result(here)["run_id"] == "fetched"
