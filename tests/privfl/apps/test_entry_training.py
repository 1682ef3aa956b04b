"""``privfl run --entry module:function`` carries the user's loss and optimizer (a mapping entry), and the run JSON
describes the model that actually ran: its class and parameter count, not the built-in "mlp" settings."""

import json
import sys

import pytest

from privfl.apps.cli import main
from privfl.data.own import load_entry

ENTRY = '''
import numpy as np
import torch
from torch import nn

CALLS = {"loss": 0, "optimizer": 0}


class Net(nn.Module):  # the user's 3-16-2 module
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x):
        return self.body(x)


class CountingLoss(nn.CrossEntropyLoss):
    def forward(self, outputs, targets):
        CALLS["loss"] += 1
        return super().forward(outputs, targets)


def adam(params):
    CALLS["optimizer"] += 1
    return torch.optim.Adam(params, lr=1e-2)


def _clients():
    rng = np.random.default_rng(0)
    out = {}
    for k in range(3):
        x = rng.normal(size=(40, 3)).astype(np.float32)
        out[f"h{k}"] = (x, (x[:, 0] > 0).astype(np.int64))
    return out


def federation():
    torch.manual_seed(0)
    return {"model": Net(), "clients": _clients(), "loss": CountingLoss(), "optimizer": adam}


def only_optimizer():
    return {"model": "mlp", "clients": _clients(), "optimizer": adam}


def module_only():
    torch.manual_seed(0)
    return Net(), _clients()


def bad_key():
    return {"clients": _clients(), "optimiser": adam}
'''


@pytest.fixture
def entry(tmp_path, monkeypatch):
    (tmp_path / "userfed.py").write_text(ENTRY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("userfed", None)
    yield tmp_path
    sys.modules.pop("userfed", None)


def _run(*extra, algorithm="fedavg", entry_point="userfed:federation"):
    return ["run", "--entry", entry_point, "--classes", "0,1", "--algorithm", algorithm, "--rounds", "2",
            "--standardize", "none", "--quiet", *extra]


def test_entry_loss_and_optimizer_train_the_model_and_the_json_describes_it(entry, capsys):
    out = entry / "r.json"
    assert main(_run("--epsilon", "inf", "--json", str(out))) == 0, capsys.readouterr().err
    calls = sys.modules["userfed"].CALLS
    assert calls["loss"] > 0 and calls["optimizer"] > 0  # the user's own, used by every client's local step
    result = json.loads(out.read_text())
    # the model that ran: the user's Net, 3*16 + 16 + 16*2 + 2 = 98 parameters
    assert result["model"] == {"class": "Net", "module": "userfed", "parameters": 98, "own": True}
    settings = result["settings"]
    assert settings["federation"]["model"] == "own (see user_model)"
    assert settings["federation"]["hidden"] is None and settings["federation"]["pool"] is None
    assert settings["user_model"]["class"] == "Net" and settings["user_model"]["parameters"] == 98
    assert settings["user_model"]["source"] == "--entry userfed:federation"
    assert settings["user_training"] == {"loss": "CountingLoss", "optimizer": "adam"}


def test_private_run_takes_them_too(entry, capsys):
    out = entry / "r.json"
    code = main(_run("--epsilon", "3", "--client-size", "32", "--seeded-noise", "--algorithm", "dpsgd_fedavg",
                     "--json", str(out)))
    assert code == 0, capsys.readouterr().err
    assert sys.modules["userfed"].CALLS["optimizer"] > 0
    result = json.loads(out.read_text())
    assert result["model"]["class"] == "Net" and 0 < result["epsilon_spent_max"] <= 3 * (1 + 1e-9)


def test_a_built_in_model_is_described_as_such(entry, capsys):
    out = entry / "r.json"
    assert main(_run("--epsilon", "inf", "--json", str(out), entry_point="userfed:only_optimizer")) == 0
    assert sys.modules["userfed"].CALLS["optimizer"] > 0
    model = json.loads(out.read_text())["model"]
    assert model["class"] == "MLP" and model["own"] is False and model["name"] == "mlp" and model["parameters"] > 0


def test_tuple_entries_still_work_and_describe_the_module(entry, capsys):
    out = entry / "r.json"
    assert main(_run("--epsilon", "inf", "--json", str(out), entry_point="userfed:module_only")) == 0
    assert json.loads(out.read_text())["model"]["class"] == "Net"


@pytest.mark.parametrize("algorithm, needle", [("fola", "returned your own optimizer, which fola does not take"),
                                               ("fedbnn", "which fedbnn does not take")])
def test_an_algorithm_that_trains_with_its_own_loss_refuses_them(entry, capsys, algorithm, needle):
    code = main(_run("--epsilon", "inf", algorithm=algorithm))
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "dpsgd_fedavg" in err and "Traceback" not in err


def test_unknown_keys_are_refused(entry, capsys):
    assert main(_run("--epsilon", "inf", entry_point="userfed:bad_key")) == 2
    err = capsys.readouterr().err
    assert "unknown keys ['optimiser']" in err and "loss, optimizer" in err


def test_load_entry_reads_the_mapping(entry):
    got = load_entry("userfed:federation")
    assert type(got.module).__name__ == "Net" and type(got.loss).__name__ == "CountingLoss"
    assert got.optimizer.__name__ == "adam" and set(got.training) == {"model", "loss", "optimizer"}
