"""The Process base class and the Context each process replica runs with.

A process is a class with typed ports and a ``run`` method. The ports are two ``TypedDict``s of
channel ends (:mod:`csp.core.ports`), given as the type parameters of ``Process``::

    class UpperIn(TypedDict):
        text: csp.Receiver[str]                 # port name: Receiver[item type]

    class UpperOut(TypedDict):
        out: csp.Sender[str]

    @csp.register("examples.upper")
    class Upper(csp.Process[UpperIn, UpperOut]):
        class Options(csp.Strict):
            factor: int = 1                     # decoded from [process.options]

        def run(self, inputs: UpperIn, outputs: UpperOut) -> None:   # blocking -> its own thread
            for text in inputs["text"]:
                outputs["out"].send(text.upper() * self.options.factor)

``csp.NoPorts`` is the side of a source without inputs, or of a sink without outputs. An untyped
process may instead set the port tables itself (``inputs = {"text": str}``, ``outputs = {"out":
str}``) and subclass plain ``csp.Process``. ``async def run`` makes it an anyio task instead
(``setup``/``teardown`` may then be ``async`` too). ``inputs``/``outputs`` map port names to
:class:`csp.Receiver` / :class:`csp.Sender` ends; the runtime closes them all when ``run`` returns
or raises. An ``EndOfStream`` escaping ``run`` counts as a normal return (the input ran dry). Do
not override ``__init__``: put initialisation that needs the device or the run directory in
``setup()``, which runs in the process's own thread with its device and stream current.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager, Generic, TypeVar, get_args, get_origin, is_typeddict

from csp.core.channel import Receiver, Sender
from csp.core.ports import port_table
from csp.core.strict import Strict
from csp.errors import PortTypeError

if TYPE_CHECKING:  # torch is imported only by processes that use a device
    import torch

NULL_SPAN: ContextManager[None] = contextlib.nullcontext()
"""The shared no-op span returned by :meth:`Context.span` when tracing is off."""

InPorts = TypeVar("InPorts", bound=Mapping[str, object])
"""A process's input ports: a ``TypedDict`` of ``Receiver[item type]`` (``Any`` when untyped)."""
OutPorts = TypeVar("OutPorts", bound=Mapping[str, object])
"""A process's output ports: a ``TypedDict`` of ``Sender[item type]`` (``Any`` when untyped)."""


class Context:
    """What one process replica knows about where and how it runs.

    Attributes:
        name: the process name in the graph (``"target"``).
        replica: this replica's index, 0-based.
        replicas: number of replicas of this process.
        device: the bound ``torch.device``, or None when the graph gives no device.
        stream: the replica's own CUDA stream (current while setup/run/teardown run), or None
            off CUDA.
        run_dir: the run directory handed to the Runtime, or None.
        app: any object the caller handed to the Runtime (dflash passes its decoded config).
    """

    __slots__ = ("name", "replica", "replicas", "device", "stream", "run_dir", "app",
                 "_stop", "_tracer", "_track", "_statistics")

    def __init__(
        self,
        name: str,
        replica: int = 0,
        replicas: int = 1,
        *,
        device: torch.device | None = None,
        run_dir: Path | None = None,
        app: Any = None,
        stop_event: threading.Event | None = None,
        tracer: Any = None,
        track: int = 0,
        statistics: Callable[[], dict[str, dict[str, Any]]] | None = None,
    ) -> None:
        self.name = name
        self.replica = replica
        self.replicas = replicas
        self.device = device
        self.stream: torch.cuda.Stream | None = None
        self.run_dir = run_dir
        self.app = app
        self._stop = stop_event if stop_event is not None else threading.Event()
        self._tracer = tracer
        self._track = track
        self._statistics = statistics

    @property
    def qualname(self) -> str:
        """``name[replica]``, e.g. ``"target[1]"``: how errors, stats and traces name it."""
        return f"{self.name}[{self.replica}]"

    def stopping(self) -> bool:
        """True once a graceful stop was requested. Sources poll it and return when it is set."""
        return self._stop.is_set()

    def statistics(self) -> dict[str, dict[str, Any]]:
        """The live statistics of the run this replica belongs to, as :meth:`csp.Runtime.statistics`
        returns them (``{"channels": {name: ChannelStatistics}, "processes": {...}}``): what a
        monitoring process shows beside its own numbers. Empty dicts outside a Runtime."""
        if self._statistics is None:
            return {"channels": {}, "processes": {}}
        return self._statistics()

    def span(self, name: str) -> ContextManager[None]:
        """A trace span on this replica's track (``with ctx.span("forward"): ...``).

        Returns a shared no-op context manager when tracing is off; never blocks.
        """
        if self._tracer is None:
            return NULL_SPAN
        return self._tracer.span(self._track, name)

    def __repr__(self) -> str:
        return f"Context({self.qualname}, device={self.device})"


