"""The drafter and the shared head are never built while a target is being built in another thread.

transformers builds a model under process-wide patches (4.x's ``init_empty_weights`` swaps
``nn.Module.register_parameter`` for one that puts every new parameter on the meta device; every
release swaps ``torch.nn.init``'s functions for no-ops). The pipeline's stages set up in threads of
their own, so a drafter built beside a target's load got meta-device weights ("META device type not
an accelerator" in drafter[0], seen under transformers 4.56). The simulated patch below is 4.x's.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from torch import nn

from dflash.model.build_lock import BUILD_LOCK
from dflash.model.drafter import DFlashDrafter
from dflash.model.shared_head import SharedHead
from tests.dflash.export.test_export import make


@contextlib.contextmanager
def _params_on_meta():
    """What transformers 4.x's ``init_empty_weights`` does while it builds a model: every parameter
    registered anywhere in the process lands on the meta device."""
    original = nn.Module.register_parameter

    def on_meta(module, name, param):
        original(module, name, param)
        if param is not None:
            kw = {"requires_grad": param.requires_grad}
            module._parameters[name] = nn.Parameter(module._parameters[name].to("meta"), **kw)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _build_beside_a_target_build(build):
    """Run ``build()`` in a thread while another thread holds the build lock under the patch, as
    ``load_target`` does; returns (whether ``build`` waited for the lock, what it built)."""
    inside, release, built = threading.Event(), threading.Event(), {}

    def target_build():
        with BUILD_LOCK, _params_on_meta():
            inside.set()
            release.wait(10)

    loader = threading.Thread(target=target_build)
    loader.start()
    assert inside.wait(10)
    builder = threading.Thread(target=lambda: built.update(module=build()))
    builder.start()
    builder.join(0.5)
    waited = builder.is_alive()
    release.set()
    loader.join(10)
    builder.join(10)
    return waited, built["module"]


def test_the_simulated_patch_does_break_a_drafter_build():
    """Negative control: a drafter built under the patch, with no lock between them, fails as
    drafter[0] did (its seeded init makes a generator on its weights' device, meta)."""
    cfg = make().cfg
    with _params_on_meta(), pytest.raises(RuntimeError, match="META device"):
        DFlashDrafter(cfg, seed=0)


def test_a_drafter_built_beside_a_target_build_waits_and_gets_real_weights():
    cfg = make().cfg
    want = DFlashDrafter(cfg, seed=0).state_dict()
    waited, d = _build_beside_a_target_build(lambda: DFlashDrafter(cfg, seed=0))
    assert waited
    got = d.state_dict()
    assert not any(p.is_meta for p in d.parameters())
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_a_shared_head_built_beside_a_target_build_waits_and_keeps_its_weights():
    embed, head = torch.randn(32, 8), torch.randn(32, 8)
    waited, h = _build_beside_a_target_build(lambda: SharedHead(embed, head))
    assert waited
    assert torch.equal(h.embed_tokens.weight, embed) and torch.equal(h.lm_head.weight, head)
