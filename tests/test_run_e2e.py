"""End to end: ``python -m dflash.run`` on the default graph (examples/dflash-tiny.toml), shrunk.

Real ShareGPT rows, the real stages, checkpoints and resume, on CPU. Each run here takes a few
seconds; they share one tokenized-data cache.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import csp
from dflash.checkpoint import is_healthy, list_checkpoints, read_meta
from dflash.run import main
from dflash.stages.postprocess import PostprocessStage
from dflash.stages.target import TargetStage

ROOT = Path(__file__).resolve().parent.parent
GRAPH = str(ROOT / "examples" / "dflash-tiny.toml")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


def small(run_dir: Path, cache_dir: Path, *extra: str, steps: int = 8) -> list[str]:
    """The default graph, shrunk to seconds: few rows, short batches, one target replica, exact mode."""
    sets = [
        f"run.out_dir={run_dir}",
        f"run.steps={steps}",
        "run.deterministic=true",
        "data.max_samples=200",
        "data.max_length=256",
        "data.tokens_per_batch=512",
        "data.packed_rows=2",
        "data.num_workers=1",
        "data.holdout=4",
        f"data.cache_dir={cache_dir}",
        "drafter.num_anchors=8",
        "checkpoint.every=4",
        "checkpoint.keep_last=5",
        "monitor.window=1",
        "monitor.wandb=disabled",
        "monitor.display=plain",
        "monitor.plot=false",
        "trace.stats_interval_s=0.2",
        "process.target.replicas=1",
        *extra,
    ]
    return [GRAPH] + [a for s in sets for a in ("--set", s)]


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir, "train")}


def test_default_graph_trains_checkpoints_and_writes_observability(tmp_path, cache_dir):
    run = tmp_path / "run"
    assert main(small(run, cache_dir)) == 0
    assert sorted(losses(run)) == list(range(1, 9))
    assert all(r["window"] == 1 for r in records(run, "train"))
    names = [p.name for p in list_checkpoints(run / "checkpoints")]
    assert names == ["step_00000004", "step_00000008"]
    assert all(is_healthy(p) for p in list_checkpoints(run / "checkpoints"))
    assert read_meta(run / "checkpoints" / "step_00000008")["step"] == 8
    stats = [json.loads(x) for x in (run / "csp" / "stats.jsonl").read_text().splitlines()]
    assert stats[0]["kind"] == "header" and stats[-1]["kind"] == "final"
    assert set(stats[-1]["channels"]) == {"batches", "hidden", "features", "metrics"}
    assert (run / "csp" / "trace.json").is_file() and (run / "config.toml").is_file()


def test_resume_reproduces_the_uninterrupted_run_bitwise(tmp_path, cache_dir):
    """Exact resume (DESIGN failure mode 3): a run resumed from its step-4 checkpoint has the same
    step 5..8 losses and the same final weights as the run that was never interrupted."""
    full = tmp_path / "full"
    assert main(small(full, cache_dir)) == 0
    # The "interrupted" run: the same run directory as it was right after the step-4 checkpoint.
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step_00000008")
    kept = [r for r in map(json.loads, (part / "metrics.jsonl").read_text().splitlines())
            if r.get("step", 0) <= 4 and r["kind"] in ("train", "start")]
    (part / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert main(small(part, cache_dir)) == 0  # resume = "auto" picks step 4
    assert records(part, "resume")[0]["step"] == 4
    assert (part / "csp" / "stats.before-step-4.jsonl").is_file()  # the earlier segment's stats are kept
    assert losses(part) == losses(full)
    a = load_file(str(full / "checkpoints" / "step_00000008" / "model.safetensors"))
    b = load_file(str(part / "checkpoints" / "step_00000008" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_postprocess_side_is_a_switch_with_equal_results(tmp_path, cache_dir):
    """[train].postprocess_side = target | drafter: same features (noise included), same losses."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ("train.feature_noise=0.05", "checkpoint.every=0")
    assert main(small(a, cache_dir, *common, "train.postprocess_side=\"target\"", steps=4)) == 0
    assert main(small(b, cache_dir, *common, "train.postprocess_side=\"drafter\"", steps=4)) == 0
    assert losses(a) == losses(b)
    c = tmp_path / "c"  # and the noise is really applied: without it the losses differ
    assert main(small(c, cache_dir, "checkpoint.every=0", steps=4)) == 0
    assert losses(c) != losses(a)


