"""Every condition on which a client must abort, and what it then refuses to do."""

import dataclasses

import numpy as np
import pytest

from privfl.secure_agg import ProtocolAbort
from privfl.secure_agg import messages as M

pytestmark = pytest.mark.timeout(120)


def _at_share_keys(harness, **kwargs):
    h = harness(**kwargs)
    h.advertise()
    h.directories = h.server.key_directories()
    return h


def _at_masked_input(harness, **kwargs):
    h = _at_share_keys(harness, **kwargs)
    for c, d in h.directories.items():
        h.server.receive(h.clients[c].share_keys(d))
    h.deliveries = h.server.share_deliveries()
    return h


def _at_unmask(harness, drop=(), **kwargs):
    h = _at_masked_input(harness, **kwargs)
    for c, d in h.deliveries.items():
        if c not in drop:
            h.server.receive(h.clients[c].masked_input(d))
    h.request = h.server.unmask_request()
    return h


def _assert_aborts(call, match):
    with pytest.raises(ProtocolAbort, match=match):
        call()


# ---------------------------------------------------------------------------------------------- out of order
def test_out_of_order_stages_abort_and_the_client_stays_aborted(harness):
    h = _at_masked_input(harness, n=5)
    client = h.clients[1]
    _assert_aborts(lambda: client.advertise_keys(), "out-of-order")
    assert client.stage == "aborted" and client.aborted is not None
    _assert_aborts(lambda: client.masked_input(h.deliveries[1]), "already aborted")


def test_a_stage_cannot_be_skipped_or_repeated(harness):
    h = _at_share_keys(harness, n=5)
    fake_request = M.UnmaskRequest(session_id=h.config.session_id, alive=(1, 2, 3, 4, 5), dropped=())
    _assert_aborts(lambda: h.clients[2].unmask(fake_request), "out-of-order")
    h.clients[3].share_keys(h.directories[3])
    _assert_aborts(lambda: h.clients[3].share_keys(h.directories[3]), "out-of-order")
    _assert_aborts(lambda: h.clients[4].handle(h.sent["advertise_keys"][4]), "unexpected message type")


# ---------------------------------------------------------------------------------------------- key directory
def _directory_with(h, c, entries):
    return dataclasses.replace(h.directories[c], keys=tuple(entries))


@pytest.mark.parametrize("case", ["twice", "unknown", "self", "dup_key", "our_key", "same_pair", "too_few",
                                  "session", "recipient"])
def test_bad_key_directories_abort(harness, case):
    h = _at_share_keys(harness, n=5, threshold=3)
    d = h.directories[1]
    keys = list(d.keys)
    own = h.sent["advertise_keys"][1]
    if case == "twice":
        bad, match = _directory_with(h, 1, keys + [keys[0]]), "listed twice"
    elif case == "unknown":
        bad, match = _directory_with(h, 1, keys + [M.PublicKeys(99, b"u" * 32, b"v" * 32)]), "unknown client id"
    elif case == "self":
        bad, match = _directory_with(h, 1, keys + [M.PublicKeys(1, b"u" * 32, b"v" * 32)]), "our own id"
    elif case == "dup_key":
        clone = dataclasses.replace(keys[1], mask_key=keys[0].mask_key)
        bad, match = _directory_with(h, 1, [keys[0], clone] + keys[2:]), "duplicate public key"
    elif case == "our_key":
        clone = dataclasses.replace(keys[0], mask_key=own.mask_key)
        bad, match = _directory_with(h, 1, [clone] + keys[1:]), "duplicate public key"
    elif case == "same_pair":
        clone = dataclasses.replace(keys[0], mask_key=keys[0].encryption_key)
        bad, match = _directory_with(h, 1, [clone] + keys[1:]), "duplicate public key"
    elif case == "too_few":
        bad, match = _directory_with(h, 1, keys[:1]), "fewer than the threshold"
    elif case == "session":
        bad, match = dataclasses.replace(d, session_id=b"x" * 32), "another session"
    else:
        bad, match = h.directories[2], "addressed to client 2"
    _assert_aborts(lambda: h.clients[1].share_keys(bad), match)


