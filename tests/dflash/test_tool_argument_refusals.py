"""The tools refuse arguments they cannot honour with one line and exit 2, before any work:
``dflash.plan -o`` where no file can be written or numbers no layout fits (``--coloc`` above 1,
absurd GPU and host counts), ``dflash.regenerate --device`` naming a device
this machine lacks, ``dflash.plot --dpi`` beyond what a figure can be rendered at,
``dflash.eval --top-p/--top-k`` on the greedy decode that would ignore them, ``dflash.eval
--data`` naming no source (in the words it was given), and ``dflash.eval --target-quantization
fp8`` where float8 cannot run."""

from __future__ import annotations

import pytest
import torch

from tests.dflash.plan.test_plan import ROOT, tiny_run  # noqa: F401 - the module-scoped fixture


def test_plan_writes_into_a_new_directory_and_refuses_a_path_under_a_file(tiny_run, tmp_path, capsys):  # noqa: F811
    from dflash.plan.cli import main

    out = tmp_path / "new" / "dir" / "plan.toml"
    assert main([str(tiny_run), "--extrapolate", "--gpus", "2", "-o", str(out)]) == 0 and out.is_file()
    capsys.readouterr()
    (tmp_path / "afile").write_text("x")
    assert main([str(tiny_run), "--extrapolate", "--gpus", "2", "-o", str(tmp_path / "afile" / "x.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write -o" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "4", "--coloc", "1.5"], "--coloc must be in (0, 1]"),
    (["--gpus", str(10 ** 9)], "--gpus 1000000000 is more than 131,072 GPUs"),
    (["--gpus", "2", "--hosts", "4"], "--hosts 4 is more than --gpus 2"),
    (["--gpus", "9", "--hosts", "2"], "--gpus 9 is not a multiple of --hosts 2"),
])
def test_plan_refuses_numbers_no_layout_can_be_planned_for(tmp_path, capsys, argv, message):
    """A colocation factor above 1, more GPUs than any cluster (the search walks every split),
    more hosts than GPUs or uneven hosts: one line and exit 2, before the run is read."""
    from dflash.plan.cli import main

    assert main([str(tmp_path / "no-run-read"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_plan_refuses_gpu_counts_below_one(tmp_path, capsys):
    from dflash.plan.cli import main

    for n in ("0", "-2"):
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path), "--gpus", n])
        assert e.value.code == 2 and f"argument --gpus: {n} must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--gpu-mem", "--net-gbps", "--target-tok-s", "--drafter-tok-s", "--coloc",
                                    "--window"])
@pytest.mark.parametrize("value", ["inf", "nan", "1e999"])
def test_plan_refuses_numbers_that_are_not_finite(tmp_path, capsys, option, value):
    """Regression: --gpu-mem inf, --net-gbps inf (and the other rates; 1e999 reads as inf) passed
    the "> 0" check and were planned with. Invariant: a value that is not a finite number is
    refused by argparse with one line and exit 2, before the run is read."""
    from dflash.plan.cli import main

    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "no-run-read"), "--gpus", "2", option, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert line == f"python -m dflash.plan: error: argument {option}: {value} must be a finite number > 0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal of a CUDA device on a machine without one")
def test_regenerate_refuses_a_cuda_device_this_machine_lacks(tmp_path, capsys):
    from dflash.regenerate import main

    rc = main([str(ROOT / "examples" / "dflash-tiny.toml"), "-o", str(tmp_path / "r.jsonl"),
               "--num-conversations", "2", "--device", "cuda"])
    err = capsys.readouterr().err
    assert rc == 2 and "--device cuda: this machine has 0 CUDA device(s); use --device cpu" in err
    assert "Traceback" not in err


def test_plot_refuses_a_dpi_it_cannot_render(tmp_path, capsys):
    from dflash.observe.plot import MAX_DPI, main

    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--dpi", "100000"])
    assert e.value.code == 2 and f"--dpi must be in 1..{MAX_DPI}, got 100000" in capsys.readouterr().err


