"""Run the DFlash csp training graph in this process for a fixed number of steps and time it.

Used by ``benchmarks/h200/bench.py``. A run is built exactly as ``python -m dflash.run`` builds it
(:func:`dflash.run.config.load_config` with ``--set`` overrides, :func:`dflash.run.resolve.load_and_resolve`, :func:`dflash.run.prepare.prepare`,
``csp.Graph.from_spec``, ``csp.Runtime``), with the monitor logging every step
(``monitor.window = 1``) so ``metrics.jsonl`` holds one ``train`` record per step.

Steady state, not start-up or drain: ``run.steps`` is set well past ``warmup + timed`` so the source
never runs dry inside the timed window, and the run is aborted (``Runtime.abort``) as soon as the
monitor has logged step ``warmup + timed``. Throughput is the real (non-padding) tokens of steps
``warmup+1 .. warmup+timed`` divided by the wall time between the end of step ``warmup`` and the end
of step ``warmup+timed`` (the records' ``time`` fields).

Run it inside ``with benchmarks.h200.reuse.ModelReuse():`` so consecutive runs share the frozen models.
"""

from __future__ import annotations

import gc
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

# Every benchmark run: one train record per step, no wandb, no live display, never resume.
BENCH_SETTINGS = ["monitor.window=1", "monitor.wandb=disabled", "monitor.display=off", "run.resume=none"]
SLACK_STEPS = 100  # run.steps beyond the timed window (never reached: the run is aborted first)


# -- metrics.jsonl ----------------------------------------------------------------------------------

class StepRecord(msgspec.Struct, frozen=True):
    """One drafter step as logged with ``monitor.window = 1``.

    Attributes:
        step: drafter step (1-based).
        time: unix time (s) when the step finished.
        tokens: real tokens of the step's batch (``tok_s`` x the gap to the previous record);
            None for the first record (its window starts at the monitor's start).
    """

    step: int
    time: float
    tokens: int | None


def read_metrics(path: Path) -> tuple[list[StepRecord], list[dict[str, Any]]]:
    """``(steps, checkpoints)`` from a ``metrics.jsonl`` written with ``monitor.window = 1``.

    Raises:
        ValueError: a ``train`` record averages more than one step.
    """
    train, ckpts = [], []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            if rec["window"] != 1:
                raise ValueError(f"{path}: step {rec['step']} averages {rec['window']} steps; "
                                 "run with --set monitor.window=1")
            train.append(rec)
        elif rec.get("kind") == "checkpoint":
            ckpts.append(rec)
    train.sort(key=lambda r: r["step"])
    steps, prev = [], None
    for rec in train:
        tokens = None
        if prev is not None and prev["step"] == rec["step"] - 1:
            tokens = round(rec["tok_s"] * (rec["time"] - prev["time"]))
        steps.append(StepRecord(rec["step"], rec["time"], tokens))
        prev = rec
    return steps, ckpts


def steady_throughput(steps: list[StepRecord], warmup: int, timed: int) -> dict[str, Any]:
    """Tokens/s and mean step time over steps ``warmup+1 .. warmup+timed``.

    Raises:
        ValueError: a step of the window (or step ``warmup``, its start) is missing.
    """
    by_step = {s.step: s for s in steps}
    need = range(max(warmup, 1), warmup + timed + 1)
    missing = [i for i in need if i not in by_step or (i > warmup and by_step[i].tokens is None)]
    if missing:
        raise ValueError(f"steps {missing[:5]} missing from metrics.jsonl (run ended early?)")
    t0, t1 = by_step[max(warmup, 1)].time, by_step[warmup + timed].time
    first = max(warmup, 1) + 1
    tokens = sum(by_step[i].tokens or 0 for i in range(first, warmup + timed + 1))
    n = warmup + timed - first + 1
    wall = max(t1 - t0, 1e-9)
    return {"tok_s": tokens / wall, "step_s": wall / n, "steps_timed": n, "tokens_timed": tokens}


