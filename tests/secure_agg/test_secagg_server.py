"""The server ignores what it must not use and aborts rather than return a wrong or revealing sum."""

import dataclasses

import numpy as np
import pytest

from privfl.secure_agg import ProtocolAbort
from privfl.secure_agg import messages as M

pytestmark = pytest.mark.timeout(120)


def test_server_ignores_other_sessions_unknown_senders_duplicates_and_early_messages(harness):
    h = harness(n=5, d=8, bits=16)
    ads = h.advertise(drop=[3])
    s = h.server
    assert not s.receive(dataclasses.replace(ads[1], session_id=b"o" * 32))
    assert not s.receive(dataclasses.replace(ads[1], sender=42))
    assert not s.receive(ads[1])  # duplicate
    stolen = dataclasses.replace(ads[2], sender=3)
    assert not s.receive(stolen)
    early = M.MaskedInput(session_id=h.config.session_id, sender=1, masked=bytes(16))
    assert not s.receive(early)
    assert not s.receive("not a message")
    reasons = [r for _, _, r in s.ignored]
    assert reasons[0] == "other session" and reasons[1] == "unknown sender" and reasons[2] == "duplicate"
    assert "already in use" in reasons[3] and "not the current stage" in reasons[4]


def test_server_rejects_clients_copying_public_keys_before_anyone_uses_them(harness):
    h = harness(n=5, d=8, bits=16)
    m1 = h.clients[1].advertise_keys()
    assert h.server.receive(m1)
    copycat = M.AdvertiseKeys(session_id=h.config.session_id, sender=2, encryption_key=b"z" * 32,
                              mask_key=m1.mask_key)
    assert not h.server.receive(copycat)


def test_late_messages_from_dropped_clients_are_ignored_at_every_stage(harness):
    h = harness(n=6, d=8, bits=16, threshold=4)
    h.advertise(drop=[6])
    late_ad = h.clients[6].advertise_keys()
    h.share(drop=[5])
    assert not h.server.receive(late_ad)
    late_share = h.clients[5].share_keys(h.directories[5])
    h.mask()
    assert not h.server.receive(late_share)
    h.unmask()
    result = h.server.finalize()
    assert result.included == (1, 2, 3, 4)
    assert np.array_equal(result.sum, h.expected(result.included))
    assert all(r.startswith("stage") for _, _, r in h.server.ignored)


def test_malformed_masked_inputs_are_ignored(harness):
    h = harness(n=5, d=8, bits=12)
    h.advertise()
    h.share()
    h.deliveries = h.server.share_deliveries()
    good = h.clients[1].masked_input(h.deliveries[1])
    assert not h.server.receive(dataclasses.replace(good, masked=good.masked[:-4]))
    unreduced = np.full(8, 2 ** 12, dtype=np.uint32).tobytes()
    assert not h.server.receive(dataclasses.replace(good, masked=unreduced))
    assert h.server.receive(good)


def test_share_messages_must_address_exactly_the_live_neighbours(harness):
    h = harness(n=5, d=8, bits=16)
    h.advertise()
    h.directories = h.server.key_directories()
    msg = h.clients[1].share_keys(h.directories[1])
    assert not h.server.receive(dataclasses.replace(msg, shares=msg.shares[1:]))
    assert not h.server.receive(dataclasses.replace(msg, shares=msg.shares + msg.shares[:1]))
    assert h.server.receive(msg)


def test_a_corrupted_revealed_share_is_detected(harness):
    h = harness(n=5, d=8, bits=16, threshold=3)
    h.advertise()
    h.share()
    h.mask()
    h.request = h.server.unmask_request()
    for c in h.request.alive:
        answer = h.clients[c].unmask(h.request)
        if c == 2:
            first = answer.self_mask_shares[0]
            bad_y = ((first.value + 1) % 2 ** 520).to_bytes(66, "big")
            answer = dataclasses.replace(answer, self_mask_shares=(dataclasses.replace(first, y=bad_y),)
                                         + answer.self_mask_shares[1:])
        h.server.receive(answer)
    with pytest.raises(ProtocolAbort, match="inconsistent"):
        h.server.finalize()


def test_stages_close_in_order_only(harness):
    h = harness(n=5, d=8, bits=16)
    h.advertise()
    with pytest.raises(ProtocolAbort, match="cannot close"):
        h.server.finalize()
    with pytest.raises(ProtocolAbort, match="already aborted"):
        h.server.key_directories()
    assert h.server.stage == "aborted"
