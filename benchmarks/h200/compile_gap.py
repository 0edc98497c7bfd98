"""Per-step timing of the compiled varlen target over the same batches, three passes, to find the
step that stalls (a recompile, a collection, an allocator retry) and test a fix for it.

    python benchmarks/h200/compile_gap.py --variant plain|bucket|dynamic [--batches 11] [--passes 3]

``plain``: the target as ``[target] compile = true`` builds it. ``bucket``: the varlen boundaries
``cu_seq_lens`` padded to the next power of two with zero-length sequences, so their length takes
few values. ``dynamic``: the boundaries marked dynamic before the first call. Prints one JSON line
per step (pass, batch, sequences, device ms, host ms) and the dynamo counters at the end. CUDA only.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from benchmarks.h200.bench import GRAPH_1GPU


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", default="plain", choices=["plain", "bucket", "dynamic"])
    p.add_argument("--batches", type=int, default=11)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    a = p.parse_args()

    import dflash.model.target as tmod
    from benchmarks.h200.stages import make_batches, scratch_app, sync, target_forward
    from dflash.model.target import load_target
    from dflash.model.target_engine import CompiledLayers, register_varlen
    from dflash.train.loss import needs_final_hidden

    gc_pauses: list[float] = []
    gc_t0 = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            gc_pauses.append((time.perf_counter() - gc_t0[0]) * 1e3)
    gc.callbacks.append(on_gc)

    seqs: list[int] = []
    plain = tmod.varlen_kwargs

    def kwargs(doc_ids, max_length=None):
        out = plain(doc_ids, max_length)
        cu = out["cu_seq_lens_q"]
        seqs.append(len(cu) - 1)
        if a.variant == "bucket":
            n = 1 << (len(cu) - 1).bit_length()
            cu = torch.cat([cu, cu[-1:].expand(n + 1 - len(cu))])
        elif a.variant == "dynamic":
            torch._dynamo.mark_dynamic(cu, 0)
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
        return out
    tmod.varlen_kwargs = kwargs

    register_varlen()
    app = scratch_app(GRAPH_1GPU, ["drafter.compile=false", "target.attn_implementation=\"varlen\"", *a.overrides],
                      Path("/tmp/compile_gap") / a.variant)
    cfg = app.resolved.cfg
    dev = torch.device("cuda:0")
    batches = make_batches(app, a.batches, pin=True)
    target = load_target(cfg.target, dev, num_draft_layers=cfg.drafter.num_layers,
                         need_final=needs_final_hidden(cfg.loss))
    target.compiled = CompiledLayers(target.decoder_layers, None)
    fwd = target_forward(app, target, dev)
    for pas in range(a.passes):
        for i, b in enumerate(batches):
            sync(dev)
            g0 = len(gc_pauses)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            h0 = time.perf_counter()
            e0.record()
            fwd(b)
            e1.record()
            host = (time.perf_counter() - h0) * 1e3
            sync(dev)
            print(json.dumps({"variant": a.variant, "pass": pas, "batch": i, "seqs": seqs[-1],
                              "ms": round(e0.elapsed_time(e1), 1), "host_ms": round(host, 1),
                              "gc_ms": round(sum(gc_pauses[g0:]), 1)}), flush=True)
    from torch._dynamo.utils import counters

    print(json.dumps({"variant": a.variant, "counters": {k: dict(v) for k, v in counters.items()},
                      "gc_max_ms": round(max(gc_pauses, default=0), 1)}, default=str), flush=True)


if __name__ == "__main__":
    main()
