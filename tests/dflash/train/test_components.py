"""The training step's components on their own: feature post-processing on either side, the
non-finite guard, the schedule, restoring an optimizer under a changed [train] table."""

from __future__ import annotations

import math

import pytest
import torch

from dflash.messages import Batch, TargetOutput
from dflash.model.features import FeaturePostprocess
from dflash.train.nonfinite import NonFiniteGuard
from dflash.train.optim import load_optimizer_state, lr_lambda, make_optimizer


def _target_output(layer_hidden: torch.Tensor) -> TargetOutput:
    ids = torch.zeros(1, 5, dtype=torch.long)
    b = Batch(seq=0, batch_id=7, epoch=0, input_ids=ids, loss_mask=ids.bool(), position_ids=ids,
              doc_ids=ids.int(), num_tokens=5, num_padding=0, anchors=torch.tensor([[0, -1]]))
    return TargetOutput(batch=b, layer_hidden=layer_hidden, final_hidden=None, replica=2, target_s=0.5)


def test_feature_noise_is_added_on_exactly_one_side_with_the_same_result():
    """postprocess_side = target | drafter: the noise is added once, by the side named, and both
    give the same DrafterInput; the other side leaves the features untouched."""
    h = torch.randn(1, 5, 12, generator=torch.Generator().manual_seed(0))
    got = {}
    for side in ("target", "drafter"):
        fp = FeaturePostprocess(noise=0.1, seed=3, side=side)
        at_target = fp.at_target(h, batch_id=7)
        assert (at_target is h) == (side == "drafter")
        got[side] = fp.at_drafter(_target_output(at_target))
    a, b = got["target"], got["drafter"]
    assert torch.equal(a.features, b.features) and not torch.equal(a.features, h)
    assert (a.replica, a.target_s, a.batch.batch_id) == (2, 0.5, 7)
    assert torch.equal(a.anchors, torch.tensor([[0, -1]]))
    x = a.loss_input()
    assert x.features is a.features and x.anchors is a.anchors and x.input_ids is a.batch.input_ids


def test_nonfinite_guard_counts_streaks_and_stops():
    g = NonFiniteGuard(max_streak=2, skipped_total=5)
    assert g.reason(1.0, 2.0) is None
    assert g.reason(float("nan"), 2.0) == "non-finite loss"
    assert g.reason(1.0, float("inf")) == "non-finite gradient"
    g.record("non-finite loss")
    assert (g.streak, g.skipped_total, g.exhausted) == (1, 6, False)
    g.record(None)
    assert (g.streak, g.skipped_total) == (0, 6)
    g.record("non-finite gradient"), g.record("non-finite gradient")
    assert g.exhausted
    msg = str(g.stop_error(step=9, batch_id=4, replica=1, reason="non-finite gradient", last=None))
    assert "2 consecutive non-finite steps" in msg and "batch 4 from target[1]" in msg
    assert "No healthy checkpoint" in msg and "\n" not in msg


def test_lr_schedule_warms_up_linearly_then_decays_to_the_floor():
    f = lr_lambda(warmup=4, total=14, min_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def _Train(lr: float):  # noqa: N802 (the real table, so that a key added later is never missing here)
    from dflash.train.config import TrainSection

    return TrainSection(lr=lr, betas=(0.9, 0.95), weight_decay=0.01, warmup_steps=2, min_lr_ratio=0.1)


def test_restored_optimizer_follows_the_runs_own_lr():
    """A checkpoint saved at lr 1e-3 resumed under lr 2e-3: same moments and schedule position, the
    new peak lr times the schedule's multiplier at that position."""
    model = torch.nn.Linear(3, 2)
    o = make_optimizer(model, _Train(1e-3), total_steps=10)
    for _ in range(3):
        model(torch.ones(1, 3)).sum().backward()
        o.step(), o.zero_grad(), o.schedule_step()
    state = o.state_dict()
    o2 = make_optimizer(model, _Train(2e-3), total_steps=10)
    load_optimizer_state(o2, state, _Train(2e-3))
    assert o2.sched.last_epoch == 3
    assert o2.lr == pytest.approx(2e-3 * lr_lambda(2, 10, 0.1)(3))
    assert o2.sched.get_last_lr() == [o2.lr]
    m1 = state["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(o2.opt.state_dict()["state"][0]["exp_avg"], m1)
