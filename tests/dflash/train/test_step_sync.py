"""The drafter step's performance switches: no host sync in the loss, no fp32 feature copy.

* ``[train].sync_free_loss``: the fixed-shape loss equals the boolean-mask one (loss, metrics,
  counts, gradients) and makes no host sync; the whole ``train_step`` makes exactly one (the
  documented read of ``[loss, grad_norm, ce, kl, blocks, acc...]``).
* ``[train].features_fp32``: under bf16 autocast, leaving the features in bf16 is bitwise equal to
  the old fp32 copy.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from dflash.messages import LossInput
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import SharedHead, TargetConfig, load_target
from dflash.train.anchors import sample_anchors
from dflash.train.loss import LossConfig
from dflash.train.objective import compute_loss
from tests.sync_probe import SyncProbe, device_syncs

BS = 4
CFGS = [LossConfig(), LossConfig(label="target_argmax", weighting="none"),
        LossConfig(kl_weight=0.5, temperature=1.5, weighting="streak", alpha=0.2),
        LossConfig(label="target_argmax", weighting="dpace", dpace_alpha=0.3)]


@pytest.fixture(scope="module")
def setup():
    """Two packed rows; row 1 is mostly padding, so it has fewer eligible anchors than slots and
    some anchors are -1 (empty blocks the fixed-shape loss must weight 0)."""
    tcfg = TargetConfig(preset="tiny", seed=5, vocab_size=200)
    target = load_target(tcfg, "cpu", num_draft_layers=2)
    dcfg = DrafterConfig(num_layers=1, block_size=BS, mask_token_id=199).resolve(target.hf_config,
                                                                                 target.layer_ids)
    g = torch.Generator().manual_seed(3)
    T = 40
    ids = torch.randint(0, 199, (2, T), generator=g)
    doc = torch.tensor([[0] * 25 + [1] * 15, [0] * 14 + [-1] * 26])
    pos = torch.stack([torch.cat([torch.arange(25), torch.arange(15)]),
                       torch.cat([torch.arange(14), torch.zeros(26, dtype=torch.long)])])
    lm = (torch.rand(2, T, generator=g) < 0.7) & (doc >= 0)
    with torch.no_grad():
        feats, final = target(ids, pos, doc)
    anchors = sample_anchors(lm, doc, 12, BS, torch.Generator().manual_seed(0))
    assert (anchors < 0).any() and (anchors >= 0).sum() > 12
    return dict(target=target, head=target.shared_head(), dcfg=dcfg, ids=ids, doc=doc, pos=pos, lm=lm,
                feats=feats, final=final, anchors=anchors)


def run_loss(s, cfg, drafter=None, **switches):
    drafter = drafter or DFlashDrafter(s["dcfg"], seed=1)
    x = LossInput(features=s["feats"], input_ids=s["ids"], loss_mask=s["lm"], doc_ids=s["doc"],
                  position_ids=s["pos"], anchors=s["anchors"], final_hidden=s["final"])
    out = compute_loss(drafter, s["head"], x, cfg, **switches)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in drafter.named_parameters()}


@pytest.mark.parametrize("cfg", CFGS)
def test_sync_free_loss_equals_masked_loss(setup, cfg):
    """Same loss, ce, kl, accuracy, streak, counts and gradients (rtol 1e-5: only the order of the
    sums differs, zeros added in) with [train].sync_free_loss on and off."""
    masked, g_masked = run_loss(setup, cfg, sync_free=False)
    fixed, g_fixed = run_loss(setup, cfg, sync_free=True)
    assert isinstance(masked.num_predictions, int) and isinstance(fixed.num_predictions, torch.Tensor)
    assert int(fixed.num_predictions) == masked.num_predictions > 20
    assert int(fixed.num_blocks) == masked.num_blocks == int((setup["anchors"] >= 0).sum())
    for name in ("loss", "ce", "kl", "streak_mean"):
        torch.testing.assert_close(getattr(fixed, name), getattr(masked, name), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fixed.acc_per_pos, masked.acc_per_pos, equal_nan=True)
    assert g_fixed.keys() == g_masked.keys()
    for name, g in g_masked.items():
        assert g.abs().max() > 0, name
        # atol relative to the tensor's scale: the weights' sums run in a different order
        torch.testing.assert_close(g_fixed[name], g, rtol=1e-5, atol=1e-6 * float(g.abs().max()), msg=name)


@pytest.mark.parametrize("cfg", CFGS)
def test_sync_free_loss_makes_no_host_sync(setup, cfg):
    """Forward and backward of the fixed-shape loss read no value and make no data-dependent shape;
    the masked path (the regression this guards against) does."""
    with SyncProbe() as probe:
        run_loss(setup, cfg, sync_free=True)
    assert probe.syncs == []
    with SyncProbe() as probe:
        run_loss(setup, cfg, sync_free=False)
    kinds = {k for k, _ in probe.syncs}
    assert {"boolean-mask indexing", "read a value (item/int/float/bool)"} <= kinds


def test_features_fp32_switch_is_bitwise_equal_under_autocast(setup):
    """bf16 features under bf16 autocast: the fp32 copy autocast rounds straight back changes
    nothing (loss and every gradient bitwise equal), so features_fp32 = False is free."""
    s = dict(setup, feats=setup["feats"].bfloat16(), final=setup["final"].bfloat16())
    runs = []
    for fp32 in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs.append(run_loss(s, LossConfig(kl_weight=0.3), features_fp32=fp32))
    (a, ga), (b, gb) = runs
    assert torch.equal(a.loss, b.loss) and a.loss.isfinite()
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name


def test_drafter_casts_features_outside_autocast(setup):
    """Without autocast the drafter still casts bf16 features to its weights' dtype (fp32 here)."""
    d = DFlashDrafter(setup["dcfg"], seed=1)
    from dflash.model.attention import training_layout

    lay = training_layout(setup["pos"], setup["doc"], setup["anchors"], BS)
    emb = setup["head"].embed(torch.zeros(2, setup["anchors"].shape[1], BS, dtype=torch.long))
    out = d(setup["feats"].bfloat16(), emb, lay)
    ref = d(setup["feats"].bfloat16().float(), emb, lay)
    assert out.dtype == torch.float32 and torch.equal(out, ref)


