"""The typed items that travel on the DFlash training graph's channels.

prefetch --Batch--> target[i] --TargetOutput--> postprocess --DrafterInput--> drafter
--StepMetrics--> monitor; with ``[eval]``: drafter --DrafterSnapshot--> evaluator --HeldoutTau--> monitor

:class:`LossInput` is the part of a :class:`DrafterInput` the loss reads (``inp.loss_input()``).

Tensors stay tensors (no serialisation in-process); msgspec Structs are used for their cheap,
typed, slotted records. Shapes use B = rows in the batch, T = tokens per row, H = target hidden
size, k = number of captured target layers, A = anchors per row.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch


class Batch(msgspec.Struct, kw_only=True):
    """One training batch produced by ``prefetch``.

    Attributes:
        seq: position of this batch in this run's stream (0, 1, 2, ...); the ordered fan-in after
            the target replicas restores this order.
        batch_id: global index of the batch in the sampler's order (stable across resume).
        epoch: data epoch the batch belongs to.
        input_ids: ``[B, T]`` int64 token ids (pad id on padding).
        loss_mask: ``[B, T]`` bool, True on tokens the drafter is trained to predict (assistant
            tokens).
        position_ids: ``[B, T]`` int64, restarting at 0 at each packed document.
        doc_ids: ``[B, T]`` int32 document index within the row; -1 on padding. Attention and
            anchors never cross a document boundary.
        num_tokens: real (non-padding) tokens in the batch.
        num_padding: padding tokens in the batch (computed but useless).
        sampler_state: the sampler's state *after* this batch (restoring it resumes exactly at the
            next batch).
        anchors: ``[B, A]`` int64 anchor positions drawn by ``prefetch`` (-1 = empty slot), or None
            before they are drawn.
    """

    seq: int
    batch_id: int
    epoch: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    num_tokens: int
    num_padding: int
    sampler_state: dict[str, Any] = {}
    anchors: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The batch's tensors by field name (anchors included once drawn)."""
        names = ("input_ids", "loss_mask", "position_ids", "doc_ids", "anchors")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """Copy of this batch with every tensor moved to ``device``."""
        moved = {n: t.to(device, non_blocking=non_blocking) for n, t in self.tensors().items()}
        return msgspec.structs.replace(self, **moved)

    def pin_memory(self) -> "Batch":
        """Copy of this batch with every tensor in page-locked host memory (for async H2D)."""
        return msgspec.structs.replace(self, **{n: t.pin_memory() for n, t in self.tensors().items()})


class TargetOutput(msgspec.Struct, kw_only=True):
    """What one target replica produced for one batch.

    Attributes:
        batch: the input batch (on the target's device).
        layer_hidden: ``[B, T, k*H]`` outputs of the captured target layers, concatenated per token
            (target dtype: bf16 on GPU, fp32 on CPU).
        final_hidden: ``[B, T, H]`` final post-norm hidden state, or None when the loss needs no
            target logits (hard labels from the data, ``kl_weight == 0``).
        replica: index of the target replica that produced it.
        target_s: seconds the target forward took (host-side, for monitoring).

    With ``[train].postprocess_side = "target"`` the feature noise is already in ``layer_hidden``
    (:mod:`dflash.model.features`).
    """

    batch: Batch
    layer_hidden: torch.Tensor
    final_hidden: torch.Tensor | None
    replica: int
    target_s: float = 0.0


class DrafterInput(msgspec.Struct, kw_only=True):
    """A batch made ready for the drafter by ``postprocess`` (on the drafter's device).

    Attributes:
        batch: the input batch.
        features: ``[B, T, k*H]`` target features (optionally with feature noise added).
        final_hidden: ``[B, T, H]`` or None (see :class:`TargetOutput`).
        anchors: ``[B, A]`` int64 anchor positions, -1 in unused slots.
        replica: the target replica that produced the features.
        target_s: seconds the target forward took.
    """

    batch: Batch
    features: torch.Tensor
    final_hidden: torch.Tensor | None
    anchors: torch.Tensor
    replica: int
    target_s: float = 0.0

    def loss_input(self) -> "LossInput":
        """The tensors :func:`dflash.train.objective.compute_loss` reads (no copies)."""
        b = self.batch
        return LossInput(features=self.features, input_ids=b.input_ids, loss_mask=b.loss_mask,
                         doc_ids=b.doc_ids, position_ids=b.position_ids, anchors=self.anchors,
                         final_hidden=self.final_hidden)


class LossInput(msgspec.Struct, kw_only=True, frozen=True):
    """What the drafter's loss reads for one batch (:func:`dflash.train.objective.compute_loss`), all on
    the drafter's device.

    Attributes:
        features: ``[B, T, k*H]`` target features (target dtype: bf16 on GPU, fp32 on CPU).
        input_ids: ``[B, T]`` int64 token ids.
        loss_mask: ``[B, T]`` bool, True on tokens the drafter is trained to predict.
        doc_ids: ``[B, T]`` int32/int64 document index within the row, -1 on padding.
        position_ids: ``[B, T]`` int64, restarting at 0 at each packed document.
        anchors: ``[B, A]`` int64 anchor positions, -1 in unused slots.
        final_hidden: ``[B, T, H]`` target final hidden states (target dtype), or None when the
            loss needs no target logits.
    """

    features: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    doc_ids: torch.Tensor
    position_ids: torch.Tensor
    anchors: torch.Tensor
    final_hidden: torch.Tensor | None = None


