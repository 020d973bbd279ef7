"""Login that cannot be locked (spec/auth.md §2 "Limits" and "Replay", §7), against a live `peerloom auth serve`
process and the fake OIDC provider of tests/fake_oidc.py, all on loopback.

2,000 `POST /v1/login/start` from one address (127.0.0.2, the flooder's client socket bound to it; it is
loopback on Linux) are all answered, and the flooder holds at most `max_sessions_per_address` pending logins
however many it starts; a volunteer on another address (127.0.0.1) then logs in with `peerloom login`,
which prints the key it asks a certificate for. The service's start rate per address is raised here so
that every start reaches the pending table (the rate itself is tested in tests/adapters/test_auth_service.py):
the table's bound, not the rate, is what this shows. Then the service restarts, and the provider token the
volunteer's login used is refused as `replayed` when it reaches the service again.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.request
from collections import Counter

import aiohttp
import pytest

from peerloom.adapters.keys import save_identity
from peerloom.adapters.storage import atomic_write
from tests.adapters.test_auth_service import GATE, REVISION
from tests.fake_oidc import FakeProvider, auth_config, serve_auth
from tests.helpers import ident
from tests.node_cluster import free_port, peerloom

pytestmark = pytest.mark.slow

FLOOD = 2000
PER_ADDRESS = 8  # the default max_sessions_per_address


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    assert process.wait(timeout=15) == 0


async def flood(url: str, peer: str, count: int) -> Counter[int]:
    """`count` login starts from 127.0.0.2, 32 at a time: the HTTP status of each."""
    statuses: Counter[int] = Counter()
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0), limit=32)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        async def one() -> None:
            async with http.post(f"{url}/v1/login/start", json={"provider": "oidc", "peer": peer}) as resp:
                await resp.read()
                statuses[resp.status] += 1

        await asyncio.gather(*(one() for _ in range(count)))
    return statuses


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/healthz", timeout=10) as resp:
        return json.loads(resp.read())


def test_a_login_flood_from_one_address_locks_no_one_out_and_used_tokens_survive_a_restart(tmp_path):
    save_identity(GATE, tmp_path / "gate.key")
    atomic_write(tmp_path / "manifest.cbor", REVISION.envelope.to_bytes())
    volunteer, thief = ident(11), ident(12)
    for name, key in (("volunteer", volunteer), ("thief", thief)):
        save_identity(key, tmp_path / f"{name}.key")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with FakeProvider() as provider:  # nothing approved: the flood's logins stay pending
        (tmp_path / "auth.toml").write_text(auth_config(provider, port, extra="starts_per_minute = 1000000\n"))
        log = tmp_path / "auth.log"
        service = serve_auth(tmp_path / "auth.toml", log)
        try:
            started = time.monotonic()
            statuses = asyncio.run(flood(url, ident(13).peer_id.to_text(), FLOOD))
            flood_s = time.monotonic() - started
            # Never `busy` (503) nor rate-limited: the oldest are evicted instead. The in-process fake provider
            # may drop a few of 32 concurrent requests on a loaded machine: the service then answers 502
            # (provider-error), which locks no one out.
            assert set(statuses) <= {200, 502} and statuses[200] >= 0.95 * FLOOD, statuses
            state = health(url)
            assert state["sessions"] <= PER_ADDRESS and state["evicted"] >= statuses[200] - PER_ADDRESS, state

            provider.auto = {"token": provider.id_token({"sub": "volunteer-1"})}  # one token, handed out twice
            login = peerloom("login", "--edge", url, "--provider", "oidc", "--key", str(tmp_path / "volunteer.key"),
                             "--out", str(tmp_path / "volunteer.cbor"), "--timeout", "60")
            assert login.returncode == 0, login.stderr + log.read_text()[-2000:]
            assert f"This node's key (its fingerprint): {volunteer.peer_id.to_text()}" in login.stdout
            assert f"{url}/v1/login/approve/" in login.stdout
            stop(service)

            service = serve_auth(tmp_path / "auth.toml", tmp_path / "auth-restarted.log")  # the restart
            replay = peerloom("login", "--edge", url, "--provider", "oidc", "--key", str(tmp_path / "thief.key"),
                              "--out", str(tmp_path / "thief.cbor"), "--timeout", "60")
            assert replay.returncode == 1 and "replayed" in replay.stderr, replay.stdout + replay.stderr
            assert not (tmp_path / "thief.cbor").exists()
            assert health(url)["issued"] == 0
        finally:
            if service.poll() is None:
                stop(service)
    print(f"{FLOOD} starts from one address in {flood_s:.1f} s (load {os.getloadavg()[0]:.1f})")
