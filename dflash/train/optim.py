"""The drafter's optimizer and learning-rate schedule: AdamW, linear warmup then cosine decay.

:func:`make_optimizer` builds both from ``[train]``; :func:`load_optimizer_state` restores them
from a checkpoint's ``train_state.pt`` and then applies the run's own ``[train]`` values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dflash.train.config import TrainSection

__all__ = ["DrafterOptimizer", "load_optimizer_state", "lr_lambda", "make_optimizer"]


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak lr at step s (0-based): linear warmup over ``warmup`` steps, then
    cosine decay to ``min_ratio`` at ``total`` (the usual warmup + cosine schedule)."""

    def f(s: int) -> float:
        if warmup > 0 and s < warmup:
            return (s + 1) / warmup
        progress = min(max(s - warmup, 0) / max(total - warmup, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


@dataclass
class DrafterOptimizer:
    """The trained parameters, their AdamW and its schedule (stepped once per batch)."""

    params: list[torch.nn.Parameter]
    opt: torch.optim.AdamW
    sched: torch.optim.lr_scheduler.LambdaLR

    @property
    def lr(self) -> float:
        """The lr the next ``opt.step()`` uses."""
        return self.opt.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer": ..., "scheduler": ...}``, the optimizer part of ``train_state.pt``."""
        return {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()}


def make_optimizer(model: torch.nn.Module, train: TrainSection, total_steps: int) -> DrafterOptimizer:
    """AdamW over ``model``'s trainable parameters with ``[train]``'s lr, betas and weight decay,
    and the warmup + cosine schedule over ``total_steps`` (``[run].steps``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(train.warmup_steps, total_steps, train.min_lr_ratio))
    return DrafterOptimizer(params=params, opt=opt, sched=sched)


def load_optimizer_state(o: DrafterOptimizer, state: dict[str, Any], train: TrainSection) -> None:
    """Restore ``state["optimizer"]`` and ``state["scheduler"]`` (a ``train_state.pt``) into ``o``.

    The saved states carry the lr, betas and weight decay they were saved with; the run follows its
    own ``[train]`` table (a changed key is named at start-up), so an unchanged config restores the
    same values and a changed one takes effect.
    """
    o.opt.load_state_dict(state["optimizer"])
    o.sched.load_state_dict(state["scheduler"])
    o.sched.base_lrs = [train.lr for _ in o.opt.param_groups]
    for g, lam in zip(o.opt.param_groups, o.sched.lr_lambdas):
        g.update(initial_lr=train.lr, lr=train.lr * lam(o.sched.last_epoch), betas=train.betas,
                 weight_decay=train.weight_decay)
    o.sched._last_lr = [g["lr"] for g in o.opt.param_groups]  # what get_last_lr() reports
