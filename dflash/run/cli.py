"""``python -m dflash.run GRAPH.toml [--set section.key=value ...] [--resume auto|PATH|none]``

Reads and validates the graph file (:func:`dflash.run.config.load_config`), builds the csp graph, loads
the tokenizer and resolves the config (:func:`dflash.run.resolve.resolve`: every cross-table check and
each stage's options, before any data is read or the run directory is written), takes the run
lock, prepares the tokenized data (cached) and the checkpoint to resume from, runs the graph, and
closes everything on every path.

Exit codes:
    0    training finished (``[run].steps`` reached)
    1    a stage failed (the error names it: ``target[1]``, ``drafter[0]`` ...), or a checkpoint or
         data problem was found at run time
    2    bad graph file, config or data (nothing started; config errors, including those across
         tables such as drafter vs target shapes, come before any data is read or written)
    3    a stage did not stop within 10 s of an abort (one line names it)
    4    disk full: a checkpoint could not be written (one line names the device; the partial save is
         removed, the last good checkpoint intact; :class:`dflash.errors.DiskFullError`)
    130  stopped by Ctrl-C or SIGTERM: the graph drained and a final checkpoint was written

However it ends, a closing summary (:mod:`dflash.observe.summary`) says what was done and saved and what to
run next, and the curves are plotted to ``RUN_DIR/plot.png`` (:mod:`dflash.plot`) when matplotlib
is importable. Output: :mod:`dflash.observe.runlog`.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

import csp
import csp.dist
from dflash.checkpoint import CheckpointError, check_architecture, list_checkpoints
from dflash.checkpoint.files import device_of
from dflash.checkpoint.resume import (
    archive_foreign,
    changes_since,
    check_resume_path,
    new_lineage,
)
from dflash.checkpoint.resume import choose as choose_resume
from dflash.errors import ConfigError, DiskFullError
from dflash.observe import runlog
from dflash.observe.metrics_writer import MetricsLog
from dflash.records import EndRecord, ResumeRecord, StartRecord
from dflash.run.app import ResumeState, RunApp
from dflash.run.args import INTERRUPTED_STARTING, build_parser
from dflash.run.config import DFlashFile, load_config, to_toml
from dflash.run.preflight import check_run_dir, disk_space_warnings, preflight
from dflash.run.resolve import Resolved, resolve

log = logging.getLogger("dflash.run")

EXIT_DISK_FULL = 4
"""A checkpoint could not be written for lack of space (:class:`dflash.errors.DiskFullError`)."""
EXIT_DEADLOCK = 5
"""Every stage waited on a channel and nothing moved for ``[runtime].deadlock_timeout_s``; csp.run
itself uses 4 for it, which dflash.run gives to a full disk."""


def _error(exc: BaseException | str) -> None:
    """One plain, unwrapped line on stderr (greppable in logs and CI), and in run.log."""
    print(f"error: {exc}", file=sys.stderr, flush=True)
    for h in runlog.file_handlers():
        h.emit(logging.makeLogRecord({"name": "dflash.run", "levelname": "ERROR", "levelno": logging.ERROR,
                                      "msg": f"error: {exc}"}))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (:mod:`dflash.run.args`; ``--help`` lists options and exit codes)."""
    return build_parser().parse_args(argv)


setup_logging = runlog.setup  # terminal + RUN_DIR/run.log (dflash.observe.runlog)
close_logging = runlog.close


def acquire_run_lock(run_dir: Path):
    """Exclusive lock on RUN_DIR/.lock for the life of the process (two runs must not share a
    run directory: their checkpoints and metrics would interleave).

    Raises:
        ConfigError: another process holds the lock, or the directory or its lock file cannot be
            created or written (one line naming the path and the OS's reason).
    """
    import fcntl

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        f = open(run_dir / ".lock", "a+")
    except OSError as exc:
        raise ConfigError(f"run.out_dir = {str(run_dir)!r}: cannot create {exc.filename or run_dir}: "
                          f"{exc.strerror or exc}; choose another run.out_dir") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        other = f.read().strip() or "?"
        f.close()
        raise ConfigError(f"{run_dir} is in use by another dflash.run (pid {other}); wait for it, "
                          "or choose another run.out_dir") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
    except OSError as exc:  # a full disk: the lock itself holds, the pid note is only a courtesy
        log.debug("could not write the pid to %s: %s", run_dir / ".lock", exc)
    return f


