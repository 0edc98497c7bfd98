"""The DFlash training stages timed without csp: matmul peak, target alone, drafter alone, the serial
loop and the plain transformers forward, with FLOP accounting for MFU.

Used by ``benchmarks/h200/bench.py``. Every measurement runs the project's own code: the target is
:class:`dflash.model.target.Target` (``forward`` over packed rows with the document mask, the captured
layers concatenated), the drafter step is :meth:`dflash.run.stages.trainer.DrafterStage.train_step`
(:func:`dflash.train.step.train_step`: ``compute_loss`` under bf16 autocast, backward, clipping, the
one host read, AdamW, schedule) on a stage built outside csp, and the features go through
:func:`dflash.model.features.to_drafter_input`. Batches are drawn as ``dflash.prefetch`` draws them (same
sampler order, same anchors) and pinned on CUDA, so every measurement sees the batches the pipeline
sees, in the same order.

Memory: each function drops what it built when it returns; the caller runs :func:`release` after
each measurement so the next one (and the csp stages, on their own streams) get the memory back.

Timing: ``warmup`` untimed steps, then ``timed`` steps between two device synchronisations. Tokens
are real (non-padding) tokens. FLOPs: :mod:`benchmarks.h200.flops` (``model`` FLOPs for ``tflops`` and
``mfu``, ``computed`` FLOPs for ``hfu``), both divided by the matmul rate given (the bf16 one measured in
the same run; ``benchmarks/h200/bench.py`` then re-expresses a quantized target's against the fp8
peak of :func:`scaled_mm_tflops`, :func:`benchmarks.h200.report.matched_mfu`). :func:`time_serial`
records the target's share of its FLOPs (``target_flops_model`` / ``target_flops_computed``) for that. Peak memory: ``torch.cuda.max_memory_allocated``, reset at the start of each measurement.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import msgspec
import torch

GB = 2**30


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_scope(device: torch.device) -> Any:
    """Make ``device`` the current CUDA device (no-op on CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def release() -> None:
    """Free what the last measurement left (Python garbage, then the allocator's cached blocks)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def memory_gb(devices: list[torch.device]) -> dict[str, float]:
    return {str(d): round(torch.cuda.max_memory_allocated(d) / GB, 2) for d in devices if d.type == "cuda"}


def reset_peak(devices: list[torch.device]) -> dict[str, float]:
    """Reset the peak counters; returns the memory allocated now (GiB) per CUDA device."""
    out = {}
    for d in devices:
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)
            out[str(d)] = round(torch.cuda.memory_allocated(d) / GB, 2)
    return out


# -- FLOPs ----------------------------------------------------------------------------------------

def matmul_tflops(device: torch.device, n: int = 8192, iters: int = 100, warmup: int = 10) -> dict[str, Any]:
    """Rate of ``[n, n] @ [n, n]`` (bf16 on CUDA, fp32 on CPU) in TFLOP/s (``2 n^3`` per product)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.mm(a, b, out=c)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.mm(a, b, out=c)
    sync(device)
    secs = time.perf_counter() - t0
    del a, b, c
    return {"tflops": 2 * n**3 * iters / secs / 1e12, "n": n, "iters": iters, "dtype": str(dtype),
            "device": str(device)}


def scaled_mm_tflops(device: torch.device, n: int = 8192, iters: int = 100, warmup: int = 10) -> dict[str, Any]:
    """Rate of ``[n, n] @ [n, n]`` in float8 e4m3 with per-row scales and bf16 output
    (``torch._scaled_mm``, ``use_fast_accum=True``), in TFLOP/s (``2 n^3`` per product)."""
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    sa = torch.ones(n, 1, device=device)
    sb = torch.ones(1, n, device=device)
    mm = lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,  # noqa: E731
                                  use_fast_accum=True)
    for _ in range(warmup):
        mm()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        mm()
    sync(device)
    secs = time.perf_counter() - t0
    return {"tflops": 2 * n**3 * iters / secs / 1e12, "n": n, "iters": iters, "dtype": "float8_e4m3fn",
            "scales": "rowwise", "out_dtype": "bfloat16"}


