"""The target's document-causal attention mask over packed rows, in each attention path's form.

A token attends to earlier tokens of its own packed document only; ``doc_ids`` ``[B, T]`` gives
each token's document (-1 = padding). (The drafter's block masks are in :mod:`dflash.model.attention`.)
"""

from __future__ import annotations

import torch

__all__ = ["document_attention_mask", "document_causal_mask"]


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` bool mask, True = may attend: causal and within one packed document.

    ``doc_ids`` ``[B, T]`` (-1 = padding). A padding query attends only to itself, so no row is
    empty (SDPA returns NaN for an all-False row); padding outputs are finite and unused.
    Memory is ``B * T^2`` bytes, independent of the head count.
    """
    T = doc_ids.shape[1]
    idx = torch.arange(T, device=doc_ids.device)
    causal = idx[None, :] <= idx[:, None]                                  # [T, T]
    same = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, :, None] >= 0)
    diag = torch.eye(T, dtype=torch.bool, device=doc_ids.device)
    return ((same & causal) | diag)[:, None]


def document_attention_mask(doc_ids: torch.Tensor, attn_implementation: str,
                            dtype: torch.dtype = torch.float32):
    """The document-causal mask in the form ``attn_implementation`` reads it.

    transformers passes a ready 4D mask through unchanged, and each attention path reads it its
    own way, so the form must match the path:

    * ``"sdpa"``: the bool mask of :func:`document_causal_mask` (True = attend);
    * ``"eager"``: an additive ``[B, 1, T, T]`` mask in ``dtype``: 0 where allowed and
      ``finfo(dtype).min`` where not (eager *adds* the mask to the scores, so a bool mask would
      add +1 to allowed keys and mask nothing);
    * ``"flex_attention"``: a ``BlockMask`` of the same rule.

    Raises:
        ValueError: another ``attn_implementation``.
    """
    if attn_implementation == "sdpa":
        return document_causal_mask(doc_ids)
    if attn_implementation == "eager":
        allowed = document_causal_mask(doc_ids)
        return torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min)
    if attn_implementation == "flex_attention":
        return _document_block_mask(doc_ids)
    raise ValueError(f"target.attn_implementation = {attn_implementation!r}: expected "
                     "'sdpa', 'flex_attention' or 'eager'")


def _document_block_mask(doc_ids: torch.Tensor):
    """The flex_attention ``BlockMask`` equivalent of :func:`document_causal_mask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = doc_ids.shape

    def mask_mod(b, h, q, kv):
        same = (doc_ids[b, q] == doc_ids[b, kv]) & (doc_ids[b, q] >= 0)
        return ((kv <= q) & same) | (q == kv)

    return create_block_mask(mask_mod, B, None, T, T, device=doc_ids.device)
