"""The drafter's training state around its weights: restore, the checkpoint window, assembly.

``train_state.pt`` holds ``{"step", "optimizer", "scheduler", "sampler", "rng", "skipped_total"}``
(docs/architecture.md); :func:`train_state` assembles it, :func:`restore` loads it with the weights
at start-up. Under torchrun each drafter replica keeps its own optimizer/RNG state
(:mod:`dflash.train.parallel`), and the sampler state saved is the newest of the replicas'
(:func:`newest_sampler_state`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load_file

import csp
from dflash.checkpoint import WEIGHTS
from dflash.messages import StepMetrics
from dflash.train import parallel
from dflash.train.config import TrainSection
from dflash.train.optim import DrafterOptimizer, load_optimizer_state

__all__ = ["CheckpointWindow", "newest_sampler_state", "restore", "train_state"]


def restore(drafter: torch.nn.Module, o: DrafterOptimizer, resume: Any, train: TrainSection, ctx: csp.Context,
            device: torch.device) -> int:
    """Load ``resume.path``'s weights, optimizer, schedule and torch RNG state; returns the
    checkpoint's ``skipped_total``.

    ``resume`` is the run's :class:`dflash.run.app.ResumeState`; ``train`` its ``[train]`` table
    (the lr, betas and weight decay the restored optimizer follows). The weights come from
    ``resume.weights`` when :mod:`dflash.checkpoint.resume` already read and verified them (taken,
    so the memory is released once the parameters hold them), else from ``model.safetensors`` onto
    ``device``.
    """
    path, state = resume.path, resume.train_state
    if parallel.group(ctx) is not None:  # each data-parallel replica restores its own state
        state = parallel.load_rank_state(path.parent, resume.start_step, ctx) or state
    weights = resume.take_weights()
    if weights is None:
        weights = load_file(str(path / WEIGHTS), device=str(device))
    drafter.load_state_dict(weights)
    del weights  # the parameters hold them now
    load_optimizer_state(o, state, train)
    torch.set_rng_state(state["rng"]["torch"])
    return state.get("skipped_total", 0)


def newest_sampler_state(sampler_state: dict, ctx: csp.Context) -> dict:
    """Under data parallelism each replica trained a different batch of this step: the sampler
    state of the newest of them (highest ``batch_id``), so a resume continues after all of them.
    One ``all_gather_object`` over the drafter group; ``sampler_state`` itself otherwise."""
    if parallel.group(ctx) is None:
        return sampler_state
    states: list = [None] * parallel.world(ctx)
    torch.distributed.all_gather_object(states, sampler_state, group=parallel.group(ctx))
    return max(states, key=lambda st: st.get("batch_id", -1))


def train_state(*, step: int, o: DrafterOptimizer, sampler_state: dict, skipped_total: int) -> dict[str, Any]:
    """The ``train_state.pt`` dict after ``step`` (the torch RNG state is read now)."""
    return {
        "step": step,
        **o.state_dict(),
        "sampler": sampler_state,
        "rng": {"torch": torch.get_rng_state()},
        "skipped_total": skipped_total,
    }


@dataclass
class CheckpointWindow:
    """The steps since the last checkpoint, for its ``meta.json``: finite losses, skips, and the
    batch and sampler state of the newest step."""

    losses: list[float] = field(default_factory=list)
    skipped: int = 0
    last_batch_id: int = -1
    last_sampler_state: dict = field(default_factory=dict)

    def add(self, m: StepMetrics, sampler_state: dict) -> None:
        """Record one step's metrics (a skipped step's loss is not averaged)."""
        if m.skipped:
            self.skipped += 1
        else:
            self.losses.append(m.loss)
        self.last_batch_id = m.batch_id
        self.last_sampler_state = sampler_state

    def take(self) -> tuple[float, int]:
        """``(mean finite loss or nan, skipped steps)`` of the window, which starts anew."""
        losses, skipped = self.losses, self.skipped
        self.losses, self.skipped = [], 0
        return (sum(losses) / len(losses) if losses else float("nan")), skipped
