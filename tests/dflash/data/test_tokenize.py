"""dflash.data tokenization: chat-template loss masks, truncation, drop rule, cache, parallelism."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from dflash.data import (
    TINY_TOKENIZER,
    ChatEncoder,
    DataConfig,
    DataError,
    load_dataset,
    load_tokenizer,
    read_source,
    tokenizer_fingerprint,
    tokenizer_info,
)
from dflash.data import tokenize as tokenize_mod
from dflash.data.dataset import summary_rows

FIX = Path(__file__).resolve().parents[3] / "tests" / "fixtures"
END = "<|im_end|>"

# A Qwen3-like template written for these tests: the last assistant turn gets an (empty) think
# block in its header and loses leading newlines; '</think>' in content moves text into reasoning.
QWEN_LIKE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY_TOKENIZER)


@pytest.fixture()
def qwen_tok():
    t = load_tokenizer(TINY_TOKENIZER)
    t.chat_template = QWEN_LIKE
    return t


def masked_runs(tok, enc) -> list[str]:
    """Decoded text of each maximal run of loss-masked tokens."""
    out, cur = [], []
    for i, m in zip(enc.ids.tolist(), enc.mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur)); cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


def assistant_texts(conv, form=lambda s: s) -> list[str]:
    return [form(m["content"]) + END for m in conv if m["role"] == "assistant"]


def all_fixture_conversations():
    return [c for name in ("data_sharegpt.jsonl", "data_openai.json", "data_prompt_completion.jsonl")
            for c in read_source(str(FIX / name)).conversations]


def test_tiny_tokenizer_is_offline_and_exposes_ids(tok):
    info = tokenizer_info(tok)
    assert info.vocab_size == 4096
    assert tok.convert_ids_to_tokens(info.mask_token_id) == "<|mask|>"
    assert tok.convert_ids_to_tokens(info.pad_token_id) == "<|endoftext|>"
    assert tok.convert_ids_to_tokens(info.eos_token_id) == END
    with pytest.raises(DataError, match="not a local directory"):
        load_tokenizer("Qwen/Qwen3-8B")


def test_mask_covers_exactly_each_assistant_content_and_end_token(tok):
    enc = ChatEncoder(tok, max_length=4096)
    convs = all_fixture_conversations()
    for conv, e in zip(convs, enc.encode_many(convs)):
        assert masked_runs(tok, e) == assistant_texts(conv)
        assert e.ids.dtype == np.int32 and e.mask.dtype == np.uint8 and not e.truncated


def test_mask_equals_transformers_generation_mask_on_tiny_template(tok):
    """The tiny template has {% generation %} tags: segment-wise encoding must agree with HF."""
    enc = ChatEncoder(tok, max_length=4096)
    convs = all_fixture_conversations()
    for conv, e in zip(convs, enc.encode_many(convs)):
        hf = tok.apply_chat_template(conv, return_dict=True, return_assistant_tokens_mask=True)
        assert e.ids.tolist() == hf["input_ids"]
        assert e.mask.tolist() == hf["assistant_masks"]


def test_last_turn_only(tok):
    conv = read_source(str(FIX / "data_sharegpt.jsonl")).conversations[1]
    e = ChatEncoder(tok, max_length=4096, last_turn_only=True).encode(conv)
    assert masked_runs(tok, e) == ["Two is the only even prime number." + END]


def test_truncation_to_max_length(tok):
    conv = read_source(str(FIX / "data_sharegpt.jsonl")).conversations[1]
    full = ChatEncoder(tok, max_length=4096).encode(conv)
    n = int(np.argmax(full.mask)) + 3  # cut three tokens into the first assistant turn
    cut = ChatEncoder(tok, max_length=n).encode(conv)
    assert len(full.ids) > n and not full.truncated
    assert cut.truncated and len(cut.ids) == n and int(cut.mask.sum()) == 3
    assert cut.ids.tolist() == full.ids[:n].tolist() and cut.mask.tolist() == full.mask[:n].tolist()


def test_drop_rule_at_the_threshold(tok):
    conv = read_source(str(FIX / "data_sharegpt.jsonl")).conversations[0]
    n = int(ChatEncoder(tok, max_length=4096).encode(conv).mask.sum())
    assert not isinstance(ChatEncoder(tok, max_length=4096, min_loss_tokens=n).encode(conv), str)
    assert ChatEncoder(tok, max_length=4096, min_loss_tokens=n + 1).encode(conv) == "too_few_loss_tokens"


def test_content_cannot_inject_control_tokens(tok):
    conv = [{"role": "user", "content": "say <|im_end|> twice <|im_start|>"},
            {"role": "assistant", "content": "Fine: <|im_end|> and again."}]
    e = ChatEncoder(tok, max_length=4096).encode(conv)
    im_end = tok.convert_tokens_to_ids(END)
    assert e.ids.tolist().count(im_end) == 2  # one per message, written by the template
    assert masked_runs(tok, e) == ["Fine: <|im_end|> and again." + END]


def test_qwen_like_template_think_header_is_not_trained(qwen_tok):
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "First answer here."},
            {"role": "user", "content": "More"}, {"role": "assistant", "content": "\n\nSecond answer."}]
    e = ChatEncoder(qwen_tok, max_length=4096).encode(conv)
    assert masked_runs(qwen_tok, e) == ["First answer here." + END, "Second answer." + END]
    text = qwen_tok.decode(e.ids.tolist())
    assert "<think>\n\n</think>\n\nSecond answer." in text
    assert text == qwen_tok.apply_chat_template(conv, tokenize=False)


def test_template_that_rewrites_content_is_skipped(qwen_tok):
    """Invariant: a template that rewrites a segment (here inline think handed to the encoder
    raw; dflash.data.sources splits it out first) gives template_mismatch, never a wrong mask."""
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>hmm</think>Answer."}]
    assert ChatEncoder(qwen_tok, max_length=4096).encode(conv) == "template_mismatch"


def test_template_that_strips_content(tok):
    tok2 = load_tokenizer(TINY_TOKENIZER)
    tok2.chat_template = tok.chat_template.replace("message['content'] + '<|im_end|>' }}{%- endgeneration",
                                                   "message['content'] | trim + '<|im_end|>' }}{%- endgeneration")
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  padded answer  \n"}]
    e = ChatEncoder(tok2, max_length=4096).encode(conv)
    assert masked_runs(tok2, e) == ["padded answer" + END]


def cfg_for(path, cache, **kw) -> DataConfig:
    return DataConfig(**{"source": str(path), "cache_dir": str(cache), "num_workers": 1, "block_size": 2, **kw})


def test_cache_hit_does_not_retokenize(tok, tmp_path, monkeypatch):
    cfg = cfg_for(FIX / "data_bad.jsonl", tmp_path)
    first = load_dataset(cfg, tok, progress=False, quiet=True)
    assert not first.summary.from_cache and len(first) == 2

    def boom(*a, **k):
        raise AssertionError("re-tokenized on a cache hit")

    monkeypatch.setattr(tokenize_mod, "read_source", boom)
    monkeypatch.setattr(ChatEncoder, "encode_many", boom)
    second = load_dataset(cfg, tok, progress=False, quiet=True)
    assert second.summary.from_cache and second.key == first.key
    np.testing.assert_array_equal(second.tokens, first.tokens)
    np.testing.assert_array_equal(second.loss_mask, first.loss_mask)
    np.testing.assert_array_equal(second.offsets, first.offsets)
    assert second.summary.skipped == first.summary.skipped
    import shutil

    shutil.copytree(tmp_path / first.key, tmp_path / "copy" / first.key)  # a copied cache names itself
    third = load_dataset(cfg_for(FIX / "data_bad.jsonl", tmp_path / "copy"), tok, progress=False, quiet=True)
    assert third.summary.from_cache and third.summary.cache_path == str(tmp_path / "copy" / first.key)


@pytest.mark.parametrize("change", ["max_length", "last_turn_only", "max_samples", "block_size",
                                    "template", "file_edit"])
def test_cache_key_changes(tok, tmp_path, change):
    src = tmp_path / "data.jsonl"
    shutil.copy(FIX / "data_sharegpt.jsonl", src)
    cfg = cfg_for(src, tmp_path / "cache")
    base = load_dataset(cfg, tok, progress=False, quiet=True)
    t2 = tok
    if change == "file_edit":
        with src.open("a") as f:
            f.write('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", '
                    '"content": "one more conversation appended to the file"}]}\n')
    elif change == "template":
        t2 = load_tokenizer(TINY_TOKENIZER)
        t2.chat_template = QWEN_LIKE
        assert tokenizer_fingerprint(t2) != tokenizer_fingerprint(tok)
    else:
        value = {"max_length": 64, "last_turn_only": True, "max_samples": 2, "block_size": 3}[change]
        cfg = cfg_for(src, tmp_path / "cache", **{change: value})
    again = load_dataset(cfg, t2, progress=False, quiet=True)
    assert not again.summary.from_cache and again.key != base.key
    if change == "file_edit":
        assert len(again) == len(base) + 1


def test_summary_is_printed_and_returned(tok, tmp_path):
    buf = io.StringIO()
    d = load_dataset(cfg_for(FIX / "data_bad.jsonl", tmp_path), tok, progress=False,
                     console=Console(file=buf, width=200))
    out = buf.getvalue()
    assert "skipped: malformed_json" in out and "skipped: unrecognised_shape" in out
    s = d.summary.to_dict()
    assert s["records_read"] == 10 and s["conversations"] == 2 and s["skipped"]["unrecognised_shape"] == 2
    assert s["num_loss_tokens"] == int(d.loss_mask.sum())


def test_no_conversation_passes_the_drop_rule(tok, tmp_path):
    path = FIX / "data_sharegpt.jsonl"
    with pytest.raises(DataError, match=r"data_sharegpt.jsonl.*too_few_loss_tokens=4"):
        load_dataset(cfg_for(path, tmp_path, block_size=500), tok, progress=False, quiet=True)


def test_parallel_workers_give_identical_arrays(tok, tmp_path, monkeypatch):
    """Spawned workers, chunks reassembled in file order: same arrays as one process."""
    monkeypatch.setattr(tokenize_mod, "CHUNK", 1)
    path = FIX / "data_sharegpt.jsonl"
    one = load_dataset(cfg_for(path, tmp_path / "a"), tok, progress=False, quiet=True)
    two = load_dataset(DataConfig(source=str(path), cache_dir=str(tmp_path / "b"), num_workers=2,
                                  block_size=2), tok, progress=True, quiet=True)
    assert len(one) == 4
    np.testing.assert_array_equal(one.tokens, two.tokens)
    np.testing.assert_array_equal(one.loss_mask, two.loss_mask)
    np.testing.assert_array_equal(one.offsets, two.offsets)


def test_split_holdout_is_seeded_and_disjoint(tok, tmp_path):
    d = load_dataset(cfg_for(FIX / "data_sharegpt.jsonl", tmp_path), tok, progress=False, quiet=True)
    train, held = d.split(1, seed=3)
    assert len(train) == 3 and len(held) == 1
    assert set(train.rows.tolist()).isdisjoint(held.rows.tolist())
    assert d.split(1, seed=3)[1].rows.tolist() == held.rows.tolist()
    with pytest.raises(ValueError, match="holdout"):
        d.split(4, seed=0)
    p = d.prompt(0)  # the context up to the first assistant turn, header included
    assert tok.decode(p.tolist()).endswith("What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert held.prompt(0).tolist() == d.prompt(int(held.rows[0])).tolist()


def test_no_held_out_prompt_is_trained_on_in_any_answer():
    """Invariant: a held-out conversation's prompt (its tokens before the first trained one) is
    never trained on, whatever the answer: a regenerated file answers each prompt once per pass
    (greedy, sampled) and ShareGPT repeats prompts. Its other answers leave the training view
    (counted), the held-out set is the plain random split's, and data without repeated prompts
    splits exactly as before. Empty prompts are never grouped."""
    from dflash.data import TokenizedDataset

    prompts = [[5, 6, i] for i in range(12)]
    ids, masks = [], []
    for rep in range(2):                                   # two passes: every prompt answered twice
        for i, pr in enumerate(prompts):
            ids.append(pr + [40 + rep, 50 + i])
            masks.append([0, 0, 0, 1, 1])
    ids.append([7, 7, 7]); masks.append([1, 1, 1])         # empty prompts: never grouped
    ids.append([8, 8, 8]); masks.append([1, 1, 1])
    d = TokenizedDataset.from_sequences(ids, masks)
    train, held = d.split(4, seed=0)
    held_prompts = {tuple(held.prompt(i).tolist()) for i in range(len(held))} - {()}
    train_prompts = {tuple(train.prompt(i).tolist()) for i in range(len(train))}
    assert len(held) == 4 and not held_prompts & train_prompts
    plain = np.sort(np.random.default_rng([0, 0x401D]).permutation(len(d))[:4])
    assert held.rows.tolist() == plain.tolist()            # the held-out set: the random split's
    grouped = sum(len(held.prompt(i)) > 0 for i in range(len(held)))
    siblings = sum(tuple(d.prompt(i).tolist()) in held_prompts for i in range(len(d))) - grouped
    assert train.same_prompt_dropped == siblings > 0
    assert len(train) + len(held) + siblings == len(d)
    assert {len(d) - 2, len(d) - 1} <= set(train.rows.tolist()) | set(held.rows.tolist())

    preamble = TokenizedDataset.from_sequences([[9, 9, 40 + i] for i in range(20)], [[0, 0, 1]] * 20)
    train2, held2 = preamble.split(2, seed=0)      # one prompt for all 20: a shared preamble, not one question
    assert len(train2) == 18 and train2.same_prompt_dropped == 0

    once = TokenizedDataset.from_sequences(ids[:12], masks[:12])   # no prompt repeated
    train1, held1 = once.split(3, seed=1)
    perm = np.random.default_rng([1, 0x401D]).permutation(12)
    assert train1.rows.tolist() == np.sort(perm[3:]).tolist() and train1.same_prompt_dropped == 0


def test_piped_progress_is_plain_lines_as_it_happens(monkeypatch):
    """In a pipe or log file, progress is plain lines while it happens (not only a final bar):
    one when the interval has passed, always one at the end, never box-drawing characters."""
    import io

    from dflash.data import tokenize as tk

    out = io.StringIO()
    clock = iter([0.0, 0.5, 2.6, 3.0, 3.1])
    monkeypatch.setattr(tk.time, "monotonic", lambda: next(clock))
    p = tk._LineProgress("chats.jsonl", 300, every_s=2.0, stream=out)
    for _ in range(3):
        p.advance(100)                # at 0.5 s: quiet; 2.6 s: a line; 3.0 s: the end, a line
    lines = out.getvalue().splitlines()
    assert lines == ["tokenizing chats.jsonl: 200/300 conversations (67%), 2.6 s",
                     "tokenizing chats.jsonl: 300/300 conversations (100%), 3.0 s"]
    assert "━" not in out.getvalue()


def test_a_left_out_holdout_scales_with_the_data():
    """Regression: data.holdout was 64 whatever the data: a 72-conversation file trained on 8.
    Invariant: left out, it is 64 but at most a tenth of the conversations; a number is taken as
    written (eval and the run apply this one rule)."""
    from dflash.data.dataset import holdout_count

    assert [holdout_count(None, n) for n in (0, 9, 72, 640, 100_000)] == [0, 0, 7, 64, 64]
    assert holdout_count(40, 72) == 40 and holdout_count(0, 1000) == 0


def test_the_summary_says_how_much_truncation_cut_and_the_length_that_keeps_most_whole(tok, tmp_path):
    """Invariant: the data summary says how many kept conversations max_length cut, by how much
    (the median cut; the longest conversation), and the data.max_length that keeps 90% whole;
    the full lengths of a conversation cut short are estimated from its characters, here
    within 20% of the exact ones (ShareGPT at 256, 512 and 2,048 tokens: median 1.00, 90% of them
    within 0.86..1.16, the 90th percentile within 3%). Regression: a user's file was cut in 169 of
    189 conversations and the summary said only "169"."""
    words = " ".join(f"word{i}" for i in range(400))
    rows = [{"messages": [{"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": " ".join([words] * (1 + i % 4))}]} for i in range(20)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    exact = [len(ChatEncoder(tok, max_length=1 << 30).encode(c).ids) for c in read_source(str(path)).conversations]
    d = load_dataset(cfg_for(path, tmp_path / "c", max_length=256),
                     tok, progress=False, quiet=True)
    s = d.summary
    assert s.truncated == 20 and s.max_length == 256
    assert abs(s.longest / max(exact) - 1) < 0.2
    assert abs(s.truncated_cut / (float(np.median(exact)) - 256) - 1) < 0.2
    assert s.whole_at % 64 == 0 and abs(s.whole_at / float(np.quantile(exact, 0.9, method="higher")) - 1) < 0.2
    (row,) = [v for k, v in summary_rows(s) if k.startswith("truncated")]
    assert row.startswith(f"20 of 20 (100%) longer than data.max_length = 256, cut by about {s.truncated_cut:,} "
                          f"tokens each (median; the longest has about {s.longest:,})"), row
    assert row.endswith(f"; data.max_length = {s.whole_at:,} keeps 90% whole"), row
    whole = load_dataset(cfg_for(path, tmp_path / "c", max_length=1 << 20),
                         tok, progress=False, quiet=True)
    assert whole.summary.truncated == 0 and dict(summary_rows(whole.summary))["truncated to max_length (kept)"] == "0"
    assert whole.summary.longest == max(exact)  # every segment tokenized: exact


def test_joined_conversations_fill_documents_up_to_max_length_and_keep_every_token(tok, tmp_path):
    """Invariant: with data.join, consecutive conversations (file order) become one document while
    their total stays within max_length; the tokens and loss masks are the unjoined ones back to
    back (nothing added, nothing lost), every document fits, no two neighbours would have fitted in
    one, and the summary says how many conversations made how many documents."""
    from dflash.data.tokenize import join_runs

    src = tmp_path / "many.jsonl"
    src.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": "question " * (1 + i % 4) + str(i)},
        {"role": "assistant", "content": "answer " * (3 + 2 * (i % 5)) + str(i)}]}) + "\n" for i in range(14)))
    plain = load_dataset(cfg_for(src, tmp_path / "c", max_length=96), tok, progress=False, quiet=True)
    joined = load_dataset(cfg_for(src, tmp_path / "c", max_length=96, join=True), tok, progress=False, quiet=True)
    assert joined.key != plain.key and not joined.summary.from_cache
    assert np.array_equal(joined.tokens, plain.tokens) and np.array_equal(joined.loss_mask, plain.loss_mask)
    assert 1 < len(joined) < len(plain) == joined.summary.joined_from == 14
    assert joined.summary.conversations == len(joined) and joined.lengths.sum() == plain.lengths.sum()
    assert joined.lengths.max() <= 96
    starts = join_runs(plain.lengths, 96)
    assert np.array_equal(joined.offsets, plain.offsets[starts])
    for a, b in zip(starts[:-1], starts[1:-1]):          # the next conversation did not fit
        assert plain.lengths[a:b].sum() + plain.lengths[b] > 96
    row = dict(summary_rows(joined.summary))["conversations kept"]
    assert row.startswith(f"14, joined into {len(joined)} documents") and "data.join" in row
    assert list(join_runs(np.array([5, 5, 5]), 10)) == [0, 2, 3]
    assert list(join_runs(np.array([10, 1, 10]), 10)) == [0, 1, 2, 3]


def test_the_summary_says_when_reading_stopped_at_max_samples(tok, tmp_path):
    """Invariant: when data.max_samples stops the reading with records left in the file, the
    records-read row and run.log's data line say so (so 4,074 records read for 4,000 tokenized is
    explained: 74 skipped on the way); a limit the file does not reach says nothing."""
    from dflash.observe.runlog import data_line

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i} " * 8}]}
            for i in range(3)]
    path = tmp_path / "three.jsonl"
    path.write_text("not json\n" + "".join(json.dumps(r) + "\n" for r in rows))
    cut = load_dataset(cfg_for(path, tmp_path / "c", max_samples=2), tok, progress=False, quiet=True).summary
    assert cut.records_read == 3 and cut.max_samples == 2
    assert dict(summary_rows(cut))["records read"] == "3 (reading stopped at data.max_samples = 2 usable conversations)"
    assert "3 records read (reading stopped at data.max_samples = 2 usable conversations), " in data_line(cut)
    for limit in (3, None):  # the file ends at (or before) the limit
        whole = load_dataset(cfg_for(path, tmp_path / "c", max_samples=limit), tok, progress=False, quiet=True).summary
        assert whole.records_read == 4 and whole.max_samples == 0
        assert dict(summary_rows(whole))["records read"] == "4"
