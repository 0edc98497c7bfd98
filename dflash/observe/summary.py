"""The closing summary ``dflash.run`` prints when a run ends, however it ends.

Built from the run's own files (``RUN_DIR/metrics.jsonl`` since the last ``start`` record, and the
checkpoints), so it says what was recorded, not what the process believes::

    run summary: completed (exit 0) in 5.1 s
      steps        12/12 (this run: 1..12)
      last window  step 12 (2 steps): loss 7.941, tau 1.076 tokens/verify step, accepted 0.076
      throughput   7.0K tok/s (target 10.5K, drafter 7.1K; mean of this run's 6 windows)
      skipped      0 steps
      checkpoint   RUN/checkpoints/step_00000012 (step 12, healthy)
      run dir      RUN (run.log, metrics.jsonl, csp/stats.jsonl, checkpoints/)
      next
        python -m dflash.plot RUN              loss, accuracy, tau, lr, grad norm, tok/s vs step
        ...

For a stop, an abort or a failure the same block says what was saved (the checkpoint a resume
would start from, or that none exists) and the command that resumes. ``tau`` is the accepted
length reported as tokens per verify step (accepted + 1) when the records carry it; ``accepted``
(or the older ``tau_sim``) is the accepted-only figure.
"""

from __future__ import annotations

import logging
import math
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

from dflash.checkpoint import is_healthy, list_checkpoints, read_meta
from dflash.observe import runlog
from dflash.observe.logs import read_metrics
from dflash.records import EndRecord, HeldoutRecord, SkipRecord, StartRecord, TrainRecord

STATUS_TEXT = {
    "completed": "completed",
    "stopped": "stopped after draining",
    "aborted": "aborted (second stop signal): no final checkpoint was written",
    "failed": "failed",
    "stuck": "abandoned: a process did not stop",
    "disk full": "stopped: the disk is full, a checkpoint could not be written",
    "nothing to do": "nothing to do: the run is already at its last step",
}
FINISHED = ("completed", "nothing to do")  # statuses with nothing left to resume


def _skipped_text(held: list) -> str:
    """``, 1 skipped (between steps 200 and 600; ...)``: the snapshots the evaluator passed over.
    Each ``heldout`` record counts those since the previous one, so the gaps are named by the
    evaluations around them, and "2 evaluations" of a run that took 3 snapshots says why."""
    gaps, prev = [], None
    for r in held:
        n = r.skipped if isinstance(r.skipped, int) and not isinstance(r.skipped, bool) else 0
        if n > 0:
            gaps.append((n, prev, r.step))
        prev = r.step
    if not gaps:
        return ""

    def place(n: int, a: int | None, b: int) -> str:
        where = f"before step {b}" if a is None else f"between steps {a} and {b}"
        return where if len(gaps) == 1 else f"{n} {where}"  # one gap: the total already gives its count
    where = "; ".join(place(*g) for g in gaps[:3]) + ("; ..." if len(gaps) > 3 else "")
    total = sum(n for n, _, _ in gaps)
    return f", {total} skipped ({where}: the evaluator was busy, or over eval.max_busy)"


def _count(n: Any, noun: str) -> str:
    """``"1 step"``, ``"3 steps"``, ``"0 steps"`` (``n`` not a count: as it is, plural)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _num(x: Any, fmt: str = ".4g") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and math.isfinite(x) else str(x)


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def last_healthy(run_dir: Path) -> Path | None:
    """The newest checkpoint of ``run_dir`` that passes :func:`dflash.checkpoint.is_healthy` (the
    cheap check: no tensor data read; a resume verifies the tensors too), or None."""
    healthy = [p for p in list_checkpoints(Path(run_dir) / "checkpoints") if is_healthy(p)]
    return healthy[-1] if healthy else None


def segment(records: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records (:mod:`dflash.records`, or dicts of the same keys) of the latest run segment:
    from the last ``start`` record on (all if none)."""
    starts = [i for i, r in enumerate(records) if r.get("kind") == "start"]
    return records[starts[-1]:] if starts else records


def resume_command(argv: Sequence[str]) -> str:
    """``python -m dflash.run`` with the same arguments, ``--resume`` replaced by ``--resume auto``."""
    args, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--resume":
            skip = True
            continue
        if a.startswith("--resume="):
            continue
        args.append(a)
    return shlex.join(["python", "-m", "dflash.run", *args, "--resume", "auto"])


