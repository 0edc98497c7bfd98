"""Tree verification in the exported ``spec_generate`` (``tree_budget > 0``): many drafted paths
verified in one target forward under a tree attention mask, only the accepted path kept in the
target's cache. Greedy, the output must still be the target's own greedy text, whatever the budget,
the variant, the length and the stop tokens."""

from __future__ import annotations

import functools

import pytest
import torch

from dflash.eval.tree import best_first
from dflash.export import export_drafter
from dflash.model import modeling_dflash as md
from tests.dflash.model.test_spec_generate import PROMPT, _export, _greedy, _target

pytestmark = pytest.mark.timeout(300)


def _counted(target):
    """``target`` whose forward records each call's input length (1 + the tree's nodes on a verify)."""
    calls, forward = [], target.forward

    @functools.wraps(forward)  # the signature spec_generate reads its cache argument's name from
    def counting(input_ids, **kw):
        calls.append(input_ids.shape[1])
        return forward(input_ids, **kw)

    target.forward = counting
    return calls


@pytest.mark.parametrize("budget", [1, 4, 16, 40])
def test_a_tree_decode_is_the_targets_greedy_text(tmp_path, budget):
    """Invariant: greedy ``spec_generate(..., tree_budget=B)`` returns the target's greedy text for
    any budget (one node, fewer nodes than the block, more), with fewer target calls than tokens
    (paths accepted) and every verify over the anchor and B nodes (B bounded by what the block's
    positions and vocabulary allow)."""
    _, d = _export(tmp_path)
    target = _target()
    calls = _counted(target)
    got = d.spec_generate(target, PROMPT, max_new_tokens=40, stop_token_ids=None, tree_budget=budget)
    verifies = calls[1:]                                               # after the prefill
    assert torch.equal(got, _greedy(target, PROMPT, 40))
    assert len(verifies) < 39 and max(verifies) == 1 + budget


def test_a_tree_decode_stops_and_cuts_as_the_chain_does(tmp_path):
    """Invariant: the tree decode ends at max_new_tokens and right after the first stop token
    emitted (kept), as the chain decode does; a negative budget is refused in one line."""
    _, d = _export(tmp_path)
    target = _target(noise=1e-3)
    full = _greedy(target, PROMPT, 30)
    for n in (1, 2, 7, 30):
        assert torch.equal(d.spec_generate(target, PROMPT, max_new_tokens=n, stop_token_ids=None, tree_budget=8),
                           full[:, : 11 + n]), n
    new = full[0, 11:].tolist()
    cut = next(i for i in range(2, len(new)) if new[i] not in new[:i])
    got = d.spec_generate(target, PROMPT, max_new_tokens=30, stop_token_ids=[new[cut]], tree_budget=8)
    assert torch.equal(got, full[:, : 11 + cut + 1])
    with pytest.raises(ValueError, match="tree_budget"):
        d.spec_generate(target, PROMPT, max_new_tokens=4, stop_token_ids=None, tree_budget=-1)


def test_a_dflash2_tree_decode_is_greedy_and_a_one_hot_sampled_one_too(tmp_path):
    """Invariant: a DFlash2 export's tree (from its backbone's marginals, not the selector's walk)
    decodes the target's greedy text; sampled with top_k = 1 (every draw one-hot) the tree's walk
    gives the greedy text too."""
    from transformers import AutoModel

    from tests.dflash.export.test_dflash2_export import make as make2

    out = tmp_path / "export2"
    export_drafter(make2(), out, torch.float32)
    d = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    target = _target(noise=1e-3)
    want = _greedy(target, PROMPT, 30)
    assert torch.equal(d.spec_generate(target, PROMPT, max_new_tokens=30, stop_token_ids=None, tree_budget=12), want)
    torch.manual_seed(0)
    got = d.spec_generate(target, PROMPT, max_new_tokens=30, stop_token_ids=None, temperature=0.8, top_k=1,
                          tree_budget=12)
    assert torch.equal(got, want)


def test_the_shipped_tree_is_the_evaluators_tree():
    """Invariant: the export's tree builder (written out in the standalone modeling file) takes the
    same nodes, in the same order, as dflash.eval.tree.best_first: the tree dflash.eval measures is
    the tree spec_generate verifies."""
    g = torch.Generator().manual_seed(3)
    for budget in (1, 5, 16, 33):
        logits = torch.randn(7, 50, generator=g) * 3
        lp, ix = torch.log_softmax(logits, -1).topk(min(budget, 50), dim=-1)
        assert md._tree(logits, budget) == best_first(lp.tolist(), ix.tolist(), budget), budget
