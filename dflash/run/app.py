"""What the DFlash stages share at run time (handed to csp as the Runtime's ``app``): the
resolved options and the run's resources, nothing read from the graph file by a stage."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dflash.observe.metrics_writer import MetricsLog
from dflash.run.resolve import Resolved

__all__ = ["ResumeState", "RunApp", "RunProgress"]


@dataclass
class ResumeState:
    """Where this run starts (:mod:`dflash.checkpoint.resume` chose it).

    Attributes:
        start_step: drafter steps already done (0 for a fresh run).
        path: the checkpoint resumed from, or None.
        train_state: that checkpoint's ``train_state.pt`` contents, or None.
        weights: its verified ``model.safetensors`` tensors (CPU), or None; taken by the drafter
            stage (:meth:`take_weights`) so the memory goes once the parameters hold them.
        lineage: the lineage id written into this run's checkpoints (:mod:`dflash.checkpoint.resume`).
    """

    start_step: int = 0
    path: Path | None = None
    train_state: dict[str, Any] | None = None
    weights: dict[str, Any] | None = None
    lineage: str | None = None

    def take_weights(self) -> dict[str, Any] | None:
        """The resumed weights, once (later calls get None)."""
        weights, self.weights = self.weights, None
        return weights


@dataclass
class RunProgress:
    """What the stages did, as they go (each attribute written by one stage), for the run's ``end``
    record and closing summary: the metrics windows lag behind, and an abort or a failure drops
    the windows still in flight, so they cannot say how far training got.

    Attributes:
        step: the drafter's last finished step (counted over the whole run; skipped steps count),
            None before the first step of this process.
        unevaluated: the newest snapshot step whose held-out evaluation a stop cut short or never
            started (the evaluator stage), None when every evaluation ran.
        best: ``(step, tau)`` of the best held-out evaluation so far (the evaluator stage), which
            ``[checkpoint].keep_best`` keeps the checkpoint of; None before the first.
    """

    step: int | None = None
    unevaluated: int | None = None
    best: tuple[int, float] | None = None


@dataclass
class RunApp:
    """Run-wide objects built once by ``dflash.run`` before the graph starts.

    Attributes:
        resolved: the checked config and each stage's options (:class:`dflash.run.resolve.Resolved`).
        run_dir: the run directory.
        sampler: the data sampler, already positioned at the first batch to train (after resume).
        metrics: the run's ``metrics.jsonl`` writer (shared by monitor, drafter, checkpointer).
        resume: where the run starts (:class:`ResumeState`).
        clock: monotonic seconds for ``[run].time_budget_s`` (a test injects a fake one).
        budget_reached: set by the drafter stage when ``[run].time_budget_s`` ends training; the
            prefetch stage then sends no more batches and the graph drains as for a finished run
            (thread-safe; one process only, which is why torchrun refuses the budget).
        budget_end: the closing summary's line about the budget, set by the drafter stage, or None.
        budget_end_at: ``time.perf_counter()`` when the budget ended training, or None.
        schedule_end: under ``[run].time_budget_s``, the step where the drafter stage last moved
            the schedule's end (where the measured step rate meets the deadline), for the display's
            progress and ETA; None without a budget or before its first estimate.
        progress: how far the stages got (:class:`RunProgress`).
    """

    resolved: Resolved
    run_dir: Path
    sampler: Any
    metrics: MetricsLog
    resume: ResumeState
    clock: Callable[[], float] = time.monotonic
    budget_reached: threading.Event = field(default_factory=threading.Event)
    budget_end: str | None = None
    budget_end_at: float | None = None
    schedule_end: int | None = None
    progress: RunProgress = field(default_factory=RunProgress)

    def step_of(self, seq: int) -> int:
        """The drafter step (1-based, counted over the whole run) that trains the batch with
        ``Batch.seq == seq``: data-parallel drafter replicas take one batch each per step."""
        return self.resume.start_step + seq // self.resolved.prefetch.drafters + 1

    @property
    def last_step(self) -> int:
        """The last finished drafter step: this process's, or the resumed one before its first."""
        return self.resume.start_step if self.progress.step is None else self.progress.step

    @property
    def steps_to_run(self) -> int:
        """Batches still to train in this process (``[run].steps`` minus steps already done)."""
        return max(self.resolved.trainer.total_steps - self.resume.start_step, 0)
