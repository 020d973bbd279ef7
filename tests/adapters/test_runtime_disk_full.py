"""The node runtime on a full disk (spec/transport.md §15): one log line, the ``disk-full`` health
state, records held in order with the engine's `Persisted` only after they are written, uploads refused,
and everything written once space is back. The disk is "filled" with the test-only seam of adapters/disk.py."""

from __future__ import annotations

import functools
import logging

import trio

from peerloom.adapters import disk
from peerloom.adapters.runtime import _Submit
from peerloom.core.objects import JoinRequest, seal
from peerloom.core.records import LockRecord
from tests.adapters.test_host_runtime import validator_runtime
from tests.helpers import ident


def test_records_wait_on_a_full_disk_and_are_written_in_order_when_space_is_back(tmp_path, monkeypatch, caplog):
    flag = tmp_path / "full.flag"
    monkeypatch.setenv(disk.TEST_FAULT_ENV, str(flag))
    runtime = validator_runtime(tmp_path)
    fed: list[int] = []

    async def main():
        async with trio.open_nursery() as nursery:
            runtime._nursery = nursery
            flag.touch()
            with caplog.at_level(logging.ERROR, logger="peerloom.runtime"):
                for token, window in enumerate((901, 902, 903)):
                    record = LockRecord(window=window, data=f"lock/{window}".encode())
                    runtime.write_record(record, functools.partial(fed.append, token))
            assert runtime.disk_full and runtime.edge_view.health() == "disk-full" and fed == []
            assert runtime.metrics.registry.get_sample_value("peerloom_disk_full") == 1
            upload = _Submit(request_id=1, envelope=seal(ident(40), JoinRequest(revision=b"\x12\x20" + bytes(32),
                                                                                window=1, capacity=1)),
                             artifact=b"an update")
            runtime._submit(upload)
            assert upload.done.is_set() and upload.result.reason == "disk-full"  # uploads refused at once
            assert len([r for r in caplog.records if r.getMessage().startswith("disk full")]) == 1  # one line
            runtime._resume_writes()  # the flag is still there: back to the state, nothing lost
            assert runtime.disk_full and fed == []
            flag.unlink()
            runtime._resume_writes()
            assert not runtime.disk_full and runtime.edge_view.health() == "ok"
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        assert fed == [0, 1, 2]  # every record, in order, and only once written
        assert {k: v for k, v in runtime.store.records().items() if k.startswith("lock/90")} == \
            {"lock/901": b"lock/901", "lock/902": b"lock/902", "lock/903": b"lock/903"}
    finally:
        runtime.close()


def test_a_chunk_lost_to_a_full_disk_loses_its_fetch_and_charges_nobody(tmp_path, monkeypatch):
    from peerloom.core.objects import make_artifact_ref

    flag = tmp_path / "full.flag"
    monkeypatch.setenv(disk.TEST_FAULT_ENV, str(flag))
    runtime = validator_runtime(tmp_path)
    ref = make_artifact_ref(b"0123456789abcdef", 8)
    writer = runtime._store_writer

    async def main():
        async with trio.open_nursery() as nursery:
            runtime._nursery = nursery
            nursery.start_soon(writer.run)  # the chunk writes run on its thread (adapters/store_writer.py)
            runtime.write_chunk(ref, 0, b"01234567")
            await writer.drained()
            flag.touch()
            runtime.write_chunk(ref, 1, b"89abcdef")
            await writer.drained()
            flag.unlink()
            runtime.commit_artifact(ref, True, lambda ok: None)
            await writer.drained()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        # neither ArtifactStored (a hole) nor ArtifactCorrupt (a charge) waits for the engine
        assert runtime.disk_full and runtime._events.waiting == (0, 0)
        assert not runtime.store.has(ref.digest)
    finally:
        runtime.close()


def test_a_claim_whose_delta_cannot_be_fsynced_for_space_waits_with_the_records_behind_it(tmp_path, monkeypatch):
    """The fsync that makes a claim's delta durable (adapters/runtime.py `_sync_artifacts`) fails for space: the
    claim and the record after it wait, in order, and are written (the delta made durable first) once space
    is back; the engine hears `Persisted` only then."""
    import errno

    from peerloom.core.records import ClaimRecord

    runtime = validator_runtime(tmp_path)
    delta = runtime.store.put_parts([b"a delta" * 9], durable=False)
    real = runtime.store.make_durable
    full = [True]

    def make_durable(digest):
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(digest)

    monkeypatch.setattr(runtime.store, "make_durable", make_durable)
    fed: list[str] = []

    async def main():
        async with trio.open_nursery() as nursery:
            runtime._nursery = nursery
            runtime.write_record(ClaimRecord(window=5, data=b"claim", artifacts=(delta.digest,)),
                                 functools.partial(fed.append, "claim"))
            runtime.write_record(LockRecord(window=5, data=b"lock"), functools.partial(fed.append, "lock"))
            (await runtime._events.get()).done()  # the failed sync, back on the main loop
            assert runtime.disk_full and fed == []
            full[0] = False
            runtime._resume_writes()
            assert fed == ["claim", "lock"] and not runtime.disk_full
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        assert runtime.store.path_of(delta.digest).with_suffix(".ref").exists()
        assert runtime.store.records()["claim/5"] == b"claim"
    finally:
        runtime.close()
