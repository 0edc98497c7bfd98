"""``[drafter].activation_checkpointing``: the decoder layers recomputed in the backward give the
same loss and gradients as the stored activations, for the backbone and a variant with parts of
its own in every layer (DFlash2's convolutions)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from dflash.messages import LossInput
from dflash.model.drafter import DecoderLayer, DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target
from dflash.train.anchors import sample_anchors
from dflash.train.loss import LossConfig
from dflash.train.objective import compute_loss


@pytest.fixture(scope="module")
def batch():
    target = load_target(TargetConfig(preset="tiny", seed=11, vocab_size=64), "cpu", num_draft_layers=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 63, (2, 48), generator=g)
    pos = torch.arange(48)[None].expand(2, 48)
    doc, lm = torch.zeros(2, 48, dtype=torch.int32), torch.ones(2, 48, dtype=torch.bool)
    with torch.no_grad():
        feats, final = target(ids, pos, doc)
    x = LossInput(features=feats, input_ids=ids, loss_mask=lm, doc_ids=doc, position_ids=pos,
                  anchors=sample_anchors(lm, doc, 8, 4, g), final_hidden=final)
    return target, x


def _loss_and_grads(target, x, cfg: DrafterConfig, monkeypatch):
    """``(loss, {name: grad}, decoder-layer forwards run)`` of one step of a fresh seeded drafter."""
    d = DFlashDrafter(cfg.resolve(target.hf_config, target.layer_ids), seed=2)
    calls, forward = [0], DecoderLayer.forward

    def counted(self, *args):
        calls[0] += 1
        return forward(self, *args)

    monkeypatch.setattr(DecoderLayer, "forward", counted)
    out = compute_loss(d, target.shared_head(), x, LossConfig(label="target_argmax", weighting="none"))
    out.loss.backward()
    monkeypatch.setattr(DecoderLayer, "forward", forward)
    return out.loss.detach(), {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}, calls[0]


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_recomputed_layers_give_the_same_loss_and_gradients(batch, variant, monkeypatch):
    target, x = batch
    cfg = DrafterConfig(variant=variant, num_layers=2, block_size=4, mask_token_id=63)
    loss, grads, calls = _loss_and_grads(target, x, cfg, monkeypatch)
    loss_ck, grads_ck, calls_ck = _loss_and_grads(target, x, msgspec.structs.replace(cfg, activation_checkpointing=True),
                                                  monkeypatch)
    assert calls == 2 and calls_ck == 4  # every layer ran again in the backward: the switch is live
    torch.testing.assert_close(loss_ck, loss, rtol=0, atol=0)
    assert grads_ck.keys() == grads.keys() and grads
    for name, g in grads.items():
        torch.testing.assert_close(grads_ck[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_without_gradients_nothing_is_recomputed(batch):
    """Decoding and evaluation run under no_grad: the switch changes nothing there."""
    target, x = batch
    cfg = DrafterConfig(num_layers=2, block_size=4, mask_token_id=63, activation_checkpointing=True)
    d = DFlashDrafter(cfg.resolve(target.hf_config, target.layer_ids), seed=2)
    plain = DFlashDrafter(msgspec.structs.replace(d.cfg, activation_checkpointing=False), seed=2)
    with torch.no_grad():
        a = compute_loss(d, target.shared_head(), x, LossConfig(label="target_argmax", weighting="none")).loss
        b = compute_loss(plain, target.shared_head(), x, LossConfig(label="target_argmax", weighting="none")).loss
    assert torch.equal(a, b)
