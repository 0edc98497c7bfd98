"""End to end: ``python -m dflash.run`` on the default graph (examples/dflash-tiny.toml), shrunk.

Real ShareGPT rows, the real stages, checkpoints and resume, on CPU. Each run here takes a few
seconds; they share one tokenized-data cache.
"""

from __future__ import annotations

import json
import math
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
from dflash.run.cli import main
from dflash.run.stages.postprocess import PostprocessStage
from dflash.run.stages.target import TargetStage
from dflash.run.stages.trainer import DrafterStage

ROOT = Path(__file__).resolve().parents[3]
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
        "train.num_anchors=8",
        "checkpoint.every=4",
        "checkpoint.keep_last=5",
        "monitor.window=1",
        "monitor.wandb=disabled",
        "eval.every=0",  # the held-out evaluation has its own tests
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
    assert set(stats[-1]["channels"]) == {"batches", "hidden", "features", "metrics", "snapshots"}
    assert (run / "csp" / "trace.json").is_file() and (run / "config.toml").is_file()
    # the run log says how many conversations were held out (data.holdout = 4) and how many of them the
    # held-out tau decodes (eval.prompts, 8 by default, capped at the 4 there are)
    assert ("(4 more held out, never trained on: data.holdout; held-out tau decodes the first 4, eval.prompts"
            in (run / "run.log").read_text())


@pytest.mark.parametrize("loss", [
    ("loss.kl_weight=0.1", "loss.tv_weight=0.9", "loss.conf_weight=1.0"),                          # top1
    ("loss.kl_weight=0.0", "loss.tv_weight=0.9", "loss.conf_weight=1.0", "loss.confidence=head"),   # DSpark's
    ("loss.kl_weight=1.0",),                                                                        # neither
], ids=["top1", "head", "off"])
def test_metrics_log_the_tv_and_confidence_terms_when_weighted(tmp_path, cache_dir, loss):
    """Invariant: with [loss].tv_weight / conf_weight above 0 every train record carries the
    finite window mean of that term (``tv``, ``conf``) next to ``ce`` and ``kl``; with the weight
    at 0 the key is left out (a TV of 0 would read as a perfect match)."""
    run = tmp_path / "run"
    assert main(small(run, cache_dir, *(f for f in loss), "checkpoint.every=2", steps=2)) == 0
    train = records(run, "train")
    assert [r["step"] for r in train] == [1, 2]
    on = {k for k in ("tv", "conf") if any(x.startswith(f"loss.{k}_weight=") and not x.endswith("=0.0") for x in loss)}
    for r in train:
        assert {"ce", "kl"} <= r.keys() and {"tv", "conf"} & r.keys() == on, r
        assert all(isinstance(r[k], float) and math.isfinite(r[k]) and r[k] >= 0 for k in on), r


def test_resume_reproduces_the_uninterrupted_run_bitwise(tmp_path, cache_dir):
    """Exact resume (failure mode 3 of docs/failure-modes.md): a run resumed from its step-4
    checkpoint has the same step 5..8 losses and the same final weights as the run that was never interrupted."""
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


def test_a_stage_out_of_gpu_memory_says_which_settings_to_change(tmp_path, cache_dir, capsys, monkeypatch):
    """Invariant: a stage that runs out of GPU memory stops the run as any crash does (exit 1), then
    one line names the settings that set that stage's memory, with their values."""
    def out_of_memory(self, inp):  # the drafter's first step, as a CUDA allocation failure reads
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(DrafterStage, "train_step", out_of_memory)
    run = tmp_path / "run"
    code = main(small(run, cache_dir, "data.tokens_per_batch=512", steps=4))
    assert code == 1
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "ran out of memory" in x)
    assert line.startswith("error: the GPU ran out of memory in drafter")
    assert "[drafter].activation_checkpointing = true" in line and "data.tokens_per_batch (now 512)" in line
    assert "train.num_anchors (now" in line and "data.max_length (now" in line


