"""Reasoning data: conversations with ``<think>`` or ``reasoning_content`` are
kept, ``data.reasoning`` says whether reasoning is trained, the loss mask is right with a
Qwen3-style template, and what cannot be handled is counted under its own reason."""

from __future__ import annotations

import io
import json

import msgspec
import numpy as np
import pytest
from rich.console import Console

from dflash.data import (
    TINY_TOKENIZER,
    ChatEncoder,
    DataConfig,
    load_dataset,
    load_tokenizer,
    print_summary,
)
from dflash.data.sources import normalise_record, read_source
from tests.qwen3_style import qwen3_style_tokenizer

END = "<|im_end|>"

RECORDS = [
    # reasoning inline, with and without the opening tag; as a field; under transformers' aliases
    {"messages": [{"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": "<think>\nTwo plus two.\n</think>\n\nIt is four."}]},
    {"messages": [{"role": "user", "content": "Name a prime."},
                  {"role": "assistant", "content": "Small ones are easy.</think>Seven is prime."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Peru?"},
                  {"role": "assistant", "content": "Lima.", "reasoning_content": "Peru is in South America."}]},
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there!",
                                                          "reasoning": "A greeting back."}]},
    # multi-turn: Qwen3 shows only the reasoning after the last user turn
    {"messages": [{"role": "user", "content": "First question here"},
                  {"role": "assistant", "content": "First answer.", "thinking": "Early thought."},
                  {"role": "user", "content": "Second question here"},
                  {"role": "assistant", "content": "Second answer.", "reasoning_content": "Late thought."}]},
    # no reasoning at all, and an empty think block (counts as none)
    {"messages": [{"role": "user", "content": "Plain question"}, {"role": "assistant", "content": "Plain answer."}]},
    {"messages": [{"role": "user", "content": "Quick one"},
                  {"role": "assistant", "content": "<think>\n\n</think>\n\nQuick answer."}]},
]


@pytest.fixture(scope="module")
def q3(tmp_path_factory):
    return qwen3_style_tokenizer(tmp_path_factory.mktemp("q3tok"))


@pytest.fixture(scope="module")
def tiny():
    return load_tokenizer(TINY_TOKENIZER)


def convs():
    out = [normalise_record(r) for r in RECORDS]
    assert not any(isinstance(c, str) for c in out), out
    return out


def masked_runs(tok, enc) -> list[str]:
    out, cur = [], []
    for i, m in zip(enc.ids.tolist(), enc.mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


def test_reasoning_is_read_from_fields_and_inline_think():
    """Invariant: reasoning is split out of every place a dataset puts it (reasoning_content and
    its aliases, ``[<think>]...</think>`` inline), the way the Qwen3 template splits it; an empty
    think block is no reasoning."""
    got = convs()
    assert got[0][1] == {"role": "assistant", "content": "It is four.", "reasoning_content": "Two plus two."}
    assert got[1][1] == {"role": "assistant", "content": "Seven is prime.", "reasoning_content": "Small ones are easy."}
    assert got[2][2]["reasoning_content"] == "Peru is in South America."
    assert got[3][1] == {"role": "assistant", "content": "Hello there!", "reasoning_content": "A greeting back."}
    assert [m.get("reasoning_content") for m in got[4]] == [None, "Early thought.", None, "Late thought."]
    assert got[6][1] == {"role": "assistant", "content": "Quick answer."}


@pytest.mark.parametrize("turn, reason", [
    ({"role": "assistant", "content": "a</think>b</think>c"}, "malformed_reasoning"),
    ({"role": "assistant", "content": "preface <think>x</think>answer"}, "malformed_reasoning"),
    ({"role": "assistant", "content": "<think>a<think>b</think>answer"}, "malformed_reasoning"),
    ({"role": "assistant", "content": "<think>x</think>answer", "reasoning_content": "y"}, "malformed_reasoning"),
    ({"role": "assistant", "content": "<think>x</think>answer", "reasoning_content": ""}, None),
    ({"role": "assistant", "content": "answer", "reasoning_content": ["not", "text"]}, "non_string_reasoning"),
    ({"role": "assistant", "content": "<think>only thinking</think>\n\n"}, "empty_turn"),
])
def test_reasoning_that_cannot_be_split_is_counted_under_its_own_reason(tmp_path, turn, reason):
    """Invariant: a turn whose reasoning cannot be split without losing or inventing text is
    skipped under its own reason, never silently trained as something else (an empty reasoning
    field beside inline reasoning is no conflict: the row is kept)."""
    rows = [{"messages": [{"role": "user", "content": "q"}, turn]},
            {"messages": [{"role": "user", "content": "thinking user", "reasoning_content": "hm"},
                          {"role": "assistant", "content": "a"}]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "fine"}]}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = read_source(str(path))
    want = {"malformed_reasoning": 1}  # the reasoning field on a user turn
    if reason is not None:
        want[reason] = want.get(reason, 0) + 1
    assert dict(src.skipped) == want and len(src.conversations) == 3 - sum(want.values())


def _hf(tok, conv):
    return tok.apply_chat_template(conv, return_dict=True, return_assistant_tokens_mask=True)


