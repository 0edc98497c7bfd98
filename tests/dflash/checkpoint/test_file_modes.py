"""Checkpoint files get the mode open() gives (0644 under umask 022), not safetensors' 0600, so the
user's group can read them (the export has its own check in test_export.py)."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from dflash.checkpoint import Checkpointer, step_dir


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_every_checkpoint_file_follows_the_umask(tmp_path, umask):
    """Invariant: every file of a checkpoint has mode 0o666 & ~umask (0644 for 022, 0600 for 077)."""
    old = os.umask(umask)  # before the writer thread exists
    try:
        ck = Checkpointer(tmp_path / "checkpoints", keep_last=2, config_hash="h")
        ck.save(step=3, batch_id=2, loss=1.0, weights={"fc.weight": torch.ones(2, 2)},
                train_state={"step": 3, "optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}}},
                configs={"drafter_config.json": {"block_size": 4}})
        ck.close()
    finally:
        os.umask(old)
    d = step_dir(tmp_path / "checkpoints", 3)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()}
    assert {"model.safetensors", "train_state.safetensors", "train_state.pt", "meta.json"} <= set(modes)
    assert set(modes.values()) == {0o666 & ~umask}, modes
