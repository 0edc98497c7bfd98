"""The csp error family.

Every error raised by csp derives from :class:`CspError`, so ``except csp.CspError`` catches all of
them. Channel errors follow trio/anyio's split: who closed what decides which error you get.

=================  ========================================================================
``ChannelClosed``  you used an end that *you* closed (``close()`` was called on this end).
``PeerGone``       you sent, but every receive end of the channel is closed.
``EndOfStream``    you received, every send end is closed and the buffer is drained.
``WouldBlock``     a ``*_nowait`` call could not complete at once.
``ChannelAborted`` the channel was aborted (``abort(reason)``), usually by the runtime after a
                   failure elsewhere in the graph; every blocked and future operation raises it.
=================  ========================================================================
"""

from __future__ import annotations


class CspError(Exception):
    """Base class of every error raised by csp."""


class ChannelError(CspError):
    """Base class of the channel errors; ``channel`` names the channel ('' when unnamed)."""

    def __init__(self, message: str = "", channel: str = "") -> None:
        super().__init__(message)
        self.channel = channel


class ChannelClosed(ChannelError):
    """This end of the channel was closed by its owner and cannot be used any more.

    Fix: do not call ``send``/``receive``/``clone`` after ``close()`` (or after leaving the end's
    ``with`` block); clone the end first if another user still needs it.
    """


class PeerGone(ChannelError):
    """A send found every receive end of the channel closed: nobody will ever read the item.

    The item was not delivered; the sender still owns it.
    """


class EndOfStream(ChannelError):
    """Every send end is closed and the buffer is drained: no item will ever arrive.

    Iterating a receiver (``for item in recv`` / ``async for``) stops on it instead of raising.
    """


class WouldBlock(ChannelError):
    """A ``send_nowait``/``receive_nowait`` could not complete without waiting."""


class ChannelAborted(ChannelError):
    """The channel was aborted with ``abort(reason)``; ``reason`` says why.

    Raised by every operation blocked at the time of the abort and by every later operation, on
    both ends. Items still in the buffer are dropped.
    """

    def __init__(self, message: str = "", channel: str = "", reason: str = "") -> None:
        super().__init__(message, channel)
        self.reason = reason


class GraphError(CspError):
    """A graph or graph file is invalid; the message names the node or config path to fix."""


class ProcessFailed(CspError):
    """A process of a running graph raised; ``__cause__`` is the original exception.

    Attributes:
        process: the process name from the graph (e.g. ``"target"``).
        replica: the replica index (0-based).
    """

    def __init__(self, message: str, process: str = "", replica: int = 0) -> None:
        super().__init__(message)
        self.process = process
        self.replica = replica


class ProcessStuck(CspError):
    """After an abort (or a failure elsewhere) a process thread did not return within the runtime's
    ``join_timeout_s``: it is stuck outside any channel call (a ``time.sleep``, a hung collective,
    a blocking read) where the abort cannot reach it. Its thread is abandoned (daemon); its stack
    is logged by the ``csp.runtime.stack`` logger.

    Attributes:
        processes: qualnames of the threads still running, e.g. ``["drafter[0]"]``.
        timeout_s: the join timeout that expired (seconds).
    """

    def __init__(self, message: str, processes: list[str], timeout_s: float) -> None:
        super().__init__(message)
        self.processes = list(processes)
        self.timeout_s = timeout_s


__all__ = [
    "ChannelAborted",
    "ChannelClosed",
    "ChannelError",
    "CspError",
    "EndOfStream",
    "GraphError",
    "PeerGone",
    "ProcessFailed",
    "ProcessStuck",
    "WouldBlock",
]
