"""Channel semantics: send/receive, drain, clone, close, every error, timeouts, rendezvous,
thread <-> async mixing, abort, statistics and per-end counters.

Cancellation atomicity, ordered fan-in and the property test live in test_channel_concurrency.py.
"""

from __future__ import annotations

import threading

import anyio
import msgspec
import pytest
import torch

import csp
from tests.helpers import joined, start, wait_until

pytestmark = pytest.mark.timeout(20)




class Result:
    """Holds what a thread returned or raised."""

    def __init__(self) -> None:
        self.value = None
        self.error: BaseException | None = None

    def run(self, fn, *args):
        def target():
            try:
                self.value = fn(*args)
            except BaseException as e:  # noqa: BLE001 - the test inspects it
                self.error = e

        return start(target)


# ---- construction -------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [None, -1, 1.5, True, "4"])
def test_capacity_is_required_and_validated(capacity):
    with pytest.raises(ValueError, match="capacity must be an int >= 0"):
        csp.channel(int, capacity=capacity)


def test_wrong_item_type_is_rejected_with_a_fix():
    send, recv = csp.channel(int, capacity=1, name="nums")
    with pytest.raises(TypeError, match="channel 'nums' carries int, got str"):
        send.send("x")
    with pytest.raises(TypeError):
        send.send_nowait("x")
    assert recv.statistics().current_fill == 0


def test_unparameterised_generic_and_object_types_are_not_checked():
    send, recv = csp.channel(list[int], capacity=2)
    send.send("anything")
    send2, _ = csp.channel(object, capacity=1)
    send2.send(object())
    assert recv.receive() == "anything"


