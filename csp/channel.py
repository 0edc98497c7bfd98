"""Typed, bounded channels usable from OS threads and anyio tasks alike.

``send, recv = channel(item_type, capacity, name, ordered)`` makes a pair of ends sharing one
core. The core is a plain ``threading.Lock`` around a deque; nothing ever blocks while holding it.
A call that must wait parks a *waiter* in the core and sleeps outside the lock:

* a thread waits on a private pre-acquired ``threading.Lock`` (released once to wake it);
* an asyncio task (anyio's asyncio backend) awaits a future that the waker resolves directly when
  it runs on the task's loop thread, else through ``loop.call_soon_threadsafe``.

So a thread may feed a task and a task may feed a thread. Waiters are woken after the core lock is
released. Design after trio's memory channels and anyio's memory object streams:

* a blocked sender parks an *offer* holding its item; a receiver that frees a slot moves the
  oldest offer into the buffer (or, on a rendezvous channel, takes it directly) and marks it done;
* a woken receiver always takes the item itself under the lock, so it never holds an item it
  could lose: cancelling a receive can not drop an item (if it had been woken, the wake-up is
  passed on to the next waiting receiver);
* a cancelled or timed-out sender withdraws its offer if nobody took it (the item stays with the
  sender); if the offer was already taken the item was delivered once (as with anyio, the
  cancellation is still raised).

Ordered fan-in (``ordered=True``): every send gives ``seq`` (0, 1, 2, ... per run); receivers get
items in ``seq`` order. A ``seq`` at or beyond ``next_expected + max(capacity, 1)`` parks its
sender, so the buffer stays bounded and producers sending their own items in increasing order
never deadlock. Once every send end is closed, remaining items are delivered in ``seq`` order
even across a gap (a producer that stopped early), then ``EndOfStream``.
"""

from __future__ import annotations

from time import perf_counter
from typing import Any, Generic, TypeVar

from csp import _channel_core as _cc
from csp._channel_core import _EMPTY, Core
from csp.cuda import inbound, outbound
from csp.errors import EndOfStream, WouldBlock
from csp.stats import ChannelStatistics

__all__ = ["Receiver", "Sender", "channel"]

T = TypeVar("T")


def channel(
    item_type: type[T] | Any = object, capacity: int | None = None, name: str = "", ordered: bool = False
) -> tuple[Sender[T], Receiver[T]]:
    """Create a channel; returns its first ``(Sender, Receiver)`` pair.

    Args:
        item_type: the type every item must be an instance of (checked on send when it is a plain
            class; ``object``/``Any``/generic aliases are not checked).
        capacity: buffer size in items; 0 makes a rendezvous (a send waits for a receiver).
            Required: there is no unbounded channel.
        name: shown in statistics, traces and error messages.
        ordered: deliver items in ``seq`` order (see module doc); ``send`` then requires ``seq``.
            An ordered channel buffers up to ``max(capacity, 1)`` items (capacity 0 acts as 1).

    Ends must be closed (the runtime closes a process's ends; ``with`` blocks do too): an end that
    is dropped unclosed keeps its peers waiting.

    Raises:
        ValueError: capacity missing, negative or not an int.
    """
    if capacity is None or isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(
            f"channel {name!r}: capacity must be an int >= 0 (0 = rendezvous), got {capacity!r}; "
            "there is no unbounded channel"
        )
    core = Core(item_type, capacity, name, ordered)
    return Sender(core), Receiver(core)


