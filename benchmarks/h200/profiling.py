"""``torch.profiler`` over a few steps of a stage: the top kernels by device time and the window's
wall time, optionally the Chrome trace. Used by ``perf.py``'s ``profile_*`` rows and by the compiled
target rows that profile themselves as they run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch


def top_kernels(prof: Any, n: int = 25) -> list[dict[str, Any]]:
    """The ``n`` events with the most self device time (ms) and their share of the total."""
    events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    total = sum(e.self_device_time_total for e in events) or 1.0
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [{"name": e.key[:160], "self_ms": round(e.self_device_time_total / 1e3, 3),
             "share": round(e.self_device_time_total / total, 4), "calls": e.count} for e in events[:n]]


def profile(step: Callable[[Any], Any], items: list[Any], path: Path, device: torch.device,
            first: int = 1, trace: Path | None = None) -> dict[str, Any]:
    """``torch.profiler`` over ``step(item)`` for ``items[first:first + 3]`` (after one untimed step on
    ``items[first - 1]``): the top kernels by device time to ``path`` and ``top``, and the window's
    wall time (``window_s``, synced at both ends; ``tok_s`` when the items have ``num_tokens``), so a
    profile whose kernels add up to less than the timed rate's step says the device sat idle.
    ``trace``: also the Chrome trace there, gzipped (``*.json.gz``; ``chrome://tracing`` or Perfetto
    read it), to see what the host was doing while the device sat idle."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from benchmarks.h200.stages import sync

    window = items[first:first + 3]
    step(items[first - 1])
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for item in window:
            step(item)
        sync(device)
        wall = time.perf_counter() - t0
    table = None
    for sort in (["self_device_time_total", "self_cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]:
        try:
            table = prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=90)
            break
        except Exception:  # noqa: BLE001 - the key's name differs between torch versions
            continue
    path.write_text(table or "")
    if trace is not None:
        import gzip
        import os
        import shutil

        raw = trace.with_suffix("")  # .json
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.unlink(raw)
    out = {"steps": len(window), "first": first, "window_s": round(wall, 4), "table": path.name,
           "top": top_kernels(prof)}
    tokens = [getattr(item, "num_tokens", None) for item in window]
    if window and all(isinstance(n, int) for n in tokens):
        out["tok_s"] = sum(tokens) / wall
    return out