# ---- basic flow, drain ----------------------------------------------------------------------------
def test_fifo_and_nowait():
    send, recv = csp.channel(int, capacity=3)
    for i in range(3):
        send.send_nowait(i)
    with pytest.raises(csp.WouldBlock):
        send.send_nowait(3)
    assert [recv.receive_nowait() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(csp.WouldBlock):
        recv.receive_nowait()


def test_drain_then_end_of_stream():
    """Closing the only sender keeps buffered items; EndOfStream only after they are drained."""
    send, recv = csp.channel(int, capacity=4)
    for i in range(4):
        send.send(i)
    send.close()
    assert recv.receive() == 0
    assert list(recv) == [1, 2, 3]
    with pytest.raises(csp.EndOfStream):
        recv.receive()
    with pytest.raises(csp.EndOfStream):
        recv.receive_nowait()


def test_blocked_receiver_gets_end_of_stream_when_last_sender_closes():
    send, recv = csp.channel(int, capacity=1)
    res = Result()
    t = res.run(recv.receive)
    wait_until(lambda: recv.waiting)
    send.close()
    joined(t)
    assert isinstance(res.error, csp.EndOfStream)


def test_blocking_send_waits_for_room():
    send, recv = csp.channel(int, capacity=1)
    send.send(1)
    res = Result()
    t = res.run(send.send, 2)
    wait_until(lambda: send.waiting)
    assert recv.statistics().waiting_senders == 1
    assert recv.receive() == 1
    joined(t)
    assert res.error is None
    assert recv.receive() == 2


# ---- clone ----------------------------------------------------------------------------------------
def test_fan_in_end_of_stream_only_after_every_clone_closes():
    send, recv = csp.channel(int, capacity=4)
    send2 = send.clone()
    send.send(1)
    send.close()
    send2.send(2)
    assert recv.receive() == 1 and recv.receive() == 2
    with pytest.raises(csp.WouldBlock):
        recv.receive_nowait()  # send2 still open: not end of stream
    assert recv.statistics().open_send_ends == 1
    send2.close()
    with pytest.raises(csp.EndOfStream):
        recv.receive_nowait()


def test_fan_out_delivers_each_item_to_exactly_one_receiver():
    send, recv = csp.channel(int, capacity=8)
    recvs = [recv, recv.clone(), recv.clone()]
    got: list[list[int]] = [[] for _ in recvs]
    threads = [start(lambda r=r, g=g: g.extend(r)) for r, g in zip(recvs, got)]
    for i in range(300):
        send.send(i)
    send.close()
    for t in threads:
        joined(t)
    assert sorted(x for g in got for x in g) == list(range(300))


def test_closing_one_receive_clone_keeps_the_channel_open():
    send, recv = csp.channel(int, capacity=2)
    recv2 = recv.clone()
    recv.close()
    send.send(5)
    assert recv2.receive() == 5
    assert recv2.statistics().open_receive_ends == 1


# ---- close and errors -----------------------------------------------------------------------------
def test_using_a_closed_end_raises_channel_closed():
    send, recv = csp.channel(int, capacity=1)
    send.close()
    send.close()  # idempotent
    recv.close()
    for op in (lambda: send.send(1), lambda: send.send_nowait(1), send.clone):
        with pytest.raises(csp.ChannelClosed, match="end is closed"):
            op()
    for op in (recv.receive, recv.receive_nowait, recv.clone):
        with pytest.raises(csp.ChannelClosed):
            op()
    with pytest.raises(csp.ChannelClosed):
        anyio.run(send.asend, 1)
    with pytest.raises(csp.ChannelClosed):
        anyio.run(recv.areceive)


def test_context_managers_close_the_end():
    send, recv = csp.channel(int, capacity=1)
    with send:
        send.send(1)
    assert send.closed and recv.statistics().open_send_ends == 0

    async def main():
        async with recv:
            assert await recv.areceive() == 1

    anyio.run(main)
    assert recv.closed


def test_peer_gone_when_every_receiver_is_closed():
    send, recv = csp.channel(int, capacity=2)
    send.send(1)
    recv.close()
    assert recv.statistics().current_fill == 0  # undeliverable items are dropped
    with pytest.raises(csp.PeerGone, match="every receive end is closed"):
        send.send(2)
    with pytest.raises(csp.PeerGone):
        send.send_nowait(2)


def test_blocked_sender_gets_peer_gone_when_last_receiver_closes():
    send, recv = csp.channel(int, capacity=0)
    res = Result()
    t = res.run(send.send, 1)
    wait_until(lambda: send.waiting)
    recv.close()
    joined(t)
    assert isinstance(res.error, csp.PeerGone)


def test_closing_an_end_wakes_its_own_blocked_call():
    send, recv = csp.channel(int, capacity=1)
    res = Result()
    t = res.run(recv.receive)
    wait_until(lambda: recv.waiting)
    recv.close()
    joined(t)
    assert isinstance(res.error, csp.ChannelClosed)

    send, recv = csp.channel(int, capacity=0)
    res = Result()
    t = res.run(send.send, 7)
    wait_until(lambda: send.waiting)
    send.close()
    joined(t)
    assert isinstance(res.error, csp.ChannelClosed)
    with pytest.raises(csp.EndOfStream):  # the withdrawn offer is not delivered
        recv.receive_nowait()


def test_error_family():
    for err in (csp.ChannelClosed, csp.PeerGone, csp.EndOfStream, csp.WouldBlock, csp.ChannelAborted):
        assert issubclass(err, csp.ChannelError) and issubclass(err, csp.CspError)
    assert len({csp.ChannelClosed, csp.PeerGone, csp.EndOfStream, csp.WouldBlock}) == 4


# ---- abort ----------------------------------------------------------------------------------------
def test_abort_wakes_blocked_threads_and_tasks_and_fails_later_ops():
    send, recv = csp.channel(int, capacity=0, name="c")
    send_b = send.clone()
    recv_b = recv.clone()
    r_thread, s_thread = Result(), Result()
    # rendezvous: the blocked receiver and the blocked sender would meet; use capacity 0 and keep
    # the sender on another channel's receiver instead, so both stay blocked.
    other_send, other_recv = csp.channel(int, capacity=0)
    t1 = r_thread.run(other_recv.receive)
    t2 = s_thread.run(send_b.send, 1)
    wait_until(lambda: other_recv.waiting and send_b.waiting)
    task_errors: list[BaseException] = []

    async def main():
        async def blocked_receive():
            try:
                await other_recv.clone().areceive()
            except csp.ChannelAborted as e:
                task_errors.append(e)

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked_receive)
            await anyio.to_thread.run_sync(wait_until, lambda: other_recv.statistics().waiting_receivers == 2)
            other_send.abort("target[1] failed")
            # ...and the sender blocked on `send` is still blocked: abort `send` from its receive end
            recv_b.abort("target[1] failed")

    anyio.run(main)
    joined(t1)
    joined(t2)
    assert isinstance(r_thread.error, csp.ChannelAborted) and r_thread.error.reason == "target[1] failed"
    assert isinstance(s_thread.error, csp.ChannelAborted)
    assert len(task_errors) == 1 and "was aborted: target[1] failed" in str(task_errors[0])
    for op in (lambda: send.send(1), recv.receive, recv.receive_nowait, send.clone):
        with pytest.raises(csp.ChannelAborted):
            op()
    send.abort("second reason")  # idempotent; the first reason stays
    with pytest.raises(csp.ChannelAborted, match="target"):
        recv.receive()


