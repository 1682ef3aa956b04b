"""Bad arguments to the Flower launchers are refused up front with a message, exit 2 (a review, session 26 s26g):
``privfl-flower-run --result`` into a missing folder or onto a folder raised after the whole run (and left a stray
``.tmp``); ``privfl-flower-worker`` gave tracebacks (exit 1) for ``--poll-interval -1``, ``--log-level LOUD``,
``--root-certificates /missing`` and ``--parent-pid -5``."""

from __future__ import annotations

import io
import os
import stat

import pytest

from privfl.flower import launch, warm


def _fake_flwr(tmp_path) -> tuple[str, str]:
    """A ``flwr`` that streams a finished run's log with a whole result in it, and marks that it ran."""
    ran = tmp_path / "flwr-ran"
    lines = launch.result_lines(b"RESULT-BYTES" * 100)
    script = tmp_path / "flwr"
    script.write_text("#!/bin/sh\n" + f"touch {ran}\n" + "".join(f"echo '{line}'\n" for line in lines))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), str(ran)


@pytest.mark.parametrize("where", ["missing/sub/result.bin", "a-folder"])
def test_a_result_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, monkeypatch, capsys, where):
    fake, ran = _fake_flwr(tmp_path)
    monkeypatch.setattr(launch, "_flwr", lambda: fake)
    (tmp_path / "a-folder").mkdir()
    target = str(tmp_path / where)
    assert launch.run(["app", "conn", "--result", target], out=io.StringIO()) == 2  # old: raised after the run
    assert "--result" in capsys.readouterr().err
    assert not os.path.exists(ran)  # refused before flwr run started
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    # --from-log too
    assert launch.run(["--from-log", "7", "conn", "--result", target], out=io.StringIO()) == 2
    assert not os.path.exists(ran)
    # and a good path still gets the result
    good = tmp_path / "result.bin"
    assert launch.run(["app", "conn", "--result", str(good)], out=io.StringIO()) == 0
    assert good.read_bytes() == b"RESULT-BYTES" * 100


def test_a_result_that_fails_late_exits_2_and_leaves_no_tmp(tmp_path, monkeypatch, capsys):
    fake, _ = _fake_flwr(tmp_path)
    monkeypatch.setattr(launch, "_flwr", lambda: fake)
    monkeypatch.setattr(launch, "check_result_path", lambda path: None)  # the folder went away during the run
    target = tmp_path / "gone" / "result.bin"
    assert launch.run(["app", "conn", "--result", str(target)], out=io.StringIO()) == 2  # old: FileNotFoundError
    assert "--from-log" in capsys.readouterr().err
    assert not (tmp_path / "gone").exists()


@pytest.mark.parametrize("argv, flag", [
    (["--insecure", "--poll-interval", "-1"], "--poll-interval"),
    (["--insecure", "--log-level", "LOUD"], "--log-level"),
    (["--root-certificates", "/missing/ca.pem"], "--root-certificates"),
    (["--insecure", "--parent-pid", "-5"], "--parent-pid"),
    (["--insecure", "--superexec-auth-secret-file", "/missing/secret"], "--superexec-auth-secret-file"),
])
def test_worker_arguments_are_checked_by_the_parser(argv, flag, capsys):
    with pytest.raises(SystemExit) as stop:  # old: a ValueError / FileNotFoundError traceback, exit 1
        warm.main(["--runtime-api-address", "127.0.0.1:1", *argv])
    assert stop.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_worker_log_level_is_case_insensitive():
    args = warm._parser().parse_args(["--runtime-api-address", "127.0.0.1:1", "--insecure", "--log-level", "debug",
                                      "--poll-interval", "0.05", "--parent-pid", str(os.getpid())])
    assert (args.log_level, args.poll_interval, args.parent_pid) == ("DEBUG", 0.05, os.getpid())
