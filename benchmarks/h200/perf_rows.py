"""The rows ``perf.py`` measures: :class:`Perf` runs them in priority order (the matmul peaks, the
target alone bf16 then quantized to fp8 in place, the drafter alone under each switch, their
profiles), each skipped when it would end past ``--budget-s``, and rewrites ``OUT/perf.json``
after every row; :func:`summary` is the table it prints at the end. The command line is ``perf.py``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

import torch

from benchmarks.h200.graphs import CPU_SETTINGS, GRAPH_1GPU, TINY_SETTINGS
from benchmarks.h200.profiling import profile
from benchmarks.h200.report import attempt
from benchmarks.h200.stages import scaled_mm_tflops

TARGET_ROWS = ["target_bf16", "target_bf16_varlen", "target_bf16_varlen_compile", "fp8_feature_error",
               "target_fp8", "target_fp8_varlen", "target_fp8_varlen_compile"]
DRAFTER_ROWS = {  # name -> graph overrides of the drafter stage
    "drafter_default": [],
    "drafter_liger_kernels": ['drafter.kernels="liger"'],
    "drafter_liger_head": ['train.lm_head="liger"'],
    "drafter_compile": ["drafter.compile=true"],
    # Muon's step compiled too (a Muon graph: with AdamW the setting is ignored)
    "drafter_compile_optim": ["drafter.compile=true", "train.compile_optimizer=true"],
    # the chunked LM head's cross-entropy and gradient compiled (hard-label chunks)
    "drafter_compile_head": ["drafter.compile=true", "train.compile_head=true"],
    "drafter_compile_optim_head": ["drafter.compile=true", "train.compile_optimizer=true", "train.compile_head=true"],
    "drafter_all": ['drafter.kernels="liger"', 'train.lm_head="liger"', "drafter.compile=true"],
    # the backbone Linears in float8 (torchao training recipes); MFU against the bf16 peak, as the
    # attention, norms and LM head still run in bf16
    "drafter_fp8": ['drafter.precision="fp8"'],
    "drafter_fp8_compile": ['drafter.precision="fp8"', "drafter.compile=true"],
    "drafter_fp8_rowwise_compile": ['drafter.precision="fp8"', 'drafter.fp8_recipe="rowwise"', "drafter.compile=true"],
}
PROFILE_ROWS = ["profile_target_bf16", "profile_target_bf16_varlen", "profile_drafter_default",
                "profile_drafter_all", "profile_target_fp8_varlen", "profile_drafter_compile",
                "profile_drafter_compile_optim", "profile_drafter_compile_optim_head",
                "profile_drafter_fp8_compile"]
# rough seconds beyond the timed steps (builds, compiles), for the budget
FIXED_S = {"target_bf16": 70, "target_bf16_varlen_compile": 120, "target_fp8_varlen_compile": 120,
           "drafter_default": 45, "drafter_compile": 90, "drafter_compile_optim": 120,
           "drafter_compile_head": 120, "drafter_compile_optim_head": 150, "drafter_all": 90, "target_fp8": 30,
           "drafter_fp8": 45, "drafter_fp8_compile": 90, "drafter_fp8_rowwise_compile": 90}


class Perf:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.t0 = args, time.perf_counter()
        self.out = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.doc: dict[str, Any] = {"command": "python benchmarks/h200/perf.py " + " ".join(sys.argv[1:]),
                                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": {}}
        self.dev = torch.device("cpu") if args.smoke else torch.device("cuda:0")
        self.graph = getattr(args, "graph", None) or GRAPH_1GPU
        # the rows compare each switch with the code's defaults: the example graph compiles its
        # drafter, so "drafter_default" turns that off and "drafter_compile" back on
        sets = ["drafter.compile=false", *([*TINY_SETTINGS, *CPU_SETTINGS] if args.smoke else [])]
        if args.smoke:
            from dflash.data import load_tokenizer, tokenizer_info

            sets.append(f"target.vocab_size={tokenizer_info(load_tokenizer('builtin:tiny')).vocab_size}")
        self.overrides = [*sets, *args.overrides]

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def save(self) -> None:
        self.doc["elapsed_s"] = round(self.elapsed(), 1)
        (self.out / "perf.json").write_text(json.dumps(self.doc, indent=1, default=str))

    def row(self, name: str, estimate_s: float, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        from benchmarks.h200.stages import release

        rows, left = self.doc["rows"], self.args.budget_s - self.elapsed()
        if self.args.rows and name not in self.args.rows:
            return None
        if not self.args.smoke and estimate_s > left:
            rows[name] = {"status": "skipped", "reason": f"time budget: ~{estimate_s:.0f} s needed, {left:.0f} s left"}
        else:
            print(f"[h200_perf {self.elapsed():6.1f}s] {name} (~{estimate_s:.0f} s)", file=sys.stderr, flush=True)
            t = time.perf_counter()
            rows[name] = attempt(fn)
            release()
            rows[name]["seconds"] = round(time.perf_counter() - t, 1)
        self.save()
        r = rows[name]
        print(f"[h200_perf {self.elapsed():6.1f}s] {name}: {r['status']} " + " ".join(
            f"{k}={r[k]:.4g}" if isinstance(r.get(k), float) else f"{k}={r.get(k)}"
            for k in ("tok_s", "mfu", "tflops", "peak_mem_gb", "error", "reason") if k in r), file=sys.stderr, flush=True)
        return r if r["status"] == "ok" else None

    # -- target ---------------------------------------------------------------------------------------
    def _time_target(self, impl: str | None, compile: bool, peak: float, profile_as: str | None = None) -> dict[str, Any]:
        """Time the target alone with attention ``impl`` (None: the graph's), compiled or not; with
        ``profile_as`` named in ``--rows``, also profile it as it ran (compiled layers included):
        ``OUT/<profile_as>.txt`` and ``out["profile"]``."""
        from benchmarks.h200.stages import attention_implementation, target_forward, time_target
        from dflash.model.target_engine import CompiledLayers, register_varlen

        t = self.target
        if impl == "varlen":
            register_varlen()
        ctx = attention_implementation(t, impl) if impl else _null()
        with ctx:
            if compile:
                t.compiled = CompiledLayers(t.decoder_layers, None)
            try:
                t0 = time.perf_counter()
                fwd_first = self._first_step_s(t)
                out = time_target(self.app, t, self.batches, self.dev, self.args.warmup, peak)
                out["first_step_s"] = round(fwd_first, 2)
                out["setup_s"] = round(time.perf_counter() - t0, 1)
                if profile_as and profile_as in self.args.rows:
                    # the timed window's own batches: the profile then accounts for the timed steps
                    out["profile"] = profile(target_forward(self.app, t, self.dev), self.batches,
                                             self.out / f"{profile_as}.txt", self.dev,
                                             first=max(1, min(self.args.warmup, len(self.batches) - 3)),
                                             trace=self.out / f"{profile_as}.trace.json.gz")
            finally:
                if compile:
                    t.compiled = None
                    for layer in t.decoder_layers:
                        layer.__dict__.pop("forward", None)
        out["mfu_vs_bf16"] = out["tflops"] / self.peak_bf16
        out["peak_tflops_used"] = peak
        return out

    def _first_step_s(self, t: Any) -> float:
        from benchmarks.h200.stages import sync, target_forward

        fwd = target_forward(self.app, t, self.dev)
        t0 = time.perf_counter()
        fwd(self.batches[0])
        sync(self.dev)
        return time.perf_counter() - t0

    def _features(self) -> list[torch.Tensor]:
        from benchmarks.h200.stages import target_forward

        fwd = target_forward(self.app, self.target, self.dev)
        return [fwd(b).layer_hidden.float() for b in self.batches[:2]]

    def _feature_error(self, ref: list[torch.Tensor]) -> dict[str, Any]:
        new = self._features()
        H = self.target.hf_config.hidden_size
        per_layer = []
        for j, layer in enumerate(self.target.layer_ids):
            num = den = dot = nn2 = 0.0
            for b, r, q in zip(self.batches, ref, new):
                real = (b.doc_ids >= 0).to(self.dev)
                rr, qq = r[..., j * H:(j + 1) * H][real], q[..., j * H:(j + 1) * H][real]
                num += float((qq - rr).pow(2).sum())
                den += float(rr.pow(2).sum())
                dot += float((qq * rr).sum())
                nn2 += float(qq.pow(2).sum())
            per_layer.append({"layer": layer, "rel_error": (num / den) ** 0.5,
                              "cosine": dot / (den * nn2) ** 0.5})
        return {"layers": per_layer, "batches": len(ref), "max_rel_error": max(p["rel_error"] for p in per_layer)}

    def plan(self) -> None:
        """The rows in priority order (a row past the budget is skipped, so the first ones matter
        most): bf16 target, drafter without and with Liger, then the target quantized in place for
        the fp8 rows, then the compile rows (the slowest to set up)."""
        from dflash.model.target import load_target
        from dflash.model.target_engine import quantize_fp8
        from dflash.train.loss import needs_final_hidden

        cfg = self.app.resolved.cfg
        n = self.args.warmup + self.args.steps
        step = 0.6 if not self.args.smoke else 0.05
        t0 = time.perf_counter()
        self.target = load_target(cfg.target, self.dev, num_draft_layers=cfg.drafter.num_layers,
                                  need_final=needs_final_hidden(cfg.loss))
        self.doc["target_build_s"] = round(time.perf_counter() - t0, 1)
        cuda = self.dev.type == "cuda"
        est = lambda name: FIXED_S.get(name, 20) + n * step  # noqa: E731
        self.row("target_bf16", est("target_bf16"), lambda: self._time_target(None, False, self.peak_bf16))
        if cuda:
            self.row("target_bf16_varlen", est("x"), lambda: self._time_target("varlen", False, self.peak_bf16))
            if "target_bf16_varlen_compile" in self.args.rows:  # asked for by name only: before fp8, costly
                self.row("target_bf16_varlen_compile", est("target_bf16_varlen_compile"),
                         lambda: self._time_target("varlen", True, self.peak_bf16, "profile_target_bf16_varlen_compile"))
        self._profile_target("profile_target_bf16", None)
        for name in ("drafter_default", "drafter_liger_kernels", "drafter_liger_head"):
            self._drafter_row(name)
        fp8 = cuda and torch.cuda.get_device_capability(self.dev) >= (8, 9) and _has("torchao")
        if not fp8:
            self.doc["rows"]["fp8"] = {"status": "skipped", "reason": "needs CUDA >= 8.9 and torchao"}
        elif not self.args.rows or self.args.rows & ({r for r in TARGET_ROWS if "fp8" in r} | {"profile_target_fp8_varlen"}):
            ref = self._features()
            self.doc["fp8_quantized_linears"] = quantize_fp8(self.target.decoder_layers)
            self.row("fp8_feature_error", 10, lambda r=ref: self._feature_error(r))
            del ref
            self.row("target_fp8", est("target_fp8"), lambda: self._time_target(None, False, self.peak_fp8))
            self.row("target_fp8_varlen", est("x"), lambda: self._time_target("varlen", False, self.peak_fp8))
            self._profile_target("profile_target_fp8_varlen", "varlen")
            self.row("target_fp8_varlen_compile", est("target_fp8_varlen_compile"),
                     lambda: self._time_target("varlen", True, self.peak_fp8, "profile_target_fp8_varlen_compile"))
        for name in ("drafter_compile", "drafter_compile_optim", "drafter_compile_head", "drafter_compile_optim_head",
                     "drafter_all"):  # on the fp8 target's features: same drafter cost
            self._drafter_row(name)
        for name in ("drafter_fp8", "drafter_fp8_compile", "drafter_fp8_rowwise_compile"):
            if fp8:
                self._drafter_row(name)
            elif not self.args.rows or name in self.args.rows:
                self.doc["rows"][name] = {"status": "skipped", "reason": "needs CUDA >= 8.9 and torchao"}

    def _profile_target(self, name: str, impl: str | None) -> None:
        from benchmarks.h200.stages import attention_implementation, target_forward

        def fn() -> dict[str, Any]:
            with attention_implementation(self.target, impl) if impl else _null():
                return profile(target_forward(self.app, self.target, self.dev), self.batches,
                               self.out / f"{name}.txt", self.dev)

        self.row(name, 25, fn)

    # -- drafter --------------------------------------------------------------------------------------
    def _drafter_row(self, name: str) -> None:
        from benchmarks.h200.stages import scratch_app, time_drafter

        sets = DRAFTER_ROWS[name]
        n = self.args.warmup + self.args.steps
        step = 0.5 if not self.args.smoke else 0.05
        if self.args.rows and name not in self.args.rows and f"profile_{name}" not in self.args.rows:
            return
        if self.dev.type != "cuda" and any("liger" in s or "compile" in s or "fp8" in s for s in sets):
            self.doc["rows"][name] = {"status": "skipped", "reason": "Liger, inductor and float8 rows run on CUDA"}
            return
        app = self.app if not sets else scratch_app(self.graph, [*self.overrides, *sets], self.args.run_root / name)
        try:
            self.row(name, FIXED_S.get(name, 30) + n * step,
                     lambda: {"settings": sets, **time_drafter(app, self.target, self.batches, self.dev,
                                                               self.dev, self.args.warmup, self.peak_bf16)})
            if f"profile_{name}" in PROFILE_ROWS:
                self.row(f"profile_{name}", 30, lambda: self._profile_drafter(app, name))
        finally:
            if app is not self.app:
                app.metrics.close()

    def _profile_drafter(self, app: Any, name: str) -> dict[str, Any]:
        from benchmarks.h200.stages import drafter_input, drafter_stage, target_forward

        fwd = target_forward(app, self.target, self.dev)
        inputs = [drafter_input(app, fwd(b), self.dev) for b in self.batches[:4]]
        stage = drafter_stage(app, self.dev)
        try:
            return profile(stage.train_step, inputs + inputs[:1], self.out / f"profile_{name}.txt", self.dev)
        finally:
            stage.teardown()

    def execute(self) -> None:
        from benchmarks.h200.stages import make_batches, matmul_tflops, scratch_app

        a = self.args
        self.app = scratch_app(self.graph, self.overrides, a.run_root / "perf")
        self.batches = make_batches(self.app, a.warmup + a.steps, pin=self.dev.type == "cuda")
        self.doc["settings"] = {"warmup": a.warmup, "steps": a.steps, "overrides": self.overrides,
                                "budget_s": a.budget_s, "torch": torch.__version__,
                                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                                "packages": {p: _version(p) for p in ("torchao", "liger_kernel", "triton",
                                                                      "transformers")}}
        size = 256 if a.smoke else 8192
        mm = self.row("matmul_bf16", 5, lambda: matmul_tflops(self.dev, n=size))
        self.peak_bf16 = mm["tflops"] if mm else float("nan")
        mm8 = self.row("matmul_fp8", 5, lambda: scaled_mm_tflops(self.dev)) if self.dev.type == "cuda" else None
        self.peak_fp8 = mm8["tflops"] if mm8 else float("nan")
        self.plan()
        self.app.metrics.close()
        self.doc["complete"] = True
        self.save()
        print(summary(self.doc))


def summary(doc: dict[str, Any]) -> str:
    lines = []
    for name, r in doc["rows"].items():
        if r.get("status") != "ok":
            lines.append(f"{name:30s} {r.get('status')}: {r.get('reason') or r.get('error')}")
        elif "window_s" in r:  # a profile row: its window's rate, to set against the timed row's
            lines.append(f"{name:30s} profiled {r['steps']} steps in {r['window_s']:.3f} s"
                         + (f" ({r['tok_s'] / 1e3:.1f}K tok/s)" if "tok_s" in r else ""))
        elif "tok_s" in r:
            lines.append(f"{name:30s} {r['tok_s'] / 1e3:7.1f}K tok/s  mfu {r['mfu']:.3f}  "
                         f"vs-bf16 {r.get('mfu_vs_bf16', r['mfu']):.3f}  peak {r.get('peak_mem_gb')}"
                         + (f"  profiled {r['profile']['tok_s'] / 1e3:.1f}K" if "tok_s" in r.get("profile", {}) else ""))
        elif "tflops" in r:
            lines.append(f"{name:30s} {r['tflops']:.0f} TFLOP/s")
        elif "layers" in r:
            lines.append(f"{name:30s} " + " ".join(f"L{p['layer']}:{p['rel_error']:.4f}" for p in r["layers"]))
        elif "top" in r:
            lines.append(f"{name:30s} " + "; ".join(f"{k['name'][:40]} {k['share']:.0%}" for k in r["top"][:3]))
    return "\n".join(lines)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _has(pkg: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(pkg) is not None


def _version(pkg: str) -> str | None:
    try:
        import importlib.metadata as md

        return md.version(pkg.replace("_", "-"))
    except Exception:  # noqa: BLE001
        return None
