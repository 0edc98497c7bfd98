"""Draw a graph file as SVG in pure Python: no Graphviz needed (``python -m csp.graph G.toml -o g.svg``).

Layout (:mod:`csp.graph.layout`): processes are boxes in rows, top to bottom, a row per stage (its
longest path from the sources), so a pipeline of six stages is six rows, not one row six stages
wide; a channel that closes a cycle runs up a lane right of the picture. Each channel's label is
a box of its own on its arrow, under its writer, clear of every process box and every other label.

Drawing: a box lists the process name, kind, replicas and devices (the lines of
:func:`csp.graph.draw._node_lines`); a process with replicas is drawn as a stack of cards with a ``xN``
badge, its replicas listed one per row inside it (``target[3]  cuda:3``), so many replicas make
the box taller, not the picture wider (a 6-replica target once drew one long device line). A
channel is an arrow labelled with its name, capacity and ``ordered``; a fan-out or fan-in draws
one arrow per writer/reader pair. With a run summary (``--run RUN_DIR``): arrows carry the
average/peak fill as a bar and the blocked/wait percentages, boxes their busy/waiting/blocked
split and each replica row its busy bar and percentage, the verdict is the title, and the
bottleneck box (and a head-of-line blocked channel, and the slow replica's row) is red.

Text is set in a monospace font so its width is known without a font library (0.6 em per
character), which keeps every label inside its box in any viewer.
"""

from __future__ import annotations

import textwrap
from typing import Any, Callable
from xml.sax.saxutils import escape

from csp.graph.schema import GraphSpec
from csp.observe.backpressure import ChannelSummary, ProcessSummary, Summary
from csp.graph.layout import Layout, layout

FONT = 12.0  # px
CW = FONT * 0.6  # px per character (monospace)
LH = FONT * 1.35  # px per text line
PAD = 8.0  # px inside boxes and labels
MARGIN = 20.0
BAR_W = 60.0  # px, a replica row's busy bar
RED, RED_FILL, GREY = "#d62728", "#fde0dd", "#555555"


def _w(lines: list[str]) -> float:
    return max((len(s) for s in lines), default=0) * CW + 2 * PAD


def _fill_color(frac: float) -> str:
    return "#2ca02c" if frac < 0.5 else "#ff7f0e" if frac < 0.85 else RED


def measure(nodes: dict[str, dict[str, Any]], edges: list[dict[str, Any]]) -> Layout:
    """Where every box, label and arrow of the picture goes (:func:`csp.graph.layout.layout`; the
    arguments are :func:`render_svg`'s), before the title: the title's lines add to the height."""
    size: dict[str, tuple[float, float]] = {}
    for n, spec in nodes.items():
        if spec.get("point"):
            size[n] = (10.0, 10.0)
            continue
        rows = spec.get("replica_rows") or []
        h = (len(spec["lines"]) + len(rows)) * LH + 2 * PAD + (4.0 if rows else 0.0)
        row_w = _row_w(rows)
        stack = 8.0 if spec.get("replicas", 1) > 1 else 0.0
        size[n] = (max(_w(spec["lines"]), row_w, 14 * CW + 2 * PAD) + stack, h + stack)
    label_size = [(_w(e["lines"]), len(e["lines"]) * LH + 2 * PAD + (10 if e.get("fill") is not None else 0))
                  for e in edges]
    return layout(size, [(e["src"], e["dst"]) for e in edges], label_size, margin=MARGIN)


