"""A fetch of an artifact the node then computes itself ends at once (the reducer used to fetch the
head's params and DiLoCo state from a validator every window while computing the same bytes)."""

from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.messages import Chunk, ChunkRequest
from tests.core.test_engine_attacks import GENESIS, MALLORY, VALIDATOR, deliver, drain, trainer_fetching_genesis


def test_artifact_added_finishes_a_fetch_in_flight_and_late_chunks_charge_nobody():
    engine, rev = trainer_fetching_genesis()
    ref = rev.manifest.genesis_params
    asked = [e for e in drain(engine) if isinstance(e, fx.Send) and e.peer == VALIDATOR.peer_id]
    assert asked and ref.digest in engine.fetching.fetches
    engine.handle(ev.ArtifactAdded(now=engine.now, ref=ref))  # the host computed (and stored) the same artifact
    effects = drain(engine)
    assert ref.digest not in engine.fetching.fetches
    assert any(isinstance(e, fx.RunTask) and e.kind == "train" for e in effects)  # the fetch's owner went on
    # the chunks asked for before arrive late: dropped, never stored, nobody charged
    for i in range(ref.num_chunks):
        deliver(engine, VALIDATOR, Chunk(artifact=ref.digest, index=i, data=GENESIS[i * 4096:(i + 1) * 4096]))
    effects = drain(engine)
    assert not [e for e in effects if isinstance(e, (fx.StoreChunk, fx.CommitArtifact))]
    assert engine.peers[VALIDATOR.peer_id].penalty == 0 and engine.rejected_by_reason["unsolicited-chunk"] == 0
    # ...once: a second copy, or a chunk from a peer never asked, is unsolicited as before
    deliver(engine, VALIDATOR, Chunk(artifact=ref.digest, index=0, data=GENESIS[:4096]))
    deliver(engine, MALLORY, Chunk(artifact=ref.digest, index=1, data=GENESIS[4096:8192]))
    assert engine.rejected_by_reason["unsolicited-chunk"] == 2
    # and the node now serves the artifact it holds
    deliver(engine, MALLORY, ChunkRequest(artifact=ref.digest, index=0))
    assert any(isinstance(e, fx.ServeChunk) for e in drain(engine))
