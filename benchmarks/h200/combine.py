"""One results file from one run of ``python -m benchmarks.h200.suite fastest``: ``OUT/perf.json``
(the stages alone, ``benchmarks/h200/perf.py``), ``OUT/h200-bf16.json`` and ``OUT/h200-fp8.json``
(``benchmarks/h200/bench.py`` with the bf16 target and with the fp8, varlen, compiled one) side by
side, with the goals, written to ``OUT/h200.json``::

    python -m benchmarks.h200.combine OUT [--keep-2gpu FILE] [--out FILE]

``benchmarks/results/h200.json`` was generated with (the suite's files copied into
``benchmarks/results/h200_fastest/`` first, the 2-GPU run kept from the file it replaces)::

    python -m benchmarks.h200.combine benchmarks/results/h200_fastest \\
        --keep-2gpu benchmarks/results/h200.json --out benchmarks/results/h200.json

The file keeps the format of :mod:`benchmarks.h200.report` (its summary keys over ``runs``, so
``h200/plot.py`` and ``--merge`` read it as before): ``runs`` holds ``"1gpu"`` (the bf16 bench run),
``"1gpu_fp8"`` (the fp8 one; the summary keys never read it) and, with ``--keep-2gpu``, ``"2gpu"``
copied from FILE with ``kept`` saying where it came from and that this suite did not re-measure it.
Beside those:

* ``rows``: every rate, each with ``mfu`` against its matching measured peak (bf16 rows against the
  bf16 peak of the same file; the fp8 target against the fp8 peak; serial, colocated and pipeline with
  the fp8 target credited at ``(F_target / P_fp8 + F_drafter / P_bf16) / seconds``,
  :func:`benchmarks.h200.report.matched_mfu`), ``mfu_vs_bf16`` beside it, ``peak`` / ``peak_tflops`` /
  ``peak_from``, ``mfu_from`` (``recorded`` by the harness, or ``recomputed`` here from the raw TFLOP/s
  for a file written before the harness measured the fp8 peak: the fp8 peak is then perf.json's and
  the target's share of a two-stage row is the same run's ``target_alone`` FLOPs over the same timed
  batches), the ``command`` that produced it and where in which file it is (``source``). Stage rows
  from perf.json: ``target_bf16`` (eager, the graph's flex attention), ``target_bf16_compiled``
  (varlen, compiled), ``target_fp8`` (varlen, eager), ``target_fp8_compiled``, ``drafter_compiled``;
  from each bench run ``<name>_<bf16|fp8>`` for ``target_alone``, ``drafter_alone``, ``serial``,
  ``colocated_1gpu`` and ``pipeline_1gpu``;
* ``side_by_side``: tokens/s and MFU of each bench measurement, bf16 beside fp8;
* ``goals`` (:data:`GOALS`): value, ``met`` (None when not measured), ``from`` (the rows), ``missed_by``;
  the stage goals read perf.json's rows (one process, one set of batches, the model quantized in
  place) and fall back to the bench runs' stages; ``pipeline_vs_serial`` is the lower of the two
  runs' ratios (each from one run), both listed in ``values``;
* ``bench_goals``: :mod:`benchmarks.h200.report`'s per-run goals over ``runs`` (the bf16 1-GPU run
  and the kept 2-GPU one), ``inputs``: the files read and their commands.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.h200.report import fmt_value, command_line, matched_mfu, ok, summarize

SUITE = "python -m benchmarks.h200.suite fastest OUT"
# goal -> (what it is, op, bound); values are computed by goals()
GOALS = {
    "target_bf16_mfu": ("bf16 target alone, MFU (bf16 peak)", ">=", 0.72),
    "fp8_target_speedup": ("fp8 target tok/s / bf16 target tok/s (fastest of each)", ">=", 1.6),
    "drafter_mfu": ("drafter step alone, MFU (bf16 peak)", ">=", 0.65),
    "pipeline_1gpu_bf16_tok_s": ("csp pipeline, 1 GPU, bf16 target (tok/s)", ">=", 24_000),
    "pipeline_1gpu_fp8_tok_s": ("csp pipeline, 1 GPU, fp8 target (tok/s)", ">=", 30_000),
    "pipeline_vs_serial": ("pipeline_1gpu / serial, same run (the lower of bf16, fp8)", ">=", 1.05),
}
# perf.json rows -> (row name here, target precision or None for the drafter)
PERF_ROWS = {"target_bf16": ("target_bf16", "bf16"), "target_bf16_varlen_compile": ("target_bf16_compiled", "bf16"),
             "target_fp8_varlen": ("target_fp8", "fp8"), "target_fp8_varlen_compile": ("target_fp8_compiled", "fp8"),
             "drafter_compile": ("drafter_compiled", None)}
BENCH_ROWS = ("target_alone", "drafter_alone", "serial", "colocated_1gpu", "pipeline_1gpu")
KEEP = ("tok_s", "step_s", "steps_timed", "tokens_timed", "tflops", "attn_implementation", "peak_mem_gb")


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _precision(run: dict[str, Any]) -> str:
    """The bench run's target precision: recorded by the harness, else read off its overrides."""
    if run.get("target_precision"):
        return run["target_precision"]
    sets = run.get("settings", {}).get("overrides", [])
    return "fp8" if any(re.fullmatch(r"target\.quantization\s*=\s*['\"]?fp8['\"]?", s) for s in sets) else "bf16"


