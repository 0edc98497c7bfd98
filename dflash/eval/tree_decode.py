"""Draft-and-verify with a tree, greedy or sampled: many drafted paths verified in one target forward.

One step (the chain's, :mod:`dflash.eval.decode`, with a tree in place of the block):

1. The drafter's logits for the block after the anchor give each drafted position's marginals;
   the tree is their ``budget`` most probable prefixes (:func:`dflash.eval.tree.best_first`).
2. The target runs once over ``[anchor, node_1 .. node_B]``: a node sits at position
   ``anchor + 1 + depth`` and attends to the cached context, the anchor, its ancestors and itself
   (a 4-D attention mask; transformers passes a 4-D mask to the attention as it is given).
3. From the anchor, follow the child whose token is the target's argmax at the current node, as
   long as one exists: its ``m`` nodes are accepted, then the bonus token (the argmax at the last).
   Sampled (``temperature > 0``): at each node on the path draw the next token from the target's
   processed distribution there (:func:`dflash.eval.decode.sampling_probs`); if a child carries it,
   accept that child and go on, else it is the bonus token. Every emitted token is a draw from the
   target's own distribution given the tokens before it, so the output is distributed as the
   target's sampling (chi-square tested). A node's children are fixed (the best-first tree, not
   draws from the drafter), so this is the lossless rule for them: with one deterministic draft it
   is the rejection rule's ``min(1, p/q)`` at ``q`` a point mass; the node accepts with the
   target's probability of its children's tokens (SpecInfer (Miao et al. 2024) verifies token trees
   by the same per-node walk, with sampled drafts and their residuals).
4. The cache keeps the context, the anchor and the accepted path in order (the other nodes' keys
   and values are dropped), and the target's features of those rows join the drafter's context.

Greedy output equals plain greedy decoding whatever the tree (tested), so tau is measured, not
simulated; at every anchor the accepted length equals the teacher-forced tree figure of
:mod:`dflash.eval.tree` for the same budget (tested).
Source of the idea: DDTree (Ringel & Romano 2025) and SGLang's tree verify for DFlash, which build
and verify trees from a block drafter's per-position distributions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash.eval.decode import (
    CachedTarget,
    DecodeStopped,
    _check_inputs,
    sampling_probs,
    static_or_cached,
)
from dflash.eval.static_tree import StaticTreeTarget, acquire, release
from dflash.eval.tree import best_first
from dflash.model.modeling_dflash import keep_tree_rows, tree_mask
from dflash.model.target import Target

__all__ = ["tree_decode"]


@torch.no_grad()
def tree_decode(target: Target, proposer, prompt: torch.Tensor, max_new_tokens: int, block_size: int,
                budget: int, *, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                generator: torch.Generator | None = None, should_stop: Callable[[], bool] | None = None,
                cuda_graphs: bool = False) -> tuple[torch.Tensor, list[int], list[int]]:
    """Tree-verified decoding, greedy or sampled (module docstring).

    Args:
        target: the target (a transformers Llama or Qwen3 model: a 4-D mask and a dynamic cache).
        proposer: a drafter proposer with ``logits(tokens [n], features [1, n-1, k*H]) -> [bs-1, V]``
            (:class:`~dflash.eval.proposers.DrafterProposer`, ``CachedDrafterProposer``).
        prompt: ``[n]`` int64 on the target's device.
        block_size: the drafter's block size (depth of the tree + 1).
        budget: draft tokens per tree (>= 1).
        temperature, top_p, top_k: 0 = greedy; else the target's sampling, processed as
            :func:`~dflash.eval.decode.sampling_probs` (the tree is the same either way).
        generator: the random stream of the sampled draws (on the target's device).
        should_stop: asked before each verify step, as :func:`~dflash.eval.decode.speculative_decode`.
        cuda_graphs: verify with the fixed-shape tree step over a static KV cache
            (:mod:`dflash.eval.static_tree`; one CUDA-graph replay per step on a GPU), for a Llama
            or Qwen3 target; others keep the dynamic cache (logged once).

    Returns:
        ``(tokens [n + max_new_tokens], accepted m per step, anchor index per step)``.

    Raises:
        ValueError: an empty prompt, bad sampling parameters, ``budget < 1``, or a proposer
            without ``logits``.
        DecodeStopped: ``should_stop()`` returned True.
    """
    _check_inputs(prompt, temperature, top_p, top_k)
    sampled = temperature > 0

    def draw(row_logits: torch.Tensor) -> int:
        """The target's next token at one row: its argmax, or a draw from its processed distribution."""
        if not sampled:
            return int(row_logits.argmax())
        return int(torch.multinomial(sampling_probs(row_logits, temperature, top_p, top_k), 1, generator=generator))

    if budget < 1:
        raise ValueError(f"a tree holds at least one draft token, got budget {budget}")
    if not hasattr(proposer, "logits"):
        raise ValueError(f"{type(proposer).__name__} has no logits(): a tree is built from the drafter's "
                         "per-position distributions (use a drafter proposer)")
    n0, dev = prompt.shape[0], prompt.device
    end = n0 + max_new_tokens
    run = _tree_run(target, budget, end + block_size, cuda_graphs)
    static = isinstance(run, StaticTreeTarget)
    try:
        tokens = torch.empty(end + block_size, dtype=torch.long, device=dev)
        tokens[:n0] = prompt
        f, logits = run.prefill(prompt) if static else run(prompt, 0, last_only=True)
        feats = torch.empty(1, end + block_size, f.shape[-1], dtype=f.dtype, device=f.device)
        feats[:, :n0] = f
        tokens[n0] = draw(logits[0])
        n = n0 + 1                                                               # tokens[n-1]: the anchor
        accepted, anchors = [], []
        while n < end:
            if should_stop is not None and should_stop():
                raise DecodeStopped(f"stopped after {len(accepted)} verify steps")
            depth = min(block_size - 1, end - n)
            lp, ix = torch.log_softmax(proposer.logits(tokens[:n], feats[:, :n - 1])[:depth].float(), -1).topk(
                min(budget, target.hf_config.vocab_size), dim=-1)
            nodes = best_first(lp.tolist(), ix.tolist(), budget)
            parent = [p for p, _, _ in nodes]
            ids = torch.cat([tokens[n - 1:n], torch.tensor([t for _, _, t in nodes], device=dev)])
            if static:
                f, logits = run.verify(ids, [d for _, d, _ in nodes], parent, n - 1)
            else:
                pos = torch.tensor([n - 1] + [n + d for _, d, _ in nodes], device=dev)[None]
                f, logits = _verify(run, ids, pos, tree_mask(parent, n - 1, target.model.dtype, dev))
            g = logits.argmax(-1).tolist() if not sampled else None             # greedy: one host read per step
            path, row = [], 0                                                    # row 0: the anchor
            while True:
                x = g[row] if g is not None else draw(logits[row])               # the target's token after this node
                child = next((i for i, p in enumerate(parent) if p == row - 1 and nodes[i][2] == x), None)
                if child is None:
                    break
                path.append(child + 1)
                row = child + 1
            m = len(path)
            rows = torch.tensor([0] + path, device=dev)
            tokens[n:n + m] = ids[rows[1:]]
            tokens[n + m] = x
            feats[:, n - 1:n + m] = f[:, rows]
            if static:
                run.keep_path(n - 1, rows)
            else:
                keep_tree_rows(run.cache, n - 1, rows)
            accepted.append(m)
            anchors.append(n - 1)
            n += m + 1
        return tokens[:end], accepted, anchors
    finally:
        if static:  # however it ends (DecodeStopped too): the next decode reuses it
            release(run)


def _tree_run(target: Target, budget: int, capacity: int, cuda_graphs: bool) -> CachedTarget | StaticTreeTarget:
    """The target's cached forward for one tree generation: a pooled :class:`StaticTreeTarget` with
    ``cuda_graphs``, else (or for a target it does not run, logged once) a :class:`CachedTarget`
    with room for the last tree."""
    if not cuda_graphs:
        return CachedTarget(target, capacity + budget)
    return static_or_cached(target, lambda: acquire(target, budget, capacity), capacity + budget)


def _verify(run: CachedTarget, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
    """The target's cached forward over the tree: ``(features [1, 1+B, k*H], logits [1+B, V])``."""
    out = run.base(input_ids=ids[None], position_ids=positions, attention_mask=mask, **run.kwargs)
    return run.target.collect(), run.lm_head(out.last_hidden_state[0])
