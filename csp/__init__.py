"""csp: typed bounded channels and processes, for pipelines that span threads, tasks and GPUs.

The public surface is ``__all__`` (``import csp``); everything else is reached through it or is
private. The modules, by concern:

* channels: :mod:`csp.channel` (the public ends; its internals are the private ``_state``,
  ``_cores`` and ``_waiting``), :mod:`csp.errors`, :mod:`csp.stats` (the statistics records);
* processes and their execution: :mod:`csp.process`, :mod:`csp.registry` (``kind`` strings to
  classes), :mod:`csp.runtime`, :mod:`csp.cuda` and :mod:`csp.tensors` (device placement and
  event-ordered hand-off of tensors), :mod:`csp.run` (``python -m csp.run``);
* graphs: :mod:`csp.graph` (a room: load, validate, build a graph file); several processes:
  :mod:`csp.dist` (a room: ranks, cross-rank channels);
* observation: :mod:`csp.statslog` (writes ``stats.jsonl``), :mod:`csp.stats_reader` (reads it),
  :mod:`csp.backpressure` (what it says), :mod:`csp.inspect` (``python -m csp.inspect``),
  :mod:`csp.trace` (Perfetto), :mod:`csp.units`; drawing: :mod:`csp.draw`, :mod:`csp.svg`;
  :mod:`csp.cli` (the conventions every command line shares).

csp stays flat apart from its two rooms: each module's name already says its concern, the
internals are marked private by their leading underscore, and the commands keep their module
names (``python -m csp.inspect``). csp imports nothing of dflash (``tests/test_module_layering.py``).
"""

from pathlib import Path as _Path

from csp._guard import check as _check_owner

_check_owner("csp", _Path(__file__).parent)  # another 'csp' distribution here: one line, exit 1

from csp.channel import Receiver, Sender, channel
from csp.cuda import item_nbytes
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
from csp.stats import ChannelStatistics, ProcessStatistics

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

# --- processes, graphs, runtime (process.py, registry.py, graph/, runtime.py) ---
from csp.graph import ChannelSpec, Graph, GraphSpec, ProcessSpec, RuntimeSpec, TraceSpec, load_spec  # noqa: E402
from csp.process import Context, Process  # noqa: E402
from csp.registry import Registry, register, registry  # noqa: E402
from csp.runtime import RunResult, Runtime  # noqa: E402

__all__ += [
    "ChannelSpec",
    "Context",
    "Graph",
    "GraphSpec",
    "Process",
    "ProcessSpec",
    "Registry",
    "RunResult",
    "Runtime",
    "RuntimeSpec",
    "TraceSpec",
    "load_spec",
    "register",
    "registry",
]
