"""The control plane: one abort key in the torch.distributed store, watched by every rank.

The first rank to fail writes ``csp.distributed/abort = "<rank>\\n<message>"`` with ``compare_set``, so
the first failure wins and later ones (consequences) are not reported as the cause. A watcher
thread on every rank polls the key (``store.check``, every ``interval_s``) and calls back with
the failing rank and its message; the launcher then aborts the local runtime and bridges. Each
rank that saw the key bumps ``csp.distributed/acks``; before exiting after a failure a rank waits (a
bounded time) until every other rank has seen it, so that the rank hosting the store (rank 0
outside torchrun) does not take the message down with it.

Peer liveness: the watcher also bumps ``csp.distributed/beat/<rank>`` about once a second and reads
every other rank's counter. A rank whose counter has not moved for ``peer_timeout_s`` seconds
(:data:`PEER_TIMEOUT_S`, 60 s by default) is reported as lost, by the rank that noticed:
``"rank 1 stopped answering: no heartbeat for 60 s (its host lost?)"``. A dead process on a live
host usually shows sooner (gloo sees its sockets close); the heartbeat is what bounds the wait
when a host vanishes without closing its connections (power, network), where a gloo receive
would otherwise block until the group timeout (30 min) or forever between transfers. 60 s leaves
room for a rank whose Python threads are starved for a while (a long GIL-holding call).

A failure of this rank that reads as a lost connection (gloo's "Connection reset by peer", a
closed or broken socket: :data:`PEER_LOST`) is usually the consequence of another rank's loss that
the heartbeat has not timed out yet. Before publishing it, :meth:`Control.report` reads the other
ranks' counters twice, :data:`PEER_PROBE_S` apart; ranks whose counters did not move are named as
the cause (``"rank 1 stopped answering (...)"``), so the message says which rank went away rather
than which socket broke.

Nothing here blocks for long (the probe: :data:`PEER_PROBE_S`, on a connection failure only): ``check``/``get``/``add``/``compare_set`` are single store round
trips, and a store that stops answering (its host rank died) is itself reported as a failure.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable

from csp.errors import DistConfigError

if TYPE_CHECKING:
    import torch.distributed

__all__ = ["Control"]

ABORT_KEY = "csp.distributed/abort"
ACK_KEY = "csp.distributed/acks"
BEAT_KEY = "csp.distributed/beat/{}"
PEER_TIMEOUT_S = 60.0
"""Default seconds without a heartbeat before a rank is reported lost (module doc; 0 = off)."""
PEER_PROBE_S = 2.5
"""Seconds between the two heartbeat reads after a connection failure: above the watcher's beat
interval (1 s), so a live rank's counter moves in between."""
PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused")
"""Lower-case fragments of the socket errors that a lost peer causes (gloo's tcp transport)."""


