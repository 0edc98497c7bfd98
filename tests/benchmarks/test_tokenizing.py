"""benchmarks/micro/tokenizing.py measures the chat path with loss masks against plain
encode_batch on the same text, and the whole package's load time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_tokenize_smoke(tmp_path):
    """Invariant: the benchmark tokenizes the same text on both paths (equal token counts), and
    reports seconds, tokens/s, cores, the ratio against encode_batch with its goal, and the load."""
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, "benchmarks/micro/tokenizing.py", "--cores", "1", "--conversations", "30",
                           "--repeats", "1", "--no-package", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert doc["command"].startswith("python benchmarks/micro/tokenizing.py") and "load average" in doc["uptime"]
    assert run["cores"] == 1 and run["conversations"] == 30 and len(run["loadavg_before"]) == 3
    assert run["chat"]["tokens"] == run["encode_batch"]["tokens"] == run["encode_batch_fast"]["tokens"] > 0
    for key in ("encode_batch", "encode_batch_fast", "chat"):
        assert run[key]["seconds"] > 0 and run[key]["tok_s"] > 0
    assert run["ratio_chat_vs_encode_batch"] == round(run["chat"]["seconds"] / run["encode_batch"]["seconds"], 3)
    assert run["met"] == (run["ratio_chat_vs_encode_batch"] <= run["goal_ratio"] == 1.5)