def test_abort_drops_buffered_items():
    send, recv = csp.channel(int, capacity=3)
    send.send(1)
    send.abort("stop")
    assert recv.statistics().current_fill == 0
    with pytest.raises(csp.ChannelAborted):
        recv.receive_nowait()


# ---- custom ends (the hook csp.distributed builds on) --------------------------------------------------
def test_channel_state_carries_custom_ends():
    from csp.core.channel import channel_state

    class Tagged(csp.Sender):
        __slots__ = ()

        def send(self, item, timeout=None, seq=None):
            self.state.check(item)  # the declared type is checked before wrapping
            super().send(("tag", item), timeout, seq)

    state = channel_state(object, 1, "hook")
    send, recv = Tagged(state), csp.Receiver(state)
    typed = channel_state(int, 1, "typed")
    with pytest.raises(TypeError, match="channel 'typed' carries int, got str"):
        typed.check("x")
    send.send(1)
    assert recv.receive() == ("tag", 1)
    state.open_end(send)
    assert state.statistics().open_send_ends == 2 and state.statistics().items_moved == 1
    blocked = Result()
    t = blocked.run(recv.receive)
    wait_until(lambda: recv.waiting)
    state.abort("done")  # wakes the blocked receive itself
    joined(t)
    assert isinstance(blocked.error, csp.ChannelAborted)
    with pytest.raises(csp.ChannelAborted, match="done"):
        send.send(2)
    with pytest.raises(csp.ChannelAborted):
        state.open_end(send)


# ---- timeouts ---------------------------------------------------------------------------------------
def test_send_and_receive_timeouts():
    send, recv = csp.channel(int, capacity=1)
    with pytest.raises(TimeoutError, match="receive timed out"):
        recv.receive(timeout=0.02)
    with pytest.raises(TimeoutError):
        recv.receive(timeout=0)
    send.send(1)
    with pytest.raises(TimeoutError, match="send timed out"):
        send.send(2, timeout=0.02)
    with pytest.raises(TimeoutError):
        send.send(2, timeout=0)
    stats = recv.statistics()
    assert stats.current_fill == 1 and stats.waiting_senders == 0 and stats.waiting_receivers == 0
    assert recv.receive(timeout=1) == 1  # the timed-out item was not sent
    with pytest.raises(csp.WouldBlock):
        recv.receive_nowait()
    assert send.blocked_s >= 0.015 and recv.blocked_s >= 0.015


def test_rendezvous_send_timeout_takes_the_item_back():
    send, recv = csp.channel(int, capacity=0)
    with pytest.raises(TimeoutError):
        send.send(1, timeout=0.01)
    with pytest.raises(csp.WouldBlock):
        recv.receive_nowait()


# ---- rendezvous -----------------------------------------------------------------------------------
def test_rendezvous_send_waits_for_a_receiver():
    send, recv = csp.channel(int, capacity=0)
    with pytest.raises(csp.WouldBlock):
        send.send_nowait(1)  # nobody is waiting
    res = Result()
    t = res.run(send.send, 1)
    wait_until(lambda: send.waiting)
    assert recv.statistics().current_fill == 0  # the item is an offer, not buffered
    assert recv.receive_nowait() == 1
    joined(t)
    assert res.error is None and send.items == 1


def test_rendezvous_send_nowait_succeeds_when_a_receiver_waits():
    send, recv = csp.channel(int, capacity=0)
    res = Result()
    t = res.run(recv.receive)
    wait_until(lambda: recv.waiting)
    send.send_nowait(9)
    with pytest.raises(csp.WouldBlock):
        send.send_nowait(10)  # the one waiting receiver is spoken for
    joined(t)
    assert res.value == 9


# ---- thread <-> async -------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [0, 1, 16])
def test_thread_sender_async_receiver(capacity):
    send, recv = csp.channel(int, capacity=capacity)

    def produce():
        with send:
            for i in range(500):
                send.send(i)

    async def main():
        t = start(produce)
        got = [x async for x in recv]
        await anyio.to_thread.run_sync(joined, t)
        return got

    assert anyio.run(main) == list(range(500))


@pytest.mark.parametrize("capacity", [0, 1, 16])
def test_async_sender_thread_receiver(capacity):
    send, recv = csp.channel(int, capacity=capacity)
    got: list[int] = []

    async def main():
        t = start(lambda: got.extend(recv))
        async with send:
            for i in range(500):
                await send.asend(i)
        await anyio.to_thread.run_sync(joined, t)

    anyio.run(main)
    assert got == list(range(500))


