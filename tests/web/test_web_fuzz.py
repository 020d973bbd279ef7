"""Property fuzzing of the browser peer's parsers (web/src/node/fuzz.ts, run under node for a few seconds):
random bytes and mutations of valid inputs fed to the canonical CBOR decoder, the Noise handshake's message 2
and its libp2p payload, the transport's frames and byte stream, and the peer's message handler are either
taken or refused with the spec's typed error (DecodeError, TransportError, a reason in a `rejected` event),
never another exception; a CBOR decode that succeeds re-encodes to the same bytes. The valid messages it
mutates (a certified head, a chain, hello, peers, chunks) come from Python's encoder."""

from __future__ import annotations

import json
import os

import pytest

from peerloom.core.messages import (
    CertifiedHead,
    ChainEntries,
    Chunk,
    ChunkMissing,
    ChunkRequest,
    Hello,
    PeerExchange,
    encode_message,
)
from tests.edge_fixtures import VALIDATOR, certify, next_head
from tests.helpers import ident, make_revision
from tests.web.webbuild import node_driver

TARGETS = ("cbor", "payload", "message2", "frames", "stream", "messages")


def _inputs():
    revision = make_revision(validators=(VALIDATOR,), trainers=(ident(10), ident(11)))
    genesis = revision.genesis()
    head = next_head(revision, genesis, b"params of window 1", accuracy=0.5, loss=1.0)
    cert = certify(revision, head)
    later = next_head(revision, head, b"params of window 2", accuracy=0.6, loss=0.9)
    digest = head.params.digest
    messages = [
        CertifiedHead(head=head, certificate=cert),
        ChainEntries(entries=((head, cert), (later, certify(revision, later)))),
        Hello(revision=revision.id, roles=("validator",), head_window=1, listen="http://127.0.0.1:9"),
        PeerExchange(peers=((ident(12).peer_id, "http://127.0.0.1:9"), (ident(13).peer_id, "/ip4/127.0.0.1/tcp/9"))),
        Chunk(artifact=digest, index=0, data=b"x" * 40), ChunkMissing(artifact=digest, index=3),
        ChunkRequest(artifact=digest, index=0),
    ]
    return revision.envelope.to_bytes().hex(), [encode_message(m).hex() for m in messages]


@pytest.mark.serial  # counts the inputs each target takes in a fixed time
@pytest.mark.parametrize("seed", [1, 2])
def test_the_browser_peers_parsers_take_or_refuse_every_input_with_a_typed_error(seed):
    manifest, messages = _inputs()
    ms = int(os.environ.get("PEERLOOM_WEB_FUZZ_MS", "400"))  # per target; a few seconds in all
    result = node_driver({"op": "fuzz", "seed": seed, "ms": ms, "manifest": manifest, "messages": messages},
                         timeout=60 + len(TARGETS) * ms / 1000)
    assert "error" not in result, result
    assert set(result["counts"]) == set(TARGETS)
    assert all(result["counts"][t] > 50 for t in TARGETS), result["counts"]
    assert result["failures"] == [], json.dumps(result["failures"], indent=1)[:4000]
