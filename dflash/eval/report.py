"""What ``python -m dflash.eval`` reports: the result types and the printed table.

``tau*`` figures are tokens per verify step (accepted + 1, the bonus token counted); the others are
accepted drafts per step (:mod:`dflash.train.acceptance`). No torch import: a saved ``--json`` result
can be read and printed without it.
"""

from __future__ import annotations

import math

import msgspec

from dflash.eval.explain import explain

from dflash.records import over_text

__all__ = ["CategoryResult", "EvalResult", "Projection", "PromptResult", "SelectorFigures", "SpeedResult", "explain",
           "format_headline", "format_prompt", "format_result"]


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
    prompt: int = 0
    turn: int = 0


class CategoryResult(msgspec.Struct, kw_only=True):
    """Measured figures of one category's decodes (every turn of its prompts), pooled over their
    verify steps, as SPEED-Bench and the DFlash paper tabulate them.

    Attributes:
        category: its name (MT-Bench's 8, a MATH subject, the set's name, or ``"all"``).
        prompts: prompts of the category; ``decodes``: their decoded turns (MT-Bench: 2 per prompt).
        new_tokens: tokens generated over those decodes; ``steps``: their verify steps.
        tau: tokens per verify step (accepted + 1); ``mean_accepted``: ``tau - 1``.
        sampled_tau: the sampled decode's tau (None when greedy only).
        speedup: wall-clock target-alone time over draft-and-verify time, greedy, same prompts and
            device (None when not measured).
        sampled_speedup: the sampled draft-and-verify rate over the target alone's greedy rate
            (:class:`SpeedResult`; None when either was not measured).
    """

    category: str
    prompts: int
    decodes: int
    new_tokens: int
    steps: int
    tau: float
    mean_accepted: float
    sampled_tau: float | None = None
    speedup: float | None = None
    sampled_speedup: float | None = None


class SpeedResult(msgspec.Struct, kw_only=True):
    """Wall-clock decode speed, batch 1, greedy (and sampled where a temperature was given), measured
    on the same prompts and device after one untimed warm-up decode of each greedy kind (no sampled
    warm-up: the first sampled decode runs on the warmed target and drafter steps), every timed
    region synchronised (CUDA).

    Attributes:
        new_tokens: tokens each decoder generated (the same count; greedy draft-and-verify output
            equals the target's own greedy output).
        dflash_seconds, target_seconds: wall time of draft-and-verify and of the target alone.
        dflash_tok_s, target_tok_s: ``new_tokens`` per second of each.
        speedup: ``target_seconds / dflash_seconds``.
        sampled_new_tokens, sampled_seconds, sampled_tok_s: the sampled (``temperature > 0``)
            draft-and-verify decodes of the same prompts, their own output lengths (None when greedy
            only).
        sampled_speedup: ``sampled_tok_s / target_tok_s``. The baseline is the target alone's greedy
            rate: sampling alone costs the target the same forward per token as greedy (plus a
            softmax and one draw), and a greedy baseline makes every sampled output length count.
    """

    new_tokens: int
    dflash_seconds: float
    target_seconds: float
    dflash_tok_s: float
    target_tok_s: float
    speedup: float
    sampled_new_tokens: int | None = None
    sampled_seconds: float | None = None
    sampled_tok_s: float | None = None
    sampled_speedup: float | None = None


