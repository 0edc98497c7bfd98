"""The decode benchmarks run end to end on a CPU at toy sizes: the speed table has its four
decoders (or says why one is missing) and the projection follows its documented formula."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(300)


def test_projection_follows_its_formula(tmp_path):
    """Invariant: predicted speedup = tau * t_greedy / (t_verify + t_draft), and the tau needed
    for 3x and 5x is 3c and 5c; the z-lab Qwen3-8B check points imply c = tau / speedup."""
    from benchmarks.decode.projection import main

    out = tmp_path / "proj.json"
    assert main(["--tiny", "--reps", "2", "--context", "16", "--dtype", "float32", "--tau", "2,4",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [round(x["cost_ratio_c"], 2) for x in res["zlab_qwen3_8b_implied"]] == [1.26, 1.52]
    assert set(res["shapes"]) == {"tiny-8b", "tiny-27b"}
    for s in res["shapes"].values():
        for L, pr in s["projection"].items():
            c = (s["t_verify_ms"] + s["t_draft_ms"][L]) / s["t_greedy_ms"]
            assert pr["cost_ratio_c"] == pytest.approx(c)
            assert pr["speedup"]["4"] == pytest.approx(4 * s["t_greedy_ms"] / (s["t_verify_ms"] + s["t_draft_ms"][L]))
            assert pr["tau_for_3x"] == pytest.approx(3 * c) and pr["tau_for_5x"] == pytest.approx(5 * c)


@pytest.mark.parametrize("graphs", [[], ["--cuda-graphs"]])
def test_decode_speed_reports_every_decoder_with_equal_outputs(tmp_path, graphs):
    """Invariant: one run times target-only generate, the greedy loop, draft-and-verify,
    z-lab's decoder (or names why it is skipped) and the export's own spec_generate, chain and
    tree, with --cuda-graphs also the loops with the static target step (the tree one's too), and the
    greedy decoders' outputs all equal transformers' generate."""
    from benchmarks.decode.speed import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "How do I sort a list?"}\n')
    out = tmp_path / "speed.json"
    assert main(["--random-drafter", "--prompts", str(prompts), "--num-prompts", "1", "--max-new-tokens",
                 "8", "--dtypes", "float32", "--device", "cpu", "--out", str(out), *graphs]) == 0
    res = json.loads(out.read_text())
    block = res["by_dtype"]["float32"]
    extra = {"greedy_graphs", "dflash_graphs", "tree_graphs"} if graphs else set()
    assert set(block["rows"]) | set(block["skipped"]) == {"hf_generate", "greedy", "dflash", "zlab", "export",
                                                          "export_tree"} | extra
    assert {"export", "export_tree"} <= set(block["rows"])
    for name in extra:   # on a CPU the static step runs eagerly (the shipped target is a Qwen3)
        assert block["rows"][name]["target_steps"] == "eager static forward (no CUDA)"
    if graphs:
        assert block["rows"]["dflash_graphs"]["drafter_steps"] == "eager static forward (no CUDA)"
    for name, row in block["rows"].items():
        assert row["outputs_equal"] == 1, name
        assert row["tok_s"] > 0 and 1 <= row["tau"] <= res["block_size"]
    assert res["command"].startswith("python -m benchmarks.decode.speed")


def test_decode_speed_times_only_the_rows_asked_for_and_says_each_as_it_goes(tmp_path, capsys):
    """``--decoders``: only those rows, in that order, the first the reference of the others' outputs
    and speedup; each row is printed when timed, before the table. An unknown name is a usage error."""
    from benchmarks.decode.speed import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "How do I sort a list?"}\n')
    out = tmp_path / "speed.json"
    base = ["--random-drafter", "--prompts", str(prompts), "--num-prompts", "1", "--max-new-tokens", "8",
            "--dtypes", "float32", "--device", "cpu"]
    assert main([*base, "--decoders", "greedy_graphs,dflash", "--out", str(out)]) == 0
    block = json.loads(out.read_text())["by_dtype"]["float32"]
    assert list(block["rows"]) == ["greedy_graphs", "dflash"] and block["reference"] == "greedy_graphs"
    assert block["rows"]["dflash"]["outputs_equal"] == 1 and block["skipped"] == {}
    assert block["rows"]["greedy_graphs"]["speedup_vs_reference"] == 1.0
    lines = capsys.readouterr().out.splitlines()
    timed = [i for i, line in enumerate(lines) if " timed: " in line]
    table = [i for i, line in enumerate(lines) if " equal 1/1 " in line]
    assert len(timed) == 2 and len(table) == 2 and max(timed) < min(table)
    assert "vs greedy_graphs" in lines[table[1]]
    with pytest.raises(SystemExit) as stop:
        main([*base, "--decoders", "greedy,nope"])
    assert stop.value.code == 2 and "name rows of hf_generate" in capsys.readouterr().err


def test_second_stage_timing_reports_each_variant_and_its_share(tmp_path):
    """Invariant: every variant gets the backbone's time; DFlash2's walk and XPress's passes get
    theirs and their share of a verify step, second / (verify + backbone + second)."""
    from benchmarks.decode.second_stage import main

    out = tmp_path / "second.json"
    assert main(["--tiny", "--reps", "2", "--context", "24", "--block-size", "4", "--passes", "3",
                 "--dtype", "float32", "--out", str(out)]) == 0
    t = json.loads(out.read_text())["targets"]["tiny"]
    assert set(t["variants"]) == {"dflash", "dflash2", "xpress"} and t["verify_ms"] > 0
    assert "second_ms" not in t["variants"]["dflash"]
    for v in ("dflash2", "xpress"):
        row = t["variants"][v]
        assert row["backbone_ms"] > 0 and row["second_ms"] > 0
        assert row["share"] == pytest.approx(row["second_ms"] / (t["verify_ms"] + row["backbone_ms"] + row["second_ms"]))
