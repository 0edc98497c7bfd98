"""The peers benchmark's plumbing (benchmarks/peers), each peer in its own environment:

* speculators' own data loader reads the cache this project writes and yields the target's hidden
  states, on which its DFlash model takes a finite training step; a checkpoint its trainer writes
  (``--dry-run``, the same ``save_pretrained``) becomes a drafter directory with the same tensors,
  which ``dflash.eval`` decodes;
* SpecForge's own reader and normaliser read its cache as the target's hidden states, its config
  resolution accepts the run ``python -m benchmarks.peers.run`` starts, and a checkpoint of its drafter,
  exported by its own ``to_hf``, becomes a drafter directory with the same tensors;
* a public-layout directory (what SpecForge's ``to_hf`` export writes) converts with the same tensors;
* the recipe gives speculators the cache's mask token, and its eval takes the quality prompts for the
  shipped target only (test_peers_llama.py runs the peers against SmolLM2, a Llama).

Both trainers need CUDA; they run in ``python -m benchmarks.peers.run``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.peers.cache import cache_layer_ids
from benchmarks.peers.convert import NotRepresentable, convert, drafter_config, layer_types
from benchmarks.peers.specforge_config import specforge_config

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "dflash" / "assets" / "target-sharegpt-7m"
GRAPH = ROOT / "examples" / "sharegpt-target-h200.toml"
NO_STACK = ("DFLASH_SPECULATORS_PYTHON unset: speculators 0.9.0's venv "
            '(eval "$(bash tests/interop_setup.sh .stacks)" builds it; CI does)')
NO_FORGE = ("DFLASH_SPECFORGE_PYTHON or DFLASH_SPECFORGE_SRC unset: SpecForge 0.2.0's venv and unpacked wheel "
            '(eval "$(bash tests/interop_setup.sh .stacks)" builds them; CI does)')


def _spec(kind="dflash", types=None, window=None, non_causal=False, vocab=4096, **extra) -> dict:
    tl = {"num_hidden_layers": 2, "layer_types": types or ["full_attention"] * 2, "sliding_window": window,
          "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "intermediate_size": 768, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1e4},
          "max_position_embeddings": 4096, "vocab_size": 4096}
    return {"speculators_model_type": kind, "transformer_layer_config": tl, "draft_vocab_size": vocab,
            "block_size": 16, "mask_token_id": 3, "aux_hidden_state_layer_ids": [1, 3],
            "sliding_window_non_causal": non_causal, **extra}


def test_the_cache_captures_the_drafters_layers_then_the_last_and_refuses_a_drafter_reading_the_last():
    assert cache_layer_ids([1, 3, 5], 8) == [1, 3, 5, 7]
    with pytest.raises(ValueError, match="last layer"):
        cache_layer_ids([1, 7], 8)


def test_layer_types_keep_causal_sliding_layers_and_map_a_window_that_never_binds_to_full_attention():
    sliding = ["sliding_attention", "full_attention"]
    assert layer_types(_spec(types=sliding, window=2048)) == (sliding, 2048)
    assert layer_types(_spec(types=sliding, window=4096, non_causal=True)) == (["full_attention"] * 2, None)
    with pytest.raises(NotRepresentable, match="--full-attention-indices"):
        layer_types(_spec(types=sliding, window=2048, non_causal=True))


def test_drafter_config_maps_each_type_and_refuses_what_the_public_layout_lacks():
    cfg = drafter_config(_spec("dflash2", conv_kernel_size=2, conv_group_size=16, selector_top_k=8,
                               selector_rank=64))
    assert (cfg.variant, cfg.selector_top_k, cfg.selector_rank, cfg.target_layer_ids) == ("dflash2", 8, 64, [1, 3])
    cfg = drafter_config(_spec("xpress", xpress_rank=32, xpress_mlp_ratio=3, num_jacobi_passes=4))
    assert (cfg.variant, cfg.xpress_rank, cfg.xpress_mlp_ratio, cfg.jacobi_passes) == ("xpress", 32, 3, 4)
    with pytest.raises(NotRepresentable, match="t2d/d2t"):
        drafter_config(_spec(vocab=1024))
    with pytest.raises(NotRepresentable, match="eagle3"):
        drafter_config(_spec("eagle3"))


def _stack() -> str:
    py = os.environ.get("DFLASH_SPECULATORS_PYTHON")
    if not py:
        pytest.skip(NO_STACK)
    return py


def _run_spec(py: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([py, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _own_data(tmp_path: Path) -> Path:
    """Twelve conversations of a user's own JSONL."""
    data = tmp_path / "own.jsonl"
    answer = "by keeping every timetable honest and short. " * 8  # enough trained tokens for two blocks
    with open(data, "w") as f:
        for i in range(12):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: how do trains run on time?"},
                                             {"role": "assistant", "content": f"Answer {i}: {answer}"}]}) + "\n")
    return data


