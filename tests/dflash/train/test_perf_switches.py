"""The engine and kernel switches of the target and the drafter: each off by default, each equal to
the default path within its tolerance.

* ``[target].attn_implementation = "varlen"``: the sequence boundaries of packed rows, and (CPU, with
  a per-sequence SDPA standing in for the CUDA-only kernel) the whole path through transformers
  equal to the document mask's features; on the GPU the real kernel against ``sdpa`` in bf16.
* ``[target].quantization = "fp8"`` and ``"varlen"``: refused in one line where they cannot run.
* ``[target].compile``: the compiled shape runs compiled, another shape eagerly with one log line.
* ``[drafter].kernels = "liger"``: off CUDA the torch ops run (bitwise the default); on the GPU the
  Liger kernels give the same loss and gradients to bf16 rounding.
* ``[drafter].compile``: in place (same state-dict keys), same loss and gradients.
* ``[train].lm_head = "liger"``: refused with a KL, TV or confidence term; on the GPU the same loss, metrics and
  gradients as the chunked head.
* The config hash of a file that leaves every switch at its default is unchanged.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import sys
import types

import msgspec
import pytest
import torch

from dflash.errors import ConfigError
from dflash.messages import LossInput
from dflash.model import target as target_mod
from dflash.model import target_engine
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target
from dflash.train.anchors import sample_anchors
from dflash.train.loss import LossConfig
from dflash.train.objective import compute_loss
from tests.helpers import varlen_reference

CUDA = torch.cuda.is_available()
HAS = {p: importlib.util.find_spec(p) is not None for p in ("liger_kernel", "torchao", "triton")}
BS = 4

DOC = torch.tensor([[0] * 10 + [1] * 6, [0] * 12 + [-1] * 4])
POS = torch.stack([torch.cat([torch.arange(10), torch.arange(6)]),
                   torch.cat([torch.arange(12), torch.zeros(4, dtype=torch.long)])])


# -- varlen ---------------------------------------------------------------------------------------

def test_varlen_boundaries_split_documents_and_padding():
    """One sequence per document run of a row, every padding token its own sequence; rows never
    merge (row 0 ends in document 1, row 1 starts with document 0)."""
    kw = target_engine.varlen_kwargs(DOC)
    assert kw["cu_seq_lens_q"].tolist() == [0, 10, 16, 28, 29, 30, 31, 32]
    assert kw["cu_seq_lens_q"].dtype == torch.int32 and kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"]
    assert kw["max_length_q"] == kw["max_length_k"] == 12
    same = torch.tensor([[3, 3, 3, 3]])  # a document split across two rows stays two sequences
    assert target_engine.varlen_kwargs(torch.cat([same, same])).get("cu_seq_lens_q").tolist() == [0, 4, 8]
    assert target_engine.varlen_kwargs(DOC, max_length=16)["max_length_q"] == 16


def test_varlen_path_equals_document_mask_on_cpu(monkeypatch):
    """The varlen path through transformers (registration, no mask, the cu_seq_lens keyword
    arguments reaching every layer, the [B*T, h, d] layout and back) gives the document mask's
    features at every real token, with a per-sequence SDPA in place of the CUDA-only kernel."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    monkeypatch.setattr(varlen, "varlen_attn", varlen_reference)
    monkeypatch.setattr(target_mod, "check_engine", lambda *a: None)  # the real one refuses the CPU
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    feats = {}
    for impl in ("sdpa", "varlen"):
        t = load_target(TargetConfig(preset="tiny", seed=3, attn_implementation=impl), "cpu", 2)
        feats[impl], final = t(ids, POS, DOC)
        assert final is not None
    real = DOC >= 0
    torch.testing.assert_close(feats["varlen"][real], feats["sdpa"][real], rtol=1e-5, atol=1e-5)


