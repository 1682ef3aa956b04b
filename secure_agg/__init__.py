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

Security model: honest-but-curious server and clients (the semi-honest setting of Bonawitz et al., Thm. 6.3-6.4); no
signatures or consistency-check round against an actively malicious server. See ``protocol`` for the stages.
"""

from secure_agg.client import ClientSession
from secure_agg.errors import ProtocolAbort, QuantisationRangeError
from secure_agg.graph import default_degree, neighbour_graph
from secure_agg.messages import message_from_dict
from secure_agg.protocol import STAGES, SessionConfig, default_threshold
from secure_agg.quantize import Quantiser, noise_headroom
from secure_agg.runtime import RoundResult, run_round
from secure_agg.server import AggregateResult, ServerSession

__all__ = [
    "run_round", "RoundResult", "Quantiser", "noise_headroom", "ProtocolAbort", "QuantisationRangeError",
    "SessionConfig", "ClientSession", "ServerSession", "AggregateResult", "STAGES", "message_from_dict",
    "default_degree", "default_threshold", "neighbour_graph",
]
