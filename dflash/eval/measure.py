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
An XPress drafter decodes with its refiner's Jacobi passes (:func:`dflash.eval.xpress.xpress_proposer`)
and is scored by the same passes over the teacher-forced blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash.eval.decode import (
    CachedDrafterProposer,
    DecodeStopped,
    DrafterProposer,
    greedy_decode,
    speculative_decode,
)
from dflash.eval.lengths import LABELS, length_bucket
from dflash.eval.pooled import Decoded, LoopTally, category, pooled_summary, speed_of
from dflash.eval.progress import EvalProgress
from dflash.eval.report import EvalResult, PromptResult
from dflash.eval.selector import block_figures, is_dflash2, selector_proposer
from dflash.eval.static_drafter import static_proposer
from dflash.eval.tree import tree_accepted
from dflash.eval.tree_decode import tree_decode
from dflash.eval.xpress import is_xpress, xpress_block_hits, xpress_proposer
from dflash.model.attention import training_layout
from dflash.model.drafter import DFlashDrafter
from dflash.model.target import SharedHead, Target
from dflash.model.variants import variant_of
from dflash.train.acceptance import (
    accuracy_per_position,
    simulated_accepted_length,
    streak_lengths,
    tau_from_accepted,
)

__all__ = ["DecodedTau", "decode_tau", "evaluate", "greedy_labels", "proposer_factory", "teacher_forced",
           "tree_proposer_factory"]


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


@dataclass
class DecodedTau:
    """Measured tau only (:func:`decode_tau`): tokens per verify step pooled over every step."""

    tau: float
    accepted: float
    new_tokens: int
    steps: int
    sampled_tau: float | None = None
    tree_tau: float | None = None
    loop_share: float | None = None    # the greedy decodes' repetition loops (:class:`LoopTally`)
    fresh_tau: float | None = None


def proposer_factory(drafter: DFlashDrafter, head: SharedHead, cuda_graphs: bool = False) -> Callable[[], object]:
    """A new proposer per decode: the selector walk for DFlash2, the Jacobi passes for XPress, the
    cached drafter when every layer attends fully, else the recomputing one. ``cuda_graphs``: a
    full-attention DFlash or DFlash2 drafter drafts with its static step instead (same drafts;
    :mod:`dflash.eval.static_drafter`)."""
    full = all(t == "full_attention" for t in drafter.cfg.types)
    if cuda_graphs and full and not is_xpress(drafter):
        return lambda: static_proposer(drafter, head)
    if is_dflash2(drafter):
        return lambda: selector_proposer(drafter, head)
    if is_xpress(drafter):
        return lambda: xpress_proposer(drafter, head)
    if all(t == "full_attention" for t in drafter.cfg.types):
        return lambda: CachedDrafterProposer(drafter, head)
    return lambda: DrafterProposer(drafter, head)


