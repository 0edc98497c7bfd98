"""Stops while the in-training evaluator decodes: a stop request reaches the decode loop, one or two
signals end the run in one summary and a documented exit code, a stuck stage exits 3 (never a C++
abort), the summary counts the steps the trainer really finished, and held-out data that gives
the evaluator no prompt is refused before start-up."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import csp
from dflash.checkpoint import list_checkpoints, read_meta
from dflash.eval.measure import decode_tau, evaluate
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target
from dflash.run.cli import main
from dflash.run.stages.monitor import MonitorStage
from tests.dflash.run.test_run_e2e import GRAPH, ROOT, cache_dir, records, small  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(240)


# -- the decode loop asks the stop request ---------------------------------------------------------


@pytest.fixture(scope="module")
def models():
    target = load_target(TargetConfig(preset="tiny", seed=11, vocab_size=64), "cpu", num_draft_layers=1)
    head = target.shared_head()
    cfg = DrafterConfig(num_layers=1, block_size=4, mask_token_id=63).resolve(target.hf_config, target.layer_ids)
    return target, head, DFlashDrafter(cfg, seed=3).eval()


class _StopAfter:
    """``should_stop`` that turns True at its ``n``-th call, counting the calls."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls >= self.n


@pytest.mark.parametrize("measure", [decode_tau, evaluate], ids=["decode_tau", "evaluate"])
def test_a_stop_request_ends_a_decode_between_verify_steps(models, measure):
    """Invariant: ``should_stop`` is asked before each prompt and each verify step; once it says
    True the evaluation raises DecodeStopped at once (within one verify step), whatever is left
    of ``max_new_tokens`` (here 400 tokens of 2 prompts, at most 3 per step: hundreds of steps).
    Regression: the evaluator's decode never looked at the run's stop request, so a graceful stop
    waited for the whole evaluation."""
    from dflash.eval.decode import DecodeStopped

    target, head, drafter = models
    prompts = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7, 8])]
    stop = _StopAfter(5)
    with pytest.raises(DecodeStopped):
        measure(target, drafter, head, prompts, 400, should_stop=stop)
    assert stop.calls == 5  # 1 before the first prompt, then one per verify step: stopped at the 4th
    plain = decode_tau(target, drafter, head, prompts, 12)
    assert decode_tau(target, drafter, head, prompts, 12, should_stop=lambda: False) == plain


# -- signals while the evaluator decodes -----------------------------------------------------------


def _long_eval_run(run: Path, cache: Path, *extra: str) -> list[str]:
    """dflash.run arguments: 8 steps, then evaluations far longer than any test waits for (two
    prompts of 3,000 tokens each, greedy and sampled: minutes on a CPU)."""
    sets = ("eval.every=2", "eval.prompts=2", "eval.max_new_tokens=3000", "eval.temperature=1.0",
            "eval.max_busy=1", *extra)
    return [a for a in small(run, cache, *sets, steps=8)[1:]]


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash.run", GRAPH, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(proc: subprocess.Popen, ready) -> None:
    deadline = time.monotonic() + 150
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run ended early:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run never got there:\n{proc.communicate()[0]}")
        time.sleep(0.05)  # polling files another process writes; not used for ordering


def _trained(run: Path, step: int):
    """True once every step up to ``step`` is logged (the evaluator is then still decoding)."""
    def ready() -> bool:
        try:
            return any(r["step"] >= step for r in records(run, "train"))
        except (FileNotFoundError, json.JSONDecodeError):
            return False
    return ready


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the run did not end within {timeout:g} s of the signal:\n{out}")
    return out


@pytest.mark.parametrize("isolate", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["in-process", "isolated"])
def test_one_signal_ends_an_evaluation_in_progress(tmp_path, cache_dir, isolate):  # noqa: F811
    """Invariant: one SIGINT while the evaluator decodes (in the training process, or in its own
    with eval.isolate) ends the evaluation within a verify step and the run drains: exit 130, the
    summary names the step whose evaluation was cut short and how to measure it. Regression: the
    stop waited for the whole evaluation (minutes here), which is when a user presses Ctrl-C again."""
    run = tmp_path / "run"
    proc = _start(_long_eval_run(run, cache_dir, f"eval.isolate={str(isolate).lower()}"))
    _wait_for(proc, _trained(run, 8))
    if isolate:  # the child's start-up takes seconds more: signal once it decodes
        _wait_for(proc, lambda: "decoding in its own process" in (run / "run.log").read_text())
    proc.send_signal(signal.SIGINT)
    out = _finish(proc, 60)  # the evaluation alone would take minutes
    assert proc.returncode == 130, out
    assert "run summary: stopped by SIGINT after draining (exit 130)" in out, out
    ckpt = list_checkpoints(run / "checkpoints")[-1]
    assert read_meta(ckpt)["step"] == 8
    assert re.search(r"unevaluated  step 8: the stop came before its held-out evaluation finished; a resume does "
                     rf"not redo it; python -m dflash\.eval {re.escape(str(ckpt))} --data sharegpt", out), out
    assert records(run, "end")[-1]["unevaluated"] == 8
    assert "Traceback" not in out


def test_two_signals_during_an_evaluation_abort_with_exit_130(tmp_path, cache_dir):  # noqa: F811
    """Invariant: SIGINT then SIGTERM while the evaluator decodes aborts the run: one summary,
    exit 130. Regression: the decoding thread ignored the abort, the run gave up on it after 10 s
    ("a process did not stop", exit 3) and the interpreter's exit then died in C++: "terminate
    called without an active exception", SIGABRT, exit 134."""
    run = tmp_path / "run"
    proc = _start(_long_eval_run(run, cache_dir))
    _wait_for(proc, _trained(run, 8))
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)
    out = _finish(proc, 60)
    assert proc.returncode == 130, out
    assert out.count("run summary: ") == 1 and "(exit 130)" in out, out
    assert "terminate called" not in out and "did not stop" not in out and "Traceback" not in out, out


