"""The colocated data-parallel baseline, the fair competitor for any multi-GPU layout: every GPU
runs the target forward and then the drafter step on its own batches, one thread, one stream, with
the drafters in ``DistributedDataParallel`` (gradients all-reduced during backward). This is how
SpecForge-style trainers run; on one GPU it is the serial loop of
:func:`benchmarks.h200.stages.time_serial` with a one-rank DDP wrapper.

Used by ``benchmarks/h200/bench.py``:

* :func:`time_colocated_here`: one rank in this process (``world = 1``), on the harness's own target
  and batches (a one-rank ``gloo``/``nccl`` group over a ``FileStore``, destroyed afterwards);
* :func:`run_colocated`: ``world`` spawned processes, rank ``r`` on ``cuda:r`` (or the CPU with
  ``gloo``), each building its own target and drawing batches ``r, r + world, ...`` of the sampler
  (the ranks together see the first ``world * (warmup + timed)`` batches).

Throughput is the real tokens of every rank's timed steps over the longest rank's timed window (the
all-reduce keeps the ranks in step, so the windows coincide). Model FLOPs are summed over the ranks
and MFU divides by ``world`` x the matmul rate.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

ROOT = Path(__file__).resolve().parents[2]


def _ddp(device: torch.device, group: Any):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device] if device.type == "cuda" else None
    return lambda module: DDP(module, device_ids=ids, process_group=group)


@contextmanager
def process_group(device: torch.device, store_path: Path, rank: int, world: int) -> Iterator[Any]:
    """A default process group (``nccl`` on CUDA, ``gloo`` on the CPU) over a ``FileStore`` at
    ``store_path``; destroyed on exit.

    Raises:
        RuntimeError: a default group already exists in this process.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a torch.distributed default group already exists in this process")
    store_path.parent.mkdir(parents=True, exist_ok=True)
    store = dist.FileStore(str(store_path), world)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kwargs)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def time_colocated_here(app: Any, target: Any, batches: list[Any], device: torch.device, warmup: int,
                        peak_tflops: float, store_path: Path) -> dict[str, Any]:
    """The colocated loop on one rank in this process: :func:`time_serial` with a DDP drafter."""
    from benchmarks.h200.stages import time_serial

    store_path.unlink(missing_ok=True)
    with process_group(device, store_path, 0, 1) as group:
        out = time_serial(app, target, batches, device, warmup, peak_tflops, wrap=_ddp(device, group))
    return {"world": 1, **out}


def _worker(rank: int, world: int, graph_file: str, overrides: list[str], run_dir: str, warmup: int,
            timed: int, peak_tflops: float, cpu: bool) -> None:
    """One rank of :func:`run_colocated`; writes ``run_dir/rank<r>.json`` (result or error)."""
    sys.path.insert(0, str(ROOT))
    out_path = Path(run_dir) / f"rank{rank}.json"
    try:
        from benchmarks.h200.stages import make_batches, scratch_app, time_serial
        from dflash.model.target import load_target
        from dflash.train.loss import needs_final_hidden

        device = torch.device("cpu") if cpu else torch.device(f"cuda:{rank}")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        app = scratch_app(Path(graph_file), overrides, Path(run_dir) / f"scratch{rank}")
        n = warmup + timed
        batches = make_batches(app, n * world, pin=device.type == "cuda")[rank::world]
        cfg = app.resolved.cfg
        target = load_target(cfg.target, device, num_draft_layers=cfg.drafter.num_layers,
                             need_final=needs_final_hidden(cfg.loss))
        with process_group(device, Path(run_dir) / "store", rank, world) as group:
            res = time_serial(app, target, batches, device, warmup, peak_tflops, wrap=_ddp(device, group))
        app.metrics.close()
        out_path.write_text(json.dumps({"status": "ok", **res}, default=str))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent through the file
        out_path.write_text(json.dumps({"status": "error", "error": f"{type(exc).__name__}: {exc}",
                                        "traceback": traceback.format_exc()[-3000:]}))
        raise


def run_colocated(graph_file: Path, overrides: list[str], run_dir: Path, world: int, *, warmup: int,
                  timed: int, peak_tflops: float, cpu: bool = False, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run the colocated loop on ``world`` spawned ranks and combine their results.

    Returns:
        ``tok_s`` (all ranks), ``step_s`` (longest rank), ``tflops``/``mfu``/``hfu`` over ``world``
        GPUs, ``per_rank`` results, ``peak_mem_gb`` per device.

    Raises:
        RuntimeError: a rank failed (its error and traceback tail) or did not finish in ``timeout_s``.
    """
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, name=f"colocated-rank{r}",
                         args=(r, world, str(graph_file), list(overrides), str(run_dir), warmup, timed,
                               peak_tflops, cpu))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    ranks = []
    for r in range(world):
        f = run_dir / f"rank{r}.json"
        res = json.loads(f.read_text()) if f.is_file() else {"status": "error", "error": "no result (timed out?)"}
        if res["status"] != "ok":
            raise RuntimeError(f"colocated rank {r}: {res['error']}\n{res.get('traceback', '')}")
        ranks.append(res)
    secs = max(r["tokens_timed"] / r["tok_s"] for r in ranks)
    tokens = sum(r["tokens_timed"] for r in ranks)
    model = sum(r["flops_model"] for r in ranks)
    computed = sum(r["flops_computed"] for r in ranks)
    target_model = sum(r["target_flops_model"] for r in ranks)
    target_computed = sum(r["target_flops_computed"] for r in ranks)
    gpus = world if not cpu else 1
    return {"world": world, "tok_s": tokens / secs, "step_s": secs / ranks[0]["steps_timed"],
            "steps_timed": ranks[0]["steps_timed"], "tokens_timed": tokens,
            "tflops": model / secs / 1e12, "mfu": model / secs / 1e12 / (peak_tflops * gpus),
            "hfu": computed / secs / 1e12 / (peak_tflops * gpus), "flops_model": model, "flops_computed": computed,
            "target_flops_model": target_model, "target_flops_computed": target_computed,
            "peak_mem_gb": {k: v for r in ranks for k, v in r.get("peak_mem_gb", {}).items()},
            "per_rank": [{k: r[k] for k in ("device", "tok_s", "step_s", "tokens_timed")} for r in ranks]}
