"""A store that lost an artifact behind the engine's back, against a live `peerloom node` over TCP+Noise on
127.0.0.1 (spec/embedding.md, the driver): a peer asking for a chunk of it gets `chunk-missing`, the node logs
`chunk-unreadable`, goes on serving the chunks it still has, and does not end. Before, the read raised out of
the runtime's main loop (a deleted file) or a short chunk went out, which the asker charges as a bad chunk."""

from __future__ import annotations

import os
import time

import pytest
import trio

from peerloom.adapters import tcp
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.identity import Identity
from peerloom.core.messages import Chunk, ChunkMissing, ChunkRequest, Hello, decode_message, encode_message
from peerloom.core.objects import Revision
from tests.live_attacks import wait_certified
from tests.node_cluster import chain, make_fleet

pytestmark = pytest.mark.slow


async def ask(port: int, revision: Revision, ref, indices: list[int]) -> dict[int, object]:
    """Ask the node for chunks `indices` of `ref` as a fresh peer; its answer to each (Chunk or ChunkMissing)."""
    answers: dict[int, object] = {}
    conn = await tcp.connect("127.0.0.1", port, Identity(os.urandom(32)), handshake_timeout=10.0)
    try:
        await conn.send_message(encode_message(Hello(revision=revision.id, roles=("trainer",), head_window=0)))
        for index in indices:
            await conn.send_message(encode_message(ChunkRequest(artifact=ref.digest, index=index)))
        with trio.fail_after(30):
            while len(answers) < len(indices):
                message = decode_message(await conn.receive_message(), max_bytes=1 << 24)
                if isinstance(message, (Chunk, ChunkMissing)) and message.artifact == ref.digest:
                    answers[message.index] = message
    finally:
        await conn.aclose()
    return answers


def test_a_chunk_of_a_truncated_artifact_is_answered_chunk_missing_and_the_node_goes_on(tmp_path):
    validator, trainer = make_fleet(tmp_path, validators=1, trainers=1, quorum=1, window_s=1.0)
    revision = Revision.verify(SignedEnvelope.from_bytes((tmp_path / "manifest.cbor").read_bytes()))
    try:
        for node in (validator, trainer):
            node.start()
        port = validator.wait_port(90)
        trainer.wait_port(90)
        assert wait_certified(validator, 2, 120), "the fleet never certified window 2"
        trainer.stop()  # no more updates: the validator's own tasks no longer read the file cut below
        ref = chain(validator)[-1].params
        path = validator.directory / "store" / "artifacts" / ref.digest[2:].hex()
        os.truncate(path, ref.size // 2)  # the store lost the second half of the head's params
        last = ref.num_chunks - 1
        answers = trio.run(ask, port, revision, ref, [last])
        assert answers[last] == ChunkMissing(artifact=ref.digest, index=last)
        time.sleep(0.5)
        assert validator.process is not None and validator.process.poll() is None, \
            (validator.directory / "node.log").read_text()[-2000:]
        logged = [e for e in validator.events() if e["event"] == "chunk-unreadable"]
        assert logged and logged[0]["index"] == last, logged
        again = trio.run(ask, port, revision, ref, [last])  # a new connection: still answered
        assert isinstance(again[last], ChunkMissing)
        if ref.num_chunks > 1:
            intact = trio.run(ask, port, revision, ref, [0])
            assert isinstance(intact[0], Chunk) and ref.chunk_ok(0, intact[0].data)
        assert validator.process.poll() is None
    finally:
        for node in (validator, trainer):
            node.stop()