def test_two_target_replicas_fan_in_in_batch_order(tmp_path, cache_dir):
    """With two target replicas the ordered fan-in restores batch order: same losses as one replica."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(small(one, cache_dir, steps=6)) == 0
    assert main(small(two, cache_dir, "process.target.replicas=2", steps=6)) == 0
    assert losses(one) == losses(two)


@csp.register("tests.nan_features")
class NaNFeatures(PostprocessStage):
    """Postprocess that poisons the features of the batch ids listed in $DFLASH_TEST_BAD_BATCHES."""

    def process(self, out):
        item = super().process(out)
        if item.batch.batch_id in set(json.loads(os.environ.get("DFLASH_TEST_BAD_BATCHES", "[]"))):
            item.features = torch.full_like(item.features, float("nan"))
        return item


@csp.register("tests.crashing_target")
class CrashingTarget(TargetStage):
    """A target replica that raises on its third batch."""

    def run(self, inputs, outputs):
        seen = 0
        for batch in inputs["batches"]:
            seen += 1
            if seen == 3:
                raise RuntimeError("injected target failure")
            outputs["hidden"].send(self.forward(batch), seq=batch.seq)


def test_nonfinite_step_is_skipped_counted_and_training_goes_on(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("DFLASH_TEST_BAD_BATCHES", "[2]")
    run = tmp_path / "run"
    assert main(small(run, cache_dir, "process.postprocess.kind=\"tests.nan_features\"", steps=6)) == 0
    skips = records(run, "skip")
    assert [(s["step"], s["batch_id"]) for s in skips] == [(3, 2)]
    assert "non-finite" in skips[0]["reason"]
    assert records(run, "train")[-1]["skipped_total"] == 1
    per_step = losses(run)
    assert sorted(per_step) == [1, 2, 3, 4, 5, 6]
    assert per_step[3] is None  # the skipped step's one-step window has no finite loss (JSON null)
    assert all(per_step[s] is not None for s in (1, 2, 4, 5, 6))
    assert all(is_healthy(p) for p in list_checkpoints(run / "checkpoints"))


def test_repeated_nonfinite_steps_stop_and_name_the_last_healthy_checkpoint(tmp_path, cache_dir, monkeypatch,
                                                                               capsys):
    monkeypatch.setenv("DFLASH_TEST_BAD_BATCHES", json.dumps(list(range(5, 100))))
    run = tmp_path / "run"
    code = main(small(run, cache_dir, "process.postprocess.kind=\"tests.nan_features\"",
                      "train.max_nonfinite_streak=2", steps=12))
    assert code == 1
    err = capsys.readouterr().err
    assert "consecutive non-finite steps" in err and "step_00000004" in err
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000004"]


def test_check_channels_names_the_first_producer_of_a_nan(tmp_path, cache_dir, monkeypatch, capsys):
    monkeypatch.setenv("DFLASH_TEST_BAD_BATCHES", "[1]")
    run = tmp_path / "run"
    code = main(small(run, cache_dir, "process.postprocess.kind=\"tests.nan_features\"",
                      "train.check_channels=true", steps=4))
    assert code == 1
    err = capsys.readouterr().err
    assert "postprocess[0]" in err and "'features'" in err and "batch 1" in err


def test_crash_in_a_stage_stops_cleanly_naming_it(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    code = main(small(run, cache_dir, "process.target.kind=\"tests.crashing_target\"", steps=8))
    assert code == 1
    err = capsys.readouterr().err
    assert "target[0]" in err and "injected target failure" in err
    assert all(is_healthy(p) for p in list_checkpoints(run / "checkpoints"))
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert records(run, "end")[0]["exit_code"] == 1


@pytest.mark.parametrize(
    "override, message",
    [
        ("run.stepz=3", "unknown field `stepz` - at `$.run`"),
        ("channel.batches.capacity=\"big\"", "Expected `int`"),
        ("data.source=\"/nonexistent/file.jsonl\"", "/nonexistent/file.jsonl"),
    ],
)
def test_bad_config_exits_2_with_a_clear_message(tmp_path, cache_dir, capsys, override, message):
    assert main(small(tmp_path / "run", cache_dir, override)) == 2
    assert message in capsys.readouterr().err


def test_ctrl_c_drains_writes_a_final_checkpoint_and_exits_130(tmp_path, cache_dir):
    """SIGINT mid-run: the graph drains, the drafter writes a checkpoint at the step it reached, exit
    code 130; then --resume auto finishes the run."""
    run = tmp_path / "run"
    args = small(run, cache_dir, "checkpoint.every=0", steps=400)
    proc = subprocess.Popen([sys.executable, "-m", "dflash.run", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if (run / "metrics.jsonl").exists() and len(records(run, "train")) >= 3:
                break
            if proc.poll() is not None:
                pytest.fail(f"run ended early:\n{proc.stdout.read()}")
            time.sleep(0.05)  # polling a file written by another process; not used for ordering
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "run summary: stopped by SIGINT after draining (exit 130)" in out  # names the signal
    assert "--resume auto" in out and "Ctrl-C" not in out.split("run summary:")[1]
    ckpts = list_checkpoints(run / "checkpoints")
    assert len(ckpts) == 1 and is_healthy(ckpts[0])
    stopped_at = read_meta(ckpts[0])["step"]
    assert 3 <= stopped_at < 400
    assert max(losses(run)) == stopped_at  # every trained step was logged before the exit
    assert main(small(run, cache_dir, "checkpoint.every=0", steps=stopped_at + 2)) == 0
    assert records(run, "resume")[-1]["step"] == stopped_at
    assert max(losses(run)) == stopped_at + 2


def test_graph_errors_come_before_any_work_or_write(tmp_path, cache_dir, capsys):
    """A bad graph is reported before tokenization and leaves the run directory untouched."""
    run = tmp_path / "run"
    assert main(small(run, cache_dir, "process.drafter.device=\"cuda:7\"")) == 2
    assert "cuda:7" in capsys.readouterr().err
    assert not run.exists()


def test_data_parallel_drafters_need_torchrun(tmp_path, cache_dir, capsys):
    assert main(small(tmp_path / "run", cache_dir, "process.drafter.replicas=2")) == 2
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err


def test_two_runs_cannot_share_a_run_directory(tmp_path, cache_dir, capsys):
    from dflash.run import acquire_run_lock

    run = tmp_path / "run"
    held = acquire_run_lock(run)  # as if another dflash.run were training there
    try:
        assert main(small(run, cache_dir)) == 2
        assert "in use by another dflash.run" in capsys.readouterr().err
    finally:
        held.close()
    assert main(small(run, cache_dir, steps=2)) == 0  # released: usable again


def test_resume_with_another_drafter_shape_is_a_clear_error(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    assert main(small(run, cache_dir, steps=4)) == 0
    capsys.readouterr()
    assert main(small(run, cache_dir, "drafter.num_layers=3", steps=6)) == 2
    err = capsys.readouterr().err
    assert "num_layers: checkpoint 2, config 3" in err and "--resume none" in err
