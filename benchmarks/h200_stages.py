"""The DFlash training stages timed without csp: matmul peak, target alone, drafter alone, the serial
loop and the plain transformers forward, with FLOP accounting for MFU.

Used by ``benchmarks/bench_h200.py``. Every measurement runs the project's own code: the target is
:class:`dflash.target.Target` (``forward`` over packed rows with the document mask, the captured
layers concatenated), the drafter step is :meth:`dflash.stages.drafter.DrafterStage.train_step`
(``compute_loss`` under bf16 autocast, backward, clipping, the one host read, AdamW, schedule) on a
stage built outside csp, and the features go through :func:`dflash.stages.postprocess.to_drafter_input`.
Batches are drawn as ``dflash.prefetch`` draws them (same sampler order, same anchors) and pinned on
CUDA, so every measurement sees the batches the pipeline sees, in the same order.

Memory: each function drops what it built when it returns; the caller runs :func:`release` after
each measurement so the next one (and the csp stages, on their own streams) get the memory back.

Timing: ``warmup`` untimed steps, then ``timed`` steps between two device synchronisations. Tokens
are real (non-padding) tokens. FLOPs (forward, per the usual accounting, e.g. PaLM appendix B):
``2 * linear_params * tokens`` for the matmuls plus ``2 * width * L * (L + 1)`` per layer and causal
sequence of length ``L`` for attention (QK^T and AV, ``width = heads * head_dim``), where a packed
document is its own causal sequence. MFU divides by the bf16 matmul rate measured in the same run.
"""

from __future__ import annotations

import gc
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import nn

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


