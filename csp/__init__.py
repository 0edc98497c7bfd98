"""csp: typed bounded channels and processes, for pipelines that span threads, tasks and GPUs.

The public surface is ``__all__``; everything else is private.
"""

from csp.channel import Receiver, Sender, channel
from csp.cuda import item_nbytes
from csp.errors import (
    ChannelAborted,
    ChannelClosed,
    ChannelError,
    CspError,
    EndOfStream,
    GraphError,
    PeerGone,
    ProcessFailed,
    WouldBlock,
)
from csp.stats import ChannelStatistics, ProcessStatistics

__all__ = [
    "ChannelAborted",
    "ChannelClosed",
    "ChannelError",
    "ChannelStatistics",
    "CspError",
    "EndOfStream",
    "GraphError",
    "PeerGone",
    "ProcessFailed",
    "ProcessStatistics",
    "Receiver",
    "Sender",
    "WouldBlock",
    "channel",
    "item_nbytes",
]
