"""The FLOP accounting of the H200 harness (benchmarks/h200/flops.py) against hand counts, the project's own
attention masks and ``torch.utils.flop_counter.FlopCounterMode`` on CPU models."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.h200.flops import (  # noqa: E402
    Flops,
    attention_pairs_causal,
    document_lengths,
    drafter_counts,
    drafter_step_flops,
    flex_tiles,
    target_forward_flops,
    target_linear_params,
    varlen_tiles,
)
from dflash.messages import LossInput  # noqa: E402
from dflash.model.attention import sdpa_mask, training_layout  # noqa: E402
from dflash.model.drafter import DFlashDrafter, DrafterConfig  # noqa: E402
from dflash.model.target import (  # noqa: E402
    TargetConfig,
    build_hf_config,
    document_causal_mask,
    load_target,
)
from dflash.train.anchors import sample_anchors  # noqa: E402
from dflash.train.loss import LossConfig  # noqa: E402
from dflash.train.objective import compute_loss  # noqa: E402

V = 64
TINY = TargetConfig(preset="tiny", vocab_size=V, attn_implementation="eager")


def _packed(B: int = 2, T: int = 40, seed: int = 0):
    """Packed rows: documents of random lengths, positions from 0 per document, padding at the end."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.full((B, T), -1, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        t, d = 0, 0
        while t < T - 4:
            L = int(torch.randint(3, 15, (1,), generator=g))
            L = min(L, T - 4 - t)
            doc[b, t:t + L], pos[b, t:t + L] = d, torch.arange(L)
            t, d = t + L, d + 1
    ids = torch.randint(0, V, (B, T), generator=g)
    loss_mask = (torch.rand(B, T, generator=g) < 0.7) & (doc >= 0)
    return ids, pos, doc, loss_mask


def test_target_hand_count():
    hf = build_hf_config(TargetConfig(preset="tiny", vocab_size=V))
    H, nh, nkv, d, I = 128, 4, 2, 32, 384  # the "tiny" preset
    per_layer = H * nh * d + 2 * H * nkv * d + nh * d * H + 3 * H * I
    assert target_linear_params(hf) == per_layer
    doc = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 0, 0]])
    assert document_lengths(doc) == [3, 2, 6] and attention_pairs_causal([3, 2, 6]) == 6 + 3 + 21
    f = target_forward_flops(hf, 2, doc, "sdpa")
    assert f.model == 2 * 2 * per_layer * 11 + 4 * nh * d * 2 * 30            # 11 real tokens
    assert f.computed == 2 * 2 * per_layer * 12 + 4 * nh * d * 2 * 2 * 36     # all 12, dense 6x6 rows
    head = target_forward_flops(hf, 2, doc, "causal", lm_head=True)
    assert head.model == f.model + 2 * H * V * 11
    assert head.computed == 2 * (2 * per_layer + H * V) * 12 + 4 * nh * d * 2 * 2 * 21
    varlen = target_forward_flops(hf, 2, doc, "varlen")  # one 128 x 128 tile per sequence here
    assert varlen.model == f.model and varlen.computed == 2 * 2 * per_layer * 12 + 4 * nh * d * 2 * 3 * 128 * 128
    assert varlen_tiles([3, 2, 6], tile=2) == 3 + 1 + 6  # ceil(L / 2) = 2, 1, 3 tiles per side
    with pytest.raises(ValueError, match="attn_implementation"):
        target_forward_flops(hf, 2, doc, "paged")


