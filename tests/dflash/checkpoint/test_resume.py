"""dflash.checkpoint.resume: what resume loads is verified, a bad checkpoint falls back loudly, one lineage per
checkpoints/ directory, and a changed config is named key by key."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.checkpoint import (
    Checkpointer,
    CheckpointError,
    list_checkpoints,
    read_meta,
    step_dir,
)
from dflash.checkpoint.config_changes import config_changes
from dflash.run.config import added_later_keys
from dflash.checkpoint.resume import archive_foreign, choose, verify


def _save(ck: Checkpointer, step: int) -> None:
    ck.save(
        step=step, batch_id=step - 1, loss=1.0,
        weights={"fc.weight": torch.full((2, 2), float(step))},
        train_state={"step": step,
                     "optimizer": {"state": {0: {"exp_avg": torch.ones(2), "exp_avg_sq": torch.ones(2)}}},
                     "scheduler": {}, "sampler": {"batch_id": step - 1},
                     "rng": {"torch": torch.zeros(4, dtype=torch.uint8)}},
        configs={"drafter_config.json": {"block_size": 4}, "target_config.json": {"preset": "tiny"}},
    )


@pytest.fixture
def run_dir(tmp_path):
    """A run directory with healthy checkpoints at steps 1, 2 and 3 (lineage "L")."""
    ck = Checkpointer(tmp_path / "checkpoints", keep_last=5, config_hash="h", lineage="L")
    for s in (1, 2, 3):
        _save(ck, s)
    ck.close()
    return tmp_path


def _poison(path, file: str, key: str, value: float) -> None:
    tensors = load_file(str(path / file))
    tensors[key] = torch.full_like(tensors[key], value)
    save_file(tensors, str(path / file))


def _corrupt_nan_weights(p):
    _poison(p, "model.safetensors", "fc.weight", float("nan"))


def _corrupt_inf_weights(p):
    _poison(p, "model.safetensors", "fc.weight", float("inf"))


def _corrupt_nan_moments(p):
    _poison(p, "train_state.safetensors", "/optimizer/state/0/exp_avg_sq", float("nan"))


def _delete_train_state_tensors(p):
    (p / "train_state.safetensors").unlink()


def _truncate_train_state_pt(p):
    os.truncate(p / "train_state.pt", (p / "train_state.pt").stat().st_size // 2)


def _drop_tensor_from_train_state(p):
    save_file({"/unrelated": torch.ones(1)}, str(p / "train_state.safetensors"))


@pytest.mark.parametrize("corrupt, reason", [
    (_corrupt_nan_weights, "non-finite weights in model.safetensors (fc.weight)"),
    (_corrupt_inf_weights, "non-finite weights in model.safetensors (fc.weight)"),
    (_corrupt_nan_moments, "non-finite train state (/optimizer/state/0/exp_avg_sq)"),
    (_delete_train_state_tensors, "train_state.safetensors missing"),
    (_truncate_train_state_pt, "train_state.pt or train_state.safetensors is unreadable"),
    (_drop_tensor_from_train_state, "is not in train_state.safetensors"),
])
def test_auto_falls_back_from_a_corrupted_checkpoint_and_says_why(run_dir, corrupt, reason):
    """Invariant: resume verifies what it loads (every tensor finite, every file present and
    readable); auto falls back to the previous checkpoint that passes and reports the one it
    rejected with the reason, and an explicit path to it is an error naming the reason."""
    newest = step_dir(run_dir / "checkpoints", 3)
    corrupt(newest)
    got = choose(run_dir, "auto")
    assert got.path == step_dir(run_dir / "checkpoints", 2) and got.step == 2
    assert [p for p, _ in got.rejected] == [newest]
    assert reason in got.rejected[0][1]
    assert torch.equal(got.weights["fc.weight"], torch.full((2, 2), 2.0))  # what is loaded is what was checked
    with pytest.raises(CheckpointError, match="cannot be used: .*" + reason.split(" (")[0].replace(".", r"\.")):
        choose(run_dir, str(newest))


def test_verify_loads_weights_and_train_state(run_dir):
    """Invariant: a verified checkpoint hands over exactly the saved tensors and counters."""
    got = verify(step_dir(run_dir / "checkpoints", 3))
    assert got.step == 3 and got.lineage == "L" and got.meta["healthy"] is True
    assert torch.equal(got.train_state["optimizer"]["state"][0]["exp_avg"], torch.ones(2))


def test_auto_with_every_checkpoint_bad_starts_fresh(run_dir):
    for s in (1, 2, 3):
        _corrupt_nan_weights(step_dir(run_dir / "checkpoints", s))
    assert choose(run_dir, "auto") is None


def test_an_explicit_unreadable_checkpoint_names_the_healthy_one_to_give_instead(run_dir):
    """Invariant: --resume PATH to a checkpoint that fails verification names the nearest healthy
    checkpoint beside it as the one to pass instead."""
    newest = step_dir(run_dir / "checkpoints", 3)
    (newest / "meta.json").write_text("garbage")
    with pytest.raises(CheckpointError, match="cannot be used: meta.json is missing or unreadable") as err:
        choose(run_dir, str(newest))
    assert f"give --resume {step_dir(run_dir / 'checkpoints', 2)} instead" in str(err.value)


def test_an_explicit_unreadable_checkpoint_with_no_healthy_sibling_says_so(run_dir):
    """Invariant: when no checkpoint beside the refused one is healthy, the message says so and
    how to go on (another checkpoint, or a fresh start)."""
    for s in (1, 2, 3):
        (step_dir(run_dir / "checkpoints", s) / "meta.json").write_text("garbage")
    with pytest.raises(CheckpointError, match="cannot be used: meta.json is missing or unreadable") as err:
        choose(run_dir, str(step_dir(run_dir / "checkpoints", 3)))
    assert f"no healthy checkpoint beside it in {run_dir / 'checkpoints'}" in str(err.value)
    assert "--resume none" in str(err.value)


def test_fresh_start_archives_every_existing_checkpoint(run_dir):
    """Invariant: a fresh start never mixes with an old lineage: every checkpoint already in
    checkpoints/ moves (nothing is deleted) to checkpoints/archive-*/, with its rank_state files."""
    root = run_dir / "checkpoints"
    (root / "rank_state").mkdir()
    (root / "rank_state" / "step_00000003.rank1.pt").write_bytes(b"x")
    dest, moved = archive_foreign(root, None)
    assert moved == ["step_00000001", "step_00000002", "step_00000003"]
    assert list_checkpoints(root) == [] and dest.parent == root and dest.name.startswith("archive-")
    assert [p.name for p in list_checkpoints(dest)] == moved
    assert (dest / "rank_state" / "step_00000003.rank1.pt").is_file()
    assert choose(run_dir, "auto") is None  # archives are never resumed
    dest2, _ = archive_foreign(root, None)  # nothing left: nothing to do
    assert dest2 is None


def test_resume_archives_only_what_it_does_not_descend_from(run_dir):
    """Invariant: resuming from step S keeps S and the earlier checkpoints of its lineage, and moves
    aside the newer ones (a future this run rewrites) and those of another lineage."""
    root = run_dir / "checkpoints"
    other = Checkpointer(root, keep_last=5, config_hash="h", lineage="other")
    _save(other, 1)  # overwrites step 1 with another lineage's
    other.close()
    got = choose(run_dir, str(step_dir(root, 2)))
    dest, moved = archive_foreign(root, got)
    assert moved == ["step_00000001", "step_00000003"]
    assert [p.name for p in list_checkpoints(root)] == ["step_00000002"]
    assert read_meta(dest / "step_00000001")["lineage"] == "other"


def test_two_archives_in_the_same_second_do_not_collide(run_dir):
    root = run_dir / "checkpoints"
    first, _ = archive_foreign(root, None)
    ck = Checkpointer(root, keep_last=5, config_hash="h", lineage="M")
    _save(ck, 1)
    ck.close()
    second, _ = archive_foreign(root, None)
    assert first != second and len(list_checkpoints(first)) == 3 and len(list_checkpoints(second)) == 1


def test_config_changes_name_the_key_and_what_it_affects():
    """Invariant: a config change on resume is named key by key with what it changes (run.steps
    moves the cosine schedule, which the config hash alone never showed); keys that do not change
    training (out_dir, monitor, checkpoint cadence) are not reported."""
    old = {"run": {"steps": 40, "out_dir": "a", "seed": 0}, "data": {"tokens_per_batch": 512},
           "monitor": {"window": 10}, "train": {"lr": 1e-3, "num_anchors": 8},
           "process": [{"name": "target", "replicas": 1}]}
    new = {"run": {"steps": 80, "out_dir": "b", "seed": 0}, "data": {"tokens_per_batch": 1024},
           "monitor": {"window": 5}, "train": {"lr": 1e-3, "num_anchors": 16},
           "process": [{"name": "target", "replicas": 2}]}
    got = config_changes(old, new, added_later_keys())
    assert got == [
        "data.tokens_per_batch 512 -> 1024 (data order and batch shapes; the restored sampler position may no "
        "longer match)",
        "process.target.replicas 1 -> 2 (graph layout)",
        "run.steps 40 -> 80 (lr schedule: the cosine decay ends at run.steps)",
        "train.num_anchors 8 -> 16 (anchors)",
    ]
    assert config_changes(old, old, added_later_keys()) == []
    # a resume loads its own checkpoint (train.init_from is not read) and the memory check trains nothing
    moved = {**new, "run": {**new["run"], "memory_check": False}, "train": {**new["train"], "init_from": "/x"}}
    assert config_changes(new, moved, added_later_keys()) == []


def test_config_saved_with_drafter_num_anchors_is_compared_in_todays_layout():
    """Invariant: a checkpoint's train_config.json from before num_anchors moved from
    [drafter] to [train] compares equal to today's config with the same value, and a changed
    value is named under its new key."""
    before = {"run": {"steps": 40}, "drafter": {"num_layers": 1, "num_anchors": 64}, "train": {"lr": 3e-3}}
    now = {"run": {"steps": 40}, "drafter": {"num_layers": 1}, "train": {"lr": 3e-3, "num_anchors": 64}}
    assert config_changes(before, now, added_later_keys()) == []
    now["train"]["num_anchors"] = 32
    assert config_changes(before, now, added_later_keys()) == ["train.num_anchors 64 -> 32 (anchors)"]


@pytest.mark.parametrize("variant, change, says", [
    ("xpress", {"xpress_rank": 16}, "xpress_rank: checkpoint 32, config 16"),
    ("xpress", {"xpress_mlp_ratio": 3}, "xpress_mlp_ratio: checkpoint 2, config 3"),
    ("dflash2", {"selector_rank": 8}, "selector_rank: checkpoint 16, config 8"),
    ("dflash", {"intermediate_size": 96}, "intermediate_size: checkpoint"),
    ("dflash", {"block_size": 8}, "block_size: checkpoint 4, config 8"),
    ("dflash", {"confidence_head": True}, "confidence_head (loss.confidence = 'head'): checkpoint False, config True"),
    ("xpress", {"variant": "dflash"}, "variant: checkpoint 'xpress', config 'dflash' (drafter.variant)"),
])
def test_every_variants_shape_change_is_refused_naming_the_field(tmp_path, variant, change, says):
    """Invariant: a resume is refused when the run's drafter would hold tensors of other names or
    shapes than the checkpoint's, for every variant's fields alike (compared on the meta device,
    not from a list of keys), or another variant or block size; the line names each field that
    changes a shape. Fields that change no tensor (XPress's jacobi_passes, the kernels) pass.
    Regression: an XPress checkpoint resumed with another xpress_rank or xpress_mlp_ratio only
    warned, then failed after start-up in load_state_dict ("size mismatch for refiner_head.*")."""
    import msgspec

    from dflash.checkpoint.resume import check_architecture
    from dflash.model.drafter import DFlashDrafter, DrafterConfig
    from dflash.model.drafter_config import resolve_drafter_config
    from tests.dflash.export.test_export import TCFG
    from tests.helpers import save_checkpoint

    cfg = resolve_drafter_config(DrafterConfig(num_layers=1, block_size=4, variant=variant, xpress_rank=32,
                                               selector_rank=16, conv_group_size=8, mask_token_id=7), TCFG)
    save_checkpoint(tmp_path, DFlashDrafter(cfg, seed=0), cfg, TCFG)
    check_architecture(tmp_path, msgspec.structs.replace(cfg, jacobi_passes=1, kernels="liger", compile=True))
    with pytest.raises(CheckpointError, match="has another drafter shape") as err:
        check_architecture(tmp_path, msgspec.structs.replace(cfg, **change))
    assert says in str(err.value) and "--resume none" in str(err.value)
