"""The grouped tables ``dflash.eval`` prints under its result: tau per category (SPEED-Bench's
layout) and per context-length bucket, and the measured (and projected) speedup lines. Like
:mod:`dflash.eval.report`, no torch import: a saved ``--json`` result prints without it.
"""

from __future__ import annotations

from dflash.eval.report import CategoryResult, EvalResult

__all__ = ["format_by_length", "format_categories", "format_speed"]


def format_categories(res: EvalResult) -> str:
    """The per-category table (SPEED-Bench's layout): prompts, decoded turns, tokens, verify steps,
    tau, accepted length, the sampled tau and the measured speedups (greedy, sampled) where present,
    then the pooled row over every category and the mean over categories."""
    lines = _table(res, "category", f"{res.prompt_set or 'prompts'}: tau = tokens per verify step (accepted + 1)",
                   res.categories, sum(c.prompts for c in res.categories))
    if len(res.categories) > 1:
        lines.append(f"{'mean of categories':<46s}{res.macro_tau:>8.3f}{res.macro_tau - 1:>10.3f}")
    return "\n".join(lines)


def format_by_length(res: EvalResult) -> str:
    """The same table per context-length bucket (:mod:`dflash.eval.lengths`): whether tau holds as
    the prompts grow. ``turns`` counts the decodes whose prompt fell in the bucket."""
    return "\n".join(_table(res, "context", "tau by prompt length in tokens (a later turn's prompt holds "
                                            "the earlier turns)", res.by_length, len({p.prompt for p in res.per_prompt})))


def _table(res: EvalResult, name: str, title: str, groups: list[CategoryResult], prompts: int) -> list[str]:
    """Rows of ``groups`` under ``title`` and a header, then the pooled row (over ``prompts``
    prompts) when there are several."""
    sampled = res.sampled_tau is not None
    speed = res.speed is not None
    head = f"{name:<14s}{'prompts':>8s}{'turns':>7s}{'tokens':>9s}{'steps':>8s}{'tau':>8s}{'accepted':>10s}"
    head += f"{'sampled tau':>13s}" if sampled else ""
    head += f"{'speedup':>9s}" if speed else ""
    head += f"{'sampled':>9s}" if speed and sampled else ""
    lines = [title, head]

    def row(c: CategoryResult) -> str:
        text = (f"{c.category[:13]:<14s}{c.prompts:>8d}{c.decodes:>7d}{c.new_tokens:>9d}{c.steps:>8d}"
                f"{c.tau:>8.3f}{c.mean_accepted:>10.3f}")
        if sampled:
            text += f"{c.sampled_tau:>13.3f}" if c.sampled_tau is not None else f"{'-':>13s}"
        if speed:
            text += f"{c.speedup:>8.2f}x" if c.speedup is not None else f"{'-':>9s}"
        if speed and sampled:
            text += f"{c.sampled_speedup:>8.2f}x" if c.sampled_speedup is not None else f"{'-':>9s}"
        return text

    lines += [row(c) for c in groups]
    if len(groups) > 1:
        lines.append(row(CategoryResult(
            category="all (pooled)", prompts=prompts,
            decodes=sum(c.decodes for c in groups), new_tokens=sum(c.new_tokens for c in groups),
            steps=sum(c.steps for c in groups), tau=res.tau, mean_accepted=res.mean_accepted,
            sampled_tau=res.sampled_tau, speedup=None if res.speed is None else res.speed.speedup,
            sampled_speedup=None if res.speed is None else res.speed.sampled_speedup)))
    return lines


def format_speed(res: EvalResult) -> str:
    """The measured speedup line and, when present, the projection line (labelled as one)."""
    lines = []
    s = res.speed
    if s is not None:
        lines.append(f"measured speedup {s.speedup:.2f}x: draft-and-verify {s.dflash_tok_s:.1f} tok/s vs the "
                     f"target alone {s.target_tok_s:.1f} tok/s (greedy, batch 1, {s.new_tokens} tokens each, "
                     f"{res.dtype}{', CUDA graphs' if res.cuda_graphs else ''}, warmed up, synchronised)")
        if s.sampled_speedup is not None:
            lines.append(f"sampled (T = {res.temperature:g}) draft-and-verify {s.sampled_tok_s:.1f} tok/s over "
                         f"{s.sampled_new_tokens} tokens: {s.sampled_speedup:.2f}x the target alone's greedy rate "
                         f"(one target forward a token either way)")
        if res.tree_seconds:
            lines.append(f"tree-verified decode ({res.tree_budget} nodes): {s.new_tokens / res.tree_seconds:.1f} tok/s, "
                         f"{s.target_seconds / res.tree_seconds:.2f}x the target alone (dynamic KV cache)")
    p = res.projection
    if p is not None:
        lines.append(f"projected speedup {p.speedup:.2f}x on an 8B-class target at this tau (a projection, "
                     f"not a measurement: tau / c, c = {p.cost_ratio:.3f} measured for {p.basis})")
    return "\n".join(lines)
