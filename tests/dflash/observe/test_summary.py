"""dflash.observe.summary: the closing block of a run, for every way a run ends, from the run's own files;
dflash.observe.runlog: piped output is never wrapped or cut."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

import dflash.observe.summary as summary_mod
from dflash.observe import runlog
from dflash.observe.summary import closing_summary, report_end, resume_command, segment

ARGV = ["examples/dflash-tiny.toml", "--set", "run.out_dir=runs/x y", "--resume", "none"]


def _write(run: Path, recs: list[dict]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def _train(step: int, **kw) -> dict:
    rec = {"kind": "train", "step": step, "window": 2, "loss": 2.5 - step / 100, "tok_s": 9000.0,
           "target_tok_s": 30000.0, "drafter_tok_s": 12000.0, "skipped_total": 0}
    rec.update(kw)
    return rec


@pytest.fixture
def ckpt(monkeypatch, tmp_path):
    """Stand-in for the checkpoint rule (dflash.checkpoint owns it and has its own tests): the
    newest healthy checkpoint is whatever the test sets."""
    state: dict = {"path": None, "step": None}
    monkeypatch.setattr(summary_mod, "last_healthy", lambda run_dir: state["path"])
    monkeypatch.setattr(summary_mod, "read_meta", lambda p: {"step": state["step"]})
    return state


def test_completed_run_reports_steps_loss_tau_throughput_checkpoint_and_next_commands(tmp_path, ckpt):
    """Invariant: a completed run's summary gives steps done, the last window's loss and both tau
    conventions, tokens/s, skips, the checkpoint, the run dir, and the inspect/eval/export/plot
    commands pointing at that checkpoint."""
    run = tmp_path / "run"
    _write(run, [{"kind": "start", "step": 0}, _train(2, tau_sim=2.5, accepted_sim=1.5), _train(4, tau_sim=3.0, accepted_sim=2.0),
                 {"kind": "end", "status": "completed"}])
    ckpt.update(path=run / "checkpoints" / "step_00000004", step=4)
    text = closing_summary(run, status="completed", exit_code=0, total_steps=4, argv=ARGV, seconds=12.3,
                           data_source="sharegpt", plot=str(run / "plot.png"))
    lines = text.splitlines()
    assert lines[0] == "run summary: completed (exit 0) in 12.3 s"
    assert "  steps        4/4 (this run: 1..4)" in lines
    assert "  last window  step 4 (2 steps): loss 2.46, tau 3 tokens/verify step, accepted 2" in lines
    assert "  throughput   9.0K tok/s (target 30.0K, drafter 12.0K; mean of this run's 2 windows)" in lines
    assert "  skipped      0 steps in this run" in lines
    assert f"  checkpoint   {run}/checkpoints/step_00000004 (step 4, healthy)" in lines
    assert f"  plot         {run}/plot.png" in lines
    for cmd in (f"python -m csp.inspect {run}", f"python -m dflash.plot {run}", f"python -m dflash.logs {run}",
                f"python -m dflash.eval {run}/checkpoints/step_00000004 --data sharegpt",
                f"python -m dflash.export {run}/checkpoints/step_00000004 -o {run}/export"):
        assert any(line.strip().startswith(cmd) for line in lines), cmd
    assert "dflash.run" not in text  # nothing to resume


def test_sigterm_stop_names_the_signal_the_final_checkpoint_and_the_resume_command(tmp_path, ckpt):
    """Regression: after SIGTERM the log said "stopped by Ctrl-C". Invariant: the
    summary names the signal, what was saved, and a resume command with the same arguments and
    --resume auto (an earlier --resume none replaced)."""
    run = tmp_path / "run"
    _write(run, [{"kind": "start", "step": 0}, _train(2), _train(4)])
    ckpt.update(path=run / "checkpoints" / "step_00000004", step=4)
    text = closing_summary(run, status="stopped", exit_code=130, total_steps=100, argv=ARGV, stopped_by="SIGTERM")
    assert text.splitlines()[0] == "run summary: stopped by SIGTERM after draining (exit 130)"
    assert "Ctrl-C" not in text
    assert f"  saved        {run}/checkpoints/step_00000004 (step 4, healthy, the final one)" in text
    assert ("python -m dflash.run examples/dflash-tiny.toml --set 'run.out_dir=runs/x y' --resume auto"
            in text) and "--resume none" not in text
    assert "# resume from step 4" in text


def test_abort_without_any_checkpoint_does_not_promise_one(tmp_path, ckpt):
    """Regression: the double-Ctrl-C message promised "the last periodic
    checkpoint" when none existed. Invariant: with no healthy checkpoint the summary says the next
    run starts from step 0, and offers no eval/export of a checkpoint."""
    run = tmp_path / "run"
    _write(run, [{"kind": "start", "step": 0}, _train(2)])
    text = closing_summary(run, status="aborted", exit_code=130, total_steps=100, argv=ARGV, stopped_by="SIGINT")
    assert text.splitlines()[0] == ("run summary: aborted by a second stop signal (SIGINT): no final "
                                    "checkpoint was written (exit 130)")
    assert "no healthy checkpoint: the next run starts from step 0" in text
    assert "periodic" not in text and "dflash.eval" not in text and "dflash.export" not in text


def test_abort_with_an_older_checkpoint_says_which_steps_are_redone(tmp_path, ckpt):
    run = tmp_path / "run"
    _write(run, [{"kind": "start", "step": 0}, _train(2), _train(4), _train(6)])
    ckpt.update(path=run / "checkpoints" / "step_00000002", step=2)
    text = closing_summary(run, status="aborted", exit_code=130, total_steps=100, stopped_by="SIGINT")
    assert "(step 2, the last healthy checkpoint; steps 3..6 are redone on resume)" in text
    assert "# resume from step 2" in text


def test_abort_whose_last_step_was_checkpointed_does_not_say_none_was_written(tmp_path, ckpt):
    """Regression: a second Ctrl-C while the checkpoint of the last step was being written (the
    writer finishes it) gave "aborted ...: no final checkpoint was written" above "saved
    step_00000008 (step 8, healthy, the final one)". Invariant: the title says no final
    checkpoint was written only when the last step has none."""
    run = tmp_path / "run"
    _write(run, [{"kind": "start", "step": 0}, _train(4), _train(8)])
    ckpt.update(path=run / "checkpoints" / "step_00000008", step=8)
    text = closing_summary(run, status="aborted", exit_code=130, total_steps=30, stopped_by="SIGINT")
    assert text.splitlines()[0] == ("run summary: aborted by a second stop signal (SIGINT); the "
                                    "checkpoint of its last step was written (exit 130)")
    assert "no final checkpoint" not in text
    assert "(step 8, healthy, the final one)" in text


def test_failed_run_gives_the_error_and_only_this_segments_numbers(tmp_path, ckpt):
    """Invariant: after a resume the summary counts this segment only (steps, windows, skips),
    and a failed run shows its one-line error."""
    run = tmp_path / "run"
    _write(run, [{"kind": "start", "step": 0}, _train(2), _train(4),
                 {"kind": "skip", "step": 3, "reason": "non-finite loss"},
                 {"kind": "start", "step": 4}, {"kind": "resume", "step": 4},
                 {"kind": "skip", "step": 6, "reason": "non-finite grad"}, _train(6, skipped_total=2, loss=None)])
    ckpt.update(path=run / "checkpoints" / "step_00000004", step=4)
    text = closing_summary(run, status="failed", exit_code=1, total_steps=10,
                           error="process drafter[0] failed: RuntimeError: boom")
    assert "  error        process drafter[0] failed: RuntimeError: boom" in text
    assert "  steps        6/10 (this run: 5..6)" in text
    assert "  last window  step 6 (2 steps): loss None" in text
    assert "  skipped      1 step in this run, 2 in total (last: step 6, non-finite grad)" in text
    assert "mean of this run's 1 window)" in text


def test_nothing_to_do_names_the_checkpoint_and_offers_no_resume(tmp_path, ckpt):
    """Regression: a re-run of a run already at its last step printed no summary.
    Invariant: the "nothing to do" summary says so, names the final checkpoint and the eval/export
    commands, and offers no resume (there is nothing left to train)."""
    run = tmp_path / "run"
    _write(run, [{"kind": "start", "step": 0}, _train(4), {"kind": "end", "status": "completed"},
                 {"kind": "start", "step": 4}, {"kind": "end", "status": "nothing to do"}])
    ckpt.update(path=run / "checkpoints" / "step_00000004", step=4)
    text = closing_summary(run, status="nothing to do", exit_code=0, total_steps=4, argv=ARGV)
    assert text.splitlines()[0] == "run summary: nothing to do: the run is already at its last step (exit 0)"
    assert "  steps        4/4 (no step finished in this run)" in text
    assert f"  checkpoint   {run}/checkpoints/step_00000004 (step 4, healthy)" in text
    assert f"python -m dflash.export {run}/checkpoints/step_00000004" in text
    assert "dflash.run" not in text


def test_nothing_to_do_past_the_last_step_says_past_not_at(tmp_path, ckpt):
    """Regression: a re-run whose checkpoint (step 8) is past run.steps = 4 was summarized as
    "the run is already at its last step". Invariant: the title says the checkpoint is past the
    last step, with both numbers; still no resume offered."""
    run = tmp_path / "run"
    _write(run, [{"kind": "start", "step": 0}, _train(8), {"kind": "end", "status": "completed"},
                 {"kind": "start", "step": 8}, {"kind": "end", "status": "nothing to do"}])
    ckpt.update(path=run / "checkpoints" / "step_00000008", step=8)
    text = closing_summary(run, status="nothing to do", exit_code=0, total_steps=4, argv=ARGV)
    assert text.splitlines()[0] == ("run summary: nothing to do: the checkpoint is already past the last step "
                                    "(step 8, run.steps = 4) (exit 0)")
    assert "  steps        8/4 (no step finished in this run)" in text
    assert "dflash.run" not in text


def test_wandb_commands_only_when_wandb_ran(tmp_path, ckpt):
    """Regression: after a resume with monitor.wandb = "disabled" the summary still
    suggested `wandb leet` / `wandb sync` for an earlier segment's offline run. Invariant: the
    wandb commands appear only when this segment ran wandb."""
    run = tmp_path / "run"
    _write(run, [{"kind": "start", "step": 0}, _train(2)])
    (run / "wandb" / "offline-run-20260101_000000-abc").mkdir(parents=True)
    ran = closing_summary(run, status="completed", exit_code=0, total_steps=2, wandb_ran=True)
    assert "wandb leet" in ran and f"wandb sync {run}/wandb/offline-run-20260101_000000-abc" in ran
    off = closing_summary(run, status="completed", exit_code=0, total_steps=2, wandb_ran=False)
    assert "wandb" not in off.replace(f"{run}", "")


def test_no_metrics_at_all_still_summarises(tmp_path, ckpt):
    text = closing_summary(tmp_path / "nothing", status="failed", exit_code=1, total_steps=5)
    assert "  steps        0/5 (no step finished in this run)" in text


def test_segment_starts_at_the_last_start_record():
    recs = [{"kind": "start"}, {"kind": "train", "step": 1}, {"kind": "start"}, {"kind": "train", "step": 2}]
    assert segment(recs) == recs[2:] and segment(recs[1:2]) == recs[1:2]


def test_resume_command_replaces_every_resume_form():
    assert resume_command(["g.toml", "--resume=none", "--set", "a=1"]) == \
        "python -m dflash.run g.toml --set a=1 --resume auto"
    assert resume_command(["g.toml", "--resume", "/x/step_1"]) == "python -m dflash.run g.toml --resume auto"


def test_report_end_prints_once_logs_to_file_only_and_never_raises(tmp_path, ckpt, monkeypatch):
    """Invariant: the summary reaches the terminal once, as written, and run.log once; a failing
    summary or plot cannot change the run's exit."""
    run = tmp_path / "run"
    _write(run, [{"kind": "start", "step": 0}, _train(2)])
    out = io.StringIO()
    monkeypatch.setattr(runlog, "_console", runlog.make_console(out))
    runlog.setup(run)  # replaces the console with one on stderr; put ours back
    monkeypatch.setattr(runlog, "_console", runlog.make_console(out))
    try:
        text = report_end(run, status="completed", exit_code=0, total_steps=2, plot=False)
    finally:
        runlog.close()
    assert out.getvalue() == text + "\n"
    assert (run / "run.log").read_text().count("run summary: completed") == 1
    monkeypatch.setattr(summary_mod, "closing_summary", lambda *a, **k: 1 / 0)
    assert "the summary failed: ZeroDivisionError" in report_end(run, status="failed", exit_code=1,
                                                                total_steps=2, plot=False)