def _cache(tmp_path: Path, data: Path, *peers: str, graph: Path = GRAPH, more: tuple[str, ...] = ()) -> dict:
    """benchmarks/peers/cache.py of ``graph`` (``more``: KEY=VALUE settings) for ``peers`` over ``data``
    (2 held out) -> tmp_path/cache; its cache.json."""
    sets = ["--set", f'data.source="{data}"', "--set", "data.holdout=2", "--set", "data.max_samples=12"]
    sets += [w for kv in more for w in ("--set", kv)]
    peer_args = [a for p in peers for a in ("--peer", p)]
    subprocess.run([sys.executable, "-m", "benchmarks.peers.cache", str(graph), "-o", str(tmp_path / "cache"),
                    "--device", "cpu", *peer_args, *sets], cwd=ROOT, check=True, capture_output=True, timeout=300)
    return json.loads((tmp_path / "cache" / "cache.json").read_text())


def _features(row: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [1, n], [n, 4, H] bf16)``: a conversation through this project's target, layers 1, 3, 5
    and the last, before its norm."""
    from dflash.model.target import TargetConfig, load_target

    ids = torch.tensor(row["input_ids"])[None]
    target = load_target(TargetConfig(path=str(TARGET), dtype="float32", layer_ids=[1, 3, 5, 7]), "cpu", 3,
                         need_final=False)
    feats, _ = target(ids, torch.arange(ids.shape[1])[None], torch.zeros_like(ids), need_final=False)
    return ids, feats[0].view(ids.shape[1], 4, 256).to(torch.bfloat16)


READ_BACK = """
import argparse, json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
from hs_connectors import FileTransfer
from speculators.model import SpeculatorModel
from speculators.train.cli import build_draft_model, parse_vocab_mappings
from speculators.train.config import TrainConfig
from speculators.train.data import ArrowDataset
from speculators.train.dataloader import create_train_val_loaders
d, target = Path(sys.argv[1]), sys.argv[3]
shape = json.loads(sys.argv[4])  # layers, block, hidden, extra: the drafter's shape and more trainer arguments
ds = ArrowDataset(max_len=4096, datapath=str(d), transfer=FileTransfer(d / "hidden_states"), on_missing="raise",
                  train_ratio=1.0)
save_file({k: v.contiguous() for k, v in ds[0].items()}, sys.argv[2])
# one step of speculators' own DFlash model on a packed batch of its own loader (eager attention: its
# flex attention has no backward on a CPU)
k = len(shape["layers"])
args = TrainConfig.resolve(["--speculator-type", "dflash", "--verifier-name-or-path", target, "--data-path", str(d),
                            "--num-layers", str(k), "--target-layer-ids", *map(str, shape["layers"]),
                            "--block-size", str(shape["block"]), "--full-attention-indices", *map(str, range(k)),
                            "--draft-attn-impl", "eager", "--loss-implementation", "eager", "--max-anchors", "8",
                            *shape.get("extra", [])]).flatten()
ns = argparse.Namespace(**args)
cls = SpeculatorModel.registry["dflash"]
d2t, t2d, vocab = parse_vocab_mappings(ns)
model = build_draft_model(ns, cls, t2d, d2t, vocab).float()
train, _ = create_train_val_loaders(
    data_path=str(d), total_seq_len=256, hidden_states_dtype=torch.float32, transfer=FileTransfer(d / "hidden_states"),
    vllm_endpoint="", on_missing="raise", verifier_name_or_path=target, request_timeout=1, max_retries=0,
    generation_validation_retries=0, max_consecutive_generation_failures=1, hidden_size=shape["hidden"],
    num_target_layers=k,
    num_workers=0, prefetch_factor=None, preprocess=None, train_data_ratio=0.9)
