"""Crash test: SIGKILL a validator at random moments, many times; after every restart its store is consistent
(its chain has no hole) and it has never signed two different votes for one (window, round, step)
(spec/design.md §6). A trainer SIGKILLed and restarted fills in every window it missed (spec/protocol.md §8).

Fleet: two validators (quorum 2, so every window needs the victim's votes) and two trainers, each a
`peerloom node` OS process on 127.0.0.1. validator-1 is killed a random 0-1 s or 2.5-4 s after it is up
(its first life runs until it has voted in two windows), its store is checked from this process, and it is
started again from the same disk. Every node's lives are forked from a fork server that imported peerloom
once (tests/node_zygote.py, as `Node.start` does): real processes and real SIGKILLs, without paying the
interpreter start-up on every restart. Double votes are looked for in three places: the victim's own vote
log across all its lives, its database (one row per slot, matching the log), and the surviving validator,
which rejects any equivocation it receives with reason ``equivocation``.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from peerloom.adapters.storage import ArtifactStore
from peerloom.core.chain import decode_chain_entry
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.objects import make_artifact_ref
from tests.node_cluster import make_fleet

ITERATIONS = 20


def _check_store(directory) -> dict[tuple[int, int, str], bytes]:
    store = ArtifactStore(directory, chunk_size=64 * 1024)
    try:
        assert store.check() == []  # every artifact matches its digest; SQLite integrity_check is "ok"
        records = store.records()
        votes = {(w, r, s): env for w, r, s, env in store.db.votes()}
        assert {k for k in records if k.startswith("vote/")} == {f"vote/{w}/{r}/{s}" for w, r, s in votes}
        for (w, r, s), env in votes.items():
            assert records[f"vote/{w}/{r}/{s}"] == env
            SignedEnvelope.from_bytes(env)  # a whole, parseable signed vote, never a torn one
        if "head" in records:
            head, _ = decode_chain_entry(records["head"])
            assert store.has(head.params.digest) or head.window == 0
            # no hole at any moment: every window up to the head is in the store's chain (spec/protocol.md §8)
            held = {w for w, _, _ in store.db.heads()}
            assert [w for w in range(1, head.window + 1) if w not in held] == []
        return votes
    finally:
        store.close()


@pytest.mark.slow
def test_sigkill_validator_repeatedly_keeps_store_consistent_and_never_double_votes(tmp_path):
    rng = random.Random(7)
    nodes = make_fleet(tmp_path, validators=2, trainers=2, quorum=2, window_s=1.0)
    victim, witness = nodes[0], nodes[1]
    started = time.monotonic()
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_port()
        deadline = time.monotonic() + 20.0  # first life: let the fleet get going (votes in flight)
        while time.monotonic() < deadline and len({e["window"] for e in victim.events() if e["event"] == "vote"}) < 2:
            time.sleep(0.05)
        all_votes: dict[tuple[int, int, str], bytes] = {}
        for _ in range(ITERATIONS):
            # Short lives hit start-up and resume; long ones outlive the window deadline (a nil prevote).
            time.sleep(rng.uniform(0.0, 1.0) if rng.random() < 0.5 else rng.uniform(2.5, 4.0))
            victim.kill()
            assert victim.process is not None and victim.process.returncode == -signal.SIGKILL
            votes = _check_store(victim.directory / "store")
            for slot, envelope in all_votes.items():  # nothing a previous life signed was lost
                assert votes[slot] == envelope, slot
            all_votes = votes
            victim.start()
            victim.wait_port()
        time.sleep(1.0)
    finally:
        for node in nodes:
            node.stop()
    elapsed = time.monotonic() - started

    signed: dict[tuple[int, int, str], set[str | None]] = defaultdict(set)
    lives = 0
    for line in victim.events():
        if line["event"] == "start":
            lives += 1
        elif line["event"] == "vote":
            signed[(line["window"], line["round"], line["step"])].add(line["head"])
    assert lives == ITERATIONS + 1
    assert signed, "the victim never voted: the test killed nothing interesting"
    assert all(len(heads) == 1 for heads in signed.values()), {k: v for k, v in signed.items() if len(v) > 1}
    final = _check_store(victim.directory / "store")
    assert {f"{w}/{r}/{s}" for w, r, s in final} >= {f"{w}/{r}/{s}" for w, r, s in signed}
    assert not [e for e in witness.events() if e["event"] == "reject" and e.get("reason") == "equivocation"]
    heads = [e["window"] for e in witness.events() if e["event"] == "head"]
    assert heads and max(heads) >= 1, "no window was certified: the crashes hit an idle fleet"
    print(f"{ITERATIONS} kills, {len(signed)} vote slots signed, witness reached window {max(heads)}, "
          f"{elapsed:.1f} s")


_WRITER = """
import hashlib, os, sys
from peerloom.adapters.storage import ArtifactStore
from peerloom.core.objects import make_artifact_ref

