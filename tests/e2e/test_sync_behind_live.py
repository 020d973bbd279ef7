"""A validator restarted 80 windows behind catches up within 5 s while 10 lying peers are connected, and
bans no honest trainer (spec/protocol.md §8; the announcement rule of §6 for windows it has not reached).

Live `peerloom node` processes over TCP+Noise on 127.0.0.1: 4 validators (quorum 3) and 2 trainers certify
short windows; validator 4 is killed and the fleet goes on until it is 80 windows ahead of it. Validator 4
restarts with no bootstrap peer, and as soon as its port is open 10 fresh identities connect to it, each
claiming in its `hello` the validator role and a head of window 10^12, and never answer a `chain-get`. So
the liars are greeted before any honest peer, the worst order for a node that picks whom to ask.

The clock starts when the first honest peer connects to it (the honest validators and trainers redial it
within their dial back-off, at most 5 s; before that nobody who holds the chain can be asked, and that wait
is the dialer's, not sync's) and stops at the head event of the window the fleet had reached when it
restarted, both read from its own event log. It must take at most 5 s, and its log must show no ban and no
charge against either honest trainer, whose announcements for windows ahead of it arrive the whole time.
"""

import os
import time

import pytest
import trio

from peerloom.adapters import tcp
from peerloom.adapters.transport import TransportError
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.identity import Identity
from peerloom.core.messages import Hello, encode_message
from peerloom.core.objects import Revision
from tests.live_attacks import certified, wait_certified
from tests.node_cluster import make_fleet

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # "catches up within 5 s"

LIARS = 10
BEHIND = 80  # windows: two chain-gets of 64
CATCH_UP_S = 5.0
WINDOW_S = 0.1  # short windows and round timeouts, so that 80 windows without validator 4 (a round lost
AGREEMENT_TIMEOUT_S = 0.3  # whenever it is the proposer) pass in well under a minute on a loaded machine


def head_window(node) -> int:
    """The highest head (certified or skipped) a node's event log says it holds."""
    return max((e.get("window", 0) for e in node.events() if e.get("event") == "head"), default=0)


async def liar(port: int, revision: bytes, seconds: float) -> None:
    """Claim a head of window 10^12 and the validator role, then read and never answer."""
    try:
        conn = await tcp.connect("127.0.0.1", port, Identity(os.urandom(32)), handshake_timeout=10.0)
        await conn.send_message(encode_message(Hello(revision=revision, roles=("validator",), head_window=10**12)))
        with trio.move_on_after(seconds):
            while True:
                await conn.receive_message()
    except (OSError, TransportError, trio.BrokenResourceError, trio.ClosedResourceError):
        return  # the node hanging up on a liar is its right


async def lie_until(port: int, revision: bytes, node, window: int, limit_s: float) -> None:
    """Run the liars against `port` until `node` holds the head of `window`, or `limit_s`; they stay
    connected a second longer either way."""
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(LIARS):
            nursery.start_soon(liar, port, revision, limit_s + 5.0)
        while trio.current_time() - started < limit_s and head_window(node) < window:
            await trio.sleep(0.05)
        await trio.sleep(1.0)  # announcements for windows it had not reached keep coming meanwhile
        nursery.cancel_scope.cancel()


def catch_up_s(node, honest: set[str], window: int) -> tuple[float | None, float | None]:
    """From the node's log since its last start: (seconds from start to its first connection with an honest
    peer, seconds from then to its head event of `window`); None where the log lacks the event."""
    events = node.events()
    start = max(i for i, e in enumerate(events) if e.get("event") == "start")
    since = events[start:]
    first = next((e["t"] for e in since if e.get("event") == "connected" and e.get("peer") in honest), None)
    reached = next((e["t"] for e in since if e.get("event") == "head" and e.get("window", 0) >= window), None)
    if first is None:
        return None, None
    return first - events[start]["t"], None if reached is None else reached - first


def test_a_validator_80_windows_behind_catches_up_in_5_s_past_liars_and_bans_no_honest_trainer(tmp_path):
    nodes = make_fleet(tmp_path, validators=4, trainers=2, quorum=3, window_s=WINDOW_S)
    revision = Revision.verify(SignedEnvelope.from_bytes((tmp_path / "manifest.cbor").read_bytes()))
    v1, v4 = nodes[0], nodes[3]
    trainers = [n for n in nodes if n.role == "trainer"]
    for node in nodes[:4]:
        node.write_config(agreement_timeout_s=AGREEMENT_TIMEOUT_S)
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_port(90)
        assert wait_certified(v1, 3, 120), "the fleet never certified window 3"
        v4.kill()
        left_at = head_window(v4)
        deadline = time.monotonic() + 150
        while head_window(v1) < left_at + BEHIND and time.monotonic() < deadline:  # about 1 window/s
            time.sleep(0.2)
        assert head_window(v1) >= left_at + BEHIND, f"the fleet reached {head_window(v1)}, not {left_at + BEHIND}"
        v4.write_config(bootstrap=[])  # it hears first from whoever connects: the liars
        v4.start()
        port = v4.wait_port(90)
        target = head_window(v1)
        trio.run(lie_until, port, revision.id, v4, target, 25.0)
        honest = {n.identity.peer_id.to_text() for n in nodes if n is not v4}
        dialled, took = catch_up_s(v4, honest, target)
        assert dialled is not None, "no honest peer connected to validator 4"
        assert took is not None, f"validator 4 at {head_window(v4)}, the fleet at {target}"
        assert took <= CATCH_UP_S, f"validator 4 took {took:.1f} s to go from {left_at} to {target}"
        trainer_ids = {t.identity.peer_id.to_text() for t in trainers}
        events = v4.events()
        banned = [e for e in events if e.get("event") == "peer-banned" and e.get("peer") in trainer_ids]
        charged = [e for e in events if e.get("event") == "reject" and e.get("peer") in trainer_ids]
        assert not banned, f"validator 4 banned an honest trainer: {banned}"
        assert not charged, f"validator 4 charged an honest trainer: {charged[:5]}"
        assert all(n.process is not None and n.process.poll() is None for n in nodes), "a node process ended"
        after = certified(v1)
        assert wait_certified(v1, after + 1, 60), "no window certified after the attack"
    finally:
        for node in nodes:
            node.stop()
