"""The node runtime as a host of its engine (spec/design.md §2, §6): bans, rejections and a light peer's submit
verdict arrive as typed effects (`Ban`, `Rejected`, `SubmitReply`) and the runtime carries them out; a
connection that ends by our own bug is not charged to the peer (spec/transport.md §6)."""

from __future__ import annotations

import trio

from peerloom.adapters.runtime import OTHER_PEERS, NodeRuntime, RuntimeOptions, _Submit
from peerloom.adapters.storage import ArtifactStore
from peerloom.adapters.transport import TransportError
from peerloom.core import effects as fx
from peerloom.core.objects import JoinRequest, make_artifact_ref, seal
from peerloom.core.tasks import TrainTask
from tests.helpers import ident, make_revision

VALIDATOR = ident(1)
GENESIS = b"genesis params"


class _NoCompute:
    def run(self, task):  # pragma: no cover - a test that reaches it is broken
        raise AssertionError(f"unexpected compute task {task}")


def validator_runtime(tmp_path, trainers=()) -> NodeRuntime:
    store = ArtifactStore(tmp_path / "store")
    store.put(GENESIS)
    return NodeRuntime(name="v", identity=VALIDATOR, revision=make_revision(genesis=GENESIS, trainers=trainers),
                       roles={"validator"}, store=store, options=RuntimeOptions(),
                       executor=_NoCompute())  # type: ignore[arg-type]  # a stand-in: no task may run


def errors_counted(runtime: NodeRuntime, reason: str) -> float:
    return runtime.metrics.registry.get_sample_value("peerloom_connection_errors_total", {"reason": reason}) or 0.0


def test_an_internal_error_is_logged_and_counted_but_never_charged_to_the_peer(tmp_path):
    runtime = validator_runtime(tmp_path)
    honest, faulty = ident(20).peer_id, ident(21).peer_id

    async def main():
        for _ in range(runtime.book.ban_after_failures + 1):
            runtime._connection_failed(honest, RuntimeError("a bug of ours"))
            runtime._connection_failed(faulty, TransportError("bad-frame", "garbage"))
        now = trio.current_time()
        return runtime.book.is_banned(honest, now=now), runtime.book.is_banned(faulty, now=now)

    try:
        assert trio.run(main) == (False, True)  # the same count of peer faults does ban
        assert errors_counted(runtime, "internal") == runtime.book.ban_after_failures + 1
    finally:
        runtime.close()


def test_ban_effect_bans_the_peer_in_the_address_book_until_it_ends(tmp_path):
    runtime = validator_runtime(tmp_path)
    peer = ident(22).peer_id

    async def main():
        now = trio.current_time()
        runtime.ban(peer, now + 30.0)
        return [runtime.book.is_banned(peer, now=now + dt) for dt in (0.0, 29.0, 31.0)]

    try:
        assert trio.run(main) == [True, True, False]
    finally:
        runtime.close()


def test_submit_gets_the_engines_typed_verdict(tmp_path):
    """A light peer's envelope goes to the engine as `Submit`; the reply is the engine's `SubmitReply`, and the
    rejection it carries is the one the engine charged (the same reason reaches the peer's reputation)."""
    runtime = validator_runtime(tmp_path)
    revision = runtime.engine.revision
    good = seal(ident(30), JoinRequest(revision=revision.id, window=1, capacity=1))
    stale = seal(ident(31), JoinRequest(revision=b"\x12\x20" + bytes(32), window=1, capacity=1))

    async def main():
        async with trio.open_nursery() as nursery:
            runtime._nursery = nursery
            runtime.driver.start()
            items = [_Submit(request_id=n, envelope=env, artifact=None) for n, env in ((1, good), (2, stale))]
            for item in items:
                runtime._submit(item)  # fed through the driver, which executes the effects
            nursery.cancel_scope.cancel()
        return items

    try:
        accepted, refused = trio.run(main)
        assert accepted.done.is_set() and accepted.result.accepted and accepted.result.reason == ""
        assert refused.done.is_set() and not refused.result.accepted and refused.result.reason
        assert runtime.engine.rejected_by_reason[refused.result.reason] == 1
        # ident(31) is no validator and not in the roster: its rejections count under the row every peer not
        # admitted shares (spec/transport.md §14)
        assert runtime._reputation == {(OTHER_PEERS, refused.result.reason): 1}
        assert runtime._submits == {}  # nothing left waiting
    finally:
        runtime.close()


def test_rejections_of_admitted_peers_and_the_last_failed_task_reach_the_edge(tmp_path):
    """What the dashboard shows: per admitted peer, how many of its inputs were rejected and the last reason
    with its detail; a stranger gets no row (its rejections share one reputation row, spec/transport.md
    §14); the node's last failed task as one line."""
    trainer = ident(40)
    runtime = validator_runtime(tmp_path, trainers=(trainer,))
    try:
        runtime.rejected(trainer.peer_id, "screen-loss", "loss 2 applied")
        runtime.rejected(trainer.peer_id, "screen-norm-outlier", "norm 31 > 10 x\nmedian 2.9")
        runtime.rejected(ident(41).peer_id, "bad-signature", "")
        assert runtime._rejections == {trainer.peer_id: (2, "screen-norm-outlier (norm 31 > 10 x median 2.9)")}
        assert runtime.edge_view.last_error() == ""

        class Failing:
            def run_timed(self, task):
                raise ValueError("sample\n17")

        runtime.executor = Failing()  # type: ignore[assignment]  # a stand-in whose every task fails

        async def main():
            task = TrainTask(params=make_artifact_ref(b"p", 4), shards=(0,), seed=1)
            await runtime._run_task(fx.RunTask(task_id="train-12", task=task), lambda outcome: None)

        trio.run(main)
        assert runtime.edge_view.last_error() == "train task failed: ValueError('sample\\n17')"
    finally:
        runtime.close()


def test_a_claim_is_written_after_its_artifacts_are_fsynced_off_the_loop_and_records_keep_their_order(tmp_path):
    """A trainer stores its delta without fsync and goes on training (spec/protocol.md §5.2): the claim that
    names it is written only once the delta is durable (fsynced on a worker thread), and a record that comes
    after the claim waits behind it, so `Persisted` reaches the engine in order."""
    from peerloom.core.records import ClaimRecord, LockRecord

    runtime = validator_runtime(tmp_path)
    delta = runtime.store.put_parts([b"a delta" * 11], durable=False)
    vref = runtime.store.path_of(delta.digest).with_suffix(".vref")
    fed: list[str] = []

    def done(name: str) -> None:
        # the claim's artifact is durable whenever a record is reported written
        assert not vref.exists() and runtime.store.path_of(delta.digest).with_suffix(".ref").exists()
        fed.append(name)

    async def main():
        async with trio.open_nursery() as nursery:
            runtime._nursery = nursery
            runtime.write_record(ClaimRecord(window=3, data=b"claim", artifacts=(delta.digest,)),
                                 lambda: done("claim"))
            runtime.write_record(LockRecord(window=3, data=b"lock"), lambda: done("lock"))
            assert fed == [] and vref.exists()  # nothing written on the loop yet, not even the lock behind it
            item = await runtime._events.get()  # the fsync's completion, for the main loop
            item.done()
            assert fed == ["claim", "lock"]
            runtime.write_record(LockRecord(window=4, data=b"lock"), lambda: fed.append("at once"))
            assert fed[-1] == "at once"  # nothing waits: written on the loop, as before
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        records = runtime.store.records()
        assert records["claim/3"] == b"claim" and records["lock/3"] == b"lock"
    finally:
        runtime.close()
