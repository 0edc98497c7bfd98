"""Greedy decoding with a target: plain, and draft-and-verify with a drafter proposing blocks.

One step of speculative decoding (greedy; DFlash / speculative decoding, Leviathan et al. 2023):

1. The last accepted token is the anchor; its target features are not known yet. The drafter
   sees the features of every earlier token and proposes ``bs - 1`` tokens for the block
   ``[anchor, mask, ..., mask]`` in one forward.
2. The target runs over ``[anchor, d_1 .. d_{bs-1}]`` with its KV cache and takes its argmax
   ``g_0 .. g_{bs-1}`` (``g_i`` is its token for the position after block slot ``i``).
3. Accept ``m`` = the longest prefix with ``d_i == g_{i-1}``, then the bonus token ``g_m``; the
   target's features of the anchor and the ``m`` accepted drafts join the context, its cache is
   cropped to the accepted tokens. Output equals plain greedy decoding (tested).

``m`` is the *accepted length* of the step (bonus not counted); the step produces ``tau = m + 1``
tokens, the figure z-lab's reference decoder and SGLang report (:mod:`dflash.train.acceptance`). Near the
end of a generation only as many tokens are drafted as remain (``min(bs - 1, remaining)``), and
the output is cut to exactly ``max_new_tokens``.

Proposers: :class:`DrafterProposer` (recomputes the drafter's context each step),
:class:`CachedDrafterProposer` (a drafter KV cache; same drafts), :class:`OracleProposer` (the
target's own continuation: every draft accepted). Used by ``python -m dflash.eval``
(:mod:`dflash.eval.measure`) and ``benchmarks/decode_speed.py``.
"""

from __future__ import annotations

import inspect
import math
from typing import Protocol

import torch
import torch.nn.functional as F

from dflash.model.attention import decode_layout
from dflash.model.drafter import DFlashDrafter, _rope
from dflash.model.target import SharedHead, Target

__all__ = ["CachedDrafterProposer", "DrafterProposer", "OracleProposer", "Proposer", "greedy_decode",
           "speculative_decode"]


