"""The figures of many decodes pooled: over all of them, per category or context-length bucket,
and the measured speed. :func:`dflash.eval.measure.evaluate` fills one :class:`Decoded` per prompt
turn (decoded, then scored teacher-forced) and reports what these functions pool; each pools over
verify steps, not over prompts, so a long decode weighs by its steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash.eval.report import CategoryResult, EvalResult, PromptResult, SpeedResult
from dflash.eval.selector import selector_figures
from dflash.eval.xpress import is_xpress
from dflash.repetition import loop_start
from dflash.train.acceptance import (
    accuracy_per_position,
    per_position_list,
    simulated_accepted_length,
    tau_from_accepted,
)

__all__ = ["Decoded", "LoopTally", "category", "loop_figures", "pooled_summary", "speed_of"]


@dataclass
class Decoded:
    """One decode (a prompt's turn) and, once scored, its teacher-forced figures."""

    index: int                         # the prompt (its category is the prompt's)
    turn: int                          # 0: the first user turn
    prompt_len: int
    tokens: torch.Tensor               # [prompt_len + max_new_tokens] the greedy decode's output
    acc_m: list[int]                   # accepted drafts of each verify step
    visited: list[int]                 # the anchors the decode verified at
    greedy_seconds: float              # the draft-and-verify greedy decode, synchronised
    sampled_m: list[int] = field(default_factory=list)
    sampled_seconds: float = 0.0
    sampled_new_tokens: int = 0        # the sampled decode's output length (it may differ from the greedy one's)
    target_seconds: float | None = None  # the target alone, greedy (speed=True)
    result: PromptResult | None = None
    correct: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    streaks: torch.Tensor | None = None
    s_vis: torch.Tensor | None = None
    extra: tuple | None = None
    tree: torch.Tensor | None = None    # [anchors] accepted under a tree (tree_budget > 0)
    tree_m: list[int] = field(default_factory=list)  # accepted per step of the tree decode
    sampled_tree_m: list[int] = field(default_factory=list)  # the same, sampled
    tree_seconds: float = 0.0


def pooled_summary(decoded: list[Decoded], drafter, dflash2: bool) -> EvalResult:
    """The aggregate over every decode: measured figures pooled over all verify steps."""
    acc = accuracy_per_position(torch.cat([d.correct for d in decoded]), torch.cat([d.valid for d in decoded]))
    all_m = [m for d in decoded for m in d.acc_m]
    all_vis = [s for d in decoded for s in d.s_vis.tolist()]
    mean_m = sum(all_m) / max(len(all_m), 1)
    sim = simulated_accepted_length(acc)
    sampled = [m for d in decoded for m in d.sampled_m]
    sampled_m = sum(sampled) / len(sampled) if sampled else None
    return EvalResult(
        seconds=sum(d.greedy_seconds + d.sampled_seconds for d in decoded),
        sampled_tau=None if sampled_m is None else tau_from_accepted(sampled_m),
        sampled_accepted=sampled_m, tau=tau_from_accepted(mean_m), mean_accepted=mean_m,
        tau_sim=tau_from_accepted(sim), accepted_sim=sim,
        streak_visited=sum(all_vis) / max(len(all_vis), 1),
        streak_all=float(torch.cat([d.streaks for d in decoded]).float().mean()),
        acc_per_pos=per_position_list(acc), n_per_pos=torch.cat([d.valid for d in decoded]).sum(0).tolist(),
        block_size=drafter.cfg.block_size, trained_block_size=drafter.trained_block_size,
        per_prompt=[d.result for d in decoded],
        selector=selector_figures(drafter, [d.extra for d in decoded],
                                   torch.cat([d.correct for d in decoded])) if dflash2 else None,
        jacobi_passes=drafter.cfg.jacobi_passes if is_xpress(drafter) else None,
        **loop_figures(decoded))


@dataclass
class LoopTally:
    """Verify steps and generated tokens counted inside and outside repetition loops, decode by
    decode (:func:`loop_figures` pools :class:`Decoded`; the in-training evaluator, which keeps no
    ``Decoded``, adds each decode as it ends)."""

    looped: int = 0                    # generated tokens at or past their answer's loop start
    total: int = 0                     # generated tokens
    inside: list[int] = field(default_factory=list)   # accepted drafts of the steps in a loop
    outside: list[int] = field(default_factory=list)  # ... and of the others

    def add(self, tokens: torch.Tensor, prompt_len: int, visited: list[int], acc_m: list[int]) -> None:
        """One greedy decode: ``tokens`` ``[prompt_len + generated]`` its output, ``visited`` the
        anchors it verified at (absolute positions), ``acc_m`` each step's accepted drafts."""
        answer = tokens[prompt_len:].cpu().numpy()
        start = loop_start(answer)
        start = len(answer) if start is None else start
        self.looped += len(answer) - start
        self.total += len(answer)
        for anchor, m in zip(visited, acc_m):
            (self.inside if anchor - prompt_len >= start else self.outside).append(m)

    def figures(self) -> dict[str, float | None]:
        """``loop_share`` (of the generated tokens), ``loop_tau`` and ``fresh_tau`` (tokens per
        verify step inside and outside loops); None where nothing falls in that class."""

        def tau(ms: list[int]) -> float | None:
            return tau_from_accepted(sum(ms) / len(ms)) if ms else None

        return {"loop_share": self.looped / self.total if self.total else None,
                "loop_tau": tau(self.inside), "fresh_tau": tau(self.outside)}


def loop_figures(decoded: list[Decoded]) -> dict[str, float | None]:
    """How much of the greedy text is a repetition loop (:mod:`dflash.repetition`), and the
    measured tau apart inside and outside loops: a verify step counts as in a loop when its anchor
    lies at or past its answer's loop start. A weak target's loops are easy to draft, so a tau
    pooled over them says more about the target than the drafter; ``fresh_tau`` is the drafter on
    text that does not repeat itself. The :class:`EvalResult` fields ``loop_share``, ``loop_tau``
    and ``fresh_tau`` (None where no step falls in that class)."""
    tally = LoopTally()
    for d in decoded:
        tally.add(d.tokens, d.prompt_len, d.visited, d.acc_m)
    return tally.figures()


def category(name: str, decoded: list[Decoded]) -> CategoryResult:
    """Measured figures of one category's decodes (every turn), pooled over their verify steps."""
    ms = [m for d in decoded for m in d.acc_m]
    sampled = [m for d in decoded for m in d.sampled_m]
    mean_m = sum(ms) / max(len(ms), 1)
    speed = speed_of(decoded) if decoded and decoded[0].target_seconds is not None else None
    return CategoryResult(
        category=name, prompts=len({d.index for d in decoded}), decodes=len(decoded),
        new_tokens=sum(d.result.new_tokens for d in decoded), steps=len(ms),
        tau=tau_from_accepted(mean_m), mean_accepted=mean_m,
        sampled_tau=tau_from_accepted(sum(sampled) / len(sampled)) if sampled else None,
        speedup=None if speed is None else speed.speedup,
        sampled_speedup=None if speed is None else speed.sampled_speedup)


def speed_of(decoded: list[Decoded]) -> SpeedResult:
    """Wall-clock tokens/s of draft-and-verify and of the target alone over the same decodes, and of
    the sampled draft-and-verify decodes where they ran (their speedup against the target alone's
    greedy rate: see :class:`SpeedResult`)."""
    tokens = sum(d.result.new_tokens for d in decoded)
    spec = sum(d.greedy_seconds for d in decoded)
    alone = sum(d.target_seconds for d in decoded)
    res = SpeedResult(new_tokens=tokens, dflash_seconds=spec, target_seconds=alone,
                      dflash_tok_s=tokens / spec, target_tok_s=tokens / alone, speedup=alone / spec)
    s_tokens = sum(d.sampled_new_tokens for d in decoded)
    s_seconds = sum(d.sampled_seconds for d in decoded)
    if s_tokens and s_seconds > 0:
        res.sampled_new_tokens, res.sampled_seconds = s_tokens, s_seconds
        res.sampled_tok_s = s_tokens / s_seconds
        res.sampled_speedup = res.sampled_tok_s / res.target_tok_s
    return res
