"""The two modules DFlash2 adds to the DFlash backbone: a grouped dynamic causal convolution and
the candidate selector.

DFlash2 is z-lab's ``DFlash2DraftModel`` (the ``dflash`` 0.1.0 wheel). The backbone is DFlash's
(:mod:`dflash.model.drafter`); ``[drafter].variant = "dflash2"`` adds, with the same parameter
names and shapes as the published checkpoints:

* **Grouped dynamic causal convolution** (:class:`GroupedDynamicCausalConv`), two per decoder layer
  (``layers.N.attention_conv``, ``layers.N.mlp_conv``). Around each pre-norm sublayer ``f``::

      u    = RMSNorm(x)                                 # the sublayer's normed input [.., Q, H]
      c    = kernel_projection(u)  -> [.., Q, 2, K, G]  # side 0 "prepare", side 1 "finish"
      x   += conv_1( f( conv_0(u, c_0) ), c_1 )

  with ``conv_s(v, c)[t, ch] = sum_{o<K} (base_kernel[s, o, ch] + c_s[t, o, ch // gs]) * v[t-o, ch]``:
  ``K = conv_kernel_size`` taps (``o = 0`` the current token, ``o = 1`` the previous one), a static
  per-channel kernel plus a per-position correction shared by the ``gs = conv_group_size``
  channels of each of the ``G = H / gs`` groups. Only the block tokens are convolved (the context
  features go to ``k_proj``/``v_proj`` as in DFlash), and the convolution is causal *within a
  block*: ``v[t-o] = 0`` before the block's anchor. Training packs many blocks into one sequence,
  so it restarts at every block boundary (the ``block`` argument); at decode time a forward holds
  one block, as in z-lab's decoder.
* **Candidate selector** (:class:`CandidateSelector`, ``candidate_selector``): the drafter's top-K
  tokens per block position (``K = selector_top_k``) are re-ranked by a low-rank bigram term
  between neighbouring block tokens, gated by the drafter's hidden state::

      score_j[k] = z_j[c_jk] + < P[y_{j-1}] * W h_j , S[c_jk] >        (rank r = selector_rank)

  ``z_j`` the drafter's logits at slot ``j`` (through the target's LM head), ``c_jk`` its top-K
  ids, ``h_j`` the post-norm hidden state, ``P``/``S`` the predecessor/successor codebooks
  ``[V, r]``, ``W`` = ``hidden_projection`` ``[r, H]``. Decoding walks left to right from the anchor
  (``y_0``), each position's choice being the next position's predecessor (:meth:`CandidateSelector.walk`:
  greedy argmax, a chain, not Viterbi; the sampled rule softmaxes ``score / T`` over the K).
  The codebooks are bare parameters (``candidate_selector.predecessor_codebook``, no ``.weight``),
  which is how the published checkpoints store them.

Initialisation (z-lab's wheel leaves ``base_kernel`` uninitialised and ships no trainer): the
convolutions start as the identity (``base_kernel[:, 0] = 1``, other taps and ``kernel_projection``
zero) and the successor codebook at zero, so a fresh DFlash2 drafter computes exactly what the
DFlash drafter of the same seed computes, and its selector walk is the backbone's argmax. Every
one of these starting points still has a gradient: the zero taps through ``v[t-o]``, the zero
projection through the normed input, ``S`` through ``P[y] * W h`` (nonzero by the init below).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from dflash.model.drafter_config import DrafterConfig

__all__ = ["CandidateSelector", "GroupedDynamicCausalConv", "decoder_layer_parts", "drafter_parts", "walk_selector"]


def decoder_layer_parts(cfg: DrafterConfig) -> dict[str, nn.Module]:
    """The two convolutions of every decoder layer (``attention_conv``, ``mlp_conv``), which
    :class:`dflash.model.drafter.DecoderLayer` wraps around its sublayers."""
    return {name: GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            for name in ("attention_conv", "mlp_conv")}


def drafter_parts(cfg: DrafterConfig) -> dict[str, nn.Module]:
    """The drafter's ``candidate_selector``."""
    return {"candidate_selector": CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.selector_rank,
                                                    cfg.selector_top_k)}


class GroupedDynamicCausalConv(nn.Module):
    """``K``-tap causal convolution over block tokens with per-position, per-group coefficients.

    Args:
        hidden_size: ``H`` (a multiple of ``group_size``).
        kernel_size: taps ``K`` (>= 1).
        group_size: channels sharing one dynamic coefficient (``G = H / group_size`` groups).

    Parameters (the published names): ``base_kernel [2, K, H]`` (side 0 prepares the sublayer's
    input, side 1 finishes its output), ``kernel_projection.weight [2*K*G, H]`` (row
    ``side*K*G + tap*G + group``).
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"hidden size {hidden_size} is not a multiple of conv_group_size {group_size}")
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """The identity: tap 0 of both sides is 1, every other tap and the projection 0 (no draw:
        ``generator`` is unused)."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def coefficients(self, normed: torch.Tensor) -> torch.Tensor:
        """``[.., Q, 2, K, G]`` dynamic taps from the sublayer's normed input ``[.., Q, H]``."""
        return self.kernel_projection(normed).unflatten(-1, (2, self.kernel_size, self.groups))

    def forward(self, v: torch.Tensor, coef: torch.Tensor, side: int, block: int) -> torch.Tensor:
        """Convolve ``v [B, Q, H]`` with side ``side`` (0 prepare, 1 finish) of ``coef``
        ``[B, Q, 2, K, G]``, restarting every ``block`` tokens (``Q`` a multiple of ``block``).

        Returns ``[B, Q, H]`` in ``v``'s dtype (the static kernel is cast to it).
        """
        B, Q, H = v.shape
        n, K, G = Q // block, self.kernel_size, self.groups
        v5 = v.reshape(B, n, block, G, self.group_size)
        dyn = coef[:, :, side].reshape(B, n, block, K, G, 1)
        base = self.base_kernel[side].to(v.dtype).view(K, G, self.group_size)
        out = v5 * (base[0] + dyn[:, :, :, 0])
        for o in range(1, min(K, block)):  # tap o reaches v[t - o]: zero (skipped) before the anchor
            out[:, :, o:] += v5[:, :, : block - o] * (base[o] + dyn[:, :, o:, o])
        return out.reshape(B, Q, H)


