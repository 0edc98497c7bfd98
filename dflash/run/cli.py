"""``python -m dflash.run GRAPH.toml [--set section.key=value ...] [--resume auto|PATH|none]``

A run, top to bottom, in one pass (each step in its own module; no step returns to one it left):

1. load: read the graph file, apply ``--set``, decode every table (:func:`dflash.run.config.load_config`);
2. resolve: read the target's config and tokenizer, fill the file, resolve the drafter, build
   each stage's options (:func:`dflash.run.resolve.load_and_resolve`);
3. validate: every rule of the resolved run, once (:func:`dflash.run.validate.validate`);
4. build the csp graph (:meth:`csp.Graph.from_spec`);
5. take the run lock (:mod:`dflash.run.run_dir`), prepare the data, the sampler and the resume
   state (:func:`dflash.run.prepare.prepare`), run the graph, and close everything on every path.

Steps 1-4 read no data and write nothing: a mistake there is one line and exit 2.

Exit codes (``--help`` lists them; :data:`dflash.run.args.EXIT_CODES`):
    0    training finished (``[run].steps`` reached)
    1    a stage failed (the error names it: ``target[1]``, ``drafter[0]`` ...), or a checkpoint or
         data problem was found at run time
    2    bad graph file, config or data (nothing started)
    3    a stage did not stop within 10 s of an abort (one line names it)
    4    disk full: a checkpoint could not be written (one line names the device; the partial save is
         removed, the last good checkpoint intact; :class:`dflash.errors.DiskFullError`)
    5    deadlocked: nothing moved for ``[runtime].deadlock_timeout_s``
    130  stopped by Ctrl-C or SIGTERM: the graph drained and a final checkpoint was written

However it ends, a closing summary (:mod:`dflash.observe.summary`) says what was done and saved and what to
run next, and the curves are plotted to ``RUN_DIR/plot.png`` (:mod:`dflash.plot`) when matplotlib
is importable. Output: :mod:`dflash.observe.runlog`.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import csp
import csp.distributed
from dflash.checkpoint import CheckpointError
from dflash.checkpoint.files import device_of
from dflash.errors import ConfigError, DiskFullError
from dflash.observe import runlog
from dflash.records import EndRecord
from dflash.run.args import INTERRUPTED_STARTING, build_parser
from dflash.run.config import DFlashFile, load_config, to_toml
from dflash.run.memory import estimate, estimate_line, memory_fields
from dflash.run.out_of_memory import out_of_memory_advice
from dflash.run.prepare import prepare
from dflash.run.resolve import Resolved, load_and_resolve, target_hf_config
from dflash.run.run_dir import (
    acquire_run_lock,
    interrupted_before_training,
    keep_previous_observability,
    nothing_to_do,
)
from dflash.run.validate import stage_devices, validate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("dflash.run")

EXIT_DISK_FULL = 4
"""A checkpoint could not be written for lack of space (:class:`dflash.errors.DiskFullError`)."""
EXIT_DEADLOCK = 5
"""Every stage waited on a channel and nothing moved for ``[runtime].deadlock_timeout_s``; csp.run
itself uses 4 for it, which dflash.run gives to a full disk."""


def exit_code_of(status: str, error: BaseException | None) -> int | None:
    """dflash.run's exit code where it differs from csp's, handed to the runtime so that the stats
    log's final line (``csp.inspect``) and the process's exit code agree: a full disk 4, a deadlock 5."""
    if status == "deadlocked":
        return EXIT_DEADLOCK
    if status == "failed" and isinstance(error, DiskFullError):
        return EXIT_DISK_FULL
    return None


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
    rank = int(os.environ.get("RANK", "0"))
    try:  # load -> resolve -> validate -> build: no data read, nothing written
        cfg = load_config(args.graph, args.overrides)
        resume = args.resume or cfg.run.resume
        resolved, tok = load_and_resolve(cfg)
        warnings = validate(resolved, launched=csp.distributed.launched(), resume=resume)
        import dflash.run.stages  # noqa: F401  (registers the dflash.* process kinds)

        graph = csp.Graph.from_spec(resolved.cfg)
    except (csp.GraphError, ConfigError, DataError, CheckpointError) as exc:
        _error(exc)
        return 2
    if rank == 0:
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    run_dir = Path(resolved.cfg.run.out_dir)
    try:
        lock = acquire_run_lock(run_dir) if rank == 0 else None
    except ConfigError as exc:
        _error(exc)
        return 2
    try:
        return _train(resolved, tok, args, resume, graph, run_dir, rank)
    finally:
        if lock is not None:
            lock.close()  # releases the flock


def _train(resolved: Resolved, tok: PreTrainedTokenizerBase, args: argparse.Namespace, resume: str, graph: csp.Graph,
           run_dir: Path, rank: int) -> int:
    from dflash.data import DataError

    cfg = resolved.cfg
    setup_logging(run_dir)
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.run.seed)
    try:
        app = prepare(resolved, resume, tok)
    except (ConfigError, DataError, CheckpointError) as exc:
        _error(exc)
        return 2
    except KeyboardInterrupt:
        _error(interrupted_before_training(run_dir, resume))
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
                                     resume == "auto"))
        app.metrics.write(EndRecord(status="nothing to do", exit_code=0, seconds=0.0, step=app.last_step))
        app.metrics.close()
        if rank == 0:  # the short summary: where the checkpoint is and what to run next (no plot, no wandb)
            _summary(cfg, args, run_dir, "nothing to do", 0, None, None, None, plot=False, wandb_ran=False)
        return 0
    if rank == 0:
        keep_previous_observability(run_dir, app.resume.start_step)

    log.info("run %s: %d steps (%d..%d) -> %s", cfg.run.name, app.steps_to_run, app.resume.start_step + 1,
             cfg.run.steps, run_dir)
    memory = estimate(cfg, resolved.drafter, target_hf_config(cfg.target), stage_devices(cfg))
    if memory:
        log.info("GPU memory estimated: %s (docs/gpus.md)", estimate_line(memory))
    t0 = time.time()
    status, code = "failed", 1
    if csp.distributed.launched():  # torchrun: this rank runs its share of the graph (docs/distributed.md)
        result, runtime = csp.distributed.run(graph, run_dir=run_dir, app=app, exit_code_of=exit_code_of)
        status, code = result.status, result.exit_code
        app.metrics.write(EndRecord(status=status, exit_code=code, rank=result.rank, seconds=time.time() - t0,
                                    step=app.last_step, unevaluated=app.progress.unevaluated,
                                    **memory_fields(memory)))
        app.metrics.close()
        if rank == 0:
            _summary(cfg, args, run_dir, status, code, None, result.error, time.time() - t0)
        if result.error is not None:
            print(f"rank {result.rank}: error: {result.error}", file=sys.stderr)
            csp.distributed.hard_exit(code)
        return code
    runtime = csp.Runtime(graph, run_dir=run_dir, app=app, exit_code_of=exit_code_of)
    stopped_by, error = None, None
    try:
        result = runtime.run()
        status, code, stopped_by = result.status, result.exit_code, result.stopped_by
        if result.deadlock is not None:  # one line naming the cycle of waits (exit 5: exit_code_of)
            error = f"deadlock: {result.deadlock}"
            _error(error)
    except csp.ProcessFailed as exc:
        _error(exc)
        error = str(exc)
        if (advice := out_of_memory_advice(exc, cfg)) is not None:
            _error(advice)
            error = f"{error}; {advice}"
        if isinstance(exc.__cause__, DiskFullError):
            status, code = "disk full", EXIT_DISK_FULL
    except csp.ProcessStuck as exc:  # not a traceback: one line naming it, exit 3 (the stack is in run.log)
        status, code, error = "stuck", csp.runtime.engine.EXIT_STUCK, f"{exc} to {run_dir / 'run.log'}"
        _error(error)
    finally:
        app.metrics.write(EndRecord(status=status, exit_code=code, seconds=time.time() - t0, step=app.last_step,
                                    unevaluated=app.progress.unevaluated, **memory_fields(memory)))
        app.metrics.close()
    budget = app.budget_end
    if budget is not None and app.budget_end_at is not None:  # what the budget does not cover
        budget += f"; {time.perf_counter() - app.budget_end_at:.1f} s from the budget's end to the run's end"
    _summary(cfg, args, run_dir, status, code, stopped_by, error, time.time() - t0, budget=budget)
    return code


def _summary(cfg: DFlashFile, args: argparse.Namespace, run_dir: Path, status: str, code: int,
             stopped_by: str | None, error: str | None, seconds: float | None, *, plot: bool | None = None,
             wandb_ran: bool | None = None, budget: str | None = None) -> None:
    """The closing summary and the plot (dflash.observe.summary); never raises. The wandb commands are
    suggested only when this segment ran wandb (``[monitor].wandb`` not "disabled"); ``budget`` is
    how ``[run].time_budget_s`` ended the run, if it did."""
    from dflash.observe.summary import report_end

    report_end(run_dir, status=status, exit_code=code, total_steps=cfg.run.steps,
               argv=getattr(args, "argv", ()), seconds=seconds, stopped_by=stopped_by, error=error,
               data_source=cfg.data.source if isinstance(cfg.data.source, str) else None,
               plot=cfg.monitor.plot if plot is None else plot,
               wandb_ran=cfg.monitor.wandb != "disabled" if wandb_ran is None else wandb_ran, logger=log,
               budget=budget)

