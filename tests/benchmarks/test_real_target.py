"""benchmarks/real_target: the figures its steps compute from what the device wrote."""

from __future__ import annotations

import json

from benchmarks.real_target.engines import compare


def _write(path, answers: dict[int, str], torn: bool = False):
    rows = [json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": a}],
                        "source_index": i, "finished": True}) for i, a in answers.items()]
    path.write_text("\n".join(rows) + ("\n{\"messages\": [" if torn else "\n"))


def test_engines_compare_counts_rates_and_agreement(tmp_path):
    g, c = tmp_path / "g.jsonl", tmp_path / "c.jsonl"
    _write(g, {0: "a", 1: "b"})
    _write(c, {0: "a", 1: "B", 2: "c", 3: "d"}, torn=True)  # a run stopped at the cap leaves a torn line
    r = compare(g, c, seconds=2.0)
    assert (r["generate"], r["continuous"], r["both"], r["identical"]) == (2, 4, 2, 1)
    assert r["generate_per_s"] == 1.0 and r["continuous_per_s"] == 2.0 and r["speedup"] == 2.0
