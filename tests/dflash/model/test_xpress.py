"""XPress (``drafter.variant = "xpress"``): the refiner is causal over the block, its Jacobi passes
reach the serial walk, a fresh drafter is its backbone, the loss is the documented sum of terms in
any chunking, and a trained drafter decodes losslessly with its passes."""

from __future__ import annotations

import msgspec
import pytest
import torch

from dflash.eval.decode import greedy_decode, speculative_decode
from dflash.eval.measure import evaluate
from dflash.eval.proposers import CachedDrafterProposer, DrafterProposer
from dflash.eval.xpress import CachedXPressProposer, XPressProposer, xpress_proposer
from dflash.messages import LossInput
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target
from dflash.model.xpress import XPressRefiner, predecessors
from dflash.train.anchors import sample_anchors
from dflash.train.loss import LossConfig
from dflash.train.objective import compute_loss

pytestmark = pytest.mark.timeout(300)

BS, V = 4, 128


def _randomised(refiner: XPressRefiner, scale: float = 0.5, seed: int = 0) -> XPressRefiner:
    """Every refiner weight random (the mix and readout too), so that the bias depends on everything."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in refiner.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return refiner


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(preset="tiny", seed=11, vocab_size=V), "cpu", num_draft_layers=2)


def _cfg(target, variant="xpress", **kw):
    return DrafterConfig(num_layers=1, block_size=BS, mask_token_id=V - 1, variant=variant, xpress_rank=8,
                         **kw).resolve(target.hf_config, target.layer_ids)


@pytest.fixture(scope="module")
def batch(target):
    """Two packed rows, the second mostly padding, with empty anchors."""
    g = torch.Generator().manual_seed(3)
    T = 40
    ids = torch.randint(0, V - 1, (2, T), generator=g)
    doc = torch.tensor([[0] * 25 + [1] * 15, [0] * 14 + [-1] * 26])
    pos = torch.stack([torch.cat([torch.arange(25), torch.arange(15)]),
                       torch.cat([torch.arange(14), torch.zeros(26, dtype=torch.long)])])
    lm = (torch.rand(2, T, generator=g) < 0.7) & (doc >= 0)
    with torch.no_grad():
        feats, final = target(ids, pos, doc)
    anchors = sample_anchors(lm, doc, 12, BS, torch.Generator().manual_seed(0))
    assert (anchors < 0).any()
    return LossInput(features=feats, input_ids=ids, loss_mask=lm, doc_ids=doc, position_ids=pos,
                     anchors=anchors, final_hidden=final)


# --- the refiner ------------------------------------------------------------------------------------

def test_refiner_slot_k_reads_only_the_predecessors_up_to_k():
    r = _randomised(XPressRefiner(vocab_size=50, hidden_size=16, block_size=6, rank=4))
    g = torch.Generator().manual_seed(1)
    ctx = r.context(torch.randn(1, 6, 16, generator=g))
    prev = torch.randint(0, 50, (1, 6), generator=g)
    x = r.features(prev, ctx)
    for k in range(6):
        changed = prev.clone()
        changed[0, k] = (changed[0, k] + 1) % 50
        y = r.features(changed, ctx)
        torch.testing.assert_close(y[0, :k], x[0, :k], rtol=0, atol=0)   # slots before k: untouched
        assert not torch.allclose(y[0, k:], x[0, k:])                    # slot k and the mix after it: moved


def test_jacobi_with_block_size_minus_one_passes_is_the_serial_walk():
    """Pass k fixes slot k, so b - 1 passes give exactly the left-to-right greedy walk, and one pass
    gives slot 1's; a fresh refiner (readout at zero) drafts the backbone's argmax."""
    b, H, Vs = 6, 16, 40
    r = _randomised(XPressRefiner(vocab_size=Vs, hidden_size=H, block_size=b, rank=4), scale=1.0)
    g = torch.Generator().manual_seed(2)
    hidden, base = torch.randn(3, b, H, generator=g), torch.randn(3, b - 1, Vs, generator=g)
    before, anchor = torch.randint(0, Vs, (3,), generator=g), torch.randint(0, Vs, (3,), generator=g)
    ctx = r.context(hidden)
    walk = torch.zeros(3, b - 1, dtype=torch.long)
    for j in range(b - 1):  # the serial walk: slot j given the walk's own tokens before it
        x = r.features(predecessors(before, anchor, walk), ctx)
        walk[:, j] = (base + r.bias(x[:, 1:]))[:, j].argmax(-1)
    draft, logits = r.jacobi(base, hidden, before, anchor, passes=b - 1)
    assert torch.equal(draft, walk) and torch.equal(logits.argmax(-1), draft)
    assert not torch.equal(walk, base.argmax(-1))                        # the refiner moved the drafts
    assert torch.equal(r.jacobi(base, hidden, before, anchor, passes=1)[0][:, 0], walk[:, 0])
    assert torch.equal(r.jacobi(base, hidden, before, anchor, passes=50)[0], walk)  # a fixed point stays
    for k in range(b + 2):  # stopping at a fixed point changes nothing, drafts nor logits
        early, late = (r.jacobi(base, hidden, before, anchor, passes=k, stop_early=s) for s in (True, False))
        assert torch.equal(early[0], late[0]) and torch.equal(early[1], late[1]), k
    r.reset_parameters()
    assert torch.equal(r.jacobi(base, hidden, before, anchor, passes=3)[0], base.argmax(-1))


# --- training ---------------------------------------------------------------------------------------

def test_fresh_xpress_drafter_is_its_backbone_and_the_loss_sums_its_terms(target, batch):
    """At init (readout 0) every refined logit is the backbone's, so the loss is
    (base + 1 + consistency) times the DFlash drafter's of the same seed, whose weights it shares."""
    head = target.shared_head()
    xp, plain = DFlashDrafter(_cfg(target), seed=1), DFlashDrafter(_cfg(target, "dflash"), seed=1)
    backbone = {k: v for k, v in xp.state_dict().items() if not k.startswith("refiner_head.")}
    assert backbone.keys() == plain.state_dict().keys()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in backbone.items())
    cfg = LossConfig(label="target_argmax", weighting="dpace", xpress_base_weight=0.6,
                     xpress_consistency_weight=0.3, xpress_consistency_passes=2)
    got = compute_loss(xp, head, batch, cfg, lm_head_chunk=6)
    want = compute_loss(plain, head, batch, cfg, lm_head_chunk=6)
    torch.testing.assert_close(got.loss, want.loss * 1.9, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.selector.acc_per_pos, got.acc_per_pos, equal_nan=True)  # drafts = argmax


