"""A ref whose chunk hashes are honest but whose digest is not (spec/wire.md §5). No such ref decodes (the
digest is the id of the chunks: tests/core/test_objects.py), but one built in-process still reaches a
commit that refuses it: the host must not crash on it; the engine fails the fetch."""

from __future__ import annotations

import random

import attrs
import pytest

from peerloom.adapters.host import commit
from peerloom.adapters.storage import ArtifactStore
from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.encoding import content_id
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.errors import DecodeError
from peerloom.core.messages import Chunk, ChunkRequest, Hello, decode_message, encode_message
from peerloom.core.objects import ArtifactRef, make_artifact_ref
from tests.core.test_fetch_resume import WAITER, watch
from tests.helpers import ident, make_revision

CHUNK = 1024
DATA = random.Random(9).randbytes(5 * CHUNK)
PROVIDER = ident(50).peer_id


def fetch(tmp_path, ref):
    """Fetch `ref` from one provider that answers every request with the real bytes; returns
    (outcomes, store, engine)."""
    revision = make_revision(chunk_size=CHUNK)
    engine = Engine(EngineConfig(roles={"reducer"}, revision=revision), ident(60), random.Random(1))
    store = ArtifactStore(tmp_path, chunk_size=CHUNK)
    now = 0.0
    engine.handle(ev.Start(now=now))
    engine.handle(ev.PeerConnected(now=now, peer=PROVIDER))
    engine.handle(ev.MessageReceived(now=now, peer=PROVIDER, data=encode_message(
        Hello(revision=revision.id, roles=("trainer",), head_window=0))))
    outcomes: list[str] = []
    watch(engine, outcomes)
    engine.fetch(ref, [PROVIDER], "test", WAITER)
    for _ in range(100):
        effect = engine.next_effect()
        if effect is None:
            break
        now += 0.001
        if isinstance(effect, fx.CommitArtifact):
            stored = commit(store, effect.ref, effect.durable)  # never raises, whatever the bytes
            engine.handle(ev.ArtifactStored(now=now, ref=effect.ref) if stored else
                          ev.ArtifactCorrupt(now=now, ref=effect.ref))
        elif isinstance(effect, fx.Persist):
            store.put_record(effect.key, effect.record.data)
        elif isinstance(effect, fx.StoreChunk):
            store.write_chunk(effect.ref, effect.index, effect.data)
        elif isinstance(effect, fx.Send):
            message = decode_message(effect.data, max_bytes=1 << 24)
            if isinstance(message, ChunkRequest):
                i = message.index
                engine.handle(ev.MessageReceived(now=now, peer=PROVIDER, data=encode_message(
                    Chunk(artifact=ref.digest, index=i, data=DATA[i * CHUNK:(i + 1) * CHUNK]))))
    return outcomes, store, engine


def test_honest_ref_is_stored(tmp_path):
    ref = make_artifact_ref(DATA, CHUNK)
    outcomes, store, _ = fetch(tmp_path, ref)
    assert outcomes == ["done"] and store.get(ref.digest) == DATA


def test_ref_with_a_false_digest_fails_the_fetch_without_stopping_the_host(tmp_path):
    forged = attrs.evolve(make_artifact_ref(DATA, CHUNK), digest=content_id(b"not these bytes"))
    with pytest.raises(DecodeError, match="not the id of its size and chunks"):
        ArtifactRef.from_cbor(forged.to_cbor())  # on the wire it would be refused here
    outcomes, store, engine = fetch(tmp_path, forged)
    assert outcomes == ["corrupt-artifact"]
    assert not store.has(forged.digest) and not engine.is_stored(forged.digest)
    # Nothing of it is kept for a resume: a new fetch of the same ref asks for every chunk again.
    assert forged.digest not in engine.fetching.partial
