"""One step of a recipe: a command run with its output in a log file and, where asked, a wall-clock
cap after which it is sent a stop signal (and, after a grace period, killed).

A capped step reports its exit status as coreutils ``timeout`` does, so the numbers in the recipes'
logs and JSON keep their meaning: 124 when the cap was reached (whatever the command itself
returned after the signal), 137 when it had to be killed after the grace period. The stop signal
goes to the command's own process only (``timeout --foreground``): ``dflash.run`` stops gracefully
on one SIGTERM and writes a final checkpoint, and a second signal to its whole process group would
abort it without one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

CAPPED = 124  # exit status of a step stopped at its cap, as coreutils timeout reports it
KILLED = 137  # exit status of a step killed after its grace period (128 + SIGKILL)


def python(*args: object) -> list[str]:
    """The argv of this interpreter running ``args`` (``python(-m, dflash.run, G)``)."""
    return [sys.executable, *map(str, args)]


class Step:
    """A started command. ``wait()`` returns its exit status (see the module docstring).

    Args:
        argv: the command.
        log: its standard output (and standard error, unless ``err`` is given); None: the recipe's own.
        err: where its standard error goes, when apart from ``log``.
        cap_s: seconds from the start after which ``stop`` is sent; None or <= 0: no cap.
        stop: the stop signal (SIGTERM for dflash.run, SIGINT for dflash.regenerate and speculators).
        grace_s: seconds after the stop signal before SIGKILL; None: wait as long as it takes.
        env: variables added to this process's environment for the command.
    """

    def __init__(self, argv: Sequence[object], log: Path | None, *, err: Path | None = None, cap_s: float | None = None,
                 stop: signal.Signals = signal.SIGTERM, grace_s: float | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.argv = [str(a) for a in argv]
        self.started = time.monotonic()
        self.capped = self.killed = False
        sys.stdout.flush()  # what the recipe printed comes before what the command prints
        sys.stderr.flush()
        files = [open(p, "wb") for p in (log, err) if p is not None]
        try:
            out = files[0] if log is not None else None
            error = files[-1] if err is not None else (subprocess.STDOUT if out is not None else None)
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=error,
                                         env={**os.environ, **(env or {})})
        finally:
            for f in files:
                f.close()
        self._timers: list[threading.Timer] = []
        if cap_s is not None and cap_s > 0:
            self._after(cap_s, self._stop, stop, grace_s)

    def _after(self, seconds: float, fn, *args) -> None:
        timer = threading.Timer(seconds, fn, args)
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def _stop(self, sig: signal.Signals, grace_s: float | None) -> None:
        if self.proc.poll() is None:
            self.capped = True
            self.proc.send_signal(sig)
            if grace_s is not None:
                self._after(grace_s, self._kill)

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.killed = True
            self.proc.kill()

    def wait(self) -> int:
        """The exit status, once the command has ended: 124 if the cap stopped it, 137 if killed."""
        rc = self.proc.wait()
        for timer in self._timers:
            timer.cancel()
        return KILLED if self.killed else CAPPED if self.capped else rc

    @property
    def seconds(self) -> float:
        """Seconds since the command started."""
        return time.monotonic() - self.started


def run(argv: Sequence[object], log: Path | None, **kwargs) -> int:
    """Run ``argv`` to its end (see :class:`Step` for the arguments); its exit status."""
    return Step(argv, log, **kwargs).wait()


def wait_all(steps: Sequence[Step]) -> list[int]:
    """Wait for steps started side by side; their exit statuses in order."""
    return [s.wait() for s in steps]


def tail(path: Path, n: int = 3, *, drop: str | None = None) -> str:
    """The last ``n`` lines of a log, leaving out lines that match the regular expression ``drop``
    (``"^step"``: dflash.run's per-step lines; ``"%"``: progress bars); "" for a missing file."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join([line for line in lines if drop is None or not re.search(drop, line)][-n:])


class Clock:
    """Whole seconds since the recipe started (its progress lines say ``in N s``)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self) -> int:
        return int(time.monotonic() - self.t0)
