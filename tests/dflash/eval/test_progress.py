"""dflash.eval says what it is doing while it runs: the measurement reports each stage and prompt
through its ``progress`` callback, :class:`ProgressLines` turns that into plain lines at a
readable rate, and the CLI writes them to stderr whether or not stderr is a terminal, leaving
``--json`` stdout clean; ``--quiet`` drops them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dflash.eval.measure import decode_tau, evaluate
from dflash.eval.progress import EvalProgress, ProgressLines, clock_text
from tests.dflash.eval.test_eval import models, prompt  # noqa: F401 - the module-scoped fixture
from tests.dflash.plan.test_plan import ROOT, tiny_run  # noqa: F401 - the module-scoped fixture


def test_progress_lines_come_at_a_readable_rate_and_say_how_far_and_how_long():
    """Invariant: the first and the last prompt are always said, in between at most one line per
    ``every_s`` seconds (not one per prompt); each says prompts done of the total, the tau so far,
    the time elapsed and the time left (elapsed / done x remaining); stage changes are always said."""
    now = [0.0]
    lines: list[str] = []
    show = ProgressLines(lines.append, prefix="x: ", every_s=10.0, clock=lambda: now[0])
    show(EvalProgress("warmup", 0, 8))
    for i in range(1, 9):  # 4 s a prompt: prompt 1 (the first), 4 and 7 (12 s after the last line), 8 (the last)
        now[0] = 4.0 * i
        show(EvalProgress("decode", i, 8, decodes=i, new_tokens=64 * i, steps=50 * i, tau=1.25, elapsed=4.0 * i))
    show(EvalProgress("done", 8, 8, decodes=8, new_tokens=512, tau=1.25, elapsed=41.0))
    decode = [line for line in lines if "/8 prompts" in line]
    assert [line.split("/")[0] for line in decode] == ["x: 1", "x: 4", "x: 7", "x: 8"]  # 4 s, then >= 10 s apart
    assert decode[0] == "x: 1/8 prompts | tau 1.250 so far | 0:04 elapsed, ~0:28 left"
    assert decode[-1] == "x: 8/8 prompts | tau 1.250 so far | 0:32 elapsed"  # nothing left, no estimate
    assert lines[0].startswith("x: speed baseline: one untimed warm-up decode")
    assert lines[-1] == "x: done: tau 1.250 over 8 prompts, 512 tokens, in 0:41"
    assert clock_text(3725) == "1:02:05" and clock_text(59.6) == "1:00"


def test_evaluate_and_decode_tau_report_every_stage_and_prompt(models):  # noqa: F811
    """Invariant: ``evaluate`` reports the warm-up (with ``speed``), each prompt once after all its
    decodes and their scoring, and the end, whose tau is the result's; ``decode_tau`` reports each greedy
    and each sampled prompt and ends with its tau. Without a callback both are silent (the default)."""
    target, head, drafter = models
    got: list[EvalProgress] = []
    prompts = [prompt(3), prompt(4, 6), prompt(5)]
    res = evaluate(target, drafter, head, prompts, max_new_tokens=6, speed=True, progress=got.append)
    assert [(p.stage, p.done) for p in got] == [("warmup", 0), ("decode", 1), ("decode", 2), ("decode", 3),
                                                 ("done", 3)]
    assert all(p.total == 3 for p in got) and got[3].decodes == 3 and got[3].new_tokens == 18
    assert got[-1].tau == pytest.approx(res.tau) and got[-1].steps == sum(r.steps for r in res.per_prompt)
    assert [p.elapsed for p in got[1:]] == sorted(p.elapsed for p in got[1:])

    got.clear()
    tau = decode_tau(target, drafter, head, prompts[:2], 6, temperature=1.0, seed=1, progress=got.append)
    assert [(p.stage, p.done) for p in got] == [("decode", 1), ("decode", 2), ("sampled", 1), ("sampled", 2),
                                                 ("done", 2)]
    assert got[-1].tau == pytest.approx(tau.tau) and got[-1].new_tokens == tau.new_tokens == 12


def test_eval_progress_reaches_a_redirected_stderr_and_json_stdout_stays_clean(tiny_run, tmp_path):  # noqa: F811
    """Invariant (the user's case: ``dflash.eval ... > out 2> err``, nothing for minutes): with
    stderr a file, not a terminal, the set's line, prompt progress and the speed baseline's line
    are in it as the run goes; stdout holds one JSON object and nothing else."""
    ck = max((tiny_run / "checkpoints").glob("step_*"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Name a colour, number {i}."}) + "\n" for i in range(3)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.run([sys.executable, "-m", "dflash.eval", str(ck), "--prompts", str(prompts),
                               "--max-new-tokens", "5", "--device", "cpu", "--json"],
                              stdout=out, stderr=err, cwd=tmp_path, env=env, timeout=300, check=False)
    err_text = (tmp_path / "err").read_text()
    assert proc.returncode == 0, err_text[-2000:]
    lines = [line for line in err_text.splitlines() if line.startswith("dflash.eval: ")]
    assert lines[0].startswith("dflash.eval: p: 3 prompts x 5 tokens, prompts cut to their last 1024 tokens; cpu, ")
    assert "1 CPU thread(s); the target alone is timed beside each decode" in lines[0]
    assert lines[1].startswith("dflash.eval: speed baseline: one untimed warm-up decode")
    assert any(line.startswith("dflash.eval: 1/3 prompts | tau ") for line in lines)
    assert any(line.startswith("dflash.eval: 3/3 prompts | tau ") for line in lines)
    assert lines[-1].startswith("dflash.eval: done: tau ")
    res = json.loads((tmp_path / "out").read_text())  # the whole of stdout is the JSON object
    assert len(res["per_prompt"]) == 3 and res["max_new_tokens"] == 5


def test_sigterm_ends_the_eval_with_the_finished_prompts_result(tiny_run, tmp_path):  # noqa: F811
    """Invariant (the user's case: ``timeout 150 python -m dflash.eval ... --json > out``, the
    limit reached mid-set): SIGTERM ends the run after the prompt under way, exit 0, and stdout
    still holds the JSON result over the prompts finished, saying how many of how many and why."""
    ck = max((tiny_run / "checkpoints").glob("step_*"))
    prompts = tmp_path / "p.jsonl"
    n = 400   # far more than decode before the signal comes
    prompts.write_text("".join(json.dumps({"prompt": f"Name a colour, number {i}."}) + "\n" for i in range(n)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "dflash.eval", str(ck), "--prompts", str(prompts),
                                 "--max-new-tokens", "16", "--device", "cpu", "--json"],
                                stdout=out, stderr=err, cwd=tmp_path, env=env)
        try:
            deadline = time.monotonic() + 240
            while f"1/{n} prompts" not in (tmp_path / "err").read_text() and proc.poll() is None:
                assert time.monotonic() < deadline, "no prompt finished in 240 s"
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=120)
        finally:
            proc.kill()
    err_text = (tmp_path / "err").read_text()
    assert rc == 0, err_text[-2000:]
    res = json.loads((tmp_path / "out").read_text())
    assert res["stopped_by"] == "signal" and res["prompts_asked"] == n
    assert 1 <= len(res["per_prompt"]) < n
    assert "(stopped early)" in err_text.splitlines()[-1]


def test_quiet_drops_the_progress_lines_only(tiny_run, tmp_path, capsys):  # noqa: F811
    """Invariant: ``--quiet`` prints no progress line; the result on stdout is the same text (its
    headline says what the tau is over, as the run's log does)."""
    from dflash.eval.cli import main

    ck = max((tiny_run / "checkpoints").glob("step_*"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Name a colour."}\n{"turns": ["Name a fruit.", "And another?"]}\n')
    base = [str(ck), "--prompts", str(prompts), "--max-new-tokens", "4", "--device", "cpu", "--no-speedup"]
    assert main([*base, "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == ""
    assert "\np tau " in "\n" + quiet.out and "tokens/verify step (2 prompts, 3 turns x 4 tokens)" in quiet.out
    assert main(base) == 0
    loud = capsys.readouterr()
    assert "dflash.eval: p: 2 prompts, 3 turns x 4 tokens" in loud.err and "2/2 prompts (3 decodes)" in loud.err
    assert "speed baseline" not in loud.err  # --no-speedup: no warm-up, no target-alone timing
    def table(text: str) -> list[str]:  # the decode's seconds aside
        return [line for line in text.splitlines() if not line.startswith("dtype ")]

    assert table(loud.out) == table(quiet.out)
