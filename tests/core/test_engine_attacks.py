"""Hostile peers against one engine, driven by hand (explicit `now`, no network).

Each test names the attack and asserts what a naive implementation gets wrong: who is charged, what is
never stored or sent, and that honest work carries on.
"""

import random

import attrs
import cbor2

from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.config import SERVE_MIN_COST_BYTES
from peerloom.core.encoding import content_id
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.messages import CertifiedHead, Chunk, ChunkRequest, Hello, Signed, encode_message
from peerloom.core.objects import ArtifactRef, UpdateAnnouncement, make_artifact_ref, seal
from tests.helpers import ident, make_revision

GENESIS = bytes(range(256)) * 40  # 10240 bytes = 3 chunks of 4096
VALIDATOR, TRAINER, MALLORY = ident(1), ident(10), ident(66)


def drain(engine):
    out = []
    while (effect := engine.next_effect()) is not None:
        out.append(effect)
    return out


def greet(engine, peer, roles, now=0.0, head_window=0):
    engine.handle(ev.PeerConnected(now=now, peer=peer.peer_id))
    hello = Hello(revision=engine.revision.id, roles=roles, head_window=head_window)
    engine.handle(ev.MessageReceived(now=now, peer=peer.peer_id, data=encode_message(hello)))


def deliver(engine, peer, message, now=0.0):
    data = message if isinstance(message, bytes) else encode_message(message)
    engine.handle(ev.MessageReceived(now=now, peer=peer.peer_id, data=data))


def trainer_fetching_genesis():
    """A trainer with a lease, fetching the genesis params from the validator; Mallory is connected."""
    rev = make_revision(trainers=[TRAINER], genesis=GENESIS, chunk_size=4096)
    engine = Engine(EngineConfig(roles={"trainer"}, revision=rev), TRAINER, random.Random(0))
    engine.handle(ev.Start(now=0.0))
    greet(engine, MALLORY, ("trainer",))
    greet(engine, VALIDATOR, ("validator",))
    return engine, rev


def test_chunk_injection_into_another_peers_transfer_is_charged_to_the_injector():
    engine, rev = trainer_fetching_genesis()
    requests = [e for e in drain(engine) if isinstance(e, fx.Send) and e.peer == VALIDATOR.peer_id]
    assert requests, "the trainer asked the validator for chunks"
    ref = rev.manifest.genesis_params
    # Mallory injects a forged chunk 0 into the transfer the trainer runs with the validator.
    deliver(engine, MALLORY, Chunk(artifact=ref.digest, index=0, data=b"\0" * 4096))
    effects = drain(engine)
    assert not [e for e in effects if isinstance(e, fx.StoreChunk)]
    assert engine.rejected_by_reason["unsolicited-chunk"] == 1
    assert engine.peers[MALLORY.peer_id].penalty == 1
    assert engine.peers[VALIDATOR.peer_id].penalty == 0  # the victim is not charged
    # ...and the honest transfer completes untouched.
    for i in range(ref.num_chunks):
        deliver(engine, VALIDATOR, Chunk(artifact=ref.digest, index=i, data=GENESIS[i * 4096:(i + 1) * 4096]))
    effects = drain(engine)
    assert len([e for e in effects if isinstance(e, fx.StoreChunk)]) == ref.num_chunks
    assert any(isinstance(e, fx.CommitArtifact) and e.ref == ref for e in effects)


def test_bad_chunk_from_the_asked_provider_is_charged_to_it_and_never_stored():
    engine, rev = trainer_fetching_genesis()
    drain(engine)
    ref = rev.manifest.genesis_params
    deliver(engine, VALIDATOR, Chunk(artifact=ref.digest, index=1, data=b"\1" * 4096))
    effects = drain(engine)
    assert not [e for e in effects if isinstance(e, fx.StoreChunk)]
    assert engine.rejected_by_reason["bad-chunk"] == 1 and engine.peers[VALIDATOR.peer_id].penalty == 1


def validator_with_stored_genesis(**config):
    rev = make_revision(trainers=[TRAINER], genesis=GENESIS, chunk_size=4096)
    ref = make_artifact_ref(GENESIS, 4096)
    engine = Engine(EngineConfig(roles={"validator"}, revision=rev, **config), VALIDATOR, random.Random(0),
                    stored=[ref])
    engine.handle(ev.Start(now=0.0))
    greet(engine, MALLORY, ("trainer",))
    greet(engine, TRAINER, ("trainer",))
    drain(engine)
    return engine, rev, ref