def test_engine_settings_refused_where_they_cannot_run(monkeypatch):
    """One ConfigError line naming the setting: fp8 or varlen on the CPU, fp8 without torchao."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: types.SimpleNamespace() if n == "torchao" else real(n, *a))
    with pytest.raises(ConfigError, match="target.quantization = 'fp8' needs a CUDA GPU"):
        target_engine.check_engine("fp8", "sdpa", "cpu", torch.bfloat16)
    with pytest.raises(ConfigError, match="target.attn_implementation = 'varlen' runs bf16/fp16 on CUDA"):
        target_engine.check_engine("none", "varlen", "cpu", torch.float32)
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torchao" else real(n, *a))
    with pytest.raises(ConfigError, match="needs the torchao package") as exc:
        load_target(TargetConfig(preset="tiny", quantization="fp8"), "cpu", 2)
    assert "\n" not in str(exc.value)
    target_engine.check_engine("none", "sdpa", "cpu", torch.float32)  # the defaults always pass


def test_compiled_layers_run_eagerly_for_another_shape(monkeypatch, caplog):
    """The first batch's shape is compiled; another shape runs the eager forwards with one log
    line per new shape (not per batch), and the first shape goes back to the compiled ones."""
    calls: list[str] = []

    def fake_compile(fn, mode=None):
        def compiled(*a, **k):
            calls.append("compiled")
            return fn(*a, **k)
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    t = load_target(TargetConfig(preset="tiny", seed=3, compile=True), "cpu", 2)
    ref = load_target(TargetConfig(preset="tiny", seed=3), "cpu", 2)
    n = len(t.decoder_layers)
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="dflash.model.target_engine"):
        a, _ = t(ids, POS, DOC)
        assert len(calls) == n
        for _ in range(2):  # another shape, twice: eager, one line
            t(ids[:1], POS[:1], DOC[:1])
        assert len(calls) == n
        t(ids, POS, DOC)
        assert len(calls) == 2 * n
    lines = [r.getMessage() for r in caplog.records if "target.compile" in r.getMessage()]
    assert len(lines) == 1 and "[1, 16]" in lines[0] and "[2, 16]" in lines[0]
    torch.testing.assert_close(a, ref(ids, POS, DOC)[0], rtol=0, atol=0)


# -- drafter kernels --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def batch():
    tcfg = TargetConfig(preset="tiny", seed=5, vocab_size=200)
    target = load_target(tcfg, "cpu", num_draft_layers=2)
    dcfg = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=199).resolve(target.hf_config,
                                                                                 target.layer_ids)
    g = torch.Generator().manual_seed(3)
    T = 40
    ids = torch.randint(0, 199, (2, T), generator=g)
    doc = torch.tensor([[0] * 25 + [1] * 15, [0] * 30 + [-1] * 10])
    pos = torch.stack([torch.cat([torch.arange(25), torch.arange(15)]),
                       torch.cat([torch.arange(30), torch.zeros(10, dtype=torch.long)])])
    lm = (torch.rand(2, T, generator=g) < 0.8) & (doc >= 0)
    with torch.no_grad():
        feats, final = target(ids, pos, doc)
    anchors = sample_anchors(lm, doc, 8, BS, torch.Generator().manual_seed(0))
    x = LossInput(features=feats, input_ids=ids, loss_mask=lm, doc_ids=doc, position_ids=pos,
                  anchors=anchors, final_hidden=final)
    return dict(head=target.shared_head(), dcfg=dcfg, x=x)


def run(b, cfg=LossConfig(), device="cpu", autocast=False, lm_head=None, **dcfg_fields):
    d = DFlashDrafter(msgspec.structs.replace(b["dcfg"], **dcfg_fields), seed=1).to(device)
    x = b["x"] if device == "cpu" else LossInput(**{
        f: (getattr(b["x"], f).to(device) if getattr(b["x"], f) is not None else None)
        for f in LossInput.__struct_fields__})
    head = copy.deepcopy(b["head"]).to(device) if device != "cpu" else b["head"]
    with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False):
        out = compute_loss(d, head, x, cfg, **({"lm_head": lm_head} if lm_head else {}), lm_head_chunk=16)
    out.loss.backward()
    return d, out, {n: p.grad.clone() for n, p in d.named_parameters()}


def test_liger_kernels_fall_back_to_torch_off_cuda(batch, monkeypatch):
    """With drafter.kernels = "liger" on the CPU the torch ops run (Triton has no CPU backend): the
    loss and gradients are bitwise the default's, the state-dict keys unchanged, no Liger call."""
    fake = types.ModuleType("liger_kernel.transformers.functional")
    fake.liger_rms_norm = fake.liger_swiglu = lambda *a: pytest.fail("a Liger kernel ran on the CPU")
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: types.SimpleNamespace() if n in ("liger_kernel", "triton") else real(n, *a))
    d0, out0, g0 = run(batch)
    d1, out1, g1 = run(batch, kernels="liger")
    assert list(d1.state_dict()) == list(d0.state_dict())
    assert out1.loss.item() == out0.loss.item()
    for n, g in g0.items():
        assert torch.equal(g1[n], g), n


