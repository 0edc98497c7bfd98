"""A drafter loaded from a checkpoint decodes eagerly, whatever its run trained with.

A run may train with ``[drafter].compile = true``; a decode is batch 1 with a context that grows
every verify step, so a compiled drafter recompiles at each new length (on an H100 against
SmolLM2-135M, ``dflash.eval`` was found inside dynamo's tracer, not decoding). Every reader of a
checkpoint (``dflash.eval``, ``dflash.export``, the decode benchmarks) goes through
:func:`dflash.checkpoint.model_files.load_drafter`, so that is where compile is turned off.
"""

from __future__ import annotations

import msgspec
import torch

from dflash.checkpoint.model_files import load_drafter
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target
from tests.helpers import save_checkpoint


def test_a_drafter_trained_compiled_loads_eager_with_the_same_weights(tmp_path):
    tc = TargetConfig(preset="tiny", dtype="float32")
    target = load_target(tc, "cpu", 1)
    dc = DrafterConfig(num_layers=1, block_size=4, mask_token_id=127, compile=True).resolve(
        target.hf_config, target.layer_ids)
    trained = DFlashDrafter(dc, seed=0)
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in trained.layers)  # control
    save_checkpoint(tmp_path, trained, dc, tc)

    drafter, cfg, _ = load_drafter(tmp_path)
    assert cfg.compile and not drafter.cfg.compile  # the record says how it trained; the module decodes eager
    assert all(getattr(layer, "_compiled_call_impl", None) is None for layer in drafter.layers)
    want = trained.state_dict()
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, want[k]), k
    # the recorded config still says how it was trained, for resume
    assert msgspec.json.decode((tmp_path / "drafter_config.json").read_bytes())["compile"] is True