def test_async_to_async_in_one_loop():
    send, recv = csp.channel(str, capacity=0)

    async def main():
        got = []

        async def consume():
            async for x in recv:
                got.append(x)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            async with send:
                for x in "abc":
                    await send.asend(x)
        return got

    assert anyio.run(main) == ["a", "b", "c"]


def test_async_op_outside_an_event_loop_says_what_to_do():
    send, _ = csp.channel(int, capacity=0)
    coro = send.asend(1)
    coro.send(None)  # the checkpoint yields once
    with pytest.raises(RuntimeError, match="need an asyncio event loop"):
        coro.send(None)  # then it must block, and there is no loop to block on


# ---- statistics and per-end counters -----------------------------------------------------------------
class Blob:
    def __init__(self, n: int) -> None:
        self.n = n

    def __csp_nbytes__(self) -> int:
        return self.n


class Pair(msgspec.Struct):
    a: torch.Tensor
    meta: dict


def test_item_nbytes_walks_structs_containers_and_custom_sizes():
    t = torch.zeros(4, 8, dtype=torch.float32)  # 128 bytes
    assert csp.item_nbytes(t) == 128
    assert csp.item_nbytes(Pair(t, {"x": [t, (t[:2],)], "n": 3})) == 128 * 2 + 64  # a, x[0], and the 2-row view
    assert csp.item_nbytes(Blob(1000)) == 1000
    assert csp.item_nbytes([Blob(1), "s", 3, None, object()]) == 1
    nested: list = []
    nested.append(nested)  # self-reference: bounded walk, no recursion error
    assert csp.item_nbytes(nested) == 0


def test_statistics_exact_counts():
    send, recv = csp.channel(object, capacity=3, name="stats")
    recv2 = recv.clone()
    send.send(torch.zeros(10, dtype=torch.int64))  # 80 bytes
    send.send(Blob(20))
    send.send("text")
    s = recv.statistics()
    assert s == send.statistics()
    assert (s.name, s.capacity, s.current_fill, s.peak_fill) == ("stats", 3, 3, 3)
    assert (s.open_send_ends, s.open_receive_ends) == (1, 2)
    assert (s.items_moved, s.bytes_moved) == (0, 0)
    recv.receive()
    recv2.receive()
    s = recv.statistics()
    assert (s.current_fill, s.peak_fill, s.items_moved, s.bytes_moved) == (1, 3, 2, 100)
    assert (send.items, recv.items, recv2.items) == (3, 1, 1)
    assert s.waiting_senders == 0 and s.waiting_receivers == 0
    assert msgspec.json.decode(msgspec.json.encode(s), type=csp.ChannelStatistics) == s


def test_blocked_time_is_measured_and_includes_a_call_in_progress():
    send, recv = csp.channel(int, capacity=1)
    send.send(0)
    res = Result()
    t = res.run(send.send, 1)
    wait_until(lambda: send.waiting)
    first = send.blocked_s
    wait_until(lambda: send.blocked_s > first + 0.01)  # grows while still blocked
    assert recv.statistics().send_blocked_s > 0.01
    assert recv.statistics().waiting_senders == 1
    recv.receive()
    joined(t)
    assert not send.waiting
    done = send.blocked_s
    assert done > 0.01 and send.blocked_s == done
    assert recv.statistics().send_blocked_s == pytest.approx(done, rel=1e-6)
    assert recv.blocked_s == 0.0 and recv.statistics().receive_wait_s == 0.0


# ---- interrupted blocking calls ---------------------------------------------------------------------
@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread()
    or not hasattr(__import__("signal"), "pthread_kill"),
    reason="needs to run in the main thread with pthread_kill",
)
def test_ctrl_c_in_a_blocked_call_leaves_no_offer_and_no_waiter():
    """A KeyboardInterrupt while blocked withdraws a sender's offer (the item is not delivered
    later behind the caller's back) and removes a receiver's waiter."""
    import signal

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is handled by someone else here")
    main = threading.main_thread().ident
    send, recv = csp.channel(int, capacity=0)

    def interrupt_when(pred):
        wait_until(pred)
        signal.pthread_kill(main, signal.SIGINT)

    t = start(interrupt_when, lambda: send.waiting)
    with pytest.raises(KeyboardInterrupt):
        send.send(1)
    joined(t)
    assert recv.statistics().waiting_senders == 0 and not send.waiting
    with pytest.raises(csp.WouldBlock):
        recv.receive_nowait()

    t = start(interrupt_when, lambda: recv.waiting)
    with pytest.raises(KeyboardInterrupt):
        recv.receive()
    joined(t)
    assert recv.statistics().waiting_receivers == 0
    with pytest.raises(csp.WouldBlock):
        send.send_nowait(2)  # nobody is waiting any more
