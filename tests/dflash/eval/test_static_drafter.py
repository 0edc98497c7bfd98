"""The static-shape drafter step (dflash.eval.static_drafter): on a CPU the forward a CUDA graph
replays runs eagerly, and it must draft what the cached eager proposers draft, step by step,
whatever the number of context rows each step adds."""

from __future__ import annotations

import gc

import pytest
import torch

from dflash.eval import static_drafter
from dflash.eval.decode import CachedDrafterProposer, greedy_decode, speculative_decode
from dflash.eval.selector import CachedSelectorProposer
from dflash.eval.static_drafter import StaticDrafter, static_proposer
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target
from tests.sync_probe import SyncProbe

pytestmark = pytest.mark.timeout(300)

BS, V = 4, 96
D2 = dict(variant="dflash2", selector_rank=8, selector_top_k=6)


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(preset="tiny", seed=11, vocab_size=V), "cpu", num_draft_layers=2)


def _drafter(target, **kw) -> DFlashDrafter:
    cfg = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=V - 1, **kw).resolve(target.hf_config,
                                                                                      target.layer_ids)
    d = DFlashDrafter(cfg, seed=3).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():   # move DFlash2's convolutions and walk off the identity and the argmax
        for n, p in d.named_parameters():
            if "conv" in n or "candidate_selector" in n:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "base_kernel" in n else 0.5))
    return d


def prompt(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


class _Steered:
    """Records ``inner``'s draft at every step but hands the decode the target's own continuation
    with one slot per block wrong (the slot moving), so the context grows by 1 .. bs rows a step
    while the recorded drafter sees exactly what it would see decoding."""

    def __init__(self, inner, text: torch.Tensor) -> None:
        self.inner, self.text, self.drafts = inner, text, []

    def propose(self, tokens, features):
        self.drafts.append(self.inner.propose(tokens, features).clone())
        n = tokens.shape[0]
        draft = self.text[n:n + BS - 1].clone()
        k = len(self.drafts) % BS
        if k < draft.shape[0]:
            draft[k] = (draft[k] + 1) % V
        return draft


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_static_drafts_are_the_cached_proposers_drafts(target, variant):
    """Invariant: per step, the static drafter's block (DFlash: the argmax; DFlash2: the selector's
    walk) equals the eager cached proposer's, over prompts shorter and longer than a block (the
    longer ones' context projected eagerly first), steps adding 1 .. bs context rows, and a context
    that outgrows the initial cache mid-generation (reallocated, the graph captured again)."""
    head = target.shared_head()
    d = _drafter(target, **(D2 if variant == "dflash2" else {}))
    eager = CachedSelectorProposer if variant == "dflash2" else CachedDrafterProposer
    for seed, n, new in [(1, 3, 24), (2, 11, 24), (3, 244, 24)]:
        p = prompt(seed, n)
        text = greedy_decode(target, p, new + BS)
        a, b = _Steered(eager(d, head), text), _Steered(static_proposer(d, head), text)
        out_a, acc_a, _ = speculative_decode(target, a, p, new, BS)
        out_b, acc_b, _ = speculative_decode(target, b, p, new, BS)
        assert torch.equal(out_a, out_b) and acc_a == acc_b and set(acc_a) == set(range(BS))
        assert len(a.drafts) == len(b.drafts) and all(torch.equal(x, y) for x, y in zip(a.drafts, b.drafts))
        if n > 200:
            assert b.inner.core.keys[0].shape[2] == 512     # grew from 256 with the context
    if variant == "dflash2":   # the walk differs from the backbone's argmax: the walk is what is tested
        core = b.inner.core
        assert not torch.equal(core.step()[2], core.step()[1][0].argmax(-1))


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_sampled_decodes_are_the_cached_proposers(target, variant):
    """The same for sampled decoding from one seed: DFlash's q comes from the static step's logits,
    DFlash2's walk draws from the step's hidden states and logits, eagerly, with the same generator."""
    head = target.shared_head()
    d = _drafter(target, **(D2 if variant == "dflash2" else {}))
    eager = CachedSelectorProposer if variant == "dflash2" else CachedDrafterProposer
    for seed in (4, 5):
        p = prompt(seed, 9)
        runs = [speculative_decode(target, make(d, head), p, 24, BS, temperature=1.0, top_k=20,
                                   generator=torch.Generator().manual_seed(seed))
                for make in (eager, static_proposer)]
        assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1:] == runs[1][1:]


def test_the_drafter_step_reads_nothing_back_to_the_host(target):
    """Invariant (what makes it capturable): the fixed-shape step, its input copies included, has
    no op that waits for the device; DFlash2's walk included."""
    head = target.shared_head()
    prop = static_proposer(_drafter(target, **D2), head)
    tokens, feats = prompt(6, 30), torch.randn(1, 29, 2 * target.hf_config.hidden_size)
    prop.propose(tokens[:12], feats[:, :11])
    with SyncProbe() as probe:
        for n in (13, 16, 20):
            prop.propose(tokens[:n], feats[:, : n - 1])
    assert probe.syncs == []


def test_the_pool_reuses_a_freed_proposers_step_and_refuses_xpress(target):
    """A generation's proposer hands its step back when freed, and the next one of the same drafter
    reuses it (graph and all), its context emptied; two live proposers never share one; an XPress
    drafter (Jacobi refiner) is refused by name."""
    head = target.shared_head()
    d = _drafter(target)
    a = static_proposer(d, head)
    b = static_proposer(d, head)
    assert a.core is not b.core
    a.propose(prompt(1, 6), torch.randn(1, 5, 2 * target.hf_config.hidden_size))
    core = a.core
    del a
    gc.collect()
    c = static_proposer(d, head)
    assert c.core is core and core.cached == 0
    with pytest.raises(ValueError, match="XPress"):
        StaticDrafter(_drafter(target, variant="xpress"), head)
    assert static_drafter._POOL.get(d) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA graph capture and replay")
@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_graph_replay_drafts_what_the_eager_static_step_drafts_on_cuda(variant):
    """On a GPU the captured drafter step replays the eager static step bit for bit at every step
    of a decode (varied context growth), graphed target included, and was captured (no fallback)."""
    target = load_target(TargetConfig(preset="tiny", seed=11, vocab_size=V, dtype="float32"), "cuda", 2)
    head = target.shared_head()
    d = _drafter(target, **(D2 if variant == "dflash2" else {})).cuda()
    for seed, n in [(1, 3), (2, 11)]:
        p = prompt(seed, n).cuda()
        text = greedy_decode(target, p, 24 + BS)
        runs = [_Steered(static_proposer(d, head, graphs=g), text) for g in (True, False)]
        outs = [speculative_decode(target, r, p, 24, BS, cuda_graphs=True) for r in runs]
        assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]
        assert all(torch.equal(x, y) for x, y in zip(runs[0].drafts, runs[1].drafts))
        assert runs[0].inner.core.step.graph is not None and runs[1].inner.core.step.graph is None
