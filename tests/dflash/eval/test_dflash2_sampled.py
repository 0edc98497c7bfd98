"""Sampled decoding with a DFlash2 drafter: the selector walk's draws, ``q`` restricted to its K
candidates, verified by rejection sampling, emit the target's own sampling distribution; each
step's ``q`` and acceptance are z-lab's ``dflash_generate``'s on the same export."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash.eval import decode
from dflash.eval.decode import (
    CachedDrafterProposer,
    DrafterProposer,
    sampling_probs,
    speculative_decode,
)
from dflash.eval.measure import evaluate
from dflash.eval.selector import CachedSelectorProposer, SelectorProposer, _Walk
from dflash.export import export_drafter, load_exported
from dflash.model.dflash2 import CandidateSelector
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target
from tests.dflash.eval.test_decode_loop import TOP_K, T, _chi_square_pvalue, _exact_joint
from tests.zlab import zlab_model

pytestmark = pytest.mark.timeout(300)

BS, ALPHA = 4, 1e-3


def _randomise(d: DFlashDrafter) -> DFlashDrafter:
    """Move the convolutions and the selector off their identity/zero init, so that the walk's
    ``q`` depends on the token drawn before it and differs from the backbone's softmax."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if "conv" in n or "candidate_selector" in n:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "base_kernel" in n else 0.5))
    return d.eval()


def _models(vocab: int, top_k: int):
    target = load_target(TargetConfig(preset="tiny", seed=11, vocab_size=vocab), "cpu", num_draft_layers=2)
    head = target.shared_head()
    cfg = DrafterConfig(num_layers=1, block_size=BS, mask_token_id=vocab - 1, variant="dflash2", selector_rank=8,
                        selector_top_k=top_k).resolve(target.hf_config, target.layer_ids)
    return target, head, _randomise(DFlashDrafter(cfg, seed=2))


# --- one verify step, a context-free target ------------------------------------------------------

class _FixedBlock(_Walk):
    """The sampled walk over fixed slot hidden states and logits (no drafter forward)."""

    def __init__(self, selector: CandidateSelector, slots: torch.Tensor, logits: torch.Tensor) -> None:
        self.drafter = SimpleNamespace(candidate_selector=selector)
        self.head = SimpleNamespace(logits=lambda h: logits)
        self.fixed = slots

    def slots(self, tokens, features):
        return self.fixed


def _unary_only(prop: _FixedBlock, temperature: float) -> torch.Tensor:
    """A wrong q: each slot's softmax over the K candidates of the logits alone (the pair term,
    hence the dependence on the token drawn before, ignored)."""
    logits = prop.head.logits(None)[0]
    unary, cand = prop.drafter.candidate_selector.candidates(logits)
    return torch.zeros_like(logits).scatter_(-1, cand, (unary / temperature).softmax(-1))


@pytest.mark.parametrize("lossless", [True, False])
def test_one_step_of_the_sampled_walk_emits_the_target_distribution(lossless):
    """Invariant (rejection sampling with a draft chain): the walk draws slot 2 from ``q_2`` given
    slot 1's token, restricted to 3 of 8 tokens; verified against a context-free target, the first
    emitted token follows p_0 and, once the first draft is accepted, the second follows p_1
    (chi-square at 1e-3, cells of the target's support). Dividing by the unary-only q instead of
    the walk's own fails the same test: the walk's q is what makes it lossless."""
    V, H, T = 8, 4, 1.0
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the selector's own init draws from the global generator: fix it too
    sel = CandidateSelector(V, H, rank=2, top_k=3)
    with torch.no_grad():
        sel.successor_codebook.normal_(0.0, 2.0, generator=g)
    prop = _FixedBlock(sel, torch.randn(1, 2, H, generator=g), torch.randn(1, 2, V, generator=g))
    p = torch.tensor([[0.30, 0.05, 0.20, 0.10, 0.05, 0.15, 0.10, 0.05],
                      [0.05, 0.25, 0.05, 0.20, 0.05, 0.10, 0.25, 0.05],
                      [1 / V] * V])
    anchor = torch.tensor([3])
    first, second = torch.zeros(V), torch.zeros(V)
    accepted = 0
    for _ in range(4000):
        draft, q = prop.sample(anchor, None, T, g)
        assert (q > 0).sum(-1).tolist() == [3, 3] and torch.allclose(q.sum(-1), torch.ones(2))
        m, nxt = decode._accept_sampled(draft, p, q if lossless else _unary_only(prop, T), g)
        emitted = torch.cat([draft[:m], nxt[None]])
        first[emitted[0]] += 1
        if m >= 1:
            second[emitted[1]] += 1
        accepted += m
    assert accepted > 600                    # the drafts are accepted often: q is what is tested
    pv = min(_chi_square_pvalue(first, p[0]), _chi_square_pvalue(second, p[1]))
    print(f"p-value {pv:.3g}, {accepted} accepted")
    assert (pv > ALPHA) == lossless, pv