def test_a_non_neighbour_in_the_key_directory_aborts(harness):
    h = _at_share_keys(harness, n=12, degree=4, threshold=3)
    stranger = min(set(h.config.client_ids) - h.config.holders(1))
    entry = M.PublicKeys(stranger, b"u" * 32, b"v" * 32)
    bad = _directory_with(h, 1, list(h.directories[1].keys) + [entry])
    _assert_aborts(lambda: h.clients[1].share_keys(bad), "not our neighbour")


def test_a_low_order_public_key_aborts(harness):
    h = _at_share_keys(harness, n=5)
    keys = list(h.directories[1].keys)
    keys[0] = dataclasses.replace(keys[0], encryption_key=bytes(32))
    _assert_aborts(lambda: h.clients[1].share_keys(_directory_with(h, 1, keys)), "invalid encryption public key")


# ---------------------------------------------------------------------------------------------- share delivery
@pytest.mark.parametrize("case", ["twice", "unknown", "too_few", "misaddressed", "recipient"])
def test_bad_share_deliveries_abort(harness, case):
    h = _at_masked_input(harness, n=5, threshold=3)
    d = h.deliveries[1]
    shares = list(d.shares)
    if case == "twice":
        bad, match = dataclasses.replace(d, shares=tuple(shares + [shares[0]])), "listed twice"
    elif case == "unknown":
        extra = M.EncryptedShare(sender=99, recipient=1, ciphertext=b"c" * 40)
        bad, match = dataclasses.replace(d, shares=tuple(shares + [extra])), "unknown peer"
    elif case == "too_few":
        bad, match = dataclasses.replace(d, shares=tuple(shares[:1])), "fewer than the threshold"
    elif case == "misaddressed":
        other = h.deliveries[2].shares[0]
        bad, match = dataclasses.replace(d, shares=tuple(shares[1:] + [other])), "addressed to client 2"
    else:
        bad, match = h.deliveries[3], "addressed to client 3"
    _assert_aborts(lambda: h.clients[1].masked_input(bad), match)


# ---------------------------------------------------------------------------------------------- unmask request
@pytest.mark.parametrize("alive, dropped, match", [
    ((1, 2, 3, 4), (4, 5), "both alive and dropped"),
    ((1, 2, 2, 3, 4), (5,), "listed twice as alive"),
    ((1, 2, 3, 4), (5, 5), "listed twice as dropped"),
    ((2, 3, 4, 5), (1,), "listed as dropped although"),
    ((2, 3, 4, 5), (), "not listed among the alive"),
    ((1, 2, 3, 4, 77), (5,), "unknown client id"),
    ((1, 2, 3, 4), (5, 88), "unknown client id"),
    ((1, 2), (3, 4, 5), "fewer than the threshold"),
    ((1, 2, 3, 4), (), "neither alive nor dropped"),
])
def test_bad_unmask_requests_abort_without_revealing(harness, alive, dropped, match):
    h = _at_unmask(harness, n=5, threshold=3, drop=(5,))
    forged = M.UnmaskRequest(session_id=h.config.session_id, alive=alive, dropped=dropped)
    _assert_aborts(lambda: h.clients[1].unmask(forged), match)
    _assert_aborts(lambda: h.clients[1].unmask(h.request), "already aborted")  # secrets are gone


def test_unmask_request_of_another_session_aborts(harness):
    h = _at_unmask(harness, n=5)
    other = dataclasses.replace(h.request, session_id=b"o" * 32)
    _assert_aborts(lambda: h.clients[1].unmask(other), "another session")


