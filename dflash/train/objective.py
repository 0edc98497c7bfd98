"""features -> loss: the one function the training step (:mod:`dflash.train.step`) calls per batch.

Steps (shapes: B rows, T tokens, A anchors, bs block size, N trained slots):

1. Blocks: ``[input_ids[a], mask, ..., mask]`` at each anchor ``a`` -> shared embedding
   ``[B, A, bs, H]``; layout from :func:`dflash.model.attention.training_layout`.
2. Drafter forward -> hidden ``[B, A, bs, H]``; slot ``j >= 1`` predicts token ``a + j``.
3. A slot is trained iff its anchor is valid, ``a + j < T``, ``doc_ids[a + j] == doc_ids[a]`` and
   ``loss_mask[a + j]``. Only block slots go through the LM head (never ``B*T*V``): all
   ``M = B*A*(bs-1)`` of them with weight 0 where untrained (``[train].sync_free_loss``, the
   default: fixed shapes, no host sync), or the ``N`` trained ones picked by boolean masks.
4. Labels: ``input_ids[a + j]`` ("data") or the target argmax for token ``a + j``, read from
   ``final_hidden[a + j - 1]`` (the target's prediction *of* token ``a + j`` is made at the
   position before it). KL and TV use the target logits at the same ``a + j - 1``.
5. Loss (CE, KL, TV, confidence: :mod:`dflash.train.loss`), CE/KL (and TV/confidence when weighted) means, per-position accuracy (against the target argmax when target logits are
   computed, which is what greedy verification accepts; else against the data token). With
   ``[loss].confidence = "head"`` the drafter's confidence head reads each trained slot's hidden
   state and its term ``conf_weight * BCE(head, 1 - TV)`` joins that slot's loss, under the same
   position weight.
6. What the variant drafts with (its ``drafts_with``, :mod:`dflash.model.variants`): nothing more
   for ``"top1"``; for ``"selector"`` (DFlash2) the selector's loss over each slot's top-K
   candidates, ``loss += selector_weight * L_sel``, and its metrics (:mod:`dflash.train.selector_loss`);
   for ``"refiner"`` (XPress) the refiner's passes, ``loss = xpress_base_weight * loss + L_refiner``,
   and the metrics of its Jacobi drafts (:mod:`dflash.train.xpress_loss`; fixed shapes only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.messages import LossInput
from dflash.model.attention import training_layout
from dflash.model.drafter import DFlashDrafter
from dflash.model.target import SharedHead
from dflash.model.variants import variant_of
from dflash.train.acceptance import accuracy_per_position, streak_lengths
from dflash.train.chunked_head import chunked_head_loss
from dflash.train.loss import (
    LossConfig,
    accept_probability,
    head_confidence_term,
    loss_terms,
    needs_final_hidden,
    position_weights,
    uses_head,
)
from dflash.train.selector_loss import SelectorOutput, selector_terms
from dflash.train.xpress_loss import before_anchors, xpress_terms

__all__ = ["LossOutput", "block_targets", "compute_loss"]


@dataclass
class LossOutput:
    """Result of :func:`compute_loss`.

    Attributes:
        loss: scalar fp32 with grad (weighted mean, formula in :mod:`dflash.train.loss`).
        ce, kl: unweighted means over trained slots (detached scalars; kl 0 when not computed).
        tv, conf: the same for the TV and confidence terms, None when their weight
            (``tv_weight``, ``conf_weight``) is 0 (``conf``: the "top1" or the "head" term).
        acc_per_pos: ``[bs-1]`` fp32 accuracy per slot (nan where no slot was trained).
        streak_mean: mean leading-correct count over valid blocks (see :mod:`dflash.train.acceptance`).
        num_blocks: valid anchors (an int, or a 0-dim int64 tensor on the sync-free path, read
            with the step's one host read).
        num_predictions: trained slots ``N`` (int or 0-dim int64 tensor, as ``num_blocks``).
        selector: DFlash2's selector loss and metrics, or XPress's refiner loss and the metrics of
            its Jacobi drafts (already in ``loss``); None for a DFlash drafter.
    """

    loss: torch.Tensor
    ce: torch.Tensor
    kl: torch.Tensor
    acc_per_pos: torch.Tensor
    streak_mean: torch.Tensor
    num_blocks: int | torch.Tensor
    num_predictions: int | torch.Tensor
    selector: SelectorOutput | None = None
    tv: torch.Tensor | None = None
    conf: torch.Tensor | None = None


def block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, doc_ids: torch.Tensor,
                  anchors: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pos [B, A, bs-1] int64, trained [B, A, bs-1] bool)``: position ``a + j`` of the token
    slot ``j`` predicts (clamped into the row) and whether that slot is trained."""
    T = input_ids.shape[1]
    j = torch.arange(1, block_size, device=anchors.device)
    raw = anchors[:, :, None] + j                                            # [B, A, bs-1]
    pos = raw.clamp(0, T - 1)
    B, A, S = pos.shape
    flat = pos.reshape(B, A * S)
    doc = doc_ids.long()
    same_doc = doc.gather(1, flat).view(B, A, S) == doc.gather(1, anchors.clamp(min=0))[:, :, None]
    trained = ((anchors >= 0)[:, :, None] & (raw < T) & same_doc
               & loss_mask.bool().gather(1, flat).view(B, A, S))
    return pos, trained


def compute_loss(drafter: DFlashDrafter, head: SharedHead, x: LossInput, cfg: LossConfig, *,
                 sync_free: bool = True, features_fp32: bool = False, lm_head_chunk: int = 0,
                 lm_head: str = "chunked", compile_head: bool = False) -> LossOutput:
    """One batch's loss and metrics (see the module docstring for the steps).

    Args:
        drafter: the drafter (or its DDP wrapper). head: the target's frozen embedding and LM head.
        x: the batch's tensors (:class:`dflash.messages.LossInput`, shapes and dtypes there;
            ``DrafterInput.loss_input()`` on the training path).
        cfg: the ``[loss]`` table.
        sync_free: ``[train].sync_free_loss``: fixed shapes, no host read (every slot through the
            LM head, weight 0 where untrained; counts stay tensors). False: the trained slots are
            picked by boolean masks (``N`` rows, a host sync each) and the counts are ints.
        features_fp32: ``[train].features_fp32``: cast the features to the drafter's (fp32
            master) dtype before ``fc`` even under autocast, a materialised ``[B, T, k*H]`` fp32
            copy. False leaves them to autocast (exact: autocast casts them back to its dtype).
        lm_head_chunk: ``[train].lm_head_chunk``: with ``sync_free``, run the LM head and the loss
            this many slots at a time (:mod:`dflash.train.chunked_head`); 0 = all slots at once.
        lm_head: ``[train].lm_head``: "chunked" (as ``lm_head_chunk`` says) | "liger" (with
            ``sync_free``: Liger's fused linear cross-entropy, :mod:`dflash.train.liger_head`).
        compile_head: ``[train].compile_head``: the chunked head's cross-entropy and its gradient
            through ``torch.compile`` (:func:`dflash.train.chunked_head.ce_and_grad`).

    Raises:
        ValueError: the config needs target logits and ``x.final_hidden`` is None, the drafter
            has no ``mask_token_id``, ``[loss].confidence = "head"`` and the drafter has no
            confidence head, or an XPress drafter without ``sync_free``.
    """
    core = getattr(drafter, "module", drafter)  # a DDP wrapper keeps the drafter (config, heads) inside
    conf_head = getattr(core, "confidence_head", None) if uses_head(cfg) else None
    _check_inputs(core.cfg, cfg, x, conf_head)
    features = x.features
    if features_fp32:
        features = features.to(core.fc.weight.dtype)

    # 1-2. blocks -> drafter hidden [B, A, bs, H]
    bs = core.cfg.block_size
    block_ids = _block_ids(x.input_ids, x.anchors, bs, core.cfg.mask_token_id)       # [B, A, bs]
    layout = training_layout(x.position_ids, x.doc_ids, x.anchors, bs)
    hidden = drafter(features, head.embed(block_ids), layout)
    pos, trained = block_targets(x.input_ids, x.loss_mask, x.doc_ids, x.anchors, bs)  # [B, A, bs-1]
    drafts_with = variant_of(core.cfg.variant).drafts_with  # step 6's dispatch
    selector = core.candidate_selector if drafts_with == "selector" else None
    refiner = core.refiner_head if drafts_with == "refiner" else None
    if sync_free:
        before = before_anchors(x.input_ids, x.doc_ids, x.anchors) if refiner is not None else None
        return _loss_fixed_shape(head, hidden, pos, trained, x.input_ids, x.anchors, x.final_hidden, cfg,
                                 lm_head_chunk, lm_head, selector, block_ids[:, :, 0], conf_head, refiner, before,
                                 compile_head)
    if refiner is not None:
        raise ValueError("an XPress drafter trains with the fixed-shape loss: set train.sync_free_loss = true")
    return _loss_masked(head, hidden, pos, trained, x, cfg, selector, block_ids, conf_head)


def _check_inputs(dc, cfg: LossConfig, x: LossInput, conf_head) -> None:
    """The ValueErrors of :func:`compute_loss` (its docstring lists them)."""
    if dc.mask_token_id is None:
        raise ValueError("drafter.mask_token_id is unset (take it from the tokenizer)")
    if uses_head(cfg) and conf_head is None:
        raise ValueError("loss.confidence = 'head' needs a drafter built with drafter.confidence_head = true "
                         "(the run sets it from loss.confidence)")
    if needs_final_hidden(cfg) and x.final_hidden is None:
        raise ValueError(f"loss label={cfg.label!r}, kl_weight={cfg.kl_weight}, tv_weight={cfg.tv_weight}, "
                         f"confidence={cfg.confidence!r} needs the target's "
                         "final hidden state; run the target with need_final=True")


def _block_ids(input_ids: torch.Tensor, anchors: torch.Tensor, bs: int, mask_token_id: int) -> torch.Tensor:
    """``[B, A, bs]`` int64: each block's anchor token, then ``bs - 1`` mask tokens."""
    B, A = anchors.shape
    block_ids = torch.full((B, A, bs), mask_token_id, dtype=torch.long, device=input_ids.device)
    block_ids[:, :, 0] = input_ids.gather(1, anchors.clamp(min=0))
    return block_ids


def _loss_masked(head: SharedHead, hidden: torch.Tensor, pos: torch.Tensor, trained: torch.Tensor,
                 x: LossInput, cfg: LossConfig, selector, block_ids: torch.Tensor, conf_head) -> LossOutput:
    """Steps 3-6 on the trained slots only, picked by boolean masks (``sync_free = False``): ``N``
    LM-head rows, and each mask and count a host sync."""
    input_ids, anchors, final_hidden = x.input_ids, x.anchors, x.final_hidden
    B, A, S = pos.shape
    bs = S + 1

    # 3. trained slots only -> logits [N, V]
    draft_logits = head.logits(hidden[:, :, 1:][trained]).float()
    flat_pos = pos[trained]                                                      # [N]
    row = torch.arange(B, device=pos.device)[:, None, None].expand_as(pos)[trained]

    # 4. labels; target logits at a + j - 1 predict token a + j
    target_logits = None
    if final_hidden is not None and (needs_final_hidden(cfg)):
        target_logits = head.logits(final_hidden[row, flat_pos - 1]).float()
    data_labels = input_ids[row, flat_pos]
    labels = target_logits.argmax(-1) if cfg.label == "target_argmax" else data_labels

    # 5. loss
    per_slot, ce, kl, tv, conf = loss_terms(cfg, draft_logits, labels, target_logits)
    if conf_head is not None:
        accept = accept_probability(draft_logits, target_logits, cfg.temperature)
        conf = head_confidence_term(conf_head(hidden[:, :, 1:][trained]), accept)
        per_slot = per_slot + cfg.conf_weight * conf
    grid = lambda v, fill=0.0: torch.full(trained.shape, fill, dtype=v.dtype,  # noqa: E731
                                          device=v.device).masked_scatter(trained, v)
    label_prob = grid(torch.exp(-ce.detach()))
    w = position_weights(cfg, label_prob.view(B * A, bs - 1), trained.view(B * A, bs - 1))
    w = w.view(B, A, bs - 1)[trained]
    denom = w.sum()
    loss = (w * per_slot).sum() / denom.clamp(min=1e-12)
    with torch.no_grad():
        accept_label = target_logits.argmax(-1) if target_logits is not None else data_labels
    block_ok = (anchors >= 0).view(-1)

    sel = None
    if selector is not None:  # 6. on the [B, A, bs-1] grid: the walk needs each block whole
        unary, cand = selector.candidates(draft_logits)                            # [N, K]
        K, S = unary.shape[1], bs - 1
        mask_k = trained[..., None].expand(B, A, S, K)
        data_grid = input_ids.gather(1, pos.reshape(B, A * S)).view(B, A, S)
        sel = selector_terms(
            selector, hidden[:, :, 1:], block_ids[:, :, 0],
            torch.zeros(B, A, S, K, device=unary.device).masked_scatter(mask_k, unary),
            torch.zeros(B, A, S, K, dtype=torch.long, device=cand.device).masked_scatter(mask_k, cand),
            data_grid.masked_scatter(trained, labels), data_grid,
            data_grid.masked_scatter(trained, accept_label), trained,
            torch.zeros(B, A, S, device=w.device).masked_scatter(trained, w), block_ok)
        loss = loss + cfg.selector_weight * sel.loss

    with torch.no_grad():
        correct = grid(draft_logits.argmax(-1) == accept_label, False).view(B * A, bs - 1)
        valid = trained.view(B * A, bs - 1)
        n = max(int(trained.sum()), 1)
        return LossOutput(
            loss=loss,
            ce=ce.detach().sum() / n,
            kl=kl.detach().sum() / n,
            tv=tv.detach().sum() / n if cfg.tv_weight > 0 else None,
            conf=conf.detach().sum() / n if cfg.conf_weight > 0 else None,
            acc_per_pos=accuracy_per_position(correct, valid),
            streak_mean=streak_lengths(correct, valid)[block_ok].float().mean(),
            num_blocks=int(block_ok.sum()),
            num_predictions=int(trained.sum()),
            selector=sel,
        )


def _loss_fixed_shape(head: SharedHead, hidden: torch.Tensor, pos: torch.Tensor, trained: torch.Tensor,
                      input_ids: torch.Tensor, anchors: torch.Tensor, final_hidden: torch.Tensor | None,
                      cfg: LossConfig, lm_head_chunk: int = 0, lm_head: str = "chunked", selector=None,
                      anchor_ids: torch.Tensor | None = None, conf_head=None, refiner=None,
                      before_anchor: torch.Tensor | None = None, compile_head: bool = False) -> LossOutput:
    """Steps 3-6 over all ``M = B*A*(bs-1)`` slots, untrained ones weighted 0: no shape depends on
    the data, so nothing waits for the device. Same loss as the masked path up to summation order
    (zeros added in); ``num_blocks``/``num_predictions`` are 0-dim int64 tensors. ``selector``
    (DFlash2's, with ``anchor_ids [B, A]`` the blocks' token 0) adds step 6; ``conf_head`` (the
    drafter's confidence head, with ``[loss].confidence = "head"``) adds its term to step 5;
    ``refiner`` (XPress's, with ``before_anchor [B, A]``) its passes."""
    B, A, S = pos.shape
    M, H = B * A * S, hidden.shape[-1]
    tw = trained.reshape(M)
    flat_pos = pos.reshape(B, A * S)
    slot_hidden = hidden[:, :, 1:].reshape(M, H)
    target_hidden = None
    if final_hidden is not None and needs_final_hidden(cfg):
        # pos >= 1 wherever a slot is trained; the clamp only keeps empty anchors' rows in range
        prev = (flat_pos - 1).clamp(min=0)[..., None].expand(B, A * S, final_hidden.shape[-1])
        target_hidden = final_hidden.gather(1, prev).reshape(M, -1)
    data_labels = input_ids.gather(1, flat_pos).reshape(M)
    unary = cand = accept = None
    if lm_head == "liger":
        if selector is not None or refiner is not None:
            raise ValueError("train.lm_head = 'liger' gives neither DFlash2's top-K candidates nor XPress's "
                             "refined logits: use train.lm_head = 'chunked' with these variants")
        from dflash.train.liger_head import liger_head_loss

        per_slot, ce, kl, tv, conf, draft_arg, accept_label = liger_head_loss(
            slot_hidden, head, target_hidden, data_labels, cfg, lm_head_chunk or 2048)
    elif lm_head_chunk > 0:
        per_slot, ce, kl, tv, conf, draft_arg, accept_label, *rest = chunked_head_loss(
            slot_hidden, head, target_hidden, data_labels, cfg, lm_head_chunk,
            topk=selector.top_k if selector is not None else 0, accept=conf_head is not None,
            compiled=compile_head)
        if selector is not None:
            unary, cand, *rest = rest
        if conf_head is not None:
            (accept,) = rest
    else:
        draft_logits = head.logits(slot_hidden).float()                          # [M, V]
        target_logits = head.logits(target_hidden).float() if target_hidden is not None else None
        labels = target_logits.argmax(-1) if cfg.label == "target_argmax" else data_labels
        per_slot, ce, kl, tv, conf = loss_terms(cfg, draft_logits, labels, target_logits)
        with torch.no_grad():
            draft_arg = draft_logits.argmax(-1)
            accept_label = target_logits.argmax(-1) if target_logits is not None else data_labels
        if selector is not None:
            unary, cand = selector.candidates(draft_logits)
        if conf_head is not None:
            accept = accept_probability(draft_logits, target_logits, cfg.temperature)
    if conf_head is not None:
        conf = head_confidence_term(conf_head(slot_hidden), accept)
        per_slot = per_slot + cfg.conf_weight * conf
    zero = torch.zeros((), dtype=per_slot.dtype, device=per_slot.device)
    label_prob = torch.where(tw, torch.exp(-ce.detach()), zero).view(B * A, S)
    w = torch.where(tw, position_weights(cfg, label_prob, tw.view(B * A, S)).reshape(M), zero)
    loss = (w * torch.where(tw, per_slot, zero)).sum() / w.sum().clamp(min=1e-12)
    block_ok = (anchors >= 0).view(-1)

    sel = None
    if selector is not None:  # 6. (the training label: the data token, or the target argmax = accept_label)
        grid = lambda t: t.view(B, A, S, *t.shape[1:])  # noqa: E731
        train_label = data_labels if cfg.label == "data" else accept_label
        sel = selector_terms(selector, hidden[:, :, 1:], anchor_ids, grid(unary), grid(cand), grid(train_label),
                             grid(data_labels), grid(accept_label), trained, grid(w), block_ok)
        loss = loss + cfg.selector_weight * sel.loss
    if refiner is not None:  # 6'. XPress: the backbone's loss above is its base term
        grid = lambda t: t.view(B, A, S)  # noqa: E731
        train_label = data_labels if cfg.label == "data" else accept_label
        sel = xpress_terms(refiner, head, hidden, before_anchor, anchor_ids, grid(train_label), grid(data_labels),
                           grid(accept_label), trained, target_hidden, cfg, lm_head_chunk, block_ok)
        loss = cfg.xpress_base_weight * loss + sel.loss

    with torch.no_grad():
        correct = ((draft_arg == accept_label) & tw).view(B * A, S)
        valid = trained.view(B * A, S)
        n = tw.sum()
        nf = n.clamp(min=1).float()
        num_blocks = block_ok.sum()
        streak = streak_lengths(correct, valid)
        return LossOutput(
            loss=loss,
            ce=torch.where(tw, ce, zero).sum() / nf,
            kl=torch.where(tw, kl, zero).sum() / nf,
            tv=torch.where(tw, tv, zero).sum() / nf if cfg.tv_weight > 0 else None,
            conf=torch.where(tw, conf.detach(), zero).sum() / nf if cfg.conf_weight > 0 else None,
            acc_per_pos=accuracy_per_position(correct, valid),
            streak_mean=(streak * block_ok).sum().float() / num_blocks.float(),  # nan: no block
            num_blocks=num_blocks,
            num_predictions=n,
            selector=sel,
        )
