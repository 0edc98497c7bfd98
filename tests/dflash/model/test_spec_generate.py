"""``spec_generate`` on the shipped modeling file's drafter: z-lab's documented call
``AutoModel.from_pretrained(export, trust_remote_code=True).spec_generate(target, ...)``.

Greedy decoding must give the target's own greedy text (and z-lab's ``spec_generate`` output on
its own class loaded from the same export); sampling must keep the target's distribution.
"""

from __future__ import annotations

import pytest
import torch

from dflash.export import export_drafter
from dflash.model import modeling_dflash as md
from dflash.model.target import load_target
from tests.dflash.export.test_export import TCFG, make
from tests.zlab import zlab_model

pytestmark = pytest.mark.timeout(300)


def _target(noise: float = 0.0):
    """The tiny fp32 target with an LM head that scores token 7 by one random direction of the
    hidden state and every other token 0 (or by random directions ``noise`` times as long, so that
    no two logits tie), so target and drafter often agree and the accepted lengths vary (with a
    random head a random drafter is accepted almost never)."""
    target = load_target(TCFG, "cpu", 2).model.float().eval()
    g = torch.Generator().manual_seed(5)
    head = torch.randn(target.lm_head.weight.shape, generator=g) * noise
    head[7] = torch.randn(head.shape[1], generator=g)
    target.lm_head.weight = torch.nn.Parameter(head)
    return target


def _export(tmp_path, types=None):
    from transformers import AutoModel

    out = tmp_path / "export"
    export_drafter(make(types), out, torch.float32)
    return out, AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)


def _greedy(target, prompt, n):
    with torch.no_grad():
        return target.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)


PROMPT = torch.randint(5, 4000, (1, 11), generator=torch.Generator().manual_seed(2))


@pytest.mark.filterwarnings("ignore::FutureWarning")  # z-lab passes past_key_values (renamed in transformers 5.2x)
@pytest.mark.parametrize("types", [None, ["sliding_attention", "full_attention"]])
def test_spec_generate_is_the_targets_greedy_text_and_zlabs_spec_generate(tmp_path, types):
    """Invariant: greedy ``spec_generate`` on the AutoModel-loaded export returns ``[1, N + n]``
    equal to the target's greedy ``generate`` and to z-lab's ``DFlashDraftModel.spec_generate`` on
    the same export (full and sliding-window drafter layers), with blocks accepted in part and in
    full along the way (so the cache rollback is exercised)."""
    zl = zlab_model()
    out, ours = _export(tmp_path, types)
    assert type(ours).__module__.endswith("modeling_dflash")
    theirs = zl.DFlashDraftModel.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
    target = _target()
    calls = []
    verify = target.forward

    def counting(input_ids, **kw):  # the block lengths the target verifies after the prefill
        calls.append(input_ids.shape[1])
        return verify(input_ids, **kw)

    target.forward = counting
    got = ours.spec_generate(target, PROMPT, max_new_tokens=40, stop_token_ids=None)
    steps = len(calls) - 1
    target.forward = verify
    want = theirs.spec_generate(target, PROMPT, max_new_tokens=40, stop_token_ids=None)
    assert got.dtype == torch.long and got.shape == (1, 11 + 40)
    assert torch.equal(got, want)
    assert torch.equal(got, _greedy(target, PROMPT, 40))
    assert steps < 39  # some drafts were accepted: fewer target calls than tokens


def test_spec_generate_greedy_stops_and_lengths(tmp_path):
    """Invariant: the output is the prompt then at most ``max_new_tokens`` of the target's greedy
    tokens, ending right after the first stop token emitted (kept); ``max_new_tokens=0`` returns the
    prompt, and a batch of two prompts is refused."""
    _, d = _export(tmp_path)
    target = _target(noise=1e-3)  # varied tokens to stop at
    full = _greedy(target, PROMPT, 30)
    for n in (0, 1, 2, 5, 30):
        got = d.spec_generate(target, PROMPT, max_new_tokens=n, stop_token_ids=None)
        assert torch.equal(got, full[:, : 11 + n]), n
    new = full[0, 11:].tolist()
    cut = next(i for i in range(2, len(new)) if new[i] not in new[:i])  # a token first emitted at cut >= 2
    got = d.spec_generate(target, PROMPT, max_new_tokens=30, stop_token_ids=[new[cut], 4094])
    assert torch.equal(got, full[:, : 11 + cut + 1])
    got = d.spec_generate(target, PROMPT, max_new_tokens=30, stop_token_ids=[new[0]])
    assert torch.equal(got, full[:, : 11 + 1])
    with pytest.raises(ValueError, match=r"\[1, N\]"):
        d.spec_generate(target, PROMPT.repeat(2, 1), max_new_tokens=4, stop_token_ids=None)
    with pytest.raises(ValueError, match="top_p"):
        d.spec_generate(target, PROMPT, max_new_tokens=4, stop_token_ids=None, temperature=1.0, top_p=0.0)
    # regressions: an empty prompt raised an internal RuntimeError, temperature=nan decoded greedily
    with pytest.raises(ValueError, match="non-empty"):
        d.spec_generate(target, PROMPT[:, :0], max_new_tokens=4, stop_token_ids=None)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="finite temperature"):
            d.spec_generate(target, PROMPT, max_new_tokens=4, stop_token_ids=None, temperature=bad)
    with pytest.raises(ValueError, match="top_k"):
        d.spec_generate(target, PROMPT, max_new_tokens=4, stop_token_ids=None, temperature=1.0, top_k=-2)