def keep_previous_observability(run_dir: Path, start_step: int) -> None:
    """Move an earlier segment's csp stats and trace aside so this segment does not overwrite them:
    ``stats.before-step-N.jsonl`` (N: the step this segment starts from), or
    ``stats.before-step-N-2.jsonl``, ``-3`` ... when an earlier segment also ended at step N; stats
    and trace of one segment share the suffix. ``csp.inspect`` reads the current ``stats.jsonl``."""
    csp_dir = run_dir / "csp"
    names = [n for n in ("stats.jsonl", "trace.json") if (csp_dir / n).exists()]
    if not names:
        return

    def aside(name: str, k: int) -> Path:
        stem, ext = name.split(".", 1)
        return csp_dir / f"{stem}.before-step-{start_step}{'' if k == 1 else f'-{k}'}.{ext}"

    k = 1
    while any(aside(n, k).exists() for n in ("stats.jsonl", "trace.json")):
        k += 1
    for name in names:
        (csp_dir / name).rename(aside(name, k))


def interrupted_before_training(run_dir: Path, resume: str) -> str:
    """The Ctrl-C line for an interrupt before the graph started (tokenizing, loading, choosing
    the checkpoint): no step ran and no checkpoint was written, what ``run_dir`` does hold (run.log
    and .lock at least; the data cache keeps complete entries only), and what a re-run does."""
    from dflash.observe.summary import last_healthy

    try:
        names = sorted(p.name for p in run_dir.iterdir())
        ckpt = last_healthy(run_dir) if resume == "auto" else None
    except OSError:
        names, ckpt = [], None
    if resume not in ("auto", "none"):
        after = f"a re-run resumes from {resume}"
    elif ckpt is not None:
        after = f"a re-run resumes from {ckpt}"
    else:
        after = "a re-run starts from step 0"
    return (f"interrupted before training started: no step ran and no checkpoint was written; {run_dir} "
            f"holds {', '.join(names) or 'nothing'} (the data cache keeps complete entries only); {after}")


def load_resolved(cfg: DFlashFile) -> tuple[Resolved, Any]:
    """The tokenizer (no data read) and :func:`dflash.run.resolve.resolve` of ``cfg`` with it.

    Returns:
        ``(resolved, tokenizer)``.

    Raises:
        ConfigError: a cross-table mistake (one line naming the key).
        dflash.data.DataError: the tokenizer cannot be loaded.
    """
    from dflash.data import load_tokenizer, tokenizer_info

    preflight(cfg)  # the checks that need no tokenizer first: a wrong target.path is named as one
    tok = load_tokenizer(cfg.target.tokenizer or cfg.target.path or "builtin:tiny")
    return resolve(cfg, tokenizer_info(tok)), tok


def prepare(resolved: Resolved, resume: str, tok: Any = None) -> RunApp:
    """Everything that must exist before the graph starts: data, sampler, resume state.

    ``tok``: the tokenizer :func:`load_resolved` loaded (loaded again when None).

    Raises:
        dflash.data.DataError: unusable data (message names the file and the reasons).
        CheckpointError: the requested checkpoint cannot be used.
    """
    from dflash.data import (
        DataError,
        Sampler,
        load_dataset,
        load_tokenizer,
        tokenizer_info,
    )

    cfg = resolved.cfg
    run_dir = Path(cfg.run.out_dir)
    if tok is None:
        tok = load_tokenizer(cfg.target.tokenizer or cfg.target.path or "builtin:tiny")
    info = tokenizer_info(tok)
    dataset = load_dataset(cfg.data, tok, console=runlog.console())
    if dataset.summary is not None:
        log.info(runlog.data_line(dataset.summary), extra=runlog.FILE_ONLY)  # the terminal got the table
    try:
        train, _heldout = dataset.split(cfg.data.holdout, cfg.data.seed)  # heldout: python -m dflash.eval
    except ValueError as exc:
        raise DataError(f"{exc}; lower data.holdout") from exc
    sampler = Sampler(train, cfg.data, pad_id=info.pad_token_id)

    rank = int(os.environ.get("RANK", "0"))  # under torchrun, ranks > 0 log beside their csp stats
    # when auto rejects every checkpoint there was, choose_resume itself says the run starts at step 0
    found = bool(list_checkpoints(run_dir / "checkpoints"))
    got = choose_resume(run_dir, resume)  # logs a REJECTED line for each checkpoint it passes over
    state, changes = ResumeState(), []
    if got is not None:
        state = ResumeState(start_step=got.step, path=got.path, train_state=got.train_state, weights=got.weights)
        changes = changes_since(got, json.loads(msgspec.json.encode(cfg)), resolved.config_hash)
        try:
            sampler.load_state_dict(got.train_state["sampler"])
        except DataError as exc:  # name the settings behind the data order's fingerprint
            if not changes:
                raise
            raise DataError(f"{exc}; changed since {got.path}: " + "; ".join(changes[:8])) from None
        if changes:
            log.warning("the config differs from the one checkpoint %s was trained with: %s", got.path,
                        "; ".join(changes[:8]) + (f"; and {len(changes) - 8} more" if len(changes) > 8 else ""))
        if runlog.console().is_terminal:
            runlog.console().rule(f"[bold yellow]RESUMING from step {got.step}: {got.path}")
        log.warning("RESUMING from step %d: %s", got.step, got.path)
        check_architecture(got.path, resolved.drafter)
    state.lineage = (got.lineage if got is not None else None) or new_lineage()
    if rank == 0:  # one lineage per checkpoints/ directory (dflash.checkpoint.resume)
        archived, moved = archive_foreign(run_dir / "checkpoints", got)
        if archived is not None:
            log.warning("moved %d checkpoint(s) this run does not continue (%s) to %s; delete that "
                        "directory when you no longer need them", len(moved), ", ".join(moved), archived)
    if got is None and resume != "none" and not found:
        log.info("no checkpoint to resume in %s; starting from step 0", run_dir / "checkpoints")
    metrics = MetricsLog(run_dir / "metrics.jsonl" if rank == 0 else run_dir / f"rank{rank}" / "metrics.jsonl")
    app = RunApp(resolved=resolved, run_dir=run_dir, sampler=sampler, metrics=metrics, resume=state)
    stats = sampler.epoch_stats(sampler.epoch)
    log.info("data: %d training conversations (%d more held out for dflash.eval: data.holdout), %s batching: "
             "padding waste %.1f%%, %d batches/epoch",
             len(train), cfg.data.holdout, cfg.data.strategy, 100 * stats.padding_waste, stats.num_batches)
    metrics.write(StartRecord(config_hash=resolved.config_hash, step=state.start_step, lineage=state.lineage,
                              data=dataset.summary.to_dict(), batching=msgspec.to_builtins(stats)))
    if got is not None:
        metrics.write(ResumeRecord(step=state.start_step, path=str(got.path),
                                   rejected=[{"path": str(p), "reason": r} for p, r in got.rejected],
                                   config_changes=changes))
    return app


