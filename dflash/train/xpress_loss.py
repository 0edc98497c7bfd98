"""XPress's loss: the refiner trained on true predecessors and on its own Jacobi passes, with the
backbone held to the target by its own loss.

Source: XPress (arXiv 2608.02438) as vLLM speculators 0.9 trains it (``speculators/models/xpress/
core.py`` and ``metrics.py``): one teacher-forced refine pass plus ``P`` free-running passes, each
seeded by the previous pass's argmax (the first by the backbone's), with no gradient through the
argmax, exactly the recurrence :meth:`dflash.model.xpress.XPressRefiner.jacobi` decodes with::

    loss = base * L(z) + L(z + bias(y_true)) + consistency * mean_{p = 1..P} L(z + bias(d_{p-1}))

``z`` the backbone's logits of slots ``1 .. bs-1``, ``bias(y)`` the refiner's correction given
the predecessors ``y`` (:func:`dflash.model.xpress.predecessors`), ``d_0 = argmax z``,
``d_p = argmax(z + bias(d_{p-1}))``, and each ``L`` the configured per-slot loss
(:func:`dflash.train.loss.loss_terms`: CE on the hard label, KL and TV to the target) under the
configured position weights, each term's weights from its own label probabilities (as
speculators' D-PACE weights are), normalised by their sum. The true predecessors are the training
labels (the data tokens, or the target's argmax: what greedy verification has accepted when the
slot is reached), the data token where the previous slot is not trained. The base term keeps the
backbone, and with it the first pass's seed, a good drafter on its own; without it the backbone
drifts to serve the refiner (speculators' note). Defaults: speculators' 0.6, 0.3 and 3.

Memory: every pass needs the ``[c, V]`` logits of its slots. Blocks go through in chunks of about
``chunk`` slots, each under activation checkpointing: forward keeps only the chunk's inputs and
backward recomputes the chunk (the LM head once more), so the peak is one chunk's ``1 + P`` passes.

Metrics (no gradient) come back as a :class:`dflash.train.selector_loss.SelectorOutput`, the
drafter's second stage beside the backbone's figures: ``acc_per_pos`` and ``streak`` are those of
the last pass's drafts (``d_P``, the backbone's argmax when ``P = 0``) against what verification
accepts; ``recall`` and ``oracle_streak`` have no XPress meaning and are nan; ``missing`` is 0.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from dflash.model.xpress import XPressRefiner, predecessors
from dflash.train.acceptance import accuracy_per_position, streak_lengths
from dflash.train.loss import LossConfig, loss_terms, position_weights
from dflash.train.selector_loss import SelectorOutput

__all__ = ["before_anchors", "xpress_terms"]


def before_anchors(input_ids: torch.Tensor, doc_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """``[B, A]`` int64: the token before each anchor, or the anchor itself where it opens its
    document (or the row); any value where the anchor is empty (-1)."""
    a = anchors.clamp(min=0)
    prev = (a - 1).clamp(min=0)
    same = (a > 0) & (doc_ids.long().gather(1, prev) == doc_ids.long().gather(1, a))
    return torch.where(same, input_ids.gather(1, prev), input_ids.gather(1, a))


def _passes(refiner: XPressRefiner, head, cfg: LossConfig, passes: int, hidden: torch.Tensor,
            prev_true: torch.Tensor, before: torch.Tensor, anchor: torch.Tensor, labels: torch.Tensor,
            target_hidden: torch.Tensor | None):
    """One chunk of ``n`` blocks: per-slot loss and CE ``[1 + passes, n, S]`` of the teacher-forced
    pass and each free-running one, and the last pass's drafts ``[n, S]``."""
    n, S = labels.shape
    z = head.logits(hidden[:, 1:]).float()                                   # [n, S, V]
    zt = head.logits(target_hidden).float().flatten(0, 1) if target_hidden is not None else None
    ctx = refiner.context(hidden)
    ls, ces = [], []

    def term(prev: torch.Tensor) -> torch.Tensor:
        refined = z + refiner.bias(refiner.features(prev, ctx)[:, 1:]).float()
        l, ce = loss_terms(cfg, refined.flatten(0, 1), labels.flatten(), zt)[:2]
        ls.append(l.view(n, S))
        ces.append(ce.detach().view(n, S))
        return refined.detach().argmax(-1)

    term(prev_true)
    draft = z.detach().argmax(-1)
    for _ in range(passes):
        draft = term(predecessors(before, anchor, draft))
    return torch.stack(ls), torch.stack(ces), draft