STUCK_STAGE = textwrap.dedent("""
    import os, pathlib, runpy, sys, torch
    import csp
    import csp.runtime.engine
    from dflash.run.stages.postprocess import PostprocessStage

    csp.runtime.engine.JOIN_TIMEOUT_S = 1.0  # give up on the stuck thread after 1 s, not 10

    @csp.register("tests.stuck_postprocess")
    class Stuck(PostprocessStage):
        def process(self, out):
            item = super().process(out)
            if item.batch.batch_id >= 3:  # spins in torch ops, never looking at the stop request
                pathlib.Path(os.environ["STUCK_MARK"]).touch()
                x = torch.randn(64, 64)
                while True:
                    x = torch.tanh(x @ x)
            return item

    sys.argv = ["dflash.run", *sys.argv[1:]]
    runpy.run_module("dflash.run", run_name="__main__", alter_sys=True)
""")


def test_a_stage_stuck_in_native_code_exits_3_not_sigabrt(tmp_path, cache_dir):  # noqa: F811
    """Invariant: a stage thread that never returns (here: spinning in torch ops) makes
    ``python -m dflash.run`` exit 3 with its one line after an abort. Regression: the interpreter's
    shutdown with that thread inside torch aborted in C++ ("terminate called without an active
    exception"), exit 134, a code docs/failure-modes.md does not list."""
    run = tmp_path / "run"
    args = small(run, cache_dir, 'process.postprocess.kind="tests.stuck_postprocess"', steps=50)
    mark = tmp_path / "stuck"
    proc = subprocess.Popen([sys.executable, "-c", STUCK_STAGE, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "STUCK_MARK": str(mark)})
    _wait_for(proc, mark.exists)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)
    out = _finish(proc, 60)
    assert proc.returncode == 3, out
    assert "error: process postprocess[0] did not stop within 1 s" in out, out
    assert "terminate called" not in out


# -- the run summary counts the trainer's steps ----------------------------------------------------


@csp.register("tests.monitor_failing_at_step_5")
class FailingMonitor(MonitorStage):
    """A monitor that fails when the metrics of step 5 reach it (the drafter has trained 5 steps)."""

    def run(self, inputs, outputs):
        for m in inputs["metrics"]:
            if getattr(m, "step", 0) == 5:
                raise RuntimeError("injected monitor failure")


def test_the_summary_counts_the_steps_the_trainer_finished(tmp_path, cache_dir, capsys):  # noqa: F811
    """Invariant: after a failure, the summary's step count is the drafter's own (kept in the
    end record), not the last logged metrics window: with [monitor].window = 100 no window is
    ever logged here, yet at least 5 steps trained and checkpoints were written. Regression: the
    summary read "steps 0/60 (no step finished in this run)"."""
    run = tmp_path / "run"
    code = main(small(run, cache_dir, 'process.monitor.kind="tests.monitor_failing_at_step_5"',
                      "monitor.window=100", "checkpoint.every=2", steps=60))
    assert code == 1
    out = capsys.readouterr().err
    (end,) = records(run, "end")
    done = end["step"]
    assert done >= 5 and not records(run, "train")
    assert f"  steps        {done}/60 (this run: 1..{done})" in out, out
    newest = read_meta(list_checkpoints(run / "checkpoints")[-1])["step"]
    assert 4 <= newest <= done
    if newest < done:
        assert f"steps {newest + 1}..{done} are redone on resume" in out, out


def test_the_summary_says_no_redo_for_a_checkpoint_past_the_steps_done(tmp_path, monkeypatch):
    """Invariant: "steps A..B are redone on resume" appears only when A <= B (a checkpoint older
    than the last finished step). Regression: a run that logged no window beside a newer
    checkpoint printed "steps 16..0 are redone on resume"."""
    from dflash.observe import summary

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000015"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 15, "healthy": True}))
    monkeypatch.setattr(summary, "last_healthy", lambda run_dir: ckpt)  # its files are not what is tested
    lines = [{"kind": "start", "step": 0}, {"kind": "end", "status": "failed", "exit_code": 1, "step": 0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    text = summary.closing_summary(run, status="failed", exit_code=1, total_steps=60)
    assert "redone on resume" not in text, text
    assert "steps        0/60 (no step finished in this run)" in text, text
    assert f"saved        {ckpt} (step 15, the last healthy checkpoint)" in text, text


# -- held-out data with no prompt ------------------------------------------------------------------


def test_held_out_data_without_a_prompt_is_refused_before_start_up(tmp_path, cache_dir, capsys):  # noqa: F811
    """Invariant: when every conversation opens with an assistant turn no held-out conversation
    gives the evaluator a prompt; the run stops before the graph starts (no start record), exit 2,
    one line whose advice fits: eval.every = 0, not "hold out more". Regression: exit 1 after
    start-up, a traceback, and advice to hold out more conversations."""
    data = tmp_path / "assistant-first.jsonl"
    words = " ".join(f"word{i}" for i in range(60))
    rows = [{"messages": [{"role": "assistant", "content": f"Hello {i}, {words}."},
                          {"role": "user", "content": f"Question {i}?"},
                          {"role": "assistant", "content": f"Answer {i}: {words}."}]} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    code = main(small(run, cache_dir, f'data.source="{data}"', "eval.every=2", "data.max_samples=\"all\"", steps=2))
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert "none of the 4 held-out conversations" in line and "set eval.every = 0" in line, line
    assert "nor has any of its conversations" in line and "data.holdout" not in line, line
    assert "Traceback" not in err and not (run / "metrics.jsonl").exists()
