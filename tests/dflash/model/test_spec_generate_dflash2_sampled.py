"""Sampled ``spec_generate`` with a DFlash2 export (the shipped modeling file, loaded through
``AutoModel.from_pretrained(..., trust_remote_code=True)``): the candidate selector's walk draws
each slot from ``q = softmax(score / T)`` over its K candidates, and speculative rejection sampling
against that ``q`` emits the target's own sampling distribution (chi-square tested); each step's
``q`` and accepted count are z-lab's ``dflash_generate``'s on the same export."""

from __future__ import annotations

import sys

import pytest
import torch

from dflash.export import export_drafter
from tests.dflash.eval.test_decode_loop import TOP_K, T, _chi_square_pvalue, _exact_joint
from tests.dflash.eval.test_dflash2_sampled import _models, zlab_propose_as
from tests.dflash.model.test_spec_generate import PROMPT, _greedy, _target
from tests.zlab import zlab_model

pytestmark = pytest.mark.timeout(300)

ALPHA, N_RUNS = 1e-3, 600


def _load(d, path):
    """``d`` exported to ``path`` (fp32) and loaded back with transformers' ``AutoModel``; also the
    modeling module it was loaded from (to patch its module-level helpers)."""
    from transformers import AutoModel

    export_drafter(d, path, torch.float32)
    model = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__name__ == "DFlash2DraftModel"
    return model, sys.modules[type(model).__module__]


def _record_accepts(monkeypatch, module, into: list) -> None:
    """Every ``_speculative_accept`` call of ``module``'s ``spec_generate`` appends ``(drafted, p,
    q, the global RNG state before it, accepted count, next token)`` to ``into``."""
    accept = module._speculative_accept

    def recording(drafted, p, q):
        state = torch.get_rng_state()
        n, nxt = accept(drafted, p, q)
        into.append((drafted.clone(), p.clone(), q.clone(), state, n, int(nxt)))
        return n, nxt

    monkeypatch.setattr(module, "_speculative_accept", recording)


class SimpleTarget:
    """What :func:`tests.dflash.eval.test_decode_loop._exact_joint` reads of a target: ``.model``."""

    def __init__(self, model) -> None:
        self.model = model


