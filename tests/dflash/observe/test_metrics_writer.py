"""dflash.observe.metrics_writer: fixed step windows (failure mode 5 of docs/failure-modes.md) and the
metrics.jsonl writer."""

from __future__ import annotations

import json
import math

import pytest

from dflash.messages import StepMetrics
from dflash.observe.metrics_writer import MetricsLog, WindowAggregator
from dflash.records import TrainRecord


def _m(step: int, loss: float = 1.0, skipped: bool = False, t: float = 0.0) -> StepMetrics:
    return StepMetrics(step=step, batch_id=step, loss=math.nan if skipped else loss, ce=loss, kl=0.0,
                       acc_per_pos=[0.5, 0.25], accepted_sim=0.625, lr=1e-3, grad_norm=1.0, skipped=skipped,
                       num_tokens=100, num_padding=25, step_s=0.5, target_s=0.25, time=t)


def test_windows_are_fixed_in_steps_and_record_their_size():
    agg = WindowAggregator(window=4, start_time=0.0)
    out = [agg.add(_m(s, loss=float(s), t=float(s))) for s in range(1, 9)]
    records = [r for r in out if r is not None]
    assert [r["step"] for r in records] == [4, 8]
    assert [r["window"] for r in records] == [4, 4]
    assert records[0]["loss"] == (1 + 2 + 3 + 4) / 4
    assert records[1]["loss"] == (5 + 6 + 7 + 8) / 4
    assert records[0]["tok_s"] == 400 / 4.0  # 4 steps x 100 tokens over 4 wall seconds
    assert records[0]["padding_waste"] == 100 / 500


def test_windows_align_to_step_numbers_after_resume():
    """A run resumed at step 6 logs a 2-step window at step 8, then full windows: same x-axis as the
    uninterrupted run, no phantom resets."""
    agg = WindowAggregator(window=4, start_time=0.0)
    records = [r for r in (agg.add(_m(s, t=float(s))) for s in range(7, 13)) if r]
    assert [(r["step"], r["window"]) for r in records] == [(8, 2), (12, 4)]


def test_skipped_steps_are_counted_not_averaged():
    agg = WindowAggregator(window=3, start_time=0.0)
    agg.add(_m(1, loss=2.0, t=1))
    agg.add(_m(2, skipped=True, t=2))
    r = agg.add(_m(3, loss=4.0, t=3))
    assert r["loss"] == 3.0 and r["skipped_total"] == 1 and r["window"] == 3


def test_partial_last_window_is_flushed():
    agg = WindowAggregator(window=10, start_time=0.0)
    for s in (1, 2, 3):
        agg.add(_m(s, t=float(s)))
    r = agg.flush()
    assert r["step"] == 3 and r["window"] == 3
    assert agg.flush() is None


def test_metrics_log_appends_lines(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"kind": "start"})
    log.write({"kind": "train", "step": 1})
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["start", "train"] and all("time" in x for x in lines)


def test_a_window_records_how_many_steps_it_averaged():
    """Invariant: ``window`` is the span in steps, ``steps_averaged`` the steps
    its averages are over: a 5-step window holding one skip says 5 and 4; an all-skipped one 0."""
    agg = WindowAggregator(window=5, start_time=0.0)
    records = [agg.add(_m(s, loss=1.0, skipped=(s == 3), t=float(s))) for s in range(1, 6)]
    assert (records[-1]["window"], records[-1]["steps_averaged"]) == (5, 4)
    for s in range(6, 11):
        r = agg.add(_m(s, skipped=True, t=float(s)))
    assert (r["window"], r["steps_averaged"]) == (5, 0) and math.isnan(r["loss"])


def test_skipped_total_counts_on_from_a_resumed_run():
    """Invariant: a resumed run's skipped_total continues from the checkpoint's."""
    agg = WindowAggregator(window=2, start_time=0.0, skipped_total=3)
    agg.add(_m(5, skipped=True, t=1.0))
    assert agg.add(_m(6, t=2.0))["skipped_total"] == 4