def test_liger_kernels_refused_without_the_package(batch, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "liger_kernel" else real(n, *a))
    with pytest.raises(ConfigError, match="drafter.kernels = 'liger' needs the liger_kernel"):
        DFlashDrafter(msgspec.structs.replace(batch["dcfg"], kernels="liger"), seed=1)


def test_drafter_compile_in_place_same_loss_and_grads(batch, monkeypatch):
    """drafter.compile compiles each layer in place: the state-dict keys stay ``layers.N...`` and
    loss and gradients equal the eager ones. (Inductor takes minutes on a shared CPU, so the
    compiler here is dynamo with the eager backend; the GPU test below runs inductor.)"""
    real = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: real(self, backend="eager"))
    d0, out0, g0 = run(batch)
    d1, out1, g1 = run(batch, compile=True)
    assert list(d1.state_dict()) == list(d0.state_dict())
    assert all(layer._compiled_call_impl is not None for layer in d1.layers)
    torch.testing.assert_close(out1.loss, out0.loss, rtol=1e-6, atol=1e-6)
    for n, g in g0.items():
        torch.testing.assert_close(g1[n], g, rtol=1e-5, atol=1e-6, msg=n)


# -- config -----------------------------------------------------------------------------------------

def _cfg(*sets):
    from dflash.run.config import load_config

    return load_config("examples/qwen3-8b-h200.toml", list(sets))


def test_config_hash_unchanged_when_switches_are_default():
    """A file that leaves the speed switches at their defaults keeps the hash it had before they
    existed (checkpoints resume without a 'config differs' warning); setting one changes it. The
    example file itself compiles both stages and runs the target on varlen attention, so its
    defaults are taken with those set back."""
    from dflash.run.config import config_hash

    defaults = ("drafter.compile=false", "target.compile=false", 'target.attn_implementation="flex_attention"')
    assert config_hash(_cfg(*defaults)) == "5e292ff0d990de03"
    assert config_hash(_cfg()) != "5e292ff0d990de03"
    for s in ('train.lm_head="liger"', 'target.quantization="fp8"',  # each with the others at their defaults
              'drafter.kernels="liger"', "target.compile=true", "drafter.compile=true"):
        assert config_hash(_cfg(*defaults, s)) != "5e292ff0d990de03", s


def check_fast_paths(cfg):
    """The rules of the fast paths, as dflash.run.validate runs them: the drafter's kernels, the
    fused LM head against the loss, the target's engine against its devices."""
    from dflash.model.drafter_config import check_drafter_devices
    from dflash.model.target_config import check_target_devices
    from dflash.run.resolve import resolve_drafter, target_hf_config
    from dflash.run.validate import devices_of
    from dflash.train.config import check_train

    drafter = resolve_drafter(cfg, target_hf_config(cfg.target))
    check_drafter_devices(drafter, devices_of(cfg, "dflash.drafter"))
    check_train(cfg.train, cfg.loss, drafter, devices_of(cfg, "dflash.drafter"))
    check_target_devices(cfg.target, devices_of(cfg, "dflash.target"))


def test_validate_refuses_fused_head_with_kl_and_cpu_engines(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: types.SimpleNamespace() if n in ("liger_kernel", "torchao") else real(n, *a))
    check_fast_paths(_cfg('train.lm_head="liger"', 'target.quantization="fp8"',
                          'target.attn_implementation="varlen"'))
    with pytest.raises(ConfigError, match="loss.kl_weight = 0.5"):
        check_fast_paths(_cfg('train.lm_head="liger"', "loss.kl_weight=0.5"))
    with pytest.raises(ConfigError, match="loss.conf_weight = 1"):
        check_fast_paths(_cfg('train.lm_head="liger"', "loss.conf_weight=1.0"))
    with pytest.raises(ConfigError, match="train.sync_free_loss = true"):
        check_fast_paths(_cfg('train.lm_head="liger"', "train.sync_free_loss=false"))
    with pytest.raises(ConfigError, match="process 'target' runs on cpu"):
        check_fast_paths(_cfg('target.quantization="fp8"', 'process.target.device="cpu"'))
    monkeypatch.setattr(importlib.util, "find_spec", real)
    if not HAS["liger_kernel"]:
        with pytest.raises(ConfigError, match="needs the liger-kernel package"):
            check_fast_paths(_cfg('drafter.kernels="liger"'))


