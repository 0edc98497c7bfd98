"""What ``python -m dflash.eval`` reports: the result types and the printed table.

``tau*`` figures are tokens per verify step (accepted + 1, the bonus token counted); the others are
accepted drafts per step (:mod:`dflash.train.acceptance`). No torch import: a saved ``--json`` result
can be read and printed without it.
"""

from __future__ import annotations

import math

import msgspec

__all__ = ["EvalResult", "PromptResult", "SelectorFigures", "explain", "format_prompt", "format_result"]


class PromptResult(msgspec.Struct, kw_only=True):
    """Per-prompt numbers; ``tau*`` are tokens per verify step (accepted + 1), the others are
    accepted drafts per step (bonus token excluded)."""

    prompt_len: int
    new_tokens: int
    steps: int
    tau: float
    mean_accepted: float
    tau_sim: float
    accepted_sim: float
    streak_all: float
    streak_visited: float


class SelectorFigures(msgspec.Struct, kw_only=True):
    """What a DFlash2 drafter's selector adds, teacher-forced over the generated text (every anchor;
    :func:`dflash.eval.selector.block_figures`).

    Attributes:
        top_k: candidates per position (``drafter.selector_top_k``).
        recall: fraction of slots whose label (the target's greedy token) is in the top-K.
        oracle_tau: tokens per verify step of a drafter that picks the label whenever it is in the
            top-K (1 + mean leading run of "label in top-K"): the ceiling of any selector.
        backbone_tau: tokens per verify step of the backbone's top-1 on the same blocks (what a
            DFlash drafter of these weights would draft), to set beside ``streak_all + 1`` of the walk.
        backbone_acc_per_pos: ``[bs-1]`` the backbone top-1's accuracy per position (None where
            no anchor reached the position).
    """

    top_k: int
    recall: float
    oracle_tau: float
    backbone_tau: float
    backbone_acc_per_pos: list[float | None]


class EvalResult(msgspec.Struct, kw_only=True):
    """Aggregate over prompts.

    Attributes:
        tau: measured tokens per verify step (accepted + 1), over all steps of all prompts: the
            figure z-lab's decoder and SGLang report.
        mean_accepted: measured drafted tokens accepted per verify step (``tau - 1``).
        tau_sim: simulated tokens per step, ``1 + accepted_sim``.
        accepted_sim: ``sum_j prod_{i<=j} acc_j`` from teacher-forced accuracies on the generated
            text (assumes independent errors across block positions).
        streak_visited: teacher-forced streak (accepted drafts) at the anchors the decode visited
            (equals ``mean_accepted`` up to kernel numerics).
        streak_all: teacher-forced mean streak over every anchor of the generated text (the
            simulated accepted length without the independence assumption).
        acc_per_pos: ``[bs-1]`` teacher-forced accuracies; None (``null`` in ``--json``) where no
            anchor reached the position (the generated text ended before it).
        n_per_pos: ``[bs-1]`` anchors scored at each position (empty in results saved before it).
        block_size: the drafter's block size (tau is at most ``block_size``).
        per_prompt: one :class:`PromptResult` per prompt.
        dtype: the decode's dtype ("float32" | "bfloat16").
        threads: torch intra-op CPU threads during the decode.
        temperature: 0 = greedy only; else the sampled decode's temperature (``top_p``,
            ``top_k``, ``seed`` are its other settings).
        sampled_tau: measured tokens per verify step of the sampled decode (None when greedy
            only), over all its steps; ``sampled_accepted`` = ``sampled_tau - 1``.
        seconds: wall time of the greedy decodes (and the sampled ones), in seconds.
        selector: a DFlash2 drafter's :class:`SelectorFigures` (its measured and teacher-forced
            figures above are those of the selector's walk, the tokens it drafts); None for DFlash.
    """

    tau: float
    mean_accepted: float
    tau_sim: float
    accepted_sim: float
    streak_visited: float
    streak_all: float
    acc_per_pos: list[float | None]
    block_size: int
    per_prompt: list[PromptResult]
    dtype: str = "float32"
    threads: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    sampled_tau: float | None = None
    sampled_accepted: float | None = None
    seconds: float | None = None
    selector: SelectorFigures | None = None
    n_per_pos: list[int] = msgspec.field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        """Alias of :attr:`tau`."""
        return self.tau


