"""Fair serving (spec/protocol.md §8.2): strangers that pull the head's params over and over get what a
trainer needs per window and are then refused and banned, while the fleet trains on.

Live `peerloom node` processes over TCP+Noise on 127.0.0.1: 1 validator and 2 trainers, window 1 s. Four
connections, each a fresh identity claiming the trainer role, ask the validator for every chunk of its
latest head's params again and again, pipelined, reading every answer; a connection the validator hangs up
on comes back with a fresh identity at once. Before the per-window budget, 4 such connections drew 4.17 GB
in 30 s and windows fell by 81%. Checked: at most 1 window skipped while they pull, both honest trainers
announce an update in windows opened during the attack (they fetched the head), no trainer fails a params
fetch, and each identity was served at most 2 copies of the params per window it pulled in.

Short form (the suite): 8 s of pulling. The long form, in `make fuzz-live`, sets ``PEERLOOM_LIVE_ATTACK_S``
(60 there; the issue measured 30 s).
"""

from __future__ import annotations

import os
import time

import pytest
import trio

from peerloom.adapters import tcp
from peerloom.adapters.transport import TransportError
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.identity import Identity
from peerloom.core.messages import Chunk, ChunkRequest, Hello, decode_message, encode_message
from peerloom.core.objects import Revision
from tests.live_attacks import certified, head_events, wait_certified
from tests.node_cluster import chain, make_fleet

pytestmark = pytest.mark.slow

ATTACK_S = float(os.environ.get("PEERLOOM_LIVE_ATTACK_S", "0")) or 8.0
PULLERS = 4


class Pulls:
    def __init__(self) -> None:
        self.bytes = 0
        self.identities = 0
        self.per_identity: list[int] = []


async def ask_forever(conn: tcp.SecureConnection, ref) -> None:
    """Ask for every chunk of `ref`, again and again, as fast as the connection takes the requests."""
    while True:
        for index in range(ref.num_chunks):
            await conn.send_message(encode_message(ChunkRequest(artifact=ref.digest, index=index)))
        await trio.sleep(0)


async def puller(port: int, revision: Revision, validator, pulls: Pulls, seconds: float) -> None:
    """Pull the latest head's params from the validator until `seconds` pass, reconnecting with a fresh
    identity whenever the validator hangs up."""
    with trio.move_on_after(seconds):
        while True:
            got = 0
            try:
                conn = await tcp.connect("127.0.0.1", port, Identity(os.urandom(32)), handshake_timeout=10.0)
            except (OSError, TransportError):
                await trio.sleep(0.05)  # refused by the validator's admission (its handshake rate): dial again
                continue
            pulls.identities += 1
            try:
                await conn.send_message(encode_message(Hello(revision=revision.id, roles=("trainer",),
                                                             head_window=0)))
                heads = chain(validator)
                ref = heads[-1].params if heads else revision.manifest.genesis_params

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ask_forever, conn, ref)
                    while True:
                        message = decode_message(await conn.receive_message(), max_bytes=1 << 24)
                        if isinstance(message, Chunk):
                            got += len(message.data)
                            pulls.bytes += len(message.data)
            except* (OSError, TransportError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # hung up on (banned): come back as someone else
            finally:
                pulls.per_identity.append(got)
                with trio.CancelScope(shield=True):
                    await conn.aclose()


def test_strangers_pulling_params_get_a_fair_share_and_the_fleet_trains_on(tmp_path):
    validator, *trainers = make_fleet(tmp_path, validators=1, trainers=2, quorum=1, window_s=1.0)
    revision = Revision.verify(SignedEnvelope.from_bytes((tmp_path / "manifest.cbor").read_bytes()))
    try:
        for node in (validator, *trainers):
            node.start()
        port = validator.wait_port(90)
        for node in trainers:
            node.wait_port(90)
        assert wait_certified(validator, 3, 120), "the fleet never certified window 3"
        before = certified(validator)
        started = time.time()
        pulls = Pulls()

        async def attack() -> None:
            async with trio.open_nursery() as nursery:
                for _ in range(PULLERS):
                    nursery.start_soon(puller, port, revision, validator, pulls, ATTACK_S)

        trio.run(attack)
        ended = time.time()
        assert wait_certified(validator, certified(validator) + 1, 60), "no window certified after the attack"

        during = [e for e in head_events(validator) if started <= e["t"] <= ended]
        skipped = [e["window"] for e in during if e.get("skipped")]
        assert len(skipped) <= 1, f"windows skipped during the attack: {skipped}"
        assert certified(validator) > before + 1
        opened = min((e["window"] for e in during), default=before + 1)
        for trainer in trainers:
            events = trainer.events()
            assert any(e["event"] == "announce" and e["window"] >= opened for e in events), \
                f"{trainer.name} announced nothing during the attack"
            assert not [e for e in events if e["event"] == "params-fetch-failed" and e["t"] >= started]
        # each identity: at most 2 copies of a head's params in each window it pulled in (windows last >= 1 s)
        size = max(h.params.size for h in chain(validator))
        windows = len(during) + 2
        assert max(pulls.per_identity) <= 2 * size * windows, (max(pulls.per_identity), size, windows)
        assert pulls.bytes <= 2 * size * windows * pulls.identities
        refused = sum(1 for e in validator.events() if e["event"] == "reject" and e.get("reason") == "serve-quota")
        print(f"{PULLERS} pullers for {ATTACK_S:g} s: {pulls.bytes} bytes to {pulls.identities} identities "
              f"(params {size} bytes), {len(during)} heads, skipped {skipped}, serve-quota lines {refused}, "
              f"load {os.getloadavg()[0]:.1f}")
    finally:
        for node in (validator, *trainers):
            node.stop()
