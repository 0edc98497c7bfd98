"""dflash.run.resolve: the one pure step from a validated graph file to the run's options.

It never changes its input, its result is frozen, the config hash of the filled file is the one
the code before resolve computed (checkpoints resume without a "config differs" warning), and
each cross-table mistake is one line with exit 2 from ``python -m dflash.run`` before any data
is read or any run directory is written."""

from __future__ import annotations

import re

import msgspec
import pytest

from dflash.data import TokenizerInfo, load_tokenizer, tokenizer_info
from dflash.errors import ConfigError, DFlashError
from dflash.run.cli import main
from dflash.run.config import load_config
from dflash.run.resolve import resolve
from tests.dflash.run.test_validate import no_data_work  # noqa: F401 - the fixture
from tests.dflash.run.test_run_e2e import GRAPH, small

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tiny_info() -> TokenizerInfo:
    cfg = load_config(GRAPH)
    return tokenizer_info(load_tokenizer(cfg.target.tokenizer or cfg.target.path))


def test_resolve_does_not_mutate_its_input_and_fills_a_copy(tiny_info):
    """Invariant: resolve leaves the file it is given exactly as it was (every table, compared as
    plain data) and returns the filled copy: mask token from the tokenizer, data.block_size =
    drafter.block_size, the drafter resolved against the target."""
    cfg = load_config(GRAPH, ["data.block_size=3"])
    before = msgspec.to_builtins(cfg)
    got = resolve(cfg, tiny_info)
    assert msgspec.to_builtins(cfg) == before
    assert cfg.drafter.mask_token_id is None and cfg.data.block_size == 3
    assert got.cfg.drafter.mask_token_id == tiny_info.mask_token_id
    assert got.cfg.data.block_size == got.cfg.drafter.block_size == 8
    assert got.drafter.hidden_size is not None and got.drafter.target_layer_ids == [4]
    assert got.prefetch.num_anchors == got.cfg.train.num_anchors == 64
    assert got.trainer.train_config is got.cfg and got.trainer.config_hash == got.config_hash


def test_resolve_fills_a_preset_targets_vocab_size_from_the_tokenizer():
    """Invariant: a preset target with no vocab_size takes the tokenizer's; the input keeps None."""
    from dflash.model.target import TargetConfig

    cfg = msgspec.structs.replace(load_config(GRAPH, ["drafter.mask_token_id=5"]),
                                  target=TargetConfig(preset="tiny"))
    info = TokenizerInfo(vocab_size=300, mask_token_id=None, pad_token_id=0, eos_token_id=None)
    got = resolve(cfg, info)
    assert cfg.target.vocab_size is None and got.cfg.target.vocab_size == 300 == got.drafter.vocab_size
    assert got.cfg.drafter.mask_token_id == 5


def test_resolved_and_every_stage_option_are_frozen(tiny_info):
    got = resolve(load_config(GRAPH), tiny_info)
    for obj, field in [(got, "cfg"), (got.prefetch, "seed"), (got.target, "need_final"),
                       (got.postprocess, "host_staging"), (got.trainer, "total_steps"), (got.monitor, "window")]:
        with pytest.raises(AttributeError):
            setattr(obj, field, getattr(obj, field))


def test_config_hash_is_the_one_computed_before_resolve(tiny_info):
    """Invariant: the hash of the filled file is byte-identical to the one dflash.run computed
    before num_anchors moved to [train] and resolve replaced the in-place filling (the values
    below were printed by commit 26e5e8b for the same files), so checkpoints of that code resume
    without a config-differs warning."""
    assert resolve(load_config(GRAPH), tiny_info).config_hash == "e6c695fd93800797"
    assert resolve(load_config(GRAPH, ["train.lr=1e-3", "run.seed=3"]), tiny_info).config_hash == "d703e1057de9cf20"
    assert resolve(load_config(GRAPH, ["train.num_anchors=32"]), tiny_info).config_hash != "e6c695fd93800797"


def test_no_mask_token_is_a_config_error_naming_the_key():
    cfg = load_config(GRAPH)
    with pytest.raises(ConfigError, match=r"^\[drafter\]\.mask_token_id is not set and the tokenizer has no mask "
                                          r"token: set drafter.mask_token_id"):
        resolve(cfg, TokenizerInfo(vocab_size=4096, mask_token_id=None, pad_token_id=0, eos_token_id=None))


def test_errors_form_one_family():
    from dflash.checkpoint import CheckpointError
    from dflash.data import DataError

    assert issubclass(ConfigError, DFlashError) and issubclass(DataError, DFlashError)
    assert issubclass(CheckpointError, DFlashError) and issubclass(DataError, ValueError)
    import dflash.errors

    assert dflash.errors.DataError is DataError and dflash.errors.CheckpointError is CheckpointError


