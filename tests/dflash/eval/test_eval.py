"""dflash.eval: the draft-and-verify loop is lossless, an oracle is fully accepted, and the decode
sees exactly what teacher-forced training sees."""

from __future__ import annotations

import pytest
import torch

from dflash.eval.decode import CachedDrafterProposer, DrafterProposer, OracleProposer, greedy_decode, speculative_decode
from dflash.eval.measure import evaluate, greedy_labels
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target

BS = 4


@pytest.fixture(scope="module")
def models():
    target = load_target(TargetConfig(preset="tiny", seed=11, vocab_size=128), "cpu", num_draft_layers=2)
    head = target.shared_head()
    cfg = DrafterConfig(num_layers=1, block_size=BS, mask_token_id=127).resolve(target.hf_config,
                                                                                target.layer_ids)
    return target, head, DFlashDrafter(cfg, seed=2).eval()


def prompt(seed, n=9):
    return torch.randint(0, 127, (n,), generator=torch.Generator().manual_seed(seed))


def test_oracle_proposer_is_fully_accepted_and_lossless(models):
    target, _, _ = models
    p = prompt(0)
    tokens, accepted, anchors = speculative_decode(target, OracleProposer(target, BS), p, 12, BS)
    assert accepted == [BS - 1] * 3      # 1 prefill token + 3 steps x (3 + bonus), last bonus cut
    assert anchors == [9, 13, 17]
    assert torch.equal(tokens, greedy_decode(target, p, 12))


@pytest.mark.parametrize("kwargs, says", [
    ({"temperature": float("nan")}, "finite temperature"), ({"temperature": float("inf")}, "finite temperature"),
    ({"temperature": -0.5}, "finite temperature"), ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
    ({"temperature": 1.0, "top_p": 1.5}, "top_p"), ({"temperature": 1.0, "top_k": -1}, "top_k")])
def test_decode_refuses_sampling_it_cannot_honour(models, kwargs, says):
    """Regression: temperature=nan decoded greedily without a word (nan > 0 is False), inf and an
    out-of-range top_p or top_k were not refused either; each is one ValueError naming the setting."""
    target, head, drafter = models
    with pytest.raises(ValueError, match=says):
        speculative_decode(target, DrafterProposer(drafter, head), prompt(0), 4, BS, **kwargs)


def test_decode_refuses_an_empty_prompt(models):
    """Regression: an empty prompt raised an internal RuntimeError deep in the target's forward."""
    target, head, drafter = models
    empty = torch.zeros(0, dtype=torch.long)
    with pytest.raises(ValueError, match="non-empty"):
        greedy_decode(target, empty, 4)
    with pytest.raises(ValueError, match="non-empty"):
        speculative_decode(target, DrafterProposer(drafter, head), empty, 4, BS)


def test_last_step_drafts_only_what_remains(models):
    """Invariant (reference-decoder convention): the output is exactly max_new_tokens long and the
    last verify step drafts at most the tokens that remain, so tau is not inflated by drafts past
    the end."""
    target, _, _ = models
    p = prompt(0)
    seen = []

    class Counting(OracleProposer):
        def propose(self, tokens, features):
            seen.append(tokens.shape[0])
            return super().propose(tokens, features)

    tokens, accepted, _ = speculative_decode(target, Counting(target, BS), p, 7, BS)
    # prefill -> 1 token; step 1 drafts 3 (+bonus) -> 5; step 2: 2 remain -> 2 drafts accepted
    assert accepted == [3, 2] and tokens.shape[0] == 9 + 7
    assert torch.equal(tokens, greedy_decode(target, p, 7))


class _Recorder:
    def __init__(self, inner):
        self.inner, self.drafts = inner, []

    def propose(self, tokens, features):
        d = self.inner.propose(tokens, features)
        self.drafts.append(d.clone())
        return d


def test_drafter_decode_is_lossless_and_matches_teacher_forcing(models):
    """Invariant (train/inference consistency): every block the decode drafts equals the block
    teacher-forced training computes at the same anchor from the same text."""
    target, head, drafter = models
    p = prompt(1)
    rec = _Recorder(DrafterProposer(drafter, head))
    tokens, accepted, anchors = speculative_decode(target, rec, p, 10, BS)
    assert torch.equal(tokens[:19], greedy_decode(target, p, 10))
    from dflash.model.attention import training_layout
    L = tokens.shape[0]
    pos = torch.arange(L)[None]
    feats, _ = target(tokens[None], pos, torch.zeros_like(pos), need_final=False)
    a = torch.tensor([anchors])
    block = torch.full((1, len(anchors), BS), 127)
    block[0, :, 0] = tokens[a[0]]
    with torch.no_grad():
        hid = drafter(feats, head.embed(block), training_layout(pos, torch.zeros_like(pos), a, BS))
    tf = head.logits(hid[0, :, 1:]).argmax(-1)
    assert torch.equal(tf, torch.stack(rec.drafts))


