"""A packed plan's empty filler rows (dflash.data.batching) through the target, anchors and loss.

The epoch's last packed batch is filled up to ``packed_rows`` rows with empty rows (all padding), so
a compiled stage sees one shape all epoch. Invariant: such a row changes nothing but the shape:
the target's features stay finite, it draws no anchor, and the loss (a mean over trained slots) is
finite and equal to the loss of the same batch without it, for DFlash and DFlash2, on the
sync-free and the masked path.
"""

from __future__ import annotations

import pytest
import torch

from dflash.data import DataConfig, Sampler, TokenizedDataset
from dflash.messages import LossInput
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target
from dflash.train.anchors import sample_anchors
from dflash.train.loss import LossConfig
from dflash.train.objective import compute_loss

pytestmark = pytest.mark.timeout(120)

BS, PAD, ROWS, LENGTH = 4, 0, 4, 32
D2 = dict(variant="dflash2", selector_rank=8, selector_top_k=6, conv_group_size=16)


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(preset="tiny", seed=5, vocab_size=200), "cpu", num_draft_layers=2)


@pytest.fixture(scope="module")
def last_batch():
    """The last batch of a packed epoch: 6 rows of <= 32 tokens (window 1: one conversation per
    row), 4 rows per batch, so the last batch is 2 real rows and 2 filler rows."""
    g = torch.Generator().manual_seed(0)
    lengths = [30, 28, 31, 25, 29, 27]
    ids = [torch.randint(1, 199, (n,), generator=g).tolist() for n in lengths]
    masks = [[int(j > 3) for j in range(n)] for n in lengths]           # a prompt, then the reply
    ds = TokenizedDataset.from_sequences(ids, masks, key="filler")
    cfg = DataConfig(strategy="packed", tokens_per_batch=ROWS * LENGTH, packed_rows=ROWS, pack_window=1, seed=3)
    s = Sampler(ds, cfg, pad_id=PAD, max_epochs=1)
    batches = list(s)
    assert len(batches) == 2 and {tuple(b.input_ids.shape) for b in batches} == {(ROWS, LENGTH)}
    return batches[-1]


def loss_inputs(target, b) -> tuple[LossInput, LossInput]:
    """(the batch with its filler rows, the batch of its real rows only), each through the target."""
    real = b.doc_ids.ge(0).any(1)
    assert real.tolist() == [True, True, False, False]
    anchors = sample_anchors(b.loss_mask, b.doc_ids, 8, BS, torch.Generator().manual_seed(1))
    assert (anchors[~real] == -1).all() and (anchors[real] >= 0).any()

    def make(rows):
        ids, pos, doc, lm = b.input_ids[rows], b.position_ids[rows], b.doc_ids[rows], b.loss_mask[rows]
        with torch.no_grad():
            feats, final = target(ids, pos, doc)
        assert torch.isfinite(feats).all() and torch.isfinite(final).all()
        return LossInput(features=feats, input_ids=ids, loss_mask=lm, doc_ids=doc, position_ids=pos,
                         anchors=anchors[rows], final_hidden=final)

    return make(slice(None)), make(real)


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
@pytest.mark.parametrize("sync_free", [True, False])
@pytest.mark.parametrize("cfg", [LossConfig(), LossConfig(kl_weight=0.4, tv_weight=0.3, conf_weight=0.5)])
def test_filler_rows_leave_the_loss_unchanged_and_finite(target, last_batch, variant, sync_free, cfg):
    full, real = loss_inputs(target, last_batch)
    extra = D2 if variant == "dflash2" else {}
    dcfg = DrafterConfig(num_layers=1, block_size=BS, mask_token_id=199, **extra)
    d = DFlashDrafter(dcfg.resolve(target.hf_config, target.layer_ids), seed=1)
    head = target.shared_head()
    out = compute_loss(d, head, full, cfg, sync_free=sync_free)
    assert torch.isfinite(out.loss) and int(out.num_predictions) > 0
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    d.zero_grad(set_to_none=True)
    ref = compute_loss(d, head, real, cfg, sync_free=sync_free)
    ref.loss.backward()
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-5)
    assert out.ce.item() == pytest.approx(ref.ce.item(), rel=1e-5)
    assert (int(out.num_blocks), int(out.num_predictions)) == (int(ref.num_blocks), int(ref.num_predictions))
    torch.testing.assert_close(out.acc_per_pos, ref.acc_per_pos, equal_nan=True)
    for n, p in d.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
