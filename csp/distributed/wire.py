"""Messages between two ranks: one *lane* per direction, framed control bytes plus raw tensors.

A lane ``src -> dst`` is used by exactly one thread on each side (a :class:`LaneWriter` on
``src``, a :class:`LaneReader` on ``dst``), over its own 2-rank process groups, so the order of
point-to-point calls always matches on both ends (NCCL requires it; gloo matches by order too):

1. one control *frame*: ``FRAME`` (4 KiB) uint8 bytes sent over a gloo group. Its first 8 bytes
   are the length ``n`` of the pickled message; if ``n > FRAME - 8`` the rest follows in a second
   gloo send of exactly the missing bytes;
2. then one send per tensor of the item (skipped for empty tensors), as flat ``uint8`` bytes: CPU
   tensors over the same gloo group, CUDA tensors over the lane's NCCL group.

The pickled message is ``(kind, link, seq, descriptors, body)``. ``body`` is the item pickled with
every ``torch.Tensor`` replaced by a persistent id (``pickle``'s ``persistent_id`` protocol): the
tensor goes over the data plane and ``descriptors`` holds ``(shape, dtype, is_cuda)`` for each,
so the reader can allocate the receive buffers before it unpickles. Structure, msgspec Structs and
Python values travel inside ``body``; tensors are never pickled. Non-contiguous tensors are sent
as contiguous copies; views of one storage arrive as separate tensors.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist

from csp.errors import DistError

__all__ = ["CLOSE", "CREDIT", "EOS", "FRAME", "GONE", "ITEM", "LaneReader", "LaneWriter", "decode", "encode"]

FRAME = 4096  # bytes of the fixed control frame (8-byte length + up to 4088 bytes of message)
ITEM, CREDIT, EOS, GONE, CLOSE = "item", "credit", "eos", "gone", "close"


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, tensors: list) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self.tensors[pid]


def encode(kind: str, link: int, seq: int | None, item: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Pickle a message; returns ``(message bytes, tensors to send after it, in order)``.

    Raises:
        pickle.PicklingError / TypeError: the item holds something that cannot be pickled (a
            lock, an open file, a lambda); send plain data, msgspec Structs and tensors.
    """
    tensors: list[torch.Tensor] = []
    buf = io.BytesIO()
    _Pickler(buf, tensors).dump(item)
    descs = [(tuple(t.shape), t.dtype, t.is_cuda) for t in tensors]
    msg = pickle.dumps((kind, link, seq, descs, buf.getvalue()), protocol=pickle.HIGHEST_PROTOCOL)
    return msg, tensors


def decode(body: bytes, tensors: list[torch.Tensor]) -> Any:
    """Undo the item part of :func:`encode` with the received ``tensors``."""
    return _Unpickler(io.BytesIO(body), tensors).load()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous copy of ``t`` (what goes over the wire)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class LaneWriter:
    """The sending end of lane ``rank -> peer`` (use from one thread only).

    Args:
        peer: the global rank on the other end.
        control: a gloo process group holding both ranks (control frames and CPU tensors).
        cuda: an NCCL process group holding both ranks, or None when CUDA tensors cannot be sent.
    """

    def __init__(self, peer: int, control: Any, cuda: Any = None) -> None:
        self.peer, self.control, self.cuda = peer, control, cuda
        self.frame = torch.zeros(FRAME, dtype=torch.uint8)
        self.bytes_sent = 0
        # CUDA tensors sent but maybe not yet read by NCCL: (event after the send, tensor). Kept
        # alive until the event completes, so the caching allocator cannot hand their memory out
        # while the NCCL stream still reads it (independent of the process group's own
        # record_stream policy).
        self.in_flight: list[tuple[Any, torch.Tensor]] = []

    def send(self, kind: str, link: int, seq: int | None = None, item: Any = None) -> None:
        """Send one message and its tensors (blocks until gloo/NCCL accepted them).

        Raises:
            DistError (a RuntimeError): the item holds CUDA tensors and the lane has no NCCL
                group. RuntimeError: the connection to the peer broke (torch.distributed's
                error, passed on).
        """
        msg, tensors = encode(kind, link, seq, item)
        n = len(msg)
        frame = self.frame
        frame[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
        head = min(n, FRAME - 8)
        frame[8:8 + head] = torch.frombuffer(bytearray(msg[:head]), dtype=torch.uint8)
        dist.send(frame, self.peer, group=self.control)
        if n > head:
            dist.send(torch.frombuffer(bytearray(msg[head:]), dtype=torch.uint8), self.peer, group=self.control)
        for t in tensors:
            if t.numel() == 0:
                continue
            if t.is_cuda:
                if self.cuda is None:
                    raise DistError(
                        f"a CUDA tensor {tuple(t.shape)} must cross to rank {self.peer} but no NCCL "
                        "group exists (torch.cuda not available or NCCL missing); move it to CPU first"
                    )
                raw = _as_bytes(t)
                dist.send(raw, self.peer, group=self.cuda)  # the current stream now waits on it
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(raw.device))
                self.in_flight = [(e, x) for e, x in self.in_flight if not e.query()]
                self.in_flight.append((ev, raw))
            else:
                dist.send(_as_bytes(t), self.peer, group=self.control)
            self.bytes_sent += t.nbytes


class LaneReader:
    """The receiving end of lane ``peer -> rank`` (use from one thread only).

    Args:
        peer: the global rank on the other end.
        control: the gloo process group of this lane.
        cuda: the NCCL process group of this lane, or None.
        device: where CUDA tensors are received (``torch.device("cuda:N")``), or None.
    """

    def __init__(self, peer: int, control: Any, cuda: Any = None, device: torch.device | None = None) -> None:
        self.peer, self.control, self.cuda, self.device = peer, control, cuda, device
        self.frame = torch.empty(FRAME, dtype=torch.uint8)

    def recv(self) -> tuple[str, int, int | None, Any]:
        """Block until the next message; returns ``(kind, link, seq, item)``.

        Raises:
            DistError (a RuntimeError): a CUDA tensor arrives on a lane without an NCCL group.
            RuntimeError: the connection to the peer broke (torch.distributed's, passed on).
        """
        frame = self.frame
        dist.recv(frame, self.peer, group=self.control)
        n = int(frame[:8].view(torch.int64)[0])
        head = min(n, FRAME - 8)
        msg = frame[8:8 + head].numpy().tobytes()
        if n > head:
            rest = torch.empty(n - head, dtype=torch.uint8)
            dist.recv(rest, self.peer, group=self.control)
            msg += rest.numpy().tobytes()
        kind, link, seq, descs, body = pickle.loads(msg)
        tensors = []
        for shape, dtype, is_cuda in descs:
            nbytes = _numel(shape) * _itemsize(dtype)
            if is_cuda:
                if self.cuda is None or self.device is None:
                    raise DistError(f"rank {self.peer} sent a CUDA tensor but this lane has no NCCL group")
                raw = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                group = self.cuda
            else:
                raw = torch.empty(nbytes, dtype=torch.uint8)
                group = self.control
            if nbytes:
                dist.recv(raw, self.peer, group=group)
            tensors.append(raw.view(dtype).reshape(shape))
        item = decode(body, tensors)
        return kind, link, seq, item


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
