"""Decoding with an XPress drafter: the backbone drafts a block, the refiner resolves it in a few
parallel Jacobi passes (:meth:`dflash.model.xpress.XPressRefiner.jacobi`).

Greedy (:meth:`propose`): the last pass's argmax, ``[drafter].jacobi_passes`` passes at most
(fewer on a CPU, which stops at a fixed point), each slot's predecessor read from the previous pass. The decode stays
lossless whatever the drafts are: verification keeps only the target's own tokens.

Sampled (``temperature = T > 0``, :meth:`sample`): the same passes, then each slot's token drawn
from ``q_j = softmax(z'_j / T)``, ``z'_j`` the last pass's refined logits (conditioned on the
previous pass's greedy drafts, a function of the context alone). ``q`` is what each slot was drawn
from, which is all the rejection rule of :func:`dflash.eval.decode.speculative_decode` needs for
the output to be the target's own sampling.

:func:`xpress_block_hits` scores teacher-forced blocks as :mod:`dflash.eval.measure` scores the
other variants: per slot, whether the Jacobi drafts hit what verification accepts.
"""

from __future__ import annotations

import torch

from dflash.eval.proposers import CachedDrafterProposer, DrafterContextCache, DrafterProposer
from dflash.model.drafter import DFlashDrafter
from dflash.model.target import SharedHead
from dflash.model.variants import variant_of

__all__ = ["CachedXPressProposer", "XPressProposer", "is_xpress", "xpress_block_hits", "xpress_proposer"]


def is_xpress(drafter: DFlashDrafter) -> bool:
    """Whether ``drafter``'s variant drafts with a refiner's Jacobi passes (XPress's;
    ``drafts_with = "refiner"`` in :mod:`dflash.model.variants`)."""
    return variant_of(drafter.cfg.variant).drafts_with == "refiner"


def _check(drafter: DFlashDrafter, name: str) -> None:
    if not is_xpress(drafter):
        raise ValueError(f"{name} needs an XPress drafter (drafter.variant = \"xpress\")")


class _Jacobi:
    """``propose`` and ``sample`` from the ``hidden(tokens, features) -> [1, bs, H]`` of the drafter
    proposer it is mixed into. Listed first among the bases: its ``propose`` replaces the backbone
    proposer's, and, defining no ``hidden``, it leaves that proposer's to be found."""

    drafter: DFlashDrafter
    head: SharedHead
    passes: int

    def _refine(self, tokens: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.hidden(tokens, features)                                    # [1, bs, H]
        before = tokens[-2:-1] if tokens.shape[0] >= 2 else tokens[-1:]     # training's rule at a document start
        return self.drafter.refiner_head.jacobi(self.head.logits(h[:, 1:]), h, before, tokens[-1:], self.passes)

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """``tokens [n]`` (last = anchor), ``features [1, n-1, k*H]`` -> ``[bs-1]`` drafted ids."""
        return self._refine(tokens, features)[0][0]

    @torch.no_grad()
    def sample(self, tokens: torch.Tensor, features: torch.Tensor, temperature: float,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(draft [bs-1] int64, q [bs-1, V] fp32)``: the module docstring's sampled rule.

        Raises:
            ValueError: ``temperature <= 0`` (greedy is :meth:`propose`).
        """
        if not temperature > 0:
            raise ValueError(f"sample() needs temperature > 0, got {temperature}: use propose() for greedy")
        logits = self._refine(tokens, features)[1][0]                        # [bs-1, V]
        q = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(q, 1, generator=generator).squeeze(1), q


class XPressProposer(_Jacobi, DrafterProposer):
    """Drafts with an XPress drafter, recomputing the drafter's context each step.

    Args:
        passes: Jacobi passes (None: the drafter's ``jacobi_passes``).

    Raises:
        ValueError: the drafter has no refiner (``variant`` is not "xpress").
    """

    def __init__(self, drafter: DFlashDrafter, head: SharedHead, passes: int | None = None) -> None:
        _check(drafter, "XPressProposer")
        self.drafter, self.head = drafter, head
        self.bs = drafter.cfg.block_size
        self.passes = drafter.cfg.jacobi_passes if passes is None else passes


class CachedXPressProposer(_Jacobi, CachedDrafterProposer):
    """:class:`XPressProposer` with the drafter's context keys/values cached
    (:class:`dflash.eval.proposers.DrafterContextCache`); same drafts. One instance per generation.

    Raises:
        ValueError: no refiner, or sliding-window layers (use :class:`XPressProposer`).
    """

    def __init__(self, drafter: DFlashDrafter, head: SharedHead, passes: int | None = None) -> None:
        _check(drafter, "CachedXPressProposer")
        DrafterContextCache.__init__(self, drafter, head)
        self.passes = drafter.cfg.jacobi_passes if passes is None else passes


def xpress_proposer(drafter: DFlashDrafter, head: SharedHead) -> XPressProposer | CachedXPressProposer:
    """The XPress proposer for ``drafter``: cached when every layer is full attention."""
    if all(t == "full_attention" for t in drafter.cfg.types):
        return CachedXPressProposer(drafter, head)
    return XPressProposer(drafter, head)


@torch.no_grad()
def xpress_block_hits(drafter: DFlashDrafter, head: SharedHead, hidden: torch.Tensor,
                      before_anchor: torch.Tensor, anchor_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[A, bs-1]`` bool: the Jacobi drafts of ``A`` teacher-forced blocks hit ``labels``.

    Args:
        hidden: ``[A, bs, H]`` the drafter's hidden states of the blocks (slot 0 = the anchor).
        before_anchor, anchor_ids: ``[A]`` the token before each anchor, and the anchors.
        labels: ``[A, bs-1]`` what verification accepts.
    """
    draft, _ = drafter.refiner_head.jacobi(head.logits(hidden[:, 1:]), hidden, before_anchor, anchor_ids,
                                           drafter.cfg.jacobi_passes)
    return draft == labels
