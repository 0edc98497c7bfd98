"""Overhead of the NaN sentinel (``dflash.train.sentinel.FiniteSentinel``) on a realistic channel item.

The item is what a target replica sends: a ``TargetOutput`` with ``layer_hidden[1, T, k*H]`` and
``final_hidden[1, T, H]`` (bf16; T=8192, H=4096, k=5 on GPU: 403 MB). The reference step is one
bf16 matmul ``[T, H] x [H, H]`` (8192x4096x4096, ~0.27 TFLOP). Prints one JSON line:

* ``step_us``: the matmul alone, per iteration (GPU time between CUDA events on this stream).
* ``on_us`` / ``off_us``: matmul + ``check(item)`` with the sentinel on / off, per iteration;
  ``overhead_us = on_us - off_us`` and ``pct_of_step = 100 * overhead_us / step_us``.
* ``check_gpu_us``: ``check(item)`` alone (its kernels: one flag per tensor, stack, the flags'
  D2H); ``check_gbps``: item bytes / that time. (The H200 run of 2026-11-30 measured the sentinel
  when its flag was ``isfinite(t).all()``: 782 us of GPU time for a 400 MB item against 191 us for
  the aminmax flag below, which the sentinel has used since.)
* ``host_us_per_check``: host time of one ``check`` call (what the producing thread pays).
* ``host_ran_ahead``: after issuing all iterations of matmul + check the GPU was still busy, i.e.
  ``check`` did not wait for the device (no host sync per item on the fast path).
* ``pct_of_target_forward_est``: overhead vs a Qwen3-8B target forward on T tokens at the
  ~29.8K tokens/s of a plain transformers forward on one H200 (measured outside this repo; this
  repo's target stage measures 26.8K, benchmarks/results/LOG.md), an estimate, not measured here.
* ``aminmax_gpu_us``: a one-pass alternative flag (``isfinite(aminmax(t))``) for comparison, and
  ``aminmax_detects_nonfinite`` (NaN, +inf, -inf each caught).
* ``detects_nan``: a NaN planted in ``final_hidden`` is reported, naming the tensor and batch.

    python benchmarks/micro/sentinel_overhead.py            # GPU, realistic shapes
    python benchmarks/micro/sentinel_overhead.py --cpu      # CPU, small shapes: same code paths

Exit status 1 if the planted NaN was not reported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from time import perf_counter
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dflash.messages import Batch, TargetOutput  # noqa: E402
from dflash.train.sentinel import FiniteSentinel, NonFiniteError, floating_tensors  # noqa: E402

TARGET_TOK_S = 29_800.0  # Qwen3-8B-shaped transformers forward, tokens/s per H200 (see the docstring)


def make_item(tokens: int, hidden: int, layers: int, device: torch.device, dtype: torch.dtype) -> TargetOutput:
    """A target replica's output for one packed row of ``tokens`` tokens (random finite values)."""
    ids = torch.arange(tokens, device=device).unsqueeze(0)
    batch = Batch(seq=0, batch_id=0, epoch=0, input_ids=ids, loss_mask=torch.ones_like(ids, dtype=torch.bool),
                  position_ids=ids.clone(), doc_ids=torch.zeros_like(ids, dtype=torch.int32),
                  num_tokens=tokens, num_padding=0)
    return TargetOutput(batch=batch, layer_hidden=torch.randn(1, tokens, layers * hidden, device=device, dtype=dtype),
                        final_hidden=torch.randn(1, tokens, hidden, device=device, dtype=dtype), replica=0)


def timed(fn: Callable[[], Any], iters: int, cuda: bool) -> tuple[float, float, bool]:
    """``(device us per iteration, host us per iteration, host finished issuing before the device)``.

    On CUDA the device time is measured between events on the current stream; on CPU both are
    wall time.
    """
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = perf_counter()
    for _ in range(iters):
        fn()
    host_us = (perf_counter() - t0) * 1e6 / iters
    if not cuda:
        return host_us, host_us, False
    end.record()
    ahead = not end.query()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters, host_us, ahead


def aminmax_flags(item: Any) -> torch.Tensor:
    """One bool per floating tensor, from a single read pass (min/max propagate NaN and inf)."""
    return torch.stack([torch.isfinite(torch.stack(torch.aminmax(t))).all() for _, t in floating_tensors(item)])


