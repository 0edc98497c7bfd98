"""dflash.checkpoint: atomic background saves, retention, health, resume selection."""

from __future__ import annotations

import json
import math

import pytest
import torch
from dflash.checkpoint.resume import resolve_resume

from dflash.checkpoint import (
    Checkpointer,
    CheckpointError,
    is_healthy,
    list_checkpoints,
    load_train_state,
    read_meta,
    step_dir,
)


def _save(ck: Checkpointer, step: int, w: float = 1.0, loss: float = 1.0, **kw) -> None:
    ck.save(
        step=step,
        batch_id=step - 1,
        loss=loss,
        weights={"fc.weight": torch.full((2, 2), w)},
        train_state={"step": step, "optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}}, "scheduler": {},
                     "sampler": {"batch_id": step - 1}, "rng": {"torch": torch.zeros(4, dtype=torch.uint8)}},
        configs={"drafter_config.json": {"block_size": 4}, "target_config.json": {"preset": "tiny"}},
        **kw,
    )


def test_save_writes_complete_checkpoint(tmp_path):
    events = []
    ck = Checkpointer(tmp_path / "checkpoints", keep_last=3, config_hash="abc", on_event=events.append)
    _save(ck, 10, loss=2.5)
    ck.close()
    d = step_dir(tmp_path / "checkpoints", 10)
    assert is_healthy(d)
    meta = read_meta(d)
    assert meta["step"] == 10 and meta["loss"] == 2.5 and meta["config_hash"] == "abc" and meta["healthy"]
    assert json.loads((d / "drafter_config.json").read_text()) == {"block_size": 4}
    assert load_train_state(d)["step"] == 10
    assert events and events[0]["kind"] == "checkpoint" and events[0]["healthy"] is True


def test_snapshot_is_taken_at_save_time(tmp_path):
    """The weights written are those of the save() call, even if training changes them right after."""
    ck = Checkpointer(tmp_path, keep_last=3, config_hash="h")
    w = torch.zeros(3)
    ck.save(step=1, batch_id=0, loss=0.0, weights={"w": w}, train_state={}, configs={})
    w.add_(5.0)  # the next optimizer step mutates the parameter in place
    ck.close()
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(step_dir(tmp_path, 1) / "model.safetensors"))["w"], torch.zeros(3))


def test_retention_keeps_last_k(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=2, config_hash="h")
    for s in (1, 2, 3, 4):
        _save(ck, s)
    ck.close()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]


def test_retention_also_keeps_the_protected_step(tmp_path):
    """Invariant: the healthy checkpoint at the step ``protect()`` names (the best held-out step)
    survives retention beside the newest ``keep_last``; when it moves, the old one goes."""
    best = [2]
    ck = Checkpointer(tmp_path, keep_last=1, config_hash="h", protect=lambda: best[0])
    for s in (1, 2, 3, 4):
        _save(ck, s)
    ck.close()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000004"]
    best[0] = 5
    ck = Checkpointer(tmp_path, keep_last=1, config_hash="h", protect=lambda: best[0])
    for s in (5, 6):
        _save(ck, s)
    ck.close()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000005", "step_00000006"]


def test_nonfinite_weights_are_never_written(tmp_path):
    events = []
    ck = Checkpointer(tmp_path, keep_last=3, config_hash="h", on_event=events.append)
    _save(ck, 5, w=math.nan)
    ck.close()
    assert list_checkpoints(tmp_path) == []
    assert events[0]["healthy"] is False and "non-finite" in events[0]["reason"]


def test_stale_tmp_dirs_are_removed_and_ignored(tmp_path):
    (tmp_path / ".tmp-step_00000009").mkdir(parents=True)
    (tmp_path / ".tmp-step_00000009" / "model.safetensors").write_bytes(b"partial")
    Checkpointer(tmp_path, keep_last=1, config_hash="h").close()
    assert not (tmp_path / ".tmp-step_00000009").exists()


def test_resume_auto_picks_newest_healthy(tmp_path):
    root = tmp_path / "checkpoints"
    ck = Checkpointer(root, keep_last=5, config_hash="h")
    _save(ck, 1)
    _save(ck, 2)
    ck.close()
    # A newer directory without meta.json (a save interrupted by a crash) must be skipped ...
    (root / "step_00000003").mkdir()
    # ... and so must one marked unhealthy.
    bad = root / "step_00000004"
    bad.mkdir()
    (bad / "meta.json").write_text(json.dumps({"step": 4, "healthy": False}))
    assert resolve_resume(tmp_path, "auto") == root / "step_00000002"
    assert resolve_resume(tmp_path, "none") is None
    assert resolve_resume(tmp_path / "elsewhere", "auto") is None


