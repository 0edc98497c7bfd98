"""How a run ended: :class:`RunResult`, the exit codes and the status a run's end gets.

The ways a run stops and what each code means are documented in :mod:`csp.runtime.engine` (its
module doc), which re-exports these names; they live here so that the engine holds the run itself
and this small table of outcomes can be read, and imported, on its own.
"""

from __future__ import annotations

import msgspec

EXIT_OK, EXIT_FAILED, EXIT_BAD_GRAPH, EXIT_STUCK, EXIT_DEADLOCK, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


class RunResult(msgspec.Struct, frozen=True, kw_only=True):
    """How a run ended: ``status`` ("completed" | "stopped" | "failed" | "aborted" |
    "deadlocked"), ``exit_code`` (see :mod:`csp.runtime.engine`'s module doc), ``duration_s``
    (wall seconds of ``run()``), ``stopped_by``: what stopped or aborted it ("SIGINT", "SIGTERM",
    "request_stop", "abort", "deadlock"; for an abort by a second signal, the second signal), None
    when it completed; and ``deadlock``: the cycle of waits of a deadlocked run (one line,
    :func:`csp.runtime.deadlock.explain`)."""

    status: str
    exit_code: int
    duration_s: float
    stopped_by: str | None = None
    deadlock: str | None = None


def outcome(*, failed: bool, deadlocked: bool, aborted: bool, stopped: bool) -> tuple[str, int]:
    """The status and csp's exit code of a run that ended so; the first that holds wins (a failure
    over a deadlock over an abort over a graceful stop), and none of them is "completed"."""
    if failed:
        return "failed", EXIT_FAILED
    if deadlocked:
        return "deadlocked", EXIT_DEADLOCK
    if aborted:
        return "aborted", EXIT_INTERRUPTED
    if stopped:
        return "stopped", EXIT_INTERRUPTED
    return "completed", EXIT_OK


__all__ = ["EXIT_BAD_GRAPH", "EXIT_DEADLOCK", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_STUCK",
           "RunResult", "outcome"]