def test_flex_tiles_match_the_block_mask():
    """The tiles counted are the tiles flex_attention's BlockMask of the target visits."""
    from dflash.model.document_mask import _document_block_mask

    _, _, doc, _ = _packed(B=2, T=700, seed=3)
    doc[1, 300:] = -1  # a long padding tail: its diagonal tiles only
    bm = _document_block_mask(doc)
    visited = int(bm.kv_num_blocks.sum()) + int(bm.full_kv_num_blocks.sum() if bm.full_kv_num_blocks is not None else 0)
    assert flex_tiles(doc) == visited
    # and every allowed pair lies in a counted tile: the dense mask restricted to those tiles
    n = -(-700 // 128)
    assert flex_tiles(doc) < 2 * n * (n + 1) // 2  # documents shorter than a row skip tiles


def test_target_forward_matches_flop_counter():
    """An eager tiny target forward: the counter's matmuls are exactly what the module counts as
    ``computed`` (dense attention: eager computes every pair of a row)."""
    target = load_target(TINY, "cpu", num_draft_layers=2, need_final=False)
    ids, pos, doc, _ = _packed()
    B, T = ids.shape
    with FlopCounterMode(display=False) as fc:
        target(ids, pos, doc, need_final=False)
    layers = len(target.decoder_layers)
    f = target_forward_flops(target.hf_config, layers, doc, "eager")
    # transformers 4.x takes RoPE's angles as a matmul ([B, d/2, 1] @ [B, 1, T]); 5.x multiplies
    rope = 2 * B * T * (target.hf_config.head_dim // 2)
    assert fc.get_total_flops() in (f.computed, f.computed + rope)
    assert f.attention_computed == 4 * 4 * 32 * layers * B * T * T  # tiny: 4 heads x 32
    # the model count is the dense one less padding and the masked-out pairs
    assert f.model < f.computed


@pytest.mark.parametrize("sync_free", [True, False])
@pytest.mark.parametrize("layer_types,loss", [
    (None, LossConfig()),
    (["sliding_attention", "full_attention"], LossConfig(label="target_argmax")),
])
def test_drafter_step_matches_flop_counter_and_mask(layer_types, loss, sync_free):
    """compute_loss + backward on CPU: the counter's matmuls (linears, LM head; CPU SDPA is not
    counted by FlopCounterMode) equal the non-attention part of ``computed``; the allowed pairs
    equal the True entries of dflash.model.attention's mask at valid blocks."""
    BS, A = 4, 6
    hf = build_hf_config(TargetConfig(preset="tiny", vocab_size=V))
    cfg = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=V - 1,
                        layer_types=layer_types, sliding_window=6 if layer_types else None).resolve(hf, [1, 3])
    drafter = DFlashDrafter(cfg, seed=0)
    from dflash.model.target import SharedHead

    head = SharedHead(torch.randn(V, 128), torch.randn(V, 128))
    ids, pos, doc, lm = _packed()
    B, T = ids.shape
    anchors = sample_anchors(lm, doc, A, BS, generator=torch.Generator().manual_seed(1))
    anchors[1, -2:] = -1  # empty slots: computed, but no model FLOPs
    assert (anchors < 0).any() and (anchors >= 0).any()  # empty slots are counted apart
    feats = torch.randn(B, T, 2 * 128)
    final = torch.randn(B, T, 128) if loss.label == "target_argmax" else None
    with FlopCounterMode(display=False) as fc:
        x = LossInput(features=feats, input_ids=ids, loss_mask=lm, doc_ids=doc, position_ids=pos,
                      anchors=anchors, final_hidden=final)
        out = compute_loss(drafter, head, x, loss, sync_free=sync_free)
        out.loss.backward()
    c = drafter_counts(ids, lm, doc, anchors, BS, window=cfg.sliding_window)
    assert c.trained_slots == int(out.num_predictions) and c.valid_blocks == int(out.num_blocks)
    f = drafter_step_flops(cfg, c, target_logits=final is not None, sync_free=sync_free)
    counted = fc.get_flop_counts()["Global"]
    assert not any("attention" in str(op) for op in counted)  # else compare the attention too
    assert fc.get_total_flops() == f.computed - f.attention_computed
    # attention pairs: the mask's True entries in the rows of valid blocks, per layer type
    layout = training_layout(pos, doc, anchors, BS)
    valid_q = (anchors >= 0).repeat_interleave(BS, dim=1)                  # [B, Q]
    pairs = 0
    for t in cfg.types:
        sliding = t == "sliding_attention"
        m = sdpa_mask(layout, causal_block=sliding, window=cfg.sliding_window if sliding else None)[:, 0]
        pairs += int(m[valid_q].sum())
    per_pair = 4 * cfg.num_attention_heads * cfg.head_dim
    assert f.attention_model == per_pair * pairs * 3
    assert f.attention_computed == per_pair * cfg.num_layers * B * A * BS * (T + A * BS) * 3.5


def test_drafter_hand_count():
    """One row, one document of 10 tokens, one block of 4 at anchor 6, 3 trained slots."""
    hf = build_hf_config(TargetConfig(preset="tiny", vocab_size=V))
    cfg = DrafterConfig(num_layers=1, block_size=4, mask_token_id=0).resolve(hf, [1, 3, 5])
    ids = torch.arange(10)[None]
    doc = torch.zeros(1, 10, dtype=torch.long)
    lm = torch.ones(1, 10, dtype=torch.bool)
    c = drafter_counts(ids, lm, doc, torch.tensor([[6, -1]]), 4)
    assert (c.valid_blocks, c.context_visible, c.trained_slots, c.real_tokens) == (1, 6, 3, 10)
    H, I, nh, nkv, d = 128, 384, 4, 2, 32
    blk, kv, fc = 2 * H * nh * d + 3 * H * I, 2 * H * nkv * d, 3 * H * H
    lin = 2 * fc * 10 * 2 + 2 * (blk * 4 + kv * 14) * 3
    attn = 4 * nh * d * (4 * 6 + 4 * 4) * 3
    f = drafter_step_flops(cfg, c, target_logits=False, sync_free=False)
    assert f.model == lin + 2 * H * V * 3 * 2 + attn
    dense = 2 * fc * 10 * 2 + 2 * (blk * 8 + kv * 18) * 3 + 4 * nh * d * 8 * 18 * 3.5
    assert f.computed == dense + 2 * H * V * 3 * 2
    # sync-free loss (the default): the LM head runs on all 2 x 3 block slots, the model count is unchanged
    g = drafter_step_flops(cfg, c, target_logits=False)
    assert (g.model, g.computed) == (f.model, dense + 2 * H * V * 6 * 2)


def test_rates_divide_by_the_measured_peak():
    r = Flops(model=2e12, computed=3e12).rates(secs=2.0, peak_tflops=4.0, gpus=1)
    assert r == {"tflops": 1.0, "mfu": 0.25, "hfu": 0.375}
    assert (Flops(1.0, 2.0, 0.5, 1.0) + Flops(1.0, 1.0, 0.0, 0.5)) == Flops(2.0, 3.0, 0.5, 1.5)


def test_document_causal_pairs_equal_the_mask():
    _, _, doc, _ = _packed(B=3, T=50, seed=5)
    mask = document_causal_mask(doc)[:, 0]
    real = doc >= 0
    assert attention_pairs_causal(document_lengths(doc)) == int(mask[real].sum())