@torch.no_grad()
def decode_tau(target: Target, drafter: DFlashDrafter, head: SharedHead, prompts: list[torch.Tensor],
               max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               seed: int = 0, progress: Callable[[EvalProgress], None] | None = None,
               should_stop: Callable[[], bool] | None = None, cuda_graphs: bool = False,
               tree_budget: int = 0) -> DecodedTau:
    """The measured tau of greedy draft-and-verify over ``prompts`` (each ``[n]`` int64 ids), and
    with ``temperature > 0`` of the sampled decode too (one generator seeded with ``seed``):
    :func:`evaluate` without the teacher-forced scoring, for the in-training evaluator, whose cost
    is the decodes alone. ``progress``: called after each prompt's greedy decode (stage
    ``"decode"``), after each sampled one (``"sampled"``) and at the end (:mod:`dflash.eval.progress`).
    ``should_stop`` is asked before every prompt and every verify step
    (:func:`~dflash.eval.decode.speculative_decode`): an evaluation of many long decodes ends
    within one verify step of a stop request. ``cuda_graphs``: as :func:`evaluate`'s.
    ``tree_budget > 0``: every prompt decoded once more, greedy, under tree verification of that
    many draft tokens (:mod:`dflash.eval.tree_decode`; ``tree_tau``) where
    :func:`tree_proposer_factory` has a proposer for the variant (progress stage ``"tree"``).
    ``loop_share`` and ``fresh_tau``: the greedy decodes' tokens in repetition loops and the tau
    outside them (:class:`~dflash.eval.pooled.LoopTally`, as :func:`evaluate` reports them).

    Raises:
        ValueError: an empty prompt or bad sampling parameters.
        DecodeStopped: ``should_stop()`` returned True; nothing was measured.
    """
    proposer, bs = proposer_factory(drafter, head, cuda_graphs), drafter.cfg.block_size
    t_start = time.perf_counter()
    ms, tokens, loops = [], 0, LoopTally()
    for i, p in enumerate(prompts):
        _stop_if(should_stop)
        out, acc, visited = speculative_decode(target, proposer(), p, max_new_tokens, bs, should_stop=should_stop,
                                               cuda_graphs=cuda_graphs)
        ms += acc
        loops.add(out, p.shape[0], visited, acc)
        tokens += out.shape[0] - p.shape[0]
        if progress is not None:
            progress(EvalProgress.at("decode", i + 1, len(prompts), t_start, i + 1, tokens, ms))
    sampled = None
    if temperature > 0:
        gen = torch.Generator(device=target.device).manual_seed(seed)
        sm = []
        for i, p in enumerate(prompts):
            _stop_if(should_stop)
            sm += speculative_decode(target, proposer(), p, max_new_tokens, bs, temperature=temperature,
                                     top_p=top_p, top_k=top_k, generator=gen, should_stop=should_stop,
                                     cuda_graphs=cuda_graphs)[1]
            if progress is not None:
                progress(EvalProgress.at("sampled", i + 1, len(prompts), t_start, len(prompts), tokens, ms))
        sampled = tau_from_accepted(sum(sm) / max(len(sm), 1))
    tree = tree_proposer_factory(drafter, head, cuda_graphs) if tree_budget else None
    tree_tau = None
    if tree is not None:
        tm = []
        for i, p in enumerate(prompts):
            _stop_if(should_stop)
            tm += tree_decode(target, tree(), p, max_new_tokens, bs, tree_budget, should_stop=should_stop,
                              cuda_graphs=cuda_graphs)[1]
            if progress is not None:
                progress(EvalProgress.at("tree", i + 1, len(prompts), t_start, len(prompts), tokens, ms))
        tree_tau = tau_from_accepted(sum(tm) / max(len(tm), 1))
    if progress is not None:
        progress(EvalProgress.at("done", len(prompts), len(prompts), t_start, len(prompts), tokens, ms))
    mean = sum(ms) / max(len(ms), 1)
    lf = loops.figures()
    return DecodedTau(tau=tau_from_accepted(mean), accepted=mean, new_tokens=tokens, steps=len(ms),
                      sampled_tau=sampled, tree_tau=tree_tau, loop_share=lf["loop_share"], fresh_tau=lf["fresh_tau"])


def _stop_if(should_stop: Callable[[], bool] | None) -> None:
    """Raise :class:`DecodeStopped` when ``should_stop()`` says so (checked between prompts)."""
    if should_stop is not None and should_stop():
        raise DecodeStopped("stopped between prompts")


def tree_proposer_factory(drafter: DFlashDrafter, head: SharedHead,
                          cuda_graphs: bool = False) -> Callable[[], object] | None:
    """A new proposer per tree-verified decode, or None where none is built. Its tree is the
    backbone's marginals either way: a top-1 drafter's own (the cached drafter); a DFlash2
    drafter's backbone, whose marginals are also where its selector takes its top-K candidates
    from (the selector's walk is not part of the tree). XPress (its refiner passes) has none.
    ``cuda_graphs``: a full-attention drafter's logits come from its static step (the same
    logits; :mod:`dflash.eval.static_drafter`)."""
    how = variant_of(drafter.cfg.variant).drafts_with
    if cuda_graphs and how in ("top1", "selector") and all(t == "full_attention" for t in drafter.cfg.types):
        return lambda: static_proposer(drafter, head)
    if how == "top1":
        return lambda: CachedDrafterProposer(drafter, head)
    if how == "selector":
        return lambda: selector_proposer(drafter, head)
    return None