def test_sample_refuses_greedy_and_draws_from_its_q():
    """``sample`` at T <= 0 is a one-line error; at T > 0 its draft is always a candidate with q > 0."""
    g = torch.Generator().manual_seed(1)
    sel = CandidateSelector(8, 4, rank=2, top_k=3)
    prop = _FixedBlock(sel, torch.randn(1, 3, 4, generator=g), torch.randn(1, 3, 8, generator=g))
    with pytest.raises(ValueError, match="temperature > 0"):
        prop.sample(torch.tensor([0]), None, 0.0, g)
    for _ in range(20):
        draft, q = prop.sample(torch.tensor([0]), None, 0.7, g)
        assert (q.gather(1, draft[:, None]) > 0).all()


# --- the whole decode ---------------------------------------------------------------------------

# the target's exact joint distribution at T = 1.3, top-k 3 (the DFlash decode tests' setting)
N_RUNS = 600


class _BackboneQ(CachedSelectorProposer):
    """A wrong q: drafts from the walk, but returns the backbone's softmax over the vocabulary
    (what the decode would divide by if it treated the drafter as a DFlash drafter)."""

    def sample(self, tokens, features, temperature, generator):
        draft, _ = super().sample(tokens, features, temperature, generator)
        return draft, sampling_probs(self.head.logits(self.slots(tokens, features))[0], temperature)


