"""The non-finite skip policy of the training step.

A step whose loss or gradient norm is not finite is skipped: no optimizer update, so the weights
*and* AdamW's moments and step count stay untouched (the schedule still advances; it follows
batches). The skip is counted and reported with the batch id; ``[train].max_nonfinite_streak``
consecutive skips stop the run with :class:`dflash.train.sentinel.NonFiniteError`, naming the last
checkpoint that can be trusted (:func:`last_trusted_checkpoint`).
"""

from __future__ import annotations

import math
from pathlib import Path

from dflash.checkpoint import is_healthy, list_checkpoints, mark_unhealthy, read_meta
from dflash.records import CheckpointRecord
from dflash.train.sentinel import NonFiniteError

__all__ = ["NonFiniteGuard", "last_trusted_checkpoint"]


class NonFiniteGuard:
    """Decides whether a step's update is applied and counts the skips.

    Attributes:
        max_streak: ``[train].max_nonfinite_streak``.
        streak: consecutive skipped steps up to the last one recorded.
        skipped_total: skipped steps of the whole run (a resumed run starts from its checkpoint's).
    """

    def __init__(self, max_streak: int, skipped_total: int = 0) -> None:
        self.max_streak = max_streak
        self.streak = 0
        self.skipped_total = skipped_total

    @staticmethod
    def reason(loss: float, grad_norm: float) -> str | None:
        """Why the step must be skipped (``"non-finite loss"``, ``"non-finite gradient"``), or None."""
        if not math.isfinite(loss):
            return "non-finite loss"
        if not math.isfinite(grad_norm):
            return "non-finite gradient"
        return None

    def record(self, reason: str | None) -> None:
        """Count one step: a skip (``reason`` set) extends the streak, an update ends it."""
        if reason is None:
            self.streak = 0
        else:
            self.streak += 1
            self.skipped_total += 1

    @property
    def exhausted(self) -> bool:
        """The streak reached ``max_streak``: the run must stop."""
        return self.streak >= self.max_streak

    def stop_error(self, *, step: int, batch_id: int, replica: int, reason: str,
                   last: Path | None) -> NonFiniteError:
        """The one-line error that stops the run, naming ``last`` (the checkpoint to resume from)."""
        return NonFiniteError(
            f"{self.streak} consecutive non-finite steps (last: step {step}, batch {batch_id} "
            f"from target[{replica}], {reason}); stopping. "
            + (f"Last healthy checkpoint: {last} (resume with --resume {last})" if last else
               "No healthy checkpoint was written yet.")
        )


def last_trusted_checkpoint(ckpt, *, step: int, streak: int, writer: bool) -> Path | None:
    """The newest healthy checkpoint to recommend when a non-finite streak stops the run.

    ``ckpt``: the run's :class:`dflash.checkpoint.Checkpointer`. When the streak began right after
    its last healthy checkpoint, that checkpoint's weights are what every later step failed on: it
    is marked unhealthy (if it is one of this run's and ``writer``; ``meta.json`` rewritten and a
    ``checkpoint`` record with ``demoted: true`` sent to ``ckpt.on_event``, i.e. metrics.jsonl) and
    the healthy one before it (same lineage) is named instead.
    """
    ckpt.wait()  # the last save's meta.json is on disk
    last = ckpt.last_healthy
    meta = read_meta(last) if last is not None else None
    first_bad = step - streak + 1
    if meta is None or meta.get("step") != first_bad - 1:
        return last
    if last.parent.resolve() != ckpt.root.resolve():
        return last  # another run's checkpoint (an explicit --resume PATH): not ours to mark
    if writer:
        reason = f"the {streak} steps after it ({first_bad}..{step}) were all non-finite: its weights are suspect"
        mark_unhealthy(last, reason)
        ckpt.on_event(CheckpointRecord(step=int(meta["step"]), path=str(last), healthy=False, reason=reason,
                                       demoted=True))  # metrics.jsonl agrees with meta.json
    older = [p for p in list_checkpoints(ckpt.root) if p.name < last.name and is_healthy(p)
             and (read_meta(p) or {}).get("lineage") == ckpt.lineage]
    return older[-1] if older else None
