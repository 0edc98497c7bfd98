"""Graphs of processes and channels: the TOML schema, loading with overrides, validation, drawing.

A graph file (see ``docs/architecture.md``)::

    plugins = ["examples.textpipe"]     # modules to import first: they register their kinds

    [[channel]]
    name = "lines"
    capacity = 8

    [[process]]
    name = "tokenize"
    kind = "textpipe.tokenize"
    replicas = 2
    inputs = { lines = "lines" }
    outputs = { tokens = "tokens" }
    [process.options]
    lowercase = true

:func:`load_spec` reads it into a :class:`GraphSpec` (or an application's subclass of it);
:meth:`Graph.from_spec` resolves kinds and decodes options; :meth:`Graph.validate` checks the
wiring before anything starts. Every problem is a :class:`csp.GraphError` naming the file, the
msgspec path (``$.process[2].options``) or the node.

It imports the core (the process protocol, the registry) and, for a drawing annotated with a run's
measurements, :mod:`csp.observe`; the runtime and the entry points import it. Modules, each
importable alone (the public names are re-exported here; the drawing's are not, so importing the
graph loads no drawing code)::

    schema.py      GraphSpec, ChannelSpec, ProcessSpec, TraceSpec, RuntimeSpec: the TOML tables
    load.py        load_spec(), apply_override(): TOML + --set overrides -> a GraphSpec
    plugins.py     import_plugins_near(), import_plugins(): the modules that register kinds
    nodes.py       ProcessNode, ChannelNode: resolved nodes
    builder.py     Graph: from_spec(), channel(), process(), validate(), item_type()
    validation.py  ports, channels, types, devices and topology checked before a run
    port_types.py  compatible(): may a sender's item type reach a receiver's port?
    devices.py     check_device(): "cpu" / "cuda:N" exists on this machine
    draw.py        python -m csp.graph: DOT / Mermaid / SVG of a graph file, optionally with a run's numbers
    layout.py      layout(): where each box, arrow and label of a drawing goes (a row per stage)
    svg.py         graph_svg(): the SVG drawn in pure Python from that layout (no Graphviz)
    __main__.py    runs draw.py's command line
"""

from csp.graph.builder import Graph
from csp.graph.load import apply_override, load_spec
from csp.graph.nodes import ChannelNode, ProcessNode
from csp.graph.plugins import import_plugins_near
from csp.graph.port_types import compatible
from csp.graph.schema import ChannelSpec, GraphSpec, ProcessSpec, RuntimeSpec, TraceSpec

__all__ = [
    "ChannelNode", "ChannelSpec", "Graph", "GraphSpec", "ProcessNode", "ProcessSpec", "RuntimeSpec", "TraceSpec",
    "apply_override", "compatible", "import_plugins_near", "load_spec",
]
