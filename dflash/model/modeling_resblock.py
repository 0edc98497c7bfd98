"""The ``"resblock"`` drafter (:mod:`dflash.model.resblock`) as a transformers model, for
``trust_remote_code`` loading of its export.

``python -m dflash.export`` writes this file beside ``modeling_dflash.py`` and points ``auto_map``
at :class:`DFlashResBlockDraftModel`: the DFlash drafter of ``modeling_dflash.py`` with a
Medusa-style residual block on its output, ``h + SiLU(output_block.linear(h))``, so every entry
point there (``forward``, ``spec_generate``, z-lab's ``dflash_generate`` loop) drafts with it. Like
``modeling_dflash.py`` it imports only torch and transformers (and that file).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .modeling_dflash import DFlashDraftModel, _init_unless_loaded

__all__ = ["DFlashResBlockDraftModel"]


class DFlashResBlock(nn.Module):
    """``x + SiLU(linear(x))``, computed in the weights' dtype."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x.to(self.linear.weight.dtype)))


class DFlashResBlockDraftModel(DFlashDraftModel):
    """:class:`DFlashDraftModel` with ``output_block`` applied to its post-norm hidden states."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.output_block = DFlashResBlock(config.hidden_size)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """The block at zero (the identity, as trained from); the rest as :class:`DFlashDraftModel`."""
        if isinstance(module, DFlashResBlock):
            _init_unless_loaded(module.linear.weight, lambda w: w.zero_())
            _init_unless_loaded(module.linear.bias, lambda b: b.zero_())
        elif module is not getattr(getattr(self, "output_block", None), "linear", None):
            super()._init_weights(module)

    def output(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_block(self.norm(x))
