"""Secure aggregation: pairwise-masked sums over Z_{2^k} (Bonawitz et al. CCS 2017) on the sparse neighbour graph of
Bell et al. (CCS 2020). Imports nothing of the project: numpy, cryptography and the standard library only.

Public API
----------
Quantise (floats -> Z_{2^k}, sums cannot wrap)::

    q = Quantiser(low=-c, high=c, bits=32, n_clients=n, noise_headroom=noise_headroom(central_sigma_int))
    words = q.encode(q.to_integers(x, rng) + integer_noise)   # or q.quantise(x, rng) without noise
    ...
    mean = q.decode_sum(result.sum, len(result.included)) / len(result.included)

Securely sum one round in process (client key -> uint64 vector mod 2^bits)::

    result = run_round({key: words, ...}, bits=32, threshold=None, degree=None, min_inputs=n_min,
                       drop_at={"masked_input": {key3}})   # dropout simulation, optional
    result.sum        # uint64 vector: the sum mod 2^bits of the inputs of result.included
    result.included   # keys whose inputs are in the sum; result.dropped the others

``run_round`` raises ``ProtocolAbort`` (and returns no sum) when fewer than max(threshold, min_inputs) inputs would be
summed, or when some mask cannot be removed with ``threshold`` shares. With distributed DP noise, set ``min_inputs``
to the n_min the accountant was charged for, so a round with fewer noise shares aborts.

For another transport, run the state machines yourself: ``SessionConfig.create(...)`` (public parameters, shared by
all parties), one ``ClientSession(config, client_id, words)`` per client and one ``ServerSession(config)``; the server
closes each stage with ``key_directories``, ``share_deliveries``, ``unmask_request`` and ``finalize``; clients answer
with ``advertise_keys``, ``share_keys``, ``masked_input`` and ``unmask`` (or ``handle(message)``). Every message is a
frozen dataclass with ``to_dict``/``from_dict`` and ``to_bytes``/``from_bytes``.

Malicious-server variant: ``SessionConfig.create(..., malicious=True)``; each client gets its long-term Ed25519
``identity_key`` (better: ``ClientIdentity(key)``, kept for the deployment, which caches the pairwise keys), every party the deployment's ``IdentityRegistry`` (client id -> public key, registered out of
band), and each client its own declared ``ThreatModel(dropout=..., corruption=..., min_inputs=...)`` (from facts fixed
before the run, never from the server): ``ClientSession(config, client_id, words, identity_key=key, registry=registry,
threat_model=model)`` derives the degree, threshold and survivor floor itself and refuses a configuration that differs.
Pass each client ``context=`` (bytes it computes itself: what run, round and noise plan of yours the session serves)
and the server the same (``ServerSession(config, registry=..., context=...)``): a client counts a peer's keys only if
the peer bound the same context (``protocol.session_binding``).
The server closes one more stage, ``consistency_proofs``, between ``unmask_request`` and ``finalize``, and clients answer
``consistency_check`` before ``unmask``. In process: ``run_round(..., malicious=True, dropout=...)``.

A transport whose client runs each stage in a fresh process (a Flower ClientApp) keeps the client's session between
stages with ``ClientSession.to_state()`` (bytes, secrets included: store them where only that client can read them)
and ``ClientSession.from_state(config, state)``.

Parameters: declare the threat model (``dropout``, ``corruption`` fractions) to ``SessionConfig.create`` or
``run_round``; the degree and threshold are derived from it (``derive_parameters``, after Bell et al. CCS 2020) and
given ones are checked, refused with ``ParameterError`` saying what to change (``check=False``: tests only).

Security model (what holds, and what it needs):

- Honest-but-curious server, and any set of fewer than ``threshold`` share holders of each client colluding with it
  (``corruption`` declared): the server learns only sums over survivor sets of at least ``max(threshold, min_inputs)``
  clients (Bonawitz et al. Thm. 6.3 on the complete graph; Bell et al. on the sparse graph with the declared
  parameters). Clients and the honest server refuse a survivor set that splits the neighbour graph into a part
  smaller than that, so no sub-sum of a small group is ever unmasked.
- Active server (``malicious=True``), colluding with fewer clients than the declared ``corruption`` allows: it learns
  nothing beyond the sum of one part of the graph restricted to a survivor set, at least ``max(threshold,
  min_inputs)`` clients (less the corrupt ones), whatever it sends, drops, trims, reorders or replays, within or across
  sessions. Key bundles are signed (no key substitution); every later signature covers the session's transcript hash,
  built from every client's fresh keys (no replay from another session, whatever its id); each client signs its
  masked input with the exact peers it masked with, and the survivor set it checked; before revealing anything a
  client verifies that every survivor within two hops of it took part in this session with the peers the set implies
  and that ``threshold`` holders of each signed the same set (Bonawitz Thm. 6.4: ``threshold > (holders + corrupt) /
  2``). ``client`` states the argument, the README's threat model names the test of each step. With corrupt clients
  the complete graph is required (``derive_parameters`` says so).
- Integrity: a reconstructed mask key is checked against its public key and a self-mask seed against its owner's
  commitment, so a corrupted share aborts the round (``ProtocolAbort``) instead of giving a wrong sum, even with
  exactly ``threshold`` holders answering.
- Not covered: the server can always abort a round or drop clients (availability), and in the semi-honest variant the
  transport must authenticate the clients (messages carry no signatures there). A client must be given its declared
  threat model (``ClientSession(threat_model=...)``) or at least the floor it was charged for (``min_inputs=...``).
- Aborted rounds: a round that aborts after some survivors revealed their shares may still give the server the sum
  over the survivor set (never anything smaller): count it as released.

This package is imported as ``privfl.secure_agg``; importing the repository folder as a top-level ``secure_agg`` gives
the very same module objects (or fails with "No module named 'privfl'" where privfl is not installed).
"""

if __name__ != "privfl.secure_agg":  # the checkout on sys.path: hand out privfl.secure_agg itself, never a copy
    __import__("importlib").import_module("privfl._one_name").hand_over(__name__, "privfl.secure_agg")
else:
    from .client import ClientSession
    from .errors import MessageFormatError, ProtocolAbort, QuantisationRangeError
    from .graph import default_degree, neighbour_graph
    from .identity import ClientIdentity, IdentityRegistry, generate_identity, identity_public_bytes
    from .messages import message_from_dict
    from .params import ParameterError, Parameters, ThreatModel, check_parameters, derive_parameters
    from .protocol import STAGES, SessionConfig, default_threshold
    from .quantize import Quantiser, noise_headroom
    from .runtime import RoundResult, run_round
    from .server import AggregateResult, ServerSession

    __all__ = [
        "run_round", "RoundResult", "Quantiser", "noise_headroom", "ProtocolAbort", "QuantisationRangeError",
        "MessageFormatError", "SessionConfig", "ClientSession", "ServerSession", "AggregateResult", "STAGES",
        "message_from_dict", "default_degree", "default_threshold", "neighbour_graph",
        "ClientIdentity", "IdentityRegistry", "generate_identity", "identity_public_bytes",
        "ParameterError", "Parameters", "ThreatModel", "check_parameters", "derive_parameters",
    ]
