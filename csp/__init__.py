"""csp: typed bounded channels and processes, for pipelines that span threads, tasks and GPUs.

The public surface is ``__all__``; everything else is private.
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

# --- processes, graphs, runtime (issue 2: process.py, registry.py, graph.py, runtime.py) ---
from csp.graph import ChannelSpec, Graph, GraphSpec, ProcessSpec, TraceSpec, load_spec  # noqa: E402
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
    "TraceSpec",
    "load_spec",
    "register",
    "registry",
]
