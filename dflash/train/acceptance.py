"""Acceptance maths: per-position accuracy, accepted length, streaks and tau.

Conventions used everywhere in dflash (training logs, ``metrics.jsonl``, ``dflash.eval``):

* the **accepted length** ``m`` of one draft-and-verify step is the number of *drafted* tokens the
  target accepted (0 .. bs-1), the bonus token not counted;
* **tau** is the number of tokens one verify step produces, ``m + 1`` (the accepted drafts plus the
  target's bonus token). This is how z-lab's reference DFlash decoder and SGLang report acceptance
  ("acceptance length"), so a tau printed here compares directly with theirs; plain target decoding
  has tau = 1. Every output that prints tau prints the accepted-only figure beside it, labelled.

* ``acc_j`` = fraction of trained slots ``j`` whose drafter argmax equals the label
  (``j = 1 .. bs-1``).
* Simulated accepted length from marginals: ``tau = sum_{j=1}^{bs-1} prod_{i<=j} acc_i``. Exact if
  errors at different slots were independent.
* Streak (per block, teacher-forced): ``s_b = sum_j prod_{i<=j} correct_{b,i}``, the number of
  leading correct slots. Under greedy verification the measured accepted length at an anchor equals
  its streak against the target's argmax, so the mean streak over the anchors a decode visits is the
  measured figure exactly; over all anchors it is the simulated one without the independence
  assumption.
"""

from __future__ import annotations

import math

import torch

__all__ = ["accuracy_per_position", "per_position_list", "streak_lengths", "simulated_accepted_length",
           "tau_from_accepted"]


def tau_from_accepted(accepted: float) -> float:
    """Tokens per verify step from the accepted length (drafts accepted per step): ``accepted + 1``."""
    return accepted + 1.0


def accuracy_per_position(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[bs-1]`` fp32 accuracy per slot from ``correct, valid [M, bs-1]`` bool (nan where no slot
    is valid)."""
    n = valid.sum(0).float()
    return (correct & valid).sum(0).float() / n


def simulated_accepted_length(acc: torch.Tensor | list[float]) -> float:
    """``sum_j prod_{i<=j} acc_i`` (nan entries count as 0: an untested slot accepts nothing).

    Computed on the host in float64 (a tensor is read once): the drafter calls it every step on
    the values its one host read already brought back, so no tensor is built for it."""
    values = acc.tolist() if isinstance(acc, torch.Tensor) else acc
    total, reach = 0.0, 1.0
    for a in values:
        reach *= 0.0 if math.isnan(a) else float(a)
        total += reach
    return total


def streak_lengths(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[M]`` leading-correct count per block; an invalid slot ends the streak."""
    ok = (correct & valid).long()
    return torch.cumprod(ok, dim=1).sum(1)


def per_position_list(acc: torch.Tensor) -> list[float | None]:
    """Per-position accuracies ``[bs-1]`` as a list, None where no anchor reached the position
    (NaN in :func:`accuracy_per_position`): what a report serialises."""
    return [None if math.isnan(a) else a for a in acc.tolist()]
