"""Building a :class:`Graph`: from a spec or in Python, each node checked as it is added.

:meth:`Graph.from_spec` imports plugins, resolves kinds through the registry and decodes each
process's options into its kind's ``Options`` Struct; :meth:`Graph.validate` checks the whole
wiring (:mod:`csp.graph.validation`) before the runtime starts anything.
"""

from __future__ import annotations

from typing import Any, Iterable

import msgspec

from csp.core.process import Process
from csp.core.registry import Registry
from csp.core.registry import registry as default_registry
from csp.errors import GraphError
from csp.graph.nodes import ChannelNode, ProcessNode
from csp.graph.plugins import import_plugins
from csp.graph.schema import GraphSpec, RuntimeSpec, TraceSpec
from csp.graph.validation import check_wiring


class Graph:
    """Processes and channels, validated before the runtime starts them.

    Build from a spec (:meth:`from_spec`) or in Python::

        g = csp.Graph()
        g.channel("lines", capacity=4)
        g.process("read", ReadLines, outputs={"line": "lines"})
        g.process("sink", Sink, inputs={"line": "lines"}, options={"top": 5})
        g.validate()
    """

    def __init__(self, trace: TraceSpec | None = None, runtime: RuntimeSpec | None = None) -> None:
        self.channels: dict[str, ChannelNode] = {}
        self.processes: dict[str, ProcessNode] = {}
        self.trace = trace if trace is not None else TraceSpec()
        self.runtime = runtime if runtime is not None else RuntimeSpec()

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
        import_plugins(spec.plugins)
        graph = cls(trace=spec.trace, runtime=spec.runtime)
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
        ``ranks`` places replica ``i`` on rank ``ranks[i]`` under ``csp.distributed`` (ignored otherwise).

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
        feeds, one producer per ordered channel (:mod:`csp.graph.validation`).
        """
        check_wiring(self.processes, self.channels)

    def item_type(self, channel: str) -> Any:
        """The type a channel carries: its senders' common output type, else ``object``."""
        types_ = {p.cls.outputs[port] for p in self.processes.values()
                  for port, c in p.outputs.items() if c == channel}
        return types_.pop() if len(types_) == 1 else object


def _rebase(message: str, prefix: str) -> str:
    """Re-root a msgspec error path: ``... - at `$.foo``` -> ``... - at `PREFIX.foo```."""
    if " - at `$" in message:
        return message.replace(" - at `$", f" - at `{prefix}", 1)
    return f"{message} - at `{prefix}`"


__all__ = ["Graph"]
