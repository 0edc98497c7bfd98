"""The slots engine (:mod:`dflash.model.slots`): many answers over one static KV cache, rows refilled
as answers end. Greedy answers must be the target's own, token for token (fp32, CPU), whatever the
batch, the refill order and the cadence of looks; draws must follow the nucleus distribution."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash.model.slots import choose, decode
from tests.dflash.model.test_answers import _alone, target  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(600)


def _cut(row, eos):
    end = next((j for j, t in enumerate(row) if t in eos), None)
    return (row if end is None else row[:end]), end is not None


@pytest.mark.parametrize("batch,check_every", [(1, 1), (2, 3), (8, 8)])
def test_greedy_answers_are_the_targets_own_whatever_the_batch_and_refills(target, batch, check_every):  # noqa: F811
    """Invariant: each answer equals the target's unbatched greedy decode of its context, in the
    contexts' order, with fewer rows than contexts (rows refilled as answers end), one row, or more
    rows than contexts; answers that end early and answers cut at max_new_tokens both."""
    model, tok, contexts = target
    eos = [tok.eos_token_id]
    want = [_alone(model, c, 20, eos) for c in contexts]
    assert {fin for _, fin in want} == {True, False}, "the prompts should give both kinds of answer"
    got = decode(model, contexts, max_new_tokens=20, eos=eos, batch_size=batch, check_every=check_every)
    assert [_cut(r, eos) for r in got] == want
    assert all(len(r) <= 20 for r in got)


def test_a_llama_target_with_grouped_query_heads_decodes_as_generate():
    """Invariant: a Llama target whose query heads share key heads three to one (SmolLM2's 9/3)
    gives generate's greedy answers: the packed-query attention matches transformers' repeat."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 2)]
    eos = [96]
    want = [_alone(model, c, 12, eos) for c in contexts]
    got = decode(model, contexts, max_new_tokens=12, eos=eos, batch_size=2)
    assert [_cut(r, eos) for r in got] == want


def test_a_finished_call_frees_its_cache_at_once(target, monkeypatch):  # noqa: F811
    """Invariant: when ``decode`` returns, its KV cache is gone without waiting for Python's cycle
    collector (the step's bound method makes a cycle); two regeneration passes sharing a GPU
    otherwise each keep several calls' caches and one runs out of memory."""
    import gc
    import weakref

    from dflash.model import slots

    model, tok, contexts = target
    made = []
    real_init = slots.SlotDecoder.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append((weakref.ref(self), weakref.ref(self.k)))

    monkeypatch.setattr(slots.SlotDecoder, "__init__", init)
    gc.disable()
    try:
        got = decode(model, contexts, max_new_tokens=6, eos=[tok.eos_token_id], batch_size=2)
        assert len(got) == len(contexts) and made
        assert made[0][1]() is None, "the KV cache outlived the call"
    finally:
        gc.enable()


def test_the_tiniest_nucleus_is_greedy(target):  # noqa: F811
    """A nucleus of one token leaves nothing to draw: sampled answers are the greedy ones."""
    model, tok, contexts = target
    eos = [tok.eos_token_id]
    greedy = decode(model, contexts, max_new_tokens=10, eos=eos, batch_size=3)
    assert decode(model, contexts, max_new_tokens=10, eos=eos, batch_size=3, temperature=1.0, top_p=1e-9) == greedy


def test_draws_follow_the_tempered_nucleus_distribution():
    """Invariant: at temperature T and top_p, a token is drawn with probability softmax(logits / T)
    renormalised over the smallest most-probable set reaching top_p, never outside it (chi-square
    over 40,000 draws, far beyond the 0.1% critical value of 13.8 at 2 degrees of freedom)."""
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = (probs.log() * 2.0).repeat(40_000, 1)                   # T = 2 undoes the doubling
    draws = choose(logits, temperature=2.0, top_p=0.85)
    counts = torch.bincount(draws, minlength=5).double()
    assert counts[3:].sum() == 0                                       # outside the nucleus {0, 1, 2}
    expected = probs[:3].double() / probs[:3].sum() * len(draws)
    chi2 = float(((counts[:3] - expected) ** 2 / expected).sum())
    assert chi2 < 13.8, (counts, expected)
    assert torch.equal(choose(logits[:3], 0.0, 0.85), torch.zeros(3, dtype=torch.long))   # greedy


def test_a_family_the_engine_does_not_run_is_one_line():
    from dflash.model.slots import check_model

    with pytest.raises(ValueError, match="this one is 'gpt2'; use --engine generate"):
        check_model(SimpleNamespace(config=SimpleNamespace(model_type="gpt2")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA graph capture and replay")
def test_the_graphed_step_answers_as_the_eager_one_and_as_generate(target):  # noqa: F811
    """Invariant: on CUDA in fp32, the captured decode step changes how the rows run, not what they
    answer: equal to the eager step's answers and to generate's, greedy, with refills; sampled draws
    stay inside the vocabulary and end where an end token came."""
    model, tok, contexts = target
    eos = [tok.eos_token_id]
    want = [_alone(model, c, 20, eos) for c in contexts]                 # on the CPU, fp32
    model = model.cuda()
    try:
        eager = decode(model, contexts, max_new_tokens=20, eos=eos, batch_size=2, graphs=False)
        graphed = decode(model, contexts, max_new_tokens=20, eos=eos, batch_size=2, graphs=True)
        assert graphed == eager and [_cut(r, eos) for r in graphed] == want
        drawn = decode(model, contexts, max_new_tokens=20, eos=eos, batch_size=2, temperature=1.0, top_p=0.9)
        assert all(0 <= t < model.config.vocab_size for r in drawn for t in r)
        assert all(t not in eos for r in drawn for t in r[:-1])
    finally:
        model.cpu()


@pytest.mark.parametrize("seed", range(12))
def test_loop_starts_on_the_device_equal_the_rule_on_the_host(seed):
    """Invariant: the batched, hashed search finds each row's repetition loop start among its first
    ``count`` tokens exactly where :func:`dflash.repetition.loop_start` does (``W`` for none),
    whatever the tokens past ``count`` hold (a row's stale answer of an earlier context)."""
    import numpy as np

    from dflash.model.slots import loop_starts
    from dflash.repetition import loop_start

    g = torch.Generator().manual_seed(seed)
    rows, width, n = 9, 60, 4
    answers = torch.randint(0, 4 if seed % 2 else 500, (rows, width), generator=g)
    answers[0, 20:40] = answers[0, 0:20]                         # a loop of period 20 at 20
    answers[1] = answers[0]
    count = torch.randint(0, width + 1, (rows,), generator=g)
    count[0], count[1] = width, 23                               # row 1: the loop's first window is not all there
    got = loop_starts(answers, count, ngram=n).tolist()
    want = [loop_start(np.asarray(answers[r, :int(count[r])]), n) for r in range(rows)]
    assert got == [width if w is None else w for w in want]
    if seed % 2 == 0:   # 500 token values: no window of 4 repeats by chance, the one built in is found
        assert got[0] == 20 and got[1] == width


@pytest.mark.parametrize("keep", [0, 5, 24])
def test_repetition_keep_stops_a_looping_row_where_the_rule_cuts_its_answer(target, keep, monkeypatch):  # noqa: F811
    """Invariant: with ``repetition_keep`` each answer is the full greedy answer cut by the rule
    (``loop_cut``), token for token, while the rows that loop stop decoding there: fewer decode
    steps in all than decoding every loop to ``max_new_tokens``."""
    from dflash.model import slots
    from dflash.model.answers import loop_cut

    model, tok, contexts = target
    eos = [tok.eos_token_id]
    steps = []
    advance = slots.SlotDecoder.advance
    monkeypatch.setattr(slots.SlotDecoder, "advance", lambda self: (steps.append(1), advance(self))[1])
    full = [_cut(r, eos)[0] for r in decode(model, contexts, max_new_tokens=96, eos=eos, batch_size=2, check_every=4)]
    full_steps, steps[:] = len(steps), []
    cuts = [loop_cut(a, keep) for a in full]
    assert sum(c is not None for c in cuts) >= 2, "the prompts should give looping answers"
    got = decode(model, contexts, max_new_tokens=96, eos=eos, batch_size=2, check_every=4, repetition_keep=keep)
    assert [_cut(r, eos)[0] for r in got] == [a if c is None else a[:c] for a, c in zip(full, cuts)]
    assert len(steps) < full_steps