def _no_mask_token(monkeypatch):
    import dflash.data

    real = dflash.data.tokenizer_info
    monkeypatch.setattr(dflash.data, "tokenizer_info",
                        lambda tok: msgspec.structs.replace(real(tok), mask_token_id=None))


CASES = [
    ("drafter.num_anchors=8", None,
     r"drafter.num_anchors is a training-sampling setting and has moved to \[train\]: rename it to "
     r"train.num_anchors"),
    ("process.drafter.replicas=2", None,
     r"process 'drafter' has replicas = 2: data-parallel drafters need one rank each; launch with torchrun"),
    ("train.warmup_steps=4", _no_mask_token,
     r"\[drafter\]\.mask_token_id is not set and the tokenizer has no mask token"),
    ("drafter.hidden_size=7", None, r"drafter.hidden_size = 7 must equal the target's hidden size 256"),
    # found by a new user: each of these trained (or failed at step 1) before
    ("drafter.vocab_size=100", None,
     r"drafter.vocab_size = 100 must equal the target's vocabulary size 4096 .*leave it unset"),
    ("drafter.target_layer_ids=[1,3]", None,
     r"drafter.target_layer_ids = \[1, 3\] is derived, not read .*set target.layer_ids = \[1, 3\] instead"),
    ("drafter.num_target_layers=3", None, r"drafter.num_target_layers = 3 is derived from the target"),
    ("drafter.mask_token_id=999999", None,
     r"drafter.mask_token_id = 999999 is outside the target's vocabulary \(0..4095\)"),
    ("drafter.block_size=4096", None,
     r"drafter.block_size = 4096 leaves no usable conversation: .* data.max_length = 256"),
]


@pytest.mark.parametrize("override, patch, message", CASES, ids=[c[0] for c in CASES])
def test_cross_table_errors_are_one_line_exit_2_before_data_or_run_dir(
        tmp_path, capsys, monkeypatch, no_data_work, override, patch, message):  # noqa: F811
    """Invariant: each mistake across tables (an old [drafter] key, drafter replicas without
    torchrun, no mask token, drafter vs target width) exits 2 with
    one plain line on stderr naming the key, and no data cache and no run directory exist."""
    if patch is not None:
        patch(monkeypatch)
    run, cache = tmp_path / "run", tmp_path / "cache"
    assert main(small(run, cache, override)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(message, err) and "Traceback" not in err, err
    assert not run.exists() and not cache.exists()


def test_resume_path_that_does_not_exist_is_one_line_exit_2_before_data(tmp_path, capsys, no_data_work):  # noqa: F811
    """``--resume PATH`` naming no directory is refused before the data is tokenized (it used to be
    found only after tokenizing) and before the run directory is created."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    assert main([*small(run, cache), "--resume", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --resume ") and "no such checkpoint directory" in err, err
    assert err.count("\n") == 1 and not run.exists() and not cache.exists()


def test_resume_given_a_run_directory_names_a_checkpoint_of_it_before_data(tmp_path, capsys, no_data_work):  # noqa: F811
    """Found by a new user: ``--resume RUN_DIR`` said "meta.json is missing" after the data was
    tokenized. Invariant: one line naming the run directory's newest usable checkpoint, exit 2, no data.
    Regression (tester): an empty or interrupted newer ``step_*`` directory was the one suggested;
    the example must be complete and healthy, or the line says there is none."""
    import shutil
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "runs" / "dflash_run" / "checkpoints"
    old_run = tmp_path / "old"
    shutil.copytree(fixture / "step_00000050", old_run / "checkpoints" / "step_00000050")
    (old_run / "checkpoints" / "step_00000098").mkdir()
    (old_run / "checkpoints" / "step_00000098" / "meta.json").write_text('{"step": 98}')  # no files
    (old_run / "checkpoints" / "step_00000099").mkdir()  # empty: an interrupted save
    run, cache = tmp_path / "run", tmp_path / "cache"
    assert main([*small(run, cache), "--resume", str(old_run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--resume {old_run} is a run directory" in err, err
    assert f"--resume {old_run / 'checkpoints' / 'step_00000050'}" in err and "--resume auto" in err, err
    assert "step_00000099" not in err and "step_00000098" not in err, err
    assert not run.exists() and not cache.exists()
    shutil.rmtree(old_run / "checkpoints" / "step_00000050")
    assert main([*small(run, cache), "--resume", str(old_run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no complete, healthy checkpoint" in err, err
    assert "e.g." not in err and "step_00000099" not in err and "--resume none" in err, err
    assert not run.exists() and not cache.exists()
