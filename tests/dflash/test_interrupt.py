"""Ctrl-C in ``python -m dflash.eval`` and ``python -m dflash.export``: one line, exit 130.

The subprocess cases send a real SIGINT from inside the child: a ``sitecustomize`` on its
PYTHONPATH adds an import hook that signals the process itself when a named module is first
imported (``torch``: the module-level imports, before ``main`` runs; ``transformers``: inside
``main``, while the models load). The decoding and writing cases raise KeyboardInterrupt from a
monkeypatched function in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.model.drafter import DFlashDrafter, DrafterConfig, resolve_drafter_config
from dflash.model.target import TargetConfig
from tests.helpers import save_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TCFG = TargetConfig(preset="tiny", seed=4, vocab_size=4096, tokenizer="builtin:tiny")
HOOK = '''
import os, signal, sys, time

class _SigintOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("SIGINT_ON_IMPORT"):
            os.environ.pop("SIGINT_ON_IMPORT")
            signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises KeyboardInterrupt here, as a Ctrl-C would
        return None

sys.meta_path.insert(0, _SigintOnImport())
'''


@pytest.fixture
def checkpoint(tmp_path):
    dc = DrafterConfig(num_layers=2, block_size=4, mask_token_id=4095)
    d = DFlashDrafter(resolve_drafter_config(dc, TCFG), seed=3).eval()
    ck = tmp_path / "ckpt"
    ck.mkdir()
    save_checkpoint(ck, d, d.cfg, TCFG)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello there"}\n')
    return ck


def _interrupted_run(tmp_path, module: str, args: list[str], on_import: str) -> subprocess.CompletedProcess:
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {**os.environ, "SIGINT_ON_IMPORT": on_import,
           "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("on_import", ["torch", "transformers"])
def test_ctrl_c_in_eval_is_one_line_exit_130(tmp_path, checkpoint, on_import):
    """Regression (fresh-user run): Ctrl-C while importing torch or loading the models printed a
    KeyboardInterrupt traceback. Invariant: one line on stderr saying nothing was written, exit 130."""
    proc = _interrupted_run(tmp_path, "dflash.eval",
                            [str(checkpoint), "--prompts", str(tmp_path / "p.jsonl"), "--device", "cpu"],
                            on_import)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == ("dflash.eval: interrupted (Ctrl-C); nothing was written "
                                   "(eval writes no files)"), proc.stderr
    assert proc.stdout == ""


def test_ctrl_c_while_decoding_is_one_line_exit_130(tmp_path, checkpoint, monkeypatch, capsys):
    import dflash.eval.cli as ev

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ev, "evaluate", interrupted)
    assert ev.main([str(checkpoint), "--prompts", str(tmp_path / "p.jsonl"), "--num-prompts", "1",
                    "--device", "cpu", "--quiet"]) == 130  # --quiet: the set's progress line aside
    out = capsys.readouterr()
    assert out.err.strip() == ev.INTERRUPTED and out.out == ""


def test_ctrl_c_in_export_is_one_line_exit_130_and_writes_nothing(tmp_path, checkpoint):
    """Regression (fresh-user run): Ctrl-C in dflash.export printed a traceback. Invariant: one
    line on stderr saying the output directory was not written, exit 130, no output directory."""
    out = tmp_path / "hf"
    proc = _interrupted_run(tmp_path, "dflash.export", [str(checkpoint), "-o", str(out)], "torch")
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == f"dflash.export: interrupted (Ctrl-C); nothing was written to {out}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hook", "p.jsonl"]  # no temporary


@pytest.mark.parametrize("existing", ["missing", "empty", "full"])
def test_an_export_interrupted_while_writing_leaves_the_output_as_it_was(tmp_path, checkpoint, monkeypatch,
                                                                        capsys, existing):
    """Invariant: export writes into a temporary sibling directory and renames it into place, so a
    Ctrl-C while the weights are written leaves -o as it was (absent, empty, or its old files)
    and no temporary directory behind; an uninterrupted export then succeeds."""
    import dflash.export as ex
    import dflash.export.write  # noqa: F401  (ex.write below: the package imports it lazily)

    out = tmp_path / "out"
    if existing != "missing":
        out.mkdir()
    if existing == "full":
        (out / "config.json").write_text("old")
    real_save = ex.write.save_file

    def interrupted(*args, **kwargs):
        real_save(*args, **kwargs)  # the weights file exists in the temporary directory
        raise KeyboardInterrupt

    monkeypatch.setattr(ex.write, "save_file", interrupted)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert ex.main([str(checkpoint), "-o", str(out), "--force"]) == 130
    err = capsys.readouterr().err.strip()
    assert err == f"dflash.export: interrupted (Ctrl-C); nothing was written to {out}"
    assert sorted(p.name for p in tmp_path.iterdir()) == before           # no temporary left
    if existing == "missing":
        assert not out.exists()
    else:
        assert sorted(p.name for p in out.iterdir()) == (["config.json"] if existing == "full" else [])
    if existing == "full":
        assert (out / "config.json").read_text() == "old"
    monkeypatch.setattr(ex.write, "save_file", real_save)
    assert ex.main([str(checkpoint), "-o", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(ex.EXPORT_FILES)  # the card README.md too


def test_ctrl_c_while_export_loads_the_checkpoint_writes_nothing(tmp_path, checkpoint, monkeypatch, capsys):
    import dflash.checkpoint.model_files
    import dflash.export as ex
    import dflash.export.write

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dflash.checkpoint.model_files, "load_drafter", interrupted)  # imported by each export
    assert ex.main([str(checkpoint), "-o", str(tmp_path / "out")]) == 130
    err = capsys.readouterr().err.strip()
    assert err == f"dflash.export: interrupted (Ctrl-C); nothing was written to {tmp_path / 'out'}"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("existing", ["missing", "full"])
def test_a_ctrl_c_while_the_files_move_into_place_is_held_until_they_all_are(tmp_path, checkpoint,
                                                                            monkeypatch, capsys, existing):
    """Invariant: a SIGINT that arrives while export moves its files into -o does not split the
    move: it is raised after, and the line says the export is complete."""
    import signal

    import dflash.export as ex

    out = tmp_path / "out"
    if existing == "full":
        out.mkdir()
        (out / "notes.txt").write_text("keep")
    real_replace = os.replace

    def replace_after_a_ctrl_c(src, dst):
        signal.raise_signal(signal.SIGINT)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_after_a_ctrl_c)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    assert ex.main([str(checkpoint), "-o", str(out), "--force"]) == 130
    monkeypatch.setattr(os, "replace", real_replace)
    assert signal.signal(signal.SIGINT, handler) is signal.default_int_handler  # restored by export
    assert capsys.readouterr().err.strip() == (f"dflash.export: interrupted (Ctrl-C) after the export "
                                               f"was written: {out} is complete")
    assert set(ex.EXPORT_FILES) <= {p.name for p in out.iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out", "p.jsonl"]
    assert ex.load_exported(out)[1].num_layers == 2
