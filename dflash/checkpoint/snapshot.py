"""What a checkpoint is made from: a :class:`Snapshot` of the trainer's state taken at a step, and
the rule that says whether it makes a healthy checkpoint.

A snapshot copies every tensor (device to pinned host memory, ordered by events), so the
trainer runs on while :class:`dflash.checkpoint.writer.Checkpointer` writes it in the background.
"""

from __future__ import annotations

import errno
import math
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from csp.cuda.tensors import map_tensors

__all__ = ["Snapshot", "health_reason", "is_disk_full", "snapshot_tree"]


def snapshot_tree(obj: Any, copy: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Copy every tensor in a nested dict/list/tuple structure with ``copy``; other leaves as is.
    Every container is a new one, so the snapshot shares no dict or list with the live state."""
    return map_tensors(copy, obj)



class Snapshot(msgspec.Struct, kw_only=True):
    """Host copies of everything one checkpoint holds (filled by :meth:`Checkpointer.save`)."""

    step: int
    batch_id: int
    loss: float
    window_steps: int = 0
    window_skipped: int = 0
    last_skipped: bool = False
    skipped_total: int = 0
    weights: dict[str, torch.Tensor]
    train_state: dict[str, Any]
    configs: dict[str, Any]
    ready: Any = None  # torch.cuda.Event when the D2H copy is asynchronous, else None
    device: Any = None  # the CUDA device the copy was made from
    started: float = 0.0


def is_disk_full(exc: BaseException) -> bool:
    """True for "no space left on device" (or a quota): an ``OSError`` with ``ENOSPC``/``EDQUOT``,
    or safetensors' own error, which carries the OS error only in its text (``code: 28``)."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(exc)
    return "No space left on device" in text or "StorageFull" in text or f"code: {errno.ENOSPC}," in text


def health_reason(snap: Snapshot) -> str | None:
    """Why a snapshot is not a healthy checkpoint (see the module docstring), or None if it is."""
    if snap.last_skipped:
        return (f"its step {snap.step} was skipped as non-finite, with {snap.window_skipped} of the "
                f"{snap.window_steps} steps since the previous checkpoint")
    if not math.isfinite(snap.loss):
        return f"the mean loss of the {snap.window_steps} steps since the previous checkpoint is not finite"
    return None
