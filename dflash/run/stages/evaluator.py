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
"""

from __future__ import annotations

import time

import torch

import csp
from dflash.messages import DrafterSnapshot, HeldoutTau
from dflash.run.app import RunApp
from dflash.run.options import EvaluatorOptions
from dflash.run.step_gate import process_lock

__all__ = ["EvaluatorStage"]


@csp.register("dflash.evaluator")
class EvaluatorStage(csp.Process):
    """Input ``snapshots``: :class:`DrafterSnapshot`; output ``metrics``: one :class:`HeldoutTau`
    per evaluated snapshot (the monitor's input, beside the drafter's step metrics). Reads
    :class:`~dflash.run.options.EvaluatorOptions`."""

    inputs = {"snapshots": DrafterSnapshot}
    outputs = {"metrics": HeldoutTau}

    def setup(self) -> None:
        from dflash.run.stages.heldout import HeldoutDecoder, HeldoutProcess

        app: RunApp = self.ctx.app
        o: EvaluatorOptions = app.resolved.evaluator
        self.opts, self.worker = o, None
        if o.eval.every == 0:  # off: the drafter sends no snapshot, nothing to load
            return
        device = self.ctx.device or torch.device("cpu")
        self.worker = HeldoutProcess(o, device) if o.eval.isolate else HeldoutDecoder(o, device)

    def evaluate(self, snap: DrafterSnapshot) -> HeldoutTau:
        """Measured tau of ``snap``'s weights on the held-out prompts."""
        with self.ctx.span("evaluator.decode"):
            if self.opts.eval.isolate:
                return self.worker.evaluate(snap.step, snap.weights, snap.dropped)
            return self.worker.evaluate(snap.step, snap.weights, snap.dropped, lock=process_lock().shared())

    def teardown(self) -> None:
        close = getattr(getattr(self, "worker", None), "close", None)
        if close is not None:  # the child process, when eval.isolate
            close()

    def run(self, inputs, outputs) -> None:
        out = outputs["metrics"]
        cap = self.opts.eval.max_busy
        start, busy, skipped = time.perf_counter(), 0.0, 0
        for snap in inputs["snapshots"]:
            # over its share of the run's time ([eval].max_busy): skip, unless these are the final weights
            if not snap.final and busy > cap * (time.perf_counter() - start):
                skipped += 1 + snap.dropped
                continue
            item = self.evaluate(snap)
            item.skipped += skipped
            busy, skipped = busy + item.seconds, 0
            del snap  # the weights' memory goes before the next snapshot arrives
            out.send(item)
