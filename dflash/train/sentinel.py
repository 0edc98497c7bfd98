"""Non-finite sentinel at channel boundaries (``[train].check_channels``, a debug switch).

Failure mode 2 of docs/failure-modes.md: a NaN nobody can localise. With the switch on, every stage checks the
floating-point tensors of each item it sends; the first non-finite value stops the run with an error
naming the producing process (e.g. ``target[1]``), the channel, the training step the batch was
for, the batch id and the tensor.

On CUDA there is no host synchronisation per tensor: one flag per tensor (``aminmax`` — a single
read pass that propagates NaN and shows ±Inf, measured 4x cheaper on an H200 than
``isfinite().all()``, which materialises a boolean copy) is stacked on the device, copied to pinned host memory asynchronously, and checked once its event
has completed — a later ``check`` (or :meth:`FiniteSentinel.flush`) raises. Detection is therefore
delayed by at most a few items on GPU, and immediate on CPU.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from csp.cuda.tensors import Index, iter_tensors


class NonFiniteError(RuntimeError):
    """Non-finite values where none may be; the message names where they first appeared."""


def _dotted(path: tuple, prefix: str = "") -> str:
    """``hidden.layers[2]`` for the path ``("hidden", "layers", Index(2))``; "tensor" for ``()``."""
    name = prefix
    for key in path:
        name = f"{name}[{key}]" if isinstance(key, Index) else f"{name}.{key}" if name else str(key)
    return name or "tensor"


def floating_tensors(item: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """``(dotted name, tensor)`` for every floating-point tensor in a Struct/dict/list item."""
    return [(_dotted(path, prefix), t) for path, t in iter_tensors(item, paths=True) if t.is_floating_point()]


def _finite_flag(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool tensor on ``t``'s device: True iff every element of ``t`` is finite."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)


class FiniteSentinel:
    """Checks items a process sends; a no-op when disabled.

    Args:
        producer: the process's qualified name (``target[0]``), used in the error.
        enabled: the ``[train].check_channels`` switch.
    """

    def __init__(self, producer: str, enabled: bool) -> None:
        self.producer = producer
        self.enabled = enabled
        self._pending: deque[tuple[Any, torch.Tensor, list[str], int, str, int | None]] = deque()
        self.checked = 0

    def check(self, item: Any, *, batch_id: int, channel: str, step: int | None = None) -> None:
        """Check ``item`` (about to be sent on ``channel``); ``step`` is the drafter step the batch
        is for (:meth:`dflash.run.app.RunApp.step_of`), named in the error.

        Raises:
            NonFiniteError: this item (CPU) or an earlier one (CUDA, checked asynchronously) holds a
                NaN or Inf.
        """
        if not self.enabled:
            return
        self._poll(block=False)
        named = floating_tensors(item)
        if not named:
            return
        names = [n for n, _ in named]
        flags = torch.stack([_finite_flag(t) for _, t in named])
        if not flags.is_cuda:
            self._verify(flags, names, batch_id, channel, step)
            return
        host = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(flags.device))  # the stream that ran the copy
        self._pending.append((event, host, names, batch_id, channel, step))

    def flush(self) -> None:
        """Wait for every pending asynchronous check (call once at the end of the stage)."""
        self._poll(block=True)

    def _poll(self, block: bool) -> None:
        while self._pending:
            event, host, names, batch_id, channel, step = self._pending[0]
            if block:
                event.synchronize()
            elif not event.query():
                return
            self._pending.popleft()
            self._verify(host, names, batch_id, channel, step)

    def _verify(self, flags: torch.Tensor, names: list[str], batch_id: int, channel: str,
                step: int | None) -> None:
        self.checked += 1
        ok = flags.tolist()
        if all(ok):
            return
        bad = [n for n, good in zip(names, ok) if not good]
        raise NonFiniteError(
            f"non-finite values first produced by {self.producer} on channel '{channel}' "
            f"({'' if step is None else f'step {step}, '}batch {batch_id}, tensor {', '.join(bad)}); "
            "upstream items were finite"
        )