def test_cached_drafter_proposes_what_the_uncached_one_does(models):
    """Invariant: the drafter's context KV cache changes speed, not drafts: at every step of a
    decode the cached proposer's drafted block equals the recomputing proposer's."""
    target, head, drafter = models
    p = prompt(5)
    plain = _Recorder(DrafterProposer(drafter, head))
    tokens, _, _ = speculative_decode(target, plain, p, 14, BS)
    cached = _Recorder(CachedDrafterProposer(drafter, head))
    tokens_c, _, _ = speculative_decode(target, cached, p, 14, BS)
    assert torch.equal(tokens, tokens_c) and len(plain.drafts) == len(cached.drafts) > 2
    assert all(torch.equal(a, b) for a, b in zip(plain.drafts, cached.drafts))


def test_teacher_forced_streak_equals_measured_acceptance(models):
    """Invariant: at every anchor the decode visited, the leading matches of the drafted block
    against teacher-forced labels (target argmax at a + j - 1) equal the measured accepted length.
    The proposer is the oracle with some slots spoiled, so acceptances vary."""
    target, head, _ = models
    rec = []

    class Spoiled:
        def propose(self, tokens, features):
            d = OracleProposer(target, BS).propose(tokens, features).clone()
            k = tokens.shape[0] % BS                   # spoil from slot k+1 on: m varies 0..3
            d[k:] = (d[k:] + 1) % 127
            rec.append(d)
            return d

    tokens, accepted, anchors = speculative_decode(target, Spoiled(), prompt(2), 16, BS)
    assert len(set(accepted)) > 1
    labels, valid, _ = greedy_labels(target, head, tokens, torch.tensor(anchors), BS)
    assert valid[:-1].all()              # the last anchor's valid slots = what remained to draft
    from dflash.train.acceptance import streak_lengths
    assert streak_lengths(torch.stack(rec) == labels, valid).tolist() == accepted


def test_evaluate_reports_consistent_numbers(models):
    target, head, drafter = models
    res = evaluate(target, drafter, head, [prompt(3), prompt(4, 6)], max_new_tokens=8)
    assert len(res.per_prompt) == 2 and len(res.acc_per_pos) == BS - 1
    assert res.tokens_per_step == pytest.approx(res.mean_accepted + 1)
    assert res.streak_visited == pytest.approx(res.mean_accepted)
    for r in res.per_prompt:
        assert r.new_tokens >= 8 and r.steps >= 1


def test_positions_no_anchor_reached_are_dash_in_the_table_and_null_in_json(models):
    """Regression (tester): with texts shorter than a block the report printed ``nan`` for the
    positions no anchor reached, and the ``--json`` result (``null`` there) did not read back.
    Invariant: ``-`` in the table with the anchors scored per position, None / ``null`` in the
    result, and the JSON decodes back to the same result."""
    import msgspec

    from dflash.eval.report import EvalResult, format_result

    target, head, drafter = models
    res = evaluate(target, drafter, head, [prompt(3)], max_new_tokens=2)
    assert res.acc_per_pos[-1] is None and res.n_per_pos[-1] == 0, (res.acc_per_pos, res.n_per_pos)
    assert res.acc_per_pos[0] is not None and res.n_per_pos[0] > 0
    line = next(x for x in format_result(res).splitlines() if x.startswith("acc per position:"))
    assert "nan" not in line and line.split(" (")[0].endswith(" -"), line
    assert f"anchors scored per position: {' '.join(map(str, res.n_per_pos))}" in line, line
    text = msgspec.json.encode(res)
    assert b"NaN" not in text and b"null" in text
    assert msgspec.json.decode(text, type=EvalResult) == res
    full = evaluate(target, drafter, head, [prompt(3)], max_new_tokens=8)  # every position reached
    assert None not in full.acc_per_pos and "anchors scored" not in format_result(full)


