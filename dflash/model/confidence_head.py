"""DSpark's confidence head: one linear unit on the drafter's hidden state predicting acceptance.

Source: Cheng et al. (Peking University and DeepSeek-AI), "DSpark: Confidence-Scheduled
Speculative Decoding with Semi-Autoregressive Generation" (``DSpark_paper.pdf`` in
deepseek-ai/DeepSpec), section 3.2.1, eq. 7, and DeepSpec's ``AcceptRatePredictor``
(``deepspec/modeling/dspark/common.py``)::

    c_k = sigmoid(w^T [h_k ; W1[x_{k-1}]] + b)

with ``h_k`` the drafter's post-norm hidden state at block slot ``k`` and ``W1[x_{k-1}]`` the
Markov head's embedding of the previous block token. This project's drafter has no Markov head, so
the head reads ``h_k`` alone, DeepSpec's ``confidence_head_with_markov = False`` form:
``c_k = sigmoid(w^T h_k + b)``. ``c_k`` estimates the *conditional* probability that slot ``k``'s
draft survives verification given that slots ``1 .. k-1`` did; the prefix survival probability is
``prod_{i<=k} c_i``. Its training loss is :func:`dflash.train.loss.head_confidence_term`.

Built by :class:`dflash.model.drafter.DFlashDrafter` when ``[drafter].confidence_head`` is set
(the run sets it from ``[loss].confidence = "head"``), as ``confidence_head.proj.{weight,bias}``
(DeepSpec's names). It is part of the checkpoint and of the optimizer, and is left out of the
public export (:mod:`dflash.export`): DFlash loaders have no such module.

Initialisation: ``w ~ N(0, 0.02)`` (the drafter's matrix rule), ``b = 0``, so a fresh head says
``c ~ 0.5`` everywhere.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ConfidenceHead"]


class ConfidenceHead(nn.Module):
    """``Linear(hidden_size, 1)``; :meth:`forward` gives the pre-sigmoid logit of ``c_k``.

    Args:
        hidden_size: the drafter's ``H``.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator | None = None) -> None:
        """``weight ~ N(0, 0.02)`` from ``gen``, ``bias = 0``."""
        self.proj.weight.normal_(0.0, 0.02, generator=gen)
        self.proj.bias.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` hidden states (any float dtype) -> ``[...]`` fp32 logits of ``c_k``."""
        return self.proj(hidden.to(self.proj.weight.dtype)).squeeze(-1).float()
