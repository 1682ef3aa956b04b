"""The README's Flower section followed literally (issue 31): its Python block writes the apps, its config.toml block
is the coordinator's FLWR_HOME, and its bash block runs as a script, as written, on loopback: a SuperLink, three
SuperNodes with the organisations' files, three runs (the default, one with --run-config overrides, one through
privfl's launcher) and the same run on Flower's Simulation Engine. Only what a test must change is changed: free
ports for 9092, 9093 and 9094.., and a folder of its own for ``/data``. Every process the script starts is in its
process group, stopped whatever happens.

Slow (two SuperLinks, Ray, four runs: a few minutes): ``make test-all``."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("flwr")

from privfl.accounting.ledger import PrivacyLedger  # noqa: E402
from privfl.flower.app import read_result  # noqa: E402

pytestmark = pytest.mark.slow
README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def _section() -> str:
    with open(README) as f:
        text = f.read()
    start = text.index("## Across machines on Flower")
    return text[start:text.index("\n## ", start + 1)]


def _free_run(n: int) -> int:
    """A port p with p .. p + n - 1 all free a moment ago."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no run of free ports")


def _stop_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        time.sleep(3)


@pytest.mark.timeout(960)  # the script's own bound is 900 s; its seven runs take about 5 minutes here
def test_the_readme_flower_commands_run_as_written(tmp_path):
    from sklearn.datasets import load_digits

    section = _section()
    blocks = {kind: re.search(rf"```{kind}\n(.*?)```", section, re.S).group(1) for kind in ("python", "toml", "bash")}
    data = tmp_path / "data"
    link, sim, nodes = _free_run(1), _free_run(1), _free_run(3)

    def here(text: str) -> str:
        for old, new in (("/data/", f"{data}/"), ("/data\n", f"{data}\n"), ("9092", str(link)), ("9093", str(sim)),
                         ("9094", str(nodes))):
            text = text.replace(old, new)
        return text

    data.mkdir()
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    for k in range(3):  # each organisation's records, as its SuperNode's data-path names them
        np.savez(data / f"org{k}.npz", x=x[k * 500:(k + 1) * 500], y=y[k * 500:(k + 1) * 500])
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(here(blocks["python"]), "README.md", "exec"), {"__name__": "readme"})
    finally:
        os.chdir(cwd)
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(here(blocks["toml"]))
    script = tmp_path / "readme.sh"
    script.write_text("set -euo pipefail\n" + here(blocks["bash"]))
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, FLWR_HOME=str(home), PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    log_path = tmp_path / "readme.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=900)
        finally:
            _stop_group(proc)
    text = log_path.read_text(errors="replace")
    assert code == 0, text[-5000:]

    result = read_result(str(data / "coordinator" / "result.bin"))  # the launcher's last run: trial-4
    assert result["run_id"] == "trial-4" and [h["round"] for h in result["history"]] == list(range(5))
    # the coordinator's copy through Flower's log stream is the SuperLink host's result, byte for byte
    assert (data / "coordinator" / "my-copy.bin").read_bytes() == (data / "coordinator" / "result.bin").read_bytes()
    simulated = read_result(str(data / "coordinator" / "result-sim.bin"))
    assert [h["round"] for h in simulated["history"]] == list(range(5))
    assert all(h["participants"] == 3 for h in simulated["history"])
    for k in range(3):
        path = str(data / f"org{k}-ledger.sqlite")
        assert set(PrivacyLedger.run_ids(path)) == {"hospitals-dp-fedavg", "trial-2", "trial-3", "trial-4"}
        for run_id, target, rounds in (("hospitals-dp-fedavg", 3.0, 5), ("trial-2", 1.0, 3), ("trial-3", 3.0, 5),
                                       ("trial-4", 3.0, 5)):
            ledger = PrivacyLedger.open_existing(path, run_id)
            try:
                audit = ledger.audit()["clients"][str(k)]
            finally:
                ledger.close()
            assert audit["releases"] == rounds and audit["epsilon"] <= target * (1 + 1e-9)
    assert "round 5/5" in text  # the ServerApp's per-round lines reach the coordinator's stream
