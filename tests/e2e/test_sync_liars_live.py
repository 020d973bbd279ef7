"""A restarted validator catches up while peers lie to it about the chain (spec/protocol.md §8).

Live `peerloom node` processes over TCP+Noise on 127.0.0.1: 4 validators (quorum 3) and 2 trainers certify
windows; validator 4 is killed, the fleet goes on without it, and it restarts with no bootstrap peer while
10 fresh identities connect to it first, each claiming in its Hello to be a validator with a head of window
10^12, and never answer a chain-get. It must still reach the head the fleet had when it restarted within a
bounded time (the honest validators redial it; it asks the manifest's validators before any stranger and
backs off from peers that leave chain-gets unanswered), every process stays alive, and windows go on.
"""

import os

import pytest
import trio

from peerloom.adapters import tcp
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.identity import Identity
from peerloom.core.messages import Hello, encode_message
from peerloom.core.objects import Revision
from tests.live_attacks import certified, wait_certified
from tests.node_cluster import make_fleet

pytestmark = pytest.mark.slow

LIARS = 10
CATCH_UP_S = 30.0  # the honest validators redial within 5 s; 10 liars asked one after another took 50+ s


async def liar(port: int, revision: bytes, seconds: float) -> None:
    """Claim a head of window 10^12 and the validator role, then read and never answer."""
    try:
        conn = await tcp.connect("127.0.0.1", port, Identity(os.urandom(32)), handshake_timeout=10.0)
        await conn.send_message(encode_message(Hello(revision=revision, roles=("validator",), head_window=10**12)))
        with trio.move_on_after(seconds):
            while True:
                await conn.receive_message()
    except (OSError, tcp.TransportError, trio.BrokenResourceError, trio.ClosedResourceError):
        return  # the node hanging up on a liar is its right


async def lie_while(port: int, revision: bytes, node, window: int) -> float:
    """Run the liars against `port` until `node` certified `window` (or `CATCH_UP_S`); seconds it took."""
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(LIARS):
            nursery.start_soon(liar, port, revision, CATCH_UP_S + 10.0)
        while certified(node) < window and trio.current_time() - started < CATCH_UP_S:
            await trio.sleep(0.2)
        nursery.cancel_scope.cancel()
    return trio.current_time() - started


def test_a_restarted_validator_catches_up_past_peers_that_claim_a_high_head_and_never_answer(tmp_path):
    nodes = make_fleet(tmp_path, validators=4, trainers=2, quorum=3, window_s=1.0)
    revision = Revision.verify(SignedEnvelope.from_bytes((tmp_path / "manifest.cbor").read_bytes()))
    v1, v4 = nodes[0], nodes[3]
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_port(90)
        assert wait_certified(v1, 3, 120), "the fleet never certified window 3"
        v4.kill()
        behind = certified(v1) + 6
        assert wait_certified(v1, behind, 120), "the fleet stopped without validator 4"
        v4.write_config(bootstrap=[])  # it hears of the chain first from whoever connects: the liars
        v4.start()
        port = v4.wait_port(90)
        target = certified(v1)
        took = trio.run(lie_while, port, revision.id, v4, target)
        assert certified(v4) >= target, f"validator 4 at {certified(v4)} after {took:.1f} s, the fleet at {target}"
        assert all(n.process is not None and n.process.poll() is None for n in nodes), "a node process ended"
        after = certified(v1)
        assert wait_certified(v1, after + 1, 60), "no window certified after the attack"
    finally:
        for node in nodes:
            node.stop()