def aminmax_detects(device: torch.device, dtype: torch.dtype) -> bool:
    """True if :func:`aminmax_flags` flags NaN, +inf and -inf alike."""
    caught = []
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.zeros(4, 8, device=device, dtype=dtype)
        t[1, 3] = bad
        caught.append(not bool(aminmax_flags({"t": t}).all()))
    return all(caught) and bool(aminmax_flags({"t": torch.zeros(4, 8, device=device, dtype=dtype)}).all())


def detects_nan(item: TargetOutput) -> bool:
    """A NaN planted in ``final_hidden`` raises NonFiniteError naming it (after ``flush`` on GPU)."""
    fh = item.final_hidden.clone()
    fh[0, fh.shape[1] // 2, 1] = float("nan")
    bad = TargetOutput(batch=item.batch, layer_hidden=item.layer_hidden, final_hidden=fh, replica=0)
    sentinel = FiniteSentinel("target[0]", enabled=True)
    try:
        sentinel.check(bad, batch_id=7, channel="hidden")
        sentinel.flush()
    except NonFiniteError as exc:
        return "final_hidden" in str(exc) and "batch 7" in str(exc) and "layer_hidden" not in str(exc)
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on CPU (small default shapes)")
    ap.add_argument("--tokens", type=int, help="T (default 8192 on GPU, 256 on CPU)")
    ap.add_argument("--hidden", type=int, help="H (default 4096 on GPU, 128 on CPU)")
    ap.add_argument("--layers", type=int, default=5, help="k captured target layers")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda") if cuda else torch.device("cpu")
    tokens = args.tokens or (8192 if cuda else 256)
    hidden = args.hidden or (4096 if cuda else 128)
    dtype = torch.bfloat16
    item = make_item(tokens, hidden, args.layers, device, dtype)
    a = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w = torch.randn(hidden, hidden, device=device, dtype=dtype)
    on, off = FiniteSentinel("target[0]", enabled=True), FiniteSentinel("target[0]", enabled=False)

    def step() -> None:
        torch.mm(a, w)

    def step_on() -> None:
        torch.mm(a, w)
        on.check(item, batch_id=0, channel="hidden")

    def step_off() -> None:
        torch.mm(a, w)
        off.check(item, batch_id=0, channel="hidden")

    def check_only() -> None:
        on.check(item, batch_id=0, channel="hidden")

    def alt_only() -> None:
        aminmax_flags(item)

    for fn in (step, step_on, alt_only):
        timed(fn, args.warmup, cuda)
    step_us, _, _ = timed(step, args.iters, cuda)
    off_us, _, _ = timed(step_off, args.iters, cuda)
    on_us, _, ahead = timed(step_on, args.iters, cuda)
    check_us, host_us, _ = timed(check_only, args.iters, cuda)
    alt_us, _, _ = timed(alt_only, args.iters, cuda)
    on.flush()
    item_bytes = sum(t.nbytes for _, t in floating_tensors(item))
    overhead = on_us - off_us
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "item": {"layer_hidden": list(item.layer_hidden.shape), "final_hidden": list(item.final_hidden.shape),
                 "dtype": str(dtype), "bytes": item_bytes},
        "step": f"bf16 matmul {tokens}x{hidden}x{hidden}",
        "iters": args.iters,
        "step_us": round(step_us, 1),
        "off_us": round(off_us, 1),
        "on_us": round(on_us, 1),
        "overhead_us": round(overhead, 1),
        "pct_of_step": round(100.0 * overhead / step_us, 2),
        "check_gpu_us": round(check_us, 1),
        "check_gbps": round(item_bytes / check_us / 1e3, 1),
        "host_us_per_check": round(host_us, 1),
        "host_ran_ahead": ahead,
        "pct_of_target_forward_est": round(100.0 * overhead / (tokens / TARGET_TOK_S * 1e6), 3),
        "aminmax_gpu_us": round(alt_us, 1),
        "aminmax_detects_nonfinite": aminmax_detects(device, dtype),
        "detects_nan": detects_nan(item),
        "checked": on.checked,
    }
    print(json.dumps(result))
    return 0 if result["detects_nan"] else 1


if __name__ == "__main__":
    sys.exit(main())
