"""dflash.records: the metrics.jsonl tagged union reads the lines runs have always written, writes
the same bytes, and names file and line for a line it cannot read."""

from __future__ import annotations

import json
import math

import pytest

from dflash.observe.logs import analyse, render
from dflash.observe.metrics_writer import MetricsLog
from dflash.records import (
    CheckpointRecord,
    EndRecord,
    MetricsFormatError,
    ResumeRecord,
    SkipRecord,
    StartRecord,
    TrainRecord,
    decode_line,
    encode,
    read_records,
)

# One line of each kind as dflash wrote them before the record types existed (keys in file order).
OLD_LINES = {
    StartRecord: '{"kind":"start","config_hash":"3f2a","step":0,"lineage":"a1b2c3d4e5f6","data":{"records_read":12},'
                 '"batching":{"num_batches":3,"padding_waste":0.25},"time":1764580000.5}',
    ResumeRecord: '{"kind":"resume","step":50,"path":"runs/x/checkpoints/step_00000050","rejected":[{"path":'
                  '"runs/x/checkpoints/step_00000100","reason":"marked unhealthy"}],"config_changes":[],"time":1.0}',
    TrainRecord: '{"kind":"train","step":10,"window":5,"steps_averaged":4,"loss":2.5,"ce":2.4,"kl":0.1,'
                 '"acc":[0.5,null],"tau_sim":1.5,"accepted_sim":0.5,"lr":0.0003,"grad_norm":1.25,"tok_s":1000.0,'
                 '"target_tok_s":null,"drafter_tok_s":2000.0,"padding_waste":0.1,"blocks":40,"skipped_total":1,'
                 '"time":12.5,"spike":true}',
    SkipRecord: '{"kind":"skip","step":7,"batch_id":6,"replica":0,"reason":"non-finite loss","time":3.0}',
    CheckpointRecord: '{"kind":"checkpoint","step":10,"path":"runs/x/checkpoints/step_00000010","healthy":true,'
                      '"save_s":0.0123,"time":4.0}',
    EndRecord: '{"kind":"end","status":"completed","exit_code":0,"rank":1,"seconds":12.0,"time":5.0}',
}


@pytest.mark.parametrize("cls", list(OLD_LINES), ids=lambda c: c.__name__)
def test_an_existing_line_decodes_to_its_type_and_encodes_back_byte_for_byte(cls):
    line = OLD_LINES[cls]
    rec = decode_line(line)
    assert type(rec) is cls and rec["kind"] == rec.kind == json.loads(line)["kind"]
    assert encode(rec) == line.encode() + b"\n"
    assert rec.to_dict() == json.loads(line)


def test_an_old_log_without_a_later_field_reads_it_as_absent_not_null():
    """Logs written before ``accepted_sim`` existed: the plot and summary tell the conventions apart
    by the key's presence."""
    rec = decode_line('{"kind":"train","step":3,"loss":null,"tau_sim":0.4,"unknown_later_key":1}')
    assert "accepted_sim" not in rec and rec.get("accepted_sim") is None and rec.loss is None
    assert "loss" in rec and rec["tau_sim"] == 0.4
    with pytest.raises(KeyError):
        rec["accepted_sim"]


def test_the_dict_api_writes_the_same_bytes_as_the_typed_record():
    nan = float("nan")
    typed = TrainRecord(step=4, window=4, steps_averaged=0, loss=nan, acc=[], time=2.0)
    as_dict = {"kind": "train", "step": 4, "window": 4, "steps_averaged": 0, "loss": nan, "acc": [], "time": 2.0}
    assert encode(typed) == encode(as_dict) == b'{"kind":"train","step":4,"window":4,"steps_averaged":0,' \
                                              b'"loss":null,"acc":[],"time":2.0}\n'


def test_writing_an_unknown_kind_field_or_type_is_refused_with_the_reason(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    with pytest.raises(MetricsFormatError, match=r"kind 'trian' is unknown; use one of start, resume"):
        log.write({"kind": "trian", "step": 1})
    with pytest.raises(MetricsFormatError, match=r"train record has no field 'los'"):
        log.write({"kind": "train", "step": 1, "los": 2.0})
    with pytest.raises(MetricsFormatError, match=r"skip record: Expected `int`, got `str` - at `\$.step`"):
        log.write({"kind": "skip", "step": "seven"})
    log.write(SkipRecord(step=7, batch_id=6, replica=0, reason="non-finite loss"))
    log.close()
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    got = json.loads(line)
    assert list(got) == ["kind", "step", "batch_id", "replica", "reason", "time"] and math.isfinite(got["time"])


@pytest.mark.parametrize("line, why", [
    ('{"kind":"trian","step":1}', "unknown record kind 'trian' (known: start, resume, train, skip, heldout, checkpoint, end)"),
    ('{"step":1}', "Object missing required field `kind`"),
    ('{"kind":"train","step":1,"lo', "not a JSON record (Input data was truncated)"),
    ('{"kind":"skip","step":"7"}', "Expected `int`, got `str` - at `$.step`"),
    ('[1, 2]', "Expected `object`, got `array`"),
])
def test_a_bad_line_is_one_message_naming_file_and_line(line, why):
    with pytest.raises(MetricsFormatError) as got:
        decode_line(line, "runs/x/metrics.jsonl", 7)
    assert str(got.value) == f"runs/x/metrics.jsonl line 7: {why}"


def test_read_records_keeps_the_good_lines_and_names_each_bad_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join([OLD_LINES[StartRecord], '{"kind":"party","step":1}', "", OLD_LINES[TrainRecord],
                               '{"kind":"end","status":"comp']) + "\n")
    records, problems = read_records(path)
    assert [type(r) for r in records] == [StartRecord, TrainRecord]
    assert problems == [f"{path} line 2: unknown record kind 'party' (known: start, resume, train, skip, "
                        "heldout, checkpoint, end)",
                        f"{path} line 5: not a JSON record (Input data was truncated)"]


def test_dflash_logs_reports_the_bad_lines_by_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(OLD_LINES[StartRecord] + "\n" + '{"kind":"party"}\n'
                                            + OLD_LINES[TrainRecord] + "\n")
    rep = analyse(tmp_path)
    assert rep.bad_lines == 1 and rep.counts == {"start": 1, "train": 1} and rep.last_step == 10
    text = render(rep)
    assert f"  {tmp_path / 'metrics.jsonl'} line 2: unknown record kind 'party'" in text


def test_a_checkpoint_writes_meta_json_and_its_record_with_the_keys_of_old_runs(tmp_path):
    import torch

    from dflash.checkpoint import Checkpointer, step_dir

    log = MetricsLog(tmp_path / "metrics.jsonl")
    ck = Checkpointer(tmp_path / "checkpoints", keep_last=2, config_hash="h", on_event=log.write, lineage="L")
    ck.save(step=3, batch_id=2, loss=float("nan"), weights={"w": torch.zeros(2)}, train_state={"step": 3},
            configs={}, window_steps=3, window_skipped=3, last_skipped=True, skipped_total=3)
    ck.close()
    log.close()
    meta = json.loads((step_dir(tmp_path / "checkpoints", 3) / "meta.json").read_text())
    assert list(meta) == ["step", "batch_id", "loss", "window_steps", "window_skipped", "skipped_total",
                          "healthy", "reason", "lineage", "config_hash", "time", "save_s"]
    assert meta["loss"] is None and meta["healthy"] is False and meta["lineage"] == "L"
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert list(json.loads(line)) == ["kind", "step", "path", "healthy", "reason", "save_s", "time"]
