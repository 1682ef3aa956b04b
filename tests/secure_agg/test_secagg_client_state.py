"""A client session saved and restored between stages (a transport whose client runs each stage in a new process,
such as a Flower ClientApp) behaves exactly like one kept in memory, dropout recovery included."""

import numpy as np
import pytest

from privfl.secure_agg import ClientSession, ProtocolAbort, ServerSession, SessionConfig
from privfl.secure_agg.messages import AdvertiseKeys


def _round(n, dim, drop_after_share_keys=(), restore=True, bits=32, seed=0):
    rng = np.random.default_rng(seed)
    config = SessionConfig.create(list(range(1, n + 1)), bits=bits, dimension=dim, malicious=False,
                                  dropout=0.34 if drop_after_share_keys else 0.0)
    values = {c: rng.integers(0, 2 ** 20, size=dim, dtype=np.uint64) for c in config.client_ids}
    saved = {}

    def session(c):
        return ClientSession.from_state(config, saved[c]) if restore else live[c]

    live = {c: ClientSession(config, c, values[c]) for c in config.client_ids}
    server = ServerSession(config)
    for c, s in live.items():
        server.receive(AdvertiseKeys.from_bytes(s.advertise_keys().to_bytes()))
        saved[c] = s.to_state()
    for stage, call in (("share_keys", "share_keys"), ("masked_input", "masked_input"), ("unmask", "unmask")):
        if stage == "share_keys":
            out = server.key_directories()
        elif stage == "masked_input":
            out = server.share_deliveries()
        else:
            request = server.unmask_request()
            out = {c: request for c in request.alive}
        for c, message in out.items():
            if stage != "share_keys" and c in drop_after_share_keys:
                continue
            s = session(c)
            server.receive(getattr(s, call)(message))
            if s.stage != "done":
                saved[c] = s.to_state()
            live[c] = s
    result = server.finalize()
    expected = sum(values[c] for c in result.included) % (1 << bits)
    return result, expected


@pytest.mark.parametrize("restore", [True, False])
def test_a_restored_session_sums_exactly(restore):
    result, expected = _round(4, 16, restore=restore)
    assert result.included == (1, 2, 3, 4)
    np.testing.assert_array_equal(result.sum, expected)


def test_a_client_dropping_after_sharing_keys_is_recovered_from_restored_survivors():
    result, expected = _round(3, 8, drop_after_share_keys=(3,))
    assert result.included == (1, 2) and result.dropped == (3,)
    np.testing.assert_array_equal(result.sum, expected)


def test_a_saved_state_is_bound_to_its_session():
    config = SessionConfig.create([1, 2, 3], bits=32, dimension=4, malicious=False, dropout=0.0)
    other = SessionConfig.create([1, 2, 3], bits=32, dimension=4, malicious=False, dropout=0.0)
    s = ClientSession(config, 1, np.zeros(4, dtype=np.uint64))
    s.advertise_keys()
    state = s.to_state()
    with pytest.raises(ProtocolAbort, match="another session"):
        ClientSession.from_state(other, state)
    with pytest.raises(ProtocolAbort, match="cannot be restored"):
        ClientSession.from_state(config, state[:-5])
    restored = ClientSession.from_state(config, state)
    assert restored.stage == s.stage == "share_keys"


def test_a_restored_malicious_session_derives_each_pairwise_key_once(monkeypatch):
    """The malicious variant, every client restored from its saved state at every stage with its bare identity key
    (a Flower ClientApp): the sum is exact, and the pairwise keys a client derived travel in its state, so it derives
    each one once in the session, not once per stage."""
    from privfl.secure_agg import identity as I

    derived = []
    real = I.hkdf

    def counting(secret, **kwargs):
        if kwargs.get("info", b"").startswith(I.PROTOCOL_LABEL + b"/pairwise-key"):
            derived.append(kwargs["info"])
        return real(secret, **kwargs)

    monkeypatch.setattr(I, "hkdf", counting)
    n, dim = 7, 6
    config = SessionConfig.create(list(range(1, n + 1)), bits=32, dimension=dim, malicious=True)
    keys = {c: I.generate_identity() for c in config.client_ids}
    registry = I.IdentityRegistry({c: I.identity_public_bytes(k) for c, k in keys.items()})
    rng = np.random.default_rng(3)
    values = {c: rng.integers(0, 2 ** 20, size=dim, dtype=np.uint64) for c in config.client_ids}
    server = ServerSession(config, registry=registry)
    saved = {}
    for c in config.client_ids:
        s = ClientSession(config, c, values[c], identity_key=keys[c], registry=registry)
        server.receive(s.advertise_keys())
        saved[c] = s.to_state()

    def stage(out, call):
        for c, message in out.items():
            s = ClientSession.from_state(config, saved[c], identity_key=keys[c], registry=registry)
            server.receive(getattr(s, call)(message))
            if s.stage != "done":
                saved[c] = s.to_state()

    stage(server.key_directories(), "share_keys")
    stage(server.share_deliveries(), "masked_input")
    request = server.unmask_request()
    stage({c: request for c in request.alive}, "consistency_check")
    stage(server.consistency_proofs(), "unmask")
    result = server.finalize()
    assert result.included == config.client_ids
    np.testing.assert_array_equal(result.sum, sum(values.values()) % (1 << 32))
    # complete graph: each client derives its key with each of the n - 1 others once, whatever the number of stages
    assert len(derived) == n * (n - 1)
