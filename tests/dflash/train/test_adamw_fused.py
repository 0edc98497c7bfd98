"""``[train].adamw_fused``: torch's fused AdamW kernel makes the same update as the default
``foreach`` kernels, and a resume may switch between them."""

from __future__ import annotations

import copy

import torch

from dflash.model.drafter import DFlashDrafter
from dflash.train.config import TrainSection
from dflash.train.optim import load_optimizer_state, make_optimizer
from tests.dflash.train import test_perf_switches as switches

batch = switches.batch  # the fixture: a tiny target's drafter config (block size 4)


def _steps(d: DFlashDrafter, o, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in d.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        o.step()
        o.zero_grad()
        o.schedule_step()


def test_fused_adamw_makes_the_foreach_update_and_resumes_across_kernels(batch):
    base = DFlashDrafter(batch["dcfg"], seed=1)
    fused_cfg, foreach_cfg = (TrainSection(lr=1e-2, weight_decay=0.1, adamw_fused=f) for f in (True, False))
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa, ob = make_optimizer(a, fused_cfg, total_steps=10), make_optimizer(b, foreach_cfg, total_steps=10)
    assert oa.opt.param_groups[0]["fused"] is True and not ob.opt.param_groups[0]["fused"]
    _steps(a, oa, 3, seed=0)
    _steps(b, ob, 3, seed=0)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert not torch.equal(pa, base.state_dict()[name])                   # the steps moved it
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7, msg=name)
    # a foreach checkpoint resumed with the fused kernel, and back: the same next update
    c = copy.deepcopy(b)
    oc = make_optimizer(c, fused_cfg, total_steps=10)
    load_optimizer_state(oc, ob.state_dict(), fused_cfg)
    assert oc.opt.param_groups[0]["fused"] is True
    d = copy.deepcopy(a)
    od = make_optimizer(d, foreach_cfg, total_steps=10)
    load_optimizer_state(od, oa.state_dict(), foreach_cfg)
    assert not od.opt.param_groups[0]["fused"]
    assert all(st["step"].device.type == "cpu" for st in od.opt.state.values())
    _steps(c, oc, 1, seed=1)
    _steps(d, od, 1, seed=1)
    for (name, pc), pd in zip(c.named_parameters(), d.parameters()):
        torch.testing.assert_close(pc, pd, rtol=1e-5, atol=1e-7, msg=name)
