"""Draw a graph file: processes as nodes, channels as edges; SVG, PNG, DOT or Mermaid.

``python -m csp.graph GRAPH.toml -o graph.svg``::

    python -m csp.graph examples/dflash-tiny.toml -o graph.dot           # Graphviz DOT text
    python -m csp.graph examples/dflash-tiny.toml -o graph.mmd           # Mermaid (GitHub renders it)
    python -m csp.graph examples/dflash-tiny.toml -o graph.svg --run runs/dflash-tiny
    python -m csp.graph GRAPH.toml                                       # DOT on stdout

A node shows the process name, kind, replicas and devices; an edge shows the channel name and
capacity (``ordered`` when it is), one edge per writer -> reader pair (fan-in and fan-out draw
several). With ``--run RUN_DIR`` the measured numbers of :mod:`csp.observe.backpressure` are added: per
edge the average/peak fill, % of time senders were blocked and receivers waited; per node busy /
waiting / blocked %, and the bottleneck stage is drawn in red.

The file may be an application's graph file (dflash's has ``[run]``, ``[data]`` ...): tables other
than ``channel``, ``process``, ``trace`` and ``plugins`` are ignored, while those four keep their
strict schema (a typo in ``[[channel]]`` is still an error). Plugins are not imported: drawing needs
no process class.

SVG is drawn in pure Python (:mod:`csp.graph.svg`: a layered layout from networkx, SVG written here), so
``-o graph.svg`` works after ``pip install``; Graphviz's ``dot`` is used instead when it is on PATH
(``--engine dot`` to insist, ``--engine python`` to skip it). PNG and PDF come from ``dot``, or from
the Python SVG through cairosvg when that is importable (``pip install cairosvg``); with neither,
the SVG is written next to the requested file and the command says how to finish (exit status 1);
when that fallback file (``graph.svg`` for ``-o graph.png``; ``graph.dot`` for ``--engine dot``
without Graphviz) already exists, nothing is written and the command says so (exit status 2): a
file the user did not name is never overwritten. Exit status 2 also on a bad graph file or run
directory.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from csp.errors import DotNotFound, GraphError
from csp.graph.load import load_spec
from csp.graph.schema import GraphSpec, ProcessSpec
from csp.observe.backpressure import ChannelSummary, ProcessSummary, Summary

DOT_FORMATS = {"svg", "png", "pdf"}  # rendered by the `dot` program (or csp.graph.svg, + cairosvg)
EXIT_CODES = {0: "the file was written (or DOT/Mermaid printed)",
              1: "PNG/PDF asked for, but neither Graphviz's dot nor cairosvg is installed (the SVG was "
                 "written instead), or dot failed",
              2: "bad graph file, --set value or run directory, or that fallback SVG (DOT) file exists: "
                 "it is not\n     overwritten, nothing is written (name it with -o to replace it)"}


class DrawingSpec(GraphSpec, forbid_unknown_fields=False):
    """:class:`csp.GraphSpec` that ignores unknown top-level tables (an application's sections)."""


def load_for_drawing(path: str | Path, overrides: Sequence[str] = ()) -> GraphSpec:
    """Read a graph file for drawing. Raises GraphError (see :func:`csp.load_spec`)."""
    return load_spec(path, DrawingSpec, overrides)


def _devices(p: ProcessSpec) -> str:
    devs = p.devices or ([p.device] if p.device else [])
    if len(devs) > 2 and all(d.startswith("cuda:") and d[5:].isdigit() for d in devs):
        ids = [int(d[5:]) for d in devs]
        if ids == list(range(ids[0], ids[0] + len(ids))):
            return f"cuda:{ids[0]}..{ids[-1]}"
    return ", ".join(devs)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _node_lines(p: ProcessSpec, stats: ProcessSummary | None) -> list[str]:
    lines = [p.name, p.kind]
    where = ", ".join(filter(None, [f"{p.replicas} replicas" if p.replicas > 1 else "", _devices(p)]))
    if where:
        lines.append(where)
    if stats:
        lines.append(f"busy {_pct(stats.busy_frac)} wait {_pct(stats.wait_input_frac)} "
                     f"blocked {_pct(stats.blocked_output_frac)}")
    return lines


def _edge_lines(name: str, capacity: int, ordered: bool, stats: ChannelSummary | None) -> list[str]:
    lines = [f"{name} [cap {capacity}{', ordered' if ordered else ''}]"]
    if stats:
        lines.append(f"fill avg {stats.fill_avg:.1f} peak {stats.fill_peak}")
        lines.append(f"send blocked {_pct(stats.send_blocked_frac)}, "
                     f"recv wait {_pct(stats.receive_wait_frac)}")
    return lines


def _edges(spec: GraphSpec) -> list[tuple[str | None, str | None, str]]:
    """(writer, reader, channel) for every writer/reader pair; None where a channel has no end."""
    out: list[tuple[str | None, str | None, str]] = []
    for c in spec.channel:
        writers = [p.name for p in spec.process if c.name in p.outputs.values()] or [None]
        readers = [p.name for p in spec.process if c.name in p.inputs.values()] or [None]
        out += [(w, r, c.name) for w in writers for r in readers]
    return out


def _index(summary: Summary | None) -> tuple[dict[str, ChannelSummary], dict[str, ProcessSummary], str | None]:
    if summary is None:
        return {}, {}, None
    return ({c.name: c for c in summary.channels}, {p.name: p for p in summary.processes},
            summary.verdict.stage)


def _dq(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(spec: GraphSpec, summary: Summary | None = None) -> str:
    """The graph as Graphviz DOT text, top to bottom (a stage per rank, as :mod:`csp.graph.svg` draws
    it: a long pipeline stays narrow). ``summary`` adds measured numbers."""
    chans, procs, bottleneck = _index(summary)
    caps = {c.name: c for c in spec.channel}
    out = ["digraph csp {", '  rankdir=TB; fontname="Helvetica";',
           '  node [shape=box, style="rounded,filled", fillcolor="#f5f5f5", fontname="Helvetica"];',
           '  edge [fontname="Helvetica", fontsize=10];']
    if summary is not None:
        out.append(f"  label={_dq(summary.verdict.text)}; labelloc=t;")
    for p in spec.process:
        attrs = f"label={_dq(chr(10).join(_node_lines(p, procs.get(p.name))))}"
        if p.name == bottleneck:
            attrs += ', color="#d62728", penwidth=2.5, fillcolor="#fde0dd"'
        out.append(f"  {_dq(p.name)} [{attrs}];")
    for i, (w, r, name) in enumerate(_edges(spec)):
        c = caps[name]
        ends = []
        for end, role in ((w, "from"), (r, "to")):
            if end is None:
                end = f"__{role}_{name}_{i}"
                out.append(f'  {_dq(end)} [shape=point, label=""];')
            ends.append(end)
        label = "\n".join(_edge_lines(name, c.capacity, c.ordered, chans.get(name)))
        out.append(f"  {_dq(ends[0])} -> {_dq(ends[1])} [label={_dq(label)}];")
    out.append("}")
    return "\n".join(out) + "\n"


def _mq(s: str) -> str:
    return '"' + s.replace('"', "#quot;") + '"'


def to_mermaid(spec: GraphSpec, summary: Summary | None = None) -> str:
    """The graph as a Mermaid flowchart, top to bottom (renders in GitHub markdown inside a ```mermaid block)."""
    chans, procs, bottleneck = _index(summary)
    caps = {c.name: c for c in spec.channel}
    ids = {p.name: f"p{i}" for i, p in enumerate(spec.process)}
    out = ["flowchart TB"]
    if summary is not None:
        out.insert(0, f"%% {summary.verdict.text}")
    for p in spec.process:
        out.append(f"  {ids[p.name]}[{_mq('<br/>'.join(_node_lines(p, procs.get(p.name))))}]")
    for i, (w, r, name) in enumerate(_edges(spec)):
        c = caps[name]
        ends = []
        for end, role in ((w, "from"), (r, "to")):
            if end is None:
                ids[f"__{role}{i}"] = node = f"x{role}{i}"
                out.append(f"  {node}(( ))")
                ends.append(node)
            else:
                ends.append(ids[end])
        label = "<br/>".join(_edge_lines(name, c.capacity, c.ordered, chans.get(name)))
        out.append(f"  {ends[0]} -->|{_mq(label)}| {ends[1]}")
    if bottleneck in ids:
        out.append("  classDef bottleneck stroke:#d62728,stroke-width:3px,fill:#fde0dd")
        out.append(f"  class {ids[bottleneck]} bottleneck")
    return "\n".join(out) + "\n"


def render_dot(dot_text: str, fmt: str = "svg", dot: str | None = None) -> bytes:
    """Render DOT text with Graphviz's ``dot`` program. Raises DotNotFound, or
    subprocess.CalledProcessError (with dot's stderr) if dot rejects the input."""
    exe = dot or shutil.which("dot")
    if exe is None:
        raise DotNotFound("Graphviz's `dot` program is not on PATH")
    proc = subprocess.run([exe, f"-T{fmt}"], input=dot_text.encode(), capture_output=True,
                          check=True, timeout=60)
    return proc.stdout


def _format(output: str | None, explicit: str | None) -> str:
    if explicit:
        return explicit
    suffix = Path(output).suffix.lower().lstrip(".") if output else "dot"
    return {"gv": "dot", "mmd": "mermaid", "mermaid": "mermaid", "md": "mermaid"}.get(suffix, suffix)


def build_parser():
    """The command line of ``python -m csp.graph`` (see ``--help``)."""
    from csp.cli import make_parser

    parser = make_parser(
        "python -m csp.graph", "Draw a csp graph file: processes as boxes, channels as arrows (SVG, PNG, "
        "PDF, DOT or Mermaid).",
        details="A box shows the process name, kind, replicas and devices; an arrow the channel name and "
                "capacity.\nWith --run RUN_DIR the measured fill, blocked/wait shares and busy split are "
                "added, and the\nbottleneck is drawn in red. SVG needs no Graphviz (pure Python); dot is "
                "used when installed.",
        exit_codes=EXIT_CODES,
        examples=["python -m csp.graph examples/dflash-tiny.toml -o graph.svg",
                  "python -m csp.graph examples/dflash-tiny.toml -o graph.svg --run runs/dflash-tiny",
                  "python -m csp.graph examples/dflash-tiny.toml -o graph.mmd",
                  "python -m csp.graph GRAPH.toml --set process.target.replicas=4     # DOT on stdout"])
    parser.add_argument("graph", help="graph TOML file (an application file with extra tables is fine)")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="output file; its suffix picks the format: .svg, .png, .pdf, .dot/.gv, .mmd "
                             "(default: DOT text on stdout)")
    parser.add_argument("--format", choices=["dot", "mermaid", *sorted(DOT_FORMATS)],
                        help="override the format implied by the output suffix")
    parser.add_argument("--engine", choices=["auto", "dot", "python"], default="auto",
                        help="who draws SVG/PNG/PDF: auto = Graphviz's dot when on PATH, else pure Python; "
                             "dot = Graphviz only; python = csp.graph.svg (+ cairosvg for PNG/PDF)")
    parser.add_argument("--run", metavar="RUN_DIR", help="a run directory: annotate with its measured statistics")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a graph value, as for dflash.run (repeatable)")
    return parser


def render_python(spec: GraphSpec, summary: Summary | None, fmt: str) -> bytes:
    """SVG (or PNG/PDF through cairosvg) drawn by :mod:`csp.graph.svg`. Raises ImportError for PNG/PDF
    without cairosvg."""
    from csp.graph.svg import graph_svg

    svg = graph_svg(spec, summary, _node_lines, _edge_lines, _edges)
    if fmt == "svg":
        return svg.encode()
    import cairosvg  # optional: pip install cairosvg (needs the cairo library)

    convert = {"png": cairosvg.svg2png, "pdf": cairosvg.svg2pdf}[fmt]
    return convert(bytestring=svg.encode(), scale=2.0 if fmt == "png" else 1.0)


def _refuse_fallback(fallback: Path, output: str, why: str) -> bool:
    """True (after one line on stderr) when the fallback file, which the user did not name, exists."""
    if not fallback.exists() or fallback.resolve() == Path(output).resolve():
        return False
    print(f"csp.graph: {why}; the fallback {fallback} already exists and was not overwritten: "
          f"pass -o {fallback} to replace it, or move it away", file=sys.stderr)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    fmt = _format(args.output, args.format)
    if fmt not in {"dot", "mermaid", *DOT_FORMATS}:
        parser.error(f"cannot tell the format from {args.output!r}: use .svg, .png, .pdf, .dot or "
                     ".mmd, or pass --format")
    if fmt in DOT_FORMATS and not args.output:
        parser.error(f"--format {fmt} needs -o FILE")
    try:
        spec = load_for_drawing(args.graph, args.set)
        summary = None
        if args.run:
            from csp.observe.backpressure import read_stats, summarize

            summary = summarize(read_stats(args.run))
            missing = sorted({c.name for c in spec.channel} - {c.name for c in summary.channels})
            if missing:
                print(f"csp.graph: warning: {args.run} has no statistics for channel(s) "
                      f"{', '.join(missing)}: is it a run of this graph?", file=sys.stderr)
    except (GraphError, FileNotFoundError, ValueError) as e:
        print(f"csp.graph: {e}", file=sys.stderr)
        return 2
    text = to_mermaid(spec, summary) if fmt == "mermaid" else to_dot(spec, summary)
    if fmt in DOT_FORMATS:
        use_dot = args.engine == "dot" or (args.engine == "auto" and shutil.which("dot") is not None)
        try:
            data = render_dot(text, fmt) if use_dot else render_python(spec, summary, fmt)
        except DotNotFound:
            fallback = Path(args.output).with_suffix(".dot")
            if _refuse_fallback(fallback, args.output, "Graphviz's `dot` program is not installed"):
                return 2
            fallback.write_text(text)
            print(f"csp.graph: --engine dot needs Graphviz's `dot` program, which is not installed "
                  f"(apt-get install graphviz, or brew install graphviz). Wrote the DOT text to "
                  f"{fallback} instead; render it later with: dot -T{fmt} {fallback} -o "
                  f"{args.output} (or drop --engine dot)", file=sys.stderr)
            return 1
        except ImportError:
            fallback = Path(args.output).with_suffix(".svg")
            if _refuse_fallback(fallback, args.output, f"{fmt.upper()} needs Graphviz's `dot` or the "
                                "cairosvg package, and neither is installed"):
                return 2
            fallback.write_bytes(render_python(spec, summary, "svg"))
            print(f"csp.graph: {fmt.upper()} needs Graphviz's `dot` or the cairosvg package, and neither "
                  f"is installed (pip install cairosvg, or apt-get install graphviz). Wrote the SVG to "
                  f"{fallback} instead", file=sys.stderr)
            return 1
        except subprocess.CalledProcessError as e:
            print(f"csp.graph: dot failed: {e.stderr.decode(errors='replace')}", file=sys.stderr)
            return 1
        Path(args.output).write_bytes(data)
    elif args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
