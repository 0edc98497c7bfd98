"""``dflash.drafter``: the training step — forward, backward, AdamW, schedule, clipping, checkpoints.

One step, top to bottom (:meth:`DrafterStage.train_step`):

1. ``compute_loss`` on the drafter input (bf16 autocast on CUDA, fp32 on CPU);
2. backward, global gradient norm (clipped to ``[train].grad_clip``);
3. one host read of ``[loss, grad_norm, ce, kl, blocks, acc...]`` — the step's only
   synchronisation (``[train].sync_free_loss`` keeps ``compute_loss`` free of any; with it off the
   loss's boolean masks and counts add their own);
4. non-finite loss or gradient: the update is skipped, counted and reported with the batch id;
   ``[train].max_nonfinite_streak`` consecutive skips stop the run, naming the last healthy checkpoint.
   This decision is why the one read stays per step and is not deferred to the logging window: a
   skipped update must leave the weights *and* AdamW's moments and step count untouched, and no
   device-side form does that for the foreach AdamW used here (zeroed gradients still decay the
   moments and advance the step; a ``torch.where`` between old and new state needs a copy of
   weights and both moments, 3x the parameters, every step; fused AdamW's ``found_inf`` input
   would skip on the device, but it is another kernel with its own rounding, so results change,
   and the streak rule and the per-step metrics still need the values on the host). The read comes
   after backward, so the only device time it costs is the launch gap before the optimizer's
   kernels, and it carries everything the monitor needs;
5. otherwise AdamW step, scheduler step;
6. every ``[checkpoint].every`` steps a background checkpoint (:mod:`dflash.checkpoint`); its
   ``meta.json`` carries the mean loss of the steps since the previous checkpoint, and a checkpoint
   saved while a non-finite streak runs is marked unhealthy. A streak that stops the run and began
   right after a checkpoint marks that checkpoint unhealthy too, and the message names the one before.

When the input ends (the data is exhausted, or a graceful stop drained the graph) a final checkpoint
is written and waited for.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext

import torch
from safetensors.torch import load_file

import csp
from dflash import parallel
from dflash.app import RunApp
from dflash.checkpoint import Checkpointer, is_healthy, list_checkpoints, mark_unhealthy, read_meta
from dflash.messages import DrafterInput, StepMetrics
from dflash.metrics import simulated_accepted_length
from dflash.model_io import config_files
from dflash.objective import compute_loss
from dflash.resume import TRAIN_CONFIG
from dflash.sentinel import NonFiniteError


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Multiplier of the peak lr at step s (0-based): linear warmup over ``warmup`` steps, then
    cosine decay to ``min_ratio`` at ``total`` (the usual warmup + cosine schedule)."""

    def f(s: int) -> float:
        if warmup > 0 and s < warmup:
            return (s + 1) / warmup
        progress = min(max(s - warmup, 0) / max(total - warmup, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


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
        self.distributed = parallel.group(self.ctx) is not None
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        t = cfg.train
        self.opt = torch.optim.AdamW(self.params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lr_lambda(t.warmup_steps, cfg.run.steps, t.min_lr_ratio)
        )
        self.step = app.start_step
        self.streak = 0
        self.skipped_total = 0
        if app.resume_path is not None:
            self._restore()
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
                    for i, p in enumerate(self.params)}
            self.ckpt.reserve(dict(self.drafter.state_dict()), {"optimizer": {"state": like}})
        self.last_sampler_state: dict = {}
        self.window_losses: list[float] = []  # finite losses since the last checkpoint
        self.window_skipped = 0
        self.last_batch_id = -1
        self.saved_step = -1

    def _restore(self) -> None:
        path, state = self.app.resume_path, self.app.train_state
        if self.distributed:  # each data-parallel replica restores its own optimizer/RNG state
            state = parallel.load_rank_state(path.parent, self.app.start_step, self.ctx) or state
        weights = self.app.resume_weights  # verified by dflash.resume
        if weights is None:
            weights = load_file(str(path / "model.safetensors"), device=str(self.device))
        self.drafter.load_state_dict(weights)
        self.app.resume_weights = None  # the parameters hold them now
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        # The optimizer and scheduler states carry the lr, betas and weight decay they were saved
        # with; the run follows its own [train] table (a changed key is named at start-up), so an
        # unchanged config restores the same values and a changed one takes effect.
        t = self.app.cfg.train
        self.sched.base_lrs = [t.lr for _ in self.opt.param_groups]
        for g, lam in zip(self.opt.param_groups, self.sched.lr_lambdas):
            g.update(initial_lr=t.lr, lr=t.lr * lam(self.sched.last_epoch), betas=t.betas,
                     weight_decay=t.weight_decay)
        self.sched._last_lr = [g["lr"] for g in self.opt.param_groups]  # what get_last_lr() reports
        torch.set_rng_state(state["rng"]["torch"])
        self.skipped_total = state.get("skipped_total", 0)

    def run(self, inputs, outputs) -> None:
        metrics = outputs["metrics"]
        every = self.app.cfg.checkpoint.every
        for inp in inputs["features"]:
            m = self.train_step(inp)
            if parallel.is_writer(self.ctx):  # one record per step, not one per replica
                metrics.send(m)
            if every and self.step % every == 0 and self.step < self.app.cfg.run.steps:
                self.save()
        if self.last_batch_id >= 0 and self.saved_step != self.step:  # final checkpoint, once
            self.save()
        self.ckpt.wait()

    def teardown(self) -> None:
        ckpt = getattr(self, "ckpt", None)
        if ckpt is not None:
            ckpt.close()  # finishes an in-flight save; never leaves a half-written checkpoint

    def train_step(self, inp: DrafterInput) -> StepMetrics:
        """One optimizer step (or a counted skip) on one batch; see the module docstring."""
        cfg = self.app.cfg
        self.step += 1
        t0 = time.perf_counter()
        b = inp.batch
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.cuda else nullcontext()
        with self.ctx.span("drafter.step"):
            with autocast:
                out = compute_loss(
                    self.model,
                    self.head,
                    features=inp.features,
                    input_ids=b.input_ids,
                    loss_mask=b.loss_mask,
                    doc_ids=b.doc_ids,
                    position_ids=b.position_ids,
                    anchors=inp.anchors,
                    final_hidden=inp.final_hidden,
                    cfg=cfg.loss,
                    sync_free=cfg.train.sync_free_loss,
                    features_fp32=cfg.train.features_fp32,
                    lm_head_chunk=cfg.train.lm_head_chunk,
                )
            out.loss.backward()
            clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
            # The step's one host synchronisation: everything the monitor and the skip rule need.
            # The block count rides along when it is still a tensor (sync-free loss).
            blocks_t = out.num_blocks if isinstance(out.num_blocks, torch.Tensor) else None
            scalars = [out.loss.detach().float(), grad_norm.float(), out.ce.float(), out.kl.float()]
            scalars += [blocks_t.float()] if blocks_t is not None else []
            vals = torch.cat([torch.stack(scalars), out.acc_per_pos.float()]).tolist()
            loss, gnorm, ce, kl = vals[:4]
            num_blocks = int(vals[4]) if blocks_t is not None else int(out.num_blocks)
            acc = vals[len(scalars):]
            lr = self.opt.param_groups[0]["lr"]  # the lr this step uses
            reason = None
            if not math.isfinite(loss):
                reason = "non-finite loss"
            elif not math.isfinite(gnorm):
                reason = "non-finite gradient"
            if reason is None:
                self.ckpt.before_update()
                self.opt.step()
                self.streak = 0
            else:
                self.streak += 1
                self.skipped_total += 1
            self.opt.zero_grad(set_to_none=True)
            self.sched.step()  # the schedule follows steps (batches), skipped or not
        self.last_batch_id = b.batch_id
        self.last_sampler_state = b.sampler_state
        if reason is None:
            self.window_losses.append(loss)
        else:
            self.window_skipped += 1
            if self.streak >= cfg.train.max_nonfinite_streak:
                last = self._last_trusted_checkpoint()
                raise NonFiniteError(
                    f"{self.streak} consecutive non-finite steps (last: step {self.step}, batch {b.batch_id} "
                    f"from target[{inp.replica}], {reason}); stopping. "
                    + (f"Last healthy checkpoint: {last} (resume with --resume {last})" if last else
                       "No healthy checkpoint was written yet.")
                )
        return StepMetrics(
            step=self.step,
            batch_id=b.batch_id,
            loss=loss if reason is None else float("nan"),
            ce=ce if reason is None else float("nan"),
            kl=kl if reason is None else float("nan"),
            acc_per_pos=acc,
            accepted_sim=simulated_accepted_length(acc),
            lr=lr,
            grad_norm=gnorm,
            skipped=reason is not None,
            skip_reason=reason,
            replica=inp.replica,
            num_tokens=b.num_tokens,
            num_padding=b.num_padding,
            num_blocks=num_blocks,
            step_s=time.perf_counter() - t0,
            target_s=inp.target_s,
            time=time.time(),
        )

    def _last_trusted_checkpoint(self):
        """The newest healthy checkpoint to recommend when a non-finite streak stops the run.

        When the streak began right after the last healthy checkpoint, that checkpoint's weights are
        what every later step failed on: it is marked unhealthy (if it is one of this run's) and the
        healthy one before it is named instead.
        """
        self.ckpt.wait()  # the last save's meta.json is on disk
        last = self.ckpt.last_healthy
        meta = read_meta(last) if last is not None else None
        first_bad = self.step - self.streak + 1
        if meta is None or meta.get("step") != first_bad - 1:
            return last
        if last.parent.resolve() != self.ckpt.root.resolve():
            return last  # another run's checkpoint (an explicit --resume PATH): not ours to mark
        if parallel.is_writer(self.ctx):
            mark_unhealthy(last, f"the {self.streak} steps after it ({first_bad}..{self.step}) were all "
                                 "non-finite: its weights are suspect")
        older = [p for p in list_checkpoints(self.ckpt.root) if p.name < last.name and is_healthy(p)
                 and (read_meta(p) or {}).get("lineage") == self.ckpt.lineage]
        return older[-1] if older else None

    def save(self) -> None:
        """Background checkpoint of the state after ``self.step`` (returns before the disk write)."""
        window_losses, window_skipped = self.window_losses, self.window_skipped
        self.window_losses, self.window_skipped = [], 0
        window_steps = self.step - max(self.saved_step, self.app.start_step)
        self.saved_step = self.step
        sampler_state = self.last_sampler_state
        if self.distributed:
            # Each replica trained a different batch of this step: resume after the newest of them.
            states: list = [None] * parallel.world(self.ctx)
            torch.distributed.all_gather_object(states, sampler_state, group=parallel.group(self.ctx))
            sampler_state = max(states, key=lambda st: st.get("batch_id", -1))
        with self.ctx.span("checkpoint.snapshot"):
            train_state = {
                "step": self.step,
                "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(),
                "sampler": sampler_state,
                "rng": {"torch": torch.get_rng_state()},
                "skipped_total": self.skipped_total,
            }
            if parallel.is_writer(self.ctx):
                self.ckpt.save(
                    step=self.step,
                    batch_id=self.last_batch_id,
                    loss=sum(window_losses) / len(window_losses) if window_losses else float("nan"),
                    window_steps=window_steps,
                    window_skipped=window_skipped,
                    last_skipped=self.streak > 0,
                    skipped_total=self.skipped_total,
                    weights=dict(self.drafter.state_dict()),
                    train_state=train_state,
                    configs={**config_files(self.app.drafter_cfg, self.app.cfg.target), TRAIN_CONFIG: self.app.cfg},
                )
            if self.distributed:  # every replica's own state, then a barrier across replicas
                parallel.save_rank_state(self.app.run_dir / "checkpoints", self.step, self.ctx, train_state)
