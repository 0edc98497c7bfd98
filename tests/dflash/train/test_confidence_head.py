"""DSpark's confidence head ([loss].confidence = "head"): the term's formula and its float64
gradient, its place in every loss path, the head carried by checkpoints and left out of exports,
the config wiring, and a short training where the head learns which slots the target accepts."""

from __future__ import annotations

import math
import os

import msgspec
import pytest
import torch

from dflash.errors import ConfigError
from dflash.model.confidence_head import ConfidenceHead
from dflash.model.drafter import DFlashDrafter
from dflash.train.loss import (
    LossConfig,
    accept_probability,
    head_confidence_term,
    mixed_loss,
    needs_final_hidden,
    tv_term,
)
from dflash.train.objective import compute_loss
from tests.dflash.eval.test_proven_drafter import trained_target  # noqa: F401 - the fixture
from tests.dflash.train.test_loss import BS, loss_input
from tests.dflash.train.test_loss import setup as blockwise_setup  # noqa: F401 - the fixture
from tests.dflash.train.test_step_sync import (
    run_loss,
    setup,  # noqa: F401 - the fixture
)
from tests.helpers import save_checkpoint

pytestmark = pytest.mark.timeout(300)

HEAD = LossConfig(label="target_argmax", tv_weight=0.9, conf_weight=1.0, confidence="head")
HEAD_CFGS = [HEAD, LossConfig(conf_weight=0.5, confidence="head", weighting="streak", temperature=1.5),
             LossConfig(kl_weight=0.3, conf_weight=2.0, confidence="head", weighting="none")]


def with_head(drafter_or_cfg, seed=1):
    cfg = getattr(drafter_or_cfg, "cfg", drafter_or_cfg)
    return DFlashDrafter(msgspec.structs.replace(cfg, confidence_head=True), seed=seed)