def test_chunk_request_flood_is_refused_per_peer_and_others_are_still_served():
    # the byte bucket alone: the per-window budget (serve_copies) is lifted here, tested below
    engine, _rev, ref = validator_with_stored_genesis(serve_copies=10**9)
    burst = engine.config.serve_bytes_burst // SERVE_MIN_COST_BYTES  # a 4 KiB chunk costs the minimum
    for _ in range(burst + 50):
        deliver(engine, MALLORY, ChunkRequest(artifact=ref.digest, index=0))
    effects = drain(engine)
    served = [e for e in effects if isinstance(e, fx.ServeChunk)]
    assert len(served) == burst  # never a storage read beyond the quota
    assert engine.rejected_by_reason["chunk-quota"] == 50
    assert any(isinstance(e, fx.HangUp) and e.peer == MALLORY.peer_id for e in effects)
    deliver(engine, TRAINER, ChunkRequest(artifact=ref.digest, index=2))  # quotas are per peer, not global
    assert [e.peer for e in drain(engine) if isinstance(e, fx.ServeChunk)] == [TRAINER.peer_id]
    deliver(engine, MALLORY, ChunkRequest(artifact=ref.digest, index=0), now=1.0)  # the bucket refills
    assert any(isinstance(e, fx.ServeChunk) for e in drain(engine))


