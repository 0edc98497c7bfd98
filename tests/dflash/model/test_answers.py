"""The target's answers to many contexts (:mod:`dflash.model.answers`): the engines agree."""

from __future__ import annotations

import pytest
import torch
import transformers

from dflash.model.answers import answer, check_engine
from tests.dflash.run.test_run_e2e import ROOT

pytestmark = pytest.mark.timeout(600)
TARGET = ROOT / "dflash" / "assets" / "target-sharegpt-7m"
TRANSFORMERS_4 = int(transformers.__version__.split(".")[0]) < 5


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    texts = ["Hi", "Tell me about the sea and why it is salty", "What is two plus two?",
             "Write a short poem about a cat who likes to sleep all day long in the sun"]
    contexts = [tok(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                            add_generation_prompt=True), add_special_tokens=False)["input_ids"]
                for t in texts]
    return model, tok, contexts


def _alone(model, context, n, eos):
    """The target's greedy answer to one context, unbatched: the reference."""
    with torch.no_grad():
        out = model.generate(torch.tensor([context]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos[0])[0, len(context):].tolist()
    cut = next((j for j, t in enumerate(out) if t in eos), None)
    return (out if cut is None else out[:cut]), cut is not None


@pytest.mark.parametrize("engine,cache", [("generate", "dynamic"), ("generate", "static"), ("slots", "dynamic"), pytest.param(
    "continuous", "dynamic", marks=pytest.mark.skipif(TRANSFORMERS_4, reason="the continuous engine needs transformers >= 5"))])
def test_each_engine_gives_each_context_its_own_greedy_answer_in_order(target, engine, cache):
    """Invariant: in fp32 on a CPU, greedy answers are token-identical to the target's unbatched
    greedy answer to each context, returned in the order of the contexts, whatever the engine, the
    KV cache (a static one pads prompts wider) and however the contexts were batched (sorted by
    length, two per batch)."""
    model, tok, contexts = target
    eos = [tok.eos_token_id]
    got = answer(model, contexts, max_new_tokens=12, eos=eos, pad=eos[0], batch_size=2, engine=engine, cache=cache)
    assert got == [_alone(model, c, 12, eos) for c in contexts]
    assert answer(model, [], max_new_tokens=12, eos=eos, pad=eos[0], engine=engine) == []


def test_an_engine_that_cannot_run_here_is_one_line():
    with pytest.raises(ValueError, match="not one of"):
        check_engine("vllm")
    if TRANSFORMERS_4:
        with pytest.raises(ValueError, match="needs transformers >= 5"):
            check_engine("continuous")
    else:
        check_engine("continuous")
