"""The neighbouring-dataset contract (``test_neighbouring_contract.py``) on the vectorised executor: the same grid,
for every algorithm the executor trains, with each client's step taken by ``Simulation.client_steps`` (all clients
of the round trained together) instead of ``client_step``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from privfl.runtime.engine import Simulation

_spec = importlib.util.spec_from_file_location("_contract", Path(__file__).with_name("test_neighbouring_contract.py"))
contract = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_contract", contract)  # dataclasses look their module up there
_spec.loader.exec_module(contract)

VECTORISED = ("fedavg", "fedprox", "dp_fedavg", "dpsgd_fedavg", "dp_fedsgd", "dp_fedsgd_sampled", "fola", "hbfl")
GRID = [g for g in contract.GRID if g[0] in VECTORISED]



def vectorised_transcript(name, data, public, fed, privacy, secure):
    sim = Simulation(contract.make(name, fed, privacy), data, fed, privacy, secure=secure, public=public,
                     executor="vectorised")
    sim.prepare()
    assert sim.vectorised, f"{name} did not take the vectorised path"
    for p in sim.pipelines:
        p.noise = contract.ZeroNoise()
    present = [k for k in range(public.n_clients) if len(data.train_parts[k]) > 0]
    releases = dict(sim.client_steps(present, 0))
    charges = {k: {c.channel: c.event for c in sim.ledger.charges(str(k))} for k in releases}
    ranges = {}
    if secure is not None:
        for ch in sim.channels:
            rs = [releases[k][ch.name] for k in releases]
            ranges[ch.name] = (sim.plans[ch.name].quantiser.high if sim.plans and ch.name in sim.plans
                               else contract._range(ch, rs))
    return contract.Transcript(releases, charges, ranges, sim)


@pytest.mark.parametrize("name, unit, adjacency, placement, secure, sampling", contract.grid_params(GRID))
def test_what_a_client_sends_on_neighbouring_datasets_vectorised(monkeypatch, name, unit, adjacency, placement,
                                                                 secure, sampling):
    monkeypatch.setattr(contract, "transcript", vectorised_transcript)
    contract.test_what_a_client_sends_on_neighbouring_datasets(name, unit, adjacency, placement, secure, sampling)
