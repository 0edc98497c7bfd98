"""dflash.logs on a recorded run directory (tests/fixtures/runs/dflash_run) with planted events:
a loss spike at step 120, a skipped step 73 (batch 72), a 60 s gap over the step-100 checkpoint
write, a 45 s unexplained gap (steps 150 -> 160), an unhealthy and an incomplete checkpoint (steps
50 and 100 are complete, tiny real checkpoints that pass dflash.checkpoint.resume.verify)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from dflash.observe.logs import analyse, find_gaps, find_spikes, main, render

RUN = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "runs" / "dflash_run"


def test_finds_every_planted_event():
    rep = analyse(RUN)
    assert rep.counts == {"start": 1, "train": 20, "skip": 1, "checkpoint": 2, "end": 1}
    assert (rep.last_step, rep.end_status, rep.skipped_total, rep.bad_lines) == (200, "completed", 1, 0)
    assert [s.step for s in rep.spikes] == [120]
    assert rep.spikes[0].loss == 9.0
    assert [(s.step, s.batch_id, s.reason) for s in rep.skips] == [(73, 72, "non-finite loss")]
    assert [(g.after_step, g.before_step, g.seconds, g.typical_s) for g in rep.gaps] == [
        (100, 110, 60.0, 10.0), (150, 160, 45.0, 10.0)]
    assert rep.gaps[0].cause == "checkpoint at step 100 (save 50.0 s)"
    assert rep.gaps[1].cause == "stall"


def test_header_says_it_counts_records_not_checkpoints():
    """The fixture has 2 checkpoint records (saves logged) but 4 checkpoint directories: the first
    line must say it counts metrics.jsonl records, and the checkpoint section counts directories."""
    out = render(analyse(RUN))
    first = out.splitlines()[0]
    assert "metrics.jsonl records: 2 checkpoint, 1 end, 1 skip, 1 start, 20 train;" in first
    assert "\ncheckpoints (4; loss: the mean of the steps since the previous checkpoint, as meta.json records it):" in out


def test_checkpoint_health():
    ckpts = {c.name: c for c in analyse(RUN).checkpoints}
    assert list(ckpts) == ["step_00000050", "step_00000100", "step_00000150", "step_00000200"]
    assert (ckpts["step_00000100"].complete, ckpts["step_00000100"].healthy) == (True, True)
    assert ckpts["step_00000150"].healthy is False
    assert ckpts["step_00000200"].complete is False  # model file but no meta.json
    # resume="auto" would take the newest complete *healthy* one, not the unhealthy step 150
    assert [c.name for c in ckpts.values() if c.auto_resume] == ["step_00000100"]


def test_plain_text_report(capsys):
    assert main([str(RUN)]) == 0
    out = capsys.readouterr().out
    assert "  step 120: loss 9 (median" in out
    assert "  step 73 batch 72: non-finite loss" in out
    assert "  steps 100 -> 110: 60.0 s (typical 10.0 s), cause: checkpoint at step 100" in out
    assert "  steps 150 -> 160: 45.0 s (typical 10.0 s), cause: stall" in out
    assert "  step_00000150: step 150, loss 3.5, UNHEALTHY, incomplete: model.safetensors, " in out  # meta.json alone
    assert "  step_00000200: incomplete (no meta.json)" in out
    assert "step_00000100: step 100, loss 4, healthy, complete <- resume=auto picks this" in out


def test_json_report(capsys):
    assert main([str(RUN), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in data["spikes"]] == [120]
    assert data["gaps"][1]["cause"] == "stall"
    assert data["checkpoints"][3] == {"name": "step_00000200", "complete": False, "step": None,
                                      "loss": None, "healthy": None, "save_s": None,
                                      "auto_resume": False, "problem": None, "missing": []}


def test_missing_metrics_exits_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no metrics log at" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, says", [
    ("--gap-factor", "0", "0 must be > 0"), ("-k", "-1", "-1 must be > 0"),
    ("--window", "0", "0 must be >= 1"), ("--window", "2.5", "'2.5' is not a whole number")])
def test_a_non_positive_rule_parameter_is_a_usage_error(flag, value, says, capsys):
    """Regression (fresh-user run): ``--gap-factor 0``, ``-k -1`` and ``--window 0`` were accepted
    (--gap-factor 0 reported every interval as a gap). Invariant: each is a one-line argparse
    error naming the option, exit 2, before the run is read."""
    with pytest.raises(SystemExit) as info:
        main([str(RUN), flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"python -m dflash.logs: error: argument {flag}: {says}"


def test_crashed_run_half_line_and_tmp_checkpoint(tmp_path):
    """A killed run: last metrics line cut in half, a .tmp-step_* directory left behind."""
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    text = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(text[:-1]) + "\n" + text[-1][:30])
    tmp_ckpt = run / "checkpoints" / ".tmp-step_00000210"
    tmp_ckpt.mkdir()
    (tmp_ckpt / "meta.json").write_text('{"step": 210, "healthy": true}')  # even with meta: .tmp
    rep = analyse(run)
    assert rep.bad_lines == 1 and rep.end_status is None
    tmp = next(c for c in rep.checkpoints if c.name.startswith(".tmp"))
    assert not tmp.complete and not tmp.auto_resume


def test_spike_rule_documented_threshold():
    """median 1.0, MAD 0.1 -> threshold 1 + 5 * 1.4826 * 0.1 = 1.7413; 1.74 is not a spike, 1.75 is."""
    base = [{"step": i, "loss": x} for i, x in enumerate([0.9, 1.1, 1.0, 0.9, 1.1, 1.0])]
    assert find_spikes(base + [{"step": 6, "loss": 1.74}]) == []
    spikes = find_spikes(base + [{"step": 6, "loss": 1.75}])
    assert [s.step for s in spikes] == [6]
    assert spikes[0].threshold == pytest.approx(1.0 + 5 * 1.4826 * 0.1)


def test_non_finite_train_loss_is_reported():
    spikes = find_spikes([{"step": 1, "loss": 1.0}, {"step": 2, "loss": float("nan")}])
    assert [s.step for s in spikes] == [2] and math.isnan(spikes[0].loss)


def test_gap_cause_resume():
    recs = [{"kind": "train", "step": s, "time": float(s)} for s in range(1, 6)]
    recs.append({"kind": "resume", "step": 5, "path": "ckpt/step_5", "time": 30.0})
    recs.append({"kind": "train", "step": 6, "time": 40.0})
    (gap,) = find_gaps(recs)
    assert (gap.after_step, gap.before_step) == (5, 6)
    assert gap.cause == "resume from ckpt/step_5 at step 5"


def _write(run: Path, recs: list[dict]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def _segment(start_step: int, steps: range, loss, t0: float, resume_path: str | None = None) -> list[dict]:
    recs = [{"kind": "start", "step": start_step, "time": t0}]
    if resume_path:
        recs.append({"kind": "resume", "step": start_step, "path": resume_path, "time": t0})
    recs += [{"kind": "train", "step": s, "window": 10, "steps_averaged": 10, "loss": loss(s),
              "time": t0 + 10.0 * (i + 1)} for i, s in enumerate(steps)]
    recs.append({"kind": "end", "status": "completed", "time": t0 + 10.0 * (len(steps) + 1)})
    return recs


def test_restarts_are_segments_not_spikes_or_gaps(tmp_path):
    """Invariant: each dflash.run process's part of the log is analysed on its own: a fresh start
    from step 0 (loss back at its initial value) is not a spike, and the time between processes is
    not a logging gap with garbled steps (300 -> 210); the segments say how each began."""
    run = tmp_path / "run"
    first = _segment(0, range(10, 310, 10), lambda s: 9.0 - s / 100, t0=0.0)       # loss 8.9 -> 6.0
    again = _segment(0, range(10, 110, 10), lambda s: 9.0 - s / 100, t0=5000.0)    # fresh start: 8.9 again
    resumed = _segment(200, range(210, 310, 10), lambda s: 9.0 - s / 100, t0=9000.0,
                       resume_path="ckpt/step_00000200")
    _write(run, first + again + resumed)
    rep = analyse(run)
    assert rep.spikes == [] and rep.gaps == []
    assert [(g.start_step, g.first_step, g.last_step, g.resumed_from) for g in rep.segments] == [
        (0, 10, 300, None), (0, 10, 100, None), (200, 210, 300, "ckpt/step_00000200")]
    assert rep.segments[1].down_s == 5000.0 - 310.0
    out = render(rep)
    assert "3: resumed at step 200 from ckpt/step_00000200, after" in out and "300 -> 210" not in out


def test_all_skipped_window_is_not_a_spike_and_spikes_say_what_they_average():
    """Invariant: a window whose every step was skipped (steps_averaged 0) is listed as skips, not as
    a non-finite spike; a window that averaged steps and still has a non-finite loss is reported,
    with the number of steps it averaged."""
    recs = [{"step": s, "loss": 1.0, "steps_averaged": 4} for s in range(1, 7)]
    recs.append({"step": 7, "loss": None, "steps_averaged": 0})
    recs.append({"step": 8, "loss": 9.0, "steps_averaged": 3})
    spikes = find_spikes(recs)
    assert [(s.step, s.steps_averaged) for s in spikes] == [(8, 3)]


def test_skip_names_the_target_replica_and_skipped_total_follows_the_lineage(tmp_path, capsys):
    """Invariant: dflash.logs names the target replica of each skipped batch, and checks the last
    skipped_total against the skips of the steps it descends from: a resume from step 4 forgets a
    skip at step 6 of the abandoned future, so 2 (not 3) skip records is no mismatch."""
    run = tmp_path / "run"
    recs = [{"kind": "start", "step": 0, "time": 0.0},
            {"kind": "skip", "step": 2, "batch_id": 1, "replica": 1, "reason": "non-finite loss", "time": 1.0},
            {"kind": "skip", "step": 6, "batch_id": 5, "replica": 0, "reason": "non-finite loss", "time": 2.0},
            {"kind": "start", "step": 4, "time": 10.0},
            {"kind": "skip", "step": 7, "batch_id": 6, "replica": 0, "reason": "non-finite gradient", "time": 11.0},
            {"kind": "train", "step": 8, "window": 4, "steps_averaged": 3, "loss": 1.0, "skipped_total": 2,
             "time": 12.0}]
    _write(run, recs)
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "  step 2 batch 1 from target[1]: non-finite loss" in out
    assert "warning: skipped_total" not in out
    recs[-1]["skipped_total"] = 1
    _write(run, recs)
    assert main([str(run)]) == 0
    assert "warning: skipped_total 1 != 2 skip records" in capsys.readouterr().out


def test_checkpoint_that_resume_would_reject_is_flagged(tmp_path):
    """Invariant: dflash.logs applies resume's rule: a checkpoint marked healthy whose tensors are
    NaN (or whose file is missing) is shown REJECTED with the reason, and resume=auto's pick is the
    previous one that passes."""
    import torch
    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    model = run / "checkpoints" / "step_00000100" / "model.safetensors"
    w = load_file(str(model))
    save_file({k: torch.full_like(v, float("nan")) for k, v in w.items()}, str(model))
    rep = analyse(run)
    ckpts = {c.name: c for c in rep.checkpoints}
    assert [c.name for c in rep.checkpoints if c.auto_resume] == ["step_00000050"]
    assert "non-finite weights" in ckpts["step_00000100"].problem
    assert "step_00000100: step 100, loss 4, REJECTED: non-finite weights" in render(rep)
    (run / "checkpoints" / "step_00000050" / "train_state.safetensors").unlink()
    rep = analyse(run)
    assert not any(c.auto_resume for c in rep.checkpoints)
    assert {c.name: c.problem for c in rep.checkpoints}["step_00000050"] == "train_state.safetensors missing"


def test_archived_lineages_are_counted_not_listed_as_incomplete(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    arch = run / "checkpoints" / "archive-20260101-000000"
    shutil.copytree(run / "checkpoints" / "step_00000050", arch / "step_00000050")
    rep = analyse(run)
    assert rep.archives == {"archive-20260101-000000": 1}
    assert all(not c.name.startswith("archive") for c in rep.checkpoints)


def test_damaged_checkpoints_say_what_is_wrong(tmp_path, capsys):
    """Regression (tester): a garbage ``meta.json`` was listed as ``incomplete (no meta.json)``, and a
    checkpoint without ``train_state.pt`` as ``REJECTED: train_state.pt missing, complete``.
    Invariant: each line says what is actually wrong and never calls a checkpoint lacking a file
    complete."""
    from dflash.checkpoint.health import META_UNREADABLE

    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    (run / "checkpoints" / "step_00000100" / "train_state.pt").unlink()
    garbage = run / "checkpoints" / "step_00000120"
    shutil.copytree(run / "checkpoints" / "step_00000050", garbage)
    (garbage / "meta.json").write_text("not json {")
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    lines = {ln.split(":")[0].strip(): ln for ln in out.splitlines() if ln.startswith("  step_000")}
    assert lines["step_00000120"] == f"  step_00000120: {META_UNREADABLE}"
    assert lines["step_00000100"].endswith("REJECTED: train_state.pt missing"), lines["step_00000100"]
    assert "complete" not in lines["step_00000100"]
    assert lines["step_00000050"].endswith("healthy, complete <- resume=auto picks this"), lines["step_00000050"]
    assert lines["step_00000200"] == "  step_00000200: incomplete (no meta.json)"
