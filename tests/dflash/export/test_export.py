"""dflash.checkpoint.model_files + dflash.export: checkpoint round trip, public HF layout round trip, CLIs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflash.checkpoint.model_files import load_drafter
from dflash.export import export_drafter, load_exported
from dflash.export import main as export_main
from dflash.export.about import ExportInfo, MeasuredTau, TargetInfo
from dflash.model.attention import training_layout
from dflash.model.drafter import DFlashDrafter, DrafterConfig, resolve_drafter_config
from dflash.model.target import TargetConfig
from tests.helpers import save_checkpoint

TCFG = TargetConfig(preset="tiny", seed=4, vocab_size=4096, tokenizer="builtin:tiny")

ABOUT = ExportInfo(
    target=TargetInfo(name_or_path="models/Qwen3-tiny", model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                      num_hidden_layers=6, hidden_size=128, vocab_size=4096),
    measured=MeasuredTau(tau=2.5, accepted=1.5, step=300, prompts=8, max_new_tokens=64, verify_steps=205,
                         prompt_source="the run's first 8 held-out conversations of sharegpt (never trained on)",
                         decoder="greedy draft-and-verify against the target at block size 4, float32"))
"""The target and measured tau the CLI writes beside the public keys (``dflash_target``,
``dflash_eval``): the interop tests export with them, so every peer's loader reads a config.json
that has them."""


def make(types=None):
    dc = DrafterConfig(num_layers=2, block_size=4, mask_token_id=4095, layer_types=types,
                       sliding_window=8 if types else None)
    return DFlashDrafter(resolve_drafter_config(dc, TCFG), seed=3).eval()


def outputs(d):
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 12, 2 * 128, generator=g)
    emb = torch.randn(1, 2, 4, 128, generator=g)
    pos = torch.arange(12)[None]
    with torch.no_grad():
        return d(feats, emb, training_layout(pos, torch.zeros_like(pos), torch.tensor([[3, 7]]), 4))


def test_checkpoint_round_trip(tmp_path):
    d = make()
    save_checkpoint(tmp_path, d, d.cfg, TCFG)
    d2, dc, tc = load_drafter(tmp_path)
    assert dc == d.cfg and tc == TCFG
    torch.testing.assert_close(outputs(d2), outputs(d), rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="drafter_config.json"):
        load_drafter(tmp_path / "nope")


def test_drafter_config_json_has_no_num_anchors_and_an_old_one_still_loads(tmp_path):
    """Invariant: num_anchors is a training-sampling setting, so a saved
    drafter_config.json does not carry it; a checkpoint written before the move (its
    drafter_config.json has "num_anchors") still loads, the key dropped, weights unchanged."""
    d, ck = make(), tmp_path / "ckpt"
    ck.mkdir()
    save_checkpoint(ck, d, d.cfg, TCFG)
    saved = json.loads((ck / "drafter_config.json").read_text())
    assert "num_anchors" not in saved and saved["block_size"] == 4
    (ck / "drafter_config.json").write_text(json.dumps({**saved, "num_anchors": 64}))
    d2, dc, _ = load_drafter(ck)
    assert dc == d.cfg
    torch.testing.assert_close(outputs(d2), outputs(d), rtol=0, atol=0)
    out = tmp_path / "exported"
    assert export_main([str(ck), "-o", str(out)]) == 0   # export reads it the same way
    assert "num_anchors" not in (out / "config.json").read_text()


@pytest.mark.parametrize("types", [None, ["sliding_attention", "full_attention"]])
def test_export_public_layout_round_trip(tmp_path, types):
    d = make(types)
    export_drafter(d, tmp_path, torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 4 and cfg["num_hidden_layers"] == 2
    assert cfg["dflash_config"] == {"block_size": 4, "mask_token_id": 4095,
                                    "target_layer_ids": d.cfg.target_layer_ids}
    assert cfg["num_target_layers"] == 6 and cfg["hidden_size"] == 128
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == set(d.state_dict()) and "fc.weight" in names and "hidden_norm.weight" in names
    assert "layers.1.self_attn.q_proj.weight" in names and not any("embed" in n for n in names)
    back, bcfg = load_exported(tmp_path)
    assert bcfg.types == d.cfg.types and bcfg.target_layer_ids == d.cfg.target_layer_ids
    torch.testing.assert_close(outputs(back), outputs(d), rtol=0, atol=0)


def test_export_cli_writes_bf16(tmp_path, capsys):
    d = make()
    ck = tmp_path / "ckpt"
    ck.mkdir()
    save_checkpoint(ck, d, d.cfg, TCFG)
    assert export_main([str(ck), "-o", str(tmp_path / "hf")]) == 0
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert export_main([str(tmp_path / "missing"), "-o", str(tmp_path / "x")]) == 2
    assert "missing" in capsys.readouterr().err


def test_eval_cli_on_a_checkpoint(tmp_path, capsys):
    from dflash.eval.cli import main as eval_main

    d = make()
    save_checkpoint(tmp_path, d, d.cfg, TCFG)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"prompt": "what is two plus two?"}\n')
    assert eval_main([str(tmp_path), "--prompts", str(prompts), "--max-new-tokens", "6",
                      "--device", "cpu", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["per_prompt"]) == 2 and res["tau"] == pytest.approx(res["mean_accepted"] + 1)


def test_eval_of_a_flex_trained_checkpoint_decodes_as_sdpa(tmp_path, capsys):
    """A run trained with flex_attention (drafter and target; CUDA-only for training) evaluates on
    any device: eval decodes with sdpa, and its numbers equal those of the sdpa checkpoint."""
    import msgspec

    from dflash.eval.cli import main as eval_main

    d = make()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"prompt": "what is two plus two?"}\n')
    results = []
    for impl in ("sdpa", "flex_attention"):
        ck = tmp_path / impl
        ck.mkdir()
        save_checkpoint(ck, d, msgspec.structs.replace(d.cfg, attn_implementation=impl),
                     msgspec.structs.replace(TCFG, attn_implementation=impl))
        assert eval_main([str(ck), "--prompts", str(prompts), "--max-new-tokens", "6",
                          "--device", "cpu", "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    sdpa, flex = results
    assert flex["per_prompt"] == sdpa["per_prompt"] and flex["tau"] == sdpa["tau"]


def test_export_cli_refuses_to_overwrite(tmp_path, capsys):
    """Regression: ``export CKPT -o CKPT`` overwrote the checkpoint's weights. Invariant: export
    never writes into a checkpoint, the input, a file path, or (without --force) a non-empty dir;
    what it writes has the usual permissions."""
    import os
    import stat

    d = make()
    ck = tmp_path / "ckpt"
    ck.mkdir()
    save_checkpoint(ck, d, d.cfg, TCFG)
    before = (ck / "model.safetensors").read_bytes()
    other = tmp_path / "other_ckpt"
    other.mkdir()
    (other / "meta.json").write_text("{}")
    (tmp_path / "afile").write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("keep")
    for out, words in [(ck, "is the checkpoint"), (other, "training checkpoint"),
                       (tmp_path / "afile", "is a file"), (full, "not empty")]:
        assert export_main([str(ck), "-o", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err
    assert (ck / "model.safetensors").read_bytes() == before
    assert export_main([str(ck), "-o", str(full), "--force"]) == 0
    assert (full / "notes.txt").read_text() == "keep"
    umask = os.umask(0)
    os.umask(umask)
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((full / name).stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("force", [False, True])
def test_a_second_export_into_the_same_new_directory_is_refused(tmp_path, capsys, monkeypatch, force):
    """Regression (tester): two concurrent ``dflash.export CKPT -o NEW`` both succeeded, the later
    one silently replacing the first's files. Simulated race: the first export finishes while the
    second writes its temporary directory. Invariant: without --force the second fails with one
    line (exit 2) and the first's files are left intact, no temporary directory left behind; with
    --force it overwrites, as --force says."""
    from dflash.export import write as export  # model_card is looked up there at write time

    d = make()
    ck = tmp_path / "ckpt"
    ck.mkdir()
    save_checkpoint(ck, d, d.cfg, TCFG)
    out = tmp_path / "new"
    card = export.model_card

    def first_export_finishes_meanwhile(cfg, dtype, *more):  # called after check_output, before the move
        monkeypatch.setattr(export, "model_card", card)
        assert export_main([str(ck), "-o", str(out), "--dtype", "float32"]) == 0
        return card(cfg, dtype, *more)

    monkeypatch.setattr(export, "model_card", first_export_finishes_meanwhile)
    args = [str(ck), "-o", str(out), "--dtype", "bfloat16"] + (["--force"] if force else [])
    capsys.readouterr()
    rc = export_main(args)
    captured = capsys.readouterr()
    dtype = json.loads((out / "config.json").read_text())["dtype"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "new"]  # no .new.tmp-* left
    if force:
        assert rc == 0 and dtype == "bfloat16"
        return
    err = captured.err.strip()
    assert rc == 2 and "\n" not in err and "Traceback" not in err, err
    assert f"-o {out} was filled by another writer" in err and "--force" in err, err
    assert dtype == "float32" and sorted(p.name for p in out.iterdir()) == sorted(export.EXPORT_FILES)
    weights = load_exported(out)[0].state_dict()  # loads: the first export is whole
    assert weights.keys() == make().state_dict().keys()


def test_export_warns_when_the_target_last_layer_is_captured(tmp_path, capsys):
    """Invariant: exporting a drafter whose target_layer_ids include the target's last layer
    (which the vLLM speculators converter rejects) warns, naming the ids; the export still
    happens, and a drafter on the public [1, L-3] layers exports without a warning."""
    import warnings

    from dflash.export import LastLayerWarning

    dc = DrafterConfig(num_layers=2, block_size=4, mask_token_id=4095)
    tcfg = TargetConfig(**{**{f: getattr(TCFG, f) for f in TCFG.__struct_fields__}, "layer_ids": [1, 5]})
    d = DFlashDrafter(resolve_drafter_config(dc, tcfg), seed=3).eval()
    assert d.cfg.target_layer_ids == [1, 5] and d.cfg.num_target_layers == 6
    with pytest.warns(LastLayerWarning, match=r"\[1, 5\].*last layer"):
        export_drafter(d, tmp_path / "api", torch.float32)
    ck = tmp_path / "ckpt"
    ck.mkdir()
    save_checkpoint(ck, d, d.cfg, tcfg)
    assert export_main([str(ck), "-o", str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dflash.export: warning: target_layer_ids [1, 5]" in err
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_drafter(make(), tmp_path / "ok", torch.float32)      # default layers [1, 3]


@pytest.mark.parametrize("damage", ["torn_weights", "wrong_weights", "bad_config"])
def test_a_damaged_checkpoint_is_one_line_exit_2_in_eval_and_export(tmp_path, capsys, damage):
    """Regression (fresh-user run): a truncated model.safetensors made dflash.eval and
    dflash.export print a SafetensorError traceback (exit 1). Invariant: a damaged checkpoint is
    one line naming the file, exit 2, and nothing is written."""
    from safetensors.torch import save_file

    from dflash.eval.cli import main as eval_main

    d = make()
    ck = tmp_path / "ckpt"
    ck.mkdir()
    save_checkpoint(ck, d, d.cfg, TCFG)
    if damage == "torn_weights":
        (ck / "model.safetensors").write_bytes((ck / "model.safetensors").read_bytes()[:1000])
    elif damage == "wrong_weights":
        save_file({"fc.weight": torch.zeros(2, 2)}, str(ck / "model.safetensors"))
    else:
        (ck / "drafter_config.json").write_text('{"num_layers": "two"}')
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    want = "drafter_config.json" if damage == "bad_config" else "model.safetensors"
    for run in (lambda: eval_main([str(ck), "--prompts", str(prompts), "--device", "cpu"]),
                lambda: export_main([str(ck), "-o", str(tmp_path / "out")])):
        assert run() == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "Traceback" not in err and "damaged" in err, err
        assert want in err, err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_export_of_a_run_directory_names_its_checkpoints(tmp_path, capsys):
    """Regression (fresh-user run): ``dflash.export RUN_DIR -o OUT`` said only "drafter_config.json
    is missing". Invariant: it says, as dflash.eval does, that RUN_DIR is a run directory and names
    one of its checkpoints; exit 2, one line, nothing written.
    Regression (tester): an empty or interrupted newer ``step_*`` directory was the one suggested;
    the example is the newest complete, healthy one, or the line says there is none."""
    import shutil
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "runs" / "dflash_run" / "checkpoints"
    run = tmp_path / "run"
    ck = run / "checkpoints" / "step_00000050"
    shutil.copytree(fixture / "step_00000050", ck)
    d = make()
    (run / "checkpoints" / "step_00000098").mkdir()
    save_checkpoint(run / "checkpoints" / "step_00000098", d, d.cfg, TCFG)  # weights, no meta.json
    (run / "checkpoints" / "step_00000099").mkdir()  # empty: an interrupted save
    assert export_main([str(run), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is a run directory; give one of its checkpoints" in err, err
    assert f"e.g. {ck}" in err and "step_00000098" not in err and "step_00000099" not in err, err
    assert not (tmp_path / "out").exists()
    shutil.rmtree(ck)
    assert export_main([str(run), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "holds no complete, healthy checkpoint" in err, err
    assert "e.g." not in err and "step_00000099" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_eval_of_a_prompts_file_without_prompt_lines_names_the_file(tmp_path, capsys, text):
    """Regression (fresh-user run): an empty --prompts file said "every conversation opens with an
    assistant turn" (which is about --data), after loading both models. Invariant: one line naming
    the file and saying it has no prompt lines, exit 2."""
    from dflash.eval.cli import main as eval_main

    d = make()
    save_checkpoint(tmp_path, d, d.cfg, TCFG)
    prompts = tmp_path / "empty.jsonl"
    prompts.write_text(text)
    assert eval_main([str(tmp_path), "--prompts", str(prompts), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f'dflash.eval: --prompts {prompts} has no prompt lines; write one '
                   '{"prompt": "..."} object per line'), err


def test_export_to_an_unwritable_or_empty_output_names_it(tmp_path, capsys):
    """Regression (tester): ``-o /proc/nope`` printed ``[Errno 2] ... '/proc/.nope.tmp-XXXX'`` (an
    internal temp path, nothing to change), and ``-o ""`` said ``-o  is not empty`` (taken as the
    current directory). Invariant: one line, exit 2, naming the -o the user gave and what is wrong."""
    d = make()
    ck = tmp_path / "ckpt"
    ck.mkdir()
    save_checkpoint(ck, d, d.cfg, TCFG)
    assert export_main([str(ck), "-o", "/proc/nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and ".tmp-" not in err, err
    assert "-o /proc/nope: cannot create or write the export there" in err, err
    assert export_main([str(ck), "-o", ""]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "-o is an empty path" in err and "not empty" not in err, err
