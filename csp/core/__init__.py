"""The core of csp: channels and processes, what every other room is built on.

It imports only :mod:`csp.errors` and :mod:`csp.cuda` (a channel orders the tensors it carries
across CUDA streams); every public name is re-exported by ``import csp``. This ``__init__``
imports nothing. Modules::

    channel.py     channel(), Sender, Receiver: typed, bounded, thread and async ends; ordered fan-in
    _state.py      a channel's lock-protected state, shared by its two cores (private)
    _cores.py      the FIFO and the seq-ordered buffer of a channel (private)
    _waiting.py    the one send/receive algorithm and the thread or task waiters it parks (private)
    stats.py       ChannelStatistics, ProcessStatistics: what every channel and process reports
    strict.py      Strict: the base of every graph-file table (unknown keys refused, keyword-only)
    ports.py       typed ports: TypedDicts of Receiver[T] / Sender[T] read as a process's port tables
    process.py     Process, the base of every process kind, and the Context of each replica
    registry.py    kind strings of a graph file -> Process classes (registration, entry points)
"""
