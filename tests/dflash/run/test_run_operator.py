"""What an operator sees from ``python -m dflash.run``: run.log holds the whole story, the closing
summary and the plot at the end, one line and exit 3 for a stage that does not stop, and a
--help that answers without importing torch."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import pytest

import csp
import csp.runtime.engine
from dflash.run.cli import main
from dflash.run.stages.postprocess import PostprocessStage
from tests.dflash.run.test_run_e2e import ROOT, cache_dir, records, small  # noqa: F401  (cache_dir: a fixture)

STUCK_RELEASE = threading.Event()
STUCK_INSIDE = threading.Event()


@csp.register("tests.stuck_postprocess")
class StuckPostprocess(PostprocessStage):
    """Postprocess that, at its third batch, waits outside any channel call (a hung collective)."""

    def process(self, out):
        self.seen = getattr(self, "seen", 0) + 1
        if self.seen == 3:
            STUCK_INSIDE.set()
            assert STUCK_RELEASE.wait(60)
        return super().process(out)


def test_run_log_holds_the_whole_story_and_the_run_ends_with_a_summary_and_a_plot(tmp_path, cache_dir, capfd):
    """Regression: run.log held 6 lines; piped output wrapped at 80 columns. Invariant:
    run.log has the data summary, every window line, every checkpoint, the closing summary, each
    on one unwrapped line; the terminal (a pipe here) gets the same lines unwrapped, then the
    summary; plot.png is written at the end."""
    pytest.importorskip("matplotlib")
    run = tmp_path / ("a-long-run-directory-name-" * 4).rstrip("-")
    assert main(small(run, cache_dir, "monitor.plot=true", steps=8)) == 0
    log = (run / "run.log").read_text()
    assert re.search(r"INFO dflash.run: data: sharegpt \(.*\): \d+ records read \(reading stopped at "
                     r"data.max_samples = \d+ usable conversations\), \d+ conversations kept", log)
    for step in range(1, 9):
        assert f"INFO dflash.display: step {step}/8 " in log
    for step in (4, 8):
        assert f"checkpoint step {step} written to {run}/checkpoints/step_0000000{step}" in log
    assert "run summary: completed (exit 0)" in log and f"python -m dflash.export {run}/checkpoints/step_00000008" in log
    assert (run / "plot.png").read_bytes()[:4] == b"\x89PNG"
    err = capfd.readouterr().err
    assert f"checkpoint step 8 written to {run}/checkpoints/step_00000008" in err  # one line, whole path
    assert "…" not in err and "\x1b[" not in err
    assert "Loading weights" not in err and "\r" not in err  # no transformers tqdm bar in a pipe
    assert not set("┌┐└┘│├┤") & set(err)  # the data table is plain lines in a pipe
    assert re.search(r"^  conversations kept +[\d,]+$", err, re.M)
    assert err.count("run summary: completed (exit 0)") == 1 and f"  plot         {run}/plot.png" in err
    assert all(f"step {s}/8 " in err for s in range(1, 9))


def test_ctrl_c_while_tokenizing_says_what_exists_and_what_a_rerun_does(tmp_path, cache_dir, capsys, monkeypatch):
    """Regression: Ctrl-C during tokenizing said "nothing was written" although run.log
    and .lock were there. Invariant: the one line (exit 130) names the files the run directory
    holds, and says a re-run starts from step 0, or resumes from the healthy checkpoint there."""
    import dflash.data

    run = tmp_path / "run"

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dflash.data, "load_dataset", interrupt)
    assert main(small(run, cache_dir, steps=4)) == 130
    err = capsys.readouterr().err.strip()
    assert "nothing was written" not in err and "\n" not in err
    assert err == (f"error: interrupted before training started: no step ran and no checkpoint was written; "
                   f"{run} holds .lock, run.log (the data cache keeps complete entries only); a re-run starts "
                   "from step 0"), err
    assert sorted(p.name for p in run.iterdir()) == [".lock", "run.log"]
    monkeypatch.undo()
    assert main(small(run, cache_dir, steps=4)) == 0
    monkeypatch.setattr(dflash.data, "load_dataset", interrupt)
    capsys.readouterr()
    assert main(small(run, cache_dir, steps=8)) == 130
    assert capsys.readouterr().err.strip().endswith(f"; a re-run resumes from {run}/checkpoints/step_00000004")


def test_ctrl_c_while_reading_the_config_is_one_line_not_a_traceback(tmp_path, cache_dir, capsys, monkeypatch):
    """Regression (fresh-user run): Ctrl-C in the first seconds (config load, torch/transformers
    imports) printed a KeyboardInterrupt traceback. Invariant: one line, exit 130, no run dir."""
    import dflash.run.cli as run_mod

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "load_config", interrupt)
    run = tmp_path / "run"
    assert main(small(run, cache_dir, steps=4)) == 130
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and "run the same command again" in err, err
    assert not run.exists()


def test_a_stage_stuck_outside_channel_calls_is_one_line_and_exit_3(tmp_path, cache_dir, capsys, monkeypatch):
    """Regression: Ctrl-C, a drain that never ends, a second Ctrl-C, and after
    the join timeout an uncaught CspError traceback, exit 1. Invariant: one 'error:' line naming
    the stage that did not stop, exit code 3; its stack goes to run.log, not the terminal."""
    import os
    import signal

    monkeypatch.setattr(csp.runtime.engine, "JOIN_TIMEOUT_S", 2.0)  # the other stages stop well within it
    STUCK_RELEASE.clear(), STUCK_INSIDE.clear()

    def driver():
        assert STUCK_INSIDE.wait(60)
        os.kill(os.getpid(), signal.SIGINT)  # the drain cannot finish: postprocess never returns
        threading.Event().wait(0.3)  # let the first handler run before the second signal
        os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=driver, daemon=True)
    t.start()
    run = tmp_path / "run"
    try:
        code = main(small(run, cache_dir, 'process.postprocess.kind="tests.stuck_postprocess"', steps=40))
    finally:
        STUCK_RELEASE.set()
        t.join(10)
        for th in threading.enumerate():
            if th.name == "postprocess[0]":
                th.join(10)
    assert code == 3
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "process postprocess[0] did not stop within 2 s" in errors[0]
    assert errors[0].endswith(f"its stack is logged to {run / 'run.log'}")
    assert "Traceback" not in err and "stack of the stuck" not in err
    assert "stack of the stuck process thread postprocess[0]" in (run / "run.log").read_text()
    assert records(run, "end")[-1]["exit_code"] == 3


def test_help_answers_without_importing_torch_and_lists_exit_codes():
    """Regression: ``dflash.run --help`` took 2.9 s importing torch and transformers.
    Invariant: --help imports neither, and names every exit code."""
    code = ("import runpy, sys\nsys.argv = ['dflash.run', '--help']\n"
            "try:\n    runpy.run_module('dflash.run', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('IMPORTED', 'torch' in sys.modules, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("IMPORTED False False")
    for c in ("0 ", "1 ", "2 ", "3 ", "130 "):
        assert f"\n  {c}" in proc.stdout