class StepMetrics(msgspec.Struct, kw_only=True):
    """What the drafter reports to the monitor after each optimizer step (or skipped step).

    Attributes:
        step: drafter optimizer step this record belongs to (1-based; the step counter after it).
        batch_id: global id of the batch trained on.
        loss, ce, kl: total loss and its parts (nan for a skipped step).
        tv, conf: the unweighted total-variation and confidence terms (means over trained slots,
            like ``ce``), None when ``[loss].tv_weight`` / ``conf_weight`` is 0 (nan for a skipped
            step).
        acc_per_pos: accuracy per block position 1..block_size-1 (fraction, length block_size-1).
        accepted_sim: simulated accepted length ``sum_j prod_{i<=j} acc_i``, in drafted tokens per
            verify step (the bonus token not included; tau = accepted_sim + 1, see dflash.train.acceptance).
        lr: learning rate used for the step.
        grad_norm: global L2 gradient norm before clipping.
        skipped: True when the step was skipped (non-finite loss or gradient).
        skip_reason: why it was skipped.
        replica: the target replica that produced the batch's features (-1: unknown).
        num_tokens: real tokens in the batch (target side).
        num_padding: padding tokens in the batch.
        num_blocks: training blocks (anchors) used.
        step_s: seconds the drafter step took.
        target_s: seconds the target forward took for this batch.
        time: unix time when the step finished.

    DFlash2 only (None for a DFlash drafter; :mod:`dflash.train.selector_loss` defines them):
        sel_loss: the selector's loss (nan for a skipped step).
        sel_acc_per_pos: the selector walk's accuracy per block position 1..block_size-1.
        sel_accepted: the walk's teacher-forced accepted length (mean leading correct slots per
            block: drafted tokens per verify step a greedy verifier accepts from these blocks).
        base_accepted: the same for the backbone's top-1 (what a DFlash drafter would draft).
        recall_k: fraction of trained slots whose label is among the drafter's top-K.
        oracle_accepted: accepted length if the drafter always picked the label when it is in the
            top-K (drafted tokens per verify step; oracle top-K tau = oracle_accepted + 1).
        label_missing: trained slots whose label is not in the top-K (left out of the selector loss).
    """

    step: int
    batch_id: int
    loss: float
    ce: float
    kl: float
    acc_per_pos: list[float]
    accepted_sim: float
    lr: float
    grad_norm: float
    skipped: bool = False
    skip_reason: str | None = None
    replica: int = -1
    num_tokens: int = 0
    num_padding: int = 0
    num_blocks: int = 0
    step_s: float = 0.0
    target_s: float = 0.0
    time: float = 0.0
    tv: float | None = None
    conf: float | None = None
    sel_loss: float | None = None
    sel_acc_per_pos: list[float] | None = None
    sel_accepted: float | None = None
    base_accepted: float | None = None
    recall_k: float | None = None
    oracle_accepted: float | None = None
    label_missing: int | None = None


class DrafterSnapshot(msgspec.Struct, kw_only=True):
    """A copy of the drafter's weights after a step, for the in-training evaluator.

    Attributes:
        step: the drafter step the weights are from (1-based, counted over the whole run).
        weights: ``state_dict`` copies (the drafter's fp32 master weights, on its device): the
            trainer goes on updating its own parameters while the evaluator reads these.
        final: the run's last weights (sent blocking, so the final evaluation always happens).
        dropped: snapshots not sent since the previous one because the evaluator was still busy.
    """

    step: int
    weights: dict[str, torch.Tensor]
    final: bool = False
    dropped: int = 0


class HeldoutTau(msgspec.Struct, kw_only=True):
    """What the evaluator measured on held-out prompts with one snapshot (its ``[eval]`` settings).

    Attributes:
        step: the snapshot's step.
        tau: measured tokens per verify step (accepted + 1) of greedy draft-and-verify, pooled
            over every verify step of every prompt; ``accepted`` = ``tau - 1``.
        sampled_tau: the same for the sampled decode at ``[eval].temperature`` (None when greedy only).
        tree_tau: the same for the greedy tree-verified decode of ``tree_budget`` draft tokens per
            tree (``[eval].tree_budget``; None when off, or for a variant without a tree).
        loop_share: the share of the greedy decodes' generated tokens that lie in a repetition loop
            (:mod:`dflash.repetition`: from a 16-token window that repeats an earlier one of the
            same answer on); loops are easy to draft, so a rising ``tau`` may be more looping.
        fresh_tau: tau over the greedy verify steps whose anchor lies before its answer's loop
            (the drafter on text that does not repeat itself); None when every step is in a loop.
        prompts: prompts decoded; new_tokens: tokens generated (greedy); steps: verify steps (greedy).
        max_new_tokens: tokens generated per prompt (``[eval].max_new_tokens``; every decode
            generates exactly this many).
        temperature: the sampled decode's (``[eval].temperature``; 0: greedy only).
        dtype: the decode's dtype ("float32", "bfloat16"): the target's for generation.
        seconds: wall time of the evaluation (decodes and the weight load).
        skipped: snapshots not evaluated since the previous evaluation: the evaluator was busy, or
            over its share of the run's time (``[eval].max_busy``).
        time: unix time when it finished.
    """

    step: int
    tau: float
    accepted: float
    prompts: int
    new_tokens: int
    steps: int
    seconds: float
    sampled_tau: float | None = None
    skipped: int = 0
    time: float = 0.0
    max_new_tokens: int | None = None
    temperature: float = 0.0
    tree_tau: float | None = None
    loop_share: float | None = None
    fresh_tau: float | None = None
    tree_budget: int | None = None
    dtype: str | None = None
