"""A DFlash2 drafter exported to z-lab's DFlash2 layout loads into z-lab's ``DFlash2DraftModel``
(no missing or unexpected key, the same block states and drafts), into transformers' AutoModel
through our modeling file, and back into ours."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash.export import export_drafter, load_exported
from dflash.export import main as export_main
from dflash.model.attention import decode_layout
from dflash.model.drafter import DFlashDrafter, DrafterConfig, resolve_drafter_config
from dflash.model.target import TargetConfig
from tests.dflash.export.test_export import ABOUT
from tests.helpers import save_checkpoint
from tests.zlab import zlab_model

pytestmark = pytest.mark.timeout(300)

TCFG = TargetConfig(preset="tiny", seed=4, vocab_size=4096, tokenizer="builtin:tiny")
T, BS, H = 12, 4, 128


def make(types=None) -> DFlashDrafter:
    """A DFlash2 drafter whose convolutions and selector are far from their identity/zero init."""
    dc = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=4095, layer_types=types,
                       sliding_window=8 if types else None, variant="dflash2", selector_rank=8,
                       selector_top_k=5)
    d = DFlashDrafter(resolve_drafter_config(dc, TCFG), seed=3).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if "conv" in n or "candidate_selector" in n:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "base_kernel" in n else 0.3))
    return d


def inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, T, 2 * H, generator=g), torch.randn(1, BS, H, generator=g)


def ours(d, feats, emb):
    with torch.no_grad():
        return d(feats, emb[:, None], decode_layout(T, T, BS, "cpu")).reshape(1, BS, H)


def our_draft(d, hidden, head_w, anchor):
    sel = d.candidate_selector
    unary, cand = sel.candidates(hidden @ head_w.T)
    return sel.walk(hidden, unary, cand, anchor)[0]


@pytest.mark.parametrize("types", [None, ["sliding_attention", "full_attention"]])
def test_export_layout_and_round_trip(tmp_path, types):
    """config.json says DFlash2DraftModel with the four DFlash2 fields in dflash_config; the file
    holds the published tensor names (codebooks bare); load_exported rebuilds the same drafter."""
    d = make(types)
    export_drafter(d, tmp_path, torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlash2DraftModel"}
    assert cfg["dflash_config"] == {"block_size": BS, "mask_token_id": 4095, "target_layer_ids": d.cfg.target_layer_ids,
                                    "conv_kernel_size": 2, "conv_group_size": 16, "selector_top_k": 5,
                                    "selector_rank": 8}
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == set(d.state_dict())
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.1.mlp_conv.base_kernel",
            "layers.0.attention_conv.kernel_projection.weight"} <= names
    back, bcfg = load_exported(tmp_path)
    fields = ("variant", "conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank", "block_size")
    assert all(getattr(bcfg, f) == getattr(d.cfg, f) for f in fields) and bcfg.types == d.cfg.types
    feats, emb = inputs()
    torch.testing.assert_close(ours(back, feats, emb), ours(d, feats, emb), rtol=0, atol=0)


def test_export_cli_writes_a_dflash2_checkpoint(tmp_path):
    """python -m dflash.export on a DFlash2 checkpoint writes the DFlash2 layout."""
    d, ck = make(), tmp_path / "ckpt"
    ck.mkdir()
    save_checkpoint(ck, d, d.cfg, TCFG)
    assert export_main([str(ck), "-o", str(tmp_path / "out"), "--dtype", "float32"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]


@pytest.mark.parametrize("types", [None, ["sliding_attention", "full_attention"]])
def test_zlab_dflash2_loads_the_export_with_every_key_and_drafts_the_same(tmp_path, types):
    """Invariant (the export serves where DFlash2 is served): z-lab's DFlash2DraftModel.from_pretrained
    on our export has no missing, unexpected or mismatched key; its block hidden states equal ours
    and its greedy selector path (``propose``) equals our walk, full and sliding-window layers."""
    zl = zlab_model()
    d = make(types)
    export_drafter(d, tmp_path, torch.float32, about=ABOUT)  # dflash_target, dflash_eval: ignored
    model, info = zl.DFlash2DraftModel.from_pretrained(str(tmp_path), output_loading_info=True,
                                                        dtype=torch.float32)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    feats, emb = inputs()
    with torch.no_grad():
        got = model.eval()(position_ids=torch.arange(T + BS)[None], noise_embedding=emb, target_hidden=feats)
    want = ours(d, feats, emb)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    head = torch.nn.Linear(H, 4096, bias=False)
    torch.nn.init.normal_(head.weight, generator=torch.Generator().manual_seed(2))
    anchor = torch.tensor([7])
    with torch.no_grad():
        z_tokens, _, _ = model.propose(want[:, 1:], anchor, head, 0.0)
        assert torch.equal(z_tokens, our_draft(d, want[:, 1:], head.weight, anchor))


CHILD = r"""
import json, sys
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

d, io = sys.argv[1], sys.argv[2]
model, info = AutoModel.from_pretrained(d, trust_remote_code=True, output_loading_info=True, dtype=torch.float32)
inp = load_file(io + "/in.safetensors")
with torch.no_grad():
    out = model(target_hidden=inp["feats"], noise_embedding=inp["emb"], return_dict=True).last_hidden_state
    draft = model.select(out[:, 1:], out[:, 1:] @ inp["head"].T, inp["anchor"])
save_file({"out": out.contiguous(), "draft": draft}, io + "/out.safetensors")
print(json.dumps({"class": type(model).__name__, "missing": sorted(info["missing_keys"]),
                  "unexpected": sorted(info["unexpected_keys"]),
                  "dflash_imported": sorted(m for m in sys.modules if m == "dflash" or m.startswith("dflash."))}))
"""


def test_automodel_loads_the_dflash2_export_through_our_modeling_file(tmp_path):
    """AutoModel + trust_remote_code on a DFlash2 export builds our modeling file's
    DFlash2DraftModel with every key used, imports no dflash module, and computes our block
    hidden states and our selector's drafts."""
    d = make(["sliding_attention", "full_attention"])
    out_dir = tmp_path / "export"
    export_drafter(d, out_dir, torch.float32, about=ABOUT)
    feats, emb = inputs()
    head = torch.randn(4096, H, generator=torch.Generator().manual_seed(2))
    anchor = torch.tensor([7])
    save_file({"feats": feats, "emb": emb, "head": head, "anchor": anchor}, str(tmp_path / "in.safetensors"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(out_dir), str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"class": "DFlash2DraftModel", "missing": [], "unexpected": [], "dflash_imported": []}
    res = load_file(str(tmp_path / "out.safetensors"))
    want = ours(d, feats, emb)
    torch.testing.assert_close(res["out"], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(res["draft"], our_draft(d, want[:, 1:], head, anchor))
