"""The lock-protected state of one channel, the part its two cores share.

Private to ``csp.core.channel`` (see its module doc for the protocol; ``ChannelState`` is public there).
The cores (``csp.core._cores``) hold the buffer and the parked send offers; this base holds the parked
receivers, the open-end counts, errors, closing, abort and statistics. Every method whose
docstring does not say otherwise must be called with ``state.lock`` held. A method never wakes
anyone itself: it returns the waiters to wake (in an ``Outcome`` or a sequence) and the caller
wakes them after releasing the lock.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from time import perf_counter
from typing import Any, Iterable

from csp.core._waiting import BLOCKED, PENDING, RETRY, Item, Outcome, Waiter
from csp.core.stats import ChannelStatistics
from csp.errors import ChannelAborted, ChannelClosed, EndOfStream, ItemTypeError, PeerGone

__all__ = ["ChannelState", "ItemCheck"]


class ChannelState(ABC):
    """Buffer, parked waiters, open-end counts and counters of one channel: the part shared by
    its ends. Build ends on it with ``Sender(state)`` / ``Receiver(state)`` (or subclasses)."""

    ordered = False

    def __init__(self, item_type: Any, capacity: int, name: str) -> None:
        self.lock = threading.Lock()
        self.item_type = item_type
        self.capacity = capacity
        self.name = name
        self.check = ItemCheck(item_type, name)
        self.receivers: deque = deque()  # parked receivers not yet woken, oldest first
        self.send_ends = 1
        self.recv_ends = 1
        self.aborted: str | None = None
        self.peak = 0
        self.items_moved = 0
        self.bytes_moved = 0
        self.send_blocked = 0.0
        self.recv_wait = 0.0

    # ---- the core's own part (FifoState, OrderedState) --------------------------------------
    @abstractmethod
    def try_send(self, end: Any, item: Item) -> Outcome:
        """Put ``item`` in if there is room (done), else BLOCKED. Raises the end's errors."""

    @abstractmethod
    def try_receive(self, end: Any, item: None = None) -> Outcome:
        """Take the next item if one is ready, else BLOCKED. Raises EndOfStream at the end."""

    @abstractmethod
    def _park_sender(self, w: Waiter) -> tuple:
        """Queue sender waiter ``w`` with its offer; returns what the wake-up needs."""

    @abstractmethod
    def _remove_sender(self, w: Waiter) -> None:
        """Withdraw a parked sender (timeout, cancel, interrupt)."""

    @abstractmethod
    def _parked_senders(self) -> Iterable:
        """The parked senders' waiters, oldest first."""

    @abstractmethod
    def _fill(self) -> int:
        """Items buffered now (the statistics' current_fill)."""

    @abstractmethod
    def _drop(self) -> list:
        """Drop every buffered item and parked offer; returns the offers' waiters."""

    # ---- errors -----------------------------------------------------------------------------
    def _refuse(self, end: Any, what: str) -> None:
        if self.aborted is not None:
            raise ChannelAborted(
                f"channel {self.name!r} was aborted: {self.aborted}", self.name, self.aborted
            )
        if end._closed:
            raise ChannelClosed(
                f"channel {self.name!r}: this {what} end is closed; clone() it before closing if "
                "someone still needs it",
                self.name,
            )
        if what == "send" and self.recv_ends == 0:
            raise PeerGone(
                f"channel {self.name!r}: every receive end is closed; nobody will receive this item",
                self.name,
            )

    def _end_of_stream(self) -> EndOfStream:
        return EndOfStream(
            f"channel {self.name!r}: every send end is closed and the buffer is empty", self.name
        )

    # ---- parking ----------------------------------------------------------------------------
    def park(self, w: Waiter) -> Outcome:
        """Park a waiter (a send offer if ``w.item`` is set). Returns BLOCKED, with a receiver
        to wake if the parked offer lets it skip an ordered gap."""
        w.t0 = perf_counter()
        if w.item is None:
            self.receivers.append(w)
            return BLOCKED
        wake = self._park_sender(w)
        return (False, None, wake) if wake else BLOCKED

    def withdraw(self, w: Waiter) -> None:
        """Remove a PENDING waiter (timeout): a withdrawn offer's item stays with its sender."""
        if w.item is None:
            self.receivers.remove(w)
        else:
            self._remove_sender(w)

    def cancel(self, w: Waiter) -> tuple:
        """A parked call gives up (cancelled, interrupted). A PENDING one is withdrawn; a receiver
        woken for an item passes the wake-up on: returns the waiters to wake."""
        if w.state == PENDING:
            self.withdraw(w)
            return ()
        if w.item is None:
            return self._wake_receiver()
        return ()

    def _wake_receiver(self) -> tuple:
        if not self.receivers:
            return ()
        r = self.receivers.popleft()
        r.state = RETRY
        return (r,)

    # ---- ends -------------------------------------------------------------------------------
    def open_end(self, end: Any) -> None:
        """Count one more end of ``end``'s kind (a clone of it; takes the lock itself).

        Raises:
            ChannelClosed: ``end`` is closed. ChannelAborted: the channel was aborted.
        """
        sending = end._sending
        with self.lock:
            if self.aborted is not None or end._closed:
                self._refuse(end, "send" if sending else "receive")
            if sending:
                self.send_ends += 1
            else:
                self.recv_ends += 1

    def close_end(self, end: Any) -> list:
        """Account for a closed end; returns the waiters to wake."""
        if end._sending:
            self.send_ends -= 1
            woken = [w for w in self._parked_senders() if w.end is end]
            for w in woken:
                self._remove_sender(w)
            if self.send_ends == 0 or self.ordered:  # ordered: a gap may now be skipped
                woken += self.receivers
                self.receivers.clear()
        else:
            self.recv_ends -= 1
            woken = [*self.receivers]  # its own calls fail; others re-check (pass-on after a close)
            self.receivers.clear()
            if self.recv_ends == 0:
                woken += self._drop()
        for w in woken:
            w.state = RETRY
        return woken

    def abort(self, reason: str) -> None:
        """Abort the channel: every parked and later call raises ChannelAborted, buffered items
        are dropped. Idempotent (the first reason wins). Takes the lock and wakes itself."""
        with self.lock:
            if self.aborted is not None:
                return
            self.aborted = reason or "aborted"
            woken = [*self._drop(), *self.receivers]
            self.receivers.clear()
            for w in woken:
                w.state = RETRY
        for w in woken:
            w.wake()

    # ---- statistics -------------------------------------------------------------------------
    def add_wait(self, seconds: float, sending: bool) -> None:
        """Add a finished blocking call's duration (takes the lock itself)."""
        with self.lock:
            if sending:
                self.send_blocked += seconds
            else:
                self.recv_wait += seconds

    def statistics(self) -> ChannelStatistics:
        """A snapshot (takes the lock itself)."""
        with self.lock:
            now = perf_counter()
            senders = [*self._parked_senders()]
            return ChannelStatistics(
                name=self.name,
                capacity=self.capacity,
                current_fill=self._fill(),
                peak_fill=self.peak,
                open_send_ends=self.send_ends,
                open_receive_ends=self.recv_ends,
                waiting_senders=len(senders),
                waiting_receivers=len(self.receivers),
                items_moved=self.items_moved,
                bytes_moved=self.bytes_moved,
                send_blocked_s=self.send_blocked + sum(now - w.t0 for w in senders),
                receive_wait_s=self.recv_wait + sum(now - w.t0 for w in self.receivers),
            )


