"""dflash.train.anchors: blocks stay inside one document, honour the loss mask, are reproducible."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.train.anchors import sample_anchors


def _packed(lengths, pad, T_extra=0):
    doc = []
    for d, n in enumerate(lengths):
        doc += [d] * n
    doc += [-1] * pad
    return torch.tensor([doc])


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4), pad=st.integers(0, 6),
       bs=st.integers(2, 6), A=st.integers(1, 30), seed=st.integers(0, 10**6),
       mask_p=st.floats(0.0, 1.0))
def test_blocks_never_cross_documents_or_padding(lengths, pad, bs, A, seed, mask_p):
    doc = _packed(lengths, pad)
    T = doc.shape[1]
    g = torch.Generator().manual_seed(seed)
    loss_mask = (torch.rand(1, T, generator=g) < mask_p) & (doc >= 0)
    anchors = sample_anchors(loss_mask, doc, A, bs, torch.Generator().manual_seed(seed))
    assert anchors.shape == (1, A) and anchors.dtype == torch.int64
    got = anchors[anchors >= 0].tolist()
    assert got == sorted(set(got))                            # distinct, ascending, then -1s
    assert (anchors[0, len(got):] == -1).all()
    eligible = [a for a in range(T - bs + 1)
                if doc[0, a] >= 0 and (doc[0, a:a + bs] == doc[0, a]).all() and loss_mask[0, a + 1]]
    assert set(got) <= set(eligible)
    assert len(got) == min(A, len(eligible))                  # takes all when fewer are eligible


def test_reproducible_and_seed_dependent():
    doc = torch.zeros(2, 200, dtype=torch.long)
    lm = torch.ones(2, 200, dtype=torch.bool)
    a = sample_anchors(lm, doc, 16, 8, torch.Generator().manual_seed(7))
    b = sample_anchors(lm, doc, 16, 8, torch.Generator().manual_seed(7))
    c = sample_anchors(lm, doc, 16, 8, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a[0], a[1])                        # rows draw independently


def test_rejects_bad_arguments():
    doc = torch.zeros(1, 10, dtype=torch.long)
    lm = torch.ones(1, 10, dtype=torch.bool)
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(lm, doc, 0, 4, torch.Generator())