# -- GPU: the real kernels ------------------------------------------------------------------------
# Triton, torchao and Liger warn about versions and deprecations outside this project's control.
_third_party_warnings = [pytest.mark.filterwarnings(f"ignore::{w}") for w in
                         ("UserWarning", "DeprecationWarning", "FutureWarning")]


def gpu_test(fn):
    for mark in [pytest.mark.gpu, pytest.mark.timeout(180), *_third_party_warnings]:
        fn = mark(fn)
    return fn


def _gpu_target(**fields):
    return load_target(TargetConfig(preset="tiny", seed=3, dtype="bfloat16", **fields), "cuda", 2)


@gpu_test
@pytest.mark.skipif(not CUDA, reason="needs CUDA: varlen_attn is FlashAttention-2 in aten")
def test_gpu_varlen_features_equal_sdpa():
    """bf16 features of the varlen path equal the dense document mask's at every real token within
    bf16 tolerance (FlashAttention-2 against SDPA: different summation order)."""
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    pos, doc = POS.cuda(), DOC.cuda()
    a, fa = _gpu_target()(ids, pos, doc)
    b, fb = _gpu_target(attn_implementation="varlen")(ids, pos, doc)
    real = doc >= 0
    torch.testing.assert_close(b[real].float(), a[real].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fb[real].float(), fa[real].float(), rtol=2e-2, atol=2e-2)


@gpu_test
@pytest.mark.skipif(not (CUDA and HAS["torchao"]), reason="needs CUDA and torchao")
def test_gpu_fp8_quantizes_decoder_linears_only():
    """fp8: every decoder Linear weight becomes a float8 tensor, the embedding and LM head stay
    bf16 (shared with the drafter), and the features stay close to bf16 (relative error < 0.1)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs compute capability >= 8.9")
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    ref = _gpu_target()
    q = _gpu_target(quantization="fp8")
    assert q.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert q.model.lm_head.weight.dtype == torch.bfloat16
    linears = [(n, m) for n, m in q.decoder_layers.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all("Float8" in type(m.weight).__name__ for _, m in linears), linears[0]
    a, _ = ref(ids, POS.cuda(), DOC.cuda())
    b, _ = q(ids, POS.cuda(), DOC.cuda())
    rel = (b.float() - a.float()).norm() / a.float().norm()
    assert rel < 0.1, rel


@gpu_test
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_target_compile_equals_eager():
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    a, _ = _gpu_target()(ids, POS.cuda(), DOC.cuda())
    b, _ = _gpu_target(compile=True)(ids, POS.cuda(), DOC.cuda())
    torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)


@gpu_test
@pytest.mark.skipif(not (CUDA and HAS["torchao"]), reason="needs CUDA and torchao")
def test_gpu_fp8_compiled_varlen_target_equals_eager_fp8():
    """The fastest target measured (fp8, varlen, compiled) is as close to the bf16 target as the eager
    fp8 target is: compile changes kernels (its fused activation scaling may round a value to the
    neighbouring e4m3 step, ~6% apart), not how far the features the drafter trains on are from bf16."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs compute capability >= 8.9")
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    ref, _ = _gpu_target(attn_implementation="varlen")(ids, POS.cuda(), DOC.cuda())
    a, _ = _gpu_target(quantization="fp8", attn_implementation="varlen")(ids, POS.cuda(), DOC.cuda())
    b, _ = _gpu_target(quantization="fp8", attn_implementation="varlen", compile=True)(ids, POS.cuda(), DOC.cuda())
    rel = lambda x, y: float((x.float() - y.float()).norm() / y.float().norm())  # noqa: E731
    eager_err, compiled_err, between = rel(a, ref), rel(b, ref), rel(b, a)
    print(f"fp8 eager vs bf16 {eager_err:.4f}, compiled vs bf16 {compiled_err:.4f}, compiled vs eager {between:.4f}")
    assert compiled_err < 1.25 * eager_err + 1e-3, (compiled_err, eager_err)
    assert between < 1.5 * eager_err + 1e-3, (between, eager_err)