def test_qwen3_style_mask_is_exactly_what_the_model_generates(q3):
    """Invariant: with a Qwen3-style template and data.reasoning = "train", every conversation
    with reasoning is kept, its ids equal tokenizing the template's rendering, and the loss mask
    equals transformers' {% generation %} mask: reasoning, ``\\n</think>\\n\\n``, answer and
    ``<|im_end|>`` are trained; headers, ``<think>\\n`` and the empty non-thinking block are not."""
    enc = ChatEncoder(q3, max_length=4096, reasoning="train")
    for conv, e in zip(convs(), enc.encode_many(convs())):
        assert not isinstance(e, str), conv
        hf = _hf(q3, conv)
        assert e.ids.tolist() == hf["input_ids"], conv
        assert e.mask.tolist() == hf["assistant_masks"], conv
    e = enc.encode(convs()[0])
    assert masked_runs(q3, e) == ["Two plus two.\n</think>\n\nIt is four." + END]
    assert q3.decode(enc.context(convs()[0]).tolist()).endswith("<|im_start|>assistant\n<think>\n")


def test_reasoning_modes_context_and_drop(q3):
    """Invariant: "context" keeps reasoning in the tokens but trains only the answer; "drop"
    gives exactly the rendering without reasoning; both keep the conversation."""
    conv = convs()[2]
    ctx = ChatEncoder(q3, max_length=4096, reasoning="context").encode(conv)
    train = ChatEncoder(q3, max_length=4096, reasoning="train").encode(conv)
    assert ctx.ids.tolist() == train.ids.tolist()
    assert masked_runs(q3, ctx) == ["Lima." + END]
    assert "Peru is in South America." in q3.decode(ctx.ids.tolist())
    drop = ChatEncoder(q3, max_length=4096, reasoning="drop").encode(conv)
    bare = [{"role": m["role"], "content": m["content"]} for m in conv]
    assert drop.ids.tolist() == _hf(q3, bare)["input_ids"]
    assert masked_runs(q3, drop) == ["Lima." + END]
    assert (ctx.reasoning_turns, ctx.reasoning_dropped, drop.reasoning_dropped) == (1, 0, 1)


def test_reasoning_the_template_leaves_out_is_counted(q3):
    """Invariant: a turn whose reasoning the chat template does not render (Qwen3: turns before
    the last user turn) keeps its answer trained and is counted, not dropped or mis-masked."""
    e = ChatEncoder(q3, max_length=4096).encode(convs()[4])
    assert (e.reasoning_turns, e.reasoning_dropped) == (2, 1)
    assert masked_runs(q3, e) == ["First answer." + END, "Late thought.\n</think>\n\nSecond answer." + END]
    assert "Early thought." not in q3.decode(e.ids.tolist())


def test_template_without_reasoning_support_gets_it_inline(tiny):
    """Invariant: a template that ignores reasoning_content (ChatML) does not lose the reasoning:
    it is written inline, ``<think>\\nR\\n</think>\\n\\nA``, and trained (or not) like with Qwen3."""
    conv = convs()[2]
    e = ChatEncoder(tiny, max_length=4096, reasoning="train").encode(conv)
    text = tiny.decode(e.ids.tolist())
    assert "<|im_start|>assistant\n<think>\nPeru is in South America.\n</think>\n\nLima.<|im_end|>" in text
    assert masked_runs(tiny, e) == ["Peru is in South America.\n</think>\n\nLima." + END]
    c = ChatEncoder(tiny, max_length=4096, reasoning="context").encode(conv)
    assert masked_runs(tiny, c) == ["Lima." + END] and c.ids.tolist() == e.ids.tolist()


def test_inline_reasoning_with_a_template_that_splits_think_itself(tiny):
    """Regression: a template that moves ``<think>...</think>`` out of the content
    (as Qwen3 does) used to give template_mismatch and drop the conversation; it is kept."""
    from tests.dflash.data.test_tokenize import QWEN_LIKE

    tok = load_tokenizer(TINY_TOKENIZER)
    tok.chat_template = QWEN_LIKE
    conv = normalise_record({"messages": [{"role": "user", "content": "Hi"},
                                          {"role": "assistant", "content": "<think>hmm</think>Answer."}]})
    e = ChatEncoder(tok, max_length=4096).encode(conv)
    assert masked_runs(tok, e) == ["hmm\n</think>\n\nAnswer." + END]


def test_load_dataset_keeps_reasoning_and_reports_it(q3, tmp_path):
    """Regression: half of a file with reasoning was lost as template_mismatch. Every
    conversation is kept, the summary counts turns with reasoning and those not in the tokens,
    and data.reasoning is part of the cache key."""
    path = tmp_path / "reasoning.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))

    def load(mode):
        cfg = DataConfig(source=str(path), cache_dir=str(tmp_path / "cache"), num_workers=1, block_size=1,
                         reasoning=mode)
        return load_dataset(cfg, q3, progress=False, quiet=True)

    train, ctx = load("train"), load("context")
    s = train.summary
    assert s.conversations == len(RECORDS) and s.skipped == {}
    assert (s.reasoning_turns, s.reasoning_dropped) == (6, 1)
    buf = io.StringIO()
    print_summary(s, Console(file=buf, width=200))
    assert "turns with reasoning / reasoning not in tokens" in buf.getvalue() and "6 / 1" in buf.getvalue()
    assert ctx.key != train.key and not ctx.summary.from_cache
    np.testing.assert_array_equal(ctx.tokens, train.tokens)
    assert ctx.summary.num_loss_tokens < s.num_loss_tokens


def test_reasoning_setting_is_validated():
    """Invariant: data.reasoning accepts only train / context / drop, at config decode time."""
    assert DataConfig().reasoning == "train"
    assert msgspec.toml.decode(b'reasoning = "drop"', type=DataConfig).reasoning == "drop"
    with pytest.raises(msgspec.ValidationError, match="reasoning"):
        msgspec.toml.decode(b'reasoning = "yes"', type=DataConfig)
