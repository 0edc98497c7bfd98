"""Graphs of processes and channels: the TOML schema, loading with overrides, and validation.

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
"""

from __future__ import annotations

import importlib
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Iterable, Sequence

import msgspec
from msgspec import Meta

from csp.errors import GraphError
from csp.process import Process, is_async
from csp.registry import Registry, registry as default_registry

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

Name = Annotated[str, Meta(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_.\-]*$")]


class ChannelSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One ``[[channel]]``: a bounded, typed channel.

    Attributes:
        name: unique channel name; ports refer to it.
        capacity: buffer size in items; 0 is a rendezvous. Required: there is no unbounded channel.
        ordered: deliver items in ``seq`` order (ordered fan-in after replicas). One process
            (any number of its replicas) and one port may send to it: it restores one seq stream.
        rank_local: under torch.distributed (``csp.dist``), every rank gets its own copy of this
            channel: items never leave the rank they were sent on. Ignored in a single process.
    """

    name: Name
    capacity: Annotated[int, Meta(ge=0)]
    ordered: bool = False
    rank_local: bool = False


class ProcessSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One ``[[process]]``: a process kind, its replicas, devices and port wiring.

    Attributes:
        name: unique process name (replicas are ``name[0]``, ``name[1]``, ...).
        kind: registry kind of the Process class.
        replicas: number of instances.
        device: one device for every replica ("cpu", "cuda:N", or "cuda", which means "cuda:0" and
            is accepted for a single replica only: for several, write "cuda:0" to put them all on
            GPU 0, or ``devices``); omitted = no device (CPU).
        devices: one device per replica ("cuda" = "cuda:0"); exclusive with ``device``.
        inputs: port name -> channel name.
        outputs: port name -> channel name.
        options: decoded by the kind's ``Options`` Struct (unknown keys rejected).
        ranks: under torch.distributed (``csp.dist``), the rank of each replica (one per replica);
            omitted = the default placement (docs/distributed.md). Ignored in a single process.
    """

    name: Name
    kind: Annotated[str, Meta(min_length=1)]
    replicas: Annotated[int, Meta(ge=1)] = 1
    device: str | None = None
    devices: list[str] | None = None
    inputs: dict[str, str] = {}
    outputs: dict[str, str] = {}
    options: dict[str, Any] = {}
    ranks: list[Annotated[int, Meta(ge=0)]] | None = None


class TraceSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[trace]``: observability knobs.

    Attributes:
        stats_interval_s: period of ``RUN_DIR/csp/stats.jsonl`` snapshots and trace counters, in s.
        perfetto: write ``RUN_DIR/csp/trace.json`` (process spans, channel fill counters).
        flows: add flow arrows following sampled items across the graph.
        flow_every: with ``flows``, follow every N-th item sent by each source replica.
        max_events: cap on buffered trace events; later events are dropped and counted.
    """

    stats_interval_s: Annotated[float, Meta(gt=0)] = 1.0
    perfetto: bool = True
    flows: bool = False
    flow_every: Annotated[int, Meta(ge=1)] = 100
    max_events: Annotated[int, Meta(ge=0)] = 1_000_000


class GraphSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A whole graph file. Applications subclass it to add their own tables.

    Attributes:
        plugins: modules imported before kinds are resolved (their ``@csp.register`` runs).
        channel: the ``[[channel]]`` tables.
        process: the ``[[process]]`` tables.
        trace: the ``[trace]`` table.
    """

    plugins: list[str] = []
    channel: list[ChannelSpec] = []
    process: list[ProcessSpec] = []
    trace: TraceSpec = msgspec.field(default_factory=TraceSpec)


S = typing.TypeVar("S", bound=GraphSpec)


def load_spec(
    path: str | Path, spec_type: type[S] = GraphSpec, overrides: Sequence[str] = ()  # type: ignore[assignment]
) -> S:
    """Read a graph TOML file, apply ``--set`` overrides, decode it into ``spec_type``.

    Overrides are ``dotted.key=value``; arrays of tables are addressed by their ``name``
    (``process.target.replicas=1``, ``channel.batches.capacity=2``); the value is parsed as a
    TOML value (``true``, ``3``, ``[1, 2]``, ``"x"``), else taken as a plain string.

    ``plugins`` not importable from ``sys.path`` but found in the file's directory or a parent
    are imported here (:func:`import_plugins_near`); the rest are imported by
    :meth:`Graph.from_spec`.

    Raises:
        GraphError: the file is missing or unreadable, is not valid TOML, an override is
            malformed or addresses nothing, or decoding fails (message: ``FILE: <msgspec error>
            - at `$.channel[0]```).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GraphError(f"{path}: graph file not found (cwd {Path.cwd()})") from None
    except OSError as exc:
        raise GraphError(f"{path}: cannot read graph file: {exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise GraphError(f"{path}: invalid TOML: {exc}") from None
    overridden: dict[str, str] = {}
    for item in overrides:
        overridden[apply_override(data, item)] = item
    try:
        spec = msgspec.convert(data, spec_type)
    except msgspec.ValidationError as exc:
        raise GraphError(f"{path}: {exc}{_override_note(str(exc), overridden)}") from None
    import_plugins_near(spec.plugins, path)
    return spec


def _override_note(message: str, overridden: dict[str, str]) -> str:
    """`` (from --set KEY=VALUE)`` when the error's ``$.`` path is a key an override set."""
    at = message.rpartition(" - at `")[2].rstrip("`") if " - at `" in message else "$"
    field = message.partition("unknown field `")[2].partition("`")[0]
    where = f"{at}.{field}" if field else at
    for msgspec_path, item in overridden.items():
        inside = where.startswith((msgspec_path + ".", msgspec_path + "["))
        created = bool(field) and msgspec_path.startswith(where + ".")  # a table the --set made
        if where == msgspec_path or inside or created:
            return f" (from --set {item})"
    return ""


def import_plugins_near(plugins: Sequence[str], graph_file: str | Path) -> None:
    """Import plugins that are not importable from ``sys.path`` but live next to the graph file.

    For each plugin ``a.b`` not yet imported and not found on ``sys.path``, the nearest of the
    graph file's directory and its parents holding ``a/b/__init__.py`` or ``a/b.py`` is put on
    ``sys.path`` for the import only (so ``python -m csp.run /abs/path/examples/x.toml`` works
    from any directory). Plugins found nowhere are left for :meth:`Graph.from_spec` to report.

    Raises:
        GraphError: a plugin found this way fails to import.
    """
    import importlib.util

    start = Path(graph_file).resolve().parent
    for module in plugins:
        if module in sys.modules:
            continue
        try:
            if importlib.util.find_spec(module) is not None:
                continue
        except (ImportError, ValueError):
            pass
        rel = Path(*module.split("."))
        root = next((d for d in (start, *start.parents)
                     if (d / rel / "__init__.py").is_file() or (d / rel).with_suffix(".py").is_file()),
                    None)
        if root is None:
            continue
        sys.path.insert(0, str(root))
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise GraphError(f"plugins: cannot import {module!r} from {root}: {exc}") from exc
        finally:
            sys.path.remove(str(root))


def apply_override(data: dict[str, Any], item: str) -> str:
    """Apply one ``dotted.key=value`` override to raw TOML ``data`` in place.

    Returns:
        The key's msgspec error path, e.g. ``$.process[2].options.generate``.

    Raises:
        GraphError: no ``=``, an empty key part, a name not found in an array of tables, or a
            path through a value that is not a table.
    """
    key, eq, raw = item.partition("=")
    parts = [p.strip() for p in key.strip().split(".")]
    if not eq or not all(parts):
        raise GraphError(f"override {item!r}: expected dotted.key=value, e.g. channel.batches.capacity=2")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    node: Any = data
    walked: list[str] = []
    mpath = "$"
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            matches = [t for t in node if isinstance(t, dict) and t.get("name") == part]
            if not matches:
                names = [t.get("name") for t in node if isinstance(t, dict)]
                raise GraphError(
                    f"override {item!r}: no [[{'.'.join(walked)}]] named {part!r} (known: {names})"
                )
            if last:
                raise GraphError(f"override {item!r}: give a field of {'.'.join(walked)}.{part}")
            mpath += f"[{next(j for j, t in enumerate(node) if t is matches[0])}]"
            node = matches[0]
        elif isinstance(node, dict):
            mpath += f".{part}"
            if last:
                node[part] = value
                return mpath
            node = node.setdefault(part, {})
        else:
            raise GraphError(f"override {item!r}: {'.'.join(walked)} is a value, not a table")
        walked.append(part)


class ProcessNode(msgspec.Struct, kw_only=True):
    """A resolved process: class, decoded options, replicas, devices, wiring."""

    name: str
    cls: type
    options: Any
    replicas: int = 1
    devices: list[str | None] = []
    inputs: dict[str, str] = {}
    outputs: dict[str, str] = {}
    index: int = 0  # position in the file, for error paths
    ranks: list[int] | None = None  # csp.dist placement, one rank per replica

    @property
    def kind(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"


class ChannelNode(msgspec.Struct, kw_only=True):
    """A channel of the graph (name, capacity, ordered)."""

    name: str
    capacity: int
    ordered: bool = False
    rank_local: bool = False  # csp.dist: one copy of the channel per rank


class Graph:
    """Processes and channels, validated before the runtime starts them.

    Build from a spec (:meth:`from_spec`) or in Python::

        g = csp.Graph()
        g.channel("lines", capacity=4)
        g.process("read", ReadLines, outputs={"line": "lines"})
        g.process("sink", Sink, inputs={"line": "lines"}, options={"top": 5})
        g.validate()
    """

    def __init__(self, trace: TraceSpec | None = None) -> None:
        self.channels: dict[str, ChannelNode] = {}
        self.processes: dict[str, ProcessNode] = {}
        self.trace = trace if trace is not None else TraceSpec()

    @classmethod
    def from_spec(
        cls, spec: GraphSpec, registry: Registry | None = None, *, allow_imports: bool = False
    ) -> "Graph":
        """Import ``spec.plugins``, resolve kinds, decode options, then :meth:`validate`.

        Raises:
            GraphError: a plugin fails to import, a kind is unknown, options do not decode
                (path ``$.process[i].options...``), or validation fails.
        """
        reg = registry if registry is not None else default_registry
        for module in spec.plugins:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise GraphError(
                    f"plugins: cannot import {module!r}: {exc} (searched sys.path and, for a graph "
                    "file, its directory and their parents; add the directory holding the "
                    "package to PYTHONPATH)") from exc
        graph = cls(trace=spec.trace)
        for c in spec.channel:
            graph.channel(c.name, capacity=c.capacity, ordered=c.ordered, rank_local=c.rank_local)
        for i, p in enumerate(spec.process):
            try:
                pcls = reg.resolve(p.kind, allow_imports=allow_imports)
            except GraphError as exc:
                raise GraphError(f"process {p.name!r} ($.process[{i}].kind): {exc}") from None
            graph.process(p.name, pcls, inputs=p.inputs, outputs=p.outputs, replicas=p.replicas,
                          device=p.device, devices=p.devices, options=p.options, ranks=p.ranks,
                          _index=i)
        graph.validate()
        return graph

    def channel(self, name: str, *, capacity: int, ordered: bool = False,
                rank_local: bool = False) -> "Graph":
        """Add a channel. Raises GraphError on a duplicate name or a negative capacity."""
        if name in self.channels:
            raise GraphError(f"channel {name!r} is declared twice; channel names must be unique")
        if capacity < 0:
            raise GraphError(f"channel {name!r}: capacity must be >= 0 (0 = rendezvous), got {capacity}")
        self.channels[name] = ChannelNode(name=name, capacity=capacity, ordered=ordered,
                                          rank_local=rank_local)
        return self

    def process(
        self,
        name: str,
        cls: type,
        *,
        inputs: dict[str, str] | None = None,
        outputs: dict[str, str] | None = None,
        replicas: int = 1,
        device: str | None = None,
        devices: Iterable[str] | None = None,
        options: Any = None,
        ranks: Iterable[int] | None = None,
        _index: int | None = None,
    ) -> "Graph":
        """Add a process of class ``cls`` (a :class:`csp.Process` subclass).

        ``options`` is an instance of ``cls.Options``, a dict decoded into it, or None (defaults).
        ``ranks`` places replica ``i`` on rank ``ranks[i]`` under ``csp.dist`` (ignored otherwise).

        Raises:
            GraphError: duplicate name, bad replicas, both ``device`` and ``devices`` given,
                ``len(devices) != replicas``, ``len(ranks) != replicas``, ``device = "cuda"``
                for several replicas (ambiguous: one GPU or one each?), or options that do
                not decode.

        A device ``"cuda"`` is stored as ``"cuda:0"`` (what ``torch.device("cuda")`` means in a
        process that never called ``torch.cuda.set_device``), so every later check sees "cuda:N".
        """
        index = len(self.processes) if _index is None else _index
        where = f"process {name!r}"
        if name in self.processes:
            raise GraphError(f"{where} is declared twice; process names must be unique")
        if not (isinstance(cls, type) and issubclass(cls, Process)):
            raise GraphError(f"{where}: {cls!r} is not a csp.Process subclass")
        if replicas < 1:
            raise GraphError(f"{where}: replicas must be >= 1, got {replicas}")
        if device is not None and devices is not None:
            raise GraphError(f"{where}: give either device (all replicas) or devices (one per replica), not both")
        if devices is not None:
            devs: list[str | None] = list(devices)
            if len(devs) != replicas:
                raise GraphError(
                    f"{where}: {len(devs)} devices for {replicas} replicas; give one device per "
                    "replica or set replicas to match"
                )
        else:
            if device == "cuda" and replicas > 1:
                raise GraphError(
                    f"{where}: device = \"cuda\" for {replicas} replicas is ambiguous; write "
                    f"device = \"cuda:0\" (every replica on GPU 0) or devices = [\"cuda:0\", \"cuda:1\", ...] "
                    "(one per replica)")
            devs = [device] * replicas
        devs = ["cuda:0" if d == "cuda" else d for d in devs]
        rank_list = None if ranks is None else [int(r) for r in ranks]
        if rank_list is not None and len(rank_list) != replicas:
            raise GraphError(f"{where}: {len(rank_list)} ranks for {replicas} replicas; give one "
                             "rank per replica (ranks = [0, 1, ...]) or set replicas to match")
        options_t = cls.Options
        if options is None:
            options = {}
        if isinstance(options, dict):
            try:
                options = msgspec.convert(options, options_t)
            except msgspec.ValidationError as exc:
                raise GraphError(f"{where}: options: {_rebase(str(exc), f'$.process[{index}].options')}") from None
        elif not isinstance(options, options_t):
            raise GraphError(f"{where}: options must be a {options_t.__qualname__} or a dict, got {type(options).__name__}")
        self.processes[name] = ProcessNode(
            name=name, cls=cls, options=options, replicas=replicas, devices=devs,
            inputs=dict(inputs or {}), outputs=dict(outputs or {}), index=index, ranks=rank_list,
        )
        return self

    def validate(self) -> None:
        """Check the wiring and devices. Raises GraphError naming the first bad node.

        Checked: every port connected to a declared channel, every channel with a sender and a
        receiver, port types compatible, devices exist, no self-loop, no cycle that no source
        feeds, one producer per ordered channel (:func:`_check_topology`).
        """
        senders: dict[str, list[tuple[ProcessNode, str]]] = {c: [] for c in self.channels}
        receivers: dict[str, list[tuple[ProcessNode, str]]] = {c: [] for c in self.channels}
        for p in self.processes.values():
            where = f"process {p.name!r}"
            for declared, wired, direction, table in (
                (p.cls.inputs, p.inputs, "input", receivers),
                (p.cls.outputs, p.outputs, "output", senders),
            ):
                for port in declared:
                    if port not in wired:
                        raise GraphError(
                            f"{where}: {direction} port {port!r} is not connected; add it to "
                            f"{direction}s = {{ {port} = \"<channel>\" }}"
                        )
                for port, chan in wired.items():
                    if port not in declared:
                        raise GraphError(
                            f"{where}: {p.cls.__name__} has no {direction} port {port!r} "
                            f"(its {direction}s: {sorted(declared)})"
                        )
                    if chan not in self.channels:
                        raise GraphError(
                            f"{where}: {direction} port {port!r} is connected to unknown channel "
                            f"{chan!r} (channels: {sorted(self.channels)})"
                        )
                    table[chan].append((p, port))
            for dev in p.devices:
                _check_device(where, dev)
            if is_async(p.cls) and any(d and d.startswith("cuda") for d in p.devices):
                raise GraphError(
                    f"{where}: an async process cannot be bound to a CUDA device (the current "
                    "stream is per thread); make its run() blocking"
                )
        for name in self.channels:
            if not senders[name]:
                raise GraphError(f"channel {name!r} has no sender: connect a process output to it or remove it")
            if not receivers[name]:
                raise GraphError(f"channel {name!r} has no receiver: connect a process input to it or remove it")
            for sp, sport in senders[name]:
                out_t = sp.cls.outputs[sport]
                for rp, rport in receivers[name]:
                    in_t = rp.cls.inputs[rport]
                    if not compatible(out_t, in_t):
                        raise GraphError(
                            f"channel {name!r}: process {sp.name!r} sends {_tname(out_t)} "
                            f"(port {sport!r}) but process {rp.name!r} receives {_tname(in_t)} "
                            f"(port {rport!r})"
                        )
        _check_topology(self.processes, self.channels, senders, receivers)

    def item_type(self, channel: str) -> Any:
        """The type a channel carries: its senders' common output type, else ``object``."""
        types_ = {p.cls.outputs[port] for p in self.processes.values()
                  for port, c in p.outputs.items() if c == channel}
        return types_.pop() if len(types_) == 1 else object


def _check_topology(processes: dict[str, ProcessNode], channels: dict[str, ChannelNode],
                    senders: dict[str, list[tuple[ProcessNode, str]]],
                    receivers: dict[str, list[tuple[ProcessNode, str]]]) -> None:
    """Reject wiring that can only hang or fail once running.

    * A self-loop: a process receiving from a channel it sends to. That channel closes only when
      its senders do, so its receive loop never ends.
    * A cycle no source feeds: processes whose inputs all come, directly or not, from each other
      and not from a source (a process with no input ports, or one whose class declares
      ``sends_first = True``: it sends before it receives). Nothing ever sends the first item.
    * An ordered channel fed by more than one process or port. It restores one ``seq`` stream;
      two producers number their items independently and collide. Replicas of one process share
      one stream (they split the items of an upstream channel) and are fine.

    Raises:
        GraphError: naming the channels (and processes) involved.
    """
    for name in channels:
        for sp, sport in senders[name]:
            for rp, rport in receivers[name]:
                if sp is rp:
                    raise GraphError(
                        f"channel {name!r} is a self-loop: process {sp.name!r} sends to it (port "
                        f"{sport!r}) and receives from it (port {rport!r}); it would never close "
                        "and the run would hang. Keep that state inside the process instead")
    for name, c in channels.items():
        feeds = sorted({(p.name, port) for p, port in senders[name]})
        if c.ordered and len(feeds) > 1:
            listed = ", ".join(f"process {p!r} port {port!r}" for p, port in feeds)
            raise GraphError(
                f"channel {name!r} is ordered but has {len(feeds)} producers ({listed}); an ordered "
                "channel restores one seq stream, so feed it from one process (replicas of it may "
                "share it) or set ordered = false")
    # processes reachable from a source, following channels downstream
    reached = {n for n, p in processes.items() if not p.inputs or getattr(p.cls, "sends_first", False)}
    frontier = list(reached)
    while frontier:
        p = processes[frontier.pop()]
        for chan in p.outputs.values():
            for rp, _ in receivers[chan]:
                if rp.name not in reached:
                    reached.add(rp.name)
                    frontier.append(rp.name)
    unfed = [n for n in processes if n not in reached]
    if not unfed:
        return
    # walk upstream from an unfed process: every sender of its input is unfed too, so the walk
    # must come back to a process it has seen; the loop closed there is the cycle to name
    path: list[tuple[str, str]] = []          # (process, channel it receives from)
    seen: dict[str, int] = {}
    node = unfed[0]
    while node not in seen:
        seen[node] = len(path)
        chan = sorted(processes[node].inputs.values())[0]
        path.append((node, chan))
        node = next(sp.name for sp, _ in senders[chan] if sp.name not in reached)
    cycle = path[seen[node]:][::-1]           # in the direction items flow
    chans = ", ".join(repr(c) for _, c in cycle)
    flow = repr(cycle[-1][0]) + "".join(f" --{c}--> {p!r}" for p, c in cycle)
    raise GraphError(
        f"channels {chans} form a cycle ({flow}) that no source feeds: no process without inputs "
        "reaches it, so nothing would ever send and the run would hang; feed the cycle from a "
        "source process, break it, or, if one of its processes sends before it receives, declare "
        "sends_first = True on that class")


def compatible(out_t: Any, in_t: Any) -> bool:
    """True if items of type ``out_t`` may be received on a port typed ``in_t``.

    Rules: ``object``/``Any`` on either side matches; a union input accepts an output matching
    any member, a union output must match for every member; generics compare their origins
    (``list[int]`` -> ``list``); classes use ``issubclass``.
    """
    if out_t in (object, Any) or in_t in (object, Any):
        return True
    if _is_union(out_t):
        return all(compatible(a, in_t) for a in typing.get_args(out_t))
    if _is_union(in_t):
        return any(compatible(out_t, a) for a in typing.get_args(in_t))
    out_o, in_o = typing.get_origin(out_t) or out_t, typing.get_origin(in_t) or in_t
    if isinstance(out_o, type) and isinstance(in_o, type):
        return issubclass(out_o, in_o)
    return out_t == in_t


def _is_union(t: Any) -> bool:
    return typing.get_origin(t) is typing.Union or isinstance(t, types.UnionType)


def _tname(t: Any) -> str:
    return t.__qualname__ if isinstance(t, type) else repr(t)


def _rebase(message: str, prefix: str) -> str:
    """Re-root a msgspec error path: ``... - at `$.foo``` -> ``... - at `PREFIX.foo```."""
    if " - at `$" in message:
        return message.replace(" - at `$", f" - at `{prefix}", 1)
    return f"{message} - at `{prefix}`"


def _check_device(where: str, dev: str | None) -> None:
    if dev is None or dev == "cpu":
        return
    kind, _, index = dev.partition(":")
    if kind != "cuda" or not index.isdigit():
        raise GraphError(f"{where}: device {dev!r} is not 'cpu', 'cuda' or 'cuda:N'")
    try:
        import torch
    except ImportError:
        raise GraphError(f"{where}: device {dev!r} needs torch, which is not installed") from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(index) >= count:
        raise GraphError(
            f"{where}: device {dev!r} does not exist (this machine has {count} CUDA device(s)); "
            "use an index below that or 'cpu'"
        )


__all__ = [
    "ChannelNode", "ChannelSpec", "Graph", "GraphSpec", "ProcessNode", "ProcessSpec", "TraceSpec",
    "apply_override", "compatible", "import_plugins_near", "load_spec",
]
