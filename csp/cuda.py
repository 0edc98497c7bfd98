"""Event-ordered tensor hand-off between CUDA streams, copy-stream device moves, pinned pools.

Channels call :func:`outbound` in ``send`` and :func:`inbound` in ``receive``; user code never
does. The protocol (the CUDA caching-allocator rules from the PyTorch "CUDA semantics" notes):

1. ``outbound(item)`` walks the item once (msgspec Structs, dicts, lists, tuples) summing tensor
   ``nbytes``. If it holds CUDA tensors, it records one ``torch.cuda.Event`` per device on the
   sending thread's current stream for that device and wraps the item in a :class:`Handoff`.
2. ``inbound(payload)`` unwraps it: the receiving thread's current stream waits on each event
   (``Stream.wait_event``: a device-side wait, the host never blocks) and every CUDA tensor gets
   ``tensor.record_stream(receiver_stream)``, so the allocator does not hand the producer's memory
   to anyone else until the receiver's queued work on it is done.

No ``synchronize()`` anywhere on this path. Items without tensors cost one type lookup; torch is
never imported here (it is looked up in ``sys.modules``, so a channel that never sees a tensor
works without torch installed).
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec

__all__ = ["Handoff", "inbound", "item_nbytes", "outbound"]

# Leaf types that can hold no tensor: the walk stops at once on them.
_ATOMS = frozenset({int, float, str, bytes, bool, type(None), complex, bytearray})
_MAX_DEPTH = 16  # nesting limit of the walk: guards against self-referencing containers


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


def _walk(obj: Any, tensor_type: type | None, cuda: list, depth: int) -> int:
    """Sum tensor bytes in ``obj``; append CUDA tensors to ``cuda``."""
    t = type(obj)
    if t in _ATOMS:
        return 0
    if tensor_type is not None and isinstance(obj, tensor_type):
        if obj.is_cuda:
            cuda.append(obj)
        return obj.nbytes
    size = getattr(t, "__csp_nbytes__", None)
    if size is not None:
        return int(size(obj))
    if depth >= _MAX_DEPTH:
        return 0
    depth += 1
    if isinstance(obj, msgspec.Struct):
        return sum(_walk(getattr(obj, f), tensor_type, cuda, depth) for f in t.__struct_fields__)
    if isinstance(obj, dict):
        return sum(_walk(v, tensor_type, cuda, depth) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_walk(v, tensor_type, cuda, depth) for v in obj)
    return 0


def item_nbytes(item: Any) -> int:
    """Bytes an item carries, as channels count them in ``bytes_moved``.

    Tensors count ``nbytes`` (walked through msgspec Structs, dicts, lists and tuples, at most 16
    levels deep); an object whose class defines ``__csp_nbytes__(self) -> int`` counts that; any
    other object counts 0.
    """
    torch = sys.modules.get("torch")
    return _walk(item, torch.Tensor if torch is not None else None, [], 0)


def outbound(item: Any) -> tuple[int, Any]:
    """Prepare ``item`` for a channel: returns ``(nbytes, payload)``.

    ``payload`` is ``item`` itself unless the item holds CUDA tensors; then it is a
    :class:`Handoff` carrying an event recorded on the current stream of each device involved.
    """
    if type(item) in _ATOMS:
        return 0, item
    torch = sys.modules.get("torch")
    cuda: list = []
    nbytes = _walk(item, torch.Tensor if torch is not None else None, cuda, 0)
    if not cuda:
        return nbytes, item
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
