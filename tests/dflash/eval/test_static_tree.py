"""The fixed-shape tree verify step (dflash.eval.static_tree): on a CPU the forward a CUDA graph
replays runs eagerly, and it must compute what the dynamic-cache tree verify computes, step by
step, and decode the same tokens with the same accepted lengths."""

from __future__ import annotations

import pytest
import torch

from dflash.eval import static_tree
from dflash.eval.decode import CachedTarget, greedy_decode
from dflash.eval.proposers import CachedDrafterProposer
from dflash.eval.static_tree import StaticTreeTarget, ancestors
from dflash.eval.tree_decode import _verify, tree_decode
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.modeling_dflash import keep_tree_rows, tree_mask
from tests.dflash.eval.test_static_target import BS, CUDA, V, _close, prompt, targets  # noqa: F401 - the fixture
from tests.sync_probe import SyncProbe

pytestmark = pytest.mark.timeout(300)

BUDGET = 6
# (parents of the nodes in best-first order, depth of each, path of accepted rows after row 0)
TREES = [
    ([-1, -1, 0, 0, 2, 1], [0, 0, 1, 1, 2, 1], [1, 3, 5]),      # a branching tree, 3 accepted
    ([-1, 0, 1], [0, 1, 2], []),                              # a chain shorter than the budget, none accepted
    ([-1, -1, -1, 2, 3, 0], [0, 0, 0, 1, 2, 1], [3, 4, 5]),   # the path through the third root
    ([-1], [0], [1]),                                         # one node, accepted
]


def test_the_ancestor_mask_is_the_exported_tree_mask():
    """Invariant: the static step's visibility among the tree's rows is the exported file's
    ``tree_mask`` (anchor, ancestors, self); padding rows see only themselves."""
    for parent, _, _ in TREES:
        anc = ancestors(parent, BUDGET + 1)
        exported = tree_mask(parent, 0, torch.float32, "cpu")[0, 0] == 0
        assert torch.equal(anc[: len(parent) + 1, : len(parent) + 1], exported)
        assert torch.equal(anc[len(parent) + 1:], torch.eye(BUDGET + 1, dtype=torch.bool)[len(parent) + 1:])


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tree_steps_compute_what_the_dynamic_cache_computes(targets, family):  # noqa: F811
    """Invariant: per tree step, the static step's logits and features equal transformers' forward
    with the 4-D tree mask over a dynamic cache (fp32), and after each step's path is kept (the
    dynamic cache re-indexed, the static one's rows moved into place) the next step still agrees:
    trees smaller than the budget, none and several nodes accepted."""
    target = targets[family]
    dyn, static = CachedTarget(target, 128), StaticTreeTarget(target, BUDGET, 128)
    p = prompt(1)
    f_d, l_d = dyn(p, 0, last_only=True)
    f_s, l_s = static.prefill(p)
    _close(f_s, f_d)
    _close(l_s, l_d)
    n = p.shape[0] + 1                                       # tokens[n-1] is the anchor
    for i, (parent, depth, path) in enumerate(TREES):
        ids = prompt(100 + i, len(parent) + 1)
        pos = torch.tensor([n - 1] + [n + d for d in depth])[None]
        f_d, l_d = _verify(dyn, ids, pos, tree_mask(parent, n - 1, target.model.dtype, "cpu"))
        f_s, l_s = static.verify(ids, depth, parent, n - 1)
        assert l_s.shape == (len(parent) + 1, V)
        _close(f_s, f_d)
        _close(l_s, l_d)
        rows = torch.tensor([0] + path)
        keep_tree_rows(dyn.cache, n - 1, rows)
        static.keep_path(n - 1, rows)
        n += len(path) + 1