def _reference_tf_loss(d, head, x):
    """The teacher-forced term alone (label "data", no weighting), block by block from the formula:
    slot j's predecessor is the data token at a + j - 1, slot 0's the token before the anchor in
    its document (else the anchor)."""
    from dflash.model.attention import training_layout
    from dflash.train.objective import _block_ids, block_targets

    ids, doc = x.input_ids, x.doc_ids
    block = _block_ids(ids, x.anchors, BS, d.cfg.mask_token_id)
    hidden = d(x.features, head.embed(block), training_layout(x.position_ids, doc, x.anchors, BS))
    _, trained = block_targets(ids, x.loss_mask, doc, x.anchors, BS)
    total, n = 0.0, 0
    for b in range(ids.shape[0]):
        for i, a in enumerate(x.anchors[b].tolist()):
            if a < 0 or not trained[b, i].any():
                continue
            first = ids[b, a - 1] if a > 0 and doc[b, a - 1] == doc[b, a] else ids[b, a]
            prev = torch.stack([first] + [ids[b, min(a + j - 1, ids.shape[1] - 1)] for j in range(1, BS)])
            h = hidden[b, i][None]
            z = head.logits(h[:, 1:]) + d.refiner_head.bias(d.refiner_head.features(prev[None],
                                                                                    d.refiner_head.context(h))[:, 1:])
            for j in range(1, BS):
                if trained[b, i, j - 1]:
                    total = total + torch.nn.functional.cross_entropy(z[0, j - 1], ids[b, a + j])
                    n += 1
    return total / n


def test_teacher_forced_term_matches_the_formula_and_chunks_change_nothing(target, batch):
    head = target.shared_head()
    d = DFlashDrafter(_cfg(target), seed=1)
    _randomised(d.refiner_head, scale=0.2)
    cfg = LossConfig(weighting="none", xpress_base_weight=0.0, xpress_consistency_weight=0.0)
    got = compute_loss(d, head, batch, cfg, lm_head_chunk=0)
    torch.testing.assert_close(got.loss, _reference_tf_loss(d, head, batch), rtol=1e-5, atol=0)

    full = LossConfig(label="target_argmax", kl_weight=0.3, weighting="streak", xpress_consistency_passes=2)
    grads = []
    for chunk in (0, 3, 7):
        d.zero_grad()
        out = compute_loss(d, head, batch, full, lm_head_chunk=chunk)
        out.loss.backward()
        grads.append((out.loss.detach(), {n: p.grad.clone() for n, p in d.named_parameters()}))
    for loss, g in grads[1:]:
        torch.testing.assert_close(loss, grads[0][0], rtol=1e-5, atol=0)
        for name, ref in grads[0][1].items():
            assert name.startswith("layers.") or ref.abs().max() > 0, name
            torch.testing.assert_close(g[name], ref, rtol=1e-4, atol=1e-6 * float(ref.abs().max()), msg=name)


