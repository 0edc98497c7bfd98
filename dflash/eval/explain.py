"""Why an evaluation's measured and simulated figures differ: one sentence per gap over 0.05
tokens per verify step, printed under ``dflash.eval``'s table (:func:`dflash.eval.report.format_result`)."""

from __future__ import annotations

__all__ = ["explain"]


def explain(res) -> list[str]:
    """One line per way the measured and simulated figures of ``res`` (a
    :class:`dflash.eval.report.EvalResult`) differ by more than 0.05 tokens/step, saying why (empty
    when they agree)."""
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