def _logits(n=6, v=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(n, v, generator=g), 3 * torch.randn(n, v, generator=g), torch.randn(n, generator=g)


# -- the term --------------------------------------------------------------------------------------

def test_head_term_is_dspark_bce_against_one_minus_tv():
    """Each slot's term is -(c* log c + (1 - c*) log(1 - c)) with c = sigmoid(s) and
    c* = 1 - 0.5 * sum |p^D - p^T| (DSpark eqs. 8 and 11), written out in Python floats."""
    zd, zt, s = _logits()
    t = 1.3
    acc = accept_probability(zd, zt, t)
    conf = head_confidence_term(s, acc)
    for n in range(zd.shape[0]):
        ed, et = [math.exp(v / t) for v in zd[n].tolist()], [math.exp(v / t) for v in zt[n].tolist()]
        c_star = 1 - 0.5 * sum(abs(a / sum(ed) - b / sum(et)) for a, b in zip(ed, et))
        c = 1 / (1 + math.exp(-float(s[n])))
        assert acc[n].item() == pytest.approx(c_star, rel=1e-5, abs=1e-7)
        assert conf[n].item() == pytest.approx(-(c_star * math.log(c) + (1 - c_star) * math.log(1 - c)), rel=1e-5)
    with pytest.raises(ValueError, match="one value per slot"):
        head_confidence_term(s[:3], acc)


def test_the_label_is_not_differentiated_and_the_head_logit_gradient_matches_float64():
    """Invariant (DeepSpec detaches the label): the head term sends no gradient to the drafter's
    logits through c*; its gradient in the head's logit, sigmoid(s) - c*, matches float64."""
    zd, zt, s = _logits(seed=1)
    zd = zd.requires_grad_(True)
    s32 = s.clone().requires_grad_(True)
    head_confidence_term(s32, accept_probability(zd, zt, 1.0)).sum().backward()
    assert zd.grad is None
    s64 = s.double().requires_grad_(True)
    c_star = 1 - 0.5 * (torch.softmax(zd.detach().double(), -1) - torch.softmax(zt.double(), -1)).abs().sum(-1)
    (-(c_star * torch.sigmoid(s64).log() + (1 - c_star) * (1 - torch.sigmoid(s64)).log())).sum().backward()
    torch.testing.assert_close(s32.grad.double(), s64.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(s64.grad, torch.sigmoid(s64.detach()) - c_star, rtol=1e-9, atol=1e-12)


def test_tv_alone_is_expressible_and_is_the_tv_term():
    """tv_weight = 1 (CE weight 0), conf_weight = 0: the per-slot loss is TV, nothing else."""
    zd, zt, _ = _logits(seed=2)
    y = torch.zeros(zd.shape[0], dtype=torch.long)
    l, _, _ = mixed_loss(LossConfig(tv_weight=1.0), zd, y, zt)
    torch.testing.assert_close(l, tv_term(zd, zt, 1.0), rtol=0, atol=0)


def test_mixed_loss_leaves_the_head_term_to_the_caller():
    """With confidence = "head" mixed_loss neither adds the top-1 stand-in nor needs a head."""
    zd, zt, _ = _logits(seed=3)
    y = zd.argmax(-1)
    l_head, _, _ = mixed_loss(HEAD, zd, y, zt)
    l_none, _, _ = mixed_loss(msgspec.structs.replace(HEAD, conf_weight=0.0, confidence="top1"), zd, y, zt)
    torch.testing.assert_close(l_head, l_none, rtol=0, atol=0)


def test_config_errors_and_needs():
    with pytest.raises(ValueError, match=r"conf_weight > 0"):
        LossConfig(confidence="head")
    assert needs_final_hidden(LossConfig(conf_weight=1.0, confidence="head"))
    assert not needs_final_hidden(LossConfig(conf_weight=1.0))


# -- in the loss paths ------------------------------------------------------------------------------

def test_head_term_enters_each_slot_as_the_blockwise_reference_says(blockwise_setup):  # noqa: F811
    """Invariant: slot j's head term reads slot j's hidden state and the label 1 - TV of slot j's
    draft and target logits (target position a + j - 1), added to that slot's loss."""
    from dflash.model.attention import training_layout

    s = blockwise_setup
    d = with_head(s["drafter"])
    cfg = msgspec.structs.replace(HEAD, weighting="none")
    out = compute_loss(d, s["head"], loss_input(s), cfg)
    num, n = 0.0, 0
    with torch.no_grad():
        for b in range(s["ids"].shape[0]):
            seg = s["doc"][b]
            for a in s["anchors"][b].tolist():
                if a < 0:
                    continue
                lay = training_layout(s["pos"][b:b + 1], s["doc"][b:b + 1], torch.tensor([[a]]), BS)
                blk = torch.tensor([[[int(s["ids"][b, a])] + [199] * (BS - 1)]])
                hid = d(s["feats"][b:b + 1], s["head"].embed(blk), lay)[0, 0]
                start = int((seg == seg[a]).nonzero()[0, 0])
                tgt = s["target"].model(s["ids"][b:b + 1, start:int((seg == seg[a]).nonzero()[-1, 0]) + 1]).logits[0]
                for j in range(1, BS):
                    if not bool(s["lm"][b, a + j]):
                        continue
                    zd, zt = s["head"].logits(hid[j])[None], tgt[a + j - 1 - start][None]
                    l, _, _ = mixed_loss(cfg, zd, zt.argmax(-1), zt)
                    conf = head_confidence_term(d.confidence_head(hid[j][None]), accept_probability(zd, zt, 1.0))
                    num, n = num + float(l + cfg.conf_weight * conf), n + 1
    assert out.num_predictions == n > 20
    assert out.loss.item() == pytest.approx(num / n, rel=1e-4)


@pytest.mark.parametrize("cfg", HEAD_CFGS)
def test_every_loss_path_gives_the_same_loss_and_gradients_with_the_head(setup, cfg):  # noqa: F811
    """Invariant: masked, fixed-shape and chunked LM-head paths agree on the loss and on every
    gradient, the head's included (and the head does get one)."""
    masked, g_masked = run_loss(setup, cfg, drafter=with_head(setup["dcfg"]), sync_free=False)
    fixed, g_fixed = run_loss(setup, cfg, drafter=with_head(setup["dcfg"]), sync_free=True)
    chunked, g_chunked = run_loss(setup, cfg, drafter=with_head(setup["dcfg"]), sync_free=True, lm_head_chunk=7)
    assert g_masked["confidence_head.proj.weight"].abs().max() > 0
    for other, g_other in ((fixed, g_fixed), (chunked, g_chunked)):
        torch.testing.assert_close(other.loss, masked.loss, rtol=1e-5, atol=1e-7)
        assert g_other.keys() == g_masked.keys()
        for name, g in g_masked.items():
            torch.testing.assert_close(g_other[name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_head_config_without_a_head_is_refused(setup):  # noqa: F811
    with pytest.raises(ValueError, match="drafter.confidence_head = true"):
        run_loss(setup, HEAD)


# -- the drafter, checkpoint and export ---------------------------------------------------------

def test_a_head_leaves_the_backbone_init_and_hidden_states_unchanged(setup):  # noqa: F811
    """Invariant: the head is drawn after the backbone, so a drafter with a head has the same
    backbone weights (and so the same hidden states) as one without, for the same seed."""
    plain, headed = DFlashDrafter(setup["dcfg"], seed=1), with_head(setup["dcfg"])
    p, h = plain.state_dict(), headed.state_dict()
    assert set(h) - set(p) == {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    for k, v in p.items():
        assert torch.equal(h[k], v), k
    assert isinstance(headed.confidence_head, ConfidenceHead) and headed.confidence_head.proj.bias.eq(0).all()


def test_checkpoint_and_optimizer_carry_the_head(tmp_path, setup):  # noqa: F811
    from dflash.checkpoint.model_files import load_drafter
    from dflash.model.target import TargetConfig
    from dflash.train.config import TrainSection
    from dflash.train.optim import make_optimizer

    d = with_head(setup["dcfg"])
    with torch.no_grad():
        d.confidence_head.proj.bias.fill_(0.25)
    o = make_optimizer(d, TrainSection(), 10)
    assert any(p is d.confidence_head.proj.weight for p in o.params)
    save_checkpoint(tmp_path, d, d.cfg, TargetConfig(preset="tiny", seed=5, vocab_size=200))
    back, cfg, _ = load_drafter(tmp_path)
    assert cfg.confidence_head
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_resume_refuses_a_checkpoint_whose_head_differs(tmp_path, setup):  # noqa: F811
    from dflash.checkpoint.resume import CheckpointError, check_architecture
    from dflash.model.target import TargetConfig

    d = DFlashDrafter(setup["dcfg"], seed=1)
    save_checkpoint(tmp_path, d, d.cfg, TargetConfig(preset="tiny", seed=5, vocab_size=200))
    check_architecture(tmp_path, d.cfg)
    with pytest.raises(CheckpointError, match="confidence_head"):
        check_architecture(tmp_path, msgspec.structs.replace(d.cfg, confidence_head=True))


def test_export_leaves_the_head_out_and_loads_with_no_missing_or_unexpected_key(tmp_path):
    """Invariant: the export of a drafter with a head is that of the same drafter without it:
    no confidence_head key, our loader and z-lab's DFlashDraftModel (when ZLAB_DFLASH_PATH is set)
    take it with no missing or unexpected key."""
    from safetensors.torch import load_file

    from dflash.export import export_drafter, load_exported
    from tests.dflash.export.test_export import make
    from tests.zlab import ENV, zlab_model

    plain = make()
    headed = with_head(plain, seed=3).eval()
    export_drafter(headed, tmp_path / "h", torch.float32)
    export_drafter(plain, tmp_path / "p", torch.float32)
    got, want = load_file(str(tmp_path / "h" / "model.safetensors")), load_file(str(tmp_path / "p" / "model.safetensors"))
    assert not [k for k in got if k.startswith("confidence_head")]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    _, cfg = load_exported(tmp_path / "h")
    assert not cfg.confidence_head
    if os.environ.get(ENV):
        _, info = zlab_model().DFlashDraftModel.from_pretrained(str(tmp_path / "h"), output_loading_info=True,
                                                                dtype=torch.float32)
        assert (set(info["missing_keys"]), set(info["unexpected_keys"])) == (set(), set())


# -- the run's wiring --------------------------------------------------------------------------------

def test_the_run_adds_the_head_from_the_loss_and_keeps_old_hashes():
    """Invariant: loss.confidence = "head" is the one switch (the resolved drafter gets the head);
    drafter.confidence_head set by hand alone is one config error; files without the head hash as
    before it existed, and a pre-head train_config.json compares equal."""
    from dflash.checkpoint.config_changes import config_changes
    from dflash.run.config import added_later_keys
    from dflash.data import TokenizerInfo
    from dflash.run.config import config_hash, load_config
    from dflash.run.resolve import filled
    from tests.dflash.run.test_run_e2e import GRAPH

    info = TokenizerInfo(vocab_size=4096, mask_token_id=5, pad_token_id=0, eos_token_id=None)
    base = load_config(GRAPH)
    on = load_config(GRAPH, ["loss.confidence=head", "loss.conf_weight=1.0"])
    assert filled(on, info).drafter.confidence_head and not filled(base, info).drafter.confidence_head
    with pytest.raises(ConfigError, match="loss.confidence = 'head'") as exc:
        filled(load_config(GRAPH, ["drafter.confidence_head=true"]), info)
    assert "\n" not in str(exc.value)
    explicit = load_config(GRAPH, ["loss.confidence=top1", "drafter.confidence_head=false"])
    assert config_hash(filled(base, info)) == config_hash(filled(explicit, info)) != config_hash(filled(on, info))
    old = {"loss": {"label": "data", "kl_weight": 0.0}, "drafter": {"num_layers": 1}}
    now = {"loss": {**old["loss"], "confidence": "top1"}, "drafter": {"num_layers": 1, "confidence_head": False}}
    assert config_changes(old, now, added_later_keys()) == []


# -- it learns ------------------------------------------------------------------------------------

def _auc(score: torch.Tensor, positive: torch.Tensor) -> float:
    """Probability that a random positive scores above a random negative (ties count half)."""
    pos, neg = score[positive], score[~positive]
    greater = (pos[:, None] > neg[None]).float().mean() + 0.5 * (pos[:, None] == neg[None]).float().mean()
    return float(greater)


def test_trained_head_separates_accepted_from_rejected_slots(trained_target):  # noqa: F811
    """A drafter trained with DSpark's head term on the synthetic word language (next token fixed
    inside a word, free at word starts): on held-out text the head's c ranks the slots whose
    greedy draft the target accepts above those it rejects: AUC > 0.7 (0.5 is no separation;
    measured 0.92, against 0.65 for the untrained head of a drafter trained without the term)."""
    from dflash.messages import LossInput
    from dflash.model.attention import training_layout
    from dflash.model.drafter import DrafterConfig
    from dflash.train.anchors import sample_anchors
    from dflash.train.objective import block_targets
    from tests.dflash.eval.test_proven_drafter import BS as PBS
    from tests.dflash.eval.test_proven_drafter import T, sentences

    target, _ = trained_target
    head = target.shared_head()
    dc = DrafterConfig(num_layers=1, block_size=PBS, mask_token_id=3, confidence_head=True).resolve(
        target.hf_config, target.layer_ids)
    drafter = DFlashDrafter(dc, seed=0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    cfg = LossConfig(label="target_argmax", conf_weight=1.0, confidence="head", weighting="none")
    pos = torch.arange(T)[None].expand(16, T)
    doc = torch.zeros(16, T, dtype=torch.long)
    mask = torch.ones(16, T, dtype=torch.bool)
    gen = torch.Generator().manual_seed(0)

    def batch(x):
        with torch.no_grad():
            feats, final = target(x, pos, doc, need_final=True)
        return LossInput(features=feats, input_ids=x, loss_mask=mask, doc_ids=doc, position_ids=pos,
                         anchors=sample_anchors(mask, doc, 16, PBS, gen), final_hidden=final)

    def held_out_auc():
        x = batch(sentences(16, seed=77))
        with torch.no_grad():
            blk = torch.full((*x.anchors.shape, PBS), 3, dtype=torch.long)
            blk[:, :, 0] = x.input_ids.gather(1, x.anchors.clamp(min=0))
            hid = drafter(x.features, head.embed(blk), training_layout(pos, doc, x.anchors, PBS))[:, :, 1:]
            p, trained = block_targets(x.input_ids, mask, doc, x.anchors, PBS)
            prev = (p - 1).clamp(min=0)[trained]
            rows = torch.arange(16)[:, None, None].expand_as(p)[trained]
            accepted = head.logits(hid[trained]).argmax(-1) == head.logits(x.final_hidden[rows, prev]).argmax(-1)
            score = drafter.confidence_head(hid[trained])
        assert 0.1 < accepted.float().mean() < 0.9        # both kinds of slot are there to separate
        return _auc(score, accepted)

    data = sentences(128, seed=2)
    for step in range(150):
        out = compute_loss(drafter, head, batch(data[(step * 16) % 128: (step * 16) % 128 + 16]), cfg)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    assert held_out_auc() > 0.7