def test_the_masked_loss_and_the_fused_head_refuse_xpress(target, batch):
    from dflash.errors import ConfigError
    from dflash.train.config import TrainSection, check_train

    d = DFlashDrafter(_cfg(target), seed=1)
    with pytest.raises(ValueError, match="sync_free_loss = true"):
        compute_loss(d, target.shared_head(), batch, LossConfig(), sync_free=False)
    with pytest.raises(ConfigError, match="sync_free_loss = true"):
        check_train(TrainSection(sync_free_loss=False), LossConfig(), d.cfg, ["cpu"])
    with pytest.raises(ConfigError, match="XPress's refined logits"):
        check_train(TrainSection(lm_head="liger"), LossConfig(), d.cfg, ["cuda:0"])


# --- decoding ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(target):
    """An XPress drafter trained briefly on the target's greedy labels (random token rows)."""
    head = target.shared_head()
    d = DFlashDrafter(_cfg(target), seed=2)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    before = {n: p.detach().clone() for n, p in d.refiner_head.named_parameters()}
    for _ in range(40):
        ids = torch.randint(0, V - 1, (4, 48), generator=g)
        pos = torch.arange(48)[None].expand(4, 48)
        doc, lm = torch.zeros(4, 48, dtype=torch.int32), torch.ones(4, 48, dtype=torch.bool)
        with torch.no_grad():
            feats, final = target(ids, pos, doc)
        x = LossInput(features=feats, input_ids=ids, loss_mask=lm, doc_ids=doc, position_ids=pos,
                      anchors=sample_anchors(lm, doc, 16, BS, g), final_hidden=final)
        compute_loss(d, head, x, LossConfig(label="target_argmax", weighting="none"), lm_head_chunk=16).loss.backward()
        opt.step()
        opt.zero_grad()
    moved = [n for n, p in d.refiner_head.named_parameters() if not torch.equal(p, before[n])]
    assert sorted(moved) == sorted(before)                                  # every refiner weight trains
    return d.eval()


def _prompt(seed, n=9):
    return torch.randint(0, V - 1, (n,), generator=torch.Generator().manual_seed(seed))


def test_xpress_decode_is_the_target_greedy_output_with_either_proposer(target, trained):
    head = target.shared_head()
    assert isinstance(xpress_proposer(trained, head), CachedXPressProposer)
    for seed in range(3):
        p = _prompt(seed)
        with torch.no_grad():
            ref = greedy_decode(target, p, 24)
            a, acc_a, _ = speculative_decode(target, CachedXPressProposer(trained, head), p, 24, BS)
            b, acc_b, _ = speculative_decode(target, XPressProposer(trained, head), p, 24, BS)
        assert torch.equal(a, ref) and torch.equal(b, ref) and acc_a == acc_b
    res = evaluate(target, trained, head, [_prompt(s) for s in range(3)], 24, speed=False, temperature=1.0)
    # the teacher-forced Jacobi drafts reproduce each measured step (the drafts the decode made)
    assert res.tau >= 1.0 and res.sampled_tau >= 1.0
    assert res.streak_visited == pytest.approx(res.mean_accepted, abs=1e-6)
    from dflash.eval.report import format_result

    assert res.jacobi_passes == trained.cfg.jacobi_passes
    assert f"up to {trained.cfg.jacobi_passes} Jacobi passes" in format_result(res)


def test_sampled_xpress_drafts_come_from_their_q(target, trained):
    head = target.shared_head()
    prop = CachedXPressProposer(trained, head)
    tokens = _prompt(5)
    with torch.no_grad():
        feats, _ = target(tokens[None, :-1], torch.arange(8)[None], torch.zeros(1, 8, dtype=torch.int32))
        with pytest.raises(ValueError, match="temperature > 0"):
            prop.sample(tokens, feats, 0.0, None)
        draft, q = prop.sample(tokens, feats, 0.8, torch.Generator().manual_seed(0))
    assert draft.shape == (BS - 1,) and q.shape == (BS - 1, V)
    torch.testing.assert_close(q.sum(-1), torch.ones(BS - 1))
    assert (q.gather(1, draft[:, None]) > 0).all()


