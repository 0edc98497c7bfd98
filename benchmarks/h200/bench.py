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
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.h200.report import load_runs, matched_mfu, ok, write_results  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "h200.json"
GRAPH_1GPU = ROOT / "examples" / "qwen3-8b-h200.toml"
GRAPH_2GPU = ROOT / "examples" / "qwen3-8b-h200x2.toml"
SWEEP_CHANNELS = ("hidden", "features")
# [target].attn_implementation values measured by target_alone_<impl> besides the graph's own:
# impl -> (fixed seconds: compile and first-batch costs, step time relative to the default's)
TARGET_VARIANTS = {"sdpa": (10, 1.0), "flex_attention": (60, 1.0), "eager": (10, 2.0)}

# --smoke / --tiny: the same graphs and code paths with tiny shapes (the vocabulary is the tokenizer's).
TINY_SETTINGS = [
    "target.preset=tiny", "drafter.num_layers=2", "drafter.block_size=8", "train.num_anchors=8",
    "data.max_samples=160", "data.max_length=256", "data.tokens_per_batch=512", "data.packed_rows=2",
    "data.num_workers=1", "data.holdout=8", "trace.stats_interval_s=0.2",
]
CPU_SETTINGS = ["process.target.device=cpu", "process.postprocess.device=cpu", "process.drafter.device=cpu",
                # the graphs' flex_attention trains on CUDA only (no flex backward on the CPU)
                'drafter.attn_implementation="sdpa"', 'target.attn_implementation="sdpa"']


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


