"""csp: typed bounded channels and processes, for pipelines that span threads, tasks and GPUs.

The public surface is ``__all__`` (``import csp``); everything else is reached through it or is
private. The package is in rooms, each of whose ``__init__`` says what it owns; imports run one
way, from the top of this list to the bottom, never back (``tests/test_layering.py``):

* entry points: ``python -m csp.run`` (:mod:`csp.run`), ``python -m csp.inspect``
  (:mod:`csp.inspect`);
* :mod:`csp.distributed`: ranks and channels across processes and hosts (torchrun);
* :mod:`csp.runtime`: the engine that runs a graph (threads bound to devices and streams, one
  event loop) and its deadlock watch;
* :mod:`csp.graph`: the TOML schema, loading with overrides, validation, the built graph, and its
  drawing (``python -m csp.graph``);
* :mod:`csp.observe`: stats log, trace, backpressure, what-if;
* :mod:`csp.core`: channels, processes, statistics records, the ``kind`` registry;
* :mod:`csp.cuda`: the tensor walker and the event-ordered CUDA hand-off;
* the leaves: :mod:`csp.errors` (the error family), :mod:`csp.cli` (the conventions every
  command line shares), :mod:`csp._guard` (refuses to run mixed with another distribution's
  ``csp`` or ``dflash``).

csp imports nothing of dflash.
"""

from pathlib import Path as _Path

from csp._guard import check as _check_owner

_check_owner("csp", _Path(__file__).parent)  # another 'csp' distribution here: one line, exit 1

from csp.core.channel import Receiver, Sender, channel
from csp.core.stats import ChannelStatistics, ProcessStatistics
from csp.cuda.handoff import item_nbytes
from csp.errors import (
    ChannelAborted,
    ChannelClosed,
    ChannelConfigError,
    ChannelError,
    ChannelTimeout,
    CspError,
    DistConfigError,
    DistError,
    DotNotFound,
    EndOfStream,
    GraphError,
    ItemTypeError,
    NoEventLoop,
    NotAProcess,
    PeerGone,
    PinnedPoolError,
    PinnedPoolTimeout,
    PortTypeError,
    ProcessFailed,
    ProcessStuck,
    RegistryError,
    RuntimeReused,
    SeqError,
    StatsFormatError,
    StatsNotFound,
    UnknownProcess,
    WouldBlock,
)

__all__ = [
    "ChannelAborted",
    "ChannelClosed",
    "ChannelConfigError",
    "ChannelError",
    "ChannelStatistics",
    "ChannelTimeout",
    "CspError",
    "DistConfigError",
    "DistError",
    "DotNotFound",
    "EndOfStream",
    "GraphError",
    "ItemTypeError",
    "NoEventLoop",
    "NotAProcess",
    "PeerGone",
    "PinnedPoolError",
    "PinnedPoolTimeout",
    "PortTypeError",
    "ProcessFailed",
    "ProcessStatistics",
    "ProcessStuck",
    "Receiver",
    "RegistryError",
    "RuntimeReused",
    "Sender",
    "SeqError",
    "StatsFormatError",
    "StatsNotFound",
    "UnknownProcess",
    "WouldBlock",
    "channel",
    "item_nbytes",
]

# --- processes, graphs, runtime (process.py, ports.py, registry.py, graph/, runtime/) ---
from csp.core.ports import NoPorts  # noqa: E402
from csp.core.process import Context, Process  # noqa: E402
from csp.core.registry import Registry, register, registry  # noqa: E402
from csp.core.strict import Strict  # noqa: E402
from csp.graph import ChannelSpec, Graph, GraphSpec, ProcessSpec, RuntimeSpec, TraceSpec, load_spec  # noqa: E402
from csp.runtime.engine import RunResult, Runtime  # noqa: E402

__all__ += [
    "ChannelSpec",
    "Context",
    "Graph",
    "GraphSpec",
    "NoPorts",
    "Process",
    "ProcessSpec",
    "Registry",
    "RunResult",
    "Runtime",
    "RuntimeSpec",
    "Strict",
    "TraceSpec",
    "load_spec",
    "register",
    "registry",
]
