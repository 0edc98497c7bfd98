"""Cross-rank channels: local Sender/Receiver ends on each rank, bridge threads, credits.

On every rank a crossing channel (see :mod:`csp.distributed.placement`) has two local halves
(:class:`csp.distributed.crossing.CrossChannel`, with the :class:`DistSender`/:class:`DistReceiver` ends of
:mod:`csp.distributed.crossing`; the :class:`Hub` here holds the credits, lanes and failure handling):

* the **outbox**: a rendezvous channel (capacity 0). The rank's producers hold
  :class:`DistSender` clones of it. A *pump* thread takes an item out only while some link of the
  channel holds a credit, then hands it to that link: so a producer blocks exactly while no
  receiving rank has room, and that time shows in its ``send_blocked_s`` / ``blocked_output_s``.
* the **inbox**: a channel of ``sum(link credits)`` slots, where the rank's consumers hold
  :class:`DistReceiver` clones. One *feeder* thread per incoming remote link moves the items
  that arrive from the lane into it (the local link's pump sends into it directly). Each item
  carries its link id; when a consumer takes it out, one credit goes back to that link's sender.

Credit-based flow control: link ``src -> dst`` starts with ``ceil(capacity / sending ranks)``
credits (at least 1). A credit is spent when the pump hands an item to the link and returned when
a consumer on ``dst`` takes that item out of the inbox, so per link at most ``credits`` items are
in flight or buffered, and a receiving rank buffers at most about ``capacity`` items. A pump
deals its items to its links in turn (receiving ranks ascending, skipping gone links): every
receiving rank gets an equal share, as lockstep data-parallel consumers (DDP) need.

End of stream: when all of a rank's producers closed, its pump sends EOS on each of its links;
a feeder closes its inbox end on EOS; consumers see ``EndOfStream`` once every link's end closed
and the inbox drained. If every consumer on ``dst`` closes, the feeder answers ``gone``; when all
of a pump's links are gone its outbox closes and the producers get ``PeerGone``.
"""


from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from csp.distributed.crossing import CrossChannel, DistReceiver, DistSender
from csp.distributed.placement import Link, Placement
from csp.distributed.wire import CLOSE, CREDIT, EOS, GONE, ITEM, LaneReader, LaneWriter

__all__ = ["DistReceiver", "DistSender", "Hub"]

log = logging.getLogger("csp.distributed")
_STOP = ("stop", -1, None, None)  # queue sentinel: leave the loop (abort)


