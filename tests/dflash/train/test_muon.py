"""``[train].optimizer = "muon"``: Muon for the drafter's Linear matrices, AdamW for the rest, one
schedule shape for both, saved and restored with the checkpoint, and never mixed with AdamW state."""

from __future__ import annotations

import copy
import json

import msgspec
import pytest
import torch

from dflash.checkpoint import CheckpointError, check_optimizer
from dflash.model.drafter import DFlashDrafter
from dflash.train.config import TrainSection
from dflash.train.objective import compute_loss
from dflash.train.optim import load_optimizer_state, lr_lambda, make_optimizer, muon_parameters
from tests.dflash.train import test_perf_switches as switches
from tests.dflash.train.test_perf_switches import _cfg

batch = switches.batch  # the fixture: a tiny target's features and one batch of anchors (block size 4)
MUON = TrainSection(optimizer="muon", lr=2e-3, warmup_steps=2, weight_decay=0.01)


def _drafter(batch, **fields):
    return DFlashDrafter(msgspec.structs.replace(batch["dcfg"], **fields), seed=1)


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_muon_takes_the_linear_matrices_and_adamw_the_rest(batch, variant):
    d = _drafter(batch, variant=variant)
    o = make_optimizer(d, MUON, total_steps=10)
    muon = {id(p) for g in o.muon.param_groups for p in g["params"]}
    adamw = {id(p) for g in o.opt.param_groups for p in g["params"]}
    names = {id(p): n for n, p in d.named_parameters()}
    assert muon | adamw == set(names) and not muon & adamw  # every parameter, once
    assert {names[i] for i in muon} == {n for n, p in d.named_parameters()
                                        if n.endswith(("proj.weight", "projection.weight")) or n == "fc.weight"}
    assert all(p.ndim == 2 for p in muon_parameters(d))
    if variant == "dflash2":  # the codebooks are looked up by token id: AdamW's, like an embedding
        assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"} <= \
            {names[i] for i in adamw}


def _steps(d, o, b, n):
    losses = []
    for _ in range(n):
        out = compute_loss(d, b["head"], b["x"], switches.LossConfig(), lm_head_chunk=16)
        out.loss.backward()
        o.step(), o.zero_grad(), o.schedule_step()
        losses.append(out.loss.item())
    return losses


def test_muon_trains_and_its_state_resumes_bitwise(batch):
    """Loss falls on a fixed batch; a restore of the state after 3 steps continues exactly as the
    uninterrupted run (weights bitwise equal after the 5th step), at the run's own schedule."""
    d = _drafter(batch)
    o = make_optimizer(d, MUON, total_steps=10)
    losses = _steps(d, o, batch, 3)
    state = copy.deepcopy(o.state_dict())  # as train_state.pt holds it, apart from the live tensors
    saved = {k: v.clone() for k, v in d.state_dict().items()}
    losses += _steps(d, o, batch, 2)
    assert losses[-1] < losses[0], losses
    assert set(state) == {"optimizer", "scheduler", "muon", "muon_scheduler"}

    d2 = _drafter(batch)
    d2.load_state_dict(saved)
    o2 = make_optimizer(d2, MUON, total_steps=10)
    load_optimizer_state(o2, state, MUON)
    assert o2.muon_sched.last_epoch == 3 and o2.lr == pytest.approx(2e-3 * lr_lambda(2, 10, 0.1)(3))
    assert o2.muon.param_groups[0]["lr"] == o2.lr
    _steps(d2, o2, batch, 2)
    for k, v in d.state_dict().items():
        assert torch.equal(d2.state_dict()[k], v), k


def test_optimizer_state_never_crosses_over(batch, tmp_path):
    """AdamW state into a Muon run (or back) is refused: at start-up from the checkpoint's saved
    config (one line naming both and what to set), and by the restore itself."""
    d = _drafter(batch)
    adamw = make_optimizer(d, TrainSection(), total_steps=10)
    with pytest.raises(ValueError, match="trained with train.optimizer = 'adamw' and this run sets 'muon'"):
        load_optimizer_state(make_optimizer(d, MUON, total_steps=10), adamw.state_dict(), MUON)
    (tmp_path / "train_config.json").write_text(json.dumps({"train": {"optimizer": "muon"}}))
    check_optimizer(tmp_path, "muon")
    with pytest.raises(CheckpointError, match="trained with train.optimizer = 'muon', and this run sets 'adamw'"):
        check_optimizer(tmp_path, "adamw")
    (tmp_path / "train_config.json").write_text(json.dumps({"train": {}}))  # saved before the key: AdamW
    check_optimizer(tmp_path, "adamw")
    with pytest.raises(CheckpointError, match="set train.optimizer = 'adamw' to resume"):
        check_optimizer(tmp_path, "muon")


def test_config_hash_changes_only_when_muon_is_set():
    from dflash.run.config import config_hash

    base = config_hash(_cfg())
    assert config_hash(_cfg('train.optimizer="adamw"', "train.muon_momentum=0.95")) == base
    assert config_hash(_cfg('train.optimizer="muon"')) != base
