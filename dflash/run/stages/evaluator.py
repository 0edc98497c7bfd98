"""``dflash.evaluator``: real draft-and-verify tau on held-out prompts while the drafter trains.

Fed weight snapshots by the drafter stage (its ``snapshots`` output, every ``[eval].every`` steps
and after the last), it loads each into its own drafter and decodes the run's first
``[eval].prompts`` held-out conversations (the ones ``python -m dflash.eval --data SOURCE`` would
decode) against its own copy of the target, then sends the measured tau to the monitor. It is off
the training path: the drafter drops a snapshot rather than wait while an evaluation runs
(:mod:`dflash.eval.config`), it skips snapshots while its evaluations exceed ``[eval].max_busy`` of
the run's time, and an evaluation holds the process's step lock shared, so it runs beside the
other stages (:mod:`dflash.run.step_gate`). With ``[eval].isolate = true`` the decode runs in a
child process of its own (:mod:`dflash.run.stages.heldout`), which shares no interpreter lock with
training.

It decodes with ``[eval].threads`` torch CPU threads of its own (default 1), set in its thread
(the training threads keep theirs; :func:`~dflash.run.stages.heldout.own_threads` says how) or in
the isolated child. While it decodes it logs progress lines (prompts done, tau so far, time left):
to run.log only while training runs, so the live view stays put, and to the terminal as well for
the final weights, whose evaluation comes after the last step's line.

A stop request (Ctrl-C, SIGTERM, an abort or a failure elsewhere) ends an evaluation within one
verify step, and no evaluation starts after it, the final weights' included: a stop must not wait
for a decode of minutes. The newest step left unevaluated is kept for the run's summary
(:class:`dflash.run.app.RunProgress`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TypedDict

import torch

import csp
from dflash.eval.decode import DecodeStopped
from dflash.messages import DrafterSnapshot, HeldoutTau
from dflash.observe.runlog import FILE_ONLY
from dflash.run.app import RunApp
from dflash.run.options import EvaluatorOptions
from dflash.run.step_gate import process_lock

__all__ = ["EvaluatorStage", "EvaluatorStageInputs", "EvaluatorStageOutputs"]

log = logging.getLogger("dflash.evaluator")


class EvaluatorStageInputs(TypedDict):
    snapshots: csp.Receiver[DrafterSnapshot]


class EvaluatorStageOutputs(TypedDict):
    metrics: csp.Sender[HeldoutTau]


@csp.register("dflash.evaluator")
class EvaluatorStage(csp.Process[EvaluatorStageInputs, EvaluatorStageOutputs]):
    """Input ``snapshots``: :class:`DrafterSnapshot`; output ``metrics``: one :class:`HeldoutTau`
    per evaluated snapshot (the monitor's input, beside the drafter's step metrics). Reads
    :class:`~dflash.run.options.EvaluatorOptions`."""

    def setup(self) -> None:
        from dflash.run.stages.heldout import HeldoutDecoder, HeldoutProcess, own_threads, threads_are_per_thread

        app: RunApp = self.ctx.app
        o: EvaluatorOptions = app.resolved.evaluator
        self.opts, self.worker = o, None
        if o.eval.every == 0:  # off: the drafter sends no snapshot, nothing to load
            return
        device = self.ctx.device or torch.device("cpu")
        if o.eval.isolate:  # the child sets its own count
            try:
                self.worker = HeldoutProcess(o, device, self.ctx.stopping)
            except DecodeStopped:  # stopped while the child started: run() evaluates nothing
                log.info("evaluator: the run stopped while the evaluator's process started")
            return
        threads = own_threads(o.eval.threads)  # this thread's count; the training threads keep theirs
        if o.eval.threads and threads != o.eval.threads and not threads_are_per_thread():
            log.warning("evaluator: eval.threads = %d not applied: this torch's CPU backend is not OpenMP, whose "
                        "thread counts are per thread, so the count is the whole process's; set eval.isolate = "
                        "true to decode in a process of its own with that count", o.eval.threads)
        elif o.eval.threads == 0:
            log.info("evaluator: decoding in the training process with torch's default of %d CPU thread(s) "
                     "(eval.threads = 0)", threads)
        else:
            log.info("evaluator: decoding in the training process with %d torch CPU thread(s) of its own "
                     "(eval.threads)", threads)
        self.worker = HeldoutDecoder(o, device)

    def evaluate(self, snap: DrafterSnapshot) -> HeldoutTau:
        """Measured tau of ``snap``'s weights on the held-out prompts.

        Raises:
            DecodeStopped: the run is stopping; the evaluation ended unfinished.
        """
        say, stopping = _say(snap.final), self.ctx.stopping
        with self.ctx.span("evaluator.decode"):
            if self.opts.eval.isolate:
                return self.worker.evaluate(snap.step, snap.weights, snap.dropped, say=say, should_stop=stopping)
            return self.worker.evaluate(snap.step, snap.weights, snap.dropped, lock=process_lock().shared(),
                                        say=say, should_stop=stopping)

    def teardown(self) -> None:
        close = getattr(getattr(self, "worker", None), "close", None)
        if close is not None:  # the child process, when eval.isolate
            close()

    def run(self, inputs: EvaluatorStageInputs, outputs: EvaluatorStageOutputs) -> None:
        out = outputs["metrics"]
        cap = self.opts.eval.max_busy
        start, busy, skipped = time.perf_counter(), 0.0, 0
        progress = self.ctx.app.progress
        for snap in inputs["snapshots"]:
            if self.ctx.stopping():  # the run is stopping: start no evaluation (it takes seconds to minutes)
                progress.unevaluated = snap.step
                continue
            # over its share of the run's time ([eval].max_busy): skip, unless these are the final weights
            if not snap.final and busy > cap * (time.perf_counter() - start):
                skipped += 1 + snap.dropped
                continue
            try:
                item = self.evaluate(snap)
            except DecodeStopped:
                log.info("evaluator: the run is stopping; the evaluation of step %d ends unfinished", snap.step)
                progress.unevaluated = snap.step
                continue
            item.skipped += skipped
            busy, skipped = busy + item.seconds, 0
            if math.isfinite(item.tau) and (progress.best is None or item.tau > progress.best[1]):
                progress.best = (item.step, item.tau)   # [checkpoint].keep_best keeps its checkpoint
            del snap  # the weights' memory goes before the next snapshot arrives
            out.send(item)


def _say(final: bool) -> Callable[[str], None]:
    """Where an evaluation's progress lines go: run.log while training runs (the live view stays as
    it is), the terminal too for the final weights (nothing else moves after the last step)."""
    if final:
        return log.info
    return lambda line: log.info(line, extra=FILE_ONLY)