class ItemCheck:
    """The item-type check of a channel: ``check(item)`` raises TypeError, saying what to change,
    unless ``item`` is an instance of ``item_type``. ``cls`` is the class checked against, None
    when the type can't be checked (``object``, ``Any``, generic aliases such as ``list[int]``):
    then every item passes."""

    __slots__ = ("item_type", "name", "cls")

    def __init__(self, item_type: Any, name: str) -> None:
        self.item_type = item_type
        self.name = name
        self.cls = _checkable(item_type)

    def __call__(self, item: Any) -> None:
        if self.cls is not None and not isinstance(item, self.cls):
            raise self.error(item)

    def error(self, item: Any) -> ItemTypeError:
        """The :class:`~csp.errors.ItemTypeError` (a TypeError) for ``item``, of the wrong type."""
        want = getattr(self.item_type, "__qualname__", repr(self.item_type))
        return ItemTypeError(
            f"channel {self.name!r} carries {want}, got {type(item).__qualname__}; send a {want} "
            "or declare the channel with a matching item_type",
            self.name,
        )


def _checkable(item_type: Any) -> type | None:
    """The class to isinstance-check items against, or None when the type can't be checked."""
    if item_type is object or not isinstance(item_type, type):
        return None
    try:
        isinstance(None, item_type)
    except TypeError:  # generic aliases such as list[int]
        return None
    return item_type