def target_flops(app: Any, target: Any, batches: list[Any]) -> Any:
    """:class:`benchmarks.h200.flops.Flops` of the target forward over ``batches`` as ``target`` runs it
    (its decoder layers, its current attention implementation)."""
    from benchmarks.h200.flops import Flops, target_forward_flops

    impl = target.hf_config._attn_implementation
    total = Flops(0.0, 0.0)
    for b in batches:
        total = total + target_forward_flops(target.hf_config, len(target.decoder_layers), b.doc_ids, impl,
                                             num_tokens=b.num_tokens)
    return total


def drafter_flops(app: Any, batches: list[Any]) -> Any:
    """:class:`benchmarks.h200.flops.Flops` of the drafter steps on ``batches`` (forward + backward, the LM
    head on trained slots, target logits when the loss needs them)."""
    from benchmarks.h200.flops import Flops, drafter_counts, drafter_step_flops
    from dflash.train.loss import needs_final_hidden

    dc = app.resolved.drafter
    total = Flops(0.0, 0.0)
    for b in batches:
        c = drafter_counts(b.input_ids, b.loss_mask, b.doc_ids, b.anchors, dc.block_size, window=dc.sliding_window)
        total = total + drafter_step_flops(dc, c, target_logits=needs_final_hidden(app.resolved.cfg.loss),
                                           sync_free=app.resolved.cfg.train.sync_free_loss)
    return total


def flop_fields(flops: Any, secs: float, peak_tflops: float, gpus: int = 1) -> dict[str, Any]:
    """``tflops``, ``mfu``, ``hfu``, the FLOPs behind them and the attention share, for a results entry."""
    return {**flops.rates(secs, peak_tflops, gpus), "flops_model": flops.model, "flops_computed": flops.computed,
            "attention_share": flops.attention_model / flops.model if flops.model else None}


@contextmanager
def attention_implementation(target: Any, impl: str) -> Iterator[Any]:
    """``target`` running attention ``impl`` ("sdpa" | "flex_attention" | "eager", every value
    ``[target].attn_implementation`` takes; tests/dflash/model/test_target.py holds them equivalent),
    switched in place (``set_attn_implementation``) and switched back on exit. A compiled target
    (``[target] compile = true``) runs eagerly meanwhile: its layers were compiled for its own
    implementation, and another would recompile each of them."""
    model_impl, mask_impl = target.model.config._attn_implementation, target.hf_config._attn_implementation
    compiled = target.compiled
    if compiled is not None:
        target.compiled = None
        compiled.off()
    target.model.set_attn_implementation(impl)
    target.hf_config._attn_implementation = impl  # the mask form Target.forward builds
    try:
        yield target
    finally:
        target.model.set_attn_implementation(model_impl)
        target.hf_config._attn_implementation = mask_impl
        target.compiled = compiled


# -- batches --------------------------------------------------------------------------------------

def make_batches(app: Any, n: int, pin: bool) -> list[Any]:
    """The first ``n`` batches of a fresh sampler, anchors drawn as ``dflash.prefetch`` draws them."""
    from dflash.data import Sampler
    from dflash.run.stages.prefetch import anchor_generator
    from dflash.train.anchors import sample_anchors

    cfg = app.resolved.cfg
    sampler = Sampler(app.sampler.dataset, cfg.data, pad_id=app.sampler.pad_id)
    out = []
    for seq in range(n):
        b = next(sampler)
        anchors = sample_anchors(b.loss_mask, b.doc_ids, cfg.train.num_anchors, cfg.drafter.block_size,
                                 generator=anchor_generator(cfg.run.seed, b.batch_id))
        b = msgspec.structs.replace(b, seq=seq, anchors=anchors)
        out.append(b.pin_memory() if pin else b)
    return out


def _timed(step: Any, items: list[Any], warmup: int, device: torch.device,
           step_ms: list[float] | None = None, host_ms: list[float] | None = None) -> float:
    """Run ``step(item)`` over ``items``; seconds from after item ``warmup - 1`` to the end (synced).

    ``step_ms``: on CUDA, filled with each timed step's device-timeline milliseconds (CUDA events
    recorded between the steps, no sync inside the window), to tell one slow step from a uniform rate.
    ``host_ms``: filled with each timed step's host milliseconds (a host that waits on the device
    inside a step shows here as the device's time; one that only enqueues, as less)."""
    for item in items[:warmup]:
        step(item)
    sync(device)
    events = [] if step_ms is not None and device.type == "cuda" else None
    t0 = time.perf_counter()
    for item in items[warmup:]:
        if events is not None:
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
        h0 = time.perf_counter()
        step(item)
        if host_ms is not None:
            host_ms.append(round((time.perf_counter() - h0) * 1e3, 2))
    if events is not None:
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()
    sync(device)
    secs = time.perf_counter() - t0
    if events is not None:
        step_ms[:] = [round(a.elapsed_time(b), 2) for a, b in zip(events, events[1:])]
    return secs