class _End:
    """What both ends share: close, clone, abort, statistics, per-end counters."""

    __slots__ = ("_core", "_closed", "_items", "_blocked", "_wait_t0", "__weakref__")

    def __init__(self, core: Core) -> None:
        self._core = core
        self._closed = False
        self._items = 0  # items through this end
        self._blocked = 0.0  # seconds spent in finished blocking calls
        self._wait_t0: float | None = None  # start of the call blocked now

    @property
    def name(self) -> str:
        """The channel's name."""
        return self._core.name

    @property
    def item_type(self) -> Any:
        """The declared item type."""
        return self._core.item_type

    @property
    def capacity(self) -> int:
        """Buffer size in items (0 = rendezvous)."""
        return self._core.capacity

    @property
    def ordered(self) -> bool:
        """True if items are delivered in ``seq`` order."""
        return self._core.ordered

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called on this end."""
        return self._closed

    @property
    def items(self) -> int:
        """Items that went through this end (sent, or received)."""
        return self._items

    @property
    def blocked_s(self) -> float:
        """Seconds this end spent blocked (send) or waiting (receive), including a call now."""
        t0 = self._wait_t0
        return self._blocked + (perf_counter() - t0 if t0 is not None else 0.0)

    @property
    def waiting(self) -> bool:
        """True while a call on this end is blocked."""
        return self._wait_t0 is not None

    def statistics(self) -> ChannelStatistics:
        """A snapshot of the whole channel (the same from every end)."""
        return self._core.statistics()

    def abort(self, reason: str = "") -> None:
        """Abort the whole channel: every blocked and later operation on any end raises
        ``ChannelAborted(reason)``; buffered items are dropped. Idempotent (the first reason wins).
        """
        _wake(self._core.abort(reason))

    def _clone(self) -> None:
        with self._core.lock:
            self._core.check_clone(self, isinstance(self, Sender))

    def _begin_wait(self, waiter: _cc.ThreadWaiter | _cc.AsyncWaiter) -> None:
        self._wait_t0 = waiter.t0  # set when it was parked

    def _end_wait(self, sending: bool) -> None:
        t0 = self._wait_t0
        self._wait_t0 = None
        if t0 is not None:
            dt = perf_counter() - t0
            self._blocked += dt
            self._core.add_wait(dt, sending)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self._core.name!r} capacity={self._core.capacity} {state}>"


def _wake(waiters) -> None:
    for w in waiters:
        w.wake()


class Sender(_End, Generic[T]):
    """The send end of a channel. Use from one thread or task at a time; ``clone()`` for more."""

    __slots__ = ()

    def send(self, item: T, timeout: float | None = None, seq: int | None = None) -> None:
        """Send ``item``, blocking the calling thread while the channel is full.

        Args:
            item: an instance of the channel's item type (tensors inside are handed off with
                events, see ``csp.cuda``).
            timeout: seconds to wait at most; None waits forever.
            seq: position of the item in the run's stream; required on an ordered channel,
                ignored otherwise.

        Raises:
            TimeoutError: still full after ``timeout`` seconds (the item was not sent).
            PeerGone: every receive end is closed. ChannelClosed: this end is closed.
            ChannelAborted: the channel was aborted. TypeError: wrong item type.
            ValueError: bad or repeated ``seq`` on an ordered channel.
        """
        core = self._core
        if core.check_type is not None and not isinstance(item, core.check_type):
            core.raise_type(item)
        nbytes, payload = outbound(item)
        with core.lock:
            got = core.admit(self, payload, nbytes, seq)
            if got is False:
                if timeout is not None and timeout <= 0:
                    raise TimeoutError(f"channel {core.name!r}: send timed out (channel full)")
                w = _cc.ThreadWaiter(self, payload, nbytes, seq)
                extra = core.park_sender(w)
        if got is False:
            if extra is not None:
                extra.wake()
            self._send_blocking(w, timeout)
        elif got is not True:
            got.wake()
        self._items += 1

    def _send_blocking(self, w: _cc.ThreadWaiter, timeout: float | None) -> None:
        core = self._core
        self._begin_wait(w)
        deadline = None if timeout is None else w.t0 + timeout
        try:
            while True:
                try:
                    woke = w.wait(-1 if deadline is None else max(0.0, deadline - perf_counter()))
                except BaseException:  # KeyboardInterrupt in the main thread: withdraw the offer
                    with core.lock:
                        if w.state == _cc.PENDING:
                            core.unpark_sender(w)
                    raise
                with core.lock:
                    if w.state == _cc.DONE:
                        return
                    if not woke and w.state == _cc.PENDING:
                        core.unpark_sender(w)
                        raise TimeoutError(
                            f"channel {core.name!r}: send timed out after {timeout} s (channel full)"
                        )
                    got = core.admit(self, w.payload, w.nbytes, w.seq)
                    if got is False:
                        w = _cc.ThreadWaiter(self, w.payload, w.nbytes, w.seq)
                        extra = core.park_sender(w)
                if got is False:
                    if extra is not None:
                        extra.wake()
                else:
                    if got is not True:
                        got.wake()
                    return
        finally:
            self._end_wait(True)

    def send_nowait(self, item: T, seq: int | None = None) -> None:
        """Send ``item`` only if that needs no waiting.

        Raises:
            WouldBlock: the channel is full (on a rendezvous: no receiver is waiting).
            And as :meth:`send`.
        """
        core = self._core
        if core.check_type is not None and not isinstance(item, core.check_type):
            core.raise_type(item)
        nbytes, payload = outbound(item)
        with core.lock:
            got = core.admit(self, payload, nbytes, seq)
        if got is False:
            raise WouldBlock(f"channel {core.name!r} is full", core.name)
        if got is not True:
            got.wake()
        self._items += 1

    async def asend(self, item: T, seq: int | None = None) -> None:
        """Send ``item`` from an anyio task (asyncio backend), waiting while the channel is full.

        Always a checkpoint (a cancellation point before anything happens). If cancelled while
        waiting, the item is either still with the caller (nobody took it) or was delivered
        exactly once (taken just before the cancellation); never both, never lost.

        Raises: as :meth:`send` (no TimeoutError: use ``anyio.fail_after``).
        """
        await _cc.checkpoint()
        core = self._core
        if core.check_type is not None and not isinstance(item, core.check_type):
            core.raise_type(item)
        nbytes, payload = outbound(item)
        with core.lock:
            got = core.admit(self, payload, nbytes, seq)
            if got is False:
                w = _cc.AsyncWaiter(self, payload, nbytes, seq)
                extra = core.park_sender(w)
        if got is False:
            if extra is not None:
                extra.wake()
            await self._asend_blocking(w)
        elif got is not True:
            got.wake()
        self._items += 1

    async def _asend_blocking(self, w: _cc.AsyncWaiter) -> None:
        core = self._core
        self._begin_wait(w)
        try:
            while True:
                try:
                    await w.future
                except BaseException:
                    with core.lock:
                        if w.state == _cc.PENDING:
                            core.unpark_sender(w)  # the item stays with the caller
                    raise
                with core.lock:
                    if w.state == _cc.DONE:
                        return
                    got = core.admit(self, w.payload, w.nbytes, w.seq)
                    if got is False:
                        w = _cc.AsyncWaiter(self, w.payload, w.nbytes, w.seq)
                        extra = core.park_sender(w)
                if got is False:
                    if extra is not None:
                        extra.wake()
                else:
                    if got is not True:
                        got.wake()
                    return
        finally:
            self._end_wait(True)

    def clone(self) -> Sender[T]:
        """Another send end of the same channel (fan-in); receivers see end-of-stream only after
        every clone is closed too. Raises ChannelClosed if this end is closed."""
        self._clone()
        return Sender(self._core)

    def close(self) -> None:
        """Close this send end (idempotent). Once every send end is closed, receivers drain the
        buffer and then get EndOfStream. A send blocked on this end raises ChannelClosed."""
        core = self._core
        with core.lock:
            if self._closed:
                return
            self._closed = True
            woken = core.close_end(self, sending=True)
        _wake(woken)


class Receiver(_End, Generic[T]):
    """The receive end of a channel. Iterable (``for`` / ``async for``) until end of stream."""

    __slots__ = ()

    def receive(self, timeout: float | None = None) -> T:
        """Receive the next item, blocking the calling thread while the channel is empty.

        Raises:
            TimeoutError: nothing arrived within ``timeout`` seconds.
            EndOfStream: every send end is closed and the buffer is empty.
            ChannelClosed: this end is closed. ChannelAborted: the channel was aborted.
        """
        core = self._core
        with core.lock:
            payload, w1, w2 = core.take(self)
            if payload is _EMPTY:
                if timeout is not None and timeout <= 0:
                    raise TimeoutError(f"channel {core.name!r}: receive timed out (channel empty)")
                w = _cc.ThreadWaiter(self)
                core.park_receiver(w)
        if payload is _EMPTY:
            return self._receive_blocking(w, timeout)
        if w1 is not None:
            w1.wake()
            if w2 is not None:
                w2.wake()
        self._items += 1
        return inbound(payload)

    def _receive_blocking(self, w: _cc.ThreadWaiter, timeout: float | None) -> T:
        core = self._core
        self._begin_wait(w)
        deadline = None if timeout is None else w.t0 + timeout
        try:
            while True:
                try:
                    woke = w.wait(-1 if deadline is None else max(0.0, deadline - perf_counter()))
                except BaseException:  # KeyboardInterrupt in the main thread: pass any wake-up on
                    with core.lock:
                        passed_on = core.abandon_receiver(w)
                    if passed_on is not None:
                        passed_on.wake()
                    raise
                with core.lock:
                    if not woke and w.state == _cc.PENDING:
                        core.unpark_receiver(w)
                        raise TimeoutError(
                            f"channel {core.name!r}: receive timed out after {timeout} s"
                        )
                    payload, w1, w2 = core.take(self)
                    if payload is _EMPTY:
                        if deadline is not None and perf_counter() >= deadline:
                            raise TimeoutError(
                                f"channel {core.name!r}: receive timed out after {timeout} s"
                            )
                        w = _cc.ThreadWaiter(self)
                        core.park_receiver(w)
                if payload is not _EMPTY:
                    if w1 is not None:
                        w1.wake()
                        if w2 is not None:
                            w2.wake()
                    self._items += 1
                    return inbound(payload)
        finally:
            self._end_wait(False)

    def receive_nowait(self) -> T:
        """Receive an item only if one is ready.

        Raises: WouldBlock if none is ready; otherwise as :meth:`receive`.
        """
        core = self._core
        with core.lock:
            payload, w1, w2 = core.take(self)
        if payload is _EMPTY:
            raise WouldBlock(f"channel {core.name!r} is empty", core.name)
        if w1 is not None:
            w1.wake()
            if w2 is not None:
                w2.wake()
        self._items += 1
        return inbound(payload)

    async def areceive(self) -> T:
        """Receive the next item from an anyio task (asyncio backend).

        Always a checkpoint. Cancelling it never loses an item: the item stays in the channel.

        Raises: as :meth:`receive` (no TimeoutError: use ``anyio.fail_after``).
        """
        await _cc.checkpoint()
        core = self._core
        with core.lock:
            payload, w1, w2 = core.take(self)
            if payload is _EMPTY:
                w = _cc.AsyncWaiter(self)
                core.park_receiver(w)
        if payload is _EMPTY:
            return await self._areceive_blocking(w)
        if w1 is not None:
            w1.wake()
            if w2 is not None:
                w2.wake()
        self._items += 1
        return inbound(payload)

    async def _areceive_blocking(self, w: _cc.AsyncWaiter) -> T:
        core = self._core
        self._begin_wait(w)
        try:
            while True:
                try:
                    await w.future
                except BaseException:
                    with core.lock:
                        passed_on = core.abandon_receiver(w)
                    if passed_on is not None:
                        passed_on.wake()
                    raise
                with core.lock:
                    payload, w1, w2 = core.take(self)
                    if payload is _EMPTY:
                        w = _cc.AsyncWaiter(self)
                        core.park_receiver(w)
                if payload is not _EMPTY:
                    if w1 is not None:
                        w1.wake()
                        if w2 is not None:
                            w2.wake()
                    self._items += 1
                    return inbound(payload)
        finally:
            self._end_wait(False)

    def clone(self) -> Receiver[T]:
        """Another receive end of the same channel (fan-out: each item goes to exactly one
        receiver). Raises ChannelClosed if this end is closed."""
        self._clone()
        return Receiver(self._core)

    def close(self) -> None:
        """Close this receive end (idempotent). When the last receive end closes, buffered items
        are dropped and senders get PeerGone. A receive blocked on this end raises ChannelClosed."""
        core = self._core
        with core.lock:
            if self._closed:
                return
            self._closed = True
            woken = core.close_end(self, sending=False)
        _wake(woken)

    def __iter__(self) -> Receiver[T]:
        return self

    def __next__(self) -> T:
        try:
            return self.receive()
        except EndOfStream:
            raise StopIteration from None

    def __aiter__(self) -> Receiver[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.areceive()
        except EndOfStream:
            raise StopAsyncIteration from None