def test_piped_console_never_wraps_or_cuts_a_path():
    """Regression: piped output wrapped at 80 columns and cut paths with '…'.
    Invariant: a non-terminal console prints a 300-character path, and a table holding it, whole."""
    from rich.table import Table

    out = io.StringIO()
    con = runlog.make_console(out)
    path = "/very/long/" + "x" * 300 + "/step_00000012"
    con.print(f"checkpoint written to {path}")
    table = Table(show_header=False)
    table.add_row("cache", path)
    con.print(table)
    text = out.getvalue()
    assert f"checkpoint written to {path}\n" in text and "…" not in text
    assert any(path in line for line in text.splitlines()[1:])


def test_terminal_handler_skips_file_only_records_and_stacks(tmp_path, capsys):
    """Invariant: window lines and the data line (FILE_ONLY) and stuck-thread stacks go to run.log
    only; ordinary records go to both, on one unwrapped line each."""
    runlog.setup(tmp_path)
    try:
        long = "checkpoint step 4 written to " + "/p" * 80
        logging.getLogger("dflash.checkpoint").info(long)
        logging.getLogger("dflash.display").info("step 2/8 | loss 1", extra=runlog.FILE_ONLY)
        logging.getLogger("csp.runtime.stack").error("stack of the stuck process thread x:\n  File ...")
    finally:
        runlog.close()
    err = capsys.readouterr().err
    assert [line.split(" ", 2)[2] for line in err.splitlines()] == [long]
    logged = (tmp_path / "run.log").read_text()
    assert long in logged and "step 2/8 | loss 1" in logged and "stack of the stuck process thread x" in logged


