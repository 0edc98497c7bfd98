"""Target hidden states -> the drafter's features: the feature noise and the :class:`DrafterInput`.

One module for both sides of ``[train].postprocess_side``: the target stage calls
:meth:`FeaturePostprocess.at_target` on its output, the postprocess stage calls
:meth:`FeaturePostprocess.at_drafter` after the move to the drafter's device. The config says on
which side the noise is added, so the message carries no flag: exactly one of the two adds it, and
both sides give the same :class:`DrafterInput` (tests/dflash/run/test_run_e2e.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.messages import DrafterInput, TargetOutput
from dflash.seeding import FEATURE_NOISE, derive_seed

__all__ = ["FeaturePostprocess", "apply_feature_noise", "to_drafter_input"]


def apply_feature_noise(features: torch.Tensor, *, std: float, seed: int, batch_id: int) -> torch.Tensor:
    """``features + std * rms(features) * N(0, 1)``; rms is per token over the ``k*H`` features.

    ``features``: ``[B, T, k*H]`` (any float dtype; the result has the same dtype and device).
    The noise comes from a generator seeded by (seed, batch id) on the features' device, so it is
    reproducible across resume. ``std == 0`` returns ``features`` unchanged.

    Computed in fp32 in place: at most one fp32 ``[B, T, k*H]`` buffer is alive at a time (the
    squares, then the noise, which takes the sum), not four, with the same values operation by
    operation as the plain formula (tests/dflash/train/test_step_sync.py).
    """
    if std <= 0:
        return features
    rms = features.to(torch.float32, copy=True).pow_(2).mean(-1, keepdim=True).sqrt_()
    noise_seed = derive_seed(seed, batch_id + 1, salt=FEATURE_NOISE)
    gen = torch.Generator(device=features.device).manual_seed(noise_seed)
    noise = torch.randn(features.shape, generator=gen, device=features.device, dtype=torch.float32)
    return noise.mul_(std * rms).add_(features).to(features.dtype)


def to_drafter_input(out: TargetOutput, *, feature_noise: float, seed: int) -> DrafterInput:
    """The drafter's input for one target output, with ``feature_noise`` (0: none) added to its
    ``layer_hidden``; the tensors stay on ``out``'s device."""
    features = apply_feature_noise(out.layer_hidden, std=feature_noise, seed=seed, batch_id=out.batch.batch_id)
    return DrafterInput(
        batch=out.batch,
        features=features,
        final_hidden=out.final_hidden,
        anchors=out.batch.anchors,
        replica=out.replica,
        target_s=out.target_s,
    )


@dataclass(frozen=True)
class FeaturePostprocess:
    """Where and how the features are post-processed: ``[train].feature_noise`` (std, a fraction of
    the per-token rms), ``[run].seed`` and ``[train].postprocess_side`` ("target" or "drafter");
    built by :func:`dflash.run.resolve.resolve` for the target and postprocess stages' options."""

    noise: float
    seed: int
    side: str = "drafter"

    def at_target(self, layer_hidden: torch.Tensor, batch_id: int) -> torch.Tensor:
        """The target side: ``[B, T, k*H]`` with the noise added when ``side == "target"``."""
        if self.side != "target":
            return layer_hidden
        return apply_feature_noise(layer_hidden, std=self.noise, seed=self.seed, batch_id=batch_id)

    def at_drafter(self, out: TargetOutput) -> DrafterInput:
        """The drafter side: the :class:`DrafterInput`, with the noise added when ``side == "drafter"``."""
        return to_drafter_input(out, feature_noise=self.noise if self.side == "drafter" else 0.0, seed=self.seed)
