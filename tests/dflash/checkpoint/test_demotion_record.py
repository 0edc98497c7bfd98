"""A checkpoint demoted to unhealthy after it was written gets a metrics.jsonl record saying so."""

from __future__ import annotations

import torch

from dflash.checkpoint import Checkpointer, read_meta, step_dir
from dflash.observe.metrics_writer import MetricsLog
from dflash.records import read_records
from dflash.train.nonfinite import last_trusted_checkpoint


def test_demoting_a_checkpoint_writes_a_record_that_agrees_with_meta_json(tmp_path):
    """Invariant: when a non-finite streak right after a checkpoint demotes it (meta.json rewritten
    healthy: false), metrics.jsonl gets a later checkpoint record for that step with healthy: false,
    the reason and demoted: true, so the last record for each step agrees with meta.json."""
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    ck = Checkpointer(tmp_path / "checkpoints", keep_last=3, config_hash="h", on_event=metrics.write, lineage="L")
    for step in (2, 4):
        ck.save(step=step, batch_id=step, loss=1.0, weights={"fc.weight": torch.ones(2, 2)},
                train_state={"step": step, "optimizer": {}, "scheduler": {}, "sampler": {}, "rng": {}},
                configs={"drafter_config.json": {}, "target_config.json": {}})
        ck.wait()
    last = last_trusted_checkpoint(ck, step=6, streak=2, writer=True)  # steps 5..6 failed
    ck.close()
    metrics.close()
    assert last == step_dir(tmp_path / "checkpoints", 2)
    meta = read_meta(step_dir(tmp_path / "checkpoints", 4))
    recs, problems = read_records(tmp_path / "metrics.jsonl")
    assert not problems
    ckpts = [r for r in recs if r.kind == "checkpoint"]
    assert [(r.step, r.healthy) for r in ckpts] == [(2, True), (4, True), (4, False)]
    assert ckpts[-1].demoted is True and ckpts[-1].reason == meta["reason"] and meta["healthy"] is False
    final = {r.step: r.healthy for r in ckpts}
    assert final == {2: True, 4: False}