class Projection(msgspec.Struct, kw_only=True):
    """A projected speedup on a larger target: ``tau / cost_ratio`` (not a measurement).

    Attributes:
        speedup: the projected decode speedup at the measured tau.
        cost_ratio: ``(t_verify(bs) + t_draft) / t_greedy`` measured at the projected shape.
        basis: where ``cost_ratio`` was measured (shape, drafter, device, the benchmark command).
    """

    speedup: float
    cost_ratio: float
    basis: str


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
        reached_in_k_per_pos: ``[bs-1]`` where the walk lost its tokens, part 1: among blocks whose
            walk was right up to position ``j - 1`` (so verification reaches ``j`` and the walk's
            predecessor there is the true token), the fraction whose label at ``j`` is in the
            top-K. 1 minus it is what no selector can recover.
        reached_pick_per_pos: ``[bs-1]`` part 2: among those blocks with the label in the top-K,
            the fraction where the walk picks it (the pair scores' share of the loss). The walk's
            acceptance at ``j`` given it reached ``j`` is the product of the two. Empty in results
            saved before they were recorded.
    """

    top_k: int
    recall: float
    oracle_tau: float
    backbone_tau: float
    backbone_acc_per_pos: list[float | None]
    reached_in_k_per_pos: list[float | None] = msgspec.field(default_factory=list)
    reached_pick_per_pos: list[float | None] = msgspec.field(default_factory=list)


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
        block_size: the block size decoded at (tau is at most ``block_size``).
        trained_block_size: the block size the drafter was trained at (``--block-size`` serves it
            at a smaller one); None in results saved before it was recorded.
        per_prompt: one :class:`PromptResult` per prompt.
        dtype: the decode's dtype ("float32" | "bfloat16").
        threads: torch intra-op CPU threads during the decode.
        cuda_graphs: the target's steps ran at a fixed shape, CUDA-graph replays on a GPU
            (``--cuda-graphs``, :mod:`dflash.eval.static_target`); False in results saved before it.
        temperature: 0 = greedy only; else the sampled decode's temperature (``top_p``,
            ``top_k``, ``seed`` are its other settings).
        sampled_tau: measured tokens per verify step of the sampled decode (None when greedy
            only), over all its steps; ``sampled_accepted`` = ``sampled_tau - 1``.
        seconds: wall time of the greedy decodes (and the sampled ones), in seconds.
        selector: a DFlash2 drafter's :class:`SelectorFigures` (its measured and teacher-forced
            figures above are those of the selector's walk, the tokens it drafts); None for DFlash.
        jacobi_passes: an XPress drafter's Jacobi passes at most (its figures above are those of
            the passes' drafts); None for the other variants.
        tree_budget: ``--tree-budget B``: draft tokens per tree (None when not asked for).
        tree_tau: measured tokens per verify step of the greedy tree-verified decode of every
            prompt (:mod:`dflash.eval.tree_decode`; trees of ``B`` draft tokens from the backbone's
            per-position marginals; for DFlash2 its backbone's, not the selector's walk), over all
            its steps; None for XPress (no tree proposer for its passes) or when not asked for.
            ``tree_seconds``: its wall time. ``sampled_tree_tau``: the same tree decode sampled at
            ``temperature`` (lossless; :mod:`dflash.eval.tree_decode`), None when greedy only.
        tree_tau_tf: the same tree, teacher-forced at every anchor of the chain decode's text
            (:mod:`dflash.eval.tree`; for every variant, from its backbone).
        prompt_set: the evaluation set (``mtbench``, ``humaneval``, a file's stem, ``--data``'s source).
        heldout: the prompts were the run's held-out conversations (``--data`` = the run's source).
        max_new_tokens: tokens each decode generated (``--max-new-tokens``); None in results saved
            before it was recorded.
        categories: one :class:`CategoryResult` per category, in first-seen order.
        by_length: the same figures per context-length bucket of the decodes' prompts
            (:mod:`dflash.eval.lengths`), shortest first, the empty buckets left out.
        macro_tau: the mean of the categories' tau (each category weighs the same, as SPEED-Bench
            averages); ``tau`` above pools every verify step instead.
        speed: the measured :class:`SpeedResult` (None when not measured).
        prompts_asked: prompts the evaluation was given; more than the prompts in ``per_prompt``
            when it stopped early (``stopped_by``). None in results saved before it.
        time_limit_s: the time limit it ran under, in seconds (None: none).
        stopped_by: why it ended before every prompt was decoded: ``"time_limit"``
            (``--time-limit``: the next prompt would have ended after it), ``"signal"`` (SIGTERM,
            e.g. from ``timeout``); None: every prompt ran (or a result saved before this field).
        projection: the projected speedup on an 8B-class target (:mod:`dflash.eval.projection`).
        loop_share: the share of the greedy decodes' generated tokens from each answer's repetition
            loop start on (:mod:`dflash.repetition`); None in results saved before it.
        loop_tau, fresh_tau: measured tau of the verify steps whose anchor lies inside a loop, and
            of the others (:func:`dflash.eval.pooled.loop_figures`); None where no step does.
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
    trained_block_size: int | None = None
    dtype: str = "float32"
    threads: int = 1
    cuda_graphs: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    sampled_tau: float | None = None
    sampled_accepted: float | None = None
    seconds: float | None = None
    selector: SelectorFigures | None = None
    jacobi_passes: int | None = None
    tree_budget: int | None = None
    tree_tau: float | None = None
    sampled_tree_tau: float | None = None
    tree_seconds: float | None = None
    tree_tau_tf: float | None = None
    n_per_pos: list[int] = msgspec.field(default_factory=list)
    prompt_set: str = ""
    heldout: bool = False
    max_new_tokens: int | None = None
    categories: list[CategoryResult] = msgspec.field(default_factory=list)
    by_length: list[CategoryResult] = msgspec.field(default_factory=list)
    speed: SpeedResult | None = None
    prompts_asked: int | None = None
    time_limit_s: float | None = None
    stopped_by: str | None = None
    projection: Projection | None = None
    loop_share: float | None = None
    loop_tau: float | None = None
    fresh_tau: float | None = None

    @property
    def stopped_early(self) -> bool:
        """The evaluation stopped before every prompt was decoded (the time limit or a signal:
        ``stopped_by`` says which)."""
        return self.prompts_asked is not None and len({r.prompt for r in self.per_prompt}) < self.prompts_asked

    @property
    def macro_tau(self) -> float | None:
        """Mean of the categories' tau (None without categories)."""
        return sum(c.tau for c in self.categories) / len(self.categories) if self.categories else None

    @property
    def tokens_per_step(self) -> float:
        """Alias of :attr:`tau`."""
        return self.tau


def format_headline(res: EvalResult) -> str:
    """The result's first line: ``held-out tau 2.310 tokens/verify step (8 prompts x 64 tokens)``,
    the words the run's log and summary use for its in-training held-out tau (``held-out`` for the
    run's held-out conversations, else the set's name)."""
    name = "held-out" if res.heldout else (res.prompt_set or "measured")
    prompts = len({r.prompt for r in res.per_prompt})
    why = ("by SIGTERM" if res.stopped_by == "signal"
           else f"at --time-limit {res.time_limit_s:g} s" if res.time_limit_s is not None else "early")
    cut = f"; {prompts} of {res.prompts_asked} prompts: stopped {why}" if res.stopped_early else ""
    return (f"{name} tau {res.tau:.3f} tokens/verify step "
            f"({over_text(prompts, res.max_new_tokens, len(res.per_prompt))}{cut})")


def _loops_line(res: EvalResult) -> str:
    """``repetition loops: 23% of the generated tokens; measured tau 5.1 in them, 2.0 elsewhere``:
    how much of the target's greedy text repeats itself, and the drafter's tau apart there."""
    def fig(t: float | None) -> str:
        return "-" if t is None else f"{t:.3f}"
    return (f"repetition loops (16-token windows repeated within an answer): {res.loop_share:.0%} of the "
            f"generated tokens; measured tau {fig(res.loop_tau)} in them, {fig(res.fresh_tau)} elsewhere")


def format_result(res: EvalResult) -> str:
    """The side-by-side table ``dflash.eval`` prints (tau = tokens per verify step = accepted + 1)."""
    rows = [("measured: draft-and-verify decode", res.tau, res.mean_accepted),
            ("teacher-forced streak @ visited anchors", res.streak_visited + 1, res.streak_visited),
            ("teacher-forced streak @ all anchors", res.streak_all + 1, res.streak_all),
            ("simulated tau_sim (per-position accuracy)", res.tau_sim, res.accepted_sim)]
    if res.tree_tau is not None:
        name = (f"measured: tree decode ({res.tree_budget} nodes, backbone)" if res.selector is not None
                else f"measured: tree-verified decode ({res.tree_budget} nodes)")
        rows.insert(1, (name, res.tree_tau, res.tree_tau - 1))
    if res.tree_tau_tf is not None:
        rows.append((f"teacher-forced tree of {res.tree_budget} @ all anchors", res.tree_tau_tf, res.tree_tau_tf - 1))
    if res.sampled_tau is not None:
        knobs = f"T={res.temperature:g}" + (f", top-p {res.top_p:g}" if res.top_p < 1 else "") + (
            f", top-k {res.top_k}" if res.top_k else "")
        rows.insert(1, (f"measured: sampled ({knobs})", res.sampled_tau, res.sampled_accepted))
    if res.sampled_tree_tau is not None:  # after the sampled chain (and the greedy tree)
        rows.insert(3, (f"measured: sampled tree ({res.tree_budget} nodes, T={res.temperature:g})",
                        res.sampled_tree_tau, res.sampled_tree_tau - 1))
    lines = [f"{'':44s}{'tau (tokens/step)':>18s}{'accepted/step':>15s}"]
    lines += [f"{name:44s}{t:>18.3f}{a:>15.3f}" for name, t, a in rows]
    trained = (f", trained at {res.trained_block_size}" if res.trained_block_size not in (None, res.block_size)
               else "")
    lines.append(f"block size {res.block_size} (tau <= {res.block_size}{trained}); plain target decoding "
                 "has tau = 1")
    secs = f", decode {res.seconds:.1f} s" if res.seconds is not None else ""
    graphs = ", target steps as CUDA graphs" if res.cuda_graphs else ""
    lines.append(f"dtype {res.dtype}, {res.threads} CPU thread(s){graphs}{secs}")
    if res.loop_share:
        lines.append(_loops_line(res))
    if res.jacobi_passes is not None:
        lines.append(f"XPress: drafts are the last of up to {res.jacobi_passes} Jacobi passes of its refiner")
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
        if sel.reached_in_k_per_pos:
            lines.append(f"walk reached j, label in top-{sel.top_k}: " + _per_position(sel.reached_in_k_per_pos, []))
            lines.append(f"walk reached j, label in top-{sel.top_k}, picked: "
                         + _per_position(sel.reached_pick_per_pos, []))
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
    """The per-prompt line ``dflash.eval`` prints before the table (``i``: the prompt's index; a
    later turn of the same prompt is labelled ``prompt i turn t``)."""
    label = f"{i} turn {r.turn + 1}" if r.turn else str(i)
    return (f"prompt {label}: len {r.prompt_len} new {r.new_tokens} steps {r.steps} "
            f"tau {r.tau:.3f} (accepted {r.mean_accepted:.3f}) streak@visited {r.streak_visited:.3f} "
            f"streak@all {r.streak_all:.3f} tau_sim {r.tau_sim:.3f}")
