"""Typed, bounded channels usable from OS threads and anyio tasks alike.

``send, recv = channel(item_type, capacity, name, ordered)`` makes a pair of ends sharing one
:class:`ChannelState`: a plain ``threading.Lock`` around the buffer; nothing ever blocks while
holding it. Every send and receive runs the same algorithm (:func:`_step`): under the lock, try
the operation now; if it can not be done, park a *waiter* and sleep outside the lock, then try
again when woken. A waiter is the only thing that differs between a thread and a task:

* a thread waits on a private pre-acquired ``threading.Lock`` (released once to wake it);
* an asyncio task (anyio's asyncio backend) awaits a future that the waker resolves directly when
  it runs on the task's loop thread, else through ``loop.call_soon_threadsafe``.

So a thread may feed a task and a task may feed a thread. Waiters are woken after the lock is
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

from csp.core._cores import FifoState, OrderedState
from csp.core._state import ChannelState, ItemCheck
from csp.core._waiting import Item, checkpoint, nowait, task_call, thread_call, wake_all
from csp.core.stats import ChannelStatistics
from csp.cuda.handoff import inbound, outbound
from csp.errors import ChannelConfigError, EndOfStream, WouldBlock

__all__ = ["ChannelState", "ItemCheck", "Receiver", "Sender", "channel", "channel_state"]

T = TypeVar("T")


def channel_state(
    item_type: Any = object, capacity: int | None = None, name: str = "", ordered: bool = False
) -> ChannelState:
    """The shared state of a new channel, without ends: the hook for custom ends (``csp.distributed``).

    Build ends on it with ``Sender(state)`` and ``Receiver(state)`` (or subclasses of them); the
    state counts one open end of each kind, so make exactly one of each and ``clone()`` for more.
    The state's public part: ``abort(reason)``, ``statistics()``, ``open_end(end)`` (count a
    clone of ``end``) and ``check``, its :class:`ItemCheck`.
    Arguments and errors as :func:`channel`.
    """
    if capacity is None or isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ChannelConfigError(
            f"channel {name!r}: capacity must be an int >= 0 (0 = rendezvous), got {capacity!r}; "
            "there is no unbounded channel"
        )
    return (OrderedState if ordered else FifoState)(item_type, capacity, name)


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
        ChannelConfigError (a ValueError): capacity missing, negative or not an int.
    """
    state = channel_state(item_type, capacity, name, ordered)
    return Sender(state), Receiver(state)


# ---- the ends -------------------------------------------------------------------------------------
class _End:
    """What both ends share: close, clone, abort, statistics, per-end counters."""

    __slots__ = ("_core", "_closed", "_items", "_blocked", "_wait_t0", "__weakref__")
    _sending = False

    def __init__(self, state: ChannelState) -> None:
        self._core = state
        self._closed = False
        self._items = 0  # items through this end
        self._blocked = 0.0  # seconds spent in finished blocking calls
        self._wait_t0: float | None = None  # start of the call blocked now

    @property
    def state(self) -> ChannelState:
        """The channel's shared state (see :func:`channel_state`)."""
        return self._core

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
        self._core.abort(reason)

    def close(self) -> None:
        """Close this end (idempotent); see :meth:`Sender.close` and :meth:`Receiver.close`."""
        state = self._core
        with state.lock:
            if self._closed:
                return
            self._closed = True
            woken = state.close_end(self)
        wake_all(woken)

    def _end_wait(self) -> None:
        t0 = self._wait_t0
        self._wait_t0 = None
        if t0 is not None:
            dt = perf_counter() - t0
            self._blocked += dt
            self._core.add_wait(dt, self._sending)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self._core.name!r} capacity={self._core.capacity} {state}>"


