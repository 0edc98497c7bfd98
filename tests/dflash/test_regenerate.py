"""dflash.regenerate: target-answered data that resumes without loss and counts every drop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dflash.regenerate as regen

ROOT = Path(__file__).resolve().parents[2]
GRAPH = str(ROOT / "examples" / "dflash-tiny.toml")
TARGET = str(ROOT / "dflash" / "assets" / "target-sharegpt-7m")


def _source(tmp_path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"question {i}?"},
                          {"role": "assistant", "content": "old answer"},
                          {"role": "user", "content": "and then?"},
                          {"role": "assistant", "content": "old again"}]} for i in range(5)]
    rows.insert(1, {"messages": [{"role": "assistant", "content": "hello"},          # leading answer
                                 {"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "old"}]})
    rows.insert(3, {"messages": [{"role": "user", "content": "word " * 400},          # too long
                                 {"role": "assistant", "content": "old"}]})
    lines = [json.dumps(r) for r in rows] + ['{"messages": [', json.dumps({"messages": [
        {"role": "user", "content": "no answer"}]})]                                    # 2 bad rows
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _args(src: Path, out: Path, *extra: str) -> list[str]:
    return [GRAPH, "-o", str(out), "--set", f'data.source="{src}"', "--set", f'target.path="{TARGET}"',
            "--max-new-tokens", "3", "--max-prompt-tokens", "200", "--chunk", "2", "--batch-size", "2",
            "--device", "cpu", *extra]


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in out.read_text().splitlines() if x.strip()]


def test_regenerated_turns_are_the_targets_and_drops_are_counted(tmp_path, capsys):
    """Invariant: every assistant turn written is the target's own answer (never the dataset's),
    the turns before the first user turn are dropped but the rest kept, and each record that is
    not written is counted under its reason."""
    src, out = _source(tmp_path), tmp_path / "out.jsonl"
    assert regen.main(_args(src, out)) == 0
    err = capsys.readouterr().err
    rows = _lines(out)
    assert sorted(r["source_index"] for r in rows) == [0, 1, 2, 4, 5, 6]      # 3 is too long
    for r in rows:
        answers = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert answers and not {"old answer", "old again", "old"} & set(answers)
        assert r["messages"][0]["role"] == "user"
    assert len([m for m in rows[0]["messages"] if m["role"] == "assistant"]) == 2  # both turns
    for reason in ("prompt_too_long 1", "leading_assistant_turns_dropped 1", "malformed_json 1",
                   "no_assistant_turn 1"):
        assert reason in err, err
    # a line per round of answers (chunk and turn), with the engine's rate: a slow run shows in a log
    rounds = [line for line in err.splitlines() if ", turn " in line]
    assert any(line.startswith("dflash.regenerate: conversations 1-2, turn 2: ") for line in rounds), err
    assert all("tokens/s;" in line and "cut at --max-new-tokens)" in line for line in rounds)


def test_an_interrupted_run_resumes_without_loss_or_duplicates(tmp_path, monkeypatch, capsys):
    """Invariant (resumable): after an interruption, and a torn last line, the same command
    continues where it stopped: every conversation is written exactly once, and what was written
    before the interruption is kept unchanged."""
    src, out = _source(tmp_path), tmp_path / "out.jsonl"
    from dflash.model import answers

    real, calls = answers.answer, []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 3:                 # inside the second chunk
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(answers, "answer", flaky)
    assert regen.main(_args(src, out)) == 130
    first = out.read_text()
    assert len(_lines(out)) == 2            # the first chunk (2 conversations) was kept
    with open(out, "a") as f:
        f.write('{"messages": [{"role": "user", "con\n')  # a cut write, then a newline (echo, editor)
    monkeypatch.setattr(answers, "answer", real)
    assert regen.main(_args(src, out)) == 0
    rows = _lines(out)
    idx = [r["source_index"] for r in rows]
    assert sorted(idx) == [0, 1, 2, 4, 5, 6] and len(idx) == len(set(idx))
    assert out.read_text().startswith(first)
    assert "2 already in" in capsys.readouterr().err


def test_running_out_of_gpu_memory_is_one_line_and_keeps_what_finished(tmp_path, monkeypatch, capsys):
    """Invariant: an out-of-memory error mid-run ends in one line (exit 1) that names the setting a
    resume may change (--batch-size, with its value) and the count kept; the finished chunks stay
    and the same command with a smaller batch continues after them."""
    src, out = _source(tmp_path), tmp_path / "out.jsonl"
    from dflash.model import answers

    real, calls = answers.answer, []

    def short_of_memory(*a, **kw):
        calls.append(1)
        if len(calls) == 3:                 # inside the second chunk
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 5.62 GiB.")
        return real(*a, **kw)

    monkeypatch.setattr(answers, "answer", short_of_memory)
    assert regen.main(_args(src, out)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    last = err[-1]
    assert "ran out of memory" in last and "--batch-size (now" in last and "keeps its 2 finished" in last, last
    monkeypatch.setattr(answers, "answer", real)
    assert regen.main(_args(src, out, "--batch-size", "1")) == 0
    idx = sorted(r["source_index"] for r in _lines(out))
    assert idx == [0, 1, 2, 4, 5, 6]


def test_resuming_with_other_generation_settings_is_refused(tmp_path, capsys):
    """Invariant: one output file holds one generation setting; a resume that changes it is a
    one-line error (exit 2), and the file is left as it was."""
    src, out = _source(tmp_path), tmp_path / "out.jsonl"
    assert regen.main(_args(src, out, "--num-conversations", "2")) == 0
    before = out.read_text()
    capsys.readouterr()
    assert regen.main(_args(src, out, "--temperature", "0.7")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other settings" in err[0]
    assert out.read_text() == before


def test_a_second_writer_of_the_same_output_is_refused(tmp_path, capsys):
    """Invariant: two regenerate processes never append to one file (each would write every
    conversation once more): the second is a one-line error while the first holds the lock."""
    import fcntl

    src, out = _source(tmp_path), tmp_path / "out.jsonl"
    with open(tmp_path / "out.jsonl.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        import subprocess
        import sys

        proc = subprocess.run([sys.executable, "-m", "dflash.regenerate", *_args(src, out)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "another dflash.regenerate" in proc.stderr
    assert not out.exists() or out.read_text() == ""


@pytest.mark.parametrize("bad", [["--max-new-tokens", "0"], ["--top-p", "0"], ["--num-conversations", "0"],
                                 ["--repetition-keep", "-1"]])
def test_bad_arguments_are_usage_errors(tmp_path, bad):
    with pytest.raises(SystemExit) as e:
        regen.main(_args(tmp_path / "x.jsonl", tmp_path / "o.jsonl", *bad))
    assert e.value.code == 2


def test_excluded_conversations_are_never_answered_and_are_counted(tmp_path, capsys):
    """Invariant: a source_index listed in --exclude (e.g. the eval prompts) is not in the output,
    and the drop is counted; a malformed --exclude file is one line, exit 2, nothing written."""
    src, out = _source(tmp_path), tmp_path / "out.jsonl"
    held = tmp_path / "prompts.jsonl"
    held.write_text(json.dumps({"prompt": "question 0?", "source_index": 0}) + "\n"
                    + json.dumps({"prompt": "x", "source_index": 4}) + "\n\n")
    assert regen.main(_args(src, out, "--exclude", str(held))) == 0
    assert sorted(r["source_index"] for r in _lines(out)) == [1, 2, 5, 6]
    assert "excluded 2" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no index"}\n')
    out2 = tmp_path / "out2.jsonl"
    assert regen.main(_args(src, out2, "--exclude", str(bad))) == 2
    err = capsys.readouterr().err
    assert "line 1" in err and "source_index" in err and len(err.strip().splitlines()) == 1
    assert not out2.exists()


def test_a_flex_attention_target_regenerates_as_sdpa(tmp_path):
    """A graph whose target trains with flex_attention regenerates with sdpa (one sequence per row,
    KV cache, no document mask): the same answers as the sdpa graph, no compile per length."""
    src = _source(tmp_path)
    outs = []
    for impl in ("sdpa", "flex_attention"):
        out = tmp_path / f"{impl}.jsonl"
        assert regen.main(_args(src, out, "--set", f'target.attn_implementation="{impl}"')) == 0
        outs.append(_lines(out))
    assert outs[0] == outs[1] and outs[0]


def test_a_torn_meta_file_is_one_line_naming_it(tmp_path, capsys):
    """Invariant: an OUT.meta.json cut short (a crash while it was written by older code, a full
    disk) is refused with exit 2 and one line that names the file and the way out, before the
    target is loaded; the file is left as it was for the user to judge."""
    src, out = _source(tmp_path), tmp_path / "out.jsonl"
    meta = tmp_path / "out.jsonl.meta.json"
    torn = '{\n "settings": {\n  "version": 1,\n  "source": "'
    meta.write_text(torn)
    assert regen.main(_args(src, out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{meta} is damaged" in err and "delete it" in err and "another -o" in err
    assert meta.read_text() == torn and not out.exists()


def test_the_meta_file_is_replaced_atomically(tmp_path, monkeypatch):
    """Invariant: a failure while OUT.meta.json is rewritten (here: fsync fails, as on a full disk)
    leaves the previous file whole and no temporary beside it; a plain write_text would have
    truncated it first."""
    meta = tmp_path / "out.jsonl.meta.json"
    regen.write_meta(meta, {"settings": {"version": 1}})
    before = meta.read_text()

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(regen.os, "fsync", no_space)
    with pytest.raises(OSError, match="No space"):
        regen.write_meta(meta, {"settings": {"version": 2}})
    assert meta.read_text() == before and json.loads(before)["settings"] == {"version": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == [meta.name]


@pytest.mark.skipif(int(__import__("transformers").__version__.split(".")[0]) < 5,
                    reason="the continuous engine needs transformers >= 5")
def test_the_continuous_engine_writes_what_the_padded_one_writes(tmp_path, capsys):
    """Invariant: greedy, in fp32 on a CPU, ``--engine continuous`` (transformers' continuous
    batching) writes the same conversations as ``--engine generate``, multi-turn and all."""
    src = _source(tmp_path)
    a, b = tmp_path / "generate.jsonl", tmp_path / "continuous.jsonl"
    assert regen.main(_args(src, a, "--engine", "generate")) == 0
    assert regen.main(_args(src, b, "--engine", "continuous")) == 0
    assert _lines(a) == _lines(b) and len(_lines(a)) == 6


def test_the_slots_engine_writes_what_the_padded_one_writes(tmp_path):
    """Invariant: greedy, in fp32 on a CPU, ``--engine slots`` (a static cache, rows refilled as
    answers end) writes the same conversations as ``--engine generate``, multi-turn and all, with
    more answers per round than rows."""
    src = _source(tmp_path)
    a, b = tmp_path / "generate.jsonl", tmp_path / "slots.jsonl"
    assert regen.main(_args(src, a, "--engine", "generate", "--max-new-tokens", "12")) == 0
    assert regen.main(_args(src, b, "--engine", "slots", "--max-new-tokens", "12", "--chunk", "8")) == 0
    assert _lines(a) == _lines(b) and len(_lines(a)) == 6


def test_repetition_keep_cuts_looping_answers_alike_in_every_engine(tmp_path, capsys):
    """Invariant: with --repetition-keep, an answer that loops ends that many tokens into its loop,
    unfinished, and both engines write the same conversations (the slots engine stops such a row
    early, generate cuts the full answer): the cut depends on the tokens alone. The round lines
    count the answers cut in a loop apart from those cut at --max-new-tokens; the setting is part
    of the file's settings, so a resume without it is refused."""
    src = _source(tmp_path)
    full, a, b = (tmp_path / f"{n}.jsonl" for n in ("full", "generate", "slots"))
    assert regen.main(_args(src, full, "--engine", "generate", "--max-new-tokens", "64")) == 0
    capsys.readouterr()
    keep = ["--max-new-tokens", "64", "--repetition-keep", "4"]
    assert regen.main(_args(src, a, "--engine", "generate", *keep)) == 0
    err = capsys.readouterr().err
    assert regen.main(_args(src, b, "--engine", "slots", "--chunk", "8", *keep)) == 0
    assert _lines(a) == _lines(b) and len(_lines(a)) == 6
    shorter = 0
    for whole, cut in zip(_lines(full), _lines(a)):      # the first answer: the same context in both files
        w, c = whole["messages"][1]["content"], cut["messages"][1]["content"]
        assert w.startswith(c)
        shorter += len(c) < len(w)
        assert len(c) == len(w) or not cut["finished"]
    assert shorter and "in a repetition loop)" in err
    assert regen.main(_args(src, a, "--engine", "generate", "--max-new-tokens", "64")) == 2


