"""``dflash.postprocess``: target hidden states -> drafter input on the drafter's device.

Moves each :class:`TargetOutput` to the drafter's device by the cheapest correct route
(:func:`csp.cuda.to_device`): by reference on the same device (the channel orders it with an
event), device to device to another GPU, through host memory only when ``[train].host_staging``
asks for it. Then :mod:`dflash.features` makes the :class:`DrafterInput` (the feature noise is
added here unless ``[train].postprocess_side = "target"`` added it in the target replica).
"""

from __future__ import annotations

import torch

import csp
from dflash.app import RunApp
from dflash.features import FeaturePostprocess
from dflash.messages import DrafterInput, TargetOutput
from dflash.sentinel import FiniteSentinel


@csp.register("dflash.postprocess")
class PostprocessStage(csp.Process):
    """Input ``hidden``: :class:`TargetOutput`; output ``features``: :class:`DrafterInput` on this
    process's device (bind it to the drafter's device)."""

    inputs = {"hidden": TargetOutput}
    outputs = {"features": DrafterInput}

    def setup(self) -> None:
        app: RunApp = self.ctx.app
        self.app = app
        self.train = app.cfg.train
        self.features = FeaturePostprocess.from_config(app.cfg)
        self.device = self.ctx.device or torch.device("cpu")
        self.sentinel = FiniteSentinel(self.ctx.qualname, enabled=self.train.check_channels)

    def process(self, out: TargetOutput) -> DrafterInput:
        """One target output -> drafter input on this process's device."""
        with self.ctx.span("postprocess"):
            out = csp.cuda.to_device(out, self.device, via_host=self.train.host_staging)
            return self.features.at_drafter(out)

    def run(self, inputs, outputs) -> None:
        out_ch = outputs["features"]
        for out in inputs["hidden"]:
            item = self.process(out)
            self.sentinel.check(item, batch_id=item.batch.batch_id, channel="features",
                                step=self.app.step_of(item.batch.seq))
            out_ch.send(item)
        self.sentinel.flush()