def evaluate(target: Target, drafter: DFlashDrafter, head: SharedHead,
             prompts: list[torch.Tensor], max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0, categories: list[str] | None = None,
             next_turn: Callable[[int, int, torch.Tensor], torch.Tensor | None] | None = None,
             speed: bool = False, cuda_graphs: bool = False, tree_budget: int = 0,
             progress: Callable[[EvalProgress], None] | None = None,
             should_stop: Callable[[], bool] | None = None, time_limit_s: float | None = None,
             started_at: float | None = None, stop_early: Callable[[], bool] | None = None) -> EvalResult:
    """Greedy speculative decode of each prompt ``[n]`` (int64 token ids) + teacher-forced scoring
    of the same text (each prompt scored as soon as its decodes end, so a cut evaluation has every
    finished prompt's figures); with ``temperature > 0`` also a sampled decode of each prompt (one
    ``torch.Generator`` seeded with ``seed``), whose measured tau is reported beside greedy
    (:func:`~dflash.eval.decode.speculative_decode` has the rule; a DFlash2 drafter samples its
    selector's walk, ``q`` restricted to the K candidates, :mod:`dflash.eval.selector`).

    Args:
        categories: one per prompt; the result then has a :class:`CategoryResult` per category
            (in first-seen order) and the mean over categories. None: one category, ``"all"``.
        next_turn: ``next_turn(i, turn, tokens [n + max_new_tokens]) -> prompt [n'] | None``,
            called after prompt ``i``'s greedy decode of turn ``turn`` (0 first) with its tokens: the
            next turn's prompt (e.g. MT-Bench's second question after the target's own answer;
            the greedy decode's output is the target's own greedy text), or None when the prompt
            has no further turn. Every turn counts under its prompt's category.
        speed: also time the target alone (:func:`~dflash.eval.decode.greedy_decode`) on every
            decoded prompt, after one untimed warm-up decode of each kind, every timed region
            synchronised: :class:`SpeedResult` (wall-clock tokens/s of both, their ratio).
        cuda_graphs: every decode here (both timed kinds, the sampled one, the tree-verified
            ones) runs the target's steps through :mod:`dflash.eval.static_target` (trees:
            :mod:`dflash.eval.static_tree`), and a full-attention DFlash or DFlash2 drafter's
            through :mod:`dflash.eval.static_drafter` (CUDA-graph replays on a GPU).
        tree_budget: > 0: also score every anchor's block under a tree of that many draft tokens
            (teacher-forced, :mod:`dflash.eval.tree`: ``EvalResult.tree_tau_tf``) and decode
            each prompt again with tree verification (:mod:`dflash.eval.tree_decode`:
            ``tree_tau``, timed) where :func:`tree_proposer_factory` has a proposer for the
            variant; with ``temperature > 0`` once more sampled (``sampled_tree_tau``, its own
            generator seeded with ``seed``).
        progress: called with an :class:`~dflash.eval.progress.EvalProgress` before the warm-up
            (``speed``), after each prompt's decodes and scoring (every turn) and at the end;
            None: quiet.
        should_stop: asked before every decode and between its verify steps, as :func:`decode_tau`.
        time_limit_s: seconds from ``started_at`` by which the evaluation should end: no prompt
            starts whose predicted end (now + the mean seconds of the prompts finished, decodes
            and scoring) passes it. The first prompt always runs; the one under way finishes,
            every turn and pass of it. The result is over the prompts finished;
            ``prompts_asked`` says of how many, ``stopped_by`` ``"time_limit"``.
        started_at: the ``time.perf_counter()`` the time limit counts from (a CLI passes its own
            start, so loading the models counts); None: this call's start.
        stop_early: asked before each prompt after the first; True ends the evaluation there
            like the time limit (``stopped_by`` ``"signal"``): e.g. a SIGTERM handler's flag, so
            ``timeout`` still gets the finished prompts' result.

    Raises:
        ValueError: bad sampling parameters, an empty prompt, or ``categories`` of another length.
        DecodeStopped: ``should_stop()`` returned True; nothing was measured.
    """
    if categories is not None and len(categories) != len(prompts):
        raise ValueError(f"{len(categories)} categories for {len(prompts)} prompts")
    bs = drafter.cfg.block_size
    dflash2 = is_dflash2(drafter)  # drafts with the selector's walk over its top-K (sampled: q over the K)
    proposer = proposer_factory(drafter, head, cuda_graphs)
    tree_proposer = tree_proposer_factory(drafter, head, cuda_graphs) if tree_budget else None
    t_start = time.perf_counter()
    t_limit = t_start if started_at is None else started_at

    if speed and prompts:  # kernels, allocator and caches warmed before anything is timed
        if progress is not None:
            progress(EvalProgress("warmup", 0, len(prompts)))
        speculative_decode(target, proposer(), prompts[0], max_new_tokens, bs, cuda_graphs=cuda_graphs)
        greedy_decode(target, prompts[0], max_new_tokens, cuda_graphs=cuda_graphs)
    gen = torch.Generator(device=target.device).manual_seed(seed) if temperature > 0 else None
    tree_gen = torch.Generator(device=target.device).manual_seed(seed) if temperature > 0 else None
    decoded: list[Decoded] = []
    stopped_by = None
    t_loop = time.perf_counter()
    for i, first in enumerate(prompts):
        if i and stop_early is not None and stop_early():
            stopped_by = "signal"
            break
        now = time.perf_counter()
        if i and time_limit_s is not None and now - t_limit + (now - t_loop) / i > time_limit_s:
            stopped_by = "time_limit"
            break
        prompt, turn = first, 0
        while prompt is not None:
            _stop_if(should_stop)
            t0 = _clock(prompt.device)
            tokens, acc_m, visited = speculative_decode(target, proposer(), prompt, max_new_tokens, bs,
                                                        cuda_graphs=cuda_graphs, should_stop=should_stop)
            d = Decoded(i, turn, prompt.shape[0], tokens, acc_m, visited, _clock(prompt.device) - t0)
            if speed:
                t0 = _clock(prompt.device)
                greedy_decode(target, prompt, max_new_tokens, cuda_graphs=cuda_graphs)
                d.target_seconds = _clock(prompt.device) - t0
            if tree_budget and tree_proposer is not None:
                t0 = _clock(prompt.device)
                d.tree_m = tree_decode(target, tree_proposer(), prompt, max_new_tokens, bs,
                                       tree_budget, should_stop=should_stop, cuda_graphs=cuda_graphs)[1]
                d.tree_seconds = _clock(prompt.device) - t0
            if gen is not None:  # the generator's stream runs through the prompts in order
                t0 = _clock(prompt.device)
                s_tokens, d.sampled_m, _ = speculative_decode(target, proposer(), prompt, max_new_tokens, bs,
                                                              temperature=temperature, top_p=top_p, top_k=top_k,
                                                              generator=gen, cuda_graphs=cuda_graphs,
                                                              should_stop=should_stop)
                d.sampled_seconds = _clock(prompt.device) - t0
                d.sampled_new_tokens = s_tokens.shape[0] - prompt.shape[0]
                if tree_budget and tree_proposer is not None:  # the sampled tree: a stream of its own
                    d.sampled_tree_m = tree_decode(target, tree_proposer(), prompt, max_new_tokens, bs, tree_budget,
                                                   temperature=temperature, top_p=top_p, top_k=top_k,
                                                   generator=tree_gen, should_stop=should_stop,
                                                   cuda_graphs=cuda_graphs)[1]
            _score(d, target, drafter, head, dflash2, tree_budget)  # teacher-forced, after the timed decodes
            decoded.append(d)
            prompt = next_turn(i, turn, tokens) if next_turn is not None else None
            turn += 1
        if progress is not None:
            progress(EvalProgress.at("decode", i + 1, len(prompts), t_start, len(decoded),
                               sum(d.tokens.shape[0] - d.prompt_len for d in decoded),
                               [m for d in decoded for m in d.acc_m]))
    cats = categories or ["all"] * len(prompts)
    finished = decoded[-1].index + 1 if decoded else 0   # prompts decoded: all unless the time limit cut
    res = pooled_summary(decoded, drafter, dflash2)
    res.dtype, res.threads = str(target.model.dtype).removeprefix("torch."), torch.get_num_threads()
    res.temperature, res.top_p, res.top_k, res.seed = temperature, top_p, top_k, seed
    res.cuda_graphs = cuda_graphs
    res.prompts_asked, res.time_limit_s, res.stopped_by = len(prompts), time_limit_s, stopped_by
    if tree_budget:
        res.tree_budget = tree_budget
        res.tree_tau_tf = tau_from_accepted(float(torch.cat([d.tree for d in decoded]).float().mean()))
        tree_m = [m for d in decoded for m in d.tree_m]
        if tree_m:
            res.tree_tau = tau_from_accepted(sum(tree_m) / len(tree_m))
            res.tree_seconds = sum(d.tree_seconds for d in decoded)
        sampled_tree = [m for d in decoded for m in d.sampled_tree_m]
        if sampled_tree:
            res.sampled_tree_tau = tau_from_accepted(sum(sampled_tree) / len(sampled_tree))
    res.categories = [category(name, [d for d in decoded if cats[d.index] == name])
                      for name in dict.fromkeys(cats[:finished])]
    buckets = [length_bucket(d.prompt_len) for d in decoded]
    res.by_length = [category(b, [d for d, db in zip(decoded, buckets) if db == b]) for b in LABELS if b in buckets]
    res.speed = speed_of(decoded) if speed else None
    if progress is not None:
        progress(EvalProgress.at("done", finished, len(prompts), t_start, len(decoded),
                           sum(r.new_tokens for r in res.per_prompt), [m for d in decoded for m in d.acc_m]))
    return res


