"""What drafts a block in :func:`dflash.eval.decode.speculative_decode`: the proposer protocols and
the proposers built on a drafter.

:class:`DrafterProposer` recomputes the drafter's context each step; :class:`CachedDrafterProposer`
keeps a drafter KV cache (same drafts, tested). A proposer with ``logits`` (these two) or
``sample`` (its own draft distribution, e.g. a DFlash2 selector walk, :mod:`dflash.eval.selector`)
can be used with ``temperature > 0``. :class:`dflash.eval.decode.OracleProposer`, the target's own
continuation, lives with the greedy decode it runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from dflash.model.attention import decode_layout
from dflash.model.drafter import DFlashDrafter, apply_rope
from dflash.model.target import SharedHead
from dflash.model.variants import variant_of

__all__ = ["CachedDrafterProposer", "DrafterContextCache", "DrafterProposer", "Proposer", "SamplingProposer"]


class Proposer(Protocol):
    def propose(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """``tokens [n]`` accepted so far (last = anchor), ``features [1, n-1, k*H]`` of all but
        the anchor -> ``[bs-1]`` drafted token ids (the decoder may use only a prefix). Both
        inputs are views of the decoder's buffers, valid only during the call."""


class SamplingProposer(Protocol):
    def sample(self, tokens: torch.Tensor, features: torch.Tensor, temperature: float,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs as :meth:`Proposer.propose` -> ``(draft [bs-1] int64, q [bs-1, V] fp32)``: a block
        sampled from the proposer's own distribution, row ``j`` of ``q`` the distribution slot
        ``j`` was drawn from given the drafts before it (what the rejection rule divides by)."""


_PROPOSER = {"selector": ("candidate selector", "dflash.eval.selector.selector_proposer"),
             "refiner": ("refiner", "dflash.eval.xpress.xpress_proposer")}


def _refuse_selector(drafter: DFlashDrafter, name: str) -> None:
    """A variant that drafts with more than the backbone's top-1 (DFlash2's selector walk,
    XPress's refiner passes: its ``drafts_with``) is refused: these proposers draft the top-1."""
    spec = variant_of(drafter.cfg.variant)
    if spec.drafts_with != "top1":
        what, use = _PROPOSER[spec.drafts_with]
        raise ValueError(f"{name} drafts with the backbone's top-1 and would ignore this {spec.title} drafter's "
                         f"{what}: use {use}")


class DrafterProposer:
    """Drafts with a :class:`DFlashDrafter` (recomputes the context each step; no drafter cache).

    Raises:
        ValueError: the drafter is a DFlash2 drafter (use :func:`dflash.eval.selector.selector_proposer`).
    """

    def __init__(self, drafter: DFlashDrafter, head: SharedHead) -> None:
        _refuse_selector(drafter, "DrafterProposer")
        self.drafter, self.head = drafter, head
        self.bs = drafter.cfg.block_size

    @torch.no_grad()
    def hidden(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The drafter's post-norm hidden states ``[1, bs, H]`` of the block after ``tokens[-1]``."""
        n = tokens.shape[0]
        block = torch.full((1, 1, self.bs), self.drafter.cfg.mask_token_id, device=tokens.device)
        block[0, 0, 0] = tokens[-1]
        layout = decode_layout(n - 1, n - 1, self.bs, tokens.device)
        return self.drafter(features, self.head.embed(block), layout)[:, 0]

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The drafter's logits ``[bs-1, V]`` (head dtype) for the block after ``tokens[-1]``."""
        return self.head.logits(self.hidden(tokens, features)[0, 1:])

    def propose(self, tokens, features):
        return self.logits(tokens, features).argmax(-1)


class DrafterContextCache:
    """A per-layer KV cache of a drafter's context, shared by the cached proposers.

    The drafter's context keys/values depend only on the context features (every layer attends to
    the same ``hidden_norm(fc(features))``), and the context only grows by accepted tokens, so each
    step projects the new features alone. The cache is one buffer per layer, ``[1, nkv, capacity,
    head_dim]``, doubled when full: the block's own keys/values are written just after the
    context and the block attends to ``buffer[:, :, :context + bs]`` with no mask (full-attention
    layers: the block sees all context and itself); the next step's context overwrites them.

    Raises:
        ValueError: the drafter has sliding-window layers.
    """

    def __init__(self, drafter: DFlashDrafter, head: SharedHead, capacity: int = 256) -> None:
        if any(t != "full_attention" for t in drafter.cfg.types):
            raise ValueError(f"{type(self).__name__} supports full-attention drafter layers only")
        self.drafter, self.head = drafter, head
        self.bs = drafter.cfg.block_size
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.cached = 0

    def _reserve(self, need: int, device: torch.device) -> None:
        """Make every layer's buffer hold at least ``need`` positions (keeps the cached ones)."""
        if self.keys and need <= self.keys[0].shape[2]:
            return
        self._grow_to(max(need, 2 * self.keys[0].shape[2] if self.keys else self.capacity), device)

    def _grow_to(self, cap: int, device: torch.device, alloc: Callable[..., torch.Tensor] = torch.empty) -> None:
        """Every layer's key and value buffers ``[1, kv heads, cap, head dim]``, made with ``alloc``
        (``torch.empty`` or ``torch.zeros``), the ``cached`` positions copied over."""
        dtype = self.drafter.fc.weight.dtype
        for i, layer in enumerate(self.drafter.layers):
            a = layer.self_attn
            k = alloc(1, a.nkv, cap, a.d, device=device, dtype=dtype)
            v = alloc(1, a.nkv, cap, a.d, device=device, dtype=dtype)
            if i < len(self.keys):
                k[:, :, : self.cached] = self.keys[i][:, :, : self.cached]
                v[:, :, : self.cached] = self.values[i][:, :, : self.cached]
                self.keys[i], self.values[i] = k, v
            else:
                self.keys.append(k)
                self.values.append(v)

    @torch.no_grad()
    def _extend(self, features: torch.Tensor) -> None:
        """Project the features of context positions ``cached..`` into every layer's cache."""
        d = self.drafter
        new = features[:, self.cached:]                                      # [1, t, k*H]
        t = new.shape[1]
        if t == 0:
            return
        ctx = d.hidden_norm(d.fc(new.to(d.fc.weight.dtype)))                 # [1, t, H]
        pos = torch.arange(self.cached, self.cached + t, device=new.device)[None]
        cos, sin = d._rope_table(pos)
        end = self.cached + t
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            k = a.k_norm(a.k_proj(ctx).view(1, t, a.nkv, a.d)).transpose(1, 2)
            self.keys[i][:, :, self.cached:end] = apply_rope(k, cos, sin)
            self.values[i][:, :, self.cached:end] = a.v_proj(ctx).view(1, t, a.nkv, a.d).transpose(1, 2)
        self.cached = end


class CachedDrafterProposer(DrafterContextCache):
    """Drafts with a :class:`DFlashDrafter` keeping a per-layer KV cache of the context
    (:class:`DrafterContextCache`). Same drafts as :class:`DrafterProposer` up to float rounding
    (tested). Use one instance per generation.

    Raises:
        ValueError: the drafter has sliding-window layers (use :class:`DrafterProposer`), or is a
            DFlash2 drafter (use :func:`dflash.eval.selector.selector_proposer`).
    """

    def __init__(self, drafter: DFlashDrafter, head: SharedHead, capacity: int = 256) -> None:
        _refuse_selector(drafter, "CachedDrafterProposer")
        super().__init__(drafter, head, capacity)

    @torch.no_grad()
    def hidden(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The drafter's post-norm hidden states ``[1, bs, H]`` of the block after ``tokens[-1]``."""
        d, bs = self.drafter, self.bs
        self._reserve(features.shape[1] + bs, tokens.device)
        self._extend(features)
        c = self.cached
        block = torch.full((1, bs), d.cfg.mask_token_id, device=tokens.device)
        block[0, 0] = tokens[-1]
        x = self.head.embed(block).to(d.fc.weight.dtype)                     # [1, bs, H]
        qpos = torch.arange(tokens.shape[0] - 1, tokens.shape[0] - 1 + bs, device=tokens.device)[None]
        cos, sin = d._rope_table(qpos)
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = apply_rope(a.q_norm(a.q_proj(h).view(1, bs, a.nh, a.d)).transpose(1, 2), cos, sin)
            kb = a.k_norm(a.k_proj(h).view(1, bs, a.nkv, a.d)).transpose(1, 2)
            self.keys[i][:, :, c:c + bs] = apply_rope(kb, cos, sin)       # scratch after the context
            self.values[i][:, :, c:c + bs] = a.v_proj(h).view(1, bs, a.nkv, a.d).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, self.keys[i][:, :, :c + bs],
                                                 self.values[i][:, :, :c + bs],
                                                 scale=1.0 / math.sqrt(a.d), enable_gqa=a.nh != a.nkv)
            x = x + a.o_proj(out.transpose(1, 2).reshape(1, bs, a.nh * a.d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return d.output(x)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The drafter's logits ``[bs-1, V]`` (head dtype) for the block after ``tokens[-1]``."""
        return self.head.logits(self.hidden(tokens, features)[0, 1:])

    def propose(self, tokens, features):
        return self.logits(tokens, features).argmax(-1)