def test_evaluate_records_dtype_threads_and_sampled_tau(models):
    """Invariant: an eval result says the dtype and CPU threads it decoded with, and with a
    temperature its sampled tau beside greedy (reproducible from the seed); greedy-only leaves it
    None."""
    target, head, drafter = models
    greedy = evaluate(target, drafter, head, [prompt(3)], max_new_tokens=8)
    assert greedy.sampled_tau is None and greedy.temperature == 0.0
    assert greedy.dtype == "float32" and greedy.threads == torch.get_num_threads()
    runs = [evaluate(target, drafter, head, [prompt(3), prompt(4)], max_new_tokens=8, temperature=1.0,
                     top_k=20, seed=4) for _ in range(2)]
    assert runs[0].sampled_tau == runs[1].sampled_tau
    assert 1.0 <= runs[0].sampled_tau <= BS
    assert runs[0].sampled_accepted == pytest.approx(runs[0].sampled_tau - 1)
    from dflash.eval.report import format_result
    assert "measured: sampled (T=1, top-k 20)" in format_result(runs[0])


def test_a_time_limit_stops_between_prompts_and_says_how_many_were_decoded(models):
    """Invariant: under a time limit the evaluation starts no prompt once it has passed (the first
    always runs); the result is exactly the evaluation of the prompts it finished (same figures as
    asking for those alone), lists only their categories, and its headline and JSON say how many of
    how many and why. A limit never reached changes nothing but the recorded limit."""
    import msgspec

    from dflash.eval.progress import EvalProgress
    from dflash.eval.report import EvalResult, format_headline

    target, head, drafter = models
    prompts, cats = [prompt(3), prompt(4, 6), prompt(5)], ["a", "b", "b"]
    seen: list[EvalProgress] = []
    cut = evaluate(target, drafter, head, prompts, max_new_tokens=8, categories=cats, time_limit_s=1e-9,
                   progress=seen.append)
    alone = evaluate(target, drafter, head, prompts[:1], max_new_tokens=8, categories=cats[:1])
    assert [r.prompt for r in cut.per_prompt] == [0]
    assert (cut.tau, cut.streak_all, cut.acc_per_pos) == (alone.tau, alone.streak_all, alone.acc_per_pos)
    assert [c.category for c in cut.categories] == ["a"] and cut.macro_tau == alone.macro_tau
    assert cut.stopped_early and cut.prompts_asked == 3 and cut.stopped_by == "time_limit"
    assert "1 of 3 prompts: stopped at --time-limit 1e-09 s" in format_headline(cut)
    assert seen[-1].stage == "done" and (seen[-1].done, seen[-1].total) == (1, 3)
    assert msgspec.json.decode(msgspec.json.encode(cut), type=EvalResult).prompts_asked == 3
    whole = evaluate(target, drafter, head, prompts, max_new_tokens=8, categories=cats, time_limit_s=1e9)
    assert len(whole.per_prompt) == 3 and not whole.stopped_early and whole.stopped_by is None
    assert "stopped" not in format_headline(whole)


def test_a_time_limit_starts_no_prompt_predicted_to_end_after_it(models, monkeypatch):
    """Invariant: a prompt starts only if now + the mean time of the prompts finished (decodes and
    scoring) stays within the limit, counted from ``started_at`` (the CLI's start: loading counts),
    so the evaluation ends by the limit instead of one prompt after it. A fake clock makes each
    prompt take 10 s."""
    from types import SimpleNamespace

    from dflash.eval import measure

    target, head, drafter = models
    now = [0.0]
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def tick(p):
        if p.stage == "decode":
            now[0] += 10.0

    def finished(limit, started_at=None):
        now[0] = 0.0
        res = evaluate(target, drafter, head, [prompt(3), prompt(4), prompt(5)], max_new_tokens=4,
                       time_limit_s=limit, started_at=started_at, progress=tick)
        return len(res.per_prompt), res.stopped_by

    assert finished(25.0) == (2, "time_limit")        # at 20 s the third would end at 30 s: not started
    assert finished(30.0) == (3, None)                # it ends at 30 s: within the limit
    assert finished(25.0, started_at=-10.0) == (1, "time_limit")  # 10 s of loading before the first prompt


def test_stop_early_ends_after_the_prompt_under_way_with_its_result(models):
    """Invariant: ``stop_early`` (the CLI's SIGTERM flag) is asked before each prompt after the
    first; once it says True the evaluation ends there, its result over the prompts finished,
    ``stopped_by`` ``"signal"`` and the headline saying so."""
    from dflash.eval.report import format_headline

    target, head, drafter = models
    asked: list[int] = []

    def stop():
        asked.append(1)
        return len(asked) >= 2   # the flag rises while the second prompt decodes

    res = evaluate(target, drafter, head, [prompt(3), prompt(4), prompt(5)], max_new_tokens=4, stop_early=stop)
    assert [r.prompt for r in res.per_prompt] == [0, 1] and res.stopped_by == "signal"
    assert "2 of 3 prompts: stopped by SIGTERM" in format_headline(res)


