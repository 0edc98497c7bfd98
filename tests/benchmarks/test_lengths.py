"""benchmarks.h200.lengths in --smoke mode (tiny shapes, CPU): every cell of the length table is
measured and reported, one joined row of L tokens per step, and a cell that runs out of memory is
recorded while the table goes on."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.h200 import lengths

pytestmark = pytest.mark.timeout(600)


def test_the_length_table_measures_every_cell(tmp_path, capsys):
    out = tmp_path / "lengths.json"
    assert lengths.main(["--smoke", "--out", str(out), "--lengths", "64,128", "--windows", "0,32", "--warmup", "1",
                         "--steps", "1", "--run-root", str(tmp_path / "runs")]) == 0
    doc = json.loads(out.read_text())
    assert [r["length"] for r in doc["rows"]] == [64, 128]
    for r in doc["rows"]:
        assert r["tokens_per_step"] == r["length"]             # one joined row, no padding
        assert r["num_anchors"] == r["length"] // 16 and r["target"]["status"] == "ok"
        cells = {(c["checkpointing"], c["window"]): c for c in r["drafter"]}
        assert set(cells) == {(False, 0), (True, 0), (False, 32), (True, 32)}
        for c in cells.values():
            assert c["status"] == "ok" and c["tok_s"] > 0 and c["blocks_per_step"] == r["num_anchors"]
    table = capsys.readouterr().out
    assert "L =    128 (8 blocks)" in table and "x of without" in table


def test_a_cell_out_of_memory_is_recorded_and_the_table_goes_on(tmp_path, monkeypatch):
    from benchmarks.h200 import stages

    def short_of_memory(*_a, **_k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")

    monkeypatch.setattr(stages, "time_drafter", short_of_memory)
    out = tmp_path / "lengths.json"
    assert lengths.main(["--smoke", "--out", str(out), "--lengths", "64,128", "--checkpointing", "on",
                         "--warmup", "0", "--steps", "1", "--run-root", str(tmp_path / "runs")]) == 0
    doc = json.loads(out.read_text())
    assert [r["length"] for r in doc["rows"]] == [64, 128]
    for r in doc["rows"]:
        assert r["target"]["status"] == "ok"
        assert [c["status"] for c in r["drafter"]] == ["out of memory"]
        assert "Tried to allocate 40.00 GiB" in r["drafter"][0]["error"]


def test_cells_set_the_length_anchors_checkpointing_and_window():
    sets = lengths.cell_overrides(8192, 16, True, 2048, 3)
    assert "data.max_length=8192" in sets and "data.tokens_per_batch=8192" in sets and "data.join=true" in sets
    assert "train.num_anchors=512" in sets and "drafter.activation_checkpointing=true" in sets
    assert 'drafter.layer_types=["sliding_attention", "sliding_attention", "sliding_attention"]' in sets
    assert "drafter.sliding_window=2048" in sets
    assert not any("window" in s for s in lengths.cell_overrides(2048, 16, False, 0, 3))
