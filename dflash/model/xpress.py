"""XPress's causal refiner: a low-rank head on the DFlash backbone that corrects each block slot's
logits from the token before it, resolved at decode time by a few parallel Jacobi passes.

Source: XPress (arXiv 2608.02438) as vLLM speculators 0.9 implements it (``speculators/models/
xpress/``, registered as ``xpress``; its released checkpoints use rank 256, MLP ratio 2, 6 passes).
``[drafter].variant = "xpress"`` adds the refiner as ``refiner_head``, with speculators' parameter
names and shapes, so its weights load there as they are.

For a block of ``b`` slots (slot 0 the anchor, slot ``j`` predicting token ``anchor + j``), with
``h [b, H]`` the backbone's post-norm hidden states, ``g`` their mean over the block, ``y_prev[j]``
the token before the one slot ``j`` predicts (the token before the anchor for slot 0, the anchor for
slot 1, the draft or label of slot ``j - 1`` after that), all in rank ``r``::

    a_j  = in_proj([down_h(h_j) ; down_g(g) ; token_embed(y_prev[j])])
    c_j  = a_j + sum_{i <= j} L[:, j, i] * a_i          # causal mix over the block, per channel
    x_j  = c_j + mlp_down(silu(mlp_gate(c_j)) * mlp_up(c_j))
    z'_j = z_j + readout(x_j)                           # z_j the backbone's logits (the target's LM head)

``L = mix_l * tril`` (``[r, b, b]``; a block served shorter than trained uses its leading ``b x b``).
Slot ``j``'s refined logits depend on the tokens before slot ``j`` only, so greedy decoding is a
left-to-right walk; :meth:`XPressRefiner.jacobi` runs it as ``K`` parallel passes instead (each
pass re-reads every slot's predecessor from the previous pass's argmax, the first from the
backbone's), and after ``K >= b - 1`` passes it equals the serial walk exactly (pass ``k`` fixes
slot ``k``); the released recipe stops at ``K = 6``.

Initialisation: ``N(0, 0.02)`` for the embedding and the projections (speculators' recipe), the mix
at zero (speculators') and ``readout`` at zero (this project's choice): a fresh XPress drafter's
logits are exactly its backbone's, so it starts as the DFlash drafter of the same seed, and every
refiner weight still gets a gradient from the second step on (``readout`` from the first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from dflash.model.drafter_config import DrafterConfig

__all__ = ["XPressRefiner", "drafter_parts", "predecessors"]


def drafter_parts(cfg: DrafterConfig) -> dict[str, nn.Module]:
    """The drafter's ``refiner_head``."""
    return {"refiner_head": XPressRefiner(cfg.vocab_size, cfg.hidden_size, cfg.block_size, cfg.xpress_rank,
                                          cfg.xpress_mlp_ratio)}