def test_sigterm_inside_the_block_raises_the_flag_and_leaves_the_process_alive():
    """Invariant: within :func:`sigterm_ends_early` SIGTERM only raises the flag it yields (the
    evaluation then ends after the prompt under way); on leaving, the earlier handler is back."""
    import os
    import signal

    from dflash.eval.cli import sigterm_ends_early

    before = signal.getsignal(signal.SIGTERM)
    with sigterm_ends_early() as stopped:
        assert not stopped()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopped()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("flags", [["--threads", "0"], ["--temperature", "-1"], ["--top-p", "0"],
                                   ["--time-limit", "0"], ["--time-limit", "nan"]])
def test_eval_cli_bad_decode_flags_exit_2(tmp_path, flags, capsys):
    from dflash.eval.cli import main as eval_main

    with pytest.raises(SystemExit) as exc:
        eval_main([str(tmp_path), "--data", "sharegpt", *flags])
    assert exc.value.code == 2 and flags[0] in capsys.readouterr().err


# -- prompt selection and CLI input (QA regressions) -------------------------------------------

def _conv(i, assistant_first=False):
    turns = [{"role": "user", "content": f"question number {i} about channels"},
             {"role": "assistant", "content": f"answer number {i}: " + "word " * 12}]
    return {"messages": turns[1:] if assistant_first else turns}


def _write_source(path, flags):
    import json

    path.write_text("".join(json.dumps(_conv(i, f)) + "\n" for i, f in enumerate(flags)))
    return path


@pytest.fixture(scope="module")
def tok():
    from dflash.data.tokenizer import load_tokenizer

    return load_tokenizer("builtin:tiny")


def test_source_prompts_skip_conversations_that_open_with_the_assistant(tmp_path, tok):
    """Regression: a last conversation that opens with an assistant turn gave an empty prompt and
    apply_chat_template raised; it is skipped and an earlier one taken, so N prompts come back."""
    from dflash.data.prompts import source_prompts

    src = _write_source(tmp_path / "d.jsonl", [False, False, False, True])
    got = source_prompts(str(src), tok, 2, 1024)
    texts = [tok.decode(x) for x in got]
    assert len(got) == 2 and "question number 1" in texts[0] and "question number 2" in texts[1]
    assert source_prompts(str(src), tok, 2, 5)[0] == got[0][-5:]


def test_heldout_prompts_are_the_training_runs_holdout(tmp_path, tok):
    """Invariant: with RUN_DIR/config.toml, eval's prompts come from exactly the conversations
    dflash.run held out (dataset.split(holdout, seed)[1]), never from its training part."""
    from dflash.data import load_dataset
    from dflash.data.prompts import heldout_prompts
    from dflash.eval.inputs import run_data_config

    flags = [False] * 7 + [True]
    src = _write_source(tmp_path / "d.jsonl", flags)
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    assert run_data_config(ckpt) is None
    (run / "config.toml").write_text(
        f'[run]\nname = "x"\n[data]\nsource = "{src}"\nholdout = 7\nseed = 3\nblock_size = 1\n'
        f'cache_dir = "{tmp_path / "cache"}"\nnum_workers = 1\n')
    cfg = run_data_config(ckpt)
    assert (cfg.holdout, cfg.seed, cfg.source) == (7, 3, str(src))
    train, held = load_dataset(cfg, tok, progress=False, quiet=True).split(7, 3)
    got = heldout_prompts(cfg, tok, 7, 1024)
    held_prompts = [held.prompt(i).tolist() for i in range(len(held))]
    train_prompts = [train.prompt(i).tolist() for i in range(len(train))]
    assert got and all(p in held_prompts and p not in train_prompts for p in got)
    assert all("question number" in tok.decode(p) for p in got)   # assistant-first one skipped
    assert any("question number" not in tok.decode(p) for p in held_prompts)  # one to skip
    assert len(got) == sum("question number" in tok.decode(p) for p in held_prompts) == 6


