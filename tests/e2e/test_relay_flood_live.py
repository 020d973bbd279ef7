"""A relay flooded with reservations by fresh identities, against live `peerloom node` processes on 127.0.0.1
(spec/transport.md §12, §13): validator-1 relays (``[relay] enabled``, 8 reservations, at most 4 from one
address); trainer-2 listens nowhere and is reached only through its reservation there; trainer-1 is an
ordinary peer, so windows go on certifying whatever trainer-2's fate.

Then 70 fresh identities, from the same address as everyone here, ask for reservations and keep asking (each
is a `RelayTransport.listen`, which remakes a refused reservation with backoff). trainer-2's reservation
survives: it keeps announcing updates through its circuit. Killed and restarted during the flood, it gets its
reservation back (the slot of a lost reservation is kept for its peer, not handed to a stranger) and
announces again. The relay stays alive, windows certify with never more than 2 in a row uncertified, and the
relay's RSS ends within 20% of where it started.

The long form (`make fuzz-live`) sets ``PEERLOOM_LIVE_ATTACK_S`` to keep the flood up that long.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import trio

from peerloom.adapters.relay import RelayTransport
from peerloom.adapters.runtime import LOG_INTERVAL_S
from peerloom.adapters.tcp import TcpTransport
from peerloom.core.identity import Identity
from tests.e2e.test_identity_flood_live import rss_bytes, wait_for
from tests.live_attacks import certified, longest_skip_run, wait_certified
from tests.node_cluster import Node, free_port, make_fleet

pytestmark = pytest.mark.slow

FLOODERS = 70
ATTACK_S = float(os.environ.get("PEERLOOM_LIVE_ATTACK_S", "0"))


def announcements(node: Node) -> int:
    return sum(e.get("event") == "announce" for e in node.events())


def test_a_reservation_flood_keeps_neither_a_known_peers_reservation_nor_its_slot(tmp_path: Path) -> None:
    nodes = make_fleet(tmp_path, validators=1, trainers=2, quorum=1, window_s=1.0)
    validator, _, hidden = nodes
    relay = f"/ip4/127.0.0.1/tcp/{free_port()}"
    # every identity here dials from 127.0.0.1: the per-address handshake bucket (§13) would refuse the flood
    # before any reservation is asked, and this test is about the reservations
    validator.write_config(relay={"enabled": True, "listen": relay, "max_reservations": 8,
                                  "max_reservations_per_ip": 4},
                           limits={"handshake_rate": 10_000.0, "handshake_burst": 10_000})
    circuit = f"{relay}/p2p-circuit/{hidden.identity.peer_id.to_text()}"
    config = dict(hidden.config)
    del config["listen"]  # reached only through its reservation
    hidden.config = {**config, "bootstrap": [], "relay": {"via": [relay], "only": True}}
    hidden.write_config()
    validator.write_config(bootstrap=validator.config["bootstrap"] + [circuit])
    try:
        for node in nodes:
            node.start()
        for node in nodes[:2]:
            node.wait_port()
        assert wait_for(lambda: announcements(hidden) >= 2, 90), hidden.directory.joinpath("node.log").read_text()
        time.sleep(2.0)
        rss_before = rss_bytes(validator.process.pid)

        async def flood_while(check) -> None:
            async def reserve() -> None:
                await RelayTransport([TcpTransport()]).listen(f"{relay}/p2p-circuit", Identity(os.urandom(32)),
                                                              lambda conn: trio.sleep(0))

            async with trio.open_nursery() as nursery:
                for _ in range(FLOODERS):
                    nursery.start_soon(reserve)
                await trio.sleep(2.0)  # the flood has taken what it can: the relay's per-address share
                await trio.to_thread.run_sync(check)
                nursery.cancel_scope.cancel()

        def during() -> None:
            started = time.monotonic()
            before = announcements(hidden)
            assert wait_for(lambda: announcements(hidden) >= before + 2, 30), "the known peer lost its reservation"
            hidden.kill()  # its reservation is lost; a restart must get it back, with the flood still on
            hidden.start()
            restarted = announcements(hidden)
            assert wait_for(lambda: announcements(hidden) >= restarted + 2, 60), \
                "the restarted peer did not get its reservation back: " + \
                hidden.directory.joinpath("node.log").read_text()[-2000:]
            remaining = ATTACK_S - (time.monotonic() - started)
            if remaining > 0:  # the long form keeps the flood up
                time.sleep(remaining)
                assert announcements(hidden) > restarted + 2

        trio.run(flood_while, during)
        assert validator.process is not None and validator.process.poll() is None
        assert wait_certified(validator, certified(validator) + 2, 60), "windows stopped after the flood"
        assert longest_skip_run(validator) <= 2
        # within a log interval the relay hands the flood's memory back (spec/transport.md §14)
        assert wait_for(lambda: rss_bytes(validator.process.pid) <= 1.2 * rss_before, LOG_INTERVAL_S + 2.0), \
            (rss_before, rss_bytes(validator.process.pid))
    finally:
        for node in nodes:
            node.stop()