def _rate(tokens: int, secs: float, steps: int) -> dict[str, Any]:
    return {"tok_s": tokens / secs, "step_s": secs / steps, "steps_timed": steps, "tokens_timed": tokens}


# -- stages alone, serial loop, plain forward -------------------------------------------------------

def target_forward(app: Any, target: Any, device: torch.device):
    """``step(batch) -> TargetOutput``: what the ``dflash.target`` stage does for one batch."""
    from dflash.messages import TargetOutput
    from dflash.train.loss import needs_final_hidden

    need_final = needs_final_hidden(app.resolved.cfg.loss)

    def step(batch: Any) -> Any:
        with torch.no_grad():
            b = batch.to(device, non_blocking=True)
            layer_hidden, final_hidden = target.forward(b.input_ids, b.position_ids, b.doc_ids, need_final=need_final)
        return TargetOutput(batch=b, layer_hidden=layer_hidden, final_hidden=final_hidden, replica=0)

    return step


def time_target(app: Any, target: Any, batches: list[Any], device: torch.device, warmup: int,
                peak_tflops: float) -> dict[str, Any]:
    """Target forward alone with its current attention implementation: tokens/s, TFLOP/s, MFU
    (document-causal pairs), HFU (the pairs the kernel visits) and peak memory."""
    fwd = target_forward(app, target, device)
    before = reset_peak([device])
    per_step: list[float] = []
    per_host: list[float] = []
    secs = _timed(fwd, batches, warmup, device, per_step, per_host)
    timed = batches[warmup:]
    out = _rate(sum(b.num_tokens for b in timed), secs, len(timed))
    out.update({"device": str(device), **flop_fields(target_flops(app, target, timed), secs, peak_tflops),
                "layers": len(target.decoder_layers), "attn_implementation": target.hf_config._attn_implementation,
                "resident_gb": before, "peak_mem_gb": memory_gb([device])})
    if per_step:  # device-timeline ms of each timed step (CUDA): a uniform rate or one slow step
        out["step_ms"] = per_step
    out["host_ms"] = per_host
    return out


def drafter_stage(app: Any, device: torch.device) -> Any:
    """A ``dflash.drafter`` stage (fresh drafter, AdamW, schedule) built outside csp on ``device``.
    Call ``teardown()`` when done."""
    import csp
    from dflash.run.stages.trainer import DrafterStage

    stage = DrafterStage(ctx=csp.Context("drafter", device=device, run_dir=app.run_dir, app=app))
    with device_scope(device):
        stage.setup()
    return stage


def drafter_input(app: Any, out: Any, device: torch.device) -> Any:
    import csp
    from dflash.model.features import to_drafter_input

    out = csp.cuda.handoff.to_device(out, device) if device != out.layer_hidden.device else out
    return to_drafter_input(out, feature_noise=app.resolved.cfg.train.feature_noise, seed=app.resolved.cfg.run.seed)


def time_drafter(app: Any, target: Any, batches: list[Any], target_device: torch.device,
                 device: torch.device, warmup: int, peak_tflops: float, cached: int = 4) -> dict[str, Any]:
    """Drafter step alone on features the target computed beforehand for ``cached`` batches
    (cycled; held on ``device``)."""
    fwd = target_forward(app, target, target_device)
    inputs = [drafter_input(app, fwd(b), device) for b in batches[:cached]]
    sync(target_device)
    before = reset_peak([device])
    stage = drafter_stage(app, device)
    items = [inputs[i % len(inputs)] for i in range(len(batches))]
    try:
        with device_scope(device):
            secs = _timed(stage.train_step, items, warmup, device)
        timed = items[warmup:]
        out = _rate(sum(i.batch.num_tokens for i in timed), secs, len(timed))
        flops = drafter_flops(app, [i.batch for i in timed])
        out.update({"device": str(device), "cached_batches": len(inputs), **flop_fields(flops, secs, peak_tflops),
                    "blocks_per_step": sum(int((i.anchors >= 0).sum()) for i in timed) / len(timed),
                    "resident_gb": before, "peak_mem_gb": memory_gb([device])})
    finally:
        stage.teardown()  # the caller frees the memory (release()) once this frame is gone
    return out


