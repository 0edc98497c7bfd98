"""csp.graph.draw (``python -m csp.graph``): DOT and Mermaid text, run annotations, SVG via Graphviz or
a clear fallback when Graphviz's `dot` is missing. No test needs the `dot` binary except the one
marked to skip without it."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from csp.observe.backpressure import read_stats, summarize
from csp.graph.draw import load_for_drawing, main, to_dot, to_mermaid

FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "runs"

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
    assert lines[0] == "flowchart TB"  # a stage per row: a long pipeline stays narrow
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


def _svg_geometry(svg: str):
    """(width, height, texts as (x, y, text)) of an SVG written by csp.graph.svg, in picture coordinates."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(svg)  # well-formed XML, or this raises
    ns = "{http://www.w3.org/2000/svg}"
    width, height = float(root.get("width")), float(root.get("height"))
    texts = []

    def walk(el, dy):
        t = el.get("transform", "")
        if t.startswith("translate(0,"):
            dy += float(t[len("translate(0,"):-1])
        if el.tag == ns + "text":
            texts.append((float(el.get("x")), float(el.get("y")) + dy, el.text or ""))
        for child in el:
            walk(child, dy)

    walk(root, 0.0)
    return width, height, texts


def test_svg_without_graphviz_is_drawn_in_python(graph_file, tmp_path, monkeypatch, capsys):
    """Regression: ``-o graph.svg`` failed without Graphviz's dot, which pip cannot
    install. Invariant: without dot the SVG is drawn in pure Python, well-formed, with every
    process and channel labelled and every label inside the picture."""
    from csp.graph.svg import CW

    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main([str(graph_file), "-o", str(tmp_path / "g.svg")]) == 0
    svg = (tmp_path / "g.svg").read_text()
    width, height, texts = _svg_geometry(svg)
    words = [t for _, _, t in texts]
    for label in ("source", "work", "t.work", "3 replicas", "work[0]  cuda:0", "work[2]  cuda:2", "x3", "sink",
                  "tap", "batches [cap 4]"):
        assert label in words, label
    assert words.count("out [cap 2, ordered]") == 2  # fan-out: one arrow per reader
    assert all(0 <= x and x + len(t) * CW <= width + 1 and 0 < y <= height for x, y, t in texts)


def test_svg_with_a_run_marks_the_bottleneck_the_fill_and_each_replica(graph_file, tmp_path, monkeypatch):
    """Invariant: with --run the picture carries the verdict as its title, fill and blocked/wait
    numbers on the arrows, one busy bar per replica, and the bottleneck box in red."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main([str(graph_file), "-o", str(tmp_path / "g.svg"), "--run", str(FIXTURES / "pipeline")]) == 0
    svg = (tmp_path / "g.svg").read_text()
    _, _, texts = _svg_geometry(svg)
    words = [t for _, _, t in texts]
    assert words[0].startswith("bottleneck: work (busy 90%")
    assert "fill avg 3.0 peak 4" in words and "send blocked 75%, recv wait 5%" in words
    assert svg.count("<title>work[") == 4  # 2 replicas: a bar and its fill each
    red_boxes = [line for line in svg.splitlines()
                 if 'rx="6" fill="#fde0dd" stroke="#d62728" stroke-width="2.5"' in line]
    assert len(red_boxes) == 1  # the front card of work's stack (the cards behind are thinner)


def test_head_of_line_channel_is_drawn_red():
    """Invariant: a verdict that names an ordered channel (head-of-line) colours its arrows red."""
    import msgspec

    from csp.observe.backpressure import Verdict
    from csp.graph.draw import _edge_lines, _edges, _node_lines
    from csp.graph.svg import RED, graph_svg

    spec = load_for_drawing_text(GRAPH)
    summary = summarize(read_stats(FIXTURES / "pipeline"))
    summary = msgspec.structs.replace(summary, verdict=Verdict(text="bottleneck: ordered channel 'out' ...",
                                                               channel="out"))
    svg = graph_svg(spec, summary, _node_lines, _edge_lines, _edges)
    red_paths = [line for line in svg.splitlines() if line.startswith("<path") and f'stroke="{RED}"' in line]
    assert len(red_paths) == 2  # work -> sink and work -> tap


def load_for_drawing_text(text: str):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "g.toml"
        path.write_text(text)
        return load_for_drawing(path)


def _front_boxes(svg: str) -> list[tuple[float, float, float, float]]:
    """(x, y, width, height) of every process box's front card (grey stroke 1.2)."""
    return [tuple(float(v) for v in re.findall(r'(?:x|y|width|height)="([\d.]+)"', line)[:4])
            for line in svg.splitlines() if line.startswith("<rect") and 'rx="6"' in line and 'stroke-width="1.2"' in line]