def test_backbone_proposers_refuse_an_xpress_drafter_and_xpress_ones_a_dflash_drafter(target):
    head = target.shared_head()
    xp, plain = DFlashDrafter(_cfg(target), seed=1), DFlashDrafter(_cfg(target, "dflash"), seed=1)
    for cls in (DrafterProposer, CachedDrafterProposer):
        with pytest.raises(ValueError, match="xpress_proposer"):
            cls(xp, head)
    for cls in (XPressProposer, CachedXPressProposer):
        with pytest.raises(ValueError, match="variant = \"xpress\""):
            cls(plain, head)


def test_serving_at_a_smaller_block_is_lossless(target, trained):
    d = DFlashDrafter(trained.cfg)
    d.load_state_dict(trained.state_dict())
    d.eval().serve_at_block_size(3)
    head, p = target.shared_head(), _prompt(7)
    with torch.no_grad():
        out, acc, _ = speculative_decode(target, xpress_proposer(d, head), p, 20, 3)
    assert torch.equal(out, greedy_decode(target, p, 20)) and max(acc) <= 2


def test_xpress_settings_leave_other_variants_hashes_alone():
    from dflash.run.config import config_hash, load_config
    from tests.dflash.run.test_run_e2e import GRAPH

    for variant in ("dflash", "dflash2"):
        base = config_hash(load_config(GRAPH, [f'drafter.variant="{variant}"']))
        assert config_hash(load_config(GRAPH, [f'drafter.variant="{variant}"', "drafter.xpress_rank=8",
                                               "loss.xpress_base_weight=0.1"])) == base
    xp = config_hash(load_config(GRAPH, ['drafter.variant="xpress"']))
    assert xp != base
    assert config_hash(load_config(GRAPH, ['drafter.variant="xpress"', "drafter.xpress_rank=8"])) != xp
    assert msgspec.json.encode(load_config(GRAPH, ['drafter.variant="xpress"']).drafter)  # round-trips


def test_a_config_saved_before_xpress_and_dpace_existed_resumes_without_a_change_reported():
    """Resume compares the checkpoint's saved config with today's: the keys added with XPress and
    D-PACE, at their defaults, are no change; set otherwise, they are named."""
    from dflash.checkpoint.config_changes import config_changes
    from dflash.run.config import added_later_keys
    from dflash.model.variants import variant_of
    from dflash.run.config import load_config
    from tests.dflash.run.test_run_e2e import GRAPH

    xpress = variant_of("xpress")
    now = msgspec.to_builtins(load_config(GRAPH))
    old = {**now, "drafter": {k: v for k, v in now["drafter"].items() if k not in xpress.drafter_fields},
           "loss": {k: v for k, v in now["loss"].items() if k not in (*xpress.loss_fields, "dpace_alpha")}}
    assert config_changes(old, now, added_later_keys()) == []
    passes = {**now, "drafter": {**now["drafter"], "jacobi_passes": 2}}
    assert config_changes(old, passes, added_later_keys()) == [
        "drafter.jacobi_passes 6 -> 2 (decoding only: the Jacobi passes an XPress drafter drafts with)"]


def test_trained_xpress_drafts_are_accepted_longer_than_the_backbone_top1():
    """A short XPress run on DFlash2's test language (tests/dflash/model/test_dflash2.py: the
    backbone's per-slot argmax is a phrase that never occurs, since its slot-2 token never follows
    its slot-1 token): the refiner, reading each slot's predecessor, makes the Jacobi drafts
    coherent, so on held-out text they are accepted longer than the backbone's top-1. At step 0 the
    two are the same."""
    from tests.dflash.model.test_dflash2 import BS as LBS
    from tests.dflash.model.test_dflash2 import _train_on_language

    V = 64
    tgt = load_target(TargetConfig(preset="tiny", seed=1, vocab_size=V, layer_ids=[0],
                                   overrides={"num_hidden_layers": 2}), "cpu", num_draft_layers=1)
    head = tgt.shared_head()
    cfg = DrafterConfig(num_layers=1, block_size=LBS, mask_token_id=V - 1, variant="xpress",
                        xpress_rank=16).resolve(tgt.hf_config, tgt.layer_ids)
    before, after = _train_on_language(DFlashDrafter(cfg, seed=0), head, tgt)
    assert float(before.selector.streak) == float(before.streak_mean)
    jacobi, base = float(after.selector.streak), float(after.streak_mean)
    assert jacobi > base + 0.15, (jacobi, base)
