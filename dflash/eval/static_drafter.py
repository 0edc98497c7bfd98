"""The drafter's step at a fixed shape over a fixed-capacity context cache, replayed as a CUDA graph.

Once the target's verify step is one graph replay (:mod:`dflash.eval.static_target`), the drafter's
eager step is the host-bound part of a draft-and-verify step: the context projection, every layer
over the block, the LM head, and for DFlash2 the selector's walk, a few hundred small ops.
:class:`StaticDrafter` computes what :class:`dflash.eval.proposers.CachedDrafterProposer` and
:class:`dflash.eval.selector.CachedSelectorProposer` compute, in one fixed-shape function of
static buffers (:class:`dflash.model.cuda_graph.GraphedStep`):

1. The context grows by the features of the tokens accepted since the last step (``t`` rows,
   1 .. bs). The step always projects ``bs`` rows, ``feats [1, bs, k*H]``, into the context cache at
   slots ``cpos = cached + arange(bs)``; the rows past ``t`` are stale buffer rows, and their slots
   are exactly the ones the block overwrites in 2. (the block starts at ``cached + t``). More than
   ``bs`` new rows (the prompt, on the first step) are projected eagerly first, at their own length.
2. The block ``[anchor, mask, ..]`` runs through the layers at positions ``qpos = n-1 + arange(bs)``,
   writing its keys/values at those slots and attending to every slot up to the block's last,
   masked by ``slot <= qpos[-1]`` (a tensor); slot ``i`` always holds position ``i``.
3. Outputs: the post-norm hidden states ``[1, bs, H]``, the logits of slots 1..bs-1 and the greedy
   draft (DFlash: their argmax; DFlash2: the selector's greedy walk from the anchor).

Sampling (``logits`` for DFlash, ``sample`` for DFlash2: the walk draws from a generator) reads the
graph's outputs and draws eagerly, so a generator's stream is the eager proposers'. The cache is
zero-filled, so a masked slot is never NaN. One instance is reused by later generations of the same
drafter, head and block size (:func:`acquire`; the proposer hands it back when it is freed).
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

from dflash.model.cuda_graph import GraphedStep, weights_signature
from dflash.eval.proposers import DrafterContextCache
from dflash.model.drafter import DFlashDrafter, apply_rope
from dflash.model.target import SharedHead
from dflash.model.variants import variant_of

__all__ = ["StaticDrafter", "StaticDrafterProposer", "StaticSelectorProposer", "acquire", "pooled",
           "static_proposer"]

MIN_CAPACITY = 256


class StaticDrafter(DrafterContextCache):
    """A DFlash or DFlash2 drafter's cached step at a fixed shape (module docstring).

    Raises:
        ValueError: sliding-window layers, or an XPress drafter (its refiner runs Jacobi passes).
    """

    def __init__(self, drafter: DFlashDrafter, head: SharedHead, capacity: int = MIN_CAPACITY,
                 graphs: bool = True) -> None:
        if variant_of(drafter.cfg.variant).drafts_with == "refiner":
            raise ValueError("StaticDrafter drafts the backbone's top-1 or the selector's walk; an XPress drafter "
                             "refines with Jacobi passes: use dflash.eval.xpress.xpress_proposer")
        # a proxy: the pool (acquire) is keyed weakly on the drafter, and an idle step must not keep
        # its drafter alive; owner names the pool it returns to
        super().__init__(weakref.proxy(drafter), head, capacity)
        self.owner = weakref.ref(drafter)
        dev, bs, kH = head.embed_tokens.weight.device, self.bs, drafter.fc.weight.shape[1]
        self.dflash2 = variant_of(drafter.cfg.variant).drafts_with == "selector"
        self.feats = torch.zeros(1, bs, kH, device=dev, dtype=drafter.fc.weight.dtype)
        self.cpos = torch.zeros(1, bs, dtype=torch.long, device=dev)
        self.qpos = torch.zeros(1, bs, dtype=torch.long, device=dev)
        self.block = torch.full((1, bs), drafter.cfg.mask_token_id, dtype=torch.long, device=dev)
        self.offsets = torch.arange(bs, device=dev)
        self.asked_graphs = graphs
        self.weights = weights_signature(drafter, head)
        self.step = GraphedStep(self._forward, graphs, dev.type == "cuda", f"the drafter's {bs}-token step")
        self._reserve(capacity, dev)

    def _reserve(self, need: int, device: torch.device) -> None:
        """Room for ``need`` slots, zero-filled (a masked slot must not be NaN: ``0 * NaN``); growing
        reallocates, so the graph, which reads the old buffers, is captured again."""
        if self.keys and need <= self.keys[0].shape[2]:
            return
        cap = max(need, MIN_CAPACITY, 2 * self.keys[0].shape[2] if self.keys else 0)
        cap = 1 << (cap - 1).bit_length()
        self._grow_to(cap, device, torch.zeros)
        self.slots = torch.arange(cap, device=device)
        if hasattr(self, "step"):
            self.step.reset()

    @torch.no_grad()
    def run(self, tokens: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step for the block after ``tokens [n]`` (last = anchor), ``features [1, n-1, k*H]``:
        ``(hidden [1, bs, H] post-norm, logits [1, bs-1, V], draft [bs-1] int64)``, views of static
        buffers valid until the next call."""
        ctx, bs = features.shape[1], self.bs
        self._reserve(ctx + bs, tokens.device)
        if ctx - self.cached > bs:                  # the prompt: all but the last bs rows, eagerly
            self._extend(features[:, : ctx - bs])
        t = ctx - self.cached                                                # 1 .. bs new rows
        self.feats[:, :t] = features[:, self.cached:]
        torch.add(self.offsets, self.cached, out=self.cpos[0])
        torch.add(self.offsets, ctx, out=self.qpos[0])
        self.block[0, :1] = tokens[-1:]
        out = self.step()
        self.cached = ctx
        return out

    def _forward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fixed-shape step of the static inputs (module docstring, 1.-3.); no host reads."""
        d, bs = self.drafter, self.bs
        ctx = d.hidden_norm(d.fc(self.feats))                                # [1, bs, H]
        rope_c = d._rope_table(self.cpos)
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            k = a.k_norm(a.k_proj(ctx).view(1, bs, a.nkv, a.d)).transpose(1, 2)
            self.keys[i].index_copy_(2, self.cpos[0], apply_rope(k, *rope_c))
            self.values[i].index_copy_(2, self.cpos[0], a.v_proj(ctx).view(1, bs, a.nkv, a.d).transpose(1, 2))
        x = self.head.embed(self.block).to(d.fc.weight.dtype)                # [1, bs, H]
        rope_q = d._rope_table(self.qpos)
        mask = (self.slots <= self.qpos[0, -1])[None, None, None]            # [1, 1, 1, capacity]
        for i, layer in enumerate(d.layers):
            attend = lambda h, i=i, a=layer.self_attn: self._attend(a, i, h, rope_q, mask)  # noqa: E731
            if layer.attention_conv is not None:                             # DFlash2's layer
                x = layer.apply_conv(x, attend)
            else:
                x = x + attend(layer.input_layernorm(x))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        hidden = d.output(x)                                                 # [1, bs, H]
        logits = self.head.logits(hidden[:, 1:])                             # [1, bs-1, V]
        if self.dflash2:
            sel = d.candidate_selector
            unary, cand = sel.candidates(logits)
            draft = sel.walk(hidden[:, 1:], unary, cand, self.block[0, :1])[0][0]
        else:
            draft = logits[0].argmax(-1)
        return hidden, logits, draft

    def _attend(self, a, i: int, h: torch.Tensor, rope, mask: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s attention of the block ``h [1, bs, H]`` over the context cache and itself.
        The query heads of one key head are packed into the query length (equal head counts for
        SDPA, so any backend that takes a mask runs it)."""
        bs, g = self.bs, a.nh // a.nkv
        q = apply_rope(a.q_norm(a.q_proj(h).view(1, bs, a.nh, a.d)).transpose(1, 2), *rope)
        k = apply_rope(a.k_norm(a.k_proj(h).view(1, bs, a.nkv, a.d)).transpose(1, 2), *rope)
        self.keys[i].index_copy_(2, self.qpos[0], k)
        self.values[i].index_copy_(2, self.qpos[0], a.v_proj(h).view(1, bs, a.nkv, a.d).transpose(1, 2))
        out = F.scaled_dot_product_attention(q.reshape(1, a.nkv, g * bs, a.d), self.keys[i], self.values[i],
                                             attn_mask=mask, scale=1.0 / math.sqrt(a.d))
        return a.o_proj(out.reshape(1, a.nh, bs, a.d).transpose(1, 2).reshape(1, bs, a.nh * a.d))


