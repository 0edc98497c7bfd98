"""Reproduce the tensor-lifetime race class on a GPU and show that csp's hand-off prevents it.

Failure mode 1 of docs/failure-modes.md: a non-blocking copy whose source is freed or reused before
the copy ran, or a buffer the caching allocator hands to the producer's next forward while a
consumer stream still reads it, gives silent garbage. Each case below runs twice through the same
csp graph, with the same threads, streams and host-side choreography:

* ``naive``: the tensor is handed over the way a ``queue.Queue`` would (wrapped in :class:`Hidden`,
  so csp's hooks never see it: no event, no ``record_stream``), copies are plain
  ``non_blocking=True``, one pinned staging buffer is refilled at once;
* ``csp``: the same tensor goes through the channel (event + ``record_stream``), device moves use
  ``csp.cuda.handoff.to_device``, pinned staging uses ``csp.cuda.handoff.PinnedPool``.

Every trial writes a known value (``trial + 1``) and checks it on the far side; ``torch.cuda._sleep``
keeps one stream busy for ``--window-ms`` so that the race window is far wider than the host-side
hand-off (a few microseconds). The cases are :data:`CASES` (their text goes into the JSON); their
processes and payloads are in ``benchmarks/micro/cuda_race_processes.py``, and this module builds
their graphs, runs both modes and is the command line.

CSAN (``--csan``) checks stream ordering of GPU accesses only: it forgets a tensor when it is freed
and does not track host memory, so the lifetime cases are proven by the value checks, not by it.

Run (prints the JSON; ``--out`` also writes it)::

    python benchmarks/micro/cuda_races.py --trials 100 --out benchmarks/results/cuda_races.json
    python benchmarks/micro/cuda_races.py --dry-run --trials 3     # CPU: same Python paths, no races
    TORCH_CUDA_SANITIZER=1 python benchmarks/micro/cuda_races.py --csan csp   # exits 0, no CSAN report
    TORCH_CUDA_SANITIZER=1 python benchmarks/micro/cuda_races.py --csan naive # CSAN reports a race

The exit status is 1 when a csp run corrupted anything or a case failed (listed under "errors").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import csp  # noqa: E402
from csp.cuda import handoff as ccuda  # noqa: E402

from benchmarks.micro.cuda_race_processes import (  # noqa: E402,F401 - CASES .. Checker are importable from here too
    CASES,
    LIFETIME,
    SLOW_PRODUCER,
    TIMEOUT_S,
    Checker,
    Consumer,
    Hidden,
    Item,
    Loader,
    Producer,
    RaceOptions,
    sanitizer_mode,
)


# ---- running the cases ----------------------------------------------------------------------------
def case_devices(case: str, cuda: bool) -> tuple[str | None, str | None]:
    """``(producer device, consumer device)`` for a case; None = a CPU thread (the dry run)."""
    if not cuda:
        return None, None
    if case == "d2h_unwaited_read":
        return "cuda:0", None  # the consumer is a host thread
    return "cuda:0", ("cuda:1" if case == "cross_device" else "cuda:0")


def run_case(case: str, mode: str, *, trials: int, numel: int, cycles: int,
             devices: tuple[str | None, str | None]) -> dict[str, Any]:
    """Run one case's graph once (``mode`` "naive" or "csp").

    Returns ``{"corrupted": trials with a wrong value, "released": trials where the consumer's last
    reference was gone before its read ran, "block_reused": trials where the next forward got the
    handed-off tensor's block, "seconds": wall time}`` (the last two only where they apply).

    Raises: csp.ProcessFailed if a process raised (e.g. CSAN found a race).
    """
    if case not in CASES or mode not in ("naive", "csp"):
        raise ValueError(f"case must be one of {sorted(CASES)} and mode 'naive' or 'csp'; got {case!r}, {mode!r}")
    opts = RaceOptions(case=case, mode=mode, trials=trials, numel=numel, cycles=cycles)
    prod, cons = devices
    g = csp.Graph()
    if case == "h2d_pinned_reuse":
        g.channel("items", capacity=1)
        g.process("loader", Loader, outputs={"items": "items"}, device=prod, options=opts)
        g.process("checker", Checker, inputs={"items": "items"}, device=cons, options=opts)
    else:
        g.channel("items", capacity=1).channel("acks", capacity=2).channel("forwards", capacity=1)
        g.process("producer", Producer, inputs={"acks": "acks"},
                  outputs={"items": "items", "forwards": "forwards"}, device=prod, options=opts)
        g.process("consumer", Consumer, inputs={"items": "items", "forwards": "forwards"},
                  outputs={"acks": "acks"}, device=cons, options=opts)
    app: dict[str, Any] = {}
    t0 = perf_counter()
    csp.Runtime(g, app=app, join_timeout_s=30.0).run()
    app["seconds"] = round(perf_counter() - t0, 3)
    return app


def calibrate_cycles(window_ms: float) -> int:
    """``torch.cuda._sleep`` cycles lasting at least ``window_ms`` (at the fastest clock measured)."""
    probe = 20_000_000
    torch.cuda._sleep(probe)  # let the clocks ramp up
    per_ms = 0.0
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        per_ms = max(per_ms, probe / max(start.elapsed_time(end), 1e-3))
    return int(per_ms * window_ms)


def compare(case: str, *, trials: int, numel: int, cycles: int, cuda: bool) -> dict[str, Any]:
    """Both modes of one case: a ``cases`` entry of the result file."""
    devices = case_devices(case, cuda)
    naive = run_case(case, "naive", trials=trials, numel=numel, cycles=cycles, devices=devices)
    safe = run_case(case, "csp", trials=trials, numel=numel, cycles=cycles, devices=devices)
    entry = {"case": case, "naive_corrupted": naive["corrupted"], "csp_corrupted": safe["corrupted"],
             "trials": trials, "what": CASES[case]}
    if case in LIFETIME:
        entry.update(naive_block_reused=naive["block_reused"], csp_block_reused=safe["block_reused"],
                     csp_released_before_read=safe["released"])
    entry["seconds"] = round(naive["seconds"] + safe["seconds"], 3)
    return entry


def csan_pipeline(mode: str, cuda: bool) -> dict[str, Any]:
    """A small csp CUDA pipeline for a ``TORCH_CUDA_SANITIZER=1`` run.

    Part 1 (main thread, two streams): a tensor written on stream P crosses a channel to stream C
    and is read there, then H2D through a copy stream and D2H with ``csp.cuda.handoff.to_device``. With
    ``mode="naive"`` the tensor is :class:`Hidden` and CSAN must report the read on C (the
    positive control). Part 2 (``csp`` only): every single-GPU race case's csp variant, a few
    trials, each process thread under CSAN's dispatch mode.
    """
    san = sys.modules.get("torch.cuda._sanitizer")
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    n = 1 << 12
    streams = [torch.cuda.Stream(dev) for _ in range(3)] if cuda else [None] * 3
    p, c, copy = streams  # created first: CSAN then knows every pool stream before threads start

    def on(s):
        return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()

    send, recv = csp.channel(Item, capacity=1, name="csan")
    with on(p):
        x = torch.full((n,), 1.0, device=dev)
        send.send(Item(0, 1.0, x if mode == "csp" else Hidden(x)))
        del x
    with on(c):
        got = recv.receive()
        x = got.data.tensor if isinstance(got.data, Hidden) else got.data
        y = x * 2  # naive: CSAN reports this read (x was written on P, nothing ordered C after it)
        del x, got
        h = torch.full((n,), 3.0)
        h = h.pin_memory() if cuda else h
        g = ccuda.to_device(h, dev, stream=copy)
        total = ccuda.to_device({"s": (y + g).sum()}, "cpu")["s"]
    if float(total) != 5.0 * n:
        raise AssertionError(f"csan pipeline: expected {5.0 * n}, got {float(total)}")
    cases = {}
    if mode == "csp":
        for case in ("d2h_unwaited_read", "d2h_source_freed", "h2d_pinned_reuse", "forward_buffer_reuse"):
            r = run_case(case, "csp", trials=3, numel=n, cycles=1_000_000 if cuda else 0,
                         devices=case_devices(case, cuda))
            cases[case] = r["corrupted"]
    return {"csan": bool(san is not None and san.cuda_sanitizer.enabled), "mode": mode,
            "corrupted": cases, "ok": not any(cases.values())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=100, help="trials per case and mode")
    ap.add_argument("--window-ms", type=float, default=10.0, help="how long the deliberate delays last")
    ap.add_argument("--numel", type=int, default=1 << 20, help="fp32 elements per tensor (4 MiB)")
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--dry-run", action="store_true", help="CPU only: same code paths, no race possible")
    ap.add_argument("--csan", choices=("csp", "naive"), help="run the small sanitizer pipeline instead")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if args.csan:
        result = csan_pipeline(args.csan, cuda)
        print(json.dumps(result))
        return 0 if result["ok"] else 1
    gpus = torch.cuda.device_count() if cuda else 0
    cycles = calibrate_cycles(args.window_ms) if cuda else 0
    cases, skipped, errors = [], [], []
    for case in args.cases:
        if case == "cross_device" and gpus < 2:
            skipped.append({"case": case, "reason": f"needs 2 CUDA devices; found {gpus}"})
            continue
        try:
            cases.append(compare(case, trials=args.trials, numel=args.numel, cycles=cycles, cuda=cuda))
        except Exception as exc:  # report the other cases anyway
            errors.append({"case": case, "error": f"{type(exc).__name__}: {exc}"})
    result = {
        "command": shlex.join(["python", *sys.argv]) if argv is None else shlex.join(["python", __file__, *argv]),
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run: code paths only, no race possible)",
        "torch": torch.__version__, "window_ms": args.window_ms, "sleep_cycles": cycles, "numel": args.numel,
        "cases": cases, "skipped": skipped, "errors": errors,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 1 if errors or any(c["csp_corrupted"] for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
