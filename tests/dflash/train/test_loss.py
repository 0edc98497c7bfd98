"""dflash.train.loss / dflash.train.objective / dflash.train.acceptance against slow references written from the formulas."""

from __future__ import annotations

import math

import pytest
import torch

from dflash.messages import LossInput
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target
from dflash.train.acceptance import simulated_accepted_length, streak_lengths
from dflash.train.anchors import sample_anchors
from dflash.train.loss import (
    LossConfig,
    mixed_loss,
    needs_final_hidden,
    position_weights,
)
from dflash.train.objective import compute_loss

BS = 4


def loss_input(s, **kw) -> LossInput:
    """The fixture's batch as compute_loss's input (``kw`` replaces fields)."""
    fields = dict(features=s["feats"], input_ids=s["ids"], loss_mask=s["lm"], doc_ids=s["doc"],
                  position_ids=s["pos"], anchors=s["anchors"], final_hidden=s["final"])
    return LossInput(**{**fields, **kw})


def test_mixed_loss_matches_formula():
    g = torch.Generator().manual_seed(0)
    zd, zt = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    y = torch.randint(0, 11, (5,), generator=g)
    cfg = LossConfig(kl_weight=0.3, temperature=2.0)
    l, ce, kl = mixed_loss(cfg, zd, y, zt)
    for n in range(5):
        pd = [math.exp(v) for v in zd[n].tolist()]
        ce_ref = -math.log(pd[y[n]] / sum(pd))
        t = 2.0
        et = [math.exp(v / t) for v in zt[n].tolist()]
        ed = [math.exp(v / t) for v in zd[n].tolist()]
        p = [e / sum(et) for e in et]
        q = [e / sum(ed) for e in ed]
        kl_ref = t * t * sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q))
        assert ce[n].item() == pytest.approx(ce_ref, rel=1e-5)
        assert kl[n].item() == pytest.approx(kl_ref, rel=1e-4, abs=1e-6)
        assert l[n].item() == pytest.approx(0.7 * ce_ref + 0.3 * kl_ref, rel=1e-4)
    with pytest.raises(ValueError, match="target logits"):
        mixed_loss(cfg, zd, y, None)


def test_position_weights_match_formulas():
    q = torch.tensor([[0.5, 0.8, 0.1], [1.0, 0.0, 0.3]])
    w = position_weights(LossConfig(weighting="exp_decay", gamma=2.0), q)
    assert w[0].tolist() == pytest.approx([1.0, math.exp(-0.5), math.exp(-1.0)])
    w = position_weights(LossConfig(weighting="streak", alpha=0.2), q)
    assert w[0].tolist() == pytest.approx([1.0, 0.2 + 0.8 * 0.5, 0.2 + 0.8 * 0.5 * 0.8])
    assert w[1].tolist() == pytest.approx([1.0, 1.0, 0.2])
    assert position_weights(LossConfig(weighting="none"), q).eq(1).all()
    assert not needs_final_hidden(LossConfig()) and needs_final_hidden(LossConfig(kl_weight=0.1))
    assert needs_final_hidden(LossConfig(label="target_argmax"))


def test_dpace_weights_match_formula_and_skip_untrained_slots():
    q = torch.tensor([[0.5, 0.8, 0.1]])
    a = 0.25
    s1, s2, s3 = (0.75 * v + a for v in (0.5, 0.8, 0.1))
    w = position_weights(LossConfig(weighting="dpace", dpace_alpha=a), q)
    p1, p2, p3 = s1, s1 * s2, s1 * s2 * s3
    assert w[0].tolist() == pytest.approx([p1 + p2 + p3, p2 + p3, p3])
    # an untrained middle slot passes the product through (s = 1) and adds nothing to the sums
    mask = torch.tensor([[True, False, True]])
    w = position_weights(LossConfig(weighting="dpace", dpace_alpha=a), q, mask)
    assert w[0].tolist() == pytest.approx([s1 + s1 * s3, s1 * s3, s1 * s3])


def test_dpace_at_alpha_zero_is_the_gradient_of_the_expected_accepted_length():
    """w_j = d E[tau] / d log q_j with E[tau] = sum_j prod_{i<=j} q_i: the slots that the draft
    reaches only through slot j count toward slot j's weight."""
    g = torch.Generator().manual_seed(0)
    q = torch.rand(4, 7, generator=g) * 0.9 + 0.05
    logq = q.log().requires_grad_(True)
    expected = torch.cumprod(logq.exp(), dim=1).sum()
    (grad,) = torch.autograd.grad(expected, logq)
    torch.testing.assert_close(position_weights(LossConfig(weighting="dpace", dpace_alpha=0.0), q), grad)
    with pytest.raises(ValueError, match="dpace_alpha"):
        LossConfig(weighting="dpace", dpace_alpha=1.5)