# -- the whole training step ----------------------------------------------------------------------

def drafter_stage(tmp_path, sync_free: bool):
    import csp
    from dflash.data import TokenizerInfo
    from dflash.observe.metrics_writer import MetricsLog
    from dflash.run.app import ResumeState, RunApp
    from dflash.run.config import DFlashFile, RunSection
    from dflash.run.resolve import resolve
    from dflash.run.stages.trainer import DrafterStage
    from dflash.train.config import TrainSection

    cfg = DFlashFile(run=RunSection(name="t", out_dir=str(tmp_path), steps=4),
                     target=TargetConfig(preset="tiny", seed=5, vocab_size=200),
                     drafter=DrafterConfig(num_layers=2, block_size=BS, mask_token_id=199),
                     loss=LossConfig(kl_weight=0.5, weighting="streak"),
                     train=TrainSection(sync_free_loss=sync_free, num_anchors=12))
    resolved = resolve(cfg, TokenizerInfo(vocab_size=200, mask_token_id=None, pad_token_id=0, eos_token_id=None))
    app = RunApp(resolved=resolved, run_dir=tmp_path, sampler=None, metrics=MetricsLog(tmp_path / "metrics.jsonl"),
                 resume=ResumeState())
    stage = DrafterStage(ctx=csp.Context("drafter", device=torch.device("cpu"), run_dir=tmp_path, app=app))
    stage.setup()
    return stage


def drafter_input(s, batch_id: int):
    from dflash.messages import Batch, DrafterInput

    b = Batch(seq=batch_id, batch_id=batch_id, epoch=0, input_ids=s["ids"], loss_mask=s["lm"],
              position_ids=s["pos"], doc_ids=s["doc"].int(), num_tokens=int((s["doc"] >= 0).sum()),
              num_padding=int((s["doc"] < 0).sum()), anchors=s["anchors"])
    return DrafterInput(batch=b, features=s["feats"], final_hidden=s["final"], anchors=s["anchors"],
                        replica=0)


@pytest.mark.parametrize("sync_free", [True, False])
def test_train_step_has_exactly_one_host_read(setup, tmp_path, sync_free):
    """The documented sync of a step: one ``tolist`` of the stacked scalars, which also decides the
    non-finite skip. With sync_free_loss off the loss's own syncs come on top (the old path)."""
    stage = drafter_stage(tmp_path, sync_free)
    try:
        stage.train_step(drafter_input(setup, 0))        # first step: optimizer state is created
        inp = drafter_input(setup, 1)
        with SyncProbe() as probe:
            m = stage.train_step(inp)
    finally:
        stage.teardown()
        stage.app.metrics.close()
    syncs = device_syncs(probe.syncs)
    if sync_free:
        assert [k for k, _ in syncs] == ["tolist"], syncs
        assert syncs[0][1].startswith("train/step.py")
    else:
        assert len(syncs) > 1
    assert m.num_blocks == int((setup["anchors"] >= 0).sum()) and not m.skipped