def render_svg(nodes: dict[str, dict[str, Any]], edges: list[dict[str, Any]], title: str | None = None) -> str:
    """The SVG text of a graph.

    Args:
        nodes: ``name -> {"lines": [str], "replicas": int, "red": bool, "point": bool,
            "replica_rows": [(label, busy_frac | None, red)]}``; a ``point`` is a channel end
            with no process (drawn as a dot); ``replica_rows`` are drawn one per line under
            ``lines`` (``label`` starts with the replica's qualname, e.g. "target[2]  cuda:2"),
            with a busy bar when ``busy_frac`` is given.
        edges: ``{"src", "dst", "lines": [str], "fill": float | None, "red": bool}`` in draw order.
        title: a line (wrapped to the picture's width) above the graph, or None.
    """
    placed = measure(nodes, edges)
    total_w = placed.width
    head = textwrap.wrap(title, max(int((total_w - 2 * MARGIN) / (CW * 1.1)), 40)) if title else []
    shift = len(head) * LH * 1.1 + 10 if head else 0.0  # the title's lines, above the graph
    total_w = max(total_w, 2 * MARGIN + max((len(line) for line in head), default=0) * CW * 1.1)

    parts: list[str] = []
    for e, route in zip(edges, placed.routes):  # every arrow first: labels and boxes go over them
        color = RED if e.get("red") else GREY
        width = 2.5 if e.get("red") else 1.4
        parts.append(f'<path d="{route.d}" fill="none" stroke="{color}" stroke-width="{width}"/>')
        ax, ay, rot = route.tip
        parts.append(f'<path d="M0,0 L-9,-4.5 L-9,4.5 Z" fill="{color}" '
                     f'transform="translate({ax:.1f},{ay:.1f}) rotate({rot:.0f})"/>')
    for e, box in zip(edges, placed.labels):
        bx, by, lw, lh = box.x, box.y, box.w, box.h
        parts.append(f'<rect x="{bx:.1f}" y="{by:.1f}" width="{lw:.1f}" height="{lh:.1f}" rx="4" '
                     f'fill="white" stroke="{RED if e.get("red") else "#cccccc"}" stroke-width="0.8"/>')
        parts += _text(e["lines"], bx + PAD, by + PAD, bold_first=True)
        if e.get("fill") is not None:
            frac = min(max(e["fill"], 0.0), 1.0)
            fy = by + lh - PAD - 6
            parts.append(f'<rect x="{bx + PAD:.1f}" y="{fy:.1f}" width="{lw - 2 * PAD:.1f}" height="6" '
                         f'fill="#eeeeee" stroke="#bbbbbb" stroke-width="0.5"/>')
            parts.append(f'<rect x="{bx + PAD:.1f}" y="{fy:.1f}" width="{(lw - 2 * PAD) * frac:.1f}" '
                         f'height="6" fill="{_fill_color(frac)}"/>')

    for n, spec in nodes.items():
        box = placed.boxes[n]
        x0, y0, w, h = box.x, box.y, box.w, box.h
        if spec.get("point"):
            parts.append(f'<circle cx="{x0 + 5:.1f}" cy="{y0 + 5:.1f}" r="4" fill="{GREY}"/>')
            continue
        red = spec.get("red")
        stroke, fill, sw = (RED, RED_FILL, 2.5) if red else (GREY, "#f5f5f5", 1.2)
        reps = spec.get("replicas", 1)
        if reps > 1:
            w, h = w - 8, h - 8
            for off in (8, 4):
                parts.append(f'<rect x="{x0 + off:.1f}" y="{y0 + off:.1f}" width="{w:.1f}" height="{h:.1f}" '
                             f'rx="6" fill="{fill}" stroke="{stroke}" stroke-width="{sw * 0.6:.2f}"/>')
        parts.append(f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{w:.1f}" height="{h:.1f}" rx="6" '
                     f'fill="{fill}" stroke="{stroke}" stroke-width="{sw}"/>')
        if reps > 1:
            badge = f"x{reps}"
            bw = len(badge) * CW + 8
            parts.append(f'<rect x="{x0 + w - bw - 4:.1f}" y="{y0 + 4:.1f}" width="{bw:.1f}" height="{LH:.1f}" '
                         f'rx="{LH / 2:.1f}" fill="{stroke}"/>')
            parts.append(f'<text x="{x0 + w - bw / 2 - 4:.1f}" y="{y0 + 4 + LH * 0.78:.1f}" fill="white" '
                         f'text-anchor="middle" font-weight="bold">{escape(badge)}</text>')
        parts += _text(spec["lines"], x0 + PAD, y0 + PAD, bold_first=True)
        parts += _replica_rows(spec.get("replica_rows") or [], x0 + PAD, y0 + PAD + len(spec["lines"]) * LH + 4)

    total_h = placed.height + shift
    title_svg = _text(head, MARGIN, MARGIN, bold_first=False, weight="bold", size=FONT * 1.1) if head else []
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w:.0f}" height="{total_h:.0f}" '
        f'viewBox="0 0 {total_w:.0f} {total_h:.0f}" font-family="DejaVu Sans Mono, Menlo, Consolas, monospace" '
        f'font-size="{FONT:g}px">',
        '<rect width="100%" height="100%" fill="white"/>',
        *title_svg, f'<g transform="translate(0,{shift:.1f})">', *parts, "</g>", "</svg>", ""])


def _row_w(rows: list[tuple[str, float | None, bool]]) -> float:
    """Width (px) of replica rows: the longest label, then a busy bar and "100%" when measured."""
    if not rows:
        return 0.0
    bar = 8 + BAR_W + 6 + 4 * CW if any(busy is not None for _, busy, _ in rows) else 0.0
    return max(len(label) for label, _, _ in rows) * CW + bar + 2 * PAD