def explain(res: EvalResult) -> list[str]:
    """One line per way the measured and simulated figures differ by more than 0.05 tokens/step,
    saying why (empty when they agree)."""
    out = []
    if abs(res.streak_visited - res.mean_accepted) > 0.05:
        out.append("streak@visited != measured: the decode's cached, block-sized target forwards "
                   "round differently from the teacher-forced full forward (kernel numerics), so "
                   "a few near-tied argmaxes flip")
    if res.streak_visited < res.streak_all - 0.05:
        out.append("streak@visited < streak@all: a decode visits anchors in proportion to how short "
                   "their streak is (an accepted run skips the anchors inside it), so the measured "
                   "figure weighs the hard anchors more than an average over all anchors does")
    elif res.streak_visited > res.streak_all + 0.05:
        out.append("streak@visited > streak@all: the anchors this decode happened to visit were "
                   "easier than the average anchor of the same text (few prompts, short texts)")
    if abs(res.accepted_sim - res.streak_all) > 0.05:
        sign = "above" if res.accepted_sim > res.streak_all else "below"
        out.append(f"tau_sim is {sign} streak@all: tau_sim multiplies per-position accuracies as "
                   "if errors were independent; in a block they are correlated (a wrong slot "
                   "makes the next one likelier wrong)" if sign == "above" else
                   f"tau_sim is {sign} streak@all: correct slots cluster in the same blocks, "
                   "which the product of marginals undercounts")
    return out


def format_result(res: EvalResult) -> str:
    """The side-by-side table ``dflash.eval`` prints (tau = tokens per verify step = accepted + 1)."""
    rows = [("measured: draft-and-verify decode", res.tau, res.mean_accepted),
            ("teacher-forced streak @ visited anchors", res.streak_visited + 1, res.streak_visited),
            ("teacher-forced streak @ all anchors", res.streak_all + 1, res.streak_all),
            ("simulated tau_sim (per-position accuracy)", res.tau_sim, res.accepted_sim)]
    if res.sampled_tau is not None:
        knobs = f"T={res.temperature:g}" + (f", top-p {res.top_p:g}" if res.top_p < 1 else "") + (
            f", top-k {res.top_k}" if res.top_k else "")
        rows.insert(1, (f"measured: sampled ({knobs})", res.sampled_tau, res.sampled_accepted))
    lines = [f"{'':44s}{'tau (tokens/step)':>18s}{'accepted/step':>15s}"]
    lines += [f"{name:44s}{t:>18.3f}{a:>15.3f}" for name, t, a in rows]
    lines.append(f"block size {res.block_size} (tau <= {res.block_size}); plain target decoding "
                 "has tau = 1")
    secs = f", decode {res.seconds:.1f} s" if res.seconds is not None else ""
    lines.append(f"dtype {res.dtype}, {res.threads} CPU thread(s){secs}")
    sel = res.selector
    if sel is not None:  # DFlash2: the rows above are the selector walk's
        lines[5:5] = [f"{name:44s}{t:>18.3f}{t - 1:>15.3f}" for name, t in (
            ("backbone top-1 streak @ all anchors", sel.backbone_tau),
            (f"oracle top-{sel.top_k} (label in top-{sel.top_k}) @ all", sel.oracle_tau))]
        lines.append(f"DFlash2: drafts are the selector's walk over the top-{sel.top_k}; recall@{sel.top_k} "
                     f"{sel.recall:.3f} (label in the top-{sel.top_k}); walk vs backbone top-1 "
                     f"{res.streak_all + 1:.3f} vs {sel.backbone_tau:.3f} tokens/step")
    lines.append("acc per position: " + _per_position(res.acc_per_pos, res.n_per_pos))
    if sel is not None:
        lines.append("backbone top-1 acc per position: " + _per_position(sel.backbone_acc_per_pos, res.n_per_pos))
    lines += [f"why they differ: {why}" for why in explain(res)]
    return "\n".join(lines)


def _per_position(acc: list[float | None], n: list[int]) -> str:
    """``0.95 0.80 0.61``: two decimals per position; when some position was never reached, ``-``
    there (None, or NaN in an older result) and the anchors scored per position, when known."""
    unscored = [a is None or math.isnan(a) for a in acc]
    text = " ".join("-" if u else f"{a:.2f}" for a, u in zip(acc, unscored))
    if not any(unscored):
        return text
    counts = f"anchors scored per position: {' '.join(map(str, n))}; " if len(n) == len(acc) else ""
    return f"{text} ({counts}-: no anchor reached that position)"


def format_prompt(i: int, r: PromptResult) -> str:
    """The per-prompt line ``dflash.eval`` prints before the table."""
    return (f"prompt {i}: len {r.prompt_len} new {r.new_tokens} steps {r.steps} "
            f"tau {r.tau:.3f} (accepted {r.mean_accepted:.3f}) streak@visited {r.streak_visited:.3f} "
            f"streak@all {r.streak_all:.3f} tau_sim {r.tau_sim:.3f}")
