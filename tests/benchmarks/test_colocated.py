"""The colocated data-parallel baseline of the H200 harness (benchmarks/h200/colocated.py) on CPU
ranks with gloo: two spawned ranks, each running target forward then a DDP drafter step on its own
batches, give one combined rate and FLOP count; a failing rank is one clear error."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def test_two_gloo_ranks_run_the_colocated_loop(tmp_path, monkeypatch):
    from benchmarks.h200.bench import CPU_SETTINGS, GRAPH_1GPU, TINY_SETTINGS
    from benchmarks.h200.colocated import run_colocated
    from dflash.data import load_tokenizer, tokenizer_info

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    vocab = tokenizer_info(load_tokenizer("builtin:tiny")).vocab_size
    overrides = [*TINY_SETTINGS, f"target.vocab_size={vocab}", *CPU_SETTINGS]
    out = run_colocated(GRAPH_1GPU, overrides, tmp_path / "colocated", 2, warmup=1, timed=2,
                        peak_tflops=1.0, cpu=True, timeout_s=200)
    assert out["world"] == 2 and len(out["per_rank"]) == 2
    ranks = out["per_rank"]
    assert out["tokens_timed"] == sum(r["tokens_timed"] for r in ranks) > 0
    secs = max(r["tokens_timed"] / r["tok_s"] for r in ranks)
    assert math.isclose(out["tok_s"], out["tokens_timed"] / secs)
    assert math.isclose(out["mfu"], out["tflops"] / 1.0) and out["flops_model"] <= out["flops_computed"]
    # each rank drew its own batches: rank r takes r, r + 2, ...
    res = [json.loads((tmp_path / "colocated" / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["status"] == "ok" and r["steps_timed"] == 2 for r in res)


def test_a_failing_rank_is_one_error(tmp_path):
    from benchmarks.h200.bench import GRAPH_1GPU
    from benchmarks.h200.colocated import run_colocated

    with pytest.raises(RuntimeError, match="colocated rank 0"):
        run_colocated(GRAPH_1GPU, ["no.such.key=1"], tmp_path / "c", 2, warmup=1, timed=1, peak_tflops=1.0,
                      cpu=True, timeout_s=60)
