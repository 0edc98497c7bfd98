"""Measure a drafter: decode each prompt for real, then score the same text teacher-forced.

The decode (:func:`dflash.eval.decode.speculative_decode`) gives the measured accepted length of every
verify step. Next to it the generated text is scored teacher-forced: a block at every anchor of
the generated region, labels = target argmax. Its streak at the anchors the decode visited
reproduces each measured ``m`` (up to kernel numerics), and its marginal per-position accuracies
give the simulated figure printed in training (``tau_sim = 1 + sum_j prod_{i<=j} acc_i``;
:mod:`dflash.train.acceptance`). The result types and the printed table are in :mod:`dflash.eval.report`.

A DFlash2 drafter decodes with its selector's walk (:func:`dflash.eval.selector.selector_proposer`)
and is scored by the walk; beside it the same text gives recall@K, the oracle top-K tau and the
backbone top-1's teacher-forced tau (:func:`dflash.eval.selector.block_figures`). Its sampled
decode (``temperature > 0``) samples the walk, ``q`` restricted to the selector's K candidates.
"""

from __future__ import annotations

import math
import time

import torch

from dflash.eval.decode import (
    CachedDrafterProposer,
    DrafterProposer,
    speculative_decode,
)
from dflash.eval.report import EvalResult, PromptResult, SelectorFigures
from dflash.eval.selector import block_figures, is_dflash2, selector_proposer
from dflash.model.attention import training_layout
from dflash.model.drafter import DFlashDrafter
from dflash.model.target import SharedHead, Target
from dflash.train.acceptance import (
    accuracy_per_position,
    simulated_accepted_length,
    streak_lengths,
    tau_from_accepted,
)

__all__ = ["evaluate", "greedy_labels", "teacher_forced"]


