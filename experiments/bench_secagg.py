"""Benchmark of privfl's secure aggregation (``secure_agg``), printed as ``key=value`` lines.

Measured side by side in one run on this machine:

- ``client_mask_ms``: one client's masked-input step (``ClientSession.masked_input``) in a complete graph of N clients
  (N - 1 pairwise masks and one self mask, each HKDF + X25519 + AES-CTR + add), d coordinates;
- ``keystream_bound_ms``: N x (X25519 key agreement + AES-CTR keystream of d words + numpy add), the raw cost of the
  same work with nothing else; ``mask_over_bound`` is their ratio (goal <= 1.2). Best of interleaved repeats (the
  least-disturbed run of deterministic work), with the medians printed too;
- ``round_s``: a full protocol round in process (quantise N float vectors, the stages, decode) for N clients,
  d coordinates and a dropout fraction of clients that drop after sharing keys, before sending their masked input
  (every such dropout forces the server to reconstruct a key and regenerate its pairwise masks), in the
  malicious-server variant that privfl runs by default: the Ed25519 signatures of every key bundle, masked input and
  survivor set (which the server verifies), the pairwise tags (HMAC-SHA256, ``identity.tag``) of the bundles and
  survivor sets (which the clients verify) and the consistency round are counted here (and only here:
  ``mask_over_bound`` measures the masking alone); ``round_semi_honest_s`` is the same round without them, and
  ``malicious_over_semi_honest`` = round_s / round_semi_honest_s (goal <= 1.5): the two variants run interleaved
  ``--round-repeats`` times, each key the best run (``round_median_s``, ``round_semi_honest_median_s``: the medians).
  The clients keep their identities (``ClientIdentity``) from round to round, as a deployment's do, so a pairwise key
  is derived once per pair of clients: ``round_first_s`` is the first round of those identities, which derives them
  (a pairwise key is one X25519 agreement and one HKDF, ``pairwise_key_us``; one run, after an untimed semi-honest
  round), and ``malicious_first_over_semi_honest``
  = round_first_s / round_semi_honest_s; it is also what every round costs where a client keeps no state between
  rounds (a Flower ClientApp). Every party runs in this one process, one after the other, so a round time is the work
  of all N clients and the server together: a client's share of the malicious variant's extra work is checking the
  tags of its neighbours' key bundles and of the survivors within two hops of it (``client.ClientSession``), about 100
  tags at N = 100 (``tag_verify_us`` each), and the server's is verifying 3 N signatures;
  ``round_spread_s`` (one run) spreads the same number of dropouts over the share-keys, masked-input and unmask
  stages; the degree and threshold are derived from the dropout (``secure_agg.derive_parameters``);
  ``input_signature_ms`` is one client's signature of its masked input (SHA-256 of the d words + Ed25519),
  ``signature_verify_us`` one Ed25519 verification of a survivor-set signature (``IdentityRegistry.verify``, the
  server's unit of extra work), ``tag_verify_us`` one check of a survivor-set tag (the client's);
- ``flower_round_s``: the same round (same N, d, dropouts, share-holder count and threshold) through Flower's SecAgg+
  (``SecAggPlusWorkflow`` + ``secaggplus_mod``) over an in-process loopback grid, when ``flwr`` is importable, and
  ``flower_over_privfl`` = flower_round_s / round_s (goal >= 5; one Flower run against the best malicious privfl
  run). Flower is a comparison only, not a dependency.

Usage: python experiments/bench_secagg.py [--n 100] [--d 100000] [--dropout 0.2] [--bits 32] [--repeats 15]
       [--round-repeats 3] [--no-flower] [--smoke]

``--smoke`` sets the sizes to their smallest (``--n 13 --d 100 --repeats 1 --round-repeats 1``; flags given with it
win): 13 clients are the fewest whose 20 % dropouts (3) put one in each stage of the spread round, so every stage,
both variants and the Flower comparison (when flwr is importable) run and every key is printed, in seconds; a smoke
test whose values are not a measurement.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import time

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from privfl.secure_agg import (ClientIdentity, ClientSession, Quantiser, SessionConfig, derive_parameters,
                               generate_identity, run_round)
from privfl.secure_agg import identity as I
from privfl.secure_agg import messages as M
from privfl.secure_agg import primitives as P


SMOKE = {"n": 13, "d": 100, "repeats": 1, "round_repeats": 1}


def emit(key: str, value) -> None:
    if isinstance(value, float):
        value = f"{value:.6g}"
    print(f"{key}={value}", flush=True)


# ---------------------------------------------------------------------------------------------- masking micro-bench
def _client_ready_to_mask(n: int, d: int, bits: int) -> tuple[ClientSession, M.ShareDelivery]:
    """Client 1 of a complete graph of n, with its key directory and share delivery from all n - 1 peers."""
    config = SessionConfig.create(range(1, n + 1), bits=bits, dimension=d, degree=n - 1)
    rng = np.random.default_rng(0)
    client = ClientSession(config, 1, rng.integers(0, 2 ** bits, size=d, dtype=np.uint64))
    client.advertise_keys()
    peers = range(2, n + 1)
    keys = tuple(M.PublicKeys(c, P.public_bytes(P.generate_private_key()), P.public_bytes(P.generate_private_key()))
                 for c in peers)
    client.share_keys(M.KeyDirectory(session_id=config.session_id, recipient=1, keys=keys))
    # masked_input does not open the ciphertexts (that happens at unmasking), so placeholders suffice here
    shares = tuple(M.EncryptedShare(sender=c, recipient=1, ciphertext=b"\0" * 60) for c in peers)
    return client, M.ShareDelivery(session_id=config.session_id, recipient=1, shares=shares)


def _keystream_bound(n: int, d: int, bits: int) -> float:
    """Seconds for n x (X25519 exchange + AES-CTR keystream of d words + add), with nothing else."""
    dtype = P.word_dtype(bits)
    zeros = bytes(d * dtype.itemsize)
    out = bytearray(len(zeros) + 15)
    view = np.frombuffer(out, dtype=dtype, count=d)
    acc = np.zeros(d, dtype=dtype)
    me = X25519PrivateKey.generate()
    peers = [X25519PrivateKey.generate().public_key() for _ in range(n)]
    start = time.perf_counter()
    for peer in peers:
        key = me.exchange(peer)
        Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update_into(zeros, out)
        np.add(acc, view, out=acc)
    return time.perf_counter() - start


def bench_masking(n: int, d: int, bits: int, repeats: int) -> None:
    client_times, bound_times = [], []
    for _ in range(repeats):
        client, delivery = _client_ready_to_mask(n, d, bits)
        start = time.perf_counter()
        client.masked_input(delivery)
        client_times.append(time.perf_counter() - start)
        bound_times.append(_keystream_bound(n, d, bits))
    client_ms, bound_ms = 1e3 * min(client_times), 1e3 * min(bound_times)
    emit("mask_peers", n - 1)
    emit("mask_repeats", repeats)
    emit("client_mask_ms", client_ms)
    emit("keystream_bound_ms", bound_ms)
    emit("mask_over_bound", client_ms / bound_ms)
    emit("client_mask_median_ms", 1e3 * statistics.median(client_times))
    emit("keystream_bound_median_ms", 1e3 * statistics.median(bound_times))


def bench_input_signature(d: int, bits: int, repeats: int) -> float:
    """Milliseconds (best of ``repeats``) for one client to sign its masked input of d words."""
    key = generate_identity()
    payload = np.random.default_rng(0).integers(0, 2 ** bits, size=d, dtype=np.uint64).astype(
        P.word_dtype(bits)).tobytes()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        I.sign(key, I.INPUT_PURPOSE, bytes(32), 1, I.digest(payload))
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def bench_signature_verification(repeats: int) -> float:
    """Microseconds (best of ``repeats`` batches of 200) for one Ed25519 verification of a survivor-set signature
    through the registry, the malicious variant's unit of extra work."""
    key = generate_identity()
    registry = I.IdentityRegistry({1: I.identity_public_bytes(key)})
    parts = (bytes(32), I.encode_ids(range(1, 81)), I.encode_ids(range(81, 101)))
    signature = I.sign(key, I.SURVIVORS_PURPOSE, bytes(32), 1, *parts)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(200):
            registry.verify(signature, I.SURVIVORS_PURPOSE, bytes(32), 1, *parts)
        times.append((time.perf_counter() - start) / 200)
    return 1e6 * min(times)


