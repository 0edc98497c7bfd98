"""``dflash.drafter``: the stage that trains the drafter; glue around :mod:`dflash.train.step`.

Per batch: :func:`dflash.train.step.train_step` (loss, backward, clip, the one host read, the
non-finite skip, AdamW, schedule), then the stop rule: ``[train].max_nonfinite_streak``
consecutive skips stop the run, naming the last healthy checkpoint
(:func:`dflash.train.nonfinite.last_trusted_checkpoint`). Every ``[checkpoint].every`` steps a background
checkpoint (:mod:`dflash.checkpoint`); its ``meta.json`` carries the mean loss of the steps since
the previous checkpoint, and a checkpoint saved while a non-finite streak runs is marked unhealthy.
When the input ends (the data is exhausted, or a graceful stop drained the graph) a final
checkpoint is written and waited for. Where the graph connects the ``snapshots`` output (an
in-training evaluator, ``[eval]``), a copy of the weights goes there every ``[eval].every`` steps
without waiting (dropped, and counted, while the evaluator is busy) and after the last step
(waited for, so the final weights are evaluated, unless the run is stopping:
:mod:`dflash.run.stages.evaluator`). Each finished step is counted in the app's
:class:`~dflash.run.app.RunProgress`, which the run's end record and summary read.

With ``[run].time_budget_s`` (:mod:`dflash.train.budget`) the schedule's end follows the measured
step rate after every step; when the budget is spent the stage sets ``RunApp.budget_reached`` (the
prefetch stage sends no more batches), drains the batches already on their way without training
them, and ends as a finished run: final checkpoint, final snapshot.

Built from: :mod:`dflash.train.optim` (AdamW and schedule), :mod:`dflash.train.nonfinite` (the skip policy),
:mod:`dflash.train.state` (restore, the checkpoint window, ``train_state.pt``).
"""

from __future__ import annotations

import logging
import time
from typing import NotRequired, TypedDict

import torch

import csp
from csp.errors import WouldBlock
from dflash.checkpoint import TRAIN_CONFIG, Checkpointer
from dflash.checkpoint.init_from import load_init_from
from dflash.checkpoint.model_files import config_files
from dflash.messages import DrafterInput, DrafterSnapshot, StepMetrics
from dflash.run.app import RunApp
from dflash.run.options import DrafterStageOptions
from dflash.run.step_gate import StepGate
from dflash.train import parallel
from dflash.train.budget import TimeBudget
from dflash.train.nonfinite import NonFiniteGuard, last_trusted_checkpoint
from dflash.train.optim import make_optimizer
from dflash.train.state import (
    CheckpointWindow,
    newest_sampler_state,
    restore,
    train_state,
)
from dflash.train.step import train_step

__all__ = ["DrafterStage", "DrafterStageInputs", "DrafterStageOutputs"]

log = logging.getLogger("dflash.drafter")


class DrafterStageInputs(TypedDict):
    features: csp.Receiver[DrafterInput]


class DrafterStageOutputs(TypedDict):
    metrics: csp.Sender[StepMetrics]
    snapshots: NotRequired[csp.Sender[DrafterSnapshot]]  # wired only where the graph has an evaluator