def test_last_healthy_is_the_newest_checkpoint_that_passes_the_health_check(tmp_path):
    """Invariant: the summary names the newest checkpoint whose files pass
    dflash.checkpoint.is_healthy, skipping a newer one with a truncated weights file."""
    import torch

    from dflash.checkpoint import Checkpointer, step_dir

    ck = Checkpointer(tmp_path / "checkpoints", keep_last=5, config_hash="h")
    for step in (2, 4):
        ck.save(step=step, batch_id=step - 1, loss=1.0, weights={"fc.weight": torch.ones(2, 2)},
                train_state={"step": step, "optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}}},
                configs={"drafter_config.json": {"block_size": 4}, "target_config.json": {"preset": "tiny"}})
    ck.close()
    assert summary_mod.last_healthy(tmp_path) == step_dir(tmp_path / "checkpoints", 4)
    weights = step_dir(tmp_path / "checkpoints", 4) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])  # truncated: its header no longer covers the file
    assert summary_mod.last_healthy(tmp_path) == step_dir(tmp_path / "checkpoints", 2)
    assert summary_mod.last_healthy(tmp_path / "nowhere") is None


def test_log_lines_and_the_live_view_share_one_console(tmp_path, monkeypatch):
    """Regression: in a terminal the live view repainted over the "graceful stop
    requested" and "checkpoint written" lines while it drained, because the log handler wrote to
    its own console. rich keeps printed lines above a Live only when both use one console.
    Invariant: on a terminal the log handler and the default TrainingDisplay use the same console,
    and a line logged while the view is live is printed through it."""
    from rich.console import Console
    from rich.logging import RichHandler

    from dflash.observe.display import TrainingDisplay

    out = io.StringIO()
    monkeypatch.setattr(runlog, "make_console", lambda file=None: Console(file=out, force_terminal=True, width=120))
    runlog.setup(tmp_path)
    try:
        handlers = [h for h in logging.getLogger().handlers if isinstance(h, RichHandler)]
        assert len(handlers) == 1 and handlers[0].console is runlog.console()
        display = TrainingDisplay(10, mode="live", refresh_per_second=20)
        try:
            assert display.console is runlog.console()
            logging.getLogger("csp.runtime").warning("SIGTERM: graceful stop requested")
        finally:
            display.close()
    finally:
        runlog.close()
    assert "SIGTERM: graceful stop requested" in out.getvalue()


