"""dflash.train.chunked_head with a bf16 head, as in training: the labels, argmaxes and top-K that
the chunks take from the head's own output equal those of fp32 copies of the whole logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.model.shared_head import SharedHead
from dflash.train.chunked_head import chunked_head_loss
from dflash.train.loss import LossConfig
from tests.dflash.train import test_perf_switches as switches

batch = switches.batch  # the fixture: a tiny target's features and one batch of anchors (block size 4)

M, H, V, K = 37, 16, 300, 8


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g).bfloat16()
    head = SharedHead(w, w)
    hidden = torch.randn(M, H, generator=g).bfloat16().requires_grad_(True)
    target_hidden = torch.randn(M, H, generator=g).bfloat16()
    data = torch.randint(0, V, (M,), generator=g)
    return head, hidden, target_hidden, data


@pytest.mark.parametrize("chunk", [5, 16, M])  # a ragged last chunk, and one chunk
@pytest.mark.parametrize("label,kl_weight", [("target_argmax", 0.0), ("data", 0.0), ("target_argmax", 0.3)])
def test_bf16_head_chunks_equal_the_fp32_reference(chunk, label, kl_weight):
    head, hidden, target_hidden, data = _inputs()
    cfg = LossConfig(label=label, kl_weight=kl_weight)
    l, ce, kl, _, _, draft_arg, accept, top_v, top_i = chunked_head_loss(
        hidden, head, target_hidden, data, cfg, chunk, topk=K)

    z = head.logits(hidden.detach()).float()
    zt = head.logits(target_hidden).float()
    y = zt.argmax(-1) if label == "target_argmax" else data
    assert torch.equal(draft_arg, z.argmax(-1))
    assert torch.equal(accept, zt.argmax(-1))
    ref_v, _ = torch.topk(z, K, dim=-1)
    torch.testing.assert_close(top_v, ref_v, rtol=0, atol=0)  # the same K values, largest first
    assert torch.equal(z.gather(1, top_i), top_v)              # and the ids point at them
    ref_ce = -F.log_softmax(z, -1).gather(1, y[:, None]).squeeze(1)
    torch.testing.assert_close(ce, ref_ce)
    if kl_weight:
        ref_kl = (F.softmax(zt, -1) * (F.log_softmax(zt, -1) - F.log_softmax(z, -1))).sum(-1)
        torch.testing.assert_close(kl, ref_kl, rtol=1e-4, atol=1e-5)
    else:
        assert torch.all(kl == 0)
    l.sum().backward()  # the gradient reaches the hidden states, in their dtype
    assert hidden.grad is not None and hidden.grad.dtype == torch.bfloat16 and torch.isfinite(hidden.grad).all()


@pytest.fixture
def frames(monkeypatch):
    """``torch.compile`` with dynamo's eager backend (inductor takes minutes on a shared CPU; the GPU
    test below runs it), counting the graphs compiled, and the compiled head function made afresh."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from dflash.train import chunked_head

    counter = CompileCounterWithBackend("eager")
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": counter}))
    chunked_head.compiled_ce_and_grad.cache_clear()
    torch._dynamo.reset()
    yield counter
    chunked_head.compiled_ce_and_grad.cache_clear()
    torch._dynamo.reset()


@pytest.mark.parametrize("kl_weight", [0.0, 0.3])
def test_compiled_head_gives_the_eager_loss_and_gradient(frames, kl_weight):
    """Invariant (``[train].compile_head``): the compiled chunks give the eager chunks' loss terms,
    argmaxes and top-K, and the same gradient to the hidden states; a ragged last chunk makes a
    second graph, a second call none. With a KL term the chunks run eagerly: nothing compiles."""
    cfg = LossConfig(label="target_argmax", kl_weight=kl_weight)
    outs, grads = [], []
    for compiled in (False, True, True):
        head, hidden, target_hidden, data = _inputs()
        out = chunked_head_loss(hidden, head, target_hidden, data, cfg, 16, topk=K, compiled=compiled)
        out[0].sum().backward()
        outs.append(out)
        grads.append(hidden.grad)
    for out, grad in zip(outs[1:], grads[1:]):
        for a, b in zip(outs[0], out):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, grads[0], rtol=0, atol=0)
    assert frames.frame_count == (0 if kl_weight else 2)  # chunks of 16, 16 and 5 slots


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (inductor's GPU kernels)")
def test_gpu_compiled_head_matches_eager_through_inductor():
    """Invariant on a GPU, inductor compiling: the same CE and the same hidden-state gradient as the
    eager chunks to bf16 rounding (the gradient is cast to the head's bf16 either way)."""
    from dflash.train import chunked_head

    chunked_head.compiled_ce_and_grad.cache_clear()
    cfg = LossConfig(label="target_argmax")
    got = []
    for compiled in (False, True):
        head, hidden, target_hidden, data = _inputs()
        head = head.cuda()
        hidden = hidden.detach().cuda().requires_grad_(True)
        out = chunked_head_loss(hidden, head, target_hidden.cuda(), data.cuda(), cfg, 16, topk=K, compiled=compiled)
        out[0].sum().backward()
        got.append((out[1], hidden.grad))
    torch.testing.assert_close(got[1][0], got[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1][1], got[0][1], rtol=2e-2, atol=1e-3)


def test_compute_loss_passes_compile_head_to_the_chunks(frames, batch):
    """Invariant: ``compute_loss(..., compile_head=True)`` (what ``[train].compile_head`` sets in
    the step) runs its chunks through the compiled function, and its loss is the eager one's."""
    from dflash.model.drafter import DFlashDrafter
    from dflash.train.objective import compute_loss

    b = batch
    losses = []
    for compile_head in (False, True):
        d = DFlashDrafter(b["dcfg"], seed=1)
        out = compute_loss(d, b["head"], b["x"], LossConfig(), lm_head_chunk=16, compile_head=compile_head)
        losses.append(out.loss.detach())
    assert frames.frame_count >= 1
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
