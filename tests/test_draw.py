"""csp.draw (``python -m csp.graph``): DOT and Mermaid text, run annotations, SVG via Graphviz or
a clear fallback when Graphviz's `dot` is missing. No test needs the `dot` binary except the one
marked to skip without it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from csp.backpressure import read_stats, summarize
from csp.draw import load_for_drawing, main, to_dot, to_mermaid

FIXTURES = Path(__file__).parent / "fixtures" / "runs"

# An application-style file: [run] and [data] are not csp's, and are ignored for drawing.
GRAPH = """
[run]
name = "demo"
[data]
source = "x"

[[channel]]
name = "batches"
capacity = 4

[[channel]]
name = "out"
capacity = 2
ordered = true

[[process]]
name = "source"
kind = "t.source"
outputs = { out = "batches" }

[[process]]
name = "work"
kind = "t.work"
replicas = 3
devices = ["cuda:0", "cuda:1", "cuda:2"]
inputs = { inp = "batches" }
outputs = { out = "out" }

[[process]]
name = "sink"
kind = "t.sink"
inputs = { inp = "out" }

[[process]]
name = "tap"
kind = "t.sink"
inputs = { inp = "out" }
"""


@pytest.fixture
def graph_file(tmp_path: Path) -> Path:
    path = tmp_path / "graph.toml"
    path.write_text(GRAPH)
    return path


def test_dot_nodes_and_edges(graph_file):
    dot = to_dot(load_for_drawing(graph_file))
    assert dot.startswith("digraph csp {") and dot.rstrip().endswith("}")
    assert '"work" [label="work\\nt.work\\n3 replicas, cuda:0..2"];' in dot
    assert '"source" -> "work" [label="batches [cap 4]"];' in dot
    # fan-out: one edge per reader of 'out'
    assert '"work" -> "sink" [label="out [cap 2, ordered]"];' in dot
    assert '"work" -> "tap" [label="out [cap 2, ordered]"];' in dot
    assert "run" not in dot.replace("rankdir", "")  # the [run] table is not drawn


def test_mermaid_text(graph_file):
    mmd = to_mermaid(load_for_drawing(graph_file))
    lines = mmd.splitlines()
    assert lines[0] == "flowchart LR"
    assert '  p1["work<br/>t.work<br/>3 replicas, cuda:0..2"]' in lines
    assert '  p0 -->|"batches [cap 4]"| p1' in lines
    assert '  p1 -->|"out [cap 2, ordered]"| p2' in lines and '  p1 -->|"out [cap 2, ordered]"| p3' in lines


def test_run_annotations_and_bottleneck_highlight(graph_file):
    summary = summarize(read_stats(FIXTURES / "pipeline"))
    spec = load_for_drawing(graph_file)
    dot = to_dot(spec, summary)
    assert "batches [cap 4]\\nfill avg 3.0 peak 4\\nsend blocked 75%, recv wait 5%" in dot
    assert "busy 90% wait 8% blocked 2%" in dot  # aggregated over work's replicas
    work_line = next(line for line in dot.splitlines() if line.startswith('  "work" ['))
    assert 'color="#d62728"' in work_line
    assert "label=\"bottleneck: work (" in dot
    mmd = to_mermaid(spec, summary)
    assert "class p1 bottleneck" in mmd and mmd.startswith("%% bottleneck: work")


def test_typo_in_channel_table_is_still_an_error(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(GRAPH.replace("capacity = 4", "capactiy = 4"))
    assert main([str(bad), "-o", str(tmp_path / "g.dot")]) == 2
    err = capsys.readouterr().err
    assert "capactiy" in err and "$.channel[0]" in err


def test_cli_writes_dot_and_mermaid(graph_file, tmp_path, capsys):
    assert main([str(graph_file), "-o", str(tmp_path / "g.dot")]) == 0
    assert (tmp_path / "g.dot").read_text() == to_dot(load_for_drawing(graph_file))
    assert main([str(graph_file), "-o", str(tmp_path / "g.mmd"), "--run", str(FIXTURES / "pipeline")]) == 0
    assert "fill avg 3.0 peak 4" in (tmp_path / "g.mmd").read_text()
    capsys.readouterr()
    assert main([str(graph_file), "--set", "channel.batches.capacity=16"]) == 0
    assert "batches [cap 16]" in capsys.readouterr().out


def test_svg_without_graphviz_writes_dot_and_says_how(graph_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main([str(graph_file), "-o", str(tmp_path / "g.svg")]) == 1
    err = capsys.readouterr().err
    assert "apt-get install graphviz" in err and "dot -Tsvg" in err
    assert not (tmp_path / "g.svg").exists()
    assert (tmp_path / "g.dot").read_text().startswith("digraph csp {")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` not installed")
def test_svg_with_graphviz(graph_file, tmp_path):
    assert main([str(graph_file), "-o", str(tmp_path / "g.svg")]) == 0
    svg = (tmp_path / "g.svg").read_text()
    assert "<svg" in svg and "batches [cap 4]" in svg


def test_unknown_output_suffix_is_a_usage_error(graph_file, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main([str(graph_file), "-o", str(tmp_path / "g.txt")])
    assert exc.value.code == 2
