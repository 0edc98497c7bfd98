"""Decoding with a DFlash2 drafter: its blocks drafted by the candidate selector's walk, and the
figures that say what the selector adds.

:class:`SelectorProposer` is a :class:`dflash.eval.decode.Proposer`: the drafter's forward over
one block after the context (the same forward training runs, so the convolutions see exactly the
block they were trained on), the target's LM head on slots 1..bs-1, their top-K, then
:meth:`dflash.model.dflash2.CandidateSelector.walk` from the anchor. This is z-lab's
``dflash_generate`` rule for a ``DFlash2DraftModel`` (greedy); its per-step accepted lengths equal
that decoder's on the same export (tested). It recomputes the drafter's context each step:
``fc`` and the context keys/values over ``n`` tokens per step. :class:`CachedSelectorProposer`
keeps them instead (:class:`dflash.eval.decode.DrafterContextCache`: the context is never
convolved, so DFlash2's context keys/values are DFlash's) and runs only the block through the
layers; same drafts (tested), full-attention drafters only.

Sampled (``temperature = T > 0``; z-lab's ``dflash_generate`` rule for DFlash2): both proposers'
``sample`` walks the same way but draws each slot's token from ``q_j = softmax(score_j / T)`` over
its K candidates (the score given the token drawn for the slot before,
:func:`dflash.model.dflash2.walk_selector`), and returns ``q_j`` scattered onto the vocabulary
(zero off the candidates). :func:`dflash.eval.decode.speculative_decode` accepts a draft with
probability ``min(1, p/q)`` and resamples a rejection from ``norm(max(p - q, 0))``, which covers
the target's mass outside the K; the output is the target's own sampling (chi-square tested).
The walk's ``q`` gets no top-p/top-k: only the target's ``p`` is processed.

:func:`block_figures` scores teacher-forced blocks of a text the way :mod:`dflash.eval.measure`
scores a DFlash drafter: per slot, whether the walk hits the label (the drafts the decode
makes), whether the backbone's top-1 does (what a DFlash drafter of the same weights would
draft), and whether the label is in the top-K at all (recall@K; its leading run per block is the
oracle top-K accepted length, the most any selector over these candidates can accept).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dflash.eval.decode import DrafterContextCache
from dflash.eval.report import SelectorFigures
from dflash.model.attention import decode_layout
from dflash.model.drafter import DFlashDrafter, apply_rope
from dflash.model.target import SharedHead
from dflash.model.variants import variant_of
from dflash.train.acceptance import accuracy_per_position, per_position_list, streak_lengths, tau_from_accepted

__all__ = ["CachedSelectorProposer", "SelectorProposer", "block_figures", "is_dflash2", "selector_figures",
           "selector_proposer"]


def is_dflash2(drafter: DFlashDrafter) -> bool:
    """Whether ``drafter``'s variant drafts with a candidate selector's walk (DFlash2's;
    ``drafts_with = "selector"`` in :mod:`dflash.model.variants`)."""
    return variant_of(drafter.cfg.variant).drafts_with == "selector"


class _Walk:
    """``propose`` and ``sample`` from a subclass's ``slots(tokens, features) -> [1, bs-1, H]``
    (the drafter's post-norm hidden states of the block's slots 1..bs-1)."""

    drafter: DFlashDrafter
    head: SharedHead

    def slots(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The drafter's post-norm hidden states ``[1, bs-1, H]`` of the block's slots 1..bs-1 after
        ``tokens[-1]`` (``features [1, n-1, k*H]``); each proposer computes them its own way."""
        raise NotImplementedError

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The backbone's logits ``[bs-1, V]`` (head dtype) for the block's slots: the marginals
        the selector picks its top-K candidates from. What a tree of drafts is built from
        (:func:`dflash.eval.tree_decode.tree_decode`); the walk itself is :meth:`propose`."""
        return self.head.logits(self.slots(tokens, features)[0])

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """``tokens [n]`` (last = anchor), ``features [1, n-1, k*H]`` -> ``[bs-1]`` drafted ids."""
        slots = self.slots(tokens, features)
        unary, cand = self.drafter.candidate_selector.candidates(self.head.logits(slots))
        return self.drafter.candidate_selector.walk(slots, unary, cand, tokens[-1:])[0][0]

    @torch.no_grad()
    def sample(self, tokens: torch.Tensor, features: torch.Tensor, temperature: float,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled walk (module docstring): ``(draft [bs-1] int64, q [bs-1, V] fp32)``, row ``j``
        of ``q`` the distribution slot ``j`` was drawn from, zero off its K candidates.

        Raises:
            ValueError: ``temperature <= 0`` (the greedy walk is :meth:`propose`).
        """
        if not temperature > 0:
            raise ValueError(f"sample() needs temperature > 0, got {temperature}: use propose() for greedy")
        slots = self.slots(tokens, features)
        logits = self.head.logits(slots)                                     # [1, bs-1, V]
        unary, cand = self.drafter.candidate_selector.candidates(logits)
        path, q = self.drafter.candidate_selector.walk(slots, unary, cand, tokens[-1:], temperature, generator)
        full = torch.zeros(logits.shape[1:], dtype=q.dtype, device=q.device)
        return path[0], full.scatter_(-1, cand[0], q[0])                     # top-K ids are distinct


