"""The peers benchmark (benchmarks/peers) against a Llama target, SmolLM2-135M-Instruct (30 layers,
hidden 576, 9/3 heads, tied embeddings, a ChatML template with a default system prompt, no mask
token: ``examples/smollm2-cpu.toml`` sets ``drafter.mask_token_id = 16``), each peer in its own
environment, as tests/benchmarks/test_peers.py does for the shipped Qwen3 target:

* the cache holds the public rule's layers for 30 layers ([1, 14, 27] for 3 drafter layers) and the
  last layer's output before the final norm, as transformers' Llama computes them; its loss mask is
  the assistant's answers only;
* speculators' own loader reads it, its DFlash model takes a finite step with the verifier's tied
  embedding as LM head and its final norm, and the trainer command the recipe builds gives it the
  graph's mask token; its checkpoints convert with the same tensors and SmolLM2's shape;
* SpecForge resolves the run, builds its drafter with the graph's layers and mask token, and its
  ``to_hf`` export (the embedding from a checkpoint without ``lm_head.weight``) converts.

Each needs SmolLM2's GGUF (the ``smollm2_dir`` fixture, which skips without it) and a peer's stack
(skipped without it, saying how to build it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.peers.convert import convert
from benchmarks.peers.specforge_config import specforge_config
from tests.benchmarks.test_peers import (
    FORGE_CHECKPOINT,
    FORGE_READ_BACK,
    NO_FORGE,
    NO_STACK,
    READ_BACK,
    ROOT,
    SMOL_GRAPH,
    SMOL_LAYERS,
    _cache,
    _forge,
    _own_data,
    _peers,
    _run_spec,
    _stack,
)


def _smol_cache(tmp_path: Path, smollm2_dir, *peers: str) -> tuple[dict, Path]:
    """SmolLM2's cache (3 drafter layers, the graph's mask token 16); its cache.json and the target."""
    target = smollm2_dir[0]
    info = _cache(tmp_path, _own_data(tmp_path), *peers, graph=SMOL_GRAPH,
                  more=(f'target.path="{target}"', "drafter.num_layers=3"))
    assert (info["target_layer_ids"], info["captured_layer_ids"]) == (SMOL_LAYERS, [*SMOL_LAYERS, 29])
    assert (info["mask_token_id"], info["num_target_layers"], info["hidden_size"]) == (16, 30, 576)
    return info, target


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not os.environ.get("DFLASH_SPECULATORS_PYTHON"), reason=NO_STACK)  # before SmolLM2's import
def test_speculators_on_a_llama_target_reads_its_layers_trains_with_its_mask_token_and_converts(tmp_path, smollm2_dir):
    py = _stack()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.checkpoint.model_files import load_drafter
    from dflash.model.target import TargetConfig

    _, target = _smol_cache(tmp_path, smollm2_dir, "speculators")
    out = tmp_path / "cache" / "speculators"
    _run_spec(py, [str(ROOT / "benchmarks" / "peers" / "speculators_rows.py"), str(out)], tmp_path)
    mask = ["--mask-token-id", "16"]  # as benchmarks.peers.run passes it (Peers.spec_argv)
    shape = json.dumps({"layers": SMOL_LAYERS, "block": 8, "hidden": 576, "extra": mask})
    sample = tmp_path / "sample.safetensors"
    step = json.loads(_run_spec(py, ["-c", READ_BACK, str(out), str(sample), str(target), shape],
                                tmp_path).stdout.splitlines()[-1])
    assert step["rows"] == 10 and step["mask_token_id"] == 16
    assert step["grads"] > 0 and step["grads_finite"] and 0 < step["loss"] < 30, step
    got = load_file(str(sample))

    # the target's own layers (transformers' Llama, hooked): each decoder layer's output, the last before the norm
    llama = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    seen = {}
    for i in (*SMOL_LAYERS, 29):
        llama.model.layers[i].register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o[0] if isinstance(o, tuple) else o))
    ids = got["input_ids"][None]
    with torch.no_grad():
        normed = llama(ids, output_hidden_states=True).hidden_states[-1][0]

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:  # bf16 storage: one rounding step apart at most
        return bool(((a.float() - b).abs() <= b.abs() * 2**-7 + 1e-2).all())

    hs = got["hidden_states"].view(ids.shape[1], 3, 576)
    assert all(close(hs[:, j], seen[i][0]) for j, i in enumerate(SMOL_LAYERS))
    last = got["verifier_last_hidden_states"]
    assert close(last, seen[29][0]) and not close(last, normed)  # before the final norm, which speculators applies
    tok = AutoTokenizer.from_pretrained(str(target))
    trained = tok.decode(ids[0][got["loss_mask"].bool()])
    assert trained.startswith("Answer ") and trained.endswith("<|im_end|>") and "<|im_start|>" not in trained
    assert tok.decode(ids[0]).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    verifier = load_file(str(sample) + ".verifier")  # tied: the embedding is the LM head; the final norm loaded
    embed = llama.model.embed_tokens.weight
    assert torch.equal(verifier["embed_tokens"], embed) and torch.equal(verifier["verifier_lm_head"], embed)
    assert torch.equal(verifier["verifier_norm"], llama.model.norm.weight)

    spec = _peers(tmp_path, "train", "--spec-python", py)
    spec.data = tmp_path / "cache"
    for kind in ("dflash", "dflash2", "xpress"):  # the trainer's own command, as the recipe builds it
        ckpt = tmp_path / f"spec-{kind}"
        argv = [str(a) for a in spec.spec_argv(kind, 10, ckpt)]
        _run_spec(argv[0], [*argv[1:], "--dry-run"], tmp_path)
        cfg = convert(ckpt, tmp_path / f"conv-{kind}", TargetConfig(path=str(target)))
        assert (cfg.variant, cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id) == (kind, 8, SMOL_LAYERS, 16)
        assert (cfg.num_target_layers, cfg.rope_theta, cfg.vocab_size, cfg.num_key_value_heads) == (30, 1e5, 49152, 3)
        drafter, _, _ = load_drafter(tmp_path / f"conv-{kind}")
        theirs, ours = load_file(str(ckpt / "model.safetensors")), drafter.state_dict()
        assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k].float()) for k in ours)


FORGE_MODEL = """
import json, sys, torch
from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
m = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(sys.argv[1]), torch_dtype=torch.bfloat16)
print(json.dumps({"target_layer_ids": list(m.target_layer_ids), "mask_token_id": m.config.dflash_config["mask_token_id"],
                  "block_size": int(m.block_size)}))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not (os.environ.get("DFLASH_SPECFORGE_PYTHON") and os.environ.get("DFLASH_SPECFORGE_SRC")),
                    reason=NO_FORGE)  # before SmolLM2's import
