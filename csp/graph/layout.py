"""Where the parts of a graph picture go: process boxes in rows, top to bottom, and each channel's
route and label box. Units: pixels of the SVG (:mod:`csp.graph.svg` draws what this places;
``python -m csp.graph -o g.png`` renders that SVG at twice the scale).

Rows. A process's row is its longest path from the graph's sources, once each cycle is broken
at the edge that closes it (:func:`back_edges`). Rows run top to bottom, so a pipeline of six
stages is six rows about as wide as its widest stage, not one row six stages wide. Between two
process rows lies a row of labels: the label of a channel is a box of its own on the channel's
route, just under its writer, placed like a process box, so no label lies on a box or on another
label. A channel that skips rows crosses each of them in a narrow slot of its own (the dummy
nodes of layered drawing: Sugiyama, Tagawa and Toda, 1981), so it passes beside the boxes of those
rows, never through one.

Order and position. Within a row, items are ordered by the mean position of their neighbours in
the row above, then below, then above again (the barycenter heuristic), which keeps the routes
of fan-out and fan-in from crossing. Each item then moves towards the mean centre of its
neighbours above and below, keeping its row's order and spacing (twelve sweeps, each the mean of a
left-to-right and a right-to-left placement), which straightens chains.

Cycles. A channel that closes a cycle (its reader is not below its writer) runs in a lane of its
own right of the picture: down out of its writer, along the gap under the writer's row to its
lane, along the lane to the gap above the reader's row, and into the reader from above. Its
label stands in its lane, right of the line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GAP_X = 24.0  # px between the boxes of a row
GAP_Y = 20.0  # px between a row and the next: room for the curves and an arrowhead
VIA_W = 8.0  # px, the slot a channel takes in a row it passes
LANE_GAP = 24.0  # px left of each lane of a cycle-closing channel
ARROW = 6.0  # px a route stops short of its reader's box (the arrowhead fills them)
SWEEPS = 12  # passes moving items towards their neighbours (alternately down and up the rows)

__all__ = ["Box", "Layout", "Route", "back_edges", "layers", "layout"]


@dataclass(frozen=True)
class Box:
    """An axis-aligned rectangle: top-left corner ``(x, y)``, width ``w``, height ``h`` (px)."""

    x: float
    y: float
    w: float
    h: float

    def overlaps(self, other: Box) -> bool:
        """True when the two share more than an edge."""
        return (self.x < other.x + other.w and other.x < self.x + self.w
                and self.y < other.y + other.h and other.y < self.y + self.h)


@dataclass(frozen=True)
class Route:
    """One channel's line: SVG path data ``d`` (px) ending ``ARROW`` px short of its reader, and
    the arrowhead's tip ``(x, y)`` with its direction in degrees (0 = right, 90 = down)."""

    d: str
    tip: tuple[float, float, float]


@dataclass
class Layout:
    """A placed graph: ``width`` x ``height`` px, margins included; ``boxes`` by node name (every
    node, channel-end points too); ``labels`` and ``routes`` in the order of the edges given."""

    width: float
    height: float
    boxes: dict[str, Box]
    labels: list[Box]
    routes: list[Route]


@dataclass
class _Item:
    """A box in a row: a node, a label, or a channel's slot in a row it passes (``w`` x ``h`` px)."""

    key: tuple
    w: float
    h: float
    row: int
    x: float = 0.0
    y: float = 0.0
    up: list[_Item] = field(default_factory=list)
    down: list[_Item] = field(default_factory=list)

    @property
    def cx(self) -> float:
        return self.x + self.w / 2


