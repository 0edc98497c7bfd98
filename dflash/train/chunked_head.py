"""The LM head and the per-slot loss in chunks of slots, never the whole ``[M, V]`` logits.

The drafter's logits over the vocabulary for every scored slot are the step's largest activation.
:func:`chunked_head_loss` computes, ``chunk`` slots at a time, what :func:`dflash.train.loss.mixed_loss`
computes from full logits, and the gradient of each slot's loss with respect to its hidden state
right away (the head is frozen, so that is the only gradient it needs); autograd later scales it
by the incoming per-slot gradient. The same idea as the fused linear cross-entropy of Liger-Kernel
(Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels for LLM Training"), written here with
plain torch ops for this loss (CE + temperature KL).

Gradient (notation of :mod:`dflash.train.loss`, ``p = softmax(z^D)``, ``q_tau = softmax(z^D / tau)``,
``p^T_tau = softmax(z^T / tau)``, ``e_y`` the one-hot label):
``dl/dz^D = (1 - kl_weight) (p - e_y) + kl_weight * tau * (q_tau - p^T_tau)``, then
``dl/dh = (dl/dz^D) W`` through the head (in the head's dtype, as autograd would). With a TV or
"top1" confidence term (``tv_weight``/``conf_weight`` > 0) the chunk's ``dl/dz^D`` is taken by
autograd from :func:`dflash.train.loss.mixed_loss` itself on the chunk's fp32 logits (same formula,
no second derivation to keep in step; a few more ``[c, V]`` buffers while the chunk is computed).
DSpark's confidence head is trained outside: this function gives its label ``c* = 1 - TV`` per slot
(``accept=True``, not differentiated) and :mod:`dflash.train.objective` adds the head's term.

Memory, for ``M`` slots, vocabulary ``V``, hidden ``H``, ``c`` slots per chunk (fp32 = 4 bytes):
unchunked, autograd keeps the ``[M, V]`` fp32 log-probabilities for backward (two more ``[M, V]``
with KL: the draft and target log-softmax at ``tau``), about ``4 M V`` bytes each, plus the head's
``[M, V]`` output; chunked, about five ``[c, V]`` fp32 buffers live while a chunk is computed and
only ``dl/dh`` ``[M, H]`` fp32 is kept. At the 8B shape (``V = 151,936``, ``H = 4,096``) and
``M = 3,840`` slots that is 2.3 GB per ``[M, V]`` tensor against 63 MB kept and 0.6 GB per
``[c, V]`` chunk buffer at ``c = 1,024``. FLOPs are the same: the head's forward once, and its
input-gradient product moves from backward into forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dflash.train.loss import LossConfig, accept_probability, loss_terms

__all__ = ["ce_and_grad", "ce_and_p_minus_y", "chunked_head_loss", "compiled_ce_and_grad"]


def ce_and_p_minus_y(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's hard-label cross-entropy and its gradient with respect to the logits, in fp32.

    Args:
        z: ``[c, V]`` logits (the head's bf16 output, or fp32); the softmax runs in fp32.
        y: ``[c]`` int64 labels.

    Returns:
        ``(ce [c], dz [c, V])``, both fp32: ``ce = -log softmax(z)_y`` and ``dz = softmax(z) - e_y``,
        ``dz`` made in place over the log-probabilities (one ``[c, V]`` fp32 buffer).
    """
    logp = F.log_softmax(z, dim=-1, dtype=torch.float32)
    ce = -logp.gather(1, y[:, None]).squeeze(1)
    dz = logp.exp_()                                                     # p, in place
    dz.scatter_add_(1, y[:, None], torch.full_like(dz[:, :1], -1.0))     # p - e_y
    return ce, dz


