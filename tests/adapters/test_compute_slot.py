"""`ComputeSlot`: a node's tasks share one compute slot, and sampled audits (background tasks) never hold up
the critical path's tasks waiting with them (spec/protocol.md §6.2, §6.3 "Scheduling"); with an audit worker
a running audit does not hold them up either."""

import threading
import time

import pytest
import trio

from peerloom.adapters.runtime import ComputeSlot


@pytest.mark.parametrize("audit_worker", [False, True])
def test_background_tasks_wait_for_every_waiting_foreground_task(audit_worker):
    order: list[str] = []
    running = threading.Semaphore(0)

    def work(name: str, seconds: float) -> str:
        running.release()
        time.sleep(seconds)
        order.append(name)
        return name

    async def main() -> list[tuple[float, str]]:
        slot = ComputeSlot(audit_worker=audit_worker)
        results: list[tuple[float, str]] = []

        async def submit(background: bool, name: str, seconds: float) -> None:
            results.append(await slot.run(background, work, name, seconds))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit, False, "screen-1", 0.2)
            await trio.to_thread.run_sync(running.acquire)  # screen-1 holds the slot
            nursery.start_soon(submit, True, "audit", 0.01)
            await trio.sleep(0.02)
            nursery.start_soon(submit, False, "screen-2", 0.01)  # arrives after the audit, runs before it
            await trio.sleep(0.02)
            nursery.start_soon(submit, False, "reduce", 0.01)
        return results

    results = trio.run(main)
    assert order == ["screen-1", "screen-2", "reduce", "audit"]
    assert sorted(name for _, name in results) == sorted(order)


def test_one_slot_runs_one_task_at_a_time_and_errors_propagate():
    active, peak = 0, 0
    lock = threading.Lock()

    def work(fail: bool) -> None:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.01)
        with lock:
            active -= 1
        if fail:
            raise ValueError("task failed")

    async def main() -> list[str]:
        slot = ComputeSlot()
        errors: list[str] = []

        async def submit(background: bool, fail: bool) -> None:
            try:
                await slot.run(background, work, fail)
            except ValueError as exc:
                errors.append(str(exc))

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(submit, i % 2 == 0, i == 3)
        return errors

    assert trio.run(main) == ["task failed"] and peak == 1


def test_with_an_audit_worker_a_running_audit_never_delays_a_screen():
    """The audit runs until the screen that arrived after it has finished: without its own worker the screen
    would wait for the audit, which waits for the screen (bounded by the timeout, so a failure is no hang)."""
    order: list[str] = []
    audit_started = threading.Semaphore(0)
    screened = threading.Event()

    def audit() -> bool:
        audit_started.release()
        saw_screen = screened.wait(timeout=10.0)
        order.append("audit")
        return saw_screen

    def screen() -> str:
        order.append("screen")
        screened.set()
        return "screen"

    async def main() -> tuple[bool, str]:
        slot = ComputeSlot(audit_worker=True)
        out: dict[str, object] = {}

        async def submit(background: bool, fn: object) -> None:
            out[fn.__name__] = (await slot.run(background, fn))[1]  # type: ignore[attr-defined]  # fn is a function

        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit, True, audit)
            await trio.to_thread.run_sync(audit_started.acquire)  # the audit is running
            nursery.start_soon(submit, False, screen)
        return out["audit"], out["screen"]  # type: ignore[return-value]  # both set above

    assert trio.run(main) == (True, "screen")
    assert order == ["screen", "audit"]


def test_with_an_audit_worker_each_lane_runs_one_task_at_a_time():
    """Foreground tasks never overlap each other, nor background tasks each other; errors propagate."""
    active = {False: 0, True: 0}
    peak = {False: 0, True: 0}
    lock = threading.Lock()

    def work(background: bool, fail: bool) -> None:
        with lock:
            active[background] += 1
            peak[background] = max(peak[background], active[background])
        time.sleep(0.01)
        with lock:
            active[background] -= 1
        if fail:
            raise ValueError("task failed")

    async def main() -> list[str]:
        slot = ComputeSlot(audit_worker=True)
        errors: list[str] = []

        async def submit(background: bool, fail: bool) -> None:
            try:
                await slot.run(background, work, background, fail)
            except ValueError as exc:
                errors.append(str(exc))

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(submit, i % 2 == 0, i == 3)
                await trio.sleep(0.005)
        return errors

    assert trio.run(main) == ["task failed"] and peak == {False: 1, True: 1}