class Bench:
    """One invocation: the plan, the time budget, the results of this run."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        import torch

        self.args = args
        self.t0 = time.perf_counter()
        ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.tiny = args.smoke or args.tiny
        if args.smoke:
            self.mode = "cpu"
        elif ngpu == 0:
            raise SystemExit("no CUDA device visible: run on a GPU machine, or use --smoke for the CPU check")
        else:
            self.mode = "2gpu" if (args.gpus == "2" or (args.gpus == "auto" and ngpu >= 2)) else "1gpu"
            if self.mode == "2gpu" and ngpu < 2:
                raise SystemExit(f"--gpus 2 but {ngpu} CUDA device(s) visible")
        self.name = "smoke" if self.tiny else self.mode  # tiny-shape numbers never pass for H200 ones
        cpu = torch.device("cpu")
        self.dev0 = cpu if args.smoke else torch.device("cuda:0")
        self.dev1 = torch.device("cuda:1") if self.mode == "2gpu" else self.dev0
        self.overrides = list(args.overrides)
        self.runs = load_runs(args.merge)
        self.run: dict[str, Any] = {
            "mode": self.mode,
            "tiny": self.tiny,
            "command": "python " + shlex.join(["benchmarks/h200/bench.py", *argv]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "complete": False,
            "env": environment(ngpu),
            "settings": {"warmup": args.warmup, "steps": args.steps, "capacities": args.capacities,
                         "sweep_channels": list(SWEEP_CHANNELS), "sweep_steps": args.sweep_steps,
                         "ckpt_every": args.ckpt_every, "ckpt_steps": args.ckpt_steps,
                         "budget_s": args.budget_s, "overrides": self.overrides},
            "measurements": {},
        }
        self.runs[self.name] = self.run
        # step-time guesses for the budget, replaced by measured ones as they come in (seconds)
        self.t_target, self.t_drafter = (0.05, 0.05) if self.tiny else (0.6, 0.5)  # first H200 measurements

    # -- bookkeeping ----------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def save(self) -> None:
        self.run["elapsed_s"] = round(self.elapsed(), 1)
        write_results(self.args.out, self.runs)

    def measure(self, name: str, estimate_s: float, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Run one measurement unless skipped or over budget; record its result or error; save."""
        ms = self.run["measurements"]
        left = self.args.budget_s - self.elapsed()
        if name in self.args.skip:
            ms[name] = {"status": "skipped", "reason": "--skip"}
        elif not self.tiny and estimate_s > left:
            ms[name] = {"status": "skipped", "reason": f"time budget: needs ~{estimate_s:.0f} s, {left:.0f} s left "
                        f"of --budget-s {self.args.budget_s:.0f}"}
        else:
            print(f"[bench_h200 {self.elapsed():6.1f}s] {name} (~{estimate_s:.0f} s)", file=sys.stderr, flush=True)
            t = time.perf_counter()
            try:
                ms[name] = {"status": "ok", **fn()}
            except Exception as exc:  # noqa: BLE001 - recorded; the next measurement still runs
                tb = traceback.format_exc()
                print(tb, file=sys.stderr, flush=True)
                ms[name] = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": tb[-3000:]}
            from benchmarks.h200.stages import release

            release()  # here, not in the except: the measurement's (and a traceback's) frames are gone
            ms[name]["seconds"] = round(time.perf_counter() - t, 1)
        self.save()
        return ok(self.run, name)

    # -- the plan ---------------------------------------------------------------------------------
    def execute(self) -> None:
        import torch

        from benchmarks.h200.reuse import ModelReuse
        from benchmarks.h200.stages import make_batches, matmul_tflops, scratch_app

        a = self.args
        n = a.warmup + a.steps
        if self.tiny:
            from dflash.data import load_tokenizer, tokenizer_info

            vocab = tokenizer_info(load_tokenizer("builtin:tiny")).vocab_size
            cpu = CPU_SETTINGS if self.mode == "cpu" else []
            self.overrides = [*TINY_SETTINGS, f"target.vocab_size={vocab}", *cpu, *self.overrides]
            self.run["settings"]["overrides"] = self.overrides
        if self.mode == "1gpu":
            self.run["measurements"]["pipeline_2gpu"] = {
                "status": "skipped", "reason": "one CUDA device visible: run this harness on a 2-GPU machine "
                "and merge the two results files (benchmarks/results/LOG.md)"}
        # data first: tokenizing spawns workers, better before CUDA is initialised
        self.app = scratch_app(GRAPH_1GPU, self.overrides, a.run_root / "scratch")
        self.run["data"] = data_summary(self.app)
        self.batches = make_batches(self.app, n, pin=self.dev0.type == "cuda")
        self.save()
        size = 256 if self.mode == "cpu" else (2048 if self.tiny else 8192)
        mm = self.measure("matmul", 5, lambda: matmul_tflops(self.dev0, n=size))
        self.peak = mm["tflops"] if mm else float("nan")
        # the target's matching peak: the fp8 matmul rate when it is quantized (MFU against bf16 would
        # credit fp8 tensor cores as if they were bf16 ones: an fp8 target read 1.25)
        self.precision = "fp8" if self.app.resolved.cfg.target.quantization == "fp8" else "bf16"
        self.run["target_precision"] = self.precision
        self.peak_target: float | None = self.peak
        if self.precision == "fp8":
            if self.dev0.type == "cuda":
                from benchmarks.h200.stages import scaled_mm_tflops

                mm8 = self.measure("matmul_fp8", 5, lambda: scaled_mm_tflops(self.dev0, n=size))
            else:
                self.run["measurements"]["matmul_fp8"] = {"status": "skipped", "reason": "float8 matmul runs on CUDA"}
                mm8 = None
            self.peak_target = mm8["tflops"] if mm8 else None
        ckpt_n = a.warmup + a.ckpt_steps
        default_impl = self.app.resolved.cfg.target.attn_implementation
        steps = {  # name -> (estimated seconds, evaluated when its turn comes; the measurement)
            "target_alone": (lambda: 40 + n * self.t_target, self._target_alone),
            "plain_forward": (lambda: 30 + n * self.t_target * 1.3, self._plain_forward),
            "drafter_alone": (lambda: 15 + n * self.t_drafter, self._drafter_alone),
            "serial": (lambda: 15 + n * (self.t_target + self.t_drafter), self._serial),
            "colocated_1gpu": (lambda: 15 + n * (self.t_target + self.t_drafter), lambda: self._colocated(1)),
            "colocated_2gpu": (lambda: 60 + n * (self.t_target + self.t_drafter), lambda: self._colocated(2)),
        }
        # the other attention implementations of [target] (flex compiles on its first batches)
        for impl, (fixed, factor) in TARGET_VARIANTS.items():
            if impl != default_impl:
                steps[f"target_alone_{impl}"] = (lambda f=fixed, k=factor: f + n * self.t_target * k,
                                                 lambda i=impl: self._target_alone(i))
        for mode in ("1gpu", "2gpu"):
            steps[f"pipeline_{mode}"] = (lambda m=mode: self._pipeline_estimate(m, n),
                                         lambda m=mode: self._pipeline(m))
            steps[f"checkpoint_{mode}"] = (lambda m=mode: 20 + self._pipeline_estimate(m, ckpt_n),
                                           lambda m=mode: self._checkpoint(m))
        variants = [f"target_alone_{i}" for i in TARGET_VARIANTS if i != default_impl]
        # priority order: the rows the performance goals need first, then the attention variants and
        # baselines, extras last (a budget cut drops the least needed)
        plan = {
            # CPU smoke: flex runs unfused off CUDA (slow; its equivalence is tests/dflash/model/test_target.py's)
            # and two spawned ranks cost a minute (tests/benchmarks/test_colocated.py runs them)
            "cpu": ["target_alone", "drafter_alone", "serial", "pipeline_1gpu", "plain_forward",
                    *[v for v in variants if v != "target_alone_flex_attention"], "colocated_1gpu",
                    "checkpoint_1gpu", "sweep_1gpu", "pipeline_2gpu"],
            "1gpu": ["target_alone", "drafter_alone", "serial", "pipeline_1gpu", "plain_forward", variants[0],
                     "colocated_1gpu", *variants[1:], "checkpoint_1gpu", "sweep_1gpu"],
            "2gpu": ["target_alone", "drafter_alone", "serial", "colocated_2gpu", "pipeline_2gpu", "checkpoint_2gpu",
                     "sweep_2gpu", "pipeline_1gpu", "plain_forward", *variants, "colocated_1gpu"],
        }[self.mode]
        # the whole invocation's estimate, from the step-time guesses (the first H200 measurements)
        sweep_s = lambda m: (len(a.capacities) - 1) * self._pipeline_estimate(m, a.warmup + a.sweep_steps)  # noqa: E731
        estimates = {p: (sweep_s(p.removeprefix("sweep_")) if p.startswith("sweep_") else steps[p][0]())
                     for p in plan if p not in a.skip}
        total = self.elapsed() + sum(estimates.values())
        self.run["settings"]["estimate_s"] = {k: round(v) for k, v in estimates.items()}
        print(f"[bench_h200 {self.elapsed():6.1f}s] plan ({self.mode}): " + ", ".join(
            f"{k} ~{v:.0f}s" for k, v in estimates.items()) + f"; whole invocation ~{total:.0f} s from start "
            f"(--budget-s {a.budget_s:.0f}: a measurement that would end later is skipped)", file=sys.stderr, flush=True)
        with ModelReuse() as self.reuse:
            for name in plan:
                if name.startswith("sweep_") and name in a.skip:
                    self.run["measurements"][f"capacity_{name}"] = {"status": "skipped", "reason": "--skip"}
                elif name.startswith("sweep_"):
                    self._sweep(name.removeprefix("sweep_"))
                else:
                    estimate, fn = steps[name]
                    self.measure(name, estimate(), fn)
            self.run["model_reuse"] = self.reuse.report()
        self.app.metrics.close()
        self.run["complete"] = True
        self.run["cuda_memory_after_gb"] = (round(torch.cuda.memory_allocated(self.dev0) / 2**30, 2)
                                            if self.dev0.type == "cuda" else None)
        self.save()

    def _pipeline_estimate(self, mode: str, steps: int) -> float:
        per_step = max(self.t_target, self.t_drafter) if mode == "2gpu" else self.t_target + self.t_drafter
        return 10 + steps * per_step

    def _target(self) -> Any:
        from dflash.train.loss import needs_final_hidden

        cfg = self.app.resolved.cfg  # the same arguments as the dflash.target stage: the pipeline reuses this model
        return self.reuse.load_target(cfg.target, self.dev0, num_draft_layers=cfg.drafter.num_layers,
                                      need_final=needs_final_hidden(cfg.loss))

    def _target_alone(self, impl: str | None = None) -> dict[str, Any]:
        """The target forward alone; ``impl`` switches its attention implementation for this
        measurement only (None: the graph's ``[target].attn_implementation``)."""
        from contextlib import nullcontext

        from benchmarks.h200.stages import attention_implementation, time_target

        t = time.perf_counter()
        target = self._target()
        build_s = time.perf_counter() - t
        with attention_implementation(target, impl) if impl else nullcontext():
            out = time_target(self.app, target, self.batches, self.dev0, self.args.warmup, self.peak)
        if impl is None:
            self.t_target = out["step_s"]
        return {"build_s": round(build_s, 1), **self._matched(out, out["flops_model"], out["flops_computed"])}

    def _matched(self, out: dict[str, Any], target_model: float, target_computed: float | None = None,
                 gpus: int = 1) -> dict[str, Any]:
        """``out`` with ``mfu``/``hfu`` against the matching peaks (the target's FLOPs, ``target_model``
        of ``flops_model``, against ``self.peak_target``), ``mfu_vs_bf16`` and the peak used."""
        return {**out, **matched_mfu(out, bf16_tflops=self.peak, target_tflops=self.peak_target,
                                     precision=self.precision, target_model=target_model,
                                     target_computed=target_computed, gpus=gpus)}

    def _drafter_alone(self) -> dict[str, Any]:
        from benchmarks.h200.stages import time_drafter

        out = time_drafter(self.app, self._target(), self.batches, self.dev0, self.dev1, self.args.warmup, self.peak)
        self.t_drafter = out["step_s"]
        return self._matched(out, 0.0)

    def _serial(self) -> dict[str, Any]:
        from benchmarks.h200.stages import time_serial

        out = time_serial(self.app, self._target(), self.batches, self.dev0, self.args.warmup, self.peak)
        return self._matched(out, out["target_flops_model"], out["target_flops_computed"])

    def _colocated(self, world: int) -> dict[str, Any]:
        from benchmarks.h200.colocated import run_colocated, time_colocated_here

        a = self.args
        if world == 1:
            out = time_colocated_here(self.app, self._target(), self.batches, self.dev0, a.warmup, self.peak,
                                      a.run_root / "colocated_1" / "store")
        else:
            est = 60 + (a.warmup + a.steps) * (self.t_target + self.t_drafter)
            out = run_colocated(GRAPH_1GPU, self.overrides, a.run_root / f"colocated_{world}", world, warmup=a.warmup,
                                timed=a.steps, peak_tflops=self.peak, cpu=self.mode == "cpu",
                                timeout_s=max(180.0, 3 * est))
        gpus = world if world > 1 and self.mode != "cpu" else 1
        return self._matched(out, out["target_flops_model"], out["target_flops_computed"], gpus=gpus)

    def _plain_forward(self) -> dict[str, Any]:
        from benchmarks.h200.stages import time_plain_forward

        # the whole model as loaded: decoder layers quantized with the target (its bf16 LM head is
        # counted against the target's peak too)
        out = time_plain_forward(self.reuse, self.app, self.batches, self.dev0, self.args.warmup, self.peak)
        return self._matched(out, out["flops_model"], out["flops_computed"])

    def _pipeline_flops(self, out: dict[str, Any], mode: str) -> dict[str, Any]:
        """TFLOP/s and MFU of a pipeline run: FLOPs per real token of the harness's batches
        (the pipeline draws the same batches in the same order) x the measured tokens/s."""
        from benchmarks.h200.stages import drafter_flops, target_flops

        timed = self.batches[self.args.warmup:]
        tf = target_flops(self.app, self._target(), timed)
        flops = tf + drafter_flops(self.app, timed)
        per_token = 1.0 / sum(b.num_tokens for b in timed)
        secs = 1.0 / (out["tok_s"] * per_token)  # seconds for the FLOPs of these batches at the run's rate
        from benchmarks.h200.stages import flop_fields

        gpus = 2 if mode == "2gpu" else 1
        out = {**out, **flop_fields(flops, secs, self.peak, gpus=gpus), "target_flops_computed": tf.computed}
        return self._matched(out, tf.model, tf.computed, gpus=gpus)

    def _run(self, mode: str, name: str, extra: list[str], timed: int, every: int = 0) -> dict[str, Any]:
        from benchmarks.h200.pipeline import run_pipeline

        a = self.args
        graph = GRAPH_2GPU if mode == "2gpu" else GRAPH_1GPU
        est = self._pipeline_estimate(mode, a.warmup + timed)
        return run_pipeline(graph, [*self.overrides, *extra], a.run_root / name, warmup=a.warmup, timed=timed,
                            checkpoint_every=every, timeout_s=max(120.0, 3 * est),
                            artifacts=a.artifacts / name if a.artifacts else None)

    def _pipeline(self, mode: str) -> dict[str, Any]:
        return self._pipeline_flops(self._run(mode, f"pipeline_{mode}", [], self.args.steps), mode)

    def _checkpoint(self, mode: str) -> dict[str, Any]:
        a = self.args
        out = self._run(mode, f"checkpoint_{mode}", ["checkpoint.keep_last=1"], a.ckpt_steps, every=a.ckpt_every)
        return {**out.pop("checkpoint"), "pipeline": out}

    def _sweep(self, mode: str) -> None:
        """One measurement per capacity (each its own budget check), then the collected points."""
        a, ms = self.args, self.run["measurements"]
        main = ok(self.run, f"pipeline_{mode}")
        points: dict[str, float | None] = {}
        for cap in a.capacities:
            default = main is not None and all(
                c.capacity == cap for c in self.app.resolved.cfg.channel if c.name in SWEEP_CHANNELS)
            if default:
                points[str(cap)] = main["tok_s"]
                continue
            name = f"capacity_{mode}_{cap}"
            extra = [f"channel.{ch}.capacity={cap}" for ch in SWEEP_CHANNELS]
            m = self.measure(name, self._pipeline_estimate(mode, a.warmup + a.sweep_steps),
                             lambda e=extra, nm=name: self._run(mode, nm, e, a.sweep_steps))
            points[str(cap)] = m["tok_s"] if m else None
        ms[f"capacity_sweep_{mode}"] = {"status": "ok", "channels": list(SWEEP_CHANNELS), "tok_s": points}
        self.save()


def environment(ngpu: int) -> dict[str, Any]:
    import torch
    import transformers

    gpus = [torch.cuda.get_device_name(i) for i in range(ngpu)]
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda": torch.version.cuda, "gpus": gpus,
            "cpu_count": os.cpu_count(), "platform": platform.platform(),
            # a variable-length (packed documents) attention kernel in torch itself; the project has no path for it
            "torch_varlen_attn": importlib.util.find_spec("torch.nn.attention.varlen") is not None}


def data_summary(app: Any) -> dict[str, Any]:
    cfg = app.resolved.cfg
    stats = app.sampler.epoch_stats(0)
    return {"source": cfg.data.source, "conversations": len(app.sampler.dataset),
            "strategy": cfg.data.strategy, "tokens_per_batch": cfg.data.tokens_per_batch,
            "rows": cfg.data.packed_rows, "max_length": cfg.data.max_length,
            "padding_waste": round(stats.padding_waste, 4), "batches_per_epoch": stats.num_batches,
            "anchors_per_row": cfg.train.num_anchors, "block_size": cfg.drafter.block_size,
            "target_preset": cfg.target.preset, "vocab_size": cfg.target.vocab_size,
            "drafter_layers": cfg.drafter.num_layers}


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