@torch.no_grad()
def greedy_labels(target: Target, head: SharedHead, tokens: torch.Tensor, anchors: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What greedy verification would accept at each anchor of ``tokens [L]``.

    Returns ``(labels [A, bs-1], valid [A, bs-1], features [1, L+1, k*H])``: ``labels[:, j-1]`` is
    the target's argmax for token ``a + j``, read at position ``a + j - 1``; slot ``j`` is valid
    iff ``a + j < L`` (token ``a + j`` is part of the text, so the decode could have drafted it).
    """
    L = tokens.shape[0]
    ext = torch.cat([tokens, tokens[-1:]])[None]          # one dummy token: features stay causal
    pos = torch.arange(L + 1, device=tokens.device)[None]
    feats, final = target(ext, pos, torch.zeros_like(pos), need_final=True)
    greedy = head.logits(final[0, :L]).argmax(-1)        # greedy[t] = target's token t + 1
    lab_pos = anchors[:, None] + torch.arange(block_size - 1, device=tokens.device)   # a + j - 1
    valid = lab_pos + 1 < L
    return greedy[lab_pos.clamp(max=L - 1)], valid, feats


@torch.no_grad()
def teacher_forced(target: Target, drafter: DFlashDrafter, head: SharedHead, tokens: torch.Tensor,
                   anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Score drafter blocks at ``anchors [A]`` of ``tokens [L]`` against :func:`greedy_labels`.

    Returns ``(correct, valid)``, both ``[A, bs-1]`` bool.
    """
    hidden, labels, valid = _teacher_forced_blocks(target, drafter, head, tokens, anchors)
    return head.logits(hidden[:, 1:]).argmax(-1) == labels, valid


def _teacher_forced_blocks(target, drafter, head, tokens, anchors):
    """``(hidden [A, bs, H], labels [A, bs-1], valid [A, bs-1])`` of the blocks at ``anchors``."""
    bs = drafter.cfg.block_size
    labels, valid, feats = greedy_labels(target, head, tokens, anchors, bs)
    pos = torch.arange(feats.shape[1], device=tokens.device)[None]
    block = torch.full((1, anchors.shape[0], bs), drafter.cfg.mask_token_id, device=tokens.device)
    block[0, :, 0] = tokens[anchors]
    layout = training_layout(pos, torch.zeros_like(pos), anchors[None], bs)
    return drafter(feats, head.embed(block), layout)[0], labels, valid


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def evaluate(target: Target, drafter: DFlashDrafter, head: SharedHead,
             prompts: list[torch.Tensor], max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0) -> EvalResult:
    """Greedy speculative decode of each prompt ``[n]`` + teacher-forced scoring of the same text;
    with ``temperature > 0`` also a sampled decode of each prompt (one ``torch.Generator`` seeded
    with ``seed``), whose measured tau is reported beside greedy
    (:func:`~dflash.eval.decode.speculative_decode` has the rule; a DFlash2 drafter samples its
    selector's walk, ``q`` restricted to the K candidates, :mod:`dflash.eval.selector`).

    Raises:
        ValueError: bad sampling parameters.
    """
    bs = drafter.cfg.block_size
    cached = all(t == "full_attention" for t in drafter.cfg.types)
    dflash2 = is_dflash2(drafter)

    def proposer():
        if dflash2:  # drafts with the selector's walk over its top-K (sampled: q over the K)
            return selector_proposer(drafter, head)
        return CachedDrafterProposer(drafter, head) if cached else DrafterProposer(drafter, head)

    per, all_m, all_streak, all_streaks, corrects, valids, extra = [], [], [], [], [], [], []
    seconds = 0.0
    for prompt in prompts:
        t0 = _clock(prompt.device)
        tokens, acc_m, visited = speculative_decode(target, proposer(), prompt, max_new_tokens, bs)
        seconds += _clock(prompt.device) - t0
        n = prompt.shape[0]
        region = torch.arange(n, tokens.shape[0], device=tokens.device)     # anchors after prefill
        if dflash2:  # scored by the walk it drafts with; the backbone's top-1 and the top-K beside it
            hidden, labels, valid = _teacher_forced_blocks(target, drafter, head, tokens, region)
            correct, top1, in_k = block_figures(drafter, head, hidden, tokens[region], labels)
            extra.append((top1, in_k, valid))
        else:
            correct, valid = teacher_forced(target, drafter, head, tokens, region)
        streaks = streak_lengths(correct, valid)
        s_vis = streaks[torch.tensor(visited, device=tokens.device) - n]
        acc = accuracy_per_position(correct, valid)
        mean_m, sim = sum(acc_m) / len(acc_m), simulated_accepted_length(acc)
        per.append(PromptResult(
            prompt_len=n, new_tokens=tokens.shape[0] - n, steps=len(acc_m),
            tau=tau_from_accepted(mean_m), mean_accepted=mean_m,
            tau_sim=tau_from_accepted(sim), accepted_sim=sim,
            streak_all=float(streaks.float().mean()), streak_visited=float(s_vis.float().mean())))
        all_m += acc_m
        all_streaks.append(streaks)
        all_streak += s_vis.tolist()
        corrects.append(correct)
        valids.append(valid)
    acc = accuracy_per_position(torch.cat(corrects), torch.cat(valids))
    mean_m = sum(all_m) / max(len(all_m), 1)
    sim = simulated_accepted_length(acc)
    sampled_m = None
    if temperature > 0:
        gen = torch.Generator(device=target.device).manual_seed(seed)
        ms: list[int] = []
        for prompt in prompts:
            t0 = _clock(prompt.device)
            ms += speculative_decode(target, proposer(), prompt, max_new_tokens, bs, temperature=temperature,
                                     top_p=top_p, top_k=top_k, generator=gen)[1]
            seconds += _clock(prompt.device) - t0
        sampled_m = sum(ms) / max(len(ms), 1)
    return EvalResult(
        dtype=str(target.model.dtype).removeprefix("torch."), threads=torch.get_num_threads(),
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, seconds=seconds,
        sampled_tau=None if sampled_m is None else tau_from_accepted(sampled_m),
        sampled_accepted=sampled_m, tau=tau_from_accepted(mean_m), mean_accepted=mean_m,
                      tau_sim=tau_from_accepted(sim), accepted_sim=sim,
                      streak_visited=sum(all_streak) / max(len(all_streak), 1),
                      streak_all=float(torch.cat(all_streaks).float().mean()),
                      acc_per_pos=_scored(acc), n_per_pos=torch.cat(valids).sum(0).tolist(),
                      block_size=bs, per_prompt=per,
                      selector=_selector_figures(drafter, extra) if dflash2 else None)


def _selector_figures(drafter: DFlashDrafter, extra) -> SelectorFigures:
    """recall@K, oracle top-K tau and the backbone top-1's tau over every teacher-forced block."""
    top1, in_k, valid = (torch.cat(x) for x in zip(*extra))
    return SelectorFigures(
        top_k=drafter.cfg.selector_top_k,
        recall=float((in_k & valid).sum() / valid.sum().clamp(min=1)),
        oracle_tau=tau_from_accepted(float(streak_lengths(in_k, valid).float().mean())),
        backbone_tau=tau_from_accepted(float(streak_lengths(top1, valid).float().mean())),
        backbone_acc_per_pos=_scored(accuracy_per_position(top1, valid)))


def _scored(acc: torch.Tensor) -> list[float | None]:
    """Per-position accuracies as a list, None where no anchor reached the position (NaN)."""
    return [None if math.isnan(a) else a for a in acc.tolist()]
