"""In-process driver: one full round between a ``ServerSession`` and ``ClientSession`` objects in this process.

Messages pass through ``to_bytes``/``from_bytes`` only if ``serialise=True`` (a transport check); otherwise the objects
are handed over directly. Dropouts are simulated per stage: a client in ``drop_at[stage]`` sends nothing from that
stage on. A client that aborts (``ProtocolAbort``) also stops talking, exactly like a dropout.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .client import ClientSession
from .errors import ProtocolAbort
from .identity import ClientIdentity, IdentityRegistry, generate_identity
from .params import ThreatModel
from .protocol import ADVERTISE_KEYS, CONSISTENCY, MASKED_INPUT, SHARE_KEYS, UNMASK, SessionConfig
from .server import ServerSession

__all__ = ["run_round", "RoundResult"]

_DROP_STAGES = (ADVERTISE_KEYS, SHARE_KEYS, MASKED_INPUT, CONSISTENCY, UNMASK)


@dataclass(frozen=True, eq=False)
class RoundResult:
    """``sum``: the modular sum (uint64, entries < 2^bits) of the inputs of ``included`` (the caller's keys).

    ``dropped`` are the other clients; ``client_aborts`` maps a key to the ``ProtocolAbort`` of a client that stopped
    on its own; ``config`` is the session's public configuration.
    """

    sum: np.ndarray
    included: tuple
    dropped: tuple
    bits: int
    config: SessionConfig
    client_aborts: dict = field(default_factory=dict)


def _transport(message, serialise: bool):
    return type(message).from_bytes(message.to_bytes()) if serialise else message


def run_round(values: Mapping[Hashable, np.ndarray], *, bits: int, threshold: int | None = None,
              degree: int | None = None, min_inputs: int | None = None,
              drop_at: Mapping[str, Iterable[Hashable]] | None = None, serialise: bool = False,
              malicious: bool = False, identities: Mapping[Hashable, object] | None = None,
              dropout: float | None = None, corruption: float = 0.0, check: bool = True, context: bytes = b"",
              contexts: Mapping[Hashable, bytes] | None = None) -> RoundResult:
    """Securely sum ``values`` (client key -> 1-D integer vector mod 2^bits) with the full protocol, in process.

    ``threshold``/``degree`` default to a strict majority of a O(log n)-degree neighbour graph (see
    ``SessionConfig.create``); ``min_inputs`` makes the round abort unless that many inputs are in the sum.
    ``drop_at`` maps a stage name (``"advertise_keys"``, ``"share_keys"``, ``"masked_input"``, ``"consistency_check"``
    (malicious variant), ``"unmask"``) to the
    clients that drop before sending that stage's message. Raises ``ProtocolAbort`` when the server cannot finish
    without revealing something it must not (then no sum is returned), including when ``min_inputs`` exceeds the
    number of clients.

    ``malicious=True`` runs the malicious-server variant, with the consistency round; ``identities`` maps each client
    key to its identity (a ``ClientIdentity``, whose pairwise keys then carry over to the next round, or a bare Ed25519
    key; fresh ones are drawn, and registered, when it is not given: a simulation).
    ``dropout``/``corruption`` declare the threat model the degree and threshold are derived from, or checked against
    (``SessionConfig.create``; ``check=False`` is for tests only). With a declared threat model and no explicit degree
    or threshold, every client also derives them itself and refuses a configuration that differs
    (``ClientSession(threat_model=...)``), as a deployment's clients must.

    ``context``: the bytes the server binds the session to (``protocol.session_binding``, malicious variant), and
    each client's unless ``contexts`` maps the client's key to the context it computed itself; a client whose context
    differs from its neighbours' aborts at the first tag check (``client_aborts``), and the round with it.
    """
    if not isinstance(values, Mapping) or len(values) < 2:
        raise ValueError("values must map at least 2 client keys to vectors")
    if isinstance(min_inputs, int) and not isinstance(min_inputs, bool) and min_inputs > len(values):
        raise ProtocolAbort(f"only {len(values)} clients, fewer than min_inputs={min_inputs}: the round is aborted",
                            party="server")
    keys = list(values)
    ids = {key: i + 1 for i, key in enumerate(keys)}
    dims = {np.asarray(v).shape for v in values.values()}
    if len(dims) != 1 or len(next(iter(dims))) != 1:
        raise ValueError(f"all values must be 1-D vectors of one length, got shapes {sorted(dims)}")
    dimension = next(iter(dims))[0]
    drops: dict[str, set[int]] = {s: set() for s in _DROP_STAGES}
    for stage, who in (drop_at or {}).items():
        if stage not in _DROP_STAGES or (stage == CONSISTENCY and not malicious):
            raise ValueError(f"unknown stage {stage!r}; stages are {_DROP_STAGES} (the consistency check only in the "
                             f"malicious variant)")
        for key in who:
            if key not in ids:
                raise ValueError(f"drop_at[{stage!r}] names unknown client {key!r}")
            drops[stage].add(ids[key])

    config = SessionConfig.create(sorted(ids.values()), bits=bits, dimension=dimension, threshold=threshold,
                                  degree=degree, min_inputs=min_inputs, malicious=malicious, dropout=dropout,
                                  corruption=corruption, check=check)
    declared = dropout is not None or bool(corruption)
    threat_model = (ThreatModel(dropout=dropout or 0.0, corruption=corruption, min_inputs=min_inputs,
                                malicious=malicious, n_clients=len(keys))
                    if declared and degree is None and threshold is None and check else None)
    secret_keys, registry = {}, None
    if malicious:
        secret_keys = {ids[k]: (identities[k] if identities is not None else generate_identity()) for k in keys}
        secret_keys = {c: key if isinstance(key, ClientIdentity) else ClientIdentity(key)
                       for c, key in secret_keys.items()}
        registry = IdentityRegistry({c: key.public_bytes for c, key in secret_keys.items()})
    if contexts is not None and set(contexts) - set(keys):
        raise ValueError(f"contexts names unknown client(s) {sorted(map(str, set(contexts) - set(keys)))[:5]}")
    own = {k: (contexts[k] if contexts is not None and k in contexts else context) for k in keys}
    server = ServerSession(config, registry=registry, context=context)
    clients = {ids[k]: ClientSession(config, ids[k], values[k], identity_key=secret_keys.get(ids[k]),
                                     registry=registry, min_inputs=min_inputs, threat_model=threat_model,
                                     context=own[k])
               for k in keys}
    gone: set[int] = set()
    aborts: dict[int, ProtocolAbort] = {}

    def talking(stage: str) -> list[int]:
        gone.update(drops[stage])
        return [c for c in sorted(clients) if c not in gone]

    def step(c: int, call, *args):
        try:
            message = call(*(_transport(a, serialise) for a in args))
        except ProtocolAbort as exc:
            aborts[c] = exc
            gone.add(c)
            return
        server.receive(_transport(message, serialise))

    for c in talking(ADVERTISE_KEYS):
        step(c, clients[c].advertise_keys)
    directories = server.key_directories()
    for c in talking(SHARE_KEYS):
        if c in directories:
            step(c, clients[c].share_keys, directories[c])
    deliveries = server.share_deliveries()
    for c in talking(MASKED_INPUT):
        if c in deliveries:
            step(c, clients[c].masked_input, deliveries[c])
    request = server.unmask_request()
    if malicious:
        for c in talking(CONSISTENCY):
            if c in request.alive:
                step(c, clients[c].consistency_check, request)
        proofs = server.consistency_proofs()
    else:
        proofs = {c: request for c in request.alive}
    for c in talking(UNMASK):
        if c in proofs:
            step(c, clients[c].unmask, proofs[c])
    result = server.finalize()

    back = {i: k for k, i in ids.items()}
    return RoundResult(sum=result.sum, included=tuple(back[i] for i in result.included),
                       dropped=tuple(back[i] for i in result.dropped), bits=bits, config=config,
                       client_aborts={back[i]: e for i, e in aborts.items()})
