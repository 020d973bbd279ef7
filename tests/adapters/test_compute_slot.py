"""`ComputeSlot`: a node's tasks share one compute slot, and sampled audits (background tasks) never hold up
the critical path's tasks waiting with them (spec/protocol.md §6.2)."""

import threading
import time

import trio

from peerloom.adapters.runtime import ComputeSlot


def test_background_tasks_wait_for_every_waiting_foreground_task():
    order: list[str] = []
    running = threading.Semaphore(0)

    def work(name: str, seconds: float) -> str:
        running.release()
        time.sleep(seconds)
        order.append(name)
        return name

    async def main() -> list[tuple[float, str]]:
        slot = ComputeSlot()
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