def _tau_text(rec: dict[str, Any]) -> str:
    parts = []
    if "accepted_sim" in rec:  # tau_sim: simulated tokens per verify step (accepted + 1)
        if rec.get("tau_sim") is not None:
            parts.append(f"tau {_num(rec['tau_sim'])} tokens/verify step")
        accepted = rec.get("accepted_sim")
    else:                      # a log older than that convention: tau_sim was the accepted length
        accepted = rec.get("tau_sim")
    if accepted is not None:
        parts.append(f"accepted {_num(accepted)}")
    return ", ".join(parts)


def closing_summary(run_dir: str | Path, *, status: str, exit_code: int, total_steps: int,
                    argv: Sequence[str] = (), seconds: float | None = None,
                    stopped_by: str | None = None, error: str | None = None,
                    data_source: str | None = None, plot: str | None = None,
                    wandb_ran: bool = True, budget: str | None = None) -> str:
    """The summary block (plain text, lines indented under a title line; no markup).

    Args:
        run_dir: the run directory (``metrics.jsonl`` and ``checkpoints/`` are read; missing ones
            are reported, never raised).
        status: "completed" | "stopped" | "aborted" | "failed" | "stuck".
        exit_code: the process exit code.
        total_steps: ``[run].steps``.
        argv: the ``dflash.run`` arguments (for the resume command).
        seconds: wall time of the run (s), if known.
        stopped_by: the signal that stopped it ("SIGINT", "SIGTERM", ...), if any.
        error: the one-line error of a failed run.
        data_source: ``[data].source`` (for the eval command).
        plot: the plot file written at the end, or a line saying why none was.
        wandb_ran: wandb logged this segment (``[monitor].wandb`` other than "disabled", and steps
            ran); only then are the wandb viewer and sync commands suggested.
        budget: how ``[run].time_budget_s`` ended the run (steps reached, seconds after it), if it did.
    """
    run_dir = Path(run_dir)
    try:
        records, _ = read_metrics(run_dir / "metrics.jsonl")
    except OSError:
        records = []
    seg = segment(records)
    start = next((r for r in seg if isinstance(r, StartRecord)), {})
    train = [r for r in seg if isinstance(r, TrainRecord)]
    skips = [r for r in seg if isinstance(r, SkipRecord)]
    last = train[-1] if train else {}
    end = next((r for r in reversed(seg) if isinstance(r, EndRecord)), {})
    start_step = int(start.get("step", 0) or 0)

    # the trainer's own count (the end record): the windows lag, and an abort or failure drops those in flight
    done = end.get("step") if isinstance(end.get("step"), int) else last.get("step", start_step)
    try:
        ckpt = last_healthy(run_dir)
    except Exception:  # noqa: BLE001 - a summary never fails the run's exit
        ckpt = None
    ckpt_step = (read_meta(ckpt) or {}).get("step") if ckpt is not None else None
    how = STATUS_TEXT.get(status, status)
    if status == "nothing to do" and isinstance(done, int) and done > total_steps:  # run.steps was lowered
        how = f"nothing to do: the checkpoint is already past the last step (step {done}, run.steps = {total_steps})"
    elif status == "stopped" and stopped_by:
        how = f"stopped by {stopped_by} after draining"
    elif status == "aborted":
        # the checkpoint writer finishes a save in flight, so the last step may have one after all
        how = (f"aborted by a second stop signal ({stopped_by})" if stopped_by else "aborted (second stop signal)")
        how += ("; the checkpoint of its last step was written" if ckpt is not None and ckpt_step == done
                else ": no final checkpoint was written")
    title = f"run summary: {how} (exit {exit_code})" + (f" in {seconds:.1f} s" if seconds is not None else "")
    lines = [title]
    row = lambda k, v: lines.append(f"  {k:<12} {v}")  # noqa: E731

    if error:
        row("error", error)
    this = f"this run: {start_step + 1}..{done}" if done > start_step else "no step finished in this run"
    row("steps", f"{done}/{total_steps} ({this})")
    if budget:
        row("time budget", budget)
    if train:
        row("last window", f"step {last.get('step')} ({_count(last.get('window', '?'), 'step')}): loss "
                           f"{_num(last.get('loss'))}" + (f", {_tau_text(last)}" if _tau_text(last) else ""))
        rates = [r["tok_s"] for r in train if isinstance(r.get("tok_s"), (int, float)) and math.isfinite(r["tok_s"])]
        if rates:
            mean = lambda k: [r[k] for r in train if isinstance(r.get(k), (int, float))]  # noqa: E731
            tgt, dft = mean("target_tok_s"), mean("drafter_tok_s")
            parts = ", ".join(filter(None, [f"target {_si(sum(tgt) / len(tgt))}" if tgt else "",
                                            f"drafter {_si(sum(dft) / len(dft))}" if dft else ""]))
            row("throughput", f"{_si(sum(rates) / len(rates))} tok/s ({parts + '; ' if parts else ''}"
                              f"mean of this run's {_count(len(rates), 'window')})")
    held = [r for r in seg if isinstance(r, HeldoutRecord)]
    best_kept, best_ckpt, best = False, None, None
    if held:  # real draft-and-verify on held-out prompts ([eval]); the last one is the final weights'
        h = held[-1]
        best = max(held, key=lambda r: r.tau if isinstance(r.tau, (int, float)) else -1.0)
        sampled = f", sampled {_num(h.sampled_tau)}" if isinstance(h.sampled_tau, (int, float)) else ""
        if isinstance(h.tree_tau, (int, float)):
            sampled += f", tree of {h.tree_budget} {_num(h.tree_tau)}"
        sampled += h.loops_text()
        best_ckpt = run_dir / "checkpoints" / f"step_{best.step:08d}" if isinstance(best.step, int) else None
        best_kept = best_ckpt is not None and best.step != h.step and is_healthy(best_ckpt)
        row("held-out", f"tau {_num(h.tau)} tokens/verify step measured at step {h.step} ({h.over()}"
                        f"{sampled}); best {_num(best.tau)} at step {best.step}"
                        + (f" (its checkpoint kept: {best_ckpt})" if best_kept else "")
                        + f"; {_count(len(held), 'evaluation')}" + _skipped_text(held))
    unevaluated = end.get("unevaluated")
    if isinstance(unevaluated, int):  # a stop cut the held-out evaluation of these weights short
        src = f"--data {shlex.quote(data_source)}" if data_source else "--prompts FILE.jsonl"
        measure = (f"; python -m dflash.eval {shlex.quote(str(ckpt))} {src} measures these weights"
                   if ckpt is not None and ckpt_step == unevaluated else "")
        row("unevaluated", f"step {unevaluated}: the stop came before its held-out evaluation finished; a resume "
                           f"does not redo it{measure}")
    total_skipped = last.get("skipped_total")
    skipped = f"{_count(len(skips), 'step')} in this run"
    if isinstance(total_skipped, int) and total_skipped != len(skips):
        skipped += f", {total_skipped} in total"
    if skips:
        skipped += f" (last: step {skips[-1].get('step')}, {skips[-1].get('reason')})"
    row("skipped", skipped)
    estimated, peak = end.get("estimated_gib"), end.get("peak_gib")
    if isinstance(estimated, dict) and estimated:  # the run's CUDA devices (dflash.run.memory)
        row("GPU memory", "; ".join(
            (f"{d} peak {peak[d]:.1f} GiB allocated, estimated {e:.1f}" if isinstance(peak, dict) and d in peak
             else f"{d} estimated {e:.1f} GiB") for d, e in estimated.items()))

    finished = status in FINISHED
    label = "checkpoint" if finished else "saved"
    if ckpt is None:
        row(label, "no healthy checkpoint: the next run starts from step 0")
    elif finished or ckpt_step == done:
        row(label, f"{ckpt} (step {ckpt_step}, healthy{'' if finished else ', the final one'})")
    else:
        redo = (f"; steps {ckpt_step + 1}..{done} are redone on resume"
                if isinstance(ckpt_step, int) and isinstance(done, int) and ckpt_step < done else "")
        row(label, f"{ckpt} (step {ckpt_step}, the last healthy checkpoint{redo})")
    row("run dir", f"{run_dir} (run.log, metrics.jsonl, csp/stats.jsonl, checkpoints/)")
    if plot:
        row("plot", plot)

    nxt: list[tuple[str, str]] = []
    if not finished and ckpt is not None and (ckpt_step or 0) < total_steps:
        nxt.append((resume_command(argv), f"resume from step {ckpt_step}"))
    elif not finished and ckpt is None:
        nxt.append((resume_command(argv), "start again (no checkpoint to resume)"))
    nxt.append((f"python -m dflash.logs {shlex.quote(str(run_dir))}", "spikes, skips, gaps, checkpoint health"))
    nxt.append((f"python -m dflash.plot {shlex.quote(str(run_dir))}",
                "loss, accuracy, tau, lr, grad norm, tok/s vs step (PNG)"))
    nxt.append((f"python -m csp.inspect {shlex.quote(str(run_dir))}", "channel backpressure, the bottleneck stage"))
    if ckpt is not None:
        q = shlex.quote(str(ckpt))
        src = f"--data {shlex.quote(data_source)}" if data_source else "--prompts FILE.jsonl"
        nxt.append((f"python -m dflash.eval {q} {src}", "measured accepted length (draft and verify)"))
        nxt.append((f"python -m dflash.export {q} -o {shlex.quote(str(run_dir / 'export'))}",
                    "the public DFlash Hugging Face layout"))
    if held and best_kept:
        nxt.append((f"python -m dflash.export {shlex.quote(str(best_ckpt))} -o {shlex.quote(str(run_dir / 'export-best'))}",
                    f"the best held-out weights (tau {_num(best.tau)} at step {best.step})"))
    offline = sorted((run_dir / "wandb").glob("offline-run-*")) if wandb_ran and (run_dir / "wandb").is_dir() else []
    if offline:
        nxt.append((f"wandb leet {shlex.quote(str(run_dir / 'wandb'))}", "wandb's offline viewer (terminal)"))
        nxt.append((f"wandb sync {shlex.quote(str(offline[-1]))}", "upload the offline wandb run"))
    lines.append("  next")
    width = min(max(len(c) for c, _ in nxt), 64)
    for c, why in nxt:  # a long command gets its comment on the line above
        lines += [f"    # {why}", f"    {c}"] if len(c) > width else [f"    {c.ljust(width)}  # {why}"]
    return "\n".join(lines)


