"""``dflash.evaluator``: real draft-and-verify tau on held-out prompts while the drafter trains.

Fed weight snapshots by the drafter stage (its ``snapshots`` output, every ``[eval].every`` steps
and after the last), it loads each into its own drafter and decodes the run's first
``[eval].prompts`` held-out conversations (the ones ``python -m dflash.eval --data SOURCE`` would
decode) against its own copy of the target, then sends the measured tau to the monitor. It is off
the training path: the drafter drops a snapshot rather than wait while an evaluation runs
(:mod:`dflash.eval.config`), it skips snapshots while its evaluations exceed ``[eval].max_busy`` of
the run's time, and an evaluation holds the process's step lock shared, so it runs beside the
other stages (:mod:`dflash.run.step_gate`).
"""

from __future__ import annotations

import logging
import time

import msgspec
import torch

import csp
from dflash.data.config import DataError
from dflash.messages import DrafterSnapshot, HeldoutTau
from dflash.run.app import RunApp
from dflash.run.options import EvaluatorOptions
from dflash.run.step_gate import process_lock

__all__ = ["EvaluatorStage"]

log = logging.getLogger("dflash.evaluator")


@csp.register("dflash.evaluator")
class EvaluatorStage(csp.Process):
    """Input ``snapshots``: :class:`DrafterSnapshot`; output ``metrics``: one :class:`HeldoutTau`
    per evaluated snapshot (the monitor's input, beside the drafter's step metrics). Reads
    :class:`~dflash.run.options.EvaluatorOptions`."""

    inputs = {"snapshots": DrafterSnapshot}
    outputs = {"metrics": HeldoutTau}

    def setup(self) -> None:
        from dflash.data.prompts import heldout_prompts
        from dflash.data.tokenizer import load_tokenizer
        from dflash.model.drafter import DFlashDrafter
        from dflash.model.target import for_generation, load_target

        app: RunApp = self.ctx.app
        o: EvaluatorOptions = app.resolved.evaluator
        self.opts = o
        if o.eval.every == 0:  # off: the drafter sends no snapshot, nothing to load
            return
        self.device = self.ctx.device or torch.device("cpu")
        self.target = load_target(for_generation(o.target), self.device, o.drafter.num_layers, need_final=True)
        self.head = self.target.shared_head()
        # decodes with sdpa in the target's dtype whatever training uses (flex, float8): the same
        # outputs, no compile per length
        cfg = msgspec.structs.replace(o.drafter, attn_implementation="sdpa", compile=False, precision="bf16")
        self.drafter = DFlashDrafter(cfg, seed=0).to(self.device, self.target.model.dtype).eval()
        tok = load_tokenizer(o.target.tokenizer_source)
        ids = heldout_prompts(o.data, tok, o.eval.prompts, o.eval.max_prompt_tokens)
        if not ids:
            raise DataError("[eval]: the run's held-out conversations hold no usable prompt (each opens with an "
                            "assistant turn); set eval.every = 0 or hold out more (data.holdout)")
        if len(ids) < o.eval.prompts:
            log.warning("[eval] decodes the %d usable held-out prompts (eval.prompts = %d)", len(ids), o.eval.prompts)
        self.prompts = [torch.tensor(x, device=self.device) for x in ids]

    def evaluate(self, snap: DrafterSnapshot) -> HeldoutTau:
        """Measured tau of ``snap``'s weights on the held-out prompts."""
        from dflash.eval.measure import decode_tau

        e = self.opts.eval
        t0 = time.perf_counter()
        with self.ctx.span("evaluator.decode"), process_lock().shared(), torch.no_grad():
            self.drafter.load_state_dict(snap.weights)
            got = decode_tau(self.target, self.drafter, self.head, self.prompts, e.max_new_tokens,
                             temperature=e.temperature, seed=e.seed)
        return HeldoutTau(step=snap.step, tau=got.tau, accepted=got.accepted, sampled_tau=got.sampled_tau,
                          prompts=len(self.prompts), new_tokens=got.new_tokens, steps=got.steps,
                          seconds=time.perf_counter() - t0, skipped=snap.dropped, time=time.time())

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