class Hub:
    """This rank's side of every crossing channel: credits, lanes, bridge threads.

    Args:
        placement: the graph's placement.
        rank: this rank.
        lanes: ``peer -> (LaneWriter to peer, LaneReader from peer)`` for :meth:`Placement.peers`.
        on_failure: called once (from any thread) with a message when a bridge or lane fails;
            the launcher reports it to every rank and aborts the local runtime.
        on_abort: called with the reason when the runtime aborts a crossing channel locally (a
            process failed on this rank, or ``Runtime.abort``).
    """

    def __init__(self, placement: Placement, rank: int, lanes: dict[int, tuple[LaneWriter, LaneReader]],
                 on_failure: Callable[[str], None], on_abort: Callable[[str], None]) -> None:
        self.placement, self.rank, self.lanes = placement, rank, lanes
        self.on_failure, self.on_abort = on_failure, on_abort
        self.cond = threading.Condition()
        links = placement.links
        self.credits = {lk.id: lk.credits for lk in links if lk.src == rank}
        self.dead: set[int] = set()
        self.in_done: set[int] = set()  # incoming links that delivered EOS
        self.inq = {lk.id: queue.SimpleQueue() for lk in links if lk.dst == rank and lk.src != rank}
        self.outq = {p: queue.SimpleQueue() for p in lanes}
        self.open_out = {p: sum(1 for lk in links if lk.src == rank and lk.dst == p) for p in lanes}
        self.open_in = {p: sum(1 for lk in links if lk.dst == rank and lk.src == p) for p in lanes}
        self.channels: dict[str, CrossChannel] = {}
        self.threads: list[threading.Thread] = []
        self.aborted: str | None = None
        self.remote_reason: str | None = None

    # -- building -----------------------------------------------------------------------------
    def factory(self, *, item_type: Any, capacity: int, name: str, ordered: bool) -> tuple[Any, Any]:
        """The Runtime's ``channel_factory``: a plain channel unless ``name`` crosses ranks."""
        plan = self.placement.channels.get(name)
        if plan is None or not plan.crosses:
            from csp.core.channel import channel

            return channel(item_type, capacity, name, ordered)
        x = CrossChannel(self, name, item_type, capacity, ordered, plan.links)
        self.channels[name] = x
        if self.aborted is not None:
            x.abort(self.aborted)
        self.threads += x.start()
        return x.sender, x.receiver

    def start_lanes(self) -> None:
        """Start one writer and one reader thread per peer rank."""
        for peer, (writer, reader) in self.lanes.items():
            for target, kind in ((self._write, "write"), (self._read, "read")):
                t = threading.Thread(target=target, args=(peer, writer if kind == "write" else reader),
                                     name=f"csp.distributed.lane-{kind}[{peer}]", daemon=True)
                t.start()
                self.threads.append(t)
        for peer in self.lanes:
            with self.cond:
                self._maybe_close_lane(peer)

    # -- credits ------------------------------------------------------------------------------
    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def acquire(self, x: CrossChannel) -> Link | None:
        """Block until the link whose turn it is holds a credit and take it: the pump deals its
        items to ``x``'s live links in turn (receiving ranks ascending), so receiving rank ``k`` of
        ``n`` gets this rank's items ``k, k + n, k + 2n, ...``. Dealing, not "any link with a
        credit": data-parallel consumers in lockstep (DDP) need equal shares (an unequal split
        leaves one replica in a collective that the others never join), and a fixed split makes
        runs reproducible. Returns None when the run aborted, every link is gone, or the rank's
        producers are all closed (the pump then drains the outbox: EndOfStream)."""
        with self.cond:
            while True:
                if self.aborted is not None:
                    return None
                n = len(x.out_links)
                turn = next((x.turn + k for k in range(n) if x.out_links[(x.turn + k) % n].id not in self.dead),
                            None)
                if turn is None:
                    return None  # every link is gone
                lk = x.out_links[turn % n]
                if self.credits[lk.id] > 0:
                    self.credits[lk.id] -= 1
                    x.turn = (turn + 1) % n
                    return lk
                st = x.pump_end.statistics()
                if st.open_send_ends == 0 and st.current_fill == 0:
                    return None  # producers closed and nothing left (an ordered outbox holds one)
                self.cond.wait()

    def refund(self, link: Link) -> None:
        with self.cond:
            self.credits[link.id] += 1

    def taken(self, link_id: int) -> None:
        """A consumer on this rank took an item of ``link_id`` out of the inbox: give back a credit."""
        link = self.placement.links[link_id]
        with self.cond:
            if link.src == self.rank:
                self.credits[link_id] += 1
                self.cond.notify_all()
            elif link_id not in self.in_done:
                self.outq[link.src].put((CREDIT, link_id, None, 1))

    def post(self, peer: int, msg: tuple) -> None:
        """Queue a message for the lane to ``peer`` (never blocks: credits bound the queue)."""
        self.outq[peer].put(msg)

    def end_link(self, link: Link) -> None:
        """The pump finished ``link``: send EOS (local link: close the inbox end)."""
        if link.dst == self.rank:
            end = self.channels[link.channel].local_end
            if end is not None:
                end.close()
            return
        with self.cond:
            self.outq[link.dst].put((EOS, link.id, None, None))
            self.open_out[link.dst] -= 1
            self._maybe_close_lane(link.dst)

    def _maybe_close_lane(self, peer: int) -> None:
        # Called with self.cond held. CLOSE is the lane's last message: nothing is sent after it.
        if self.open_out[peer] == 0 and self.open_in[peer] == 0:
            self.open_out[peer] = -1  # closed once
            self.outq[peer].put((CLOSE, -1, None, None))

    # -- lane threads -------------------------------------------------------------------------
    def _write(self, peer: int, writer: LaneWriter) -> None:
        q = self.outq[peer]
        try:
            while True:
                kind, link, seq, item = q.get()
                if kind == "stop":
                    return
                if kind == CREDIT:  # coalesce queued credits of the same link into one message
                    merged: dict[int, int] = {link: item}
                    pending: list[tuple] = []
                    while True:
                        try:
                            m = q.get_nowait()
                        except queue.Empty:
                            break
                        if m[0] == CREDIT:
                            merged[m[1]] = merged.get(m[1], 0) + m[3]
                        else:
                            pending.append(m)
                            break
                    for lid, n in merged.items():
                        writer.send(CREDIT, lid, None, n)
                    if not pending:
                        continue
                    kind, link, seq, item = pending[0]
                    if kind == "stop":
                        return
                    if kind == CREDIT:
                        writer.send(CREDIT, link, None, item)
                        continue
                writer.send(kind, link, seq, item)
                if kind == CLOSE:
                    return
        except BaseException as exc:
            if self.aborted is None:
                self.fail(f"sending to rank {peer} failed: {exc!r}")

    def _read(self, peer: int, reader: LaneReader) -> None:
        try:
            while True:
                kind, lid, seq, item = reader.recv()
                if kind == ITEM:
                    self.inq[lid].put((ITEM, seq, item))
                elif kind == CREDIT:
                    with self.cond:
                        self.credits[lid] += int(item)  # coalesced: item is the count
                        self.cond.notify_all()
                elif kind == EOS:
                    self.inq[lid].put((EOS, None, None))
                    with self.cond:
                        self.in_done.add(lid)
                        self.open_in[peer] -= 1
                        self._maybe_close_lane(peer)
                elif kind == GONE:
                    with self.cond:
                        self.dead.add(lid)
                        self.cond.notify_all()
                elif kind == CLOSE:
                    return
        except BaseException as exc:
            if self.aborted is None:
                self.fail(f"receiving from rank {peer} failed (did it die?): {exc!r}")

    # -- failure ------------------------------------------------------------------------------
    def fail(self, message: str) -> None:
        """A bridge or lane of this rank failed: report it and abort (idempotent)."""
        if self.aborted is None:
            self.on_failure(message)

    def local_abort(self, reason: str) -> None:
        """The runtime aborted a crossing channel here (local failure, or ``Runtime.abort``)."""
        if self.aborted is None and self.remote_reason is None:
            self.on_abort(reason)
        self.abort(self.remote_reason or reason)

    def abort(self, reason: str) -> None:
        """Abort every crossing channel on this rank and wake every bridge thread (idempotent)."""
        with self.cond:
            if self.aborted is not None:
                return
            self.aborted = reason
            self.cond.notify_all()
        for x in self.channels.values():
            x.abort(reason)
        for q in self.inq.values():
            q.put((_STOP[0], None, None))
        for q in self.outq.values():
            q.put(_STOP)

    def join(self, timeout: float | None = None) -> list[str]:
        """Wait for the bridge and lane threads; returns the names of those still running."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            while t.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                t.join(0.05 if left is None else min(0.05, left))
                if self.aborted is not None and deadline is None:
                    deadline = time.monotonic() + 1.0  # aborted: give the threads a moment only
        return [t.name for t in self.threads if t.is_alive()]