class StaticDrafterProposer:
    """A :class:`dflash.eval.decode.Proposer` with ``logits`` on a pooled :class:`StaticDrafter`:
    the drafts of :class:`~dflash.eval.proposers.CachedDrafterProposer` (DFlash) or
    :class:`~dflash.eval.selector.CachedSelectorProposer` (DFlash2's greedy walk). One per generation."""

    def __init__(self, drafter: DFlashDrafter, head: SharedHead, graphs: bool = True) -> None:
        self.core = acquire(drafter, head, graphs)
        self.drafter, self.head, self.bs = drafter, head, self.core.bs
        weakref.finalize(self, _release, self.core)   # back to the pool once this generation is over

    def propose(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.core.run(tokens, features)[2]

    def logits(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The drafter's logits ``[bs-1, V]`` for the block after ``tokens[-1]``."""
        return self.core.run(tokens, features)[1][0]


class StaticSelectorProposer(StaticDrafterProposer):
    """:class:`StaticDrafterProposer` of a DFlash2 drafter, with the sampled walk
    (:meth:`dflash.eval.selector.CachedSelectorProposer.sample`, drawn eagerly from the step's outputs)."""

    @torch.no_grad()
    def sample(self, tokens: torch.Tensor, features: torch.Tensor, temperature: float,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        if not temperature > 0:
            raise ValueError(f"sample() needs temperature > 0, got {temperature}: use propose() for greedy")
        hidden, logits, _ = self.core.run(tokens, features)
        sel = self.drafter.candidate_selector
        unary, cand = sel.candidates(logits)
        path, q = sel.walk(hidden[:, 1:], unary, cand, tokens[-1:], temperature, generator)
        full = torch.zeros(logits.shape[1:], dtype=q.dtype, device=q.device)
        return path[0], full.scatter_(-1, cand[0], q[0])


def static_proposer(drafter: DFlashDrafter, head: SharedHead, graphs: bool = True) -> StaticDrafterProposer:
    """The graphed proposer of a DFlash or DFlash2 drafter.

    Raises:
        ValueError: as :class:`StaticDrafter` (sliding-window layers, XPress).
    """
    if getattr(drafter, "candidate_selector", None) is not None:
        return StaticSelectorProposer(drafter, head, graphs)
    return StaticDrafterProposer(drafter, head, graphs)


# drafter -> {(block size, graphs): an idle StaticDrafter}; weak, so a dropped drafter frees its graph
_POOL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def acquire(drafter: DFlashDrafter, head: SharedHead, graphs: bool = True) -> StaticDrafter:
    """An idle :class:`StaticDrafter` of ``drafter`` at its current block size with ``head`` and the
    same weights (its graph is reused), else a new one; its context starts empty."""
    run = _POOL.get(drafter, {}).pop((drafter.cfg.block_size, graphs), None)
    if run is None or run.head is not head or run.weights != weights_signature(drafter, head):
        run = StaticDrafter(drafter, head, graphs=graphs)
    run.cached = 0
    return run


def pooled(drafter: DFlashDrafter, graphs: bool = True) -> StaticDrafter | None:
    """The idle :class:`StaticDrafter` of ``drafter`` at its block size (the last generation's), if
    any: e.g. to ask whether its step was captured (``step.graph is not None``)."""
    return _POOL.get(drafter, {}).get((drafter.cfg.block_size, graphs))


def _release(run: StaticDrafter) -> None:
    drafter = run.owner()
    if drafter is not None:
        _POOL.setdefault(drafter, {})[(run.bs, run.asked_graphs)] = run
