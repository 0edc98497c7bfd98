"""dflash.model.attention + dflash.model.drafter: the block mask rule, SDPA == flex, no peeking, public names."""

from __future__ import annotations

import pytest
import torch

from dflash.model.attention import flex_block_mask, sdpa_mask, training_layout
from dflash.model.drafter import DFlashDrafter, DrafterConfig

H, V, BS = 64, 100, 4


class _HF:  # the fields DrafterConfig.resolve reads from a transformers config
    hidden_size, num_attention_heads, num_key_value_heads, head_dim = H, 4, 2, 16
    intermediate_size, rms_norm_eps, max_position_embeddings, vocab_size = 128, 1e-6, 512, V
    num_hidden_layers = 6
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}


def make_drafter(types=None, attn="sdpa", seed=0):
    cfg = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=V - 1, layer_types=types,
                        sliding_window=6 if types else None, attn_implementation=attn)
    return DFlashDrafter(cfg.resolve(_HF, [1, 3]), seed=seed).eval()


def packed_batch(seed=0):
    """One row: doc 0 = positions 0..11, doc 1 = 12..21, padding 22..23; anchors incl. an empty slot."""
    g = torch.Generator().manual_seed(seed)
    T = 24
    doc = torch.tensor([[0] * 12 + [1] * 10 + [-1] * 2])
    pos = torch.cat([torch.arange(12), torch.arange(10), torch.zeros(2, dtype=torch.long)])[None]
    feats = torch.randn(1, T, 2 * H, generator=g)
    emb = torch.randn(1, 4, BS, H, generator=g)
    anchors = torch.tensor([[3, 7, 15, -1]])
    return feats, emb, pos, doc, anchors


def reference_mask(pos, doc, anchors, bs, causal, window):
    """The rule of dflash/model/attention.py's module docstring, written out element by element."""
    T, A = doc.shape[1], anchors.shape[1]
    m = torch.zeros(A * bs, T + A * bs, dtype=torch.bool)
    for a in range(A):
        anc = int(anchors[0, a])
        for j in range(bs):
            q = a * bs + j
            qpos = (int(pos[0, anc]) if anc >= 0 else 0) + j
            for t in range(T):
                ok = anc >= 0 and t < anc and doc[0, t] == doc[0, anc] and doc[0, t] >= 0
                if window is not None:
                    ok = ok and qpos - int(pos[0, t]) < window
                m[q, t] = ok
            for jj in range(bs):
                m[q, T + a * bs + jj] = (jj <= j) if causal else True
    return m


@pytest.mark.parametrize("causal,window", [(False, None), (True, 6)])
def test_masks_follow_the_rule(causal, window):
    _, _, pos, doc, anchors = packed_batch()
    lay = training_layout(pos, doc, anchors, BS)
    ref = reference_mask(pos, doc, anchors, BS, causal, window)
    got = sdpa_mask(lay, causal, window)
    assert got.shape == (1, 1, 16, 24 + 16)          # [B, 1, Q, K]: no heads dimension
    assert torch.equal(got[0, 0], ref)
    dense = flex_block_mask(lay, causal, window).to_dense()   # tile-level: must cover the rule
    assert dense.shape[-2:] == (1, 1) and bool(dense.all())


@pytest.mark.parametrize("types", [None, ["sliding_attention", "full_attention"]])
def test_sdpa_and_flex_paths_match(types):
    feats, emb, pos, doc, anchors = packed_batch()
    lay = training_layout(pos, doc, anchors, BS)
    a = make_drafter(types, "sdpa")
    b = make_drafter(types, "flex_attention")
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(a(feats, emb, lay), b(feats, emb, lay), atol=1e-5, rtol=1e-4)


DRAFTER_ATTN = ["sdpa", "flex_attention"]   # every value DrafterConfig accepts


def test_every_accepted_drafter_attn_implementation_is_tested():
    """Invariant: the perturbation test below covers each attn_implementation the config accepts."""
    import typing
    hint = typing.get_type_hints(DrafterConfig)["attn_implementation"]
    assert set(typing.get_args(hint)) == set(DRAFTER_ATTN)