def _row(m: dict[str, Any] | None, *, source: str, command: str | None, precision: str, kind: str,
         peaks: dict[str, tuple[float | None, str]], target_model: float | None = None,
         target_computed: float | None = None, gpus: int = 1) -> dict[str, Any]:
    """A ``rows`` entry of the measurement ``m``. ``kind``: ``target``, ``drafter`` or ``both``;
    ``peaks``: ``{"bf16"|"fp8": (TFLOP/s or None, where it was measured)}``; ``target_model``: the
    target's share of a ``both`` row's FLOPs when the measurement does not record it (``target_computed``
    likewise of its computed FLOPs)."""
    base = {"source": source, "command": command, "precision": precision if kind != "drafter" else "bf16"}
    if m is None:
        return {"status": "missing", **base}
    if m.get("status") != "ok":
        return {"status": m.get("status"), "reason": m.get("reason") or m.get("error"), **base}
    row = {"status": "ok", **{k: m[k] for k in KEEP if k in m}, **base}
    bf16, bf16_from = peaks["bf16"]
    fp8, fp8_from = peaks.get("fp8", (None, "not measured"))
    uses_fp8 = precision == "fp8" and kind != "drafter"
    if "mfu_vs_bf16" in m and ("peak" in m or "peak_tflops_used" in m):  # the harness chose the peaks itself
        row.update({"mfu": m.get("mfu"), "hfu": m.get("hfu"), "mfu_vs_bf16": m["mfu_vs_bf16"],
                    "peak": m.get("peak", "fp8" if uses_fp8 else "bf16"),
                    "peak_tflops": m.get("peak_tflops", m.get("peak_tflops_used")), "mfu_from": "recorded"})
        row["peak_from"] = (None if row["peak_tflops"] is None else f"{fp8_from} + {bf16_from}"
                            if row["peak"] == "fp8 target + bf16 drafter" else fp8_from if row["peak"] == "fp8"
                            else bf16_from)
        return row
    if not uses_fp8:  # bf16 throughout: the recorded MFU is against the bf16 peak of the same run
        t = {"target": m.get("flops_model", 0.0), "drafter": 0.0}.get(kind, m.get("target_flops_model"))
        return {**row, "mfu": m.get("mfu"), "hfu": m.get("hfu"), "mfu_vs_bf16": m.get("mfu"), "peak": "bf16",
                "peak_tflops": bf16, "peak_from": bf16_from, "mfu_from": "recorded", **(
                    {"target_flops_model": t} if t is not None else {})}
    t = m["flops_model"] if kind == "target" else m.get("target_flops_model", target_model)
    if t is None:
        return {**row, "mfu": None, "hfu": None, "mfu_vs_bf16": m["tflops"] / (bf16 * gpus), "peak": None,
                "peak_tflops": None, "mfu_from": "not computed: the target's share of the FLOPs is unknown "
                "(no target_alone over the same timed batches in this run)"}
    tc = m["flops_computed"] if kind == "target" else m.get("target_flops_computed", target_computed)
    out = matched_mfu(m, bf16_tflops=bf16, target_tflops=fp8, precision="fp8", target_model=t,
                      target_computed=tc, gpus=gpus)
    out.pop("hfu_vs_bf16", None)
    peak_from = fp8_from if out["peak"] == "fp8" else f"{fp8_from} + {bf16_from}"
    return {**row, **out, "peak_from": peak_from,
            "mfu_from": "recomputed from tflops (the file predates the fp8 peak in bench_h200)"}


