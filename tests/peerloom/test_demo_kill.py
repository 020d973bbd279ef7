"""When the demo may SIGKILL its honest killed-and-restarted trainer (peerloom.demo `_audit_exposure`): never
while a segment audit of one of its updates can still ask it for checkpoints (spec/protocol.md §6.3)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from peerloom import demo
from peerloom.core.identity import Identity

UPDATE = bytes(range(34))


def _node(tmp_path: Path, name: str, events: list[dict[str, object]]) -> demo.NodeProc:
    directory = tmp_path / name
    (directory / "store" / "chain").mkdir(parents=True)
    (directory / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    peer = Identity(name.encode().ljust(32, b"\0")).peer_id
    return demo.NodeProc(name=name, role="trainer", peer=peer, directory=directory)


def _revision() -> SimpleNamespace:
    return SimpleNamespace(manifest=SimpleNamespace(audit=True, audit_rate=1.0, audit_segments=4))


def test_a_kill_waits_for_the_head_that_decides_an_announced_updates_audit(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    victim = _node(tmp_path, "trainer", [{"event": "announce", "window": 9, "update": UPDATE.hex()}])
    validator = _node(tmp_path, "validator", [])
    monkeypatch.setattr(demo, "_head_of", lambda node, window, wait_s=3.0: None)  # window 9 not certified yet
    reason = demo._audit_exposure(victim, [validator], _revision(), 10)
    assert "not certified yet" in reason


def test_a_kill_waits_until_every_validator_concluded_the_audit(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    victim = _node(tmp_path, "trainer", [{"event": "announce", "window": 9, "update": UPDATE.hex()}])
    author = victim.peer.to_text()
    done = _node(tmp_path, "validator-1", [{"event": "audit-passed", "author": author, "window": 9}])
    busy = _node(tmp_path, "validator-2", [])
    monkeypatch.setattr(demo, "_head_of", lambda node, window, wait_s=3.0: SimpleNamespace(id=b"h" * 34))
    assert "auditing its update of window 9" in demo._audit_exposure(victim, [done, busy], _revision(), 10)
    (busy.directory / "events.jsonl").write_text(json.dumps({"event": "audit-failed", "author": author,
                                                             "window": 9}) + "\n")
    assert demo._audit_exposure(victim, [done, busy], _revision(), 10) == ""


def test_a_trainer_with_nothing_announced_recently_may_be_killed(tmp_path: Path) -> None:
    victim = _node(tmp_path, "trainer", [{"event": "announce", "window": 3, "update": UPDATE.hex()}])
    assert demo._audit_exposure(victim, [_node(tmp_path, "validator", [])], _revision(), 10) == ""
    assert "announced its update of window 10" in demo._audit_exposure(
        _node(tmp_path, "t2", [{"event": "announce", "window": 10, "update": UPDATE.hex()}]),
        [_node(tmp_path, "v2", [])], _revision(), 10)
