"""``dflash.target``: one frozen target replica per device; hidden states of the captured layers."""

from __future__ import annotations

import time
from typing import TypedDict

import torch

import csp
from dflash.messages import Batch, TargetOutput
from dflash.model.target import load_target
from dflash.run.app import RunApp
from dflash.run.options import TargetStageOptions
from dflash.run.step_gate import StepGate
from dflash.train.sentinel import FiniteSentinel


class TargetStageInputs(TypedDict):
    batches: csp.Receiver[Batch]


class TargetStageOutputs(TypedDict):
    hidden: csp.Sender[TargetOutput]


@csp.register("dflash.target")
class TargetStage(csp.Process[TargetStageInputs, TargetStageOutputs]):
    """Runs the frozen target over each batch and sends its hidden states.

    Input ``batches``: :class:`Batch` (host memory, pinned on GPU runs). Output ``hidden``:
    :class:`TargetOutput` with ``layer_hidden [B, T, k*H]`` and, only when the loss needs target
    logits, ``final_hidden [B, T, H]``, both on this replica's device in the target dtype.
    The output channel is normally ``ordered``: the item is sent with ``seq = batch.seq`` so the
    fan-in restores the batch order whatever replica finishes first. Reads :class:`~dflash.run.options.TargetStageOptions`.
    """

    def setup(self) -> None:
        self.app: RunApp = self.ctx.app
        o: TargetStageOptions = self.app.resolved.target
        self.device = self.ctx.device or torch.device("cpu")
        self.need_final = o.need_final
        self.target = load_target(o.target, self.device, num_draft_layers=o.num_draft_layers, need_final=o.need_final)
        self.sentinel = FiniteSentinel(self.ctx.qualname, enabled=o.check_channels)
        self.features = o.features  # the noise, when postprocess_side = "target"
        self.gate = StepGate(name=self.ctx.qualname)  # a batch of a new shape may compile: it runs alone (dflash.run.step_gate)

    def forward(self, batch: Batch) -> TargetOutput:
        """The target's hidden states for one batch (moved to this replica's device)."""
        t0 = time.perf_counter()
        with self.ctx.span("target.forward"):
            b = batch.to(self.device, non_blocking=True)

            def step():  # no state changes: safe to run again (dflash.run.step_gate)
                with torch.no_grad():
                    return self.target.forward(b.input_ids, b.position_ids, b.doc_ids, need_final=self.need_final)

            layer_hidden, final_hidden = self.gate.run(tuple(batch.input_ids.shape), step)
            layer_hidden = self.features.at_target(layer_hidden, b.batch_id)
        return TargetOutput(
            batch=b,
            layer_hidden=layer_hidden,
            final_hidden=final_hidden,
            replica=self.ctx.replica,
            target_s=time.perf_counter() - t0,
        )

    def run(self, inputs: TargetStageInputs, outputs: TargetStageOutputs) -> None:
        out = outputs["hidden"]
        for batch in inputs["batches"]:
            item = self.forward(batch)
            self.sentinel.check(item, batch_id=batch.batch_id, channel="hidden", step=self.app.step_of(batch.seq))
            out.send(item, seq=batch.seq)
        self.sentinel.flush()
