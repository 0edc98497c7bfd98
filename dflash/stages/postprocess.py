"""``dflash.postprocess``: target hidden states -> drafter input on the drafter's device.

Builds the drafter's features (the target already concatenates the captured layers per token:
``[B, T, k*H]``), adds the optional feature noise, and moves everything to the drafter's device by
the cheapest correct route (:func:`csp.cuda.to_device`): by reference on the same device (the channel
orders it with an event), device to device to another GPU, through host memory only when
``[train].host_staging`` asks for it.

``[train].postprocess_side`` chooses where the computation runs: in the target replica, on the
features' source device before the move ("target"; ``TargetOutput.postprocessed`` is then True), or
here on the drafter's device after the move ("drafter"). Both give the same :class:`DrafterInput`
(tests/test_stages.py checks it).
"""

from __future__ import annotations

import torch

import csp
from dflash.app import RunApp
from dflash.messages import DrafterInput, TargetOutput
from dflash.sentinel import FiniteSentinel


def apply_feature_noise(features: torch.Tensor, *, std: float, seed: int, batch_id: int) -> torch.Tensor:
    """``features + std * rms(features) * N(0, 1)``; rms is per token over the ``k*H`` features.

    The noise comes from a generator seeded by (seed, batch id) on the features' device, so it is
    reproducible across resume. ``std == 0`` returns ``features`` unchanged.

    Computed in fp32 in place: at most one fp32 ``[B, T, k*H]`` buffer is alive at a time (the
    squares, then the noise, which takes the sum), not four, with the same values operation by
    operation as the plain formula (tests/test_step_sync.py).
    """
    if std <= 0:
        return features
    rms = features.to(torch.float32, copy=True).pow_(2).mean(-1, keepdim=True).sqrt_()
    gen = torch.Generator(device=features.device).manual_seed((seed * 7_000_003 + batch_id + 1) % (2**63))
    noise = torch.randn(features.shape, generator=gen, device=features.device, dtype=torch.float32)
    return noise.mul_(std * rms).add_(features).to(features.dtype)


def to_drafter_input(out: TargetOutput, *, feature_noise: float, seed: int) -> DrafterInput:
    """The drafter's input for one target output (noise applied unless already ``postprocessed``)."""
    features = out.layer_hidden
    if not out.postprocessed:
        features = apply_feature_noise(features, std=feature_noise, seed=seed, batch_id=out.batch.batch_id)
    return DrafterInput(
        batch=out.batch,
        features=features,
        final_hidden=out.final_hidden,
        anchors=out.batch.anchors,
        replica=out.replica,
        target_s=out.target_s,
    )


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
        self.seed = app.cfg.run.seed
        self.device = self.ctx.device or torch.device("cpu")
        self.sentinel = FiniteSentinel(self.ctx.qualname, enabled=self.train.check_channels)

    def process(self, out: TargetOutput) -> DrafterInput:
        """One target output -> drafter input on this process's device."""
        with self.ctx.span("postprocess"):
            out = csp.cuda.to_device(out, self.device, via_host=self.train.host_staging)
            return to_drafter_input(out, feature_noise=self.train.feature_noise, seed=self.seed)

    def run(self, inputs, outputs) -> None:
        out_ch = outputs["features"]
        for out in inputs["hidden"]:
            item = self.process(out)
            self.sentinel.check(item, batch_id=item.batch.batch_id, channel="features",
                                step=self.app.step_of(item.batch.seq))
            out_ch.send(item)
        self.sentinel.flush()
