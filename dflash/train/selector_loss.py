"""DFlash2's selector loss and the metrics that say whether the selector earns its place.

No public reference fixes this loss (z-lab's wheel ships no trainer). The one used here:
**cross-entropy over the top-K candidates at each block slot, conditioned on the true
predecessor**::

    score_j[k] = z_j[c_jk] + <P[y_{j-1}] * W h_j, S[c_jk]>          (dflash.model.dflash2)
    L_sel      = sum_{b,j} w_bj m_bj (logsumexp_k score_j[k] - score_j[k*]) / sum w m

with ``c_j`` the drafter's top-K at slot ``j`` (from the same logits the backbone's loss uses),
``y_{j-1}`` the slot's true predecessor (the anchor for ``j = 1``, else the previous slot's
hard label: the data token or the target's argmax, ``[loss].label``), ``k*`` the candidate equal to
the label ``y_j``, ``w`` the backbone's position weights (``[loss].weighting``: a slot only counts
once every slot before it was accepted, for the selector as for the backbone) and ``m`` = the
slot is trained *and* ``y_j`` is among the K. The total loss is ``backbone + selector_weight * L_sel``.

Why this loss. Greedy verification accepts slot ``j`` iff every slot before it was accepted and
the walk's choice at ``j`` is the target's token. On that event the walk's predecessor at ``j``
*is* the true token ``y_{j-1}``, so the teacher-forced choice given the true predecessor decides
acceptance exactly; the walk's behaviour after its first error never changes the accepted length.
Maximising ``log q(y_j | y_{j-1}, top-K)`` is therefore the likelihood of the very event that is
counted, with no exposure bias and no sequential walk in the training graph (all slots at once).
The unary logits are detached here: the backbone's full-vocabulary loss already trains them, and
a gradient through them would need the K head rows per slot (``[M, K, H]``, 1 GB at the 8B shape);
the gate ``W h`` does pass its gradient into the backbone's hidden state.

When the label is not among the top-K, the selector can never draft it, whatever its scores: the
slot is left out of ``L_sel`` (a K-way CE has no target) and counted (``label_missing``). Only the
backbone's CE, which still trains that slot, can lift the label into the top-K; injecting it into
the candidate set instead would train pair scores on a candidate set decoding never sees.

Metrics (no gradient), all against the label verification accepts (the target's argmax when its
logits are computed, else the data token), as the backbone's ``acc_per_pos``:

* ``recall``: unary recall@K, the fraction of trained slots whose label is in the top-K;
* ``acc_per_pos``: the selector's path accuracy per slot: the greedy walk from the anchor, each
  choice the next predecessor, exactly as decoding drafts, compared slot by slot with the label
  (beside the backbone's top-1 accuracy; both start equal: the pair term is 0 at init);
* ``streak``: the walk's accepted length, the mean over valid blocks of its leading correct slots:
  what greedy verification of these blocks would accept, to compare with the backbone top-1's
  streak (``LossOutput.streak_mean``). This, not the per-slot accuracy, is where a selector wins: a
  choice made from the context alone cannot beat a calibrated backbone's marginal argmax slot by
  slot (the argmax maximises that slot's hit rate), but the walk keeps the block *coherent*
  (its slot ``j`` is right where slot ``j - 1`` was), and acceptance counts only leading runs;
* ``oracle_streak``: the accepted length of a drafter that always picks the label when it is in
  the top-K (mean over valid blocks of the leading run of "label in top-K"): the ceiling any
  selector over these candidates can reach; oracle top-K tau = ``oracle_streak + 1``;
* ``missing``: trained slots whose (training) label is not in the top-K, a count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.model.dflash2 import CandidateSelector, walk_selector
from dflash.train.acceptance import accuracy_per_position, streak_lengths

__all__ = ["SelectorOutput", "selector_terms"]


@dataclass
class SelectorOutput:
    """What :func:`selector_terms` returns; every field a tensor on the loss's device (the step's
    one host read brings them back).

    Attributes:
        loss: 0-dim fp32 with grad, ``L_sel`` (0 when no slot's label is in the top-K).
        acc_per_pos: ``[bs-1]`` fp32 path accuracy of the selector's walk (nan: no trained slot).
        recall: 0-dim fp32, unary recall@K over trained slots.
        streak: 0-dim fp32, the walk's teacher-forced accepted length (nan: no valid block).
        oracle_streak: 0-dim fp32, oracle top-K accepted length (nan: no valid block).
        missing: 0-dim int64, trained slots whose label is not in the top-K.
    """

    loss: torch.Tensor
    acc_per_pos: torch.Tensor
    streak: torch.Tensor
    recall: torch.Tensor
    oracle_streak: torch.Tensor
    missing: torch.Tensor


def selector_terms(selector: CandidateSelector, slot_hidden: torch.Tensor, anchor_ids: torch.Tensor,
                   unary: torch.Tensor, cand: torch.Tensor, labels: torch.Tensor, data_labels: torch.Tensor,
                   accept: torch.Tensor, trained: torch.Tensor, weights: torch.Tensor,
                   block_ok: torch.Tensor) -> SelectorOutput:
    """The selector loss and metrics of one batch (module docstring); shapes ``B`` rows, ``A``
    anchors, ``S = bs - 1`` slots, ``K`` candidates, fixed (no host sync).

    Args:
        selector: the drafter's ``candidate_selector``.
        slot_hidden: ``[B, A, S, H]`` drafter hidden states of slots 1..S (with grad).
        anchor_ids: ``[B, A]`` each block's token 0.
        unary, cand: ``[B, A, S, K]`` the top-K logits (fp32, no grad) and their token ids.
        labels: ``[B, A, S]`` the hard training labels (any value where not trained).
        data_labels: ``[B, A, S]`` the data tokens at the same positions: the predecessor where the
            previous slot is not trained (its label may be unknown there).
        accept: ``[B, A, S]`` the labels the metrics compare with (what verification accepts).
        trained: ``[B, A, S]`` bool. weights: ``[B, A, S]`` fp32 position weights (0 where untrained).
        block_ok: ``[B*A]`` bool, the anchor is valid.
    """
    B, A, S, K = cand.shape
    known = torch.where(trained, labels, data_labels)
    prev = torch.cat([anchor_ids[:, :, None], known[:, :, :-1]], dim=2)         # [B, A, S]
    gate = selector.gate(slot_hidden)                                           # [B, A, S, r]
    score = unary + selector.pair_scores(gate, prev, cand).float()              # [B, A, S, K]
    hit = cand == labels[..., None]
    has = hit.any(-1)
    ce = torch.logsumexp(score, -1) - score.gather(-1, hit.long().argmax(-1, keepdim=True)).squeeze(-1)
    use = trained & has
    w = torch.where(use, weights, torch.zeros_like(weights))
    loss = (w * torch.where(use, ce, torch.zeros_like(ce))).sum() / w.sum().clamp(min=1e-12)

    with torch.no_grad():
        path, _ = walk_selector(selector, gate.detach().reshape(B * A, S, -1), unary.reshape(B * A, S, K),
                                cand.reshape(B * A, S, K), anchor_ids.reshape(B * A))
        valid = trained.reshape(B * A, S)
        correct = (path == accept.reshape(B * A, S)) & valid
        in_k = (cand == accept[..., None]).any(-1).reshape(B * A, S) & valid
        n, blocks = valid.sum(), block_ok.sum().float()
        return SelectorOutput(
            loss=loss,
            acc_per_pos=accuracy_per_position(correct, valid),
            streak=(streak_lengths(correct, valid) * block_ok).sum().float() / blocks,
            recall=in_k.sum().float() / n.clamp(min=1).float(),
            oracle_streak=(streak_lengths(in_k, valid) * block_ok).sum().float() / blocks,
            missing=(trained & ~has).sum(),
        )
