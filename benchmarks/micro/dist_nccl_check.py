"""Cross-rank csp channel over NCCL: tensors from a process on cuda:0 (rank 0) to one on cuda:1
(rank 1), contents checked, bandwidth measured. Prints one JSON line (rank 1).

    torchrun --nproc-per-node 2 benchmarks/micro/dist_nccl_check.py [--mib 64] [--items 50] [--capacity 4]

Also runs on CPU with gloo (``--cpu``) as a smoke test. The producer fills each tensor with a
value derived from its index on its own CUDA stream; the consumer checks every element on the
GPU (one host read per item) and measures, after the first ``--warmup`` items, bytes received
per second of wall time (consumer side, after a device synchronize at the end).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import csp  # noqa: E402
from csp.distributed import launch  # noqa: E402

RESULT: dict = {}


class Chunk(msgspec.Struct):
    index: int
    data: torch.Tensor  # [n] bf16 on the producer's device


class Produce(csp.Process):
    class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        items: int = 50
        numel: int = 1 << 25

    outputs = {"out": Chunk}

    def run(self, inputs, outputs):
        dev = self.ctx.device or torch.device("cpu")
        for i in range(self.options.items):
            t = torch.full((self.options.numel,), float(i % 251), dtype=torch.bfloat16, device=dev)
            outputs["out"].send(Chunk(i, t))


class Consume(csp.Process):
    class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        warmup: int = 5

    inputs = {"inp": Chunk}

    def run(self, inputs, outputs):
        bad, n, nbytes, t0 = 0, 0, 0, None
        dev = self.ctx.device
        for c in inputs["inp"]:
            ok = bool((c.data == float(c.index % 251)).all())  # one host read per item
            bad += 0 if ok and c.index == n else 1
            n += 1
            if n == self.options.warmup:
                if dev is not None and dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
            elif n > self.options.warmup:
                nbytes += c.data.nbytes
            RESULT["device"] = str(c.data.device)
        if dev is not None and dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0 if t0 is not None else float("nan")
        RESULT.update(items=n, bad=bad, bytes=nbytes, seconds=dt, gb_per_s=nbytes / dt / 1e9 if dt else 0.0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=64.0, help="tensor size per item, MiB")
    ap.add_argument("--items", type=int, default=50)
    ap.add_argument("--capacity", type=int, default=4)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU instead of NCCL between GPUs")
    args = ap.parse_args()
    numel = int(args.mib * (1 << 20)) // 2
    d0, d1 = (None, None) if args.cpu else ("cuda:0", "cuda:1")
    g = csp.Graph()
    g.channel("chunks", capacity=args.capacity)
    g.process("produce", Produce, outputs={"out": "chunks"}, device=d0, ranks=[0],
              options={"items": args.items, "numel": numel})
    g.process("consume", Consume, inputs={"inp": "chunks"}, device=d1, ranks=[1])
    result, rt = launch.run(g)
    if result.error is not None:
        print(f"rank {result.rank}: error: {result.error}", file=sys.stderr)
        launch.hard_exit(1)
    if result.rank == 1:
        stats = rt.statistics()["channels"]["chunks"]
        ok = RESULT.get("bad") == 0 and RESULT.get("items") == args.items
        print(json.dumps({"check": "dist_nccl" if not args.cpu else "dist_gloo_cpu", "ok": ok,
                          "mib_per_item": args.mib, "capacity": args.capacity, **RESULT,
                          "items_moved": stats.items_moved, "bytes_moved": stats.bytes_moved,
                          "receive_wait_s": round(stats.receive_wait_s, 4),
                          "torch": torch.__version__}), flush=True)
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
