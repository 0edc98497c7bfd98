"""The total-variation and "top1" confidence loss terms ([loss].tv_weight, conf_weight; DSpark's
weights 0.1 CE + 0.9 TV + 1.0 conf, on our TV, which is half DSpark's L1): formulas, fp32
gradients against a float64 reference (and bf16 failing the same tolerance), every loss path
giving the same loss, and the defaults unchanged. The "head" form: tests/dflash/train/test_confidence_head.py."""

from __future__ import annotations

import math

import pytest
import torch

from dflash.errors import ConfigError
from dflash.train.loss import (
    LossConfig,
    confidence_term,
    mixed_loss,
    needs_final_hidden,
    tv_term,
)
from dflash.train.objective import compute_loss
from tests.dflash.train.test_loss import loss_input, slow_reference
from tests.dflash.train.test_loss import setup as blockwise_setup  # noqa: F401 - the fixture
from tests.dflash.train.test_step_sync import (
    run_loss,
    setup,  # noqa: F401 - the fixture
)

pytestmark = pytest.mark.timeout(120)

DSPARK = LossConfig(label="target_argmax", tv_weight=0.9, conf_weight=1.0)
TERM_CFGS = [DSPARK,
             LossConfig(tv_weight=0.4, kl_weight=0.3, temperature=1.5, weighting="streak"),
             LossConfig(conf_weight=0.5, weighting="none")]