def nothing_to_do(step: int, steps: int, path: Path | None, latest: bool) -> str:
    """The line a run whose checkpoint is already at (or past) ``run.steps`` logs: where it is and
    what to change (``latest``: the checkpoint was found by ``--resume auto``, not given)."""
    which = f"the latest checkpoint ({path})" if latest else f"the checkpoint {path}"
    where = f"already past run.steps = {steps}" if step > steps else f"run.steps = {steps}: the run is finished"
    return (f"nothing to do: {which} is at step {step}, {where}; to train further raise run.steps above "
            f"{step} (--set run.steps=N), or give --resume none to start over")


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # while reading the config and importing the stages (~2 s)
        print(INTERRUPTED_STARTING, file=sys.stderr)
        return 130
    finally:
        close_logging()


def _main(argv: list[str] | None) -> int:
    from dflash.data import DataError

    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the resume command in the summary
    try:
        cfg = load_config(args.graph, args.overrides)
    except ConfigError as exc:
        _error(exc)
        return 2
    import dflash.run.stages  # noqa: F401  (registers the dflash.* process kinds)

    if not cfg.run.out_dir.strip():
        _error("run.out_dir is empty; set it to a directory, e.g. runs/my-run")
        return 2
    try:  # the whole graph is checked before any data is read or anything is written
        graph = csp.Graph.from_spec(cfg)
        resolved, tok = load_resolved(cfg)  # cross-table checks: drafter vs target, devices, backends
    except (csp.GraphError, ConfigError, DataError) as exc:
        _error(exc)
        return 2
    for warning in resolved.warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    try:
        check_resume_path(args.resume or cfg.run.resume)  # before the data is tokenized
    except CheckpointError as exc:
        _error(exc)
        return 2
    run_dir = Path(cfg.run.out_dir)
    rank = int(os.environ.get("RANK", "0"))
    try:
        check_run_dir(cfg.run.out_dir)  # a file, read-only or over-long path: one line, before any data work
        lock = acquire_run_lock(run_dir) if rank == 0 else None
    except ConfigError as exc:
        _error(exc)
        return 2
    if rank == 0:
        for warning in disk_space_warnings(cfg.run.out_dir, resolved.drafter, cfg.checkpoint.keep_last):
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    try:
        return _train(resolved, tok, args, graph, run_dir, rank)
    finally:
        if lock is not None:
            lock.close()  # releases the flock


