"""What the DFlash stages share at run time (handed to csp as the Runtime's ``app``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.config import DFlashFile
from dflash.metrics_writer import MetricsLog


@dataclass
class RunApp:
    """Run-wide objects built once by ``dflash.run`` before the graph starts.

    Attributes:
        cfg: the resolved graph file (``[target].vocab_size`` and ``[drafter].mask_token_id`` filled
            from the tokenizer).
        run_dir: the run directory.
        sampler: the data sampler, already positioned at the first batch to train (after resume).
        start_step: drafter steps already done (0 for a fresh run).
        resume_path: checkpoint being resumed from, or None.
        train_state: that checkpoint's ``train_state.pt`` contents, or None.
        metrics: the run's ``metrics.jsonl`` writer (shared by monitor, drafter, checkpointer).
        config_hash: hash of the resolved config (stored in checkpoints).
        drafter_cfg: the drafter config with the dimensions taken from the target.
        resume_weights: the resumed checkpoint's verified ``model.safetensors`` tensors (CPU), or None.
        lineage: the lineage id written into this run's checkpoints (``dflash.resume``).
    """

    cfg: DFlashFile
    run_dir: Path
    sampler: Any
    start_step: int
    resume_path: Path | None
    train_state: dict[str, Any] | None
    metrics: MetricsLog
    config_hash: str
    drafter_cfg: Any
    resume_weights: dict[str, Any] | None = None
    lineage: str | None = None

    def step_of(self, seq: int) -> int:
        """The drafter step (1-based, counted over the whole run) that trains the batch with
        ``Batch.seq == seq``: data-parallel drafter replicas take one batch each per step."""
        drafters = next((p.replicas for p in self.cfg.process if p.kind == "dflash.drafter"), 1)
        return self.start_step + seq // drafters + 1

    @property
    def steps_to_run(self) -> int:
        """Batches still to train in this process (``[run].steps`` minus steps already done)."""
        return max(self.cfg.run.steps - self.start_step, 0)