def test_spec_generate_sampling_with_top_k_1_is_greedy(tmp_path):
    """Invariant: with ``top_k=1`` the target's and the drafter's sampling distributions are one-hot,
    so speculative sampling (drafts, accept test, residual draw) must return the greedy text."""
    _, d = _export(tmp_path)
    target = _target(noise=1e-3)  # top_k=1 keeps one of tied logits, argmax the first: no ties here
    torch.manual_seed(0)
    got = d.spec_generate(target, PROMPT, max_new_tokens=25, stop_token_ids=None, temperature=0.7, top_k=1)
    assert torch.equal(got, _greedy(target, PROMPT, 25))


def test_speculative_accept_keeps_the_target_distribution():
    """Invariant: a drafted token drawn from ``q``, passed through the accept test against ``p``
    (with the residual draw on rejection), is distributed as ``p`` even where ``q`` puts mass on a
    token ``p`` gives none, and a block accepted in full draws its next token from ``p[L]``."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    torch.manual_seed(0)
    n_trials, first, after_full = 20000, torch.zeros(4), torch.zeros(4)
    for _ in range(n_trials):
        drafted = md._draw(q)
        n, nxt = md._speculative_accept(drafted, p, q)
        first[int(drafted[0]) if n == 1 else int(nxt)] += 1
        if n == 1:
            after_full[int(nxt)] += 1
    torch.testing.assert_close(first / n_trials, p[0], atol=0.015, rtol=0)
    torch.testing.assert_close(after_full / after_full.sum(), p[1], atol=0.03, rtol=0)


def test_probs_top_k_and_top_p():
    """Invariant: ``top_k`` keeps the k largest logits, ``top_p`` the smallest prefix (by
    probability) whose mass reaches ``top_p``; the rest get probability 0 and the kept ones are
    renormalised."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    torch.testing.assert_close(md._probs(logits, 1.0, 1.0, 2), torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))
    torch.testing.assert_close(md._probs(logits, 1.0, 0.65, 0), torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))
    torch.testing.assert_close(md._probs(logits, 1.0, 0.75, 0), torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0]))
    torch.testing.assert_close(md._probs(logits, 1.0, 1.0, 0), torch.tensor([0.4, 0.3, 0.2, 0.1]))


@pytest.mark.filterwarnings("ignore::FutureWarning")  # z-lab passes past_key_values (renamed in transformers 5.2x)
def test_dflash2_spec_generate_is_greedy_and_zlabs(tmp_path):
    """Invariant: a DFlash2 export's ``spec_generate`` drafts with its candidate selector and still
    returns the target's greedy text, equal to z-lab's ``DFlash2DraftModel.spec_generate`` (its
    sampled decoding: ``tests/dflash/model/test_spec_generate_dflash2_sampled.py``)."""
    from transformers import AutoModel

    from tests.dflash.export.test_dflash2_export import make as make2

    zl = zlab_model()
    out = tmp_path / "export2"
    export_drafter(make2(), out, torch.float32)
    ours = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    assert type(ours).__name__ == "DFlash2DraftModel"
    theirs = zl.DFlash2DraftModel.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
    target = _target(noise=1e-3)
    got = ours.spec_generate(target, PROMPT, max_new_tokens=30, stop_token_ids=None)
    assert torch.equal(got, theirs.spec_generate(target, PROMPT, max_new_tokens=30, stop_token_ids=None))
    assert torch.equal(got, _greedy(target, PROMPT, 30))