def _train(resolved: Resolved, tok: Any, args: argparse.Namespace, graph: csp.Graph, run_dir: Path,
           rank: int) -> int:
    from dflash.data import DataError

    cfg = resolved.cfg
    setup_logging(run_dir)
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.run.seed)
    try:
        app = prepare(resolved, args.resume or cfg.run.resume, tok)
    except (ConfigError, DataError, CheckpointError) as exc:
        _error(exc)
        return 2
    except KeyboardInterrupt:
        _error(interrupted_before_training(run_dir, args.resume or cfg.run.resume))
        return 130
    if rank == 0:
        try:
            (run_dir / "config.toml").write_bytes(to_toml(cfg))
        except OSError as exc:  # a full disk before any step: one line, not a traceback
            _error(f"cannot write {run_dir / 'config.toml'}: {exc.strerror or exc} (on {device_of(run_dir)})")
            app.metrics.close()
            return EXIT_DISK_FULL if exc.errno in (errno.ENOSPC, errno.EDQUOT) else 1
    if app.steps_to_run == 0:  # the previous segment's csp stats and trace stay where csp.inspect reads them
        log.info("%s", nothing_to_do(app.resume.start_step, cfg.run.steps, app.resume.path,
                                     (args.resume or cfg.run.resume) == "auto"))
        app.metrics.write(EndRecord(status="nothing to do", exit_code=0, seconds=0.0))
        app.metrics.close()
        if rank == 0:  # the short summary: where the checkpoint is and what to run next (no plot, no wandb)
            _summary(cfg, args, run_dir, "nothing to do", 0, None, None, None, plot=False, wandb_ran=False)
        return 0
    if rank == 0:
        keep_previous_observability(run_dir, app.resume.start_step)

    log.info("run %s: %d steps (%d..%d) -> %s", cfg.run.name, app.steps_to_run, app.resume.start_step + 1,
             cfg.run.steps, run_dir)
    t0 = time.time()
    status, code = "failed", 1
    if csp.dist.launched():  # torchrun: this rank runs its share of the graph (docs/distributed.md)
        result, runtime = csp.dist.run(graph, run_dir=run_dir, app=app)
        status, code = result.status, result.exit_code
        app.metrics.write(EndRecord(status=status, exit_code=code, rank=result.rank, seconds=time.time() - t0))
        app.metrics.close()
        if rank == 0:
            _summary(cfg, args, run_dir, status, code, None, result.error, time.time() - t0)
        if result.error is not None:
            print(f"rank {result.rank}: error: {result.error}", file=sys.stderr)
            csp.dist.hard_exit(code)
        return code
    runtime = csp.Runtime(graph, run_dir=run_dir, app=app)
    stopped_by, error = None, None
    try:
        result = runtime.run()
        status, code, stopped_by = result.status, result.exit_code, result.stopped_by
        if result.deadlock is not None:  # one line naming the cycle of waits
            # csp.run's deadlock code is 4; dflash.run's 4 is a full disk, so a deadlock is 5 here
            error, code = f"deadlock: {result.deadlock}", EXIT_DEADLOCK
            _error(error)
    except csp.ProcessFailed as exc:
        _error(exc)
        error = str(exc)
        if isinstance(exc.__cause__, DiskFullError):
            status, code = "disk full", EXIT_DISK_FULL
    except csp.ProcessStuck as exc:  # not a traceback: one line naming it, exit 3 (the stack is in run.log)
        status, code, error = "stuck", csp.runtime.EXIT_STUCK, f"{exc} to {run_dir / 'run.log'}"
        _error(error)
    finally:
        app.metrics.write(EndRecord(status=status, exit_code=code, seconds=time.time() - t0))
        app.metrics.close()
    _summary(cfg, args, run_dir, status, code, stopped_by, error, time.time() - t0)
    return code


def _summary(cfg: DFlashFile, args: argparse.Namespace, run_dir: Path, status: str, code: int,
             stopped_by: str | None, error: str | None, seconds: float | None, *, plot: bool | None = None,
             wandb_ran: bool | None = None) -> None:
    """The closing summary and the plot (dflash.observe.summary); never raises. The wandb commands are
    suggested only when this segment ran wandb (``[monitor].wandb`` not "disabled")."""
    from dflash.observe.summary import report_end

    report_end(run_dir, status=status, exit_code=code, total_steps=cfg.run.steps,
               argv=getattr(args, "argv", ()), seconds=seconds, stopped_by=stopped_by, error=error,
               data_source=cfg.data.source if isinstance(cfg.data.source, str) else None,
               plot=cfg.monitor.plot if plot is None else plot,
               wandb_ran=cfg.monitor.wandb != "disabled" if wandb_ran is None else wandb_ran, logger=log)