def write(n):
    store = ArtifactStore(sys.argv[1], chunk_size=4096)
    print("ready", os.getpid(), flush=True)
    while True:
        n += 1
        data = hashlib.sha256(str(n).encode()).digest() * (1 + n % 2000)  # up to 64 KB, often several chunks
        if n % 3:
            store.put(data)
        else:  # a chunked fetch: chunks at their offsets, then verify-and-commit
            ref = make_artifact_ref(data, 4096)
            for i in reversed(range(ref.num_chunks)):
                store.write_chunk(ref, i, data[i * 4096:(i + 1) * 4096])
            store.commit(ref)
        store.put_record(f"vote/{n}/0/prevote", hashlib.sha256(data).digest())
        store.put_record("head", str(n).encode())

# One writer process per input line (the last vote it may assume written), forked from this one so that the
# imports are paid once; it opens the store itself, and this process never does.
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            write(int(line))
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    print("ended", os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.slow
def test_sigkill_during_store_writes_leaves_no_torn_artifact_or_record(tmp_path):
    """A process writing artifacts (whole and chunked) and records flat out is SIGKILLed at random moments;
    every reopening sees only complete artifacts, and every record it sees is whole and self-consistent."""
    import hashlib

    rng = random.Random(11)
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    store_dir = tmp_path / "store"
    last = 0
    server = subprocess.Popen([sys.executable, str(script), str(store_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert server.stdin is not None and server.stdout is not None
    pid = None
    try:
        for _ in range(ITERATIONS):
            server.stdin.write(f"{last}\n")
            server.stdin.flush()
            ready, pid = server.stdout.readline().split()
            assert ready == "ready"
            time.sleep(rng.uniform(0.0, 0.3))
            os.kill(int(pid), signal.SIGKILL)
            assert server.stdout.readline().split() == ["ended", str(-signal.SIGKILL)]
            pid = None
            store = ArtifactStore(store_dir, chunk_size=4096)
            assert store.check() == []  # every visible artifact is whole and matches its digest
            records = store.records()
            head = int(records.get("head", b"0"))
            votes = {int(k.split("/")[1]): v for k, v in records.items() if k.startswith("vote/")}
            for n, value in votes.items():
                data = hashlib.sha256(str(n).encode()).digest() * (1 + n % 2000)
                assert value == hashlib.sha256(data).digest()
                assert store.has(make_artifact_ref(data, 4096).digest)  # its artifact was durable before it
            assert max(votes, default=0) - head in (0, 1)  # records commit in order: head n only after vote n
            assert sorted(votes) == list(range(1, len(votes) + 1))  # nothing committed was lost
            last = max(votes, default=0)
            store.close()
    finally:
        if pid is not None:  # a failed check left a writer running
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        server.stdin.close()
        server.wait(timeout=30)
    assert last > ITERATIONS  # the writer made progress between kills


def _head_windows(node) -> list[int]:
    return [e["window"] for e in node.events() if e["event"] == "head"]


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _store_chain(store_dir) -> tuple[list[int], list[int]]:
    """(windows of the store's database chain, windows of its chain directory), each in order."""
    from peerloom.adapters.database import DB_NAME, Database

    db = Database(store_dir / DB_NAME)
    try:
        windows = sorted(w for w, _, _ in db.heads() if w > 0)
    finally:
        db.close()
    files = sorted(int(p.stem) for p in (store_dir / "chain").glob("[0-9]*.cbor"))
    return windows, [w for w in files if w > 0]


@pytest.mark.slow
def test_sigkilled_trainer_restarts_with_no_hole_in_its_chain(tmp_path):
    """A trainer SIGKILLed at a random moment and restarted after the fleet has certified
    several windows without it fills in every head it missed (verified, with certificates) from its peers,
    so its store's chain - the database and the chain directory - runs from window 1 to its head with no
    hole, and `peerloom verify` accepts the store. Two lives end this way: one short, one long enough that
    the validator certifies at least three windows while the trainer is down."""
    from peerloom.verify import run_verify

    rng = random.Random(5)
    nodes = make_fleet(tmp_path, validators=1, trainers=2, quorum=1, window_s=1.0)
    validator, victim = nodes[0], nodes[1]
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_port()
        _wait(lambda: len(set(_head_windows(victim))) >= 2, 60.0, "the victim never held two heads")
        for downtime_windows in (0, 3):
            time.sleep(rng.uniform(0.0, 1.0))  # somewhere inside a window: training, announcing or adopting
            victim.kill()
            down_at = max(_head_windows(validator), default=0)
            _wait(lambda d=down_at, n=downtime_windows: max(_head_windows(validator), default=0) >= d + n, 60.0,
                  "the fleet stopped while the victim was down")
            restart_at = max(_head_windows(validator), default=0)
            victim.start()
            victim.wait_port()
            _wait(lambda r=restart_at: max(_head_windows(victim), default=0) > r, 60.0,
                  "the restarted victim never caught up")
    finally:
        for node in nodes:
            node.stop()
    victim_windows, victim_files = _store_chain(victim.directory / "store")
    head = max(victim_windows)
    assert head > 5
    assert victim_windows == list(range(1, head + 1)), f"holes: {sorted(set(range(1, head + 1)) - set(victim_windows))}"
    assert victim_files == victim_windows
    lines: list[str] = []
    assert run_verify(victim.directory / "store", echo=lines.append) == 0, lines
    assert run_verify(victim.directory, echo=lines.append) == 0, lines