def test_nonfinite_step_is_skipped_counted_and_training_goes_on(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("DFLASH_TEST_BAD_BATCHES", "[2]")
    run = tmp_path / "run"
    assert main(small(run, cache_dir, "process.postprocess.kind=\"tests.nan_features\"", steps=6)) == 0
    skips = records(run, "skip")
    assert [(s["step"], s["batch_id"], s["replica"]) for s in skips] == [(3, 2, 0)]
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
    assert "postprocess[0]" in err and "'features'" in err and "step 2, batch 1" in err  # batch 1 trains step 2


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
    from dflash.run.run_dir import acquire_run_lock

    run = tmp_path / "run"
    held = acquire_run_lock(run)  # as if another dflash.run were training there
    try:
        assert main(small(run, cache_dir)) == 2
        assert "in use by another dflash.run" in capsys.readouterr().err
    finally:
        held.close()
    assert main(small(run, cache_dir, steps=2)) == 0  # released: usable again


def test_resume_with_another_drafter_shape_is_a_clear_error(tmp_path, cache_dir, capsys, monkeypatch):
    """Invariant: a checkpoint of another drafter shape or variant (DFlash vs DFlash2) is refused
    before any data work, one line naming both sides, exit 2, for resume = auto and a given path.
    Regression: a DFlash checkpoint resumed as DFlash2 warned, then failed late in load_state_dict
    with a traceback."""
    import dflash.data

    run = tmp_path / "run"
    assert main(small(run, cache_dir, steps=4)) == 0
    capsys.readouterr()
    monkeypatch.setattr(dflash.data, "load_dataset", lambda *a, **k: pytest.fail("data work before the check"))
    assert main(small(run, cache_dir, "drafter.num_layers=3", steps=6)) == 2
    err = capsys.readouterr().err
    assert "num_layers: checkpoint 1, config 3" in err and "--resume none" in err and err.count("\n") == 1
    ckpt = str(list_checkpoints(run / "checkpoints")[-1])
    for extra in ([], ["--resume", ckpt]):
        assert main(small(run, cache_dir, 'drafter.variant="dflash2"', "drafter.conv_group_size=8", steps=6)
                    + extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert "variant: checkpoint 'dflash', config 'dflash2' (drafter.variant)" in err, err


def test_resume_of_an_xpress_checkpoint_with_another_refiner_shape_is_refused(tmp_path, cache_dir, capsys,
                                                                              monkeypatch):
    """Invariant: an XPress checkpoint resumed with another drafter.xpress_rank or
    xpress_mlp_ratio is refused as DFlash and DFlash2 shape changes are: one line naming both
    values, exit 2, before any data work. Regression: a WARNING, then after start-up a
    load_state_dict "size mismatch for refiner_head.*" traceback, exit 1, and a summary saying
    no healthy checkpoint exists."""
    import dflash.data

    run = tmp_path / "run"
    xpress = ('drafter.variant="xpress"', "drafter.xpress_rank=32")
    assert main(small(run, cache_dir, *xpress, steps=2)) == 0
    capsys.readouterr()
    monkeypatch.setattr(dflash.data, "load_dataset", lambda *a, **k: pytest.fail("data work before the check"))
    for change, says in (("drafter.xpress_rank=16", "xpress_rank: checkpoint 32, config 16"),
                         ("drafter.xpress_mlp_ratio=3", "xpress_mlp_ratio: checkpoint 2, config 3")):
        assert main(small(run, cache_dir, *xpress, change, steps=4)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and says in err, err


# -- checkpoints that must not lie, resume that must not change the run ---------------------------


def run_log(run_dir: Path) -> str:
    return (run_dir / "run.log").read_text()


def test_blown_up_weights_never_make_a_healthy_checkpoint(tmp_path, cache_dir, capsys):
    """Invariant: with lr = 1e30 the weights blow up (finite, ~1e30) and every later step
    is skipped; the checkpoints saved during that streak are unhealthy, carry the loss of their own
    window (not a stale one), and the stop message recommends none of them."""
    run = tmp_path / "run"
    code = main(small(run, cache_dir, "train.lr=1e30", "checkpoint.every=2", "train.max_nonfinite_streak=4",
                      steps=8))
    assert code == 1
    assert "No healthy checkpoint was written yet" in capsys.readouterr().err
    metas = [read_meta(p) for p in list_checkpoints(run / "checkpoints")]
    assert [(m["step"], m["healthy"]) for m in metas] == [(2, False), (4, False)]
    assert "was skipped as non-finite" in metas[0]["reason"]
    assert metas[0]["loss"] == losses(run)[1]  # window 1..2: only step 1 trained
    assert metas[1]["loss"] is None and metas[1]["window_skipped"] == 2  # window 3..4: nothing trained
    assert not any(map(is_healthy, list_checkpoints(run / "checkpoints")))


def test_a_streak_right_after_a_checkpoint_marks_it_and_names_the_one_before(tmp_path, cache_dir, monkeypatch,
                                                                             capsys):
    """Invariant: when the non-finite streak that stops a run began on the step right after
    a checkpoint, that checkpoint (whose weights every later step failed on) is marked unhealthy and
    the stop message names the healthy one before it; metrics.jsonl records the demotion."""
    monkeypatch.setenv("DFLASH_TEST_BAD_BATCHES", json.dumps(list(range(4, 100))))  # steps 5.. fail
    run = tmp_path / "run"
    code = main(small(run, cache_dir, "process.postprocess.kind=\"tests.nan_features\"", "checkpoint.every=2",
                      "train.max_nonfinite_streak=2", steps=12))
    assert code == 1
    (err,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "Last healthy checkpoint:" in err and "step_00000002" in err and "step_00000004" not in err
    step4 = read_meta(run / "checkpoints" / "step_00000004")
    assert step4["healthy"] is False and "were all non-finite" in step4["reason"]
    assert is_healthy(run / "checkpoints" / "step_00000002")
    demoted = [r for r in records(run, "checkpoint") if r.get("step") == 4][-1]  # metrics.jsonl agrees
    assert demoted["healthy"] is False and demoted.get("demoted") is True


def test_resume_auto_rejects_a_poisoned_checkpoint_loudly_and_falls_back(tmp_path, cache_dir):
    """Invariant: resume = "auto" verifies the tensors it loads: a newest checkpoint marked
    healthy but holding NaN weights is rejected with a line naming it and why, the run continues from
    the previous one, and the rejected one is kept aside (archived), not overwritten."""
    from safetensors.torch import save_file

    run = tmp_path / "run"
    assert main(small(run, cache_dir)) == 0
    bad = run / "checkpoints" / "step_00000008"
    w = load_file(str(bad / "model.safetensors"))
    save_file({k: torch.full_like(v, float("nan")) for k, v in w.items()}, str(bad / "model.safetensors"))
    assert main(small(run, cache_dir, steps=9)) == 0
    log = run_log(run)
    assert "REJECTED checkpoint" in log and "step_00000008: non-finite weights in model.safetensors" in log
    resume = records(run, "resume")[-1]
    assert resume["step"] == 4 and resume["rejected"][0]["path"].endswith("step_00000008")
    (archive,) = (run / "checkpoints").glob("archive-*")
    assert (archive / "step_00000008" / "model.safetensors").is_file()
    assert is_healthy(run / "checkpoints" / "step_00000008")  # retrained from step 4


def test_resume_auto_with_every_checkpoint_rejected_says_step_0_once(tmp_path, cache_dir):
    """Invariant: when resume = "auto" rejects every checkpoint of the run directory, the run says
    once that it starts from step 0 (after the REJECTED lines), not twice."""
    run = tmp_path / "run"
    assert main(small(run, cache_dir, steps=4)) == 0
    (run / "checkpoints" / "step_00000004" / "meta.json").write_text("garbage")
    before = len(run_log(run))
    assert main(small(run, cache_dir, steps=4)) == 0
    log = run_log(run)[before:]
    assert "REJECTED checkpoint" in log
    assert log.count("starting from step 0") == 1, log


def test_a_fresh_start_never_loses_its_checkpoints_to_an_old_lineage(tmp_path, cache_dir):
    """Invariant: --resume none in a directory holding an older run's higher-step
    checkpoints moves them to checkpoints/archive-*/ (nothing deleted); retention then keeps the new
    run's checkpoints, and the next auto resume continues the new run, not the old one."""
    run = tmp_path / "run"
    assert main(small(run, cache_dir, steps=8)) == 0  # old lineage: steps 4 and 8
    fresh = small(run, cache_dir, "checkpoint.every=1", "checkpoint.keep_last=2", steps=3) + ["--resume", "none"]
    assert main(fresh) == 0
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000002", "step_00000003"]
    (archive,) = (run / "checkpoints").glob("archive-*")
    assert [p.name for p in list_checkpoints(archive)] == ["step_00000004", "step_00000008"]
    assert "moved 2 checkpoint(s)" in run_log(run)
    assert main(small(run, cache_dir, "checkpoint.every=1", "checkpoint.keep_last=2", steps=4)) == 0
    assert records(run, "resume")[-1]["step"] == 3


def test_a_rerun_with_nothing_to_do_leaves_the_observability_in_place(tmp_path, cache_dir, capfd):
    """Invariant: re-running a finished run (nothing to do) keeps csp/stats.jsonl and
    trace.json where csp.inspect reads them, and moves nothing aside. Regression: that
    re-run printed no closing summary; it prints the short one (the checkpoint, what to run next)."""
    from csp.inspect import main as inspect_main

    run = tmp_path / "run"
    assert main(small(run, cache_dir, steps=2)) == 0
    capfd.readouterr()
    assert main(small(run, cache_dir, steps=2)) == 0
    assert "nothing to do" in run_log(run)
    err = capfd.readouterr().err
    assert err.count("run summary: nothing to do: the run is already at its last step (exit 0)") == 1
    assert f"python -m dflash.export {run}/checkpoints/step_00000002" in err and "--resume auto" not in err
    assert (run / "csp" / "stats.jsonl").is_file() and (run / "csp" / "trace.json").is_file()
    assert not list((run / "csp").glob("*before-step*"))
    assert inspect_main([str(run)]) == 0


def test_a_rerun_past_run_steps_says_where_the_checkpoint_is_and_what_to_change(tmp_path, cache_dir, capfd):
    """Invariant: resuming a run whose latest checkpoint is past run.steps says so plainly (the step,
    run.steps, and the two ways on: raise run.steps or --resume none), exit 0, no step trained; the
    closing summary says the checkpoint is past the last step. Regression: the summary said the run
    was "already at its last step"."""
    run = tmp_path / "run"
    assert main(small(run, cache_dir, steps=4)) == 0
    capfd.readouterr()
    assert main(small(run, cache_dir, steps=2)) == 0
    line = (f"nothing to do: the latest checkpoint ({run}/checkpoints/step_00000004) is at step 4, already past "
            "run.steps = 2; to train further raise run.steps above 4 (--set run.steps=N), or give --resume none "
            "to start over")
    err = capfd.readouterr().err
    assert line in run_log(run) and line in err
    assert max(losses(run)) == 4
    # the closing summary agrees: past the last step, not at it (it said "already at its last step")
    assert err.count("run summary: nothing to do: the checkpoint is already past the last step "
                     "(step 4, run.steps = 2) (exit 0)") == 1, err
    assert "at its last step" not in err and "  steps        4/2 (no step finished in this run)" in err


def test_resume_counts_skips_on_and_names_what_changed(tmp_path, cache_dir, monkeypatch):
    """Invariants (items 9, 10, 11, 16): after a resume skipped_total counts on from the
    checkpoint's; a changed run.steps (which moves the cosine schedule) is named with its effect;
    the skip record names the target replica and its window says it averaged no step."""
    monkeypatch.setenv("DFLASH_TEST_BAD_BATCHES", "[1]")
    run = tmp_path / "run"
    nan = "process.postprocess.kind=\"tests.nan_features\""
    assert main(small(run, cache_dir, nan, steps=4)) == 0
    (skip,) = records(run, "skip")
    assert (skip["step"], skip["replica"]) == (2, 0)
    assert {r["step"]: r["steps_averaged"] for r in records(run, "train")}[2] == 0
    assert main(small(run, cache_dir, nan, steps=6)) == 0
    assert [r["skipped_total"] for r in records(run, "train") if r["step"] > 4] == [1, 1]
    assert "run.steps 4 -> 6 (lr schedule: the cosine decay ends at run.steps)" in run_log(run)
    assert records(run, "resume")[-1]["config_changes"] == [
        "run.steps 4 -> 6 (lr schedule: the cosine decay ends at run.steps)"]


def test_earlier_segments_keep_distinct_names_when_they_end_at_the_same_step(tmp_path):
    """Invariant: a segment's csp stats and trace moved aside never overwrite an earlier
    segment's, even when both segments were followed by a start from the same step (two fresh
    starts, or two resumes from one checkpoint); stats and trace of one segment share a name."""
    from dflash.run.run_dir import keep_previous_observability

    csp_dir = tmp_path / "csp"
    csp_dir.mkdir()
    for segment in ("a", "b", "c"):
        (csp_dir / "stats.jsonl").write_text(segment)
        (csp_dir / "trace.json").write_text(segment)
        keep_previous_observability(tmp_path, 0)
    assert sorted(p.name for p in csp_dir.iterdir()) == [
        "stats.before-step-0-2.jsonl", "stats.before-step-0-3.jsonl", "stats.before-step-0.jsonl",
        "trace.before-step-0-2.json", "trace.before-step-0-3.json", "trace.before-step-0.json"]
    assert (csp_dir / "stats.before-step-0.jsonl").read_text() == "a"
    assert (csp_dir / "trace.before-step-0-3.json").read_text() == "c"


def test_a_changed_lr_on_resume_takes_effect(tmp_path, cache_dir):
    """Regression (the warning named `train.lr 0.001 -> 3e-05` yet the old schedule went on): the
    resumed run trains with its own [train].lr: every later step's lr is the new peak times the
    schedule, i.e. 100x lower here than the uninterrupted run's at the same step."""
    run = tmp_path / "run"
    assert main(small(run, cache_dir, "train.lr=1e-3", "train.warmup_steps=2", steps=4)) == 0
    assert main(small(run, cache_dir, "train.lr=1e-5", "train.warmup_steps=2", steps=8)) == 0
    ref = tmp_path / "ref"
    assert main(small(ref, cache_dir, "train.lr=1e-3", "train.warmup_steps=2", steps=8)) == 0

    def lrs(d):
        return {r["step"]: r["lr"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
                if r.get("kind") == "train"}

    got, want = lrs(run), lrs(ref)
    assert got[2] == want[2]                                 # before the resume: the same run
    for step in (5, 6, 7, 8):
        assert got[step] == pytest.approx(want[step] / 100, rel=1e-6), step


def test_resume_refused_for_the_data_order_names_the_setting_that_changed(tmp_path, cache_dir, capsys):
    """Found by a new user: resuming with another drafter.block_size said only "cannot resume the
    data order: dataset: saved '7f77..', now '9d5d..'". Invariant: the one error line also names
    the setting that changed the data order (exit 2, nothing trained); a block size, which changes
    the drafter as well, is refused earlier, naming both sizes."""
    run = tmp_path / "run"
    assert main(small(run, cache_dir, steps=4)) == 0
    capsys.readouterr()
    assert main(small(run, cache_dir, "data.max_length=128", steps=8)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "cannot resume the data order" in err[0], err
    assert "data.max_length 256 -> 128" in err[0], err[0]
    # a block size that changes the data order changes the drafter too: refused before the data
    assert main(small(run, cache_dir, "drafter.block_size=4", steps=8)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "block_size: checkpoint 8, config 4" in err[0], err


def test_ctrl_c_while_torch_imports_is_one_line_exit_130(tmp_path):
    """Found by a new user: Ctrl-C 1.5 s into ``python -m dflash.run`` (torch importing) printed a
    KeyboardInterrupt traceback. A ``torch`` module that raises KeyboardInterrupt when imported
    stands for the Ctrl-C, at exactly that moment."""
    (tmp_path / "torch.py").write_text("raise KeyboardInterrupt\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "dflash.run", GRAPH], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("dflash.run: interrupted while starting, before any step ran")


def test_a_run_that_would_train_on_too_few_conversations_stops_before_training(tmp_path, capsys):
    """Invariant: a data file that leaves fewer than MIN_TRAIN conversations to train on after the
    hold-out is one line naming both counts, exit 2, before any step; left out, the hold-out takes
    only a tenth of a small file (7 of 72), so that file trains on 65."""
    import json

    from dflash.run.prepare import MIN_TRAIN

    def chats(n: int) -> str:
        return "".join(json.dumps({"messages": [
            {"role": "user", "content": f"Question {i}: name a colour and say why you like it."},
            {"role": "assistant", "content": f"Answer {i}: blue, because it is the colour of the sea and the sky."}]})
            + "\n" for i in range(n))

    data = tmp_path / "few.jsonl"
    data.write_text(chats(24))
    run = tmp_path / "run"
    args = small(run, tmp_path / "cache", f'data.source="{data}"', "data.holdout=12", steps=2)
    assert main(args) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert f"24 usable conversations, 12 held out (data.holdout) leaves 12 to train on, fewer than {MIN_TRAIN}" in line
    assert not list_checkpoints(run / "checkpoints")
    many = tmp_path / "many.jsonl"
    many.write_text(chats(72))  # 72 conversations (72 prompts), the hold-out left out
    args = small(run, tmp_path / "cache", f'data.source="{many}"', steps=2)
    i = args.index("data.holdout=4")
    del args[i - 1:i + 1]  # the "--set data.holdout=4" pair: leave the key out
    assert main(args) == 0
    assert "65 training conversations (7 more held out" in (run / "run.log").read_text()
