"""The control plane: one abort key in the torch.distributed store, watched by every rank.

The first rank to fail writes ``csp.dist/abort = "<rank>\\n<message>"`` with ``compare_set``, so
the first failure wins and later ones (consequences) are not reported as the cause. A watcher
thread on every rank polls the key (``store.check``, every ``interval_s``) and calls back with
the failing rank and its message; the launcher then aborts the local runtime and bridges. Each
rank that saw the key bumps ``csp.dist/acks``; before exiting after a failure a rank waits (a
bounded time) until every other rank has seen it, so that the rank hosting the store (rank 0
outside torchrun) does not take the message down with it.

Nothing here blocks for long: ``check``/``get``/``add``/``compare_set`` are single store round
trips, and a store that stops answering (its host rank died) is itself reported as a failure.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

__all__ = ["Control"]

ABORT_KEY = "csp.dist/abort"
ACK_KEY = "csp.dist/acks"


class Control:
    """Abort reporting and watching for one rank.

    Args:
        store: the ``torch.distributed`` store shared by all ranks (TCPStore).
        rank: this rank.
        world_size: number of ranks.
    """

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.seen: tuple[int, str] | None = None  # (rank, message) of the winning failure

    def report(self, message: str) -> tuple[int, str]:
        """Publish this rank's failure unless another was published first.

        Returns:
            ``(rank, message)`` of the failure that won (this one, or the earlier one).
        """
        value = f"{self.rank}\n{message}"
        try:
            got = self.store.compare_set(ABORT_KEY, "", value)
        except Exception:  # the store is gone: nobody can be told; keep our own message
            got = value.encode()
        won = _parse(got)
        if self.seen is None:
            self.seen = won
        return won

    def watch(self, on_abort: Callable[[int, str], None], interval_s: float = 0.05) -> None:
        """Start the watcher thread: ``on_abort(rank, message)`` once another rank reports
        (rank ``-1`` if the store itself became unreachable)."""

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    if not self.store.check([ABORT_KEY]):
                        continue
                    rank, message = _parse(self.store.get(ABORT_KEY))
                    if self.seen is None:
                        self.seen = (rank, message)  # before the ack: the store host may then leave
                    if rank != self.rank:  # acks count the ranks other than the failing one
                        self.store.add(ACK_KEY, 1)
                except Exception as exc:
                    if self._stop.is_set():
                        return
                    rank, message = -1, f"lost the torch.distributed store (did rank 0 die?): {exc!r}"
                    if self.seen is None:
                        self.seen = (rank, message)
                if rank != self.rank:
                    on_abort(rank, message)
                return

        self._thread = threading.Thread(target=loop, name="csp.dist.watch", daemon=True)
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