def bench_tags(repeats: int) -> tuple[float, float]:
    """Microseconds (best of ``repeats`` batches of 200): one pairwise-key derivation (X25519 + HKDF, on an identity
    that has not met the peer) and one check of a survivor-set tag (content digest + HMAC), as a client makes them."""
    keys = {c: generate_identity() for c in range(1, 202)}
    registry = I.IdentityRegistry({c: I.identity_public_bytes(k) for c, k in keys.items()})
    parts = (bytes(32), I.encode_ids(range(1, 81)), I.encode_ids(range(81, 101)))
    derive, check = [], []
    for _ in range(repeats):
        me = ClientIdentity(keys[1])
        start = time.perf_counter()
        for peer in range(2, 202):
            me.pairwise_key(1, peer, registry)
        derive.append((time.perf_counter() - start) / 200)
        key = me.pairwise_key(1, 2, registry)
        value = I.tag(key, I.content_digest(I.SURVIVORS_PURPOSE, bytes(32), 2, *parts), 1)
        start = time.perf_counter()
        for _ in range(200):
            assert I.check_tag(key, I.content_digest(I.SURVIVORS_PURPOSE, bytes(32), 2, *parts), 1, value)
        check.append((time.perf_counter() - start) / 200)
    return 1e6 * min(derive), 1e6 * min(check)