def _replica_rows(rows: list[tuple[str, float | None, bool]], x: float, y: float) -> list[str]:
    """One line per replica from (x, y): its label, and its busy bar and percentage if measured
    (red for the slow replica the verdict names)."""
    out: list[str] = []
    label_w = max((len(label) for label, _, _ in rows), default=0) * CW
    for i, (label, busy, slow) in enumerate(rows):
        ry = y + i * LH
        color = RED if slow else "#333333"
        out.append(f'<text x="{x:.1f}" y="{ry + LH * 0.78:.1f}" fill="{color}" xml:space="preserve">'
                   f'{escape(label)}</text>')
        if busy is None:
            continue
        frac = min(max(busy, 0.0), 1.0)
        bx, qual = x + label_w + 8, escape(label.split()[0])
        out.append(f'<rect x="{bx:.1f}" y="{ry + 3:.1f}" width="{BAR_W:.1f}" height="{LH - 6:.1f}" fill="#eeeeee" '
                   f'stroke="#bbbbbb" stroke-width="0.5"><title>{qual}</title></rect>')
        out.append(f'<rect x="{bx:.1f}" y="{ry + 3:.1f}" width="{BAR_W * frac:.1f}" height="{LH - 6:.1f}" '
                   f'fill="{RED if slow else "#1f77b4"}"><title>{qual}: busy {100 * busy:.0f}%</title></rect>')
        out.append(f'<text x="{bx + BAR_W + 6:.1f}" y="{ry + LH * 0.78:.1f}" fill="{color}">{100 * frac:.0f}%</text>')
    return out


def _text(lines: list[str], x: float, y: float, *, bold_first: bool, weight: str = "normal",
          size: float = FONT) -> list[str]:
    out = []
    lh = LH * size / FONT
    for i, line in enumerate(lines):
        w = "bold" if (bold_first and i == 0) else weight
        out.append(f'<text x="{x:.1f}" y="{y + lh * (i + 0.78):.1f}" font-weight="{w}"'
                   f'{f" font-size={chr(34)}{size:g}px{chr(34)}" if size != FONT else ""} '
                   f'xml:space="preserve">{escape(line)}</text>')
    return out


def graph_svg(spec: GraphSpec, summary: Summary | None, node_lines: Callable[..., list[str]],
              edge_lines: Callable[..., list[str]], edge_pairs: Callable[..., Any]) -> str:
    """SVG of a :class:`csp.GraphSpec` (see :mod:`csp.graph.draw` for the line builders and pairs)."""
    return render_svg(*graph_parts(spec, summary, node_lines, edge_lines, edge_pairs))


def graph_parts(spec: GraphSpec, summary: Summary | None, node_lines: Callable[..., list[str]],
                edge_lines: Callable[..., list[str]], edge_pairs: Callable[..., Any]
                ) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]], str | None]:
    """``(nodes, edges, title)`` of a :class:`csp.GraphSpec`, as :func:`render_svg` and :func:`measure` take them."""
    chans: dict[str, ChannelSummary] = {c.name: c for c in summary.channels} if summary else {}
    procs: dict[str, ProcessSummary] = {p.name: p for p in summary.processes} if summary else {}
    verdict = summary.verdict if summary else None
    nodes: dict[str, dict[str, Any]] = {}
    for p in spec.process:
        st = procs.get(p.name)
        lines, rows = node_lines(p, st), []
        if p.replicas > 1:  # the devices go on the replica rows, not on one long line
            lines = [f"{p.replicas} replicas" if k == 2 else line for k, line in enumerate(lines)]
            devs = p.devices or [p.device] * p.replicas
            busy = {r.qualname: r.busy_frac for r in st.replicas} if st is not None else {}
            names = [f"{p.name}[{i}]" for i in range(p.replicas)]
            width = max(len(q) for q in names)
            rows = [(f"{q:<{width}}  {d}" if d else q, busy.get(q),
                     verdict is not None and verdict.replica == q) for q, d in zip(names, devs)]
        nodes[p.name] = {"lines": lines, "replicas": p.replicas, "replica_rows": rows,
                         "red": verdict is not None and verdict.stage == p.name}
    caps = {c.name: c for c in spec.channel}
    edges = []
    for i, (w, r, name) in enumerate(edge_pairs(spec)):
        ends = []
        for end, role in ((w, "from"), (r, "to")):
            if end is None:
                end = f"__{role}_{name}_{i}"
                nodes[end] = {"point": True, "lines": []}
            ends.append(end)
        c, st = caps[name], chans.get(name)
        edges.append({"src": ends[0], "dst": ends[1], "lines": edge_lines(name, c.capacity, c.ordered, st),
                      "fill": (st.fill_avg / c.capacity if st is not None and c.capacity else None),
                      "red": verdict is not None and verdict.channel == name})
    return nodes, edges, verdict.text if verdict else None


__all__ = ["graph_parts", "graph_svg", "measure", "render_svg"]
