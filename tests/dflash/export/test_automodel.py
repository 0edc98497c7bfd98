"""An exported drafter loads through transformers alone: ``AutoModel.from_pretrained(DIR,
trust_remote_code=True)`` in a fresh process builds the shipped modeling_dflash.DFlashDraftModel
with no missing or unexpected keys, imports no dflash module, and drafts what
dflash.export.load_exported drafts, so transformers users need no other package; the weights stay
as loaded through transformers' post-load init."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from dflash.export import MODELING_FILE, export_drafter, load_exported
from dflash.model.attention import decode_layout
from tests.dflash.export.test_export import ABOUT, make
from tests.helpers import save_checkpoint

CHILD = r"""
import json, sys
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

d, io = sys.argv[1], sys.argv[2]
model, info = AutoModel.from_pretrained(d, trust_remote_code=True, output_loading_info=True, dtype=torch.float32)
inp = load_file(io + "/in.safetensors")
with torch.no_grad():
    out = model(target_hidden=inp["feats"], noise_embedding=inp["emb"])
    assert torch.equal(out, model(target_hidden=inp["feats"], noise_embedding=inp["emb"], return_dict=True).last_hidden_state)
save_file({"out": out.contiguous()}, io + "/out.safetensors")
print(json.dumps({"class": type(model).__name__, "module": type(model).__module__,
                  "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
                  "dflash_imported": sorted(m for m in sys.modules if m == "dflash" or m.startswith("dflash."))}))
