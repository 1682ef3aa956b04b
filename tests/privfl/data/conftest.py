"""Every data test runs offline: any attempt to open a network connection fails loudly, and the default cache
directory points into the test's temporary folder."""

from __future__ import annotations

import socket
import urllib.request

import pytest


class NetworkDisabled(RuntimeError):
    pass


def _refuse(*args, **kwargs):
    raise NetworkDisabled("tests must not touch the network")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setattr(socket.socket, "connect", _refuse)
    monkeypatch.setattr(socket, "create_connection", _refuse)
    monkeypatch.setattr(urllib.request, "urlopen", _refuse)
    monkeypatch.setenv("PRIVFL_DATA", str(tmp_path / "privfl-cache"))
    yield
