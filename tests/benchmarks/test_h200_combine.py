"""The H200 results combiner (benchmarks/h200/combine.py) and the choice of MFU peak
(benchmarks.h200.report.matched_mfu, used by h200/bench.py): on small hand-made dicts and on the
committed SUITE=fastest run (benchmarks/results/h200_fastest/, written before bench_h200 measured
the fp8 peak), CPU only."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.h200.combine import combine, goals, main  # noqa: E402
from benchmarks.h200.report import matched_mfu  # noqa: E402

FASTEST = ROOT / "benchmarks" / "results" / "h200_fastest"
BF16, FP8 = 500.0, 1000.0  # peaks of the hand-made runs (TFLOP/s)


def _m(tflops: float, model: float = 1e15, computed: float | None = None, **extra) -> dict:
    return {"status": "ok", "tflops": tflops, "flops_model": model, "flops_computed": computed or model, **extra}


# -- the MFU peak --------------------------------------------------------------------------------

def test_bf16_mfu_is_against_the_bf16_peak_whatever_the_split():
    out = matched_mfu(_m(400.0, computed=1.2e15), bf16_tflops=BF16, target_tflops=BF16, precision="bf16",
                      target_model=0.6e15)
    assert out["peak"] == "bf16" and out["peak_tflops"] == BF16
    assert math.isclose(out["mfu"], 0.8) and math.isclose(out["mfu_vs_bf16"], 0.8)
    assert math.isclose(out["hfu"], 0.96) and math.isclose(out["hfu_vs_bf16"], 0.96)


def test_an_fp8_target_is_against_the_fp8_peak():
    out = matched_mfu(_m(800.0), bf16_tflops=BF16, target_tflops=FP8, precision="fp8", target_model=1e15)
    assert out["peak"] == "fp8" and math.isclose(out["peak_tflops"], FP8)
    assert math.isclose(out["mfu"], 0.8) and math.isclose(out["mfu_vs_bf16"], 1.6)  # the old reading


def test_a_two_stage_row_credits_each_stages_flops_at_its_own_peak():
    # 1e15 FLOPs in 2 s: 0.5e15 fp8 target (0.5 s at peak) + 0.5e15 bf16 drafter (1 s at peak)
    out = matched_mfu(_m(500.0), bf16_tflops=BF16, target_tflops=FP8, precision="fp8", target_model=0.5e15)
    assert out["peak"] == "fp8 target + bf16 drafter"
    assert math.isclose(out["mfu"], 1.5 / 2.0) and math.isclose(out["mfu_vs_bf16"], 1.0)
    assert math.isclose(out["peak_tflops"], 1e15 / 1.5e12)  # tflops / peak_tflops == mfu
    assert math.isclose(out["mfu"], 500.0 / out["peak_tflops"])
    two = matched_mfu(_m(500.0), bf16_tflops=BF16, target_tflops=FP8, precision="fp8", target_model=0.5e15, gpus=2)
    assert math.isclose(two["mfu"], out["mfu"] / 2)
    # the drafter alone never uses the fp8 peak; an unmeasured fp8 peak leaves the MFU unknown
    d = matched_mfu(_m(400.0), bf16_tflops=BF16, target_tflops=FP8, precision="fp8", target_model=0.0)
    assert d["peak"] == "bf16" and math.isclose(d["mfu"], 0.8)
    none = matched_mfu(_m(800.0), bf16_tflops=BF16, target_tflops=None, precision="fp8", target_model=1e15)
    assert none["mfu"] is None and none["hfu"] is None and math.isclose(none["mfu_vs_bf16"], 1.6)


def test_the_harness_applies_the_target_peak():
    """bench_h200.Bench._matched: what each measurement records (the fp8 target's peak when it is
    quantized, the bf16 one otherwise)."""
    from benchmarks.h200.bench import Bench

    b = Bench.__new__(Bench)  # only the peaks; no device, no models
    b.peak, b.peak_target, b.precision = BF16, FP8, "fp8"
    t = b._matched(_m(800.0), 1e15)
    assert t["peak"] == "fp8" and math.isclose(t["mfu"], 0.8) and math.isclose(t["mfu_vs_bf16"], 1.6)
    assert b._matched(_m(400.0), 0.0)["peak"] == "bf16"
    b.peak_target, b.precision = BF16, "bf16"
    assert math.isclose(b._matched(_m(800.0), 1e15)["mfu"], 1.6)


# -- the combiner --------------------------------------------------------------------------------

def _perf(bf16_tok: float = 30e3, fp8_tok: float = 60e3, drafter_mfu: float = 0.7) -> dict:
    r = lambda tok, mfu, vs, peak: _m(mfu * peak, tok_s=tok, mfu=mfu, mfu_vs_bf16=vs, peak_tflops_used=peak)  # noqa: E731
    return {"command": "python benchmarks/h200/perf.py --out OUT", "rows": {
        "matmul_bf16": {"status": "ok", "tflops": BF16}, "matmul_fp8": {"status": "ok", "tflops": FP8},
        "target_bf16": r(bf16_tok, 0.75, 0.75, BF16),
        "target_bf16_varlen_compile": r(bf16_tok * 0.9, 0.7, 0.7, BF16),
        "target_fp8_varlen": r(fp8_tok / 2, 0.3, 0.6, FP8),
        "target_fp8_varlen_compile": r(fp8_tok, 0.6, 1.2, FP8),
        "drafter_compile": _m(drafter_mfu * BF16, tok_s=50e3, mfu=drafter_mfu)}}


def _bench(precision: str, serial: float, pipeline: float, new_fields: bool = False) -> dict:
    """A bench_h200 results file: fp8 rows as written before the fix (MFU against bf16) unless
    ``new_fields``."""
    fp8 = precision == "fp8"
    tgt, both = 1.0e15, 1.6e15  # the target's FLOPs over the timed batches; target + drafter
    ms = {"matmul": {"status": "ok", "tflops": BF16},
          "target_alone": _m(800.0 if fp8 else 400.0, tgt, tok_s=60e3 if fp8 else 30e3, tokens_timed=100),
          "drafter_alone": _m(350.0, 0.6e15, tok_s=50e3, tokens_timed=128),
          "serial": _m(600.0, both, tok_s=serial, tokens_timed=100),
          "colocated_1gpu": _m(600.0, both, tok_s=serial * 0.99, tokens_timed=100),
          "pipeline_1gpu": _m(610.0, both, tok_s=pipeline, tokens_timed=100),
          "pipeline_2gpu": {"status": "skipped", "reason": "one CUDA device visible"}}
    for m in ms.values():
        if "tflops" in m and "flops_model" in m:
            m["mfu"] = m["tflops"] / BF16  # what the harness recorded before the fix
    if fp8 and new_fields:
        ms["matmul_fp8"] = {"status": "ok", "tflops": 2 * FP8}  # its own peak, not perf.json's
        ms["target_alone"].update(mfu=0.4, mfu_vs_bf16=1.6, peak="fp8", peak_tflops=2 * FP8)
    sets = ['target.quantization="fp8"'] if fp8 else []
    return {"runs": {"1gpu": {"mode": "1gpu", "command": f"python benchmarks/h200/bench.py {precision}",
                              "settings": {"overrides": ["data.source=x", *sets]}, "measurements": ms}}}


def test_goals_met_not_met_and_not_measured():
    doc = combine(_perf(), _bench("bf16", 20e3, 25e3), _bench("fp8", 28e3, 31e3))
    g = doc["goals"]
    assert set(g) == {"target_bf16_mfu", "fp8_target_speedup", "drafter_mfu", "pipeline_1gpu_bf16_tok_s",
                      "pipeline_1gpu_fp8_tok_s", "pipeline_vs_serial"}
    assert g["target_bf16_mfu"]["value"] == 0.75 and g["target_bf16_mfu"]["met"] is True
    assert g["target_bf16_mfu"]["from"] == "target_bf16"
    assert g["fp8_target_speedup"]["value"] == 2.0 and g["fp8_target_speedup"]["met"] is True
    assert g["fp8_target_speedup"]["from"] == ["target_fp8_compiled", "target_bf16"]
    assert g["drafter_mfu"]["met"] is True
    assert g["pipeline_1gpu_bf16_tok_s"]["met"] is True and g["pipeline_1gpu_fp8_tok_s"]["met"] is True
    ps = g["pipeline_vs_serial"]  # the lower of the two runs' ratios
    assert ps["values"] == {"bf16": 1.25, "fp8": 31 / 28} and ps["value"] == 31 / 28 and ps["met"] is True

    low = combine(_perf(bf16_tok=30e3, fp8_tok=45e3, drafter_mfu=0.6), _bench("bf16", 20e3, 20.5e3),
                  _bench("fp8", 28e3, 29e3))["goals"]
    assert low["fp8_target_speedup"]["met"] is False and math.isclose(low["fp8_target_speedup"]["missed_by"], 0.1)
    assert low["drafter_mfu"]["met"] is False
    assert low["pipeline_1gpu_bf16_tok_s"]["met"] is False and low["pipeline_1gpu_bf16_tok_s"]["missed_by"] == 3500
    assert low["pipeline_1gpu_fp8_tok_s"]["met"] is False and low["pipeline_vs_serial"]["met"] is False

    none = combine(None, _bench("bf16", 20e3, 25e3), None)
    ng = none["goals"]
    assert ng["pipeline_1gpu_fp8_tok_s"] == {**ng["pipeline_1gpu_fp8_tok_s"], "value": None, "met": None}
    assert ng["fp8_target_speedup"]["met"] is None and ng["pipeline_vs_serial"]["values"] == {"bf16": 1.25}
    # without perf.json the stage goals fall back to the bench run's stages
    assert ng["target_bf16_mfu"]["from"] == "target_alone_bf16" and ng["target_bf16_mfu"]["value"] == 0.8
    assert none["rows"]["target_fp8_compiled"]["status"] == "missing"
    assert none["rows"]["serial_fp8"]["status"] == "missing"
    assert goals({})["drafter_mfu"]["met"] is None


def test_an_old_fp8_file_is_recomputed_against_perf_jsons_fp8_peak():
    doc = combine(_perf(), _bench("bf16", 20e3, 25e3), _bench("fp8", 28e3, 31e3))
    rows = doc["rows"]
    t = rows["target_alone_fp8"]
    assert t["peak"] == "fp8" and t["peak_tflops"] == FP8 and t["peak_from"] == "perf.json matmul_fp8"
    assert math.isclose(t["mfu"], 0.8) and math.isclose(t["mfu_vs_bf16"], 1.6) and t["mfu_from"].startswith("recomputed")
    s = rows["serial_fp8"]  # 1.6e15 in 1.6e15 / 600e12 s: 1e15 at the fp8 peak, 0.6e15 at the bf16 peak
    assert s["peak"] == "fp8 target + bf16 drafter" and s["target_flops_model"] == 1.0e15
    assert math.isclose(s["mfu"], (1e15 / FP8 + 0.6e15 / BF16) / (1.6e15 / 600.0))
    assert math.isclose(s["mfu_vs_bf16"], 600.0 / BF16)
    assert rows["drafter_alone_fp8"]["peak"] == "bf16" and math.isclose(rows["drafter_alone_fp8"]["mfu"], 0.7)
    # bf16 rows keep their recorded MFU; perf.json rows carry their own peaks
    assert rows["serial_bf16"]["peak"] == "bf16" and rows["serial_bf16"]["mfu"] == rows["serial_bf16"]["mfu_vs_bf16"]
    assert rows["target_fp8_compiled"]["mfu"] == 0.6 and rows["target_fp8_compiled"]["peak_tflops"] == FP8
    for r in rows.values():
        assert r["command"] and r["source"], r
    assert doc["side_by_side"]["serial"]["fp8"]["tok_s"] == 28e3 and doc["side_by_side"]["serial"]["bf16"]["mfu"] == 1.2
    # a file written after the fix keeps the peaks it measured itself
    new = combine(_perf(), None, _bench("fp8", 28e3, 31e3, new_fields=True))["rows"]["target_alone_fp8"]
    assert new["mfu"] == 0.4 and new["peak_tflops"] == 2 * FP8 and new["mfu_from"] == "recorded"
    assert new["peak_from"] == "h200-fp8.json matmul_fp8"
    # no target_alone over the same batches: the two-stage MFU is unknown, not guessed
    odd = _bench("fp8", 28e3, 31e3)
    odd["runs"]["1gpu"]["measurements"]["target_alone"]["tokens_timed"] = 99
    s = combine(_perf(), None, odd)["rows"]["serial_fp8"]
    assert s["mfu"] is None and s["mfu_from"].startswith("not computed")


def test_the_runs_and_the_kept_2gpu_run():
    two = {"mode": "2gpu", "command": "python benchmarks/h200/bench.py", "started": "2026-11-30",
           "measurements": {"pipeline_2gpu": {"status": "ok", "tok_s": 27e3}}}
    doc = combine(_perf(), _bench("bf16", 20e3, 25e3), _bench("fp8", 28e3, 31e3), copy.deepcopy(two),
                  kept_from={"from": "old.json"})
    assert set(doc["runs"]) == {"1gpu", "1gpu_fp8", "2gpu"}
    kept = doc["runs"]["2gpu"]["kept"]
    assert kept["from"] == "old.json" and kept["remeasured"] is False
    assert doc["pipeline_2gpu_tok_s"] == 27e3  # h200_report's summary keys, the 1-GPU ones from the bf16 run
    assert doc["serial_tok_s"] == 20e3 and "efficiency_2gpu" in doc["bench_goals"]
    # combining a combined file again keeps where the 2-GPU run first came from
    again = combine(None, None, None, doc["runs"]["2gpu"], kept_from={"from": "new.json"})
    assert again["runs"]["2gpu"]["kept"]["from"] == "old.json"


def test_the_command_line_on_the_committed_fastest_run(tmp_path):
    """The committed SUITE=fastest files: the fp8 target row's MFU is against an fp8 peak measured
    in the same call (the bench run's own, as bench_h200 now measures it; perf.json's for files
    written before it did), and the goals are those of benchmarks/results/h200.json."""
    out = tmp_path / "h200.json"
    keep = tmp_path / "old.json"
    keep.write_text(json.dumps({"runs": {"2gpu": {"command": "x", "measurements": {}}}}))
    assert main([str(FASTEST), "--keep-2gpu", str(keep), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    perf = json.loads((FASTEST / "perf.json").read_text())["rows"]
    bench = json.loads((FASTEST / "h200-fp8.json").read_text())
    fp8_peak = bench.get("matmul_fp8_tflops") or perf["matmul_fp8"]["tflops"]
    t = doc["rows"]["target_alone_fp8"]
    assert t["peak"] == "fp8" and math.isclose(t["peak_tflops"], fp8_peak)
    assert math.isclose(t["mfu"], t["tflops"] / fp8_peak) and t["mfu"] < 1 < t["mfu_vs_bf16"]
    # the fp8 run's own measurements carry the same matched MFU (the tables drawn from runs show it)
    m = doc["runs"]["1gpu_fp8"]["measurements"]["target_alone"]
    assert m["mfu"] == pytest.approx(t["mfu"]) and m["mfu_vs_bf16"] > 1 and m["peak"] == "fp8"
    assert doc["runs"]["2gpu"]["kept"]["remeasured"] is False and doc["runs"]["2gpu"]["kept"]["from"] == str(keep)
    committed = json.loads((ROOT / "benchmarks" / "results" / "h200.json").read_text())
    for k, g in doc["goals"].items():
        assert g["met"] == committed["goals"][k]["met"] and g["value"] == pytest.approx(committed["goals"][k]["value"]), k
    # bf16 MFU (compiled varlen) met; fp8 1.56x of it missed; drafter met; the pipeline goals missed
    assert [doc["goals"][k]["met"] for k in doc["goals"]] == [True, False, True, False, False, False]