@pytest.mark.parametrize("case", ["missing", "run_dir", "not_ckpt", "no_meta", "bad_data"])
def test_eval_cli_bad_input_is_one_line_exit_2(tmp_path, capsys, case):
    """Invariant: each bad input is one line, exit 2. ``no_meta`` is a regression: a directory with
    the weights and configs but no meta.json (a save that never finished) was evaluated."""
    from dflash.eval.cli import main as eval_main

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000005").mkdir(parents=True)
    path = {"missing": tmp_path / "nope", "run_dir": run, "not_ckpt": tmp_path,
            "no_meta": run / "checkpoints" / "step_00000005", "bad_data": run / "checkpoints" / "step_00000005"}[case]
    if case in ("no_meta", "bad_data"):
        for name in ("model.safetensors", "drafter_config.json", "target_config.json"):
            (path / name).write_text("{}")
    if case == "bad_data":
        (path / "meta.json").write_text('{"step": 5, "batch_id": 4, "loss": 1.0, "healthy": true}')
    assert eval_main([str(path), "--data", "no-such-source.jsonl", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    # run_dir: its only step_* directory is empty (an interrupted save), so none is suggested
    want = {"missing": "no such checkpoint", "run_dir": "holds no complete, healthy checkpoint",
            "not_ckpt": "not a drafter checkpoint", "no_meta": "has no meta.json: a checkpoint's meta.json is "
            "written last", "bad_data": "no-such-source.jsonl"}[case]
    assert want in err, err
    if case == "run_dir":
        assert "step_00000005" not in err, err


@pytest.mark.parametrize("text, says", [
    (b"[data]\nseed = " + b"1" * 5000 + b"\n", "an integer has more than 4,300 digits"),
    (b"[data\n", "invalid TOML"), (b"\xff\xfe", "not a UTF-8 text file")])
def test_an_unreadable_run_config_toml_names_the_file(tmp_path, text, says):
    """Regression (tester): a hand-edited integer of more than 4,300 digits in RUN_DIR/config.toml
    (Python's int-string limit: a bare ValueError, not a TOML error) escaped as a ValueError saying
    only to call sys.set_int_max_str_digits. Invariant: an EvalInputError naming the file."""
    from dflash.eval.inputs import EvalInputError, run_data_config

    ck = tmp_path / "run" / "checkpoints" / "step_00000005"
    ck.mkdir(parents=True)
    (tmp_path / "run" / "config.toml").write_bytes(text)
    with pytest.raises(EvalInputError) as e:
        run_data_config(ck)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{(tmp_path / 'run' / 'config.toml').resolve()}: ") and says in msg, msg


def test_a_broken_run_config_toml_is_said_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """A run whose config.toml does not read (its [data] table names the held-out prompts) is a
    one-line error before the drafter and the target load, not after."""
    import dflash.checkpoint.model_files as model_files
    import dflash.eval.cli as cli

    src = _write_source(tmp_path / "d.jsonl", [False] * 3)
    ck = tmp_path / "run" / "checkpoints" / "step_00000005"
    ck.mkdir(parents=True)
    (tmp_path / "run" / "config.toml").write_text("[data\n")
    monkeypatch.setattr(cli, "check_checkpoint", lambda *a: None)

    def no_models(*a, **k):
        raise AssertionError("a model was loaded before the config.toml error")
    monkeypatch.setattr(model_files, "load_drafter", no_models)
    assert cli.main([str(ck), "--data", str(src), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "config.toml" in err and "invalid TOML" in err, err


@pytest.mark.parametrize("bad, says", [
    ('{"conversations": []}', ':1: expected a JSON object with a string "prompt"'),
    ('{"prompt": "ok"}\nnot json', ':2: expected a JSON object with a string "prompt"')])
def test_bad_prompt_lines_name_the_file_and_line(tmp_path, bad, says, capsys):
    """Invariant: a malformed --prompts file is a one-line error naming the line, not a bare
    KeyError or a JSON message without a location."""
    from dflash.eval.cli import prompt_ids
    from dflash.eval.inputs import EvalInputError

    f = tmp_path / "p.jsonl"
    f.write_text(bad + "\n")
    args = type("A", (), {"prompts": str(f), "num_prompts": 8, "max_prompt_tokens": 64})()
    with pytest.raises(EvalInputError, match=says.replace("(", r"\(")):
        prompt_ids(args, None)


def test_a_device_this_machine_lacks_is_a_one_line_error(tmp_path, capsys):
    """Invariant: --device cuda on a CPU-only machine (or a typo like gpu) exits 2 with one line,
    before any model is loaded."""
    import dflash.eval.cli as ev

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA: the check is for a missing device")
    for dev in ("cuda", "gpu"):
        assert ev.main([str(tmp_path), "--prompts", str(tmp_path), "--device", dev]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("dflash.eval: --device ") for line in err)


def test_the_in_training_measure_counts_loops_as_dflash_eval_does(models, monkeypatch):
    """Invariant: ``decode_tau`` (the in-training evaluator's measure) reports the share of its
    greedy decodes' tokens in repetition loops and the tau outside them by the rule of
    ``dflash.eval``'s table (a step is in the loop when its anchor is at or past the loop start);
    the run's log line and summary say them, and say nothing of loops when none was decoded."""
    from dflash.eval import measure
    from dflash.eval.measure import decode_tau
    from dflash.records import HeldoutRecord

    target, head, drafter = models
    head_tokens = list(range(200, 220))
    looping = head_tokens + list(range(300, 317)) * 4             # loop start 37 of 88 tokens
    decodes = {9: (looping, [1, 2, 7, 9], [8, 19, 46, 69]), 4: (head_tokens, [3], [3])}

    def fake(target, proposer, p, max_new_tokens, bs, **kw):
        answer, acc, visited = decodes[p.shape[0]]
        return torch.cat([p, torch.tensor(answer)]), acc, visited

    monkeypatch.setattr(measure, "speculative_decode", fake)
    got = decode_tau(target, drafter, head, [prompt(0, 9), prompt(1, 4)], 88)
    assert got.steps == 5 and got.tau == pytest.approx(1 + (1 + 2 + 7 + 9 + 3) / 5)
    assert got.loop_share == pytest.approx((88 - 37) / (88 + 20))
    assert got.fresh_tau == pytest.approx(1 + (1 + 2 + 3) / 3)   # the steps at anchors 8, 19 and 3
    text = HeldoutRecord(step=1, loop_share=got.loop_share, fresh_tau=got.fresh_tau).loops_text()
    assert text == "; 47% of tokens in repetition loops, 3.000 outside them"
    assert HeldoutRecord(step=1, loop_share=0.0, fresh_tau=2.0).loops_text() == ""
    assert HeldoutRecord(step=1).loops_text() == ""                  # a record older than the fields


def test_verify_steps_inside_repetition_loops_are_counted_apart():
    """Invariant: a step whose anchor lies at or past its answer's loop start counts as in the loop;
    the share of generated tokens in loops and both taus follow from the decodes alone; the table
    prints them, and a decode with no loop has every step outside."""
    from dflash.eval.pooled import Decoded, loop_figures
    from dflash.eval.report import _loops_line

    head = list(range(200, 220))                       # 20 fresh tokens, then a period-17 loop
    answer = head + list(range(300, 317)) * 4          # loop start: the second copy, 20 + 17 = 37
    n = 5
    tokens = torch.tensor(list(range(n)) + answer)
    d = Decoded(0, 0, n, tokens, acc_m=[1, 2, 7, 9], visited=[n - 1, n + 10, n + 37, n + 60], greedy_seconds=0.0)
    fresh = Decoded(1, 0, n, torch.tensor(list(range(n)) + head), acc_m=[3], visited=[n - 1], greedy_seconds=0.0)
    got = loop_figures([d, fresh])
    assert got["loop_share"] == pytest.approx((len(answer) - 37) / (len(answer) + len(head)))
    assert got["loop_tau"] == pytest.approx(1 + (7 + 9) / 2)
    assert got["fresh_tau"] == pytest.approx(1 + (1 + 2 + 3) / 3)
    assert loop_figures([fresh]) == {"loop_share": 0.0, "loop_tau": None, "fresh_tau": 4.0}

    class R:
        loop_share, loop_tau, fresh_tau = 0.25, 8.0, None
    assert _loops_line(R).endswith("25% of the generated tokens; measured tau 8.000 in them, - elsewhere")


def test_evaluate_reports_the_loops_of_the_text_it_decoded(models):
    """Through evaluate: the random tiny target's greedy text loops (a share of it is in loops,
    some steps on each side), and the pooled tau lies between the taus inside and outside loops,
    the two classes making up every step; the table says so."""
    from dflash.eval.report import format_result

    target, head, drafter = models
    res = evaluate(target, drafter, head, [prompt(5), prompt(6, 7)], max_new_tokens=64)
    assert 0 < res.loop_share < 1 and res.loop_tau is not None and res.fresh_tau is not None
    assert min(res.loop_tau, res.fresh_tau) - 1e-9 <= res.tau <= max(res.loop_tau, res.fresh_tau) + 1e-9
    assert f"{res.loop_share:.0%} of the generated tokens" in format_result(res)
