"""The two cores of a channel: first-in-first-out, and ordered by ``seq``.

Private to ``csp.core.channel``. Each core is a :class:`ChannelState` holding the buffer and the parked
send offers; the methods' contracts are the base class's (called with the lock held, waiters to
wake returned, never woken here).

* :class:`FifoState`: a deque of items and a queue of parked send offers, oldest first.
* :class:`OrderedState`: items by ``seq`` and parked offers by ``seq``, delivered in ``seq`` order
  within a window of ``max(capacity, 1)`` seqs ahead of the next expected one.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable

from csp.core._state import ChannelState
from csp.core._waiting import BLOCKED, DONE, SENT, SEQ, Item, Outcome, Waiter
from csp.errors import SeqError

__all__ = ["FifoState", "OrderedState"]


class FifoState(ChannelState):
    """First in, first out. A parked offer moves into the buffer when a receive frees a slot;
    on a rendezvous channel (capacity 0) a receiver takes it directly."""

    def __init__(self, item_type: Any, capacity: int, name: str) -> None:
        super().__init__(item_type, capacity, name)
        self.buf: deque[Item] = deque()
        self.senders: deque = deque()  # parked offers, oldest first

    def try_send(self, end: Any, item: Item) -> Outcome:
        if self.aborted is not None or end._closed or self.recv_ends == 0:
            self._refuse(end, "send")
        buf = self.buf
        if len(buf) >= self.capacity and not self.receivers:
            return BLOCKED
        buf.append(item)  # on a rendezvous only while a receiver waits: it is spoken for
        if len(buf) > self.peak:
            self.peak = len(buf)
        return (True, None, self._wake_receiver()) if self.receivers else SENT

    def try_receive(self, end: Any, item: None = None) -> Outcome:
        if self.aborted is not None or end._closed:
            self._refuse(end, "receive")
        buf, senders = self.buf, self.senders
        wake: tuple = ()
        if buf:
            got = buf.popleft()
            if senders and len(buf) < self.capacity:  # move the oldest offer into the freed slot
                w = senders.popleft()
                w.state = DONE
                buf.append(w.item)
                wake = (w,)
        elif senders:  # rendezvous (or a slot freed by a woken receiver): take the offer
            w = senders.popleft()
            w.state = DONE
            got = w.item
            wake = (w,)
        elif self.send_ends == 0:
            raise self._end_of_stream()
        else:
            return BLOCKED
        payload, nbytes, _ = got
        self.items_moved += 1
        self.bytes_moved += nbytes
        return True, payload, wake

    def _park_sender(self, w: Waiter) -> tuple:
        self.senders.append(w)
        return ()

    def _remove_sender(self, w: Waiter) -> None:
        self.senders.remove(w)

    def _parked_senders(self) -> Iterable:
        return self.senders

    def _fill(self) -> int:
        return len(self.buf)

    def _drop(self) -> list:
        woken = [*self.senders]
        self.senders.clear()
        self.buf.clear()
        return woken


class OrderedState(ChannelState):
    """Delivery in ``seq`` order (see ``csp.core.channel``): a send whose ``seq`` is at or beyond
    ``next_seq + window`` parks; once no open, unparked sender can fill a gap, the lowest
    ``seq`` that exists is delivered next."""

    ordered = True

    def __init__(self, item_type: Any, capacity: int, name: str) -> None:
        super().__init__(item_type, capacity, name)
        self.window = max(capacity, 1)  # seqs admitted ahead of the next expected one
        self.pending: dict[int, Item] = {}  # seq -> item
        self.senders: dict[int, Any] = {}  # seq -> parked offer
        self.next_seq = 0

    def try_send(self, end: Any, item: Item) -> Outcome:
        if self.aborted is not None or end._closed or self.recv_ends == 0:
            self._refuse(end, "send")
        seq = item[SEQ]
        if seq is None or isinstance(seq, bool) or not isinstance(seq, int):
            raise SeqError(
                f"channel {self.name!r} is ordered: pass seq=<int> (0, 1, 2, ... per run) to send, "
                f"got {seq!r}",
                self.name,
            )
        nxt = self.next_seq
        if seq < nxt or seq in self.pending or seq in self.senders:
            raise SeqError(
                f"channel {self.name!r}: seq {seq} was already sent on this ordered channel (next "
                f"expected is {nxt}); every item needs its own seq",
                self.name,
            )
        if seq >= nxt + self.window:
            return BLOCKED
        self.pending[seq] = item
        if len(self.pending) > self.peak:
            self.peak = len(self.pending)
        return (True, None, self._wake_receiver()) if seq == nxt and self.receivers else SENT

    def try_receive(self, end: Any, item: None = None) -> Outcome:
        if self.aborted is not None or end._closed:
            self._refuse(end, "receive")
        pending, senders = self.pending, self.senders
        got = pending.pop(self.next_seq, None)
        woken = []
        if got is None:
            if len(senders) < self.send_ends:
                return BLOCKED  # an open, unparked sender may still send the missing seq
            # Nobody left who could fill the gap: deliver the lowest seq that exists.
            if pending:
                got = pending.pop(min(pending))
            elif senders:
                w = senders.pop(min(senders))
                w.state = DONE
                got = w.item
                woken.append(w)
            else:
                raise self._end_of_stream()
            self.next_seq = got[SEQ]
        self.next_seq += 1
        w = senders.pop(self.next_seq + self.window - 1, None)
        if w is not None:  # the window slid: admit the offer that now fits
            w.state = DONE
            pending[w.item[SEQ]] = w.item
            woken.append(w)
        if self.next_seq in pending or len(senders) >= self.send_ends:
            woken += self._wake_receiver()  # the next item is ready (or another gap skip is due)
        payload, nbytes, _ = got
        self.items_moved += 1
        self.bytes_moved += nbytes
        return True, payload, tuple(woken)

    def _park_sender(self, w: Waiter) -> tuple:
        self.senders[w.item[SEQ]] = w
        return self._wake_receiver() if len(self.senders) >= self.send_ends else ()

    def _remove_sender(self, w: Waiter) -> None:
        del self.senders[w.item[SEQ]]

    def _parked_senders(self) -> Iterable:
        return self.senders.values()

    def _fill(self) -> int:
        return len(self.pending)

    def _drop(self) -> list:
        woken = [*self.senders.values()]
        self.senders.clear()
        self.pending.clear()
        return woken
