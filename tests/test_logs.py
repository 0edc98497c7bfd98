"""dflash.logs on a recorded run directory (tests/fixtures/runs/dflash_run) with planted events:
a loss spike at step 120, a skipped step 73 (batch 72), a 60 s gap over the step-100 checkpoint
write, a 45 s unexplained gap (steps 150 -> 160), an unhealthy and an incomplete checkpoint."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from dflash.logs import analyse, find_gaps, find_spikes, main

RUN = Path(__file__).parent / "fixtures" / "runs" / "dflash_run"


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
    assert "  step_00000150: step 150, loss 3.5, UNHEALTHY, complete" in out
    assert "  step_00000200: incomplete (no meta.json)" in out
    assert "step_00000100: step 100, loss 4, healthy, complete <- resume=auto picks this" in out


def test_json_report(capsys):
    assert main([str(RUN), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in data["spikes"]] == [120]
    assert data["gaps"][1]["cause"] == "stall"
    assert data["checkpoints"][3] == {"name": "step_00000200", "complete": False, "step": None,
                                      "loss": None, "healthy": None, "save_s": None,
                                      "auto_resume": False}


def test_missing_metrics_exits_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no metrics log at" in capsys.readouterr().err


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