@pytest.mark.parametrize("devices", [None, '["cuda:0","cuda:0","cuda:0","cuda:1","cuda:1","cuda:1"]'])
def test_six_replicas_read_well(tmp_path, monkeypatch, devices):
    """Regression: a graph with 6 target replicas drew a strip 13-15 times as wide as
    tall (all devices on one line). Invariant: one stacked box with a x6 badge whose replicas are
    listed one per row inside it, so the picture is about as wide as with one replica and under 8
    times as wide as tall; no process boxes overlap; every label lies inside the picture."""
    from csp.graph.svg import CW

    monkeypatch.setattr(shutil, "which", lambda name: None)
    graph = Path(__file__).resolve().parents[3] / "examples" / "qwen3-8b-h200x8-6to1.toml"
    sets = ["--set", f"process.target.devices={devices}"] if devices else []
    assert main([str(graph), "-o", str(tmp_path / "g.svg"), *sets]) == 0
    one = ["--set", "process.target.replicas=1", "--set", 'process.target.devices=["cuda:0"]']
    assert main([str(graph), "-o", str(tmp_path / "one.svg"), *one]) == 0
    svg = (tmp_path / "g.svg").read_text()
    width, height, texts = _svg_geometry(svg)
    words = [t for _, _, t in texts]
    assert "x6" in words and "6 replicas" in words and words.count("target") == 1
    devs = [f"cuda:{i}" for i in range(6)] if devices is None else ["cuda:0"] * 3 + ["cuda:1"] * 3
    rows = [(x, y) for x, y, t in texts if t.startswith("target[")]
    assert [t for _, _, t in texts if t.startswith("target[")] == [f"target[{i}]  {d}" for i, d in enumerate(devs)]
    assert len({x for x, _ in rows}) == 1 and all(b[1] - a[1] > 12 for a, b in zip(rows, rows[1:]))  # stacked
    one_width = _svg_geometry((tmp_path / "one.svg").read_text())[0]
    assert width <= one_width + 40 and width / height < 8, (width, height, one_width)  # 40: the cards behind
    assert all(0 <= x and x + len(t) * CW <= width + 1 and 0 < y <= height for x, y, t in texts)
    boxes = _front_boxes(svg)
    target_box = next(b for b in boxes if b[0] < rows[0][0] < b[0] + b[2] and b[1] < rows[0][1] < b[1] + b[3])
    assert all(target_box[1] < y <= target_box[1] + target_box[3] for _, y in rows)  # rows inside their box
    for i, (x1, y1, w1, h1) in enumerate(boxes):
        for x2, y2, w2, h2 in boxes[i + 1:]:
            assert x1 + w1 <= x2 or x2 + w2 <= x1 or y1 + h1 <= y2 or y2 + h2 <= y1, "boxes overlap"


def test_engine_dot_without_graphviz_writes_dot_and_says_how(graph_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main([str(graph_file), "-o", str(tmp_path / "g.svg"), "--engine", "dot"]) == 1
    err = capsys.readouterr().err
    assert "apt-get install graphviz" in err and "dot -Tsvg" in err
    assert not (tmp_path / "g.svg").exists()
    assert (tmp_path / "g.dot").read_text().startswith("digraph csp {")


def test_png_without_dot_or_cairosvg_writes_the_svg_and_says_how(graph_file, tmp_path, monkeypatch, capsys):
    """Invariant: PNG needs dot or cairosvg; with neither, the SVG is written and one line says how."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "cairosvg", None)
    assert main([str(graph_file), "-o", str(tmp_path / "g.png")]) == 1
    err = capsys.readouterr().err.strip()
    assert "pip install cairosvg" in err and err.count("\n") == 0
    assert (tmp_path / "g.svg").read_text().startswith("<svg") and not (tmp_path / "g.png").exists()


@pytest.mark.parametrize("output, engine, fallback", [("g.png", "auto", "g.svg"), ("g.svg", "dot", "g.dot")])
def test_an_existing_fallback_file_is_not_overwritten(graph_file, tmp_path, monkeypatch, capsys,
                                                      output, engine, fallback):
    """Regression (fresh-user run): ``-o g.png`` without Graphviz or cairosvg silently overwrote an
    existing g.svg (its fallback). Invariant: a fallback file the user did not name is never
    overwritten; one line says so and how to proceed, exit 2, nothing is written."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "cairosvg", None)
    (tmp_path / fallback).write_text("mine")
    assert main([str(graph_file), "-o", str(tmp_path / output), "--engine", engine]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{tmp_path / fallback} already exists and was not overwritten" in err
    assert f"pass -o {tmp_path / fallback} to replace it" in err, err
    assert (tmp_path / fallback).read_text() == "mine" and not (tmp_path / output).exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` not installed")
def test_svg_with_graphviz(graph_file, tmp_path):
    assert main([str(graph_file), "-o", str(tmp_path / "g.svg")]) == 0
    svg = (tmp_path / "g.svg").read_text()
    assert "<svg" in svg and "batches [cap 4]" in svg


def test_unknown_output_suffix_is_a_usage_error(graph_file, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main([str(graph_file), "-o", str(tmp_path / "g.txt")])
    assert exc.value.code == 2


def test_the_default_graph_draws_narrow_enough_to_read(tmp_path, monkeypatch):
    """Regression: ``python -m csp.graph examples/dflash-tiny.toml -o graph.png`` drew the six
    stages in one row, 3,412 px wide (5,446 with --run). Invariant: its SVG, which the PNG renders
    at twice the size, is at most 800 px wide, and taller than wide (a stage per row)."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    graph = Path(__file__).resolve().parents[3] / "examples" / "dflash-tiny.toml"
    assert main([str(graph), "-o", str(tmp_path / "g.svg")]) == 0
    width, height, _ = _svg_geometry((tmp_path / "g.svg").read_text())
    assert width <= 800 and height > width, (width, height)
