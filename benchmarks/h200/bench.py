"""DFlash training on H200: the csp pipeline against a serial loop, efficiency against the slowest
stage, MFU, memory, channel capacity and checkpoint cost. Results: benchmarks/results/LOG.md.

    python benchmarks/h200/bench.py [--set data.source=PATH] [--out benchmarks/results/h200.json]
    python benchmarks/h200/bench.py --smoke                  # tiny shapes on the CPU: every code path
    python benchmarks/h200/bench.py --tiny                   # tiny shapes on the GPUs: a quick GPU check

One invocation measures, on the visible GPUs (``--gpus auto``: 2 if there are two, else 1):

* ``matmul``: bf16 ``8192^3`` matmul rate on cuda:0 (the MFU denominator);
* ``matmul_fp8``: when the target is quantized (``target.quantization = "fp8"``), the float8
  ``8192^3`` ``torch._scaled_mm`` rate as well (:func:`benchmarks.h200.stages.scaled_mm_tflops`,
  the peak ``benchmarks/h200/perf.py`` measures): the fp8 target's MFU denominator;
* ``target_alone`` (cuda:0), ``drafter_alone`` (cuda:1 on two GPUs, else cuda:0; on features the
  target computed beforehand): each stage by itself, for the bound;
* ``serial``: target forward then drafter step per batch, one thread, one stream, cuda:0;
* ``pipeline_1gpu`` (examples/qwen3-8b-h200.toml) and, on two GPUs, ``pipeline_2gpu``
  (examples/qwen3-8b-h200x2.toml: target cuda:0, drafter cuda:1): the csp graph as
  ``python -m dflash.run`` runs it;
* ``checkpoint_<mode>``: the pipeline with ``[checkpoint].every`` saves inside the timed window; step
  times overlapping a background save against steady steps;
* ``capacity_sweep_<mode>``: pipeline tokens/s with the ``hidden`` and ``features`` channels at
  capacity 1, 2, 4, 8;
* ``plain_forward``: the plain transformers forward (all layers, all logits) for the MFU comparison;
* ``target_alone_<impl>``: the target alone with each other ``[target].attn_implementation``
  (``sdpa``, ``flex_attention``, ``eager``), switched in place, to pick the fastest default;
* ``colocated_1gpu`` / ``colocated_2gpu``: the colocated data-parallel baseline (target then drafter
  on every GPU, DDP drafters; ``benchmarks/h200/colocated.py``), one rank in this process / two
  spawned ranks.

Every measurement reports tokens/s, TFLOP/s, MFU and HFU (``benchmarks/h200/flops.py``) against the
matching measured peak, and peak memory per device: the drafter's FLOPs against ``matmul``
(bf16), the target's against ``matmul`` or, when it is quantized, ``matmul_fp8``; a measurement of
both stages (serial, colocated, pipelines) is credited with the time its FLOPs would take at those
peaks, ``(F_target / P_fp8 + F_drafter / P_bf16) / seconds``
(:func:`benchmarks.h200.report.matched_mfu`; ``peak`` and ``peak_tflops`` say which rate), so
neither stage's precision flatters the other's. ``mfu_vs_bf16`` beside it is the same rate against
the bf16 peak alone (the figure before quantization; above 1 for a fast fp8 target). At start the plan is printed with each measurement's
estimated seconds and the whole invocation's estimate.

Each measurement runs ``--warmup`` untimed then ``--steps`` timed steps, in priority order; one that
would not finish inside ``--budget-s`` (from the start of this process) is skipped and says so, one
that fails records its error, and the results file is rewritten after every measurement, so a run
killed by a time limit still leaves everything measured before. ``--merge FILE`` folds the runs of an
earlier results file (e.g. the 1-GPU machine's) into this one; ``--merge-only`` only merges.

This module is the command line (its arguments, the merge, the printed headline); the measurements
and their plan are ``benchmarks/h200/bench_plan.py``'s (:class:`Bench`), the graph files and the
tiny-shape settings ``benchmarks/h200/graphs.py``'s. Their names are importable from here too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.h200.bench_plan import (  # noqa: E402,F401 - importable from here too
    SWEEP_CHANNELS,
    TARGET_VARIANTS,
    Bench,
    data_summary,
    environment,
)
from benchmarks.h200.graphs import CPU_SETTINGS, GRAPH_1GPU, GRAPH_2GPU, TINY_SETTINGS  # noqa: E402,F401
from benchmarks.h200.report import load_runs, write_results  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "h200.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/h200/bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="graph-file override for every run, e.g. --set data.source=.devdata/sharegpt-subset.jsonl")
    p.add_argument("--out", type=Path, default=None,
                   help="results file (rewritten after each measurement; default benchmarks/results/h200.json, "
                        "or runs/bench-h200/smoke.json with --smoke/--tiny, so a check never overwrites "
                        "the committed H200 results)")
    p.add_argument("--merge", type=Path, action="append", default=[], metavar="FILE",
                   help="fold the runs of this earlier results file into --out (repeatable)")
    p.add_argument("--merge-only", action="store_true", help="only merge --merge files into --out")
    p.add_argument("--gpus", choices=["auto", "1", "2"], default="auto")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: every code path in seconds")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the visible GPUs: a quick GPU check")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per measurement (default 5; tiny 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per measurement (default 20; tiny 2)")
    p.add_argument("--capacities", default="1,2,4,8", help="channel capacities of the sweep")
    p.add_argument("--sweep-steps", type=int, default=None, help="timed steps per sweep point "
                   "(default 10; tiny 2); a point equal to the graph's capacities reuses the main run")
    p.add_argument("--ckpt-every", type=int, default=None, help="[checkpoint].every of the checkpoint run "
                   "(default 15; tiny 2)")
    p.add_argument("--ckpt-steps", type=int, default=None, help="timed steps of the checkpoint run "
                   "(default 20; tiny 4)")
    p.add_argument("--budget-s", type=float, default=390.0, help="skip what would end later than this "
                   "many seconds after start")
    p.add_argument("--skip", default="", help="comma-separated measurement names to leave out: target_alone, "
                   "target_alone_{sdpa,flex_attention,eager}, plain_forward, drafter_alone, serial, colocated_1gpu, "
                   "colocated_2gpu, pipeline_{1gpu,2gpu}, checkpoint_{1gpu,2gpu}, sweep_{1gpu,2gpu}")
    p.add_argument("--run-root", type=Path, default=ROOT / "runs" / "bench-h200",
                   help="run directories (checkpoints of the checkpoint run are written and deleted here)")
    p.add_argument("--artifacts", type=Path, default=None,
                   help="copy each pipeline run's metrics.jsonl, csp/stats.jsonl and csp/trace.json here")
    args = p.parse_args(argv)
    small = args.smoke or args.tiny
    if args.out is None:
        args.out = ROOT / "runs" / "bench-h200" / "smoke.json" if small else OUT
    args.warmup = args.warmup if args.warmup is not None else (1 if small else 5)
    args.steps = args.steps if args.steps is not None else (2 if small else 20)
    args.sweep_steps = args.sweep_steps if args.sweep_steps is not None else (2 if small else 10)
    args.ckpt_every = args.ckpt_every if args.ckpt_every is not None else (2 if small else 15)
    args.ckpt_steps = args.ckpt_steps if args.ckpt_steps is not None else (4 if small else 20)
    args.capacities = [int(c) for c in args.capacities.split(",") if c]
    args.skip = {s for s in args.skip.split(",") if s}
    known = {"matmul", "matmul_fp8", "target_alone", *(f"target_alone_{i}" for i in TARGET_VARIANTS), "plain_forward",
             "drafter_alone", "serial", "colocated_1gpu", "colocated_2gpu",
             *(f"{k}_{m}" for k in ("pipeline", "checkpoint", "sweep") for m in ("1gpu", "2gpu"))}
    unknown = {n for n in args.skip - known if not n.startswith(("capacity_1gpu_", "capacity_2gpu_"))}
    if unknown:
        p.error(f"--skip {','.join(sorted(unknown))}: not a measurement; expected capacity_<mode>_<N> or one of "
                f"{', '.join(sorted(known))}")
    if args.warmup < 1 or min(args.steps, args.sweep_steps, args.ckpt_steps) < 1 or args.ckpt_every < 1:
        p.error("--warmup, --steps, --sweep-steps, --ckpt-steps and --ckpt-every must be >= 1 (a timed "
                "window starts at the end of the last warmup step)")
    if args.ckpt_every > args.warmup + args.ckpt_steps:
        p.error(f"--ckpt-every {args.ckpt_every} saves after the checkpoint run's window (warmup + "
                f"--ckpt-steps = {args.warmup + args.ckpt_steps} steps): lower it")
    if any(c < 0 for c in args.capacities):
        p.error("--capacities must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.merge_only:
        doc = write_results(args.out, load_runs(args.merge))
        print(f"merged {', '.join(doc['runs'])} -> {args.out}")
        return 0
    bench = Bench(args, argv)
    bench.execute()
    print(f"[bench_h200 {bench.elapsed():6.1f}s] done -> {args.out}", file=sys.stderr)
    print(headline(json.loads(Path(args.out).read_text())))
    return 0


def headline(doc: dict[str, Any]) -> str:
    """The summary numbers, one per line (what a terminal tail should show)."""
    keys = ("matmul_tflops", "matmul_fp8_tflops", "target_alone_tok_s", "drafter_alone_tok_s", "serial_tok_s", "pipeline_1gpu_tok_s",
            "speedup_1gpu_vs_serial", "pipeline_2gpu_tok_s", "slowest_stage_2gpu", "slowest_stage_tok_s_2gpu",
            "efficiency_2gpu", "speedup_2gpu_vs_serial", "target_mfu", "plain_forward_mfu",
            "checkpoint_slowdown_1gpu", "checkpoint_slowdown_2gpu", "pipeline_2gpu_null_reason")
    lines = [f"{k:28s} {doc[k]:.4g}" if isinstance(doc.get(k), float) else f"{k:28s} {doc.get(k)}"
             for k in keys if k in doc]
    lines += [f"{'capacity_sweep_' + m:28s} {v['tok_s']}" for m, v in doc.get("capacity_sweep", {}).items()]
    lines += [f"{'peak_mem_gb_' + k:28s} {v}" for k, v in doc.get("peak_mem_gb", {}).items()]
    lines += [f"goal {k:23s} {g['goal']:>22s}  value {g['value']}  met {g['met']}" for k, g in doc["goals"].items()]
    for run in doc.get("runs", {}).values():
        lines += [f"{name:28s} {m['status']}: {m.get('reason') or m.get('error')}"
                  for name, m in run.get("measurements", {}).items() if m.get("status") != "ok"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
