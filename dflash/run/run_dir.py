"""The run directory as one run holds it: its lock, the earlier segments' csp observability kept
aside, and the lines that say what it holds when a run ends before training.

Two runs must never share a run directory (their checkpoints and metrics would interleave), so
``python -m dflash.run`` takes :func:`acquire_run_lock` before it writes anything there.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import IO

from dflash.errors import ConfigError
from dflash.observe.summary import last_healthy

__all__ = ["acquire_run_lock", "interrupted_before_training", "keep_previous_observability", "nothing_to_do"]

log = logging.getLogger("dflash.run")


def acquire_run_lock(run_dir: Path) -> IO[str]:
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


def nothing_to_do(step: int, steps: int, path: Path | None, latest: bool) -> str:
    """The line a run whose checkpoint is already at (or past) ``run.steps`` logs: where it is and
    what to change (``latest``: the checkpoint was found by ``--resume auto``, not given)."""
    which = f"the latest checkpoint ({path})" if latest else f"the checkpoint {path}"
    where = f"already past run.steps = {steps}" if step > steps else f"run.steps = {steps}: the run is finished"
    return (f"nothing to do: {which} is at step {step}, {where}; to train further raise run.steps above "
            f"{step} (--set run.steps=N), or give --resume none to start over")