class Sender(_End, Generic[T]):
    """The send end of a channel. Use from one thread or task at a time; ``clone()`` for more."""

    __slots__ = ()
    _sending = True

    def _offer(self, item: T, seq: int | None) -> Item:
        state = self._core
        check = state.check
        if check.cls is not None and not isinstance(item, check.cls):
            raise check.error(item)
        nbytes, payload = outbound(item)  # records the CUDA events of tensors inside
        return payload, nbytes, seq

    def send(self, item: T, timeout: float | None = None, seq: int | None = None) -> None:
        """Send ``item``, blocking the calling thread while the channel is full.

        Args:
            item: an instance of the channel's item type (tensors inside are handed off with
                events, see ``csp.cuda.handoff``).
            timeout: seconds to wait at most; None waits forever; 0 or less never waits (as
                :meth:`send_nowait`, raising ChannelTimeout): on a rendezvous it succeeds only
                if a receiver is already waiting, so it never meets a receive that never waits.
            seq: position of the item in the run's stream; required on an ordered channel,
                ignored otherwise.

        Raises:
            ChannelTimeout (a TimeoutError): still full after ``timeout`` seconds (the item was not sent).
            PeerGone: every receive end is closed. ChannelClosed: this end is closed.
            ChannelAborted: the channel was aborted. ItemTypeError (a TypeError): wrong item type.
            SeqError (a ValueError): bad or repeated ``seq`` on an ordered channel.
        """
        state, offer = self._core, self._offer(item, seq)
        with state.lock:  # the nowait step, inline: the common case that needs no waiting
            done, _, wake = state.try_send(self, offer)
        if wake:
            wake_all(wake)
        if not done:
            thread_call(self, state.try_send, offer, timeout)
        self._items += 1

    def send_nowait(self, item: T, seq: int | None = None) -> None:
        """Send ``item`` only if that needs no waiting.

        Raises:
            WouldBlock: the channel is full (on a rendezvous: no receiver is waiting).
            And as :meth:`send`.
        """
        done, _, _ = nowait(self, self._core.try_send, self._offer(item, seq))
        if not done:
            raise WouldBlock(f"channel {self._core.name!r} is full", self._core.name)
        self._items += 1

    async def asend(self, item: T, seq: int | None = None) -> None:
        """Send ``item`` from an anyio task (asyncio backend), waiting while the channel is full.

        Always a checkpoint (a cancellation point before anything happens). If cancelled while
        waiting, the item is either still with the caller (nobody took it) or was delivered
        exactly once (taken just before the cancellation); never both, never lost.

        Raises: as :meth:`send` (no TimeoutError: use ``anyio.fail_after``).
        """
        await checkpoint()
        state, offer = self._core, self._offer(item, seq)
        done, _, _ = nowait(self, state.try_send, offer)
        if not done:
            await task_call(self, state.try_send, offer)
        self._items += 1

    def clone(self) -> Sender[T]:
        """Another send end of the same channel (fan-in); receivers see end-of-stream only after
        every clone is closed too. Raises ChannelClosed if this end is closed."""
        self._core.open_end(self)
        return Sender(self._core)

    def close(self) -> None:
        """Close this send end (idempotent). Once every send end is closed, receivers drain the
        buffer and then get EndOfStream. A send blocked on this end raises ChannelClosed."""
        super().close()


class Receiver(_End, Generic[T]):
    """The receive end of a channel. Iterable (``for`` / ``async for``) until end of stream."""

    __slots__ = ()

    def receive(self, timeout: float | None = None) -> T:
        """Receive the next item, blocking the calling thread while the channel is empty.

        ``timeout``: seconds to wait at most; None waits forever; 0 or less never waits (as
        :meth:`receive_nowait`, raising ChannelTimeout): on a rendezvous it succeeds only if a
        sender is already waiting.

        Raises:
            ChannelTimeout (a TimeoutError): nothing arrived within ``timeout`` seconds.
            EndOfStream: every send end is closed and the buffer is empty.
            ChannelClosed: this end is closed. ChannelAborted: the channel was aborted.
        """
        state = self._core
        with state.lock:  # the nowait step, inline: the common case that needs no waiting
            done, payload, wake = state.try_receive(self, None)
        if wake:
            wake_all(wake)
        if not done:
            payload = thread_call(self, state.try_receive, None, timeout)
        self._items += 1
        return inbound(payload)  # waits on the item's CUDA events

    def receive_nowait(self) -> T:
        """Receive an item only if one is ready.

        Raises: WouldBlock if none is ready; otherwise as :meth:`receive`.
        """
        done, payload, _ = nowait(self, self._core.try_receive, None)
        if not done:
            raise WouldBlock(f"channel {self._core.name!r} is empty", self._core.name)
        self._items += 1
        return inbound(payload)

    async def areceive(self) -> T:
        """Receive the next item from an anyio task (asyncio backend).

        Always a checkpoint. Cancelling it never loses an item: the item stays in the channel.

        Raises: as :meth:`receive` (no TimeoutError: use ``anyio.fail_after``).
        """
        await checkpoint()
        state = self._core
        done, payload, _ = nowait(self, state.try_receive, None)
        if not done:
            payload = await task_call(self, state.try_receive, None)
        self._items += 1
        return inbound(payload)

    def clone(self) -> Receiver[T]:
        """Another receive end of the same channel (fan-out: each item goes to exactly one
        receiver). Raises ChannelClosed if this end is closed."""
        self._core.open_end(self)
        return Receiver(self._core)

    def close(self) -> None:
        """Close this receive end (idempotent). When the last receive end closes, buffered items
        are dropped and senders get PeerGone. A receive blocked on this end raises ChannelClosed."""
        super().close()

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