def test_specforge_on_a_llama_target_resolves_its_run_and_its_export_converts(tmp_path, smollm2_dir):
    py, src = os.environ["DFLASH_SPECFORGE_PYTHON"], os.environ["DFLASH_SPECFORGE_SRC"]  # the skipif's
    from dflash.checkpoint.model_files import load_drafter
    from dflash.model.target import TargetConfig

    _, target = _smol_cache(tmp_path, smollm2_dir, "specforge")
    cache, run = tmp_path / "cache", tmp_path / "sf-run"
    draft = json.loads((cache / "draft_config.json").read_text())
    assert (draft["num_target_layers"], draft["rope_theta"], draft["tie_word_embeddings"]) == (30, 1e5, False)
    cfg = specforge_config(cache, run, max_steps=10)
    assert cfg["training"]["batch_size"] == 1  # one row of 256 tokens: the graph's tokens per step
    Path(f"{run}.yaml").write_text(json.dumps(cfg))
    forge = _forge(py, src, tmp_path)

    assert json.loads(forge("-c", FORGE_READ_BACK, str(cache / "specforge"), str(tmp_path / "s.safetensors"),
                            f"{run}.yaml").splitlines()[-1])["files"] == 10
    built = json.loads(forge("-c", FORGE_MODEL, str(cache / "draft_config.json")).splitlines()[-1])
    assert built == {"target_layer_ids": SMOL_LAYERS, "mask_token_id": 16, "block_size": 8}
    forge("-c", FORGE_CHECKPOINT, str(cache / "draft_config.json"), str(run), str(tmp_path / "theirs.safetensors"))
    forge("-m", "specforge.export.to_hf", "--checkpoint", str(run), "--draft-config", str(cache / "draft_config.json"),
          "--output-dir", str(tmp_path / "hf"), "--embedding-source", str(target))  # no lm_head.weight: tied
    got = convert(tmp_path / "hf", tmp_path / "conv", TargetConfig(path=str(target)))
    assert (got.target_layer_ids, got.mask_token_id, got.num_target_layers) == (SMOL_LAYERS, 16, 30)
    ours, theirs = load_drafter(tmp_path / "conv")[0].state_dict(), load_file(str(tmp_path / "theirs.safetensors"))
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k].float()) for k in ours)
