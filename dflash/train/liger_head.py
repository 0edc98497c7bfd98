"""The LM head and the hard-label cross-entropy fused in Liger-Kernel: ``[train].lm_head = "liger"``.

``LigerFusedLinearCrossEntropy`` (Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels for LLM
Training", section 3.3) computes ``-log softmax(h W^T)[y]`` chunk by chunk of rows in Triton, never
holding the ``[M, V]`` logits, and the drafter's argmax token on the way
(``return_predicted_tokens``). It is run with ``reduction="none"``: the per-slot losses are
weighted afterwards by :func:`dflash.train.loss.position_weights`, and Liger then recomputes the
chunked logits in backward to fold each slot's incoming gradient in.

Only the hard-label loss fuses this way: with ``loss.kl_weight``, ``tv_weight`` or ``conf_weight``
above 0 the other terms need the drafter's (and the target's) distribution per slot (Liger's fused
JSD returns one mean, not per-slot values, so the position weights could not be applied); :func:`dflash.train.config.check_train` refuses that
combination. With ``label = "target_argmax"`` the target's argmax is computed here in chunks
without gradient.

Cost: Liger reads the count of non-ignored rows on the host once per call (a device sync inside the
loss; ``tests/dflash/train/test_step_sync.py`` covers the default path only).
"""

from __future__ import annotations

import torch

from dflash.train.loss import LossConfig

__all__ = ["liger_head_loss"]


@torch.no_grad()
def _target_argmax(head, target_hidden: torch.Tensor, chunk: int) -> torch.Tensor:
    out = torch.empty(target_hidden.shape[0], dtype=torch.long, device=target_hidden.device)
    for s in range(0, target_hidden.shape[0], chunk):
        out[s:s + chunk] = head.logits(target_hidden[s:s + chunk]).argmax(-1)
    return out


def liger_head_loss(hidden: torch.Tensor, head, target_hidden: torch.Tensor | None,
                    data_labels: torch.Tensor, cfg: LossConfig, chunk: int = 2048):
    """Per-slot hard-label CE through the frozen LM head, fused (the outputs of
    :func:`dflash.train.chunked_head.chunked_head_loss`).

    Args:
        hidden: ``[M, H]`` drafter hidden states (differentiable; cast to the head's dtype).
        head: the :class:`dflash.model.target.SharedHead` (frozen, CUDA).
        target_hidden: ``[M, H]`` target final hidden states, or None (needed for
            ``label = "target_argmax"``).
        data_labels: ``[M]`` int64 dataset tokens.
        cfg: the loss config; ``kl_weight``, ``tv_weight`` and ``conf_weight`` must be 0.
        chunk: rows per chunk of the target-argmax logits (``label = "target_argmax"`` only).

    Returns:
        ``(l, ce, kl, tv, conf, draft_argmax, accept_label)``, each ``[M]``: ``l`` fp32 with grad to
        ``hidden`` (``= ce``: the other terms are 0), ``ce`` detached, ``kl``/``tv``/``conf`` zeros,
        ``draft_argmax`` the drafter's argmax, ``accept_label`` the target's argmax (or
        ``data_labels`` without target hidden states).

    Raises:
        ValueError: ``kl_weight``, ``tv_weight`` or ``conf_weight`` > 0, or ``label = "target_argmax"`` without ``target_hidden``.
    """
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    soft = {k: getattr(cfg, k) for k in ("kl_weight", "tv_weight", "conf_weight") if getattr(cfg, k) > 0}
    if soft:
        raise ValueError(f"train.lm_head = 'liger' fuses the hard-label CE only; loss.{next(iter(soft))} must "
                         "be 0 (or use train.lm_head = 'chunked')")
    if cfg.label == "target_argmax" and target_hidden is None:
        raise ValueError("loss.label = 'target_argmax' needs target hidden states")
    W = head.lm_head.weight
    target_arg = _target_argmax(head, target_hidden, chunk) if target_hidden is not None else None
    labels = target_arg if cfg.label == "target_argmax" else data_labels
    out = liger_fused_linear_cross_entropy(hidden.to(W.dtype), W, labels, reduction="none",
                                           return_predicted_tokens=True)
    l = out.loss.float()
    ce = l.detach()
    zero = torch.zeros_like(ce)
    return l, ce, zero, zero, zero, out.predicted_tokens, \
        target_arg if target_arg is not None else data_labels