@pytest.mark.parametrize("attn", DRAFTER_ATTN)
@pytest.mark.parametrize("types", [None, ["sliding_attention", "sliding_attention"]])
def test_no_future_token_changes_a_block(types, attn):
    """Invariant (every drafter attn_implementation; flex runs its eager forward on CPU): block a
    depends only on context strictly before its anchor in its own document (and, in sliding
    layers, on earlier slots of its own block); changing earlier context does change it."""
    d = make_drafter(types, attn)
    feats, emb, pos, doc, anchors = packed_batch()
    lay = training_layout(pos, doc, anchors, BS)
    with torch.no_grad():
        base = d(feats, emb, lay)
        # context at and after the anchor of block 0 (anchor 3), and everything in doc 1
        f2 = feats.clone()
        f2[:, 3:] += 5.0
        e2 = emb.clone()
        e2[:, 1:] += 5.0                                  # other blocks' tokens
        out = d(f2, e2, lay)
        torch.testing.assert_close(out[:, 0], base[:, 0])
        # block 2 (anchor 15, doc 1) ignores doc 0 entirely and doc-1 context from 15 on
        f3 = feats.clone()
        f3[:, :12] += 5.0
        f3[:, 15:] += 5.0
        torch.testing.assert_close(d(f3, emb, lay)[:, 2], base[:, 2])
        # context before the anchor does change it
        f4 = feats.clone()
        f4[:, 2] += 5.0
        assert not torch.allclose(d(f4, emb, lay)[:, 0], base[:, 0], atol=1e-4)
        if types:  # causal inside the block: a later slot cannot change an earlier one
            e5 = emb.clone()
            e5[:, 0, 2:] += 5.0
            out = d(feats, e5, lay)
            torch.testing.assert_close(out[:, 0, :2], base[:, 0, :2])
            assert not torch.allclose(out[:, 0, 2:], base[:, 0, 2:], atol=1e-4)
        else:      # bidirectional inside the block
            e5 = emb.clone()
            e5[:, 0, 3] += 5.0
            assert not torch.allclose(d(feats, e5, lay)[:, 0, 1], base[:, 0, 1], atol=1e-4)
    assert torch.isfinite(base).all()                      # the empty slot and doc starts too


def test_state_dict_uses_public_names():
    keys = set(make_drafter().state_dict())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for n in range(2):
        p = f"layers.{n}."
        expected |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        expected |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight",
                     p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        expected |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    assert keys == expected
    sd = make_drafter().state_dict()
    assert sd["fc.weight"].shape == (H, 2 * H)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (2 * 16, H)


def test_config_validation():
    with pytest.raises(ValueError, match="sliding_window"):
        DrafterConfig(num_layers=1, layer_types=["sliding_attention"])
    with pytest.raises(ValueError, match="layer_types"):
        DrafterConfig(num_layers=2, layer_types=["full_attention"])
    with pytest.raises(ValueError, match="hidden_size"):
        DrafterConfig(hidden_size=32).resolve(_HF, [1])
    with pytest.raises(ValueError, match="resolve"):
        DFlashDrafter(DrafterConfig())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: compiled flex_attention and bf16 SDPA")
def test_cuda_compiled_flex_matches_sdpa_bf16():
    feats, emb, pos, doc, anchors = (t.cuda() for t in packed_batch())
    lay = training_layout(pos, doc, anchors, BS)
    a = make_drafter(["sliding_attention", "full_attention"], "sdpa").cuda().bfloat16()
    b = make_drafter(["sliding_attention", "full_attention"], "flex_attention").cuda().bfloat16()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(a(feats, emb, lay).float(), b(feats, emb, lay).float(),
                                   atol=3e-2, rtol=3e-2)


def test_compiled_flex_is_made_before_compiled_layers_first_trace():
    """A drafter whose layers are compiled with flex attention holds the one compiled flex_attention
    from its construction on, so the global its layers read never changes after their first trace
    (it changing from None made every compiled layer compile again on seen shapes)."""
    import dflash.model.drafter as drafter_module

    cfg = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=V - 1, attn_implementation="flex_attention",
                        compile=True)
    saved = drafter_module._compiled_flex
    drafter_module._compiled_flex = None
    try:
        DFlashDrafter(cfg.resolve(_HF, [1, 3]))
        made = drafter_module._compiled_flex
        assert made is not None
        DFlashDrafter(cfg.resolve(_HF, [1, 3]))
        assert drafter_module._compiled_flex is made  # one for the process, never replaced
        assert drafter_module.compiled_flex_attention() is made
    finally:
        drafter_module._compiled_flex = saved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: compiled flex_attention")
def test_cuda_compiled_layers_do_not_compile_again_on_seen_shapes():
    """The second step of a compiled flex drafter on the same shapes compiles nothing (the
    recompile found on an H100: a guard on the compiled flex global failing once it was set)."""
    from torch._dynamo.utils import counters

    import dflash.model.drafter as drafter_module

    torch._dynamo.reset()  # as in a fresh process: no earlier test's graphs, no recompile limit reached
    counters.clear()
    drafter_module._compiled_flex = None
    cfg = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=V - 1, attn_implementation="flex_attention",
                        compile=True)
    d = DFlashDrafter(cfg.resolve(_HF, [1, 3])).cuda().bfloat16().train()
    feats, emb, pos, doc, anchors = (t.cuda() for t in packed_batch())
    lay = training_layout(pos, doc, anchors, BS)

    def step():
        out = d(feats.bfloat16(), emb.bfloat16().requires_grad_(True), lay)
        out.float().square().mean().backward()

    step()
    torch.cuda.synchronize()
    before = counters["stats"]["unique_graphs"]
    assert before >= 1  # the layers did compile: the count below is live
    step()
    torch.cuda.synchronize()
    assert counters["stats"]["unique_graphs"] == before