def predecessors(before_anchor: torch.Tensor, anchor: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``y_prev [..., b]`` int64: each block slot's predecessor token (module docstring).

    Args:
        before_anchor: ``[...]`` the token before each block's anchor (the anchor itself where the
            anchor starts its document).
        anchor: ``[...]`` the anchors.
        slots: ``[..., b - 1]`` the tokens of slots ``1 .. b-1`` (labels or drafts); the last is
            nobody's predecessor.
    """
    return torch.cat([before_anchor[..., None], anchor[..., None], slots[..., :-1]], dim=-1)


class XPressRefiner(nn.Module):
    """XPress's refiner head (formula in the module docstring).

    Args:
        vocab_size: ``V``, the target's vocabulary (token embedding rows, readout columns).
        hidden_size: ``H``, the drafter's hidden size.
        block_size: the trained block size ``bs`` (the mix's ``[r, bs, bs]``).
        rank: ``r`` (speculators' ``xpress_rank``, released 256).
        mlp_ratio: the refiner MLP's hidden width over ``r`` (released 2).
    """

    def __init__(self, vocab_size: int, hidden_size: int, block_size: int, rank: int = 256,
                 mlp_ratio: int = 2) -> None:
        super().__init__()
        if rank < 1 or mlp_ratio < 1:
            raise ValueError(f"XPress rank and MLP ratio must be >= 1, got {rank} and {mlp_ratio}")
        r = rank
        self.token_embed = nn.Embedding(vocab_size, r)
        self.down_h = nn.Linear(hidden_size, r, bias=False)
        self.down_g = nn.Linear(hidden_size, r, bias=False)
        self.in_proj = nn.Linear(3 * r, r, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(r, block_size, block_size))
        self.mlp_gate = nn.Linear(r, r * mlp_ratio, bias=False)
        self.mlp_up = nn.Linear(r, r * mlp_ratio, bias=False)
        self.mlp_down = nn.Linear(r * mlp_ratio, r, bias=False)
        self.readout = nn.Linear(r, vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """``N(0, 0.02)`` projections and embedding; the mix and ``readout`` at zero (module docstring)."""
        for m in (self.token_embed, self.down_h, self.down_g, self.in_proj, self.mlp_gate, self.mlp_up,
                  self.mlp_down):
            m.weight.normal_(0.0, 0.02, generator=generator)
        self.mix_l.zero_()
        self.readout.weight.zero_()

    def context(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[down_h(h) ; down_g(mean_block h)]`` ``[N, b, 2r]`` from ``hidden [N, b, H]`` (every
        slot, the anchor's included): what every pass shares."""
        h = hidden.to(self.down_h.weight.dtype) if not torch.is_autocast_enabled(hidden.device.type) else hidden
        g = h.mean(dim=1, keepdim=True).expand_as(h)
        return torch.cat([self.down_h(h), self.down_g(g)], dim=-1)

    def mix(self, b: int) -> torch.Tensor:
        """``L = mix_l * tril`` ``[r, b, b]`` for a block of ``b`` slots (the leading ``b x b``)."""
        return self.mix_l[:, :b, :b] * torch.ones(b, b, device=self.mix_l.device, dtype=torch.bool).tril()

    def features(self, prev: torch.Tensor, ctx: torch.Tensor, mix: torch.Tensor | None = None) -> torch.Tensor:
        """``x [N, b, r]`` from the slots' predecessors ``prev [N, b]`` (:func:`predecessors`) and
        :meth:`context` ``ctx [N, b, 2r]``; ``b`` at most the trained block size. ``mix``: :meth:`mix`
        of ``b``, when the caller reuses it across passes."""
        b = prev.shape[1]
        emb = self.token_embed(prev)
        a = self.in_proj(torch.cat([ctx, emb.to(ctx.dtype)], dim=-1))
        mix = self.mix(b) if mix is None else mix
        a = a + torch.einsum("cji,nic->njc", mix.to(a.dtype), a)
        return a + self.mlp_down(F.silu(self.mlp_gate(a)) * self.mlp_up(a))

    def bias(self, x: torch.Tensor) -> torch.Tensor:
        """The logit correction ``readout(x)`` ``[..., V]`` for features ``x [..., r]``."""
        return self.readout(x)

    @torch.no_grad()
    def jacobi(self, base_logits: torch.Tensor, hidden: torch.Tensor, before_anchor: torch.Tensor,
               anchor: torch.Tensor, passes: int, stop_early: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy decoding of ``N`` blocks by ``passes`` parallel Jacobi passes (module docstring).

        Args:
            base_logits: ``[N, b-1, V]`` the backbone's logits of slots ``1 .. b-1``.
            hidden: ``[N, b, H]`` the backbone's hidden states of every slot.
            before_anchor, anchor: ``[N]`` int64 (:func:`predecessors`).
            passes: ``K >= 0``; 0 drafts the backbone's argmax.
            stop_early: stop at a fixed point (a further pass would change nothing, so the result
                is the same either way). Default: on a CPU, where the check is free and a pass is
                not; on a GPU every pass runs, since the check would make the host wait for the
                device at every pass.

        Returns:
            ``(draft [N, b-1] int64, logits [N, b-1, V])``: the last pass's argmax and the refined
            logits it was taken from (the backbone's with ``passes = 0``), each slot's logits
            conditioned on the previous pass's draft before it.
        """
        logits = base_logits
        draft = logits.argmax(-1)
        if passes <= 0:
            return draft, logits
        ctx, mix = self.context(hidden), self.mix(hidden.shape[1])
        stop_early = base_logits.device.type == "cpu" if stop_early is None else stop_early
        for _ in range(passes):
            x = self.features(predecessors(before_anchor, anchor, draft), ctx, mix)
            logits = base_logits + self.bias(x[:, 1:]).to(base_logits.dtype)
            new = logits.argmax(-1)
            if stop_early and torch.equal(new, draft):
                break
            draft = new
        return draft, logits