def test_resume_explicit_path_must_be_healthy(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        resolve_resume(tmp_path, str(tmp_path / "nope"))
    (tmp_path / "half").mkdir()
    with pytest.raises(CheckpointError, match="cannot be used: meta.json is missing"):
        resolve_resume(tmp_path, str(tmp_path / "half"))


@pytest.mark.parametrize("name", ["model.safetensors", "train_state.safetensors"])
def test_resume_auto_skips_a_truncated_tensor_file(tmp_path, name):
    """Regression: a checkpoint whose safetensors file was truncated (disk full, partial copy)
    counted as healthy; resume auto must skip it and take the older intact one."""
    import os

    root = tmp_path / "checkpoints"
    ck = Checkpointer(root, keep_last=5, config_hash="h")
    _save(ck, 1)
    _save(ck, 2)
    ck.close()
    newest = root / "step_00000002"
    assert resolve_resume(tmp_path, "auto") == newest
    f = newest / name
    os.truncate(f, f.stat().st_size - 4)
    assert not is_healthy(newest)
    assert resolve_resume(tmp_path, "auto") == root / "step_00000001"
    with pytest.raises(CheckpointError, match=f"cannot be used: {name} is unreadable"):
        resolve_resume(tmp_path, str(newest))


# -- health of what is written: a checkpoint is healthy only if its recent steps trained -----------


def test_a_checkpoint_saved_during_a_nonfinite_streak_is_written_unhealthy(tmp_path):
    """Invariant: a checkpoint whose own step was skipped (a non-finite streak is running) or whose
    window has no finite loss is never healthy, so resume = "auto" passes over it; the one before
    stays the newest healthy."""
    events = []
    ck = Checkpointer(tmp_path, keep_last=5, config_hash="h", on_event=events.append)
    _save(ck, 2, loss=3.0, window_steps=2)
    _save(ck, 4, loss=2.5, window_steps=2, window_skipped=1, last_skipped=True)
    _save(ck, 6, loss=math.nan, window_steps=2, window_skipped=2)
    ck.close()
    metas = {p.name: read_meta(p) for p in list_checkpoints(tmp_path)}
    assert [m["healthy"] for m in metas.values()] == [True, False, False]
    assert "step 4 was skipped" in metas["step_00000004"]["reason"]
    assert "not finite" in metas["step_00000006"]["reason"]
    assert [e["healthy"] for e in events] == [True, False, False] and "reason" in events[1]
    assert ck.last_healthy == step_dir(tmp_path, 2)


def test_meta_carries_the_loss_and_skips_of_its_own_window(tmp_path):
    """Invariant: meta.json's loss is the one the saver passed for this checkpoint's window (not a
    stale earlier value), beside the window's size, its skips and the run's skipped_total."""
    ck = Checkpointer(tmp_path, keep_last=5, config_hash="h", lineage="L1")
    _save(ck, 4, loss=1.25, window_steps=4, window_skipped=1, skipped_total=3)
    ck.close()
    meta = read_meta(step_dir(tmp_path, 4))
    assert (meta["loss"], meta["window_steps"], meta["window_skipped"], meta["skipped_total"],
            meta["lineage"], meta["healthy"]) == (1.25, 4, 1, 3, "L1", True)


def test_nonfinite_optimizer_state_is_never_written(tmp_path):
    """Invariant: NaN optimizer moments never reach disk (like NaN weights)."""
    events = []
    ck = Checkpointer(tmp_path, keep_last=3, config_hash="h", on_event=events.append)
    ck.save(step=1, batch_id=0, loss=1.0, weights={"w": torch.ones(2)},
            train_state={"optimizer": {"state": {0: {"exp_avg_sq": torch.tensor([1.0, math.nan])}}}}, configs={})
    ck.close()
    assert list_checkpoints(tmp_path) == []
    assert events[0]["healthy"] is False and "/optimizer/state/0/exp_avg_sq" in events[0]["reason"]


# -- retention: only the current lineage's checkpoints are ever removed -----------------------------


def test_retention_never_deletes_another_lineage(tmp_path):
    """Invariant: retention only removes checkpoints of its own lineage: an older run's higher-step
    checkpoints in the same directory neither count towards keep_last nor push out the new run's."""
    old = Checkpointer(tmp_path, keep_last=2, config_hash="h", lineage="old")
    for s in (200, 300):
        _save(old, s)
    old.close()
    new = Checkpointer(tmp_path, keep_last=2, config_hash="h", lineage="new")
    for s in (10, 20, 30):
        _save(new, s)
    new.close()
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_00000020", "step_00000030", "step_00000200", "step_00000300"]


def test_retention_keeps_healthy_checkpoints_when_unhealthy_ones_pile_up(tmp_path):
    """Invariant: unhealthy checkpoints never push the last healthy ones out: keep_last counts
    healthy checkpoints; unhealthy ones are kept only when newer than the newest healthy one."""
    ck = Checkpointer(tmp_path, keep_last=1, config_hash="h")
    _save(ck, 1)
    _save(ck, 2, last_skipped=True)
    _save(ck, 3, last_skipped=True)
    _save(ck, 4)
    _save(ck, 5, last_skipped=True)
    ck.close()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]
    assert is_healthy(step_dir(tmp_path, 4)) and not is_healthy(step_dir(tmp_path, 5))


def test_mark_unhealthy_rewrites_meta(tmp_path):
    """Invariant: a checkpoint marked unhealthy after the fact is skipped by resume = "auto"."""
    from dflash.checkpoint import mark_unhealthy

    ck = Checkpointer(tmp_path / "checkpoints", keep_last=3, config_hash="h")
    _save(ck, 1)
    _save(ck, 2)
    ck.close()
    mark_unhealthy(step_dir(tmp_path / "checkpoints", 2), "the steps after it were non-finite")
    meta = read_meta(step_dir(tmp_path / "checkpoints", 2))
    assert meta["healthy"] is False and meta["reason"] == "the steps after it were non-finite"
    assert resolve_resume(tmp_path, "auto") == step_dir(tmp_path / "checkpoints", 1)
