"""The csp error family.

Every error csp itself raises derives from :class:`CspError`, so ``except csp.CspError`` catches all
of them (the exceptions, Python protocols and passed-on errors, are listed at the end). Channel
errors follow trio/anyio's split: who closed what decides which error you get.

=================  ========================================================================
``ChannelClosed``  you used an end that *you* closed (``close()`` was called on this end).
``PeerGone``       you sent, but every receive end of the channel is closed.
``EndOfStream``    you received, every send end is closed and the buffer is drained.
``WouldBlock``     a ``*_nowait`` call could not complete at once.
``ChannelAborted`` the channel was aborted (``abort(reason)``), usually by the runtime after a
                   failure elsewhere in the graph; every blocked and future operation raises it.
=================  ========================================================================

Where csp used to raise a builtin, it raises a csp class that derives from :class:`CspError` *and*
that builtin, so ``except ValueError`` (or ``TypeError``, ...) around a csp call keeps working:

======================  =====================  =============================================================
class                   also a                 raised by
======================  =====================  =============================================================
``ChannelConfigError``  ``ValueError``         ``channel()``/``channel_state()``: bad ``capacity``
``ItemTypeError``       ``TypeError``          ``send``: the item is not of the channel's ``item_type``
``SeqError``            ``ValueError``         ``send`` on an ordered channel: missing or repeated ``seq``
``ChannelTimeout``      ``TimeoutError``       ``send``/``receive`` with ``timeout=``: not done in time
``NoEventLoop``         ``RuntimeError``       ``asend``/``areceive`` outside an asyncio event loop
``RegistryError``       ``ValueError``         ``csp.register``: an invalid kind, or one already taken
``NotAProcess``         ``TypeError``          ``csp.register``: not a ``csp.Process`` subclass
``PortTypeError``       ``TypeError``          ``csp.Process[In, Out]``: a port not ``Receiver[T]``/``Sender[T]``
``PinnedPoolError``     ``ValueError``         ``csp.cuda.handoff.PinnedPool``: ``max_bytes`` or a request too big
``PinnedPoolTimeout``   ``TimeoutError``       ``PinnedPool.take``: no buffer came back in time
``DistError``           ``RuntimeError``       ``csp.distributed``: no distributed run / process group / NCCL group
``DistConfigError``     ``ValueError``         ``csp.distributed``: an argument out of range (``peer_timeout_s < 0``)
``UnknownProcess``      ``KeyError``           ``Placement.ranks_of``, ``whatif.predict``: unknown process
``RuntimeReused``       ``RuntimeError``       ``Runtime.run`` called a second time
``StatsFormatError``    ``ValueError``         reading a malformed ``stats.jsonl`` line
``StatsNotFound``       ``FileNotFoundError``  reading a directory that has no stats log
``DotNotFound``         ``RuntimeError``       ``csp.graph.draw``: Graphviz's ``dot`` is not on PATH
======================  =====================  =============================================================

What stays a builtin, and why (``tests/csp/test_errors.py`` walks every ``raise`` in csp and checks
this list):

- ``StopIteration``/``StopAsyncIteration`` (iterating a receiver) and ``AttributeError`` (the
  module ``__getattr__`` of ``csp.distributed``): Python protocols, which only work with the builtin.
- ``NotImplementedError`` from ``Process.run`` when a subclass does not define it: Python's own
  signal for a method a subclass must provide.
- ``SystemExit`` from the command-line entry points and the import guard, and
  ``argparse.ArgumentTypeError`` from ``csp.cli``'s argument parsers: argparse and the
  interpreter turn them into a usage message and an exit status.
- Errors csp only passes on: whatever a process's ``run`` raises (the runtime reports it as
  :class:`ProcessFailed`, the original as ``__cause__``), and errors of the system and library
  calls csp makes on the caller's behalf: ``OSError`` writing a stats or trace file or reading a
  graph file, ``subprocess.CalledProcessError`` when ``dot`` rejects its input, a
  ``torch.distributed`` error when a lane's peer dies (``csp.distributed.wire``), an unpicklable item on
  a cross-rank channel.
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


class ChannelConfigError(CspError, ValueError):
    """``channel()`` got an invalid argument (a ``capacity`` that is not an int >= 0); the message
    names the channel and what to pass instead."""


class ItemTypeError(ChannelError, TypeError):
    """A sent item is not an instance of the channel's ``item_type``; nothing was sent."""


class SeqError(ChannelError, ValueError):
    """A send on an ordered channel had no int ``seq``, or a ``seq`` already sent; nothing was
    sent."""


class ChannelTimeout(ChannelError, TimeoutError):
    """A ``send``/``receive`` with ``timeout=`` did not complete in time (a send did not deliver
    its item; the sender still owns it)."""


class NoEventLoop(CspError, RuntimeError):
    """An async channel call (``asend``/``areceive``) ran outside an asyncio event loop; from a
    thread, use ``send``/``receive``."""


class RegistryError(CspError, ValueError):
    """``csp.register`` got an invalid kind name, or one already taken by another class."""


class NotAProcess(CspError, TypeError):
    """``csp.register`` was given something that is not a :class:`csp.Process` subclass."""


class PortTypeError(CspError, TypeError):
    """A process class's typed ports (``csp.Process[Inputs, Outputs]``) cannot be read: a port that
    is not a ``Receiver[T]`` (inputs) or ``Sender[T]`` (outputs), a port type the module lacks at
    run time, or port tables set beside the typed ports. Raised when the class is defined; the
    message names the class and the port."""


class PinnedPoolError(CspError, ValueError):
    """A ``csp.cuda.handoff.PinnedPool`` size is out of range (``max_bytes`` too small, or a request
    larger than ``max_bytes``)."""


class PinnedPoolTimeout(CspError, TimeoutError):
    """``PinnedPool.take`` found no buffer free within its timeout (a buffer not given back?)."""


class DistError(CspError, RuntimeError):
    """A ``csp.distributed`` call cannot work in this run: no distributed run, no process group for the
    process, or a CUDA tensor to send without an NCCL group."""


class DistConfigError(CspError, ValueError):
    """A ``csp.distributed`` argument is out of range (a negative ``peer_timeout_s``); the message says
    which values it takes."""


class UnknownProcess(CspError, KeyError):
    """A process name that is not in the graph."""


class RuntimeReused(CspError, RuntimeError):
    """``Runtime.run`` was called a second time; a Runtime runs once."""


class StatsFormatError(CspError, ValueError):
    """A line of a ``stats.jsonl`` is not a valid stats record; the message names file and line."""


class StatsNotFound(CspError, FileNotFoundError):
    """No stats log where one was expected; the message names the path looked at."""


class DotNotFound(CspError, RuntimeError):
    """Graphviz's ``dot`` program is not on PATH (install graphviz, or write DOT text instead)."""


__all__ = [
    "ChannelAborted",
    "ChannelClosed",
    "ChannelConfigError",
    "ChannelError",
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
    "ProcessStuck",
    "RegistryError",
    "RuntimeReused",
    "SeqError",
    "StatsFormatError",
    "StatsNotFound",
    "UnknownProcess",
    "WouldBlock",
]
