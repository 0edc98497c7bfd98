"""The decode loops: the buffered loop decides every step as the plain concatenating loop did, and
sampled draft-and-verify is distributed exactly as the target's own sampling."""

from __future__ import annotations

import pytest
import torch

from dflash.eval import decode
from dflash.eval.decode import (
    CachedDrafterProposer,
    DrafterProposer,
    OracleProposer,
    greedy_decode,
    sampling_probs,
    speculative_decode,
)
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target

pytestmark = pytest.mark.timeout(300)
BS = 4


@pytest.fixture(scope="module")
def models():
    target = load_target(TargetConfig(preset="tiny", seed=11, vocab_size=64), "cpu", num_draft_layers=2)
    head = target.shared_head()
    cfg = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=63).resolve(target.hf_config,
                                                                               target.layer_ids)
    return target, head, DFlashDrafter(cfg, seed=3).eval()


def _reference_decode(target, proposer, prompt, max_new_tokens, block_size):
    """The straightforward loop (tokens and features grown by ``torch.cat``, the target's full
    argmax per step): what the buffered loop must reproduce step by step."""
    cache = decode._new_cache(target)
    kw = decode._cache_kwarg(target)

    def step(ids, start):
        pos = torch.arange(start, start + ids.shape[0], device=ids.device)[None]
        out = target.model.model(input_ids=ids[None], position_ids=pos, use_cache=True, **{kw: cache})
        feats = target.collect()
        return feats, target.model.get_output_embeddings()(out.last_hidden_state[0]).argmax(-1)

    feats, g = step(prompt, 0)
    tokens = torch.cat([prompt, g[-1:]])
    accepted = []
    while tokens.shape[0] - prompt.shape[0] < max_new_tokens:
        n = tokens.shape[0]
        remaining = max_new_tokens - (n - prompt.shape[0])
        draft = proposer.propose(tokens, feats)[: min(block_size - 1, remaining)]
        f_blk, g = step(torch.cat([tokens[-1:], draft]), n - 1)
        m = int((draft == g[: draft.shape[0]]).long().cumprod(0).sum())
        tokens = torch.cat([tokens, draft[:m], g[m:m + 1]])
        feats = torch.cat([feats, f_blk[:, : m + 1]], dim=1)
        decode.crop_cache(cache, n + m)
        accepted.append(m)
    return tokens[: prompt.shape[0] + max_new_tokens], accepted


class _Spoiled:
    """The drafter's block with some slots replaced, so accepted lengths vary from step to step."""

    def __init__(self, inner, target):
        self.inner, self.target = inner, target

    def propose(self, tokens, features):
        d = OracleProposer(self.target, BS).propose(tokens, features).clone()
        k = tokens.shape[0] % BS
        d[k:] = self.inner.propose(tokens, features)[k:]
        return d


@pytest.mark.parametrize("kind", ["drafter", "cached", "spoiled-oracle"])
def test_buffered_loop_accepts_what_the_reference_loop_accepts(models, kind):
    """Invariant: preallocated buffers and one host read per step change speed only: per verify
    step the accepted length, and the output, equal the concatenating reference loop's."""
    target, head, drafter = models
    for seed in range(3):
        prompt = torch.randint(0, 63, (7 + seed,), generator=torch.Generator().manual_seed(seed))
        make = {"drafter": lambda: DrafterProposer(drafter, head),
                "cached": lambda: CachedDrafterProposer(drafter, head, capacity=4),  # grows twice
                "spoiled-oracle": lambda: _Spoiled(DrafterProposer(drafter, head), target)}[kind]
        ref, ref_acc = _reference_decode(target, make(), prompt, 21, BS)
        out, acc, _ = speculative_decode(target, make(), prompt, 21, BS)
        assert acc == ref_acc and torch.equal(out, ref)
        assert torch.equal(out, greedy_decode(target, prompt, 21))
    if kind == "spoiled-oracle":
        assert len(set(acc)) > 1