def ce_and_grad(z: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ce_and_p_minus_y` with the gradient cast to ``dtype`` (the head's weight dtype, for
    ``dz @ W``): the function :func:`compiled_ce_and_grad` compiles, so that the cast joins the
    softmax in one pass over ``z``."""
    ce, dz = ce_and_p_minus_y(z, y)
    return ce, dz.to(dtype)


@functools.cache
def compiled_ce_and_grad():
    """:func:`ce_and_grad` through ``torch.compile`` (``dynamic=False``: a run's chunks have two
    shapes, the full chunk and the last), created once per process so every drafter replica and
    step reuse its graphs."""
    return torch.compile(ce_and_grad, dynamic=False)


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head, target_hidden, data_labels, cfg: LossConfig, chunk: int, topk: int,
                want_accept: bool, compiled: bool):
        M = hidden.shape[0]
        W = head.lm_head.weight
        kw, tau = cfg.kl_weight, cfg.temperature
        l, ce, kl, tv, conf = (torch.empty(M, device=hidden.device) for _ in range(5))
        draft_arg = torch.empty(M, dtype=torch.long, device=hidden.device)
        target_arg = torch.empty_like(draft_arg) if target_hidden is not None else None
        grad_h = torch.empty(M, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        top_v = torch.empty(M, topk, device=hidden.device) if topk else None
        top_i = torch.empty(M, topk, dtype=torch.long, device=hidden.device) if topk else None
        accept = torch.empty(M, device=hidden.device) if want_accept else None
        for s in range(0, M, chunk):
            e = min(s + chunk, M)
            # argmax and top-K read the head's own output (bf16 in training): an fp32 copy holds
            # the same values, so the same answers, at twice the bytes read
            zh = head.logits(hidden[s:e])                                    # [c, V]
            zth = head.logits(target_hidden[s:e]) if target_hidden is not None else None
            if target_arg is not None:
                target_arg[s:e] = zth.argmax(-1)
            y = target_arg[s:e] if cfg.label == "target_argmax" else data_labels[s:e]
            draft_arg[s:e] = zh.argmax(-1)
            if topk:  # DFlash2's selector candidates
                top_v[s:e], top_i[s:e] = torch.topk(zh, topk, dim=-1)
            # fp32 copies of the logits only where a term reads them (CE alone upcasts inside its
            # log-softmax, and the argmax label needs none)
            fp32 = kw > 0 or want_accept or cfg.tv_weight > 0 or cfg.conf_weight > 0
            z = zh.float() if fp32 else None
            zt = zth.float() if zth is not None and fp32 else None
            if want_accept:  # the confidence head's label, before z is consumed
                accept[s:e] = accept_probability(z, zt, tau)
            if cfg.tv_weight > 0 or (cfg.conf_weight > 0 and cfg.confidence == "top1"):
                with torch.enable_grad():
                    z_leaf = z.detach().requires_grad_(True)
                    l_c, ce_c, kl_c, tv_c, conf_c = loss_terms(cfg, z_leaf, y, zt)
                    (dz,) = torch.autograd.grad(l_c.sum(), z_leaf)
                l[s:e], ce[s:e], kl[s:e] = l_c.detach(), ce_c.detach(), kl_c.detach()
                tv[s:e] = tv_c.detach() if tv_c is not None else 0.0
                conf[s:e] = conf_c.detach() if conf_c is not None else 0.0
                grad_h[s:e] = (dz.to(W.dtype) @ W).float()
                continue
            tv[s:e], conf[s:e] = 0.0, 0.0
            if compiled and kw == 0:  # the hard-label CE in one fused pass, cast included
                ce[s:e], dz = compiled_ce_and_grad()(zh, y, W.dtype)
            else:
                ce[s:e], dz = ce_and_p_minus_y(zh if z is None else z, y)
            if kw > 0:
                logp_t = F.log_softmax(zt / tau, dim=-1)
                logq_t = F.log_softmax(z / tau, dim=-1)
                p_t = logp_t.exp()
                kl[s:e] = (tau * tau) * (p_t * (logp_t - logq_t)).sum(-1)
                dz.mul_(1.0 - kw).add_(logq_t.exp_().sub_(p_t), alpha=kw * tau)
            else:
                kl[s:e] = 0.0
            grad_h[s:e] = (dz.to(W.dtype) @ W).float()
            l[s:e] = (1.0 - kw) * ce[s:e] + kw * kl[s:e]
        ctx.save_for_backward(grad_h)
        ctx.h_dtype = hidden.dtype
        outs = (l, ce, kl, tv, conf, draft_arg, target_arg if target_arg is not None else data_labels)
        outs += (top_v, top_i) if topk else ()
        outs += (accept,) if want_accept else ()
        ctx.mark_non_differentiable(*outs[1:])
        return outs

    @staticmethod
    def backward(ctx, grad_l, *_):
        (grad_h,) = ctx.saved_tensors
        return (grad_l[:, None] * grad_h).to(ctx.h_dtype), None, None, None, None, None, None, None, None


def chunked_head_loss(hidden: torch.Tensor, head, target_hidden: torch.Tensor | None,
                      data_labels: torch.Tensor, cfg: LossConfig, chunk: int, topk: int = 0,
                      accept: bool = False, compiled: bool = False):
    """Per-slot loss terms through the frozen LM head, ``chunk`` slots at a time.

    Args:
        hidden: ``[M, H]`` drafter hidden states (differentiable).
        head: the :class:`dflash.model.target.SharedHead` (frozen).
        target_hidden: ``[M, H]`` target final hidden states predicting the same tokens, or None
            (required when the loss needs target logits).
        data_labels: ``[M]`` int64 dataset tokens.
        cfg: the loss config (label, kl_weight, tv_weight, conf_weight, temperature).
        chunk: slots per chunk (>= 1).
        topk: > 0: also the drafter's ``topk`` largest logits per slot (DFlash2's selector
            candidates, :mod:`dflash.train.selector_loss`), taken from the same chunk logits.
        accept: also ``c* = clamp(1 - TV, 0, 1)`` per slot at ``cfg.temperature``, the confidence
            head's label (:func:`dflash.train.loss.accept_probability`); needs ``target_hidden``.
        compiled: a chunk whose loss is the hard-label CE alone takes it and its gradient from
            :func:`compiled_ce_and_grad` (``[train].compile_head``); other chunks run eagerly.

    Returns:
        ``(l, ce, kl, tv, conf, draft_argmax, accept_label)``, each ``[M]``: ``l`` fp32 with grad to
        ``hidden``; ``ce``/``kl`` fp32 as :func:`dflash.train.loss.mixed_loss`; ``tv``/``conf`` fp32
        the unweighted TV and "top1" confidence terms (:func:`dflash.train.loss.loss_terms`; zeros
        where that term is off); ``draft_argmax`` the
        drafter's argmax token; ``accept_label`` the target's argmax (or ``data_labels`` without
        target hidden states). With ``topk``, then ``(top_values [M, topk] fp32, top_ids [M, topk]
        int64)``, largest first (no gradient). With ``accept``, last ``c* [M]`` fp32 (no gradient).

    Raises:
        ValueError: ``chunk < 1``, or the config (or ``accept``) needs target logits and
            ``target_hidden`` is None.
    """
    if chunk < 1:
        raise ValueError(f"LM-head chunk must be >= 1 slots, got {chunk}")
    if (cfg.kl_weight > 0 or cfg.tv_weight > 0 or cfg.label == "target_argmax" or accept) and target_hidden is None:
        raise ValueError("loss.kl_weight > 0, tv_weight > 0, label = 'target_argmax' or a confidence head "
                         "needs target hidden states")
    return _ChunkedHeadLoss.apply(hidden, head, target_hidden, data_labels, cfg, chunk, topk, accept, compiled)
