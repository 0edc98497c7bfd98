"""The graph file's ``[checkpoint]`` table, and the size of one checkpoint on disk.

The writer (:mod:`dflash.checkpoint.writer`) owns these settings: how often it saves and how many
complete, healthy checkpoints it keeps. :func:`checkpoint_bytes` is what the run's disk-space
warning compares the free space against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from dflash.tables import NonNegInt, PositiveInt, Table, added_later

if TYPE_CHECKING:  # a type only: the reports that read a run directory import this room without the models
    from dflash.model.drafter_config import DrafterConfig

__all__ = ["CheckpointSection", "checkpoint_bytes"]



class CheckpointSection(Table):
    """``[checkpoint]``: how often and how many."""

    every: NonNegInt = 100
    """Save every N steps (0 = only at the end)."""
    keep_last: PositiveInt = 3
    """Keep the newest K complete healthy checkpoints."""
    keep_best: Annotated[bool, added_later(False, hashed=False)] = True
    """Also keep the checkpoint of the step whose held-out evaluation measured the best tau so far
    (``[eval]``), when one was written at that step (make ``eval.every`` a multiple of ``every``): a
    drafter that overfits small data ends worse than it was, and this is the one to export. At most
    one checkpoint more on disk."""


def checkpoint_bytes(drafter: DrafterConfig) -> int:
    """Expected size of one checkpoint of a resolved drafter, in bytes: its parameters (``fc``, the
    layers' attention, MLP and norms, the final norms) in fp32, plus AdamW's two fp32 moments."""
    H, n, k = drafter.hidden_size, drafter.num_layers, len(drafter.target_layer_ids)
    q, kv = drafter.num_attention_heads * drafter.head_dim, drafter.num_key_value_heads * drafter.head_dim
    layer = H * q * 2 + H * kv * 2 + 3 * H * drafter.intermediate_size + 2 * drafter.head_dim + 2 * H
    params = k * H * H + n * layer + 2 * H
    return params * 4 * 3
