"""How long a drafter's blocks would be accepted under tree verification, teacher-forced.

A chain verifies one draft per block position; a tree verifies many paths in one target forward
(a tree attention mask) and keeps the longest path the target agrees with. A block drafter drafts
every position in one pass, so its per-position distributions give a tree directly (DDTree, Ringel
& Romano 2025, "Accelerating Speculative Decoding with Block Diffusion Draft Trees"; SGLang's tree
verify for DFlash): here the tree of a block is its ``budget`` most probable prefixes under the
product of the drafter's per-position marginals (the backbone's logits, for every variant), found
best-first. A prefix's probability never exceeds its parent's, so the set is ancestor-closed: a
tree of ``budget`` draft tokens, as a serving engine would verify.

Teacher-forced: at every anchor of a decoded text, the tree is scored against the target's greedy
tokens (the labels); the accepted length is that of the longest label prefix in the tree. The
figure shows what a tree would buy for the same drafter, without a tree-verifying decoder. With
``budget = 1`` the tree is the first position's top-1 alone; a tree is not a superset of the chain
(a chain prefix is in it only when it ranks among the ``budget`` most probable), so at a small budget
it can accept less than the chain.
"""

from __future__ import annotations

import heapq

import torch

__all__ = ["best_first", "tree_accepted"]


@torch.no_grad()
def tree_accepted(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, budget: int) -> torch.Tensor:
    """The accepted length of each block under a tree of ``budget`` draft tokens.

    Args:
        logits: ``[A, S, V]`` the drafter's logits of each block's ``S = bs - 1`` drafted positions.
        labels: ``[A, S]`` int64, the target's greedy token at each position.
        valid: ``[A, S]`` bool, False past the end of the text (a label that does not exist).
        budget: draft tokens in each tree (>= 1).

    Returns:
        ``[A]`` int64 (CPU): per block, the length of the longest label prefix that is a path of
        its tree and lies within the valid positions.

    Raises:
        ValueError: ``budget < 1`` or mismatched shapes.
    """
    if budget < 1:
        raise ValueError(f"a tree holds at least one draft token, got budget {budget}")
    if logits.shape[:2] != labels.shape or labels.shape != valid.shape:
        raise ValueError(f"logits {tuple(logits.shape)}, labels {tuple(labels.shape)} and valid "
                         f"{tuple(valid.shape)} do not describe the same blocks")
    k = min(budget, logits.shape[-1])
    logp, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)      # [A, S, k], descending
    lengths = valid.long().cumprod(1).sum(1).tolist()                          # valid positions per block
    logp, ids, labels = logp.tolist(), ids.tolist(), labels.tolist()
    return torch.tensor([_accepted(lp, ix, lab, budget, n) for lp, ix, lab, n in zip(logp, ids, labels, lengths)],
                        dtype=torch.long)


def best_first(logp: list[list[float]], ids: list[list[int]], budget: int) -> list[tuple[int, int, int]]:
    """The tree of one block: its ``budget`` most probable prefixes, most probable first.

    Args:
        logp, ids: per drafted position, the log-probabilities (descending) and token ids of its
            top-k tokens (``k <= budget`` is enough: no prefix beyond rank ``budget`` can be chosen).
        budget: draft tokens in the tree.

    Returns:
        One ``(parent, position, token)`` per node, in the order taken: ``parent`` is the index of
        the node it extends (-1: the block's anchor), ``position`` its depth (0: the first drafted
        position). Every parent comes before its children.

    A heap entry is a prefix: (minus its log-probability, position, rank of its last token at that
    position, the parent's log-probability, the parent's node index). Taking one pushes its next
    sibling (the next rank at the same position, same parent) and its best child (rank 0 at the next
    position); neither is more probable than it, so prefixes are taken in order of probability.
    """
    depth, width = len(logp), len(logp[0]) if logp else 0
    heap = [(-logp[0][0], 0, 0, 0.0, -1)] if depth and width else []
    nodes: list[tuple[int, int, int]] = []
    while heap and len(nodes) < budget:
        neg, pos, rank, parent_lp, parent = heapq.heappop(heap)
        nodes.append((parent, pos, ids[pos][rank]))
        if rank + 1 < width:
            heapq.heappush(heap, (-(parent_lp + logp[pos][rank + 1]), pos, rank + 1, parent_lp, parent))
        if pos + 1 < depth:
            heapq.heappush(heap, (neg - logp[pos + 1][0], pos + 1, 0, -neg, len(nodes) - 1))
    return nodes


def _accepted(logp: list[list[float]], ids: list[list[int]], labels: list[int], budget: int, limit: int) -> int:
    """One block: the longest label prefix, within ``limit`` valid positions, among its tree's paths."""
    on_label: list[bool] = []
    accepted = 0
    for parent, pos, token in best_first(logp, ids, budget):
        on = (parent < 0 or on_label[parent]) and token == labels[pos]
        on_label.append(on)
        if on and pos < limit:
            accepted = max(accepted, pos + 1)
    return accepted
