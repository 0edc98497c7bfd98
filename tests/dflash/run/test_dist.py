"""dflash.run under torchrun with data-parallel drafters (DDP over gloo, CPU): checkpoint and resume."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.checkpoint import is_healthy, list_checkpoints

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now. Not ``--master-port 0``: torchrun's static rendezvous
    binds its store to a random port but tells the workers MASTER_PORT=0, and they then retry
    connecting to port 0 until the rendezvous timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(run_dir: Path, cache: Path, steps: int, timeout_s: float = 80) -> subprocess.CompletedProcess:
    sets = [f"run.out_dir={run_dir}", f"run.steps={steps}", "checkpoint.every=3", "monitor.wandb=disabled", "eval.every=0",
            "monitor.display=plain", "data.max_samples=120", "data.max_length=256", "data.tokens_per_batch=512",
            "data.packed_rows=2", "data.num_workers=1", f"data.cache_dir={cache}", "train.num_anchors=8",
            "process.drafter.replicas=2", "process.target.replicas=1", "monitor.window=1", "run.deterministic=true"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "dflash.run", str(ROOT / "examples" / "dflash-tiny.toml")]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun's agent then stops its workers (they run in sessions of their
        # own, so killing torchrun alone would leave them behind, blocked in gloo).
        p.terminate()
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        pytest.fail(f"torchrun did not finish within {timeout_s} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


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
