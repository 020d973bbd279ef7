"""End to end, relays (spec/transport.md §12): a fleet of `peerloom node` processes (tests/node_cluster.py
make_fleet: two validators, two trainers, quorum 2) in which trainer-2 listens nowhere and dials nobody: it
holds reservations at two relays, a tampering one (a separate process flipping a bit of every circuit
message) and validator-1 (``[relay] enabled = true``), and the validators dial its two circuit addresses.
Every circuit through the tampering relay fails its end-to-end handshake; the validators reach trainer-2
through validator-1's relay instead, its updates are certified (a cohort of both trainers' updates), and
`peerloom verify` accepts the chain.

Run as ``python -m tests.e2e.test_relay_e2e PORT KEYFILE COUNTFILE`` it is the tampering relay."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerloom.adapters.keys import generate_identity, save_identity
from tests.node_cluster import Node, chain, chain_windows, check_chain, free_port, make_fleet, run_fleet_until

REPO = Path(__file__).resolve().parents[2]


def run_tampering_relay(port: int, key: Path, count_file: Path) -> None:
    """Serve a relay on 127.0.0.1:`port` that corrupts every circuit message; write the number of circuits
    it carried to `count_file` as each one starts."""
    import trio

    from peerloom.adapters.keys import load_identity
    from peerloom.adapters.tcp import TcpTransport
    from tests.adapters.test_relay import TamperingRelay

    class Counting(TamperingRelay):
        async def _splice(self, a, b, *rest) -> None:
            count_file.write_text(str(self.circuits_total))
            await super()._splice(a, b, *rest)

    async def main() -> None:
        await Counting().serve(TcpTransport(), f"/ip4/127.0.0.1/tcp/{port}", load_identity(key))

    trio.run(main)


@pytest.mark.slow
def test_a_trainer_behind_a_nat_trains_through_a_relay_and_survives_a_tampering_one(tmp_path: Path) -> None:
    nodes = make_fleet(tmp_path, validators=2, trainers=2, quorum=2, window_s=1.0)
    validator_1, validator_2, _, hidden = nodes
    relay_port, bad_port = free_port(), free_port()
    good_relay, bad_relay = f"/ip4/127.0.0.1/tcp/{relay_port}", f"/ip4/127.0.0.1/tcp/{bad_port}"
    validator_1.write_config(relay={"enabled": True, "listen": good_relay, "max_reservations": 4})
    config = dict(hidden.config)
    del config["listen"]  # it listens nowhere directly, and dials only circuits: only its relays reach it
    hidden.config = {**config, "bootstrap": [], "relay": {"via": [bad_relay, good_relay], "only": True}}
    hidden.write_config()
    circuits = [f"{relay}/p2p-circuit/{hidden.identity.peer_id.to_text()}" for relay in (bad_relay, good_relay)]
    for validator in (validator_1, validator_2):
        validator.write_config(bootstrap=validator.config["bootstrap"] + circuits)

    bad_key, count_file = tmp_path / "bad-relay.key", tmp_path / "bad-relay.count"
    save_identity(generate_identity(), bad_key)
    with open(tmp_path / "bad-relay.log", "wb") as log:
        bad = subprocess.Popen([sys.executable, "-m", "tests.e2e.test_relay_e2e", str(bad_port), str(bad_key),
                                str(count_file)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_listening(bad_port, bad, tmp_path / "bad-relay.log")  # up before trainer-2 dials it
        run_fleet(nodes)
        assert bad.poll() is None, (tmp_path / "bad-relay.log").read_text()[-3000:]
    finally:
        bad.kill()
        bad.wait()

    # the tampering relay carried circuits to trainer-2, and none of them became a connection
    assert count_file.exists() and int(count_file.read_text()) >= 1
    hidden_id = hidden.identity.peer_id.to_text()
    for validator in (validator_1, validator_2):
        to_hidden = [e for e in validator.events() if e.get("event") == "connected" and e.get("peer") == hidden_id]
        assert to_hidden and all(e["transport"] == "relay" and e["address"] == circuits[1] for e in to_hidden)
    connected = [e for e in hidden.events() if e.get("event") == "connected"]
    assert connected and {e["transport"] for e in connected} == {"relay"}  # reached only through the relay
    assert any(e.get("event") == "relay" for e in validator_1.events())
    for validator in (validator_1, validator_2):
        check_chain(validator, 3)
    assert any(len(h.cohort) == 2 for h in chain(validator_1)), "trainer-2's update was never certified"


def _wait_listening(port: int, process: subprocess.Popen[bytes], log: Path, timeout_s: float = 60.0) -> None:
    """Wait until `process` accepts TCP connections on 127.0.0.1:`port` (a bare connection, closed at once:
    no handshake, no circuit)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port}: {log.read_text()[-3000:]}"
            time.sleep(0.05)


def run_fleet(nodes: list[Node], windows: int = 3) -> None:
    """Start the fleet and wait (at most 120 s) until each validator holds `windows` certified windows and
    one of them certified both trainers' updates (one update per leaseholder: a cohort of 2)."""
    validators = [n for n in nodes if n.role == "validator"]
    run_fleet_until(nodes, lambda: min(len(chain_windows(v)) for v in validators) >= windows
                    and any(len(h.cohort) == 2 for h in chain(validators[0])), 120)


if __name__ == "__main__":
    run_tampering_relay(int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