# ---------------------------------------------------------------------------------------------- full round
def _dropouts(keys, fraction: float, spread: bool) -> dict:
    k = int(round(fraction * len(keys)))
    gone = list(keys[:k])
    if not spread:
        return {"masked_input": gone}
    a, b = k // 3 + (k % 3 > 0), k // 3 + (k % 3 > 1)
    return {"share_keys": gone[:a], "masked_input": gone[a:a + b], "unmask": gone[a + b:]}


def privfl_round(vectors: dict, bits: int, clip: float, drop_at: dict, degree: int, threshold: int,
                 dropout: float, malicious: bool = True, identities: dict | None = None):
    rng = np.random.default_rng(1)
    start = time.perf_counter()
    q = Quantiser(low=-clip, high=clip, bits=bits, n_clients=len(vectors))
    words = {k: q.quantise(v, rng) for k, v in vectors.items()}
    result = run_round(words, bits=bits, degree=degree, threshold=threshold, drop_at=drop_at, dropout=dropout,
                       malicious=malicious, identities=identities if malicious else None)
    mean = q.decode_sum(result.sum, len(result.included)) / len(result.included)
    elapsed = time.perf_counter() - start
    plain = np.zeros(len(next(iter(words.values()))), dtype=np.uint64)
    for k in result.included:
        plain += words[k]
    exact = np.array_equal(result.sum, plain & np.uint64((1 << bits) - 1))
    error = float(np.abs(mean - np.mean([vectors[k] for k in result.included], axis=0)).max())
    return elapsed, exact, error, len(result.included)


# ---------------------------------------------------------------------------------------------- Flower SecAgg+
def flower_round(vectors: dict, clip: float, drop_after_share: set, num_shares: int, threshold: int):
    """One SecAgg+ round with Flower's own workflow and client mod, over an in-process loopback grid."""
    from flwr.app import ConfigRecord, Context, RecordDict
    from flwr.client import NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.clientapp import ClientApp
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.common.logger import FLOWER_LOGGER
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server import LegacyContext, ServerConfig, SimpleClientManager
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.supercore.task_identity import TaskIdentity

    FLOWER_LOGGER.setLevel(logging.ERROR)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1

    from loopback_grid import LoopbackGrid

    gone = set()

    def silent(node, message):
        """The nodes of ``drop_after_share`` never answer from the masked-vectors stage on."""
        if message.content.config_records["secaggplus_configs"]["stage"] == "collect_masked_vectors":
            gone.update(drop_after_share)
        return node in gone

    class Client(NumPyClient):
        def __init__(self, node):
            self.node = node

        def fit(self, parameters, config):
            return [vectors[self.node]], 1, {}

    app = ClientApp(client_fn=lambda ctx: Client(ctx.node_id).to_client(), mods=[secaggplus_mod])
    apps = {node: (app, Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={}))
            for node in vectors}
    grid = LoopbackGrid(apps, silent, copy_messages=True)
    n, d = len(vectors), len(next(iter(vectors.values())))
    start = time.perf_counter()
    context = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=1),
                            strategy=FedAvg(fraction_fit=1.0, min_fit_clients=n, min_available_clients=n),
                            client_manager=SimpleClientManager())
    for node in vectors:
        context.client_manager.register(GridClientProxy(node, grid, 1))
    context.state.config_records["config"] = ConfigRecord({"current_round": 1})
    context.state.array_records["parameters"] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters([np.zeros(d)]), True)
    SecAggPlusWorkflow(num_shares=num_shares, reconstruction_threshold=threshold, clipping_range=clip)(grid, context)
    elapsed = time.perf_counter() - start
    out = parameters_to_ndarrays(compat.arrayrecord_to_parameters(context.state.array_records["parameters"], True))[0]
    alive = [vectors[k] for k in vectors if k not in drop_after_share]
    return elapsed, float(np.abs(out - np.mean(alive, axis=0)).max())