def checkpoint_overlap(steps: list[StepRecord], saves: list[dict[str, Any]], lo: int, hi: int) -> dict[str, Any]:
    """Step times of steps that overlap a background save against steady steps.

    A save after step ``E`` runs from the end of step ``E`` (the drafter snapshots right after it)
    to its ``checkpoint`` record's ``time``. Step ``s`` (its interval is from the end of step
    ``s-1`` to its own end) overlaps a save if the intervals intersect. Only steps
    ``lo+1 .. hi`` are counted (step ``lo`` must be present).

    Returns:
        ``slowdown`` = mean step time overlapping a save / mean steady step time - 1 (None when no
        step overlapped or none was steady), ``max_ratio`` (worst single step / steady mean),
        ``extra_s`` (seconds lost to saves inside the window), per-save details.
    """
    by_step = {s.step: s for s in steps}
    windows = []
    for c in saves:
        if c.get("path") is None or c["step"] not in by_step:
            continue
        windows.append((by_step[c["step"]].time, c["time"], c))
    overlap, steady, per_save = [], [], {c["step"]: [] for _, _, c in windows}
    for s in range(lo + 1, hi + 1):
        if s not in by_step or s - 1 not in by_step:
            continue
        a, b = by_step[s - 1].time, by_step[s].time
        hit = [c["step"] for (w0, w1, c) in windows if b > w0 and a < w1]
        (overlap if hit else steady).append(b - a)
        for e in hit:
            per_save[e].append(s)
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    m_over, m_steady = mean(overlap), mean(steady)
    ok = m_over is not None and m_steady is not None and m_steady > 0
    return {
        "slowdown": (m_over / m_steady - 1.0) if ok else None,
        "max_ratio": (max(overlap) / m_steady) if ok else None,
        "extra_s": (sum(overlap) - m_steady * len(overlap)) if ok else None,
        "mean_step_s_during_save": m_over,
        "mean_step_s_steady": m_steady,
        "steps_during_save": len(overlap),
        "steps_steady": len(steady),
        "saves": [{"step": c["step"], "save_s": c.get("save_s"), "steps_overlapped": per_save[c["step"]]}
                  for _, _, c in windows],
    }


def stage_statistics(stats_path: Path) -> dict[str, Any]:
    """Busy/waiting/blocked seconds per process and channel counters from the final csp snapshot."""
    last = None
    if not Path(stats_path).is_file():
        return {}
    for line in Path(stats_path).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") in ("snapshot", "final"):
            last = rec
    if last is None:
        return {}
    keep_p = ("busy_s", "wait_input_s", "blocked_output_s", "items_out")
    keep_c = ("capacity", "peak_fill", "send_blocked_s", "receive_wait_s", "items_moved")
    return {
        "processes": {q: {k: p[k] for k in keep_p if k in p} for q, p in last.get("processes", {}).items()},
        "channels": {n: {k: c[k] for k in keep_c if k in c} for n, c in last.get("channels", {}).items()},
    }


# -- one pipeline run -------------------------------------------------------------------------------

def _cuda_devices(cfg: Any) -> list[str]:
    devs = []
    for p in cfg.process:
        for d in (p.devices or ([p.device] * p.replicas if p.device else [])):
            if d and d.startswith("cuda") and d not in devs:
                devs.append(d)
    return devs