def report_end(run_dir: str | Path, *, status: str, exit_code: int, total_steps: int,
               argv: Sequence[str] = (), seconds: float | None = None, stopped_by: str | None = None,
               error: str | None = None, data_source: str | None = None, plot: bool = True,
               wandb_ran: bool = True, logger: logging.Logger | None = None, budget: str | None = None) -> str:
    """Plot the curves to ``RUN_DIR/plot.png`` when ``plot`` (without matplotlib, the summary's plot
    line says where it would be and how to draw it), print the closing summary on
    the run's console and log it to run.log (INFO for a finished run, WARNING otherwise). Never
    raises: a summary must not change how a run exits. Returns the summary text."""
    logger = logger or logging.getLogger("dflash.run")
    run_dir = Path(run_dir)
    note = None
    if plot:
        from dflash.observe.plot import INSTALL_HINT, PlotUnavailable, plot_run

        try:
            note = str(plot_run(run_dir))
        except PlotUnavailable:
            note = (f"{run_dir / 'plot.png'} not drawn (matplotlib is not importable): {INSTALL_HINT}, "
                    f"then python -m dflash.plot {shlex.quote(str(run_dir))}")
        except Exception as exc:  # noqa: BLE001 - no train record yet, an unreadable log, ...
            note = f"not drawn: {exc}"
    try:
        text = closing_summary(run_dir, status=status, exit_code=exit_code, total_steps=total_steps,
                               argv=argv, seconds=seconds, stopped_by=stopped_by, error=error,
                               data_source=data_source, plot=note, wandb_ran=wandb_ran, budget=budget)
    except Exception as exc:  # noqa: BLE001
        text = f"run summary: {status} (exit {exit_code}); the summary failed: {exc!r}"
    logger.log(logging.INFO if status in FINISHED else logging.WARNING, text, extra=runlog.FILE_ONLY)
    try:  # the terminal: as written (a log handler would indent and re-wrap the block)
        runlog.console().print(text, markup=False, highlight=False, soft_wrap=True)
    except Exception:  # noqa: BLE001 - a closed stderr must not change the exit code
        pass
    return text


__all__ = ["closing_summary", "last_healthy", "report_end", "resume_command", "segment"]
