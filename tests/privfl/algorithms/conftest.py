"""Shared fixtures of the algorithm tests."""

import pytest


@pytest.fixture
def cli_run(tmp_path, capsys):
    """``cli_run(algorithm, *flags)``: ``privfl run`` on 3 digits clients for 2 rounds of 16-unit models (flags may
    override any of these), asserted to succeed; returns its JSON result."""
    import json

    from privfl.apps.cli import main

    def run(algorithm: str, *flags: str) -> dict:
        out = tmp_path / f"{algorithm}.json"
        code = main(["run", "--algorithm", algorithm, "--dataset", "digits", "--clients", "3", "--rounds", "2",
                     "--hidden", "16", *flags, "--json", str(out), "--quiet"])
        assert code == 0, capsys.readouterr().err
        return json.loads(out.read_text())

    return run
