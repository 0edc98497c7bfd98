"""What to change when a stage ran out of GPU memory: one line naming the settings that set the
failing stage's memory, with their present values, after the error line.

The memory of a training step grows with the tokens in a batch (``data.tokens_per_batch``: every
stage), the longest sequence (``data.max_length``: the target's attention and the packed rows), and
for the drafter the blocks trained per row (``train.num_anchors``) times its layers' activations,
which ``[drafter].activation_checkpointing`` trades for a second forward (docs/gpus.md).
"""

from __future__ import annotations

import torch

__all__ = ["out_of_memory_advice"]


def out_of_memory_advice(exc: BaseException, cfg) -> str | None:
    """The advice line for ``exc`` (a ``csp.ProcessFailed`` whose cause, or a cause of that, is
    ``torch.OutOfMemoryError``), or None when it is another failure.

    Args:
        exc: the failure the runtime raised; its ``process`` names the stage.
        cfg: the resolved run config (:class:`dflash.run.config.DFlashFile`).
    """
    cause, seen = exc.__cause__, 0
    while cause is not None and not isinstance(cause, torch.OutOfMemoryError) and seen < 16:
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    if not isinstance(cause, torch.OutOfMemoryError):
        return None
    d = cfg.data
    levers = [f"data.tokens_per_batch (now {d.tokens_per_batch:,})", f"data.max_length (now {d.max_length:,})"]
    stage = getattr(exc, "process", "") or "a stage"
    if stage.startswith("drafter"):
        if not cfg.drafter.activation_checkpointing:
            levers.insert(0, "[drafter].activation_checkpointing = true (a second forward of its layers)")
        levers.insert(1, f"train.num_anchors (now {cfg.train.num_anchors:,})")
    verb = "set" if levers[0].startswith("[") else "lower"
    return f"the GPU ran out of memory in {stage}: {verb} " + ", or lower ".join(levers)
