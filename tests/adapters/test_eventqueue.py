"""The runtime's event queue (spec/transport.md §14, "Strangers wait"): admitted peers' and the node's own
events before strangers', each queue in arrival order, and a waiting reader woken by either."""

from __future__ import annotations

import trio
from hypothesis import given
from hypothesis import strategies as st

from peerloom.adapters.eventqueue import EventQueue


@given(st.lists(st.tuples(st.booleans(), st.integers()), max_size=40))
def test_urgent_items_come_first_and_each_queue_keeps_its_order(items):
    async def main():
        queue: EventQueue[int] = EventQueue()
        for stranger, value in items:
            queue.put(value, stranger=stranger)
        assert queue.waiting == (sum(not s for s, _ in items), sum(s for s, _ in items))
        return [await queue.get() for _ in items]

    got = trio.run(main)
    assert got == [v for s, v in items if not s] + [v for s, v in items if s]


def test_a_flood_of_stranger_events_does_not_delay_an_admitted_peers_message():
    """The case the queue exists for: 10,000 strangers' events are waiting when an admitted peer's message
    arrives; the next `get` returns it."""
    async def main():
        queue: EventQueue[str] = EventQueue()
        for n in range(10_000):
            queue.put(f"stranger-{n}", stranger=True)
        queue.put("announcement")
        first = await queue.get()
        return first, sum(queue.waiting)

    assert trio.run(main) == ("announcement", 10_000)


def test_get_waits_for_an_item_from_either_queue_and_is_cancellable():
    async def main():
        queue: EventQueue[str] = EventQueue()
        got = []

        async def reader():
            got.append(await queue.get())
            got.append(await queue.get())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.sleep(0.01)
            assert got == []  # nothing yet: it waits
            queue.put("late stranger", stranger=True)
            await trio.sleep(0.01)
            queue.put("own task result")
        with trio.move_on_after(0.05) as cancelled:
            await queue.get()
        return got, cancelled.cancelled_caught

    assert trio.run(main) == (["late stranger", "own task result"], True)
