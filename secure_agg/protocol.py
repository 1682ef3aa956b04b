"""The protocol's stages and its public session configuration.

Bonawitz et al. (CCS 2017, Fig. 4) run four stages after setup; we keep their order and names:

1. ``advertise_keys``  each client sends two X25519 public keys (one for share encryption, one for masks) and a
                       commitment to its self-mask seed, all fresh for this session (signed, and tagged for each
                       neighbour, in the malicious variant);
2. ``share_keys``      each client Shamir-shares its mask private key and a fresh self-mask seed among its
                       neighbours (Bell et al. CCS 2020) and sends each share encrypted to its holder. In the malicious
                       variant the server also sends every client the session's transcript (the digest of every key
                       bundle); the client checks its own bundle and its neighbours' are in it and hashes it: the
                       transcript hash every later signature covers (``identity.transcript_hash``);
3. ``masked_input``    each client sends y = x + PRG(self seed) + sum_v +-PRG(pairwise key with v)  mod 2^k, signed
                       (malicious variant) together with the transcript hash and the set of peers it masked with;
4. ``consistency_check`` (malicious-server variant only, ``SessionConfig.malicious``) each survivor checks the
                       survivor set U3 and dropped set the server announces (large enough, its own part of the graph
                       large enough, exactly its masking peers listed) and signs them with the transcript hash (and
                       tags them for each survivor within three hops, ``identity.tag``);
5. ``unmask``          survivors reveal, for every neighbour, the self-seed share if it is alive or the mask-key share
                       if it dropped - never both - and the server removes all masks. In the malicious variant a
                       client first verifies that every survivor within two hops of it took part in this very session
                       with the neighbours the survivor set implies (its signature of the set, or its input
                       attestation), and that ``threshold`` share holders of each of them, and of each dropped peer,
                       tagged the very same set for it (``client.ClientSession`` states the argument).

``SessionConfig`` is everything public that all parties must agree on before the round: session id, roster, k, d,
threshold and the neighbour graph (derived from a public seed). Against an active server a client does not take it on
trust: given its declared ``params.ThreatModel`` it derives the degree, threshold and survivor floor itself and
refuses a configuration that differs (``threat_model_problem``). What the configuration cannot say (which run, round
or noise plan of the caller the session serves) each party binds as its own ``context`` (``session_binding``):
opaque bytes, computed by each client itself, never taken from the server.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

from . import codec, params
from .graph import default_degree, neighbour_graph
from .primitives import random_seed, word_dtype

__all__ = ["STAGES", "ADVERTISE_KEYS", "SHARE_KEYS", "MASKED_INPUT", "CONSISTENCY", "UNMASK", "DONE", "SessionConfig",
           "default_threshold", "survivor_set_problem", "component_of", "threat_model_problem", "session_binding",
           "check_context", "MAX_CONTEXT_BYTES"]

ADVERTISE_KEYS = "advertise_keys"
SHARE_KEYS = "share_keys"
MASKED_INPUT = "masked_input"
CONSISTENCY = "consistency_check"
UNMASK = "unmask"
DONE = "done"
STAGES = (ADVERTISE_KEYS, SHARE_KEYS, MASKED_INPUT, CONSISTENCY, UNMASK, DONE)

_MAX_ID = 2 ** 63 - 1

#: the longest context a caller may bind (a digest is 32 bytes; the bound leaves room for a short plain label)
MAX_CONTEXT_BYTES = 1024


def default_threshold(degree: int) -> int:
    """A strict majority of the degree + 1 share holders of each client (the client itself and its neighbours)."""
    return (degree + 1) // 2 + 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SessionConfig:
    """Public parameters of one secure-aggregation round; validated at construction.

    - ``client_ids``: distinct integers in [1, 2^63) (also the Shamir x-coordinates);
    - ``bits``: inputs and the sum live in Z_{2^bits}, 1 <= bits <= 64;
    - ``threshold``: shares needed to recover a secret; must be a strict majority of the degree + 1 holders, so two
      disjoint groups of survivors can never both reach it (the reason a client never reveals both of a peer's shares);
    - ``degree``: neighbours per client (n - 1 means the complete graph of Bonawitz et al.);
    - ``min_inputs``: the round aborts unless at least this many inputs are in the sum (e.g. the minimum number of
      noise shares a distributed DP guarantee needs); the effective minimum is max(threshold, min_inputs). Clients
      check it too: a client refuses to unmask a survivor set smaller than this, whatever the server says;
    - ``malicious``: run the malicious-server variant (signed keys and inputs, consistency round, survivor-set checks);
      every client and the server then need the deployment's ``IdentityRegistry``.
    """

    session_id: bytes
    client_ids: tuple[int, ...]
    bits: int
    dimension: int
    threshold: int
    degree: int
    graph_seed: bytes
    min_inputs: int
    malicious: bool = False
    _graph: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.session_id, bytes) or not 16 <= len(self.session_id) <= 64:
            raise ValueError("session_id must be 16 to 64 random bytes")
        if not isinstance(self.graph_seed, bytes) or len(self.graph_seed) < 16:
            raise ValueError("graph_seed must be at least 16 random bytes")
        ids = tuple(self.client_ids)
        if not all(_is_int(c) and 1 <= c <= _MAX_ID for c in ids):
            raise ValueError("client ids must be integers in [1, 2^63)")
        if len(set(ids)) != len(ids):
            raise ValueError("client ids must be distinct")
        n = len(ids)
        if n < 2:
            raise ValueError("secure aggregation needs at least 2 clients")
        object.__setattr__(self, "client_ids", tuple(sorted(ids)))
        if not _is_int(self.bits):
            raise ValueError(f"bits must be an integer, got {self.bits!r}")
        word_dtype(self.bits)  # validates 1 <= bits <= 64
        if not _is_int(self.dimension) or self.dimension < 1:
            raise ValueError(f"dimension must be a positive integer, got {self.dimension!r}")
        if not _is_int(self.degree) or self.degree < 1:
            raise ValueError(f"degree must be a positive integer, got {self.degree!r}")
        degree = min(self.degree, n - 1)
        object.__setattr__(self, "degree", degree)
        holders = degree + 1
        if not _is_int(self.threshold) or not (2 * self.threshold > holders and self.threshold <= holders):
            raise ValueError(f"threshold must be an integer with {holders // 2 + 1} <= threshold <= {holders} (a "
                             f"strict majority of the {holders} share holders of each client), got {self.threshold!r}")
        if not _is_int(self.min_inputs) or not 1 <= self.min_inputs <= n:
            raise ValueError(f"min_inputs must be an integer in [1, {n}], got {self.min_inputs!r}")
        if not isinstance(self.malicious, bool):
            raise ValueError(f"malicious must be True or False, got {self.malicious!r}")
        object.__setattr__(self, "_graph", neighbour_graph(self.client_ids, degree, self.graph_seed))

    @property
    def digest(self) -> bytes:
        """SHA-256 of every public parameter of the session (id, roster, bits, dimension, threshold, degree, graph
        seed, survivor floor, variant). The malicious variant binds it into each client's signed and tagged keys and
        into the transcript hash every later signature covers: a client counts a peer's tag or attestation only if
        that peer ran the same session, so a server cannot hand clients different graphs (different seeds) under one
        session id and make each count share holders in a graph of its own."""
        body = b"".join([
            len(self.session_id).to_bytes(2, "big"), self.session_id,
            len(self.client_ids).to_bytes(8, "big"), *(c.to_bytes(8, "big") for c in self.client_ids),
            self.bits.to_bytes(2, "big"), self.dimension.to_bytes(8, "big"), self.threshold.to_bytes(8, "big"),
            self.degree.to_bytes(8, "big"), len(self.graph_seed).to_bytes(2, "big"), self.graph_seed,
            self.min_inputs.to_bytes(8, "big"), bytes([int(self.malicious)])])
        return hashlib.sha256(b"privfl-secagg/session-config/v1" + body).digest()

    @classmethod
    def create(cls, client_ids, *, bits: int, dimension: int, threshold: int | None = None,
               degree: int | None = None, min_inputs: int | None = None, malicious: bool = False,
               dropout: float | None = None, corruption: float = 0.0, check: bool = True) -> SessionConfig:
        """A fresh session: random 32-byte session id and graph seed.

        Declare the threat model with ``dropout`` (the fraction of clients that may drop) and ``corruption`` (the
        fraction that may collude with the server): a missing degree and threshold are then derived from it
        (``params.derive_parameters``, after Bell et al. CCS 2020), and given ones are checked against it, raising
        ``params.ParameterError`` with what to change. Without ``dropout`` the degree defaults to the O(log n)
        heuristic ``default_degree`` and the check assumes no dropout. ``check=False`` skips the check: for tests that
        need an unsafe configuration on purpose, never for a deployment.
        """
        ids = tuple(client_ids)
        n = len(ids)
        if corruption and dropout is None and not malicious:
            raise params.ParameterError("with corrupt clients and a semi-honest server the guarantee depends on the "
                                        "dropouts too: declare dropout as well")
        declared = dropout is not None or bool(corruption)
        if degree is None and declared and n >= 2:
            degree = params.derive_parameters(n, dropout=dropout or 0.0, corruption=corruption,
                                              malicious=malicious).degree
        if degree is None:
            degree = default_degree(n)
        elif _is_int(degree):
            degree = min(degree, n - 1) if n >= 2 else degree
        if threshold is None:
            derived = (params.threshold_for(n, degree, dropout=dropout or 0.0, corruption=corruption,
                                            malicious=malicious)
                       if declared and n >= 2 and _is_int(degree) else None)
            threshold = derived if derived is not None else default_threshold(degree)
        if check and n >= 2 and _is_int(degree) and _is_int(threshold) and degree >= 1:
            params.check_parameters(n, degree, threshold, dropout=dropout or 0.0, corruption=corruption,
                                    malicious=malicious)
        if min_inputs is None and declared and n >= 2 and _is_int(threshold):
            min_inputs = params.default_min_inputs(n, threshold, dropout=dropout or 0.0, corruption=corruption,
                                                   malicious=malicious)
        if min_inputs is None:
            min_inputs = threshold if _is_int(threshold) else 1
        return cls(session_id=random_seed(), client_ids=ids, bits=bits, dimension=dimension, threshold=threshold,
                   degree=degree, graph_seed=random_seed(), min_inputs=min_inputs, malicious=malicious)

    @property
    def n_clients(self) -> int:
        return len(self.client_ids)

    @property
    def required_inputs(self) -> int:
        return max(self.threshold, self.min_inputs)

    def neighbours(self, client_id: int) -> frozenset[int]:
        return self._graph[client_id]

    def within(self, client_id: int, hops: int) -> frozenset[int]:
        """The clients at most ``hops`` edges from ``client_id`` in the neighbour graph, ``client_id`` included."""
        if self.degree >= self.n_clients - 1 and hops >= 1:
            return frozenset(self.client_ids)
        seen, frontier = {client_id}, {client_id}
        for _ in range(hops):
            frontier = {v for c in frontier for v in self._graph[c]} - seen
            if not frontier:
                break
            seen |= frontier
        return frozenset(seen)

    def holders(self, client_id: int) -> frozenset[int]:
        """Who holds shares of ``client_id``'s secrets: its neighbours and itself."""
        return self._graph[client_id] | {client_id}

    def to_dict(self) -> dict:
        return codec.to_plain(self)

    @classmethod
    def from_dict(cls, data: dict) -> SessionConfig:
        return codec.from_plain(cls, data)

    def replace(self, **changes) -> SessionConfig:
        return dataclasses.replace(self, **changes)


def check_context(context) -> bytes:
    """``context`` as bytes (at most ``MAX_CONTEXT_BYTES``): what a party binds its session to beyond the public
    configuration (see :func:`session_binding`)."""
    if not isinstance(context, (bytes, bytearray)):
        raise TypeError(f"context must be bytes, got {type(context).__name__}")
    if len(context) > MAX_CONTEXT_BYTES:
        raise ValueError(f"context must be at most {MAX_CONTEXT_BYTES} bytes (bind a digest), got {len(context)}")
    return bytes(context)


def session_binding(config: SessionConfig, context: bytes = b"") -> bytes:
    """What a party of the malicious variant binds into its signed and tagged keys and into the transcript hash: the
    session's public parameters (``SessionConfig.digest``) and, when given, the caller's ``context``.

    The protocol does not interpret ``context``: it is opaque bytes that each party computes *itself*, from what it
    holds, never from a server message (a deployment binds, e.g., a digest of its run, round and noise plan). Two
    clients count each other's keys only when their contexts are equal, so a server that puts clients of different
    runs, rounds or plans into one session (one ``SessionConfig``) fails at the first tag check, before any share
    or masked input leaves. An empty context binds the configuration alone (``config.digest``, as before)."""
    context = check_context(context)
    if not context:
        return config.digest
    return hashlib.sha256(b"privfl-secagg/session-context/v1" + len(config.digest).to_bytes(2, "big") + config.digest
                          + len(context).to_bytes(4, "big") + context).digest()


def component_of(config: SessionConfig, client_id: int, alive) -> frozenset[int]:
    """The connected component of ``client_id`` in the neighbour graph restricted to ``alive``.

    Once the masks of the dropped clients are removed, the server can unmask the sum of each such component on its own
    (the pairwise masks inside a component cancel, and no mask links it to another): these are the smallest sums it
    can learn from one survivor set.
    """
    alive = frozenset(alive)
    seen, frontier = {client_id}, [client_id]
    while frontier:
        c = frontier.pop()
        for v in config.neighbours(c):
            if v in alive and v not in seen:
                seen.add(v)
                frontier.append(v)
    return frozenset(seen)


def survivor_set_problem(config: SessionConfig, client_id: int, alive) -> str | None:
    """Why ``client_id`` must refuse to unmask for the survivor set ``alive``, or None if it may.

    Refused: fewer than ``required_inputs`` survivors (the ``min_inputs`` floor the ledger was charged for), and a
    connected component of the graph restricted to ``alive`` holding ``client_id`` with fewer
    than ``required_inputs`` clients: a server that declares chosen clients dropped (or random dropouts at a small
    degree) could otherwise cut the sparse graph and unmask the sum of a small group on its own.
    """
    need = config.required_inputs
    alive = frozenset(alive)
    if len(alive) < need:
        return (f"the server asks to unmask a sum of {len(alive)} inputs, fewer than the session's minimum {need} "
                f"(min_inputs, the survivor floor the noise was charged for)")
    if config.degree < config.n_clients - 1:
        part = component_of(config, client_id, alive)
        if len(part) < need:
            return (f"the survivor set cuts the neighbour graph: our part of it has {len(part)} clients, fewer than "
                    f"the minimum {need}, so its sum could be unmasked on its own")
    return None


def threat_model_problem(config: SessionConfig, threat_model: params.ThreatModel) -> str | None:
    """Why a client that declared ``threat_model`` must refuse ``config`` (the server's), or None.

    The client derives the degree, threshold and survivor floor itself (``params.derive_parameters``) and accepts only
    exactly that degree and threshold, at least that floor, the variant it declared and, if declared, its roster size.
    The graph follows from the degree and the public seed, and every party recomputes it (``neighbour_graph``).
    """
    n = config.n_clients
    if threat_model.n_clients is not None and n != threat_model.n_clients:
        return f"the session's roster has {n} clients, the deployment declared {threat_model.n_clients}"
    if config.malicious != threat_model.malicious:
        name = {True: "malicious-server", False: "semi-honest"}
        return (f"the session runs the {name[config.malicious]} variant, we declared the "
                f"{name[threat_model.malicious]} one")
    try:
        derived = threat_model.parameters(n)
    except params.ParameterError as exc:
        return f"our declared threat model has no safe parameters for {n} clients: {exc}"
    if (config.degree, config.threshold) != (derived.degree, derived.threshold):
        return (f"the session's degree {config.degree} and threshold {config.threshold} differ from the degree "
                f"{derived.degree} and threshold {derived.threshold} derived from our declared threat model (n={n}, "
                f"dropout={threat_model.dropout:g}, corruption={threat_model.corruption:g})")
    if config.required_inputs < derived.required_inputs:
        return (f"the session requires only {config.required_inputs} inputs, fewer than the {derived.required_inputs} "
                f"derived from our declared threat model (min_inputs)")
    return None