class CandidateSelector(nn.Module):
    """Low-rank, hidden-gated bigram re-ranking of the drafter's top-K tokens (module docstring).

    Args:
        vocab_size: ``V``. hidden_size: ``H``. rank: ``r``. top_k: ``K`` (candidates per position).

    Parameters: ``predecessor_codebook [V, r]``, ``successor_codebook [V, r]`` (bare, as published),
    ``hidden_projection.weight [r, H]``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """``P ~ N(0, 1)``, ``W ~ N(0, 1/H)`` (so ``P[y] * W h`` is O(1) per rank for a post-norm
        ``h``), ``S = 0``: the pair term starts at exactly 0 and ``S`` gets the first gradient."""
        H = self.hidden_projection.weight.shape[1]
        self.predecessor_codebook.normal_(0.0, 1.0, generator=generator)
        self.hidden_projection.weight.normal_(0.0, 1.0 / math.sqrt(H), generator=generator)
        self.successor_codebook.zero_()

    def gate(self, hidden: torch.Tensor) -> torch.Tensor:
        """``W h``: ``[.., H] -> [.., r]``."""
        return self.hidden_projection(hidden)

    def successors(self, cand: torch.Tensor) -> torch.Tensor:
        """``S[cand]``: ``[.., K] -> [.., K, r]`` (gathered once per batch; every predecessor reuses it).

        An embedding lookup rather than advanced indexing, for its backward: the K candidates of
        every slot repeat a few thousand frequent tokens, and indexing's backward (``index_put_``
        with accumulation) spent 93 ms a step on those duplicates at 512 anchors a row (SmolLM2,
        one H100: 18% of the drafter's step), where the embedding's backward sums them per token."""
        return F.embedding(cand, self.successor_codebook)

    def pair_scores(self, gate: torch.Tensor, prev: torch.Tensor, succ: torch.Tensor) -> torch.Tensor:
        """``<P[prev] * gate, succ_k>``: ``gate [.., r]``, ``prev [..]``, ``succ [.., K, r]``
        (:meth:`successors`) -> ``[.., K]`` in the codebooks' dtype, outside autocast: the scores are
        compared with each other and with logit gaps, so a bf16 product (3 significant digits)
        would reorder near-ties, and the ``[.., K, r]`` product is small (16 x 256 per slot at the
        published sizes)."""
        with torch.autocast(gate.device.type, enabled=False):
            pred = F.embedding(prev, self.predecessor_codebook)              # [.., r]
            ctx = pred * gate.to(pred.dtype)
            return torch.matmul(succ.to(pred.dtype), ctx.unsqueeze(-1)).squeeze(-1)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(unary [.., K] fp32, ids [.., K] int64)``: the top-K logits, largest first."""
        values, ids = torch.topk(logits.detach().float(), self.top_k, dim=-1)
        return values, ids

    @torch.no_grad()
    def walk(self, hidden: torch.Tensor, unary: torch.Tensor, cand: torch.Tensor, anchor: torch.Tensor,
             temperature: float = 0.0, generator: torch.Generator | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode-time path; see :func:`walk_selector`."""
        return walk_selector(self, self.gate(hidden), unary, cand, anchor, temperature, generator)


def walk_selector(selector: CandidateSelector, gate: torch.Tensor, unary: torch.Tensor, cand: torch.Tensor,
                  anchor: torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None,
                  succ: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Walk the block left to right from ``anchor``, each choice the next predecessor.

    Args:
        gate: ``[N, S, r]`` (:meth:`CandidateSelector.gate` of the hidden states of slots 1..S).
        unary, cand: ``[N, S, K]`` top-K logits and ids (:meth:`CandidateSelector.candidates`).
        anchor: ``[N]`` the block's token 0 (the last committed token).
        temperature: <= 0: argmax of the scores (greedy). > 0: sample an index from
            ``q = softmax(score / T)`` over the K candidates (``generator`` for the draws).
        succ: ``[N, S, K, r]`` :meth:`CandidateSelector.successors` of ``cand`` when already
            gathered (gathered here otherwise).

    Returns:
        ``(tokens [N, S] int64, q [N, S, K] fp32 or None when greedy)``.
    """
    succ = selector.successors(cand) if succ is None else succ
    prev, path, qs = anchor, [], []
    for j in range(cand.shape[1]):
        score = unary[:, j].float() + selector.pair_scores(gate[:, j], prev, succ[:, j]).float()
        if temperature > 0:
            q = torch.softmax(score / temperature, dim=-1)
            idx = torch.multinomial(q, 1, generator=generator)[:, 0]
            qs.append(q)
        else:
            idx = score.argmax(-1)
        prev = cand[:, j].gather(1, idx[:, None])[:, 0]
        path.append(prev)
    return torch.stack(path, 1), (torch.stack(qs, 1) if qs else None)