def test_the_tree_step_reads_nothing_back_to_the_host(targets):  # noqa: F811
    """Invariant (what makes the tree step capturable): the step itself, given the tree in its
    static buffers, has no op that waits for the device."""
    run = StaticTreeTarget(targets["llama"], BUDGET, 64)
    run.prefill(prompt(3))
    parent, depth, _ = TREES[0]
    run.verify(prompt(4, len(parent) + 1), depth, parent, 9)
    with SyncProbe() as probe:
        run.tree_step()
    assert probe.syncs == []


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("budget", [1, 3, 12])
def test_tree_decodes_are_token_identical_with_the_static_step(targets, family, budget):  # noqa: F811
    """Invariant: ``cuda_graphs=True`` changes how the tree is verified, not what is decoded: the
    target's greedy text and the dynamic path's accepted lengths, greedy; and sampled, the same
    draws from the same generator."""
    target = targets[family]
    head = target.shared_head()
    cfg = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=V - 1).resolve(target.hf_config,
                                                                                  target.layer_ids)
    drafter = DFlashDrafter(cfg, seed=3).eval()
    for seed, n in [(1, 9), (2, 3)]:
        p = prompt(seed, n)
        ref = greedy_decode(target, p, 30)
        out, acc, anchors = tree_decode(target, CachedDrafterProposer(drafter, head), p, 30, BS, budget)
        out_s, acc_s, anchors_s = tree_decode(target, CachedDrafterProposer(drafter, head), p, 30, BS, budget,
                                              cuda_graphs=True)
        assert torch.equal(out, ref) and torch.equal(out_s, ref)
        assert acc_s == acc and anchors_s == anchors
        sampled = [tree_decode(target, CachedDrafterProposer(drafter, head), p, 20, BS, budget, temperature=1.0,
                               generator=torch.Generator().manual_seed(7), cuda_graphs=graphs)
                   for graphs in (False, True)]
        assert torch.equal(sampled[0][0], sampled[1][0]) and sampled[0][1] == sampled[1][1]
    assert static_tree._POOL.get(target), "the static tree step was not the one that ran"


def test_a_step_over_budget_or_capacity_is_refused(targets):  # noqa: F811
    run = StaticTreeTarget(targets["qwen3"], 2, 16)
    with pytest.raises(ValueError, match="a tree of 3 nodes"):
        run.verify(prompt(1, 4), [0, 1, 2], [-1, 0, 1], 0)
    with pytest.raises(ValueError, match="capacity"):
        run.verify(prompt(1, 2), [0], [-1], run.capacity - 1)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA graph capture and replay")
def test_tree_graph_replay_equals_the_eager_tree_step_on_cuda():
    """On a GPU the captured tree step replays the eager one bit for bit over a sequence of trees,
    and a graphed tree decode gives the target's greedy text (fp32)."""
    from dflash.model.target import TargetConfig, load_target

    target = load_target(TargetConfig(preset="tiny", seed=11, vocab_size=V, dtype="float32"), "cuda", 2)
    graphed = StaticTreeTarget(target, BUDGET, 128, graphs=True)
    eager = StaticTreeTarget(target, BUDGET, 128, graphs=False)
    p = prompt(1).cuda()
    for run in (graphed, eager):
        run.prefill(p)
    n = p.shape[0] + 1
    for i, (parent, depth, path) in enumerate(TREES):
        ids = prompt(100 + i, len(parent) + 1).cuda()
        f_g, l_g = graphed.verify(ids, depth, parent, n - 1)
        f_e, l_e = eager.verify(ids, depth, parent, n - 1)
        assert torch.equal(f_g, f_e) and torch.equal(l_g, l_e)
        rows = torch.tensor([0] + path, device="cuda")
        graphed.keep_path(n - 1, rows)
        eager.keep_path(n - 1, rows)
        n += len(path) + 1
    assert graphed.tree_step.graph is not None and eager.tree_step.graph is None
    head = target.shared_head()
    cfg = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=V - 1).resolve(target.hf_config,
                                                                                  target.layer_ids)
    drafter = DFlashDrafter(cfg, seed=3).eval().cuda()
    p = prompt(2).cuda()
    out, _, _ = tree_decode(target, CachedDrafterProposer(drafter, head), p, 40, BS, 8, cuda_graphs=True)
    assert torch.equal(out, greedy_decode(target, p, 40))
