"""``dflash.monitor``: step-indexed metrics to metrics.jsonl, wandb and the live display."""

from __future__ import annotations

import logging
import time
from typing import TypedDict

import msgspec

import csp
from dflash.messages import HeldoutTau, StepMetrics
from dflash.observe.metrics_writer import WandbSink, WindowAggregator
from dflash.observe.spikes import spike_threshold
from dflash.records import HeldoutRecord, SkipRecord, TrainRecord
from dflash.run.app import RunApp

log = logging.getLogger("dflash.monitor")


class MonitorStageInputs(TypedDict):
    metrics: csp.Receiver[StepMetrics | HeldoutTau]


@csp.register("dflash.monitor")
class MonitorStage(csp.Process[MonitorStageInputs, csp.NoPorts]):
    """Sink stage. Input ``metrics``: :class:`StepMetrics`, one per drafter step, and, where the
    graph has an in-training evaluator, its :class:`HeldoutTau` results (a ``heldout`` record each,
    wandb ``heldout/*`` at the snapshot's step, a line in the log).

    Writes a ``train`` record per fixed window of ``[monitor].window`` steps and a ``skip`` record
    per skipped step (step, batch id, the target replica that produced the batch, reason) to
    ``RUN_DIR/metrics.jsonl``, logs the same windows to wandb (offline unless configured), and
    refreshes the live display (rich on a terminal, plain lines otherwise) with
    throughput, loss, accepted length, progress/ETA and channel fills. A window whose loss is a spike by
    :func:`dflash.observe.spikes.spike_threshold` (median + ``[monitor].spike_k`` MADs of the previous windows)
    is flagged in the record and the log. Reads :class:`~dflash.run.options.MonitorOptions`, the app's metrics
    writer, run directory and resume state.
    """

    def setup(self) -> None:
        from dflash.observe.display import make_display

        app: RunApp = self.ctx.app
        self.app, o = app, app.resolved.monitor
        self.spike_k = o.spike_k
        # A resumed run counts on from the checkpoint's skipped_total, as the drafter does.
        skipped = int((app.resume.train_state or {}).get("skipped_total", 0))
        self.windows = WindowAggregator(o.window, start_time=time.time(), skipped_total=skipped)
        self.wandb = WandbSink(o.wandb, o.wandb_project, o.run_name, app.run_dir, o.wandb_config)
        self.display = make_display(mode=o.display, total_steps=o.total_steps, start_step=app.resume.start_step,
                                    run_name=o.run_name)
        self.losses: list[float] = []

    def run(self, inputs: MonitorStageInputs, outputs: csp.NoPorts) -> None:
        for m in inputs["metrics"]:
            if isinstance(m, HeldoutTau):
                self._heldout(m)
                continue
            if m.skipped:
                self.app.metrics.write(SkipRecord(step=m.step, batch_id=m.batch_id, replica=m.replica,
                                                  reason=m.skip_reason, time=m.time))
                log.warning("step %d skipped (%s, batch %d from target[%d])", m.step, m.skip_reason, m.batch_id,
                            m.replica)
            record = self.windows.add(m)
            if record is not None:
                self._emit(record)
        record = self.windows.flush()
        if record is not None:
            self._emit(record)

    def _emit(self, record: TrainRecord) -> None:
        loss = record.loss
        got = spike_threshold(self.losses, k=self.spike_k)  # the rule dflash.logs uses
        if got is not None and loss == loss and loss > got[1]:
            record.spike = True
            log.warning("loss spike at step %d: %.4f (median of recent windows %.4f, threshold %.4f)",
                        record.step, loss, got[0], got[1])
        if loss == loss:
            self.losses.append(loss)
        self.app.metrics.write(record)
        self.wandb.log(record)
        if self.app.schedule_end is not None:  # a time budget: the run ends where its schedule does
            self.display.total_steps = self.app.schedule_end
        self.display.update(record, self.ctx.statistics()["channels"])

    def _heldout(self, m: HeldoutTau) -> None:
        record = HeldoutRecord(**msgspec.structs.asdict(m))  # the same fields, as the record
        self.app.metrics.write(record)
        self.wandb.log_heldout(record)
        sampled = f", sampled {m.sampled_tau:.3f}" if m.sampled_tau is not None else ""
        sampled += f", tree of {m.tree_budget} {m.tree_tau:.3f}" if m.tree_tau is not None else ""
        sampled += record.loops_text()
        dropped = f"; {m.skipped} snapshot(s) skipped (evaluator busy, or over eval.max_busy)" if m.skipped else ""
        line = (f"held-out tau {m.tau:.3f} tokens/verify step ({record.over()}; accepted {m.accepted:.3f}{sampled}) "
                f"at step {m.step}: decoded in {m.seconds:.1f} s{dropped}")
        self.display.note(line)  # the terminal and run.log

    def teardown(self) -> None:
        if hasattr(self, "display"):
            self.display.close()
        if hasattr(self, "wandb"):
            self.wandb.close()