def test_train_step_metrics_equal_with_sync_free_on_and_off(setup, tmp_path):
    """Two steps on each path from the same init: the same reported metrics and the same weights."""
    runs = []
    for sync_free in (True, False):
        stage = drafter_stage(tmp_path / str(sync_free), sync_free)
        try:
            ms = [stage.train_step(drafter_input(setup, i)) for i in range(2)]
        finally:
            stage.teardown()
            stage.app.metrics.close()
        stage.app.metrics.close()
        runs.append((ms, {k: v.clone() for k, v in stage.drafter.state_dict().items()}))
    (ma, wa), (mb, wb) = runs
    for a, b in zip(ma, mb):
        da, db = msgspec.structs.asdict(a), msgspec.structs.asdict(b)
        for k in ("step_s", "time"):
            da.pop(k), db.pop(k)
        for k in ("loss", "ce", "kl", "grad_norm", "accepted_sim"):
            assert da.pop(k) == pytest.approx(db.pop(k), rel=1e-5), k
        assert da.pop("acc_per_pos") == pytest.approx(db.pop("acc_per_pos"))
        assert da == db
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_feature_noise_in_place_equals_formula(dtype):
    """The in-place feature noise is bitwise the plain ``features + std * rms * N(0, 1)`` with the
    same generator (and leaves its input untouched)."""
    from dflash.model.features import apply_feature_noise

    x = torch.randn(2, 7, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    before = x.clone()
    got = apply_feature_noise(x, std=0.05, seed=3, batch_id=11)
    gen = torch.Generator().manual_seed((3 * 7_000_003 + 11 + 1) % (2**63))
    noise = torch.randn(x.shape, generator=gen, dtype=torch.float32)
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()
    want = (x.float() + 0.05 * rms * noise).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want) and not torch.equal(got, x)
    assert torch.equal(x, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch.cuda.set_sync_debug_mode")
def test_cuda_sync_free_loss_under_sync_debug_mode(setup):
    """On the GPU itself: forward and backward of the fixed-shape loss under bf16 autocast raise
    nothing with ``torch.cuda.set_sync_debug_mode("error")`` (every host sync raises there)."""
    s = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in setup.items()}
    h = setup["head"]
    emb = h.embed_tokens.weight.detach().cuda().bfloat16()       # copies: the CPU fixture stays
    tied = h.lm_head.weight is h.embed_tokens.weight
    s["head"] = SharedHead(emb, emb if tied else h.lm_head.weight.detach().cuda().bfloat16())
    s["feats"], s["final"] = s["feats"].bfloat16(), s["final"].bfloat16()
    drafter = DFlashDrafter(setup["dcfg"], seed=1).cuda()
    cfg = LossConfig(kl_weight=0.5, weighting="streak")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        run_loss(s, cfg, drafter=drafter, sync_free=True)  # warm-up: lazy init may sync once
    drafter.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            run_loss(s, cfg, drafter=drafter, sync_free=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# -- chunked LM head ([train].lm_head_chunk) --------------------------------------------------------

@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_chunked_lm_head_equals_whole_logits(setup, cfg, chunk):
    """Same loss, metrics and gradients (rtol 1e-5; the gradient is formed per slot before the
    incoming scale instead of after) with the head in chunks of 1, 7 and more slots than exist."""
    whole, g_whole = run_loss(setup, cfg, sync_free=True)
    part, g_part = run_loss(setup, cfg, sync_free=True, lm_head_chunk=chunk)
    for name in ("loss", "ce", "kl", "streak_mean"):
        torch.testing.assert_close(getattr(part, name), getattr(whole, name), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(part.acc_per_pos, whole.acc_per_pos, equal_nan=True)
    assert int(part.num_predictions) == int(whole.num_predictions)
    for name, g in g_whole.items():
        torch.testing.assert_close(g_part[name], g, rtol=1e-5, atol=1e-7, msg=name)


def saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd keeps for backward while ``fn()`` runs forward."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("cfg", [CFGS[0], CFGS[2]])
def test_chunked_lm_head_keeps_no_vocab_sized_activation(setup, cfg):
    """Measured: unchunked, backward keeps at least one fp32 [M, V] tensor (two more with KL);
    chunked it keeps none, only [M, H] (the vocabulary is 200, hidden 128 here)."""
    d = DFlashDrafter(setup["dcfg"], seed=1)
    M = setup["anchors"].numel() * (BS - 1)
    V, H = setup["head"].vocab_size, setup["dcfg"].hidden_size

    def loss(**kw):
        x = LossInput(features=setup["feats"], input_ids=setup["ids"], loss_mask=setup["lm"],
                      doc_ids=setup["doc"], position_ids=setup["pos"], anchors=setup["anchors"],
                      final_hidden=setup["final"])
        return lambda: compute_loss(d, setup["head"], x, cfg, **kw)

    whole, part = saved_bytes(loss()), saved_bytes(loss(lm_head_chunk=16))
    vocab_copies = 3 if cfg.kl_weight > 0 else 1
    assert whole - part >= vocab_copies * M * V * 4 - M * H * 4, (whole, part)


def test_chunked_lm_head_makes_no_host_sync(setup):
    with SyncProbe() as probe:
        run_loss(setup, CFGS[2], sync_free=True, lm_head_chunk=7)
    assert probe.syncs == []
