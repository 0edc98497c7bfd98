"""csp.graph.layout: where a graph picture's boxes, labels and arrows go, checked on the layout's
own geometry (no rendering): the default dflash graph fits a readable width, no label lies on a
box or on another label, a channel that skips rows passes beside their boxes, cycles go up a lane."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from csp.observe.backpressure import ChannelSummary, ProcessSummary, ReplicaSummary, Summary, Verdict
from csp.graph.draw import _edge_lines, _edges, _node_lines, load_for_drawing
from csp.graph.layout import Box, back_edges, layers, layout
from csp.graph.svg import graph_parts, measure

ROOT = Path(__file__).resolve().parents[3]
PNG_SCALE = 2.0  # python -m csp.graph -o g.png renders the SVG at twice its size (csp.graph.draw)


def _busiest(spec) -> Summary:
    """A run summary of ``spec`` with the widest numbers each label and box can show (100%, a
    full channel), so the picture is as wide as a measured run of that graph can make it."""
    chans = [ChannelSummary(name=c.name, capacity=c.capacity, writers=[], readers=[], fill_now=c.capacity,
                            fill_avg=c.capacity - 0.05, fill_peak=c.capacity, send_blocked_frac=1.0,
                            receive_wait_frac=1.0, items_per_s=1e6, bytes_per_s=1e9, ordered=c.ordered)
             for c in spec.channel]
    procs = [ProcessSummary(name=p.name, busy_frac=1.0, wait_input_frac=1.0, blocked_output_frac=1.0,
                            items_in_per_s=1e6, items_out_per_s=1e6,
                            replicas=[ReplicaSummary(qualname=f"{p.name}[{i}]", name=p.name, replica=i, state="running",
                                                     alive_s=1e4, busy_frac=1.0, wait_input_frac=1.0,
                                                     blocked_output_frac=1.0, items_in_per_s=1e6, items_out_per_s=1e6)
                                      for i in range(p.replicas)])
             for p in spec.process]
    verdict = Verdict(text="bottleneck: drafter (busy 100%; monitor waits 100% on 'metrics'; prefetch blocked "
                           "100% on 'batches'): add replicas or a faster device", stage="drafter")
    return Summary(t_start=0.0, t_end=1e4, elapsed_s=1e4, samples=10_000, status="completed", exit_code=0,
                   channels=chans, processes=procs, verdict=verdict)


def _placed(graph: Path, annotated: bool):
    spec = load_for_drawing(graph)
    return measure(*graph_parts(spec, _busiest(spec) if annotated else None, _node_lines, _edge_lines, _edges)[:2])


def _route_points(d: str) -> list[tuple[float, float]]:
    """The points a route passes through: every M/L end and every C segment's end (not its controls)."""
    points = []
    for cmd, args in re.findall(r"([MLC])([^MLC]*)", d):
        nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", args)]
        points.append((nums[-2], nums[-1]))
    return points


def _inside(p: tuple[float, float], b: Box) -> bool:
    return b.x < p[0] < b.x + b.w and b.y < p[1] < b.y + b.h


@pytest.mark.parametrize("annotated", [False, True], ids=["plain", "with-run"])
def test_the_default_graph_is_narrow_and_no_label_is_hidden(annotated):
    """Regression: the default graph (examples/dflash-tiny.toml, six stages) was drawn as one row
    5,446 px wide as a PNG with a run's numbers (3,412 without), and the label of drafter ->
    monitor, placed halfway along an arrow that skips the evaluator's column, lay under the
    evaluator's box. Invariant: the PNG is at most 1,600 px wide; no label box overlaps a process
    box or another label; a route passes no box but its two ends."""
    placed = _placed(ROOT / "examples" / "dflash-tiny.toml", annotated)
    assert placed.width * PNG_SCALE <= 1600, placed.width
    boxes = placed.boxes
    for k, label in enumerate(placed.labels):
        for name, box in boxes.items():
            assert not label.overlaps(box), (k, name)
        for j, other in enumerate(placed.labels[:k]):
            assert not label.overlaps(other), (j, k)
    spec = load_for_drawing(ROOT / "examples" / "dflash-tiny.toml")
    for (src, dst, name), route in zip(_edges(spec), placed.routes):
        for point in _route_points(route.d):
            hit = [n for n, b in boxes.items() if n not in (src, dst) and _inside(point, b)]
            assert not hit, (name, src, dst, hit)
    drafter, evaluator, monitor = boxes["drafter"], boxes["evaluator"], boxes["monitor"]
    assert drafter.y + drafter.h < evaluator.y < evaluator.y + evaluator.h < monitor.y  # a stage per row


def test_a_six_stage_chain_is_as_wide_as_its_widest_stage():
    """Invariant: the rows run down, so more stages make the picture taller, not wider."""
    sizes = {f"stage{i}": (200.0, 60.0) for i in range(6)}
    edges = [(f"stage{i}", f"stage{i + 1}") for i in range(5)]
    placed = layout(sizes, edges, [(260.0, 30.0)] * 5, margin=20.0)
    assert placed.width == pytest.approx(260.0 + 40.0)
    xs = {round(b.x + b.w / 2, 1) for b in [*placed.boxes.values(), *placed.labels]}
    assert len(xs) == 1  # one straight column
    assert [n for n, _ in sorted(placed.boxes.items(), key=lambda kv: kv[1].y)] == list(sizes)


def test_fan_out_labels_sit_side_by_side_and_the_readers_under_them():
    """Invariant: one writer, two readers: each label on its own route, side by side, each reader
    under its own label (the routes do not cross)."""
    sizes = {"w": (120.0, 50.0), "a": (120.0, 50.0), "b": (120.0, 50.0)}
    placed = layout(sizes, [("w", "b"), ("w", "a")], [(150.0, 30.0), (90.0, 30.0)])
    la, lb = placed.labels[1], placed.labels[0]
    assert not la.overlaps(lb) and la.y == lb.y
    a, b = placed.boxes["a"], placed.boxes["b"]
    assert (la.x < lb.x) == (a.x < b.x)


def test_a_cycle_is_broken_at_its_closing_edge_which_runs_up_a_lane():
    """Invariant: a cycle's processes get rows of their own in the order of its channels; the
    channel that closes it is the only one drawn up, in a lane right of every box, its label there."""
    nodes = ["src", "b", "c", "a"]
    edges = [("src", "b"), ("b", "c"), ("c", "a"), ("a", "b")]
    assert back_edges(nodes, edges) == {("a", "b")}
    assert layers(nodes, edges) == {"src": 0, "b": 1, "c": 2, "a": 3}
    assert back_edges(["x"], [("x", "x")]) == {("x", "x")}
    placed = layout({n: (100.0, 40.0) for n in nodes}, edges, [(80.0, 30.0)] * 4)
    right = max(b.x + b.w for b in placed.boxes.values())
    lane_label = placed.labels[3]
    assert lane_label.x > right and all(not lane_label.overlaps(b) for b in placed.labels[:3])
    tip_x, tip_y, angle = placed.routes[3].tip
    b = placed.boxes["b"]
    assert (tip_y, angle) == (b.y, 90.0) and b.x < tip_x < b.x + b.w  # into b from above
    assert placed.width >= lane_label.x + lane_label.w


def test_a_graph_with_no_process_is_an_empty_picture():
    placed = layout({}, [], [])
    assert (placed.boxes, placed.labels, placed.routes) == ({}, [], [])
    assert placed.width == placed.height == 40.0
