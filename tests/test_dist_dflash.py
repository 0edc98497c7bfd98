"""dflash.run under torchrun with data-parallel drafters (DDP over gloo, CPU): checkpoint and resume."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.checkpoint import is_healthy, list_checkpoints

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parent.parent


def torchrun(run_dir: Path, cache: Path, steps: int) -> subprocess.CompletedProcess:
    sets = [f"run.out_dir={run_dir}", f"run.steps={steps}", "checkpoint.every=3", "monitor.wandb=disabled",
            "monitor.display=plain", "data.max_samples=120", "data.max_length=256", "data.tokens_per_batch=512",
            "data.packed_rows=2", "data.num_workers=1", f"data.cache_dir={cache}", "drafter.num_anchors=8",
            "process.drafter.replicas=2", "process.target.replicas=1", "monitor.window=1", "run.deterministic=true"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", "0", "-m", "dflash.run", str(ROOT / "examples" / "dflash-tiny.toml")]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)


def test_data_parallel_drafters_checkpoint_and_resume_exactly(tmp_path):
    """Two drafter replicas on two ranks train one model (DDP); a run resumed from its step-3
    checkpoint ends with the same weights as the uninterrupted 6-step run."""
    cache = tmp_path / "cache"
    full = tmp_path / "full"
    r = torchrun(full, cache, steps=6)
    assert r.returncode == 0, r.stdout + r.stderr
    ckpts = list_checkpoints(full / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000003", "step_00000006"] and all(map(is_healthy, ckpts))
    assert sorted(p.name for p in (full / "checkpoints" / "rank_state").iterdir()) == [
        "step_00000003.rank0.pt", "step_00000003.rank1.pt", "step_00000006.rank0.pt", "step_00000006.rank1.pt"]

    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step_00000006")
    r = torchrun(part, cache, steps=6)
    assert r.returncode == 0, r.stdout + r.stderr
    a = load_file(str(full / "checkpoints" / "step_00000006" / "model.safetensors"))
    b = load_file(str(part / "checkpoints" / "step_00000006" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
