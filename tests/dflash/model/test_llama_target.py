"""A Llama-family target through the same code as a Qwen3 one: capture, documents, truncation, the
tied head read from the embedding, the drafter's shapes, and the refusal of other families.

The model is a small random ``LlamaForCausalLM`` saved as a local directory (tied embeddings, no
q/k norms, no ``lm_head.weight`` in the file: SmolLM2's layout), so these run in every CI pass,
the transformers floor included; tests/dflash/test_smollm2_target.py runs the real SmolLM2.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from dflash.model.drafter import DFlashDrafter
from dflash.model.drafter_config import DrafterConfig
from dflash.model.target import TargetConfig, build_hf_config, default_layer_ids, load_shared_head, load_target
from dflash.model.target_config import TARGET_MODEL_TYPES


def _llama_config(**kw):
    from transformers import LlamaConfig

    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, tie_word_embeddings=True,
                  rms_norm_eps=1e-5, rope_theta=100_000.0)
    return LlamaConfig(**{**fields, **kw})


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(_llama_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(llama_dir):
    return load_target(TargetConfig(path=str(llama_dir)), "cpu", num_draft_layers=2)


def _row(T, seed):
    return torch.randint(0, 300, (1, T), generator=torch.Generator().manual_seed(seed))


def test_capture_is_the_layer_outputs_of_a_llama(target):
    """Invariant: the captured features of a Llama are its decoder layers' outputs
    (``output_hidden_states[i + 1]``), as for Qwen3, at the public default layers."""
    ids = _row(20, 0)
    feats, final = target(ids, torch.arange(20)[None], torch.zeros_like(ids))
    hs = target.model(ids, output_hidden_states=True).hidden_states
    assert target.model.config.model_type == "llama" and target.layer_ids == [1, 5] == default_layer_ids(8, 2)
    torch.testing.assert_close(feats, torch.cat([hs[2], hs[6]], dim=-1))
    torch.testing.assert_close(final, hs[-1])


def test_packed_llama_documents_do_not_see_each_other(target):
    """Invariant: with a Llama as with Qwen3, a packed row gives each document what it gets alone."""
    a, b = _row(9, 1), _row(6, 2)
    ids = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(9), torch.arange(6)])[None]
    feats, _ = target(ids, pos, torch.tensor([[0] * 9 + [1] * 6]))
    alone_b, _ = target(b, torch.arange(6)[None], torch.zeros_like(b))
    torch.testing.assert_close(feats[:, 9:], alone_b, atol=1e-5, rtol=1e-4)


def test_truncated_llama_gives_the_same_features(target, llama_dir):
    short = load_target(TargetConfig(path=str(llama_dir)), "cpu", num_draft_layers=2, need_final=False)
    assert len(short.decoder_layers) == 6
    ids = _row(12, 3)
    pos, doc = torch.arange(12)[None], torch.zeros_like(ids)
    torch.testing.assert_close(short(ids, pos, doc, need_final=False)[0], target(ids, pos, doc)[0])


def test_tied_head_is_read_from_the_embedding(target, llama_dir):
    """Invariant: a tied target saved without ``lm_head.weight`` (transformers drops it) gives the
    drafter its embedding as the LM head, one tensor, equal to the target's own head."""
    with safe_open(str(llama_dir / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    head = load_shared_head(TargetConfig(path=str(llama_dir)), "cpu")
    assert head.lm_head.weight is head.embed_tokens.weight
    torch.testing.assert_close(head.lm_head.weight, target.model.lm_head.weight)
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(head.logits(hidden), target.model.lm_head(hidden))


def test_drafter_shapes_come_from_a_smollm2_shaped_llama_config():
    """Invariant: the drafter resolved against SmolLM2-135M's config (30 layers, hidden 576, 9/3 heads,
    no head_dim needed, RoPE base 1e5) has head_dim 576 / 9 = 64, its own q/k norms, and the public
    target layers for 1, 2, 3 and 5 drafter layers."""
    hf = _llama_config(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192)
    assert {k: default_layer_ids(30, k) for k in (1, 2, 3, 5)} == {
        1: [15], 2: [1, 27], 3: [1, 14, 27], 5: [1, 8, 14, 20, 27]}
    cfg = DrafterConfig(num_layers=3, block_size=16, mask_token_id=16).resolve(hf, default_layer_ids(30, 3))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (576, 9, 3, 64)
    assert (cfg.intermediate_size, cfg.rope_theta, cfg.vocab_size) == (1536, 100_000.0, 49152)
    assert cfg.target_layer_ids == [1, 14, 27] and cfg.num_target_layers == 30
    cfg = DrafterConfig(num_layers=1, block_size=8, intermediate_size=64).resolve(hf, default_layer_ids(30, 1))
    drafter = DFlashDrafter(cfg)
    attn = drafter.layers[0].self_attn
    assert attn.q_proj.weight.shape == (9 * 64, 576) and attn.k_norm.weight.shape == (64,)
    assert drafter.fc.weight.shape == (576, 576)  # one captured layer of width 576


def test_other_model_families_are_refused_in_one_line(tmp_path):
    """Invariant: a target directory of a family dflash does not train for is refused where its config
    is read, naming the family and the supported ones, before any weights load."""
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"holds a 'gpt2' model; dflash trains drafters for llama and qwen3 "
                                         r"targets") as info:
        build_hf_config(TargetConfig(path=str(tmp_path)))
    assert "\n" not in str(info.value) and TARGET_MODEL_TYPES == ("llama", "qwen3")


def test_import_gguf_accepts_exactly_the_target_families():
    """Invariant: dflash.import_gguf imports the GGUF architectures a run accepts (kept apart there so
    its --help needs no torch)."""
    from dflash.import_gguf import SUPPORTED_ARCHITECTURES

    assert SUPPORTED_ARCHITECTURES == TARGET_MODEL_TYPES


def test_the_target_runs_the_rope_base_a_transformers_5_config_names(llama_dir, tmp_path):
    """Regression: a config.json written by transformers 5 names the RoPE base only in
    ``rope_parameters``; transformers 4.56 ignored it and built SmolLM2 with base 10,000 instead of
    100,000 while the drafter took 100,000 (greedy output changed from token 13). Invariant: under
    either transformers the target's rotary embedding uses the file's base, as the drafter does."""
    import json
    import shutil

    from dflash.model.drafter_config import rope_theta_of

    shutil.copytree(llama_dir, tmp_path / "t5")
    path = tmp_path / "t5" / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("rope_theta", None)
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_theta": 100_000.0, "rope_type": "default"}
    path.write_text(json.dumps(cfg))
    tcfg = TargetConfig(path=str(tmp_path / "t5"))
    inv_freq = load_target(tcfg, "cpu", num_draft_layers=2).model.model.rotary_emb.inv_freq
    head_dim = 64 // 4
    expected = 1.0 / 100_000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    torch.testing.assert_close(inv_freq, expected)
    assert rope_theta_of(build_hf_config(tcfg)) == 100_000.0
