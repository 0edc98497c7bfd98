"""DFlash2 (``[drafter].variant = "dflash2"``): the convolution and the selector, their config
checks, the selector's training loss and metrics, and a short run where the selector earns its
place on a language built so that it must."""

from __future__ import annotations

import pytest
import torch

from dflash.messages import LossInput
from dflash.model.attention import training_layout
from dflash.model.dflash2 import GroupedDynamicCausalConv
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target
from dflash.train.anchors import sample_anchors
from dflash.train.loss import LossConfig
from dflash.train.objective import compute_loss
from tests.sync_probe import SyncProbe

pytestmark = pytest.mark.timeout(120)

BS = 4
D2 = dict(variant="dflash2", selector_rank=8, selector_top_k=6, conv_group_size=16)


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(preset="tiny", seed=5, vocab_size=200), "cpu", num_draft_layers=2)


def drafter(target, seed=1, **kw):
    cfg = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=199, **kw)
    return DFlashDrafter(cfg.resolve(target.hf_config, target.layer_ids), seed=seed)


def scramble(d: DFlashDrafter, seed=0) -> DFlashDrafter:
    """Random values for the DFlash2 parameters that start at the identity or at zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "base_kernel" in name else 0.3))
    return d


@pytest.fixture(scope="module")
def batch(target):
    """Two packed rows (two documents in row 0, padding in row 1) with anchors, some empty."""
    g = torch.Generator().manual_seed(3)
    T = 40
    ids = torch.randint(0, 199, (2, T), generator=g)
    doc = torch.tensor([[0] * 25 + [1] * 15, [0] * 14 + [-1] * 26])
    pos = torch.stack([torch.cat([torch.arange(25), torch.arange(15)]),
                       torch.cat([torch.arange(14), torch.zeros(26, dtype=torch.long)])])
    lm = (torch.rand(2, T, generator=g) < 0.7) & (doc >= 0)
    feats, final = target(ids, pos, doc)
    anchors = sample_anchors(lm, doc, 12, BS, torch.Generator().manual_seed(0))
    return LossInput(features=feats, input_ids=ids, loss_mask=lm, doc_ids=doc, position_ids=pos,
                     anchors=anchors, final_hidden=final)


def hidden(d, x: LossInput):
    B, A = x.anchors.shape
    blk = torch.full((B, A, BS), 199)
    blk[:, :, 0] = x.input_ids.gather(1, x.anchors.clamp(min=0))
    emb = torch.randn(B, A, BS, d.cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    return d(x.features, emb, training_layout(x.position_ids, x.doc_ids, x.anchors, BS))


# -- the model ------------------------------------------------------------------------------------

def test_state_dict_has_the_published_names_and_shapes(target):
    """Invariant: a DFlash2 drafter's state dict is the DFlash one plus, per layer,
    ``attention_conv``/``mlp_conv`` (``base_kernel [2, K, H]``, ``kernel_projection.weight
    [2*K*H/gs, H]``) and once the selector (bare codebooks ``[V, r]``, ``hidden_projection.weight
    [r, H]``): the names z-lab's DFlash2DraftModel and the published checkpoints use."""
    d1, d2 = drafter(target), drafter(target, **D2)
    s1, s2 = d1.state_dict(), d2.state_dict()
    H, V = 128, 200
    extra = {k: tuple(v.shape) for k, v in s2.items() if k not in s1}
    want = {}
    for i in range(2):
        for c in ("attention_conv", "mlp_conv"):
            want[f"layers.{i}.{c}.base_kernel"] = (2, 2, H)
            want[f"layers.{i}.{c}.kernel_projection.weight"] = (2 * 2 * H // 16, H)
    want.update({"candidate_selector.predecessor_codebook": (V, 8),
                 "candidate_selector.successor_codebook": (V, 8),
                 "candidate_selector.hidden_projection.weight": (8, H)})
    assert extra == want
    assert set(s1) <= set(s2) and all(s1[k].shape == s2[k].shape for k in s1)
    assert not any("conv" in k or "selector" in k for k in s1)


def test_fresh_dflash2_computes_what_dflash_of_the_same_seed_does(target, batch):
    """Invariant (every DFlash2 parameter initialised, z-lab leaves base_kernel empty): the
    convolutions start as the identity and the pair term at zero, and the backbone draws the
    same weights as DFlash, so a fresh DFlash2 drafter's hidden states equal DFlash's exactly
    and its loss is DFlash's plus the selector term."""
    d1, d2 = drafter(target, seed=4), drafter(target, seed=4, **D2)
    assert all(torch.isfinite(p).all() for p in d2.parameters())
    torch.testing.assert_close(hidden(d2, batch), hidden(d1, batch), rtol=0, atol=0)
    head = target.shared_head()
    o1, o2 = compute_loss(d1, head, batch, LossConfig()), compute_loss(d2, head, batch, LossConfig())
    torch.testing.assert_close(o2.loss, o1.loss + o2.selector.loss)
    torch.testing.assert_close(o2.selector.acc_per_pos, o1.acc_per_pos, equal_nan=True)  # walk = argmax
    torch.testing.assert_close(o2.selector.streak, o1.streak_mean)


def test_forward_and_backward_reach_every_parameter(target, batch):
    """DFlash2 forward + backward (the loss with its selector term): finite loss, and a nonzero
    finite gradient for every parameter, the convolutions and the selector's included."""
    d = scramble(drafter(target, **D2))
    out = compute_loss(d, target.shared_head(), batch, LossConfig(label="target_argmax"))
    assert torch.isfinite(out.loss) and out.selector.loss > 0
    out.loss.backward()
    for name, p in d.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name


def _conv_reference(conv, v, coef, side, block):
    """The convolution written out tap by tap, channel by channel (slow; the formula of
    dflash.model.dflash2's docstring)."""
    B, Q, H = v.shape
    out = torch.zeros_like(v)
    for t in range(Q):
        start = t - t % block
        for o in range(conv.kernel_size):
            if t - o < start:
                continue
            for ch in range(H):
                w = conv.base_kernel[side, o, ch] + coef[:, t, side, o, ch // conv.group_size]
                out[:, t, ch] += w * v[:, t - o, ch]
    return out


@pytest.mark.parametrize("K", [1, 2, 3])
def test_convolution_matches_its_formula_and_restarts_at_every_block(K):
    """Invariant: the grouped dynamic causal convolution equals its written-out formula (tap 0
    the current token, dynamic taps indexed by the output position and shared per group), and
    never reaches across a block boundary: training packs many blocks into one sequence."""
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(8, K, 4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    v, u = torch.randn(2, 12, 8), torch.randn(2, 12, 8)
    coef = conv.coefficients(u)
    for side in (0, 1):
        torch.testing.assert_close(conv(v, coef, side, 4), _conv_reference(conv, v, coef, side, 4))
    bumped = v.clone()
    bumped[:, 5] += 1.0                              # block 1 (tokens 4..7), its second token
    changed = (conv(bumped, coef, 0, 4) - conv(v, coef, 0, 4)).abs().amax((0, 2)) > 0
    assert changed.nonzero().flatten().tolist() == list(range(5, min(5 + K, 8)))


# -- config checks --------------------------------------------------------------------------------

CASES = [
    ("drafter.conv_group_size=48", r"drafter.conv_group_size = 48 does not divide the hidden size 256"),
    ("drafter.conv_kernel_size=9", r"drafter.conv_kernel_size = 9 is longer than a block \(block_size = 8\)"),
    ("drafter.conv_kernel_size=0", r"Expected `int` >= 1 - at `\$.drafter.conv_kernel_size`"),
    ("drafter.selector_top_k=100000", r"drafter.selector_top_k = 100000 exceeds the vocabulary"),
    ("loss.selector_weight=-1", r"loss.selector_weight must be >= 0, got -1"),
]


@pytest.mark.parametrize("override, message", CASES, ids=[c[0] for c in CASES])
def test_bad_dflash2_settings_are_one_line_exit_2(tmp_path, capsys, override, message):
    """Invariant: a DFlash2 setting the model cannot use is one line on stderr, exit 2, naming the
    key, before any data work (no run directory, no data cache)."""
    import re

    from dflash.run.cli import main
    from tests.dflash.run.test_run_e2e import small

    run, cache = tmp_path / "run", tmp_path / "cache"
    assert main(small(run, cache, 'drafter.variant="dflash2"', override)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not run.exists() and not cache.exists()


def test_dflash_settings_do_not_change_a_dflash_runs_hash():
    """Invariant (resume without a "config differs" warning): the DFlash2 fields are left out of a
    DFlash run's config hash, so a DFlash run hashes as before they existed; for DFlash2 they count."""
    from dflash.run.config import config_hash, load_config
    from tests.dflash.run.test_run_e2e import GRAPH

    base = config_hash(load_config(GRAPH))
    assert config_hash(load_config(GRAPH, ["drafter.selector_rank=8", "loss.selector_weight=0.5"])) == base
    d2 = config_hash(load_config(GRAPH, ['drafter.variant="dflash2"']))
    assert d2 != base
    assert config_hash(load_config(GRAPH, ['drafter.variant="dflash2"', "drafter.selector_rank=8"])) != d2


# -- the selector loss ----------------------------------------------------------------------------

def _run(d, head, x, cfg, **kw):
    out = compute_loss(d, head, x, cfg, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in d.named_parameters()}
    d.zero_grad()
    return out, grads


@pytest.mark.parametrize("cfg", [LossConfig(), LossConfig(label="target_argmax", weighting="streak"),
                                 LossConfig(kl_weight=0.5, selector_weight=0.3)])
def test_selector_loss_is_the_same_on_every_loss_path(target, batch, cfg):
    """The selector's loss, metrics and gradients are the same with [train].sync_free_loss on
    (the LM head at once, or in chunks) and off (the masked path), as the backbone's are."""
    d, head = scramble(drafter(target, **D2)), target.shared_head()
    runs = [_run(d, head, batch, cfg, sync_free=False), _run(d, head, batch, cfg, sync_free=True),
            _run(d, head, batch, cfg, sync_free=True, lm_head_chunk=7)]
    (ref, g_ref), rest = runs[0], runs[1:]
    assert ref.selector.missing > 0 and ref.selector.recall < 1
    for out, grads in rest:
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
        for f in ("loss", "streak", "recall", "oracle_streak", "missing"):
            torch.testing.assert_close(getattr(out.selector, f), getattr(ref.selector, f), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.selector.acc_per_pos, ref.selector.acc_per_pos, equal_nan=True)
        for name, g in g_ref.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()), msg=name)


def test_selector_loss_makes_no_host_sync(target, batch):
    """The fixed-shape loss stays sync-free with the selector (top-K, its CE, the metrics' walk)."""
    d, head = scramble(drafter(target, **D2)), target.shared_head()
    for chunk in (0, 7):
        with SyncProbe() as probe:
            _run(d, head, batch, LossConfig(label="target_argmax"), sync_free=True, lm_head_chunk=chunk)
        assert probe.syncs == []


def test_a_label_outside_the_top_k_is_counted_and_left_out(target, batch):
    """What happens when the label is not among the K: the slot is counted in ``missing`` and
    adds nothing to the selector loss; recall@K and the oracle count only labels inside the K.
    Checked against counts made here from the logits."""
    d, head = scramble(drafter(target, **{**D2, "selector_top_k": 2})), target.shared_head()
    out = compute_loss(d, head, batch, LossConfig(label="target_argmax"))
    B, A = batch.anchors.shape
    blk = torch.full((B, A, BS), 199)
    blk[:, :, 0] = batch.input_ids.gather(1, batch.anchors.clamp(min=0))
    with torch.no_grad():
        hid = d(batch.features, head.embed(blk), training_layout(batch.position_ids, batch.doc_ids,
                                                                 batch.anchors, BS))
        top = head.logits(hid[:, :, 1:]).topk(2, dim=-1).indices                  # [B, A, S, 2]
    from dflash.train.objective import block_targets

    pos, trained = block_targets(batch.input_ids, batch.loss_mask, batch.doc_ids, batch.anchors, BS)
    greedy = head.logits(batch.final_hidden).argmax(-1)                            # token t + 1
    label = greedy.gather(1, (pos - 1).clamp(min=0).view(B, -1)).view(pos.shape)
    inside = (top == label[..., None]).any(-1)
    assert int(out.selector.missing) == int((trained & ~inside).sum()) > 0
    torch.testing.assert_close(out.selector.recall, (trained & inside).sum() / trained.sum())


def test_dflash2_train_step_has_exactly_one_host_read(target, batch, tmp_path):
    """Invariant (dflash.train.step): with the selector's figures the step still makes one host
    read, and they arrive in StepMetrics."""
    import csp
    from dflash.data import TokenizerInfo
    from dflash.observe.metrics_writer import MetricsLog
    from dflash.run.app import ResumeState, RunApp
    from dflash.run.config import DFlashFile, RunSection
    from dflash.run.resolve import resolve
    from dflash.run.stages.trainer import DrafterStage
    from dflash.train.config import TrainSection
    from tests.sync_probe import device_syncs
    from tests.dflash.train.test_step_sync import drafter_input

    cfg = DFlashFile(run=RunSection(name="t", out_dir=str(tmp_path), steps=4),
                     target=TargetConfig(preset="tiny", seed=5, vocab_size=200),
                     drafter=DrafterConfig(num_layers=2, block_size=BS, mask_token_id=199, **D2),
                     loss=LossConfig(kl_weight=0.5, weighting="streak"), train=TrainSection(num_anchors=12))
    resolved = resolve(cfg, TokenizerInfo(vocab_size=200, mask_token_id=None, pad_token_id=0, eos_token_id=None))
    app = RunApp(resolved=resolved, run_dir=tmp_path, sampler=None, resume=ResumeState(),
                 metrics=MetricsLog(tmp_path / "metrics.jsonl"))
    stage = DrafterStage(ctx=csp.Context("drafter", device=torch.device("cpu"), run_dir=tmp_path, app=app))
    stage.setup()
    setup = dict(ids=batch.input_ids, lm=batch.loss_mask, pos=batch.position_ids, doc=batch.doc_ids,
                 anchors=batch.anchors, feats=batch.features, final=batch.final_hidden)
    try:
        stage.train_step(drafter_input(setup, 0))
        inp = drafter_input(setup, 1)
        with SyncProbe() as probe:
            m = stage.train_step(inp)
    finally:
        stage.teardown()
        stage.app.metrics.close()
    syncs = device_syncs(probe.syncs)
    assert [k for k, _ in syncs] == ["tolist"], syncs
    assert len(m.sel_acc_per_pos) == BS - 1 and 0 <= m.recall_k <= 1 and m.label_missing >= 0
    assert m.sel_accepted >= 0 and m.base_accepted >= 0 and m.oracle_accepted >= m.sel_accepted
    assert m.sel_loss > 0


# -- a short run on a language where the selector must win ----------------------------------------

# Each unit is [S, p1, p2, p3] with the phrase drawn afresh (so no context predicts it):
#   (a, x, c) 0.4    (b, y, d) 0.3    (b, z, e) 0.3
# Slot by slot the backbone's argmax is (b, x, c): b is likelier than a, x likelier than y or z,
# but x never follows b, so the block dies at slot 2. The walk, given b, takes y or z and keeps
# the block alive. A, B, X, Y, Z, C, D, E = 10..17.
S_TOK, PHRASES, PROBS = 1, torch.tensor([[10, 12, 15], [11, 13, 16], [11, 14, 17]]), torch.tensor([0.4, 0.3, 0.3])


def _language_batch(target, g, rows=8, units=16, anchors=16):
    ph = PHRASES[torch.multinomial(PROBS, rows * units, replacement=True, generator=g).view(rows, units)]
    ids = torch.cat([torch.full((rows, units, 1), S_TOK), ph], -1).reshape(rows, -1)
    T = ids.shape[1]
    pos = torch.arange(T)[None].expand(rows, T)
    doc = torch.zeros(rows, T, dtype=torch.int32)
    lm = torch.ones(rows, T, dtype=torch.bool)
    feats, _ = target(ids, pos, doc, need_final=False)
    return LossInput(features=feats, input_ids=ids, loss_mask=lm, doc_ids=doc, position_ids=pos,
                     anchors=sample_anchors(lm, doc, anchors, BS, g))

def _train_on_language(d, head, target, steps=200):
    """The loss outputs on 32 held-out rows of the language before and after ``steps`` AdamW steps
    (lr 3e-3) on fresh batches of it; seeded, so a run is repeatable."""
    held_out = _language_batch(target, torch.Generator().manual_seed(99), rows=32)
    lc = LossConfig(weighting="none")
    with torch.no_grad():
        before = compute_loss(d, head, held_out, lc)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        compute_loss(d, head, _language_batch(target, g), lc).loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return before, compute_loss(d, head, held_out, lc)



def test_trained_selector_walk_is_accepted_longer_than_the_backbone_top1():
    """A short DFlash2 training run (one core, seconds) on the language above: on held-out text the
    selector's walk is accepted longer than the backbone's top-1 (teacher-forced streaks, what
    greedy verification accepts), while per slot it may hit less often (module docstring of
    dflash.train.selector_loss: its gain is coherence). At step 0 the two are the same."""
    V = 64
    tgt = load_target(TargetConfig(preset="tiny", seed=1, vocab_size=V, layer_ids=[0],
                                   overrides={"num_hidden_layers": 2}), "cpu", num_draft_layers=1)
    head = tgt.shared_head()
    cfg = DrafterConfig(num_layers=1, block_size=BS, mask_token_id=V - 1, variant="dflash2",
                        selector_rank=16, selector_top_k=8).resolve(tgt.hf_config, tgt.layer_ids)
    before, after = _train_on_language(DFlashDrafter(cfg, seed=0), head, tgt)
    assert float(before.selector.streak) == float(before.streak_mean)
    sel, base = float(after.selector.streak), float(after.streak_mean)
    assert sel > base + 0.15, (sel, base)
    assert float(after.selector.recall) == 1.0 and int(after.selector.missing) == 0
    assert float(after.selector.oracle_streak) == pytest.approx(BS - 1)   # every label is in the top-8


def test_window_records_carry_the_selector_figures_only_for_dflash2():
    """metrics.jsonl: a DFlash2 window averages the selector's figures like the others (taus are
    accepted + 1, missing labels summed over the window); a DFlash window has none of the keys,
    so its lines are what they were."""
    from dflash.messages import StepMetrics
    from dflash.observe.metrics_writer import WindowAggregator
    from dflash.records import decode_line, encode

    def step(i, **sel):
        return StepMetrics(step=i, batch_id=i, loss=1.0, ce=1.0, kl=0.0, acc_per_pos=[0.5, 0.25],
                           accepted_sim=0.625, lr=1e-3, grad_norm=1.0, time=float(i), **sel)

    plain = WindowAggregator(2)
    plain.add(step(1))
    rec = plain.add(step(2))
    assert not any(k.startswith(("sel_", "base_", "recall", "oracle", "label_")) for k in rec.keys())
    agg = WindowAggregator(2)
    sel = dict(sel_loss=0.5, sel_acc_per_pos=[0.5, 0.5], sel_accepted=0.75, base_accepted=0.5,
               recall_k=0.9, oracle_accepted=1.5, label_missing=3)
    agg.add(step(1, **sel))
    rec = agg.add(step(2, **{**sel, "sel_loss": 0.25, "label_missing": 1}))
    assert rec.sel_loss == 0.375 and rec.sel_acc == [0.5, 0.5] and rec.label_missing == 4
    assert rec.sel_tau == 1.75 and rec.base_tau == 1.5 and rec.oracle_tau == 2.5 and rec.recall_k == 0.9
    back = decode_line(encode(rec))
    assert all(back[k] == rec[k] for k in ("sel_loss", "sel_acc", "sel_tau", "base_tau", "recall_k",
                                           "oracle_tau", "label_missing"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch.cuda.set_sync_debug_mode")
def test_cuda_dflash2_loss_under_sync_debug_mode(target, batch):
    """On the GPU: the DFlash2 loss (selector CE, top-K from the chunked head, the metrics' walk)
    forward and backward under bf16 autocast raise nothing with set_sync_debug_mode("error")."""
    from dflash.model.target import SharedHead

    h = target.shared_head()
    emb = h.embed_tokens.weight.detach().cuda().bfloat16()
    head = SharedHead(emb, h.lm_head.weight.detach().cuda().bfloat16())
    x = LossInput(**{f: (getattr(batch, f).cuda() if getattr(batch, f) is not None else None)
                     for f in batch.__struct_fields__})
    x = LossInput(**{**{f: getattr(x, f) for f in x.__struct_fields__},
                     "features": x.features.bfloat16(), "final_hidden": x.final_hidden.bfloat16()})
    d = scramble(drafter(target, **D2)).cuda()
    cfg = LossConfig(label="target_argmax")
    for debug in ("default", "error"):    # the first pass warms up (lazy init may sync once)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(debug)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = compute_loss(d, head, x, cfg, sync_free=True, lm_head_chunk=7)
            out.loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.loss) and torch.isfinite(out.selector.loss)