class Proposer(Protocol):
    def propose(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """``tokens [n]`` accepted so far (last = anchor), ``features [1, n-1, k*H]`` of all but
        the anchor -> ``[bs-1]`` drafted token ids (the decoder may use only a prefix)."""


class DrafterProposer:
    """Drafts with a :class:`DFlashDrafter` (recomputes the context each step; no drafter cache)."""

    def __init__(self, drafter: DFlashDrafter, head: SharedHead) -> None:
        self.drafter, self.head = drafter, head
        self.bs = drafter.cfg.block_size

    @torch.no_grad()
    def propose(self, tokens, features):
        n = tokens.shape[0]
        block = torch.full((1, 1, self.bs), self.drafter.cfg.mask_token_id, device=tokens.device)
        block[0, 0, 0] = tokens[-1]
        layout = decode_layout(n - 1, n - 1, self.bs, tokens.device)
        hidden = self.drafter(features, self.head.embed(block), layout)      # [1, 1, bs, H]
        return self.head.logits(hidden[0, 0, 1:]).argmax(-1)


class CachedDrafterProposer:
    """Drafts with a :class:`DFlashDrafter` keeping a per-layer KV cache of the context.

    The drafter's context keys/values depend only on the context features (every layer attends to
    the same ``hidden_norm(fc(features))``), and the context only grows by accepted tokens, so each
    step projects the new features alone and the block attends to ``cat(cache, block)`` with no
    mask (full-attention layers: the block sees all context and itself). Same drafts as
    :class:`DrafterProposer` up to float rounding (tested). Use one instance per generation.

    Raises:
        ValueError: the drafter has sliding-window layers (use :class:`DrafterProposer`).
    """

    def __init__(self, drafter: DFlashDrafter, head: SharedHead) -> None:
        if any(t != "full_attention" for t in drafter.cfg.types):
            raise ValueError("CachedDrafterProposer supports full-attention drafter layers only")
        self.drafter, self.head = drafter, head
        self.bs = drafter.cfg.block_size
        self.keys: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self.values: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self.cached = 0

    @torch.no_grad()
    def _extend(self, features: torch.Tensor) -> None:
        """Project the features of context positions ``cached..`` into every layer's cache."""
        d = self.drafter
        new = features[:, self.cached:]                                      # [1, t, k*H]
        if new.shape[1] == 0:
            return
        ctx = d.hidden_norm(d.fc(new.to(d.fc.weight.dtype)))                 # [1, t, H]
        pos = torch.arange(self.cached, self.cached + new.shape[1], device=new.device)[None]
        cos, sin = d._rope_table(pos)
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            k = a.k_norm(a.k_proj(ctx).view(1, -1, a.nkv, a.d)).transpose(1, 2)
            v = a.v_proj(ctx).view(1, -1, a.nkv, a.d).transpose(1, 2)
            k = _rope(k, cos, sin)
            self.keys[i] = k if self.keys[i] is None else torch.cat([self.keys[i], k], dim=2)
            self.values[i] = v if self.values[i] is None else torch.cat([self.values[i], v], dim=2)
        self.cached += new.shape[1]

    @torch.no_grad()
    def propose(self, tokens, features):
        d = self.drafter
        self._extend(features)
        block = torch.full((1, self.bs), d.cfg.mask_token_id, device=tokens.device)
        block[0, 0] = tokens[-1]
        x = self.head.embed(block).to(d.fc.weight.dtype)                     # [1, bs, H]
        qpos = torch.arange(tokens.shape[0] - 1, tokens.shape[0] - 1 + self.bs, device=tokens.device)[None]
        cos, sin = d._rope_table(qpos)
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = _rope(a.q_norm(a.q_proj(h).view(1, self.bs, a.nh, a.d)).transpose(1, 2), cos, sin)
            kb = _rope(a.k_norm(a.k_proj(h).view(1, self.bs, a.nkv, a.d)).transpose(1, 2), cos, sin)
            vb = a.v_proj(h).view(1, self.bs, a.nkv, a.d).transpose(1, 2)
            k = torch.cat([self.keys[i], kb], dim=2) if self.keys[i] is not None else kb
            v = torch.cat([self.values[i], vb], dim=2) if self.values[i] is not None else vb
            out = F.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(a.d),
                                                 enable_gqa=a.nh != a.nkv)
            x = x + a.o_proj(out.transpose(1, 2).reshape(1, self.bs, a.nh * a.d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.head.logits(d.norm(x)[0, 1:]).argmax(-1)


class OracleProposer:
    """Proposes the target's own greedy continuation (an upper bound: every draft is accepted)."""

    def __init__(self, target: Target, block_size: int) -> None:
        self.target, self.bs = target, block_size

    @torch.no_grad()
    def propose(self, tokens, features):
        return greedy_decode(self.target, tokens, self.bs - 1)[tokens.shape[0]:]


def _cache_kwarg(target: Target) -> str:
    """The KV-cache keyword of the base model's forward (``cache`` in newer transformers 5.x)."""
    params = inspect.signature(target.model.model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(target: Target):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=target.hf_config)
    except TypeError:
        return DynamicCache()


def _crop(cache, keep: int) -> None:
    """Keep the first ``keep`` cached tokens. A negative ``crop`` argument means "remove that
    many" in every transformers 5.x; 0 must be skipped (older 5.x read it as "keep 0")."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


@torch.no_grad()
def _target_step(target: Target, ids: torch.Tensor, start: int, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached forward of ``ids [n]`` at positions ``start..``: ``(features [1, n, k*H],
    argmax [n])`` (logits only for these ``n`` positions)."""
    pos = torch.arange(start, start + ids.shape[0], device=ids.device)[None]
    out = target.model.model(input_ids=ids[None], position_ids=pos, use_cache=True,
                              **{_cache_kwarg(target): cache})
    feats = target.collect()
    logits = target.model.get_output_embeddings()(out.last_hidden_state[0])
    return feats, logits.argmax(-1)


@torch.no_grad()
def greedy_decode(target: Target, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Plain greedy decoding with a KV cache: ``prompt [n]`` -> ``[n + max_new_tokens]``."""
    cache = _new_cache(target)
    _, g = _target_step(target, prompt, 0, cache)
    out = [*prompt.tolist(), int(g[-1])]
    for _ in range(max_new_tokens - 1):
        _, g = _target_step(target, torch.tensor(out[-1:], device=prompt.device), len(out) - 1, cache)
        out.append(int(g[-1]))
    return torch.tensor(out, device=prompt.device)


@torch.no_grad()
def speculative_decode(target: Target, proposer: Proposer, prompt: torch.Tensor,
                       max_new_tokens: int, block_size: int
                       ) -> tuple[torch.Tensor, list[int], list[int]]:
    """Greedy draft-and-verify (module docstring).

    Returns:
        ``(tokens [n + max_new_tokens], accepted m per step, anchor index per step)``: the last
        step drafts only as many tokens as remain; a bonus token past the end is dropped.
    """
    cache = _new_cache(target)
    feats, g = _target_step(target, prompt, 0, cache)                        # prefill
    tokens = torch.cat([prompt, g[-1:]])
    accepted, anchors = [], []
    while tokens.shape[0] - prompt.shape[0] < max_new_tokens:
        n = tokens.shape[0]
        remaining = max_new_tokens - (n - prompt.shape[0])                   # >= 1
        draft = proposer.propose(tokens, feats)[: min(block_size - 1, remaining)]  # [<= bs-1]
        block = torch.cat([tokens[-1:], draft])
        f_blk, g = _target_step(target, block, n - 1, cache)                 # g: [bs]
        match = (draft == g[: draft.shape[0]]).long().cumprod(0)
        m = int(match.sum())
        tokens = torch.cat([tokens, draft[:m], g[m:m + 1]])
        feats = torch.cat([feats, f_blk[:, : m + 1]], dim=1)
        _crop(cache, n + m)
        accepted.append(m)
        anchors.append(n - 1)
    return tokens[: prompt.shape[0] + max_new_tokens], accepted, anchors
