"""One crossing channel on one rank: its outbox and inbox halves, pump and feeder threads, and the
:class:`DistSender`/:class:`DistReceiver` ends its producers and consumers hold.

The protocol (credits, end of stream, gone links) is described in :mod:`csp.distributed.bridge`, whose
:class:`~csp.distributed.bridge.Hub` owns the lanes and credits these halves use.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Protocol

from csp.core.channel import ChannelState, ItemCheck, Receiver, Sender, channel_state
from csp.core.stats import ChannelStatistics
from csp.distributed.placement import Link
from csp.distributed.wire import GONE, ITEM
from csp.errors import ChannelAborted, ChannelClosed, EndOfStream, PeerGone

__all__ = ["CrossChannel", "DistReceiver", "DistSender", "Hub"]


class Hub(Protocol):
    """What a crossing channel needs of its rank's hub (:class:`csp.distributed.bridge.Hub` is the one):
    declared here so the bridge imports the crossing halves and never the other way round."""

    rank: int
    inq: dict[int, queue.SimpleQueue]

    def notify(self) -> None: ...
    def acquire(self, x: CrossChannel) -> Link | None: ...
    def refund(self, link: Link) -> None: ...
    def taken(self, link_id: int) -> None: ...
    def post(self, peer: int, msg: tuple) -> None: ...
    def end_link(self, link: Link) -> None: ...
    def fail(self, message: str) -> None: ...
    def local_abort(self, reason: str) -> None: ...


class DistSender(Sender):
    """A send end of a cross-rank channel (what producers get): same API as :class:`csp.Sender`.

    Items go to the rank's outbox as ``(seq, item)``; statistics are the channel's merged view
    on this rank (:meth:`CrossChannel.statistics`)."""

    __slots__ = ("_x",)

    def __init__(self, state: ChannelState, x: "CrossChannel") -> None:
        super().__init__(state)
        self._x = x

    def send(self, item: Any, timeout: float | None = None, seq: int | None = None) -> None:
        """As :meth:`csp.Sender.send` (blocks while no receiving rank grants a credit)."""
        self._x.check_item(item)
        super().send((seq, item), timeout, seq=seq)

    def send_nowait(self, item: Any, seq: int | None = None) -> None:
        """As :meth:`csp.Sender.send_nowait`: WouldBlock unless the pump is waiting with a credit."""
        self._x.check_item(item)
        super().send_nowait((seq, item), seq=seq)

    async def asend(self, item: Any, seq: int | None = None) -> None:
        """As :meth:`csp.Sender.asend`."""
        self._x.check_item(item)
        await super().asend((seq, item), seq=seq)

    def clone(self) -> "DistSender":
        self.state.open_end(self)
        return DistSender(self.state, self._x)

    def close(self) -> None:
        super().close()
        self._x.hub.notify()  # the pump may be waiting for credit while the producers are done

    def abort(self, reason: str = "") -> None:
        """Abort the channel on this rank (both halves) and, through the hub, the whole run."""
        self._x.hub.local_abort(reason)

    def statistics(self) -> ChannelStatistics:
        return self._x.statistics()


class DistReceiver(Receiver):
    """A receive end of a cross-rank channel (what consumers get): same API as
    :class:`csp.Receiver`. Taking an item returns a credit to the link it came from."""

    __slots__ = ("_x",)

    def __init__(self, state: ChannelState, x: "CrossChannel") -> None:
        super().__init__(state)
        self._x = x

    def receive(self, timeout: float | None = None) -> Any:
        link, item = super().receive(timeout)
        self._x.hub.taken(link)
        return item

    def receive_nowait(self) -> Any:
        link, item = super().receive_nowait()
        self._x.hub.taken(link)
        return item

    async def areceive(self) -> Any:
        link, item = await super().areceive()
        self._x.hub.taken(link)
        return item

    def clone(self) -> "DistReceiver":
        self.state.open_end(self)
        return DistReceiver(self.state, self._x)

    def abort(self, reason: str = "") -> None:
        self._x.hub.local_abort(reason)

    def statistics(self) -> ChannelStatistics:
        return self._x.statistics()


class CrossChannel:
    """The two local halves of one crossing channel on this rank, with its pump and feeders."""

    def __init__(self, hub: Hub, name: str, item_type: Any, capacity: int, ordered: bool,
                 links: list[Link]) -> None:
        rank = hub.rank
        self.hub, self.name, self.item_type, self.capacity = hub, name, item_type, capacity
        self.check_item = ItemCheck(item_type, name)
        self.out_links = sorted((lk for lk in links if lk.src == rank), key=lambda lk: lk.dst)
        self.turn = 0  # index in out_links of the link that gets the pump's next item (Hub.acquire)
        self.in_links = [lk for lk in links if lk.dst == rank]
        self.outbox = channel_state(object, 0, name, ordered)
        self.inbox = channel_state(object, sum(lk.credits for lk in self.in_links), name, ordered)
        self.sender = DistSender(self.outbox, self)  # handed to the runtime (it clones, then closes)
        self.receiver = DistReceiver(self.inbox, self)
        self.pump_end = Receiver(self.outbox)
        inbox_send = Sender(self.inbox)
        self.local_end: Sender | None = None  # the local link's way into the inbox
        self.feeds: list[tuple[Link, Sender]] = []
        for lk in self.in_links:
            if lk.src == rank:
                self.local_end = inbox_send.clone()
            else:
                self.feeds.append((lk, inbox_send.clone()))
        inbox_send.close()
        if not self.out_links:
            self.pump_end.close()

    def start(self) -> list[threading.Thread]:
        """Start the pump (if this rank sends) and one feeder per remote incoming link."""
        threads = []
        if self.out_links:
            threads.append(threading.Thread(target=self._pump, name=f"csp.distributed.pump[{self.name}]", daemon=True))
        for lk, end in self.feeds:
            threads.append(threading.Thread(target=self._feed, args=(lk, end), daemon=True,
                                            name=f"csp.distributed.feed[{self.name}<-{lk.src}]"))
        for t in threads:
            t.start()
        return threads

    def _pump(self) -> None:
        hub = self.hub
        try:
            while True:
                link = hub.acquire(self)
                if link is None:
                    break
                try:
                    seq, item = self.pump_end.receive()
                except EndOfStream:
                    hub.refund(link)
                    break
                except (ChannelAborted, ChannelClosed):
                    break
                if link.dst == hub.rank:
                    self.local_end.send((link.id, item), seq=seq)  # type: ignore[union-attr]
                else:
                    hub.post(link.dst, (ITEM, link.id, seq, item))
        except (ChannelAborted, ChannelClosed):
            pass
        except BaseException as exc:  # a bug or a dead lane: stop the run, naming this rank
            hub.fail(f"csp.distributed pump of channel {self.name!r} failed: {exc!r}")
        finally:
            self.pump_end.close()  # producers still sending now get PeerGone
            for lk in self.out_links:
                hub.end_link(lk)

    def _feed(self, link: Link, end: Sender) -> None:
        hub, q, gone = self.hub, self.hub.inq[link.id], False
        try:
            while True:
                kind, seq, item = q.get()
                if kind != ITEM:
                    break
                if gone:
                    continue
                try:
                    end.send((link.id, item), seq=seq)
                except PeerGone:
                    gone = True
                    hub.post(link.src, (GONE, link.id, None, None))
        except (ChannelAborted, ChannelClosed):
            pass
        except BaseException as exc:
            hub.fail(f"csp.distributed feeder of channel {self.name!r} from rank {link.src} failed: {exc!r}")
        finally:
            end.close()

    def abort(self, reason: str) -> None:
        self.outbox.abort(reason)
        self.inbox.abort(reason)

    def statistics(self) -> ChannelStatistics:
        """This rank's view of the channel, merged from its two halves.

        ``current_fill``/``peak_fill``, ``items_moved``/``bytes_moved``, ``waiting_receivers`` and
        ``receive_wait_s`` are the inbox's (items received on this rank). ``waiting_senders`` and
        ``send_blocked_s`` add the outbox's (this rank's producers waiting for credit) and the
        inbox's (arrived items waiting for room). ``open_send_ends`` counts this rank's open
        producer ends plus the open incoming remote links; ``open_receive_ends`` this rank's
        consumer ends. ``capacity`` is the declared one.
        """
        o, i = self.outbox.statistics(), self.inbox.statistics()
        local_open = 1 if self.local_end is not None and not self.local_end.closed else 0
        return ChannelStatistics(
            name=self.name, capacity=self.capacity, current_fill=i.current_fill, peak_fill=i.peak_fill,
            open_send_ends=o.open_send_ends + i.open_send_ends - local_open,
            open_receive_ends=i.open_receive_ends,
            waiting_senders=o.waiting_senders + i.waiting_senders, waiting_receivers=i.waiting_receivers,
            items_moved=i.items_moved, bytes_moved=i.bytes_moved,
            send_blocked_s=o.send_blocked_s + i.send_blocked_s, receive_wait_s=i.receive_wait_s,
        )
