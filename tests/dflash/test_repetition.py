"""Repetition loops in assistant turns (dflash.repetition): where a loop starts, what
``[data].repetition_keep`` keeps in the loss, and what the data summary says."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash.data import TINY_TOKENIZER, DataConfig, load_dataset, load_tokenizer
from dflash.data.dataset import summary_rows
from dflash.repetition import NGRAM, loop_start, mask_repetition


def brute_loop_start(ids: list[int], n: int) -> int | None:
    """The rule spelled out: the first window of ``n`` tokens equal to one that started earlier."""
    seen = set()
    for i in range(len(ids) - n + 1):
        w = tuple(ids[i:i + n])
        if w in seen:
            return i
        seen.add(w)
    return None


@pytest.mark.parametrize("seed", range(40))
def test_loop_start_equals_the_rule_spelled_out(seed):
    """Random token strings over a small vocabulary (short repeats happen by chance) and strings
    built with a loop at a known place: the vectorised search finds what the plain scan finds."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 6))
    if seed % 2:
        ids = rng.integers(0, 3, size=int(rng.integers(1, 60)))
    else:
        head = rng.integers(0, 1000, size=int(rng.integers(0, 30)))
        period = rng.integers(1000, 2000, size=int(rng.integers(1, 8)))
        ids = np.concatenate([head, np.tile(period, 6)])
    assert loop_start(ids, n) == brute_loop_start(ids.tolist(), n)


def test_a_loop_starts_where_its_first_window_repeats():
    """An answer, then the same sentence written again and again: the loop starts at the second
    copy's first token (period P: the window at P equals the one at 0); an answer with no repeat
    of NGRAM tokens has none, however often shorter phrases recur."""
    sentence = np.arange(100, 100 + 20)
    ids = np.concatenate([np.arange(1, 11), np.tile(sentence, 4)])
    assert loop_start(ids) == 10 + 20
    one_token = np.concatenate([np.arange(1, 11), np.full(40, 7)])   # a token repeated: period 1
    assert loop_start(one_token) == 11
    phrases = np.concatenate([np.r_[np.arange(50 + 10 * i, 60 + 10 * i), 1, 2, 3] for i in range(8)])
    assert loop_start(phrases) is None      # "1 2 3" recurs, but no 16-token window does
    assert loop_start(np.arange(NGRAM)) is None


def test_hash_collisions_never_cut_a_span(monkeypatch):
    """Windows are compared by hash and confirmed token by token: with every window hashing alike,
    only a true repeat is a loop start."""
    import dflash.repetition as rep

    monkeypatch.setattr(rep, "HASH_BASE", np.uint64(0))   # every window hashes to its last token
    ids = np.array([5, 1, 2, 9, 3, 2, 9, 3, 2])       # windows of 3: (2, 9, 3) at 2 repeats at 5
    assert rep.loop_start(ids, 3) == 5 == brute_loop_start(ids.tolist(), 3)
    assert rep.loop_start(np.array([1, 2, 3, 4, 5, 3]), 3) is None


def test_keep_takes_each_loops_tail_out_of_its_own_turn_only():
    """Two trained spans (assistant turns) with a prompt between them: each span's loop is found
    inside that span alone (the second turn copying the first is no loop), ``keep`` tokens from
    the loop's start stay trained, the rest leaves the loss, and the tokens stay in the sequence."""
    loop = np.tile(np.arange(200, 210), 8)                    # period 10
    turn1 = np.concatenate([np.arange(300, 310), loop])        # 90 tokens; the loop starts at its second copy, 20
    turn2 = np.concatenate([np.arange(300, 310), np.arange(400, 430)])   # copies turn 1's start: no loop
    prompt = np.arange(1, 6)
    ids = np.concatenate([prompt, turn1, prompt, turn2])
    mask = np.concatenate([np.zeros(5), np.ones(90), np.zeros(5), np.ones(40)]).astype(np.uint8)

    counted, n = mask_repetition(ids, mask, keep=None, ngram=8)
    assert counted is mask and n == (1, 70, 0)                # counted only: 70 tokens from the loop on

    kept, n = mask_repetition(ids, mask, keep=24, ngram=8)
    assert n == (1, 70, 46) and kept is not mask and mask.sum() == 130
    expect = mask.copy()
    expect[5 + 20 + 24: 5 + 90] = 0
    assert np.array_equal(kept, expect)
    assert kept[100:].sum() == 40                             # the second turn is whole
    _, n = mask_repetition(ids, mask, keep=200, ngram=8)
    assert n.masked_tokens == 0                               # keep longer than the loop: nothing leaves


def test_the_summary_counts_loops_and_repetition_keep_masks_them(tmp_path):
    """Through load_dataset: the summary counts the turns that loop and their loss tokens whether
    or not the key is set (and says the key is there when loops hold a large share); with it set,
    the loss mask loses each loop's tail, the tokens stay, the cache key differs, and a
    conversation left with too few loss tokens is dropped as ``repetition``."""
    tok = load_tokenizer(TINY_TOKENIZER)
    words = " ".join(f"w{i}" for i in range(30))
    loopy = " ".join(["the cat sat on the mat and looked at the dog"] * 12)
    rows = [{"messages": [{"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": loopy if i % 2 else words}]} for i in range(10)]
    rows.append({"messages": [{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "x " * 40}]})   # loops from its second token
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"source": str(src), "cache_dir": str(tmp_path / "c"), "block_size": 8, "max_length": 512}

    plain = load_dataset(DataConfig(**cfg), tok, progress=False, quiet=True)
    s = plain.summary
    assert s.looping_turns == 6 and s.loop_tokens_masked == 0 and len(plain) == 11
    assert s.loop_tokens > s.num_loss_tokens / 2
    assert "data.repetition_keep = 64" in dict(summary_rows(s))["turns that loop"]

    trimmed = load_dataset(DataConfig(**cfg, repetition_keep=8), tok, progress=False, quiet=True)
    t = trimmed.summary
    assert trimmed.key != plain.key and not t.from_cache
    assert t.skipped.get("repetition") == 1 and len(trimmed) == 10     # "x x x ..." keeps too few
    assert t.looping_turns == 5 and t.loop_tokens_masked > 0
    dropped = int(plain.loss_mask[plain.offsets[10]:plain.offsets[11]].sum())
    assert t.num_loss_tokens == s.num_loss_tokens - dropped - t.loop_tokens_masked
    assert "took" in dict(summary_rows(t))["turns that loop"]
    for i in range(10):                 # the same tokens; the loss mask a subset of the plain one
        a, b = plain.offsets[i], plain.offsets[i + 1]
        c, d = trimmed.offsets[i], trimmed.offsets[i + 1]
        assert np.array_equal(plain.tokens[a:b], trimmed.tokens[c:d])
        m0, m1 = plain.loss_mask[a:b], trimmed.loss_mask[c:d]
        assert not (m1 & ~m0).any()
        assert (m1 != m0).any() == bool(i % 2)
