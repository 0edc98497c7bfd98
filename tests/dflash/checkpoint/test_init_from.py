"""``[train].init_from``: a fresh run's drafter starts from the weights of a checkpoint or an export
of one (fresh optimizer and schedule); a drafter of another shape or a missing path is one line
before any data work; a run that resumes its own checkpoint ignores it.

Real runs of the default graph, shrunk as tests/dflash/run/test_run_e2e.py shrinks them (a few
seconds each on CPU), sharing one source run and its tokenized-data cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.checkpoint import list_checkpoints
from dflash.checkpoint.init_from import (
    check_init_from,
    init_from_config,
    load_init_from,
)
from dflash.errors import ConfigError
from dflash.export.cli import main as export_main
from dflash.model.drafter import DFlashDrafter
from dflash.run.cli import main
from dflash.run.config import load_config
from dflash.run.stages.trainer import DrafterStage
from tests.dflash.run.test_run_e2e import cache_dir, records, small  # noqa: F401 - cache_dir: the fixture

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def source(tmp_path_factory, cache_dir) -> Path:  # noqa: F811 - the imported fixture
    """A tiny run trained 4 steps: its checkpoint step_00000004 is what the warm starts start from."""
    run = tmp_path_factory.mktemp("source") / "run"
    assert main(small(run, cache_dir, steps=4)) == 0
    (ckpt,) = list_checkpoints(run / "checkpoints")
    return ckpt


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory) -> Path:
    """``python -m dflash.export`` of the source checkpoint, in float32 (the weights exactly)."""
    out = tmp_path_factory.mktemp("export") / "drafter"
    assert export_main([str(source), "-o", str(out), "--dtype", "float32"]) == 0
    return out


@pytest.fixture
def setup_weights(monkeypatch) -> list[dict[str, torch.Tensor]]:
    """The drafter's weights right after each DrafterStage.setup, before its first step."""
    seen: list[dict[str, torch.Tensor]] = []
    original = DrafterStage.setup

    def setup(self):
        original(self)
        seen.append({k: v.detach().clone().cpu() for k, v in self.drafter.state_dict().items()})

    monkeypatch.setattr(DrafterStage, "setup", setup)
    return seen


@pytest.fixture
def no_data_work(monkeypatch):
    import dflash.data

    monkeypatch.setattr(dflash.data, "load_dataset", lambda *a, **k: pytest.fail("data work before the check"))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert got[k].dtype == torch.float32, k
        assert torch.equal(got[k], t.float()), k


def lrs(run: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in records(run, "train")}


def test_a_fresh_run_starts_from_a_checkpoints_weights_with_a_fresh_schedule(tmp_path, cache_dir, source,  # noqa: F811
                                                                             setup_weights):
    """Invariant: with train.init_from = a checkpoint, the drafter holds exactly the checkpoint's
    weights (every tensor, fp32) before its first step, the run counts from step 1 with the
    schedule's first lr (not the source's step 5), and the log says how many tensors came."""
    run = tmp_path / "run"
    assert main(small(run, cache_dir, f"train.init_from={json.dumps(str(source))}", steps=2)) == 0
    (got,) = setup_weights
    want = load_file(str(source / "model.safetensors"))
    assert_same(got, want)
    fresh = DFlashDrafter(init_from_config(source), seed=0).state_dict()  # the run's own seeded init
    assert any(not torch.equal(fresh[k], want[k]) for k in want)
    assert sorted(lrs(run)) == [1, 2]
    assert lrs(run)[1] == lrs(source.parent.parent)[1]  # warmup starts again
    assert f"init_from {source}: {len(want)} tensors" in (run / "run.log").read_text()


def test_a_fresh_run_starts_from_an_exported_drafter(tmp_path, cache_dir, source, exported, setup_weights):  # noqa: F811
    """Invariant: a ``python -m dflash.export`` directory (config.json, public names) of the
    checkpoint gives the same start as the checkpoint itself."""
    run = tmp_path / "run"
    assert main(small(run, cache_dir, f"train.init_from={json.dumps(str(exported))}", steps=1)) == 0
    (got,) = setup_weights
    assert_same(got, load_file(str(source / "model.safetensors")))