def perf_rows(perf: dict[str, Any] | None, name: str = "perf.json") -> dict[str, dict[str, Any]]:
    """The stage rows of a perf.json (missing ones say so)."""
    rows = (perf or {}).get("rows", {})
    mm, mm8 = ok({"measurements": rows}, "matmul_bf16"), ok({"measurements": rows}, "matmul_fp8")
    peaks = {"bf16": (mm and mm["tflops"], f"{name} matmul_bf16"),
             "fp8": (mm8 and mm8["tflops"], f"{name} matmul_fp8" if mm8 else "not measured")}
    out = {}
    for src, (dst, prec) in PERF_ROWS.items():
        out[dst] = _row(rows.get(src), source=f"{name} rows.{src}", command=(perf or {}).get("command"),
                        precision=prec or "bf16", kind="target" if prec else "drafter", peaks=peaks)
    return out


def bench_rows(run: dict[str, Any] | None, label: str, name: str,
               fallback_fp8: tuple[float | None, str]) -> dict[str, dict[str, Any]]:
    """The ``BENCH_ROWS`` of one bench run as ``<row>_<label>``; ``fallback_fp8``: perf.json's fp8
    peak, for a run that did not measure its own."""
    run = run or {}
    ms = run.get("measurements", {})
    precision = _precision(run) if run else label
    mm, mm8 = ok(run, "matmul"), ok(run, "matmul_fp8")
    peaks = {"bf16": (mm and mm["tflops"], f"{name} matmul"),
             "fp8": (mm8["tflops"], f"{name} matmul_fp8") if mm8 else fallback_fp8}
    t_alone = ok(run, "target_alone")
    out = {}
    for r in BENCH_ROWS:
        m = ms.get(r)
        kind = {"target_alone": "target", "drafter_alone": "drafter"}.get(r, "both")
        share = share_c = None  # the target's FLOPs in a two-stage row: target_alone's, same timed batches
        if kind == "both" and m and t_alone and m.get("tokens_timed") == t_alone.get("tokens_timed"):
            share, share_c = t_alone["flops_model"], t_alone.get("flops_computed")
        out[f"{r}_{label}"] = _row(m if run else None, source=f"{name} runs.1gpu.measurements.{r}",
                                   command=run.get("command"), precision=precision, kind=kind, peaks=peaks,
                                   target_model=share, target_computed=share_c)
    return out


def _goal(value: float | None, op: str, bound: float, what: str, **extra: Any) -> dict[str, Any]:
    g = {"goal": f"{op} {bound}", "what": what, "value": value,
         "met": None if value is None else (value >= bound if op == ">=" else value < bound), **extra}
    if g["met"] is False:
        g["missed_by"] = bound - value if op == ">=" else value - bound
    return g


def _val(rows: dict[str, Any], name: str, field: str) -> float | None:
    r = rows.get(name) or {}
    return r.get(field) if r.get("status") == "ok" else None


def _best(rows: dict[str, Any], names: list[str], field: str) -> tuple[float | None, str | None]:
    vals = [(v, n) for n in names if (v := _val(rows, n, field)) is not None]
    return max(vals) if vals else (None, None)