def back_edges(nodes: list[str], edges: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """The edges that close a cycle: those a depth-first search, started from the nodes in file
    order, finds pointing at a node still on its path (self-loops included). Without them the
    graph is acyclic."""
    adj: dict[str, list[str]] = {n: [] for n in nodes}
    for s, d in edges:
        adj[s].append(d)
    state: dict[str, int] = {}  # 1: on the search's path, 2: done
    back: set[tuple[str, str]] = set()
    for root in nodes:
        if root in state:
            continue
        state[root] = 1
        path = [(root, iter(adj[root]))]
        while path:
            n, nexts = path[-1]
            for m in nexts:
                if state.get(m) == 1:
                    back.add((n, m))
                elif m not in state:
                    state[m] = 1
                    path.append((m, iter(adj[m])))
                    break
            else:
                state[n] = 2
                path.pop()
    return back


def layers(nodes: list[str], edges: list[tuple[str, str]]) -> dict[str, int]:
    """Row per node: its longest path from a node no edge enters (networkx's topological
    generations), once the edges that close a cycle (:func:`back_edges`) are set aside, so every
    other edge points down at least one row."""
    import networkx as nx

    back = back_edges(nodes, edges)
    g = nx.DiGraph()
    g.add_nodes_from(nodes)
    g.add_edges_from(e for e in edges if e not in back)
    return {n: i for i, gen in enumerate(nx.topological_generations(g)) for n in gen}


def _order(rows: list[list[_Item]]) -> None:
    """Sort each row by the mean index of its items' neighbours: down, up, down (stable for ties)."""
    def sweep(indices: range, side: str) -> None:
        for r in indices:
            here = {id(it): k for k, it in enumerate(rows[r])}

            def bary(it: _Item) -> float:
                nbs = getattr(it, side)
                return sum(pos[id(n)] for n in nbs) / len(nbs) if nbs else float(here[id(it)])

            pos = {id(it): k for k, it in enumerate(rows[r - 1 if side == "up" else r + 1])}
            rows[r].sort(key=bary)

    for indices, side in ((range(1, len(rows)), "up"), (range(len(rows) - 2, -1, -1), "down"),
                          (range(1, len(rows)), "up")):
        sweep(indices, side)


def _place(row: list[_Item], want: list[float]) -> None:
    """Set the row's x to ``want`` as nearly as its order and spacing allow: the mean of a
    left-to-right and a right-to-left placement (both keep order and ``GAP_X``, so their mean does)."""
    n = len(row)
    right, left = [0.0] * n, [0.0] * n
    for i in range(n):
        right[i] = want[i] if i == 0 else max(want[i], right[i - 1] + row[i - 1].w + GAP_X)
    for i in range(n - 1, -1, -1):
        left[i] = want[i] if i == n - 1 else min(want[i], left[i + 1] - row[i].w - GAP_X)
    for i, it in enumerate(row):
        it.x = (right[i] + left[i]) / 2


def _ports(n: int, box: Box) -> list[float]:
    """x of ``n`` routes leaving (or entering) ``box``, spread evenly across it."""
    return [box.x + box.w * (i + 1) / (n + 1) for i in range(n)]


def _curve(a: tuple[float, float], b: tuple[float, float]) -> str:
    """SVG path data from ``a`` to ``b`` (below it): an S-curve, or a straight line where the two
    are within a few px across (a curve there reads as a wobble)."""
    if abs(a[0] - b[0]) < 4:
        return f" L{b[0]:.1f},{b[1]:.1f}"
    my = (a[1] + b[1]) / 2
    return f" C{a[0]:.1f},{my:.1f} {b[0]:.1f},{my:.1f} {b[0]:.1f},{b[1]:.1f}"


def layout(sizes: dict[str, tuple[float, float]], edges: list[tuple[str, str]],
           label_sizes: list[tuple[float, float]], margin: float = 20.0) -> Layout:
    """Place a graph.

    Args:
        sizes: ``name -> (width, height)`` of every node's box (px), in file order.
        edges: ``(writer, reader)`` node names, one per route, in draw order.
        label_sizes: ``(width, height)`` of each edge's label box (px).
        margin: px around the picture.
    """
    names = list(sizes)
    layer = layers(names, edges)
    n_rows = 2 * (max(layer.values(), default=-1) + 1) - 1
    rows: list[list[_Item]] = [[] for _ in range(max(n_rows, 0))]

    def add(key: tuple, wh: tuple[float, float], row: int) -> _Item:
        it = _Item(key, wh[0], wh[1], row)
        rows[row].append(it)
        return it

    node = {n: add(("node", n), sizes[n], 2 * layer[n]) for n in names}
    chains: dict[int, list[_Item]] = {}
    lanes: list[int] = []
    for k, (s, d) in enumerate(edges):
        if layer[d] <= layer[s]:
            lanes.append(k)
            continue
        chain = [node[s], add(("label", k), label_sizes[k], 2 * layer[s] + 1)]
        chain += [add(("via", k, r), (VIA_W, 0.0), r) for r in range(2 * layer[s] + 2, 2 * layer[d])]
        chain.append(node[d])
        for a, b in zip(chain, chain[1:]):
            a.down.append(b)
            b.up.append(a)
        chains[k] = chain
    _order(rows)

    # rows top to bottom; the gap above the first row takes the lanes' entries into it
    top = margin + (GAP_Y if lanes else 0.0)
    row_top, row_h = [], []
    for row in rows:
        h = max((it.h for it in row), default=0.0)
        row_top.append(top)
        row_h.append(h)
        for it in row:
            it.y = top + (h - it.h) / 2
        top += h + GAP_Y

    # x: packed and centred, then each item drawn towards its neighbours
    widths = [sum(it.w for it in row) + GAP_X * (len(row) - 1) for row in rows]
    widest = max(widths, default=0.0)
    for row, w in zip(rows, widths):
        x = (widest - w) / 2
        for it in row:
            it.x, x = x, x + it.w + GAP_X
    for sweep in range(SWEEPS):
        for r in (range(len(rows)) if sweep % 2 == 0 else range(len(rows) - 1, -1, -1)):
            want = [(sum(n.cx for n in it.up + it.down) / len(it.up + it.down) if it.up or it.down else it.cx)
                    - it.w / 2 for it in rows[r]]
            _place(rows[r], want)
    left = min((it.x for row in rows for it in row), default=0.0)
    for row in rows:
        for it in row:
            it.x += margin - left
    right = max((it.x + it.w for row in rows for it in row), default=margin)

    boxes = {n: Box(it.x, it.y, it.w, it.h) for n, it in node.items()}
    labels: list[Box | None] = [None] * len(edges)
    for k, chain in chains.items():
        labels[k] = Box(chain[1].x, chain[1].y, chain[1].w, chain[1].h)
    lane_x: dict[int, float] = {}
    x = right + LANE_GAP
    for k in lanes:
        lane_x[k] = x
        x += 6 + label_sizes[k][0] + LANE_GAP

    # ports: a node's routes leave its bottom (enter its top) in the order of where they go (come from)
    def toward(k: int, out: bool) -> float:
        if k in lane_x:
            return lane_x[k]
        return chains[k][1].cx if out else chains[k][-2].cx

    port_out: dict[int, float] = {}
    port_in: dict[int, float] = {}
    for n in names:
        outs = sorted((k for k, (s, _) in enumerate(edges) if s == n), key=lambda k: toward(k, True))
        port_out.update(zip(outs, _ports(len(outs), boxes[n])))
        ins = sorted((k for k, (_, d) in enumerate(edges) if d == n), key=lambda k: toward(k, False))
        port_in.update(zip(ins, _ports(len(ins), boxes[n])))

    routes: list[Route | None] = [None] * len(edges)
    bottom = (top - GAP_Y if rows else top) + margin  # the last row's bottom, then the margin
    for k, chain in chains.items():
        src, dst = boxes[edges[k][0]], boxes[edges[k][1]]
        start = (port_out[k], src.y + src.h)
        d, at = f"M{start[0]:.1f},{start[1]:.1f}", start
        for it in chain[1:-1]:  # a label is crossed from its top to its bottom, a slot from row top to bottom
            y0, y1 = (it.y, it.y + it.h) if it.key[0] == "label" else (row_top[it.row], row_top[it.row] + row_h[it.row])
            d += _curve(at, (it.cx, y0)) + f" L{it.cx:.1f},{y1:.1f}"
            at = (it.cx, y1)
        d += _curve(at, (port_in[k], dst.y - ARROW))
        routes[k] = Route(d, (port_in[k], dst.y, 90.0))
    for j, k in enumerate(lanes):
        s, t = edges[k]
        src, dst = boxes[s], boxes[t]
        lx = lane_x[k]
        y_out = row_top[2 * layer[s]] + row_h[2 * layer[s]] + 4 + 4 * (j % 4)  # in the gaps, apart
        y_in = row_top[2 * layer[t]] - 4 - 4 * (j % 4)
        d = (f"M{port_out[k]:.1f},{src.y + src.h:.1f} L{port_out[k]:.1f},{y_out:.1f} L{lx:.1f},{y_out:.1f} "
             f"L{lx:.1f},{y_in:.1f} L{port_in[k]:.1f},{y_in:.1f} L{port_in[k]:.1f},{dst.y - ARROW:.1f}")
        routes[k] = Route(d, (port_in[k], dst.y, 90.0))
        lw, lh = label_sizes[k]
        labels[k] = Box(lx + 6, (y_out + y_in) / 2 - lh / 2, lw, lh)
        bottom = max(bottom, y_out + margin)
    width = max([right + margin] + [b.x + b.w + margin for b in labels if b is not None])
    return Layout(width, bottom, boxes, labels, routes)  # type: ignore[arg-type]