class Process(Generic[InPorts, OutPorts]):
    """Base class of every process kind.

    Type parameters: the ``TypedDict`` of its input ports and that of its output ports
    (``Process[UpperIn, UpperOut]``, :mod:`csp.core.ports`). They type ``run``'s arguments for a type
    checker and, read when the class is defined, set the three port tables below, so the ports
    are declared once; a class that gives them must not set the tables too (PortTypeError).

    Class attributes:
        inputs: port name -> item type received on that port (``object``/``Any`` accepts all).
        outputs: port name -> item type sent on that port.
        optional: names of ports (inputs or outputs) a graph may leave unconnected; ``run`` then
            finds no entry for them in ``inputs`` / ``outputs`` (typed: ``NotRequired[...]``). For
            a port that adds a feature (a side output of snapshots, a second input of occasional
            results) without making every graph wire it. Default: none, every declared port must
            be connected.
        Options: a :class:`csp.Strict` subclass (a msgspec Struct) decoded from the graph's
            ``[process.options]`` table (unknown keys rejected). The default accepts no keys.
        sends_first: True if ``run`` sends before its first receive, so the process can start a
            cycle of channels on its own (a producer waiting for acknowledgements). Graph
            validation rejects a cycle that neither a source (a process without inputs) nor such
            a process feeds. Default False.
        seq_origin: True if the ``seq`` this process passes to ordered sends is its own count,
            one stream across all its replicas, not the seq of what it received. Graph
            validation traces each ordered channel's seqs upstream to their origins (sources,
            or such processes) and rejects more than one (``csp.graph.validation.seq_origins``).
            Default False.

    Instance attributes (set by the runtime): ``options`` (decoded ``Options``), ``ctx``
    (:class:`Context`).
    """

    class Options(Strict):
        """No options (a kind's own ``Options`` subclasses :class:`csp.Strict` too)."""

    inputs: ClassVar[dict[str, Any]] = {}
    outputs: ClassVar[dict[str, Any]] = {}
    optional: ClassVar[frozenset[str]] = frozenset()
    sends_first: ClassVar[bool] = False
    seq_origin: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in cls.__dict__.get("__orig_bases__", ()):
            ports = get_args(base)
            if get_origin(base) is Process and all(is_typeddict(p) for p in ports):
                _declare_ports(cls, *ports)

    def __init__(self, options: Any = None, ctx: Context | None = None) -> None:
        self.options = options if options is not None else type(self).Options()
        self.ctx = ctx if ctx is not None else Context(type(self).__name__)

    def setup(self) -> None:
        """Optional; runs before ``run`` in the process's own thread/task, device current."""

    def run(self, inputs: InPorts, outputs: OutPorts) -> None | Awaitable[None]:
        """Consume ``inputs`` (port -> Receiver), produce on ``outputs`` (port -> Sender).

        Blocking here means the runtime gives the process its own thread; define
        ``async def run`` for an anyio task.
        """
        raise NotImplementedError(f"{type(self).__name__} must define run(inputs, outputs)")

    def teardown(self) -> None:
        """Optional; always called once ``run`` (or a failed ``setup``) has finished."""


def _declare_ports(cls: type[Process[Any, Any]], inputs: type, outputs: type) -> None:
    """Set ``cls``'s port tables from its port ``TypedDict``s (see :class:`Process`)."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    tables = sorted(t for t in ("inputs", "outputs", "optional") if t in cls.__dict__)
    if tables:
        raise PortTypeError(f"{name}: its ports are typed by Process[{inputs.__qualname__}, {outputs.__qualname__}]; "
                        f"drop {', '.join(tables)} (the tables are read from those)")
    cls.inputs, optional_in = port_table(inputs, Receiver, name)
    cls.outputs, optional_out = port_table(outputs, Sender, name)
    cls.optional = frozenset(optional_in | optional_out)


def is_async(cls: type[Process]) -> bool:
    """True if ``cls.run`` is a coroutine function (the process runs as an anyio task)."""
    return inspect.iscoroutinefunction(cls.run)


__all__ = ["Context", "InPorts", "NULL_SPAN", "OutPorts", "Process", "is_async"]