def goals(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The :data:`GOALS` table from ``rows`` (module docstring: which rows each goal reads)."""
    g: dict[str, dict[str, Any]] = {}
    perf_bf16, perf_fp8 = ["target_bf16", "target_bf16_compiled"], ["target_fp8", "target_fp8_compiled"]
    v, frm = _best(rows, perf_bf16, "mfu")
    if v is None:
        v, frm = _best(rows, ["target_alone_bf16"], "mfu")
    g["target_bf16_mfu"] = _goal(v, *GOALS["target_bf16_mfu"][1:], GOALS["target_bf16_mfu"][0], **{"from": frm})
    (f8, f8_from), (b16, b16_from) = _best(rows, perf_fp8, "tok_s"), _best(rows, perf_bf16, "tok_s")
    if f8 is None or b16 is None:  # one pair from one kind of source
        (f8, f8_from), (b16, b16_from) = _best(rows, ["target_alone_fp8"], "tok_s"), _best(rows, ["target_alone_bf16"], "tok_s")
    sp = f8 / b16 if f8 is not None and b16 else None
    g["fp8_target_speedup"] = _goal(sp, *GOALS["fp8_target_speedup"][1:], GOALS["fp8_target_speedup"][0],
                                    **{"from": [f8_from, b16_from] if sp is not None else None})
    v, frm = _best(rows, ["drafter_compiled"], "mfu")
    if v is None:
        v, frm = _best(rows, ["drafter_alone_bf16", "drafter_alone_fp8"], "mfu")
    g["drafter_mfu"] = _goal(v, *GOALS["drafter_mfu"][1:], GOALS["drafter_mfu"][0], **{"from": frm})
    for p in ("bf16", "fp8"):
        k = f"pipeline_1gpu_{p}_tok_s"
        v = _val(rows, f"pipeline_1gpu_{p}", "tok_s")
        g[k] = _goal(v, *GOALS[k][1:], GOALS[k][0], **{"from": f"pipeline_1gpu_{p}" if v is not None else None})
    ratios = {}
    for p in ("bf16", "fp8"):
        pl, se = _val(rows, f"pipeline_1gpu_{p}", "tok_s"), _val(rows, f"serial_{p}", "tok_s")
        if pl is not None and se:
            ratios[p] = pl / se
    low = min(ratios, key=ratios.get) if ratios else None
    g["pipeline_vs_serial"] = _goal(ratios[low] if low else None, *GOALS["pipeline_vs_serial"][1:],
                                    GOALS["pipeline_vs_serial"][0], values=ratios,
                                    **{"from": [f"pipeline_1gpu_{low}", f"serial_{low}"] if low else None})
    return g


def _git_commit(path: Path) -> str | None:
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%H", "--", path.name], cwd=path.parent, check=False,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _with_matched_mfu(run: dict[str, Any], rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``run`` (an fp8 bench run) with each measurement's ``mfu``/``hfu`` replaced by the row's
    recomputed, matched-peak figures (the recorded ones kept as ``mfu_vs_bf16``/``hfu_vs_bf16``), so
    every table read off ``runs`` shows the same MFU as ``rows``. A run whose harness recorded matched
    figures itself is returned as it is."""
    out = copy.deepcopy(run)
    for r in BENCH_ROWS:
        m, row = out.get("measurements", {}).get(r), rows.get(f"{r}_fp8", {})
        if not m or m.get("status") != "ok" or not str(row.get("mfu_from", "")).startswith("recomputed"):
            continue
        m["mfu_vs_bf16"], m["hfu_vs_bf16"] = m.get("mfu"), m.get("hfu")
        m["mfu"], m["hfu"], m["peak"] = row.get("mfu"), row.get("hfu"), row.get("peak")
    return out


def combine(perf: dict[str, Any] | None, bf16: dict[str, Any] | None, fp8: dict[str, Any] | None,
            kept_2gpu: dict[str, Any] | None = None, *, command: str = "", names: dict[str, str] | None = None,
            kept_from: dict[str, Any] | None = None) -> dict[str, Any]:
    """The combined results document from the three files of one suite run (any may be None: its
    rows say ``missing`` and its goals are None) and an earlier 2-GPU run to carry over."""
    names = {"perf": "perf.json", "bf16": "h200-bf16.json", "fp8": "h200-fp8.json", **(names or {})}
    rows = perf_rows(perf, names["perf"])
    fp8_peak = ok({"measurements": (perf or {}).get("rows", {})}, "matmul_fp8")
    fallback = (fp8_peak["tflops"], f"{names['perf']} matmul_fp8") if fp8_peak else (None, "not measured")
    bench: dict[str, dict[str, Any] | None] = {}
    for label, doc in (("bf16", bf16), ("fp8", fp8)):
        bench[label] = (doc or {}).get("runs", {}).get("1gpu")
        rows.update(bench_rows(bench[label], label, names[label], fallback))
    runs: dict[str, Any] = {}
    if bench["bf16"]:
        runs["1gpu"] = bench["bf16"]
    if bench["fp8"]:
        runs["1gpu_fp8"] = _with_matched_mfu(bench["fp8"], rows)
    if kept_2gpu is not None:
        runs["2gpu"] = {**kept_2gpu, "kept": kept_2gpu.get("kept") or {
            **(kept_from or {}), "remeasured": False,
            "note": "measured earlier on a 2-GPU machine; copied in, not re-measured by this suite run"}}
    summary = summarize(runs)
    side = {r: {p: {"tok_s": _val(rows, f"{r}_{p}", "tok_s"), "mfu": _val(rows, f"{r}_{p}", "mfu"),
                    "mfu_vs_bf16": _val(rows, f"{r}_{p}", "mfu_vs_bf16")} for p in ("bf16", "fp8")}
            for r in BENCH_ROWS}
    inputs = {k: {"file": names[k], "command": (d or {}).get("command"), "found": d is not None}
              for k, d in (("perf", perf), ("bf16", bf16), ("fp8", fp8))}
    if kept_from is not None or kept_2gpu is not None:
        inputs["2gpu"] = {**(kept_from or {}), "found": kept_2gpu is not None}
    bench_goals = summary.pop("goals")
    return {"command": command, "suite": SUITE, "bench_commands": command_line(runs), **summary,
            "goals": goals(rows), "rows": rows, "side_by_side": side, "bench_goals": bench_goals,
            "inputs": inputs, "runs": runs}


def markdown(doc: dict[str, Any]) -> str:
    """The goals and the rows as markdown tables."""
    out = ["| goal | target | value | met | from |", "| --- | --- | ---: | --- | --- |"]
    for k, g in doc["goals"].items():
        kind = "tok" if k.endswith("tok_s") else "num"
        met = "n/a" if g["met"] is None else ("yes" if g["met"] else f"no (by {fmt_value(g['missed_by'], kind)})")
        frm = g.get("from")
        out.append(f"| {k} | {g['goal']} | {fmt_value(g['value'], kind)} | {met} | "
                   f"{', '.join(frm) if isinstance(frm, list) else frm or '-'} |")
    out += ["", "| row | tokens/s | TFLOP/s | MFU | MFU vs bf16 | peak | peak TFLOP/s |",
            "| --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for k, r in doc["rows"].items():
        if r.get("status") != "ok":
            out.append(f"| {k} | {r.get('status')}: {r.get('reason') or ''} | | | | | |")
            continue
        out.append(f"| {k} | {fmt_value(r.get('tok_s'), 'tok')} | {fmt_value(r.get('tflops'))} | {fmt_value(r.get('mfu'))} | "
                   f"{fmt_value(r.get('mfu_vs_bf16'))} | {r.get('peak') or 'n/a'} | {fmt_value(r.get('peak_tflops'))} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.h200.combine", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path, help="the suite's OUT (perf.json, h200-bf16.json, h200-fp8.json)")
    p.add_argument("--keep-2gpu", type=Path, default=None, metavar="FILE",
                   help="copy the \"2gpu\" run of this earlier results file in (marked as not re-measured)")
    p.add_argument("--out", type=Path, default=None, help="the combined file (default OUT/h200.json)")
    a = p.parse_args(argv)
    out = a.out or a.out_dir / "h200.json"
    docs = {k: _load(a.out_dir / f) for k, f in (("perf", "perf.json"), ("bf16", "h200-bf16.json"),
                                                 ("fp8", "h200-fp8.json"))}
    if not any(docs.values()):
        p.error(f"{a.out_dir}: none of perf.json, h200-bf16.json, h200-fp8.json")
    kept, kept_from = None, None
    if a.keep_2gpu is not None:
        old = _load(a.keep_2gpu)
        kept = (old or {}).get("runs", {}).get("2gpu")
        kept_from = {"from": str(a.keep_2gpu), "git_commit": _git_commit(a.keep_2gpu.resolve()),
                     "started": (kept or {}).get("started"), "run_command": (kept or {}).get("command")}
        if kept is None:
            print(f"h200_combine: --keep-2gpu {a.keep_2gpu}: no \"2gpu\" run there; none kept", file=sys.stderr)
    names = {k: str(a.out_dir / f) for k, f in (("perf", "perf.json"), ("bf16", "h200-bf16.json"),
                                                ("fp8", "h200-fp8.json"))}
    doc = combine(docs["perf"], docs["bf16"], docs["fp8"], kept,
                  command="python -m benchmarks.h200.combine " + " ".join(argv), names=names, kept_from=kept_from)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(markdown(doc))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