def test_a_bfloat16_export_loads_as_its_values_in_fp32(tmp_path, source):
    """Invariant: an export in bfloat16 (the CLI's default) is loaded strictly, every tensor
    widened to the fp32 master weights: the bf16 values exactly."""
    out = tmp_path / "bf16"
    assert export_main([str(source), "-o", str(out)]) == 0
    cfg = init_from_config(source)
    drafter = DFlashDrafter(cfg, seed=0)
    assert load_init_from(drafter, out) == len(drafter.state_dict())
    want = {k: t.to(torch.bfloat16) for k, t in load_file(str(source / "model.safetensors")).items()}
    assert_same(drafter.state_dict(), want)


def test_a_drafter_of_another_shape_is_one_line_before_any_data_work(tmp_path, cache_dir, source, exported,  # noqa: F811
                                                                     capsys, no_data_work):
    """Invariant: a checkpoint or an export of another drafter.num_layers is refused with one
    line naming train.init_from and the differing field, exit 2, before any data work and
    before the run directory is made."""
    for path in (source, exported):
        run = tmp_path / f"run-{path.name}"
        assert main(small(run, cache_dir, f"train.init_from={json.dumps(str(path))}", "drafter.num_layers=3")) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"train.init_from = {str(path)!r} holds a drafter of another architecture" in err, err
        assert "num_layers: init_from 1, config 3" in err, err
        assert not run.exists()


