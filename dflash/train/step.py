"""One training step of the drafter, top to bottom: loss, backward, clip, one host read, update.

Shapes: B rows, T tokens, k captured target layers of hidden size H, A anchors, bs block size.

1. :func:`dflash.train.objective.compute_loss` on the batch's :class:`dflash.messages.LossInput`
   (bf16 autocast on CUDA, fp32 on CPU);
2. backward, global gradient norm (clipped to ``[train].grad_clip``);
3. one host read of ``[loss, grad_norm, ce, kl, (tv), (conf), blocks, acc..., (DFlash2's selector figures)]``:
   the step's only synchronisation (``[train].sync_free_loss`` keeps ``compute_loss`` free of any; with it off the
   loss's boolean masks and counts add their own);
4. non-finite loss or gradient (:class:`dflash.train.nonfinite.NonFiniteGuard`): the update is skipped
   and counted. This decision is why the one read stays per step and is not deferred to the logging
   window: a skipped update must leave the weights *and* AdamW's moments and step count untouched,
   and no device-side form does that for the foreach AdamW used here (zeroed gradients still decay
   the moments and advance the step; a ``torch.where`` between old and new state needs a copy of
   weights and both moments, 3x the parameters, every step; fused AdamW's ``found_inf`` input would
   skip on the device, but it is another kernel with its own rounding, so results change, and the
   streak rule and the per-step metrics still need the values on the host). The read comes after
   backward, so the only device time it costs is the launch gap before the optimizer's kernels,
   and it carries everything the monitor needs;
5. otherwise the optimizer's step (AdamW, or Muon and AdamW: ``[train].optimizer``); the schedule
   steps either way (it follows batches).

The caller (:class:`dflash.run.stages.trainer.DrafterStage`) owns the step counter, checkpoints and
the stop when the guard's streak is exhausted.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Callable, NamedTuple, Protocol

import torch

from dflash.messages import DrafterInput, StepMetrics
from dflash.model.target import SharedHead
from dflash.train.acceptance import simulated_accepted_length
from dflash.train.config import TrainSection
from dflash.train.loss import LossConfig
from dflash.train.nonfinite import NonFiniteGuard
from dflash.train.objective import LossOutput, compute_loss
from dflash.train.optim import DrafterOptimizer

__all__ = ["HostRead", "StepOptions", "read_to_host", "train_step"]


class StepOptions(Protocol):
    """The tables one step reads (:class:`dflash.run.stages.trainer.DrafterStageOptions` has both)."""

    @property
    def train(self) -> TrainSection: ...  # [train]: the loss switches, grad_clip

    @property
    def loss(self) -> LossConfig: ...  # [loss]


def train_step(model: torch.nn.Module, head: SharedHead, o: DrafterOptimizer, guard: NonFiniteGuard,
               inp: DrafterInput, cfg: StepOptions, *, step: int, cuda: bool,
               before_update: Callable[[], None] = lambda: None) -> StepMetrics:
    """One optimizer step (or a counted skip) on one batch; see the module docstring.

    Args:
        model: the drafter (or its DDP wrapper); ``o`` holds its parameters, optimizers and schedules.
        head: the target's frozen embedding and LM head (bf16 on CUDA, fp32 on CPU).
        inp: the batch on ``model``'s device (``features [B, T, k*H]``, ``anchors [B, A]``).
        cfg: the run's ``.train`` and ``.loss`` tables (the drafter stage passes its
            :class:`dflash.run.stages.trainer.DrafterStageOptions`).
        step: this step's number (1-based), reported in the metrics.
        cuda: run the forward under bf16 autocast.
        before_update: called just before ``opt.step()`` changes the weights (the checkpointer
            finishes copying the previous state there).

    Returns:
        the step's :class:`StepMetrics` (``skipped`` with nan loss/ce/kl (and tv/conf) when the guard
        skipped it).
    """
    t0 = time.perf_counter()
    b, train = inp.batch, cfg.train

    # 1. loss: features [B, T, k*H] + blocks [B, A, bs] -> scalar loss, acc_per_pos [bs-1]
    with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext():
        out = compute_loss(model, head, inp.loss_input(), cfg.loss, sync_free=train.sync_free_loss,
                           features_fp32=train.features_fp32, lm_head_chunk=train.lm_head_chunk,
                           lm_head=train.lm_head, compile_head=train.compile_head)

    # 2. backward; global L2 gradient norm before clipping (0-dim, on the device)
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(o.params, train.grad_clip if train.grad_clip > 0 else float("inf"))

    # 3. the step's one host read (every scalar of the step, in one .tolist())
    host = read_to_host(out, grad_norm)
    loss, gnorm = host.loss, host.grad_norm
    lr = o.lr  # the lr this step uses

    # 4-5. skip a non-finite step, else update; the schedule follows batches, skipped or not
    reason = guard.reason(loss, gnorm)
    if reason is None:
        before_update()
        o.step()
    guard.record(reason)
    o.zero_grad()
    o.schedule_step()

    skipped = reason is not None
    return StepMetrics(
        step=step,
        batch_id=b.batch_id,
        loss=float("nan") if skipped else loss,
        ce=float("nan") if skipped else host.ce,
        kl=float("nan") if skipped else host.kl,
        tv=None if host.tv is None else float("nan") if skipped else host.tv,
        conf=None if host.conf is None else float("nan") if skipped else host.conf,
        acc_per_pos=host.acc,
        accepted_sim=simulated_accepted_length(host.acc),
        lr=lr,
        grad_norm=gnorm,
        skipped=skipped,
        skip_reason=reason,
        replica=inp.replica,
        num_tokens=b.num_tokens,
        num_padding=b.num_padding,
        num_blocks=host.num_blocks,
        step_s=time.perf_counter() - t0,
        target_s=inp.target_s,
        time=time.time(),
        **(_selector_metrics(host.selector, skipped) if host.selector is not None else {}),
    )


class HostRead(NamedTuple):
    """A step's scalars on the host, read from the device in one ``.tolist()`` (:func:`read_to_host`).

    Attributes:
        loss, grad_norm, ce, kl: the step's loss, its global gradient norm before clipping, and
            the cross-entropy and KL terms.
        tv, conf: the TV and confidence terms, None when their weights are 0.
        num_blocks: the training blocks the loss was averaged over.
        acc: per-position accuracy of block positions 1 .. bs-1.
        selector: DFlash2's ``[sel_loss, sel_streak, base_streak, recall, oracle_streak,
            missing, sel_acc_1 ..]``, None for a DFlash drafter.
    """

    loss: float
    grad_norm: float
    ce: float
    kl: float
    tv: float | None
    conf: float | None
    num_blocks: int
    acc: list[float]
    selector: list[float] | None


def read_to_host(out: LossOutput, grad_norm: torch.Tensor) -> HostRead:
    """Every scalar of a step in one device-to-host read: one flat tensor
    ``[loss, grad_norm, ce, kl, (tv), (conf), (blocks), acc_1 .. acc_{bs-1}, (selector ...)]``
    (tv/conf when their weights are > 0; the block count when it is still a tensor, as the
    sync-free loss leaves it), so the step waits on the device once (the module docstring)."""
    blocks_t = out.num_blocks if isinstance(out.num_blocks, torch.Tensor) else None
    optional = [t for t in (out.tv, out.conf) if t is not None]
    scalars = [out.loss.detach(), grad_norm, out.ce, out.kl, *optional] + ([blocks_t] if blocks_t is not None else [])
    parts = [torch.stack([t.float() for t in scalars]), out.acc_per_pos.float()]
    sel = out.selector
    if sel is not None:
        parts += [torch.stack([sel.loss.detach().float(), sel.streak.float(), out.streak_mean.float(),
                               sel.recall.float(), sel.oracle_streak.float(), sel.missing.float()]),
                  sel.acc_per_pos.float()]
    vals = torch.cat(parts).tolist()
    n, S = len(scalars), out.acc_per_pos.shape[0]
    terms = iter(vals[4:4 + len(optional)])
    return HostRead(
        loss=vals[0], grad_norm=vals[1], ce=vals[2], kl=vals[3],
        tv=next(terms) if out.tv is not None else None,
        conf=next(terms) if out.conf is not None else None,
        num_blocks=int(vals[n - 1]) if blocks_t is not None else int(out.num_blocks),
        acc=vals[n:n + S],
        selector=vals[n + S:] if sel is not None else None)


def _selector_metrics(vals: list[float], skipped: bool) -> dict[str, Any]:
    """The :class:`StepMetrics` fields of DFlash2's selector from its part of the host read
    (``[sel_loss, sel_streak, base_streak, recall, oracle_streak, missing, sel_acc...]``)."""
    sel_loss, sel_streak, base_streak, recall, oracle, missing, *acc = vals
    return {"sel_loss": float("nan") if skipped else sel_loss, "sel_acc_per_pos": acc,
            "sel_accepted": sel_streak, "base_accepted": base_streak, "recall_k": recall,
            "oracle_accepted": oracle, "label_missing": int(missing)}