def run_pipeline(graph_file: Path, overrides: list[str], run_dir: Path, *, warmup: int, timed: int,
                 checkpoint_every: int = 0, timeout_s: float = 300.0, join_timeout_s: float = 180.0,
                 artifacts: Path | None = None) -> dict[str, Any]:
    """Run the graph for ``warmup + timed`` steps (then abort) and measure it.

    Args:
        graph_file: the graph TOML. overrides: ``--set`` items applied first (benchmark settings,
            ``run.out_dir``, ``run.steps`` and ``checkpoint.every`` are added after them).
        run_dir: the run directory (emptied first; its checkpoints are deleted afterwards).
        checkpoint_every: ``[checkpoint].every`` (0: no checkpoint inside the run).
        timeout_s: abort the run if step ``warmup + timed`` is not logged by then.
        join_timeout_s: how long the aborted run may take to stop (a checkpoint being written when
            the window ends is finished first).
        artifacts: copy ``metrics.jsonl``, ``config.toml``, ``csp/stats.jsonl`` and ``csp/trace.json``
            to this directory.

    Returns:
        ``tok_s``, ``step_s``, per-step ``steps``/``step_end_s`` (seconds after step 1 ended)/
        ``step_tokens``, ``peak_mem_gb`` per device, csp ``stages`` statistics, ``checkpoints`` (the
        metrics records, plus ``time_rel`` on the ``step_end_s`` clock), ``wall_s``, and with
        ``checkpoint_every`` a ``checkpoint`` entry (:func:`checkpoint_overlap` over the window).

    Raises:
        dflash.errors.ConfigError, csp.GraphError, csp.ProcessFailed, dflash.data.DataError: from
            resolving, building or running the graph.
        TimeoutError: the window was not reached within ``timeout_s``.
        ValueError: a device hosts more than one target replica (:class:`ModelReuse` shares one
            target per device).
    """
    import csp
    import dflash.run.stages  # noqa: F401  (registers the dflash.* kinds)
    from dflash.run.config import load_config, to_toml
    from dflash.run.prepare import prepare
    from dflash.run.resolve import load_and_resolve

    total = warmup + timed
    sets = [*overrides, *BENCH_SETTINGS, f"run.out_dir={run_dir}", f"run.steps={total + SLACK_STEPS}",
            f"checkpoint.every={checkpoint_every}"]
    cfg = load_config(graph_file, sets)
    target = next(p for p in cfg.process if p.kind == "dflash.target")
    tdevs = target.devices or [target.device] * target.replicas
    if len(set(tdevs)) != len(tdevs):
        raise ValueError(f"{graph_file}: target replicas share a device ({tdevs}); the benchmark reuses "
                         "one target per device: use one replica per device")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_bytes(to_toml(cfg))
    torch.manual_seed(cfg.run.seed)
    resolved, tok = load_and_resolve(cfg)
    app = prepare(resolved, "none", tok)
    graph = csp.Graph.from_spec(cfg)
    # join_timeout_s: after the abort the drafter's teardown finishes an in-flight checkpoint first
    runtime = csp.Runtime(graph, run_dir=run_dir, app=app, join_timeout_s=join_timeout_s)

    reached, ended = threading.Event(), threading.Event()
    write = app.metrics.write

    def write_and_watch(record: dict[str, Any]) -> None:
        write(record)
        if record.get("kind") == "train" and record.get("step", 0) >= total:
            reached.set()

    app.metrics.write = write_and_watch  # type: ignore[method-assign]
    timed_out = []

    def watchdog() -> None:
        if not reached.wait(timeout_s):
            timed_out.append(True)
        if not ended.is_set():
            runtime.abort()  # the window is complete (or will never be): stop without draining

    devices = _cuda_devices(cfg)
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    watcher = threading.Thread(target=watchdog, name="bench-watchdog", daemon=True)
    t0 = time.perf_counter()
    watcher.start()
    try:
        result = runtime.run()
    finally:
        ended.set()
        reached.set()
        watcher.join()
        app.metrics.close()
    wall = time.perf_counter() - t0
    peak = {d: round(torch.cuda.max_memory_allocated(d) / 2**30, 2) for d in devices}
    del runtime, graph, app
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the stages' streams are gone: release their cached blocks
    if timed_out:
        raise TimeoutError(f"step {total} was not reached within {timeout_s:.0f} s (status {result.status})")

    steps, ckpts = read_metrics(run_dir / "metrics.jsonl")
    out = steady_throughput(steps, warmup, timed)
    if checkpoint_every:
        out["checkpoint"] = checkpoint_overlap(steps, ckpts, warmup, total)
    base = steps[0].time if steps else 0.0
    ckpts = [{**c, "time_rel": round(c["time"] - base, 4)} for c in ckpts]
    out.update({
        "graph": str(graph_file),
        "overrides": list(overrides),
        "checkpoint_every": checkpoint_every,
        "warmup": warmup,
        "steps": [s.step for s in steps if s.step <= total],
        "step_end_s": [round(s.time - base, 4) for s in steps if s.step <= total],
        "step_tokens": [s.tokens for s in steps if s.step <= total],
        "peak_mem_gb": peak,
        "stages": stage_statistics(run_dir / "csp" / "stats.jsonl"),
        "checkpoints": ckpts,
        "run_status": result.status,
        "wall_s": round(wall, 2),
    })
    if artifacts is not None:
        artifacts.mkdir(parents=True, exist_ok=True)
        for rel in ("metrics.jsonl", "config.toml", "csp/stats.jsonl", "csp/trace.json"):
            if (run_dir / rel).is_file():
                shutil.copy(run_dir / rel, artifacts / rel.replace("/", "_"))
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return out
