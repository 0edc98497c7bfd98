"""``dflash.drafter``: the stage that trains the drafter; glue around :mod:`dflash.train_step`.

Per batch: :func:`dflash.train_step.train_step` (loss, backward, clip, the one host read, the
non-finite skip, AdamW, schedule), then the stop rule: ``[train].max_nonfinite_streak``
consecutive skips stop the run, naming the last healthy checkpoint
(:func:`dflash.nonfinite.last_trusted_checkpoint`). Every ``[checkpoint].every`` steps a background
checkpoint (:mod:`dflash.checkpoint`); its ``meta.json`` carries the mean loss of the steps since
the previous checkpoint, and a checkpoint saved while a non-finite streak runs is marked unhealthy.
When the input ends (the data is exhausted, or a graceful stop drained the graph) a final
checkpoint is written and waited for.

Built from: :mod:`dflash.optim` (AdamW and schedule), :mod:`dflash.nonfinite` (the skip policy),
:mod:`dflash.train_state` (restore, the checkpoint window, ``train_state.pt``).
"""

from __future__ import annotations

import torch

import csp
from dflash import parallel
from dflash.app import RunApp
from dflash.checkpoint import Checkpointer
from dflash.messages import DrafterInput, StepMetrics
from dflash.model_io import config_files
from dflash.nonfinite import NonFiniteGuard, last_trusted_checkpoint
from dflash.optim import make_optimizer
from dflash.checkpoint import TRAIN_CONFIG
from dflash.train_state import CheckpointWindow, newest_sampler_state, restore, train_state
from dflash.train_step import train_step

__all__ = ["DrafterStage"]


@csp.register("dflash.drafter")
class DrafterStage(csp.Process):
    """Trains the DFlash drafter. Input ``features``: :class:`DrafterInput`; output ``metrics``:
    one :class:`StepMetrics` per step (skipped steps included)."""

    inputs = {"features": DrafterInput}
    outputs = {"metrics": StepMetrics}

    def setup(self) -> None:
        from dflash.drafter import DFlashDrafter
        from dflash.target import load_shared_head

        app: RunApp = self.ctx.app
        self.app, cfg = app, app.cfg
        self.device = self.ctx.device or torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.head = load_shared_head(cfg.target, self.device, torch.bfloat16 if self.cuda else torch.float32)
        # Seeded init from its own generator: the global RNG is shared with the other stages' threads.
        self.drafter = DFlashDrafter(app.drafter_cfg, seed=cfg.run.seed).to(self.device)  # fp32 master weights
        # DDP over the drafter replicas' ranks under torchrun (dflash.parallel); the module itself otherwise.
        self.model = parallel.wrap(self.drafter, self.ctx)
        self.optim = make_optimizer(self.drafter, cfg.train, cfg.run.steps)
        self.guard = NonFiniteGuard(cfg.train.max_nonfinite_streak)
        self.step = app.start_step
        if app.resume_path is not None:
            self.guard.skipped_total = restore(self.drafter, self.optim, app, self.ctx, self.device)
        self.ckpt = Checkpointer(
            app.run_dir / "checkpoints",
            keep_last=cfg.checkpoint.keep_last,
            config_hash=app.config_hash,
            on_event=app.metrics.write,
            lineage=app.lineage,
        )
        self.ckpt.last_healthy = app.resume_path
        if self.cuda and parallel.is_writer(self.ctx):
            # Page-lock the host buffers of the checkpoint copy now, not in the middle of training.
            like = {str(i): {"step": torch.zeros(()), "exp_avg": p, "exp_avg_sq": p}
                    for i, p in enumerate(self.optim.params)}
            self.ckpt.reserve(dict(self.drafter.state_dict()), {"optimizer": {"state": like}})
        self.window = CheckpointWindow()
        self.saved_step = -1

    def run(self, inputs, outputs) -> None:
        metrics = outputs["metrics"]
        every = self.app.cfg.checkpoint.every
        for inp in inputs["features"]:
            m = self.train_step(inp)
            if parallel.is_writer(self.ctx):  # one record per step, not one per replica
                metrics.send(m)
            if every and self.step % every == 0 and self.step < self.app.cfg.run.steps:
                self.save()
        if self.window.last_batch_id >= 0 and self.saved_step != self.step:  # final checkpoint, once
            self.save()
        self.ckpt.wait()

    def teardown(self) -> None:
        ckpt = getattr(self, "ckpt", None)
        if ckpt is not None:
            ckpt.close()  # finishes an in-flight save; never leaves a half-written checkpoint

    def train_step(self, inp: DrafterInput) -> StepMetrics:
        """One optimizer step (or a counted skip) on one batch; raises
        :class:`dflash.sentinel.NonFiniteError` when the skip streak is exhausted."""
        self.step += 1
        with self.ctx.span("drafter.step"):
            m = train_step(self.model, self.head, self.optim, self.guard, inp, self.app.cfg, step=self.step,
                           cuda=self.cuda, before_update=self.ckpt.before_update)
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
        window_steps = self.step - max(self.saved_step, self.app.start_step)
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
                    configs={**config_files(self.app.drafter_cfg, self.app.cfg.target), TRAIN_CONFIG: self.app.cfg},
                )
            if parallel.group(self.ctx) is not None:  # every replica's own state, then a barrier
                parallel.save_rank_state(self.app.run_dir / "checkpoints", self.step, self.ctx, state)