class SelectorProposer(_Walk):
    """Drafts a block with a DFlash2 drafter's selector walk (module docstring).

    Raises:
        ValueError: ``drafter`` has no candidate selector (``variant = "dflash"``).
    """

    def __init__(self, drafter: DFlashDrafter, head: SharedHead) -> None:
        if not is_dflash2(drafter):
            raise ValueError("SelectorProposer needs a DFlash2 drafter (drafter.variant = \"dflash2\")")
        self.drafter, self.head = drafter, head
        self.bs = drafter.cfg.block_size

    def slots(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        n, d = tokens.shape[0], self.drafter
        block = torch.full((1, 1, self.bs), d.cfg.mask_token_id, device=tokens.device)
        block[0, 0, 0] = tokens[-1]
        hidden = d(features, self.head.embed(block), decode_layout(n - 1, n - 1, self.bs, tokens.device))
        return hidden[0, :, 1:]                                              # [1, bs-1, H]


class CachedSelectorProposer(_Walk, DrafterContextCache):
    """:class:`SelectorProposer` with the drafter's context keys/values cached (module docstring).
    One instance per generation.

    Raises:
        ValueError: no candidate selector, or sliding-window layers (use :class:`SelectorProposer`).
    """

    def __init__(self, drafter: DFlashDrafter, head: SharedHead) -> None:
        if not is_dflash2(drafter):
            raise ValueError("CachedSelectorProposer needs a DFlash2 drafter (drafter.variant = \"dflash2\")")
        super().__init__(drafter, head)

    def slots(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        d, bs = self.drafter, self.bs
        self._reserve(features.shape[1] + bs, tokens.device)
        self._extend(features)
        block = torch.full((1, bs), d.cfg.mask_token_id, device=tokens.device)
        block[0, 0] = tokens[-1]
        x = self.head.embed(block).to(d.fc.weight.dtype)                     # [1, bs, H]
        qpos = torch.arange(tokens.shape[0] - 1, tokens.shape[0] - 1 + bs, device=tokens.device)[None]
        rope = d._rope_table(qpos)
        for i, layer in enumerate(d.layers):
            x = layer.apply_conv(x, lambda h, i=i, a=layer.self_attn: self._attend(a, i, h, rope))
        return d.norm(x)[:, 1:]                                              # [1, bs-1, H]

    def _attend(self, a, i: int, h: torch.Tensor, rope) -> torch.Tensor:
        """Layer ``i``'s attention of the block ``h [1, bs, H]`` over the cached context and itself."""
        n = h.shape[1]
        q = apply_rope(a.q_norm(a.q_proj(h).view(1, n, a.nh, a.d)).transpose(1, 2), *rope)
        kb = apply_rope(a.k_norm(a.k_proj(h).view(1, n, a.nkv, a.d)).transpose(1, 2), *rope)
        vb = a.v_proj(h).view(1, n, a.nkv, a.d).transpose(1, 2)
        c = self.cached  # the block's keys/values are scratch just after the cached context
        self.keys[i][:, :, c:c + n], self.values[i][:, :, c:c + n] = kb, vb
        out = F.scaled_dot_product_attention(q, self.keys[i][:, :, :c + n], self.values[i][:, :, :c + n],
                                             scale=1.0 / math.sqrt(a.d), enable_gqa=a.nh != a.nkv)
        return a.o_proj(out.transpose(1, 2).reshape(1, n, a.nh * a.d))


def selector_proposer(drafter: DFlashDrafter, head: SharedHead) -> SelectorProposer | CachedSelectorProposer:
    """The DFlash2 proposer for ``drafter``: cached when every layer is full attention."""
    if all(t == "full_attention" for t in drafter.cfg.types):
        return CachedSelectorProposer(drafter, head)
    return SelectorProposer(drafter, head)


@torch.no_grad()
def block_figures(drafter: DFlashDrafter, head: SharedHead, hidden: torch.Tensor, anchor_ids: torch.Tensor,
                  labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced hits of ``A`` blocks.

    Args:
        hidden: ``[A, bs, H]`` the drafter's hidden states of the blocks (slot 0 = the anchor).
        anchor_ids: ``[A]`` the blocks' token 0. labels: ``[A, bs-1]`` what verification accepts.

    Returns:
        ``(walk, top1, in_top_k)``, each ``[A, bs-1]`` bool: the selector walk's token is the label,
        the backbone's argmax is, the label is among the top-K.
    """
    sel = drafter.candidate_selector
    slots = hidden[:, 1:]
    logits = head.logits(slots)
    unary, cand = sel.candidates(logits)
    path, _ = sel.walk(slots, unary, cand, anchor_ids)
    return path == labels, logits.argmax(-1) == labels, (cand == labels[..., None]).any(-1)


def selector_figures(drafter: DFlashDrafter, extra, correct: torch.Tensor) -> SelectorFigures:
    """recall@K, oracle top-K tau and the backbone top-1's tau over every teacher-forced block, and
    where the walk loses its tokens per position (``correct [A, bs-1]``: the walk's hits; ``extra``:
    one ``(top1, in_k, valid)`` of :func:`block_figures` per decode)."""
    top1, in_k, valid = (torch.cat(x) for x in zip(*extra))
    hit = correct & valid
    before = torch.cat([torch.ones_like(hit[:, :1]), hit[:, :-1]], dim=1).cumprod(1).bool()  # right up to j-1
    reached = before & valid
    reached_k = reached & in_k

    def rate(num: torch.Tensor, den: torch.Tensor) -> list[float | None]:
        n, d = num.sum(0).float(), den.sum(0).float()
        return [None if int(b) == 0 else float(a / b) for a, b in zip(n, d)]

    return SelectorFigures(
        reached_in_k_per_pos=rate(reached_k, reached),
        reached_pick_per_pos=rate(reached_k & hit, reached_k),
        top_k=drafter.cfg.selector_top_k,
        recall=float((in_k & valid).sum() / valid.sum().clamp(min=1)),
        oracle_tau=tau_from_accepted(float(streak_lengths(in_k, valid).float().mean())),
        backbone_tau=tau_from_accepted(float(streak_lengths(top1, valid).float().mean())),
        backbone_acc_per_pos=per_position_list(accuracy_per_position(top1, valid)))
