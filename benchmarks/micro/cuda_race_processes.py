"""The processes and payloads of the CUDA race cases that ``cuda_races.py`` runs.

Each case (:data:`CASES`) is a two-process csp graph: :class:`Producer` -> :class:`Consumer` (with
acks back, so the producer's next forward is queued only after the consumer let go of the tensor)
or :class:`Loader` -> :class:`Checker` (pinned staging). Every process runs its case in the
``naive`` mode (the tensor wrapped in :class:`Hidden`, plain ``non_blocking`` copies, one pinned
buffer) or the ``csp`` one (channel, ``csp.cuda.handoff.to_device``, ``PinnedPool``), chosen by its
:class:`RaceOptions`, and records what it saw in the runtime's ``app`` dict. Building the graphs,
running both modes and the command line are ``cuda_races.py``'s.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from pathlib import Path
from typing import Any

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import csp  # noqa: E402
from csp.cuda import handoff as ccuda  # noqa: E402

CASES = {
    "d2h_unwaited_read": "GPU->pinned host copy behind a busy producer stream; a host thread reads the "
                         "copy at once (naive: non_blocking copy; csp: csp.cuda.handoff.to_device)",
    "d2h_source_freed": "a copier stream copies the tensor to the host late; the source is freed and "
                        "the producer's next forward reuses its block (naive: plain hand-off; csp: channel)",
    "h2d_pinned_reuse": "the loader refills its pinned staging memory while the H2D copy is queued "
                        "(naive: one pinned buffer; csp: PinnedPool, reuse only after the copy's event)",
    "forward_buffer_reuse": "a consumer stream reads the tensor late; the producer's next forward reuses "
                            "the freed block (naive: plain hand-off; csp: channel)",
    "cross_device": "producer on cuda:0 behind a busy stream, consumer on cuda:1 copies it over "
                    "(naive: plain hand-off + .to(); csp: channel + csp.cuda.handoff.to_device)",
}
SLOW_PRODUCER = {"d2h_unwaited_read", "cross_device"}  # the race is a read before the write finished
LIFETIME = {"d2h_source_freed", "forward_buffer_reuse", "cross_device"}  # the consumer lets go early
TIMEOUT_S = 30.0  # every hand-off in these graphs takes at most a few windows (milliseconds)


class Hidden:
    """Carries a tensor past csp's hand-off hooks, as a plain ``queue.Queue`` would (no event, no
    ``record_stream``): the ``naive`` side of every comparison."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __csp_nbytes__(self) -> int:  # the channel counts it without walking into it
        return self.tensor.nbytes


class Item(msgspec.Struct):
    """One trial's payload: ``data`` holds ``value`` in every element (a tensor or :class:`Hidden`)."""

    trial: int
    value: float
    data: Any


class RaceOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``case`` (a key of CASES), ``mode`` ("naive" | "csp"), ``trials``, ``numel`` (fp32 elements
    per tensor), ``cycles`` (GPU clock cycles of each deliberate delay; 0 off CUDA)."""

    case: str
    mode: str
    trials: int
    numel: int
    cycles: int = 0


# ---- small helpers (no-ops off CUDA, so the dry run walks the same code) ---------------------------
def _device(ctx: csp.Context) -> torch.device:
    return ctx.device if ctx.device is not None else torch.device("cpu")


def _busy(dev: torch.device, cycles: int) -> None:
    """Keep the current stream of ``dev`` busy for ``cycles`` GPU clock cycles (host returns at once)."""
    if dev.type == "cuda" and cycles > 0:
        torch.cuda._sleep(cycles)


def _event(dev: torch.device) -> Any:
    """An event recorded on the current stream of ``dev`` (None off CUDA)."""
    if dev.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(dev))
    return event


def _pinned(numel: int) -> torch.Tensor:
    return torch.empty(numel, pin_memory=torch.cuda.is_available())


def _holds(t: torch.Tensor, value: float) -> bool:
    """True if every element equals ``value`` (a GPU tensor: syncs the current stream only)."""
    return bool((t == value).all())


def sanitizer_mode() -> Any:
    """CSAN's dispatch mode for the calling thread when ``TORCH_CUDA_SANITIZER`` is on.

    The sanitizer sees only kernels launched by threads with its mode on their (thread-local)
    dispatch stack; ``TORCH_CUDA_SANITIZER=1`` enables it for the importing thread only, so each
    process thread enters it here. A no-op context otherwise.
    """
    san = sys.modules.get("torch.cuda._sanitizer")
    if san is None or not san.cuda_sanitizer.enabled:
        return contextlib.nullcontext()
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    mode = san.cuda_sanitizer.dispatch
    return contextlib.nullcontext() if mode in _get_current_dispatch_mode_stack() else mode


# ---- the processes --------------------------------------------------------------------------------
class Producer(csp.Process):
    """Per trial: a tensor filled with ``trial + 1`` on this stream, handed off; once the consumer
    has queued its read and let go (``acks``), the next forward allocates a same-sized output and
    fills it with -1 (the caching allocator hands it the freed block unless something holds it)."""

    Options = RaceOptions
    inputs = {"acks": int}
    outputs = {"items": Item, "forwards": int}
    sends_first = True  # starts the items -> acks handshake (csp.graph rejects an unfed cycle)

    def run(self, inputs, outputs):
        o, dev = self.options, _device(self.ctx)
        reused = 0
        with sanitizer_mode():
            for i in range(o.trials):
                value = float(i + 1)
                if o.case in SLOW_PRODUCER:
                    _busy(dev, o.cycles)  # this forward is still running when the hand-off happens
                x = torch.full((o.numel,), value, device=dev)
                ptr = x.data_ptr()
                if o.case == "d2h_unwaited_read":
                    if o.mode == "csp":
                        data = ccuda.to_device(x, "cpu")  # readable when it returns
                    else:
                        data = _pinned(o.numel)
                        data.copy_(x, non_blocking=True)
                else:
                    data = x if o.mode == "csp" else Hidden(x)
                del x
                outputs["items"].send(Item(i, value, data))
                del data
                inputs["acks"].receive(timeout=TIMEOUT_S)  # the consumer queued its read, let go
                z = torch.full((o.numel,), -1.0, device=dev)  # the next forward's output
                reused += z.data_ptr() == ptr
                del z
                outputs["forwards"].send(i)
                inputs["acks"].receive(timeout=TIMEOUT_S)  # checked
                if dev.type == "cuda":
                    torch.cuda.current_stream(dev).synchronize()  # harness only: independent trials
        self.ctx.app["block_reused"] = reused


class Consumer(csp.Process):
    """Per trial: receives the tensor, queues its (late) read, drops its last reference, lets the
    producer run its next forward, then checks what it read."""

    Options = RaceOptions
    inputs = {"items": Item, "forwards": int}
    outputs = {"acks": int}

    def run(self, inputs, outputs):
        o = self.options
        corrupted = released = 0
        with sanitizer_mode():
            for item in inputs["items"]:
                value = item.value
                x = item.data.tensor if isinstance(item.data, Hidden) else item.data
                del item
                ok = None
                if o.case == "d2h_unwaited_read":
                    ok = _holds(x, value)  # a host tensor: read at once, as any CPU consumer would
                    out = event = None
                else:
                    out, event = self._read(x)
                ref = weakref.ref(x)
                del x
                released += ref() is None  # the block is back with the allocator before the read ran
                outputs["acks"].send(0)
                inputs["forwards"].receive(timeout=TIMEOUT_S)  # the next forward is queued
                if out is not None:
                    if event is not None:
                        event.synchronize()
                    ok = _holds(out, value)
                corrupted += not ok
                outputs["acks"].send(1)
        self.ctx.app.update(corrupted=corrupted, released=released)

    def _read(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Queue this case's read of ``x``: ``(result, event to wait on before reading it | None)``."""
        o, dev = self.options, _device(self.ctx)
        if o.case == "d2h_source_freed":
            host = _pinned(o.numel)
            _busy(dev, o.cycles)  # the copier stream is still busy with earlier copies
            host.copy_(x, non_blocking=True)
            return host, _event(dev)
        if o.case == "forward_buffer_reuse":
            _busy(dev, o.cycles)  # the consumer's previous kernels are still running
            return x.clone(), None
        if o.case == "cross_device":
            return (ccuda.to_device(x, dev) if o.mode == "csp" else x.to(dev, non_blocking=True)), None
        raise ValueError(f"unknown case {o.case!r}; known: {sorted(CASES)}")


class Loader(csp.Process):
    """h2d_pinned_reuse: stages each item in pinned memory, copies it to the GPU behind a busy
    stream, sends it, and at once stages the next item (-1) in the same pinned memory (naive) or in
    whatever the PinnedPool hands out (csp: only a buffer whose copy has finished)."""

    Options = RaceOptions
    outputs = {"items": Item}

    def run(self, inputs, outputs):
        o, dev = self.options, _device(self.ctx)
        nbytes = 4 * o.numel
        pool = single = None
        if o.mode == "csp":  # room for exactly one buffer: every reuse has to wait for its copy
            pool = ccuda.PinnedPool(max_bytes=max(ccuda.PinnedPool.MIN_BYTES, 1 << (nbytes - 1).bit_length()))
        else:
            single = _pinned(o.numel)  # one staging buffer, refilled for every item
        with sanitizer_mode():
            for i in range(o.trials):
                value = float(i + 1)
                raw, stage = self._stage(pool, single, nbytes)
                stage.fill_(value)
                _busy(dev, o.cycles)  # earlier copies keep this stream busy
                if dev.type != "cuda":
                    g = stage.clone()  # dry run: a synchronous stand-in for the device copy
                elif o.mode == "csp":
                    g = ccuda.to_device(stage, dev)
                else:
                    g = stage.to(dev, non_blocking=True)
                if raw is not None:
                    pool.give(raw, after=_event(dev))
                outputs["items"].send(Item(i, value, g))
                del g
                raw, stage = self._stage(pool, single, nbytes)  # the next item, staged at once
                stage.fill_(-1.0)
                if raw is not None:
                    pool.give(raw)

    def _stage(self, pool: Any, single: Any, nbytes: int) -> tuple[Any, torch.Tensor]:
        if pool is None:
            return None, single
        raw = pool.take(nbytes)  # waits for the buffer's last copy if it must reuse it
        return raw, raw[:nbytes].view(torch.float32)


class Checker(csp.Process):
    """h2d_pinned_reuse: checks every item's GPU tensor (ordered after the copy by the channel)."""

    Options = RaceOptions
    inputs = {"items": Item}

    def run(self, inputs, outputs):
        corrupted = 0
        with sanitizer_mode():
            for item in inputs["items"]:
                corrupted += not _holds(item.data, item.value)
        self.ctx.app["corrupted"] = corrupted
