"""The README's Flower section, as a user follows it (issue 31): its Python block builds a spec from public facts
alone and writes the app, and its config.toml block names the connection the same way LocalDeployment does."""

from __future__ import annotations

import pathlib
import re
import tomllib

import pytest

pytest.importorskip("flwr")

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _section() -> str:
    text = README.read_text()
    start = text.index("## Across machines on Flower")
    return text[start:text.index("\n## ", start + 1)]


def test_the_readme_flower_python_block_writes_an_app(tmp_path, monkeypatch):
    code = re.search(r"```python\n(.*?)```", _section(), re.S).group(1).replace("/data/", f"{tmp_path}/data/")
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "readme_flower"}
    exec(compile(code, "README.md", "exec"), scope)
    spec = scope["spec"]
    assert spec.client_size == 500 and spec.privacy.private and spec.n_clients == 3
    app = tmp_path / "app"
    config = tomllib.loads((app / "pyproject.toml").read_text())
    assert config["tool"]["flwr"]["app"]["components"]["serverapp"].endswith(":server_app")
    assert {"rounds", "epsilon", "run-id"} <= set(config["tool"]["flwr"]["app"]["config"])


def test_the_readme_config_toml_names_the_connection_flwr_run_uses():
    section = _section()
    block = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    config = tomllib.loads(block)
    name = config["superlink"]["default"]
    assert f"flwr run app {name}" in section
    connection = config["superlink"][name]
    port = connection["address"].rsplit(":", 1)[1]
    assert f"flower-superlink --insecure --port {port}" in section and connection["insecure"] is True