def _data_summary():
    from dflash.data import DataSummary

    return DataSummary(source="sharegpt", path="/d/sharegpt.json", cache_path="/c/0123", from_cache=True,
                       records_read=4074, conversations=3553, skipped={"empty_turn": 44}, truncated=3100,
                       num_tokens=1725641, num_loss_tokens=1438331, seconds=0.25)


def test_data_table_is_plain_aligned_lines_when_piped_and_a_box_on_a_terminal():
    """Regression: piped output drew the data summary as a rich box. Invariant: a
    non-terminal console gets a title and aligned ``label  value`` lines (no box drawing, no
    trailing blanks); a terminal keeps the table."""
    from rich.console import Console

    from dflash.data import print_summary

    out = io.StringIO()
    print_summary(_data_summary(), runlog.make_console(out))
    assert out.getvalue().splitlines() == [
        "data: sharegpt (cache hit, 0.2 s)",
        "  records read                    4,074",
        "  conversations kept              3,553",
        "  tokens / loss tokens            1,725,641 / 1,438,331",
        "  truncated to max_length (kept)  3,100",
        "  skipped: empty_turn             44",
        "  cache                           /c/0123",
    ]
    tty = io.StringIO()
    print_summary(_data_summary(), Console(file=tty, force_terminal=True, width=100))
    assert "┌" in tty.getvalue() and "│ conversations kept" in tty.getvalue()