def test_sampled_dflash2_spec_generate_is_distributed_as_the_target_samples(tmp_path, monkeypatch):
    """Invariant (lossless; Leviathan et al. 2023, Chen et al. 2023): the first 3 of 4 tokens of a
    sampled ``spec_generate`` with a DFlash2 export (the prefill's token, then one verify step
    drafting a full block of 3 with the selector walk, of which 0, 1 and 2 are accepted along the
    way: accepted drafts and residual draws both make the tokens tested) follow the target's own
    distribution at T = 1.3, top-k 3, by a chi-square test at significance 1e-3 over 600 seeds,
    which rejects the same decode when the walk's draws are divided by the wrong ``q`` (the
    backbone's full-vocabulary softmax, what a DFlash drafter would use).

    (The block is a full one because ``spec_generate``, like z-lab's ``dflash_generate``, drafts a
    block cut to the tokens still wanted, and the drafter attends within the block both ways, so
    a cut block drafts from other states, here rarely accepted.)"""
    target, _, d = _models(16, 15)   # 15 of 16 candidates: the target's top-3 is usually among them
    target = target.model.float().eval()
    model, module = _load(d, tmp_path / "export")
    prompt = torch.randint(0, 15, (6,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        exact = _exact_joint(SimpleTarget(target), prompt, 3)
    cells = sorted(exact)
    probs = torch.tensor([exact[c] for c in cells] + [0.0])    # the last cell: outside the support
    index = {c: i for i, c in enumerate(cells)}
    accepts: list = []
    _record_accepts(monkeypatch, module, accepts)

    def counts():
        torch.manual_seed(1234)
        out = torch.zeros(len(cells) + 1)
        accepts.clear()
        for _ in range(N_RUNS):
            got = model.spec_generate(target, prompt[None], max_new_tokens=4, stop_token_ids=None,
                                      temperature=T, top_k=TOP_K)
            out[index.get(tuple(got[0, prompt.shape[0]:][:3].tolist()), len(cells))] += 1
        return out

    good = counts()
    first_steps = [a for a in accepts if a[0].shape[0] == 3]
    assert len(first_steps) == N_RUNS and {0, 1, 2} <= {a[4] for a in first_steps}
    for drafted, _, q, *_ in first_steps:  # q: the walk's, K candidates per slot, the draft among them
        assert ((q > 0).sum(-1) == 15).all() and (q.gather(1, drafted[:, None]) > 0).all()
    pv = _chi_square_pvalue(good, probs)

    walk = model.select_sampled

    def backbone_q(hidden, logits, anchor_ids, temperature):
        drafted, _ = walk(hidden, logits, anchor_ids, temperature)
        return drafted, torch.softmax(logits.float() / temperature, dim=-1)

    monkeypatch.setattr(model, "select_sampled", backbone_q)
    bad = _chi_square_pvalue(counts(), probs)
    ms = [a[4] for a in first_steps]
    print(f"chi-square p-value: walk's q {pv:.3g}; backbone's q {bad:.3g}; "
          f"first-step accepted counts {[ms.count(m) for m in range(4)]}")
    assert pv > ALPHA
    assert bad < ALPHA


def test_sampled_dflash2_spec_generate_with_target_top_k_1_is_greedy(tmp_path):
    """Invariant: with ``top_k=1`` the target's sampling is one-hot, so whatever the selector walk
    draws (its ``q`` is not one-hot: no top-k is applied to it), rejection sampling must return the
    target's greedy text, over many blocks (cache rollback after partial acceptance) and seeds."""
    from tests.dflash.export.test_dflash2_export import make as make2

    model, _ = _load(make2(), tmp_path / "export2")
    target = _target(noise=1e-3)
    want = _greedy(target, PROMPT, 30)
    for seed in range(3):
        torch.manual_seed(seed)
        got = model.spec_generate(target, PROMPT, max_new_tokens=30, stop_token_ids=None,
                                  temperature=0.9, top_k=1)
        assert torch.equal(got, want), seed


def test_select_sampled_q_is_over_the_candidates_and_refuses_greedy(tmp_path):
    """``select_sampled`` returns ``q [B, L, V]`` fp32 with exactly K nonzero entries per row summing
    to 1, the drawn token among them; at T <= 0 it is a one-line error (greedy is ``select``)."""
    target, _, d = _models(64, 6)
    model, _ = _load(d, tmp_path / "export")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 3, target.hf_config.hidden_size, generator=g)
    logits = model.compute_logits(hidden, target.model.get_output_embeddings())
    anchor = torch.tensor([5])
    torch.manual_seed(0)
    for _ in range(20):
        drafted, q = model.select_sampled(hidden, logits, anchor, 0.7)
        assert drafted.shape == (1, 3) and q.shape == (1, 3, 64) and q.dtype == torch.float32
        assert ((q > 0).sum(-1) == 6).all() and torch.allclose(q.sum(-1), torch.ones(1, 3))
        assert (q[0].gather(1, drafted[0, :, None]) > 0).all()
    with pytest.raises(ValueError, match="temperature > 0"):
        model.select_sampled(hidden, logits, anchor, 0.0)


# z-lab's decoder passes past_key_values, which transformers 5.24 renames (removal in 5.40)
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_each_sampled_spec_generate_step_is_zlab_dflash2_rule(tmp_path, monkeypatch):
    """Invariant (we sample what the reference decoder samples). Draws are not comparable one for
    one with z-lab's (its walk orders the candidates as ``topk(sorted=False)`` does), so each
    step's rule is compared, on the same export: at every verify step of our sampled
    ``spec_generate``, z-lab's ``DFlash2DraftModel.propose`` on the same drafter states, its draws
    forced to ours, walks to our drafts with the same ``q`` over the vocabulary, and its
    ``_rejection_sample`` given the same target ``p`` and the same uniforms (the global RNG state
    replayed) accepts as many drafts as ours, and draws the same bonus after a full acceptance.
    Against a target ``p`` moved near ``q`` (so that every accepted length occurs; the tiny random
    target itself accepts almost nothing) the accepted counts and bonus tokens agree too."""
    zl = zlab_model()
    target, _, d = _models(64, 6)
    target = target.model.float().eval()
    model, module = _load(d, tmp_path / "export")
    zmodel = zl.DFlash2DraftModel.from_pretrained(str(tmp_path / "export"), dtype=torch.float32).eval()
    walks: list = []
    accepts: list = []
    walk, accept = model.select_sampled, module._speculative_accept

    def recording(hidden, logits, anchor_ids, temperature):
        drafted, q = walk(hidden, logits, anchor_ids, temperature)
        walks.append((hidden.clone(), anchor_ids.clone(), drafted[0].clone(), q[0].clone()))
        return drafted, q

    monkeypatch.setattr(model, "select_sampled", recording)
    _record_accepts(monkeypatch, module, accepts)
    for seed in range(3):
        torch.manual_seed(seed)
        p = torch.randint(0, 63, (1, 9), generator=torch.Generator().manual_seed(seed))
        model.spec_generate(target, p, max_new_tokens=16, stop_token_ids=None, temperature=0.8, top_p=0.9)
    assert len(walks) == len(accepts) >= 9
    out_head = target.get_output_embeddings()
    ms = []
    for i, ((hidden, anchor, draft, q), (drafted, p, q_acc, state, n, nxt)) in enumerate(zip(walks, accepts)):
        assert torch.equal(drafted, draft) and torch.equal(q_acc, q)
        z_cand, z_q = zlab_propose_as(zmodel, zl, monkeypatch, hidden, anchor, out_head, draft, q)
        torch.set_rng_state(state)
        z_m, z_nxt = zl._rejection_sample(draft[None], p[None], z_q, z_cand)
        assert z_m == n, i
        if n == draft.shape[0]:  # the bonus: both draw from p[L] with the same generator state
            assert int(z_nxt) == nxt, i
        # a target near q, so that acceptances of every length occur
        noise = torch.softmax(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)), -1)
        near = 0.3 * noise + 0.7 * torch.cat([q, noise[-1:]])
        torch.manual_seed(i)
        z_m, z_nxt = zl._rejection_sample(draft[None], near[None], z_q, z_cand)
        torch.manual_seed(i)
        m, nxt = accept(draft, near, q)
        assert m == z_m, i
        if m == draft.shape[0]:
            assert int(nxt) == int(z_nxt), i
        ms.append(m)
    print(f"{len(ms)} steps; accepted counts against the real target {[a[4] for a in accepts]}, "
          f"against a target near q {ms}")
    assert len(set(ms)) > 1
