"""Two "nodes" on one machine: ``torchrun --nnodes 2 --nproc-per-node 2`` twice, c10d rendezvous
on the loopback, gloo. A text pipeline placed by global rank, with channels crossing the node
boundary both ways, gives the same result as the single-process run of the same graph, and every
rank logs under its global rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]
ROOT = Path(__file__).resolve().parents[3]

# node of ranks 0-1 | node of ranks 2-3 (which torchrun agent gets which is the rendezvous' choice)
#   read@0 --lines--> tokenize[0]@1, tokenize[1]@2, tokenize[2]@3    (0 -> 2, 3 cross the boundary)
#   tokenize[*] --tokens (ordered)--> count@3                          (1 -> 3 crosses back)
#   count@3 --counts--> merge@2                                        (within the second node)
GRAPH = """
plugins = ["examples.textpipe"]

[trace]
stats_interval_s = 0.2
perfetto = false

[[channel]]
name = "lines"
capacity = 16

[[channel]]
name = "tokens"
capacity = 16
ordered = true

[[channel]]
name = "counts"
capacity = 4

[[process]]
name = "read"
kind = "textpipe.lines"
outputs = { line = "lines" }
ranks = [0]
[process.options]
generate = 3000
seed = 7

[[process]]
name = "tokenize"
kind = "textpipe.tokenize"
replicas = 3
ranks = [1, 2, 3]
inputs = { line = "lines" }
outputs = { tokens = "tokens" }

[[process]]
name = "count"
kind = "textpipe.count"
ranks = [3]
inputs = { tokens = "tokens" }
outputs = { counts = "counts" }
[process.options]
batch = 64

[[process]]
name = "merge"
kind = "textpipe.merge"
ranks = [2]
inputs = { counts = "counts" }
[process.options]
top = 25
"""

PLACED = {0: {"read[0]"}, 1: {"tokenize[0]"}, 2: {"tokenize[1]", "merge[0]"}, 3: {"tokenize[2]", "count[0]"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def _finish(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[int, str]]:
    """Wait for every launcher; on a timeout SIGTERM them (torchrun's agent then stops its workers)."""
    out = []
    for p in procs:
        try:
            o, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.terminate()
            for q in procs:
                try:
                    q.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    q.kill()
            pytest.fail(f"a torchrun node did not finish within {timeout_s} s")
        out.append((p.returncode, o))
    return out


def test_two_nodes_on_loopback_equal_the_single_process_run(tmp_path):
    """Invariant: a graph placed by global rank over two torchrun nodes (c10d rendezvous, 2 ranks
    each) moves items across the node boundary and ends with the result of the single-process run
    of the same graph and seed; each rank writes its stats under its global rank (RUN_DIR/csp for
    rank 0, RUN_DIR/rank<r>/csp otherwise) on whichever node it runs, holding the processes placed
    on that global rank, never under its local rank."""
    graph = tmp_path / "textpipe_2nodes.toml"
    graph.write_text(GRAPH)
    single = subprocess.run([sys.executable, "-m", "csp.run", str(graph), "--run-dir", str(tmp_path / "single"),
                             "-q"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stdout + single.stderr
    want = json.loads((tmp_path / "single" / "textpipe" / "top_words.json").read_text())
    assert want["lines"] == 3000

    port = free_port()
    nodes = [tmp_path / "node_a", tmp_path / "node_b"]  # nothing shared between the nodes' run dirs
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "csp-two-nodes",
         "--max-restarts", "0", "-m", "csp.run", str(graph), "--run-dir", str(node), "-q"],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in nodes]
    results = _finish(procs, timeout_s=110)
    assert all(rc == 0 for rc, _ in results), "\n".join(o for _, o in results)

    stats = {}  # global rank -> the node dir that holds its stats
    for node in nodes:
        if (node / "csp" / "stats.jsonl").exists():
            stats[0] = (node, node / "csp" / "stats.jsonl")
        for d in node.glob("rank*"):
            stats[int(d.name[4:])] = (node, d / "csp" / "stats.jsonl")
    assert sorted(stats) == [0, 1, 2, 3]
    assert stats[0][0] == stats[1][0] != stats[2][0] == stats[3][0]  # ranks 0-1 on one node, 2-3 on the other
    for rank, (_, path) in stats.items():
        final = msgspec.json.decode(path.read_text().splitlines()[-1])
        assert final["kind"] == "final" and final["status"] == "completed", (rank, final)
        assert set(final["processes"]) == PLACED[rank], rank
    got = json.loads((stats[2][0] / "rank2" / "textpipe" / "top_words.json").read_text())
    assert got == want
