"""Event-ordered tensor hand-off between CUDA streams, device moves, a bounded pinned-buffer pool.

Channels call :func:`outbound` in ``send`` and :func:`inbound` in ``receive``; user code never
does. The protocol (the CUDA caching-allocator rules from the PyTorch "CUDA semantics" notes):

1. ``outbound(item)`` walks the item once (msgspec Structs, dicts, lists, tuples) summing tensor
   ``nbytes``. If it holds CUDA tensors, it records one ``torch.cuda.Event`` per device on the
   sending thread's current stream for that device and wraps the item in a :class:`Handoff`.
2. ``inbound(payload)`` unwraps it: the receiving thread's current stream waits on each event
   (``Stream.wait_event``: a device-side wait, the host never blocks) and every CUDA tensor gets
   ``tensor.record_stream(receiver_stream)``, so the allocator does not hand the producer's memory
   to anyone else until the receiver's queued work on it is done.

The event is recorded whenever the item holds CUDA tensors, also on the default stream: the
receiver may run on another (non-blocking) stream, and an event costs a few microseconds.
No ``synchronize()`` anywhere on this path. Items without tensors cost one type lookup; torch is
never imported here (it is looked up in ``sys.modules``, so a channel that never sees a tensor
works without torch installed).

:func:`to_device` moves every tensor of an item to a device by the cheapest correct route, and
:class:`PinnedPool` bounds the page-locked host memory used to stage copies through the host.
"""

from __future__ import annotations

import sys
import threading
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any

from csp.cuda.tensors import ATOMS, iter_tensors, map_tensors
from csp.errors import PinnedPoolError, PinnedPoolTimeout

if TYPE_CHECKING:  # never imported at run time: torch is looked up in sys.modules
    import torch

__all__ = ["Handoff", "PinnedPool", "inbound", "item_nbytes", "outbound", "to_device"]

_MAX_DEPTH = 16  # nesting limit of the walk: guards against self-referencing containers


def _sized(obj: Any) -> bool:
    """An object whose class counts its own bytes (``__csp_nbytes__``): not walked into."""
    return getattr(type(obj), "__csp_nbytes__", None) is not None


class Handoff:
    """A channel payload holding CUDA tensors plus the events that order their use.

    Attributes:
        item: the user's item, unchanged.
        tensors: the CUDA tensors found in ``item``.
        events: ``[(event, producer_stream)]``, one per device the tensors live on.
    """

    __slots__ = ("item", "tensors", "events")

    def __init__(self, item: Any, tensors: list, events: list) -> None:
        self.item = item
        self.tensors = tensors
        self.events = events


def _walk(obj: Any, cuda: list) -> int:
    """Sum tensor bytes in ``obj``; append CUDA tensors to ``cuda``."""
    n = 0
    for x in iter_tensors(obj, max_depth=_MAX_DEPTH, opaque=_sized):
        if _sized(x):
            n += int(type(x).__csp_nbytes__(x))
        else:
            if x.is_cuda:
                cuda.append(x)
            n += x.nbytes
    return n


def item_nbytes(item: Any) -> int:
    """Bytes an item carries, as channels count them in ``bytes_moved``.

    Tensors count ``nbytes`` (walked through msgspec Structs, dicts, lists and tuples, at most 16
    levels deep); an object whose class defines ``__csp_nbytes__(self) -> int`` counts that; any
    other object counts 0.
    """
    return _walk(item, [])


def outbound(item: Any) -> tuple[int, Any]:
    """Prepare ``item`` for a channel: returns ``(nbytes, payload)``.

    ``payload`` is ``item`` itself unless the item holds CUDA tensors; then it is a
    :class:`Handoff` carrying an event recorded on the current stream of each device involved.
    """
    if type(item) in ATOMS:
        return 0, item
    cuda: list = []
    nbytes = _walk(item, cuda)
    if not cuda:
        return nbytes, item
    torch = sys.modules["torch"]
    events = []
    for device in {t.device for t in cuda}:
        stream = torch.cuda.current_stream(device)
        event = torch.cuda.Event()
        event.record(stream)
        events.append((event, stream))
    return nbytes, Handoff(item, cuda, events)