def _shaped(layers: int, kv_heads: int, head_dim: int, dtype=torch.bfloat16):
    """A stand-in with a target's config and embedding dtype: what the KV arithmetic reads."""
    from types import SimpleNamespace

    weight = torch.empty(0, dtype=dtype)
    cfg = SimpleNamespace(num_hidden_layers=layers, num_key_value_heads=kv_heads, head_dim=head_dim,
                          hidden_size=kv_heads * head_dim, num_attention_heads=kv_heads)
    return SimpleNamespace(config=cfg, get_input_embeddings=lambda: SimpleNamespace(weight=weight))


def test_the_slots_rows_fill_half_the_free_memory_with_kv_cache():
    """Invariant: the rows chosen for a GPU hold their KV cache (keys and values of every layer,
    for the longest context and answer) in half the free memory, at least one and at most 512."""
    from dflash.model.slots import kv_bytes_per_row, positions_for, rows_that_fit

    smollm2, qwen3_8b = _shaped(30, 3, 64), _shaped(36, 8, 128)
    slots = positions_for(768, 256)
    assert slots == 1088 and slots >= 768 + 256 + 16 and slots % 64 == 0
    assert kv_bytes_per_row(smollm2, 1) == 2 * 30 * 3 * 64 * 2 == 23040
    assert kv_bytes_per_row(_shaped(30, 3, 64, torch.float32), 1) == 2 * 23040
    assert rows_that_fit(smollm2, slots, 70 * 2**30) == 512                     # capped
    assert rows_that_fit(qwen3_8b, slots, 62 * 10**9) == 193                    # 31 GB / 160.4 MB a row
    assert rows_that_fit(qwen3_8b, slots, 10**6) == 1