def test_an_honest_fetch_of_a_400_mb_artifact_is_never_refused():
    """The serving quota counts bytes (spec/wire.md §6): every chunk of a 400 MB artifact in 1 MiB chunks,
    asked for at one instant, is served; asking for the same bytes again at once runs the bucket dry."""
    rev = make_revision(trainers=[TRAINER], genesis=GENESIS, chunk_size=4096)
    size, chunk = 400_000_000, 1 << 20
    big = ArtifactRef(digest=content_id(b"big"), size=size, chunk_size=chunk, chunks=(bytes(32),) * -(-size // chunk))
    engine = Engine(EngineConfig(roles={"validator"}, revision=rev, serve_copies=4), VALIDATOR, random.Random(0),
                    stored=[big])
    engine.handle(ev.Start(now=0.0))
    greet(engine, TRAINER, ("trainer",))
    drain(engine)
    for index in range(big.num_chunks):
        deliver(engine, TRAINER, ChunkRequest(artifact=big.digest, index=index))
    assert sum(isinstance(e, fx.ServeChunk) for e in drain(engine)) == big.num_chunks
    assert engine.rejected_by_reason["chunk-quota"] == 0
    for _ in range(2):
        for index in range(big.num_chunks):
            deliver(engine, TRAINER, ChunkRequest(artifact=big.digest, index=index))
    assert engine.rejected_by_reason["chunk-quota"] > 0 and engine.rejected_by_reason["serve-quota"] == 0


def test_a_peer_is_served_each_artifact_at_most_twice_per_window():
    """spec/protocol.md §8.2: a peer that is not a validator gets each artifact at most `serve_copies` (2)
    times in one window of the head; beyond, each request is refused (`serve-quota`, a penalty point) before
    any storage read, so a puller ends banned. Another peer, and a validator, are served in full meanwhile;
    a reconnect does not renew the budget."""
    vals = [ident(1), ident(2), ident(3), ident(4)]
    rev = make_revision(validators=vals, quorum=3, trainers=[TRAINER], genesis=GENESIS, chunk_size=4096)
    ref = make_artifact_ref(GENESIS, 4096)
    engine = Engine(EngineConfig(roles={"validator"}, revision=rev), vals[0], random.Random(0), stored=[ref])
    engine.handle(ev.Start(now=0.0))
    for peer, roles in ((MALLORY, ("reducer",)), (TRAINER, ("trainer",)), (vals[1], ("validator",))):
        greet(engine, peer, roles)
    drain(engine)

    def pull(peer, times=1):
        for _ in range(times):
            for index in range(ref.num_chunks):
                deliver(engine, peer, ChunkRequest(artifact=ref.digest, index=index))
        return sum(isinstance(e, fx.ServeChunk) and e.peer == peer.peer_id for e in drain(engine))

    assert pull(MALLORY, 2) == 2 * ref.num_chunks  # a whole fetch, and a whole retry
    engine.handle(ev.PeerDisconnected(now=0.0, peer=MALLORY.peer_id))
    greet(engine, MALLORY, ("reducer",))
    assert pull(MALLORY) == 0  # the same window: reconnecting renews nothing
    assert engine.rejected_by_reason["serve-quota"] == ref.num_chunks
    assert pull(TRAINER) == ref.num_chunks and pull(vals[1], 5) == 5 * ref.num_chunks
    effects = []
    for _ in range(engine.config.penalty_limit):
        deliver(engine, MALLORY, ChunkRequest(artifact=ref.digest, index=0))
        effects += drain(engine)
    assert any(isinstance(e, fx.Ban) and e.peer == MALLORY.peer_id for e in effects)
    assert engine.peers[TRAINER.peer_id].penalty == 0


def test_the_serving_budget_counts_artifacts_and_starts_again_at_the_next_head():
    """A peer is served at most 4 + 2 × shards + validators distinct artifacts in one window (what a window
    can hold); the next head gives every peer a new budget."""
    from tests.helpers import certify, child

    vals = [ident(1), ident(2), ident(3), ident(4)]
    rev = make_revision(validators=vals, quorum=3, trainers=[TRAINER], shards=(10,), genesis=GENESIS,
                        chunk_size=4096)
    limit = 4 + 2 * 1 + len(vals)
    refs = [make_artifact_ref(GENESIS + bytes([i]), 4096) for i in range(limit + 1)]
    engine = Engine(EngineConfig(roles={"trainer"}, revision=rev), TRAINER, random.Random(0), stored=refs)
    engine.handle(ev.Start(now=0.0))
    greet(engine, MALLORY, ("reducer",))
    greet(engine, vals[0], ("validator",))
    drain(engine)

    def first_chunks():
        for ref in refs:
            deliver(engine, MALLORY, ChunkRequest(artifact=ref.digest, index=0))
        return [e.ref for e in drain(engine) if isinstance(e, fx.ServeChunk) and e.peer == MALLORY.peer_id]

    assert first_chunks() == refs[:limit]
    assert engine.rejected_by_reason["serve-quota"] == 1
    head = child(rev, rev.genesis())
    deliver(engine, vals[0], CertifiedHead(head=head, certificate=certify(rev, head, vals[:3])))
    for effect in drain(engine):
        if isinstance(effect, fx.Persist):
            engine.handle(ev.Persisted(now=0.0, token=effect.token))
    drain(engine)
    assert engine.head.window == 1
    assert first_chunks() == refs[:limit]  # a new window, a new budget


def test_announcement_flood_is_capped_before_signature_checks():
    engine, rev, ref = validator_with_stored_genesis()
    head = engine.head
    for n in range(40):
        forger = ident(100 + n)
        env = seal(forger, UpdateAnnouncement(revision=rev.id, window=1, base=head.id, shards=(0,), delta=ref,
                                              delta_digest=ref.digest, train_loss=0.0))
        env = attrs.evolve(env, signature=bytes(64))  # junk signatures cost a verification each
        deliver(engine, MALLORY, Signed(envelope=env))
    allowed = 1 + engine.config.announcement_slack  # one lease in this revision
    assert engine.rejected_by_reason["bad-signature"] == allowed
    assert engine.rejected_by_reason["announce-quota"] == 40 - allowed


def test_tampered_signature_rejected_and_charged_to_sender():
    engine, rev, ref = validator_with_stored_genesis()
    env = seal(TRAINER, UpdateAnnouncement(revision=rev.id, window=1, base=engine.head.id, shards=(0, 1, 2, 3),
                                           delta=ref, delta_digest=ref.digest, train_loss=0.0))
    sig = bytearray(env.signature)
    sig[5] ^= 1
    deliver(engine, MALLORY, Signed(envelope=attrs.evolve(env, signature=bytes(sig))))
    assert engine.rejected_by_reason["bad-signature"] == 1
    assert engine.peers[MALLORY.peer_id].penalty == 1 and engine.peers[TRAINER.peer_id].penalty == 0


def test_replayed_announcement_from_an_old_window_is_not_accepted():
    engine, rev, ref = validator_with_stored_genesis()
    old = seal(TRAINER, UpdateAnnouncement(revision=rev.id, window=0, base=rev.genesis().id, shards=(0, 1, 2, 3),
                                           delta=ref, delta_digest=ref.digest, train_loss=0.0))
    deliver(engine, MALLORY, Signed(envelope=old))
    effects = drain(engine)
    assert engine.stats["stale_updates"] == 1
    assert not [e for e in effects if isinstance(e, fx.Send)]  # no fetch started for a replay
    # the same envelope replayed twice in the right window is one update, not two
    fresh = seal(TRAINER, UpdateAnnouncement(revision=rev.id, window=1, base=engine.head.id, shards=(0, 1, 2, 3),
                                             delta=ref, delta_digest=ref.digest, train_loss=0.0))
    deliver(engine, TRAINER, Signed(envelope=fresh))
    deliver(engine, MALLORY, Signed(envelope=fresh))
    collector = engine.roles[0].collector
    assert list(collector.entries) == [TRAINER.peer_id]
    assert engine.rejected_by_reason["duplicate-update"] == 0


def test_non_canonical_encoding_of_a_valid_message_is_refused():
    engine, _rev, ref = validator_with_stored_genesis()
    valid = encode_message(ChunkRequest(artifact=ref.digest, index=1))
    kind, body = cbor2.loads(valid)
    reordered = cbor2.dumps([kind, dict(sorted(body.items()))])  # alphabetical, not length-first: non-canonical
    assert reordered != valid and cbor2.loads(reordered) == cbor2.loads(valid)
    deliver(engine, TRAINER, reordered)
    assert engine.rejected_by_reason["decode-non-canonical"] == 1
    assert not [e for e in drain(engine) if isinstance(e, fx.ServeChunk)]


def test_envelope_relabelled_as_another_kind_is_refused():
    engine, rev, ref = validator_with_stored_genesis()
    vote_like = SignedEnvelope.seal(TRAINER, "vote", 1, {"revision": rev.id, "window": 1, "head": ref.digest})
    relabelled = attrs.evolve(vote_like, kind="update")
    deliver(engine, TRAINER, Signed(envelope=relabelled))
    assert engine.rejected_by_reason["bad-signature"] == 1