def xpress_terms(refiner: XPressRefiner, head, hidden: torch.Tensor, before_anchor: torch.Tensor,
                 anchor_ids: torch.Tensor, labels: torch.Tensor, data_labels: torch.Tensor, accept: torch.Tensor,
                 trained: torch.Tensor, target_hidden: torch.Tensor | None, cfg: LossConfig,
                 chunk: int, block_ok: torch.Tensor) -> SelectorOutput:
    """The refiner's part of XPress's loss and its metrics for one batch (module docstring); shapes
    ``B`` rows, ``A`` anchors, ``bs`` block slots, ``S = bs - 1``, fixed (no host sync).

    Args:
        refiner: the drafter's ``refiner_head``. head: the target's frozen LM head.
        hidden: ``[B, A, bs, H]`` the backbone's hidden states of every block slot (with grad).
        before_anchor, anchor_ids: ``[B, A]`` (:func:`before_anchors`; each block's token 0).
        labels: ``[B, A, S]`` the hard training labels. data_labels: ``[B, A, S]`` the data tokens
            (a slot's predecessor where the previous slot is not trained).
        accept: ``[B, A, S]`` what verification accepts (the metrics' reference).
        trained: ``[B, A, S]`` bool. block_ok: ``[B*A]`` bool, the anchor is valid.
        target_hidden: ``[B*A*S, H]`` the target's final hidden states predicting each slot's token,
            or None (required when the loss needs target logits).
        cfg: the ``[loss]`` table (its ``xpress_*`` keys). chunk: slots per checkpointed chunk
            (``[train].lm_head_chunk``; 0: every block at once).

    Returns:
        ``SelectorOutput`` whose ``loss`` (fp32, with grad) is ``L(refined, true) + consistency *
        mean L(refined, pass p)``; the caller adds ``xpress_base_weight`` times the backbone's loss.
    """
    B, A, bs, H = hidden.shape
    S, N = bs - 1, B * A
    known = torch.where(trained, labels, data_labels)
    prev_true = predecessors(before_anchor, anchor_ids, known).reshape(N, bs)
    flat = lambda t: t.reshape(N, *t.shape[2:])  # noqa: E731
    h, before, anchor, y = flat(hidden), flat(before_anchor), flat(anchor_ids), flat(labels)
    th = target_hidden.view(N, S, -1) if target_hidden is not None else None
    passes = cfg.xpress_consistency_passes if cfg.xpress_consistency_weight > 0 else 0
    step = max(1, chunk // S) if chunk > 0 else N
    parts = [checkpoint(_passes, refiner, head, cfg, passes, h[s:s + step], prev_true[s:s + step],
                        before[s:s + step], anchor[s:s + step], y[s:s + step],
                        th[s:s + step] if th is not None else None, use_reentrant=False)
             for s in range(0, N, step)]
    l = torch.cat([p[0] for p in parts], dim=1)                             # [1 + P, N, S]
    ce = torch.cat([p[1] for p in parts], dim=1)
    draft = torch.cat([p[2] for p in parts], dim=0)                          # [N, S]

    tw = trained.reshape(N, S)
    zero = torch.zeros((), device=l.device)
    losses = []
    for t in range(l.shape[0]):
        w = torch.where(tw, position_weights(cfg, torch.where(tw, torch.exp(-ce[t]), zero), tw), zero)
        losses.append((w * torch.where(tw, l[t], zero)).sum() / w.sum().clamp(min=1e-12))
    loss = losses[0]
    if passes:
        loss = loss + cfg.xpress_consistency_weight * torch.stack(losses[1:]).mean()

    with torch.no_grad():
        correct = (draft == accept.reshape(N, S)) & tw
        blocks = block_ok.sum().float()
        nan = torch.full((), float("nan"), device=l.device)
        return SelectorOutput(
            loss=loss,
            acc_per_pos=accuracy_per_position(correct, tw),
            streak=(streak_lengths(correct, tw) * block_ok).sum().float() / blocks,
            recall=nan, oracle_streak=nan,
            missing=torch.zeros((), dtype=torch.long, device=l.device))