def test_accepted_length_metrics():
    assert simulated_accepted_length([1.0, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    c = torch.tensor([[True, True, False], [False, True, True], [True, True, True]])
    v = torch.tensor([[True, True, True], [True, True, True], [True, False, True]])
    assert streak_lengths(c, v).tolist() == [2, 0, 1]


@pytest.fixture(scope="module")
def setup():
    tcfg = TargetConfig(preset="tiny", seed=5, vocab_size=200)
    target = load_target(tcfg, "cpu", num_draft_layers=2)
    head = target.shared_head()
    dcfg = DrafterConfig(num_layers=1, block_size=BS, mask_token_id=199).resolve(target.hf_config,
                                                                                 target.layer_ids)
    drafter = DFlashDrafter(dcfg, seed=1)
    g = torch.Generator().manual_seed(3)
    T = 40
    ids = torch.randint(0, 199, (2, T), generator=g)
    doc = torch.tensor([[0] * 25 + [1] * 15, [0] * 34 + [-1] * 6])
    pos = torch.stack([torch.cat([torch.arange(25), torch.arange(15)]),
                       torch.cat([torch.arange(34), torch.zeros(6, dtype=torch.long)])])
    lm = (torch.rand(2, T, generator=g) < 0.8) & (doc >= 0)
    feats, final = target(ids, pos, doc)
    anchors = sample_anchors(lm, doc, 12, BS, torch.Generator().manual_seed(0))
    return dict(target=target, head=head, drafter=drafter, ids=ids, doc=doc, pos=pos, lm=lm,
                feats=feats, final=final, anchors=anchors)


def slow_reference(s, cfg):
    """Every block run on its own; labels from the HF causal-LM logits (logits[t] predicts t+1)."""
    from dflash.model.attention import training_layout

    d, head, ids = s["drafter"], s["head"], s["ids"]
    num, den, ces, n = 0.0, 0.0, [], 0
    doc_logits = {}                                  # (row, doc start) -> HF logits of that document
    for b in range(ids.shape[0]):
        seg = s["doc"][b]
        for a in s["anchors"][b].tolist():
            if a < 0:
                continue
            lay = training_layout(s["pos"][b:b + 1], s["doc"][b:b + 1], torch.tensor([[a]]), BS)
            blk = torch.tensor([[[int(ids[b, a])] + [199] * (BS - 1)]])
            hid = d(s["feats"][b:b + 1], head.embed(blk), lay)[0, 0]
            where = (seg == seg[a]).nonzero()[:, 0]
            start, end = int(where[0]), int(where[-1]) + 1
            if (b, start) not in doc_logits:                              # full-vocab reference
                doc_logits[b, start] = s["target"].model(ids[b:b + 1, start:end]).logits[0]
            tgt_logits = doc_logits[b, start]
            for j in range(1, BS):
                if not bool(s["lm"][b, a + j]):
                    continue
                zd = head.logits(hid[j])
                zt = tgt_logits[a + j - 1 - start]                        # predicts token a + j
                y = int(zt.argmax()) if cfg.label == "target_argmax" else int(ids[b, a + j])
                l, ce, _ = mixed_loss(cfg, zd[None], torch.tensor([y]), zt[None])
                w = {"none": 1.0, "exp_decay": math.exp(-(j - 1) / cfg.gamma)}[cfg.weighting]
                num, den = num + w * float(l), den + w
                ces.append(float(ce))
                n += 1
    return num / den, sum(ces) / n, n


@pytest.mark.parametrize("cfg", [LossConfig(), LossConfig(label="target_argmax", weighting="none"),
                                 LossConfig(kl_weight=0.5, temperature=1.5, gamma=3.0)])
def test_compute_loss_matches_blockwise_reference(setup, cfg):
    """Invariant: slot j of the block at anchor a is scored against token a + j (target logits
    from position a + j - 1); packed rows and padding do not leak. An off-by-one fails here."""
    s = setup
    out = compute_loss(s["drafter"], s["head"], loss_input(s), cfg)
    with torch.no_grad():
        ref_loss, ref_ce, n = slow_reference(s, cfg)
    assert out.num_predictions == n > 20
    assert out.loss.item() == pytest.approx(ref_loss, rel=1e-4)
    assert out.ce.item() == pytest.approx(ref_ce, rel=1e-4)
    out.loss.backward()
    assert s["drafter"].fc.weight.grad is not None
    assert all(p.grad is None for p in s["head"].parameters())
    s["drafter"].zero_grad()


class _Oracle(torch.nn.Module):
    """A 'drafter' whose slot j output is the target's final hidden state at anchor + j - 1 + shift."""

    def __init__(self, base, final, anchors, shift):
        super().__init__()
        self.cfg, self.final, self.anchors, self.shift = base.cfg, final, anchors, shift
        self.p = torch.nn.Parameter(torch.zeros(()))

    def forward(self, features, block_emb, layout):
        B, A, bs, H = block_emb.shape
        T = self.final.shape[1]
        j = torch.arange(bs)
        idx = (self.anchors.clamp(min=0)[:, :, None] + j - 1 + self.shift).clamp(0, T - 1)
        return self.final[torch.arange(B)[:, None, None], idx] + self.p


@pytest.mark.parametrize("shift,perfect", [(0, True), (1, False), (-1, False)])
def test_label_alignment_oracle(setup, shift, perfect):
    """An oracle that outputs the target state predicting token a + j is 100% accurate; the same
    oracle off by one position is not."""
    s = setup
    oracle = _Oracle(s["drafter"], s["final"], s["anchors"], shift)
    out = compute_loss(oracle, s["head"], loss_input(s), LossConfig(label="target_argmax"))
    acc = out.acc_per_pos
    assert acc.shape == (BS - 1,)
    if perfect:
        assert acc.eq(1).all() and out.streak_mean.item() > 0
    else:
        assert acc.mean() < 0.75   # random targets repeat tokens, so a shift is sometimes right


def test_missing_final_hidden_is_a_clear_error(setup):
    s = setup
    with pytest.raises(ValueError, match="need_final=True"):
        compute_loss(s["drafter"], s["head"], loss_input(s, final_hidden=None), LossConfig(kl_weight=0.5))
