"""A Medusa-style residual block between the DFlash backbone and the shared LM head: the
``"resblock"`` variant, a worked example of a variant that lives in its own files.

Medusa (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads", section 2.1.1) decodes each of its heads as ``LMHead(h + SiLU(W h + b))``: one
feed-forward layer with a residual connection in front of the model's LM head, ``W`` and ``b``
zero at the start. Here the block maps every post-norm hidden state of the drafter (``[.., H]``)
before every reader of it (the target's LM head, the confidence head), so each block slot gets one
more nonlinear layer of its own width at ``H * (H + 1)`` parameters::

    h' = h + SiLU(linear(h))          # linear: H -> H, with bias

Zero-initialised, a fresh ``"resblock"`` drafter computes exactly the DFlash drafter of the same
seed (``SiLU(0) = 0``), and ``linear`` still gets a gradient at once (``SiLU'(0) = 1/2``). It
drafts with the backbone's top-1 and trains on the backbone's loss (``drafts_with = "top1"``), so
the decoders, the objective and the fused LM head serve it unchanged. The export names
``DFlashResBlockDraftModel``, defined in ``modeling_resblock.py`` (written beside
``modeling_dflash.py``): z-lab's ``dflash_generate`` and ``spec_generate`` decode with it through
``AutoModel``; vLLM speculators and SpecForge have no such class.

State-dict keys: the backbone's, plus ``output_block.linear.weight`` ``[H, H]`` and
``output_block.linear.bias`` ``[H]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from dflash.model.drafter_config import DrafterConfig

__all__ = ["ResBlock", "drafter_parts"]


class ResBlock(nn.Module):
    """``x + SiLU(linear(x))`` for ``x [..., H]`` (any float dtype: computed in the weights')."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Zero weight and bias: the identity (no draw; ``generator`` is unused)."""
        self.linear.weight.zero_()
        self.linear.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


def drafter_parts(cfg: DrafterConfig) -> dict[str, nn.Module]:
    """The drafter's ``output_block`` (:meth:`dflash.model.drafter.DFlashDrafter.output` applies it)."""
    return {"output_block": ResBlock(cfg.hidden_size)}