class Control:
    """Abort reporting and watching for one rank.

    Args:
        store: the ``torch.distributed`` store shared by all ranks (TCPStore).
        rank: this rank.
        world_size: number of ranks.
        peer_timeout_s: seconds without a heartbeat before another rank is reported lost
            (:data:`PEER_TIMEOUT_S`; 0 = no heartbeat).
        store_address: where the store lives (``"host:port"``), for the message when it is lost.

    Raises:
        csp.errors.DistConfigError (a ValueError): ``peer_timeout_s`` is negative.
    """

    def __init__(self, store: torch.distributed.Store, rank: int, world_size: int, peer_timeout_s: float = PEER_TIMEOUT_S,
                 store_address: str | None = None) -> None:
        if peer_timeout_s < 0:
            raise DistConfigError(f"peer_timeout_s must be >= 0 seconds (0 = no heartbeat), got {peer_timeout_s}")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.peer_timeout_s, self.store_address = float(peer_timeout_s), store_address
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.seen: tuple[int, str] | None = None  # (rank, message) of the winning failure

    def report(self, message: str, rank: int | None = None) -> tuple[int, str]:
        """Publish this rank's failure (or ``rank``'s, one this rank saw stop answering) unless
        another was published first.

        Returns:
            ``(rank, message)`` of the failure that won (this one, or the earlier one).
        """
        if rank is None and self.peer_timeout_s and any(x in message.lower() for x in PEER_LOST):
            silent = self.silent_peers()
            if silent:
                names = ", ".join(map(str, silent))
                message = (f"rank{'s' * (len(silent) > 1)} {names} stopped answering (its host lost?): "
                           f"this rank's connection to it failed: {message}")
                rank = silent[0]
        value = f"{self.rank if rank is None else rank}\n{message}"
        try:
            got = self.store.compare_set(ABORT_KEY, "", value)
        except Exception:  # the store is gone: nobody can be told; keep our own message
            got = value.encode()
        won = _parse(got)
        if self.seen is None:
            self.seen = won
        return won

    def silent_peers(self, probe_s: float = PEER_PROBE_S) -> list[int]:
        """The other ranks whose heartbeat counters did not move over ``probe_s`` seconds
        (``[]`` when the store cannot be read: nothing is then known)."""
        peers = [r for r in range(self.world_size) if r != self.rank]
        try:
            before = [self.store.add(BEAT_KEY.format(r), 0) for r in peers]
            time.sleep(probe_s)
            after = [self.store.add(BEAT_KEY.format(r), 0) for r in peers]
        except Exception:
            return []
        return [r for r, a, b in zip(peers, before, after) if a == b]

    def watch(self, on_abort: Callable[[int, str], None], interval_s: float = 0.05) -> None:
        """Start the watcher thread: ``on_abort(rank, message)`` once another rank reports
        (rank ``-1`` if the store itself became unreachable; the lost rank if a heartbeat
        stopped, see the module doc)."""
        beat_s = min(1.0, self.peer_timeout_s / 4)
        peers = [r for r in range(self.world_size) if r != self.rank]
        seen: dict[int, tuple[int, float]] = {}  # rank -> (last counter, monotonic time it moved)
        next_beat = 0.0

        def lost_peers() -> list[int]:
            now = time.monotonic()
            self.store.add(BEAT_KEY.format(self.rank), 1)
            for r in peers:
                count = self.store.add(BEAT_KEY.format(r), 0)
                if r not in seen or seen[r][0] != count:
                    seen[r] = (count, now)
            return [r for r in peers if now - seen[r][1] >= self.peer_timeout_s]

        def loop() -> None:
            nonlocal next_beat
            while not self._stop.wait(interval_s):
                try:
                    if not self.store.check([ABORT_KEY]):
                        if self.peer_timeout_s and time.monotonic() >= next_beat:
                            next_beat = time.monotonic() + beat_s
                            lost = lost_peers()
                            if lost:
                                names = ", ".join(map(str, lost))
                                self.report(f"rank{'s' * (len(lost) > 1)} {names} stopped answering: no "
                                            f"heartbeat for {self.peer_timeout_s:g} s (its host lost?)", lost[0])
                        continue
                    rank, message = _parse(self.store.get(ABORT_KEY))
                    if self.seen is None:
                        self.seen = (rank, message)  # before the ack: the store host may then leave
                    if rank != self.rank:  # acks count the ranks other than the failing one
                        self.store.add(ACK_KEY, 1)
                except Exception as exc:
                    if self._stop.is_set():
                        return
                    where = f" at {self.store_address}" if self.store_address else ""
                    rank, message = -1, (f"lost the torch.distributed store{where} (did its host die? rank 0's, "
                                         f"or under torchrun the rendezvous endpoint's): {exc!r}")
                    if self.seen is None:
                        self.seen = (rank, message)
                if rank != self.rank:
                    on_abort(rank, message)
                return

        self._thread = threading.Thread(target=loop, name="csp.distributed.watch", daemon=True)
        self._thread.start()

    def linger(self, timeout_s: float = 5.0) -> bool:
        """After a failure: wait until every other rank acknowledged the abort key, at most
        ``timeout_s`` seconds. Returns True if all did."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.store.add(ACK_KEY, 0) >= self.world_size - 1:
                    return True
            except Exception:
                return False
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        """Stop the watcher (returns within one poll interval)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)


def _parse(raw: bytes | str) -> tuple[int, str]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    rank, _, message = text.partition("\n")
    return int(rank), message
