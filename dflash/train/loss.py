"""DFlash training losses: hard cross-entropy, soft KL and TV, a confidence term, position weights.

Notation: a block has prediction slots ``j = 1 .. bs-1`` (slot ``j`` predicts token ``anchor + j``);
``z^D`` are drafter logits, ``z^T`` target logits for the same token (the target's logits at
position ``anchor + j - 1``); ``v_{b,j}`` is 1 where the slot is trained.

* Cross-entropy (hard label ``y``: the data token, or ``argmax z^T``):
  ``CE_{b,j} = -log softmax(z^D)[y]``.
* KL at temperature ``tau`` (knowledge distillation, Hinton et al. 2015, "Distilling the
  Knowledge in a Neural Network", with its ``tau^2`` gradient-scale factor):
  ``KL_{b,j} = tau^2 * sum_v p^T_v (log p^T_v - log p^D_v)``, ``p = softmax(z / tau)``.
* Total variation at the same temperature: ``TV_{b,j} = 0.5 * sum_v |p^T_v - p^D_v|``,
  ``p = softmax(z / tau)``, no ``tau^2`` factor (TV is bounded in [0, 1]). ``1 - TV`` is the
  probability that speculative sampling accepts a token drawn from ``p^D`` (Leviathan et al.
  2023), so TV is the loss that sampled acceptance optimises directly. Source: DSpark (Cheng et
  al., Peking University and DeepSeek-AI, "DSpark: Confidence-Scheduled Speculative Decoding with
  Semi-Autoregressive Generation", eq. 10; deepseek-ai/DeepSpec ``deepspec/modeling/dspark/loss.py``),
  whose ``L_tv`` is the L1 distance ``||p^D - p^T||_1 = 2 TV`` at temperature 1, weighted like CE
  and normalised by the same ``sum w``. Its recipe ``0.1 L_ce + 0.9 L_tv + 1.0 L_conf`` is
  therefore ``0.1 CE + 1.8 TV + 1.0 conf`` per slot; here CE gets ``1 - kl_weight - tv_weight``,
  so the same loss divided by 1.9 is ``tv_weight = 0.947, conf_weight = 0.526`` (Adam does not see
  a constant loss scale; ``[train].grad_clip`` does). ``tv_weight = 0.9, conf_weight = 1.0`` is
  half DSpark's TV weight.
* Confidence (``conf``), two forms (``[loss].confidence``):

  - ``"head"``, DSpark's (paper section 3.2.1 and eqs. 8 and 11; DeepSpec ``loss.py``): a separate
    confidence head (:mod:`dflash.model.confidence_head`) gives the logit ``s_{b,j}`` of
    ``c_{b,j} = sigmoid(s_{b,j})`` from the drafter's hidden state, trained by binary
    cross-entropy against the soft acceptance label ``c*_{b,j} = clamp(1 - TV_{b,j}, 0, 1)``:
    ``conf_{b,j} = -(c* log c + (1 - c*) log(1 - c))``. ``c*`` is not differentiated
    (DeepSpec: ``accept_rate.detach()``); the hidden state is (DeepSpec trains the head "end-to-end
    alongside the draft model": its gradient reaches the backbone). ``c*`` uses ``tau`` as TV does
    (DSpark: 1, the default). Needs the target's logits. Computed by
    :func:`head_confidence_term` and added by :mod:`dflash.train.objective` (the head is not in
    :func:`mixed_loss`'s inputs).
  - ``"top1"``, a stand-in with no head and no published formula (this project's): binary
    cross-entropy making the drafter's top-1 probability ``c = max_v softmax(z^D)_v``
    (temperature 1, the greedy draft's) match whether its argmax equals the hard label ``y``:
    ``conf_{b,j} = -(a log c + (1 - a) log(1 - c))``, ``a = 1[argmax z^D = y]`` (not
    differentiated). On a right slot it is ``CE``; on a wrong one it lowers the overconfident
    top-1. Measured on the H200 at 0.1 CE + 0.9 TV + 1.0 conf it lost 30% tau against plain CE
    (benchmarks/results/LOG.md).
* Mixed per slot: ``l_{b,j} = (1 - kl_weight - tv_weight) * CE_{b,j} + kl_weight * KL_{b,j}
  + tv_weight * TV_{b,j} + conf_weight * conf_{b,j}`` (terms with weight 0 are not computed, so
  the defaults give exactly the plain CE/KL loss).
* Precision: every term is computed in fp32 from fp32 casts of the logits (the head's logit
  too). In bf16 the KL and TV gradients are 19-31% off (catastrophic cancellation of nearly equal
  probabilities; found by speculators' trainer), tested against a float64 reference in
  tests/dflash/train/test_loss_terms.py.
* Position weights ``w_{b,j}`` (never differentiated):

  - ``"none"``: 1.
  - ``"exp_decay"``: ``exp(-(j - 1) / gamma)`` (DFlash paper: later block positions matter less,
    since a draft is accepted only up to its first error). DSpark weighs all three of its terms
    so, with ``gamma = 4`` in DeepSpec's configs.
  - ``"streak"``: ``alpha + (1 - alpha) * prod_{i<j} q_{b,i}``, with ``q_{b,i}`` the drafter's
    probability of the hard label at slot ``i`` (detached): the probability that slot ``j`` is
    reached at verification, i.e. its share in the expected accepted length
    ``E[tau] = sum_j prod_{i<=j} q_i``. ``alpha`` is a floor keeping later slots trained early on.
    (This project's cumulative-acceptance weighting; no published formula.)
  - ``"dpace"``: D-PACE, ``sum_{k >= j} prod_{i <= k} s_{b,i}`` with the smoothed confidence
    ``s = (1 - dpace_alpha) * q + dpace_alpha`` (``s = 1`` on an untrained slot, whose own weight
    is 0). With ``dpace_alpha = 0`` this is ``d E[tau] / d log q_j``: how much the expected
    accepted length grows when slot ``j``'s label gets likelier, which counts every later slot that
    the draft only reaches through ``j``. Source: D-PACE as implemented in vLLM speculators 0.9
    (``speculators/losses/utils.py``, ``dpace_loss_decay``, its ``per_position_loss_weight =
    "dpace"``; ``dpace_alpha`` 0.5 there), the default position weighting of NVIDIA ModelOpt's
    DFlash recipe.

* Total: ``loss = sum w v l / sum w v`` (0 with no trained slot).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
import torch.nn.functional as F

from dflash.tables import Table, added_later

__all__ = ["LossConfig", "accept_probability", "confidence_term", "head_confidence_term", "loss_terms",
           "mixed_loss", "needs_final_hidden", "position_weights", "tv_term", "uses_head"]


class LossConfig(Table):
    """The graph file's ``[loss]`` table.

    Attributes:
        label: hard CE label: "data" (dataset token) | "target_argmax".
        kl_weight: weight of the KL term in [0, 1] (CE gets ``1 - kl_weight - tv_weight``).
        tv_weight: weight of the total-variation term in [0, 1], with ``kl_weight + tv_weight
            <= 1``; needs the target's logits, like KL. TV alone: ``tv_weight = 1.0`` (CE's weight
            ``1 - kl_weight - tv_weight`` is then 0), ``kl_weight = 0``, ``conf_weight = 0``.
            DSpark's recipe in this scale: 0.947 (module docstring).
        conf_weight: weight (>= 0, added on top) of the confidence term (DSpark's: 1.0 on a loss
            1.9 times this one's scale, 0.526 here).
        confidence: which confidence term ``conf_weight`` weighs: "top1" (a stand-in on the
            drafter's top-1 probability) | "head" (DSpark's: a confidence head on the drafter,
            trained toward ``1 - TV``; needs ``conf_weight > 0``; the run adds the head to the
            drafter). Formulas in the module docstring.
        temperature: KL and TV temperature (> 0).
        weighting: "exp_decay" | "streak" | "dpace" | "none".
        gamma: exp_decay scale, in block positions.
        alpha: streak floor in [0, 1].
        dpace_alpha: D-PACE's confidence smoothing in [0, 1] (0: the exact gradient of the
            expected accepted length; 1: each slot weighs the count of trained slots from it to the block's end).
        selector_weight: weight (>= 0) of DFlash2's selector loss, added to the loss above
            (:mod:`dflash.train.selector_loss`); DFlash2's own key (:mod:`dflash.model.variants`).
        xpress_base_weight, xpress_consistency_weight, xpress_consistency_passes: XPress's loss
            (:mod:`dflash.train.xpress_loss`; XPress's own keys):
            ``base * L(backbone) + L(refined, true predecessors) + consistency * mean over the
            passes of L(refined, the previous pass's drafts)``, each ``L`` the loss above.
            speculators' recipe: 0.6, 0.3, 3.
    """

    label: Literal["data", "target_argmax"] = "data"
    kl_weight: float = 0.0
    tv_weight: Annotated[float, added_later(0.0)] = 0.0
    conf_weight: Annotated[float, added_later(0.0)] = 0.0
    confidence: Annotated[Literal["top1", "head"], added_later("top1")] = "top1"  # "top1": the term's only form before
    temperature: float = 1.0
    weighting: Literal["exp_decay", "streak", "dpace", "none"] = "exp_decay"
    gamma: float = 7.0
    alpha: float = 0.1
    dpace_alpha: Annotated[float, added_later(0.5)] = 0.5
    selector_weight: Annotated[float, added_later(1.0, hashed=False)] = 1.0
    xpress_base_weight: Annotated[float, added_later(0.6, hashed=False)] = 0.6
    xpress_consistency_weight: Annotated[float, added_later(0.3, hashed=False)] = 0.3
    xpress_consistency_passes: Annotated[int, added_later(3, hashed=False)] = 3

    def __post_init__(self) -> None:
        if not 0.0 <= self.kl_weight <= 1.0:
            raise ValueError(f"loss.kl_weight must be in [0, 1], got {self.kl_weight}")
        if not 0.0 <= self.tv_weight <= 1.0 - self.kl_weight:
            raise ValueError(f"loss.tv_weight must be in [0, 1 - kl_weight] = [0, {1.0 - self.kl_weight:g}] "
                             f"(CE gets 1 - kl_weight - tv_weight), got {self.tv_weight}")
        if not (self.conf_weight >= 0.0 and math.isfinite(self.conf_weight)):
            raise ValueError(f"loss.conf_weight must be a finite number >= 0, got {self.conf_weight}")
        if self.confidence == "head" and self.conf_weight == 0:
            raise ValueError("loss.confidence = 'head' trains a confidence head with weight loss.conf_weight, "
                             "which is 0: set loss.conf_weight > 0 (DSpark: 1.0) or leave loss.confidence unset")
        if self.temperature <= 0:
            raise ValueError(f"loss.temperature must be > 0, got {self.temperature}")
        if self.gamma <= 0:
            raise ValueError(f"loss.gamma must be > 0, got {self.gamma}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"loss.alpha must be in [0, 1], got {self.alpha}")
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ValueError(f"loss.dpace_alpha must be in [0, 1], got {self.dpace_alpha}")
        if not self.selector_weight >= 0.0:
            raise ValueError(f"loss.selector_weight must be >= 0, got {self.selector_weight}")
        for key in ("xpress_base_weight", "xpress_consistency_weight"):
            if not (getattr(self, key) >= 0.0 and math.isfinite(getattr(self, key))):
                raise ValueError(f"loss.{key} must be a finite number >= 0, got {getattr(self, key)}")
        if self.xpress_consistency_passes < 0:
            raise ValueError(f"loss.xpress_consistency_passes must be >= 0, got {self.xpress_consistency_passes}")


def needs_final_hidden(cfg: LossConfig) -> bool:
    """Whether the loss needs target logits (so the target must return its final hidden state)."""
    return cfg.label == "target_argmax" or cfg.kl_weight > 0 or cfg.tv_weight > 0 or uses_head(cfg)


def uses_head(cfg: LossConfig) -> bool:
    """Whether the loss trains DSpark's confidence head (``confidence = "head"``, ``conf_weight > 0``)."""
    return cfg.confidence == "head" and cfg.conf_weight > 0


def position_weights(cfg: LossConfig, label_prob: torch.Tensor,
                     trained: torch.Tensor | None = None) -> torch.Tensor:
    """``w [M, bs-1]`` (fp32, detached) from ``label_prob [M, bs-1]`` (drafter p of the hard label;
    used by "streak" and "dpace", any values elsewhere). Column ``c`` is slot ``j = c + 1``.

    ``trained [M, bs-1]`` bool (None: every slot) tells "dpace" which slots to pass through with
    ``s = 1``; the caller zeroes the weights of untrained slots in every mode."""
    M, S = label_prob.shape
    j = torch.arange(1, S + 1, device=label_prob.device, dtype=torch.float32)
    if cfg.weighting == "none":
        return torch.ones(M, S, device=label_prob.device)
    if cfg.weighting == "exp_decay":
        return torch.exp(-(j - 1) / cfg.gamma).expand(M, S).clone()
    q = label_prob.detach().float()
    if cfg.weighting == "dpace":
        s = (1.0 - cfg.dpace_alpha) * q + cfg.dpace_alpha
        if trained is not None:
            s = torch.where(trained, s, torch.ones_like(s))
        prefix = torch.cumprod(s, dim=1)
        if trained is not None:
            prefix = prefix * trained
        return prefix.flip(1).cumsum(1).flip(1)
    reach = torch.cumprod(torch.cat([torch.ones_like(q[:, :1]), q[:, :-1]], dim=1), dim=1)
    return cfg.alpha + (1.0 - cfg.alpha) * reach


def tv_term(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``TV [N]`` fp32: ``0.5 * sum_v |softmax(z^T / tau) - softmax(z^D / tau)|`` per row.

    Args:
        draft_logits, target_logits: ``[N, V]`` (any float dtype; cast to fp32 first, since the
            difference of nearly equal probabilities loses most of its bits in bf16).
        temperature: ``tau`` (> 0).
    """
    p_t = F.softmax(target_logits.float() / temperature, dim=-1)
    p_d = F.softmax(draft_logits.float() / temperature, dim=-1)
    return 0.5 * (p_t - p_d).abs().sum(-1)


def confidence_term(draft_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``conf [N]`` fp32: binary cross-entropy of the drafter's top-1 probability against whether
    its argmax is the label (formula in the module docstring).

    ``log(1 - c)`` is taken as the log-sum-exp of the other logits minus that of all, which stays
    finite where ``c`` rounds to 1 in fp32.

    Args:
        draft_logits: ``[N, V]`` (any float dtype; computed in fp32), ``V >= 2``.
        labels: ``[N]`` int64 hard labels.
    """
    z = draft_logits.float()
    lse = torch.logsumexp(z, dim=-1)
    top, arg = z.max(dim=-1)
    log_c = top - lse
    others = z.scatter(1, arg[:, None], float("-inf"))
    log_1mc = torch.logsumexp(others, dim=-1) - lse
    right = (arg == labels).float()                                   # not differentiated
    return -(right * log_c + (1.0 - right) * log_1mc)


def accept_probability(draft_logits: torch.Tensor, target_logits: torch.Tensor,
                       temperature: float) -> torch.Tensor:
    """``c* [N]`` fp32, not differentiated: ``clamp(1 - TV, 0, 1)``, the probability that
    speculative sampling at ``temperature`` accepts the draft (DSpark eq. 8; the confidence head's
    label). Arguments as :func:`tv_term`."""
    with torch.no_grad():
        return (1.0 - tv_term(draft_logits, target_logits, temperature)).clamp_(0.0, 1.0)


def head_confidence_term(conf_logits: torch.Tensor, accept: torch.Tensor) -> torch.Tensor:
    """``conf [N]`` fp32: DSpark's confidence loss (eq. 11), the binary cross-entropy of
    ``c = sigmoid(conf_logits)`` against the soft label ``accept`` (not differentiated).

    Args:
        conf_logits: ``[N]`` the confidence head's logits (any float dtype; computed in fp32).
        accept: ``[N]`` labels in [0, 1] (:func:`accept_probability`).

    Raises:
        ValueError: the shapes differ.
    """
    if conf_logits.shape != accept.shape:
        raise ValueError(f"confidence logits {tuple(conf_logits.shape)} and labels {tuple(accept.shape)} "
                         "must have one value per slot each")
    return F.binary_cross_entropy_with_logits(conf_logits.float(), accept.detach().float(), reduction="none")


def mixed_loss(cfg: LossConfig, draft_logits: torch.Tensor, labels: torch.Tensor,
               target_logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-slot terms for ``N`` trained slots: ``(l [N], ce [N], kl [N])``, the first three of
    :func:`loss_terms` (arguments, formula and errors there)."""
    return loss_terms(cfg, draft_logits, labels, target_logits)[:3]


def loss_terms(cfg: LossConfig, draft_logits: torch.Tensor, labels: torch.Tensor,
               target_logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                            torch.Tensor | None, torch.Tensor | None]:
    """Per-slot terms for ``N`` trained slots.

    Args:
        draft_logits: ``[N, V]`` (any float dtype; computed in fp32).
        labels: ``[N]`` int64 hard labels.
        target_logits: ``[N, V]`` or None (required when ``kl_weight > 0`` or ``tv_weight > 0``).

    Returns:
        ``(l [N], ce [N], kl [N], tv [N] | None, conf [N] | None)`` fp32; ``kl`` is zeros without
        target logits; ``tv`` is None when ``tv_weight = 0``, ``conf`` (the "top1" confidence term)
        None unless ``conf_weight > 0`` with ``confidence = "top1"`` (unweighted: for the metrics;
        formula of ``l`` in the module docstring). The "head" confidence term is not in ``l``
        (:func:`head_confidence_term`, added by the caller).

    Raises:
        ValueError: ``kl_weight > 0`` or ``tv_weight > 0`` and no target logits.
    """
    logp = F.log_softmax(draft_logits.float(), dim=-1)
    ce = -logp.gather(1, labels[:, None]).squeeze(1)
    if (cfg.kl_weight > 0 or cfg.tv_weight > 0) and target_logits is None:
        raise ValueError("loss.kl_weight > 0 or loss.tv_weight > 0 needs target logits (final_hidden)")
    if cfg.kl_weight > 0:
        t = cfg.temperature
        logp_t = F.log_softmax(target_logits.float() / t, dim=-1)
        logq_t = F.log_softmax(draft_logits.float() / t, dim=-1)
        kl = (t * t) * (logp_t.exp() * (logp_t - logq_t)).sum(-1)
    else:
        kl = torch.zeros_like(ce)
    top1 = cfg.conf_weight > 0 and cfg.confidence == "top1"
    if cfg.tv_weight == 0 and not top1:
        return (1.0 - cfg.kl_weight) * ce + cfg.kl_weight * kl, ce, kl, None, None  # the plain CE/KL loss
    l = (1.0 - cfg.kl_weight - cfg.tv_weight) * ce + cfg.kl_weight * kl
    tv = conf = None
    if cfg.tv_weight > 0:
        tv = tv_term(draft_logits, target_logits, cfg.temperature)
        l = l + cfg.tv_weight * tv
    if top1:
        conf = confidence_term(draft_logits, labels)
        l = l + cfg.conf_weight * conf
    return l, ce, kl, tv, conf
