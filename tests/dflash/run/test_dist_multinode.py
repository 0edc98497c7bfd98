"""dflash.run over two torchrun "nodes" on the loopback (c10d rendezvous, one gloo rank each):
the DDP drafter replicas sit on different nodes and end with the weights of the single-node
two-rank run of the same graph and seed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.dflash.run.test_dist import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parents[3]


def _sets(run_dir: Path, cache: Path) -> list[str]:
    sets = [f"run.out_dir={run_dir}", "run.steps=4", "checkpoint.every=4", "monitor.wandb=disabled", "eval.every=0",
            "monitor.display=plain", "monitor.plot=false", "data.max_samples=120", "data.max_length=256",
            "data.tokens_per_batch=512", "data.packed_rows=2", "data.num_workers=1", f"data.cache_dir={cache}",
            "train.num_anchors=8", "process.drafter.replicas=2", "process.target.replicas=1",
            "monitor.window=1", "run.deterministic=true"]
    return [x for s in sets for x in ("--set", s)]


def _launch(cmds: list[list[str]], timeout_s: float) -> list[tuple[int, str]]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    out = []
    for p in procs:
        try:
            o, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:  # SIGTERM: torchrun's agent stops its workers
                q.terminate()
            for q in procs:
                try:
                    q.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    q.kill()
                    q.communicate()
            pytest.fail(f"torchrun did not finish within {timeout_s} s")
        out.append((p.returncode, o))
    return out


def test_ddp_drafters_on_two_nodes_equal_the_single_node_run(tmp_path):
    """Invariant: global and local ranks are never confused for data sharding, DDP and
    checkpoints: drafters on two nodes (local rank 0 on both) train the same weights as on one
    node with two ranks."""
    cache = tmp_path / "cache"
    graph = str(ROOT / "examples" / "dflash-tiny.toml")
    one = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "dflash.run", graph, *_sets(tmp_path / "one", cache)]
    (rc, out), = _launch([one], timeout_s=170)
    assert rc == 0, out
    port = free_port()
    two = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "dflash-two-nodes",
            "--max-restarts", "0", "-m", "dflash.run", graph, *_sets(tmp_path / "two", cache)]] * 2
    results = _launch(two, timeout_s=170)
    assert all(rc == 0 for rc, _ in results), "\n".join(o for _, o in results)
    a = load_file(str(tmp_path / "one" / "checkpoints" / "step_00000004" / "model.safetensors"))
    b = load_file(str(tmp_path / "two" / "checkpoints" / "step_00000004" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ranks = sorted(p.name for p in (tmp_path / "two" / "checkpoints" / "rank_state").iterdir())
    assert ranks == ["step_00000004.rank0.pt", "step_00000004.rank1.pt"]
