"""Block attention for DFlash training and drafting: the layout of blocks and their masks.

A drafter forward attends ``Q = A * bs`` block queries (``A`` blocks of ``block_size`` tokens per
row) over ``K = T + Q`` keys: the row's ``T`` context features followed by every block token.
The rule (DFlash's block attention; tests/dflash/model/test_attention_drafter.py spells it out per element):

* a block query sees context key ``t`` iff ``t < block_end`` (strictly before the block's anchor)
  and ``t`` is in the block's document (``ctx_doc[t] == block_doc``; padding is -1 and never
  matches a valid block);
* it sees the keys of its own block: all of them (bidirectional) in full-attention layers, those at
  or before it (causal) in sliding-window layers; never another block's keys;
* in sliding-window layers a context key must also be within the window:
  ``query_position - key_position < sliding_window`` (positions are RoPE positions, which restart
  at 0 per packed document).

Every query sees at least its own block slot, so no mask row is empty (no NaN from softmax).

Two equivalent mask forms: :func:`sdpa_mask` (bool ``[B, 1, Q, K]``, broadcast over heads, so
memory is ``B * Q * K`` bytes and never ``heads * Q * K``) and :func:`flex_block_mask` (a
``torch.nn.attention.flex_attention.BlockMask`` built from the same predicate, which skips fully
masked 128x128 tiles). Tests check they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BlockLayout", "decode_layout", "flex_block_mask", "mask_predicate", "sdpa_mask",
           "training_layout"]


@dataclass(frozen=True)
class BlockLayout:
    """Where ``A`` blocks per row sit relative to ``T`` context tokens.

    Attributes:
        ctx_positions: ``[B, T]`` int64 RoPE positions of the context tokens.
        ctx_doc: ``[B, T]`` int64 document of each context token (-1 = padding, never visible).
        block_end: ``[B, A]`` int64; the block sees context indices ``t < block_end`` (its anchor).
        block_doc: ``[B, A]`` int64 document of the block (-2 for an empty slot: sees no context).
        block_start_pos: ``[B, A]`` int64 RoPE position of the block's slot 0 (the anchor token).
        block_size: tokens per block (``bs``).
    """

    ctx_positions: torch.Tensor
    ctx_doc: torch.Tensor
    block_end: torch.Tensor
    block_doc: torch.Tensor
    block_start_pos: torch.Tensor
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.block_end.shape[1]

    @property
    def context_len(self) -> int:
        return self.ctx_positions.shape[1]

    def query_positions(self) -> torch.Tensor:
        """``[B, A * bs]`` RoPE positions of the block tokens (anchor position + j)."""
        j = torch.arange(self.block_size, device=self.block_start_pos.device)
        return (self.block_start_pos[:, :, None] + j).flatten(1)


def training_layout(position_ids: torch.Tensor, doc_ids: torch.Tensor, anchors: torch.Tensor,
                    block_size: int) -> BlockLayout:
    """Layout of training blocks at ``anchors`` within packed rows.

    Args:
        position_ids, doc_ids: ``[B, T]`` (positions restart per document; doc -1 = padding).
        anchors: ``[B, A]`` int64 anchor indices into ``T``, -1 = empty slot.
        block_size: ``bs``.
    """
    valid = anchors >= 0
    safe = anchors.clamp(min=0)
    doc = doc_ids.long()
    return BlockLayout(
        ctx_positions=position_ids.long(),
        ctx_doc=doc,
        block_end=torch.where(valid, safe, torch.zeros_like(safe)),
        block_doc=torch.where(valid, doc.gather(1, safe), torch.full_like(safe, -2)),
        block_start_pos=torch.where(valid, position_ids.long().gather(1, safe), torch.zeros_like(safe)),
        block_size=block_size,
    )


def decode_layout(context_len: int, anchor_position: int, block_size: int,
                  device: torch.device | str) -> BlockLayout:
    """Layout for drafting one block after ``context_len`` accepted tokens (batch of one).

    The context holds positions ``0..context_len-1``; the block's anchor (the last accepted token,
    whose target features are not yet known) is at ``anchor_position``.
    """
    z = torch.zeros(1, 1, dtype=torch.long, device=device)
    return BlockLayout(
        ctx_positions=torch.arange(context_len, device=device)[None],
        ctx_doc=torch.zeros(1, context_len, dtype=torch.long, device=device),
        block_end=z + context_len,
        block_doc=z,
        block_start_pos=z + anchor_position,
        block_size=block_size,
    )


def mask_predicate(layout: BlockLayout, causal_block: bool, window: int | None):
    """The attention rule as ``fn(b, q, kv) -> bool tensor`` over broadcastable index tensors.

    Used verbatim by both mask builders, so SDPA and flex see one definition.
    """
    T, bs = layout.context_len, layout.block_size
    qpos = layout.query_positions()                          # [B, Q]
    ctx_doc, ctx_pos = layout.ctx_doc, layout.ctx_positions
    end, bdoc = layout.block_end, layout.block_doc

    def fn(b, q, kv):
        a = q // bs
        is_ctx = kv < T
        t = torch.clamp(kv, max=T - 1) if T > 0 else kv * 0
        kb = torch.clamp(kv - T, min=0)
        if T > 0:
            ctx_ok = is_ctx & (t < end[b, a]) & (ctx_doc[b, t] == bdoc[b, a])
            if window is not None:
                ctx_ok = ctx_ok & (qpos[b, q] - ctx_pos[b, t] < window)
        else:
            ctx_ok = is_ctx
        blk_ok = ~is_ctx & (kb // bs == a)
        if causal_block:
            blk_ok = blk_ok & (kb % bs <= q % bs)
        return ctx_ok | blk_ok

    return fn


def sdpa_mask(layout: BlockLayout, causal_block: bool = False,
              window: int | None = None) -> torch.Tensor:
    """Bool mask ``[B, 1, Q, T + Q]`` (True = attend) for ``scaled_dot_product_attention``."""
    B = layout.block_end.shape[0]
    Q = layout.num_blocks * layout.block_size
    K = layout.context_len + Q
    dev = layout.block_end.device
    b = torch.arange(B, device=dev)[:, None, None]
    q = torch.arange(Q, device=dev)[None, :, None]
    kv = torch.arange(K, device=dev)[None, None, :]
    return mask_predicate(layout, causal_block, window)(b, q, kv)[:, None]


def flex_block_mask(layout: BlockLayout, causal_block: bool = False, window: int | None = None):
    """The same rule as a flex_attention ``BlockMask`` (``torch.nn.attention.flex_attention``)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B = layout.block_end.shape[0]
    Q = layout.num_blocks * layout.block_size
    fn = mask_predicate(layout, causal_block, window)

    def mask_mod(b, h, q, kv):
        return fn(b, q, kv)

    return create_block_mask(mask_mod, B, None, Q, layout.context_len + Q,
                             device=layout.block_end.device)