def test_every_segment_of_a_run_directory_logs_into_one_wandb_run(tmp_path):
    """Regression: every resume started a new wandb run. Invariant: the run directory keeps its
    wandb id (RUN_DIR/wandb/run-id) and each segment's sink logs into that run; the config it
    records names the target layers, the drafter variant and the data's identity."""
    from dflash.observe.metrics_writer import WANDB_ID, WandbSink, run_id

    made = iter(["first", "second"])
    assert run_id(tmp_path / "a", lambda: next(made)) == "first"
    assert run_id(tmp_path / "a", lambda: next(made)) == "first"  # kept: no new id for a resume
    assert (tmp_path / "a" / WANDB_ID).read_text().strip() == "first"

    ids = []
    for _ in range(2):
        sink = WandbSink("offline", "p", "n", tmp_path / "run", {"resolved": {"target_layer_ids": [1, 4]}})
        ids.append(sink.run.id)
        assert sink.run.config["resolved"]["target_layer_ids"] == [1, 4]
        sink.close()
    assert ids[0] == ids[1] == (tmp_path / "run" / WANDB_ID).read_text().strip()


def test_the_wandb_config_names_layers_variant_and_data():
    """Invariant: the resolved run hands wandb the layers the drafter reads, its variant and the
    data file's identity, which the graph file leaves implicit."""
    from dflash.data import TokenizerInfo
    from dflash.run.config import load_config
    from dflash.run.resolve import resolve
    from tests.dflash.run.test_run_e2e import GRAPH

    info = TokenizerInfo(vocab_size=4096, mask_token_id=5, pad_token_id=0, eos_token_id=None)
    got = resolve(load_config(GRAPH), info).monitor.wandb_config["resolved"]
    assert got["target_layer_ids"] == [4] and got["drafter_variant"] == "dflash" and got["config_hash"]
    assert got["data"]["path"].endswith(".json") and got["data"]["size"] > 0


@pytest.mark.parametrize("content, why", [
    (b"a/b:c\n", "holds 'a/b:c', not a run id"),
    (b"\xff\xfe\x00id", "is not UTF-8 text"),
    (b"x" * 300_000, "not a run id"),
    (b"  \n", "is empty"),
], ids=["refused-characters", "not-utf8", "300K-characters", "empty"])
def test_an_unusable_wandb_run_id_costs_only_the_curve(tmp_path, caplog, content, why):
    """Invariant: a RUN_DIR/wandb/run-id that wandb cannot use (characters it refuses, bytes that
    are not UTF-8, 300K characters, nothing) gives a new id for this segment and one warning line
    naming the file; the file then keeps the new id. Regression: wandb.init raised at start-up
    (UsageError, UnicodeDecodeError): exit 1 with a traceback and a line that never named the file."""
    import logging

    from dflash.observe.metrics_writer import WANDB_ID, run_id

    path = tmp_path / WANDB_ID
    path.parent.mkdir()
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="dflash.monitor"):
        assert run_id(tmp_path, lambda: "fresh123") == "fresh123"
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"{path} ") and why in line and "new run fresh123" in line, line
    assert "\n" not in line and len(line) < 400
    assert path.read_text() == "fresh123\n"
    caplog.clear()
    assert run_id(tmp_path, lambda: "other") == "fresh123" and not caplog.records  # kept from now on


def test_a_wandb_path_that_is_a_file_costs_only_wandb(tmp_path, caplog):
    """Invariant: RUN_DIR/wandb being a file turns wandb off for the run with one warning line
    naming it (metrics.jsonl still has every window), and the id it cannot keep is said once.
    Regression: wandb.init failed in the monitor's setup (NotADirectoryError), exit 1, traceback."""
    import logging

    from dflash.observe.metrics_writer import WandbSink

    (tmp_path / "wandb").write_text("x")
    with caplog.at_level(logging.WARNING, logger="dflash.monitor"):
        sink = WandbSink("offline", "p", "n", tmp_path, {})
    assert sink.run is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"{tmp_path / 'wandb'} is a file, not a directory: wandb logs nothing"), line
    sink.log(TrainRecord(step=1, window=1))  # a no-op, as with wandb disabled
    sink.close()


@pytest.mark.parametrize("mode, quiet", [("offline", True), ("online", False)])
def test_an_offline_wandb_run_keeps_its_end_of_run_panel_off_the_terminal(tmp_path, monkeypatch, mode, quiet):
    """Invariant: offline (the default), wandb is started quiet: its end-of-run history sparklines and
    sync hints (about 30 lines, seen by a new user) would push the run summary off the screen, and the
    summary's "next" block gives the sync command. Online runs keep wandb's own lines (the run's URL)."""
    import wandb

    from dflash.observe.metrics_writer import WandbSink

    seen = {}

    class _Run:
        def define_metric(self, *a, **k):
            pass

    def init(**kwargs):
        seen.update(kwargs)
        return _Run()

    monkeypatch.setattr(wandb, "init", init)
    WandbSink(mode, "p", "n", tmp_path, {})
    settings = seen.get("settings")
    assert (settings is not None and settings.quiet) == quiet
