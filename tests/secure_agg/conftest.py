"""A step-by-step harness for one protocol round, so tests can drop, delay or tamper with single messages."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from privfl.secure_agg.client import ClientSession
from privfl.secure_agg.identity import IdentityRegistry, generate_identity, identity_public_bytes
from privfl.secure_agg.protocol import SessionConfig
from privfl.secure_agg.server import ServerSession


class Harness:
    def __init__(self, n: int = 5, d: int = 16, bits: int = 16, threshold: int | None = None,
                 degree: int | None = None, min_inputs: int | None = None, seed: int = 0,
                 graph_seed: bytes | None = None, malicious: bool = False):
        self.config = SessionConfig.create(range(1, n + 1), bits=bits, dimension=d, threshold=threshold,
                                           degree=degree, min_inputs=min_inputs, malicious=malicious)
        if graph_seed is not None:  # a fixed neighbour graph, for tests whose drops must leave every client enough
            self.config = dataclasses.replace(self.config, graph_seed=graph_seed)
        rng = np.random.default_rng(seed)
        self.values = {c: rng.integers(0, 2 ** bits, size=d, dtype=np.uint64) for c in self.config.client_ids}
        self.identities, self.registry = {}, None
        if malicious:
            self.identities = {c: generate_identity() for c in self.config.client_ids}
            self.registry = IdentityRegistry({c: identity_public_bytes(k) for c, k in self.identities.items()})
        self.server = ServerSession(self.config, registry=self.registry)
        self.clients = {c: ClientSession(self.config, c, self.values[c], identity_key=self.identities.get(c),
                                         registry=self.registry) for c in self.config.client_ids}
        self.gone: set[int] = set()
        self.sent: dict[str, dict[int, object]] = {}

    def _talk(self, stage, eligible, call, drop):
        self.gone |= set(drop)
        out = {}
        for c in sorted(eligible):
            if c not in self.gone:
                out[c] = call(c)
                self.server.receive(out[c])
        self.sent[stage] = out
        return out

    def advertise(self, drop=()):
        return self._talk("advertise_keys", self.clients, lambda c: self.clients[c].advertise_keys(), drop)

    def share(self, drop=()):
        self.directories = self.server.key_directories()
        return self._talk("share_keys", self.directories,
                          lambda c: self.clients[c].share_keys(self.directories[c]), drop)

    def mask(self, drop=()):
        self.deliveries = self.server.share_deliveries()
        return self._talk("masked_input", self.deliveries,
                          lambda c: self.clients[c].masked_input(self.deliveries[c]), drop)

    def unmask(self, drop=()):
        self.request = self.server.unmask_request()
        if self.config.malicious:
            self._talk("consistency_check", self.request.alive,
                       lambda c: self.clients[c].consistency_check(self.request), ())
            self.proofs = self.server.consistency_proofs()
            return self._talk("unmask", self.proofs, lambda c: self.clients[c].unmask(self.proofs[c]), drop)
        return self._talk("unmask", self.request.alive, lambda c: self.clients[c].unmask(self.request), drop)

    def run(self, drops: dict | None = None):
        drops = drops or {}
        self.advertise(drops.get("advertise_keys", ()))
        self.share(drops.get("share_keys", ()))
        self.mask(drops.get("masked_input", ()))
        self.unmask(drops.get("unmask", ()))
        return self.server.finalize()

    def expected(self, included) -> np.ndarray:
        total = np.zeros(self.config.dimension, dtype=np.uint64)
        for c in included:
            total += self.values[c]
        if self.config.bits < 64:
            total &= np.uint64((1 << self.config.bits) - 1)
        return total


@pytest.fixture
def harness():
    return Harness
