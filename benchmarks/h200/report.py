"""The results file of ``benchmarks/h200/bench.py``: per-run measurements, merging, the summary.

``benchmarks/results/h200.json``::

    {<summary keys>, "goals": {...}, "sources": {key: run}, "runs": {"1gpu": RUN, "2gpu": RUN}}

A RUN holds ``mode``, ``command``, ``env``, ``settings``, ``data`` and ``measurements`` (name ->
``{"status": "ok", ...}`` | ``{"status": "skipped", "reason"}`` | ``{"status": "error", "error"}``).
Runs from separate invocations (one 1-GPU machine, one 2-GPU machine) are merged by run name; the
summary is recomputed from the merged runs and takes every ratio from a single run (a 2-GPU
speedup divides by the serial loop measured on the same machine in the same invocation).

MFU against the matching peak (:func:`matched_mfu`): a run whose target is quantized
(``target.quantization = "fp8"``) also measures the fp8 matmul peak (``matmul_fp8``); the target's
FLOPs count against that peak and the drafter's against the bf16 one. A measurement of both stages
(serial, colocated, pipeline) is credited with the time its FLOPs would take at those peaks,
``(F_target / P_fp8 + F_drafter / P_bf16) / seconds``, so it reads 1.0 only when every FLOP ran at
its own precision's peak; ``peak_tflops`` is the single rate that gives the same MFU
(``tflops / peak_tflops``) and ``mfu_vs_bf16`` is the same rate against the bf16 peak alone.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

# Where each summary number comes from, in order of preference.
SINGLE = ("1gpu", "2gpu", "smoke")
DOUBLE = ("2gpu", "smoke")

# goal name -> (summary key, op, bound); the 2-GPU pipeline's goals, then the per-stage performance ones
GOALS = {
    "efficiency_2gpu": ("efficiency_2gpu", ">=", 0.95),
    "speedup_2gpu_vs_serial": ("speedup_2gpu_vs_serial", ">=", 1.8),
    "checkpoint_slowdown": ("checkpoint_slowdown", "<", 0.02),
    "target_stage_mfu": ("target_mfu", ">=", 0.67),
    "drafter_stage_mfu": ("drafter_mfu", ">=", 0.55),
    "serial_1gpu_tok_s": ("serial_tok_s", ">=", 20_000),
    "pipeline_1gpu_tok_s": ("pipeline_1gpu_tok_s", ">=", 20_000),
}
ATTN_VARIANTS = ("sdpa", "flex_attention", "eager")
# measurements whose rates, FLOPs and memory are tabled (in this order)
TABLED = ("target_alone", *(f"target_alone_{i}" for i in ATTN_VARIANTS), "plain_forward", "drafter_alone",
          "serial", "colocated_1gpu", "pipeline_1gpu", "colocated_2gpu", "pipeline_2gpu")


def matched_mfu(m: dict[str, Any], *, bf16_tflops: float, target_tflops: float | None, precision: str,
                target_model: float, target_computed: float | None = None, gpus: int = 1) -> dict[str, Any]:
    """MFU and HFU of the measurement ``m`` against the matching measured peaks (module docstring).

    Args:
        m: a measurement with ``tflops`` (model FLOPs per second / 1e12), ``flops_model`` and
            ``flops_computed``.
        bf16_tflops: the bf16 matmul peak (the drafter's, and the target's when not quantized).
        target_tflops: the target's matching peak (``fp8``: the fp8 matmul peak; None when it was
            not measured: ``mfu`` and ``hfu`` are then None and only the ``*_vs_bf16`` figures stay).
        precision: the target's matmul precision, ``"bf16"`` or ``"fp8"``.
        target_model: the target's share of ``flops_model`` (all of it for a target row, 0 for a
            drafter row); ``target_computed`` likewise of ``flops_computed`` (default: the same
            fraction as the model FLOPs).
        gpus: the devices the rate is spread over.

    Returns:
        ``mfu``, ``hfu``, ``mfu_vs_bf16``, ``hfu_vs_bf16``, ``peak`` (which peaks: ``"bf16"``,
        ``"fp8"`` or ``"fp8 target + bf16 drafter"``), ``peak_tflops`` (effective), ``target_flops_model``.
    """
    model, computed, tflops = m["flops_model"], m["flops_computed"], m["tflops"]
    if target_computed is None:
        target_computed = computed * (target_model / model) if model else 0.0
    out: dict[str, Any] = {"mfu_vs_bf16": tflops / (bf16_tflops * gpus),
                           "hfu_vs_bf16": tflops * (computed / model) / (bf16_tflops * gpus) if model else None,
                           "target_flops_model": target_model}
    fp8 = precision == "fp8" and target_model > 0
    if fp8 and not target_tflops:
        return {**out, "mfu": None, "hfu": None, "peak": "fp8 (not measured)", "peak_tflops": None}
    pt = target_tflops if fp8 else bf16_tflops
    secs = model / (tflops * 1e12)
    ideal_model = target_model / pt + (model - target_model) / bf16_tflops  # seconds x 1e12 at the peaks
    ideal_computed = target_computed / pt + (computed - target_computed) / bf16_tflops
    peak = "bf16" if not fp8 else ("fp8" if target_model >= model else "fp8 target + bf16 drafter")
    return {**out, "mfu": ideal_model / 1e12 / (secs * gpus), "hfu": ideal_computed / 1e12 / (secs * gpus),
            "peak": peak, "peak_tflops": model / ideal_model}


def attempt(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``{"status": "ok", **fn()}``, or, when ``fn`` raises, ``{"status": "error", "error": ...,
    "traceback": ...}`` with the traceback printed to stderr: a failed measurement is recorded and
    the next one still runs."""
    try:
        return {"status": "ok", **fn()}
    except Exception as exc:  # noqa: BLE001 - recorded, not raised
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": tb[-3000:]}