def _assert_same_training(ref, new, rtol=2e-2, atol=2e-3, grad_rtol=3e-2):
    (_, o0, g0), (_, o1, g1) = ref, new
    torch.testing.assert_close(o1.loss, o0.loss, rtol=rtol, atol=atol)
    torch.testing.assert_close(o1.ce, o0.ce, rtol=rtol, atol=atol)
    for n, g in g0.items():
        assert g.abs().max() > 0, n
        rel = (g1[n] - g).norm() / g.norm()
        assert rel < grad_rtol, (n, rel.item())


@gpu_test
@pytest.mark.skipif(not (CUDA and HAS["liger_kernel"]), reason="needs CUDA and liger-kernel")
def test_gpu_liger_kernels_same_loss_and_grads(batch):
    """drafter.kernels = "liger" under bf16 autocast: loss, CE and every gradient equal the torch
    ops' within bf16 rounding (gradient relative error < 3%)."""
    _assert_same_training(run(batch, device="cuda", autocast=True),
                          run(batch, device="cuda", autocast=True, kernels="liger"))


@gpu_test
@pytest.mark.skipif(not CUDA, reason="needs CUDA (inductor on the CPU takes minutes)")
def test_gpu_drafter_compile_same_loss_and_grads(batch):
    _assert_same_training(run(batch, device="cuda", autocast=True),
                          run(batch, device="cuda", autocast=True, compile=True))


@gpu_test
@pytest.mark.skipif(not (CUDA and HAS["liger_kernel"]), reason="needs CUDA and liger-kernel")
@pytest.mark.parametrize("cfg", [LossConfig(), LossConfig(label="target_argmax", weighting="streak")])
def test_gpu_liger_lm_head_same_loss_and_grads(batch, cfg):
    """train.lm_head = "liger": same loss, CE, accuracy and gradients as the chunked head."""
    ref = run(batch, cfg, device="cuda", autocast=True)
    new = run(batch, cfg, device="cuda", autocast=True, lm_head="liger")
    _assert_same_training(ref, new)
    torch.testing.assert_close(new[1].acc_per_pos, ref[1].acc_per_pos, equal_nan=True, atol=0.05, rtol=0)


# -- the harness ------------------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_perf_harness_smoke_writes_every_row(tmp_path):
    """benchmarks/h200/perf.py --smoke (tiny shapes, CPU) runs its plan and records every CPU row as
    ok and every CUDA-only row as skipped with its reason, in OUT/perf.json."""
    import json

    from benchmarks.h200 import perf as h200_perf

    out = tmp_path / "out"
    h200_perf.main(["--smoke", "--out", str(out), "--warmup", "1", "--steps", "1",
                    "--run-root", str(tmp_path / "runs")])
    doc = json.loads((out / "perf.json").read_text())
    rows = doc["rows"]
    assert doc["complete"]
    for name in ("matmul_bf16", "target_bf16", "drafter_default", "profile_target_bf16", "profile_drafter_default"):
        assert rows[name]["status"] == "ok", (name, rows[name])
    assert rows["target_bf16"]["tok_s"] > 0 and rows["drafter_default"]["mfu"] > 0
    for name in ("drafter_liger_kernels", "drafter_liger_head", "drafter_compile", "drafter_compile_optim",
                 "drafter_compile_head", "drafter_compile_optim_head", "drafter_all", "fp8",
                 "drafter_fp8", "drafter_fp8_compile", "drafter_fp8_rowwise_compile"):
        assert rows[name]["status"] == "skipped" and rows[name]["reason"], name
    assert (out / "profile_target_bf16.txt").read_text().strip()
    # a profile carries its own window's wall time and rate, to set against the kernels' sum
    prof = rows["profile_target_bf16"]
    assert prof["steps"] >= 1 and prof["window_s"] > 0 and prof["tok_s"] > 0, prof
