"""Readers of a checkpoint's weights outside resume (dflash.eval, dflash.export) apply one health rule:
a checkpoint marked ``healthy: false`` or holding NaN/Inf weights is refused with one line (exit 2)
naming what is wrong and the nearest healthy checkpoint, unless ``--allow-unhealthy`` (then a loud
WARNING line)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file

from dflash.checkpoint import Checkpointer, CheckpointError, mark_unhealthy, resolve_resume, step_dir
from dflash.checkpoint.health import META_UNREADABLE, nearest_healthy, reader_problem, scan_checkpoints
from dflash.checkpoint.model_files import config_files
from dflash.eval.cli import main as eval_main
from dflash.eval.inputs import check_checkpoint
from dflash.export import main as export_main
from tests.dflash.export.test_export import TCFG, make


def _run(tmp_path):
    """A run's checkpoints/: step 100 healthy, 200 with a NaN weight, 300 marked unhealthy."""
    d = make()
    root = tmp_path / "run" / "checkpoints"
    ck = Checkpointer(root, keep_last=5, config_hash="h")
    for step in (100, 200, 300):
        ck.save(step=step, batch_id=step, loss=1.0, weights=d.state_dict(),
                train_state={"step": step, "optimizer": {}, "scheduler": {}, "sampler": {}, "rng": {}},
                configs=config_files(d.cfg, TCFG))
        ck.wait()
    ck.close()
    w = load_file(str(step_dir(root, 200) / "model.safetensors"))
    w["fc.weight"][0, 0] = float("nan")
    save_file(w, str(step_dir(root, 200) / "model.safetensors"))
    mark_unhealthy(step_dir(root, 300), "the 4 steps after it were all non-finite")
    return root


def test_export_and_eval_refuse_unhealthy_checkpoints_naming_the_nearest_healthy_one(tmp_path, capsys):
    """Invariant: dflash.export and dflash.eval refuse (exit 2, one line, nothing exported) a
    checkpoint marked unhealthy and one with NaN weights, saying why and naming the nearest
    checkpoint that is healthy with finite weights; a healthy one passes silently."""
    root = _run(tmp_path)
    s100, s200, s300 = (step_dir(root, s) for s in (100, 200, 300))
    assert reader_problem(s100) is None
    assert "marked unhealthy (the 4 steps after it" in reader_problem(s300)
    assert reader_problem(s200) == "non-finite weights in model.safetensors (fc.weight)"
    assert nearest_healthy(s300) == s100 and nearest_healthy(s200) == s100

    assert export_main([str(s300), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is unhealthy: marked unhealthy" in err
    assert f"nearest healthy checkpoint: {s100}" in err and "--allow-unhealthy" in err
    assert not (tmp_path / "out").exists()

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert eval_main([str(s200), "--prompts", str(prompts), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "non-finite weights in model.safetensors (fc.weight)" in err
    assert f"nearest healthy checkpoint: {s100}" in err

    assert check_checkpoint(str(s100)) == s100
    assert capsys.readouterr().err == ""


def test_allow_unhealthy_reads_it_after_a_loud_line(tmp_path, capsys):
    """Invariant: --allow-unhealthy is the only way past the rule, and it says so on stderr."""
    root = _run(tmp_path)
    s300 = step_dir(root, 300)
    assert export_main([str(s300), "-o", str(tmp_path / "out"), "--dtype", "float32", "--allow-unhealthy"]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"WARNING: {s300} is UNHEALTHY: marked unhealthy")
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert check_checkpoint(str(step_dir(root, 200)), allow_unhealthy=True) == step_dir(root, 200)
    assert "UNHEALTHY: non-finite weights" in capsys.readouterr().err


def test_no_healthy_neighbour_is_said(tmp_path):
    """Invariant: when no sibling is healthy the refusal says so instead of naming one."""
    from dflash.eval.inputs import EvalInputError

    root = _run(tmp_path)
    mark_unhealthy(step_dir(root, 100), "suspect")
    with pytest.raises(EvalInputError, match=r"no healthy checkpoint beside it in .*checkpoints"):
        check_checkpoint(str(step_dir(root, 300)))


def test_a_torn_meta_json_is_refused_by_export_as_resume_refuses_it(tmp_path, capsys):
    """Invariant: a checkpoint whose meta.json exists but does not parse (a torn save) is not
    trusted by a reader either: export refuses it in one line naming meta.json; a checkpoint with
    no meta.json at all (weights and configs copied alone) is still judged by its tensors."""
    root = _run(tmp_path)
    s100 = step_dir(root, 100)
    (s100 / "meta.json").write_text("{bad")
    assert reader_problem(s100) == META_UNREADABLE
    assert export_main([str(s100), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "meta.json is unreadable" in err
    (s100 / "meta.json").unlink()
    assert reader_problem(s100) is None


@pytest.mark.parametrize("content", [b"[1, 2]", b"{}", b'{"step": 200, "batch_id": 200, "healthy": "no"}',
                                     b'{"step": "200", "healthy": true}', b'{"healthy": true}', b"\xff\xfe{}"],
                         ids=["list", "empty", "healthy-not-bool", "step-not-int", "no-step", "not-utf8"])
def test_a_damaged_meta_json_is_judged_alike_by_every_reader(tmp_path, capsys, content):
    """Invariant: a meta.json that is not a JSON object with a boolean ``healthy`` and an integer
    ``step`` is damaged for every reader: resume = "auto" passes over it to the previous
    checkpoint (as over a torn one), ``--resume PATH``, dflash.eval and dflash.export refuse it in
    one line (exit 2) naming meta.json unless --allow-unhealthy, dflash.logs lists it as damaged.
    Regression: a JSON list crashed all four (AttributeError: 'list' object has no attribute
    'get'), and ``{}`` or ``{"healthy": "no"}`` were evaluated and exported without a word."""
    d = make()
    run = tmp_path / "run"
    root = run / "checkpoints"
    ck = Checkpointer(root, keep_last=5, config_hash="h")
    for step in (100, 200):
        ck.save(step=step, batch_id=step, loss=1.0, weights=d.state_dict(),
                train_state={"step": step, "optimizer": {}, "scheduler": {}, "sampler": {}, "rng": {}},
                configs=config_files(d.cfg, TCFG))
        ck.wait()
    ck.close()
    s100, s200 = step_dir(root, 100), step_dir(root, 200)
    (s200 / "meta.json").write_bytes(content)

    assert resolve_resume(run, "auto") == s100
    with pytest.raises(CheckpointError, match="meta.json is missing or unreadable, or damaged"):
        resolve_resume(run, str(s200))
    assert reader_problem(s200) == META_UNREADABLE
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    for reader in (lambda: export_main([str(s200), "-o", str(tmp_path / "out")]),
                   lambda: eval_main([str(s200), "--prompts", str(prompts), "--device", "cpu"])):
        code, err = reader(), capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        assert "meta.json is unreadable or damaged" in err and f"nearest healthy checkpoint: {s100}" in err, err
    assert not (tmp_path / "out").exists()
    assert export_main([str(s200), "-o", str(tmp_path / "out"), "--dtype", "float32", "--allow-unhealthy"]) == 0
    assert capsys.readouterr().err.startswith(f"WARNING: {s200} is UNHEALTHY: meta.json is unreadable")
    info = {c.name: c for c in scan_checkpoints(run)}
    assert info[s200.name].problem == META_UNREADABLE and not info[s200.name].complete
    assert info[s100.name].auto_resume