batch = next(iter(train))
batch.pop("error_records")
loss = model(**batch, **cls.get_trainer_kwargs(**args)[0])[1]
loss.backward()
grads = [p.grad for p in model.parameters() if p.grad is not None]
# the verifier's tensors it trains against: its embedding, LM head (tied or not) and final norm
save_file({"embed_tokens": model.embed_tokens.weight.detach().contiguous(),
           "verifier_lm_head": model.verifier_lm_head.weight.detach().contiguous(),
           "verifier_norm": model.verifier_norm.weight.detach().contiguous()}, sys.argv[2] + ".verifier")
print(json.dumps({"rows": len(ds), "loss": loss.item(), "grads": len(grads), "mask_token_id": model.mask_token_id,
                  "grads_finite": all(bool(torch.isfinite(g).all()) for g in grads)}))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_speculators_reads_the_cache_as_the_targets_hidden_states_and_its_checkpoints_convert(tmp_path):
    py = _stack()
    from dflash.checkpoint.model_files import load_drafter
    from dflash.model.target import TargetConfig

    data = _own_data(tmp_path)
    info = _cache(tmp_path, data, "speculators")
    assert (info["conversations"], info["heldout_left_out"]) == (10, 2)
    assert info["captured_layer_ids"] == [1, 3, 5, 7]
    out = tmp_path / "cache" / "speculators"
    _run_spec(py, [str(ROOT / "benchmarks" / "peers" / "speculators_rows.py"), str(out)], tmp_path)
    shape = json.dumps({"layers": [1, 3, 5], "block": 16, "hidden": 256})
    back = _run_spec(py, ["-c", READ_BACK, str(out), str(tmp_path / "sample.safetensors"), str(TARGET), shape], tmp_path)
    step = json.loads(back.stdout.splitlines()[-1])
    assert step["rows"] == 10
    assert step["grads"] > 0 and step["grads_finite"] and 0 < step["loss"] < 20, step  # speculators trains on it
    got = load_file(str(tmp_path / "sample.safetensors"))

    row = json.loads((out / "rows.jsonl").read_text().splitlines()[0])
    ids, feats = _features(row)
    assert torch.equal(got["input_ids"], ids[0])
    assert torch.equal(got["loss_mask"], torch.tensor(row["loss_mask"]))
    assert 0 < int(got["loss_mask"].sum()) < ids.shape[1]  # the assistant's tokens only
    assert torch.equal(got["hidden_states"], feats[:, :3].flatten(1))
    assert torch.equal(got["verifier_last_hidden_states"], feats[:, 3])

    for kind in ("dflash", "dflash2", "xpress"):
        ckpt = tmp_path / f"spec-{kind}"
        _run_spec(py, ["-m", "speculators.train", "--speculator-type", kind, "--verifier-name-or-path", str(TARGET),
                       "--data-path", str(out), "--num-layers", "3", "--target-layer-ids", "1", "3", "5",
                       "--block-size", "16", "--full-attention-indices", "0", "1", "2", "--save-path", str(ckpt),
                       "--dry-run", "--logger", ""], tmp_path)
        conv = tmp_path / f"conv-{kind}"
        cfg = convert(ckpt, conv, TargetConfig(path=str(TARGET)))
        assert (cfg.variant, cfg.num_layers, cfg.block_size, cfg.target_layer_ids) == (kind, 3, 16, [1, 3, 5])
        drafter, _, tc = load_drafter(conv)
        theirs = load_file(str(ckpt / "model.safetensors"))
        ours = drafter.state_dict()
        assert set(ours) == set(theirs)  # their file holds no verifier tensor: the same keys, none left over
        assert all(torch.equal(ours[k], theirs[k].float()) for k in ours)
        assert Path(tc.path).is_absolute()

    eval_out = subprocess.run([sys.executable, "-m", "dflash.eval", str(tmp_path / "conv-dflash2"), "--data",
                               str(data), "--num-prompts", "1", "--max-new-tokens", "8", "--no-speedup", "--json"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert eval_out.returncode == 0, eval_out.stderr[-2000:]
    res = json.loads(eval_out.stdout)
    assert len(res["per_prompt"]) == 1 and res["tau"] >= 1.0 and res["block_size"] == 16


FORGE_READ_BACK = """
import json, sys
from safetensors.torch import save_file
from specforge.algorithms.common.dflash_family_data import normalize_offline_sample
from specforge.application.composition import resolve_run
from specforge.config import load_config
from specforge.runtime.data_plane.feature_store import load_feature_file
from specforge.runtime.data_plane.offline_reader import list_feature_files
files = list_feature_files(sys.argv[1])
first = [f for f in files if f.endswith("data_0.ckpt")][0]
sample = normalize_offline_sample(load_feature_file(first), max_len=1024)
save_file({k: v.contiguous() for k, v in sample.items()}, sys.argv[2])
resolve_run(load_config(sys.argv[3], []))  # the run's config: schema, algorithm, offline mode, draft config
print(json.dumps({"files": len(files)}))
"""

FORGE_CHECKPOINT = """
import os, sys, torch
from safetensors.torch import save_file
from specforge.export.checkpoint_io import STATE_FILE
from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
# a checkpoint as SpecForge's trainer saves one ({run_id}-step{N}/training_state.pt), of its own
# DFlash drafter built from the run's draft config, randomly initialised
model = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(sys.argv[1]), torch_dtype=torch.bfloat16)
step = os.path.join(sys.argv[2], "specforge-run-step7")
os.makedirs(step)
torch.save({"draft_state_dict": model.state_dict()}, os.path.join(step, STATE_FILE))
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, sys.argv[3])
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def _forge(py: str, src: str, cwd: Path):
    """A runner of SpecForge's interpreter (its unpacked source first on the path, offline): call it
    with the interpreter's arguments; it asserts exit 0 and returns the stdout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=src, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")

    def forge(*args: str) -> str:
        done = subprocess.run([py, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                              check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    return forge


def test_specforge_reads_its_cache_accepts_the_runs_config_and_its_export_converts(tmp_path):
    py, src = os.environ.get("DFLASH_SPECFORGE_PYTHON"), os.environ.get("DFLASH_SPECFORGE_SRC")
    if not (py and src):
        pytest.skip(NO_FORGE)
    from dflash.checkpoint.model_files import load_drafter
    from dflash.model.target import TargetConfig

    info = _cache(tmp_path, _own_data(tmp_path), "specforge")
    cache = tmp_path / "cache"
    assert info["peers"] == ["specforge"] and not (cache / "speculators").exists()
    draft = json.loads((cache / "draft_config.json").read_text())
    assert (draft["architectures"], draft["num_hidden_layers"], draft["dflash_config"]["target_layer_ids"]) == \
        (["DFlashDraftModel"], 3, [1, 3, 5])
    run = tmp_path / "sf-run"
    cfg = specforge_config(cache, run, max_steps=10)
    assert cfg["training"]["batch_size"] == 16  # 16 rows of 1024 tokens: the graph's 16,384 tokens per step
    Path(f"{run}.yaml").write_text(json.dumps(cfg))
    forge = _forge(py, src, tmp_path)

    out = forge("-c", FORGE_READ_BACK, str(cache / "specforge"), str(tmp_path / "sample.safetensors"), f"{run}.yaml")
    assert json.loads(out.splitlines()[-1])["files"] == 10
    got = load_file(str(tmp_path / "sample.safetensors"))
    ids = got["input_ids"][0]
    _, feats = _features({"input_ids": ids.tolist()})
    assert torch.equal(got["hidden_states"][0], feats[:, :3].flatten(1))  # the drafter's layers, no last one
    assert 0 < int(got["loss_mask"].sum()) < ids.shape[0]

    # its checkpoint -> its own HF export (specforge.export.to_hf, as benchmarks.peers.run calls it) -> a drafter directory
    forge("-c", FORGE_CHECKPOINT, str(cache / "draft_config.json"), str(run), str(tmp_path / "theirs.safetensors"))
    forge("-m", "specforge.export.to_hf", "--checkpoint", str(run), "--draft-config", str(cache / "draft_config.json"),
          "--output-dir", str(tmp_path / "hf"), "--embedding-source", str(TARGET))
    cfg = convert(tmp_path / "hf", tmp_path / "conv", TargetConfig(path=str(TARGET)))
    assert (cfg.variant, cfg.num_layers, cfg.block_size, cfg.target_layer_ids) == ("dflash", 3, 16, [1, 3, 5])
    ours, theirs = load_drafter(tmp_path / "conv")[0].state_dict(), load_file(str(tmp_path / "theirs.safetensors"))
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k].float()) for k in ours)


def test_a_public_layout_directory_converts_with_the_same_tensors(tmp_path):
    """What SpecForge's ``to_hf`` writes (z-lab's layout, which SpecForge's class loads: the interop
    tests) becomes a drafter directory holding the same weights."""
    from dflash.checkpoint.model_files import load_drafter
    from dflash.export import export_drafter
    from dflash.model.drafter import DFlashDrafter, DrafterConfig
    from dflash.model.target import TargetConfig, build_hf_config

    tc = TargetConfig(path=str(TARGET))
    hf = build_hf_config(tc)
    cfg = DrafterConfig(num_layers=2, block_size=8, mask_token_id=3).resolve(hf, [1, 4])
    drafter = DFlashDrafter(cfg, seed=0)
    export_drafter(drafter, tmp_path / "hf", dtype=torch.float32)
    got = convert(tmp_path / "hf", tmp_path / "conv", tc)
    assert (got.num_layers, got.block_size, got.target_layer_ids, got.num_target_layers) == (2, 8, [1, 4], 8)
    back, _, _ = load_drafter(tmp_path / "conv")
    want = drafter.state_dict()
    assert set(back.state_dict()) == set(want)
    assert all(torch.equal(back.state_dict()[k], want[k]) for k in want)


# --- a Llama target: SmolLM2-135M-Instruct (30 layers, tied embeddings, ChatML, no mask token) ---------------
SMOL_GRAPH = ROOT / "examples" / "smollm2-cpu.toml"
SMOL_LAYERS = [1, 14, 27]  # the public rule for 3 drafter layers of 30: evenly spaced over [1, 30 - 3]


def _peers(tmp_path: Path, *argv: str):
    """A :class:`benchmarks.peers.run.Peers` of ``argv`` (phase first), its scratch under tmp_path."""
    from benchmarks.peers.run import Peers, build_parser

    args = build_parser().parse_args([*argv[:1], str(tmp_path / "out"), "--scratch", str(tmp_path / "s"), *argv[1:]])
    (tmp_path / "s" / "peer-data").mkdir(parents=True, exist_ok=True)
    return Peers(args)


def test_speculators_is_given_the_caches_mask_token(tmp_path):
    """speculators resolves an unset mask token from the tokenizer alone: SmolLM2's has none and no
    spare embedding row, so it would train with the pad token (<|im_end|>, 2) where ours uses 16."""
    peers = _peers(tmp_path, "train")
    info = {"target": "/t", "drafter_layers": 3, "target_layer_ids": SMOL_LAYERS, "block_size": 8,
            "tokens_per_batch": 256, "mask_token_id": 16}
    (peers.data / "cache.json").write_text(json.dumps(info))
    argv = [str(a) for a in peers.spec_argv("dflash2", 100, tmp_path / "save")]
    assert argv[argv.index("--mask-token-id") + 1] == "16"
    assert argv[argv.index("--target-layer-ids") + 1:argv.index("--block-size")] == ["1", "14", "27"]
    del info["mask_token_id"]  # a cache written before the field: speculators resolves it, as it did
    (peers.data / "cache.json").write_text(json.dumps(info))
    assert "--mask-token-id" not in peers.spec_argv("dflash", 100, tmp_path / "save")


def test_eval_takes_the_quality_prompts_only_for_the_shipped_target(tmp_path, monkeypatch):
    """The quality prompts are held out of the shipped 7M target's data only; SmolLM2's regenerated
    answers cover them, so eval refuses them there (before decoding anything) unless --prompts is given."""
    from benchmarks.peers import run

    written = []
    monkeypatch.setattr(run.carry, "held_out_prompts", lambda path, num: written.append((path, num)))
    monkeypatch.setattr(run, "run", lambda *a, **k: pytest.fail(f"nothing may run: {a}"))
    smol = _peers(tmp_path, "eval", "--graph", str(SMOL_GRAPH))
    assert smol.eval_prompts() is None and smol.evaluate() == 1 and not written
    assert _peers(tmp_path, "eval", "--graph", str(SMOL_GRAPH), "--prompts", "mtbench").eval_prompts() == "mtbench"
    assert _peers(tmp_path, "eval").eval_prompts() == str(tmp_path / "s" / "prompts.jsonl")  # the 7M graph
    assert written == [(tmp_path / "s" / "prompts.jsonl", 32)]
