"""The fast tokenization path gives exactly what the old path gave, so it needs no switch.

The fast path renders each conversation structure's skeleton once, renders conversations with the
compiled template, and tokenizes segments of many conversations per ``encode_batch`` call. The
old path, kept here as the reference, rendered twice per conversation with
``apply_chat_template`` and encoded segment by segment. They must agree bit for bit on real
ShareGPT conversations and on the fixtures, for several templates, limits and settings.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from dflash.data import (
    TINY_TOKENIZER,
    ChatEncoder,
    DataConfig,
    load_dataset,
    load_tokenizer,
    read_source,
)
from dflash.data import chat as chat_mod
from dflash.data import tokenize as tokenize_mod
from dflash.data.tokenizer import special_token_ids
from tests.qwen3_style import qwen3_style_tokenizer

FIX = Path(__file__).resolve().parents[3] / "tests" / "fixtures"
_SPLIT = re.compile("\ue000(\\d+)\ue001")

# Renders content that starts with "!" upper-cased: the skeleton of a structure cannot know that.
CONTENT_DEPENDENT = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.content.startswith('!') %}{{- m.content.upper() }}{%- else %}{{- m.content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
)


_LITERAL: dict[int, tuple] = {}


def _literal(tok):
    if id(tok) not in _LITERAL:
        from tokenizers import Tokenizer

        literal = Tokenizer.from_str(tok.backend_tokenizer.to_str())
        literal.encode_special_tokens = True
        _LITERAL[id(tok)] = (literal, special_token_ids(tok), tok)
    return _LITERAL[id(tok)][:2]


def old_encode(tok, conv, *, max_length, last_turn_only=False, min_loss_tokens=0):
    """The path before the fast one (conversations without reasoning): two renders, one encode per
    segment."""
    literal, special = _literal(tok)
    skeleton = tok.apply_chat_template([{"role": m["role"], "content": f"\ue000{i}\ue001"}
                                        for i, m in enumerate(conv)], tokenize=False)
    parts = _SPLIT.split(skeleton)
    pieces = parts[0::2]
    if parts[1::2] != [str(i) for i in range(len(conv))]:
        return "template_mismatch"
    real = tok.apply_chat_template(conv, tokenize=False)
    if not real.startswith(pieces[0]):
        return "template_mismatch"
    pos, forms = len(pieces[0]), []
    for m, after in zip(conv, pieces[1:]):
        c = m["content"]
        for f in dict.fromkeys([c, c.strip(), c.lstrip(), c.rstrip(), c.lstrip("\n"), c.strip("\n"), c.rstrip("\n")]):
            if real.startswith(f, pos) and real.startswith(after, pos + len(f)):
                break
        else:
            return "template_mismatch"
        forms.append(f)
        pos += len(f) + len(after)
    if pos != len(real):
        return "template_mismatch"
    assistant = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
    trained = set(assistant[-1:] if last_turn_only else assistant)
    ids = tok.backend_tokenizer.encode(pieces[0], add_special_tokens=False).ids
    mask = [0] * len(ids)
    cut = False
    for i, f in enumerate(forms):
        if len(ids) >= max_length:
            cut = True
            break
        content = literal.encode(f, add_special_tokens=False).ids
        ids, mask = ids + content, mask + [int(i in trained)] * len(content)
        after = tok.backend_tokenizer.encode(pieces[i + 1], add_special_tokens=False).ids
        ids, mask = ids + after, mask + [0] * len(after)
        if i in trained and after and after[0] in special:
            mask[len(ids) - len(after)] = 1
    truncated = cut or len(ids) > max_length
    ids, mask = ids[:max_length], mask[:max_length]
    if sum(mask) < max(min_loss_tokens, 1):
        return "too_few_loss_tokens"
    return ids, mask, truncated


@pytest.fixture(scope="module")
def sharegpt():
    return read_source("sharegpt", max_samples=120).conversations


def fixture_conversations():
    return [c for name in ("data_sharegpt.jsonl", "data_openai.json", "data_prompt_completion.jsonl", "data_bad.jsonl")
            for c in read_source(str(FIX / name)).conversations]


def tokenizers(tmp_path_factory):
    tiny = load_tokenizer(TINY_TOKENIZER)
    dependent = load_tokenizer(TINY_TOKENIZER)
    dependent.chat_template = CONTENT_DEPENDENT
    return {"tiny": tiny, "qwen3_style": qwen3_style_tokenizer(tmp_path_factory.mktemp("q3")),
            "content_dependent": dependent}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    return tokenizers(tmp_path_factory)


def assert_same(tok, convs, **kw):
    new = ChatEncoder(tok, **kw).encode_many(convs)
    for conv, got in zip(convs, new):
        want = old_encode(tok, conv, **kw)
        if isinstance(want, str):
            assert got == want, conv
        else:
            assert not isinstance(got, str), (got, conv)
            assert (got.ids.tolist(), got.mask.tolist(), got.truncated) == want
            assert got.ids.dtype == np.int32 and got.mask.dtype == np.uint8


@pytest.mark.parametrize("name", ["tiny", "qwen3_style", "content_dependent"])
@pytest.mark.parametrize("kw", [dict(max_length=1 << 20), dict(max_length=300, min_loss_tokens=40),
                                dict(max_length=9, last_turn_only=True)])
def test_fast_path_equals_old_path(toks, sharegpt, name, kw):
    """Invariant: the fast path (skeleton per structure, compiled rendering, batched segments,
    rounds that stop at max_length) gives exactly the old path's ids, masks, truncation flags and
    skip reasons: on real ShareGPT, on the fixtures, and with a template whose output depends on
    the content (every ``!`` conversation is a template_mismatch in both)."""
    convs = sharegpt + fixture_conversations()
    if name == "content_dependent":
        convs = convs[:40] + [[{"role": "user", "content": "!shout"}, {"role": "assistant", "content": "calm"}],
                              [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "!loud"}]]
    assert_same(toks[name], convs, **kw)


def test_wrong_compiled_renderer_cannot_change_the_output(toks, sharegpt, monkeypatch):
    """Invariant: the compiled-template shortcut is checked against apply_chat_template once per
    structure and abandoned on the first difference, so it can never change what is produced."""
    tok = toks["tiny"]
    ref = ChatEncoder(tok, max_length=1 << 20).encode_many(sharegpt[:20])
    monkeypatch.setattr(chat_mod, "compiled_renderer", lambda t: (lambda messages: "garbage"))
    enc = ChatEncoder(tok, max_length=1 << 20)
    got = enc.encode_many(sharegpt[:20])
    assert enc._fast is None
    for a, b in zip(ref, got):
        assert a.ids.tolist() == b.ids.tolist() and a.mask.tolist() == b.mask.tolist()


def test_threads_and_chunks_give_identical_arrays(toks, tmp_path, monkeypatch):
    """Invariant: the arrays depend on neither the chunking nor the in-process threads (the
    number of processes: test_data_tokenize.test_parallel_workers_give_identical_arrays)."""
    tok = toks["tiny"]
    path = FIX / "data_sharegpt.jsonl"

    def load(tag, **kw):
        cfg = DataConfig(source=str(path), cache_dir=str(tmp_path / tag), block_size=2, **kw)
        return load_dataset(cfg, tok, progress=False, quiet=True)

    whole = load("whole", num_workers=1)
    monkeypatch.setattr(tokenize_mod, "CHUNK", 1)
    monkeypatch.setattr(tokenize_mod, "THREADS", 3)
    for other in (load("threads", num_workers=1),):
        np.testing.assert_array_equal(whole.tokens, other.tokens)
        np.testing.assert_array_equal(whole.loss_mask, other.loss_mask)
        np.testing.assert_array_equal(whole.offsets, other.offsets)


def test_a_failing_chunk_stops_tokenization_promptly(toks, tmp_path, monkeypatch):
    """Invariant: in-process tokenization keeps at most THREADS chunks in flight, so an error (or
    Ctrl-C) in one chunk is raised after those finish, not after the whole source."""
    calls = []

    def encode_many(self, conversations):
        calls.append(conversations[0][0]["content"])
        raise RuntimeError("boom")

    monkeypatch.setattr(tokenize_mod, "CHUNK", 1)
    monkeypatch.setattr(tokenize_mod, "THREADS", 2)
    monkeypatch.setattr(ChatEncoder, "encode_many", encode_many)
    cfg = DataConfig(source=str(FIX / "data_sharegpt.jsonl"), cache_dir=str(tmp_path), block_size=2, num_workers=1)
    with pytest.raises(RuntimeError, match="boom"):
        load_dataset(cfg, toks["tiny"], progress=False, quiet=True)
    assert 1 <= len(calls) <= 2  # of 4 chunks


def test_a_template_that_raises_is_a_counted_skip(toks):
    """Regression: a template that raises on some role orders (Llama-2 / Mistral style "roles must
    alternate") crashed the whole load; those conversations are skipped as template_error."""
    tok = load_tokenizer(TINY_TOKENIZER)
    tok.chat_template = ("{%- if messages[0].role != 'user' %}{{ raise_exception('must start with user') }}{%- endif %}"
                         + toks["tiny"].chat_template)
    convs = read_source(str(FIX / "data_sharegpt.jsonl")).conversations  # 2nd opens with system, 3rd assistant
    got = ChatEncoder(tok, max_length=4096).encode_many(convs)
    assert [e if isinstance(e, str) else "ok" for e in got] == ["ok", "template_error", "template_error", "ok"]


def test_default_tokenizes_in_this_process(monkeypatch):
    """Invariant: with data.num_workers unset, tokenization runs in this process (its
    encode_batch already uses every core; a spawned process costs ~2 s of start-up), whatever
    the CPU count."""
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert DataConfig().resolved_workers() == 1 and DataConfig(num_workers=8).resolved_workers() == 8
