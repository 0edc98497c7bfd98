"""Progress of an evaluation while it runs, for a person waiting on it.

:func:`dflash.eval.measure.evaluate` and :func:`~dflash.eval.measure.decode_tau` stay quiet: they
call an optional ``progress`` callback with an :class:`EvalProgress` at each stage and after each
prompt. :class:`ProgressLines` turns those reports into plain lines (no carriage returns, no
colour: they read the same in a terminal, a redirected file and ``run.log``) at a rate a person can
follow: the first prompt, then at most one line every ``every_s`` seconds, and the last prompt.
``python -m dflash.eval`` writes them to stderr (``--quiet`` drops them; ``--json`` keeps stdout to
the result); the in-training evaluator writes them to the run's log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["EvalProgress", "ProgressLines", "clock_text"]

Stage = Literal["warmup", "decode", "sampled", "tree", "done"]


@dataclass(frozen=True)
class EvalProgress:
    """One report of a running evaluation.

    Attributes:
        stage: ``"warmup"``: the untimed warm-up decodes before the speed baseline (the target
            alone, timed beside every decode) start; ``"decode"``: prompt ``done`` finished all its
            decodes (greedy draft-and-verify, the target alone when timed, the sampled decode) and
            their teacher-forced scoring;
            ``"sampled"``: :func:`~dflash.eval.measure.decode_tau`'s sampled pass finished prompt
            ``done``; ``"tree"``: its tree-verified pass finished prompt ``done``; ``"done"``.
        done: prompts finished in this stage (0 for ``warmup``).
        total: prompts in all.
        decodes: decodes finished so far (a prompt's later turns count one each).
        new_tokens: tokens generated so far by the greedy decodes.
        steps: verify steps so far (greedy).
        tau: measured tokens per verify step so far (greedy, pooled over ``steps``); None before
            the first decode.
        elapsed: seconds since the evaluation began (wall clock).
    """

    stage: Stage
    done: int
    total: int
    decodes: int = 0
    new_tokens: int = 0
    steps: int = 0
    tau: float | None = None
    elapsed: float = 0.0

    @classmethod
    def at(cls, stage: Stage, done: int, total: int, t_start: float, decodes: int, tokens: int,
           accepted: list[int]) -> EvalProgress:
        """The report of ``stage`` at this moment: ``accepted`` the accepted drafts of every greedy
        verify step so far, ``t_start`` the ``time.perf_counter()`` the evaluation began at."""
        from dflash.train.acceptance import tau_from_accepted

        return cls(stage, done, total, decodes=decodes, new_tokens=tokens, steps=len(accepted),
                   tau=tau_from_accepted(sum(accepted) / len(accepted)) if accepted else None,
                   elapsed=time.perf_counter() - t_start)


def clock_text(seconds: float) -> str:
    """``seconds`` as ``m:ss`` (``h:mm:ss`` from an hour)."""
    s = max(int(round(seconds)), 0)
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class ProgressLines:
    """An ``EvalProgress`` callback that writes plain progress lines through ``write``.

    A stage change is always said; in a decode stage the first prompt, the last, and in between at
    most one line per ``every_s`` seconds, each with prompts done of the total, the tau so far, the
    time elapsed and an estimate of the time left (elapsed / done x remaining prompts).

    Args:
        write: called with each line (e.g. a print to stderr, or a logger).
        prefix: put before every line (``"dflash.eval: "``).
        every_s: seconds between decode lines, at least.
        done_line: say the ``"done"`` stage (off where the caller prints the result itself).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, write: Callable[[str], None], *, prefix: str = "", every_s: float = 10.0,
                 done_line: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.write, self.prefix, self.every_s, self.clock = write, prefix, every_s, clock
        self.done_line = done_line
        self._last: float | None = None
        self._stage: str | None = None

    def __call__(self, p: EvalProgress) -> None:
        now = self.clock()
        if p.stage in ("decode", "sampled", "tree"):
            due = (self._stage != p.stage or p.done in (1, p.total)
                   or self._last is None or now - self._last >= self.every_s)
            self._stage = p.stage
            if due:
                self._last = now
                self.write(self.prefix + self.decode_line(p))
            return
        self._stage, self._last = p.stage, now
        if p.stage != "done" or self.done_line:
            self.write(self.prefix + self.stage_line(p))

    @staticmethod
    def decode_line(p: EvalProgress) -> str:
        """``3/8 prompts (5 decodes) | tau 1.231 so far | 0:42 elapsed, ~1:10 left``."""
        what = {"decode": "prompts", "sampled": "prompts sampled", "tree": "prompts tree-verified"}[p.stage]
        turns = f" ({p.decodes} decodes)" if p.stage == "decode" and p.decodes != p.done else ""
        tau = f" | tau {p.tau:.3f} so far" if p.tau is not None and p.stage == "decode" else ""
        left = p.elapsed / p.done * (p.total - p.done) if p.done else None
        eta = f", ~{clock_text(left)} left" if left is not None and p.done < p.total else ""
        return f"{p.done}/{p.total} {what}{turns}{tau} | {clock_text(p.elapsed)} elapsed{eta}"

    @staticmethod
    def stage_line(p: EvalProgress) -> str:
        """The line of a stage change."""
        if p.stage == "warmup":
            return ("speed baseline: one untimed warm-up decode of each kind, then the target alone is "
                    "timed beside every decode")
        tau = f": tau {p.tau:.3f}" if p.tau is not None else ""
        over = f"{p.done} of {p.total} prompts (stopped early)" if p.done < p.total else f"{p.total} prompts"
        return f"done{tau} over {over}, {p.new_tokens} tokens, in {clock_text(p.elapsed)}"
