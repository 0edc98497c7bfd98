"""dflash.pretrain: the shipped target's recipe writes a directory every real-model path loads."""

from __future__ import annotations

import json

import numpy as np
import torch

from dflash.pretrain import main, split_conversations


def test_holdout_split_is_disjoint_complete_and_seeded():
    """Invariant: the held-out conversations never enter training, together they are all of them,
    and the split is a pure function of the seed."""
    train, held = split_conversations(1000, 0.05, seed=0)
    assert len(held) == 50 and not set(train) & set(held) and len(train) + len(held) == 1000
    assert np.array_equal(held, split_conversations(1000, 0.05, seed=0)[1])
    assert not np.array_equal(held, split_conversations(1000, 0.05, seed=1)[1])


def test_pretrained_directory_loads_as_a_target_and_records_its_run(tmp_path):
    """Invariant (no special case for the shipped target): what dflash.pretrain writes is an
    ordinary local Hugging Face directory that [target].path loads, tokenizer included, with
    the command, the held-out loss and the held-out record indices recorded beside it."""
    out = tmp_path / "target"
    assert main(["-o", str(out), "--hidden", "64", "--layers", "3", "--kv-heads", "1", "--seq-len", "64",
                 "--batch", "4", "--steps", "6", "--eval-every", "3", "--warmup", "2",
                 "--max-conversations", "40", "--device", "cpu"]) == 0
    rec = json.loads((out / "training.json").read_text())
    assert rec["steps_done"] == 6 and [c["step"] for c in rec["curve"]] == [3, 6]
    assert np.isfinite(rec["heldout_loss"]) and rec["command"].startswith("python -m dflash.pretrain -o")
    held = json.loads((out / "heldout.json").read_text())["record_indices"]
    assert len(held) == 2 and all(isinstance(i, int) for i in held)
    from dflash.data import load_tokenizer, tokenizer_info
    from dflash.model.target import TargetConfig, load_target

    tok = load_tokenizer(str(out))
    assert tokenizer_info(tok).vocab_size == 4096
    target = load_target(TargetConfig(path=str(out)), "cpu", num_draft_layers=1, need_final=True)
    ids = torch.tensor([tok("hello there", add_special_tokens=False)["input_ids"]])
    pos = torch.arange(ids.shape[1])[None]
    feats, final = target(ids, pos, torch.zeros_like(pos), need_final=True)
    assert feats.shape == (1, ids.shape[1], 64) and torch.isfinite(final).all()
    assert oct((out / "model.safetensors").stat().st_mode & 0o777) == "0o644"
