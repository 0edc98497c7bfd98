"""FLOP accounting for the H200 harness: the target forward and the drafter training step,
the numerators of every MFU and HFU the harness reports.

Two counts for every measurement (:class:`Flops`):

* ``model``: the work the step needs. Matmuls over real (non-padding) tokens and valid blocks;
  attention over the query-key pairs the mask allows; the LM head on trained slots only.
  MFU divides this by the measured bf16 matmul rate.
* ``computed``: what the kernels run. Matmuls over every position of the ``[B, T]`` rows (padding
  included) and every anchor slot (empty ones included); attention over every pair a dense-mask
  kernel visits (``sdpa`` with a ``[B, 1, T, T]`` mask and ``eager`` visit all ``T x T`` pairs of a
  row) or, for ``flex_attention``, every 128 x 128 tile that holds an allowed pair (flex skips the
  empty tiles and computes whole partial ones). Divided by the matmul rate this is the hardware
  utilisation (``hfu``).

Conventions (the usual ones, e.g. PaLM, appendix B; FlashAttention-2, section 3.1):

* a linear layer with weight ``[out, in]`` costs ``2 * in * out`` FLOPs per token forward; its
  backward costs ``2 * in * out`` for the input gradient plus ``2 * in * out`` for the weight
  gradient, each only where it is computed: ``fc`` has a weight gradient only (the target
  features need no gradient), the frozen shared LM head an input gradient only;
* attention costs ``4 * heads * head_dim`` FLOPs per query-key pair forward (``Q K^T`` and
  ``P V``); backward 2x that (``dV``, ``dP``, ``dQ``, ``dK``) in ``model``, 2.5x in ``computed``
  (the fused kernels recompute ``Q K^T`` in backward);
* norms, RoPE, softmax, SwiGLU's product, the loss and the optimizer are not counted (they are
  memory-bound and small next to the matmuls).

Shapes come from the transformers config of the target (:func:`target_linear_params`) and the
resolved :class:`dflash.model.drafter.DrafterConfig`; per-batch counts from the batch tensors
(:func:`document_lengths`, :func:`drafter_counts`). Tests: ``tests/benchmarks/test_flops.py`` (hand counts and
``torch.utils.flop_counter.FlopCounterMode`` on CPU).
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

__all__ = ["DrafterCounts", "Flops", "attention_pairs_causal", "document_lengths", "drafter_counts",
           "drafter_linear_params", "drafter_step_flops", "flex_tiles", "target_forward_flops",
           "target_linear_params", "varlen_tiles"]

TILE = 128  # flex_attention's default block size (BlockMask tiles are TILE x TILE)
ATTN_BWD_MODEL = 2.0  # backward / forward attention FLOPs without recompute
ATTN_BWD_COMPUTED = 2.5  # with the fused kernels' recompute of Q K^T


class Flops(msgspec.Struct, frozen=True):
    """FLOPs of one step (or a sum of steps): ``model`` (needed) and ``computed`` (run), see the
    module docstring; ``attention_model`` / ``attention_computed``: the attention share of each."""

    model: float
    computed: float
    attention_model: float = 0.0
    attention_computed: float = 0.0

    def __add__(self, other: "Flops") -> "Flops":
        return Flops(self.model + other.model, self.computed + other.computed,
                     self.attention_model + other.attention_model,
                     self.attention_computed + other.attention_computed)

    def rates(self, secs: float, peak_tflops: float, gpus: int = 1) -> dict[str, float]:
        """``tflops`` (model FLOPs per second / 1e12), ``mfu`` and ``hfu`` against ``gpus`` x the
        measured matmul rate ``peak_tflops`` (TFLOP/s)."""
        tflops = self.model / secs / 1e12
        return {"tflops": tflops, "mfu": tflops / (peak_tflops * gpus),
                "hfu": self.computed / secs / 1e12 / (peak_tflops * gpus)}


def _attn_dims(hf_config: Any) -> tuple[int, int, int, int, int]:
    H, nh = hf_config.hidden_size, hf_config.num_attention_heads
    nkv = getattr(hf_config, "num_key_value_heads", None) or nh
    d = getattr(hf_config, "head_dim", None) or H // nh
    return H, nh, nkv, d, hf_config.intermediate_size


def target_linear_params(hf_config: Any) -> int:
    """Weights of the matmuls of one Qwen3-style decoder layer: ``q, k, v, o`` projections
    (``H * d * (2 * heads + 2 * kv_heads)``) and the SwiGLU MLP (``3 * H * intermediate``)."""
    H, nh, nkv, d, inter = _attn_dims(hf_config)
    return H * d * (2 * nh + 2 * nkv) + 3 * H * inter


def document_lengths(doc_ids: torch.Tensor) -> list[int]:
    """Lengths of the packed documents of ``doc_ids [B, T]`` (consecutive runs of one id >= 0)."""
    out: list[int] = []
    for row in doc_ids.cpu():
        ids, counts = torch.unique_consecutive(row, return_counts=True)
        out += [int(c) for i, c in zip(ids.tolist(), counts.tolist()) if i >= 0]
    return out


def attention_pairs_causal(lengths: list[int]) -> int:
    """Query-key pairs of causal attention over sequences of ``lengths`` (``L (L + 1) / 2`` each)."""
    return sum(L * (L + 1) // 2 for L in lengths)


def varlen_tiles(lengths: list[int], tile: int = TILE) -> int:
    """``TILE x TILE`` tiles a causal variable-length kernel (FlashAttention-2 varlen) visits: per
    sequence of length ``L``, the ``n (n + 1) / 2`` lower tiles of its own ``n = ceil(L / TILE)``
    tile grid (nothing across sequences; a partial tile counts whole)."""
    return sum((n := -(-L // tile)) * (n + 1) // 2 for L in lengths)


def flex_tiles(doc_ids: torch.Tensor, tile: int = TILE) -> int:
    """``TILE x TILE`` tiles of the document-causal mask that hold an allowed pair, summed over the
    rows of ``doc_ids [B, T]`` (what flex_attention computes; a partial tile counts whole).

    A diagonal tile always holds one (a query sees itself); an off-diagonal tile (query tile ``i``
    > key tile ``j``) holds one iff a document (id >= 0) has tokens in both.
    """
    B, T = doc_ids.shape
    n = -(-T // tile)
    total = 0
    for row in doc_ids.cpu().long():
        ids = row.clamp(min=-1) + 1                                        # 0 = padding
        pad = torch.zeros(n * tile, dtype=torch.long)
        pad[:T] = ids
        present = torch.zeros(n, int(ids.max()) + 1, dtype=torch.bool)
        present[torch.arange(n).repeat_interleave(tile), pad] = True
        present[:, 0] = False
        shared = (present.float() @ present.float().T) > 0                  # [n, n]
        lower = torch.tril(shared, diagonal=-1)
        total += int(lower.sum()) + n
    return total


def target_forward_flops(hf_config: Any, layers: int, doc_ids: torch.Tensor, attn_implementation: str,
                         lm_head: bool = False, num_tokens: int | None = None) -> Flops:
    """Forward FLOPs of ``layers`` Qwen3-style decoder layers over packed rows.

    Args:
        hf_config: the target's transformers config (sizes; ``vocab_size`` for ``lm_head``).
        layers: decoder layers run (the harness's target drops those after the last captured one).
        doc_ids: ``[B, T]`` document of each token (-1 padding); each document is its own causal
            sequence (the document mask). For a plain causal forward pass ``zeros(B, T)``.
        attn_implementation: "sdpa" | "eager" (dense kernels: ``T^2`` pairs per row computed) |
            "flex_attention" (:func:`flex_tiles`) | "varlen" (:func:`varlen_tiles`) | "causal"
            (a causal kernel: ``T (T+1) / 2``).
        lm_head: the LM head runs on every position (the plain transformers forward).
        num_tokens: real tokens (default: the non-padding entries of ``doc_ids``).

    Raises:
        ValueError: an unknown ``attn_implementation``.
    """
    B, T = doc_ids.shape
    H, nh, _, d, _ = _attn_dims(hf_config)
    real = int((doc_ids >= 0).sum()) if num_tokens is None else num_tokens
    per_token = layers * target_linear_params(hf_config) + (H * hf_config.vocab_size if lm_head else 0)
    per_pair = 4.0 * nh * d * layers
    allowed = attention_pairs_causal(document_lengths(doc_ids))
    if attn_implementation in ("sdpa", "eager"):
        visited = B * T * T
    elif attn_implementation == "flex_attention":
        visited = flex_tiles(doc_ids) * TILE * TILE
    elif attn_implementation == "varlen":
        visited = varlen_tiles(document_lengths(doc_ids)) * TILE * TILE
    elif attn_implementation == "causal":
        visited = B * T * (T + 1) // 2
    else:
        raise ValueError(f"attn_implementation {attn_implementation!r}: expected sdpa, eager, "
                         "flex_attention, varlen or causal")
    return Flops(model=2.0 * per_token * real + per_pair * allowed,
                 computed=2.0 * per_token * B * T + per_pair * visited,
                 attention_model=per_pair * allowed, attention_computed=per_pair * visited)


# -- drafter -------------------------------------------------------------------------------------

class DrafterCounts(msgspec.Struct, frozen=True):
    """What the FLOPs of one drafter step depend on, from one batch.

    Attributes:
        rows, context_len, slots: ``B``, ``T`` and anchor slots per row ``A`` (the computed shape).
        real_tokens: non-padding context tokens.
        valid_blocks: anchors >= 0.
        context_visible: sum over valid blocks of the context keys a block query sees in a
            full-attention layer (the tokens of the anchor's document before it).
        trained_slots: ``N``, block slots with a label (the LM head rows).
        context_visible_window: the same sum over valid blocks and their ``bs`` slots in a
            sliding-window layer of ``window`` tokens (0 without a window).
    """

    rows: int
    context_len: int
    slots: int
    real_tokens: int
    valid_blocks: int
    context_visible: int
    trained_slots: int
    context_visible_window: int = 0


def drafter_counts(input_ids: torch.Tensor, loss_mask: torch.Tensor, doc_ids: torch.Tensor,
                   anchors: torch.Tensor, block_size: int, window: int | None = None) -> DrafterCounts:
    """:class:`DrafterCounts` of a batch (``[B, T]`` tensors, ``anchors [B, A]``, -1 = empty), with
    the trained slots of :func:`dflash.train.objective.block_targets` and the context rule of
    :mod:`dflash.model.attention` (``t < anchor`` and same document; in a sliding layer also
    ``query position - key position < window``). Documents are contiguous runs of one id whose
    positions count from 0, as the packer lays them out."""
    from dflash.train.objective import block_targets

    input_ids, loss_mask, doc_ids, anchors = (x.cpu() for x in (input_ids, loss_mask, doc_ids, anchors))
    B, T = doc_ids.shape
    _, trained = block_targets(input_ids, loss_mask, doc_ids, anchors, block_size)
    doc = doc_ids.long()
    idx = torch.arange(T).expand(B, T)
    starts = torch.ones(B, T, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # start of each run
    valid = anchors >= 0
    a = anchors.clamp(min=0)
    # contiguous documents: the same-document tokens before the anchor are those since its run began
    visible = (a - first.gather(1, a)) * valid                             # [B, A]
    windowed = 0
    if window is not None:  # slot j (position p_a + j) sees context positions > p_a + j - window
        j = torch.arange(block_size)
        windowed = int((torch.minimum(visible[..., None], (window - 1 - j).clamp(min=0)) * valid[..., None]).sum())
    return DrafterCounts(rows=B, context_len=T, slots=anchors.shape[1], real_tokens=int((doc >= 0).sum()),
                         valid_blocks=int(valid.sum()), context_visible=int(visible.sum()),
                         trained_slots=int(trained.sum()), context_visible_window=windowed)


def drafter_linear_params(cfg: Any) -> dict[str, int]:
    """Per-layer matmul weights of a resolved :class:`dflash.model.drafter.DrafterConfig`: ``block``
    (``q``, ``o`` and the MLP: run on block tokens only), ``kv`` (``k``, ``v``: run on context and
    block tokens), and ``fc`` (``k * H -> H``, run once on the context)."""
    H, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return {"block": 2 * H * nh * d + 3 * H * cfg.intermediate_size, "kv": 2 * H * nkv * d,
            "fc": len(cfg.target_layer_ids) * H * H}


def _block_pairs(c: DrafterCounts, bs: int, layer_type: str) -> int:
    """Allowed query-key pairs of one layer over the valid blocks (see :mod:`dflash.model.attention`):
    context keys plus the block's own slots (all ``bs``; ``j + 1`` for slot ``j`` when sliding)."""
    if layer_type == "sliding_attention":
        return c.context_visible_window + c.valid_blocks * bs * (bs + 1) // 2
    return bs * c.context_visible + c.valid_blocks * bs * bs


def drafter_step_flops(cfg: Any, c: DrafterCounts, target_logits: bool, sync_free: bool = True) -> Flops:
    """Forward + backward FLOPs of one drafter training step (``dflash.train.objective.compute_loss``
    then ``backward``) for a batch of counts ``c``.

    Args:
        cfg: the resolved :class:`dflash.model.drafter.DrafterConfig` (``vocab_size`` = the shared head's).
        c: :func:`drafter_counts` of the batch (with ``window = cfg.sliding_window`` when a
            layer slides).
        target_logits: the loss computes target logits on the trained slots (``target_argmax``
            labels or KL: :func:`dflash.train.loss.needs_final_hidden`), forward only.
        sync_free: ``[train].sync_free_loss``: the LM head (and target logits) run on every block
            slot ``B * A * (bs - 1)`` (weight 0 where untrained), which ``computed`` counts; the
            model count keeps the ``N`` trained slots. False: both count ``N``.

    Pieces (``Q = A * bs`` block tokens per row; multipliers are forward + backward):
    ``fc`` on the context, x2 (weight gradient only); per layer ``q, o, gate, up, down`` on the
    block tokens and ``k, v`` on context + block tokens, x3; attention, x3 (model) / x3.5
    (computed); the shared LM head on the ``N`` trained slots, x2 (input gradient only); target
    logits on the same slots, x1. ``computed`` attention is dense (``sdpa`` with the
    ``[B, 1, Q, T + Q]`` bool mask visits every pair; for ``flex_attention`` this is an upper bound).
    """
    bs, L = cfg.block_size, cfg.num_layers
    p = drafter_linear_params(cfg)
    head = cfg.hidden_size * cfg.vocab_size
    per_pair = 4.0 * cfg.num_attention_heads * cfg.head_dim

    def linear(ctx_tokens: int, block_tokens: int) -> float:
        fc = 2.0 * p["fc"] * ctx_tokens * 2
        layers = 2.0 * L * (p["block"] * block_tokens + p["kv"] * (ctx_tokens + block_tokens)) * 3
        return fc + layers

    lm_per_row = 2.0 * head * (2 + (1 if target_logits else 0))
    lm = lm_per_row * c.trained_slots
    lm_computed = lm_per_row * (c.rows * c.slots * (bs - 1) if sync_free else c.trained_slots)
    allowed = sum(_block_pairs(c, bs, t) for t in cfg.types)
    Q = c.slots * bs
    dense = L * c.rows * Q * (c.context_len + Q)
    attn_model = per_pair * allowed * (1 + ATTN_BWD_MODEL)
    attn_computed = per_pair * dense * (1 + ATTN_BWD_COMPUTED)
    return Flops(model=linear(c.real_tokens, c.valid_blocks * bs) + lm + attn_model,
                 computed=linear(c.rows * c.context_len, c.rows * Q) + lm_computed + attn_computed,
                 attention_model=attn_model, attention_computed=attn_computed)
