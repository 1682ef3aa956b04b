"""The context a client binds its secure-aggregation session to (``privfl.privacy.secure.secure_context``): run,
phase, round, encodings and noise plan, computed by each client from what it holds. The clients of one run, phase and
round compute the same bytes; anything a server could mix (another run, phase, round, plan) changes them, and
sessions bound to different contexts abort at the first tag check. The attack it stops, through the Flower
ClientApp: ``tests/flower/test_secagg_context.py``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from privfl.accounting.ledger import PrivacyLedger
from privfl.core.channels import Channel, NormClip
from privfl.core.release import ReleasePipeline
from privfl.privacy.secure import (SecureAggregation, channel_encodings, client_secure_context,
                                   plan_distributed_noise, secure_context, secure_weighted_sums)
from privfl.secure_agg import ProtocolAbort
from privfl.secure_agg import identity as I
from privfl.secure_agg.client import ClientSession
from privfl.secure_agg.identity import IdentityRegistry, generate_identity, identity_public_bytes
from privfl.secure_agg.messages import BundleDigest, KeyDirectory, PublicKeys
from privfl.secure_agg.protocol import SessionConfig

CH = Channel("update", (20,), unit="client", clip=NormClip(1.0))
SEC = SecureAggregation(bits=48)


def plan(multiplier=2.0, n_min=5, honest=None):
    return plan_distributed_noise(1.0, 20, multiplier, 6, n_min, 48, n_honest=honest)


def encodings(p):
    return channel_encodings([CH], SEC, n_clients=6, local_stds={}, weight_bound=1.0, distributed={"update": p})


def context(run="r", rnd=0, phase=None, p=None):
    p = plan() if p is None else p
    return secure_context(run, rnd, encodings(p), phase=phase, distributed={"update": p})


def test_one_run_phase_and_round_give_one_context_and_anything_a_server_could_mix_changes_it():
    base = context()
    assert base == context() and len(base) == 32
    p = plan()
    variants = {
        "run": context(run="other"), "phase": context(phase="regression"), "round": context(rnd=1),
        "noise share (another run's calibration)": context(p=plan(multiplier=1.0)),
        "survivor floor": context(p=plan(n_min=4)), "honest shares": context(p=plan(honest=4)),
        "charged event": context(p=dataclasses.replace(p, event=plan(multiplier=3.0).event)),
        "share sigma alone": secure_context("r", 0, encodings(dataclasses.replace(p, local_sigma=p.local_sigma * 2)),
                                            distributed={"update": p}),
    }
    assert base not in variants.values() and len(set(variants.values())) == len(variants)


def releases(run="r", rounds=(0, 0, 0, 0, 0, 0), runs=None):
    out = []
    rng = np.random.default_rng(0)
    ledgers = {}
    for k, rnd in enumerate(rounds):
        rid = run if runs is None else runs[k]
        led = ledgers.setdefault(rid, PrivacyLedger(":memory:", rid))
        pipe = ReleasePipeline(str(k), [CH], led, {"update": 1.0}, placement="local", noise=k)
        out += pipe.release(rnd, {"update": rng.normal(size=20)}, weight=1.0).values()
    return out


def test_a_client_reads_its_run_and_round_off_its_own_ledger_rows():
    p = plan()
    rels = releases(run="run-7", rounds=(3,) * 6)
    assert client_secure_context({"update": rels[0]}, encodings(p), distributed={"update": p}) == \
        secure_context("run-7", 3, encodings(p), distributed={"update": p})


@pytest.mark.parametrize("mix", ["rounds", "runs"])
def test_in_process_releases_of_two_rounds_or_runs_never_enter_one_secure_sum(mix):
    rels = (releases(rounds=(0, 0, 0, 1, 1, 1)) if mix == "rounds" else
            releases(runs=("a", "a", "a", "b", "b", "b")))
    with pytest.raises(ProtocolAbort, match="different runs, phases or rounds"):
        secure_weighted_sums(rels, {"update": CH}, SEC, np.random.default_rng(0))
    # one round of one run sums as before
    agg = secure_weighted_sums(releases(), {"update": CH}, SEC, np.random.default_rng(0))["update"]
    assert agg.participants == 6


def test_clients_of_two_phases_under_one_session_abort_at_the_first_tag_check():
    """One run, one round index, identical encodings and plan, two phases (a multi-phase run's kernel and regression
    phases): the phase alone tells the contexts apart, and an active server relaying between the two groups gets
    every client to abort before any share leaves."""
    config = SessionConfig.create(range(1, 4), bits=48, dimension=20, malicious=True, dropout=0.0)
    ctx = {1: context(run="r", phase="kernel"), 2: context(run="r", phase="regression"),
           3: context(run="r", phase="regression")}
    assert ctx[1] != ctx[2] == ctx[3]
    keys = {c: generate_identity() for c in config.client_ids}
    registry = IdentityRegistry({c: identity_public_bytes(k) for c, k in keys.items()})
    clients = {c: ClientSession(config, c, np.zeros(20, dtype=np.uint64), identity_key=keys[c], registry=registry,
                                context=ctx[c]) for c in config.client_ids}
    adverts = {c: s.advertise_keys() for c, s in clients.items()}
    sid = config.session_id
    transcript = tuple(BundleDigest(c, I.bundle_digest(sid, c, a.encryption_key, a.mask_key, a.seed_commitment))
                       for c, a in sorted(adverts.items()))
    for c, session in clients.items():
        directory = KeyDirectory(session_id=sid, recipient=c, transcript=transcript, keys=tuple(
            PublicKeys(v, adverts[v].encryption_key, adverts[v].mask_key, adverts[v].seed_commitment,
                       {t.client_id: t.tag for t in adverts[v].tags}[c])
            for v in sorted(config.neighbours(c))))
        with pytest.raises(ProtocolAbort, match="do not carry its tag"):
            session.share_keys(directory)
        assert session.stage == "aborted"