@csp.register("dflash.drafter")
class DrafterStage(csp.Process[DrafterStageInputs, DrafterStageOutputs]):
    """Trains the DFlash drafter. Input ``features``: :class:`DrafterInput`; output ``metrics``:
    one :class:`StepMetrics` per step (skipped steps included); optional output ``snapshots``:
    :class:`DrafterSnapshot` for the in-training evaluator. Reads :class:`~dflash.run.options.DrafterStageOptions`,
    the app's run directory, metrics writer and resume state."""

    def setup(self) -> None:
        from dflash.model.drafter import DFlashDrafter
        from dflash.model.target import load_shared_head

        app: RunApp = self.ctx.app
        self.app, o, resume = app, app.resolved.trainer, app.resume
        self.opts: DrafterStageOptions = o
        self.device = self.ctx.device or torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.head = load_shared_head(o.target, self.device, torch.bfloat16 if self.cuda else torch.float32)
        # Seeded init from its own generator: the global RNG is shared with the other stages' threads.
        self.drafter = DFlashDrafter(o.drafter, seed=o.seed).to(self.device)  # fp32 master weights
        if o.train.init_from is not None:  # a warm start: weights only; optimizer and schedule start fresh
            if resume.path is None:
                n = load_init_from(self.drafter, o.train.init_from)
                log.info("init_from %s: %d tensors", o.train.init_from, n)
            else:
                log.info("init_from %s ignored: resuming %s, whose weights continue", o.train.init_from, resume.path)
        # DDP over the drafter replicas' ranks under torchrun (dflash.train.parallel); the module itself otherwise.
        self.model = parallel.wrap(self.drafter, self.ctx)
        self.optim = make_optimizer(self.drafter, o.train, o.total_steps)
        self.guard = NonFiniteGuard(o.train.max_nonfinite_streak)
        self.step = resume.start_step
        if resume.path is not None:
            self.guard.skipped_total = restore(self.drafter, self.optim, resume, o.train, self.ctx, self.device)
        self.ckpt = Checkpointer(
            app.run_dir / "checkpoints",
            keep_last=o.keep_last,
            config_hash=o.config_hash,
            on_event=app.metrics.write,
            lineage=resume.lineage,
            protect=(lambda: app.progress.best[0] if app.progress.best else None) if o.keep_best else None,
        )
        self.ckpt.last_healthy = resume.path
        if self.cuda and parallel.is_writer(self.ctx):
            # Page-lock the host buffers of the checkpoint copy now, not in the middle of training.
            like = {str(i): {"step": torch.zeros(()), "exp_avg": p, "exp_avg_sq": p}
                    for i, p in enumerate(self.optim.params)}
            self.ckpt.reserve(dict(self.drafter.state_dict()), {"optimizer": {"state": like}})
        self.window = CheckpointWindow()
        self.saved_step = -1
        # a batch of a new shape may compile: it runs alone, unless this replica is data-parallel (dflash.run.step_gate)
        self.gate = StepGate(name=self.ctx.qualname, data_parallel=parallel.unwrap(self.model) is not self.model)
        self.budget = None
        if o.time_budget_s is not None:
            self.budget = TimeBudget(o.time_budget_s, o.total_steps, clock=app.clock)
            self.budget_logged = 0
            log.info("time budget %g s: the schedule's end follows the measured step rate", o.time_budget_s)

    def run(self, inputs: DrafterStageInputs, outputs: DrafterStageOutputs) -> None:
        metrics = outputs["metrics"]
        every, total = self.opts.checkpoint_every, self.opts.total_steps
        eval_every, dropped, sent = self.opts.eval_every, 0, -1
        snapshots = outputs.get("snapshots") if parallel.is_writer(self.ctx) and eval_every else None
        for inp in inputs["features"]:
            if self.app.budget_reached.is_set():
                continue  # on its way when the time budget ended: drained, not trained
            if self.budget is not None and not self.budget.started:
                self.budget.start(self.step)
            m = self.train_step(inp)
            self.app.progress.step = self.step
            if parallel.is_writer(self.ctx):  # one record per step, not one per replica
                metrics.send(m)
            if every and self.step % every == 0 and self.step < total:
                self.save()
            if snapshots is not None and self.step % eval_every == 0 and self.step < total:
                try:  # never waits: a busy evaluator skips these weights
                    snapshots.send_nowait(self.snapshot(dropped=dropped))
                    dropped, sent = 0, self.step
                except WouldBlock:
                    dropped += 1
                    log.info("step %d: the evaluator is still busy; these weights are not evaluated", self.step)
            if self.budget is not None:
                self.follow_budget()
        final = time.perf_counter()
        if self.window.last_batch_id >= 0 and self.saved_step != self.step:  # final checkpoint, once
            self.save()
        if snapshots is not None and self.window.last_batch_id >= 0 and sent != self.step:
            snapshots.send(self.snapshot(dropped=dropped, final=True))  # the final weights (skipped if stopping)
        self.ckpt.wait()
        if self.app.budget_end is not None:
            self.app.budget_end += f"; final checkpoint and snapshot hand-off {time.perf_counter() - final:.1f} s"

    def follow_budget(self) -> None:
        """After a step under ``[run].time_budget_s``: move the schedule's end to where the measured
        step rate meets the deadline; once the budget is spent (or the end reached), say so to the
        prefetch stage (``RunApp.budget_reached``) and for the closing summary (``RunApp.budget_end``)."""
        b = self.budget
        self.optim.schedule.total = b.after_step(self.step)
        if b.rate is not None:  # the display counts its progress and ETA to this step
            self.app.schedule_end = b.total
        if b.expired(self.step):
            self.app.budget_end_at = time.perf_counter()
            self.app.budget_end = (f"run.steps reached at {b.elapsed():.1f} s of the {b.seconds:g} s time budget"
                                   if self.step >= b.max_total else
                                   f"stopped at the time budget ({b.seconds:g} s): {self.step} steps "
                                   f"(run.steps {b.max_total})")
            log.info("%s", self.app.budget_end)
            self.app.budget_reached.set()
        elif b.rate is not None and b.elapsed() >= (self.budget_logged + 1) * b.seconds / 10:
            self.budget_logged = int(10 * b.elapsed() / b.seconds)  # a line per tenth of the budget
            log.info("time budget: %.0f of %g s at %.2f steps/s, step %d: the schedule ends at step %d",
                     b.elapsed(), b.seconds, b.rate, self.step, b.total)

    def snapshot(self, *, dropped: int, final: bool = False) -> DrafterSnapshot:
        """A copy of the weights after ``self.step`` (on this device; the trainer keeps updating its own)."""
        with self.ctx.span("evaluator.snapshot"), torch.no_grad():
            weights = {k: v.detach().clone() for k, v in self.drafter.state_dict().items()}
        return DrafterSnapshot(step=self.step, weights=weights, final=final, dropped=dropped)

    def teardown(self) -> None:
        ckpt = getattr(self, "ckpt", None)
        if ckpt is not None:
            ckpt.close()  # finishes an in-flight save; never leaves a half-written checkpoint

    def train_step(self, inp: DrafterInput) -> StepMetrics:
        """One optimizer step (or a counted skip) on one batch; raises
        :class:`dflash.train.sentinel.NonFiniteError` when the skip streak is exhausted."""
        self.step += 1
        shapes = (tuple(inp.batch.input_ids.shape), tuple(inp.anchors.shape))
        with self.ctx.span("drafter.step"):  # a rerun starts from zero gradients (dflash.run.step_gate)
            m = self.gate.run(shapes, lambda: train_step(self.model, self.head, self.optim, self.guard, inp, self.opts,
                                                         step=self.step, cuda=self.cuda,
                                                         before_update=self.ckpt.before_update),
                              again=self.optim.zero_grad)
        self.window.add(m, inp.batch.sampler_state)
        if m.skipped and self.guard.exhausted:
            last = last_trusted_checkpoint(self.ckpt, step=self.step, streak=self.guard.streak,
                                           writer=parallel.is_writer(self.ctx))
            raise self.guard.stop_error(step=self.step, batch_id=m.batch_id, replica=m.replica,
                                        reason=m.skip_reason, last=last)
        return m

    def save(self) -> None:
        """Background checkpoint of the state after ``self.step`` (returns before the disk write)."""
        loss, window_skipped = self.window.take()
        window_steps = self.step - max(self.saved_step, self.app.resume.start_step)
        self.saved_step = self.step
        sampler_state = newest_sampler_state(self.window.last_sampler_state, self.ctx)
        with self.ctx.span("checkpoint.snapshot"):
            state = train_state(step=self.step, o=self.optim, sampler_state=sampler_state,
                                skipped_total=self.guard.skipped_total)
            if parallel.is_writer(self.ctx):
                self.ckpt.save(
                    step=self.step,
                    batch_id=self.window.last_batch_id,
                    loss=loss,
                    window_steps=window_steps,
                    window_skipped=window_skipped,
                    last_skipped=self.guard.streak > 0,
                    skipped_total=self.guard.skipped_total,
                    weights=dict(self.drafter.state_dict()),
                    train_state=state,
                    configs={**config_files(self.opts.drafter, self.opts.target), TRAIN_CONFIG: self.opts.train_config},
                )
            if parallel.group(self.ctx) is not None:  # every replica's own state, then a barrier
                parallel.save_rank_state(self.app.run_dir / "checkpoints", self.step, self.ctx, state)