def flower_version() -> str | None:
    try:
        from importlib.metadata import version
        import flwr.server.workflow  # noqa: F401  (importable, not just installed)
        return version("flwr")
    except Exception:  # flwr absent or broken: no comparison
        return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--d", type=int, default=100_000)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--bits", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--round-repeats", type=int, default=3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--no-flower", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="smallest sizes (a smoke test; seconds)")
    args = parser.parse_args(argv)
    if args.smoke:  # the smallest sizes as defaults, so that a flag given with --smoke still wins
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)

    emit("python", platform.python_version())
    emit("cpus", os.cpu_count())
    emit("n", args.n)
    emit("d", args.d)
    emit("bits", args.bits)
    emit("mask_word_bits", 8 * P.word_dtype(args.bits).itemsize)
    emit("dropout", args.dropout)

    bench_masking(args.n, args.d, args.bits, args.repeats)

    rng = np.random.default_rng(0)
    vectors = {node: rng.uniform(-args.clip, args.clip, size=args.d) for node in range(1001, 1001 + args.n)}
    keys = list(vectors)
    probe = derive_parameters(args.n, dropout=args.dropout, malicious=True)
    emit("degree", probe.degree)
    emit("threshold", probe.threshold)
    emit("input_signature_ms", bench_input_signature(args.d, args.bits, args.repeats))
    emit("signature_verify_us", bench_signature_verification(args.repeats))
    pairwise_us, tag_us = bench_tags(args.repeats)
    emit("pairwise_key_us", pairwise_us)
    emit("tag_verify_us", tag_us)
    drop = _dropouts(keys, args.dropout, spread=False)
    common = (args.bits, args.clip)
    params = dict(degree=probe.degree, threshold=probe.threshold, dropout=args.dropout)
    # the deployment's identities, kept from round to round: their first round derives the pairwise keys (after one
    # untimed semi-honest round, so that it does not also carry the process's own first-round warm-up)
    privfl_round(vectors, *common, drop, **params, malicious=False)
    identities = {k: ClientIdentity(generate_identity()) for k in keys}
    first = privfl_round(vectors, *common, drop, **params, identities=identities)
    # the two variants interleaved, best of --round-repeats each (the least-disturbed run, as for the masking)
    malicious_runs, semi_honest_runs = [], []
    for _ in range(args.round_repeats):
        malicious_runs.append(privfl_round(vectors, *common, drop, **params, identities=identities))
        semi_honest_runs.append(privfl_round(vectors, *common, drop, **params, malicious=False))
    round_s = min(run[0] for run in malicious_runs)
    round_semi_honest_s = min(run[0] for run in semi_honest_runs)
    _, _, error, included = malicious_runs[0]
    emit("round_repeats", args.round_repeats)
    emit("round_s", round_s)
    emit("round_included", included)
    emit("round_sum_exact", str(all(run[1] for run in malicious_runs)).lower())
    emit("round_mean_max_abs_error", error)
    emit("round_semi_honest_s", round_semi_honest_s)
    emit("round_semi_honest_sum_exact", str(all(run[1] for run in semi_honest_runs)).lower())
    emit("malicious_over_semi_honest", round_s / round_semi_honest_s)
    emit("round_first_s", first[0])
    emit("round_first_sum_exact", str(first[1]).lower())
    emit("malicious_first_over_semi_honest", first[0] / round_semi_honest_s)
    emit("round_median_s", statistics.median(run[0] for run in malicious_runs))
    emit("round_semi_honest_median_s", statistics.median(run[0] for run in semi_honest_runs))
    spread = _dropouts(keys, args.dropout, spread=True)
    elapsed, exact, _, included = privfl_round(vectors, *common, spread, **params, identities=identities)
    emit("round_spread_s", elapsed)
    emit("round_spread_sum_exact", str(exact).lower())

    version = None if args.no_flower else flower_version()
    if version is None:
        emit("flower_round_s", "unavailable (flwr not installed)" if not args.no_flower else "skipped")
        emit("flower_over_privfl", "unavailable")
        return
    emit("flower_version", version)
    emit("flower_num_shares", probe.degree + 1)
    emit("flower_threshold", probe.threshold)
    flower_s, flower_error = flower_round(vectors, args.clip, set(drop["masked_input"]), probe.degree + 1,
                                          probe.threshold)
    emit("flower_round_s", flower_s)
    emit("flower_mean_max_abs_error", flower_error)
    emit("flower_over_privfl", flower_s / round_s)


if __name__ == "__main__":
    sys.exit(main())