def test_auto_engine_is_slots_on_a_gpu_for_a_target_it_runs_and_generate_elsewhere(monkeypatch):
    """--engine auto: the slots engine on a GPU (rows sized from the free memory, chunks of 8 rows'
    worth), generate on a CPU and for a target the slots engine does not reproduce (the reason
    said); explicit settings are kept as given."""
    from dflash.model.slots import positions_for, rows_that_fit
    from dflash.model.target import TargetConfig, load_target

    plain = load_target(TargetConfig(preset="tiny", seed=1, vocab_size=64), "cpu", 2).model
    sliding = load_target(TargetConfig(preset="tiny", seed=1, vocab_size=64, overrides={
        "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}), "cpu", 2).model
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**29, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def chosen(model, device, *argv):
        args = regen._parse(["g.toml", "-o", "o.jsonl", "--max-prompt-tokens", "100",
                             "--max-new-tokens", "20", *argv])
        how = regen.choose_engine(args, model, device)
        return args.engine, args.batch_size, args.chunk, how

    rows = rows_that_fit(plain, positions_for(100, 20), 2**29)
    assert 1 < rows < 512
    engine, batch, chunk, how = chosen(plain, "cuda:0")
    assert (engine, batch, chunk) == ("slots", rows, 8 * rows)
    assert "engine slots (auto: a GPU)" in how and "half of the GPU's free 0.5 GiB" in how
    assert chosen(plain, "cpu")[:3] == ("generate", 32, 64)
    engine, batch, chunk, how = chosen(sliding, "cuda:0")
    assert (engine, batch, chunk) == ("generate", 32, 64) and "full-attention layers only" in how
    assert chosen(plain, "cuda:0", "--batch-size", "7", "--chunk", "9")[:3] == ("slots", 7, 9)
    assert chosen(plain, "cuda:0", "--engine", "generate")[:3] == ("generate", 32, 64)
    with pytest.raises(ValueError, match="full-attention layers only"):
        chosen(sliding, "cuda:0", "--engine", "slots")


def test_the_start_line_says_which_engine_auto_chose(tmp_path, capsys):
    src, out = _source(tmp_path), tmp_path / "out.jsonl"
    assert regen.main(_args(src, out)) == 0
    assert "engine generate (auto: a CPU), at most 2 rows at once, chunks of 2 conversations" in capsys.readouterr().err


def test_the_chunk_planner_fits_chunks_to_the_time_left_and_stops_before_a_late_one():
    """Invariant (a deadline loses no work): under a deadline the first chunk is one batch of rows,
    each later one fills at most ``margin`` of the time left at the last chunk's rate, and the run
    stops, ``stopped`` set, when not even one batch of rows fits; without a deadline every chunk is
    ``--chunk`` conversations (the last one the rest)."""
    from dflash.regenerate_plan import ChunkPlanner

    now = [0.0]
    p = ChunkPlanner(chunk=1000, batch_size=100, deadline=100.0, margin=0.8, clock=lambda: now[0])
    assert p.next_size(5000) == 100                  # the first chunk measures the rate
    now[0] = 10.0
    p.finished(100, 10.0)                            # 0.1 s a conversation, 90 s left
    assert p.next_size(4900) == 720                  # 0.8 x 90 / 0.1
    now[0] = 46.0
    p.finished(720, 36.0)                            # 0.05 s a conversation, 54 s left
    assert p.next_size(4180) == 864 and not p.stopped
    assert p.next_size(300) == 300                   # the rest fits
    now[0] = 96.0
    p.finished(864, 43.2)                            # 4 s left: 64 conversations, less than a batch
    assert p.next_size(3316) == 0 and p.stopped and p.conversations_done == 1684
    assert p.next_size(40) == 40                     # fewer left than a batch: the rest, if it fits
    now[0] = 101.0
    assert p.next_size(40) == 0 and p.stopped        # past the deadline
    plain = ChunkPlanner(chunk=64, batch_size=32)
    assert [plain.next_size(n) for n in (200, 64, 10, 0)] == [64, 64, 10, 0] and not plain.stopped
    with pytest.raises(ValueError):
        ChunkPlanner(chunk=0, batch_size=1)


def test_a_time_budget_stops_between_chunks_and_the_next_run_goes_on(tmp_path, monkeypatch, capsys):
    """Invariant: with --time-limit, a run whose next chunk would end after the budget stops
    before starting it (exit 0, every chunk it began written whole, how many are left said), and the
    same command again answers the rest: each conversation written exactly once."""
    import dflash.regenerate_plan as plan

    src, out = _source(tmp_path), tmp_path / "out.jsonl"
    clock = [0.0]
    monkeypatch.setattr(plan.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(regen.time, "monotonic", lambda: clock[0])
    from dflash.model import answers

    real = answers.answer

    def slow(*a, **kw):                 # each round of answers takes 30 "seconds"
        clock[0] += 30.0
        return real(*a, **kw)

    monkeypatch.setattr(answers, "answer", slow)
    # the first chunk (2 conversations, 2 rounds) ends at 60 s: 0.8 x 40 s left holds no chunk of 2
    assert regen.main(_args(src, out, "--time-limit", "100")) == 0
    err = capsys.readouterr().err
    assert sorted(r["source_index"] for r in _lines(out)) == [0, 1]
    assert "stopped at --time-limit 100" in err and "(5 conversations left)" in err, err
    clock[0] = 0.0
    assert regen.main(_args(src, out)) == 0          # no budget: the rest
    idx = [r["source_index"] for r in _lines(out)]
    assert sorted(idx) == [0, 1, 2, 4, 5, 6] and len(idx) == len(set(idx))
    assert "stopped at" not in capsys.readouterr().err