def inbound(payload: Any) -> Any:
    """Undo :func:`outbound` on the receiving thread; returns the user's item.

    For a :class:`Handoff`: the receiver's current stream on each device waits on the producer's
    event (skipped when it is the producer's stream), and each CUDA tensor is marked as used by the
    receiver's stream (``record_stream``) so its memory outlives the receiver's queued kernels.
    """
    if type(payload) is not Handoff:
        return payload
    torch = sys.modules["torch"]
    producer = {}
    for event, stream in payload.events:
        here = torch.cuda.current_stream(stream.device)
        producer[stream.device] = stream
        if here != stream:
            here.wait_event(event)
    for tensor in payload.tensors:
        here = torch.cuda.current_stream(tensor.device)
        if here != producer[tensor.device]:
            tensor.record_stream(here)
    return payload.item


# ---- device moves -------------------------------------------------------------------------------
def to_device(item: Any, device: torch.device | str, stream: torch.cuda.Stream | None = None, via_host: bool = False,
              pool: PinnedPool | None = None) -> Any:
    """A copy of ``item`` with every tensor on ``device``; tensors already there are kept by
    reference (a tensor that came through a channel was already ordered by its event).

    Routes (no ``synchronize()`` on any of them):

    * host -> GPU: ``non_blocking`` copy (asynchronous from pinned memory; the caching host
      allocator keeps a pinned source alive until the copy has run).
    * GPU -> other GPU: a peer copy; PyTorch orders it after the source device's current stream and
      makes that stream wait for it, so the source is neither read early nor freed early.
      With ``via_host=True`` it is staged through a pinned buffer from ``pool`` instead: D2H on the
      source stream, an event, H2D on the destination stream after that event; the buffer goes
      back to the pool once the H2D has run (event-tracked).
    * GPU -> host: copied into freshly pinned memory; the call waits for *these* copies' events
      (not the device) so the returned tensors are readable at once.

    Args:
        item: a tensor, or Structs / dicts / lists / tuples holding tensors (other leaves are kept).
        device: target ``torch.device`` or string ("cuda:1", "cpu").
        stream: a CUDA stream on the destination device to issue host->GPU and GPU->GPU copies on
            (a copy stream). It first waits for the destination's current stream; afterwards the
            current stream waits for it, and the new tensors are marked used by the current stream.
            None issues copies on the current stream.
        via_host: stage GPU->GPU copies through pinned host memory (when peer access is slow or
            absent).
        pool: the pinned pool for ``via_host`` staging (default: a module-wide 1 GiB pool).

    Returns: the item with tensors moved (the same object if nothing had to move).
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return item  # no torch loaded: the item holds no tensor
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    host_waits: list = []
    copy_stream = stream
    current = torch.cuda.current_stream(device) if device.type == "cuda" else None
    if copy_stream is not None and current is not None and copy_stream != current:
        copy_stream.wait_stream(current)
    else:
        copy_stream = None

    def move(t):
        if t.device == device:
            return t
        if device.type == "cpu":  # GPU -> host
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            host_waits.append(event)
            return out
        if t.is_cuda and via_host:
            return _staged(torch, t, device, copy_stream or current, pool or _default_pool())
        if copy_stream is None:
            return t.to(device, non_blocking=True)
        with torch.cuda.stream(copy_stream):
            out = t.to(device, non_blocking=True)
        if t.is_cuda:
            t.record_stream(copy_stream)
        out.record_stream(current)
        return out

    out = map_tensors(move, item, max_depth=_MAX_DEPTH, share_unchanged=True)
    if copy_stream is not None:
        current.wait_stream(copy_stream)
    for event in host_waits:
        event.synchronize()  # waits for this copy only: the host is about to read the result
    return out


def _staged(torch: ModuleType, t: torch.Tensor, device: torch.device, dst_stream: torch.cuda.Stream,
            pool: PinnedPool) -> torch.Tensor:
    """GPU ``t`` -> pinned staging buffer -> ``device``, ordered by events on both streams."""
    src_stream = torch.cuda.current_stream(t.device)
    buf = pool.take(t.nbytes)
    stage = buf[: t.nbytes].view(t.dtype).view(t.shape)
    stage.copy_(t, non_blocking=True)  # on the source's current stream
    d2h = torch.cuda.Event()
    d2h.record(src_stream)
    dst_stream.wait_event(d2h)
    with torch.cuda.stream(dst_stream):
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
        out.copy_(stage, non_blocking=True)
    h2d = torch.cuda.Event()
    h2d.record(dst_stream)
    pool.give(buf, after=h2d)
    current = torch.cuda.current_stream(device)
    if dst_stream != current:
        out.record_stream(current)
    return out


# ---- pinned staging buffers -----------------------------------------------------------------------
class PinnedPool:
    """A bounded pool of page-locked host buffers for staging copies (plain memory without CUDA).

    ``take(nbytes)`` returns a 1-D ``uint8`` buffer of at least ``nbytes`` (sizes are rounded up to a
    power of two, at least 64 KiB, so buffers are reused across similar requests); ``give(buf,
    after=event)`` returns it, to be reused only once ``event`` (the last copy reading or writing
    it) has completed. At most ``max_bytes`` are allocated at any time: when the pool is full, a
    request reuses or frees a returned buffer (waiting for its event if it must), and otherwise
    waits until a buffer is given back.

    Raises:
        PinnedPoolError (a ValueError): a request larger than ``max_bytes`` (raise ``max_bytes``).
        PinnedPoolTimeout (a TimeoutError): no buffer came back within ``timeout`` seconds (a leak: a buffer not given
            back, or ``max_bytes`` too small for the copies in flight).
    """

    MIN_BYTES = 1 << 16

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        if max_bytes < self.MIN_BYTES:
            raise PinnedPoolError(f"PinnedPool max_bytes must be >= {self.MIN_BYTES}, got {max_bytes}")
        self.max_bytes = max_bytes
        self.allocated = 0  # bytes held by the pool, taken or free
        self._free: list[tuple[Any, Any]] = []  # (buffer, event | None), oldest first
        self._cond = threading.Condition()

    def take(self, nbytes: int, timeout: float | None = 60.0) -> Any:
        """A buffer of at least ``nbytes`` (see the class doc)."""
        torch = sys.modules["torch"]
        size = max(self.MIN_BYTES, 1 << max(0, int(nbytes) - 1).bit_length())
        if size > self.max_bytes:
            raise PinnedPoolError(
                f"PinnedPool: a {nbytes}-byte buffer exceeds the pool's max_bytes={self.max_bytes}; "
                "raise max_bytes"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                pick = self._pick(size)
                if pick is not None:
                    buf, event = pick
                    break
                if self.allocated + size <= self.max_bytes:
                    self.allocated += size
                    buf, event = None, None
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise PinnedPoolTimeout(
                        f"PinnedPool: no {size}-byte buffer free within {timeout} s; all "
                        f"{self.allocated} bytes are taken (a buffer not given back?)"
                    )
                self._cond.wait(left)
        if event is not None:
            event.synchronize()  # the last copy on this buffer: rarely still running
        if buf is None:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return buf

    def _pick(self, size: int) -> tuple[Any, Any] | None:
        """Under the lock: a free buffer of ``size``, or None (then allocate if there is room)."""
        for i, (b, event) in enumerate(self._free):
            if b.numel() == size and (event is None or event.query()):
                return self._free.pop(i)
        if self.allocated + size <= self.max_bytes:
            return None
        keep = []
        for b, event in self._free:  # drop free buffers of other sizes, oldest first, for room
            if b.numel() != size and self.allocated + size > self.max_bytes:
                if event is not None:
                    event.synchronize()
                self.allocated -= b.numel()
            else:
                keep.append((b, event))
        self._free = keep
        if self.allocated + size <= self.max_bytes:
            return None
        for i, (b, _) in enumerate(self._free):
            if b.numel() == size:
                return self._free.pop(i)  # a copy may still use it: take() waits for its event
        return None

    def give(self, buf: Any, after: Any = None) -> None:
        """Return ``buf``; it is reused only once ``after`` (a ``torch.cuda.Event``) completed."""
        with self._cond:
            self._free.append((buf, after))
            self._cond.notify()


_POOL: PinnedPool | None = None
_POOL_LOCK = threading.Lock()


def _default_pool() -> PinnedPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = PinnedPool()
        return _POOL
