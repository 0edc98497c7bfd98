"""``[drafter].precision = "fp8"``: torchao's float8 training Linears in the drafter's backbone.

On the CPU, torch emulates the float8 matmuls (``torch._scaled_mm`` has a CPU kernel), which is
slow but exact enough to check what the swap does to the module, the state dict and the loss; the
run itself refuses a CPU drafter (the preflight). The GPU tests train on the real kernels.
"""

from __future__ import annotations

import importlib.util
import types

import msgspec
import pytest
import torch

from dflash.errors import ConfigError
from dflash.model.drafter import DFlashDrafter
from dflash.model.drafter_config import check_drafter_devices
from dflash.model.drafter_fp8 import FP8_LINEARS, fp8_linear_count
from tests.dflash.train import test_perf_switches as switches
from tests.dflash.train.test_perf_switches import CUDA, _assert_same_training, _cfg, check_fast_paths, gpu_test, run

batch = switches.batch  # the fixture: a tiny target's features and one batch of anchors (block size 4)

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="needs torchao (pip install torchao; the test extra has it)")


def _drafter(batch, **fields):
    return DFlashDrafter(msgspec.structs.replace(batch["dcfg"], **fields), seed=1)


@needs_torchao
@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_fp8_swaps_the_backbone_linears_and_keeps_the_weights(batch, variant):
    """fc and the 7 projections of every layer become Float8Linear; DFlash2's convolution-tap and
    selector projections stay plain; the state dict has the same keys, dtypes and values as the
    bf16 drafter of the same seed (so checkpoints, snapshots and exports are unchanged)."""
    from torchao.float8.float8_linear import Float8Linear

    plain = _drafter(batch, variant=variant)
    fp8 = _drafter(batch, variant=variant, precision="fp8")
    swapped = {n for n, m in fp8.named_modules() if isinstance(m, Float8Linear)}
    expected = {"fc"} | {f"layers.{i}.{part}.{p}" for i in range(plain.cfg.num_layers)
                         for part, ps in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                          ("mlp", ("gate_proj", "up_proj", "down_proj"))) for p in ps}
    assert swapped == expected
    assert fp8_linear_count(fp8) == len(expected) == 1 + 7 * plain.cfg.num_layers
    assert all(n.rsplit(".", 1)[-1] in FP8_LINEARS for n in swapped)
    if variant == "dflash2":
        others = [n for n, m in fp8.named_modules() if type(m) is torch.nn.Linear]
        assert any("kernel_projection" in n for n in others) and any("hidden_projection" in n for n in others)
    a, b = plain.state_dict(), fp8.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert b[k].dtype == a[k].dtype and torch.equal(b[k], a[k]), k


@needs_torchao
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_loss_and_gradients_follow_full_precision(batch, recipe):
    """One float8 step (CPU emulation, fp32 master weights) against the fp32 one: the loss within
    float8's rounding (e4m3 keeps 3 mantissa bits; measured 0.1%), every gradient nonzero and
    pointing the same way (cosine > 0.97; measured > 0.99), each weight's gradient in fp32 like its weight."""
    _, o0, g0 = run(batch)
    d1, o1, g1 = run(batch, precision="fp8", fp8_recipe=recipe)
    assert torch.isfinite(o1.loss)
    torch.testing.assert_close(o1.loss, o0.loss, rtol=0.01, atol=0)
    for n, g in g0.items():
        got = g1[n]
        assert got.dtype == torch.float32 and got.abs().max() > 0, n
        cos = torch.nn.functional.cosine_similarity(got.flatten(), g.flatten(), dim=0)
        assert cos > 0.97, (n, cos.item())


@needs_torchao
def test_checkpoint_of_an_fp8_run_decodes_in_plain_precision(batch, tmp_path):
    """A drafter trained in float8 is saved with ``precision = "fp8"`` in its config; loading it
    for decoding (dflash.eval, export) builds plain Linears with the same weights."""
    from dflash.checkpoint.model_files import load_drafter, save_drafter
    from dflash.model.target import TargetConfig

    d = _drafter(batch, precision="fp8")
    save_drafter(tmp_path, d, d.cfg, TargetConfig(preset="tiny", seed=5, vocab_size=200))
    loaded, dc, _ = load_drafter(tmp_path)
    assert dc.precision == "fp8"  # the record of how it trained
    assert fp8_linear_count(loaded) == 0
    for k, v in d.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_fp8_refused_where_it_cannot_run(batch, monkeypatch):
    """The preflight's one line: a CPU drafter, a machine without CUDA, no torchao."""
    cfg = msgspec.structs.replace(batch["dcfg"], precision="fp8")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: types.SimpleNamespace() if n == "torchao" else real(n, *a))
    with pytest.raises(ConfigError, match="process 'drafter' runs on cpu: set drafter.precision = \"bf16\""):
        check_drafter_devices(cfg, ["cpu"])
    if not CUDA:
        with pytest.raises(ConfigError, match="this machine has none visible"):
            check_drafter_devices(cfg, ["cuda:0"])
        with pytest.raises(ConfigError, match="drafter.precision"):  # the 8B example graph, as dflash.run checks it
            check_fast_paths(_cfg('drafter.precision="fp8"'))
    check_drafter_devices(msgspec.structs.replace(cfg, precision="bf16"), ["cpu"])  # bf16: nothing to refuse
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torchao" else real(n, *a))
    with pytest.raises(ConfigError, match="needs the torchao package"):
        check_drafter_devices(cfg, ["cuda:0"])


def test_config_hash_changes_only_when_fp8_is_set():
    """bf16 written out hashes as a file without the key (older checkpoints resume quietly); fp8
    changes the numerics, so it changes the hash."""
    from dflash.run.config import config_hash

    base = config_hash(_cfg())
    assert config_hash(_cfg('drafter.precision="bf16"', 'drafter.fp8_recipe="tensorwise"')) == base
    assert config_hash(_cfg('drafter.precision="fp8"')) != base
    assert config_hash(_cfg('drafter.precision="fp8"', 'drafter.fp8_recipe="rowwise"')) != \
        config_hash(_cfg('drafter.precision="fp8"'))


# -- GPU: the float8 tensor cores -------------------------------------------------------------------
FP8_GPU = CUDA and HAS_TORCHAO and torch.cuda.get_device_capability() >= (8, 9)


@gpu_test
@pytest.mark.skipif(not FP8_GPU, reason="needs a CUDA GPU of compute capability >= 8.9 and torchao")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_fp8_training_step_follows_bf16(batch, recipe, compile):
    """Under bf16 autocast on float8 tensor cores, eager and compiled: the loss within 3% of the
    bf16 step's and every gradient within 25% (relative L2; float8 rounds to 3 mantissa bits)."""
    ref = run(batch, device="cuda", autocast=True)
    new = run(batch, device="cuda", autocast=True, precision="fp8", fp8_recipe=recipe, compile=compile)
    assert fp8_linear_count(new[0]) == 1 + 7 * new[0].cfg.num_layers
    _assert_same_training(ref, new, rtol=3e-2, atol=0, grad_rtol=0.25)