def _logits(n=6, v=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(n, v, generator=g), 3 * torch.randn(n, v, generator=g), torch.randint(0, v, (n,), generator=g)


def test_tv_and_confidence_match_their_formulas():
    """Each term equals the module docstring's formula written out in Python floats."""
    zd, zt, y = _logits()
    y[0] = int(zd[0].argmax())                                      # one slot whose draft is right
    t = 1.7
    tv, conf = tv_term(zd, zt, t), confidence_term(zd, y)
    for n in range(zd.shape[0]):
        et, ed = [math.exp(v / t) for v in zt[n].tolist()], [math.exp(v / t) for v in zd[n].tolist()]
        tv_ref = 0.5 * sum(abs(a / sum(et) - b / sum(ed)) for a, b in zip(et, ed))
        e1 = [math.exp(v) for v in zd[n].tolist()]
        c = max(e1) / sum(e1)
        right = e1.index(max(e1)) == int(y[n])
        conf_ref = -math.log(c) if right else -math.log(1 - c)
        assert tv[n].item() == pytest.approx(tv_ref, rel=1e-5, abs=1e-7)
        assert conf[n].item() == pytest.approx(conf_ref, rel=1e-5)
    assert conf[0].item() == pytest.approx(-torch.log_softmax(zd[0], -1)[y[0]].item(), rel=1e-6)  # = CE


def test_point_one_ce_point_nine_tv_plus_conf_is_the_weighted_sum():
    zd, zt, y = _logits(seed=1)
    l, ce, kl = mixed_loss(DSPARK, zd, y, zt)
    want = 0.1 * ce + 0.9 * tv_term(zd, zt, 1.0) + 1.0 * confidence_term(zd, y)
    torch.testing.assert_close(l, want, rtol=1e-6, atol=1e-7)
    assert kl.eq(0).all()
    with pytest.raises(ValueError, match="target logits"):
        mixed_loss(LossConfig(tv_weight=0.5), zd, y, None)
    assert needs_final_hidden(LossConfig(tv_weight=0.1)) and not needs_final_hidden(LossConfig(conf_weight=1.0))


def test_confidence_term_stays_finite_where_top1_rounds_to_one():
    """Invariant: log(1 - c) is taken from the other logits, so a wrong draft with c == 1.0 in fp32
    gives a large finite loss and gradient, not inf/nan."""
    z = torch.tensor([[60.0, 0.0, 0.0]], requires_grad=True)
    conf = confidence_term(z, torch.tensor([1]))
    conf.sum().backward()
    assert math.isfinite(conf.item()) and conf.item() > 50 and torch.isfinite(z.grad).all()


def test_default_loss_is_bitwise_the_plain_ce_kl_loss():
    """Invariant: with tv_weight = conf_weight = 0 (the defaults) the per-slot loss is bit for bit
    (1 - kl_weight) * CE + kl_weight * KL, the loss before these terms existed."""
    zd, zt, y = _logits(seed=2)
    for cfg in (LossConfig(), LossConfig(kl_weight=0.3, temperature=2.0)):
        l, ce, kl = mixed_loss(cfg, zd, y, zt)
        assert torch.equal(l, (1.0 - cfg.kl_weight) * ce + cfg.kl_weight * kl)


# -- precision: fp32 against float64, and bf16 failing the same tolerance --------------------------

def _near_target_logits(v=32_000, n=8, seed=3):
    """A drafter close to its target over a real-sized vocabulary: p - q is a small difference of
    nearly equal probabilities, where low precision cancels catastrophically."""
    g = torch.Generator().manual_seed(seed)
    zt = 4 * torch.randn(n, v, generator=g, dtype=torch.float64)
    zd = zt + 0.05 * torch.randn(n, v, generator=g, dtype=torch.float64)
    return zd, zt, torch.randint(0, v, (n,), generator=g)


def _tv(zd, zt, t):
    """The formulas in whatever dtype their inputs have (float64: the reference; bf16: what a
    loss that did not cast would compute)."""
    return 0.5 * (torch.softmax(zt / t, -1) - torch.softmax(zd / t, -1)).abs().sum(-1)


def _kl(zd, zt, t):
    lp, lq = torch.log_softmax(zt / t, -1), torch.log_softmax(zd / t, -1)
    return t * t * (lp.exp() * (lp - lq)).sum(-1)


def _conf(zd, zt, t, y):
    c, arg = torch.softmax(zd, -1).max(-1)
    right = (arg == y).to(zd.dtype)
    return -(right * c.log() + (1 - right) * (1 - c).log())


def _grad(fn, zd):
    z = zd.detach().clone().requires_grad_(True)
    fn(z).sum().backward()
    return z.grad.double()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


TOL = 1e-3  # relative L2 error of d(term)/d(draft logits) against the float64 gradient


@pytest.mark.parametrize("term", ["tv", "kl", "conf"])
def test_fp32_term_gradients_match_float64_and_bf16_would_not(term):
    """Invariant: the TV, KL and confidence gradients the training step uses (mixed_loss, which
    casts bf16 logits to fp32) are within 1e-3 of a float64 reference on a near-target
    32K-vocabulary drafter; the same terms computed in bf16 miss that tolerance (so this test can
    fail: it would, if the loss stopped casting to fp32)."""
    zd64, zt64, y = _near_target_logits()
    zd, zt = zd64.bfloat16(), zt64.bfloat16()            # the logits as a bf16 LM head gives them
    t = 1.0
    cfg, formula = {"tv": (LossConfig(tv_weight=1.0), _tv), "kl": (LossConfig(kl_weight=1.0), _kl),
                    "conf": (LossConfig(conf_weight=1.0), _conf)}[term]
    extra = (y,) if term == "conf" else ()
    ref = _grad(lambda z: formula(z, zt.double(), t, *extra), zd.double())

    def ours(z):   # CE's weight is 0 for tv/kl; with conf it is 1, so its own part is taken off
        l, ce, _ = mixed_loss(cfg, z, y, zt)
        return l - ce if term == "conf" else l

    # ours takes the bf16 values as an fp32 leaf: a bf16 leaf would round the gradient itself to bf16
    fp32_err = _rel(_grad(ours, zd.float()), ref)
    bf16_err = _rel(_grad(lambda z: formula(z, zt, t, *extra), zd), ref)
    assert fp32_err < TOL < bf16_err, (fp32_err, bf16_err)


# -- every loss path gives the same loss ------------------------------------------------------------

@pytest.mark.parametrize("cfg", TERM_CFGS)
@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_chunked_head_supports_tv_and_confidence(setup, cfg, chunk):  # noqa: F811
    """Invariant: the chunked LM head ([train].lm_head_chunk, the default path) gives the loss,
    metrics and gradients of the whole-logits path with TV and confidence terms on."""
    whole, g_whole = run_loss(setup, cfg, sync_free=True)
    part, g_part = run_loss(setup, cfg, sync_free=True, lm_head_chunk=chunk)
    for name in ("loss", "ce", "kl", "streak_mean"):
        torch.testing.assert_close(getattr(part, name), getattr(whole, name), rtol=1e-5, atol=1e-7)
    for name, g in g_whole.items():
        torch.testing.assert_close(g_part[name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("cfg", TERM_CFGS)
def test_masked_and_fixed_shape_paths_agree_with_tv_and_confidence(setup, cfg):  # noqa: F811
    masked, g_masked = run_loss(setup, cfg, sync_free=False)
    fixed, g_fixed = run_loss(setup, cfg, sync_free=True)
    torch.testing.assert_close(fixed.loss, masked.loss, rtol=1e-5, atol=1e-7)
    for name, g in g_masked.items():
        torch.testing.assert_close(g_fixed[name], g, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("cfg", [*TERM_CFGS, LossConfig(kl_weight=0.5)])
def test_every_loss_path_reports_the_tv_and_confidence_means_it_weighs(setup, cfg):  # noqa: F811
    """Invariant: the step's metrics carry the unweighted TV and confidence means over trained
    slots, the same (and finite) on the masked, fixed-shape and chunked paths; None when the
    term's weight is 0, as ``kl`` is 0 then."""
    paths = [run_loss(setup, cfg, **kw)[0] for kw in
             ({"sync_free": False}, {"sync_free": True}, {"sync_free": True, "lm_head_chunk": 7})]
    for name, weight in (("tv", cfg.tv_weight), ("conf", cfg.conf_weight)):
        values = [getattr(out, name) for out in paths]
        if weight == 0:
            assert values == [None, None, None], name
            continue
        assert all(v is not None and math.isfinite(float(v)) and float(v) > 0 for v in values), (name, values)
        for v in values[1:]:
            torch.testing.assert_close(v, values[0], rtol=1e-5, atol=1e-7)


def test_dspark_loss_matches_the_blockwise_reference(blockwise_setup):  # noqa: F811
    """Invariant: with TV and confidence on, slot j of the block at anchor a is still scored
    against token a + j and the target logits of position a + j - 1."""
    s = blockwise_setup
    cfg = LossConfig(label="target_argmax", tv_weight=0.9, conf_weight=1.0, weighting="none")
    out = compute_loss(s["drafter"], s["head"], loss_input(s), cfg)
    with torch.no_grad():
        ref_loss, _, n = slow_reference(s, cfg)
    assert out.num_predictions == n > 20
    assert out.loss.item() == pytest.approx(ref_loss, rel=1e-4)


# -- config ---------------------------------------------------------------------------------------

def test_weights_are_checked_and_the_default_hash_is_kept():
    """Invariant: kl_weight + tv_weight > 1 (a negative CE weight) is one config error; the new
    keys at 0 leave the config hash as it was, and switching one on changes it."""
    from dflash.run.config import config_hash, load_config
    from tests.dflash.run.test_run_e2e import GRAPH

    with pytest.raises(ConfigError, match=r"tv_weight must be in \[0, 1 - kl_weight\]") as exc:
        load_config(GRAPH, ["loss.tv_weight=0.5"])        # the example has kl_weight = 1.0
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="conf_weight"):
        load_config(GRAPH, ["loss.conf_weight=-1"])
    base = load_config(GRAPH, ["loss.kl_weight=0.0"])
    explicit = load_config(GRAPH, ["loss.kl_weight=0.0", "loss.tv_weight=0.0", "loss.conf_weight=0.0"])
    on = load_config(GRAPH, ["loss.kl_weight=0.0", "loss.tv_weight=0.9", "loss.conf_weight=1.0"])
    assert config_hash(base) == config_hash(explicit) != config_hash(on)


def test_a_checkpoint_saved_before_the_new_terms_resumes_without_a_reported_change():
    """Invariant: a train_config.json written before tv_weight/conf_weight existed compares equal to
    today's config with both at 0 (what that code trained), and switching one on is named."""
    from dflash.checkpoint.config_changes import config_changes
    from dflash.run.config import added_later_keys

    old = {"loss": {"label": "data", "kl_weight": 0.0}, "run": {"steps": 4}}
    same = {"loss": {"label": "data", "kl_weight": 0.0, "tv_weight": 0.0, "conf_weight": 0.0}, "run": {"steps": 4}}
    assert config_changes(old, same, added_later_keys()) == []
    on = {**same, "loss": {**same["loss"], "tv_weight": 0.9}}
    assert config_changes(old, on, added_later_keys()) == ["loss.tv_weight 0.0 -> 0.9 (loss)"]