def test_a_peer_listed_that_never_shared_with_us_aborts(harness):
    h = _at_masked_input(harness, n=6, threshold=4)
    # client 1 receives no ciphertext from 6, but the server later lists 6 among the dropped
    d = h.deliveries[1]
    trimmed = dataclasses.replace(d, shares=tuple(s for s in d.shares if s.sender != 6))
    h.server.receive(h.clients[1].masked_input(trimmed))
    for c in (2, 3, 4, 5):
        h.server.receive(h.clients[c].masked_input(h.deliveries[c]))
    request = h.server.unmask_request()
    assert 6 in request.dropped
    _assert_aborts(lambda: h.clients[1].unmask(request), "never sent us its shares")


def test_a_client_reveals_one_kind_of_share_per_peer_and_answers_one_request(harness):
    h = _at_unmask(harness, n=6, threshold=4, drop=(2,))
    answer = h.clients[1].unmask(h.request)
    seed_owners = {s.owner for s in answer.self_mask_shares}
    key_owners = {s.owner for s in answer.mask_key_shares}
    assert seed_owners == {1, 3, 4, 5, 6} and key_owners == {2} and not seed_owners & key_owners
    swapped = M.UnmaskRequest(session_id=h.config.session_id, alive=(1, 2, 4, 5, 6), dropped=(3,))
    _assert_aborts(lambda: h.clients[1].unmask(swapped), "out-of-order")


# ---------------------------------------------------------------------------------------------- authentication
def _deliver_and_unmask(h, c, delivery):
    h.server.receive(h.clients[c].masked_input(delivery))
    for other in h.deliveries:
        if other != c:
            h.server.receive(h.clients[other].masked_input(h.deliveries[other]))
    return h.server.unmask_request()


def test_a_tampered_ciphertext_fails_authentication(harness):
    h = _at_masked_input(harness, n=5)
    d = h.deliveries[1]
    first = d.shares[0]
    flipped = dataclasses.replace(first, ciphertext=first.ciphertext[:-1] + bytes([first.ciphertext[-1] ^ 0x80]))
    request = _deliver_and_unmask(h, 1, dataclasses.replace(d, shares=(flipped,) + d.shares[1:]))
    _assert_aborts(lambda: h.clients[1].unmask(request), "authentication")


def test_a_ciphertext_replayed_from_another_session_is_rejected(harness):
    h1 = _at_masked_input(harness, n=5)
    h2 = _at_masked_input(harness, n=5)
    d = h1.deliveries[1]
    replayed = h2.deliveries[1].shares[0]  # same sender and recipient ids, other session
    swapped = tuple(replayed if s.sender == replayed.sender else s for s in d.shares)
    request = _deliver_and_unmask(h1, 1, dataclasses.replace(d, shares=swapped))
    _assert_aborts(lambda: h1.clients[1].unmask(request), "authentication")


def test_a_misaddressed_ciphertext_relabelled_for_us_is_rejected(harness):
    h = _at_masked_input(harness, n=5)
    d = h.deliveries[1]
    # the ciphertext client 3 made for client 2, relabelled as if client 3 had made it for client 1
    for_2 = next(s for s in h.deliveries[2].shares if s.sender == 3)
    relabelled = M.EncryptedShare(sender=3, recipient=1, ciphertext=for_2.ciphertext)
    swapped = tuple(relabelled if s.sender == 3 else s for s in d.shares)
    request = _deliver_and_unmask(h, 1, dataclasses.replace(d, shares=swapped))
    _assert_aborts(lambda: h.clients[1].unmask(request), "authentication")


def test_client_input_is_validated(harness):
    h = harness(n=3, d=4, bits=8)
    from privfl.secure_agg import ClientSession
    with pytest.raises(ValueError):
        ClientSession(h.config, 1, np.array([0, 1, 2, 256]))
    with pytest.raises(ValueError):
        ClientSession(h.config, 1, np.zeros(5, dtype=np.uint8))
    with pytest.raises(ValueError):
        ClientSession(h.config, 9, np.zeros(4, dtype=np.uint8))
