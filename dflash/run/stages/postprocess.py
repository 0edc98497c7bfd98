"""``dflash.postprocess``: target hidden states -> drafter input on the drafter's device.

Moves each :class:`TargetOutput` to the drafter's device by the cheapest correct route
(:func:`csp.cuda.handoff.to_device`): by reference on the same device (the channel orders it with an
event), device to device to another GPU, through host memory only when ``[train].host_staging``
asks for it. Then :mod:`dflash.model.features` makes the :class:`DrafterInput` (the feature noise is
added here unless ``[train].postprocess_side = "target"`` added it in the target replica).
"""

from __future__ import annotations

from typing import TypedDict

import torch

import csp
from dflash.messages import DrafterInput, TargetOutput
from dflash.run.app import RunApp
from dflash.run.options import PostprocessOptions
from dflash.train.sentinel import FiniteSentinel


class PostprocessStageInputs(TypedDict):
    hidden: csp.Receiver[TargetOutput]


class PostprocessStageOutputs(TypedDict):
    features: csp.Sender[DrafterInput]


@csp.register("dflash.postprocess")
class PostprocessStage(csp.Process[PostprocessStageInputs, PostprocessStageOutputs]):
    """Input ``hidden``: :class:`TargetOutput`; output ``features``: :class:`DrafterInput` on this
    process's device (bind it to the drafter's device). Reads :class:`~dflash.run.options.PostprocessOptions`."""

    def setup(self) -> None:
        self.app: RunApp = self.ctx.app
        self.opts: PostprocessOptions = self.app.resolved.postprocess
        self.features = self.opts.features
        self.device = self.ctx.device or torch.device("cpu")
        self.sentinel = FiniteSentinel(self.ctx.qualname, enabled=self.opts.check_channels)

    def process(self, out: TargetOutput) -> DrafterInput:
        """One target output -> drafter input on this process's device."""
        with self.ctx.span("postprocess"):
            out = csp.cuda.handoff.to_device(out, self.device, via_host=self.opts.host_staging)
            return self.features.at_drafter(out)

    def run(self, inputs: PostprocessStageInputs, outputs: PostprocessStageOutputs) -> None:
        out_ch = outputs["features"]
        for out in inputs["hidden"]:
            item = self.process(out)
            self.sentinel.check(item, batch_id=item.batch.batch_id, channel="features",
                                step=self.app.step_of(item.batch.seq))
            out_ch.send(item)
        self.sentinel.flush()