def test_sampling_probs_order_is_temperature_then_top_k_then_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = sampling_probs(logits, 1.0, top_k=3)
    assert (p[0, 3:] == 0).all() and torch.allclose(p[0, :3], logits[0, :3].softmax(-1))
    full = logits.softmax(-1)[0]
    q = sampling_probs(logits, 1.0, top_p=float(full[0]) + 1e-4)    # needs the second token too
    assert (q[0] > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(sampling_probs(logits, 2.0), (logits / 2).softmax(-1))


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness-of-fit p-value (cells with expected count < 5 pooled); 0
    when a cell of probability 0 was observed."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


T, TOP_K, N_RUNS, ALPHA = 1.3, 3, 600, 1e-3


def _exact_joint(target, prompt, steps):
    """The target's own sampling distribution of the next ``steps`` tokens: ``{tokens: prob}``."""
    out = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for prefix, pr in out.items():
            ids = torch.cat([prompt, torch.tensor(prefix, dtype=torch.long)])[None]
            logits = target.model(input_ids=ids).logits[0, -1]
            probs = sampling_probs(logits, T, top_k=TOP_K)
            for t in probs.nonzero()[:, 0].tolist():
                nxt[prefix + (t,)] = pr * float(probs[t])
        out = nxt
    return out


def _sampled_counts(target, head, drafter, prompt, cells):
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(len(cells) + 1)           # the last cell: outside the target's support
    index = {c: i for i, c in enumerate(cells)}
    steps = set()
    for _ in range(N_RUNS):
        out, acc, _ = speculative_decode(target, CachedDrafterProposer(drafter, head), prompt, 3, BS,
                                         temperature=T, top_k=TOP_K, generator=gen)
        counts[index.get(tuple(out[prompt.shape[0]:].tolist()), len(cells))] += 1
        steps.add(tuple(acc))
    return counts, steps


def test_sampled_decode_is_distributed_as_the_target_samples(models, monkeypatch):
    """Invariant (lossless rejection sampling): the first 3 tokens of sampled draft-and-verify
    (one from the prefill, two from a verify step that drafts 2: acceptance, residual and bonus
    draws all occur) follow the target's own processed distribution, by a chi-square test at
    significance 1e-3 that rejects the deliberately wrong rule "accept every draft"."""
    target, head, drafter = models
    prompt = torch.randint(0, 63, (6,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        exact = _exact_joint(target, prompt, 3)
    cells = sorted(exact)
    probs = torch.tensor([exact[c] for c in cells] + [0.0])
    counts, steps = _sampled_counts(target, head, drafter, prompt, cells)
    assert {s[0] for s in steps} == {0, 1, 2}   # first step: rejections at each slot, full acceptance
    good = _chi_square_pvalue(counts, probs)
    print(f"chi-square p-value: lossless rule {good:.3g}", end="; ")
    assert good > ALPHA

    def accept_all(draft, p, q, generator):
        return draft.shape[0], torch.multinomial(p[-1], 1, generator=generator)[0]

    monkeypatch.setattr(decode, "_accept_sampled", accept_all)
    wrong, _ = _sampled_counts(target, head, drafter, prompt, cells)
    bad = _chi_square_pvalue(wrong, probs)
    print(f"accept every draft {bad:.3g}")
    assert bad < ALPHA


def _resample_from_p(draft, p, q, generator):
    """A wrong rule: the right acceptance, then a fresh sample from p instead of the residual."""
    u = torch.rand(draft.shape[0], generator=generator)
    ok = (u * q.gather(1, draft[:, None])[:, 0] < p[:-1].gather(1, draft[:, None])[:, 0]).long()
    m = int(ok.cumprod(0).sum())
    return m, torch.multinomial(p[m], 1, generator=generator)[0]


@pytest.mark.parametrize("rule, lossless", [(decode._accept_sampled, True), (_resample_from_p, False)])
def test_one_verify_step_emits_the_target_distribution(rule, lossless):
    """Invariant (the rejection-sampling theorem, one step, a context-free target): with drafts
    from q, the first emitted token follows p_0 and, once the first draft is accepted, the second
    follows p_1; the chi-square test at 1e-3 also rejects the rule that resamples from p."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.1, 0.1, 0.0], [0.1, 0.1, 0.2, 0.2, 0.4], [0.2] * 5])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.2, 0.2], [0.4, 0.3, 0.1, 0.1, 0.1]])
    first, second = torch.zeros(5), torch.zeros(5)
    for _ in range(4000):
        draft = torch.multinomial(q, 1, generator=g)[:, 0]
        m, nxt = rule(draft, p, q, g)
        emitted = torch.cat([draft[:m], nxt[None]])
        first[emitted[0]] += 1
        if m >= 1:
            second[emitted[1]] += 1
    pv = min(_chi_square_pvalue(first, p[0]), _chi_square_pvalue(second, p[1]))
    assert (pv > ALPHA) == lossless, pv


def test_sampled_decode_rejects_bad_parameters_and_an_oracle(models):
    target, head, drafter = models
    p = torch.arange(5)
    with pytest.raises(ValueError, match="top_p"):
        speculative_decode(target, DrafterProposer(drafter, head), p, 4, BS, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="no logits"):
        speculative_decode(target, OracleProposer(target, BS), p, 4, BS, temperature=1.0)


def test_sampled_decode_is_reproducible_from_its_generator(models):
    target, head, drafter = models
    p = torch.arange(5)
    runs = [speculative_decode(target, CachedDrafterProposer(drafter, head), p, 12, BS, temperature=1.0,
                               top_p=0.9, generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert runs[0][0].shape[0] == 5 + 12


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the no-host-read greedy loop on a GPU")
def test_cuda_buffered_loop_accepts_what_the_reference_loop_accepts():
    """Invariant: on a GPU (fp32, where queued kernels run ahead of the host) the buffered loop's
    output and per-step accepted lengths equal the reference loop's and plain greedy decoding's."""
    target = load_target(TargetConfig(preset="tiny", seed=11, vocab_size=64, dtype="float32"), "cuda",
                         num_draft_layers=2)
    head = target.shared_head()
    cfg = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=63).resolve(target.hf_config,
                                                                               target.layer_ids)
    drafter = DFlashDrafter(cfg, seed=3).cuda().eval()
    prompt = torch.randint(0, 63, (9,), generator=torch.Generator().manual_seed(0)).cuda()
    spoiled = _Spoiled(CachedDrafterProposer(drafter, head), target)
    out, acc, _ = speculative_decode(target, spoiled, prompt, 40, BS)
    ref, ref_acc = _reference_decode(target, _Spoiled(CachedDrafterProposer(drafter, head), target),
                                     prompt, 40, BS)
    assert acc == ref_acc and torch.equal(out, ref) and torch.equal(out, greedy_decode(target, prompt, 40))