def ok(run: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    """The measurement ``name`` of ``run`` if it succeeded, else None."""
    m = (run or {}).get("measurements", {}).get(name)
    return m if m and m.get("status") == "ok" else None


def _first(runs: dict[str, Any], order: tuple[str, ...], *names: str) -> tuple[str | None, list[Any]]:
    """The first run (in ``order``) where every measurement in ``names`` succeeded."""
    for r in order:
        found = [ok(runs.get(r), n) for n in names]
        if all(found):
            return r, found
    return None, [None] * len(names)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(runs: dict[str, Any]) -> dict[str, Any]:
    """The top-level keys of the results file (see the module docstring); None where not measured."""
    s: dict[str, Any] = {}
    src: dict[str, str | None] = {}

    def take(key: str, order: tuple[str, ...], name: str, field: str = "tok_s") -> None:
        r, (m,) = _first(runs, order, name)
        s[key], src[key] = (m.get(field) if m else None), r  # older results files lack newer fields

    take("matmul_tflops", SINGLE, "matmul", "tflops")
    take("matmul_fp8_tflops", SINGLE, "matmul_fp8", "tflops")  # measured when the target is fp8
    take("serial_tok_s", SINGLE, "serial")
    take("target_alone_tok_s", SINGLE, "target_alone")
    take("drafter_alone_tok_s", SINGLE, "drafter_alone")

    r, (p1, ser) = _first(runs, SINGLE, "pipeline_1gpu", "serial")
    s["pipeline_1gpu_tok_s"] = p1["tok_s"] if p1 else None
    s["speedup_1gpu_vs_serial"] = _ratio(p1 and p1["tok_s"], ser and ser["tok_s"])
    src["pipeline_1gpu_tok_s"] = src["speedup_1gpu_vs_serial"] = r
    if p1 is None:
        r, (p1,) = _first(runs, SINGLE, "pipeline_1gpu")
        s["pipeline_1gpu_tok_s"], src["pipeline_1gpu_tok_s"] = (p1["tok_s"] if p1 else None), r

    r, (p2,) = _first(runs, DOUBLE, "pipeline_2gpu")
    run2 = runs.get(r) if r else None
    t, d, ser2 = ok(run2, "target_alone"), ok(run2, "drafter_alone"), ok(run2, "serial")
    stages = {k: m["tok_s"] for k, m in (("target", t), ("drafter", d)) if m}
    slowest = min(stages, key=stages.get) if len(stages) == 2 else None
    s["pipeline_2gpu_tok_s"] = p2["tok_s"] if p2 else None
    s["slowest_stage_2gpu"] = slowest
    s["slowest_stage_tok_s_2gpu"] = stages[slowest] if slowest else None
    s["efficiency_2gpu"] = _ratio(s["pipeline_2gpu_tok_s"], s["slowest_stage_tok_s_2gpu"])
    s["speedup_2gpu_vs_serial"] = _ratio(s["pipeline_2gpu_tok_s"], ser2 and ser2["tok_s"])
    for k in ("pipeline_2gpu_tok_s", "slowest_stage_tok_s_2gpu", "efficiency_2gpu", "speedup_2gpu_vs_serial"):
        src[k] = r
    if p2 is None:
        reasons = [m.get("reason") or m.get("error") for run in runs.values()
                   if (m := run.get("measurements", {}).get("pipeline_2gpu"))]
        s["pipeline_2gpu_null_reason"] = "; ".join(x for x in reasons if x) or "no run on two GPUs merged"

    r, (tm, pm) = _first(runs, SINGLE, "target_alone", "plain_forward")
    if tm is None:
        r, (tm,) = _first(runs, SINGLE, "target_alone")
    s["target_mfu"] = tm["mfu"] if tm else None
    s["plain_forward_mfu"] = pm["mfu"] if pm else None
    src["target_mfu"] = src["plain_forward_mfu"] = r
    take("drafter_mfu", SINGLE, "drafter_alone", "mfu")
    take("serial_mfu", SINGLE, "serial", "mfu")
    take("pipeline_1gpu_mfu", SINGLE, "pipeline_1gpu", "mfu")

    # the target's attention implementations, measured alone in one run (the default is target_alone)
    r, (tm,) = _first(runs, SINGLE, "target_alone")
    variants = {}
    if tm:
        variants[tm.get("attn_implementation", "default")] = tm
        for impl in ATTN_VARIANTS:
            if m := ok(runs[r], f"target_alone_{impl}"):
                variants[impl] = m
    s["target_attention"] = {k: {"tok_s": m["tok_s"], "mfu": m.get("mfu"), "hfu": m.get("hfu")}
                             for k, m in variants.items()}
    # named only when there is a choice (two or more implementations measured in one run)
    s["fastest_target_attention"] = max(variants, key=lambda k: variants[k]["tok_s"]) if len(variants) > 1 else None
    src["target_attention"] = src["fastest_target_attention"] = r

    # the colocated data-parallel baseline, and each layout against it (same run)
    for runs_of, gpus, ratio_key in ((SINGLE, "1gpu", "pipeline_1gpu_vs_colocated"),
                                     (DOUBLE, "2gpu", "speedup_2gpu_vs_colocated")):
        r, (c, p) = _first(runs, runs_of, f"colocated_{gpus}", f"pipeline_{gpus}")
        if c is None:
            r, (c,) = _first(runs, runs_of, f"colocated_{gpus}")
        s[f"colocated_{gpus}_tok_s"] = c["tok_s"] if c else None
        s[ratio_key] = _ratio(p and p["tok_s"], c and c["tok_s"])
        src[f"colocated_{gpus}_tok_s"] = src[ratio_key] = r

    # 2-GPU bounds from the stages measured alone in one run: no all-reduce, no transfer, perfect overlap
    r, (t1, d1) = _first(runs, SINGLE, "target_alone", "drafter_alone")
    t_, d_ = (t1["tok_s"], d1["tok_s"]) if t1 else (None, None)
    s["colocated_2gpu_bound_tok_s"] = 2.0 / (1.0 / t_ + 1.0 / d_) if t1 else None
    s["csp_2gpu_bound_tok_s"] = min(t_, d_) if t1 else None
    s["csp_vs_colocated_2gpu_bound"] = _ratio(s["csp_2gpu_bound_tok_s"], s["colocated_2gpu_bound_tok_s"])
    for k in ("colocated_2gpu_bound_tok_s", "csp_2gpu_bound_tok_s", "csp_vs_colocated_2gpu_bound"):
        src[k] = r

    for mode in ("1gpu", "2gpu"):
        r, (c,) = _first(runs, (mode, "smoke") if mode == "1gpu" else DOUBLE, f"checkpoint_{mode}")
        s[f"checkpoint_slowdown_{mode}"] = c["slowdown"] if c else None
        src[f"checkpoint_slowdown_{mode}"] = r
    two = s["checkpoint_slowdown_2gpu"] is not None
    s["checkpoint_slowdown"] = s["checkpoint_slowdown_2gpu"] if two else s["checkpoint_slowdown_1gpu"]
    src["checkpoint_slowdown"] = src["checkpoint_slowdown_2gpu" if two else "checkpoint_slowdown_1gpu"]

    s["peak_mem_gb"] = {}
    s["capacity_sweep"] = {}
    for mode in ("1gpu", "2gpu"):
        r, (p,) = _first(runs, SINGLE if mode == "1gpu" else DOUBLE, f"pipeline_{mode}")
        if p:
            s["peak_mem_gb"][f"pipeline_{mode}"] = p.get("peak_mem_gb")
        r, (sw,) = _first(runs, SINGLE if mode == "1gpu" else DOUBLE, f"capacity_sweep_{mode}")
        if sw:
            s["capacity_sweep"][mode] = {"channels": sw["channels"], "tok_s": sw["tok_s"]}

    goals = {}
    for name, (key, op, bound) in GOALS.items():
        v = s.get(key)
        goals[name] = {"goal": f"{op} {bound}", "value": v,
                       "met": None if v is None else (v >= bound if op == ">=" else v < bound)}
        if v is not None and goals[name]["met"] is False:
            goals[name]["missed_by"] = (bound - v) if op == ">=" else (v - bound)
    tm_, pm_ = s["target_mfu"], s["plain_forward_mfu"]
    goals["target_mfu"] = {"goal": ">= plain_forward_mfu", "value": tm_,
                           "met": None if tm_ is None or pm_ is None else tm_ >= pm_}
    s["goals"] = goals
    s["sources"] = src
    s["smoke"] = any(v == "smoke" for v in src.values())
    return s


def command_line(runs: dict[str, Any]) -> str:
    """The commands of the merged runs, in run order, joined by `` ; ``."""
    return " ; ".join(run["command"] for _, run in sorted(runs.items()) if run.get("command"))


def load_runs(paths: list[Path]) -> dict[str, Any]:
    """The ``runs`` of existing results files (later files win on a run name clash); missing files
    are skipped."""
    runs: dict[str, Any] = {}
    for p in paths:
        if Path(p).is_file():
            runs.update(json.loads(Path(p).read_text()).get("runs", {}))
    return runs


def write_results(path: Path, runs: dict[str, Any]) -> dict[str, Any]:
    """Write ``{summary..., "runs": runs}`` to ``path`` atomically (tmp file + rename); returns it."""
    doc = {"command": command_line(runs), **summarize(runs), "runs": runs}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return doc


def fmt_value(v: Any, kind: str = "num") -> str:
    if v is None:
        return "n/a"
    if kind == "tok":
        return f"{v / 1e3:,.1f}K"
    if kind == "pct":
        return f"{100 * v:+.1f}%"
    if kind == "x":
        return f"{v:.2f}x"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def markdown(doc: dict[str, Any]) -> str:
    """The results section of benchmarks/results/LOG.md, generated from a results file."""
    src = doc.get("sources", {})
    slow = doc.get("slowest_stage_2gpu")
    rows = [
        ("bf16 matmul 8192^3 (TFLOP/s)", fmt_value(doc.get("matmul_tflops")), "matmul_tflops"),
        ("target forward alone (tokens/s)", fmt_value(doc.get("target_alone_tok_s"), "tok"), "target_alone_tok_s"),
        ("drafter step alone (tokens/s)", fmt_value(doc.get("drafter_alone_tok_s"), "tok"), "drafter_alone_tok_s"),
        ("serial loop, 1 GPU (tokens/s)", fmt_value(doc.get("serial_tok_s"), "tok"), "serial_tok_s"),
        ("csp pipeline, 1 GPU (tokens/s)", fmt_value(doc.get("pipeline_1gpu_tok_s"), "tok"), "pipeline_1gpu_tok_s"),
        ("speedup, 1 GPU vs serial", fmt_value(doc.get("speedup_1gpu_vs_serial"), "x"), "speedup_1gpu_vs_serial"),
        ("csp pipeline, 2 GPUs (tokens/s)", fmt_value(doc.get("pipeline_2gpu_tok_s"), "tok"), "pipeline_2gpu_tok_s"),
        (f"slowest stage alone, 2-GPU run ({slow or 'n/a'})", fmt_value(doc.get("slowest_stage_tok_s_2gpu"), "tok"),
         "slowest_stage_tok_s_2gpu"),
        ("efficiency, 2 GPUs (pipeline / slowest stage)", fmt_value(doc.get("efficiency_2gpu")), "efficiency_2gpu"),
        ("speedup, 2 GPUs vs serial", fmt_value(doc.get("speedup_2gpu_vs_serial"), "x"), "speedup_2gpu_vs_serial"),
        ("target MFU (document-masked forward)", fmt_value(doc.get("target_mfu")), "target_mfu"),
        ("plain transformers forward MFU", fmt_value(doc.get("plain_forward_mfu")), "plain_forward_mfu"),
        ("step-time change during a checkpoint, 1 GPU", fmt_value(doc.get("checkpoint_slowdown_1gpu"), "pct"),
         "checkpoint_slowdown_1gpu"),
        ("step-time change during a checkpoint, 2 GPUs", fmt_value(doc.get("checkpoint_slowdown_2gpu"), "pct"),
         "checkpoint_slowdown_2gpu"),
        ("drafter step MFU", fmt_value(doc.get("drafter_mfu")), "drafter_mfu"),
        ("serial loop MFU", fmt_value(doc.get("serial_mfu")), "serial_mfu"),
        ("csp pipeline, 1 GPU, MFU", fmt_value(doc.get("pipeline_1gpu_mfu")), "pipeline_1gpu_mfu"),
        (f"fastest target attention alone ({doc.get('fastest_target_attention') or 'n/a'})",
         fmt_value(((doc.get("target_attention") or {}).get(doc.get("fastest_target_attention")) or {}).get("tok_s"), "tok"),
         "fastest_target_attention"),
        ("colocated data-parallel, 1 GPU (tokens/s)", fmt_value(doc.get("colocated_1gpu_tok_s"), "tok"),
         "colocated_1gpu_tok_s"),
        ("csp pipeline, 1 GPU vs colocated", fmt_value(doc.get("pipeline_1gpu_vs_colocated"), "x"),
         "pipeline_1gpu_vs_colocated"),
        ("colocated data-parallel, 2 GPUs (tokens/s)", fmt_value(doc.get("colocated_2gpu_tok_s"), "tok"),
         "colocated_2gpu_tok_s"),
        ("csp pipeline, 2 GPUs vs colocated", fmt_value(doc.get("speedup_2gpu_vs_colocated"), "x"),
         "speedup_2gpu_vs_colocated"),
        ("**bound**, 2 GPUs colocated (2 / (1/target + 1/drafter), stages alone; not measured)",
         fmt_value(doc.get("colocated_2gpu_bound_tok_s"), "tok"), "colocated_2gpu_bound_tok_s"),
        ("**bound**, 2 GPUs csp (min(target, drafter), stages alone; not measured)",
         fmt_value(doc.get("csp_2gpu_bound_tok_s"), "tok"), "csp_2gpu_bound_tok_s"),
        ("**bound** ratio, 2 GPUs csp / colocated", fmt_value(doc.get("csp_vs_colocated_2gpu_bound"), "x"),
         "csp_vs_colocated_2gpu_bound"),
    ]
    out = ["| quantity | value | run |", "| --- | ---: | --- |"]
    out += [f"| {q} | {v} | {src.get(k) or '-'} |" for q, v, k in rows]
    for name, mem in (doc.get("peak_mem_gb") or {}).items():
        shown = ", ".join(f"{d}: {g}" for d, g in mem.items()) or "n/a"
        out.append(f"| peak GPU memory, {name} (GiB) | {shown} | |")
    for mode, sweep in (doc.get("capacity_sweep") or {}).items():
        by_cap = sorted(sweep["tok_s"].items(), key=lambda kv: int(kv[0]))
        pts = ", ".join(f"{c}: {fmt_value(v, 'tok')}" for c, v in by_cap)
        out.append(f"| tokens/s by capacity of {' + '.join(sweep['channels'])}, {mode} | {pts} | |")
    out += ["", "| goal | target | value | met |", "| --- | --- | ---: | --- |"]
    for key, g in (doc.get("goals") or {}).items():
        kind = "pct" if key == "checkpoint_slowdown" else ("tok" if key.endswith("tok_s") else "num")
        by = f" (by {fmt_value(g['missed_by'], kind)})" if "missed_by" in g else ""
        met = "n/a" if g["met"] is None else ("yes" if g["met"] else f"no{by}")
        out.append(f"| {key} | {g['goal']} | {fmt_value(g['value'], kind)} | {met} |")
    out += ["", "| run | measurement | tokens/s | TFLOP/s | MFU | HFU | attention share | peak GiB |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for rname, run in sorted((doc.get("runs") or {}).items()):
        ms = run.get("measurements", {})
        for name in TABLED:
            m = ms.get(name)
            if not m or m.get("status") != "ok":
                continue
            mem = ", ".join(f"{d}: {g}" for d, g in (m.get("peak_mem_gb") or {}).items()) or "n/a"
            label = name + (f" ({m['attn_implementation']})" if name == "target_alone" and "attn_implementation" in m else "")
            out.append(f"| {rname} | {label} | {fmt_value(m.get('tok_s'), 'tok')} | {fmt_value(m.get('tflops'))} | "
                       f"{fmt_value(m.get('mfu'))} | {fmt_value(m.get('hfu'))} | {fmt_value(m.get('attention_share'))} | {mem} |")
    if doc.get("pipeline_2gpu_null_reason"):
        out += ["", f"pipeline_2gpu_tok_s is null: {doc['pipeline_2gpu_null_reason']}"]
    if doc.get("smoke"):
        out += ["", "**These are CPU smoke numbers (tiny shapes), not H200 results.**"]
    out += ["", f"Command(s): `{doc.get('command', '')}`"]
    return "\n".join(out)


BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def update_markdown(path: Path, doc: dict[str, Any]) -> None:
    """Replace the text between the results markers of ``path`` with :func:`markdown` of ``doc``.

    Raises:
        ValueError: ``path`` lacks the ``<!-- results:begin -->`` / ``<!-- results:end -->`` markers.
    """
    text = Path(path).read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path}: no {BEGIN} ... {END} section to fill")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    Path(path).write_text(f"{head}{BEGIN}\n{markdown(doc)}\n{END}{tail}")