def _score(d: Decoded, target, drafter, head, dflash2: bool, tree_budget: int = 0) -> None:
    """Teacher-forced figures of one decode's text: a block at every anchor after the prompt."""
    tokens, n = d.tokens, d.prompt_len
    region = torch.arange(n, tokens.shape[0], device=tokens.device)     # anchors after prefill
    hidden, labels, valid = _teacher_forced_blocks(target, drafter, head, tokens, region)
    if dflash2:  # scored by the walk it drafts with; the backbone's top-1 and the top-K beside it
        correct, top1, in_k = block_figures(drafter, head, hidden, tokens[region], labels)
        d.extra = (top1, in_k, valid)
    elif is_xpress(drafter):  # scored by its Jacobi drafts, the drafts it decodes with
        before = tokens[(region - 1).clamp(min=0)]
        correct = xpress_block_hits(drafter, head, hidden, before, tokens[region], labels)
    else:
        correct = head.logits(hidden[:, 1:]).argmax(-1) == labels
    if tree_budget:  # the backbone's marginals as a tree (dflash.eval.tree)
        d.tree = tree_accepted(head.logits(hidden[:, 1:]), labels, valid, tree_budget)
    d.correct, d.valid = correct, valid
    d.streaks = streak_lengths(correct, valid)
    d.s_vis = d.streaks[torch.tensor(d.visited, device=tokens.device) - n]
    acc = accuracy_per_position(correct, valid)
    mean_m, sim = sum(d.acc_m) / len(d.acc_m), simulated_accepted_length(acc)
    d.result = PromptResult(
        prompt_len=n, new_tokens=tokens.shape[0] - n, steps=len(d.acc_m),
        tau=tau_from_accepted(mean_m), mean_accepted=mean_m,
        tau_sim=tau_from_accepted(sim), accepted_sim=sim,
        streak_all=float(d.streaks.float().mean()), streak_visited=float(d.s_vis.float().mean()),
        prompt=d.index, turn=d.turn)