def test_transformers_progress_bars_are_off_when_piped_only(monkeypatch):
    """Regression: transformers' tqdm "Loading weights" bars landed in piped logs.
    Invariant: a non-terminal stderr turns them off through transformers' own switch; a
    terminal leaves them on."""
    from transformers.utils import logging as hf_logging

    class Tty(io.StringIO):
        def isatty(self):
            return True

    before = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        assert runlog.quiet_progress_bars_when_piped(Tty()) is False
        assert hf_logging.is_progress_bar_enabled()
        assert runlog.quiet_progress_bars_when_piped(io.StringIO()) is True
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()


def test_without_matplotlib_the_plot_line_says_where_and_how(tmp_path, ckpt, monkeypatch):
    """Invariant: a run never fails for lack of matplotlib; its summary's plot line names the file
    it would have written and the two commands that write it (install, then dflash.plot)."""
    import sys

    run = tmp_path / "run"
    _write(run, [{"kind": "start", "step": 0}, _train(2)])
    monkeypatch.setattr(runlog, "_console", runlog.make_console(io.StringIO()))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    text = report_end(run, status="completed", exit_code=0, total_steps=2)
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("plot "))
    assert f"{run / 'plot.png'} not drawn (matplotlib is not importable)" in line
    assert "pip install matplotlib, then python -m dflash.plot " + str(run) in line
    assert not (run / "plot.png").exists()


def test_the_held_out_row_says_how_many_snapshots_the_evaluator_skipped(tmp_path, ckpt):
    """Invariant: a run whose evaluator passed over snapshots (busy, or over eval.max_busy) says how
    many, and between which evaluations, beside its count of evaluations, so "2 evaluations" of a run with eval.every = 200 over 600
    steps is explained; a run that skipped none says nothing of it."""
    run = tmp_path / "run"
    held = lambda step, skipped: {"kind": "heldout", "step": step, "tau": 1.1, "accepted": 0.1, "prompts": 8,  # noqa: E731
                                  "max_new_tokens": 64, "skipped": skipped}
    _write(run, [{"kind": "start", "step": 0}, _train(200), held(200, 0), _train(600), held(600, 1),
                 {"kind": "end", "status": "completed"}])
    ckpt.update(path=run / "checkpoints" / "step_00000600", step=600)
    text = closing_summary(run, status="completed", exit_code=0, total_steps=600, argv=ARGV, seconds=9.0)
    row = next(line for line in text.splitlines() if line.startswith("  held-out"))
    assert row.endswith("; 2 evaluations, 1 skipped (between steps 200 and 600: the evaluator was busy, "
                        "or over eval.max_busy)"), row
    _write(run, [{"kind": "start", "step": 0}, _train(200), held(400, 1), _train(600), held(1000, 2),
                 {"kind": "end", "status": "completed"}])
    row = next(line for line in closing_summary(run, status="completed", exit_code=0, total_steps=1000, argv=ARGV,
                                                seconds=9.0).splitlines() if line.startswith("  held-out"))
    assert row.endswith("; 2 evaluations, 3 skipped (1 before step 400; 2 between steps 400 and 1000: the "
                        "evaluator was busy, or over eval.max_busy)"), row
    _write(run, [{"kind": "start", "step": 0}, _train(200), held(200, 0), held(600, 0), {"kind": "end", "status": "completed"}])
    row = next(line for line in closing_summary(run, status="completed", exit_code=0, total_steps=600, argv=ARGV,
                                                seconds=9.0).splitlines() if line.startswith("  held-out"))
    assert row.endswith("; 2 evaluations"), row


def test_gpu_memory_row_gives_each_devices_peak_beside_its_estimate(tmp_path, ckpt):
    """Invariant: a run on CUDA devices ends with each device's allocated peak beside the estimate
    the run was checked with (dflash.run.memory); a CPU run has no such row."""
    run = tmp_path / "run"
    _write(run, [{"kind": "start", "step": 0}, _train(2),
                 {"kind": "end", "status": "completed", "estimated_gib": {"cuda:0": 21.34, "cuda:1": 30.0},
                  "peak_gib": {"cuda:0": 19.81}}])
    text = closing_summary(run, status="completed", exit_code=0, total_steps=2)
    assert ("  GPU memory   cuda:0 peak 19.8 GiB allocated, estimated 21.3; cuda:1 estimated 30.0 GiB"
            in text.splitlines())
    _write(run, [{"kind": "start", "step": 0}, _train(2), {"kind": "end", "status": "completed"}])
    assert "GPU memory" not in closing_summary(run, status="completed", exit_code=0, total_steps=2)