def linear_params(module: nn.Module) -> int:
    """Weights of every ``nn.Linear`` under ``module`` (the parameters that cost 2 FLOPs per token)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def document_lengths(doc_ids: torch.Tensor) -> list[int]:
    """Lengths of the packed documents of ``doc_ids [B, T]`` (consecutive runs of one id >= 0)."""
    out: list[int] = []
    for row in doc_ids.cpu():
        ids, counts = torch.unique_consecutive(row, return_counts=True)
        out += [int(c) for i, c in zip(ids.tolist(), counts.tolist()) if i >= 0]
    return out


def attention_flops(lengths: list[int], layers: int, width: int) -> float:
    """Forward FLOPs of causal attention over sequences of ``lengths``: ``2 * width * L * (L + 1)``
    per layer and sequence (``L (L+1) / 2`` query-key pairs, 2 FLOPs per pair and channel, QK^T + AV)."""
    return float(layers * sum(2 * width * L * (L + 1) for L in lengths))


class TargetShape(msgspec.Struct, frozen=True):
    """What the FLOP count of a Qwen3-style decoder needs: linear weights run per token, decoder
    layers run, attention width (``heads * head_dim``)."""

    linear_params: int
    layers: int
    width: int

    @classmethod
    def of(cls, model: nn.Module, hf_config: Any, with_lm_head: bool) -> "TargetShape":
        """Shape of ``model`` (a transformers ``*ForCausalLM``); ``with_lm_head`` counts its LM head."""
        decoder = model.model
        head = linear_params(model.lm_head) if with_lm_head and getattr(model, "lm_head", None) is not None else 0
        width = hf_config.num_attention_heads * getattr(hf_config, "head_dim", hf_config.hidden_size
                                                        // hf_config.num_attention_heads)
        return cls(linear_params(decoder) + head, len(decoder.layers), width)

    def flops(self, tokens: int, lengths: list[int]) -> float:
        """Forward FLOPs for ``tokens`` tokens in causal sequences of ``lengths``."""
        return 2.0 * self.linear_params * tokens + attention_flops(lengths, self.layers, self.width)


# -- batches --------------------------------------------------------------------------------------

def make_batches(app: Any, n: int, pin: bool) -> list[Any]:
    """The first ``n`` batches of a fresh sampler, anchors drawn as ``dflash.prefetch`` draws them."""
    from dflash.anchors import sample_anchors
    from dflash.data import Sampler
    from dflash.stages.prefetch import anchor_generator

    cfg = app.cfg
    sampler = Sampler(app.sampler.dataset, cfg.data, pad_id=app.sampler.pad_id)
    out = []
    for seq in range(n):
        b = next(sampler)
        anchors = sample_anchors(b.loss_mask, b.doc_ids, cfg.drafter.num_anchors, cfg.drafter.block_size,
                                 generator=anchor_generator(cfg.run.seed, b.batch_id))
        b = msgspec.structs.replace(b, seq=seq, anchors=anchors)
        out.append(b.pin_memory() if pin else b)
    return out


def _timed(step: Any, items: list[Any], warmup: int, device: torch.device) -> float:
    """Run ``step(item)`` over ``items``; seconds from after item ``warmup - 1`` to the end (synced)."""
    for item in items[:warmup]:
        step(item)
    sync(device)
    t0 = time.perf_counter()
    for item in items[warmup:]:
        step(item)
    sync(device)
    return time.perf_counter() - t0


def _rate(tokens: int, secs: float, steps: int) -> dict[str, Any]:
    return {"tok_s": tokens / secs, "step_s": secs / steps, "steps_timed": steps, "tokens_timed": tokens}


# -- stages alone, serial loop, plain forward -------------------------------------------------------

def target_forward(app: Any, target: Any, device: torch.device):
    """``step(batch) -> TargetOutput``: what the ``dflash.target`` stage does for one batch."""
    from dflash.loss import needs_final_hidden
    from dflash.messages import TargetOutput

    need_final = needs_final_hidden(app.cfg.loss)

    def step(batch: Any) -> Any:
        with torch.no_grad():
            b = batch.to(device, non_blocking=True)
            layer_hidden, final_hidden = target.forward(b.input_ids, b.position_ids, b.doc_ids, need_final=need_final)
        return TargetOutput(batch=b, layer_hidden=layer_hidden, final_hidden=final_hidden, replica=0)

    return step


def time_target(app: Any, target: Any, batches: list[Any], device: torch.device, warmup: int,
                peak_tflops: float) -> dict[str, Any]:
    """Target forward alone: tokens/s, MFU (document-causal attention FLOPs) and the FLOP rate if
    the dense-mask attention kernel computes every query-key pair of a row (``hfu_dense_mask``)."""
    fwd = target_forward(app, target, device)
    before = reset_peak([device])
    secs = _timed(fwd, batches, warmup, device)
    timed = batches[warmup:]
    shape = TargetShape.of(target.model, target.hf_config, with_lm_head=False)
    flops = sum(shape.flops(b.num_tokens, document_lengths(b.doc_ids)) for b in timed)
    dense = sum(2.0 * shape.linear_params * b.input_ids.numel()
                + shape.layers * 4.0 * shape.width * b.input_ids.shape[0] * b.input_ids.shape[1] ** 2 for b in timed)
    out = _rate(sum(b.num_tokens for b in timed), secs, len(timed))
    out.update({"device": str(device), "tflops": flops / secs / 1e12, "mfu": flops / secs / 1e12 / peak_tflops,
                "hfu_dense_mask": dense / secs / 1e12 / peak_tflops, "layers": shape.layers,
                "linear_params": shape.linear_params, "attn_implementation": target.hf_config._attn_implementation,
                "resident_gb": before, "peak_mem_gb": memory_gb([device])})
    return out


def drafter_stage(app: Any, device: torch.device) -> Any:
    """A ``dflash.drafter`` stage (fresh drafter, AdamW, schedule) built outside csp on ``device``.
    Call ``teardown()`` when done."""
    import csp
    from dflash.stages.drafter import DrafterStage

    stage = DrafterStage(ctx=csp.Context("drafter", device=device, run_dir=app.run_dir, app=app))
    with device_scope(device):
        stage.setup()
    return stage


def _drafter_input(app: Any, out: Any, device: torch.device) -> Any:
    import csp
    from dflash.stages.postprocess import to_drafter_input

    out = csp.cuda.to_device(out, device) if device != out.layer_hidden.device else out
    return to_drafter_input(out, feature_noise=app.cfg.train.feature_noise, seed=app.cfg.run.seed)


def time_drafter(app: Any, target: Any, batches: list[Any], target_device: torch.device,
                 device: torch.device, warmup: int, cached: int = 4) -> dict[str, Any]:
    """Drafter step alone on features the target computed beforehand for ``cached`` batches
    (cycled; held on ``device``)."""
    fwd = target_forward(app, target, target_device)
    inputs = [_drafter_input(app, fwd(b), device) for b in batches[:cached]]
    sync(target_device)
    before = reset_peak([device])
    stage = drafter_stage(app, device)
    items = [inputs[i % len(inputs)] for i in range(len(batches))]
    try:
        with device_scope(device):
            secs = _timed(stage.train_step, items, warmup, device)
        timed = items[warmup:]
        out = _rate(sum(i.batch.num_tokens for i in timed), secs, len(timed))
        out.update({"device": str(device), "cached_batches": len(inputs),
                    "blocks_per_step": sum(int((i.anchors >= 0).sum()) for i in timed) / len(timed),
                    "resident_gb": before, "peak_mem_gb": memory_gb([device])})
    finally:
        stage.teardown()  # the caller frees the memory (release()) once this frame is gone
    return out


def time_serial(app: Any, target: Any, batches: list[Any], device: torch.device, warmup: int) -> dict[str, Any]:
    """The serial baseline: per batch, target forward then drafter step, one thread, one stream."""
    fwd = target_forward(app, target, device)
    before = reset_peak([device])
    stage = drafter_stage(app, device)
    try:
        def step(batch: Any) -> None:
            stage.train_step(_drafter_input(app, fwd(batch), device))

        with device_scope(device):
            secs = _timed(step, batches, warmup, device)
        timed = batches[warmup:]
        out = _rate(sum(b.num_tokens for b in timed), secs, len(timed))
        out.update({"device": str(device), "resident_gb": before, "peak_mem_gb": memory_gb([device])})
    finally:
        stage.teardown()
    return out


def time_plain_forward(reuse: Any, app: Any, batches: list[Any], device: torch.device, warmup: int,
                       peak_tflops: float) -> dict[str, Any]:
    """The plain transformers forward for comparison: the whole Qwen3 model (every layer, LM head,
    logits for every position, all hidden states), causal rows with no document mask, on the same
    token rows. Built for this measurement; call release() after it."""
    full = reuse.original_load_target(app.cfg.target, device, num_draft_layers=app.cfg.drafter.num_layers,
                                      need_final=True)
    model = full.model
    shape = TargetShape.of(model, full.hf_config, with_lm_head=True)

    def step(batch: Any) -> None:
        with torch.no_grad():
            model(input_ids=batch.input_ids.to(device, non_blocking=True), use_cache=False,
                  output_hidden_states=True)

    before = reset_peak([device])
    secs = _timed(step, batches, warmup, device)
    timed = batches[warmup:]
    tokens = sum(b.input_ids.numel() for b in timed)
    flops = sum(shape.flops(b.input_ids.numel(), [b.input_ids.shape[1]] * b.input_ids.shape[0]) for b in timed)
    out = _rate(tokens, secs, len(timed))
    out.update({"device": str(device), "tflops": flops / secs / 1e12, "mfu": flops / secs / 1e12 / peak_tflops,
                "layers": shape.layers, "linear_params": shape.linear_params,
                "resident_gb": before, "peak_mem_gb": memory_gb([device])})
    return out  # the model goes with this frame; the caller frees the memory (release())


def scratch_app(graph_file: Path, overrides: list[str], run_dir: Path) -> Any:
    """The prepared run objects (config with tokenizer-derived fields, data, drafter config) for the
    measurements outside csp, from the same graph file and overrides as the pipeline runs."""
    from dflash.config import load_config
    from dflash.run import prepare

    from benchmarks.h200_pipeline import BENCH_SETTINGS

    cfg = load_config(graph_file, [*overrides, *BENCH_SETTINGS, f"run.out_dir={run_dir}"])
    return prepare(cfg, "none")
