"""Eval prompts are built exactly as training builds contexts, so eval measures what was trained:
same chat template pieces, same thinking mode, with a Qwen3-style template."""

from __future__ import annotations

import json

import pytest

from dflash.data import ChatEncoder, DataConfig, load_dataset
from dflash.data.prompts import encode_prompt, heldout_prompts, source_prompts
from dflash.data.sources import read_source
from tests.qwen3_style import qwen3_style_tokenizer


@pytest.fixture(scope="module")
def q3(tmp_path_factory):
    return qwen3_style_tokenizer(tmp_path_factory.mktemp("q3tok"))


def test_eval_prompt_has_the_training_contexts_thinking_mode(q3):
    """Regression: eval prompts ended in thinking mode (``assistant\\n``) while
    training contexts end in non-thinking mode (``assistant\\n<think>\\n\\n</think>\\n\\n``). The
    prompt is now the training context of an assistant turn after the given messages."""
    user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    got = encode_prompt(q3, user, 1 << 20)
    train = ChatEncoder(q3, max_length=1 << 20).context([*user, {"role": "assistant", "content": "Scattering."}])
    assert got == train.tolist()
    assert q3.decode(got).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    non_thinking = q3.apply_chat_template(user, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert got == q3(non_thinking, add_special_tokens=False)["input_ids"]
    assert encode_prompt(q3, user, 5) == got[-5:]


ROWS = [
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Short one."},
                  {"role": "user", "content": "More please"}, {"role": "assistant", "content": "Fine."}]},
    {"messages": [{"role": "user", "content": "What is 3*3?"},
                  {"role": "assistant", "content": "<think>\nThree threes.\n</think>\n\nNine."}]},
    {"messages": [{"role": "assistant", "content": "I open the conversation."},
                  {"role": "user", "content": "ok"}, {"role": "assistant", "content": "Good."}]},
    {"messages": [{"role": "user", "content": "Capital of Chile?"}, {"role": "assistant", "content": "Santiago."}]},
]


@pytest.mark.parametrize("reasoning", ["train", "context"])
def test_source_and_heldout_prompts_are_the_training_contexts(q3, tmp_path, reasoning):
    """Invariant: every eval prompt (from a data source or a run's holdout) is the context
    training gave that conversation's first trained token, for each data.reasoning setting;
    assistant-first conversations are skipped, a one-character first user turn is not."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = DataConfig(source=str(path), cache_dir=str(tmp_path / "cache"), num_workers=1, block_size=1,
                     holdout=3, seed=0, reasoning=reasoning)
    ds = load_dataset(cfg, q3, progress=False, quiet=True)
    trained = [ds.prompt(i).tolist() for i in range(len(ds))]
    got = source_prompts(str(path), q3, 4, 1 << 20, cfg)
    assert got == [trained[0], trained[1], trained[3]]
    think = q3.decode(got[1])
    assert think.endswith("<think>\n") if reasoning == "train" else think.endswith("Three threes.\n</think>\n\n")
    assert q3.decode(got[0]).endswith("x<|im_end|>\n<|im_start|>assistant\n")  # first of two turns
    assert len(read_source(str(path)).conversations) == 4
    held = heldout_prompts(cfg, q3, 3, 1 << 20)
    _, heldout = ds.split(cfg.holdout, cfg.seed)
    want = [heldout.prompt(i).tolist() for i in range(len(heldout))]
    assert held == [p for p in want if p != trained[2]] and held


def test_last_turn_prompts_hold_the_whole_conversation_so_far(q3, tmp_path):
    """--prompt-turn last: each held-out prompt is the context before the conversation's last
    trained turn (its earlier turns and answers included, as training rendered them), and with
    data.join the last conversation's last turn, many conversations deep: the long contexts that
    tau by context length needs. A single-turn conversation's last prompt is its first."""
    rows = [{"messages": [{"role": "user", "content": f"first question {i}"},
                          {"role": "assistant", "content": f"first answer {i}"},
                          {"role": "user", "content": f"second question {i}"},
                          {"role": "assistant", "content": f"second answer {i}"}]} for i in range(6)]
    rows += [{"messages": [{"role": "user", "content": "only question"},
                           {"role": "assistant", "content": "only answer"}]}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(source=str(path), cache_dir=str(tmp_path / "cache"), num_workers=1, block_size=1,
                     holdout=7 - 1, seed=0)
    ds = load_dataset(cfg, q3, progress=False, quiet=True)
    _, held = ds.split(cfg.holdout, cfg.seed)
    first = heldout_prompts(cfg, q3, 6, 1 << 20)
    last = heldout_prompts(cfg, q3, 6, 1 << 20, turn="last")
    assert len(first) == len(last) == 6
    for i, (a, b) in enumerate(zip(first, last)):
        text, ids = q3.decode(b), held.span(i)[0].tolist()
        assert b[:len(a)] == a and ids[:len(b)] == b                  # the first context, then more
        if "second question" in text:
            assert "first answer" in text and text.rindex("<|im_start|>assistant") > text.rindex("second question")
            assert "second answer" not in text
        else:
            assert a == b                                               # one turn: the same prompt
    assert heldout_prompts(cfg, q3, 6, 5, turn="last") == [p[-5:] for p in last]

    joined = DataConfig(source=str(path), cache_dir=str(tmp_path / "cache"), num_workers=1, block_size=1,
                        holdout=1, seed=0, join=True, max_length=200)
    (deep,) = heldout_prompts(joined, q3, 1, 1 << 20, turn="last")
    (shallow,) = heldout_prompts(joined, q3, 1, 1 << 20)
    assert q3.decode(deep).count("first question") >= 2 and q3.decode(shallow).count("question") == 1
