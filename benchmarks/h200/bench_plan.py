"""The measurements of one ``bench.py`` invocation: :class:`Bench` plans them in priority order,
runs each under the ``--budget-s`` time budget, records its result or error and rewrites the results
file after every one; :func:`environment` and :func:`data_summary` are what a run records beside its
measurements. The command line (its arguments, the merge, the printed headline) is ``bench.py``'s.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shlex
import sys
import time
from typing import Any, Callable

from benchmarks.h200.graphs import CPU_SETTINGS, GRAPH_1GPU, GRAPH_2GPU, TINY_SETTINGS
from benchmarks.h200.report import attempt, load_runs, matched_mfu, ok, write_results

SWEEP_CHANNELS = ("hidden", "features")
# [target].attn_implementation values measured by target_alone_<impl> besides the graph's own:
# impl -> (fixed seconds: compile and first-batch costs, step time relative to the default's)
TARGET_VARIANTS = {"sdpa": (10, 1.0), "flex_attention": (60, 1.0), "eager": (10, 2.0)}


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
            ms[name] = attempt(fn)
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

