"""An export says what it is: ``config.json`` names the target it was trained for and, when the run
recorded one for the exported step, its measured tau; the model card says the same and holds
code that runs as written beside this project (whose package is also named ``dflash``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.export.cli import main as export_main
from tests.dflash.run.test_run_e2e import ROOT, cache_dir, records, small  # noqa: F401 - fixture
from tests.zlab import zlab_root


@pytest.fixture(scope="module")
def run(tmp_path_factory, cache_dir):  # noqa: F811
    """8 steps against the shipped 7M target, checkpoints at 4 and 8, the held-out tau measured
    for the final weights only (eval.every = 8), 2 prompts x 12 tokens."""
    from dflash.run.cli import main

    out = tmp_path_factory.mktemp("about") / "run"
    assert main(small(out, cache_dir, "eval.every=8", "eval.prompts=2", "eval.max_new_tokens=12")) == 0
    return out


def _export(ckpt: Path, out: Path, capsys) -> tuple[dict, str]:
    assert export_main([str(ckpt), "-o", str(out)]) == 0
    capsys.readouterr()
    return json.loads((out / "config.json").read_text()), (out / "README.md").read_text()


def test_config_and_card_name_the_target_and_the_measured_tau(run, tmp_path, capsys):
    """Invariant: ``dflash_target`` holds the target as the run recorded it with its model_type,
    architectures, depth, width and vocabulary (the public keys stay as they were:
    ``dflash_config.target_layer_ids``, ``num_target_layers``); ``dflash_eval`` is the run's last
    held-out record of the exported step, with what it was over and how it was decoded; the
    card's title and text name both."""
    held = [r for r in records(run, "heldout") if r["step"] == 8][-1]
    cfg, card = _export(run / "checkpoints" / "step_00000008", tmp_path / "e8", capsys)
    recorded = json.loads((run / "checkpoints" / "step_00000008" / "target_config.json").read_text())["path"]
    assert cfg["dflash_target"] == {"name_or_path": recorded, "model_type": "qwen3",
                                    "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 8,
                                    "hidden_size": 256, "vocab_size": cfg["vocab_size"]}
    assert cfg["num_target_layers"] == 8 and cfg["dflash_config"]["target_layer_ids"] == [4]
    ev = cfg["dflash_eval"]
    assert (ev["tau"], ev["accepted"], ev["step"], ev["prompts"], ev["max_new_tokens"], ev["verify_steps"]) == (
        held["tau"], held["accepted"], 8, held["prompts"], 12, held["steps"])
    assert ev["prompt_source"] == f"the run's first {held['prompts']} held-out conversations of sharegpt (never trained on)"
    assert ev["decoder"].startswith("greedy draft-and-verify against the target at block size 8, float32")
    assert (ev["loop_share"], ev["fresh_tau"]) == (held["loop_share"], held["fresh_tau"])
    assert card.splitlines()[4] == f"# DFlash drafter for `{recorded}`"
    assert f"**Measured tau: {held['tau']:.3f} tokens per verify step**" in card
    assert f"{held['prompts']} prompts x 12 tokens" in card and "with the weights of step 8" in card
    assert "(qwen3, Qwen3ForCausalLM, 8 layers, hidden size 256" in card


def test_a_step_without_a_recorded_tau_claims_none(run, tmp_path, capsys):
    """Invariant: a checkpoint whose step was not measured (here step 4; the run measured step 8)
    gets no ``dflash_eval``, never another step's tau; the card says none was recorded and how
    to measure it. The target is named all the same."""
    cfg, card = _export(run / "checkpoints" / "step_00000004", tmp_path / "e4", capsys)
    assert "dflash_eval" not in cfg and cfg["dflash_target"]["model_type"] == "qwen3"
    assert "**Measured tau:** none was recorded" in card and "python -m dflash.eval CHECKPOINT --data" in card


def test_a_preset_target_is_named_as_one(tmp_path):
    """A drafter of a random-init preset target names ``preset:tiny``, and the card says there is
    no target to load (its code has a TARGET placeholder)."""
    import torch

    from dflash.export import export_drafter
    from dflash.export.about import describe
    from dflash.model.target import TargetConfig
    from tests.dflash.export.test_export import make

    drafter = make(None)
    about = describe(tmp_path, drafter.cfg, TargetConfig(preset="tiny"))
    out = export_drafter(drafter, tmp_path / "e", torch.float32, about=about)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_target"]["name_or_path"] == "preset:tiny" and "dflash_eval" not in cfg
    card = (out / "README.md").read_text()
    assert "a random-init preset shape, for plumbing runs: there is no target to load" in card
    assert "from_pretrained('TARGET', dtype=dtype)" in card


def test_the_card_code_runs_as_written_beside_this_project(run, tmp_path, capsys):
    """Invariant: the card's Python blocks run as written with this project importable (its
    package is named ``dflash``, like z-lab's): ``spec_generate`` through ``AutoModel`` decodes
    the target's own greedy text, and, where z-lab's wheel is provided (``ZLAB_DFLASH_PATH``),
    the card's ``zlab_dflash`` import and ``dflash_generate`` give the same tokens. Without it
    (or under transformers 4.x, which z-lab's decoder does not run on) only the first block runs (the second needs the unpacked wheel the card's bash line makes)."""
    out = tmp_path / "export"
    _, card = _export(run / "checkpoints" / "step_00000008", out, capsys)
    blocks = re.findall(r"```python\n(.*?)```", card, re.S)
    assert len(blocks) == 2 and "from zlab_dflash.model import dflash_generate" in blocks[1]
    code = blocks[0] + "first = out\nprint('TOKENS', out[0, input_ids.shape[1]:].tolist())\n"
    zlab = zlab_root()
    if zlab:
        (tmp_path / "zlab").mkdir()
        (tmp_path / "zlab" / "zlab_dflash").symlink_to(Path(zlab) / "zlab_dflash")  # what the card's bash line makes
        code += blocks[1] + ("n = min(out.shape[1], first.shape[1])\n"
                             "assert n > input_ids.shape[1] and out[0, :n].tolist() == first[0, :n].tolist()\n"
                             "print('ZLAB')\n")
    (tmp_path / "card.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "card.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("TOKENS "))[7:])
    assert 0 < len(tokens) <= 64
    assert ("ZLAB" in proc.stdout.splitlines()) == bool(zlab)