def test_sampled_dflash2_decode_is_distributed_as_the_target_samples():
    """Invariant (lossless): the first 3 tokens of a sampled DFlash2 decode (the prefill's, then a
    verify step drafting 2 with the walk: acceptances at each slot, residual and bonus draws all
    occur) follow the target's own distribution at T = 1.3, top-k 3, by a chi-square test at
    significance 1e-3 that rejects the same decode dividing by the backbone's softmax."""
    target, head, d = _models(16, 15)   # 15 of 16 candidates: the target's top-3 is usually among them
    prompt = torch.randint(0, 15, (6,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        exact = _exact_joint(target, prompt, 3)
    cells = sorted(exact)
    probs = torch.tensor([exact[c] for c in cells] + [0.0])    # the last cell: outside the support

    def counts(make):
        gen = torch.Generator().manual_seed(1234)
        out = torch.zeros(len(cells) + 1)
        index = {c: i for i, c in enumerate(cells)}
        first_m = set()
        for _ in range(N_RUNS):
            tokens, acc, _ = speculative_decode(target, make(d, head), prompt, 3, BS, temperature=T,
                                                top_k=TOP_K, generator=gen)
            out[index.get(tuple(tokens[prompt.shape[0]:].tolist()), len(cells))] += 1
            first_m.add(acc[0])
        return out, first_m

    good, first_m = counts(CachedSelectorProposer)
    assert first_m == {0, 1, 2}
    pv = _chi_square_pvalue(good, probs)
    print(f"chi-square p-value: walk's q {pv:.3g}", end="; ")
    assert pv > ALPHA
    bad = _chi_square_pvalue(counts(_BackboneQ)[0], probs)
    print(f"backbone's q {bad:.3g}")
    assert bad < ALPHA


def test_sampled_selector_proposers_agree_and_evaluate_reports_sampled_tau():
    """The cached and recomputing DFlash2 proposers sample the same blocks from one seed, and
    dflash.eval on a DFlash2 drafter with a temperature reports a sampled tau (it used to refuse)."""
    target, head, d = _models(64, 6)
    p = torch.randint(0, 63, (7,), generator=torch.Generator().manual_seed(3))
    runs = [speculative_decode(target, make(d, head), p, 14, BS, temperature=1.0, top_p=0.9,
                               generator=torch.Generator().manual_seed(5))
            for make in (SelectorProposer, CachedSelectorProposer)]
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    res = evaluate(target, d, head, [p], max_new_tokens=10, temperature=1.0, seed=2)
    assert res.sampled_tau is not None and 1 <= res.sampled_tau <= BS and res.selector is not None


@pytest.mark.parametrize("make", [DrafterProposer, CachedDrafterProposer])
def test_drafter_proposers_refuse_a_dflash2_drafter(make):
    """Invariant: a DFlash proposer given a DFlash2 drafter would silently draft the backbone's
    top-1 and ignore the selector: it refuses, naming the proposer to use."""
    _, head, d = _models(64, 6)
    with pytest.raises(ValueError, match="selector_proposer"):
        make(d, head)


# --- z-lab's sampled DFlash2 rule ---------------------------------------------------------------

# z-lab's decoder passes past_key_values, which transformers 5.24 renames (removal in 5.40)
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def zlab_propose_as(zmodel, zl, monkeypatch, hidden, anchor, out_head, draft, q, temperature=0.8):
    """z-lab's ``propose`` on the same slots, its draws forced to ``draft`` (each slot's index among
    z-lab's top-6 candidates): asserts it walks to ``draft`` with our ``q`` (zero off the
    candidates), and returns its ``(candidates, q)`` for its ``_rejection_sample``."""
    with torch.no_grad(), monkeypatch.context() as mp:
        cand = torch.topk(zmodel.compute_logits(hidden, out_head), 6, dim=-1, sorted=False).indices[0]
        forced = iter((cand[j] == draft[j]).nonzero()[0] for j in range(draft.shape[0]))
        mp.setattr(zl, "_sample_probs", lambda probs, it=forced: next(it))
        z_path, z_cand, z_q = zmodel.propose(hidden, anchor, out_head, temperature)
    assert torch.equal(z_path[0], draft)
    z_full = torch.zeros_like(q).scatter_(-1, z_cand[0], z_q[0].float())
    torch.testing.assert_close(z_full, q, rtol=1e-5, atol=1e-6)
    return z_cand, z_q


def test_each_sampled_step_is_zlab_dflash2_rule(tmp_path, monkeypatch):
    """Invariant (we sample what the reference decoder samples). z-lab's ``dflash_generate`` is
    deterministic given ``torch.manual_seed``, but its outputs are not comparable with ours draw
    for draw: it draws the residual or bonus token from one row where we draw every row at once,
    and its walk orders the candidates as ``topk(sorted=False)`` does, so equal seeds give
    different tokens after the first draw. What is compared is each step's rule, on the same
    export: at every step of our sampled decode, z-lab's ``propose`` walked along our drafts
    (its draws forced to them) gives the same ``q`` over the vocabulary, and its rejection rule
    given the same uniforms accepts as many drafts as ours."""
    zl = zlab_model()
    target, head, d = _models(64, 6)
    export_drafter(d, tmp_path, torch.float32)
    ours, _ = load_exported(tmp_path)
    zmodel = zl.DFlash2DraftModel.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    steps = []

    class Recording(SelectorProposer):
        def sample(self, tokens, features, temperature, generator):
            draft, q = super().sample(tokens, features, temperature, generator)
            steps.append((tokens[-1:].clone(), self.slots(tokens, features), draft, q))
            return draft, q

    for seed in range(3):
        p = torch.randint(0, 63, (9,), generator=torch.Generator().manual_seed(seed))
        speculative_decode(target, Recording(ours, head), p, 16, BS, temperature=0.8,
                           generator=torch.Generator().manual_seed(seed))
    assert len(steps) >= 9
    out_head = target.model.get_output_embeddings()
    ms = []
    for i, (anchor, slots, draft, q) in enumerate(steps):
        z_cand, z_q = zlab_propose_as(zmodel, zl, monkeypatch, slots, anchor, out_head, draft, q)
        # a target near q, so that acceptances of every length occur
        noise = torch.softmax(torch.randn(BS, q.shape[-1], generator=torch.Generator().manual_seed(i)), -1)
        probs = 0.3 * noise + 0.7 * torch.cat([q, noise[-1:]])
        torch.manual_seed(i)
        z_m, _ = zl._rejection_sample(draft[None], probs[None], z_q, z_cand)
        m, _ = decode._accept_sampled(draft, probs, q, torch.Generator().manual_seed(i))
        assert m == z_m
        ms.append(m)
    assert len(set(ms)) > 1
