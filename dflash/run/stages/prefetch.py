"""``dflash.prefetch``: batches from the data sampler, anchors sampled, pinned when a GPU trains."""

from __future__ import annotations

from typing import TypedDict

import msgspec
import torch

import csp
from dflash.messages import Batch
from dflash.run.app import RunApp
from dflash.run.options import PrefetchOptions
from dflash.seeding import ANCHORS, derive_seed
from dflash.train.anchors import sample_anchors
from dflash.train.sentinel import FiniteSentinel


def anchor_generator(seed: int, batch_id: int) -> torch.Generator:
    """CPU generator for one batch's anchors: a pure function of (run seed, batch id), so a resumed
    run draws exactly the anchors the uninterrupted run drew."""
    return torch.Generator().manual_seed(derive_seed(seed, batch_id, salt=ANCHORS))


class PrefetchStageOutputs(TypedDict):
    batches: csp.Sender[Batch]


@csp.register("dflash.prefetch")
class PrefetchStage(csp.Process[csp.NoPorts, PrefetchStageOutputs]):
    """Source stage: pulls ``steps_to_run`` batches from the sampler and sends them on ``batches``.

    Anchors (``Batch.anchors``, ``[B, A]`` int64, -1 = empty slot) are drawn here on the CPU, off the
    GPU's critical path. With ``pin`` (when any process runs on CUDA) every batch is copied to
    page-locked memory so the target's host-to-device copy is asynchronous.
    Stops early, after the current batch, when a graceful stop is requested or the drafter stage
    says ``[run].time_budget_s`` is reached (``RunApp.budget_reached``).
    Reads :class:`~dflash.run.options.PrefetchOptions` and the app's sampler.
    """

    def setup(self) -> None:
        self.app: RunApp = self.ctx.app
        self.opts: PrefetchOptions = self.app.resolved.prefetch
        self.sentinel = FiniteSentinel(self.ctx.qualname, enabled=self.opts.check_channels)

    def run(self, inputs: csp.NoPorts, outputs: PrefetchStageOutputs) -> None:
        o, out, sampler = self.opts, outputs["batches"], self.app.sampler
        for seq in range(self.app.steps_to_run * o.drafters):
            ended = self.ctx.stopping() or self.app.budget_reached.is_set()
            if ended and seq % o.drafters == 0:  # whole steps only: DDP replicas stay even
                break
            with self.ctx.span("batch"):
                batch: Batch = next(sampler)
                anchors = sample_anchors(batch.loss_mask, batch.doc_ids, o.num_anchors, o.block_size,
                                         generator=anchor_generator(o.seed, batch.batch_id))
                batch = msgspec.structs.replace(batch, seq=seq, anchors=anchors)
                if o.pin:
                    batch = batch.pin_memory()
            self.sentinel.check(batch, batch_id=batch.batch_id, channel="batches", step=self.app.step_of(seq))
            out.send(batch)
