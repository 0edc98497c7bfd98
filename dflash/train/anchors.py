"""Anchor sampling: where the training blocks of each packed row start.

A block at anchor ``a`` covers positions ``a .. a + bs - 1``: the anchor token is given, slots
``j = 1 .. bs - 1`` predict tokens ``a + j``. A position is an eligible anchor iff

* the whole block lies in the row and in the anchor's document (``doc_ids[a + j] == doc_ids[a]
  >= 0`` for every ``j``): a block never crosses into another packed document or padding;
* the first predicted token is trained: ``loss_mask[a + 1]`` (later slots whose ``loss_mask`` is
  False are masked out of the loss by :mod:`dflash.train.objective`).

Up to ``num_anchors`` distinct anchors per row are drawn uniformly without replacement among the
eligible positions (all of them when fewer are eligible), sorted ascending; unused slots are -1.
A row with no eligible position (all padding, e.g. a packed plan's filler row) gets only -1s, and
its slots are untrained, so the loss (a mean over trained slots) is that of the other rows.
The draw happens on CPU from the caller's ``torch.Generator``, so a (seed, batch) pair gives the
same anchors on any device.
"""

from __future__ import annotations

import torch

__all__ = ["eligible_anchors", "sample_anchors"]


def eligible_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, T]`` bool: positions that may start a block (rule in the module docstring)."""
    B, T = doc_ids.shape
    doc = doc_ids.long()
    ok = doc >= 0
    if T < block_size:
        return torch.zeros(B, T, dtype=torch.bool, device=doc.device)
    same = torch.ones(B, T - block_size + 1, dtype=torch.bool, device=doc.device)
    for j in range(1, block_size):
        same &= doc[:, j: T - block_size + 1 + j] == doc[:, : T - block_size + 1]
    out = torch.zeros(B, T, dtype=torch.bool, device=doc.device)
    out[:, : T - block_size + 1] = same & ok[:, : T - block_size + 1] & loss_mask[:, 1: T - block_size + 2].bool()
    return out


def sample_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor, num_anchors: int,
                   block_size: int, generator: torch.Generator) -> torch.Tensor:
    """Draw training anchors.

    Args:
        loss_mask: ``[B, T]`` bool, True on tokens to predict.
        doc_ids: ``[B, T]`` int, -1 on padding.
        num_anchors: ``A``, slots per row.
        block_size: ``bs``.
        generator: a CPU ``torch.Generator`` (seed it from (run seed, batch id)).

    Returns:
        ``[B, A]`` int64 on ``loss_mask``'s device: ascending anchors, then -1 in empty slots.

    Raises:
        ValueError: ``num_anchors < 1`` or a non-CPU generator.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    if generator.device.type != "cpu":
        raise ValueError("sample_anchors needs a CPU torch.Generator (device-independent draws)")
    elig = eligible_anchors(loss_mask.cpu(), doc_ids.cpu(), block_size)
    B, T = elig.shape
    keys = torch.rand(B, T, generator=generator)
    keys = torch.where(elig, keys, torch.full_like(keys, -1.0))
    k = min(num_anchors, T)
    top, idx = keys.topk(k, dim=1)
    idx = torch.where(top >= 0, idx, torch.full_like(idx, T))    # T sorts after real anchors
    idx, _ = idx.sort(dim=1)
    idx = torch.where(idx == T, torch.full_like(idx, -1), idx)
    if k < num_anchors:
        idx = torch.cat([idx, torch.full((B, num_anchors - k), -1, dtype=torch.long)], dim=1)
    return idx.to(loss_mask.device)
