"""DFlash training losses: hard cross-entropy, soft KL, and per-position weights.

Notation: a block has prediction slots ``j = 1 .. bs-1`` (slot ``j`` predicts token ``anchor + j``);
``z^D`` are drafter logits, ``z^T`` target logits for the same token (the target's logits at
position ``anchor + j - 1``); ``v_{b,j}`` is 1 where the slot is trained.

* Cross-entropy (hard label ``y``: the data token, or ``argmax z^T``):
  ``CE_{b,j} = -log softmax(z^D)[y]``.
* KL at temperature ``tau`` (knowledge distillation, Hinton et al. 2015, "Distilling the
  Knowledge in a Neural Network", with its ``tau^2`` gradient-scale factor):
  ``KL_{b,j} = tau^2 * sum_v p^T_v (log p^T_v - log p^D_v)``, ``p = softmax(z / tau)``.
* Mixed per slot: ``l_{b,j} = (1 - kl_weight) * CE_{b,j} + kl_weight * KL_{b,j}``.
* Position weights ``w_{b,j}`` (never differentiated):

  - ``"none"``: 1.
  - ``"exp_decay"``: ``exp(-(j - 1) / gamma)`` (DFlash paper: later block positions matter less,
    since a draft is accepted only up to its first error).
  - ``"streak"``: ``alpha + (1 - alpha) * prod_{i<j} q_{b,i}``, with ``q_{b,i}`` the drafter's
    probability of the hard label at slot ``i`` (detached): the probability that slot ``j`` is
    reached at verification, i.e. its share in the expected accepted length
    ``E[tau] = sum_j prod_{i<=j} q_i``. ``alpha`` is a floor keeping later slots trained early on.
    (This project's cumulative-acceptance weighting; no published formula.)

* Total: ``loss = sum w v l / sum w v`` (0 with no trained slot).
"""

from __future__ import annotations

from typing import Literal

import msgspec
import torch
import torch.nn.functional as F

__all__ = ["LossConfig", "mixed_loss", "needs_final_hidden", "position_weights"]


class LossConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The graph file's ``[loss]`` table.

    Attributes:
        label: hard CE label: "data" (dataset token) | "target_argmax".
        kl_weight: weight of the KL term in [0, 1] (CE gets ``1 - kl_weight``).
        temperature: KL temperature (> 0).
        weighting: "exp_decay" | "streak" | "none".
        gamma: exp_decay scale, in block positions.
        alpha: streak floor in [0, 1].
        selector_weight: weight (>= 0) of DFlash2's selector loss, added to the loss above
            (:mod:`dflash.train.selector_loss`); read only when ``drafter.variant = "dflash2"``.
    """

    label: Literal["data", "target_argmax"] = "data"
    kl_weight: float = 0.0
    temperature: float = 1.0
    weighting: Literal["exp_decay", "streak", "none"] = "exp_decay"
    gamma: float = 7.0
    alpha: float = 0.1
    selector_weight: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.kl_weight <= 1.0:
            raise ValueError(f"loss.kl_weight must be in [0, 1], got {self.kl_weight}")
        if self.temperature <= 0:
            raise ValueError(f"loss.temperature must be > 0, got {self.temperature}")
        if self.gamma <= 0:
            raise ValueError(f"loss.gamma must be > 0, got {self.gamma}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"loss.alpha must be in [0, 1], got {self.alpha}")
        if not self.selector_weight >= 0.0:
            raise ValueError(f"loss.selector_weight must be >= 0, got {self.selector_weight}")


def needs_final_hidden(cfg: LossConfig) -> bool:
    """Whether the loss needs target logits (so the target must return its final hidden state)."""
    return cfg.label == "target_argmax" or cfg.kl_weight > 0


def position_weights(cfg: LossConfig, label_prob: torch.Tensor) -> torch.Tensor:
    """``w [M, bs-1]`` (fp32, detached) from ``label_prob [M, bs-1]`` (drafter p of the hard label;
    used by "streak" only, any values elsewhere). Column ``c`` is slot ``j = c + 1``."""
    M, S = label_prob.shape
    j = torch.arange(1, S + 1, device=label_prob.device, dtype=torch.float32)
    if cfg.weighting == "none":
        return torch.ones(M, S, device=label_prob.device)
    if cfg.weighting == "exp_decay":
        return torch.exp(-(j - 1) / cfg.gamma).expand(M, S).clone()
    q = label_prob.detach().float()
    reach = torch.cumprod(torch.cat([torch.ones_like(q[:, :1]), q[:, :-1]], dim=1), dim=1)
    return cfg.alpha + (1.0 - cfg.alpha) * reach


def mixed_loss(cfg: LossConfig, draft_logits: torch.Tensor, labels: torch.Tensor,
               target_logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-slot terms for ``N`` trained slots.

    Args:
        draft_logits: ``[N, V]`` (any float dtype; computed in fp32).
        labels: ``[N]`` int64 hard labels.
        target_logits: ``[N, V]`` or None (required when ``kl_weight > 0``).

    Returns:
        ``(l [N], ce [N], kl [N])`` fp32; ``kl`` is zeros without target logits.

    Raises:
        ValueError: ``kl_weight > 0`` and no target logits.
    """
    logp = F.log_softmax(draft_logits.float(), dim=-1)
    ce = -logp.gather(1, labels[:, None]).squeeze(1)
    if cfg.kl_weight > 0:
        if target_logits is None:
            raise ValueError("loss.kl_weight > 0 needs target logits (final_hidden)")
        t = cfg.temperature
        logp_t = F.log_softmax(target_logits.float() / t, dim=-1)
        logq_t = F.log_softmax(draft_logits.float() / t, dim=-1)
        kl = (t * t) * (logp_t.exp() * (logp_t - logq_t)).sum(-1)
    else:
        kl = torch.zeros_like(ce)
    return (1.0 - cfg.kl_weight) * ce + cfg.kl_weight * kl, ce, kl