"""


@pytest.mark.parametrize("types", [None, ["sliding_attention", "full_attention"]])
def test_automodel_loads_the_export_and_drafts_the_same(tmp_path, types):
    """Invariant: AutoModel + trust_remote_code on an export gives our DFlashDraftModel, every
    weight used (no missing/unexpected keys), no dflash import, and the same block hidden states
    as load_exported's drafter (full and sliding-window layers; context longer than the window)."""
    drafter = make(types)
    out_dir = tmp_path / "export"
    export_drafter(drafter, out_dir, torch.float32, about=ABOUT)  # dflash_target, dflash_eval: ignored
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert (out_dir / MODELING_FILE).is_file()

    T, bs, H = 12, 4, 128
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, T, 2 * H, generator=g)
    emb = torch.randn(1, 1, bs, H, generator=g)
    save_file({"feats": feats, "emb": emb.reshape(1, bs, H).contiguous()}, str(tmp_path / "in.safetensors"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(out_dir), str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["class"] == "DFlashDraftModel" and got["module"].endswith("modeling_dflash")
    assert got["missing"] == [] and got["unexpected"] == [] and got["dflash_imported"] == []

    ours, _ = load_exported(out_dir)
    with torch.no_grad():
        want = ours(feats, emb, decode_layout(T, T, bs, "cpu")).reshape(1, bs, H)
    torch.testing.assert_close(load_file(str(tmp_path / "out.safetensors"))["out"], want, rtol=1e-5, atol=1e-5)


def test_the_modeling_file_imports_no_dflash_module():
    """Invariant: the shipped modeling file needs torch and transformers only."""
    text = (Path(__file__).resolve().parents[3] / "dflash" / "model" / MODELING_FILE).read_text()
    imports = [line for line in text.splitlines() if line.startswith(("import ", "from "))]
    assert imports and all(line.split()[1].split(".")[0] in {"__future__", "heapq", "inspect", "math", "torch", "transformers"}
                           for line in imports), imports


def _load(out_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(out_dir, trust_remote_code=True, dtype=torch.float32)


def test_post_load_init_never_overwrites_loaded_weights(tmp_path):
    """Invariant: the shipped model's weight init leaves every loaded weight as loaded. transformers
    5.0-5.12 run ``_init_weights`` on every module of a ``trust_remote_code`` model after loading
    (ignoring the module-level done flags); simulated here by calling it on each module, with the
    per-parameter ``_is_hf_initialized`` flags the loader sets. A negative control without those
    flags shows the call does re-initialise (so the check can fail)."""
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"transformers {transformers.__version__}: 4.x neither re-runs the init after loading "
                    "nor sets the per-parameter flags this simulates (the load tests check its weights)")
    out_dir = tmp_path / "export"
    export_drafter(make(), out_dir, torch.float32)
    want = load_file(str(out_dir / "model.safetensors"))
    model = _load(out_dir)
    assert all(getattr(p, "_is_hf_initialized", False) for p in model.parameters())
    for module in model.modules():
        model._init_weights(module)
    model.init_weights()  # today's path too (module flags cleared: each module is visited again)
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())

    control = _load(out_dir)
    for p in control.parameters():
        p._is_hf_initialized = False
    for module in control.modules():
        control._init_weights(module)
    assert not torch.equal(control.state_dict()["fc.weight"], want["fc.weight"])


OLD_TRANSFORMERS = os.environ.get("DFLASH_TRANSFORMERS_5_8", "/tmp/tf581")
# The child sees the project's site-packages (for torch) behind transformers 5.8.1. A newer
# transformers there pulls in the hub's `kernels` 0.19, which 5.8.1 (whose extra pins kernels<0.13)
# cannot import: its kernel table raises ValueError at import time. SpecForge's own environment has
# no `kernels`, so the child hides it (a None entry in sys.modules reads as not installed).
LOAD_CHILD = r"""
import sys
sys.modules["kernels"] = None
import torch, transformers
from safetensors.torch import load_file
from transformers import AutoModel
d = sys.argv[1]
m = AutoModel.from_pretrained(d, trust_remote_code=True, dtype=torch.float32)
sd, want = m.state_dict(), load_file(d + "/model.safetensors")
print(transformers.__version__, max((sd[k] - v).abs().max().item() for k, v in want.items()))
"""


@pytest.mark.slow
def test_export_loads_its_weights_under_transformers_5_8(tmp_path):
    """Invariant: on transformers 5.8.1 (SpecForge's pin, inside the 5.0-5.12 range that
    re-initialises remote-code models after loading) AutoModel gives exactly the exported weights.

    Needs transformers 5.8.1 installed apart from the project's venv, e.g.
    ``pip install --no-deps --target /tmp/tf581 transformers==5.8.1 tokenizers==0.22.2
    'huggingface-hub>=1.5,<2'``; the directory is ``$DFLASH_TRANSFORMERS_5_8`` (default /tmp/tf581)."""
    if not (Path(OLD_TRANSFORMERS) / "transformers" / "__init__.py").is_file():
        pytest.skip(f"transformers 5.8.1 not installed at {OLD_TRANSFORMERS} (set DFLASH_TRANSFORMERS_5_8; "
                    "pip install --no-deps --target DIR transformers==5.8.1 tokenizers==0.22.2 "
                    "'huggingface-hub>=1.5,<2'; or eval \"$(bash tests/interop_setup.sh .stacks)\")")
    out_dir = tmp_path / "export"
    export_drafter(make(["sliding_attention", "full_attention"]), out_dir, torch.float32, about=ABOUT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=OLD_TRANSFORMERS, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(out_dir)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    version, diff = proc.stdout.split()[-2:]
    assert version == "5.8.1" and float(diff) == 0.0, proc.stdout


def test_the_export_says_trust_remote_code_is_required(tmp_path, capsys):
    """Invariant: forgetting trust_remote_code silently gives a plain Qwen3Model (checked here, so
    the warning stays true), and the export's card and the CLI's closing lines say so."""
    from transformers import AutoModel

    from dflash.export import CARD_FILE
    from dflash.export import main as export_main
    from tests.dflash.export.test_export import TCFG

    d = make()
    ck = tmp_path / "ckpt"
    ck.mkdir()
    save_checkpoint(ck, d, d.cfg, TCFG)
    out_dir = tmp_path / "export"
    assert export_main([str(ck), "-o", str(out_dir), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert MODELING_FILE in out and "trust_remote_code=True" in out and "plain Qwen3Model" in out
    card = (out_dir / CARD_FILE).read_text()
    assert "trust_remote_code=True" in card and "plain Qwen3Model" in card and "dflash_generate" in card
    plain = AutoModel.from_pretrained(out_dir, dtype=torch.float32)
    assert type(plain).__name__ == "Qwen3Model"