def time_serial(app: Any, target: Any, batches: list[Any], device: torch.device, warmup: int,
                peak_tflops: float, wrap: Any = None) -> dict[str, Any]:
    """The serial baseline: per batch, target forward then drafter step, one thread, one stream.

    ``wrap(drafter) -> module`` replaces the module the step calls (e.g. DDP for the colocated
    data-parallel loop, :mod:`benchmarks.h200.colocated`); the optimizer keeps the drafter's
    parameters."""
    fwd = target_forward(app, target, device)
    before = reset_peak([device])
    stage = drafter_stage(app, device)
    if wrap is not None:
        if not hasattr(stage, "model"):  # DrafterStage.train_step calls compute_loss(self.model, ...)
            raise RuntimeError("DrafterStage has no 'model' attribute to wrap: update time_serial's DDP hook")
        stage.model = wrap(stage.drafter)
    try:
        def step(batch: Any) -> None:
            stage.train_step(drafter_input(app, fwd(batch), device))

        with device_scope(device):
            secs = _timed(step, batches, warmup, device)
        timed = batches[warmup:]
        out = _rate(sum(b.num_tokens for b in timed), secs, len(timed))
        tf = target_flops(app, target, timed)
        flops = tf + drafter_flops(app, timed)
        out.update({"device": str(device), **flop_fields(flops, secs, peak_tflops),
                    "target_flops_model": tf.model, "target_flops_computed": tf.computed,
                    "resident_gb": before, "peak_mem_gb": memory_gb([device])})
    finally:
        stage.teardown()
    return out


def time_plain_forward(reuse: Any, app: Any, batches: list[Any], device: torch.device, warmup: int,
                       peak_tflops: float) -> dict[str, Any]:
    """The plain transformers forward for comparison: the whole Qwen3 model (every layer, LM head,
    logits for every position, all hidden states), causal rows with no document mask (a causal
    kernel), on the same token rows; every position counts as a token. Built for this
    measurement; call release() after it."""
    from benchmarks.h200.flops import Flops, target_forward_flops

    import msgspec

    # plain means transformers' own SDPA path: the graph's varlen attention needs the packed
    # boundaries this forward does not pass, and fp8 or compile would not be the plain forward
    plain = msgspec.structs.replace(app.resolved.cfg.target, attn_implementation="sdpa", compile=False,
                                    quantization="none")
    full = reuse.original_load_target(plain, device, num_draft_layers=app.resolved.cfg.drafter.num_layers,
                                      need_final=True)
    model = full.model

    def step(batch: Any) -> None:
        with torch.no_grad():
            model(input_ids=batch.input_ids.to(device, non_blocking=True), use_cache=False,
                  output_hidden_states=True)

    before = reset_peak([device])
    secs = _timed(step, batches, warmup, device)
    timed = batches[warmup:]
    tokens = sum(b.input_ids.numel() for b in timed)
    flops = Flops(0.0, 0.0)
    for b in timed:
        flops = flops + target_forward_flops(full.hf_config, len(full.decoder_layers), torch.zeros_like(b.doc_ids),
                                             "causal", lm_head=True)
    out = _rate(tokens, secs, len(timed))
    out.update({"device": str(device), **flop_fields(flops, secs, peak_tflops), "layers": len(full.decoder_layers),
                "resident_gb": before, "peak_mem_gb": memory_gb([device])})
    return out  # the model goes with this frame; the caller frees the memory (release())


def scratch_app(graph_file: Path, overrides: list[str], run_dir: Path) -> Any:
    """The prepared run objects (config with tokenizer-derived fields, data, drafter config) for the
    measurements outside csp, from the same graph file and overrides as the pipeline runs."""
    from benchmarks.h200.pipeline import BENCH_SETTINGS
    from dflash.run.config import load_config
    from dflash.run.prepare import prepare
    from dflash.run.resolve import load_and_resolve

    cfg = load_config(graph_file, [*overrides, *BENCH_SETTINGS, f"run.out_dir={run_dir}"])
    resolved, tok = load_and_resolve(cfg)
    return prepare(resolved, "none", tok)
