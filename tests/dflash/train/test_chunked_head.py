"""dflash.train.chunked_head with a bf16 head, as in training: the labels, argmaxes and top-K that
the chunks take from the head's own output equal those of fp32 copies of the whole logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.model.shared_head import SharedHead
from dflash.train.chunked_head import chunked_head_loss
from dflash.train.loss import LossConfig

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
