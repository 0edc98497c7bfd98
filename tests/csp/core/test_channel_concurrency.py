"""Channels under concurrency: atomicity under cancellation and timeouts, ordered fan-in, and a
property test with many producers and consumers (threads and anyio tasks) and random
cancellations: no item is ever lost or duplicated.
"""

from __future__ import annotations

import asyncio
import random
import threading

import anyio
import anyio.lowlevel
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import csp
from tests.helpers import joined, start, wait_until

pytestmark = pytest.mark.timeout(30)




class Result:
    """Holds what a thread raised."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def run(self, fn, *args) -> threading.Thread:
        def target():
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - the test inspects it
                self.error = e

        return start(target)


async def wait_async(pred) -> None:
    """Yield to the loop until ``pred`` holds (bounded)."""
    with anyio.fail_after(5):
        while not pred():
            await anyio.lowlevel.checkpoint()


# ---- cancellation atomicity -----------------------------------------------------------------------
def test_cancelled_areceive_leaves_no_waiter_and_loses_nothing():
    send, recv = csp.channel(int, capacity=1)

    async def main():
        with anyio.CancelScope() as scope:
            async def cancel_when_parked():
                await wait_async(lambda: recv.waiting)
                scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_when_parked)
                await recv.areceive()
        assert scope.cancelled_caught
        assert recv.statistics().waiting_receivers == 0 and not recv.waiting
        send.send_nowait(1)
        assert await recv.areceive() == 1

    anyio.run(main)


def test_receiver_woken_then_cancelled_passes_the_item_on():
    """Invariant: a receiver woken for an item but cancelled before taking it must not strand the
    item while another receiver waits (the wake-up is passed on).

    Uses asyncio tasks directly: ``Task.cancel()`` lands even when the awaited future has just been
    resolved, which is the race being tested (anyio's scopes would wait for the next await).
    """
    send, recv = csp.channel(int, capacity=1)
    recv2 = recv.clone()

    async def main():
        first = asyncio.ensure_future(recv.areceive())
        await wait_async(lambda: recv.waiting)
        second = asyncio.ensure_future(recv2.areceive())
        await wait_async(lambda: recv2.waiting)
        send.send_nowait(42)  # wakes the first receiver (it waited longest)...
        first.cancel()  # ...which is cancelled before it runs again
        with anyio.fail_after(5):
            assert await second == 42
        with pytest.raises(asyncio.CancelledError):
            await first

    anyio.run(main)
    assert recv.statistics().items_moved == 1


def test_cancelled_asend_on_full_channel_keeps_the_item_out():
    send, recv = csp.channel(int, capacity=1)

    async def main():
        await send.asend(1)
        with anyio.move_on_after(0.01) as scope:
            await send.asend(2)
        assert scope.cancelled_caught
        assert recv.statistics().waiting_senders == 0
        assert send.items == 1
        send.close()
        assert [x async for x in recv] == [1]

    anyio.run(main)


def test_cancelled_rendezvous_asend_takes_its_item_back():
    send, recv = csp.channel(int, capacity=0)

    async def main():
        with anyio.move_on_after(0.01) as scope:
            await send.asend(1)
        assert scope.cancelled_caught
        with pytest.raises(csp.WouldBlock):
            recv.receive_nowait()

    anyio.run(main)


def test_asend_cancelled_after_its_offer_was_taken_delivers_exactly_once():
    """If the offer was taken before the cancellation lands, the item was delivered once (the
    cancellation still propagates, as with anyio memory streams)."""
    send, recv = csp.channel(int, capacity=0)
    got = []

    async def main():
        scope = anyio.CancelScope()

        async def sender():
            with scope:
                await send.asend(7)

        async with anyio.create_task_group() as tg:
            tg.start_soon(sender)
            await wait_async(lambda: send.waiting)
            got.append(recv.receive_nowait())  # takes the offer and wakes the sender...
            scope.cancel()  # ...which is cancelled before it runs again
        with pytest.raises(csp.WouldBlock):
            recv.receive_nowait()

    anyio.run(main)
    assert got == [7]


def test_rendezvous_polling_ends_meet_only_parked_peers():
    """Invariant the property test's harness relies on: on a rendezvous a timeout-0 send or
    receive never parks, so it hands off only to a parked peer. Two polling ends never meet (a
    retry loop of them livelocks by design); a polling end meets a parked one at once, a thread
    receiver taking a parked task's offer included."""
    send, recv = csp.channel(int, capacity=0)
    with pytest.raises(TimeoutError):
        send.send(1, timeout=0)
    with pytest.raises(TimeoutError):
        recv.receive(timeout=0)
    stats = recv.statistics()
    assert (stats.waiting_senders, stats.waiting_receivers, stats.items_moved) == (0, 0, 0)

    res, got = Result(), []
    t = res.run(lambda: got.append(recv.receive()))
    wait_until(lambda: recv.waiting)
    send.send(1, timeout=0)  # meets the parked thread receiver
    joined(t)
    assert res.error is None

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(send.asend, 2)
            await wait_async(lambda: send.waiting)
            got.append(await anyio.to_thread.run_sync(recv.receive, 0))  # takes the task's offer

    anyio.run(main)
    assert got == [1, 2]
    stats = recv.statistics()
    assert (stats.waiting_senders, stats.waiting_receivers, stats.items_moved) == (0, 0, 2)


def test_rendezvous_task_senders_to_a_polling_thread_receiver_lose_and_duplicate_nothing():
    """Task senders parked on a rendezvous, a thread receiver polling with timeout 0 (it never
    parks, so every item goes by a taken offer and a cross-thread wake-up): each item arrives once,
    every sender finishes, nobody is left parked."""
    n = 400
    send, recv = csp.channel(int, capacity=0)
    sends = [send.clone() for _ in range(2)]
    send.close()
    got: list[int] = []

    def consume() -> None:
        while True:
            try:
                got.append(recv.receive(timeout=0))
            except TimeoutError:
                continue
            except csp.EndOfStream:
                return

    async def produce(k: int, s: csp.Sender) -> None:
        async with s:
            for i in range(k, n, 2):
                await s.asend(i)

    async def main():
        t = start(consume)
        async with anyio.create_task_group() as tg:
            for k, s in enumerate(sends):
                tg.start_soon(produce, k, s)
        await anyio.to_thread.run_sync(joined, t)

    anyio.run(main)
    assert sorted(got) == list(range(n))
    stats = recv.statistics()
    assert (stats.items_moved, stats.waiting_senders, stats.waiting_receivers) == (n, 0, 0)


def test_timeouts_and_cancellations_racing_deliveries_lose_and_duplicate_nothing():
    """Thread senders with tiny timeouts (retrying on TimeoutError) against async receivers with
    tiny cancel deadlines (retrying when cancelled): every item arrives exactly once."""
    n = 600
    send, recv = csp.channel(int, capacity=0)
    sends = [send.clone() for _ in range(2)]
    send.close()
    got: list[int] = []

    def produce(k: int, s: csp.Sender) -> None:
        rng = random.Random(k)
        with s:
            for i in range(k, n, 2):
                while True:
                    try:
                        s.send(i, timeout=rng.choice([0, 1e-5, 1e-4, 1e-3]))
                        break
                    except TimeoutError:
                        continue

    async def consume(r: csp.Receiver, seed: int) -> None:
        rng = random.Random(seed)
        while True:
            with anyio.move_on_after(rng.choice([0, 1e-5, 1e-4, 1e-3])):
                try:
                    got.append(await r.areceive())
                except csp.EndOfStream:
                    return

    async def main():
        threads = [start(produce, k, s) for k, s in enumerate(sends)]
        async with anyio.create_task_group() as tg:
            for seed in range(3):
                tg.start_soon(consume, recv.clone(), seed)
            recv.close()
        for t in threads:
            await anyio.to_thread.run_sync(joined, t)

    anyio.run(main)
    assert sorted(got) == list(range(n))


# ---- ordered fan-in -----------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [0, 1, 3])
def test_ordered_fan_in_restores_sequence_order_within_the_bound(capacity):
    send, recv = csp.channel(int, capacity=capacity, ordered=True)
    producers = 3
    sends = [send.clone() for _ in range(producers)]
    send.close()

    def produce(k: int, s: csp.Sender) -> None:
        with s:
            for i in range(k, 900, producers):
                s.send(i, seq=i)

    threads = [start(produce, k, s) for k, s in enumerate(sends)]
    assert list(recv) == list(range(900))
    for t in threads:
        joined(t)
    assert recv.statistics().peak_fill <= max(capacity, 1)


def test_ordered_fan_in_from_tasks_to_a_thread():
    send, recv = csp.channel(int, capacity=2, ordered=True)
    got: list[int] = []

    async def main():
        t = start(lambda: got.extend(recv))

        async def produce(k: int, s: csp.Sender) -> None:
            async with s:
                for i in range(k, 200, 2):
                    await s.asend(i * 10, seq=i)

        async with anyio.create_task_group() as tg:
            for k in range(2):
                tg.start_soon(produce, k, send.clone())
            send.close()
        await anyio.to_thread.run_sync(joined, t)

    anyio.run(main)
    assert got == [i * 10 for i in range(200)]


def test_ordered_item_beyond_the_window_blocks_until_it_fits():
    send, recv = csp.channel(str, capacity=2, ordered=True)
    send.send_nowait("b", seq=1)
    with pytest.raises(csp.WouldBlock):
        send.send_nowait("c", seq=2)  # next expected is 0, window is 2
    with pytest.raises(csp.WouldBlock):
        recv.receive_nowait()  # seq 0 has not arrived: nothing is deliverable
    res = Result()
    s2 = send.clone()
    t = res.run(s2.send, "c", None, 2)
    wait_until(lambda: s2.waiting)
    send.send("a", seq=0)
    assert [recv.receive(), recv.receive()] == ["a", "b"]
    joined(t)
    assert res.error is None and recv.receive() == "c"


def test_ordered_seq_errors_name_the_fix():
    send, recv = csp.channel(int, capacity=2, ordered=True, name="feat")
    for bad in (None, True, 1.0):
        with pytest.raises(ValueError, match="channel 'feat' is ordered: pass seq"):
            send.send(1, seq=bad)
    send.send(0, seq=1)
    with pytest.raises(ValueError, match="seq 1 was already sent"):
        send.send(0, seq=1)
    send.send(0, seq=0)
    recv.receive()
    with pytest.raises(ValueError, match="already sent"):
        send.send(0, seq=0)


def test_unordered_channel_ignores_seq():
    send, recv = csp.channel(int, capacity=2)
    send.send(1, seq=5)
    send.send(2, seq=5)
    assert [recv.receive(), recv.receive()] == [1, 2]


def test_ordered_gap_is_skipped_once_no_open_sender_can_fill_it():
    """A producer that stops early leaves a gap; delivery continues in seq order once every
    remaining send end is closed or blocked (nobody could ever send the missing seq)."""
    send, recv = csp.channel(int, capacity=1, ordered=True)  # window 1
    a, b = send, send.clone()
    a.send(0, seq=0)
    a.close()  # a stops early: seq 2 will never come
    res = Result()
    t = res.run(lambda: [b.send(seq, seq=seq) for seq in (1, 3)])
    assert [recv.receive(timeout=5), recv.receive(timeout=5)] == [0, 1]
    # b now blocks with seq 3 (beyond the window) and a is closed: skip the gap at 2.
    assert recv.receive(timeout=5) == 3
    joined(t)
    assert res.error is None
    b.close()
    with pytest.raises(csp.EndOfStream):
        recv.receive(timeout=5)

    # An idle open sender could still send the missing seq: no skip until it closes.
    send, recv = csp.channel(int, capacity=4, ordered=True)
    send.send(1, seq=1)
    with pytest.raises(csp.WouldBlock):
        recv.receive_nowait()

    send, recv = csp.channel(int, capacity=4, ordered=True)
    for seq in (0, 2, 3):
        send.send(seq, seq=seq)
    send.close()
    assert list(recv) == [0, 2, 3]


# ---- property: no loss, no duplication ----------------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Rendezvous, a polling (timeout 0) thread producer, and one polling thread consumer: livelocked
# until the harness gave such a run a consumer that parks (see the rule below).
@example(capacity=0, thread_producers=1, task_producers=2, thread_consumers=1, task_consumers=0,
         per_producer=2, seed=824)
@given(
    capacity=st.integers(0, 4),
    thread_producers=st.integers(0, 2),
    task_producers=st.integers(0, 2),
    thread_consumers=st.integers(0, 2),
    task_consumers=st.integers(0, 2),
    per_producer=st.integers(0, 40),
    seed=st.integers(0, 2**16),
)
def test_many_producers_and_consumers_lose_and_duplicate_nothing(
    capacity, thread_producers, task_producers, thread_consumers, task_consumers, per_producer, seed
):
    producers = thread_producers + task_producers
    consumers = thread_consumers + task_consumers
    if producers == 0 or consumers == 0:
        producers, thread_producers = producers + 1, thread_producers + 1
        consumers, task_consumers = consumers + 1, task_consumers + 1
    send, recv = csp.channel(int, capacity=capacity)
    sends = [send.clone() for _ in range(producers)]
    recvs = [recv.clone() for _ in range(consumers)]
    send.close()
    recv.close()
    got: list[list[int]] = [[] for _ in range(consumers)]
    rng = random.Random(seed)
    # Per participant: None (no timeout), or a timeout / cancel deadline in seconds. 0 only for
    # threads (a 0 deadline would cancel a task's every receive before it could take anything).
    timeouts = [rng.choice([None, 0, 1e-4, 1e-3]) for _ in range(producers + consumers)]
    for k in range(task_consumers):
        timeouts[producers + k] = timeouts[producers + k] or None
    # On a rendezvous a timeout-0 send is send_nowait: it only meets a parked receiver, and a
    # timeout-0 receive never parks. If some thread producer polls and every consumer polls (only
    # threads can), that producer can never hand its item off and the run livelocks by design, not
    # by a channel bug. Let one consumer park (see test_rendezvous_polling_ends_meet_only_parked_peers).
    consumer_timeouts = timeouts[producers:]
    if capacity == 0 and 0 in timeouts[:thread_producers] and set(consumer_timeouts) == {0}:
        timeouts[producers] = None

    def thread_produce(k: int) -> None:
        with sends[k]:
            for i in range(k * per_producer, (k + 1) * per_producer):
                while True:
                    try:
                        sends[k].send(i, timeout=timeouts[k])
                        break
                    except TimeoutError:
                        continue  # the item was not sent: send it again

    def thread_consume(k: int) -> None:
        while True:
            try:
                got[k].append(recvs[k].receive(timeout=timeouts[producers + k]))
            except TimeoutError:
                continue
            except csp.EndOfStream:
                return

    async def task_produce(k: int) -> None:
        async with sends[k]:
            for i in range(k * per_producer, (k + 1) * per_producer):
                await sends[k].asend(i)

    async def task_consume(k: int) -> None:
        deadline = timeouts[producers + k]
        while True:
            # Cancel some receives at random; a cancelled receive never takes an item.
            with anyio.move_on_after(deadline if deadline is not None else float("inf")):
                try:
                    got[k].append(await recvs[k].areceive())
                except csp.EndOfStream:
                    return

    async def main():
        threads = [start(thread_produce, k) for k in range(thread_producers)]
        threads += [start(thread_consume, task_consumers + k) for k in range(thread_consumers)]
        async with anyio.create_task_group() as tg:
            for k in range(thread_producers, producers):
                tg.start_soon(task_produce, k)
            for k in range(task_consumers):
                tg.start_soon(task_consume, k)
        for t in threads:
            await anyio.to_thread.run_sync(joined, t)

    anyio.run(main)
    assert sorted(x for g in got for x in g) == list(range(producers * per_producer))
    stats = sends[0].statistics()
    assert stats.items_moved == producers * per_producer
    assert (stats.waiting_senders, stats.waiting_receivers, stats.current_fill) == (0, 0, 0)


def test_threads_only_high_contention():
    """Four thread producers and four thread consumers on a capacity-1 channel."""
    send, recv = csp.channel(int, capacity=1)
    sends = [send.clone() for _ in range(4)]
    recvs = [recv.clone() for _ in range(4)]
    send.close()
    recv.close()
    got: list[list[int]] = [[] for _ in range(4)]
    consumers = [start(lambda k=k: got[k].extend(recvs[k])) for k in range(4)]

    def produce(k: int) -> None:
        with sends[k]:
            for i in range(k, 2000, 4):
                sends[k].send(i)

    producers = [start(produce, k) for k in range(4)]
    for t in producers + consumers:
        joined(t)
    assert sorted(x for g in got for x in g) == list(range(2000))
