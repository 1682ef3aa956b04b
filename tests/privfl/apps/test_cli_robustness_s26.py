"""Bad input as users type it, refused with a message naming what to change (exit 2, no traceback) and nothing lost
or charged (a review, session 26 s26g).

- ``--json`` / ``--save-model`` into a place the process cannot write: the whole budget was charged, then the write
  failed (for ``--save-model`` a torch traceback, before the JSON, so both were lost) and the same command was
  refused after (its run id held). Now checked by a real write before anything is charged; a write that still fails
  after the run exits 2 with the JSON on stderr, and the JSON is written before the model.
- ``[overrides.<algorithm>] epsilon`` (seed, delta) in a compare TOML: a TypeError traceback; ``seeds = [1.5]``
  silently truncated.
- MemoryError / allocator tracebacks for ``--trials``, ``--canaries``, ``--hidden``.
- messages that did not name the flag: ``--clip 1e308``, ``audit-mechanism --seed -1``, ``--noise-multiplier 1e308``,
  ``--option class_weights=balanced``, an OSError without a file name (``error:: ...``).
- ``privfl.federate(model, clients, epsilon="3")`` / ``model=None``: TypeErrors.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys

import numpy as np
import pytest

from privfl.apps import cli

RUN = ["run", "--algorithm", "dp_fedavg", "--dataset", "digits", "--clients", "3", "--rounds", "1", "--epsilon", "3",
       "--quiet"]


def _charges(ledger) -> int:
    if not os.path.exists(ledger):
        return 0
    with sqlite3.connect(ledger) as conn:
        return conn.execute("SELECT COUNT(*) FROM charges").fetchone()[0]


def _unwritable_paths(tmp_path):
    """Paths this process cannot write, as root too: inside /proc (no file can be created there), and, when not root,
    a folder without write permission."""
    paths = []
    if os.path.isdir("/proc/self"):
        paths.append("/proc/privfl-s26-out")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        paths.append(str(ro / "out"))
    if not paths:
        pytest.skip("no unwritable folder to test with on this system")
    return paths


@pytest.mark.parametrize("flag, suffix", [("--json", ".json"), ("--save-model", ".pt")])
def test_an_unwritable_output_is_refused_before_anything_is_charged(tmp_path, capsys, flag, suffix):
    target = _unwritable_paths(tmp_path)[0] + suffix
    ledger = tmp_path / "L.sqlite"
    rc = cli.main([*RUN, "--ledger", str(ledger), flag, target])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"{flag} {target}: this process cannot write there" in err and "Traceback" not in err
    assert _charges(ledger) == 0  # the old code trained and charged the whole budget first
    good = tmp_path / ("ok" + suffix)  # the corrected command runs: nothing holds its run id
    assert cli.main([*RUN, "--ledger", str(ledger), flag, str(good)]) == 0
    assert good.exists() and _charges(ledger) > 0


def test_the_write_probe_refuses_every_unwritable_target(tmp_path):
    from privfl.errors import ConfigurationError

    for target in _unwritable_paths(tmp_path):
        with pytest.raises(ConfigurationError, match="cannot write there"):
            cli._check_out_path(os.path.join(target, "sub", "out.json"), "--json")
        with pytest.raises(ConfigurationError, match="cannot write there"):
            cli._check_out_path(target + ".json", "--json")
    cli._check_out_path(str(tmp_path / "new" / "out.json"), "--json")  # a missing folder that can be created
    assert not (tmp_path / "new").exists() and os.listdir(tmp_path) in ([], ["ro"])  # the probe leaves nothing


def test_a_model_that_cannot_be_saved_after_the_run_exits_2_and_the_json_is_kept(tmp_path, capsys, monkeypatch):
    import torch

    def refuse(obj, path, *a, **k):  # what torch.save raises for a folder made read-only meanwhile
        raise RuntimeError(f"File {path} cannot be opened.")

    monkeypatch.setattr(torch, "save", refuse)
    out = tmp_path / "out.json"
    rc = cli.main([*RUN, "--ledger", str(tmp_path / "L.sqlite"), "--save-model", str(tmp_path / "m.pt"),
                   "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 2  # the old code: the RuntimeError's traceback, and no JSON
    assert "--save-model" in err and "could not be saved" in err and "Traceback" not in err
    result = json.loads(out.read_text())
    assert result["epsilon_spent_max"] > 0 and result["model_path"] is None


def test_json_that_cannot_be_written_after_the_run_goes_to_stderr(tmp_path, capsys, monkeypatch):
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs /proc")
    monkeypatch.setattr(cli, "_check_writable", lambda path, flag: None)  # the target became unwritable meanwhile
    rc = cli.main([*RUN, "--ledger", str(tmp_path / "L.sqlite"), "--json", "/proc/privfl-s26-late.json"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--json /proc/privfl-s26-late.json could not be written" in err
    start = err.index("{\n")
    result = json.JSONDecoder().raw_decode(err[start:])[0]  # the old code: the results were lost
    assert result["epsilon_spent_max"] > 0 and result["algorithm"] == "dp_fedavg"


def test_audit_run_json_into_an_unwritable_place_is_refused_first(tmp_path, capsys):
    target = _unwritable_paths(tmp_path)[0] + ".json"
    ledger = tmp_path / "A.sqlite"
    rc = cli.main(["audit-run", "--algorithm", "dp_fedavg", "--dataset", "digits", "--clients", "3", "--rounds", "1",
                   "--epsilon", "3", "--ledger", str(ledger), "--json", target])
    assert rc == 2
    assert "cannot write there" in capsys.readouterr().err
    assert _charges(ledger) == 0


@pytest.mark.parametrize("argv, flag", [
    (["audit-mechanism", "--trials", "100000000000000"], "--trials"),
    (["audit-mechanism", "--seed", "-1"], "--seed"),
    (["audit-mechanism", "--noise-multiplier", "1e308", "--trials", "1000"], "--noise-multiplier"),
    (["audit-run", "--algorithm", "dp_fedavg", "--dataset", "digits", "--clients", "3", "--rounds", "1",
      "--canaries", "100000000000"], "--canaries"),
])
def test_sizes_and_seeds_out_of_range_name_their_flag(argv, flag, capsys):
    assert cli.main(argv) == 2  # the old code: MemoryError tracebacks, numpy's or an overflow's messages
    err = capsys.readouterr().err
    assert f"error: {flag}" in err and "Traceback" not in err


def test_running_out_of_memory_names_the_flags_to_lower(tmp_path, capsys, monkeypatch):
    from privfl.runtime import engine

    def no_memory(self, *a, **k):  # what torch's CPU allocator raises for --hidden 100000000000
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 6400000000000 bytes.")

    monkeypatch.setattr(engine.Simulation, "run", no_memory)
    assert cli.main([*RUN, "--hidden", "8"]) == 2
    err = capsys.readouterr().err
    assert "out of memory" in err and "--hidden" in err


def test_clip_too_large_names_clip(capsys):
    assert cli.main([*RUN, "--clip", "1e308"]) == 2
    err = capsys.readouterr().err
    assert "--clip: clip must be at most" in err  # the old code: "noise_std must be a finite number > 0, got inf"


def test_class_weights_must_be_numbers(capsys):
    assert cli.main(["run", "--algorithm", "dpsgd_fedavg", "--dataset", "digits", "--clients", "3", "--rounds", "1",
                     "--option", "class_weights=balanced"]) == 2
    err = capsys.readouterr().err
    assert "--option class_weights: class weights must be numbers" in err  # old: could not convert string to float
    assert "private label counts" in err


def test_an_os_error_without_a_file_name_reads_cleanly(capsys, monkeypatch):
    def fail(args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "cmd_calibrate", fail)
    assert cli.main(["calibrate", "--epsilon", "1", "--rounds", "2"]) == 2
    assert capsys.readouterr().err.strip() == "privfl calibrate: error: No space left on device"  # old: "error:: "


# -- compare -------------------------------------------------------------------------------------------------------

_GRID = 'dataset = "digits"\nclients = 3\nrounds = 1\npartition = "iid"\nalgorithms = ["dp_fedavg"]\n'


@pytest.mark.parametrize("key, value, top", [("epsilon", "5.0", "epsilons"), ("seed", "3", "seeds"),
                                             ("delta", "1e-6", "delta")])
def test_compare_overrides_may_not_set_the_grid_keys(tmp_path, capsys, key, value, top):
    cfg = tmp_path / "c.toml"
    cfg.write_text(_GRID + f"epsilons = [3.0]\nseeds = [0]\n\n[overrides.dp_fedavg]\n{key} = {value}\n")
    assert cli.main(["compare", str(cfg), "--out-dir", str(tmp_path / "o"), "--quiet"]) == 2  # old: TypeError, rc 1
    err = capsys.readouterr().err
    assert f"[overrides.dp_fedavg] sets {key}" in err and f"{top} = ... at the top level" in err
    assert not (tmp_path / "o" / "ledgers").exists()


@pytest.mark.parametrize("seeds", ["[1.5]", "[0, -1]", "[true]"])
def test_compare_seeds_must_be_non_negative_integers(tmp_path, capsys, seeds):
    cfg = tmp_path / "c.toml"
    cfg.write_text(_GRID + f"epsilons = [3.0]\nseeds = {seeds}\n")
    assert cli.main(["compare", str(cfg), "--out-dir", str(tmp_path / "o"), "--quiet"]) == 2
    assert "seeds must be integers >= 0" in capsys.readouterr().err  # old: 1.5 ran as seed 1; -1 after seed 0 ran
    assert not (tmp_path / "o" / "ledgers").exists()


# -- privfl.federate -----------------------------------------------------------------------------------------------

def _clients():
    rng = np.random.default_rng(0)

    def part(n):
        x = rng.normal(size=(n, 4)).astype(np.float32)
        return x, (x[:, 0] > 0).astype(np.int64)

    return {"a": part(40), "b": part(40)}, part(30)


def test_federate_epsilon_of_the_wrong_type_is_a_configuration_error():
    import torch.nn as nn

    import privfl
    from privfl.errors import ConfigurationError

    clients, test = _clients()
    with pytest.raises(ConfigurationError, match=r"epsilon must be a number .* got '3' \(str\)"):
        privfl.federate(nn.Linear(4, 2), clients, algorithm="dp_fedavg", epsilon="3", test=test, client_size=40)


def test_federate_without_a_model_names_the_argument():
    import privfl
    from privfl.errors import ConfigurationError

    clients, test = _clients()
    with pytest.raises(ConfigurationError, match="model is None"):  # old: 'NoneType' object is not callable
        privfl.federate(None, clients, algorithm="dp_fedavg", epsilon=3.0, test=test, client_size=40)