def test_a_missing_path_is_one_line_before_any_data_work(tmp_path, cache_dir, capsys, no_data_work):  # noqa: F811
    missing = tmp_path / "no-such-drafter"
    run = tmp_path / "run"
    assert main(small(run, cache_dir, f"train.init_from={json.dumps(str(missing))}")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"train.init_from = {str(missing)!r} does not exist" in err and "leave train.init_from out" in err, err
    assert not run.exists()


def test_a_checkpoint_of_the_runs_own_directory_is_refused_on_a_fresh_start(tmp_path, cache_dir, source,  # noqa: F811
                                                                             capsys, no_data_work):
    """Invariant: a checkpoint whose optimizer state is gone (no train_state.pt: not resumable)
    named as init_from of a fresh run in its own run directory is refused before any work, one
    line saying to copy it out: the fresh start would archive it before the drafter is built.
    Nothing is moved."""
    import shutil

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / source.name
    shutil.copytree(source, ckpt)
    (ckpt / "train_state.pt").unlink()
    assert main(small(run, cache_dir, f"train.init_from={json.dumps(str(ckpt))}")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"train.init_from = {str(ckpt)!r} is a checkpoint of this run's own directory" in err, err
    assert "copy it out of run.out_dir" in err, err
    assert [p.name for p in (run / "checkpoints").iterdir()] == [source.name]


def test_a_resume_of_the_runs_own_checkpoint_ignores_init_from(tmp_path, cache_dir, source, setup_weights):  # noqa: F811
    """Invariant: once the run has a checkpoint of its own, resume continues it: the weights are
    its checkpoint's, not init_from's, and the log says init_from is ignored. Even an init_from
    that is gone by then does not stop the resume."""
    run = tmp_path / "run"
    warm = f"train.init_from={json.dumps(str(source))}"
    assert main(small(run, cache_dir, warm, steps=2)) == 0
    (own,) = list_checkpoints(run / "checkpoints")
    ours = load_file(str(own / "model.safetensors"))
    setup_weights.clear()
    assert main(small(run, cache_dir, warm, steps=3)) == 0
    (got,) = setup_weights
    assert_same(got, ours)
    source_weights = load_file(str(source / "model.safetensors"))
    assert any(not torch.equal(got[k], source_weights[k]) for k in got)
    assert records(run, "resume")[-1]["step"] == 2
    assert f"init_from {source} ignored: resuming {own}" in (run / "run.log").read_text()
    gone = f"train.init_from={json.dumps(str(tmp_path / 'moved-away'))}"
    assert main(small(run, cache_dir, gone, steps=4)) == 0
    assert records(run, "resume")[-1]["step"] == 3


# -- the check itself, without a run ---------------------------------------------------------------


@pytest.mark.parametrize("make, says", [
    (lambda d: d.write_text("x"), "is a file, not a directory"),
    (lambda d: d.mkdir(), ("is not a drafter directory (it holds none of drafter_config.json, config.json, "
                           "model.safetensors)")),
    (lambda d: (d.mkdir(), (d / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}'),
                (d / "model.safetensors").write_bytes(b"")),
     "holds no drafter: "),
    (lambda d: (d / "checkpoints").mkdir(parents=True), "is a run directory: give one of its checkpoints"),
], ids=["file", "empty", "target-model", "run-dir"])
def test_what_is_no_drafter_directory_is_named(tmp_path, source, make, says):
    path = tmp_path / "x"
    make(path)
    with pytest.raises(ConfigError) as exc:
        check_init_from(str(path), init_from_config(source))
    msg = str(exc.value)
    assert msg.startswith((f"train.init_from = {str(path)!r} ", f"train.init_from = {str(path)!r}:")), msg
    assert says in msg and "\n" not in msg, msg


def test_a_weights_file_that_disagrees_with_its_config_is_refused(tmp_path, exported, source):
    """Invariant: the tensors themselves are checked (from the file's header) against the run's
    drafter, not only the config beside them; and the loader refuses NaN weights."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((exported / "config.json").read_bytes())
    weights = load_file(str(exported / "model.safetensors"))
    dropped = min(weights)
    save_file({k: v for k, v in weights.items() if k != dropped}, str(bad / "model.safetensors"))
    cfg = init_from_config(source)
    with pytest.raises(ConfigError, match=rf"model.safetensors does not match this run's drafter \(missing {dropped}\)"):
        check_init_from(bad, cfg)
    weights[dropped] = torch.full_like(weights[dropped], float("nan"))
    save_file(weights, str(bad / "model.safetensors"))
    assert check_init_from(bad, cfg) == []
    with pytest.raises(ConfigError, match=rf"non-finite weights \({dropped}\)"):
        load_init_from(DFlashDrafter(cfg, seed=0), bad)


def test_other_target_layers_load_with_a_warning(source):
    """Invariant: a drafter trained on other target layers (same count, so the same shapes) is
    accepted with a warning naming both, not refused."""
    import msgspec

    cfg = init_from_config(source)
    other = msgspec.structs.replace(cfg, target_layer_ids=[cfg.target_layer_ids[0] - 1])
    (warning,) = check_init_from(source, other)
    assert f"trained on target layers {list(cfg.target_layer_ids)}, this run feeds {list(other.target_layer_ids)}" \
        in warning


def test_a_relative_path_in_the_graph_file_is_relative_to_the_file(tmp_path, monkeypatch):
    """Invariant: train.init_from is one of the path keys: written in the file it is read against
    the file's directory, from any current directory."""
    graph = tmp_path / "graphs" / "g.toml"
    graph.parent.mkdir()
    graph.write_text('[run]\nout_dir = "runs/x"\nsteps = 1\n[train]\ninit_from = "../drafters/mine"\n')
    monkeypatch.chdir(tmp_path)
    assert load_config(graph).train.init_from == "drafters/mine"
    assert load_config(graph, ["train.init_from=elsewhere"]).train.init_from == "elsewhere"


def test_a_zlab_dflash2_directory_loads_with_its_codebook_names(tmp_path):
    """Invariant: a DFlash2 drafter as z-lab's save_pretrained writes it (the selector codebooks
    under ``.weight``) passes the check and loads every tensor exactly under our bare names."""
    from dflash.export import export_drafter
    from tests.dflash.export.test_dflash2_export import make

    d = make()
    export_drafter(d, tmp_path, torch.float32)
    weights = load_file(str(tmp_path / "model.safetensors"))
    zlab = {k + ".weight" if k.endswith("_codebook") else k: t for k, t in weights.items()}
    assert zlab.keys() != weights.keys()
    save_file(zlab, str(tmp_path / "model.safetensors"))
    assert check_init_from(tmp_path, d.cfg) == []
    fresh = DFlashDrafter(d.cfg, seed=0)
    assert load_init_from(fresh, tmp_path) == len(weights)
    assert_same(fresh.state_dict(), d.state_dict())