def test_eval_refuses_sampling_options_without_a_temperature(tmp_path, capsys):
    from dflash.eval.cli import main

    for extra in (["--top-p", "0.5"], ["--top-k", "3"]):
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path), "--data", "sharegpt", *extra])
        assert e.value.code == 2 and "give --temperature > 0 with them" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal of fp8 on a machine without CUDA")
def test_eval_target_quantization_fp8_refused_off_cuda_and_none_decodes(tiny_run, capsys):  # noqa: F811
    """--target-quantization swaps the target's weights for the decode: fp8 needs CUDA (one line,
    exit 2, after the drafter loaded but before any decode); none decodes the bf16/fp32 target."""
    import json

    from dflash.eval.cli import main

    ck = max((tiny_run / "checkpoints").glob("step_*"))
    base = [str(ck), "--data", "sharegpt", "--num-prompts", "1", "--max-new-tokens", "4", "--device", "cpu"]
    assert main([*base, "--target-quantization", "fp8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--target-quantization fp8: " in err and "Traceback" not in err
    assert "torchao" in err or "CUDA" in err
    assert main([*base, "--target-quantization", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tau"] >= 1.0


def test_eval_names_the_data_argument_it_cannot_find(tiny_run, tmp_path, capsys, monkeypatch):  # noqa: F811
    """An unknown --data source is refused in the words the user typed (``--data nosuch``, not the
    config key data.source), with what --data takes, before any model is loaded."""
    from dflash.checkpoint import list_checkpoints
    from dflash.eval.cli import main

    monkeypatch.chdir(tmp_path)
    ckpt = list_checkpoints(tiny_run / "checkpoints")[-1]
    assert main([str(ckpt), "--data", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "data.source" not in err, err
    assert err.startswith("dflash.eval: --data nosuch: no such file (resolved to ")
    assert "--data takes 'sharegpt' or a path to a .json/.jsonl file" in err


def test_eval_finds_the_target_from_another_directory(tiny_run, tmp_path, capsys, monkeypatch):  # noqa: F811
    """A checkpoint records target.path relative to where training started; dflash.eval run from
    elsewhere still finds it (here: the shipped target, through the installed package), instead of
    a FileNotFoundError traceback."""
    import json

    from dflash.eval.cli import main

    monkeypatch.chdir(tmp_path)
    ck = max((tiny_run / "checkpoints").glob("step_*"))
    assert main([str(ck), "--data", "sharegpt", "--num-prompts", "1", "--max-new-tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tau"] >= 1.0


def test_locate_target_looks_above_the_checkpoint_then_fails_in_one_line(tmp_path, monkeypatch):
    from dflash.checkpoint.model_files import locate_target
    from dflash.model.target import TargetConfig

    (tmp_path / "proj" / "models" / "t").mkdir(parents=True)
    ck = tmp_path / "proj" / "runs" / "r" / "checkpoints" / "step_00000001"
    ck.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # not where training started
    tc = locate_target(TargetConfig(path="models/t", tokenizer="builtin:tiny"), ck)
    assert tc.path == str(tmp_path / "proj" / "models" / "t") and tc.tokenizer == "builtin:tiny"
    assert locate_target(TargetConfig(path="models/absent"), ck).path == "models/absent"  # the loader's error


def test_non_utf8_graph_and_prompt_files_are_one_line(tiny_run, tmp_path, capsys):  # noqa: F811
    from dflash.eval.cli import main as eval_main
    from dflash.run.cli import main as run_main

    bad = tmp_path / "g.toml"
    bad.write_bytes(b"\xff\xfe garbage")
    assert run_main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not a UTF-8 text file" in err and "Traceback" not in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "\xff"}\n')
    ck = max((tiny_run / "checkpoints").glob("step_*"))
    assert eval_main([str(ck), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompts" in err and "not a UTF-8 text file" in err


def test_a_graph_without_a_drafter_process_is_refused_before_any_work(tmp_path, capsys):
    """A graph file cut off before its [[channel]] / [[process]] tables used to 'complete' with
    exit 0 and 0 steps; it is refused in one line naming what is missing."""
    from dflash.run.cli import main

    text = (ROOT / "examples" / "dflash-tiny.toml").read_text()
    cut = tmp_path / "cut.toml"
    cut.write_text(text[:text.index("[[channel]]")].replace('"../dflash/assets', f'"{ROOT}/dflash/assets'))
    assert main([str(cut), "--set", f"run.out_dir={tmp_path / 'o'}", "--set", "run.steps=2"]) == 2
    err = capsys.readouterr().err
    assert "no process of kind 'dflash.drafter'" in err and "Traceback" not in err
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_eval_and_regenerate_refuse_a_temperature_that_is_not_finite(value, tmp_path, capsys):
    """T = inf samples uniformly (a meaningless acceptance figure); T = nan was recorded in the
    regenerated file's meta.json as NaN, which then refused the identical command's resume."""
    from dflash.eval.cli import main as eval_main
    from dflash.regenerate import main as regen_main

    with pytest.raises(SystemExit) as e:
        eval_main([str(tmp_path), "--data", "sharegpt", "--temperature", value])
    assert e.value.code == 2 and "--temperature must be a finite number >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        regen_main([str(ROOT / "examples" / "dflash-tiny.toml"), "-o", str(tmp_path / "r.jsonl"),
                    "--temperature", value])
    assert e.value.code == 2 and "--temperature must be a finite number >= 0" in capsys.readouterr().err
    assert not (tmp_path / "r.jsonl").exists()


def test_eval_decodes_exactly_the_prompts_asked_or_says_how_many_exist(tiny_run, tmp_path, capsys):  # noqa: F811
    """Regression: dflash.eval decoded fewer prompts than --num-prompts without saying so.
    Invariant: --num-prompts N decodes exactly N, or stops with one line naming how many exist
    (exit 2); left out, a --prompts set is decoded whole (--data's default of 8 is tested in
    tests/dflash/eval)."""
    import json

    from dflash.eval.cli import main

    ck = max((tiny_run / "checkpoints").glob("step_*"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Name a colour."}\n{"prompt": "Name a fruit."}\n')
    base = [str(ck), "--prompts", str(prompts), "--max-new-tokens", "4", "--device", "cpu", "--json"]
    assert main([*base, "--num-prompts", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--num-prompts 5 asked, but --prompts {prompts} holds 2 prompts" in err
    assert main([*base, "--num-prompts", "1", "--no-speedup"]) == 0
    assert len(json.loads(capsys.readouterr().out)["per_prompt"]) == 1
    assert main([*base, "--no-speedup", "--quiet"]) == 0  # a --prompts set is decoded whole by default
    out = capsys.readouterr()
    assert len(json.loads(out.out)["per_prompt"]) == 2 and out.err == ""


def test_eval_last_turn_prompts_need_the_runs_held_out_conversations(tiny_run, tmp_path, capsys):  # noqa: F811
    """--prompt-turn last reads the run's held-out conversations (the context before each one's
    last turn): with any other prompts it is refused in one line, before a model loads; with them
    it decodes and the header says which context each prompt is."""
    import json

    from dflash.eval.cli import main

    ck = max((tiny_run / "checkpoints").glob("step_*"))
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}]}) + "\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name a colour."}) + "\n")
    for source in (["--data", str(other)], ["--prompts", str(prompts)]):
        assert main([str(ck), *source, "--prompt-turn", "last", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--prompt-turn last needs the run's held-out conversations" in err, err
    args = [str(ck), "--data", "sharegpt", "--num-prompts", "2", "--max-new-tokens", "4", "--device", "cpu",
            "--no-speedup"]
    assert main([*args, "--prompt-turn", "last"]) == 0
    assert "each the context before its last assistant turn" in capsys.readouterr().err
